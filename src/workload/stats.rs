//! Trace statistics (`cacheroute trace stats`): size, rate, key skew, burstiness, lengths, and
//! the reuse diagnostic — the fraction of requests and of prompt tokens whose prefix blocks
//! were seen within the last T seconds, overall (one shared cache) and as one of R
//! destinations sees it under cache-blind spreading (each request lands on a uniformly random
//! destination, so a key's revisit time at one destination is ≈ R/λ_b, the review's Eq. 1).
//!
//! Streams: one pass over any iterator of records, memory O(keys + blocks seen within the
//! largest window). Pure: the spreading assignment uses a seeded RNG.

use super::rates::{gini, top_share};
use super::trace::TraceRecord;
use crate::rng::seeded;
use crate::rng::IdHasher;
use rand::RngExt;
use serde::Serialize;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// Options for [`compute`].
#[derive(Debug, Clone)]
pub struct StatsOptions {
    /// Reuse windows T in seconds.
    pub windows_s: Vec<f64>,
    /// Destinations R for the spreading view.
    pub destinations: u32,
    /// Tokens per block; `None` infers it from the first records (next power of two of the
    /// largest `ceil(input_length / blocks)`).
    pub block_size: Option<u32>,
    /// Seed of the spreading assignment.
    pub seed: u64,
}

impl Default for StatsOptions {
    fn default() -> Self {
        StatsOptions {
            windows_s: vec![1.0, 10.0, 60.0, 300.0, 1800.0],
            destinations: 30,
            block_size: None,
            seed: 1,
        }
    }
}

/// Percentiles of a length distribution.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// One row of the reuse diagnostic.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReuseRow {
    pub window_s: f64,
    /// Requests whose first block was seen within the window (shared cache).
    pub requests: f64,
    /// Prompt tokens in leading blocks seen within the window (shared cache).
    pub tokens: f64,
    /// The same, with one cache per destination under cache-blind spreading over R.
    pub spread_requests: f64,
    pub spread_tokens: f64,
}

/// The figures of `trace stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TraceStats {
    pub requests: u64,
    pub duration_s: f64,
    pub mean_qps: f64,
    pub distinct_keys: u64,
    /// Gini of per-key request counts (observed keys only).
    pub gini: f64,
    pub top1pct_share: f64,
    pub top4pct_share: f64,
    pub largest_key_share: f64,
    pub interarrival_cv: f64,
    pub input_length: Percentiles,
    pub output_length: Percentiles,
    pub block_size: u32,
    pub destinations: u32,
    pub reuse: Vec<ReuseRow>,
    /// Requests per observed key (no order; not serialized): what per-key rates and revisit
    /// times are computed from (`analysis::advise`).
    #[serde(skip_serializing)]
    pub key_counts: Vec<u64>,
}

type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Last-seen times of blocks: an open-addressing table (linear probing, 16 bytes a slot) keyed
/// by the block id, where an empty slot reads as "never seen" (−∞). When it fills up it is
/// rebuilt with only the entries seen within the largest window (`horizon`): an older entry
/// can never again count as a hit (every later cutoff `t − T` is at or after `now − horizon`),
/// so expiring it changes no result, and memory is bounded by the blocks seen within the
/// largest window rather than by every block ever seen.
struct Seen {
    slots: Vec<(u64, f64)>,
    len: usize,
    shift: u32,
    horizon: f64,
}

const EMPTY: f64 = f64::NEG_INFINITY;
const MIN_SLOTS: usize = 16;

impl Seen {
    fn new(horizon: f64) -> Self {
        Seen {
            slots: vec![(0, EMPTY); MIN_SLOTS],
            len: 0,
            shift: 64 - MIN_SLOTS.trailing_zeros(),
            horizon,
        }
    }

