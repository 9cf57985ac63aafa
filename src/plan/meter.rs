//! Per-key rate measurement for the control loop: count requests per key over a control
//! interval and turn the counts into rates, optionally smoothed across intervals (EWMA).
//! Used identically by the simulator (virtual time) and the live router (real time): the
//! caller says when an interval closes. Pure: no clock of its own.

use super::{KeyLoad, KeyMap};

/// Counts requests per key and yields [`KeyLoad`]s at the end of each control interval.
#[derive(Debug, Clone)]
pub struct RateMeter {
    counts: KeyMap<(u64, f64)>,
    /// Smoothed rates from previous intervals (key → (rate, prefix tokens)).
    smoothed: KeyMap<(f64, f64)>,
    /// Weight of the newest interval in the smoothed rate (1.0 = no smoothing).
    alpha: f64,
    /// Keys whose smoothed rate falls below this are forgotten (bounded memory).
    min_rate: f64,
}

impl RateMeter {
    /// `alpha` in (0, 1]: 1.0 uses only the last interval.
    pub fn new(alpha: f64) -> Self {
        Self {
            counts: KeyMap::default(),
            smoothed: KeyMap::default(),
            alpha: alpha.clamp(1e-6, 1.0),
            min_rate: 1e-9,
        }
    }

    /// Start the smoothed rates from known rates (the rates a control loop's first plan was
    /// built from: a warm start, or a plan installed at start-up), replacing any smoothed
    /// state. Without a seed the EWMA starts at zero and, with weight α on the newest
    /// interval, reports only 1 − (1 − α)ⁿ of a stationary rate after n intervals (0.5, 0.75,
    /// 0.875, … for α = 0.5), so the plans that follow under-replicate. Seeding, rather than
    /// dividing by 1 − (1 − α)ⁿ, keeps the smoothing of the first intervals (a bias-corrected
    /// first interval is the raw, noisy count) and gives keys that were known before any
    /// request was counted their rate. Has no lasting effect with α = 1 (no smoothing).
    pub fn seed(&mut self, rates: &[KeyLoad]) {
        self.smoothed.clear();
        self.smoothed.reserve(rates.len());
        for k in rates {
            if k.rate.is_finite() && k.rate > self.min_rate {
                self.smoothed.insert(k.key, (k.rate, k.prefix_tokens));
            }
        }
    }

    /// Record one request for `key` with `prefix_tokens` reusable prefix tokens.
    #[inline]
    pub fn record(&mut self, key: u64, prefix_tokens: u32) {
        let e = self.counts.entry(key).or_insert((0, 0.0));
        e.0 += 1;
        // Running mean of the prefix size seen for this key.
        e.1 += (prefix_tokens as f64 - e.1) / e.0 as f64;
    }

    /// Number of keys seen in the open interval.
    pub fn keys_in_interval(&self) -> usize {
        self.counts.len()
    }

    /// Close an interval of `interval_s` seconds and return the rates to plan with.
    pub fn close_interval(&mut self, interval_s: f64) -> Vec<KeyLoad> {
        let interval_s = interval_s.max(1e-9);
        let a = self.alpha;
        if a >= 1.0 {
            self.smoothed.clear();
        } else {
            for v in self.smoothed.values_mut() {
                v.0 *= 1.0 - a;
            }
        }
        for (&k, &(n, p)) in self.counts.iter() {
            let r = n as f64 / interval_s;
            let e = self.smoothed.entry(k).or_insert((0.0, p));
            e.0 += a * r;
            e.1 = p;
        }
        self.counts.clear();
        let min = self.min_rate;
        self.smoothed.retain(|_, v| v.0 > min);
        let mut out: Vec<KeyLoad> = self
            .smoothed
            .iter()
            .map(|(&key, &(rate, p))| KeyLoad {
                key,
                rate,
                prefix_tokens: p,
            })
            .collect();
        // Deterministic order regardless of hash-map iteration.
        out.sort_unstable_by_key(|k| k.key);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_from_counts() {
        let mut m = RateMeter::new(1.0);
        for _ in 0..10 {
            m.record(1, 100);
        }
        m.record(2, 50);
        let r = m.close_interval(5.0);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].key, 1);
        assert!((r[0].rate - 2.0).abs() < 1e-12);
        assert!((r[1].rate - 0.2).abs() < 1e-12);
        assert_eq!(r[0].prefix_tokens, 100.0);
        // Nothing in the next interval: without smoothing, rates drop to zero and are dropped.
        assert!(m.close_interval(5.0).is_empty());
    }

    /// A stationary count stream after a seed from the true rates: every interval's smoothed
    /// rate stays at the true rate (unseeded, it climbs 0.5, 0.75, 0.875, … of it).
    #[test]
    fn seeded_rates_stay_at_the_true_rate() {
        let truth = [(1u64, 4.0), (2, 0.5), (3, 12.0)];
        let seed: Vec<KeyLoad> = truth
            .iter()
            .map(|&(key, rate)| KeyLoad {
                key,
                rate,
                prefix_tokens: 100.0,
            })
            .collect();
        let mut m = RateMeter::new(0.5);
        m.seed(&seed);
        let interval = 10.0;
        for _ in 0..6 {
            for &(key, rate) in &truth {
                for _ in 0..(rate * interval) as usize {
                    m.record(key, 100);
                }
            }
            let r = m.close_interval(interval);
            assert_eq!(r.len(), truth.len());
            for (got, &(key, rate)) in r.iter().zip(&truth) {
                assert_eq!(got.key, key);
                assert!(
                    (got.rate - rate).abs() < 1e-9,
                    "key {key}: {} req/s, true {rate}",
                    got.rate
                );
                assert_eq!(got.prefix_tokens, 100.0);
            }
        }
    }

    #[test]
    fn ewma_smooths() {
        let mut m = RateMeter::new(0.5);
        for _ in 0..10 {
            m.record(7, 0);
        }
        let r1 = m.close_interval(1.0);
        assert!((r1[0].rate - 5.0).abs() < 1e-12);
        let r2 = m.close_interval(1.0);
        assert!((r2[0].rate - 2.5).abs() < 1e-12);
    }
}
