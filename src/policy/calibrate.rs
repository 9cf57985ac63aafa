//! Calibration of the control loop from the engine model: CacheRoute's q_cap and warm slots
//! W when a spec leaves them at 0, the engine-derived defaults of DualMap and Preble, and what
//! a control loop knows before a run starts (a warm start). One module for every backend: the
//! simulator's control loop, the local backend's router, `calibrate` and the study runner.
//! Pure: the engine model and the workload generator are its inputs.

use super::PolicySpec;
use crate::engine::EngineConfig;
use crate::plan::{KeyLoad, PlannerConfig};
use crate::workload::trace::TraceRecord;

/// What a control loop knows before the run: per-key rates and the mean request shape.
#[derive(Debug, Clone)]
pub struct WarmStart {
    pub rates: Vec<KeyLoad>,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
}

impl WarmStart {
    /// From a sample of records (e.g. the first few thousand of the workload) and rates.
    pub fn from_sample<'a>(
        rates: Vec<KeyLoad>,
        sample: impl IntoIterator<Item = &'a TraceRecord>,
    ) -> Self {
        let (mut n, mut p, mut o) = (0u64, 0.0, 0.0);
        for r in sample {
            n += 1;
            p += r.input_length as f64;
            o += r.output_length as f64;
        }
        let n = n.max(1) as f64;
        WarmStart {
            rates,
            mean_prompt_tokens: p / n,
            mean_output_tokens: o / n,
        }
    }
}

/// The control loop's knowledge before a generated run: the generator's expected per-key rates
/// (standing in for the previous period's measurements) and the mean request shape from a
/// sample drawn with a different seed.
pub fn warm_start(
    wl: &crate::workload::gen::Workload,
    qps: f64,
    seed: u64,
) -> Result<WarmStart, crate::workload::gen::GenError> {
    let rates: Vec<KeyLoad> = wl
        .expected_rates(qps, seed)
        .iter()
        .filter(|r| r.rate > 0.0)
        .map(|r| KeyLoad {
            key: crate::key_hash(&r.key),
            rate: r.rate,
            prefix_tokens: 0.0,
        })
        .collect();
    let sample: Vec<TraceRecord> = wl
        .generate(qps, 1e9, seed ^ 0x5a5a_5a5a)?
        .take(2000)
        .collect();
    Ok(WarmStart::from_sample(rates, sample.iter()))
}

/// A q_cap estimate from the engine model: 70% of the request rate one replica sustains at
/// saturation (batch of `max_num_seqs`, capped at 64) for requests of the given mean shape,
/// assuming half the prompt is served from cache. The knee of p99 sits below saturation; the
/// 70% factor is a rule of thumb, and `cacheroute calibrate` measures the real knee.
pub fn estimate_q_cap(engine: &EngineConfig, mean_prompt: f64, mean_output: f64) -> f64 {
    let p = mean_prompt.max(1.0);
    let cached = (p * 0.5) as u32;
    let new = (p as u32).saturating_sub(cached).max(1);
    let b = engine.knobs().max_num_seqs.clamp(1, 64);
    let ctx = (b as f64 * (p + mean_output / 2.0)) as u64;
    let per_req = engine.prefill_time(new, cached)
        + mean_output.max(1.0) * engine.decode_step_time(b, ctx) / b as f64;
    0.7 / per_req
}

/// A warm-slot estimate: keys per destination whose mean prompt fits in half of the KV cache
/// (the other half is left to running requests and the cold tail).
pub fn estimate_warm_slots(engine: &EngineConfig, mean_prefix_tokens: f64) -> u64 {
    ((0.5 * engine.kv_capacity_tokens() as f64) / mean_prefix_tokens.max(16.0))
        .floor()
        .max(1.0) as u64
}

/// The planner configuration a CacheRoute control loop uses: q_cap and W as configured, or
/// (when automatic) estimated from the engine model and the mean request shape, as the
/// simulator's control loop does without tuning.
pub fn planner_for(
    c: &crate::policy::cacheroute::CacheRouteConfig,
    engine: &EngineConfig,
    destinations: usize,
    mean_prompt: f64,
    mean_output: f64,
) -> PlannerConfig {
    let q = c
        .q_cap
        .or_else(|| estimate_q_cap(engine, mean_prompt, mean_output));
    let w = c
        .warm_slots
        .or_else(|| estimate_warm_slots(engine, mean_prompt));
    c.planner(destinations, q, w, engine.knobs().hash_block_tokens)
}

/// Preble's prefill profile and TPOT guess from the engine model, where left at 0.
fn preble_profile(c: &mut crate::policy::preble::PrebleConfig, tps: f64, tpot: f64) {
    if c.prefill_b_s_per_token <= 0.0 {
        c.prefill_b_s_per_token = 1.0 / tps;
        c.tpot_s = tpot;
    }
}

/// The constants of CacheRoute's `load: cost` from the engine model: a chunk of
/// `max_num_batched_tokens` prompt tokens prefilled in one step, what each running decode adds
/// to a step (its KV read at 2,048 tokens of context, as Preble's TPOT guess assumes), and a
/// decode step with every slot taken.
pub fn cost_model(engine: &EngineConfig) -> crate::policy::cacheroute::CostModel {
    let k = engine.knobs();
    let chunk = k.max_num_batched_tokens.max(2);
    let slots = k.max_num_seqs.max(1);
    let ctx = 2048u64;
    crate::policy::cacheroute::CostModel {
        step_s: engine.prefill_time(chunk, 0),
        per_decode_s: engine.step_time(0, 1, 0.0, ctx) - engine.step_time(0, 0, 0.0, 0),
        chunk_tokens: chunk,
        max_seqs: slots,
        decode_step_s: engine.decode_step_time(slots, slots as u64 * ctx),
    }
}

/// Fill a policy's engine-dependent parameters left at 0 from the engine model.
pub fn resolve_policy(spec: &PolicySpec, engine: &EngineConfig) -> PolicySpec {
    // Prefill throughput of one replica on a long, uncached prompt.
    let tps = 4096.0 / engine.prefill_time(4096, 0);
    let tpot = engine.decode_step_time(32, 32 * 2048);
    match spec {
        PolicySpec::Dualmap(c) => {
            let mut c = c.clone();
            if c.prefill_tokens_per_s <= 0.0 {
                c.prefill_tokens_per_s = tps;
            }
            PolicySpec::Dualmap(c)
        }
        PolicySpec::Preble(c) => {
            let mut c = c.clone();
            preble_profile(&mut c, tps, tpot);
            PolicySpec::Preble(c)
        }
        PolicySpec::Cacheroute(c) => {
            let mut c = c.clone();
            if c.may_use_prefix_tail() {
                preble_profile(&mut c.prefix, tps, tpot);
            }
            if !c.cost.known() {
                c.cost = cost_model(engine);
            }
            if c.memory_size == 0 {
                c.memory_size = 2 * engine.kv_capacity_tokens()
                    / engine.knobs().hash_block_tokens.max(1) as u64;
            }
            PolicySpec::Cacheroute(c)
        }
        PolicySpec::LlmD(c) if c.lru_capacity_per_endpoint == 0 => {
            // The prefix producer's `autoTune`: the engine's KV-cache block count.
            let mut c = c.clone();
            c.lru_capacity_per_endpoint = engine.kv_capacity_blocks().max(1) as u64;
            PolicySpec::LlmD(c)
        }
        other => other.clone(),
    }
}
