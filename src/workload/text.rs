//! Prompt text from a trace's prefix blocks, and prefix identity back from text — the one
//! convention shared by the replayer (which builds prompts), the emulator (which caches
//! prefixes by text) and the router (whose prefix-aware policies look at text).
//!
//! A token is one whitespace-separated word. Block `i` of a prompt is `block_tokens` words
//! derived from the trace's `hash_ids[i]` alone, so requests with equal leading ids have equal
//! leading text, and text blocks hash back to equal chain hashes. Pure.

/// A word derived from a block id and a position in the block.
#[inline]
fn word(id: u64, j: u32, out: &mut String) {
    use std::fmt::Write;
    let h = crate::rng::mix64(id ^ ((j as u64) << 48 | 0x7e57));
    let _ = write!(out, "w{:03x}", h & 0xfff);
}

/// The prompt text of a request of `input_length` tokens whose prefix blocks are `hash_ids`
/// (each `block_tokens` tokens). Tokens beyond the ids come from `unique`, a per-request value.
pub fn prompt_text(hash_ids: &[u64], input_length: u32, block_tokens: u32, unique: u64) -> String {
    let b = block_tokens.max(1);
    let mut s = String::with_capacity(input_length as usize * 9);
    for t in 0..input_length {
        let blk = (t / b) as usize;
        let id = match hash_ids.get(blk) {
            Some(&id) => id,
            None => crate::rng::mix64(unique ^ 0xdead_beef ^ blk as u64),
        };
        if t > 0 {
            s.push(' ');
        }
        word(id, t % b, &mut s);
    }
    s
}

/// Special tokens before the words in the word convention's vocabulary (the tiny model's:
/// `<unk>`, `<s>`, `</s>`, `<pad>` and four chat markers; `scripts/make-tiny-model.py`).
pub const SPECIAL_TOKENS: u32 = 8;

/// The token id of `word` in the word convention's vocabulary (`SPECIAL_TOKENS` specials, then
/// `w000` … `wfff`, as [`prompt_text`] writes them); `None` for any other word.
pub fn word_token_id(word: &str) -> Option<u32> {
    let hex = word.strip_prefix('w').filter(|h| h.len() == 3)?;
    u32::from_str_radix(hex, 16)
        .ok()
        .map(|i| SPECIAL_TOKENS + i)
}

/// The word of token `id` in that vocabulary; `None` for a special token or an id past it.
pub fn token_word(id: u32) -> Option<String> {
    let i = id.checked_sub(SPECIAL_TOKENS).filter(|&i| i < 4096)?;
    Some(format!("w{i:03x}"))
}

/// The raw id (before chaining: what [`text_block_hashes`] chains) of the block whose tokens
/// are `ids` in the word vocabulary; `None` when one of them is not a word there. Hashes the
/// words' bytes as the text's block would be, without building the words.
pub fn tokens_block_id(ids: &[u32]) -> Option<u64> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for &id in ids {
        let i = id.checked_sub(SPECIAL_TOKENS).filter(|&i| i < 4096)? as usize;
        h.update(&[b'w', HEX[i >> 8], HEX[(i >> 4) & 15], HEX[i & 15], b' ']);
    }
    Some(h.digest())
}

/// Number of tokens in `text` under this convention (words).
pub fn count_tokens(text: &str) -> u32 {
    text.split_ascii_whitespace().count() as u32
}

/// Chain hashes of the full `block_tokens`-word blocks of `text` (see [`crate::engine::chain_hashes`]).
pub fn text_block_hashes(text: &str, block_tokens: u32) -> Vec<u64> {
    let b = block_tokens.max(1) as usize;
    let mut ids = Vec::new();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut n = 0usize;
    for w in text.split_ascii_whitespace() {
        h.update(w.as_bytes());
        h.update(b" ");
        n += 1;
        if n == b {
            ids.push(h.digest());
            h.reset();
            n = 0;
        }
    }
    crate::engine::chain_hashes(&ids)
}

/// A prompt's words as the router records them (`cacheroute route --record`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextBlocks {
    /// Tokens under this module's convention (words): [`count_tokens`].
    pub tokens: u32,
    /// The chain hashes of the full blocks (exactly [`text_block_hashes`]), then, when the text
    /// ends inside a block, one more chained hash covering that partial block: so there are
    /// `ceil(tokens / block_tokens)` ids, as the trace format expects ("the last id may cover
    /// a partial block"), and equal leading ids still mean equal leading text.
    pub ids: Vec<u64>,
    /// How many of `ids` are full blocks (the ones prefix-aware policies route by).
    pub full: usize,
}

