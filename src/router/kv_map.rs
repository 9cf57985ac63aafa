//! An engine's KV-cache events in the router's block-hash space.
//!
//! vLLM names a cached block by its own hash (of the block's token ids, its parent's hash and
//! extra keys; a digest the router cannot compute from text). The router names a prompt's
//! blocks by chain hashes of their words (`workload::text`). A `BlockStored` event carries the
//! block's token ids and its parent, so each stored block is mapped once, when stored: its
//! words are its token ids read in the word convention's vocabulary (`workload::text::
//! tokens_block_id`: the tiny model's and the emulator's), its hash is chained onto its parent's
//! mapped hash, and the engine hash → router hash pair is kept per destination until the
//! block is removed. A block that cannot be mapped — a token outside the vocabulary, a block
//! size other than the router's, a parent never seen (stored before the subscription and not
//! replayed) — is counted and left out; so are blocks on another medium (an offload tier).

use super::lock::Locked;
use crate::engine::chain_step;
use crate::plan::KeyMap;
use crate::policy::KvEvent;
use crate::telemetry::kv_events::WireEvent;
use crate::telemetry::kv_zmq::SubscriberStats;
use crate::workload::text::tokens_block_id;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Per-destination engine-hash → router-hash maps, and the router hashes each destination
/// holds (the exact index the router predicts hits by).
#[derive(Debug, Clone)]
pub struct BlockMapper {
    block_tokens: u32,
    maps: Vec<KeyMap<u64>>,
    /// Per destination: router hash → engine blocks naming it (two engine blocks may map to
    /// one router hash: the same words under different extra keys).
    held: Vec<KeyMap<u32>>,
    /// Blocks left out because they could not be mapped.
    pub unmapped: u64,
    /// Blocks mapped.
    pub mapped: u64,
}

impl BlockMapper {
    /// A mapper for `destinations` destinations, the router hashing `block_tokens` words a block.
    pub fn new(destinations: usize, block_tokens: u32) -> Self {
        Self {
            block_tokens: block_tokens.max(1),
            maps: vec![KeyMap::default(); destinations],
            held: vec![KeyMap::default(); destinations],
            unmapped: 0,
            mapped: 0,
        }
    }

    /// Blocks currently known for `dest`.
    pub fn known(&self, dest: usize) -> usize {
        self.maps.get(dest).map_or(0, |m| m.len())
    }

    /// Forget `dest`'s cache (a resync; a destination removed): the policy is told
    /// [`KvEvent::AllCleared`].
    pub fn resync(&mut self, dest: usize) -> KvEvent {
        if let Some(m) = self.maps.get_mut(dest) {
            m.clear();
        }
        if let Some(h) = self.held.get_mut(dest) {
            h.clear();
        }
        KvEvent::AllCleared
    }

    /// Prompt tokens `dest` holds of a prompt of `prompt_tokens` tokens whose full blocks are
    /// `blocks` (the router's chain hashes, `block_tokens` each): its leading blocks `dest`
    /// holds, in whole blocks of all but the prompt's last token (vLLM computes at least that
    /// one, and looks up whole blocks: a fully cached prompt of whole blocks recomputes its
    /// last block; the emulator does the same).
    pub fn predicted_tokens(&self, dest: usize, blocks: &[u64], prompt_tokens: u32) -> u64 {
        let Some(held) = self.held.get(dest) else {
            return 0;
        };
        let bt = u64::from(self.block_tokens);
        let most = u64::from(prompt_tokens.saturating_sub(1)) / bt;
        let n = blocks.iter().take_while(|b| held.contains_key(b)).count() as u64;
        n.min(most) * bt
    }

    fn hold(&mut self, dest: usize, ours: u64) {
        if let Some(h) = self.held.get_mut(dest) {
            *h.entry(ours).or_default() += 1;
        }
    }

