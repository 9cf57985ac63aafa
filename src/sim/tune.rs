//! Self-calibration of CacheRoute's settings the configuration leaves automatic: the dispatch
//! (plan or reactive, cold tail, load signal) and pinned-or-bounded sets and W by replaying the
//! control loop's recent window of arrivals through the engine model once per candidate and
//! keeping the candidate with the best predicted tail latency; q_cap from the engine model.
//!
//! - **Dispatch** (first): [`dispatch_candidates`] at the W and sets in force. A challenger
//!   must beat the dispatch in force by the hysteresis at [`PROBE`] and be no worse at
//!   [`PROBE_HIGH`] (docs/cacheroute.md, "Self-calibration chooses the dispatch").
//! - **q_cap** is not searched: it is the engine-model estimate for the traffic's shape (mean
//!   prompt and output of the window), and it changes only when that estimate moves by more
//!   than [`Q_SHIFT`]. A change of q_cap re-sizes k_b for nearly every key, so a new plan moves
//!   almost every key (churn 0.96 measured) and their prefixes start cold — a cost the replays
//!   below cannot see, as they start from cold engines. Searching q_cap by replay lost one to
//!   three ladder steps on the flagship, burstiness and Zipf workloads (docs/cacheroute.md).
//! - **Candidates.** The first tuning spans the engine-model estimate of W: W ∈ {1, est/4, est,
//!   4·est, all}, where "all" admits every key seen with its k_b replicas (Σ k_b / R) and 1
//!   leaves nearly every request to the cold tail (long-tailed traffic, where no key is hot
//!   enough for a home to pay: a home that moves with the measured rates costs the
//!   conversations it held). Later
//!   tunings look at the neighbours of the value in force: W ∈ {W/2, W, 2·W}, so a step
//!   changes W by at most 2×. Unless the configuration says, each is tried with pinned and
//!   with bounded planned sets, under the chosen dispatch (none under a reactive one: it has
//!   no plan to size).
//! - **Replay.** The window (the last two control intervals, at most [`MAX_REPLAY`] requests)
//!   is replayed with its arrival times compressed by [`PROBE`] (25% more load than observed,
//!   so the candidates are told apart where headroom is decided), from cold engines, with the
//!   candidate's plan built at t = 0 from the rates the control loop is about to plan from.
//!   The first third warms the caches; latency is read over the rest.
//! - **Score.** p99 TTFT and p99 end-to-end latency, each relative to the best candidate's,
//!   summed (lower is better; a candidate with unfinished or failed requests scores worst).
//! - **Hysteresis.** The values in force (before the first tuning: the engine-model estimates
//!   with pinned sets) are kept unless the best candidate's score beats theirs by more than
//!   10%.
//!
//! An explicit q_cap or W is never tuned. The replays run with tuning off (no recursion).

use super::{simulate, SimConfig, WarmStart};
use crate::analysis::record::Resolved;
pub use crate::control::Tuned;
use crate::control::{TuneRequest, Tuner};
use crate::engine::EngineConfig;
use crate::plan::KeyLoad;
use crate::policy::cacheroute::{CacheRouteConfig, Dispatch, LoadSignal};
use crate::policy::calibrate::{estimate_q_cap, estimate_warm_slots};
use crate::policy::setting::Setting;
use crate::policy::PolicySpec;
use crate::workload::trace::TraceRecord;

/// Replays hold at most this many requests (the most recent).
pub use crate::control::MAX_REPLAY;
/// Load factor of a replay against the observed window.
pub const PROBE: f64 = 1.25;
/// The higher load a change of dispatch must also hold at.
pub const PROBE_HIGH: f64 = 1.6;
/// A new candidate must beat the values in force by this factor.
const HYSTERESIS: f64 = 0.9;
/// q_cap moves to a new engine-model estimate only when it differs by more than this.
pub const Q_SHIFT: f64 = 0.25;

/// What a tuning sees.
pub struct TuneInput<'a> {
    pub engine: &'a EngineConfig,
    pub destinations: usize,
    /// The policy as configured (q_cap / W of 0 are the ones to tune).
    pub policy: &'a CacheRouteConfig,
    /// Recent arrivals in order (timestamps in ms).
    pub window: &'a [TraceRecord],
    /// The rates the next plan is built from.
    pub rates: &'a [KeyLoad],
    /// The values in force (`None` before the first tuning).
    pub current: Option<Resolved>,
    pub seed: u64,
}

