//! One step of a study on its backend: simulated ([`simulate_step`], which `advise` measures
//! with too), or replayed through real HTTP on the local, ssh or slurm backend's fleet; and
//! what a finished step brings back to be stored.

use super::inputs::{step_inputs, Source};
use super::spec::{RunPlan, Spec};
use crate::analysis::early::EarlyVerdict;
use crate::analysis::model::StepMetrics;
use crate::analysis::record::PlanRecord;
use crate::analysis::step::{step_metrics, Window};
use crate::engine::engine_config;
use crate::policy::calibrate::WarmStart;
use crate::sim::{self, SimConfig, SimOutput};
use crate::store::{RequestRow, RunId};
use crate::workload::trace::TraceRecord;
use anyhow::{bail, Result};
use std::collections::HashMap;

/// Everything a step needs besides the run plan.
pub(super) struct Ctx<'a> {
    pub(super) spec: &'a Spec,
    pub(super) engine_spec: String,
    pub(super) knobs: crate::engine::KnobOverrides,
    /// Real engines the local backend started for the whole study.
    pub(super) pool: Option<&'a super::engines::EnginePool>,
    /// The slurm backend's job: a step it did not survive is an error, not a result.
    pub(super) slurm_job: Option<&'a crate::fleet::slurm::SlurmJob>,
}

/// A finished step, as it is stored.
pub(super) struct Done {
    pub(super) run_id: RunId,
    pub(super) step: usize,
    pub(super) metrics: StepMetrics,
    pub(super) requests: Vec<RequestRow>,
    pub(super) plans: Vec<PlanRecord>,
    pub(super) telemetry: Vec<crate::store::TelemetrySample>,
}

/// One simulated ladder step: the fleet, the policy, the seed, and the window measured.
pub struct SimStep<'a> {
    pub engine: crate::engine::EngineConfig,
    pub replicas: usize,
    pub policy: &'a crate::policy::PolicySpec,
    pub seed: u64,
    pub failures: Vec<crate::engine::Failure>,
    pub warm: Option<WarmStart>,
    /// Seconds at the start left out of the metrics.
    pub warmup_s: f64,
    /// Seconds measured after the warm-up.
    pub measure_s: f64,
    /// The largest SLO bound of the study: requests still running `max(10 × it, 60 s)` after
    /// the last arrival are cut off (an overloaded step would otherwise run for ever).
    pub max_slo_s: f64,
    /// The step's target rate.
    pub qps: f64,
    /// End the step once it is certain to fail every one of these SLOs (`analysis::early`);
    /// empty: run it whole.
    pub cut_for: &'a [crate::analysis::model::Slo],
    /// Router replicas behind a round-robin front ([`SimConfig::router_replicas`]).
    pub router_replicas: usize,
}

/// Simulate one step and measure its window, as every simulated study step is measured
/// (`docs/analysis.md`); the simulator's output comes back for callers that store requests or
/// plans.
pub fn simulate_step(
    step: SimStep,
    records: impl Iterator<Item = TraceRecord>,
    key_rates: &HashMap<u64, f64>,
) -> Result<(StepMetrics, SimOutput)> {
    let duration = step.warmup_s + step.measure_s;
    let cfg = SimConfig {
        destinations: step.replicas,
        engine: step.engine,
        policy: step.policy.clone(),
        seed: step.seed,
        failures: step.failures,
        horizon_s: duration + (10.0 * step.max_slo_s).max(60.0),
        warm_start: step.warm,
        seed_first_window: false,
        router_replicas: step.router_replicas,
    };
    let window = Window {
        from_s: step.warmup_s,
        to_s: duration,
    };
    let out: SimOutput = if step.cut_for.is_empty() {
        sim::simulate(cfg, records)?
    } else {
        // The watch needs the window's whole count before the step runs.
        let records: Vec<TraceRecord> = records.collect();
        let n = records
            .iter()
            .filter(|r| window.contains(r.timestamp_ms / 1000.0))
            .count() as u64;
        let watch = EarlyVerdict::new(step.cut_for, window, n, true);
        sim::Simulator::new(cfg)?.watched(watch).run(records)?
    };
    // A cut step is measured over what ran of its window, and says so.
    let measured = match &out.cut {
        Some(c) => Window {
            from_s: window.from_s,
            to_s: c.at_s.clamp(window.from_s, window.to_s),
        },
        None => window,
    };
    let mut metrics = step_metrics(
        out.records.iter().copied(),
        key_rates,
        step.replicas,
        measured,
        step.qps,
    );
    let held_s = out.cut.as_ref().map_or(out.end_s, |c| c.at_s);
    metrics.cut = out.cut.clone();
    metrics.fleet_s = step.replicas as f64 * held_s.max(0.0);
    Ok((metrics, out))
}