    #[inline]
    fn home(&self, id: u64) -> usize {
        // Fibonacci hashing: spreads small sequential ids (Mooncake) as well as random ones.
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Rebuild, keeping the entries still within the horizon at `now`, at most half full
    /// after `extra` more.
    fn rebuild(&mut self, now: f64, extra: usize) {
        let cut = now - self.horizon;
        let live = self
            .slots
            .iter()
            .filter(|e| e.1 != EMPTY && e.1 >= cut)
            .count();
        let cap = (2 * (live + extra)).next_power_of_two().max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![(0, EMPTY); cap]);
        self.shift = 64 - cap.trailing_zeros();
        self.len = 0;
        let mask = cap - 1;
        for (id, t) in old {
            if t != EMPTY && t >= cut {
                let mut i = self.home(id);
                while self.slots[i].1 != EMPTY {
                    i = (i + 1) & mask;
                }
                self.slots[i] = (id, t);
                self.len += 1;
            }
        }
    }

    /// For one request at `now` (s): the leading-run minimum of previous last-seen times per
    /// block (into `prev_min`), then mark all blocks seen now.
    fn visit(&mut self, ids: &[u64], now: f64, prev_min: &mut Vec<f64>) {
        // At most 3/4 full after this request.
        if 4 * (self.len + ids.len()) > 3 * self.slots.len() {
            self.rebuild(now, ids.len());
        }
        // Touch every home slot first: independent loads the CPU overlaps, so the cache misses
        // of a long chain are paid together rather than one after another.
        let mut touch = 0u64;
        for &id in ids {
            touch ^= self.slots[self.home(id)].0;
        }
        std::hint::black_box(touch);
        prev_min.clear();
        let mask = self.slots.len() - 1;
        let mut run = f64::INFINITY;
        for &id in ids {
            let mut i = self.home(id);
            loop {
                let e = &mut self.slots[i];
                if e.1 == EMPTY {
                    *e = (id, now);
                    self.len += 1;
                    run = run.min(EMPTY);
                    break;
                }
                if e.0 == id {
                    run = run.min(e.1);
                    e.1 = now;
                    break;
                }
                i = (i + 1) & mask;
            }
            prev_min.push(run);
        }
    }
}

fn percentiles(v: &mut [u32]) -> Percentiles {
    if v.is_empty() {
        return Percentiles {
            mean: 0.0,
            p50: 0.0,
            p90: 0.0,
            p99: 0.0,
            max: 0.0,
        };
    }
    v.sort_unstable();
    let q = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize] as f64;
    Percentiles {
        mean: v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64,
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        max: *v.last().unwrap() as f64,
    }
}

/// Infer tokens per block from records (see [`StatsOptions::block_size`]).
pub fn infer_block_size<'a>(records: impl Iterator<Item = &'a TraceRecord>) -> u32 {
    let m = records
        .filter(|r| !r.hash_ids.is_empty())
        .map(|r| r.input_length.div_ceil(r.hash_ids.len() as u32))
        .max()
        .unwrap_or(16);
    m.max(1).next_power_of_two()
}

/// Per-key request counts from records (for tests and callers that want them).
struct Acc {
    opts: StatsOptions,
    block: u32,
    horizon: f64,
    requests: u64,
    first_ts: f64,
    last_ts: f64,
    counts: IdMap<String, u64>,
    gap_n: u64,
    gap_mean: f64,
    gap_m2: f64,
    inputs: Vec<u32>,
    outputs: Vec<u32>,
    overall: Seen,
    spread: Vec<Seen>,
    rng: crate::rng::Rng64,
    hit_req: Vec<u64>,
    hit_tok: Vec<f64>,
    sp_req: Vec<u64>,
    sp_tok: Vec<f64>,
    total_tok: f64,
    scratch: Vec<f64>,
}

impl Acc {
    fn new(opts: StatsOptions, block: u32) -> Self {
        let w = opts.windows_s.len();
        let horizon = opts.windows_s.iter().cloned().fold(0.0, f64::max);
        Acc {
            rng: seeded(opts.seed),
            opts,
            block,
            horizon,
            requests: 0,
            first_ts: 0.0,
            last_ts: 0.0,
            counts: IdMap::default(),
            gap_n: 0,
            gap_mean: 0.0,
            gap_m2: 0.0,
            inputs: Vec::new(),
            outputs: Vec::new(),
            overall: Seen::new(horizon),
            spread: Vec::new(),
            hit_req: vec![0; w],
            hit_tok: vec![0.0; w],
            sp_req: vec![0; w],
            sp_tok: vec![0.0; w],
            total_tok: 0.0,
            scratch: Vec::new(),
        }
    }