/// The controller's tuner in the simulator and the router: [`tune`] through an engine model.
pub struct ReplayTuner {
    pub engine: EngineConfig,
    pub seed: u64,
}

/// The replay tuner as a [`crate::control::TunerFactory`], for the live router.
pub fn replay_tuner() -> crate::control::TunerFactory {
    crate::control::TunerFactory(std::sync::Arc::new(|engine, seed| {
        Box::new(ReplayTuner { engine, seed }) as Box<dyn Tuner>
    }))
}

impl Tuner for ReplayTuner {
    fn tune(&self, r: &TuneRequest<'_>) -> Tuned {
        tune(&TuneInput {
            engine: &self.engine,
            destinations: r.destinations,
            policy: r.policy,
            window: r.window,
            rates: r.rates,
            current: r.current,
            seed: self.seed,
        })
    }
}

/// One candidate's predicted latencies.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    q_cap: f64,
    warm_slots: u64,
    bounded: bool,
    dispatch: Dispatch,
    ttft_p99: f64,
    e2e_p99: f64,
    hit: f64,
}

impl Outcome {
    fn same_settings(&self, o: &Outcome) -> bool {
        self.warm_slots == o.warm_slots && self.bounded == o.bounded && self.dispatch == o.dispatch
    }
}

fn dedup_sorted<T: PartialOrd + Copy>(mut v: Vec<T>) -> Vec<T> {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v.dedup_by(|a, b| a == b);
    v
}

/// Warm slots per destination that admit every key of `rates` with its k_b replicas at
/// `q_cap` over `r` destinations (Σ k_b / R, rounded up; at least 1).
fn all_slots(rates: &[KeyLoad], q_cap: f64, r: usize) -> u64 {
    let r = r.max(1);
    let slots: u64 = rates
        .iter()
        .filter(|k| k.rate > 0.0)
        .map(|k| crate::plan::replicas_for(k.rate, q_cap, r) as u64)
        .sum();
    slots.div_ceil(r as u64).max(1)
}

/// Candidate values of W: around `base`, within [1, `all`] (`all` admits every key).
fn w_candidates(base: u64, all: u64, first: bool) -> Vec<u64> {
    let v: Vec<u64> = if first {
        vec![1, base / 4, base, base * 4, all]
    } else {
        vec![base / 2, base, base * 2]
    };
    dedup_sorted(v.into_iter().map(|w| w.clamp(1, all.max(1))).collect())
}