/// Token count and block ids of `text` in one pass (see [`TextBlocks`]).
pub fn text_blocks(text: &str, block_tokens: u32) -> TextBlocks {
    let b = block_tokens.max(1) as usize;
    let mut raw = Vec::new();
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let (mut n, mut tokens) = (0usize, 0u32);
    for w in text.split_ascii_whitespace() {
        h.update(w.as_bytes());
        h.update(b" ");
        n += 1;
        tokens = tokens.saturating_add(1);
        if n == b {
            raw.push(h.digest());
            h.reset();
            n = 0;
        }
    }
    let full = raw.len();
    if n > 0 {
        raw.push(h.digest());
    }
    TextBlocks {
        tokens,
        ids: crate::engine::chain_hashes(&raw),
        full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_vocabulary_round_trips_and_rebuilds_block_hashes() {
        let text = prompt_text(&[4, 5], 40, 16, 3);
        let ids: Vec<u32> = text
            .split_ascii_whitespace()
            .map(|w| word_token_id(w).unwrap())
            .collect();
        assert!(ids
            .iter()
            .all(|&i| (SPECIAL_TOKENS..SPECIAL_TOKENS + 4096).contains(&i)));
        let words: Vec<String> = ids.iter().map(|&i| token_word(i).unwrap()).collect();
        assert_eq!(words.join(" "), text);
        // Block hashes rebuilt block by block from token ids equal the text's.
        let mut prev = None;
        let rebuilt: Vec<u64> = ids
            .chunks(16)
            .filter(|c| c.len() == 16)
            .map(|c| {
                let h = crate::engine::chain_step(prev, tokens_block_id(c).unwrap());
                prev = Some(h);
                h
            })
            .collect();
        assert_eq!(rebuilt, text_block_hashes(&text, 16));
        assert_eq!(
            (
                word_token_id("hello"),
                word_token_id("w1000"),
                token_word(3)
            ),
            (None, None, None)
        );
    }

    #[test]
    fn equal_leading_ids_give_equal_leading_blocks() {
        let a = prompt_text(&[1, 2, 3], 48, 16, 7);
        let b = prompt_text(&[1, 2, 9], 48, 16, 8);
        assert_eq!(count_tokens(&a), 48);
        let (ha, hb) = (text_block_hashes(&a, 16), text_block_hashes(&b, 16));
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // A partial last block is not a block.
        assert_eq!(
            text_block_hashes(&prompt_text(&[1, 2], 40, 16, 0), 16).len(),
            2
        );
        // Tokens past the ids are unique per request.
        let (x, y) = (prompt_text(&[1], 32, 16, 1), prompt_text(&[1], 32, 16, 2));
        let (hx, hy) = (text_block_hashes(&x, 16), text_block_hashes(&y, 16));
        assert_eq!(hx[0], hy[0]);
        assert_ne!(hx[1], hy[1]);
    }

    #[test]
    fn text_blocks_are_the_routing_blocks_plus_a_partial_one() {
        for (words, b) in [
            (0u32, 16u32),
            (1, 16),
            (16, 16),
            (17, 16),
            (40, 16),
            (48, 16),
            (7, 1),
        ] {
            let t = prompt_text(&[5, 6, 7], words, b, 3);
            let tb = text_blocks(&t, b);
            let routed = text_block_hashes(&t, b);
            assert_eq!(tb.tokens, count_tokens(&t));
            assert_eq!(tb.full, routed.len(), "{words}/{b}");
            assert_eq!(tb.ids[..tb.full], routed[..]);
            assert_eq!(tb.ids.len(), words.div_ceil(b) as usize, "{words}/{b}");
        }
        // The partial block's id depends on its words and on everything before it.
        let a = text_blocks("a b c d e", 4);
        let b = text_blocks("a b c d f", 4);
        let c = text_blocks("z b c d e", 4);
        assert_eq!(a.ids.len(), 2);
        assert_eq!(a.ids[0], b.ids[0]);
        assert_ne!(a.ids[1], b.ids[1]);
        assert_ne!(a.ids[1], c.ids[1]);
    }
}