    fn release(&mut self, dest: usize, ours: u64) {
        if let Some(h) = self.held.get_mut(dest) {
            if let std::collections::hash_map::Entry::Occupied(mut e) = h.entry(ours) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// `ev` from `dest`, in the router's space; `None` when nothing of it maps.
    pub fn map(&mut self, dest: usize, ev: &WireEvent) -> Option<KvEvent> {
        if !ev.on_gpu() {
            return None;
        }
        let map = self.maps.get_mut(dest)?;
        match ev {
            WireEvent::AllCleared => Some(self.resync(dest)),
            WireEvent::Removed { blocks, .. } => {
                let ours: Vec<u64> = blocks.iter().filter_map(|h| map.remove(h)).collect();
                for &o in &ours {
                    self.release(dest, o);
                }
                (!ours.is_empty()).then_some(KvEvent::Removed { blocks: ours })
            }
            WireEvent::Stored {
                blocks,
                parent,
                token_ids,
                block_size,
                ..
            } => {
                let bs = *block_size as usize;
                let parent_ours = match parent {
                    None => None,
                    Some(p) => match map.get(p) {
                        Some(&o) => Some(o),
                        None => {
                            self.unmapped += blocks.len() as u64;
                            return None;
                        }
                    },
                };
                if *block_size != self.block_tokens || token_ids.len() != bs * blocks.len() {
                    self.unmapped += blocks.len() as u64;
                    return None;
                }
                let mut prev = parent_ours;
                let mut ours = Vec::with_capacity(blocks.len());
                let mut released = Vec::new();
                for (i, (h, toks)) in blocks.iter().zip(token_ids.chunks(bs)).enumerate() {
                    let Some(id) = tokens_block_id(toks) else {
                        // This block and the ones chained after it cannot be named.
                        self.unmapped += (blocks.len() - i) as u64;
                        break;
                    };
                    let o = chain_step(prev, id);
                    if let Some(was) = map.insert(*h, o) {
                        released.push(was);
                    }
                    ours.push(o);
                    prev = Some(o);
                }
                for was in released {
                    self.release(dest, was);
                }
                for &o in &ours {
                    self.hold(dest, o);
                }
                self.mapped += ours.len() as u64;
                (!ours.is_empty()).then_some(KvEvent::Stored {
                    parent: parent_ours,
                    blocks: ours,
                })
            }
        }
    }
}

/// One destination slot's subscription.
pub(crate) struct KvDest {
    /// The backend's `host:port` it was made for.
    pub connect: String,
    /// `tcp://host:port` subscribed.
    pub endpoint: String,
    pub stats: Arc<SubscriberStats>,
    /// Cleared (under the mapper's lock) when the subscription ends: its consumer then maps
    /// and delivers nothing more.
    pub live: Arc<AtomicBool>,
    /// Its subscriber and consumer tasks.
    pub tasks: Vec<tokio::task::AbortHandle>,
}

/// The router's KV-event subscriptions: one per destination slot that holds a backend,
/// followed as discovery fills and vacates slots.
pub(crate) struct KvFeed {
    /// Events at each backend's port + this.
    pub offset: u16,
    /// Per destination slot.
    pub dests: Mutex<Vec<Option<KvDest>>>,
    pub mapper: Mutex<BlockMapper>,
    /// Discovery changed the backends: the subscriptions are brought in line.
    pub changed: tokio::sync::Notify,
}

/// `host:port` + `offset` as ZMQ endpoints (events, replay), or why not.
pub(crate) fn endpoints(connect: &str, offset: u16) -> Result<(String, String), String> {
    let (host, port) = connect
        .rsplit_once(':')
        .ok_or_else(|| format!("`{connect}` has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("`{connect}`: `{port}` is not a port"))?;
    let at = |extra: u16| {
        port.checked_add(offset)
            .and_then(|p| p.checked_add(extra))
            .ok_or_else(|| {
                format!("kv_events_port_offset: {port} + {offset} + {extra} is past port 65535")
            })
    };
    Ok((
        format!("tcp://{host}:{}", at(0)?),
        format!("tcp://{host}:{}", at(1)?),
    ))
}

impl KvFeed {
    /// The feed for `slots` destination slots, the backends' `connects` (`host:port`, the
    /// first slots') checked to give endpoints at port + `offset`. Nothing is subscribed yet.
    pub(crate) fn new(
        connects: &[&str],
        slots: usize,
        offset: u16,
        block_tokens: u32,
    ) -> Result<Self, String> {
        for c in connects {
            endpoints(c, offset)?;
        }
        Ok(Self {
            offset,
            dests: Mutex::new((0..slots.max(connects.len())).map(|_| None).collect()),
            mapper: Mutex::new(BlockMapper::new(slots.max(connects.len()), block_tokens)),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// End slot `d`'s subscription, if any: its tasks stop, its blocks leave the index, and
    /// the policy (when `forget` is given) is told the destination's cache is gone.
    pub(crate) fn end(&self, d: usize, forget: impl FnOnce(KvEvent)) {
        let Some(sub) = self.dests.locked().get_mut(d).and_then(Option::take) else {
            return;
        };
        for t in &sub.tasks {
            t.abort();
        }
        let mut m = self.mapper.locked();
        sub.live.store(false, Ordering::Release);
        forget(m.resync(d));
    }
}

/// The feed's `/metrics` families (after the router's own), when subscribed.
pub(super) fn write_metrics(o: &mut String, feed: &KvFeed) {
    let families: [(&str, &str, usize); 5] = [
        ("cacheroute_kv_event_batches_total", "KV-event batches delivered per destination (replayed ones included).", 0),
        ("cacheroute_kv_event_gaps_total", "Sequence gaps in a destination's KV events.", 1),
        ("cacheroute_kv_event_replayed_total", "KV-event batches recovered from a destination's replay endpoint.", 2),
        ("cacheroute_kv_event_resyncs_total", "Times a destination's cache view was dropped and rebuilt (a gap the replay could not fill, an engine restart).", 3),
        ("cacheroute_kv_event_undecodable_total", "KV-event messages dropped because they did not decode.", 4),
    ];
    let dests = feed.dests.locked();
    let subscribed = || {
        dests
            .iter()
            .enumerate()
            .filter_map(|(d, x)| x.as_ref().map(|x| (d, x)))
    };
    for (name, help, i) in families {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for (d, x) in subscribed() {
            let v = x.stats.snapshot().get(i).copied().unwrap_or(0);
            let _ = writeln!(
                o,
                "{name}{{destination=\"{d}\",endpoint=\"{}\"}} {v}",
                x.endpoint
            );
        }
    }
    let m = feed.mapper.locked();
    let _ = writeln!(
        o,
        "# HELP cacheroute_kv_blocks_known Blocks the router knows a destination holds, from its KV events.\n# TYPE cacheroute_kv_blocks_known gauge"
    );
    for (d, x) in subscribed() {
        let _ = writeln!(
            o,
            "cacheroute_kv_blocks_known{{destination=\"{d}\",endpoint=\"{}\"}} {}",
            x.endpoint,
            m.known(d)
        );
    }
    for (name, help, v) in [
        ("cacheroute_kv_blocks_mapped_total", "Stored blocks mapped to the router's block hashes.", m.mapped),
        ("cacheroute_kv_blocks_unmapped_total", "Stored blocks left out: a token outside the vocabulary, another block size, an unknown parent.", m.unmapped),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::text::{prompt_text, text_block_hashes, word_token_id};

    fn ids(text: &str) -> Vec<u32> {
        text.split_ascii_whitespace()
            .map(|w| word_token_id(w).unwrap())
            .collect()
    }

    #[test]
    fn stored_blocks_map_to_the_routers_hashes_of_the_same_text() {
        let text = prompt_text(&[1, 2, 3], 48, 16, 5);
        let want = text_block_hashes(&text, 16);
        let t = ids(&text);
        let mut m = BlockMapper::new(2, 16);
        // Stored in two events, the second chained to the first's last block.
        let a = m.map(
            1,
            &WireEvent::Stored {
                blocks: vec![901, 902],
                parent: None,
                token_ids: t[..32].to_vec(),
                block_size: 16,
                medium: Some("GPU".into()),
            },
        );
        assert_eq!(
            a,
            Some(KvEvent::Stored {
                parent: None,
                blocks: want[..2].to_vec()
            })
        );
        let b = m.map(
            1,
            &WireEvent::Stored {
                blocks: vec![903],
                parent: Some(902),
                token_ids: t[32..].to_vec(),
                block_size: 16,
                medium: None,
            },
        );
        assert_eq!(
            b,
            Some(KvEvent::Stored {
                parent: Some(want[1]),
                blocks: vec![want[2]]
            })
        );
        assert_eq!((m.known(1), m.known(0), m.mapped, m.unmapped), (3, 0, 3, 0));
        // Removal names the router's hashes; unknown engine hashes are skipped.
        assert_eq!(
            m.map(
                1,
                &WireEvent::Removed {
                    blocks: vec![903, 777],
                    medium: None
                }
            ),
            Some(KvEvent::Removed {
                blocks: vec![want[2]]
            })
        );
        assert_eq!(m.resync(1), KvEvent::AllCleared);
        assert_eq!(m.known(1), 0);
    }

    #[test]
    fn what_cannot_be_mapped_is_counted_and_left_out() {
        let text = prompt_text(&[1, 2], 32, 16, 5);
        let t = ids(&text);
        let mut m = BlockMapper::new(1, 16);
        let stored =
            |blocks: Vec<u64>, parent, token_ids: Vec<u32>, block_size, medium| WireEvent::Stored {
                blocks,
                parent,
                token_ids,
                block_size,
                medium,
            };
        // A parent never seen.
        assert_eq!(
            m.map(0, &stored(vec![2], Some(1), t[16..].to_vec(), 16, None)),
            None
        );
        // Another block size than the router's.
        assert_eq!(m.map(0, &stored(vec![1], None, t.clone(), 32, None)), None);
        // A token outside the vocabulary in the second block: the first maps.
        let mut bad = t.clone();
        bad[20] = 2;
        let e = m.map(0, &stored(vec![1, 2], None, bad, 16, None)).unwrap();
        assert!(matches!(e, KvEvent::Stored { ref blocks, .. } if blocks.len() == 1));
        // An offload tier's store is not the GPU cache.
        assert_eq!(
            m.map(
                0,
                &stored(vec![5], None, t[..16].to_vec(), 16, Some("CPU".into()))
            ),
            None
        );
        assert_eq!((m.mapped, m.unmapped), (1, 1 + 1 + 1));
    }
    #[test]
    fn the_exact_index_predicts_held_leading_blocks_and_an_ended_subscription_forgets_them() {
        let text = prompt_text(&[1, 2, 3], 48, 16, 5);
        let want = text_block_hashes(&text, 16);
        let t = ids(&text);
        let feed = KvFeed::new(&["h:1"], 2, 10, 16).unwrap();
        let stored = WireEvent::Stored {
            blocks: vec![901, 902],
            parent: None,
            token_ids: t[..32].to_vec(),
            block_size: 16,
            medium: None,
        };
        {
            let mut m = feed.mapper.locked();
            m.map(0, &stored);
            // Two of the prompt's three blocks held; a 48-token prompt's lookup covers 47.
            assert_eq!(m.predicted_tokens(0, &want, 48), 32);
            assert_eq!(m.predicted_tokens(1, &want, 48), 0);
            // Only leading blocks count.
            assert_eq!(m.predicted_tokens(0, &[999, want[1]], 32), 0);
            // All but the last token: a prompt of exactly the two blocks recomputes the last.
            assert_eq!(m.predicted_tokens(0, &want[..2], 32), 16);
        }
        // A subscription slot that ends forgets its blocks and tells the policy.
        feed.dests.locked()[0] = Some(KvDest {
            connect: "h:1".into(),
            endpoint: String::new(),
            stats: Arc::default(),
            live: Arc::new(AtomicBool::new(true)),
            tasks: Vec::new(),
        });
        let mut told = Vec::new();
        feed.end(0, |e| told.push(e));
        assert_eq!(told, vec![KvEvent::AllCleared]);
        let m = feed.mapper.locked();
        assert_eq!((m.known(0), m.predicted_tokens(0, &want, 48)), (0, 0));
        assert!(feed.dests.locked()[0].is_none());
    }

    #[test]
    fn endpoints_are_the_backend_port_plus_the_offset() {
        assert_eq!(
            endpoints("10.0.0.5:8000", 1000).unwrap(),
            ("tcp://10.0.0.5:9000".into(), "tcp://10.0.0.5:9001".into())
        );
        assert!(endpoints("h:65535", 1)
            .unwrap_err()
            .contains("past port 65535"));
        assert!(endpoints("h", 1).unwrap_err().contains("no port"));
    }
}
