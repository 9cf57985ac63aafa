//! A whole study's analysis: per arm (policy, sweep point) and SLO, capacities over seeds with
//! censoring, paired ratios against each baseline, served hit, imbalance, p99 by offered rate,
//! fairness and plan churn. Pure: plain data in, plain (serde) data out; the report renders it
//! and writes it as `reports/<study>.json`.
//!
//! Per-seed aggregates over a run's ladder (rules also in `docs/analysis.md`):
//! - served KV hit of a run = request-weighted mean of its steps' served hit (≈ Σ cached /
//!   Σ prompt over all measured windows);
//! - imbalance of a run = mean of its steps' imbalance, and — what the reports show beside
//!   capacity — its imbalance *at its capacity step* for each SLO: the step at the seed's
//!   capacity (the highest passing step), or its lowest step when even that fails (left-
//!   censored). A ladder mean mixes light steps, where one replica of a whale dominates, with
//!   the loads that decide capacity;
//! - per offered rate, each metric's [`SeedStats`] over the seeds that ran that step.
//!
//! Knee probes (steps measured between two ladder steps to refine a capacity,
//! `analysis::knee`, stored from step index `PROBE_STEP_BASE` up) count towards capacity and
//! the step at capacity, not towards the ladder's served hit, imbalance mean or per-rate rows.
//! Steps cut early (`analysis::early`) count towards capacity as fails and towards nothing else:
//! their figures cover part of a window. With a knee search (`search: knee`) seeds measure
//! different ladder steps: each seed's capacity is its own steps' (on the same ladder and, with
//! `refine`, the same grid of probe rates), paired ratios pair seeds' capacities as always, the
//! per-rate rows count the seeds that ran each rate (`seeds`), and served hit and imbalance
//! are over the steps each seed measured.
//!
//! Baseline pairing: an arm is paired with the baseline arm of the same sweep point, or with
//! the baseline's un-swept arm (`sweep` empty) when there is none. A baseline is not compared
//! with itself.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::capacity::{capacity, paired_ratios, passes, seed_stats, RatioStats};
use super::churn::{churn_summary, ChurnSummary};
use super::knee::is_probe;
use super::model::{Capacity, Censoring, PlanEvent, SeedStats, Slo, StepMetrics, StepRecord};

/// How the seeds of an arm are censored at one SLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CensorSummary {
    /// No seed censored.
    None,
    /// Every censored seed is left-censored (< first step).
    Left,
    /// Every censored seed is right-censored (≥ last step).
    Right,
    /// Some seeds left-, some right-censored.
    Mixed,
}

/// One seed's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedCapacity {
    pub seed: u64,
    pub qps: f64,
    pub censored: Censoring,
}

/// Capacity of an arm at one SLO over its seeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CapacityStats {
    pub slo: Slo,
    pub slo_label: String,
    pub n: usize,
    /// Over per-seed capacities, censored values included as they are (0 for "< first",
    /// the last step for "≥ last"), so with censoring the mean is a bound.
    pub mean: f64,
    pub sd: f64,
    /// 95% Student-t interval, cut at 0 (`ci95_clipped`).
    pub ci95: [f64; 2],
    #[serde(default)]
    pub ci95_clipped: bool,
    pub censored: CensorSummary,
    pub left_censored_seeds: usize,
    pub right_censored_seeds: usize,
    pub per_seed: Vec<SeedCapacity>,
}

/// Ratios of an arm's capacity to one baseline's at one SLO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineRatio {
    pub baseline: String,
    pub slo_label: String,
    #[serde(flatten)]
    pub ratio: RatioStats,
}

/// One offered rate of an arm, over the seeds that ran it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepAgg {
    pub offered_qps: f64,
    pub seeds: usize,
    pub e2e_p99_s: SeedStats,
    pub ttft_p99_s: SeedStats,
    pub served_kv_hit: SeedStats,
    pub imbalance_requests: SeedStats,
    pub imbalance_prefill_tokens: SeedStats,
    pub achieved_qps: SeedStats,
    pub error_rate: SeedStats,
    /// Share of seeds passing each SLO at this step (SLO order).
    pub pass_share: Vec<f64>,
    /// Per key-rate decile (lowest first), the mean over seeds of the e2e p99 (None where no
    /// seed had a completed request in the decile).
    pub fairness_e2e_p99_by_decile_s: Vec<Option<f64>>,
    /// Mean over seeds of Jain's index (None when undefined for every seed).
    pub jain_index: Option<f64>,
}

