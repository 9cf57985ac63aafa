//! The shared data model of studies: what one ladder step of one run measured, what an SLO is,
//! and what the analysis derives. Every backend (sim, local, ssh) produces [`StepMetrics`]; the
//! store persists them; the report reads them back. Plain data, serde both ways.

use serde::{Deserialize, Serialize};

use super::record::PlanRecord;

/// Which latency an SLO bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SloMetric {
    /// Time to first token.
    Ttft,
    /// End-to-end latency.
    E2e,
}

/// A p99 latency objective.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    #[serde(default = "default_metric")]
    pub metric: SloMetric,
    /// p99 bound in seconds (> 0).
    pub p99_s: f64,
}

fn default_metric() -> SloMetric {
    SloMetric::E2e
}

impl Slo {
    /// Short label, e.g. `e2e p99 ≤ 3.5 s`.
    pub fn label(&self) -> String {
        let m = match self.metric {
            SloMetric::Ttft => "ttft",
            SloMetric::E2e => "e2e",
        };
        format!("{m} p99 ≤ {} s", self.p99_s)
    }
}

/// Identifies a run within a study: the policy (its report label), the seed, and the sweep
/// point (empty when the study has no sweep; e.g. `q_cap=100,W=64` otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunKey {
    pub policy: String,
    pub seed: u64,
    pub sweep: String,
}

/// Per-key fairness within a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fairness {
    /// p99 end-to-end latency of the requests of keys in each key-rate decile, lowest-rate
    /// decile first (10 entries; NaN where a decile had no completed request).
    pub e2e_p99_by_rate_decile_s: Vec<f64>,
    /// Jain's fairness index over per-key mean end-to-end latency (1 = all keys equal).
    pub jain_index: f64,
}

/// What one ladder step of one run measured. Rates are per second of the measured window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The ladder step's target rate.
    pub offered_qps: f64,
    /// Throughput: requests (of any step) that completed successfully inside the measured
    /// window, per second (≈ the in-window arrival rate when the fleet keeps up).
    pub achieved_qps: f64,
    /// Requests of the window (scheduled inside it) that completed, whenever, per second.
    pub completed_qps: f64,
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    /// Served KV hit: Σ cached prompt tokens / Σ prompt tokens.
    pub served_kv_hit: f64,
    /// max / mean per-destination requests.
    pub imbalance_requests: f64,
    /// max / mean per-destination prefill tokens computed.
    pub imbalance_prefill_tokens: f64,
    /// p99 of (actual send time − scheduled send time); 0 in simulation.
    pub schedule_lag_p99_s: f64,
    pub preemptions: u64,
    pub fairness: Fairness,
    /// Measured window, seconds. For a cut step, the part measured before the cut.
    pub window_s: f64,
    /// The step was ended early, certain to fail the SLOs its verdict could still inform
    /// (`analysis::early`): its other metrics cover only what ran before the cut, it fails
    /// those SLOs whatever its partial figures say, and it decides no other. None: the step
    /// ran whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
    /// Replica-seconds of model time the step held its fleet: replicas × (warm-up + window +
    /// the drain after it, or up to the cut). 0 in records from before it was kept.
    #[serde(default)]
    pub fleet_s: f64,
    /// Wall-clock seconds the step took on a live backend (its router's and emulators' start
    /// and the scrapes included); 0 in simulation.
    #[serde(default)]
    pub wall_s: f64,
}

/// Where and why a step was cut (see [`StepMetrics::cut`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cut {
    /// The SLOs the step was certain to fail: those its verdict could still inform when it
    /// ran (`analysis::knee::undecided_slos`). For any other SLO the step is not a measurement
    /// (`analysis::capacity::decides`).
    pub fails: Vec<Slo>,
    /// Model seconds from the step's start (warm-up included) at which it was ended.
    pub at_s: f64,
    /// Window requests that had already broken an SLO bound (finished late, or still running
    /// past it), the most over the study's SLOs' least.
    pub violations: u64,
    /// Window requests that had already failed.
    pub errors: u64,
    /// Requests the whole window would have held.
    pub window_requests: u64,
}

/// One step of one run, as stored and as analysed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub run: RunKey,
    /// 0-based index of the step in the ladder.
    pub step: usize,
    pub metrics: StepMetrics,
}

/// One installed plan during a run (CacheRoute): the plan's one record, keyed by its run and
/// ladder step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanEvent {
    pub run: RunKey,
    pub step: usize,
    #[serde(flatten)]
    pub plan: PlanRecord,
}

/// How an SLO capacity is bounded by the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Censoring {
    /// The knee lies inside the ladder.
    None,
    /// Even the first step failed: capacity < first step ("< first").
    Left,
    /// Every step passed: capacity ≥ last step ("≥ last").
    Right,
}

/// SLO capacity of one (policy, seed, sweep point) for one SLO.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// The highest step such that it and every lower step pass; 0 when left-censored.
    pub qps: f64,
    pub censored: Censoring,
}

/// Mean, standard deviation and a 95% Student-t interval over paired seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedStats {
    pub n: usize,
    pub mean: f64,
    pub sd: f64,
    pub ci95: [f64; 2],
    /// The Student-t interval reached past the quantity's physical bound (a capacity or a
    /// ratio below 0) and was cut there: at this n the interval says little.
    #[serde(default)]
    pub clipped: bool,
}

impl SeedStats {
    /// The same statistics with the interval's lower end cut at `lower` (marked `clipped`
    /// when it was below it).
    pub fn at_least(mut self, lower: f64) -> Self {
        if self.ci95[0] < lower {
            self.ci95[0] = lower;
            self.clipped = true;
        }
        self
    }
}
