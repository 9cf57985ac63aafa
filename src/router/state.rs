//! State shared by the router's parts: the policy behind its lock, the counters, the fleet
//! view and upstream connections, the installed plan and the channel to the control loop.
//! Every other file of the router reads it; it imports none of them but the fleet view, the
//! upstream connections and the recorder it holds, so the router's files depend on each other one way.

use super::backend::BackendUrl;
use super::config::{RouterConfig, RouterError};
use super::fleet::{Excluding, Fleet};
use super::lock::Locked;
use super::record::Recorder;
use super::upstream::{Marks, Targets, Upstream};
use crate::analysis::record::PlanRecord;
use crate::plan::{KeyLoad, KeyMap, Plan};
use crate::policy::{FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The policy and its RNG, behind one lock taken for `choose` (and briefly to install a plan).
pub(crate) struct PolicyState {
    pub policy: Box<dyn Policy>,
    pub rng: Rng64,
}

/// Router-wide counters for `/metrics` and `/admin/stats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    pub no_destination: AtomicU64,
    pub retries: AtomicU64,
    pub failed: AtomicU64,
    pub table_hits: AtomicU64,
    pub fallbacks: AtomicU64,
    pub policy_decisions: AtomicU64,
    pub plans_installed: AtomicU64,
    pub plan_repairs: AtomicU64,
    pub plan_failures: AtomicU64,
    /// f64 bits.
    pub plan_build_seconds_last: AtomicU64,
    pub plan_build_seconds_sum: AtomicU64,
    pub plan_churn_last: AtomicU64,
    pub plan_admitted: AtomicU64,
    /// Connections answered 503 because `max_connections` were open.
    pub connections_refused: AtomicU64,
    /// Requests answered 503 because their body did not fit `max_buffered_bytes`.
    pub buffer_refused: AtomicU64,
    /// Requests answered 408 because their body did not arrive within `body_timeout`.
    pub body_timeouts: AtomicU64,
}

impl Counters {
    pub fn add_f64(a: &AtomicU64, x: f64) {
        let _ = a.fetch_update(Relaxed, Relaxed, |b| {
            Some((f64::from_bits(b) + x).to_bits())
        });
    }
    pub fn get_f64(a: &AtomicU64) -> f64 {
        f64::from_bits(a.load(Relaxed))
    }
}

/// State shared by handlers, health checks and the control loop.
pub(crate) struct Shared {
    pub cfg: RouterConfig,
    pub fleet: Fleet,
    pub policy: Mutex<PolicyState>,
    pub label: String,
    pub uses_plan: bool,
    pub needs_blocks: bool,
    pub needs_completion: bool,
    /// (key, prompt tokens, key name) of requests since the control loop last looked
    /// (CacheRoute online). The name is the key header's or `user`'s text, kept only when
    /// [`Shared::keep_names`] (never a prompt prefix).
    pub pending: Option<Mutex<Vec<Pending>>>,
    /// Key names are kept for `/admin/plan?table=true`: the admin API is on and plans are
    /// built online.
    pub keep_names: bool,
    pub counters: Counters,
    /// Health checks.
    pub client: reqwest::Client,
    /// The request path's upstream connections (serving workers have their own).
    upstream: Arc<Upstream>,
    /// Per destination, what every worker's upstream connections know of it (whether it
    /// wrote unsolicited bytes).
    pub marks: Arc<[Marks]>,
    /// Per destination slot, where its backend is (every worker's upstream connections).
    pub targets: Arc<Targets>,
    pub started: Instant,
    pub draining: AtomicBool,
    pub control: Mutex<Option<std::sync::mpsc::Sender<Cmd>>>,
    pub background: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The installed plan and the records of the plans installed before it.
    pub plans: Mutex<Plans>,
    /// Client connections open now.
    pub connections: AtomicUsize,
    /// Request body bytes reserved now (see [`Shared::reserve_body`]).
    pub buffered: AtomicUsize,
    pub key_header: HeaderName,
    rotate: AtomicUsize,
    /// `--record`, or the self-calibration's window: the channel to the trace writer.
    pub recorder: Option<Arc<Recorder>>,
    /// CacheRoute's self-calibration: the most recent requests (filled by the recorder).
    pub window: Option<super::record::Window>,
    /// `--etcd`: the shared plan's store, as the replica sees it.
    pub plan_store: Option<Arc<super::etcd::lease::Status>>,
    /// `--kv-events-port-offset`: the destinations' KV-event subscriptions.
    pub kv: Option<Arc<super::kv_map::KvFeed>>,
}