/// Imbalance of an arm (per-seed mean over steps, then over seeds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Imbalance {
    pub requests: SeedStats,
    pub prefill_tokens: SeedStats,
}

/// Imbalance of an arm at its capacity step for one SLO (see the module docs), over seeds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImbalanceAtCapacity {
    pub slo_label: String,
    pub requests: SeedStats,
    pub prefill_tokens: SeedStats,
    /// Per seed, the offered rate of the step the imbalance was taken at.
    pub step_qps: Vec<f64>,
}

/// Everything the analysis says about one arm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArmSummary {
    /// `policy`, or `policy [sweep]` for a sweep point.
    pub label: String,
    pub policy: String,
    pub sweep: String,
    pub seeds: Vec<u64>,
    /// One entry per SLO, in the study's SLO order.
    pub capacity_qps: Vec<CapacityStats>,
    pub served_kv_hit: SeedStats,
    /// Mean over the ladder (per seed), then over seeds.
    pub imbalance: Imbalance,
    /// At each seed's capacity step, one entry per SLO in the study's SLO order.
    pub imbalance_at_capacity: Vec<ImbalanceAtCapacity>,
    /// By offered rate, ascending.
    pub steps: Vec<StepAgg>,
    /// Against each baseline (study order), for each SLO.
    pub ratios: Vec<BaselineRatio>,
    pub churn: Option<ChurnSummary>,
}

/// The analysis of a whole study.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudySummary {
    pub slos: Vec<Slo>,
    pub baselines: Vec<String>,
    pub arms: Vec<ArmSummary>,
}

/// Label of an arm.
pub fn arm_label(policy: &str, sweep: &str) -> String {
    if sweep.is_empty() {
        policy.to_string()
    } else {
        format!("{policy} [{sweep}]")
    }
}

type Arm = (String, String);

