//! Model cards, device cards and precisions: the static facts the engine model derives every
//! number from. Pure data plus arithmetic; no I/O. Every constant here is listed with its source
//! in `docs/engine-model.md`.

use serde::{Deserialize, Serialize};

/// Numeric format of weights or of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 8-bit float (E4M3), Hopper tensor cores run it at twice the BF16 rate.
    Fp8,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl Precision {
    /// Every precision, in the order error messages list them.
    pub const ALL: [Precision; 3] = [Precision::Fp8, Precision::Fp16, Precision::Bf16];

    /// Bytes per element.
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Fp8 => 1.0,
            Precision::Fp16 | Precision::Bf16 => 2.0,
        }
    }

    /// The lower-case name used in engine specs (`fp8`, `fp16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp8 => "fp8",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// Parse a spec name (case-insensitive).
    pub fn parse(s: &str) -> Option<Precision> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
    }
}

/// Architecture of a decoder-only transformer (Llama/Qwen2 family), from its public
/// `config.json`. Parameter counts are derived from these fields, never typed in.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    /// Preset name used in engine specs.
    pub name: &'static str,
    /// Hugging Face repository the numbers come from.
    pub source: &'static str,
    /// `num_hidden_layers`.
    pub layers: u32,
    /// `hidden_size`.
    pub hidden: u32,
    /// `num_attention_heads`.
    pub heads: u32,
    /// `num_key_value_heads` (GQA).
    pub kv_heads: u32,
    /// `head_dim` (hidden / heads for these models).
    pub head_dim: u32,
    /// `intermediate_size` of the gated MLP (gate, up, down projections).
    pub intermediate: u32,
    /// `vocab_size`.
    pub vocab: u32,
    /// `tie_word_embeddings`.
    pub tied_embeddings: bool,
    /// Q/K/V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
}

impl ModelCard {
    /// Presets: `llama-3.3-70b`, `llama-3.1-8b`, `qwen2.5-32b`, `tiny`.
    pub const PRESETS: [ModelCard; 4] = [
        ModelCard {
            name: "llama-3.3-70b",
            source: "meta-llama/Llama-3.3-70B-Instruct config.json",
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 28672,
            vocab: 128_256,
            tied_embeddings: false,
            qkv_bias: false,
        },
        ModelCard {
            name: "llama-3.1-8b",
            source: "meta-llama/Llama-3.1-8B-Instruct config.json",
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 14336,
            vocab: 128_256,
            tied_embeddings: false,
            qkv_bias: false,
        },
        ModelCard {
            name: "qwen2.5-32b",
            source: "Qwen/Qwen2.5-32B-Instruct config.json",
            layers: 64,
            hidden: 5120,
            heads: 40,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 27648,
            vocab: 152_064,
            tied_embeddings: false,
            qkv_bias: true,
        },
        ModelCard {
            name: "tiny",
            source:
                "scripts/make-tiny-model.py (random-weight LlamaForCausalLM, word-level tokenizer, served by vLLM CPU)",
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 4,
            head_dim: 64,
            intermediate: 512,
            vocab: 4104,
            tied_embeddings: false,
            qkv_bias: false,
        },
    ];