    fn add(&mut self, r: &TraceRecord) {
        let t = r.timestamp_ms / 1000.0;
        if self.requests == 0 {
            self.first_ts = t;
        } else {
            let g = t - self.last_ts;
            self.gap_n += 1;
            let d = g - self.gap_mean;
            self.gap_mean += d / self.gap_n as f64;
            self.gap_m2 += d * (g - self.gap_mean);
        }
        self.last_ts = t;
        self.requests += 1;
        if let Some(c) = self.counts.get_mut(r.key.as_str()) {
            *c += 1;
        } else {
            self.counts.insert(r.key.clone(), 1);
        }
        self.inputs.push(r.input_length);
        self.outputs.push(r.output_length);
        self.total_tok += r.input_length as f64;
        let ids = &r.hash_ids;
        let block = self.block;
        let input = r.input_length;
        let tokens_of = |n: usize| ((n as u64 * block as u64).min(input as u64)) as f64;
        if self.opts.windows_s.is_empty() {
            // No reuse window: the block tables would count nothing (and cost most of the time).
            return;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        // Destination 0 of the spreading view is drawn for every request, as before, so the
        // assignment (and every figure) is unchanged by how the tables are laid out.
        let dest = self.rng.random_range(0..self.opts.destinations.max(1)) as usize;
        if self.spread.len() <= dest {
            let horizon = self.horizon;
            self.spread.resize_with(dest + 1, || Seen::new(horizon));
        }
        for view in 0..2 {
            let (map, hit_req, hit_tok) = if view == 0 {
                (&mut self.overall, &mut self.hit_req, &mut self.hit_tok)
            } else {
                (&mut self.spread[dest], &mut self.sp_req, &mut self.sp_tok)
            };
            map.visit(ids, t, &mut scratch);
            for (wi, &w) in self.opts.windows_s.iter().enumerate() {
                let cut = t - w;
                // prev_min is non-increasing: count the leading blocks seen at or after `cut`.
                let n = scratch.partition_point(|&s| s >= cut);
                if n > 0 {
                    hit_req[wi] += 1;
                    hit_tok[wi] += tokens_of(n);
                }
            }
        }
        self.scratch = scratch;
    }

    fn finish(mut self) -> TraceStats {
        let n = self.requests.max(1) as f64;
        let key_counts: Vec<u64> = self.counts.values().copied().collect();
        let counts: Vec<f64> = key_counts.iter().map(|&c| c as f64).collect();
        let duration = self.last_ts - self.first_ts;
        let gap_sd = if self.gap_n > 1 {
            (self.gap_m2 / (self.gap_n - 1) as f64).sqrt()
        } else {
            0.0
        };
        let tok = self.total_tok.max(1.0);
        let reuse = self
            .opts
            .windows_s
            .iter()
            .enumerate()
            .map(|(i, &w)| ReuseRow {
                window_s: w,
                requests: self.hit_req[i] as f64 / n,
                tokens: self.hit_tok[i] / tok,
                spread_requests: self.sp_req[i] as f64 / n,
                spread_tokens: self.sp_tok[i] / tok,
            })
            .collect();
        let _ = self.horizon;
        TraceStats {
            requests: self.requests,
            duration_s: duration,
            mean_qps: if duration > 0.0 {
                self.requests as f64 / duration
            } else {
                0.0
            },
            distinct_keys: counts.len() as u64,
            gini: gini(&counts),
            top1pct_share: top_share(&counts, 0.01),
            top4pct_share: top_share(&counts, 0.04),
            largest_key_share: counts.iter().cloned().fold(0.0, f64::max) / n,
            interarrival_cv: if self.gap_mean > 0.0 {
                gap_sd / self.gap_mean
            } else {
                0.0
            },
            input_length: percentiles(&mut self.inputs),
            output_length: percentiles(&mut self.outputs),
            block_size: self.block,
            destinations: self.opts.destinations,
            reuse,
            key_counts,
        }
    }
}

/// A statistics accumulator over records in timestamp order ([`compute`] runs one over a whole
/// stream). Consecutive parts of a trace can be read in parallel, each into its own
/// accumulator, and joined in order with [`StatsAcc::join`]; the result is the whole trace's
/// (up to floating-point rounding of the inter-arrival moments). Only without reuse windows:
/// the block tables of consecutive parts cannot be joined.
pub struct StatsAcc(Acc);

impl StatsAcc {
    /// An accumulator with these options and tokens per block. Panics if `opts` asks for reuse
    /// windows.
    pub fn new(opts: StatsOptions, block: u32) -> Self {
        assert!(
            opts.windows_s.is_empty(),
            "StatsAcc: reuse windows cannot be joined across parts"
        );
        StatsAcc(Acc::new(opts, block.max(1)))
    }

