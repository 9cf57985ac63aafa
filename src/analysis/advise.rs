//! `cacheroute advise`, the pure part: the reuse diagnostic of a workload on a fleet (cache
//! residence time, revisit times, how much prefix reuse affinity could recover), the verdict
//! rule (win / tie / lose of affinity and of CacheRoute against Flat-LB and against the best
//! reactive baseline, from a small paired-seed study's [`StudySummary`]), and the sentence of
//! workload facts that drive it. Formulas and the rule: `docs/advise.md`.
//!
//! Pure: figures in, figures out; the trace statistics come from `workload::stats` (computed
//! once, there) and the engine figures from the engine model. No I/O, no clock, no randomness.
//! Nothing here knows about the CLI or the study runner.

use serde::Serialize;

use super::capacity::RatioStats;
use super::model::{Censoring, SeedStats, Slo};
use super::study::{ArmSummary, CapacityStats, StudySummary};
use crate::engine::EngineConfig;
use crate::workload::stats::TraceStats;

/// Policy labels of the affinity family (a key has one fixed home on a hash ring).
pub const AFFINITY: [&str; 2] = ["sticky", "chwbl"];
/// Policy labels of the reactive family (each request decided from the fleet's live state;
/// no fixed home, no plan).
pub const REACTIVE: [&str; 3] = ["flat-lb", "dualmap", "preble"];
/// The cache-blind baseline.
pub const FLAT_LB: &str = "flat-lb";
/// The planned policy.
pub const CACHEROUTE: &str = "cacheroute";

/// Below this gap between reuse within the residence time and reuse under spreading (share of
/// prompt tokens), a workload has "little reuse for affinity to recover".
pub const SMALL_GAP: f64 = 0.05;
/// Below this prefill share of a request's service time, cache hits "save little".
pub const SMALL_PREFILL_SHARE: f64 = 0.25;
/// Above this inter-arrival coefficient of variation, arrivals are called bursty.
pub const BURSTY_CV: f64 = 2.0;

/// Cache residence time of one replica: how long an unreferenced prefix block survives in its
/// KV cache under LRU at this load, `T_res = C / ((λ/R) · (p̄ + ō))` seconds — the time until
/// `C` tokens of new KV (every prompt token prefilled and every output token decoded, as if
/// nothing hit) have been written after it. `C` = KV capacity of one replica in tokens, `λ/R` =
/// requests per second per replica, `p̄` / `ō` = mean prompt / output tokens. Hits write
/// nothing new, so with a hit rate the real residence is longer; KV held by running requests
/// is not evictable, which makes it shorter. Infinite when nothing is written.
pub fn residence_time_s(
    kv_tokens_per_replica: f64,
    load_qps: f64,
    replicas: usize,
    mean_prompt: f64,
    mean_output: f64,
) -> f64 {
    let inflow = load_qps / replicas.max(1) as f64 * (mean_prompt + mean_output).max(0.0);
    if inflow > 0.0 {
        kv_tokens_per_replica / inflow
    } else {
        f64::INFINITY
    }
}

/// Share of one replica's busy time a mean request spends in prefill when nothing is cached:
/// `t_prefill(p̄) / (t_prefill(p̄) + ō · t_decode)`, with the engine model's prefill time of a
/// `p̄`-token prompt and its per-token decode time at a batch of `min(max_num_seqs, 64)` mean
/// requests (the batch `policy::calibrate::estimate_q_cap` uses). Cache hits can only save
/// prefill, so this bounds what they can buy.
pub fn prefill_share(engine: &EngineConfig, mean_prompt: f64, mean_output: f64) -> f64 {
    let p = mean_prompt.max(1.0);
    let b = engine.knobs().max_num_seqs.clamp(1, 64);
    let ctx = (b as f64 * (p + mean_output / 2.0)) as u64;
    let prefill = engine.prefill_time(p.min(u32::MAX as f64) as u32, 0);
    let decode = mean_output.max(0.0) * engine.decode_step_time(b, ctx) / b as f64;
    prefill / (prefill + decode).max(f64::MIN_POSITIVE)
}

/// Service time of a long request on a busy replica: prefill of a `p99_prompt`-token prompt
/// plus `p99_output` decode steps at a batch of `min(max_num_seqs, 64)` mean requests. A
/// simulated step must warm up for longer than this (twice, in `experiment::advise`) before its
/// measured window, or the requests in flight have not reached steady state and the
/// achieved-rate rule fails for want of completions.
pub fn long_request_s(
    engine: &EngineConfig,
    p99_prompt: f64,
    p99_output: f64,
    mean_prompt: f64,
    mean_output: f64,
) -> f64 {
    let b = engine.knobs().max_num_seqs.clamp(1, 64);
    let ctx = (b as f64 * (mean_prompt.max(1.0) + mean_output.max(0.0) / 2.0)) as u64;
    let prompt = p99_prompt.clamp(1.0, u32::MAX as f64) as u32;
    engine.prefill_time(prompt, 0) + p99_output.max(1.0) * engine.decode_step_time(b, ctx)
}