    /// The preset with this name (case-insensitive).
    pub fn preset(name: &str) -> Option<&'static ModelCard> {
        Self::PRESETS
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
    }

    /// Comma-separated preset names, for error messages.
    pub fn preset_names() -> String {
        Self::PRESETS.map(|m| m.name).join(", ")
    }

    /// Parameters of one decoder layer: attention projections (+ biases), gated MLP, 2 norms.
    pub fn params_per_layer(&self) -> u64 {
        let h = self.hidden as u64;
        let q = (self.heads * self.head_dim) as u64;
        let kv = (self.kv_heads * self.head_dim) as u64;
        let attn = h * q + 2 * h * kv + q * h;
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let mlp = 3 * h * self.intermediate as u64;
        attn + bias + mlp + 2 * h
    }

    /// Parameters in all decoder layers plus the final norm (the matmul weights every token uses).
    pub fn layer_params(&self) -> u64 {
        self.params_per_layer() * self.layers as u64 + self.hidden as u64
    }

    /// Parameters of the input embedding table (vocab × hidden).
    pub fn embedding_params(&self) -> u64 {
        self.vocab as u64 * self.hidden as u64
    }

    /// Parameters stored for the output projection (0 when tied to the embedding).
    pub fn lm_head_params(&self) -> u64 {
        if self.tied_embeddings {
            0
        } else {
            self.embedding_params()
        }
    }

    /// Total parameter count P.
    pub fn params(&self) -> u64 {
        self.layer_params() + self.embedding_params() + self.lm_head_params()
    }

    /// KV bytes per token: 2 (K and V) · layers · kv_heads · head_dim · bytes per element.
    pub fn kv_bytes_per_token(&self, kv: Precision) -> f64 {
        2.0 * self.layers as f64 * self.kv_heads as f64 * self.head_dim as f64 * kv.bytes()
    }

    /// Bytes of weights in memory (all GPUs together). An fp8 checkpoint quantizes the decoder's
    /// linear layers only; the embedding and output projection stay in bf16 (as the published
    /// fp8 checkpoints of these models do).
    pub fn weight_bytes(&self, weights: Precision) -> f64 {
        self.layer_params() as f64 * weights.bytes()
            + (self.embedding_params() + self.lm_head_params()) as f64 * 2.0
    }

    /// Bytes read from memory by one forward step (all GPUs together): the decoder layers and
    /// the output projection; the embedding table is only gathered row by row.
    pub fn weight_read_bytes(&self, weights: Precision) -> f64 {
        self.layer_params() as f64 * weights.bytes() + self.embedding_params() as f64 * 2.0
    }

    /// Attention FLOPs per (query token × attended token) across all layers: QKᵀ and AV are each
    /// 2 · heads · head_dim multiply-adds, so 4 · L · heads · head_dim.
    pub fn attn_flops_per_pair(&self) -> f64 {
        4.0 * self.layers as f64 * (self.heads * self.head_dim) as f64
    }
}

/// An accelerator (or the measured CPU of this machine) as the engine model sees it: memory,
/// bandwidth, dense FLOP/s, and the efficiency factors and defaults that go with it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceCard {
    /// Preset name used in engine specs.
    pub name: &'static str,
    /// What it is and where the numbers come from.
    pub description: &'static str,
    /// Memory per device in bytes (what the driver reports as total).
    pub memory_bytes: f64,
    /// Memory bandwidth per device in bytes/s (datasheet).
    pub bandwidth: f64,
    /// Dense BF16/FP16 tensor FLOP/s per device (datasheet, without sparsity).
    pub flops_16: f64,
    /// Dense FP8 tensor FLOP/s per device (datasheet, without sparsity).
    pub flops_fp8: f64,
    /// KV cache size fixed by configuration instead of derived from memory (vLLM CPU:
    /// `VLLM_CPU_KVCACHE_SPACE`), in bytes.
    pub fixed_kv_bytes: Option<f64>,
    /// Model FLOP utilisation of prefill/linear layers (fraction of `flops_*`).
    pub mfu: f64,
    /// Achieved fraction of `bandwidth` for weight and KV reads.
    pub bw_efficiency: f64,
    /// Fixed time per engine step (scheduling, sampling, launches, TP all-reduce latency), s.
    pub step_overhead_s: f64,
    /// Memory per device that is neither weights nor KV (activation peak, CUDA graphs, NCCL).
    pub reserve_bytes: f64,
    /// Default KV block size in tokens (vLLM: 16 on GPU, 128 on CPU).
    pub block_size: u32,
    /// Default per-step token budget (`max_num_batched_tokens`).
    pub max_num_batched_tokens: u32,
    /// Default `max_num_seqs`.
    pub max_num_seqs: u32,
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const MIB: f64 = 1024.0 * 1024.0;

/// HTTP/tokenizer time vLLM-CPU spends on a request before its engine sees it, measured with the
/// tiny model (docs/engine-model.md §5.3); the engine model leaves it out and the emulator adds
/// it on the `cpu` card.
pub const CPU_FRONTEND_DELAY_S: f64 = 0.004;

