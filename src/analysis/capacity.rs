//! Pass/fail of a ladder step, SLO capacity with censoring, and paired-seed statistics
//! (docs/analysis.md). Pure.
//!
//! - A step **cut** early (`analysis::early`) fails the SLOs it was certain to fail, and is no
//!   measurement for any other: capacity at those leaves it out.
//! - A step **passes** when its p99 (of the SLO's metric) ≤ the SLO, errors ≤ 1% of requests,
//!   and its throughput (`achieved_qps`: completions inside the measured window) ≥ 95% of the
//!   rate offered in that window (its requests / window; the ladder's target rate when the
//!   window length is unknown). A step with no completed request (NaN p99) fails.
//! - **Capacity** = the highest offered rate such that it and every lower step pass. Left-
//!   censored (`qps` 0) when the first step fails; right-censored (`qps` = last step) when all
//!   pass. A step that passes above a failing one does not count (non-monotone ladders).
//! - **Seed statistics**: mean, sample sd (n − 1) and mean ± t₀.₉₇₅,ₙ₋₁ · sd/√n. With n = 1
//!   the sd is 0 and the interval is the value itself (no spread can be estimated; the report
//!   says n). With n = 0 everything is NaN. Capacities and capacity ratios cannot be negative:
//!   their intervals are cut at 0 and marked `clipped` (with 2 or 3 spread seeds the t
//!   interval is that wide; the report then calls it uninformative at that n).
//! - **Paired ratios**: per seed present in both, policy capacity / baseline capacity. A
//!   left-censored baseline (capacity < first step, stored as 0) makes the ratio *undefined*:
//!   it is counted and left out of the statistics, never reported as infinity. Any other
//!   censoring on either side keeps the ratio (computed from the censored values: 0 for
//!   "< first", the last step for "≥ last") but counts it as *censored*: it is a bound, not an
//!   estimate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, StudentsT};

use super::model::{Capacity, Censoring, SeedStats, Slo, SloMetric, StepMetrics};

/// Largest error share of a passing step.
pub const MAX_ERROR_RATE: f64 = 0.01;
/// Smallest achieved / offered rate of a passing step.
pub const MIN_ACHIEVED_FRACTION: f64 = 0.95;

/// The rate a step's throughput is held against: what arrived in its window per second, or
/// the ladder's target rate when the window is unknown (`window_s` 0).
pub fn offered_in_window(m: &StepMetrics) -> f64 {
    if m.window_s > 0.0 {
        m.requests as f64 / m.window_s
    } else {
        m.offered_qps
    }
}

/// Why a step passed or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub latency_ok: bool,
    pub errors_ok: bool,
    pub rate_ok: bool,
}

impl Verdict {
    pub fn passes(&self) -> bool {
        self.latency_ok && self.errors_ok && self.rate_ok
    }
}

/// The p99 a step reports for the SLO's metric.
pub fn p99_for(m: &StepMetrics, metric: SloMetric) -> f64 {
    match metric {
        SloMetric::Ttft => m.ttft_p99_s,
        SloMetric::E2e => m.e2e_p99_s,
    }
}

/// Whether a step is a measurement for an SLO: a whole step for every SLO, a step cut early
/// (`analysis::early`) only for the SLOs it was certain to fail.
pub fn decides(m: &StepMetrics, slo: &Slo) -> bool {
    m.cut.as_ref().is_none_or(|c| c.fails.contains(slo))
}

/// Each pass condition of a step against an SLO. A step cut early (`analysis::early`) was
/// certain to fail its SLOs on latency or errors: its partial figures decide nothing, and it
/// fails both (for an SLO it does not decide, callers leave it out: [`decides`]).
pub fn verdict(m: &StepMetrics, slo: &Slo) -> Verdict {
    if m.cut.is_some() {
        return Verdict {
            latency_ok: false,
            errors_ok: false,
            rate_ok: true,
        };
    }
    let p99 = p99_for(m, slo.metric);
    let err_rate = if m.requests == 0 {
        0.0
    } else {
        m.errors as f64 / m.requests as f64
    };
    Verdict {
        latency_ok: p99.is_finite() && p99 <= slo.p99_s,
        errors_ok: err_rate <= MAX_ERROR_RATE,
        rate_ok: m.achieved_qps >= MIN_ACHIEVED_FRACTION * offered_in_window(m),
    }
}

/// Whether a step passes an SLO (docs/analysis.md).
pub fn passes(m: &StepMetrics, slo: &Slo) -> bool {
    verdict(m, slo).passes()
}