/// What decides whether affinity pays, measured on the workload for this fleet at the user's
/// load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnostic {
    /// The user's load (the ladder's 1×), requests/s.
    pub load_qps: f64,
    pub replicas: usize,
    pub kv_tokens_per_replica: u64,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
    /// [`residence_time_s`] at the user's load.
    pub residence_s: f64,
    /// Share of prompt tokens an ideal cache (one cache, never evicting) could serve over the
    /// diagnosed span: the recoverable reuse.
    pub recoverable_reuse: f64,
    /// Share of prompt tokens whose prefix was seen within the residence time (one cache):
    /// what a router that keeps each key on one warm replica could serve at this load.
    pub reuse_within_residence: f64,
    /// The same as one of R replicas sees it when requests are spread cache-blind (Flat-LB).
    pub reuse_spread: f64,
    /// `reuse_within_residence − reuse_spread`: the prompt tokens affinity can win back.
    pub affinity_gap: f64,
    /// [`prefill_share`].
    pub prefill_share: f64,
    /// `prefill_share × affinity_gap`: the fraction of the fleet's work affinity could save.
    pub work_affinity_can_save: f64,
    /// Keys observed (or listed).
    pub keys: u64,
    pub gini: f64,
    pub top1pct_share: f64,
    pub top4pct_share: f64,
    pub largest_key_share: f64,
    /// `largest_key_share × R`: the hottest key's traffic in units of one replica's fair share.
    pub hottest_key_in_replicas: f64,
    /// Keys each carrying more than one replica's fair share (1/R) of the traffic.
    pub keys_above_one_replica: u64,
    /// Traffic-weighted median over keys of the revisit time per key per destination under
    /// cache-blind spreading, `R / λ_b` seconds.
    pub revisit_spread_median_s: f64,
    /// Share of traffic from keys with `R/λ_b ≤ T_res`: their prefixes survive at every
    /// destination even when spread.
    pub traffic_survives_spread: f64,
    /// Share of traffic from keys with `1/λ_b ≤ T_res`: their prefixes survive on one home
    /// destination (affinity).
    pub traffic_survives_home: f64,
    pub interarrival_cv: f64,
}

/// Inputs of [`diagnose`].
#[derive(Debug, Clone)]
pub struct DiagnosticInput<'a> {
    pub load_qps: f64,
    pub replicas: usize,
    pub engine: &'a EngineConfig,
    /// Statistics of the whole input (sizes, skew, lengths, burstiness).
    pub whole: &'a TraceStats,
    /// Statistics of the diagnosed span at the user's load, computed with
    /// [`DiagnosticInput::windows`] and R destinations.
    pub span: &'a TraceStats,
    /// Each key's share of the traffic (any order; sums to 1).
    pub key_shares: &'a [f64],
}

/// The reuse windows the diagnosed span's statistics must be computed with: the residence time,
/// and a window longer than the span (the ideal cache).
pub fn reuse_windows(residence_s: f64, span_s: f64) -> [f64; 2] {
    let ideal = span_s.max(0.0) + 1.0;
    [residence_s.min(ideal).max(0.0), ideal]
}

/// The diagnostic (see [`Diagnostic`]; formulas in `docs/advise.md`).
pub fn diagnose(i: &DiagnosticInput) -> Diagnostic {
    let r = i.replicas.max(1);
    let kv = i.engine.kv_capacity_tokens();
    let p = i.whole.input_length.mean;
    let o = i.whole.output_length.mean;
    let t_res = residence_time_s(kv as f64, i.load_qps, r, p, o);
    let windows = reuse_windows(t_res, i.span.duration_s);
    let row = |w: f64| {
        i.span
            .reuse
            .iter()
            .find(|x| x.window_s == w)
            .or_else(|| {
                i.span
                    .reuse
                    .iter()
                    .min_by(|a, b| (a.window_s - w).abs().total_cmp(&(b.window_s - w).abs()))
            })
            .cloned()
    };
    let at_res = row(windows[0]);
    let ideal = row(windows[1]);
    let within = at_res.as_ref().map_or(0.0, |x| x.tokens);
    let spread = at_res.as_ref().map_or(0.0, |x| x.spread_tokens);
    let gap = (within - spread).max(0.0);
    let ps = prefill_share(i.engine, p, o);
    let total: f64 = i.key_shares.iter().sum();
    let shares: Vec<f64> = if total > 0.0 {
        i.key_shares.iter().map(|s| s / total).collect()
    } else {
        Vec::new()
    };
    let rate = |s: f64| s * i.load_qps;
    // (`+ 0.0`: an empty sum is −0.0.)
    let survives = |k: f64| {
        shares
            .iter()
            .filter(|&&s| s > 0.0 && k / rate(s) <= t_res)
            .sum::<f64>()
            + 0.0
    };
    // Traffic-weighted median of R/λ_b: sort by revisit time, walk until half the traffic.
    let mut by_revisit: Vec<(f64, f64)> = shares
        .iter()
        .filter(|&&s| s > 0.0)
        .map(|&s| (r as f64 / rate(s), s))
        .collect();
    by_revisit.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut acc = 0.0;
    let mut median = f64::NAN;
    for (t, s) in &by_revisit {
        acc += s;
        if acc >= 0.5 - 1e-12 {
            median = *t;
            break;
        }
    }
    let largest = shares.iter().cloned().fold(0.0, f64::max);
    Diagnostic {
        load_qps: i.load_qps,
        replicas: r,
        kv_tokens_per_replica: kv,
        mean_prompt_tokens: p,
        mean_output_tokens: o,
        residence_s: t_res,
        recoverable_reuse: ideal.map_or(0.0, |x| x.tokens),
        reuse_within_residence: within,
        reuse_spread: spread,
        affinity_gap: gap,
        prefill_share: ps,
        work_affinity_can_save: ps * gap,
        keys: shares.iter().filter(|&&s| s > 0.0).count() as u64,
        gini: crate::workload::rates::gini(&shares),
        top1pct_share: crate::workload::rates::top_share(&shares, 0.01),
        top4pct_share: crate::workload::rates::top_share(&shares, 0.04),
        largest_key_share: largest,
        hottest_key_in_replicas: largest * r as f64,
        keys_above_one_replica: shares.iter().filter(|&&s| s > 1.0 / r as f64).count() as u64,
        revisit_spread_median_s: median,
        traffic_survives_spread: survives(r as f64),
        traffic_survives_home: survives(1.0),
        interarrival_cv: i.whole.interarrival_cv,
    }
}

