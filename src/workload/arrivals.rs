//! Arrival processes, one abstraction for the generator, the simulator and a live replayer:
//! given a target rate (requests/s) and a seeded RNG, yield successive arrival times in seconds
//! from 0. Processes: Poisson, Gamma with a coefficient of variation, constant spacing, and
//! real inter-arrival gaps (replayed in order or moving-block bootstrapped), rescaled so their
//! mean matches the target rate.
//!
//! Pure: randomness is passed in, gap samples are passed in as numbers (see
//! `workload::import` for reading them from files).

use crate::rng::Rng64;
use rand::RngExt;
use rand_distr::{Distribution, Exp1, Gamma};
use std::sync::Arc;

/// Which arrival process, with its loaded data.
#[derive(Debug, Clone)]
pub enum ArrivalKind {
    /// Exponential gaps (CV 1).
    Poisson,
    /// Gamma-distributed gaps with this coefficient of variation (the paper's burst test: 1.9).
    Gamma { cv: f64 },
    /// Evenly spaced (CV 0).
    Constant,
    /// Real inter-arrival gaps (any unit; only their shape matters), rescaled to the target
    /// rate. `block: None` replays them in order (cycling); `Some(L)` is a moving-block
    /// bootstrap with blocks of L consecutive gaps.
    Gaps {
        gaps: Arc<[f64]>,
        block: Option<usize>,
    },
}

/// Errors setting up an arrival process.
#[derive(Debug, thiserror::Error)]
pub enum ArrivalError {
    #[error("arrival rate {0} is not a positive finite number of requests per second")]
    BadRate(f64),
    #[error("gamma arrivals: cv {0} must be a positive finite number (1.0 = Poisson-like)")]
    BadCv(f64),
    #[error("gap arrivals need at least 2 gaps with a positive mean; found {0} gaps")]
    FewGaps(usize),
    #[error("bootstrap block length must be ≥ 1")]
    BadBlock,
}

/// Successive arrival times (seconds from 0) of one process at one rate.
#[derive(Debug, Clone)]
pub struct Arrivals {
    kind: ArrivalKind,
    mean_gap: f64,
    rng: Rng64,
    t: f64,
    gamma: Option<Gamma<f64>>,
    gap_scale: f64,
    pos: usize,
    left_in_block: usize,
}

impl Arrivals {
    /// A process at `rate` requests/s.
    pub fn new(kind: ArrivalKind, rate: f64, rng: Rng64) -> Result<Self, ArrivalError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(ArrivalError::BadRate(rate));
        }
        let mean_gap = 1.0 / rate;
        let mut gamma = None;
        let mut gap_scale = 1.0;
        match &kind {
            ArrivalKind::Gamma { cv } => {
                if !(cv.is_finite() && *cv > 0.0) {
                    return Err(ArrivalError::BadCv(*cv));
                }
                let shape = 1.0 / (cv * cv);
                gamma = Some(
                    Gamma::new(shape, mean_gap / shape).map_err(|_| ArrivalError::BadCv(*cv))?,
                );
            }
            ArrivalKind::Gaps { gaps, block } => {
                let m = mean(gaps);
                if gaps.len() < 2 || !(m > 0.0 && m.is_finite()) {
                    return Err(ArrivalError::FewGaps(gaps.len()));
                }
                if *block == Some(0) {
                    return Err(ArrivalError::BadBlock);
                }
                gap_scale = mean_gap / m;
            }
            ArrivalKind::Poisson | ArrivalKind::Constant => {}
        }
        Ok(Arrivals {
            kind,
            mean_gap,
            rng,
            t: 0.0,
            gamma,
            gap_scale,
            pos: 0,
            left_in_block: 0,
        })
    }

    /// The next inter-arrival gap in seconds.
    pub fn next_gap(&mut self) -> f64 {
        match &self.kind {
            ArrivalKind::Poisson => {
                let e: f64 = Exp1.sample(&mut self.rng);
                e * self.mean_gap
            }
            ArrivalKind::Gamma { .. } => self
                .gamma
                .as_ref()
                .expect("gamma set")
                .sample(&mut self.rng),
            ArrivalKind::Constant => self.mean_gap,
            ArrivalKind::Gaps { gaps, block } => {
                let n = gaps.len();
                match block {
                    None => {
                        let g = gaps[self.pos % n];
                        self.pos = (self.pos + 1) % n;
                        g * self.gap_scale
                    }
                    Some(l) => {
                        let l = (*l).min(n);
                        if self.left_in_block == 0 {
                            self.pos = self.rng.random_range(0..=n - l);
                            self.left_in_block = l;
                        }
                        let g = gaps[self.pos];
                        self.pos += 1;
                        self.left_in_block -= 1;
                        g * self.gap_scale
                    }
                }
            }
        }
    }

    /// The target mean gap in seconds (1 / rate).
    pub fn mean_gap(&self) -> f64 {
        self.mean_gap
    }
}

