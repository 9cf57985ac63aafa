//! CacheRoute's controller: the one piece of code that turns measured traffic into plans, used
//! by the simulator (`sim`, on its virtual clock) and the live router (`router::control`, on
//! its own thread and clock). Neither keeps control state of its own: each feeds requests in
//! ([`Controller::observe`]), closes a window when its clock says so
//! ([`Controller::close_window`], then [`Controller::build`]) and installs what comes back.
//!
//! Per window: the rate meter's interval closes (an EWMA of per-key rates, [`RateMeter`]); the
//! history keeps the last `stale_intervals + 1` windows and plans from the oldest (staleness);
//! every `retune_intervals` plans a [`Tuner`] may choose q_cap, W, bounded sets by replaying
//! the recent window (the simulator's replay through the engine model, `sim::tune`); q_cap and
//! W are resolved (configured > tuned > the [`Defaults`]); the plan is built fresh or replanned
//! churn-aware from the plan in force; and a [`PlanRecord`] says what was installed and why.
//!
//! What differs between the simulator and the router is explicit, in [`ControlOptions`]:
//! - `defaults`: what q_cap and W are when neither configured nor tuned. The simulator always
//!   knows its engine model ([`Defaults::EngineModel`]: estimates from the mean request shape);
//!   a router without `--engine` cannot, and uses [`Defaults::FairShare`] (q_cap = measured
//!   total rate / live destinations, a fixed W).
//! - `seed_first_window`: the router seeds the meter with the first window's raw rates, so its
//!   first plans do not see an EWMA climbing from zero; the simulator's studies start the EWMA
//!   from zero and measure after a warm-up (their published figures were taken that way).
//! - The tuner: the simulator always has one (its engine model); a router only with `--engine`.
//!
//! Pure logic: no clock (times and window lengths are passed in), no I/O, no randomness but
//! the seed the tuner is given.

use crate::analysis::record::{PlanRecord, Resolved};
use crate::engine::EngineConfig;
use crate::plan::{self, meter::RateMeter, KeyLoad, Plan, PlannerConfig};
use crate::policy::cacheroute::CacheRouteConfig;
use crate::policy::calibrate::{estimate_q_cap, estimate_warm_slots, WarmStart};
use crate::workload::trace::TraceRecord;
use std::collections::VecDeque;

/// What q_cap and W are when the configuration leaves them at 0 and no tuning chose them.
#[derive(Debug, Clone)]
pub enum Defaults {
    /// The engine model's estimates for the mean request shape seen so far
    /// ([`estimate_q_cap`], [`estimate_warm_slots`]), each taken once and then kept.
    EngineModel(Box<EngineConfig>),
    /// q_cap = measured total rate / live destinations (a key hotter than a fair share is
    /// replicated), recomputed every plan; W fixed.
    FairShare { warm_slots: u64 },
}

/// The controller's parameters beyond the policy's own.
#[derive(Debug, Clone)]
pub struct ControlOptions {
    pub destinations: usize,
    /// Tokens per prefix block (the planner's byte-aware slots).
    pub block_tokens: u32,
    pub defaults: Defaults,
    /// The first window's raw rates seed the meter (see the module doc).
    pub seed_first_window: bool,
}

/// What a tuning is asked.
pub struct TuneRequest<'a> {
    pub destinations: usize,
    /// The policy as configured (its automatic settings are the ones to tune).
    pub policy: &'a CacheRouteConfig,
    /// Recent arrivals in order (timestamps in ms).
    pub window: &'a [TraceRecord],
    /// The rates the next plan is built from.
    pub rates: &'a [KeyLoad],
    /// The values in force (`None` before the first tuning).
    pub current: Option<Resolved>,
}

/// A tuning's outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuned {
    pub settings: Resolved,
    /// One line: what was compared and why these values.
    pub why: String,
}