/// The outcome of one comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Win,
    Tie,
    Lose,
    /// Neither policy passes the first step on any seed: nothing to compare.
    NoPass,
}

impl Outcome {
    pub fn word(self) -> &'static str {
        match self {
            Outcome::Win => "WIN",
            Outcome::Tie => "TIE",
            Outcome::Lose => "LOSE",
            Outcome::NoPass => "NO PASS",
        }
    }
}

/// How far beyond 1 (relatively) the interval of a capacity ratio must lie for a win or a
/// loss: a win needs the whole interval above 1.05, a loss below 0.95.
pub const VERDICT_MARGIN: f64 = 0.05;
/// Relative resolution each seed's knee (capacity) is refined to between two ladder steps
/// (`analysis::knee`), so that a ratio rests on knees, not on the ladder's steps.
pub const KNEE_RESOLUTION: f64 = 0.05;

/// One seed of a comparison: both capacities (knees refined between ladder steps) and the
/// range of capacity ratios they allow.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SeedPair {
    pub seed: u64,
    pub subject_qps: f64,
    pub subject_censored: Censoring,
    pub baseline_qps: f64,
    pub baseline_censored: Censoring,
    /// The lowest and highest ratio the two capacities allow ([`capacity_range`]): both equal
    /// the ratio when neither is censored.
    pub ratio_low: f64,
    pub ratio_high: f64,
}

/// The range a capacity allows: the value itself; `[top, ∞)` when right-censored (every step
/// passed); `[0, first step)` when left-censored (even the first step failed).
pub fn capacity_range(qps: f64, censored: Censoring, first_step: f64) -> (f64, f64) {
    match censored {
        Censoring::None => (qps, qps),
        Censoring::Right => (qps, f64::INFINITY),
        Censoring::Left => (0.0, first_step),
    }
}

/// One seed's [`SeedPair`] from the two capacities (`first_step`: the ladder's first rate).
pub fn seed_pair(
    seed: u64,
    subject: (f64, Censoring),
    baseline: (f64, Censoring),
    first_step: f64,
) -> SeedPair {
    let (s_lo, s_hi) = capacity_range(subject.0, subject.1, first_step);
    let (b_lo, b_hi) = capacity_range(baseline.0, baseline.1, first_step);
    let low = if b_hi.is_finite() && b_hi > 0.0 {
        s_lo / b_hi
    } else {
        0.0
    };
    let high = if s_hi.is_finite() && b_lo > 0.0 {
        s_hi / b_lo
    } else {
        f64::INFINITY
    };
    SeedPair {
        seed,
        subject_qps: subject.0,
        subject_censored: subject.1,
        baseline_qps: baseline.0,
        baseline_censored: baseline.1,
        ratio_low: low,
        ratio_high: high,
    }
}

/// The interval a verdict rests on: the lower end of the 95% Student-t interval over seeds of
/// each seed's lowest ratio, and the upper end of the same over each seed's highest ratio (∞
/// when some seed's ratio has no upper bound). Without censoring this is the paired capacity
/// ratio's 95% interval; with one seed, the ratio itself (no spread can be estimated).
pub fn ratio_interval(per_seed: &[SeedPair]) -> [f64; 2] {
    if per_seed.is_empty() {
        return [f64::NAN, f64::NAN];
    }
    let lows: Vec<f64> = per_seed.iter().map(|p| p.ratio_low).collect();
    let highs: Vec<f64> = per_seed.iter().map(|p| p.ratio_high).collect();
    let lo = super::capacity::seed_stats(&lows).at_least(0.0).ci95[0];
    let hi = if highs.iter().all(|h| h.is_finite()) {
        super::capacity::seed_stats(&highs).ci95[1]
    } else {
        f64::INFINITY
    };
    [lo, hi]
}