/// SLO capacity over one run's ladder steps (sorted here by offered rate, stably). An empty
/// ladder is left-censored.
pub fn capacity<'a>(steps: impl IntoIterator<Item = &'a StepMetrics>, slo: &Slo) -> Capacity {
    let mut s: Vec<&StepMetrics> = steps.into_iter().filter(|m| decides(m, slo)).collect();
    s.sort_by(|a, b| a.offered_qps.total_cmp(&b.offered_qps));
    let mut best: Option<f64> = None;
    for m in &s {
        if !passes(m, slo) {
            return match best {
                None => Capacity {
                    qps: 0.0,
                    censored: Censoring::Left,
                },
                Some(q) => Capacity {
                    qps: q,
                    censored: Censoring::None,
                },
            };
        }
        best = Some(m.offered_qps);
    }
    match best {
        None => Capacity {
            qps: 0.0,
            censored: Censoring::Left,
        },
        Some(q) => Capacity {
            qps: q,
            censored: Censoring::Right,
        },
    }
}

/// The two-sided 97.5% Student-t quantile with `df` degrees of freedom.
pub fn t975(df: f64) -> f64 {
    StudentsT::new(0.0, 1.0, df)
        .expect("df > 0")
        .inverse_cdf(0.975)
}

/// Mean, sample sd and 95% Student-t interval of `values` (see the module docs for n ≤ 1).
pub fn seed_stats(values: &[f64]) -> SeedStats {
    let n = values.len();
    if n == 0 {
        return SeedStats {
            n,
            mean: f64::NAN,
            sd: f64::NAN,
            ci95: [f64::NAN, f64::NAN],
            clipped: false,
        };
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return SeedStats {
            n,
            mean,
            sd: 0.0,
            ci95: [mean, mean],
            clipped: false,
        };
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let sd = var.sqrt();
    let half = t975((n - 1) as f64) * sd / (n as f64).sqrt();
    SeedStats {
        n,
        mean,
        sd,
        ci95: [mean - half, mean + half],
        clipped: false,
    }
}

/// One seed's ratio of a policy's capacity to a baseline's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedRatio {
    pub seed: u64,
    /// None when undefined (left-censored baseline).
    pub ratio: Option<f64>,
    /// Either capacity was censored: the ratio is a bound, not an estimate.
    pub censored: bool,
}

/// Paired per-seed ratios and their statistics (over defined ratios only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RatioStats {
    pub stats: SeedStats,
    /// Seeds present for both policies.
    pub paired_seeds: usize,
    /// Seeds whose ratio is undefined (left-censored baseline), left out of `stats`.
    pub undefined: usize,
    /// Seeds whose ratio is in `stats` but built from a censored capacity.
    pub censored: usize,
    pub per_seed: Vec<SeedRatio>,
}