/// Analyse a study. `policies` gives the report order (arms of policies not listed follow,
/// sorted); `baselines` names the policies to compare against.
pub fn summarize_study(
    slos: &[Slo],
    policies: &[String],
    baselines: &[String],
    steps: &[StepRecord],
    plans: &[PlanEvent],
) -> StudySummary {
    // arm → seed → ladder steps, and the same with the knee probes (`analysis::knee`), which
    // count towards capacity only.
    let mut runs: BTreeMap<Arm, BTreeMap<u64, Vec<&StepMetrics>>> = BTreeMap::new();
    let mut probed: BTreeMap<Arm, BTreeMap<u64, Vec<&StepMetrics>>> = BTreeMap::new();
    for s in steps {
        let arm = (s.run.policy.clone(), s.run.sweep.clone());
        if !is_probe(s.step) {
            let seed = runs
                .entry(arm.clone())
                .or_default()
                .entry(s.run.seed)
                .or_default();
            // A cut step's partial figures are never mixed with whole steps: it counts towards
            // capacity (as a fail), not towards hit, imbalance or the per-rate rows.
            if s.metrics.cut.is_none() {
                seed.push(&s.metrics);
            }
        }
        probed
            .entry(arm)
            .or_default()
            .entry(s.run.seed)
            .or_default()
            .push(&s.metrics);
    }
    let rank = |p: &str| policies.iter().position(|x| x == p).unwrap_or(usize::MAX);
    let mut order: Vec<&Arm> = runs.keys().collect();
    order.sort_by(|a, b| rank(&a.0).cmp(&rank(&b.0)).then(a.cmp(b)));

    // capacities per arm, SLO index, seed
    let caps: BTreeMap<&Arm, Vec<BTreeMap<u64, Capacity>>> = runs
        .keys()
        .map(|arm| {
            let seeds = &probed[arm];
            let per_slo = slos
                .iter()
                .map(|slo| {
                    seeds
                        .iter()
                        .map(|(seed, st)| (*seed, capacity(st.iter().copied(), slo)))
                        .collect()
                })
                .collect();
            (arm, per_slo)
        })
        .collect();

    let arms = order
        .into_iter()
        .map(|arm| {
            let seeds = &runs[arm];
            let capacity_qps = slos
                .iter()
                .zip(&caps[arm])
                .map(|(slo, c)| capacity_stats(slo, c))
                .collect();
            let mut ratios = Vec::new();
            for b in baselines {
                if *b == arm.0 {
                    continue;
                }
                let same = (b.clone(), arm.1.clone());
                let plain = (b.clone(), String::new());
                let Some(bc) = caps.get(&same).or_else(|| caps.get(&plain)) else {
                    continue;
                };
                for (i, slo) in slos.iter().enumerate() {
                    ratios.push(BaselineRatio {
                        baseline: b.clone(),
                        slo_label: slo.label(),
                        ratio: paired_ratios(&caps[arm][i], &bc[i]),
                    });
                }
            }
            let hit: Vec<f64> = seeds.values().map(|st| weighted_hit(st)).collect();
            let imb = |f: fn(&StepMetrics) -> f64| -> Vec<f64> {
                seeds
                    .values()
                    .map(|st| st.iter().map(|m| f(m)).sum::<f64>() / st.len().max(1) as f64)
                    .collect()
            };
            let arm_plans: Vec<&PlanEvent> = plans
                .iter()
                .filter(|e| e.run.policy == arm.0 && e.run.sweep == arm.1)
                .collect();
            ArmSummary {
                label: arm_label(&arm.0, &arm.1),
                policy: arm.0.clone(),
                sweep: arm.1.clone(),
                seeds: seeds.keys().copied().collect(),
                capacity_qps,
                served_kv_hit: seed_stats(&hit),
                imbalance: Imbalance {
                    requests: seed_stats(&imb(|m| m.imbalance_requests)),
                    prefill_tokens: seed_stats(&imb(|m| m.imbalance_prefill_tokens)),
                },
                imbalance_at_capacity: slos
                    .iter()
                    .zip(&caps[arm])
                    .map(|(slo, c)| imbalance_at_capacity(slo, &probed[arm], c))
                    .collect(),
                steps: step_aggs(seeds, slos),
                ratios,
                churn: (!arm_plans.is_empty()).then(|| churn_summary(arm_plans)),
            }
        })
        .collect();
    StudySummary {
        slos: slos.to_vec(),
        baselines: baselines.to_vec(),
        arms,
    }
}

/// The arm of `policy` that an arm of sweep point `sweep` is compared with: `policy`'s arm of
/// the same sweep point, else its un-swept arm (the pairing of the baseline ratios).
pub fn paired_arm<'a>(s: &'a StudySummary, policy: &str, sweep: &str) -> Option<&'a ArmSummary> {
    let of = |sweep: &str| {
        s.arms
            .iter()
            .find(|a| a.policy == policy && a.sweep == sweep)
    };
    of(sweep).or_else(|| of(""))
}

/// Paired per-seed ratios of `a`'s capacity to `b`'s at SLO `slo` (index), by the rules of the
/// baseline ratios ([`paired_ratios`]); for a comparison the summary does not carry (the
/// report's reference policy).
pub fn arm_ratio(a: &ArmSummary, b: &ArmSummary, slo: usize) -> RatioStats {
    let caps = |x: &ArmSummary| -> BTreeMap<u64, Capacity> {
        x.capacity_qps[slo]
            .per_seed
            .iter()
            .map(|p| {
                let c = Capacity {
                    qps: p.qps,
                    censored: p.censored,
                };
                (p.seed, c)
            })
            .collect()
    };
    paired_ratios(&caps(a), &caps(b))
}

/// The step of a run its capacity was found at: the step at the capacity's rate, or the
/// lowest step when the run is left-censored.
fn capacity_step<'a>(steps: &[&'a StepMetrics], cap: &Capacity) -> Option<&'a StepMetrics> {
    let lowest = || {
        steps
            .iter()
            .filter(|m| m.cut.is_none())
            .min_by(|a, b| a.offered_qps.total_cmp(&b.offered_qps))
            .or_else(|| steps.first())
            .copied()
    };
    if cap.censored == Censoring::Left {
        return lowest();
    }
    steps
        .iter()
        .find(|m| m.offered_qps == cap.qps)
        .copied()
        .or_else(lowest)
}