/// The verdict rule (`docs/advise.md`): over paired seeds,
/// - **no pass** when neither policy passes the first step on any seed;
/// - **win** when the interval of the capacity ratio ([`ratio_interval`]) lies wholly above
///   1 + [`VERDICT_MARGIN`], **lose** when it lies wholly below 1 − [`VERDICT_MARGIN`];
/// - **tie** otherwise (the seeds disagree, or the knees are within the margin of each other).
pub fn classify(per_seed: &[SeedPair]) -> Outcome {
    if per_seed.is_empty()
        || per_seed.iter().all(|p| {
            p.subject_censored == Censoring::Left && p.baseline_censored == Censoring::Left
        })
    {
        return Outcome::NoPass;
    }
    let [lo, hi] = ratio_interval(per_seed);
    if lo > 1.0 + VERDICT_MARGIN {
        Outcome::Win
    } else if hi < 1.0 - VERDICT_MARGIN {
        Outcome::Lose
    } else {
        Outcome::Tie
    }
}

/// A policy against a baseline at the SLO.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// e.g. `affinity (chwbl)` or `cacheroute`.
    pub subject: String,
    pub subject_policy: String,
    /// `flat-lb` or `best reactive (preble)`.
    pub against: String,
    pub baseline_policy: String,
    /// Paired per-seed capacity ratios (`analysis::capacity::paired_ratios`).
    pub ratio: RatioStats,
    /// The interval the verdict rests on ([`ratio_interval`]).
    pub interval: [f64; 2],
    pub per_seed: Vec<SeedPair>,
    pub outcome: Outcome,
    /// Some seed's capacity was censored: the ratio is a bound.
    pub bound: bool,
}

fn arm<'a>(summary: &'a StudySummary, label: &str) -> Option<&'a ArmSummary> {
    summary
        .arms
        .iter()
        .find(|a| a.policy == label && a.sweep.is_empty())
}

/// The best arm of `labels` at the (first) SLO: highest mean capacity, then highest served
/// hit, then the first listed.
pub fn best_of<'a>(summary: &'a StudySummary, labels: &[&str]) -> Option<&'a ArmSummary> {
    let mut best: Option<&ArmSummary> = None;
    for l in labels {
        let Some(a) = arm(summary, l) else { continue };
        let key = |a: &ArmSummary| (a.capacity_qps[0].mean, a.served_kv_hit.mean);
        if best.is_none_or(|b| {
            let (ca, ha) = key(a);
            let (cb, hb) = key(b);
            ca > cb || (ca == cb && ha > hb)
        }) {
            best = Some(a);
        }
    }
    best
}

/// Compare arm `subject` with arm `baseline` at the first SLO; `ladder_qps` is the ladder (its
/// first step bounds a left-censored capacity).
pub fn compare(
    summary: &StudySummary,
    ladder_qps: &[f64],
    subject: (&str, &ArmSummary),
    against: (&str, &ArmSummary),
) -> Comparison {
    let (s_name, s) = subject;
    let (b_name, b) = against;
    let sc: &CapacityStats = &s.capacity_qps[0];
    let bc: &CapacityStats = &b.capacity_qps[0];
    let first = ladder_qps.first().copied().unwrap_or(f64::NAN);
    let mut per_seed = Vec::new();
    for x in &sc.per_seed {
        if let Some(y) = bc.per_seed.iter().find(|y| y.seed == x.seed) {
            per_seed.push(seed_pair(
                x.seed,
                (x.qps, x.censored),
                (y.qps, y.censored),
                first,
            ));
        }
    }
    let ratio = s
        .ratios
        .iter()
        .find(|r| r.baseline == b.policy && r.slo_label == summary.slos[0].label())
        .map(|r| r.ratio.clone())
        .unwrap_or_else(|| {
            // Not among the study's baselines: pair the seeds here (same rule).
            let m = |c: &CapacityStats| {
                c.per_seed
                    .iter()
                    .map(|x| {
                        (
                            x.seed,
                            super::model::Capacity {
                                qps: x.qps,
                                censored: x.censored,
                            },
                        )
                    })
                    .collect()
            };
            super::capacity::paired_ratios(&m(sc), &m(bc))
        });
    Comparison {
        subject: s_name.to_string(),
        subject_policy: s.policy.clone(),
        against: b_name.to_string(),
        baseline_policy: b.policy.clone(),
        interval: ratio_interval(&per_seed),
        outcome: classify(&per_seed),
        bound: per_seed.iter().any(|p| {
            p.subject_censored != Censoring::None || p.baseline_censored != Censoring::None
        }),
        per_seed,
        ratio,
    }
}

