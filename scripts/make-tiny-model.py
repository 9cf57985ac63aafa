"""Builds a tiny random-weight Llama with a local word-level tokenizer, for real-engine tests.

    python scripts/make-tiny-model.py OUT_DIR [--hidden 256 --layers 2 --heads 4]

No model hub is touched and nothing is downloaded. The tokenizer follows the project's text
convention (src/workload/text.rs): a token is one whitespace-separated word, and prompts are
built from the 4,096 words `w000`..`wfff`. So every one of those words is exactly one token
(anything else is `<unk>`), and a prompt of N words is N tokens to vLLM as it is to the
emulator, the router and the replayer - block boundaries and hit rates mean the same thing on
both. The weights are random (seeded): serving behaviour - prefix caching, streaming,
metrics - is under test, not text quality. The shape matches the engine model's `tiny` card
(src/engine/cards.rs): hidden 256, 2 layers, 4 heads, intermediate 512, vocabulary 4,104.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [f"w{i:03x}" for i in range(4096)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-positions", type=int, default=4096)
    a = ap.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(a.out, exist_ok=True)
    fast.save_pretrained(a.out)
    probe = "w000 w1a2 wfff"
    assert len(fast(probe, add_special_tokens=True)["input_ids"]) == 3, "one token per word"

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 2,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=a.max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny model: {n / 1e6:.1f}M parameters, vocab {len(fast)}, in {a.out}")


if __name__ == "__main__":
    main()
