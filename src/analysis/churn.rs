//! Plan churn summary from installed plans ([`PlanEvent`]s). Pure.
//!
//! Plan churn = fraction of admitted keys whose destination set changed against the plan it
//! replaced (docs/analysis.md). The first plan of each run replaces nothing (the simulator records
//! churn 1.0 for it) and repairs after a failure move only the dead destination's keys, so
//! both are counted separately and kept out of the replan churn statistics.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::model::{PlanEvent, RunKey};

/// Churn and planning cost over a set of plan events (typically one policy, all seeds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChurnSummary {
    /// Runs with at least one plan.
    pub runs: usize,
    /// All installed plans.
    pub plans: usize,
    /// Periodic replans (not the first of a run, not repairs).
    pub replans: usize,
    /// Repairs after failures.
    pub repairs: usize,
    /// Mean and max churn of replans; None when there were none.
    pub replan_churn_mean: Option<f64>,
    pub replan_churn_max: Option<f64>,
    pub repair_churn_mean: Option<f64>,
    pub build_ms_mean: f64,
    pub build_ms_max: f64,
    pub admitted_mean: f64,
    pub admitted_share_mean: f64,
    /// Planned max/mean load, mean and max over all plans.
    pub plan_imbalance_mean: f64,
    pub plan_imbalance_max: f64,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn max(v: &[f64]) -> Option<f64> {
    v.iter().cloned().reduce(f64::max)
}

/// Summarise plan events (any order; grouped by run, ordered by step then time).
pub fn churn_summary<'a>(events: impl IntoIterator<Item = &'a PlanEvent>) -> ChurnSummary {
    let mut by_run: BTreeMap<&RunKey, Vec<&PlanEvent>> = BTreeMap::new();
    for e in events {
        by_run.entry(&e.run).or_default().push(e);
    }
    let (mut replan, mut repair) = (Vec::new(), Vec::new());
    let (mut build, mut admitted, mut share, mut imb) = (vec![], vec![], vec![], vec![]);
    for evs in by_run.values_mut() {
        evs.sort_by(|a, b| {
            a.step
                .cmp(&b.step)
                .then(a.plan.at_s.total_cmp(&b.plan.at_s))
        });
        for (i, e) in evs.iter().map(|e| &e.plan).enumerate() {
            if e.repair {
                repair.push(e.churn);
            } else if i > 0 {
                replan.push(e.churn);
            }
            // A plan whose build time was not measured counts as NaN, as it was stored.
            build.push(e.build_ms.unwrap_or(f64::NAN));
            admitted.push(e.admitted as f64);
            share.push(e.admitted_share);
            imb.push(e.imbalance);
        }
    }
    ChurnSummary {
        runs: by_run.len(),
        plans: build.len(),
        replans: replan.len(),
        repairs: repair.len(),
        replan_churn_mean: mean(&replan),
        replan_churn_max: max(&replan),
        repair_churn_mean: mean(&repair),
        build_ms_mean: mean(&build).unwrap_or(0.0),
        build_ms_max: max(&build).unwrap_or(0.0),
        admitted_mean: mean(&admitted).unwrap_or(0.0),
        admitted_share_mean: mean(&share).unwrap_or(0.0),
        plan_imbalance_mean: mean(&imb).unwrap_or(0.0),
        plan_imbalance_max: max(&imb).unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::record::PlanRecord;

    fn ev(seed: u64, at: f64, churn: f64, repair: bool) -> PlanEvent {
        PlanEvent {
            run: RunKey {
                policy: "cacheroute".into(),
                seed,
                sweep: String::new(),
            },
            step: 0,
            plan: PlanRecord {
                at_s: at,
                admitted: 100,
                admitted_share: 0.5,
                imbalance: 1.1,
                churn,
                repair,
                build_ms: Some(2.0),
                bounded_sets: None,
                dispatch: None,
                q_cap: Some(4.0),
                warm_slots: Some(64),
                replicas: None,
                tuning: None,
            },
        }
    }

    #[test]
    fn first_plan_and_repairs_are_kept_apart() {
        let e = [
            ev(1, 10.0, 0.2, false),
            ev(1, 0.0, 1.0, false), // first of seed 1 (out of order on purpose)
            ev(1, 20.0, 0.4, false),
            ev(1, 15.0, 0.05, true),
            ev(2, 0.0, 1.0, false),
            ev(2, 10.0, 0.3, false),
        ];
        let s = churn_summary(&e);
        assert_eq!((s.runs, s.plans, s.replans, s.repairs), (2, 6, 3, 1));
        assert!((s.replan_churn_mean.unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(s.replan_churn_max, Some(0.4));
        assert_eq!(s.repair_churn_mean, Some(0.05));
        assert_eq!(churn_summary(&[]).replan_churn_mean, None);
    }
}