thread_local! {
    /// A serving worker's own upstream connections (see `RouterConfig::workers`): their tasks
    /// live on the worker's runtime, so forwarding never wakes another thread.
    static WORKER_UPSTREAM: std::cell::RefCell<Option<Arc<Upstream>>> = const { std::cell::RefCell::new(None) };
}

impl Shared {
    /// Give the current (worker) thread its own upstream connections.
    pub(crate) fn use_worker_upstream(&self) {
        let own = Arc::new(Upstream::new(
            self.targets.clone(),
            self.cfg.connect_timeout,
            self.marks.clone(),
        ));
        WORKER_UPSTREAM.with(|p| *p.borrow_mut() = Some(own));
    }

    /// The upstream connections for this thread: the worker's own, else the shared ones.
    pub fn upstream(&self) -> Arc<Upstream> {
        WORKER_UPSTREAM
            .with(|p| p.borrow().clone())
            .unwrap_or_else(|| self.upstream.clone())
    }

    pub fn new(
        mut cfg: RouterConfig,
        recorder: Option<Arc<Recorder>>,
        window: Option<super::record::Window>,
    ) -> Result<Arc<Self>, RouterError> {
        // An unset `from_events` follows the engines' KV-cache events where the router is
        // subscribed to them (docs/kv-events.md); everything below sees the resolved policy.
        cfg.policy = cfg.policy.clone().with_events(cfg.kv_events.is_some());
        let r = cfg.slots();
        // With `--engine`, the parameters left at 0 that the engine model sets are set as the
        // simulator sets them (the conversation memory's size, Preble's prefill profile); a bad
        // spec never gets here (`validate` refuses it).
        let spec = match cfg.engine_model() {
            Some(Ok(e)) => crate::policy::calibrate::resolve_policy(&cfg.policy, &e),
            _ => cfg.policy.clone(),
        };
        if let crate::policy::PolicySpec::Cacheroute(c) = &spec {
            if c.conversations {
                let total = crate::policy::cacheroute::memory_capacity(c, r);
                tracing::info!(
                    blocks = total,
                    "CacheRoute's conversation memory holds {total} prefix blocks ({} per \
                     destination, {})",
                    total / r.max(1),
                    match &cfg.policy {
                        crate::policy::PolicySpec::Cacheroute(given) if given.memory_size > 0 => {
                            "memory_size in the policy"
                        }
                        _ if cfg.engine.is_some() => {
                            "twice one replica's KV cache in the engine model"
                        }
                        _ => "the default without --engine; memory_size in --config sets it",
                    }
                );
            }
        }
        let mut policy = spec.build(r, cfg.seed);
        let uses_plan = policy.planned().is_some();
        // Subscribed, the router hashes every prompt: it counts the tokens its exact index
        // predicts cached where each request goes (`/metrics`).
        let needs_blocks = cfg.policy.reads_blocks() || cfg.kv_events.is_some();
        let needs_completion = cfg.policy.reads_completions();
        let client = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            .tcp_nodelay(true)
            .pool_idle_timeout(std::time::Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| RouterError::Client(e.to_string()))?;
        let marks: Arc<[Marks]> = (0..r).map(|_| Marks::default()).collect();
        // `RouterConfig::validate` checked them with this parser; the parsed values are kept.
        let parsed = cfg
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                BackendUrl::parse(b)
                    .map_err(|why| RouterError::Config(format!("backends[{i}]: {why}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let kv = match &cfg.kv_events {
            None => None,
            Some(k) => {
                let connects: Vec<&str> = parsed.iter().map(|b| b.connect()).collect();
                let feed =
                    super::kv_map::KvFeed::new(&connects, r, k.port_offset, cfg.block_tokens)
                        .map_err(RouterError::Config)?;
                Some(Arc::new(feed))
            }
        };
        let targets = Arc::new(Targets::new(&parsed, r));
        let upstream = Arc::new(Upstream::new(
            targets.clone(),
            cfg.connect_timeout,
            marks.clone(),
        ));
        let key_header = HeaderName::from_bytes(cfg.key_header.as_bytes()).map_err(|_| {
            RouterError::Config(format!(
                "key_header: `{}` is not an HTTP header name",
                cfg.key_header
            ))
        })?;
        Ok(Arc::new(Self {
            fleet: Fleet::new(&cfg.backends, r),
            label: cfg.policy.label(),
            policy: Mutex::new(PolicyState {
                policy,
                rng: crate::rng::derive(cfg.seed, "router"),
            }),
            uses_plan,
            needs_blocks,
            needs_completion,
            pending: (uses_plan && cfg.plan_file.is_none()).then(|| Mutex::new(Vec::new())),
            keep_names: uses_plan && cfg.plan_file.is_none() && cfg.admin_token.is_some(),
            counters: Counters::default(),
            client,
            upstream,
            marks,
            targets,
            started: Instant::now(),
            draining: AtomicBool::new(false),
            control: Mutex::new(None),
            background: Mutex::new(Vec::new()),
            plans: Mutex::new(Plans::default()),
            connections: AtomicUsize::new(0),
            buffered: AtomicUsize::new(0),
            key_header,
            rotate: AtomicUsize::new(0),
            recorder,
            window,
            plan_store: cfg
                .etcd
                .as_ref()
                .map(|e| Arc::new(super::etcd::lease::Status::new(e))),
            kv,
            cfg,
        }))
    }

    /// What the upstream side knows of destination `d` (see [`Marks`]).
    pub fn mark(&self, d: usize) -> &Marks {
        super::upstream::mark_of(&self.marks, d)
    }

    /// Count a new client connection, or `None` when `max_connections` are open. The
    /// returned guard counts it closed when dropped.
    pub fn admit_connection(self: &Arc<Self>) -> Option<Held> {
        let n = self.connections.fetch_add(1, Relaxed);
        if n >= self.cfg.max_connections {
            self.connections.fetch_sub(1, Relaxed);
            self.counters.connections_refused.fetch_add(1, Relaxed);
            return None;
        }
        Some(Held {
            s: self.clone(),
            what: HeldKind::Connection,
        })
    }

    /// Reserve `bytes` of the body budget, or `None` when `max_buffered_bytes` would be
    /// passed. The guard gives them back when dropped.
    pub fn reserve_body(self: &Arc<Self>, bytes: usize) -> Option<Held> {
        let before = self.buffered.fetch_add(bytes, Relaxed);
        if before + bytes > self.cfg.max_buffered_bytes {
            self.buffered.fetch_sub(bytes, Relaxed);
            self.counters.buffer_refused.fetch_add(1, Relaxed);
            return None;
        }
        Some(Held {
            s: self.clone(),
            what: HeldKind::Body(bytes),
        })
    }

    /// Seconds since the router started in the engine model's time (`time_scale`; wall
    /// seconds with real engines): the policies' `now` and the plans' times.
    pub fn now(&self) -> f64 {
        self.cfg.time_scale.model_since(self.started.elapsed())
    }

    /// Wall seconds since the router started.
    pub fn uptime(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// A wall-clock duration in the engine model's seconds: what a policy measures (Preble's
    /// window and TPOT) keeps the units of its engine-model profile when the backends run
    /// `time_scale` times faster than the model.
    pub fn model_secs(&self, wall_s: f64) -> f64 {
        self.cfg.time_scale.to_model(wall_s)
    }

    /// A connection failure (refused, or reset or closed before any answer) or failed probe:
    /// mark `d` down and, if it was up, log `why` and repair the plan.
    pub fn destination_failed(&self, d: usize, why: &str) {
        if self.fleet.mark_down(d) {
            tracing::warn!(
                destination = d,
                url = %self.fleet.dest(d).url(),
                live = self.fleet.live(),
                "destination {d} down: {why}"
            );
            self.send_control(Cmd::Repair);
        }
    }

    /// A response from `d` that broke once begun (a stream cut mid-way, a body cut before its
    /// first byte): that request's error, not proof the destination is dead. Counted and
    /// logged; `d` stays up (probes and connection failures decide that).
    pub fn stream_broke(&self, d: usize, why: &str) {
        self.fleet.dest(d).broken_streams.fetch_add(1, Relaxed);
        tracing::warn!(
            destination = d,
            url = %self.fleet.dest(d).url(),
            "destination {d}: stream broke: {why}; the destination stays up"
        );
    }

    /// A passed probe that started when `d`'s marks said `seen` ([`Marks::probe_started`])
    /// and the slot's generation was `generation`: mark `d` up and, if it was down, log `why`;
    /// connections to it are pooled again if they were not for unsolicited bytes.
    pub fn destination_up(&self, d: usize, why: &str, seen: u64, generation: u64) {
        if self.fleet.generation(d) != generation {
            return;
        }
        if self.mark(d).probe_passed(seen) {
            tracing::info!(
                destination = d,
                url = %self.fleet.dest(d).url(),
                "destination {d}: connections pooled again: {why}"
            );
        }
        if self.fleet.mark_up(d, generation) {
            tracing::info!(
                destination = d,
                url = %self.fleet.dest(d).url(),
                live = self.fleet.live(),
                "destination {d} up: {why}"
            );
        }
    }

    pub fn send_control(&self, cmd: Cmd) -> bool {
        match &*self.control.locked() {
            Some(tx) => tx.send(cmd).is_ok(),
            None => false,
        }
    }

    /// The `--record` recording (not the self-calibration's window alone).
    pub fn recording(&self) -> Option<&Arc<Recorder>> {
        self.recorder.as_ref().filter(|_| self.cfg.record.is_some())
    }

    /// Put the self-calibration's choices in force: bounded or pinned planned sets, and the
    /// dispatch (the parts the configuration leaves open).
    pub fn apply_settings(&self, s: &crate::analysis::record::Resolved) {
        if let Some(p) = self.policy.locked().policy.planned() {
            p.set_bounded_sets(s.bounded_sets);
            p.set_dispatch(s.dispatch);
        }
    }

    /// The installed plan, if the policy has one.
    pub fn plan(&self) -> Option<Arc<Plan>> {
        self.policy.locked().policy.planned().and_then(|p| p.plan())
    }

    pub fn install_plan(&self, plan: Arc<Plan>) {
        if let Some(p) = self.policy.locked().policy.planned() {
            p.install_plan(plan);
        }
    }

    pub fn begin_drain(&self) {
        self.draining.store(true, Relaxed);
    }

    pub fn stop_background(&self) {
        for t in self.background.locked().drain(..) {
            t.abort();
        }
        if let Some(kv) = &self.kv {
            let slots = kv.dests.locked().len();
            for d in 0..slots {
                kv.end(d, |_| {});
            }
        }
        self.control.locked().take();
    }

    /// The fleet as a choice sees it: `skip` hidden, only what `only` marks (all when `None`).
    fn view<'a>(&'a self, skip: Option<usize>, only: Option<&'a [bool]>) -> Excluding<'a> {
        Excluding {
            fleet: &self.fleet,
            skip,
            only,
        }
    }

    /// Ask the policy (with `skip` hidden); also classify the decision path.
    pub fn choose(&self, rr: &RouteRequest, skip: Option<usize>) -> Result<usize, RouteError> {
        self.choose_within(rr, skip, None)
    }

    /// [`Shared::choose`] among the destinations `only` marks (all when `None`).
    pub fn choose_within(
        &self,
        rr: &RouteRequest,
        skip: Option<usize>,
        only: Option<&[bool]>,
    ) -> Result<usize, RouteError> {
        let view = self.view(skip, only);
        let mut st = self.policy.locked();
        let PolicyState { policy, rng } = &mut *st;
        let d = policy.choose(rr, &view, rng)?;
        if !view.is_up(d) {
            return Err(RouteError::NoneUp(view.len()));
        }
        if self.uses_plan {
            let hit = policy
                .planned()
                .and_then(|p| p.plan())
                .and_then(|p| {
                    p.lookup(rr.key)
                        .map(|set| set.iter().any(|&x| view.is_up(x as usize)))
                })
                .unwrap_or(false);
            drop(st);
            if hit {
                self.counters.table_hits.fetch_add(1, Relaxed);
            } else {
                self.counters.fallbacks.fetch_add(1, Relaxed);
            }
        } else {
            drop(st);
            self.counters.policy_decisions.fetch_add(1, Relaxed);
        }
        self.count_prediction(d, rr);
        Ok(d)
    }

    /// `rr` goes to `d`: its prompt tokens, and those the exact index holds there.
    fn count_prediction(&self, d: usize, rr: &RouteRequest) {
        let x = self.fleet.dest(d);
        x.prompt_tokens
            .fetch_add(u64::from(rr.prompt_tokens), Relaxed);
        if let Some(kv) = &self.kv {
            let p = kv
                .mapper
                .locked()
                .predicted_tokens(d, rr.blocks, rr.prompt_tokens);
            x.predicted_cached_tokens.fetch_add(p, Relaxed);
        }
    }

    /// Round-robin over live destinations (for key-less requests such as `/v1/models`).
    pub fn rotate(&self, skip: Option<usize>) -> Result<usize, RouteError> {
        self.rotate_within(skip, None)
    }

    /// [`Shared::rotate`] among the destinations `only` marks (all when `None`).
    pub fn rotate_within(
        &self,
        skip: Option<usize>,
        only: Option<&[bool]>,
    ) -> Result<usize, RouteError> {
        let view = self.view(skip, only);
        let n = self.fleet.len();
        let start = self.rotate.fetch_add(1, Relaxed);
        (0..n)
            .map(|i| (start + i) % n)
            .find(|&d| view.is_up(d))
            .ok_or(RouteError::NoneUp(n))
    }
}

/// One request as the control loop sees it: key hash, prompt tokens, the key's name when
/// kept (see [`Shared::keep_names`]).
pub(crate) type Pending = (u64, u32, Option<Box<str>>);

/// The longest key name kept (bytes; longer ones are cut at a character boundary).
pub(crate) const MAX_KEY_NAME_BYTES: usize = 128;

/// `name` as kept for the admin API: at most [`MAX_KEY_NAME_BYTES`], cut with `…`.
pub(crate) fn key_name(name: &str) -> Box<str> {
    if name.len() <= MAX_KEY_NAME_BYTES {
        return name.into();
    }
    let mut end = MAX_KEY_NAME_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &name[..end]).into()
}

/// Commands to the control loop.
pub(crate) enum Cmd {
    /// A destination went down: repair the installed plan.
    Repair,
    /// Reload the plan file, or plan now from the open window; reply with a summary.
    Reload(tokio::sync::oneshot::Sender<Result<serde_json::Value, String>>),
    /// `--etcd`: a plan the leader wrote, read and checked by the watch.
    Shared(Box<super::etcd::codec::Received>),
}

/// Where the installed plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    Measured,
    File,
    Repair,
    /// `--etcd`: the plan the replicas share.
    Shared,
}

impl Source {
    pub fn label(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::File => "file",
            Source::Repair => "repair",
            Source::Shared => "shared",
        }
    }
}

