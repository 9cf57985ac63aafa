//! Latency histograms for `/metrics`: fixed Prometheus buckets of atomics, one set per
//! destination (labels `destination`, `url` and `policy` only: bounded by the fleet, never by
//! keys). Recording is a bucket search and three relaxed atomic adds.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds in seconds (`+Inf` is implicit): 5 ms to 10 min.
pub(crate) const BOUNDS_S: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 600.0,
];

/// One histogram: per-bucket counts (not cumulative), the sum in microseconds, the count.
#[derive(Debug, Default)]
pub(crate) struct Hist {
    buckets: [AtomicU64; BOUNDS_S.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Hist {
    pub fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BOUNDS_S.partition_point(|&b| b < s);
        // `i` ≤ BOUNDS_S.len(): the last bucket is past every bound.
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Relaxed);
        }
        self.sum_us.fetch_add(d.as_micros() as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Prometheus lines `{name}_bucket{labels,le=…}`, `_sum`, `_count`.
    pub fn write(&self, o: &mut String, name: &str, labels: &str) {
        let mut cum = 0u64;
        for (i, b) in self.buckets.iter().enumerate() {
            cum += b.load(Relaxed);
            let le = BOUNDS_S
                .get(i)
                .map_or("+Inf".to_string(), |x| x.to_string());
            let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{le}\"}} {cum}");
        }
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(o, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(o, "{name}_count{{{labels}}} {}", self.count.load(Relaxed));
    }

    /// Every count to zero (a destination slot given to another backend).
    pub fn reset(&self) {
        for b in self.buckets.iter().chain([&self.sum_us, &self.count]) {
            b.store(0, Relaxed);
        }
    }
}

/// A destination's three histograms.
#[derive(Debug, Default)]
pub(crate) struct Latencies {
    /// Request arrival (head read) → the destination's first body byte (completions only).
    pub ttft: Hist,
    /// Request arrival → the end of the response (completions only, failed ones included).
    pub e2e: Hist,
    /// Each attempt: sending to the destination → its response head and first body byte, or
    /// the attempt's failure (retried attempts included).
    pub upstream: Hist,
}

impl Latencies {
    pub fn reset(&self) {
        for h in [&self.ttft, &self.e2e, &self.upstream] {
            h.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounded_by_le() {
        let h = Hist::default();
        for ms in [1, 5, 7, 300, 700_000] {
            h.record(Duration::from_millis(ms));
        }
        let mut o = String::new();
        h.write(&mut o, "x", "a=\"1\"");
        assert!(o.contains("x_bucket{a=\"1\",le=\"0.005\"} 2\n"), "{o}");
        assert!(o.contains("x_bucket{a=\"1\",le=\"0.01\"} 3\n"), "{o}");
        assert!(o.contains("x_bucket{a=\"1\",le=\"0.5\"} 4\n"), "{o}");
        assert!(o.contains("x_bucket{a=\"1\",le=\"600\"} 4\n"), "{o}");
        assert!(o.contains("x_bucket{a=\"1\",le=\"+Inf\"} 5\n"), "{o}");
        assert!(o.contains("x_count{a=\"1\"} 5\n"), "{o}");
        assert!(o.contains("x_sum{a=\"1\"} 700.313\n"), "{o}");
    }
}