/// Simulate one step: `warmup_s + measure_s` seconds at `qps`, seeded by the run's seed so
/// every policy sees the same trace.
pub(super) fn sim_step(
    ctx: &Ctx,
    plan: &RunPlan,
    src: &Source,
    qps: f64,
    store_requests: bool,
    cut_for: &[crate::analysis::model::Slo],
) -> Result<Done> {
    let spec = ctx.spec;
    let max_slo = spec.slos.iter().map(|s| s.p99_s).fold(0.0, f64::max);
    let super::spec::StudyPolicy::Ours(policy) = &plan.policy else {
        bail!(
            "{}: external routers run on the local or ssh backend",
            plan.key.policy
        );
    };
    let inp = step_inputs(spec, plan.key.seed, src, qps)?;
    let engine = engine_config(&ctx.engine_spec, inp.block, &ctx.knobs)?;
    let step = SimStep {
        engine,
        replicas: plan.replicas,
        policy,
        seed: plan.key.seed,
        failures: spec.failures.clone(),
        warm: inp.warm,
        warmup_s: spec.warmup_s,
        measure_s: spec.measure_s,
        max_slo_s: max_slo,
        qps,
        cut_for,
        router_replicas: plan.router_replicas,
    };
    let (metrics, out) = simulate_step(step, inp.records, &inp.key_rates)?;
    let window = Window {
        from_s: spec.warmup_s,
        to_s: spec.warmup_s + spec.measure_s,
    };
    let requests = if store_requests {
        out.records
            .iter()
            .filter(|r| window.contains(r.scheduled_s))
            .map(RequestRow::from)
            .collect()
    } else {
        Vec::new()
    };
    let plans = out.plans.clone();
    Ok(Done {
        run_id: RunId(0),
        step: 0,
        metrics,
        requests,
        plans,
        telemetry: Vec::new(),
    })
}

/// Run one step through real HTTP on loopback.
pub(super) fn local_step(
    ctx: &Ctx,
    plan: &RunPlan,
    src: &Source,
    qps: f64,
    cut_for: &[crate::analysis::model::Slo],
) -> Result<Done> {
    let inp = step_inputs(ctx.spec, plan.key.seed, src, qps)?;
    let recs: Vec<TraceRecord> = inp.records.collect();
    let warm = match (src, &inp.warm) {
        (Source::Generated(wl), Some(w)) => Some(super::front::RouterWarmStart {
            rates: wl
                .expected_rates(qps, plan.key.seed)
                .into_iter()
                .filter(|r| r.rate > 0.0)
                .collect(),
            mean_prompt_tokens: w.mean_prompt_tokens,
            mean_output_tokens: w.mean_output_tokens,
        }),
        _ => None,
    };
    let started = std::time::Instant::now();
    let s = super::local::run_step(
        ctx.spec,
        plan,
        super::local::StepLoad {
            records: recs,
            block: inp.block,
            qps,
            key_rates: &inp.key_rates,
            cut_for,
        },
        warm,
        ctx.pool,
    )?;
    // (The study's error then says what the job is doing and quotes its log.)
    if let Some(job) = ctx.slurm_job {
        crate::fleet::slurm::check_running(job)?;
    }
    // The fleet is held from the step's first request to its last answer: wall time, in the
    // engines' model seconds.
    let wall_s = started.elapsed().as_secs_f64();
    let scale = ctx
        .spec
        .local
        .as_ref()
        .map_or(crate::bounds::TimeScale::REAL, |l| l.time_scale);
    let mut metrics = s.metrics;
    metrics.wall_s = wall_s;
    metrics.fleet_s = plan.replicas as f64 * scale.to_model(wall_s);
    Ok(Done {
        run_id: RunId(0),
        step: 0,
        metrics,
        requests: s.requests,
        plans: s.plans,
        telemetry: s.telemetry,
    })
}
