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
use super::etcd::codec::{self, Received};
use super::etcd::Sharer;
use super::lock::Locked;
use super::state::{Cmd, Counters, Installed, Shared, Source};
use crate::analysis::record::PlanRecord;
use crate::control::{ControlOptions, Controller, Defaults};
use crate::plan::{self, KeyLoad, KeyMap, Plan};
use crate::policy::cacheroute::CacheRouteConfig;
use crate::policy::PolicySpec;
use std::collections::HashMap;
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
        let auto = [
            (cfg.q_cap.is_auto(), " q_cap"),
            (cfg.warm_slots.is_auto(), " W"),
            (cfg.bounded_sets.is_auto(), " bounded-sets"),
            (cfg.dispatch_automatic(), " dispatch"),
        ];
        tracing::info!(
            engine = spec,
            "CacheRoute self-calibrates{}: every {} intervals it replays its recent traffic \
             through the {spec} engine model",
            auto.iter()
                .filter(|(on, _)| *on)
                .map(|(_, name)| *name)
                .collect::<String>(),
            cfg.retune_intervals
        );
        engine = Some(e);
    } else if shared.cfg.plan_file.is_none() {
        if cfg.autotune && shared.cfg.engine.is_none() {
            tracing::info!("CacheRoute does not self-calibrate without --engine (the engines' model:device:precision:tpN)");
        } else if cfg.autotune && shared.cfg.tuner.is_none() {
            tracing::warn!("CacheRoute does not self-calibrate: the router was started with an engine model but no replay tuner (RouterConfig::tuner)");
        }
        if cfg.q_cap.is_auto() {
            tracing::warn!("q_cap not set: each plan uses the measured total rate / live destinations (a key hotter than a fair share is replicated); set --q-cap from `cacheroute calibrate` or your engine's knee");
        }
        if cfg.warm_slots.is_auto() {
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
        let deliver = {
            let (s, st) = (shared.clone(), st.clone());
            move |bytes: &[u8], revision: i64| match decode_shared(&s, bytes, revision) {
                Ok(r) if st.newer(revision) => {
                    s.send_control(Cmd::Shared(Box::new(r)));
                }
                Ok(_) => {}
                Err(e) => st.refuse(revision, &e),
            }
        };
        let (sharer, first) =
            std::thread::scope(|sc| sc.spawn(|| super::etcd::start(st.clone(), deliver)).join())
                .map_err(|_| {
                    RouterError::Client("starting the plan's sharing through etcd failed".into())
                })?
                .map_err(RouterError::Client)?;
        let first = first.and_then(|kv| {
            decode_shared(shared, &kv.value, kv.mod_revision)
                .map_err(|e| st.refuse(kv.mod_revision, &e))
                .ok()
        });
        match &first {
            Some(r) => tracing::info!(
                generation = r.meta.generation,
                revision = r.meta.revision,
                leader = %r.meta.leader,
                "shared plan read from etcd before serving: {} keys",
                r.plan.admitted()
            ),
            None => tracing::info!(
                "no shared plan in etcd yet ({}/plan); routing by the cold tail until the leader writes one",
                st.cfg.prefix
            ),
        }
        ctl.source = PlanSource::Etcd(sharer);
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

/// A shared plan record read from etcd, checked against this router's backends.
fn decode_shared(s: &Shared, bytes: &[u8], revision: i64) -> Result<Received, String> {
    let ours: HashMap<String, usize> = s
        .fleet
        .backends()
        .into_iter()
        .map(|(d, u)| (u.to_string(), d))
        .collect();
    codec::decode(bytes, &ours, s.fleet.dests.len(), revision)
}

/// Where plans come from besides this router's own measurements.
enum PlanSource {
    /// This router plans alone from what it measures.
    Local,
    /// Router replicas share one plan through etcd: this one publishes its rates every
    /// interval, plans from every replica's while it leads and writes the plan, and installs
    /// what the leader wrote.
    Etcd(Sharer),
}

/// The one owner of CacheRoute's controller and of the installed plan in the router: its
/// clock and thread, the request batches it feeds in, the plan source, plan files, key names,
/// and installing into [`Shared`] with the plan's [`PlanRecord`].
struct Control {
    s: Arc<Shared>,
    ctl: Controller,
    source: PlanSource,
    names: Option<Arc<KeyMap<String>>>,
    /// Rates of the plan being installed (kept with it in [`Installed`]).
    rates: Arc<Vec<KeyLoad>>,
    /// Names of measured keys seen with one (at most [`MAX_KEY_NAMES`]).
    known: KeyMap<Box<str>>,
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
            source: PlanSource::Local,
            names: None,
            rates: Arc::new(Vec::new()),
            known: KeyMap::default(),
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
                    if let PlanSource::Etcd(sh) = &self.source {
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
    /// the controller sees it in the model's time. With a shared plan this replica publishes
    /// its rates, and plans from every replica's only while it leads.
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
        let mut step = self.ctl.close_window(window_s, &down, &recent);
        if let (Some(Ok(step)), false) = (&step, self.known.is_empty()) {
            let measured: KeyMap<()> = step.rates.iter().map(|k| (k.key, ())).collect();
            self.known.retain(|k, _| measured.contains_key(k));
        }
        if let PlanSource::Etcd(sh) = &self.source {
            let local = match &step {
                Some(Ok(st)) => st.rates.as_slice(),
                _ => &[],
            };
            let Some(merged) = sh.exchange(local) else {
                return Ok(());
            };
            step = self.ctl.step_from(merged, &down, &recent);
        }
        let closed_ms = t0.elapsed().as_secs_f64() * 1e3;
        let step = match step {
            None => return Ok(()),
            Some(Err(e)) => {
                tracing::warn!("{e}; no plan built");
                return Err(e);
            }
            Some(Ok(step)) => step,
        };
        if let Some(why) = &step.tuned {
            self.s.apply_settings(&step.settings);
            tracing::info!(
                q_cap = step.settings.q_cap,
                warm_slots = step.settings.warm_slots,
                bounded_sets = step.settings.bounded_sets,
                dispatch = %step.settings.dispatch,
                replayed = recent.len(),
                tuning_ms = closed_ms,
                "self-calibration: {why}"
            );
        }
        let (rates, settings) = (step.rates.clone(), step.settings);
        let prev = self.s.plan();
        let t0 = Instant::now();
        let result = self.ctl.build(step, self.s.now(), prev.as_deref(), &down);
        let build_s = t0.elapsed().as_secs_f64();
        let mut d = match result {
            Ok(d) => d,
            Err(e) => {
                self.s.counters.plan_failures.fetch_add(1, Relaxed);
                tracing::warn!("{e}; the plan in force stays");
                return Err(e);
            }
        };
        d.plan.build_ms = build_s * 1e3;
        d.record.build_ms = Some(build_s * 1e3);
        let c = &self.s.counters;
        c.plan_build_seconds_last.store(build_s.to_bits(), Relaxed);
        Counters::add_f64(&c.plan_build_seconds_sum, build_s);
        let source = match &self.source {
            PlanSource::Local => Source::Measured,
            PlanSource::Etcd(sh) => {
                let Some(meta) = sh.write(&d.plan, &self.urls(d.plan.destinations), settings)
                else {
                    return Ok(());
                };
                if !sh.take(&meta) {
                    return Ok(());
                }
                Source::Shared
            }
        };
        self.names = self.names_of(&d.plan);
        self.rates = Arc::new(rates);
        self.install(d.plan, d.record, source);
        Ok(())
    }

    /// The destinations by URL, for a shared plan record (a vacant slot `None`).
    fn urls(&self, destinations: usize) -> Vec<Option<String>> {
        let f = &self.s.fleet;
        (0..destinations)
            .map(|d| (d < f.dests.len() && !f.is_vacant(d)).then(|| f.dest(d).url().to_string()))
            .collect()
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

    /// Install a plan the leader wrote, read by the watch (or before serving); one not newer
    /// than the plan in force is dropped.
    fn install_shared(&mut self, r: Received) {
        let PlanSource::Etcd(sh) = &self.source else {
            return;
        };
        if !sh.take(&r.meta) {
            return;
        }
        self.s.apply_settings(&r.settings);
        let prev = self.s.plan().map(|p| p.key_sets());
        let churn = prev.map_or(1.0, |s| plan::churn(&s, &r.plan));
        self.names = self.names_of(&r.plan);
        self.rates = Arc::new(Vec::new());
        let plan = repaired_for(r.plan, &self.s.fleet.down_mask());
        let record = crate::control::record(&plan, self.s.now(), churn, false, Some(r.settings));
        self.install(plan, record, Source::Shared);
    }

    /// Remember `key`'s name (first seen wins, at most [`MAX_KEY_NAMES`]).
    fn learn(&mut self, key: u64, name: Option<Box<str>>) {
        if let Some(n) = name {
            if self.known.len() < MAX_KEY_NAMES || self.known.contains_key(&key) {
                self.known.entry(key).or_insert(n);
            }
        }
    }

    /// The one place a plan is installed: the policy's table swapped, and the plan with its
    /// record kept for the admin API, the state file and the metrics.
    fn install(&mut self, p: Plan, record: PlanRecord, source: Source) {
        tracing::info!(
            source = source.label(),
            admitted = p.admitted(),
            measured = self.rates.len(),
            admitted_share = p.admitted_share(),
            imbalance = p.imbalance(),
            q_cap = record.q_cap,
            warm_slots = record.warm_slots,
            churn = record.churn,
            build_ms = p.build_ms,
            down = p.down.iter().filter(|d| **d).count(),
            "plan installed ({}): {} keys admitted, imbalance {:.3}, W {}, q_cap {}",
            source.label(),
            p.admitted(),
            p.imbalance(),
            record.warm_slots.map_or("—".into(), |w| w.to_string()),
            record.q_cap.map_or("—".into(), |q| format!("{q:.3}")),
        );
        let c = &self.s.counters;
        c.plans_installed.fetch_add(1, Relaxed);
        if source == Source::Repair {
            c.plan_repairs.fetch_add(1, Relaxed);
        }
        c.plan_churn_last.store(record.churn.to_bits(), Relaxed);
        c.plan_admitted.store(p.admitted() as u64, Relaxed);
        let plan = Arc::new(p);
        self.s.plans.locked().install(Installed {
            plan: plan.clone(),
            record,
            source,
            names: self.names.clone(),
            rates: self.rates.clone(),
            last_tuning: self.ctl.last_tuning().map(str::to_string),
        });
        self.s.install_plan(plan);
    }

    fn repair(&mut self) {
        let Some(p) = self.s.plan() else { return };
        let settings = self
            .s
            .plans
            .locked()
            .installed
            .as_ref()
            .and_then(|i| i.record.settings());
        let down = self.s.fleet.down_mask();
        if let Some(d) = crate::control::repair(&p, &down, self.s.now(), settings) {
            self.install(d.plan, d.record, Source::Repair);
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
        let plan = plan::file::plan_from_sets(&sets, r).map_err(|msg| RouterError::PlanFile {
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
        let record = crate::control::record(&plan, self.s.now(), churn, false, None);
        self.install(plan, record, Source::File);
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
    let inst = s.plans.locked().installed.clone();
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
        "q_cap": i.record.q_cap,
        "warm_slots": i.record.warm_slots,
        "keys": keys,
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, doc.to_string()).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming onto {}: {e}", path.display()))
}

/// The installed plan's summary (admin API and reload replies).
pub(crate) fn summary(s: &Shared) -> serde_json::Value {
    let inst = s.plans.locked().installed.clone();
    let mut v = match inst {
        None => serde_json::json!({"installed": false, "policy": s.label}),
        Some(i) => serde_json::json!({
            "installed": true,
            "policy": s.label,
            "source": i.source.label(),
            "installed_at_s": i.record.at_s,
            "destinations": i.plan.destinations,
            "admitted": i.plan.admitted(),
            "admitted_share": i.plan.admitted_share(),
            "imbalance": i.plan.imbalance(),
            "loads": i.plan.loads,
            "down": i.plan.down,
            "churn": i.record.churn,
            "build_ms": i.plan.build_ms,
            "q_cap": i.record.q_cap,
            "warm_slots": i.record.warm_slots,
            "bounded_sets": i.record.bounded_sets,
            "dispatch": i.record.dispatch.map(|d| d.to_string()),
            "self_calibration": i.last_tuning,
        }),
    };
    if let Some(st) = &s.plan_store {
        super::json::set(&mut v, "shared", st.summary());
    }
    v
}

/// The records of the plans installed since start, oldest first (at most
/// [`super::state::MAX_PLAN_HISTORY`]), and how many older ones were dropped.
pub(crate) fn history(s: &Shared) -> (serde_json::Value, u64) {
    let p = s.plans.locked();
    let records = serde_json::to_value(&p.history).unwrap_or(serde_json::Value::Null);
    (records, p.dropped)
}

/// The installed plan's table: key (name when known and unique, else the key hash in hex) →
/// destinations.
pub(crate) fn table(s: &Shared) -> serde_json::Value {
    let inst = s.plans.locked().installed.clone();
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
    use crate::policy::setting::Setting;
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
            q_cap: Setting::Fixed(2.0),
            warm_slots: Setting::Fixed(12),
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
                router_replicas: 1,
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
            let i = shared.plans.lock().unwrap();
            let i = i.installed.as_ref().expect("a plan after every window");
            router.push(PlanRecord {
                at_s: k as f64 * interval,
                build_ms: None,
                ..i.record.clone()
            });
        }
        assert_eq!(sim.plans, router);
        // The windows differ from one another (so the comparison is not of one plan repeated).
        assert!(router.iter().skip(1).any(|p| p.churn > 0.0));
    }
}