/// Chooses the dispatch, q_cap, W and bounded sets for the next plans
/// (`sim::tune::ReplayTuner`).
pub trait Tuner: Send {
    fn tune(&self, req: &TuneRequest<'_>) -> Tuned;
}

/// The most requests a tuning replays (the recent window's newest); a live window keeps no
/// more than this.
pub const MAX_REPLAY: usize = 20_000;

/// Makes a [`Tuner`] for an engine model and a seed. The live router is given one by whoever
/// starts it (the command line passes the simulator's replay, `sim::tune::replay_tuner`), so
/// the router replays through the engine model without importing the simulator.
#[derive(Clone)]
pub struct TunerFactory(
    pub std::sync::Arc<dyn Fn(EngineConfig, u64) -> Box<dyn Tuner> + Send + Sync>,
);

impl std::fmt::Debug for TunerFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TunerFactory")
    }
}

/// A window closed and ready to plan: the rates and the values the plan is built with.
#[derive(Debug, Clone)]
pub struct Step {
    pub rates: Vec<KeyLoad>,
    pub planner: PlannerConfig,
    /// The settings the plan is built with (the caller applies `bounded_sets` to the policy).
    pub settings: Resolved,
    /// Set when this step tuned: the tuning's line.
    pub tuned: Option<String>,
}

/// A plan to install and its record.
#[derive(Debug)]
pub struct Decision {
    pub plan: Plan,
    pub record: PlanRecord,
}

/// The controller's state (see the module doc).
pub struct Controller {
    cfg: CacheRouteConfig,
    opts: ControlOptions,
    tuner: Option<Box<dyn Tuner>>,
    meter: RateMeter,
    /// Until the meter is seeded (with `seed_first_window`): the first window's raw counts.
    first: Option<RateMeter>,
    history: VecDeque<Vec<KeyLoad>>,
    sum_prompt: f64,
    sum_output: f64,
    n: u64,
    /// Engine-model estimates, once taken (`Defaults::EngineModel`).
    est_q: Option<f64>,
    est_w: Option<u64>,
    /// The tuning's values in force, and plans built since it ran.
    tuned: Option<Resolved>,
    since_tune: u32,
    /// The last tuning's line.
    last_tuning: Option<String>,
    /// The settings of the last plan built (repairs keep them).
    in_force: Resolved,
}

impl Controller {
    /// A controller for `cfg`; `tuner` is consulted only when the configuration leaves
    /// something automatic (q_cap, W or bounded sets) and `autotune` is on.
    pub fn new(cfg: CacheRouteConfig, opts: ControlOptions, tuner: Option<Box<dyn Tuner>>) -> Self {
        let wants = cfg.autotune && cfg.automatic();
        Self {
            meter: RateMeter::new(cfg.rate_alpha),
            first: opts.seed_first_window.then(|| RateMeter::new(1.0)),
            tuner: tuner.filter(|_| wants),
            history: VecDeque::new(),
            sum_prompt: 0.0,
            sum_output: 0.0,
            n: 0,
            est_q: None,
            est_w: None,
            tuned: None,
            since_tune: 0,
            last_tuning: None,
            in_force: Resolved {
                q_cap: cfg.q_cap.number(),
                warm_slots: cfg.warm_slots.number(),
                bounded_sets: cfg.bounded_sets.or_else(|| false),
                dispatch: cfg.default_dispatch(),
            },
            cfg,
            opts,
        }
    }

    pub fn config(&self) -> &CacheRouteConfig {
        &self.cfg
    }

    /// Whether a tuner chooses values (self-calibration).
    pub fn tunes(&self) -> bool {
        self.tuner.is_some()
    }

    /// The last tuning's line.
    pub fn last_tuning(&self) -> Option<&str> {
        self.last_tuning.as_deref()
    }

    /// One request seen: its key, prompt tokens and (where known) output tokens.
    pub fn observe(&mut self, key: u64, prompt_tokens: u32, output_tokens: u32) {
        match &mut self.first {
            Some(m) => m.record(key, prompt_tokens),
            None => self.meter.record(key, prompt_tokens),
        }
        self.sum_prompt += prompt_tokens as f64;
        self.sum_output += output_tokens as f64;
        self.n += 1;
    }

    /// Start the meter from measured rates (a state file, a previous period): the next plans
    /// see them at full weight, not an EWMA climbing from zero.
    pub fn seed(&mut self, rates: &[KeyLoad]) {
        self.meter.seed(rates);
        self.first = None;
    }