impl DeviceCard {
    /// Device preset names.
    pub const NAMES: [&'static str; 3] = ["h100", "h200", "cpu"];

    /// The preset with this name (case-insensitive). GPU presets carry the efficiency factors
    /// fitted once by [`crate::engine::calibrate_flagship`].
    pub fn preset(name: &str) -> Option<DeviceCard> {
        let name = name.to_ascii_lowercase();
        let mut card = match name.as_str() {
            "h100" => Self::h100_raw(),
            "h200" => DeviceCard {
                name: "h200",
                description:
                    "NVIDIA H200 SXM 141 GB (HBM3e 4.8 TB/s; same tensor cores as H100 SXM)",
                memory_bytes: 143_771.0 * MIB,
                bandwidth: 4.8e12,
                ..Self::h100_raw()
            },
            "cpu" => return Some(Self::cpu()),
            _ => return None,
        };
        let cal = crate::engine::calibrate_flagship();
        card.mfu = cal.mfu;
        card.bw_efficiency = cal.bw_efficiency;
        card.step_overhead_s = cal.step_overhead_s;
        Some(card)
    }

    /// Comma-separated preset names, for error messages.
    pub fn preset_names() -> String {
        Self::NAMES.join(", ")
    }

    /// H100 SXM5 80 GB datasheet numbers, before calibration (efficiency factors 1, no overhead).
    pub(crate) fn h100_raw() -> DeviceCard {
        DeviceCard {
            name: "h100",
            description:
                "NVIDIA H100 SXM5 80 GB (HBM3 3.35 TB/s, 989.4 TFLOP/s BF16, 1978.9 FP8 dense)",
            memory_bytes: 81_559.0 * MIB,
            bandwidth: 3.35e12,
            flops_16: 989.4e12,
            flops_fp8: 1978.9e12,
            fixed_kv_bytes: None,
            mfu: 1.0,
            bw_efficiency: 1.0,
            step_overhead_s: 0.0,
            reserve_bytes: 2.5 * GIB,
            block_size: 16,
            max_num_batched_tokens: 8192,
            max_num_seqs: 1024,
        }
    }

    /// This machine's CPU running vLLM-CPU 0.32 with the tiny model. The FLOP/s and bandwidth
    /// are *effective* values fitted to measured TTFTs and decode times (docs/engine-model.md
    /// §5.3), so the efficiency factors are 1.
    fn cpu() -> DeviceCard {
        DeviceCard {
            name: "cpu",
            description:
                "2-core x86 CPU under vLLM-CPU 0.32, effective rates fitted to the measurements in docs/real-vllm.md",
            memory_bytes: 24.0 * GIB,
            bandwidth: 10.3e9,
            flops_16: 240.0e9,
            flops_fp8: 240.0e9,
            fixed_kv_bytes: Some(GIB),
            mfu: 1.0,
            bw_efficiency: 1.0,
            step_overhead_s: 1.0e-3,
            reserve_bytes: 0.0,
            block_size: 128,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
        }
    }

    /// Dense FLOP/s for matmuls with weights in `weights` precision.
    pub fn flops(&self, weights: Precision) -> f64 {
        match weights {
            Precision::Fp8 => self.flops_fp8,
            Precision::Fp16 | Precision::Bf16 => self.flops_16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_model_cards() {
        // Published totals: 70,553,706,496 / 8,030,261,248 / 32,763,876,352.
        assert_eq!(
            ModelCard::preset("llama-3.3-70b").unwrap().params(),
            70_553_706_496
        );
        assert_eq!(
            ModelCard::preset("llama-3.1-8b").unwrap().params(),
            8_030_261_248
        );
        assert_eq!(
            ModelCard::preset("qwen2.5-32b").unwrap().params(),
            32_763_876_352
        );
        let tiny = ModelCard::preset("tiny").unwrap().params();
        assert!((3_300_000..3_500_000).contains(&tiny), "{tiny}");
    }

    #[test]
    fn kv_bytes_per_token_of_llama_70b() {
        let m = ModelCard::preset("llama-3.3-70b").unwrap();
        assert_eq!(m.kv_bytes_per_token(Precision::Bf16), 320.0 * 1024.0);
        assert_eq!(m.kv_bytes_per_token(Precision::Fp8), 160.0 * 1024.0);
    }
}