/// The installed plan: the plan, its record (when, churn, the settings it was built with),
/// where it came from, and what the admin API and the state file show with it.
#[derive(Debug, Clone)]
pub(crate) struct Installed {
    pub plan: Arc<Plan>,
    pub record: PlanRecord,
    pub source: Source,
    /// Key names when known (plan files carry them).
    pub names: Option<Arc<KeyMap<String>>>,
    /// The per-key rates the plan was built from (measured, or a state file's).
    pub rates: Arc<Vec<KeyLoad>>,
    /// The self-calibration's last line (what it compared and chose), when it runs.
    pub last_tuning: Option<String>,
}

/// Records kept of the plans installed since start (the newest; `/admin/plan?history=true`).
pub const MAX_PLAN_HISTORY: usize = 4096;

/// The installed plan, and the records of every plan installed since start (at most
/// [`MAX_PLAN_HISTORY`], the newest; how many older ones were dropped).
#[derive(Debug, Default)]
pub(crate) struct Plans {
    pub installed: Option<Installed>,
    pub history: std::collections::VecDeque<PlanRecord>,
    pub dropped: u64,
}

impl Plans {
    /// `i` installed; its record joins the history.
    pub fn install(&mut self, i: Installed) {
        if self.history.len() >= MAX_PLAN_HISTORY {
            self.history.pop_front();
            self.dropped += 1;
        }
        self.history.push_back(i.record.clone());
        self.installed = Some(i);
    }
}

