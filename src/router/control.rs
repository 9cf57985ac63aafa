//! CacheRoute's control loop in the live router: the clock, thread and inputs around the one
//! controller the simulator runs too ([`crate::control::Controller`]). Every control interval
//! the requests seen are fed to it, its window closed, and the plan it builds (fresh or
//! churn-aware) installed atomically (an `Arc<Plan>` swapped under the policy lock). When a
//! destination goes down the installed plan is repaired at once ([`plan::repair`]). With a plan file, that plan is
//! installed at start and on reload, and nothing is planned online.
//!
//! The loop runs on its own thread with its own clock, so a request never waits for planning:
//! the request path only appends `(key, prompt tokens)` to a buffer the loop swaps out.
//!
//! Cold start: the first plan does not wait for a whole interval. Until one is installed the
//! loop looks every second and plans as soon as [`FIRST_PLAN_MIN_REQUESTS`] requests were seen
//! (at least [`FIRST_PLAN_MIN_S`] after start); that first window's raw rates seed the meter,
//! so the smoothing does not start from zero. With `initial_plan` the plan is installed at
//! start, and when the file is a state file a previous run wrote at shutdown (`state_file`),
//! its measured rates seed the meter too.
//!
//! Parameters the router cannot know (the simulator derives them from its engine model):
//! `q_cap = 0` means "the measured total rate / live destinations" (a key hotter than a fair
//! share is replicated), `warm_slots = 0` means [`DEFAULT_WARM_SLOTS`] keys per destination.
//!
//! Time: the controller works in the engine model's time. With backends `time_scale` times
//! faster than the model (emulators in a local study) an interval lasts `interval_s /
//! time_scale` wall seconds, a window of `w` wall seconds is closed as `w · time_scale` (its
//! rates in the model's req/s, as q_cap is), and the arrivals a tuning replays are stretched by
//! `time_scale`. Every one of these conversions is a method of the config's
//! [`crate::bounds::TimeScale`] (`wall_duration`, `to_model`, `to_wall`), never a bare factor.

use super::config::RouterError;
use super::lock::Locked;
use super::state::{Cmd, Counters, Installed, Shared, Source};
use crate::control::{ControlOptions, Controller, Defaults};
use crate::plan::{self, KeyLoad, KeyMap, Plan};
use crate::policy::cacheroute::CacheRouteConfig;
use crate::policy::PolicySpec;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Warm slots per destination when the policy leaves `warm_slots` at 0.
pub const DEFAULT_WARM_SLOTS: u64 = 1024;

/// Requests seen before the first plan is built ahead of the first interval's end.
pub const FIRST_PLAN_MIN_REQUESTS: usize = 100;

/// The earliest first plan, in seconds after start (a window shorter than this says little).
pub const FIRST_PLAN_MIN_S: f64 = 1.0;

/// Key names kept at most (header or `user` text of measured keys, for `/admin/plan`): the
/// first seen win, and names of keys no longer measured are dropped every interval.
pub use crate::bounds::MAX_KEY_NAMES;

/// The `format` of the state file the router writes at shutdown.
pub use crate::plan::file::STATE_FORMAT;

