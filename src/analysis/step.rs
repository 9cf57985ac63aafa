//! Per-step metrics (docs/analysis.md) from the request records of any backend. Pure: the
//! simulator, the live load generator and the store all feed [`RequestRecord`]s in.
//!
//! Rules (also in `docs/analysis.md`):
//! - A request belongs to the step when it was *scheduled* inside the window `[from_s, to_s)`.
//! - Latencies are measured from the scheduled send time (open loop, no coordinated omission)
//!   over completed (`ok`) requests, in HDR histograms ([`LatencyHist`]).
//! - `achieved_qps` is throughput: requests of any step (warm-up included) that completed
//!   successfully *inside* the window, per second of window. No drain allowance is added: in
//!   steady state the work in flight at the window's start (counted when it finishes inside)
//!   offsets the work in flight at its end (finishing after it), so a fleet that keeps up
//!   completes ≈ what arrives, and one that falls behind completes only what it can serve.
//!   The pass rule compares it with the in-window arrival rate (`analysis::capacity`), the same
//!   way on every backend: a request finishing after the window never counts, however late.
//! - Served KV hit, request and prefill imbalance are over completed requests (what the
//!   existing [`super::summarize`] does, so CLI summaries and step metrics agree).
//! - Fairness groups keys into ten key-rate deciles by rank (ascending rate, ties by key id):
//!   key of rank r among n keys is in decile ⌊10·r/n⌋. The key's rate is the one the caller's
//!   key → rate map gives it; when the map has no finite rate for it, the key's in-window
//!   arrival rate (requests / window) is used.

use std::collections::{BTreeMap, HashMap};

use super::latency::LatencyHist;
use super::max_over_mean;
use super::model::{Fairness, StepMetrics};
use crate::analysis::record::RequestRecord;

/// The measured window of a step: requests scheduled in `[from_s, to_s)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub from_s: f64,
    pub to_s: f64,
}

impl Window {
    pub fn len_s(&self) -> f64 {
        (self.to_s - self.from_s).max(1e-9)
    }
    pub fn contains(&self, t: f64) -> bool {
        t >= self.from_s && t < self.to_s
    }
}

/// Metrics of one ladder step over `destinations` destinations (destinations that served
/// nothing count as zero load). `key_rates` maps key hash → requests/s (e.g. from trace
/// statistics or the planner's meter; keys missing from it, or NaN, get their in-window rate).
/// `offered_qps` is the step's target rate, stored as is.
pub fn step_metrics(
    records: impl IntoIterator<Item = RequestRecord>,
    key_rates: &HashMap<u64, f64>,
    destinations: usize,
    window: Window,
    offered_qps: f64,
) -> StepMetrics {
    let (mut ttft, mut e2e, mut lag) = (LatencyHist::new(), LatencyHist::new(), LatencyHist::new());
    let mut req = vec![0.0f64; destinations];
    let mut prefill = vec![0.0f64; destinations];
    let (mut n, mut finished_inside, mut errors, mut completed) = (0u64, 0u64, 0u64, 0u64);
    let (mut prompt, mut cached, mut preemptions) = (0u64, 0u64, 0u64);
    let mut keys: HashMap<u64, KeyAcc> = HashMap::new();
    for o in records {
        let ok = o.status.is_ok();
        // Times absent on a completed request count as NaN, as a histogram sees them.
        let finish = o.finish_s.unwrap_or(f64::NAN);
        // Throughput counts every request that finished inside the window, members or not.
        if ok && window.contains(finish) {
            finished_inside += 1;
        }
        if !window.contains(o.scheduled_s) {
            continue;
        }
        n += 1;
        lag.record_s(o.schedule_lag_s().unwrap_or(0.0).max(0.0));
        preemptions += o.preemptions as u64;
        let k = keys.entry(o.key).or_insert_with(|| KeyAcc {
            rate: f64::NAN,
            arrivals: 0,
            e2e: Vec::new(),
        });
        k.arrivals += 1;
        if k.rate.is_nan() {
            if let Some(&r) = key_rates.get(&o.key).filter(|r| r.is_finite()) {
                k.rate = r;
            }
        }
        // Request imbalance counts what was routed, finished or not: an overloaded
        // destination that completes little must not look lightly loaded.
        let dest = o
            .destination
            .filter(|&d| d >= 0 && (d as usize) < destinations)
            .map(|d| d as usize);
        if let Some(d) = dest {
            req[d] += 1.0;
        }
        if !ok {
            errors += 1;
            continue;
        }
        completed += 1;
        let e = finish - o.scheduled_s;
        ttft.record_s(o.ttft_s());
        e2e.record_s(e);
        k.e2e.push(e);
        let cached_tokens = o.cached_tokens.unwrap_or(0);
        prompt += o.prompt_tokens as u64;
        cached += cached_tokens.min(o.prompt_tokens) as u64;
        if let Some(d) = dest {
            prefill[d] += o.prompt_tokens.saturating_sub(cached_tokens) as f64;
        }
    }
    let w = window.len_s();
    StepMetrics {
        offered_qps,
        achieved_qps: finished_inside as f64 / w,
        completed_qps: completed as f64 / w,
        requests: n,
        errors,
        ttft_p50_s: ttft.quantile_s(0.50),
        ttft_p99_s: ttft.quantile_s(0.99),
        e2e_p50_s: e2e.quantile_s(0.50),
        e2e_p99_s: e2e.quantile_s(0.99),
        served_kv_hit: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        imbalance_requests: max_over_mean(&req),
        imbalance_prefill_tokens: max_over_mean(&prefill),
        schedule_lag_p99_s: if n > 0 { lag.quantile_s(0.99) } else { 0.0 },
        preemptions,
        fairness: fairness(keys, w),
        window_s: w,
        cut: None,
        fleet_s: 0.0,
        wall_s: 0.0,
    }
}