/// A connection slot or body bytes held from the router's budgets, given back on drop.
pub(crate) struct Held {
    s: Arc<Shared>,
    what: HeldKind,
}

enum HeldKind {
    Connection,
    Body(usize),
}

impl Held {
    /// Hold `bytes` of the body budget instead of what this holds now (a body hold only):
    /// giving back always succeeds; growing is refused (`false`, counted as a buffer refusal,
    /// the hold unchanged) when `max_buffered_bytes` would be passed.
    pub fn resize(&mut self, bytes: usize) -> bool {
        let HeldKind::Body(now) = &mut self.what else {
            return false;
        };
        if bytes <= *now {
            self.s.buffered.fetch_sub(*now - bytes, Relaxed);
            *now = bytes;
            return true;
        }
        let more = bytes - *now;
        let before = self.s.buffered.fetch_add(more, Relaxed);
        if before + more > self.s.cfg.max_buffered_bytes {
            self.s.buffered.fetch_sub(more, Relaxed);
            self.s.counters.buffer_refused.fetch_add(1, Relaxed);
            return false;
        }
        *now = bytes;
        true
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        match self.what {
            HeldKind::Connection => self.s.connections.fetch_sub(1, Relaxed),
            HeldKind::Body(n) => self.s.buffered.fetch_sub(n, Relaxed),
        };
    }
}

