//! CacheRoute's control loop in the live router, mirroring the simulator's control loop:
//! every control interval, close the rate window ([`RateMeter`]), plan from the measured
//! per-key rates ([`plan::build`], or [`plan::replan`] when churn-aware), and install the plan
//! atomically (an `Arc<Plan>` swapped under the policy lock). When a destination goes down the
//! installed plan is repaired at once ([`plan::repair`]). With a plan file, that plan is
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

use super::config::RouterError;
use super::state::{Cmd, Counters, Installed, Shared, Source};
use crate::plan::{self, meter::RateMeter, KeyLoad, KeyMap, Plan};
use crate::policy::cacheroute::CacheRouteConfig;
use crate::policy::PolicySpec;
use std::collections::VecDeque;
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
    let mut ctl = Control {
        s: shared.clone(),
        meter: RateMeter::new(cfg.rate_alpha),
        history: VecDeque::new(),
        cfg,
        names: None,
        rates: Arc::new(Vec::new()),
        seeded: false,
        known: KeyMap::default(),
        engine: None,
        tuned: None,
        since_tune: 0,
        tuning: None,
    };
    if shared.cfg.self_calibrates() {
        let spec = shared.cfg.engine.as_deref().unwrap_or_default();
        let e = crate::engine::engine_config(
            spec,
            shared.cfg.block_tokens,
            &crate::engine::KnobOverrides::default(),
        )
        .map_err(|e| RouterError::Client(format!("engine `{spec}`: {e}")))?;
        tracing::info!(
            engine = spec,
            "CacheRoute self-calibrates{}{}{}: every {} intervals it replays its recent traffic \
             through the {spec} engine model",
            if ctl.cfg.q_cap <= 0.0 { " q_cap" } else { "" },
            if ctl.cfg.warm_slots == 0 { " W" } else { "" },
            if ctl.cfg.bounded_sets.is_none() {
                " bounded-sets"
            } else {
                ""
            },
            ctl.cfg.retune_intervals
        );
        ctl.engine = Some(e);
    } else if shared.cfg.plan_file.is_none() {
        if ctl.cfg.autotune && shared.cfg.engine.is_none() {
            tracing::info!("CacheRoute does not self-calibrate without --engine (the engines' model:device:precision:tpN)");
        }
        if ctl.cfg.q_cap <= 0.0 {
            tracing::warn!("q_cap not set: each plan uses the measured total rate / live destinations (a key hotter than a fair share is replicated); set --q-cap from `cacheroute calibrate` or your engine's knee");
        }
        if ctl.cfg.warm_slots == 0 {
            tracing::warn!("warm_slots not set: {DEFAULT_WARM_SLOTS} keys per destination; set --warm-slots from your engines' KV capacity (cacheroute calibrate suggests W)");
        }
    }
    if let Some(path) = shared
        .cfg
        .plan_file
        .clone()
        .or_else(|| shared.cfg.initial_plan.clone())
    {
        ctl.load_file(&path)?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    *shared.control.lock().expect("control") = Some(tx);
    std::thread::Builder::new()
        .name("cacheroute-control".into())
        .spawn(move || ctl.run(rx))
        .map_err(|e| RouterError::Client(format!("starting the control thread: {e}")))?;
    Ok(())
}

struct Control {
    s: Arc<Shared>,
    cfg: CacheRouteConfig,
    meter: RateMeter,
    history: VecDeque<Vec<KeyLoad>>,
    names: Option<Arc<KeyMap<String>>>,
    /// Rates of the plan being installed (kept with it in [`Installed`]).
    rates: Arc<Vec<KeyLoad>>,
    /// The engine model the self-calibration replays through (`None`: no self-calibration).
    engine: Option<crate::engine::EngineConfig>,
    /// The self-calibration's values in force: q_cap, W, bounded sets.
    tuned: Option<(f64, u64, bool)>,
    /// Plans built since the last tuning.
    since_tune: u32,
    /// The last tuning's line, for the next plan installed.
    tuning: Option<String>,
    /// The meter holds real rates (seeded from a state file or a first window).
    seeded: bool,
    /// Names of measured keys seen with one (at most [`MAX_KEY_NAMES`]).
    known: KeyMap<Box<str>>,
}