struct KeyAcc {
    rate: f64,
    arrivals: u64,
    e2e: Vec<f64>,
}

fn fairness(keys: HashMap<u64, KeyAcc>, window_s: f64) -> Fairness {
    // Deterministic order: by rate, then key id.
    let mut ranked: Vec<(f64, u64, Vec<f64>)> = keys
        .into_iter()
        .map(|(id, k)| {
            let rate = if k.rate.is_finite() {
                k.rate
            } else {
                k.arrivals as f64 / window_s
            };
            (rate, id, k.e2e)
        })
        .collect();
    ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let n = ranked.len();
    let mut deciles: Vec<LatencyHist> = (0..10).map(|_| LatencyHist::new()).collect();
    let mut means = Vec::new();
    for (r, (_, _, e2e)) in ranked.iter().enumerate() {
        let d = rate_decile(r, n);
        for &e in e2e {
            deciles[d].record_s(e);
        }
        if !e2e.is_empty() {
            means.push(e2e.iter().sum::<f64>() / e2e.len() as f64);
        }
    }
    Fairness {
        e2e_p99_by_rate_decile_s: deciles.iter().map(|h| h.quantile_s(0.99)).collect(),
        jain_index: jain_index(&means),
    }
}

/// The decile (0 = lowest rate) of the key of 0-based rank `rank` (ascending rate) among `n`.
pub fn rate_decile(rank: usize, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    (rank * 10 / n).min(9)
}

/// Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one takes everything.
/// NaN for no values; 1 when all are zero.
pub fn jain_index(x: &[f64]) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    let s: f64 = x.iter().sum();
    let s2: f64 = x.iter().map(|v| v * v).sum();
    if s2 == 0.0 {
        return 1.0;
    }
    s * s / (x.len() as f64 * s2)
}