/// Per-seed ratios `policy / baseline` over the seeds both have (see the module docs).
pub fn paired_ratios(
    policy: &BTreeMap<u64, Capacity>,
    baseline: &BTreeMap<u64, Capacity>,
) -> RatioStats {
    let mut per_seed = Vec::new();
    for (seed, p) in policy {
        let Some(b) = baseline.get(seed) else {
            continue;
        };
        let undefined = b.censored == Censoring::Left || b.qps <= 0.0;
        per_seed.push(SeedRatio {
            seed: *seed,
            ratio: (!undefined).then(|| p.qps / b.qps),
            censored: !undefined
                && (p.censored != Censoring::None || b.censored != Censoring::None),
        });
    }
    let defined: Vec<f64> = per_seed.iter().filter_map(|r| r.ratio).collect();
    RatioStats {
        // A capacity ratio is never negative.
        stats: seed_stats(&defined).at_least(0.0),
        paired_seeds: per_seed.len(),
        undefined: per_seed.iter().filter(|r| r.ratio.is_none()).count(),
        censored: per_seed.iter().filter(|r| r.censored).count(),
        per_seed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(q: f64, p99: f64) -> StepMetrics {
        StepMetrics {
            offered_qps: q,
            achieved_qps: q,
            requests: 1000,
            e2e_p99_s: p99,
            ttft_p99_s: p99 / 2.0,
            ..Default::default()
        }
    }
    const SLO: Slo = Slo {
        metric: SloMetric::E2e,
        p99_s: 3.5,
    };

    #[test]
    fn pass_rule_checks_latency_errors_and_rate() {
        let ok = step(10.0, 3.5);
        assert!(passes(&ok, &SLO)); // equal to the SLO passes
        assert!(!passes(&step(10.0, 3.51), &SLO));
        assert!(!passes(&step(10.0, f64::NAN), &SLO));
        let ttft = Slo {
            metric: SloMetric::Ttft,
            p99_s: 2.0,
        };
        assert!(passes(&step(10.0, 3.9), &ttft));
        let mut e = ok.clone();
        e.errors = 10; // exactly 1%
        assert!(passes(&e, &SLO));
        e.errors = 11;
        assert!(!verdict(&e, &SLO).errors_ok);
        let mut r = ok.clone();
        r.achieved_qps = 9.5; // exactly 95%
        assert!(passes(&r, &SLO));
        r.achieved_qps = 9.49;
        let v = verdict(&r, &SLO);
        assert!(v.latency_ok && v.errors_ok && !v.rate_ok);
        // With a known window the rate rule holds throughput against what arrived in it:
        // 1000 requests in 125 s = 8/s offered; 7.6/s (95%) passes, 7.59/s fails, whatever the
        // ladder's target said.
        r.window_s = 125.0;
        r.achieved_qps = 7.6;
        assert!(verdict(&r, &SLO).rate_ok);
        r.achieved_qps = 7.59;
        assert!(!verdict(&r, &SLO).rate_ok);
    }

    #[test]
    fn capacity_censoring_both_sides_and_interior() {
        let all = [step(10.0, 1.0), step(20.0, 2.0), step(30.0, 3.0)];
        assert_eq!(
            capacity(&all, &SLO),
            Capacity {
                qps: 30.0,
                censored: Censoring::Right
            }
        );
        let none = [step(10.0, 4.0), step(20.0, 5.0)];
        assert_eq!(
            capacity(&none, &SLO),
            Capacity {
                qps: 0.0,
                censored: Censoring::Left
            }
        );
        let knee = [step(30.0, 9.0), step(10.0, 1.0), step(20.0, 3.0)]; // unsorted input
        assert_eq!(
            capacity(&knee, &SLO),
            Capacity {
                qps: 20.0,
                censored: Censoring::None
            }
        );
        assert_eq!(
            capacity(&[] as &[StepMetrics], &SLO).censored,
            Censoring::Left
        );
    }

    #[test]
    fn non_monotone_ladder_stops_at_the_first_failure() {
        // 10 pass, 20 fail, 30 pass, 40 pass → 10, not 40.
        let s = [
            step(10.0, 1.0),
            step(20.0, 4.0),
            step(30.0, 2.0),
            step(40.0, 2.0),
        ];
        assert_eq!(
            capacity(&s, &SLO),
            Capacity {
                qps: 10.0,
                censored: Censoring::None
            }
        );
        // first fails, later ones pass → still left-censored.
        let s = [step(10.0, 4.0), step(20.0, 1.0)];
        assert_eq!(capacity(&s, &SLO).censored, Censoring::Left);
    }

    #[test]
    fn t_interval_matches_tables() {
        // t(0.975, 4) = 2.776445 (standard tables); t(0.975, 1) = 12.706205.
        assert!((t975(4.0) - 2.776445).abs() < 1e-5);
        assert!((t975(1.0) - 12.706205).abs() < 1e-5);
        // values 1..=5: mean 3, sd √2.5, half = 2.776445·√2.5/√5 = 1.963243
        let s = seed_stats(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(s.n, 5);
        assert_eq!(s.mean, 3.0);
        assert!((s.sd - 2.5f64.sqrt()).abs() < 1e-12);
        assert!((s.ci95[0] - (3.0 - 1.963243)).abs() < 1e-5);
        assert!((s.ci95[1] - (3.0 + 1.963243)).abs() < 1e-5);
    }

    #[test]
    fn seed_stats_small_n() {
        let one = seed_stats(&[42.0]);
        assert_eq!(
            (one.n, one.mean, one.sd, one.ci95),
            (1, 42.0, 0.0, [42.0, 42.0])
        );
        let none = seed_stats(&[]);
        assert!(none.mean.is_nan() && none.ci95[0].is_nan());
        let same = seed_stats(&[7.0, 7.0, 7.0]);
        assert_eq!((same.sd, same.ci95), (0.0, [7.0, 7.0]));
    }

    #[test]
    fn paired_ratios_skip_left_censored_baselines_and_flag_bounds() {
        let c = |qps: f64, censored: Censoring| Capacity { qps, censored };
        let pol: BTreeMap<u64, Capacity> = [
            (1, c(176.0, Censoring::None)),
            (2, c(160.0, Censoring::None)),
            (3, c(200.0, Censoring::Right)),
            (4, c(100.0, Censoring::None)),
            (9, c(100.0, Censoring::None)), // no baseline run for seed 9
        ]
        .into();
        let base: BTreeMap<u64, Capacity> = [
            (1, c(88.0, Censoring::None)),
            (2, c(80.0, Censoring::None)),
            (3, c(100.0, Censoring::None)),
            (4, c(0.0, Censoring::Left)),
        ]
        .into();
        let r = paired_ratios(&pol, &base);
        assert_eq!((r.paired_seeds, r.undefined, r.censored), (4, 1, 1));
        assert_eq!(r.stats.n, 3);
        assert_eq!(r.stats.mean, 2.0);
        assert_eq!(
            r.per_seed[3],
            SeedRatio {
                seed: 4,
                ratio: None,
                censored: false
            }
        );
        assert!(r.per_seed[2].censored);
    }
}