/// The four comparisons of the verdict: affinity (the better of Sticky and CHWBL) and
/// CacheRoute, each against Flat-LB and against the best reactive baseline (the best of
/// Flat-LB, DualMap and Preble). Missing arms are left out.
pub fn verdicts(summary: &StudySummary, ladder_qps: &[f64]) -> Vec<Comparison> {
    let mut out = Vec::new();
    let flat = arm(summary, FLAT_LB);
    let reactive = best_of(summary, &REACTIVE);
    let affinity = best_of(summary, &AFFINITY);
    let cr = arm(summary, CACHEROUTE);
    let aff_name = affinity.map(|a| format!("affinity ({})", a.policy));
    let react_name = reactive.map(|a| format!("best reactive ({})", a.policy));
    for (name, subject) in [(aff_name, affinity), (Some(CACHEROUTE.to_string()), cr)] {
        let (Some(name), Some(subject)) = (name, subject) else {
            continue;
        };
        if let Some(f) = flat {
            out.push(compare(summary, ladder_qps, (&name, subject), (FLAT_LB, f)));
        }
        if let (Some(rn), Some(r)) = (&react_name, reactive) {
            out.push(compare(summary, ladder_qps, (&name, subject), (rn, r)));
        }
    }
    out
}

/// Whether no policy passes even the first step on any seed (the SLO cannot be met at any
/// load of the ladder).
pub fn nothing_passes(summary: &StudySummary) -> bool {
    summary.arms.iter().all(|a| {
        a.capacity_qps
            .first()
            .is_none_or(|c| c.per_seed.iter().all(|s| s.censored == Censoring::Left))
    })
}

/// The one or two workload facts that drive the outcome, as one sentence: first how much reuse
/// affinity can win back (and how much of the work that is); then, when it applies, a hot key
/// beyond one replica's share, else prefill too small a share of the work to matter, else bursty
/// arrivals.
pub fn driving_facts(d: &Diagnostic) -> String {
    let pct = |x: f64| format!("{:.0}%", 100.0 * x);
    let first = if d.affinity_gap < SMALL_GAP {
        format!(
            "little reuse for affinity to recover — {} of prompt tokens reuse a prefix seen within the ~{} cache residence time and spreading over {} replicas already keeps {}",
            pct(d.reuse_within_residence),
            seconds(d.residence_s),
            d.replicas,
            pct(d.reuse_spread)
        )
    } else {
        format!(
            "affinity can win back {} of prompt tokens ({} reuse a prefix within the ~{} cache residence time, only {} survive spreading over {} replicas), about {} of the fleet's work",
            pct(d.affinity_gap),
            pct(d.reuse_within_residence),
            seconds(d.residence_s),
            pct(d.reuse_spread),
            d.replicas,
            pct(d.work_affinity_can_save)
        )
    };
    let second = if d.hottest_key_in_replicas > 1.0 {
        Some(format!(
            "the hottest key alone carries {:.1}× one replica's share of traffic ({} key(s) above 1/R), so pinning it to one home overloads that replica unless it is replicated",
            d.hottest_key_in_replicas, d.keys_above_one_replica
        ))
    } else if d.prefill_share < SMALL_PREFILL_SHARE {
        Some(format!(
            "prefill is only {} of a request's service time here, so cache hits save little",
            pct(d.prefill_share)
        ))
    } else if d.interarrival_cv > BURSTY_CV {
        Some(format!(
            "arrivals are bursty (inter-arrival CV {:.1}), which queues behind a pinned home",
            d.interarrival_cv
        ))
    } else {
        None
    };
    match second {
        Some(s) => format!("{first}; {s}."),
        None => format!("{first}."),
    }
}

/// A duration for people: `850 ms`, `4.2 s`, `12 min`.
pub fn seconds(s: f64) -> String {
    if !s.is_finite() {
        "∞".into()
    } else if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.0} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// One policy's figures for the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyRow {
    pub policy: String,
    pub capacity: CapacityStats,
    /// Mean capacity / the user's load.
    pub capacity_x_load: f64,
    /// At the 1× step, over seeds.
    pub served_kv_hit_at_load: SeedStats,
    pub p99_at_load_s: SeedStats,
    pub imbalance_at_load: SeedStats,
    /// Share of seeds passing the SLO at the 1× step.
    pub pass_share_at_load: f64,
    /// Paired capacity ratios against Flat-LB (None for Flat-LB itself).
    pub vs_flat_lb: Option<RatioStats>,
}