    /// Plan at `now_s` from a previous period (`ws`), as if one interval had just closed; the
    /// history then starts empty. The simulator's warm start.
    pub fn warm_start(
        &mut self,
        ws: &WarmStart,
        now_s: f64,
        down: &[bool],
        prev: Option<&Plan>,
    ) -> Option<Decision> {
        self.sum_prompt = ws.mean_prompt_tokens;
        self.sum_output = ws.mean_output_tokens;
        self.n = 1;
        self.seed(&ws.rates);
        self.history.push_back(ws.rates.clone());
        let step = self.step(down, &[]);
        self.history.clear();
        self.build(step?.ok()?, now_s, prev, down).ok()
    }

    /// Close a window of `window_s` seconds: the meter's interval, the history, and — when the
    /// history is deep enough and something was measured — the step to plan from. `down`: the
    /// destinations down now; `recent`: the arrivals a tuning may replay. `None`: nothing to
    /// plan this time; `Err`: nothing can be planned (no destination is up).
    pub fn close_window(
        &mut self,
        window_s: f64,
        down: &[bool],
        recent: &[TraceRecord],
    ) -> Option<Result<Step, String>> {
        let window_s = window_s.max(1e-3);
        let rates = match self.first.take() {
            Some(mut first) => {
                let rates = first.close_interval(window_s);
                if rates.is_empty() {
                    self.first = Some(first);
                } else {
                    self.meter.seed(&rates);
                }
                rates
            }
            None => self.meter.close_interval(window_s),
        };
        self.history.push_back(rates);
        while self.history.len() > self.cfg.stale_intervals as usize + 1 {
            self.history.pop_front();
        }
        if self.history.len() <= self.cfg.stale_intervals as usize {
            return None;
        }
        self.step(down, recent)
    }

    /// The step from the oldest rates in the history (tuning first when due).
    fn step(&mut self, down: &[bool], recent: &[TraceRecord]) -> Option<Result<Step, String>> {
        let rates = self.history.front().cloned().unwrap_or_default();
        self.step_from(rates, down, recent)
    }

    /// The step from rates measured elsewhere (router replicas sharing one plan: the sum of
    /// every replica's rates), planned as [`Controller::close_window`] plans its own; the meter
    /// and the history are left as they are. `None` when `rates` is empty.
    pub fn step_from(
        &mut self,
        rates: Vec<KeyLoad>,
        down: &[bool],
        recent: &[TraceRecord],
    ) -> Option<Result<Step, String>> {
        if rates.is_empty() {
            return None;
        }
        let r_live = down.iter().filter(|d| !**d).count();
        if r_live == 0 {
            return Some(Err("no destination is up; nothing to plan for".into()));
        }
        let mut tuned_now = None;
        if let Some(tuner) = self.tuner.as_ref().filter(|_| !recent.is_empty()) {
            if self.tuned.is_none() || self.since_tune + 1 >= self.cfg.retune_intervals {
                let t = tuner.tune(&TuneRequest {
                    destinations: self.opts.destinations,
                    policy: &self.cfg,
                    window: recent,
                    rates: &rates,
                    current: self.tuned,
                });
                self.tuned = Some(t.settings);
                self.since_tune = 0;
                self.last_tuning = Some(t.why.clone());
                tuned_now = Some(t.why);
            } else {
                self.since_tune += 1;
            }
        }
        let settings = self.resolve(&rates, r_live);
        let planner = self.cfg.planner(
            self.opts.destinations,
            settings.q_cap,
            settings.warm_slots,
            self.opts.block_tokens,
        );
        Some(Ok(Step {
            rates,
            planner,
            settings,
            tuned: tuned_now,
        }))
    }