    /// Count one record (after every earlier one of this part).
    pub fn add(&mut self, r: &TraceRecord) {
        self.0.add(r)
    }

    /// Append the statistics of the part that follows this one in the trace.
    pub fn join(&mut self, next: StatsAcc) {
        let a = &mut self.0;
        let b = next.0;
        if b.requests == 0 {
            return;
        }
        if a.requests == 0 {
            *a = b;
            return;
        }
        // Inter-arrival gaps: a's, the one across the boundary, b's (Chan et al.'s pairwise
        // update of the mean and the sum of squared deviations).
        let mut merge = |n: u64, mean: f64, m2: f64| {
            if n == 0 {
                return;
            }
            let total = a.gap_n + n;
            let d = mean - a.gap_mean;
            a.gap_mean += d * n as f64 / total as f64;
            a.gap_m2 += m2 + d * d * a.gap_n as f64 * n as f64 / total as f64;
            a.gap_n = total;
        };
        merge(1, b.first_ts - a.last_ts, 0.0);
        merge(b.gap_n, b.gap_mean, b.gap_m2);
        a.last_ts = b.last_ts;
        a.requests += b.requests;
        for (k, c) in b.counts {
            *a.counts.entry(k).or_default() += c;
        }
        a.inputs.extend(b.inputs);
        a.outputs.extend(b.outputs);
        a.total_tok += b.total_tok;
    }

    /// The statistics.
    pub fn finish(self) -> TraceStats {
        self.0.finish()
    }
}

/// Compute the statistics of a stream of records. Stops at the first error and returns it.
pub fn compute<I, E>(records: I, opts: &StatsOptions) -> Result<TraceStats, E>
where
    I: IntoIterator<Item = Result<TraceRecord, E>>,
{
    let mut it = records.into_iter();
    // Buffer a head of records to infer the block size when it is not given.
    let mut head = Vec::new();
    let block = match opts.block_size {
        Some(b) => b.max(1),
        None => {
            for r in it.by_ref().take(4096) {
                head.push(r?);
            }
            infer_block_size(head.iter())
        }
    };
    let mut acc = Acc::new(opts.clone(), block);
    for r in &head {
        acc.add(r);
    }
    drop(head);
    for r in it {
        acc.add(&r?);
    }
    Ok(acc.finish())
}

/// Statistics of in-memory records (infallible convenience).
pub fn compute_records<'a>(
    records: impl IntoIterator<Item = &'a TraceRecord>,
    opts: &StatsOptions,
) -> TraceStats {
    let it = records
        .into_iter()
        .map(|r| Ok::<_, std::convert::Infallible>(r.clone()));
    match compute(it, opts) {
        Ok(s) => s,
        Err(e) => match e {},
    }
}

/// Key-skew figures of a rate vector (e.g. the generator's expected rates).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SkewStats {
    pub keys: u64,
    pub gini: f64,
    pub top1pct_share: f64,
    pub top4pct_share: f64,
    pub largest_key_share: f64,
}

/// Skew of expected per-key rates.
pub fn skew_of_rates(rates: &[f64]) -> SkewStats {
    let sum: f64 = rates.iter().sum();
    SkewStats {
        keys: rates.len() as u64,
        gini: gini(rates),
        top1pct_share: top_share(rates, 0.01),
        top4pct_share: top_share(rates, 0.04),
        largest_key_share: if sum > 0.0 {
            rates.iter().cloned().fold(0.0, f64::max) / sum
        } else {
            0.0
        },
    }
}