impl Iterator for Arrivals {
    type Item = f64;

    /// The next arrival time in seconds (the first arrival is one gap after 0).
    fn next(&mut self) -> Option<f64> {
        self.t += self.next_gap();
        Some(self.t)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

/// Coefficient of variation (sd / mean) of values; 0 for fewer than 2 values.
pub fn cv(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let m = mean(values);
    if m <= 0.0 {
        return 0.0;
    }
    let var = values.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (values.len() - 1) as f64;
    var.sqrt() / m
}

/// Gaps between successive times (sorted input assumed).
pub fn gaps_of(times: &[f64]) -> Vec<f64> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::seeded;

    fn sample_cv(kind: ArrivalKind, n: usize) -> (f64, f64) {
        let mut a = Arrivals::new(kind, 50.0, seeded(7)).unwrap();
        let g: Vec<f64> = (0..n).map(|_| a.next_gap()).collect();
        (cv(&g), mean(&g))
    }

    #[test]
    fn gamma_cv_19_over_100k() {
        let (c, m) = sample_cv(ArrivalKind::Gamma { cv: 1.9 }, 100_000);
        assert!((c - 1.9).abs() < 0.1, "cv {c}");
        assert!((m * 50.0 - 1.0).abs() < 0.05, "mean gap {m}");
    }

    #[test]
    fn poisson_cv_1_over_100k() {
        let (c, m) = sample_cv(ArrivalKind::Poisson, 100_000);
        assert!((c - 1.0).abs() < 0.03, "cv {c}");
        assert!((m * 50.0 - 1.0).abs() < 0.02, "mean gap {m}");
    }

    #[test]
    fn constant_and_times() {
        let a = Arrivals::new(ArrivalKind::Constant, 4.0, seeded(1)).unwrap();
        let t: Vec<f64> = a.take(3).collect();
        assert_eq!(t, vec![0.25, 0.5, 0.75]);
    }

    #[test]
    fn bootstrap_keeps_shape_and_hits_rate() {
        // A bursty source: alternating runs of short and long gaps.
        let mut rng = seeded(5);
        let src: Vec<f64> = (0..20_000)
            .map(|i| {
                let e: f64 = Exp1.sample(&mut rng);
                if (i / 50) % 2 == 0 {
                    e * 0.1
                } else {
                    e * 3.0
                }
            })
            .collect();
        let src_cv = cv(&src);
        let gaps: Arc<[f64]> = src.into();
        let (c, m) = sample_cv(
            ArrivalKind::Gaps {
                gaps: gaps.clone(),
                block: Some(64),
            },
            100_000,
        );
        assert!(
            (c / src_cv - 1.0).abs() < 0.10,
            "bootstrap cv {c} vs source {src_cv}"
        );
        assert!((m * 50.0 - 1.0).abs() < 0.1, "mean gap {m}");
        let (c2, m2) = sample_cv(ArrivalKind::Gaps { gaps, block: None }, 20_000);
        assert!((c2 - src_cv).abs() < 1e-9);
        assert!((m2 * 50.0 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn bad_inputs() {
        assert!(Arrivals::new(ArrivalKind::Poisson, 0.0, seeded(1)).is_err());
        assert!(Arrivals::new(ArrivalKind::Gamma { cv: -1.0 }, 1.0, seeded(1)).is_err());
        let one: Arc<[f64]> = vec![1.0].into();
        assert!(Arrivals::new(
            ArrivalKind::Gaps {
                gaps: one,
                block: None
            },
            1.0,
            seeded(1)
        )
        .is_err());
    }
}
