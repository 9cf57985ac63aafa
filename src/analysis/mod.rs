//! Metrics, defined once (docs/analysis.md), over request records from any backend. Pure.
//!
//! - Served KV hit = Σ cached prompt tokens / Σ prompt tokens over the measured window.
//! - Latency from the scheduled send time: TTFT and end-to-end percentiles.
//! - Imbalance = max / mean of per-destination load (requests, and prefill tokens computed).
//!
//! Everything here is pure: no I/O, no clock, no live layers (it imports only `engine` and
//! `workload`, both pure). Submodules: [`latency`] (HDR histograms), [`step`] (per-step metrics and
//! fairness from per-request observations), [`capacity`] (pass/fail, SLO capacity with
//! censoring, paired-seed statistics), [`early`] (a step certain to fail, decided before it
//! ends), [`knee`] (bisection of a knee between two ladder steps),
//! [`churn`] (plan churn), [`cost`] (what a study cost its fleet), [`study`] (a whole study, as the report and its JSON show it),
//! [`model`] (the shared data model), [`advise`] (the reuse diagnostic and the win / tie / lose
//! rule of `cacheroute advise`). Definitions and rules: `docs/analysis.md`.

pub mod advise;
pub mod capacity;
pub mod churn;
pub mod cost;
pub mod early;
pub mod knee;
pub mod latency;
pub mod model;
pub mod record;
pub mod step;
pub mod study;

pub use capacity::{capacity, paired_ratios, passes, seed_stats, verdict, RatioStats, Verdict};
pub use churn::{churn_summary, ChurnSummary};
pub use latency::LatencyHist;
pub use step::{jain_index, step_metrics, Window};
pub use study::{summarize_study, StudySummary};

use serde::{Deserialize, Serialize};

/// One finished (or failed) request, as every backend records it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub destination: i32,
    pub scheduled_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub ok: bool,
}

/// Summary of one measured window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub window_s: f64,
    pub offered_qps: f64,
    pub throughput_qps: f64,
    pub served_kv_hit: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    pub imbalance_requests: f64,
    pub imbalance_prefill_tokens: f64,
}

/// The q-quantile (0..=1) of `v` by the nearest-rank method; NaN when empty. Sorts `v`.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    v[rank.saturating_sub(1).min(v.len() - 1)]
}

/// max / mean of non-negative loads (1.0 when all are zero).
pub fn max_over_mean(loads: &[f64]) -> f64 {
    if loads.is_empty() {
        return 1.0;
    }
    let sum: f64 = loads.iter().sum();
    if sum <= 0.0 {
        return 1.0;
    }
    loads.iter().cloned().fold(0.0, f64::max) / (sum / loads.len() as f64)
}

/// Summarise the samples scheduled in `[from_s, to_s)` over `destinations` destinations.
/// Failed requests count as errors; latency percentiles are over completed requests.
pub fn summarize(
    samples: impl IntoIterator<Item = Sample>,
    destinations: usize,
    from_s: f64,
    to_s: f64,
) -> Summary {
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut req = vec![0.0f64; destinations];
    let mut prefill = vec![0.0f64; destinations];
    let (mut n, mut errors, mut prompt, mut cached) = (0u64, 0u64, 0u64, 0u64);
    for s in samples {
        if s.scheduled_s < from_s || s.scheduled_s >= to_s {
            continue;
        }
        n += 1;
        let dest = (s.destination >= 0 && (s.destination as usize) < destinations)
            .then_some(s.destination as usize);
        // Request imbalance counts what was routed, finished or not.
        if let Some(d) = dest {
            req[d] += 1.0;
        }
        if !s.ok {
            errors += 1;
            continue;
        }
        ttft.push(s.ttft_s);
        e2e.push(s.e2e_s);
        prompt += s.prompt_tokens as u64;
        cached += s.cached_tokens as u64;
        if let Some(d) = dest {
            prefill[d] += (s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens)) as f64;
        }
    }
    let window = (to_s - from_s).max(1e-9);
    let completed = ttft.len() as u64;
    Summary {
        requests: n,
        completed,
        errors,
        window_s: window,
        offered_qps: n as f64 / window,
        throughput_qps: completed as f64 / window,
        served_kv_hit: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        ttft_p50_s: percentile(&mut ttft, 0.50),
        ttft_p99_s: percentile(&mut ttft, 0.99),
        e2e_p50_s: percentile(&mut e2e, 0.50),
        e2e_p99_s: percentile(&mut e2e, 0.99),
        imbalance_requests: max_over_mean(&req),
        imbalance_prefill_tokens: max_over_mean(&prefill),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 1.0), 100.0);
        assert!(percentile(&mut [], 0.5).is_nan());
    }

    #[test]
    fn summary_counts_window_errors_and_hit() {
        let s = |d: i32, t: f64, ok: bool| Sample {
            destination: d,
            scheduled_s: t,
            ttft_s: 0.1,
            e2e_s: 1.0,
            prompt_tokens: 100,
            cached_tokens: 25,
            ok,
        };
        let v = vec![
            s(0, 0.5, true),
            s(0, 1.5, true),
            s(1, 1.6, true),
            s(1, 1.7, false),
            s(0, 3.0, true),
        ];
        let m = summarize(v, 2, 1.0, 2.0);
        assert_eq!((m.requests, m.completed, m.errors), (3, 2, 1));
        assert!((m.served_kv_hit - 0.25).abs() < 1e-12);
        // Routed in the window: destination 0 once, destination 1 twice (one failed).
        assert!((m.imbalance_requests - 2.0 / 1.5).abs() < 1e-12);
        assert_eq!(m.e2e_p99_s, 1.0);
    }
}