/// Render the statistics as a table for people.
pub fn render(s: &TraceStats) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let pct = |x: f64| format!("{:.1}%", x * 100.0);
    let _ = writeln!(o, "requests             {}", s.requests);
    let _ = writeln!(o, "duration             {:.1} s", s.duration_s);
    let _ = writeln!(o, "mean QPS             {:.3}", s.mean_qps);
    let _ = writeln!(o, "distinct keys        {}", s.distinct_keys);
    let _ = writeln!(o, "gini (req counts)    {:.3}", s.gini);
    let _ = writeln!(o, "top-1% keys share    {}", pct(s.top1pct_share));
    let _ = writeln!(o, "top-4% keys share    {}", pct(s.top4pct_share));
    let _ = writeln!(
        o,
        "largest key share    {:.3}%",
        s.largest_key_share * 100.0
    );
    let _ = writeln!(o, "inter-arrival CV     {:.3}", s.interarrival_cv);
    for (name, p) in [
        ("input tokens", &s.input_length),
        ("output tokens", &s.output_length),
    ] {
        let _ = writeln!(
            o,
            "{name:<20} mean {:.0}  p50 {:.0}  p90 {:.0}  p99 {:.0}  max {:.0}",
            p.mean, p.p50, p.p90, p.p99, p.max
        );
    }
    let _ = writeln!(
        o,
        "\nreuse: prefix blocks seen within the last T s (block {} tokens; spread = one of R = {} destinations, cache-blind)",
        s.block_size, s.destinations
    );
    let _ = writeln!(
        o,
        "| T (s) | requests | prompt tokens | spread requests | spread tokens |"
    );
    let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: |");
    for r in &s.reuse {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} |",
            r.window_s,
            pct(r.requests),
            pct(r.tokens),
            pct(r.spread_requests),
            pct(r.spread_tokens)
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::gen::{GeneratorConfig, Workload, PAPER_KEYS};

    fn rec(t: f64, key: &str, ids: &[u64], input: u32) -> TraceRecord {
        TraceRecord {
            timestamp_ms: t * 1000.0,
            key: key.into(),
            input_length: input,
            output_length: 1,
            hash_ids: ids.to_vec(),
            session: None,
            turn: None,
        }
    }

    #[test]
    fn reuse_windows_and_spreading() {
        let recs = vec![
            rec(0.0, "a", &[1, 2, 3], 48),
            rec(5.0, "a", &[1, 2, 4], 48), // 2 blocks seen 5 s ago
            rec(100.0, "b", &[1, 9], 20),  // block 1 seen 95 s ago
            rec(101.0, "c", &[7], 10),     // new
        ];
        let opts = StatsOptions {
            windows_s: vec![1.0, 10.0, 1000.0],
            destinations: 1,
            block_size: Some(16),
            seed: 1,
        };
        let s = compute_records(&recs, &opts);
        assert_eq!(s.requests, 4);
        assert_eq!(s.distinct_keys, 3);
        assert_eq!(s.duration_s, 101.0);
        assert_eq!(s.reuse[0].requests, 0.0);
        assert_eq!(s.reuse[1].requests, 0.25);
        assert!((s.reuse[1].tokens - 32.0 / 126.0).abs() < 1e-12);
        assert_eq!(s.reuse[2].requests, 0.5);
        assert!((s.reuse[2].tokens - 48.0 / 126.0).abs() < 1e-12);
        // One destination: spreading sees exactly what the shared cache sees.
        assert_eq!(s.reuse[2].spread_tokens, s.reuse[2].tokens);
        let many = StatsOptions {
            destinations: 1000,
            ..opts
        };
        let s2 = compute_records(&recs, &many);
        assert!(s2.reuse[2].spread_requests <= s2.reuse[2].requests);
        assert_eq!(infer_block_size(recs.iter()), 16);
    }

    #[test]
    fn key_counts_and_no_windows() {
        let recs = vec![
            rec(0.0, "a", &[1, 2], 32),
            rec(1.0, "a", &[1, 2], 32),
            rec(2.0, "b", &[3], 16),
        ];
        let opts = StatsOptions {
            windows_s: vec![],
            destinations: 2,
            block_size: Some(16),
            seed: 1,
        };
        let s = compute_records(&recs, &opts);
        let mut c = s.key_counts.clone();
        c.sort();
        assert_eq!(c, vec![1, 2]);
        assert!(s.reuse.is_empty());
        // Everything but the reuse rows is what a run with windows computes.
        let with = compute_records(
            &recs,
            &StatsOptions {
                windows_s: vec![10.0],
                ..opts
            },
        );
        assert_eq!(with.reuse[0].requests, 1.0 / 3.0);
        assert_eq!(
            TraceStats {
                reuse: vec![],
                ..with.clone()
            },
            s
        );
        // Per-key counts are not part of the JSON of `trace stats`.
        assert!(serde_json::to_value(&with)
            .unwrap()
            .get("key_counts")
            .is_none());
    }

    #[test]
    fn parts_joined_are_the_whole() {
        let recs: Vec<TraceRecord> = (0..200)
            .map(|i| {
                let t = (i * i % 97) as f64 + i as f64 * 3.0;
                rec(t, &format!("k{}", i % 7), &[i as u64], 16 + i as u32)
            })
            .collect();
        let opts = StatsOptions {
            windows_s: vec![],
            destinations: 4,
            block_size: Some(16),
            seed: 1,
        };
        let whole = compute_records(&recs, &opts);
        for cut in [0, 1, 77, 199, 200] {
            let mut a = StatsAcc::new(opts.clone(), 16);
            let mut b = StatsAcc::new(opts.clone(), 16);
            recs[..cut].iter().for_each(|r| a.add(r));
            recs[cut..].iter().for_each(|r| b.add(r));
            a.join(b);
            let j = a.finish();
            assert!(
                (j.interarrival_cv - whole.interarrival_cv).abs() < 1e-12,
                "{cut}"
            );
            let mut jc = j.key_counts.clone();
            let mut wc = whole.key_counts.clone();
            jc.sort();
            wc.sort();
            assert_eq!(jc, wc);
            assert_eq!(
                TraceStats {
                    interarrival_cv: 0.0,
                    key_counts: vec![],
                    ..j
                },
                TraceStats {
                    interarrival_cv: 0.0,
                    key_counts: vec![],
                    ..whole.clone()
                },
                "{cut}"
            );
        }
    }

    /// The paper workload: 128,824 keys. Two figures, both checked:
    /// - the generator's expected per-key rates (what the planner sees), and
    /// - per-key request counts in a generated trace. Counts carry Poisson noise that inflates
    ///   the Gini of the sparse tail, and keys that drew no request are invisible to a trace,
    ///   which deflates it: with 4.5M requests (~35 per key) 11k keys are unseen and the count
    ///   Gini is 0.737; with 13M (~100 per key) it is 0.750, within 0.01 of the rate figure.
    #[test]
    fn paper_workload_skew() {
        let w = Workload::from_config(GeneratorConfig::paper()).unwrap();
        let rates: Vec<f64> = w.expected_rates(100.0, 1).iter().map(|r| r.rate).collect();
        let e = skew_of_rates(&rates);
        assert_eq!(e.keys, PAPER_KEYS as u64);
        assert!(
            (e.gini - 0.756).abs() < 0.01,
            "expected-rate gini {}",
            e.gini
        );
        assert!(
            (0.44..=0.49).contains(&e.top4pct_share),
            "{}",
            e.top4pct_share
        );
        assert!(e.largest_key_share <= 0.003, "{}", e.largest_key_share);

        // Counts: sample keys exactly as the generator does (alias table over the same
        // weights), without building prefix chains, to keep the debug-build test fast.
        let weights = w.key_weights(1);
        let alias = crate::rng::Alias::new(&weights);
        let mut rng = crate::rng::derive(1, "workload/keys");
        let mut counts = vec![0f64; weights.len()];
        let n = 13_000_000;
        for _ in 0..n {
            counts[alias.sample(&mut rng)] += 1.0;
        }
        let observed: Vec<f64> = counts.into_iter().filter(|&c| c > 0.0).collect();
        let c = skew_of_rates(&observed);
        assert!((c.gini - 0.756).abs() < 0.01, "count gini {}", c.gini);
        assert!(
            (0.44..=0.49).contains(&c.top4pct_share),
            "{}",
            c.top4pct_share
        );
        assert!(c.largest_key_share <= 0.003, "{}", c.largest_key_share);
    }
}