/// Per-policy rows (study order) at the user's load `load_qps` (a ladder step).
pub fn policy_rows(summary: &StudySummary, slo: &Slo, load_qps: f64) -> Vec<PolicyRow> {
    summary
        .arms
        .iter()
        .map(|a| {
            let at = a
                .steps
                .iter()
                .min_by(|x, y| {
                    (x.offered_qps - load_qps)
                        .abs()
                        .total_cmp(&(y.offered_qps - load_qps).abs())
                })
                .cloned();
            let nan = SeedStats {
                n: 0,
                mean: f64::NAN,
                sd: f64::NAN,
                ci95: [f64::NAN, f64::NAN],
                clipped: false,
            };
            let p99 = |s: &super::study::StepAgg| match slo.metric {
                super::model::SloMetric::E2e => s.e2e_p99_s,
                super::model::SloMetric::Ttft => s.ttft_p99_s,
            };
            PolicyRow {
                policy: a.policy.clone(),
                capacity: a.capacity_qps[0].clone(),
                capacity_x_load: a.capacity_qps[0].mean / load_qps,
                served_kv_hit_at_load: at.as_ref().map_or(nan, |s| s.served_kv_hit),
                p99_at_load_s: at.as_ref().map_or(nan, p99),
                imbalance_at_load: at.as_ref().map_or(nan, |s| s.imbalance_requests),
                pass_share_at_load: at
                    .as_ref()
                    .and_then(|s| s.pass_share.first().copied())
                    .unwrap_or(0.0),
                vs_flat_lb: a
                    .ratios
                    .iter()
                    .find(|r| r.baseline == FLAT_LB && r.slo_label == slo.label())
                    .map(|r| r.ratio.clone()),
            }
        })
        .collect()
}

/// What was simulated, for the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Simulated {
    /// The input, in words (file and kind).
    pub input: String,
    pub input_requests: u64,
    pub input_span_s: f64,
    /// The input's own mean rate, requests/s.
    pub input_qps: f64,
    /// The user's load (1×), requests/s.
    pub load_qps: f64,
    pub engine: String,
    pub replicas: usize,
    pub slo: Slo,
    pub ladder_multipliers: Vec<f64>,
    pub ladder_qps: Vec<f64>,
    pub seeds: Vec<u64>,
    /// How seeds differ, in words.
    pub seed_variation: String,
    pub warmup_s: f64,
    pub measure_s: f64,
    /// Requests of the input used (trace: its first N; rates: generated per step).
    pub requests_used: u64,
    /// What was cut or shortened, in words (empty when nothing).
    pub cuts: Vec<String>,
    /// Steps simulated, and steps skipped (above a failed step, past 1×: they cannot change a
    /// capacity).
    pub steps_simulated: usize,
    pub steps_skipped: usize,
    /// Steps simulated between ladder steps to locate knees (`analysis::knee`).
    pub knee_probes: usize,
    /// The relative resolution knees were located to (`None`: the ladder's steps).
    pub refine: Option<f64>,
    pub requests_simulated: u64,
    pub policies: Vec<String>,
    /// Span of the diagnosed requests at the user's load, seconds, and their count.
    pub diagnosed_span_s: f64,
    pub diagnosed_requests: u64,
}

/// The dispatch CacheRoute's self-calibration chose on the user's traffic (the step at 1× of
/// the first seed) and the replayed figures it chose by.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DispatchChoice {
    pub load_qps: f64,
    /// Each dispatch in force and the share of the step's plans built under it, most first.
    pub shares: Vec<(String, f64)>,
    /// The last tuning's line: the dispatches replayed, their predicted p99 TTFT / e2e, and the
    /// choice.
    pub tuning: Option<String>,
}

/// What the plans of one CacheRoute run say about its dispatch (`None`: no plan recorded one).
pub fn dispatch_choice(
    plans: &[crate::analysis::record::PlanRecord],
    load_qps: f64,
) -> Option<DispatchChoice> {
    let mut shares: Vec<(String, f64)> = Vec::new();
    let mut n = 0.0;
    for d in plans.iter().filter_map(|p| p.dispatch) {
        let name = d.to_string();
        match shares.iter_mut().find(|(k, _)| *k == name) {
            Some(e) => e.1 += 1.0,
            None => shares.push((name, 1.0)),
        }
        n += 1.0;
    }
    if n == 0.0 {
        return None;
    }
    shares.iter_mut().for_each(|e| e.1 /= n);
    shares.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let tuning = plans.iter().rev().find_map(|p| p.tuning.clone());
    Some(DispatchChoice {
        load_qps,
        shares,
        tuning,
    })
}

/// Everything `cacheroute advise` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdviseReport {
    pub simulated: Simulated,
    pub diagnostic: Diagnostic,
    pub policies: Vec<PolicyRow>,
    pub comparisons: Vec<Comparison>,
    /// [`driving_facts`].
    pub facts: String,
    /// No policy passes the first step (the verdict is then undecided).
    pub nothing_passes: bool,
    /// Every policy passes every step on every seed.
    pub everything_passes: bool,
    /// The dispatch CacheRoute's self-calibration chose at the user's load.
    pub dispatch: Option<DispatchChoice>,
}