impl Control {
    fn run(mut self, rx: Receiver<Cmd>) {
        let interval = Duration::from_secs_f64(self.cfg.interval_s.max(1e-3));
        let online = self.s.cfg.plan_file.is_none();
        let mut window_start = Instant::now();
        let mut next = window_start + interval;
        let early = Duration::from_secs_f64(FIRST_PLAN_MIN_S);
        loop {
            // Until a first plan is in, look every second whether enough traffic was seen.
            let cold = online && self.s.plan().is_none() && self.cfg.stale_intervals == 0;
            let deadline = if cold {
                next.min(Instant::now() + early)
            } else {
                next
            };
            let wait = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Cmd::Repair) => self.repair(),
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
                    let seen = self
                        .s
                        .pending
                        .as_ref()
                        .map_or(0, |p| p.lock().expect("pending").len());
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
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Close the window of `window_s` seconds and plan (the simulator's `control_tick`).
    fn tick(&mut self, window_s: f64) -> Result<(), String> {
        let batch = match &self.s.pending {
            Some(p) => std::mem::take(&mut *p.lock().expect("pending")),
            None => Vec::new(),
        };
        let rates = if self.seeded {
            for (key, tokens, name) in batch {
                self.meter.record(key, tokens);
                self.learn(key, name);
            }
            self.meter.close_interval(window_s.max(1e-3))
        } else {
            // The first window's raw rates start the smoothing (an EWMA from zero would
            // report a fraction of every rate for several intervals).
            let mut first = RateMeter::new(1.0);
            for (key, tokens, name) in batch {
                first.record(key, tokens);
                self.learn(key, name);
            }
            let rates = first.close_interval(window_s.max(1e-3));
            if !rates.is_empty() {
                self.meter.seed(&rates);
                self.seeded = true;
            }
            rates
        };
        if !self.known.is_empty() {
            let measured: KeyMap<()> = rates.iter().map(|k| (k.key, ())).collect();
            self.known.retain(|k, _| measured.contains_key(k));
        }
        self.history.push_back(rates);
        while self.history.len() > self.cfg.stale_intervals as usize + 1 {
            self.history.pop_front();
        }
        if self.history.len() <= self.cfg.stale_intervals as usize {
            return Ok(());
        }
        let keys = self.history.front().cloned().unwrap_or_default();
        if keys.is_empty() {
            return Ok(());
        }
        let down = self.s.fleet.down_mask();
        let r_live = down.iter().filter(|d| !**d).count();
        if r_live == 0 {
            return Err("no destination is up; nothing to plan for".into());
        }
        self.self_calibrate(&keys, down.len());
        let total: f64 = keys.iter().map(|k| k.rate).sum();
        let q_cap = if self.cfg.q_cap > 0.0 {
            self.cfg.q_cap
        } else if let Some((q, _, _)) = self.tuned {
            q
        } else {
            (total / r_live as f64).max(1e-6)
        };
        let warm = if self.cfg.warm_slots > 0 {
            self.cfg.warm_slots
        } else if let Some((_, w, _)) = self.tuned {
            w
        } else {
            DEFAULT_WARM_SLOTS
        };
        let pc = self
            .cfg
            .planner(down.len(), q_cap, warm, self.s.cfg.block_tokens);
        let prev = self.s.plan();
        let prev_sets = prev.as_ref().map(|p| p.key_sets());
        let t0 = Instant::now();
        let result = match (&prev_sets, self.cfg.churn_aware) {
            (Some(sets), true) => plan::replan(&pc, &keys, sets, Some(&down)),
            _ => plan::build(&pc, &keys, Some(&down)),
        };
        let build_s = t0.elapsed().as_secs_f64();
        match result {
            Ok(mut p) => {
                p.build_ms = build_s * 1e3;
                let churn = prev_sets.as_ref().map_or(1.0, |s| plan::churn(s, &p));
                let c = &self.s.counters;
                c.plan_build_seconds_last.store(build_s.to_bits(), Relaxed);
                Counters::add_f64(&c.plan_build_seconds_sum, build_s);
                self.names = (!self.known.is_empty()).then(|| {
                    Arc::new(
                        p.entries
                            .iter()
                            .filter_map(|e| self.known.get(&e.key).map(|n| (e.key, n.to_string())))
                            .collect(),
                    )
                });
                self.rates = Arc::new(keys);
                self.install(p, Source::Measured, churn, q_cap, warm);
                Ok(())
            }
            Err(e) => {
                self.s.counters.plan_failures.fetch_add(1, Relaxed);
                tracing::warn!("planning failed: {e}; the plan in force stays");
                Err(format!("planning failed: {e}"))
            }
        }
    }

    /// With an engine model: every `retune_intervals` plans, replay the last two intervals of
    /// traffic through it for candidate q_cap / W / bounded sets (`sim::tune`, the simulator's
    /// own tuner) and keep the best; the chosen values hold until the next tuning.
    fn self_calibrate(&mut self, keys: &[KeyLoad], destinations: usize) {
        let (Some(engine), Some(window)) = (&self.engine, &self.s.window) else {
            return;
        };
        if self.tuned.is_some() && self.since_tune + 1 < self.cfg.retune_intervals {
            self.since_tune += 1;
            return;
        }
        let span_ms = 2.0 * self.cfg.interval_s.max(1e-3) * 1e3;
        let recent: Vec<crate::workload::trace::TraceRecord> = {
            let w = window.lock().expect("window");
            let newest = w.back().map_or(0.0, |r| r.timestamp_ms);
            w.iter()
                .filter(|r| r.timestamp_ms >= newest - span_ms)
                .cloned()
                .collect()
        };
        let t0 = Instant::now();
        let t = crate::sim::tune::tune(&crate::sim::tune::TuneInput {
            engine,
            destinations,
            policy: &self.cfg,
            window: &recent,
            rates: keys,
            current: self.tuned,
            seed: self.s.cfg.seed,
        });
        self.tuned = Some((t.q_cap, t.warm_slots, t.bounded_sets));
        self.since_tune = 0;
        self.s.set_bounded_sets(t.bounded_sets);
        tracing::info!(
            q_cap = t.q_cap,
            warm_slots = t.warm_slots,
            bounded_sets = t.bounded_sets,
            replayed = recent.len(),
            tuning_ms = t0.elapsed().as_secs_f64() * 1e3,
            "self-calibration: {}",
            t.why
        );
        self.tuning = Some(t.why);
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
        *self.s.installed.lock().expect("installed") = Some(Installed {
            plan: plan.clone(),
            source,
            at_s: self.s.now(),
            churn,
            q_cap,
            warm_slots,
            names: self.names.clone(),
            rates: self.rates.clone(),
            tuning: self.tuning.clone(),
            bounded_sets: self.tuned.map(|t| t.2).or(self.cfg.bounded_sets),
        });
        self.s.install_plan(plan);
    }

    fn repair(&mut self) {
        let Some(p) = self.s.plan() else { return };
        let down = self.s.fleet.down_mask();
        if down.iter().all(|d| *d) {
            return;
        }
        if let Ok(q) = plan::repair(&p, &down) {
            let churn = plan::churn(&p.key_sets(), &q);
            let (q_cap, warm) = self
                .s
                .installed
                .lock()
                .expect("installed")
                .as_ref()
                .map_or((0.0, 0), |i| (i.q_cap, i.warm_slots));
            self.install(q, Source::Repair, churn, q_cap, warm);
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
            self.meter.seed(&rates);
            self.seeded = true;
        }
        self.rates = Arc::new(rates);
        let prev = self.s.plan().map(|p| p.key_sets());
        let churn = prev.map_or(1.0, |s| plan::churn(&s, &plan));
        self.names = Some(Arc::new(names));
        let down = self.s.fleet.down_mask();
        let plan = if down.iter().any(|d| *d) && !down.iter().all(|d| *d) {
            plan::repair(&plan, &down).unwrap_or(plan)
        } else {
            plan
        };
        self.install(plan, Source::File, churn, 0.0, 0);
        Ok(())
    }
}

/// Write the installed plan and the rates it was built from to `path` (atomically: a
/// temporary file renamed over it), in the form [`plan::file::read_plan`] reads back.
pub(crate) fn save_state(s: &Shared, path: &std::path::Path) -> Result<(), String> {
    let inst = s.installed.lock().expect("installed").clone();
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
    if rows.len() > crate::bounds::MAX_PLAN_KEYS {
        // The file must read back: keep the admitted keys, then the hottest measured ones.
        rows.sort_unstable_by(|a, b| {
            (dests.contains_key(&b.0), b.1)
                .partial_cmp(&(dests.contains_key(&a.0), a.1))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        tracing::warn!(
            "state file {}: {} keys measured, keeping the {} admitted and hottest (the most a plan file may hold)",
            path.display(),
            rows.len(),
            crate::bounds::MAX_PLAN_KEYS
        );
        rows.truncate(crate::bounds::MAX_PLAN_KEYS);
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
                o["name"] = serde_json::json!(n);
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
    let inst = s.installed.lock().expect("installed").clone();
    match inst {
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
    }
}

/// The installed plan's table: key (name when known and unique, else the key hash in hex) →
/// destinations.
pub(crate) fn table(s: &Shared) -> serde_json::Value {
    let inst = s.installed.lock().expect("installed").clone();
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