/// `{"error": {"message", "type", "code"}}` with `status`.
pub(crate) fn json_error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan history keeps the newest MAX_PLAN_HISTORY records, oldest first, counting the
    /// ones it let go; the installed plan is always the last.
    #[test]
    fn the_plan_history_keeps_the_newest_records_and_counts_the_dropped() {
        let sets: KeyMap<Vec<u16>> = [(7u64, vec![0u16])].into_iter().collect();
        let plan = Arc::new(crate::plan::file::plan_from_sets(&sets, 2).unwrap());
        let mut plans = Plans::default();
        for n in 0..MAX_PLAN_HISTORY + 3 {
            let record = crate::control::record(&plan, n as f64, 0.0, false, None);
            plans.install(Installed {
                plan: plan.clone(),
                record,
                source: Source::Measured,
                names: None,
                rates: Arc::new(Vec::new()),
                last_tuning: None,
            });
        }
        assert_eq!(plans.history.len(), MAX_PLAN_HISTORY);
        assert_eq!(plans.dropped, 3);
        assert_eq!(plans.history.front().map(|r| r.at_s), Some(3.0));
        let last = (MAX_PLAN_HISTORY + 2) as f64;
        assert_eq!(plans.history.back().map(|r| r.at_s), Some(last));
        assert_eq!(plans.installed.map(|i| i.record.at_s), Some(last));
    }

    #[test]
    fn long_key_names_are_cut_at_a_character_boundary() {
        assert_eq!(&*key_name("tenant-7"), "tenant-7");
        let long = "é".repeat(100); // 200 bytes
        let cut = key_name(&long);
        assert!(cut.ends_with('…'));
        assert_eq!(cut.len(), MAX_KEY_NAME_BYTES + '…'.len_utf8());
        assert!(long.starts_with(cut.trim_end_matches('…')));
    }
}