    /// The one resolution of CacheRoute's settings: each as configured, else as tuned, else
    /// the defaults (bounded sets: pinned).
    fn resolve(&mut self, rates: &[KeyLoad], r_live: usize) -> Resolved {
        let (mean_prompt, mean_output) = (
            self.sum_prompt / self.n.max(1) as f64,
            self.sum_output / self.n.max(1) as f64,
        );
        let tuned = self.tuned;
        let q_cap = self
            .cfg
            .q_cap
            .or_else(|| match (tuned, &self.opts.defaults) {
                (Some(t), _) => t.q_cap,
                (None, Defaults::EngineModel(e)) => *self
                    .est_q
                    .get_or_insert_with(|| estimate_q_cap(e, mean_prompt, mean_output)),
                (None, Defaults::FairShare { .. }) => {
                    let total: f64 = rates.iter().map(|k| k.rate).sum();
                    (total / r_live as f64).max(1e-6)
                }
            });
        let warm_slots = self
            .cfg
            .warm_slots
            .or_else(|| match (tuned, &self.opts.defaults) {
                (Some(t), _) => t.warm_slots,
                (None, Defaults::EngineModel(e)) => *self
                    .est_w
                    .get_or_insert_with(|| estimate_warm_slots(e, mean_prompt)),
                (None, Defaults::FairShare { warm_slots }) => *warm_slots,
            });
        let bounded_sets = self
            .cfg
            .bounded_sets
            .or_else(|| tuned.is_some_and(|t| t.bounded_sets));
        let dispatch = match tuned {
            Some(t) => self.cfg.configured_dispatch(t.dispatch),
            None => self.cfg.default_dispatch(),
        };
        Resolved {
            q_cap,
            warm_slots,
            bounded_sets,
            dispatch,
        }
    }

    /// Build the step's plan at `now_s`: churn-aware from `prev` when configured, fresh
    /// otherwise; the record says what it is.
    pub fn build(
        &mut self,
        step: Step,
        now_s: f64,
        prev: Option<&Plan>,
        down: &[bool],
    ) -> Result<Decision, String> {
        let prev_sets = prev.map(|p| p.key_sets());
        let result = match (&prev_sets, self.cfg.churn_aware) {
            (Some(sets), true) => plan::replan(&step.planner, &step.rates, sets, Some(down)),
            _ => plan::build(&step.planner, &step.rates, Some(down)),
        };
        let p = result.map_err(|e| format!("planning failed: {e}"))?;
        let churn = prev_sets.as_ref().map_or(1.0, |s| plan::churn(s, &p));
        self.in_force = step.settings;
        let mut record = record(&p, now_s, churn, false, Some(step.settings));
        record.tuning = step.tuned;
        Ok(Decision { record, plan: p })
    }

    /// The plan in force repaired for `down` (its keys on failed destinations moved, nothing
    /// else): `None` when every destination is down or nothing can be repaired.
    pub fn repair(&self, prev: &Plan, down: &[bool], now_s: f64) -> Option<Decision> {
        repair(prev, down, now_s, Some(self.in_force))
    }
}

/// `prev` repaired for `down` with its record (the settings as given): `None` when every
/// destination is down or the repair fails. Also for plans the controller did not build (a
/// router's plan file).
pub fn repair(
    prev: &Plan,
    down: &[bool],
    now_s: f64,
    settings: Option<Resolved>,
) -> Option<Decision> {
    if down.iter().all(|d| *d) {
        return None;
    }
    let q = plan::repair(prev, down).ok()?;
    let churn = plan::churn(&prev.key_sets(), &q);
    Some(Decision {
        record: record(&q, now_s, churn, true, settings),
        plan: q,
    })
}

/// The record of plan `p` built with `settings` (`None`: not known, as for a plan file's).
pub fn record(
    p: &Plan,
    at_s: f64,
    churn: f64,
    repair: bool,
    settings: Option<Resolved>,
) -> PlanRecord {
    PlanRecord {
        at_s,
        admitted: p.admitted(),
        admitted_share: p.admitted_share(),
        imbalance: p.imbalance(),
        churn,
        repair,
        build_ms: None,
        q_cap: settings.map(|s| s.q_cap),
        warm_slots: settings.map(|s| s.warm_slots),
        bounded_sets: settings.map(|s| s.bounded_sets),
        dispatch: settings.map(|s| s.dispatch),
        replicas: Some(p.replicas()),
        tuning: None,
    }
}