fn imbalance_at_capacity(
    slo: &Slo,
    seeds: &BTreeMap<u64, Vec<&StepMetrics>>,
    caps: &BTreeMap<u64, Capacity>,
) -> ImbalanceAtCapacity {
    let at: Vec<&StepMetrics> = seeds
        .iter()
        .filter_map(|(seed, st)| capacity_step(st, caps.get(seed)?))
        .collect();
    let stats =
        |f: fn(&StepMetrics) -> f64| seed_stats(&at.iter().map(|m| f(m)).collect::<Vec<_>>());
    ImbalanceAtCapacity {
        slo_label: slo.label(),
        requests: stats(|m| m.imbalance_requests),
        prefill_tokens: stats(|m| m.imbalance_prefill_tokens),
        step_qps: at.iter().map(|m| m.offered_qps).collect(),
    }
}

fn weighted_hit(steps: &[&StepMetrics]) -> f64 {
    let n: u64 = steps.iter().map(|m| m.requests).sum();
    if n == 0 {
        return steps.iter().map(|m| m.served_kv_hit).sum::<f64>() / steps.len().max(1) as f64;
    }
    steps
        .iter()
        .map(|m| m.served_kv_hit * m.requests as f64)
        .sum::<f64>()
        / n as f64
}

fn capacity_stats(slo: &Slo, caps: &BTreeMap<u64, Capacity>) -> CapacityStats {
    let values: Vec<f64> = caps.values().map(|c| c.qps).collect();
    let s = seed_stats(&values).at_least(0.0);
    let left = caps
        .values()
        .filter(|c| c.censored == Censoring::Left)
        .count();
    let right = caps
        .values()
        .filter(|c| c.censored == Censoring::Right)
        .count();
    CapacityStats {
        slo: *slo,
        slo_label: slo.label(),
        n: s.n,
        mean: s.mean,
        sd: s.sd,
        ci95: s.ci95,
        ci95_clipped: s.clipped,
        censored: match (left, right) {
            (0, 0) => CensorSummary::None,
            (_, 0) => CensorSummary::Left,
            (0, _) => CensorSummary::Right,
            _ => CensorSummary::Mixed,
        },
        left_censored_seeds: left,
        right_censored_seeds: right,
        per_seed: caps
            .iter()
            .map(|(seed, c)| SeedCapacity {
                seed: *seed,
                qps: c.qps,
                censored: c.censored,
            })
            .collect(),
    }
}