/// Start the loop if the policy uses plans; install the plan file first (errors surface here).
pub(crate) fn spawn(shared: &Arc<Shared>) -> Result<(), RouterError> {
    if !shared.uses_plan {
        return Ok(());
    }
    let PolicySpec::Cacheroute(cfg) = shared.cfg.policy.clone() else {
        return Ok(());
    };
    let mut engine = None;
    if shared.cfg.self_calibrates() {
        let spec = shared.cfg.engine.as_deref().unwrap_or_default();
        // `self_calibrates` holds only with an engine model.
        let e = shared
            .cfg
            .engine_model()
            .ok_or_else(|| RouterError::Client("self-calibration needs --engine".into()))?
            .map_err(|e| RouterError::Client(format!("engine `{spec}`: {e}")))?;
        tracing::info!(
            engine = spec,
            "CacheRoute self-calibrates{}{}{}: every {} intervals it replays its recent traffic \
             through the {spec} engine model",
            if cfg.q_cap <= 0.0 { " q_cap" } else { "" },
            if cfg.warm_slots == 0 { " W" } else { "" },
            if cfg.bounded_sets.is_none() {
                " bounded-sets"
            } else {
                ""
            },
            cfg.retune_intervals
        );
        engine = Some(e);
    } else if shared.cfg.plan_file.is_none() {
        if cfg.autotune && shared.cfg.engine.is_none() {
            tracing::info!("CacheRoute does not self-calibrate without --engine (the engines' model:device:precision:tpN)");
        } else if cfg.autotune && shared.cfg.tuner.is_none() {
            tracing::warn!("CacheRoute does not self-calibrate: the router was started with an engine model but no replay tuner (RouterConfig::tuner)");
        }
        if cfg.q_cap <= 0.0 {
            tracing::warn!("q_cap not set: each plan uses the measured total rate / live destinations (a key hotter than a fair share is replicated); set --q-cap from `cacheroute calibrate` or your engine's knee");
        }
        if cfg.warm_slots == 0 {
            tracing::warn!("warm_slots not set: {DEFAULT_WARM_SLOTS} keys per destination; set --warm-slots from your engines' KV capacity (cacheroute calibrate suggests W)");
        }
    }
    let mut ctl = Control::new(shared, cfg, engine);
    if let Some(path) = shared
        .cfg
        .plan_file
        .clone()
        .or_else(|| shared.cfg.initial_plan.clone())
    {
        ctl.load_file(&path)?;
    }
    if let Some(st) = shared.plan_store.clone() {
        // The stored plan is installed before the first request is served (no cold start).
        // A plain thread: etcd's blocking client must not be made on the async runtime.
        let (sharer, first) =
            std::thread::scope(|sc| sc.spawn(|| super::etcd::start(shared, st)).join())
                .map_err(|_| {
                    RouterError::Client("starting the plan's sharing through etcd failed".into())
                })?
                .map_err(RouterError::Client)?;
        ctl.sharer = Some(sharer);
        if let Some(r) = first {
            ctl.install_shared(r);
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    *shared.control.locked() = Some(tx);
    std::thread::Builder::new()
        .name("cacheroute-control".into())
        .spawn(move || ctl.run(rx))
        .map_err(|e| RouterError::Client(format!("starting the control thread: {e}")))?;
    Ok(())
}

/// The router's side of CacheRoute's controller ([`crate::control`]): its clock and thread,
/// the request batches it feeds in, plan files, key names, and installing into [`Shared`].
struct Control {
    s: Arc<Shared>,
    ctl: Controller,
    names: Option<Arc<KeyMap<String>>>,
    /// Rates of the plan being installed (kept with it in [`Installed`]).
    rates: Arc<Vec<KeyLoad>>,
    /// Names of measured keys seen with one (at most [`MAX_KEY_NAMES`]).
    known: KeyMap<Box<str>>,
    /// `--etcd`: the plan is shared with the other replicas (`etcd.rs`).
    sharer: Option<super::etcd::Sharer>,
}

impl Control {
    /// The controller with the router's options: no engine model, no estimates (q_cap a fair
    /// share, W = [`DEFAULT_WARM_SLOTS`]); the first window seeds the meter; `engine`: the
    /// model the self-calibration replays through.
    fn new(
        s: &Arc<Shared>,
        cfg: CacheRouteConfig,
        engine: Option<crate::engine::EngineConfig>,
    ) -> Self {
        let opts = ControlOptions {
            destinations: s.fleet.dests.len(),
            block_tokens: s.cfg.block_tokens,
            defaults: Defaults::FairShare {
                warm_slots: DEFAULT_WARM_SLOTS,
            },
            seed_first_window: true,
        };
        let tuner = engine
            .zip(s.cfg.tuner.as_ref())
            .map(|(engine, make)| (make.0)(engine, s.cfg.seed));
        Self {
            s: s.clone(),
            ctl: Controller::new(cfg, opts, tuner),
            names: None,
            rates: Arc::new(Vec::new()),
            known: KeyMap::default(),
            sharer: None,
        }
    }

    fn run(mut self, rx: Receiver<Cmd>) {
        // The interval is the model's (`time_scale`): this many wall seconds.
        let interval = self
            .clock()
            .wall_duration(self.ctl.config().interval_s.max(1e-3));
        let online = self.s.cfg.plan_file.is_none();
        let mut window_start = Instant::now();
        let mut next = window_start + interval;
        let early = Duration::from_secs_f64(FIRST_PLAN_MIN_S);
        loop {
            // Until a first plan is in, look every second whether enough traffic was seen.
            let cold = online && self.s.plan().is_none() && self.ctl.config().stale_intervals == 0;
            let deadline = if cold {
                next.min(Instant::now() + early)
            } else {
                next
            };
            let wait = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Cmd::Repair) => self.repair(),
                Ok(Cmd::Shared(r)) => self.install_shared(*r),
                Ok(Cmd::Reload(reply)) => {
                    let r = if let Some(path) = self.s.cfg.plan_file.clone() {
                        self.load_file(&path).map_err(|e| e.to_string())
                    } else {
                        let r = self.tick(window_start.elapsed().as_secs_f64());
                        window_start = Instant::now();
                        next = window_start + interval;
                        r
                    };
                    let _ = reply.send(r.map(|_| summary(&self.s)));
                }
                Err(RecvTimeoutError::Timeout) if cold && Instant::now() < next => {
                    let seen = self.s.pending.as_ref().map_or(0, |p| p.locked().len());
                    if seen >= FIRST_PLAN_MIN_REQUESTS && window_start.elapsed() >= early {
                        let _ = self.tick(window_start.elapsed().as_secs_f64());
                        window_start = Instant::now();
                        next = window_start + interval;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if online {
                        let _ = self.tick(window_start.elapsed().as_secs_f64());
                    }
                    window_start = Instant::now();
                    next = window_start + interval;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    if let Some(sh) = &self.sharer {
                        sh.stop();
                    }
                    return;
                }
            }
        }
    }

    /// How many times faster than the engine model the backends run (`time_scale`).
    fn clock(&self) -> crate::bounds::TimeScale {
        self.s.cfg.time_scale
    }

    /// Close the window of `wall_s` wall seconds and plan (the simulator's `control_tick`);
    /// the controller sees it in the model's time.
    fn tick(&mut self, wall_s: f64) -> Result<(), String> {
        let window_s = self.s.model_secs(wall_s);
        let batch = match &self.s.pending {
            Some(p) => std::mem::take(&mut *p.locked()),
            None => Vec::new(),
        };
        for (key, tokens, name) in batch {
            self.ctl.observe(key, tokens, 0);
            self.learn(key, name);
        }
        let down = self.s.fleet.down_mask();
        let recent = self.recent();
        let t0 = Instant::now();
        let step = self.ctl.close_window(window_s, &down, &recent);
        let closed_ms = t0.elapsed().as_secs_f64() * 1e3;
        if let (Some(Ok(step)), false) = (&step, self.known.is_empty()) {
            let measured: KeyMap<()> = step.rates.iter().map(|k| (k.key, ())).collect();
            self.known.retain(|k, _| measured.contains_key(k));
        }
        if let Some(sh) = &self.sharer {
            // Shared: publish the rates; the leader plans from every replica's and writes.
            let local = match &step {
                Some(Ok(st)) => st.rates.as_slice(),
                _ => &[],
            };
            if let Some(r) = sh.tick(&self.s, &mut self.ctl, local, &down, &recent) {
                self.install_shared(r);
            }
            return Ok(());
        }
        let step = match step {
            None => return Ok(()),
            Some(Err(e)) => return Err(e),
            Some(Ok(step)) => step,
        };
        if let Some((why, bounded)) = &step.tuned {
            self.s.set_bounded_sets(*bounded);
            tracing::info!(
                q_cap = step.q_cap,
                warm_slots = step.warm_slots,
                bounded_sets = bounded,
                replayed = recent.len(),
                tuning_ms = closed_ms,
                "self-calibration: {why}"
            );
        }
        let rates = step.rates.clone();
        let prev = self.s.plan();
        let t0 = Instant::now();
        let result = self.ctl.build(step, self.s.now(), prev.as_deref(), &down);
        let build_s = t0.elapsed().as_secs_f64();
        match result {
            Ok(mut d) => {
                d.plan.build_ms = build_s * 1e3;
                let c = &self.s.counters;
                c.plan_build_seconds_last.store(build_s.to_bits(), Relaxed);
                Counters::add_f64(&c.plan_build_seconds_sum, build_s);
                self.names = self.names_of(&d.plan);
                self.rates = Arc::new(rates);
                self.install(
                    d.plan,
                    Source::Measured,
                    d.record.churn,
                    // The controller records the q_cap and W of every plan it builds.
                    d.record.q_cap.unwrap_or(0.0),
                    d.record.warm_slots.unwrap_or(0),
                );
                Ok(())
            }
            Err(e) => {
                self.s.counters.plan_failures.fetch_add(1, Relaxed);
                tracing::warn!("{e}; the plan in force stays");
                Err(e)
            }
        }
    }

    /// The arrivals of the last two intervals, for a tuning's replays (empty when the
    /// controller does not tune or nothing is recorded), at the model's pace: the arrival
    /// times stretched by `time_scale`.
    fn recent(&self) -> Vec<crate::workload::trace::TraceRecord> {
        let Some(window) = self.s.window.as_ref().filter(|_| self.ctl.tunes()) else {
            return Vec::new();
        };
        // Milliseconds, scaled both ways by the time scale: the span in wall ms, the replayed
        // arrivals in the model's ms.
        let clock = self.clock();
        let span_ms = clock.to_wall(2.0 * self.ctl.config().interval_s.max(1e-3) * 1e3);
        let w = window.locked();
        let newest = w.back().map_or(0.0, |r| r.timestamp_ms);
        w.iter()
            .filter(|r| r.timestamp_ms >= newest - span_ms)
            .map(|r| crate::workload::trace::TraceRecord {
                timestamp_ms: clock.to_model(r.timestamp_ms),
                ..r.clone()
            })
            .collect()
    }

    /// The names known of `p`'s keys.
    fn names_of(&self, p: &Plan) -> Option<Arc<KeyMap<String>>> {
        (!self.known.is_empty()).then(|| {
            Arc::new(
                p.entries
                    .iter()
                    .filter_map(|e| self.known.get(&e.key).map(|n| (e.key, n.to_string())))
                    .collect(),
            )
        })
    }

    /// Install a plan the replicas share: read from etcd by the watch, or written by this
    /// replica as the leader; one not newer than the plan in force is dropped.
    fn install_shared(&mut self, r: super::etcd::Received) {
        let Some(sh) = &self.sharer else { return };
        if !sh.take(&r.meta) {
            return;
        }
        if let Some(b) = r.bounded_sets {
            self.s.set_bounded_sets(b);
        }
        let prev = self.s.plan().map(|p| p.key_sets());
        let churn = prev.map_or(1.0, |s| plan::churn(&s, &r.plan));
        self.names = self.names_of(&r.plan);
        self.rates = Arc::new(r.rates);
        let plan = repaired_for(r.plan, &self.s.fleet.down_mask());
        self.install(plan, Source::Shared, churn, r.q_cap, r.warm_slots);
    }

    /// Remember `key`'s name (first seen wins, at most [`MAX_KEY_NAMES`]).
    fn learn(&mut self, key: u64, name: Option<Box<str>>) {
        if let Some(n) = name {
            if self.known.len() < MAX_KEY_NAMES || self.known.contains_key(&key) {
                self.known.entry(key).or_insert(n);
            }
        }
    }

    fn install(&mut self, p: Plan, source: Source, churn: f64, q_cap: f64, warm_slots: u64) {
        tracing::info!(
            source = source.label(),
            admitted = p.admitted(),
            measured = self.rates.len(),
            admitted_share = p.admitted_share(),
            imbalance = p.imbalance(),
            q_cap,
            warm_slots,
            churn,
            build_ms = p.build_ms,
            down = p.down.iter().filter(|d| **d).count(),
            "plan installed ({}): {} keys admitted, imbalance {:.3}, W {warm_slots}, q_cap {q_cap:.3}",
            source.label(),
            p.admitted(),
            p.imbalance()
        );
        let c = &self.s.counters;
        c.plans_installed.fetch_add(1, Relaxed);
        if source == Source::Repair {
            c.plan_repairs.fetch_add(1, Relaxed);
        }
        c.plan_churn_last.store(churn.to_bits(), Relaxed);
        c.plan_admitted.store(p.admitted() as u64, Relaxed);
        let plan = Arc::new(p);
        *self.s.installed.locked() = Some(Installed {
            plan: plan.clone(),
            source,
            at_s: self.s.now(),
            churn,
            q_cap,
            warm_slots,
            names: self.names.clone(),
            rates: self.rates.clone(),
            tuning: self.ctl.last_tuning().map(str::to_string),
            bounded_sets: self
                .ctl
                .tuned()
                .map(|t| t.2)
                .or(self.ctl.config().bounded_sets),
        });
        self.s.install_plan(plan);
    }

    fn repair(&mut self) {
        let Some(p) = self.s.plan() else { return };
        let in_force = self
            .s
            .installed
            .locked()
            .as_ref()
            .map_or((0.0, 0), |i| (i.q_cap, i.warm_slots));
        let down = self.s.fleet.down_mask();
        if let Some(d) = crate::control::repair(&p, &down, self.s.now(), in_force) {
            let r = d.record;
            let (q, w) = (r.q_cap.unwrap_or(0.0), r.warm_slots.unwrap_or(0));
            self.install(d.plan, Source::Repair, r.churn, q, w);
        }
    }

    /// Install a `cacheroute plan --out` JSON: its table (key name → destinations) exactly.
    fn load_file(&mut self, path: &std::path::Path) -> Result<(), RouterError> {
        let r = self.s.fleet.dests.len();
        let plan::file::PlanFile { sets, names, rates } =
            plan::file::read_plan_path(path, plan::file::Fleet::Exactly(r)).map_err(|msg| {
                RouterError::PlanFile {
                    path: path.display().to_string(),
                    msg,
                }
            })?;
        let plan = plan_from_sets(&sets, r).map_err(|msg| RouterError::PlanFile {
            path: path.display().to_string(),
            msg,
        })?;
        if !rates.is_empty() && self.s.cfg.plan_file.is_none() {
            self.ctl.seed(&rates);
        }
        self.rates = Arc::new(rates);
        let prev = self.s.plan().map(|p| p.key_sets());
        let churn = prev.map_or(1.0, |s| plan::churn(&s, &plan));
        self.names = Some(Arc::new(names));
        let plan = repaired_for(plan, &self.s.fleet.down_mask());
        self.install(plan, Source::File, churn, 0.0, 0);
        Ok(())
    }
}

/// `plan` with its keys on destinations down now moved (as it is when none or all are down).
fn repaired_for(plan: Plan, down: &[bool]) -> Plan {
    if down.iter().any(|d| *d) && !down.iter().all(|d| *d) {
        plan::repair(&plan, down).unwrap_or(plan)
    } else {
        plan
    }
}

/// Cut a state file's `(key, rate, prefix_tokens)` rows to at most `max`, so that the file
/// reads back: the admitted keys first, then the hottest measured ones. Whether it cut any.
fn keep_for_file(
    rows: &mut Vec<(u64, f64, f64)>,
    admitted: impl Fn(u64) -> bool,
    max: usize,
) -> bool {
    if rows.len() <= max {
        return false;
    }
    rows.sort_unstable_by(|a, b| {
        (admitted(b.0), b.1)
            .partial_cmp(&(admitted(a.0), a.1))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    rows.truncate(max);
    true
}

/// Write the installed plan and the rates it was built from to `path` (atomically: a
/// temporary file renamed over it), in the form [`plan::file::read_plan`] reads back.
pub(crate) fn save_state(s: &Shared, path: &std::path::Path) -> Result<(), String> {
    let inst = s.installed.locked().clone();
    let Some(i) = inst else {
        return Err("no plan was installed; nothing to save".into());
    };
    let mut dests: KeyMap<&[u16]> = KeyMap::default();
    for (n, e) in i.plan.entries.iter().enumerate() {
        dests.insert(e.key, i.plan.dests_of(n));
    }
    // Every measured key, then admitted keys the rates do not list (a plan file's).
    let mut rows: Vec<(u64, f64, f64)> = i
        .rates
        .iter()
        .map(|k| (k.key, k.rate, k.prefix_tokens))
        .collect();
    let measured: KeyMap<()> = i.rates.iter().map(|k| (k.key, ())).collect();
    rows.extend(
        i.plan
            .entries
            .iter()
            .filter(|e| !measured.contains_key(&e.key))
            .map(|e| (e.key, e.rate, 0.0)),
    );
    let measured_keys = rows.len();
    if keep_for_file(
        &mut rows,
        |k| dests.contains_key(&k),
        crate::bounds::MAX_PLAN_KEYS,
    ) {
        tracing::warn!(
            "state file {}: {measured_keys} keys measured, keeping the {} admitted and hottest (the most a plan file may hold)",
            path.display(),
            crate::bounds::MAX_PLAN_KEYS
        );
    }
    let keys: Vec<serde_json::Value> = rows
        .into_iter()
        .map(|(key, rate, prefix_tokens)| {
            let mut o = serde_json::json!({
                "key": format!("{key:016x}"),
                "destinations": dests.get(&key).copied().unwrap_or(&[]),
                "rate": rate,
                "prefix_tokens": prefix_tokens,
            });
            if let Some(n) = i.names.as_ref().and_then(|ns| ns.get(&key)) {
                super::json::set(&mut o, "name", serde_json::json!(n));
            }
            o
        })
        .collect();
    let doc = serde_json::json!({
        "format": STATE_FORMAT,
        "policy": s.label,
        "destinations": i.plan.destinations,
        "q_cap": i.q_cap,
        "warm_slots": i.warm_slots,
        "keys": keys,
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, doc.to_string()).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming onto {}: {e}", path.display()))
}

/// A [`Plan`] whose table is exactly `sets`, through the planner's public API: a churn-aware
/// replan against `sets` where every key's rate equals its set size at q_cap 1 (so k_b = |set|),
/// every key fits the slot budget, and the imbalance bound never forces a move.
pub(crate) fn plan_from_sets(sets: &KeyMap<Vec<u16>>, r: usize) -> Result<Plan, String> {
    let mut keys: Vec<KeyLoad> = sets
        .iter()
        .map(|(&key, s)| KeyLoad {
            key,
            rate: s.len() as f64,
            prefix_tokens: 0.0,
        })
        .collect();
    keys.sort_unstable_by_key(|k| k.key);
    let total_k: u64 = sets.values().map(|s| s.len() as u64).sum();
    let mut pc = CacheRouteConfig::default().planner(r, 1.0, total_k.max(1), 16);
    pc.max_imbalance = 1e12;
    pc.admission_hysteresis = 0.0;
    let p =
        plan::replan(&pc, &keys, sets, None).map_err(|e| format!("cannot build the plan: {e}"))?;
    let got = p.key_sets();
    if got.len() != sets.len() || sets.iter().any(|(k, s)| got.get(k) != Some(s)) {
        return Err("the planner could not reproduce the file's table exactly".into());
    }
    Ok(p)
}

/// The installed plan's summary (admin API and reload replies).
pub(crate) fn summary(s: &Shared) -> serde_json::Value {
    let inst = s.installed.locked().clone();
    let mut v = match inst {
        None => serde_json::json!({"installed": false, "policy": s.label}),
        Some(i) => serde_json::json!({
            "installed": true,
            "policy": s.label,
            "source": i.source.label(),
            "installed_at_s": i.at_s,
            "destinations": i.plan.destinations,
            "admitted": i.plan.admitted(),
            "admitted_share": i.plan.admitted_share(),
            "imbalance": i.plan.imbalance(),
            "loads": i.plan.loads,
            "down": i.plan.down,
            "churn": i.churn,
            "build_ms": i.plan.build_ms,
            "q_cap": i.q_cap,
            "warm_slots": i.warm_slots,
            "bounded_sets": i.bounded_sets,
            "self_calibration": i.tuning,
        }),
    };
    if let Some(shared) = super::etcd::summary(s) {
        super::json::set(&mut v, "shared", shared);
    }
    v
}

/// The installed plan's table: key (name when known and unique, else the key hash in hex) →
/// destinations.
pub(crate) fn table(s: &Shared) -> serde_json::Value {
    let inst = s.installed.locked().clone();
    let mut m = serde_json::Map::new();
    if let Some(i) = inst {
        for (n, e) in i.plan.entries.iter().enumerate() {
            // Two keys whose long names were cut to the same text: the second by its hash.
            let name = i
                .names
                .as_ref()
                .and_then(|ns| ns.get(&e.key).cloned())
                .filter(|n| !m.contains_key(n))
                .unwrap_or_else(|| format!("{:016x}", e.key));
            m.insert(name, serde_json::json!(i.plan.dests_of(n)));
        }
    }
    serde_json::Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::record::PlanRecord;
    use crate::policy::cacheroute::CacheRouteConfig;
    use crate::sim::{simulate, SimConfig};
    use crate::workload::gen::{GeneratorConfig, KeyDist, LengthDist, Workload};

    #[test]
    fn a_state_file_over_the_cap_keeps_the_admitted_keys_then_the_hottest() {
        // Six measured keys (rate = key × 1.5), two admitted (1 and 2, the coldest), cap 4.
        let mut rows: Vec<(u64, f64, f64)> = (1..=6).map(|k| (k, k as f64 * 1.5, 0.0)).collect();
        let admitted = |k: u64| k <= 2;
        assert!(
            !keep_for_file(&mut rows.clone(), admitted, 6),
            "at the cap: nothing cut"
        );
        assert!(keep_for_file(&mut rows, admitted, 4));
        let kept: Vec<u64> = rows.iter().map(|r| r.0).collect();
        assert_eq!(
            kept,
            [2, 1, 6, 5],
            "admitted first (hottest first), then the hottest measured"
        );
    }

    /// The same measured windows through the simulator's control path and the router's give
    /// the same plan sequence: one controller, fed the same way. `seed_first_window` is the
    /// router's setting on both sides; q_cap and W are explicit (the two sides' defaults
    /// differ by design: the router has no engine model).
    #[test]
    fn the_simulator_and_the_router_plan_the_same_windows_alike() {
        let (r, interval, qps, dur) = (6usize, 10.0, 30.0, 80.0);
        let mut g = GeneratorConfig::paper();
        g.keys.count = 400;
        g.keys.dist = KeyDist::Lognormal { sigma: 1.5 };
        g.prefix.block_size = 64;
        g.prefix.system_prompt = LengthDist::Constant { value: 1024 };
        g.prefix.user_message = LengthDist::Constant { value: 100 };
        g.prefix.output = LengthDist::Constant { value: 40 };
        let w = Workload::load(&g).unwrap();
        let trace: Vec<_> = w.generate(qps, dur, 3).unwrap().collect();
        let policy = CacheRouteConfig {
            q_cap: 2.0,
            warm_slots: 12,
            interval_s: interval,
            autotune: false,
            ..Default::default()
        };
        let engine =
            crate::engine::engine_config("llama-3.1-8b:h100:fp8:tp1", 64, &Default::default())
                .unwrap();
        let sim = simulate(
            SimConfig {
                destinations: r,
                engine,
                policy: PolicySpec::Cacheroute(policy.clone()),
                seed: 1,
                failures: vec![],
                horizon_s: f64::INFINITY,
                warm_start: None,
                seed_first_window: true,
            },
            trace.clone(),
        )
        .unwrap();
        assert!(sim.plans.len() >= 5, "{} plans", sim.plans.len());

        let backends = (0..r)
            .map(|d| format!("http://127.0.0.1:{}", 9 + d))
            .collect();
        let mut rc = super::super::config::RouterConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            backends,
            PolicySpec::Cacheroute(policy.clone()),
        );
        rc.block_tokens = 64;
        let shared = Shared::new(rc, None, None).unwrap();
        let mut ctl = Control::new(&shared, policy, None);
        let mut router: Vec<PlanRecord> = Vec::new();
        let mut next = 0;
        for k in 1..=sim.plans.len() {
            let end_ms = k as f64 * interval * 1e3;
            let batch: Vec<_> = trace[next..]
                .iter()
                .take_while(|t| t.timestamp_ms < end_ms)
                .map(|t| (crate::key_hash(&t.key), t.input_length, None))
                .collect();
            next += batch.len();
            shared
                .pending
                .as_ref()
                .unwrap()
                .lock()
                .unwrap()
                .extend(batch);
            ctl.tick(interval).unwrap();
            let i = shared.installed.lock().unwrap();
            let i = i.as_ref().expect("a plan after every window");
            router.push(PlanRecord {
                at_s: k as f64 * interval,
                admitted: i.plan.admitted(),
                admitted_share: i.plan.admitted_share(),
                imbalance: i.plan.imbalance(),
                churn: i.churn,
                repair: false,
                build_ms: None,
                q_cap: Some(i.q_cap),
                warm_slots: Some(i.warm_slots),
                replicas: Some(i.plan.replicas()),
                tuning: None,
            });
        }
        assert_eq!(sim.plans, router);
        // The windows differ from one another (so the comparison is not of one plan repeated).
        assert!(router.iter().skip(1).any(|p| p.churn > 0.0));
    }
}