/// The dispatches a tuning compares: the plan with a CHWBL tail under the queued-prefill
/// signal and under outstanding requests, and no plan at all with the prefix-aware tail
/// (Preble's rule: the best reactive router where a plan has little to hold). The predicted-TTFT
/// signal (`load: cost`) is not among them: on the engine model it ranks destinations as the
/// queued prefill does (docs/cacheroute.md). A part the configuration fixes is fixed in every
/// candidate (duplicates dropped).
pub fn dispatch_candidates(policy: &CacheRouteConfig) -> Vec<Dispatch> {
    let all = [
        Dispatch::PLANNED,
        Dispatch {
            load: LoadSignal::Outstanding,
            ..Dispatch::PLANNED
        },
        Dispatch::REACTIVE,
    ];
    let mut out: Vec<Dispatch> = Vec::new();
    for d in all.map(|d| policy.configured_dispatch(d)) {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// q_cap follows the engine model's estimate for the traffic's current shape (mean prompt and
/// output), but only once that estimate has moved by more than [`Q_SHIFT`] from the value in
/// force: every change of q_cap re-sizes k_b for nearly every key.
fn follow_estimate(current: f64, estimate: f64) -> f64 {
    if current > 0.0 && (estimate / current - 1.0).abs() <= Q_SHIFT {
        current
    } else {
        estimate
    }
}

/// Each outcome's score: p99 TTFT and p99 e2e, each relative to the best candidate's, summed
/// (lower is better; unfinished or failed requests score worst).
fn scores(outcomes: &[Outcome]) -> Vec<f64> {
    let best_ttft = outcomes
        .iter()
        .map(|o| o.ttft_p99)
        .fold(f64::INFINITY, f64::min);
    let best_e2e = outcomes
        .iter()
        .map(|o| o.e2e_p99)
        .fold(f64::INFINITY, f64::min);
    outcomes
        .iter()
        .map(|o| {
            let s = o.ttft_p99 / best_ttft.max(1e-9) + o.e2e_p99 / best_e2e.max(1e-9);
            if s.is_finite() {
                s
            } else {
                f64::INFINITY
            }
        })
        .collect()
}

/// The best of `outcomes` (lowest [`scores`]; ties to the higher hit, then pinned, the smaller
/// W, the earlier candidate) and the one chosen: the incumbent unless the best beats it by
/// more than [`HYSTERESIS`].
fn pick(outcomes: &[Outcome], incumbent: impl Fn(&Outcome) -> bool) -> (Outcome, Outcome) {
    let sc = scores(outcomes);
    let best = (0..outcomes.len())
        .min_by(|&a, &b| {
            let (oa, ob) = (&outcomes[a], &outcomes[b]);
            sc[a]
                .total_cmp(&sc[b])
                .then(ob.hit.total_cmp(&oa.hit))
                .then(oa.bounded.cmp(&ob.bounded))
                .then(oa.warm_slots.cmp(&ob.warm_slots))
        })
        .expect("at least one candidate");
    let chosen = match outcomes.iter().position(incumbent) {
        Some(inc) if sc[best] > sc[inc] * HYSTERESIS => inc,
        _ => best,
    };
    (outcomes[best], outcomes[chosen])
}

/// Whether a challenging dispatch that beat the one in force at [`PROBE`] holds at
/// [`PROBE_HIGH`]: its score there (against the incumbent's replay at that load) no worse.
fn holds_at_high(incumbent: &Outcome, challenger: &Outcome) -> bool {
    let sc = scores(&[*incumbent, *challenger]);
    sc[1] <= sc[0]
}

/// Choose the dispatch, q_cap, W and bounded sets for the next plans.
pub fn tune(t: &TuneInput) -> Tuned {
    let shape = WarmStart::from_sample(Vec::new(), t.window);
    let (mean_prompt, mean_output) = (shape.mean_prompt_tokens, shape.mean_output_tokens);
    let est_q = estimate_q_cap(t.engine, mean_prompt, mean_output);
    let est_w = estimate_warm_slots(t.engine, mean_prompt);
    let first = t.current.is_none();
    // Before the first tuning the incumbent is the engine-model estimates with pinned sets
    // and the configured (else planned) dispatch: a replay must beat them clearly to move.
    let held = t.current.unwrap_or(Resolved {
        q_cap: est_q,
        warm_slots: est_w,
        bounded_sets: false,
        dispatch: t.policy.default_dispatch(),
    });
    let (cur_q, cur_w, cur_b) = (held.q_cap, held.warm_slots, held.bounded_sets);
    let cur_d = t.policy.configured_dispatch(held.dispatch);
    let w_in_force = cur_w;
    // One q_cap: as configured, or the engine model's (not replayed: see the module comment).
    let q = t.policy.q_cap.or_else(|| follow_estimate(cur_q, est_q));
    // W that admits every measured key with its k_b replicas at q (more is the same), and the
    // W in force compared as that when it is above it.
    let all = all_slots(t.rates, q, t.destinations);
    let cur_w = cur_w.clamp(1, all);
    let ws = match t.policy.warm_slots {
        Setting::Fixed(w) => vec![w],
        Setting::Auto => w_candidates(cur_w, all, first),
    };
    let bs: Vec<bool> = match t.policy.bounded_sets {
        Setting::Fixed(b) => vec![b],
        Setting::Auto => vec![false, true],
    };
    let ds = dispatch_candidates(t.policy);
    let bounded_sets = t.policy.bounded_sets.or_else(|| cur_b);
    let (w0, b0) = (cur_w_or(&ws, cur_w), bounded_sets);
    let fixed = |q_cap: f64, warm_slots: u64| Tuned {
        #[rustfmt::skip]
        settings: Resolved { q_cap, warm_slots, bounded_sets, dispatch: cur_d },
        why: String::new(),
    };
    if (ws.len() * bs.len() <= 1 && ds.len() <= 1) || t.window.len() < 50 || t.rates.is_empty() {
        let mut r = fixed(q, w0);
        r.why = if t.window.len() < 50 {
            format!(
                "too little traffic to replay ({} requests): kept {} dispatch, q_cap {:.3}, W {}",
                t.window.len(),
                cur_d,
                r.settings.q_cap,
                r.settings.warm_slots
            )
        } else {
            format!(
                "{} dispatch, q_cap {:.3}, W {} as configured",
                cur_d, r.settings.q_cap, r.settings.warm_slots
            )
        };
        return r;
    }
    let window = &t.window[t.window.len().saturating_sub(MAX_REPLAY)..];
    let t0 = window[0].timestamp_ms;
    let replay: Vec<TraceRecord> = window
        .iter()
        .map(|r| TraceRecord {
            timestamp_ms: (r.timestamp_ms - t0) / PROBE,
            ..r.clone()
        })
        .collect();
    let span_s = replay
        .last()
        .map(|r| r.timestamp_ms / 1000.0)
        .unwrap_or(0.0);
    let replay_high: Vec<TraceRecord> = replay
        .iter()
        .map(|r| TraceRecord {
            timestamp_ms: r.timestamp_ms * PROBE / PROBE_HIGH,
            ..r.clone()
        })
        .collect();
    let run = |replay: &[TraceRecord], w: u64, b: bool, d: Dispatch| {
        let span_s = replay.last().map_or(0.0, |r| r.timestamp_ms / 1000.0);
        replay_one(t, (q, w, b, d), replay, span_s, (mean_prompt, mean_output))
    };
    let mut n_replays = ds.len();
    // Stage 1, the dispatch: every candidate at the W and sets in force, at the probe load. A
    // challenger that beats the dispatch in force there must also hold at [`PROBE_HIGH`]: a
    // dispatch that wins at this load and collapses at a higher one (a reactive router where
    // a few hot keys carry the load) would cost capacity, and a switch itself costs the
    // caches the old dispatch had warmed.
    let stage1: Vec<Outcome> = ds.iter().map(|&d| run(&replay, w0, b0, d)).collect();
    let (best_d, mut chose_d) = pick(&stage1, |o| o.dispatch == cur_d);
    let mut confirm = String::new();
    if chose_d.dispatch != cur_d {
        if let Some(inc) = stage1.iter().find(|o| o.dispatch == cur_d) {
            let pair = [
                run(&replay_high, w0, b0, inc.dispatch),
                run(&replay_high, w0, b0, chose_d.dispatch),
            ];
            confirm = format!(
                "; at {:.0}% load {} {:.2}/{:.2} s, {} {:.2}/{:.2} s",
                100.0 * PROBE_HIGH,
                pair[0].dispatch,
                pair[0].ttft_p99,
                pair[0].e2e_p99,
                pair[1].dispatch,
                pair[1].ttft_p99,
                pair[1].e2e_p99
            );
            if !holds_at_high(&pair[0], &pair[1]) {
                confirm.push_str(": not confirmed");
                chose_d = *inc;
            }
            n_replays += 2;
        }
    }
    let dispatch_line = format!(
        "{} {} dispatch ({}{}{})",
        if chose_d.dispatch == cur_d {
            "kept"
        } else {
            "moved to"
        },
        chose_d.dispatch,
        stage1
            .iter()
            .map(|o| format!("{} {:.2}/{:.2} s", o.dispatch, o.ttft_p99, o.e2e_p99))
            .collect::<Vec<_>>()
            .join(", "),
        confirm,
        if best_d.dispatch != chose_d.dispatch && confirm.is_empty() {
            format!("; {} was within 10%", best_d.dispatch)
        } else {
            String::new()
        }
    );
    // Stage 2, W and pinned or bounded sets under the chosen dispatch (no plan: nothing to
    // size, the values in force stay).
    let mut outcomes = vec![chose_d];
    if chose_d.dispatch.plan {
        for &b in &bs {
            for &w in &ws {
                if (w, b) != (w0, b0) {
                    outcomes.push(run(&replay, w, b, chose_d.dispatch));
                    n_replays += 1;
                }
            }
        }
    }
    let incumbent = Outcome {
        warm_slots: cur_w,
        bounded: cur_b,
        dispatch: chose_d.dispatch,
        ..chose_d
    };
    let (best, chosen) = pick(&outcomes, |o| o.same_settings(&incumbent));
    let kept = !first
        && q == cur_q
        && chosen.warm_slots == cur_w
        && chosen.bounded == cur_b
        && chosen.dispatch == cur_d;
    let w_out = keep_headroom(chosen.warm_slots, all, w_in_force);
    let why = format!(
        "{} q_cap {:.3}, W {}{}, {} sets: predicted p99 TTFT {:.2} s, e2e {:.2} s, hit {:.1}% on a replay of the last {:.0} s ({} requests) at {:.0}% load; {}; {} replays{}",
        match (kept, first) {
            (true, true) => "kept the engine-model estimates",
            (true, false) => "kept",
            (false, _) => "moved to",
        },
        chosen.q_cap,
        w_out,
        if w_out != chosen.warm_slots {
            format!(" (W {} admits every key; the larger W stays for drift)", chosen.warm_slots)
        } else {
            String::new()
        },
        if chosen.bounded { "bounded" } else { "pinned" },
        chosen.ttft_p99,
        chosen.e2e_p99,
        100.0 * chosen.hit,
        span_s * PROBE,
        replay.len(),
        100.0 * PROBE,
        dispatch_line,
        n_replays,
        if !best.same_settings(&chosen) {
            format!(
                " (W {}, {} sets was within 10%)",
                best.warm_slots,
                if best.bounded { "bounded" } else { "pinned" }
            )
        } else {
            String::new()
        }
    );
    #[rustfmt::skip]
    let settings = Resolved { q_cap: chosen.q_cap, warm_slots: w_out, bounded_sets: chosen.bounded, dispatch: chosen.dispatch };
    Tuned { settings, why }
}

/// The W to install for a chosen `w`: when it admits every key seen (`all`), the W in force if
/// that is larger. Both admit the same keys now, but a W just at `all` leaves no room for the
/// keys and replicas that drift adds before the next tuning.
fn keep_headroom(w: u64, all: u64, in_force: u64) -> u64 {
    if w >= all {
        w.max(in_force)
    } else {
        w
    }
}

/// The W in force when it is a candidate, else the first candidate.
fn cur_w_or(ws: &[u64], cur: u64) -> u64 {
    if ws.contains(&cur) {
        cur
    } else {
        ws[0]
    }
}

fn replay_one(
    t: &TuneInput,
    (q, w, b, d): (f64, u64, bool, Dispatch),
    replay: &[TraceRecord],
    span_s: f64,
    (mean_prompt, mean_output): (f64, f64),
) -> Outcome {
    let policy = CacheRouteConfig {
        q_cap: Setting::from_number(q),
        warm_slots: Setting::from_number(w),
        bounded_sets: Setting::Fixed(b),
        plan: Setting::Fixed(d.plan),
        cold_tail: Setting::Fixed(d.cold_tail),
        load: Setting::Fixed(d.load),
        autotune: false,
        ..t.policy.clone()
    };
    let cfg = SimConfig {
        destinations: t.destinations,
        engine: t.engine.clone(),
        policy: PolicySpec::Cacheroute(policy),
        seed: t.seed,
        failures: Vec::new(),
        horizon_s: f64::INFINITY,
        warm_start: Some(WarmStart {
            rates: t.rates.to_vec(),
            mean_prompt_tokens: mean_prompt,
            mean_output_tokens: mean_output,
        }),
        seed_first_window: false,
        router_replicas: 1,
    };
    let worst = Outcome {
        q_cap: q,
        warm_slots: w,
        bounded: b,
        dispatch: d,
        ttft_p99: f64::INFINITY,
        e2e_p99: f64::INFINITY,
        hit: 0.0,
    };
    let Ok(out) = simulate(cfg, replay.iter().cloned()) else {
        return worst;
    };
    let s = out.summary(span_s / 3.0, f64::INFINITY);
    if s.errors > 0 || s.completed == 0 {
        return worst;
    }
    Outcome {
        q_cap: q,
        warm_slots: w,
        bounded: b,
        dispatch: d,
        ttft_p99: s.ttft_p99_s,
        e2e_p99: s.e2e_p99_s,
        hit: s.served_kv_hit,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_stay_in_range_and_move_by_bounded_steps() {
        assert_eq!(w_candidates(40, 300, true), vec![1, 10, 40, 160, 300]);
        assert_eq!(w_candidates(40, 100, true), vec![1, 10, 40, 100]);
        assert_eq!(w_candidates(1, 300, false), vec![1, 2]);
        assert_eq!(w_candidates(100, 300, false), vec![50, 100, 200]);
    }

    fn outcome(dispatch: Dispatch, ttft_p99: f64, e2e_p99: f64) -> Outcome {
        Outcome {
            q_cap: 1.0,
            warm_slots: 8,
            bounded: false,
            dispatch,
            ttft_p99,
            e2e_p99,
            hit: 0.5,
        }
    }

    /// A challenger replaces the dispatch in force only when it beats it by more than the
    /// hysteresis at the probe load, and holds at the higher load: the flagship's reactive
    /// dispatch wins at 125% and collapses at 160% (figures of one of its tunings), so the plan
    /// stays; where it wins at both, it is taken.
    #[test]
    fn a_dispatch_switch_needs_a_clear_gain_and_must_hold_at_the_higher_load() {
        let (plan, reactive) = (Dispatch::PLANNED, Dispatch::REACTIVE);
        let in_force = |o: &Outcome| o.dispatch == plan;
        // Within 10%: kept.
        let close = [outcome(plan, 1.0, 4.0), outcome(reactive, 0.95, 3.9)];
        assert_eq!(pick(&close, in_force).1.dispatch, plan);
        // Clearly better at the probe load: chosen there...
        let probe = [outcome(plan, 2.21, 4.28), outcome(reactive, 0.75, 2.74)];
        assert_eq!(pick(&probe, in_force).1.dispatch, reactive);
        // ... but not confirmed when it collapses at the higher load,
        assert!(!holds_at_high(
            &outcome(plan, 3.36, 9.14),
            &outcome(reactive, 35.36, 47.29)
        ));
        // and confirmed when it holds there.
        assert!(holds_at_high(
            &outcome(plan, 2.95, 13.51),
            &outcome(reactive, 2.10, 12.74)
        ));
        // Failed requests score worst: never confirmed.
        assert!(!holds_at_high(
            &outcome(plan, 3.0, 9.0),
            &outcome(reactive, f64::INFINITY, f64::INFINITY)
        ));
    }

    /// A W that admits everything keeps the larger W in force; a smaller W is installed as is.
    #[test]
    fn headroom() {
        assert_eq!(keep_headroom(6, 6, 19), 19);
        assert_eq!(keep_headroom(6, 6, 3), 6);
        assert_eq!(keep_headroom(4, 6, 19), 4);
    }

    /// q_cap keeps its value while the estimate stays within 25% of it, and follows a larger
    /// shift (in either direction).
    #[test]
    fn q_cap_follows_only_a_clear_shift_of_the_estimate() {
        assert_eq!(follow_estimate(1.0, 1.2), 1.0);
        assert_eq!(follow_estimate(1.0, 0.8), 1.0);
        assert_eq!(follow_estimate(1.0, 1.3), 1.3);
        assert_eq!(follow_estimate(1.0, 0.7), 0.7);
        assert_eq!(follow_estimate(0.0, 0.7), 0.7);
    }

    /// "Every key" counts each key's k_b replicas: 10 keys over 3 destinations at q_cap 1,
    /// two of them at 2.5 req/s (k_b = 3), need ⌈(8 + 6) / 3⌉ = 5 slots each, not ⌈10 / 3⌉ = 4
    /// (with 4 the tuner's "all" candidate left keys out). Keys sending nothing need none.
    #[test]
    fn all_counts_replicas() {
        let key = |i: u64, rate: f64| KeyLoad {
            key: i,
            rate,
            prefix_tokens: 0.0,
        };
        let mut rates: Vec<KeyLoad> = (0..8).map(|i| key(i, 0.5)).collect();
        rates.push(key(8, 2.5));
        rates.push(key(9, 2.5));
        rates.push(key(10, 0.0));
        assert_eq!(all_slots(&rates, 1.0, 3), 5);
        assert_eq!(all_slots(&rates, 10.0, 3), 4);
        assert_eq!(all_slots(&[], 1.0, 3), 1);
    }
}
