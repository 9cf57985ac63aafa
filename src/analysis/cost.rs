//! What a study cost its fleet (docs/studies.md): per arm and in all, the replica-seconds of
//! model time its steps held the fleet (warm-ups, drains and knee probes included; a cut step
//! up to its cut), how many steps ran whole and how many were cut, and on a live backend the
//! wall time. Pure: summed from the stored steps.

use serde::{Deserialize, Serialize};

use super::knee::is_probe;
use super::model::StepRecord;
use super::study::arm_label;

/// The cost of one arm, or of the whole study.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Replica-seconds of model time.
    pub fleet_seconds: f64,
    /// Steps run (ladder steps and knee probes).
    pub steps: usize,
    /// Of them, knee probes.
    pub probes: usize,
    /// Of them, steps ended early, certain to fail (`analysis::early`).
    pub cut: usize,
    /// Wall-clock seconds of the steps (live backends; 0 in simulation).
    pub wall_s: f64,
    /// Steps stored before their cost was recorded (counted in `steps`, not in the seconds).
    pub uncosted: usize,
}

impl Cost {
    fn add(&mut self, s: &StepRecord) {
        self.steps += 1;
        self.probes += usize::from(is_probe(s.step));
        self.cut += usize::from(s.metrics.cut.is_some());
        self.fleet_seconds += s.metrics.fleet_s;
        self.wall_s += s.metrics.wall_s;
        self.uncosted += usize::from(s.metrics.fleet_s <= 0.0);
    }
}

/// A study's cost: in all, and per arm (label, cost) in first-seen order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StudyCost {
    #[serde(flatten)]
    pub total: Cost,
    /// Replica-seconds of simulated model time spent predicting where each knee search starts
    /// (off the fleet on a live backend; `experiment::search`). 0 without a search.
    pub prediction_fleet_seconds: f64,
    pub by_arm: Vec<(String, Cost)>,
}

/// Sum the cost of `steps`; `prediction_fleet_seconds` as the search recorded it.
pub fn study_cost(steps: &[StepRecord], prediction_fleet_seconds: f64) -> StudyCost {
    let mut c = StudyCost {
        prediction_fleet_seconds,
        ..Default::default()
    };
    for s in steps {
        c.total.add(s);
        let label = arm_label(&s.run.policy, &s.run.sweep);
        match c.by_arm.iter_mut().find(|(l, _)| *l == label) {
            Some((_, a)) => a.add(s),
            None => {
                let mut a = Cost::default();
                a.add(s);
                c.by_arm.push((label, a));
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::knee::PROBE_STEP_BASE;
    use crate::analysis::model::{Cut, RunKey, StepMetrics};

    fn step(policy: &str, step: usize, fleet_s: f64, cut: bool) -> StepRecord {
        StepRecord {
            run: RunKey {
                policy: policy.into(),
                seed: 1,
                sweep: String::new(),
            },
            step,
            metrics: StepMetrics {
                fleet_s,
                wall_s: fleet_s / 80.0,
                cut: cut.then_some(Cut {
                    fails: Vec::new(),
                    at_s: 40.0,
                    violations: 9,
                    errors: 0,
                    window_requests: 100,
                }),
                ..Default::default()
            },
        }
    }

    #[test]
    fn the_cost_sums_every_step_per_arm_and_in_all() {
        let steps = [
            step("a", 0, 960.0, false),
            step("a", 1, 320.0, true),
            step("a", PROBE_STEP_BASE, 960.0, false),
            step("b", 0, 960.0, false),
            step("b", 1, 0.0, false),
        ];
        let c = study_cost(&steps, 123.0);
        assert_eq!(c.total.fleet_seconds, 3200.0);
        assert_eq!((c.total.steps, c.total.probes, c.total.cut), (5, 1, 1));
        assert_eq!(c.total.uncosted, 1);
        assert_eq!(c.total.wall_s, 40.0);
        assert_eq!(c.prediction_fleet_seconds, 123.0);
        assert_eq!(c.by_arm.len(), 2);
        assert_eq!(c.by_arm[0].0, "a");
        assert_eq!(c.by_arm[0].1.fleet_seconds, 2240.0);
        assert_eq!(c.by_arm[1].1.steps, 2);
    }
}