/// Request counts per key over records: a helper for building a key → rate map from a trace
/// or a whole run (`count / duration_s`).
pub fn key_rates_from_counts<I: IntoIterator<Item = u64>>(
    keys: I,
    duration_s: f64,
) -> HashMap<u64, f64> {
    let mut c: BTreeMap<u64, u64> = BTreeMap::new();
    for k in keys {
        *c.entry(k).or_default() += 1;
    }
    let d = duration_s.max(1e-9);
    c.into_iter().map(|(k, n)| (k, n as f64 / d)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::analysis::record::Status;

    /// A request of key `key` (whose rate is `rate`) and the rate, for [`metrics`].
    fn obs(key: u64, rate: f64, dest: i32, t: f64, e2e: f64, ok: bool) -> (RequestRecord, f64) {
        let r = RequestRecord {
            id: 0,
            key,
            destination: (dest >= 0).then_some(dest),
            scheduled_s: t,
            sent_s: None,
            first_token_s: Some(t + e2e / 4.0),
            finish_s: Some(t + e2e),
            prompt_tokens: 100,
            output_tokens: 1,
            cached_tokens: Some(40),
            preemptions: 0,
            retried: false,
            status: if ok { Status::Ok } else { Status::Failed },
        };
        (r, rate)
    }

    /// [`step_metrics`] over the requests, each key at the first finite rate given for it.
    fn metrics(v: Vec<(RequestRecord, f64)>, dests: usize, w: Window, qps: f64) -> StepMetrics {
        let mut rates = HashMap::new();
        for (r, rate) in &v {
            if rate.is_finite() {
                rates.entry(r.key).or_insert(*rate);
            }
        }
        step_metrics(v.into_iter().map(|(r, _)| r), &rates, dests, w, qps)
    }

    #[test]
    fn jain_index_by_hand() {
        assert_eq!(jain_index(&[1.0, 1.0, 1.0, 1.0]), 1.0);
        // one of four takes everything: 1/4
        assert_eq!(jain_index(&[4.0, 0.0, 0.0, 0.0]), 0.25);
        // (1+2+3)^2 / (3·(1+4+9)) = 36/42
        assert!((jain_index(&[1.0, 2.0, 3.0]) - 36.0 / 42.0).abs() < 1e-12);
        assert!(jain_index(&[]).is_nan());
    }

    #[test]
    fn deciles_by_rank() {
        // 10 keys: one per decile; 20 keys: two per decile; 5 keys: deciles 0,2,4,6,8.
        assert_eq!(
            (0..10).map(|r| rate_decile(r, 10)).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        assert_eq!(rate_decile(1, 20), 0);
        assert_eq!(rate_decile(2, 20), 1);
        assert_eq!(rate_decile(19, 20), 9);
        assert_eq!(
            (0..5).map(|r| rate_decile(r, 5)).collect::<Vec<_>>(),
            vec![0, 2, 4, 6, 8]
        );
    }

    #[test]
    fn fairness_puts_slow_hot_keys_in_the_top_decile() {
        // 10 keys with rates 1..=10; key k's requests take k seconds.
        let mut v = Vec::new();
        for k in 1..=10u64 {
            for i in 0..3 {
                v.push(obs(k, k as f64, 0, i as f64, k as f64, true));
            }
        }
        let m = metrics(
            v,
            1,
            Window {
                from_s: 0.0,
                to_s: 10.0,
            },
            3.0,
        );
        let d = &m.fairness.e2e_p99_by_rate_decile_s;
        assert_eq!(d.len(), 10);
        for (i, p) in d.iter().enumerate() {
            let want = (i + 1) as f64;
            assert!(*p >= want && *p <= want * 1.001, "decile {i}: {p}");
        }
        // means 1..=10: (55)^2 / (10 · 385)
        assert!((m.fairness.jain_index - 3025.0 / 3850.0).abs() < 1e-12);
    }

    #[test]
    fn missing_rates_fall_back_to_in_window_arrivals_and_empty_deciles_are_nan() {
        // key 1: 3 arrivals, key 2: 1 arrival → key 2 ranks lower.
        let v = vec![
            obs(1, f64::NAN, 0, 0.0, 5.0, true),
            obs(1, f64::NAN, 0, 1.0, 5.0, true),
            obs(1, f64::NAN, 0, 2.0, 5.0, true),
            obs(2, f64::NAN, 0, 3.0, 1.0, true),
        ];
        let m = metrics(
            v,
            1,
            Window {
                from_s: 0.0,
                to_s: 4.0,
            },
            1.0,
        );
        let d = &m.fairness.e2e_p99_by_rate_decile_s;
        assert!((d[0] - 1.0).abs() < 1e-3); // key 2 (rank 0 of 2)
        assert!((d[5] - 5.0).abs() < 5e-3); // key 1 (rank 1 of 2 → decile 5)
        assert!(d[1].is_nan() && d[9].is_nan());
    }

    #[test]
    fn step_counts_window_errors_hit_imbalance_lag_and_achieved_rate() {
        let mut v = vec![
            obs(1, 1.0, 0, 0.5, 1.0, true),
            obs(1, 1.0, 0, 1.0, 2.0, true),
            obs(2, 1.0, 1, 1.5, 1.0, false),
            obs(2, 1.0, 0, 9.0, 1.0, true), // outside
        ];
        // sent late: scheduled 1.9, sent at 2.1 → after the window end.
        let mut late = obs(3, 1.0, 1, 1.9, 1.0, true);
        late.0.sent_s = Some(late.0.scheduled_s + 0.2);
        v.push(late);
        let m = metrics(
            v,
            3,
            Window {
                from_s: 0.0,
                to_s: 2.0,
            },
            2.0,
        );
        assert_eq!((m.requests, m.errors), (4, 1));
        // Throughput: only the request finishing at 1.5 s completed inside the window (the
        // others finish at 3.0 and 2.9, or failed).
        assert_eq!(m.achieved_qps, 0.5);
        assert_eq!(m.completed_qps, 1.5);
        assert!((m.served_kv_hit - 0.4).abs() < 1e-12);
        // routed per destination, finished or not: [2, 2, 0] → max/mean = 2 / (4/3)
        assert!((m.imbalance_requests - 1.5).abs() < 1e-12);
        assert!((m.schedule_lag_p99_s - 0.2).abs() < 1e-3);
        assert!((m.e2e_p99_s - 2.0).abs() < 2e-3);
        assert_eq!(m.window_s, 2.0);
    }

    #[test]
    fn throughput_counts_completions_inside_the_window_whoever_sent_them() {
        // Before the window: one finishes inside it (counts), one before it (does not).
        // Members: one finishes inside, two long after the window's end (a fleet that fell
        // behind: they complete, but not within the window), one is not ok.
        let v = vec![
            obs(1, 1.0, 0, 8.0, 3.0, true),
            obs(1, 1.0, 0, 8.0, 1.0, true),
            obs(1, 1.0, 0, 10.0, 2.0, true),
            obs(1, 1.0, 0, 11.0, 30.0, true),
            obs(1, 1.0, 0, 12.0, 40.0, true),
            obs(1, 1.0, 0, 13.0, 1.0, false),
        ];
        let m = metrics(
            v,
            1,
            Window {
                from_s: 10.0,
                to_s: 20.0,
            },
            0.4,
        );
        assert_eq!(m.requests, 4);
        assert_eq!(m.achieved_qps, 0.2); // 2 completions inside 10 s
        assert_eq!(m.completed_qps, 0.3); // 3 members completed, whenever
    }

    #[test]
    fn sim_records_convert_with_rates() {
        let r = RequestRecord {
            id: 0,
            key: 7,
            destination: Some(2),
            scheduled_s: 1.0,
            sent_s: Some(1.0),
            first_token_s: Some(1.5),
            finish_s: Some(3.0),
            prompt_tokens: 10,
            output_tokens: 5,
            cached_tokens: Some(4),
            preemptions: 1,
            retried: false,
            status: Status::Ok,
        };
        let rates = key_rates_from_counts([7, 7, 9], 2.0);
        assert_eq!(rates[&7], 1.0);
        // A simulated request is sent on time: no schedule lag.
        assert!(r.status.is_ok() && r.schedule_lag_s() == Some(0.0));
        assert_eq!(r.e2e_s(), 2.0);
        let w = Window {
            from_s: 0.0,
            to_s: 4.0,
        };
        let m = step_metrics([r], &rates, 3, w, 1.0);
        assert_eq!((m.requests, m.errors, m.preemptions), (1, 0, 1));
        assert_eq!(m.schedule_lag_p99_s, 0.0);
    }
}