fn finite_mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn step_aggs(seeds: &BTreeMap<u64, Vec<&StepMetrics>>, slos: &[Slo]) -> Vec<StepAgg> {
    // offered rate (as bits, ordered by value) → one metrics per seed
    let mut by_q: Vec<(f64, Vec<&StepMetrics>)> = Vec::new();
    let qs: BTreeSet<u64> = seeds
        .values()
        .flatten()
        .map(|m| m.offered_qps.to_bits())
        .collect();
    let mut qs: Vec<f64> = qs.into_iter().map(f64::from_bits).collect();
    qs.sort_by(f64::total_cmp);
    for q in qs {
        let ms: Vec<&StepMetrics> = seeds
            .values()
            .filter_map(|st| st.iter().find(|m| m.offered_qps == q).copied())
            .collect();
        by_q.push((q, ms));
    }
    by_q.into_iter()
        .map(|(q, ms)| {
            let st = |f: fn(&StepMetrics) -> f64| {
                seed_stats(&ms.iter().map(|m| f(m)).collect::<Vec<_>>())
            };
            let deciles = ms
                .iter()
                .map(|m| m.fairness.e2e_p99_by_rate_decile_s.len())
                .max()
                .unwrap_or(0);
            StepAgg {
                offered_qps: q,
                seeds: ms.len(),
                e2e_p99_s: st(|m| m.e2e_p99_s),
                ttft_p99_s: st(|m| m.ttft_p99_s),
                served_kv_hit: st(|m| m.served_kv_hit),
                imbalance_requests: st(|m| m.imbalance_requests),
                imbalance_prefill_tokens: st(|m| m.imbalance_prefill_tokens),
                achieved_qps: st(|m| m.achieved_qps),
                error_rate: st(|m| {
                    if m.requests == 0 {
                        0.0
                    } else {
                        m.errors as f64 / m.requests as f64
                    }
                }),
                pass_share: slos
                    .iter()
                    .map(|slo| {
                        ms.iter().filter(|m| passes(m, slo)).count() as f64 / ms.len().max(1) as f64
                    })
                    .collect(),
                fairness_e2e_p99_by_decile_s: (0..deciles)
                    .map(|d| {
                        finite_mean(
                            ms.iter().filter_map(|m| {
                                m.fairness.e2e_p99_by_rate_decile_s.get(d).copied()
                            }),
                        )
                    })
                    .collect(),
                jain_index: finite_mean(ms.iter().map(|m| m.fairness.jain_index)),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::model::{RunKey, SloMetric};

    fn rec(policy: &str, seed: u64, step: usize, q: f64, p99: f64, hit: f64) -> StepRecord {
        StepRecord {
            run: RunKey {
                policy: policy.into(),
                seed,
                sweep: String::new(),
            },
            step,
            metrics: StepMetrics {
                offered_qps: q,
                achieved_qps: q,
                requests: 100,
                e2e_p99_s: p99,
                served_kv_hit: hit,
                imbalance_requests: 1.0 + step as f64,
                ..Default::default()
            },
        }
    }

    #[test]
    fn capacities_ratios_and_hits_per_arm() {
        let slo = Slo {
            metric: SloMetric::E2e,
            p99_s: 3.5,
        };
        let mut steps = Vec::new();
        for seed in [1, 2] {
            // base passes 10 only; cr passes 10, 20 (seed 1) or all three (seed 2)
            steps.push(rec("base", seed, 0, 10.0, 1.0, 0.5));
            steps.push(rec("base", seed, 1, 20.0, 9.0, 0.7));
            steps.push(rec("base", seed, 2, 30.0, 9.0, 0.6));
            steps.push(rec("cr", seed, 0, 10.0, 1.0, 0.9));
            steps.push(rec("cr", seed, 1, 20.0, 2.0, 0.9));
            steps.push(rec(
                "cr",
                seed,
                2,
                30.0,
                if seed == 1 { 4.0 } else { 3.0 },
                0.9,
            ));
        }
        let s = summarize_study(
            &[slo],
            &["cr".into(), "base".into()],
            &["base".into()],
            &steps,
            &[],
        );
        assert_eq!(s.arms[0].label, "cr");
        let c = &s.arms[0].capacity_qps[0];
        assert_eq!(
            (c.mean, c.censored, c.right_censored_seeds),
            (25.0, CensorSummary::Right, 1)
        );
        let r = &s.arms[0].ratios[0];
        assert_eq!(r.baseline, "base");
        assert_eq!(r.ratio.stats.mean, 2.5); // (20/10 + 30/10) / 2
        assert_eq!(r.ratio.censored, 1);
        assert!(s.arms[1].ratios.is_empty()); // base vs base skipped
        assert!((s.arms[1].served_kv_hit.mean - 0.6).abs() < 1e-12);
        assert_eq!(s.arms[1].imbalance.requests.mean, 2.0);
        // At capacity: cr's seed 1 passes up to 20 (step 1: imbalance 2), seed 2 up to 30
        // (step 2: 3); base passes 10 only (step 0: 1), unlike its ladder mean of 2.
        let at = &s.arms[0].imbalance_at_capacity[0];
        assert_eq!(
            (at.requests.mean, at.step_qps.clone()),
            (2.5, vec![20.0, 30.0])
        );
        let at = &s.arms[1].imbalance_at_capacity[0];
        assert_eq!(
            (at.requests.mean, at.step_qps.clone()),
            (1.0, vec![10.0, 10.0])
        );
        assert_eq!(s.arms[0].steps.len(), 3);
        assert_eq!(s.arms[0].steps[2].pass_share, vec![0.5]);
        assert!(s.arms[0].churn.is_none());
    }
}