/// Whether every policy passes every step of the ladder on every seed.
pub fn everything_passes(summary: &StudySummary) -> bool {
    summary.arms.iter().all(|a| {
        a.capacity_qps
            .first()
            .is_some_and(|c| c.per_seed.iter().all(|s| s.censored == Censoring::Right))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: f64 = 50.0;

    /// Seeds with the subject's capacity `ratios[i]` × the baseline's 100 req/s (uncensored).
    fn ratios(ratios: &[f64]) -> Vec<SeedPair> {
        ratios
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                seed_pair(
                    i as u64 + 1,
                    (100.0 * r, Censoring::None),
                    (100.0, Censoring::None),
                    FIRST,
                )
            })
            .collect()
    }

    #[test]
    fn a_loss_of_21_percent_on_every_seed_is_a_loss_and_3_percent_a_tie() {
        // The case the ladder's resolution called a tie: 0.79× on all three seeds.
        assert_eq!(classify(&ratios(&[0.79, 0.79, 0.79])), Outcome::Lose);
        assert_eq!(classify(&ratios(&[1.21, 1.21, 1.21])), Outcome::Win);
        // Within the 5% margin: a tie however tight the interval (this fails without it).
        assert_eq!(classify(&ratios(&[0.97, 0.97, 0.97])), Outcome::Tie);
        assert_eq!(classify(&ratios(&[1.04, 1.04, 1.04])), Outcome::Tie);
        // Just beyond the margin on every seed.
        assert_eq!(classify(&ratios(&[0.94, 0.94, 0.94])), Outcome::Lose);
        assert_eq!(classify(&ratios(&[1.06, 1.06, 1.06])), Outcome::Win);
        // One seed: the ratio itself, with the same margin.
        assert_eq!(classify(&ratios(&[0.79])), Outcome::Lose);
        assert_eq!(classify(&ratios(&[0.97])), Outcome::Tie);
        let i = ratio_interval(&ratios(&[0.79, 0.79, 0.79]));
        assert!(
            (i[0] - 0.79).abs() < 1e-9 && (i[1] - 0.79).abs() < 1e-9,
            "{i:?}"
        );
    }

    #[test]
    fn seeds_that_disagree_are_a_tie() {
        // Mean 0.93 but the 95% interval (t, 2 df) reaches above 0.95.
        let p = ratios(&[0.90, 0.93, 0.96]);
        let i = ratio_interval(&p);
        assert!(i[0] < 0.95 && i[1] > 0.95, "{i:?}");
        assert_eq!(classify(&p), Outcome::Tie);
        // Two seeds far apart on either side of 1.
        assert_eq!(classify(&ratios(&[2.0, 0.5])), Outcome::Tie);
        // Spread, but every seed well below: a loss.
        assert_eq!(classify(&ratios(&[0.70, 0.75, 0.80])), Outcome::Lose);
    }

    #[test]
    fn a_censored_capacity_is_a_bound_not_a_figure() {
        let pair = |s: (f64, Censoring), b: (f64, Censoring)| vec![seed_pair(1, s, b, FIRST)];
        use Censoring::{Left, None as Exact, Right};
        // The subject passes every step (≥ 200), the baseline knees at 100: at least 2×.
        let p = pair((200.0, Right), (100.0, Exact));
        assert_eq!((p[0].ratio_low, p[0].ratio_high), (2.0, f64::INFINITY));
        assert_eq!(classify(&p), Outcome::Win);
        // The baseline passes every step (≥ 200), the subject knees at 100: the ratio is at
        // most 0.5, a loss.
        let p = pair((100.0, Exact), (200.0, Right));
        assert_eq!((p[0].ratio_low, p[0].ratio_high), (0.0, 0.5));
        assert_eq!(classify(&p), Outcome::Lose);
        // Both pass every step: nothing is known, a tie.
        assert_eq!(
            classify(&pair((200.0, Right), (200.0, Right))),
            Outcome::Tie
        );
        // The baseline fails the first step (< 50): the subject at 52.5 may be barely above
        // it, a tie; at 63 it is at least 1.26×, a win.
        assert_eq!(classify(&pair((52.5, Exact), (0.0, Left))), Outcome::Tie);
        assert_eq!(classify(&pair((63.0, Exact), (0.0, Left))), Outcome::Win);
        // The subject fails the first step, the baseline knees at 63: at most 0.79×, a loss.
        assert_eq!(classify(&pair((0.0, Left), (63.0, Exact))), Outcome::Lose);
        // Neither passes the first step on any seed: no verdict.
        assert_eq!(classify(&pair((0.0, Left), (0.0, Left))), Outcome::NoPass);
        assert_eq!(classify(&[]), Outcome::NoPass);
    }

    #[test]
    fn residence_time_formula() {
        // 1M tokens of KV, 10 req/s over 5 replicas = 2 req/s each, 4k + 1k tokens each:
        // 10k tokens/s written, 100 s residence.
        let t = residence_time_s(1e6, 10.0, 5, 4000.0, 1000.0);
        assert!((t - 100.0).abs() < 1e-9, "{t}");
        assert!(residence_time_s(1e6, 0.0, 5, 4000.0, 1000.0).is_infinite());
        // Twice the load or twice the replicas' load halves/doubles it.
        assert!((residence_time_s(1e6, 20.0, 5, 4000.0, 1000.0) - 50.0).abs() < 1e-9);
        assert!((residence_time_s(1e6, 10.0, 10, 4000.0, 1000.0) - 200.0).abs() < 1e-9);
    }

    #[test]
    fn prefill_share_grows_with_the_prompt() {
        let e = EngineConfig::parse("llama-3.1-8b:h100:fp8:tp1").unwrap();
        let long_prompt = prefill_share(&e, 8000.0, 20.0);
        let long_answer = prefill_share(&e, 200.0, 1000.0);
        assert!(long_prompt > 0.5, "{long_prompt}");
        assert!(long_answer < 0.1, "{long_answer}");
        assert!(prefill_share(&e, 1000.0, 0.0) > 0.999);
    }

    fn stats_with(reuse: Vec<crate::workload::stats::ReuseRow>, span: f64) -> TraceStats {
        use crate::workload::stats::Percentiles;
        let p = |m: f64| Percentiles {
            mean: m,
            p50: m,
            p90: m,
            p99: m,
            max: m,
        };
        TraceStats {
            requests: 100,
            duration_s: span,
            mean_qps: 1.0,
            distinct_keys: 2,
            gini: 0.0,
            top1pct_share: 0.0,
            top4pct_share: 0.0,
            largest_key_share: 0.0,
            interarrival_cv: 1.0,
            input_length: p(4000.0),
            output_length: p(100.0),
            block_size: 16,
            destinations: 4,
            reuse,
            key_counts: vec![],
        }
    }

    #[test]
    fn diagnose_reads_the_residence_and_ideal_windows_and_key_shares() {
        use crate::workload::stats::ReuseRow;
        let e = EngineConfig::parse("llama-3.1-8b:h100:fp8:tp1").unwrap();
        let load = 8.0;
        let t_res = residence_time_s(e.kv_capacity_tokens() as f64, load, 4, 4000.0, 100.0);
        let w = reuse_windows(t_res, 1000.0);
        let row = |w: f64, t: f64, s: f64| ReuseRow {
            window_s: w,
            requests: t,
            tokens: t,
            spread_requests: s,
            spread_tokens: s,
        };
        let span = stats_with(vec![row(w[0], 0.6, 0.2), row(w[1], 0.7, 0.3)], 1000.0);
        let whole = stats_with(vec![], 1000.0);
        // One key with half the traffic (4 req/s: revisits each of 4 replicas every 1 s), and
        // 50 keys sharing the rest (0.08 req/s each: every 50 s, every 12.5 s at home).
        let mut shares = vec![0.5];
        shares.extend(std::iter::repeat_n(0.01, 50));
        let d = diagnose(&DiagnosticInput {
            load_qps: load,
            replicas: 4,
            engine: &e,
            whole: &whole,
            span: &span,
            key_shares: &shares,
        });
        assert!((d.residence_s - t_res).abs() < 1e-9);
        assert_eq!(d.reuse_within_residence, 0.6);
        assert_eq!(d.reuse_spread, 0.2);
        assert!((d.affinity_gap - 0.4).abs() < 1e-12);
        assert_eq!(d.recoverable_reuse, 0.7);
        assert_eq!(d.keys, 51);
        assert!((d.hottest_key_in_replicas - 2.0).abs() < 1e-12);
        assert_eq!(d.keys_above_one_replica, 1);
        // The big key's revisit time per destination is 1 s and holds half the traffic.
        assert!((d.revisit_spread_median_s - 1.0).abs() < 1e-12);
        // t_res is about two minutes here: every key survives at home and under spreading.
        assert!((50.0..1000.0).contains(&t_res), "{t_res}");
        assert!((d.traffic_survives_home - 1.0).abs() < 1e-9);
        assert!((d.traffic_survives_spread - 1.0).abs() < 1e-9);
        let facts = driving_facts(&d);
        assert!(facts.contains("win back 40%"), "{facts}");
        assert!(facts.contains("hottest key"), "{facts}");
    }

    #[test]
    fn facts_name_little_reuse_and_small_prefill() {
        let e = EngineConfig::parse("llama-3.1-8b:h100:fp8:tp1").unwrap();
        let span = stats_with(vec![], 10.0);
        let mut whole = stats_with(vec![], 10.0);
        whole.input_length.mean = 100.0;
        whole.output_length.mean = 2000.0;
        let shares = vec![0.01; 100];
        let d = diagnose(&DiagnosticInput {
            load_qps: 1.0,
            replicas: 8,
            engine: &e,
            whole: &whole,
            span: &span,
            key_shares: &shares,
        });
        let f = driving_facts(&d);
        assert!(f.contains("little reuse"), "{f}");
        assert!(f.contains("prefill is only"), "{f}");
    }
}
