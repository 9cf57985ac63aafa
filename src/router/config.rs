//! The router's configuration and the errors it can fail to start with. Below every other
//! file of the router: it imports none of them.

use super::backend::{without_v1, BackendUrl};
use crate::engine::engine_config;
use crate::policy::PolicySpec;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Where the destinations publish their KV-cache events (docs/kv-events.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// Events at each backend's port + this; its replay endpoint at + 1 more.
    pub port_offset: u16,
    /// The topic subscribed to (vLLM's default: empty, every topic).
    pub topic: String,
}

/// `--record`: default size at which the file is rotated (256 MiB).
pub const DEFAULT_RECORD_MAX_BYTES: u64 = 256 << 20;
/// Default number of rotated files kept (`FILE.1` … `FILE.8`).
pub const DEFAULT_RECORD_KEEP: usize = 8;
/// Default capacity of the channel to the writer (records).
pub const DEFAULT_RECORD_QUEUE: usize = 16_384;
/// Default longest wait, after a record is complete, for the requests that arrived before it.
pub const DEFAULT_RECORD_HOLD: Duration = Duration::from_secs(10);

/// Where and how to record traffic (`RouterConfig::record`; the writer is `record.rs`).
#[derive(Debug, Clone)]
pub struct RecordConfig {
    /// The trace file; appended to when it already holds a trace.
    pub path: PathBuf,
    /// Start a new file (rotating the old) before a line would take it past this many bytes;
    /// each file holds at least one record.
    pub max_bytes: u64,
    /// Rotated files kept: `FILE.1` (newest) … `FILE.keep`; older ones are deleted.
    pub keep: usize,
    /// Capacity of the channel to the writer; a record that finds it full is dropped.
    pub queue: usize,
    /// How long a finished record waits for requests that arrived before it and are still
    /// running, so the file stays sorted by arrival; a request that finishes later than that
    /// is written when it finishes, its timestamp moved up (`clamped_ms`).
    pub hold: Duration,
}

impl RecordConfig {
    /// Defaults for everything but the path.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            max_bytes: DEFAULT_RECORD_MAX_BYTES,
            keep: DEFAULT_RECORD_KEEP,
            queue: DEFAULT_RECORD_QUEUE,
            hold: DEFAULT_RECORD_HOLD,
        }
    }

    /// Every problem, one per entry, each naming its field.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut errs = Vec::new();
        if self.path.as_os_str().is_empty() {
            errs.push("record: empty path; pass --record FILE".into());
        }
        if self.max_bytes == 0 {
            errs.push("record_max_bytes: must be ≥ 1".into());
        }
        if self.keep > 10_000 {
            errs.push(format!(
                "record_keep: {} is more than 10000 files",
                self.keep
            ));
        }
        if self.queue == 0 {
            errs.push("record_queue: must be ≥ 1".into());
        }
        if self.hold > Duration::from_secs(3600) {
            errs.push("record_hold_s: at most 3600 seconds".into());
        }
        errs
    }
}

/// Replicas sharing one CacheRoute plan through etcd v3 (`--etcd`; the client and the
/// sharing are `etcd.rs`, docs/router.md "Many replicas, one plan").
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// etcd's client URL, `http://HOST:PORT` (its v3 JSON gateway is used).
    pub endpoint: String,
    /// Key prefix of this fleet's plan, leader and rates (`/cacheroute/NAME`).
    pub prefix: String,
    /// This replica's name (unique among the replicas sharing the prefix).
    pub replica_id: String,
    /// The lease that holds a replica's rates and the leader role: a replica that stops
    /// renewing it is gone after this long (whole seconds, etcd's unit).
    pub lease_ttl: Duration,
}

impl EtcdConfig {
    /// The default prefix and lease, this host's name and process id as the replica's name.
    pub fn new(endpoint: impl Into<String>) -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "replica".into());
        Self {
            endpoint: endpoint.into().trim_end_matches('/').to_string(),
            prefix: "/cacheroute/default".into(),
            replica_id: format!("{host}-{}", std::process::id()),
            lease_ttl: Duration::from_secs(10),
        }
    }

    /// Every problem, one per entry, each naming its field.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut errs = Vec::new();
        match reqwest::Url::parse(&self.endpoint) {
            Ok(u) if u.scheme() == "http" && u.host().is_some() && u.path() == "/" => {}
            _ => errs.push(format!(
                "etcd: `{}` is not etcd's client URL; give http://HOST:PORT (e.g. http://127.0.0.1:2379)",
                self.endpoint
            )),
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') || self.prefix.len() > 200 {
            errs.push(format!(
                "etcd_prefix: `{}` must start with / and not end with / (e.g. /cacheroute/prod), at most 200 bytes",
                self.prefix
            ));
        }
        let id_ok = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
        if self.replica_id.is_empty()
            || self.replica_id.len() > 128
            || !self.replica_id.chars().all(id_ok)
        {
            errs.push(format!(
                "replica_id: `{}` must be 1-128 letters, digits, -, _, . or :",
                self.replica_id
            ));
        }
        let ttl = self.lease_ttl.as_secs_f64();
        if !(2.0..=3600.0).contains(&ttl) || self.lease_ttl.subsec_nanos() != 0 {
            errs.push(format!(
                "etcd_lease_ttl_s: {ttl} must be whole seconds between 2 and 3600"
            ));
        }
        errs
    }
}

/// Everything the router needs to start. [`RouterConfig::new`] fills sensible defaults.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Address to listen on (port 0 picks a free port; see [`RouterHandle::addr`]).
    pub listen: SocketAddr,
    /// Backend base URLs, e.g. `http://127.0.0.1:9001` (destination index = position).
    pub backends: Vec<String>,
    /// Read the backends from this file instead (one base URL a line, `#` comments) and
    /// watch it: a replacement is re-read and its backends added and removed while routing
    /// (`discovery`). `backends` is then what the file held at start.
    pub backends_file: Option<PathBuf>,
    /// Read the backends from DNS instead and re-resolve every `backends_poll`
    /// (`discovery`): `http://NAME:PORT` (every A/AAAA address of NAME at PORT) or
    /// `srv+http://NAME` (NAME's SRV records: each target's addresses at the record's port).
    /// `backends` is then what the name resolved to at start.
    pub backends_dns: Option<String>,
    /// The DNS server `backends_dns` asks (UDP, then TCP); `None`: the system's
    /// (resolv.conf).
    pub dns_server: Option<SocketAddr>,
    /// Destination slots with a backends file or DNS (0: max(64, 2 × the backends at start));
    /// an answer naming more backends than this is refused.
    pub max_backends: usize,
    /// How often the backends file is looked at (its identity and modification time), or the
    /// DNS name re-resolved.
    pub backends_poll: Duration,
    /// Routing policy and its parameters (CacheRoute's interval and churn-awareness included).
    pub policy: PolicySpec,
    /// Seed for the policy's RNG and hash rings.
    pub seed: u64,
    /// Header carrying the routing key (checked before the body's `user`).
    pub key_header: String,
    /// Without a header or `user`, the key is a hash of the prompt's first this many characters.
    pub prefix_chars: usize,
    /// Tokens (words) per block when hashing prompt text into prefix blocks.
    pub block_tokens: u32,
    /// Active health check period and per-probe timeout (`GET {backend}/health`).
    pub health_interval: Duration,
    pub health_timeout: Duration,
    /// TCP connect timeout to a backend.
    pub connect_timeout: Duration,
    /// From sending a request to its first body byte (prefill included).
    pub first_byte_timeout: Duration,
    /// Longest silence between two body chunks once streaming.
    pub idle_timeout: Duration,
    /// Bearer token for `/admin/*`; `None` disables the admin API.
    pub admin_token: Option<String>,
    /// CacheRoute: install this plan (a `cacheroute plan --out` JSON) instead of planning online.
    pub plan_file: Option<PathBuf>,
    /// CacheRoute: install this plan at start, then keep planning online from measured rates
    /// (a warm start from a previous period's plan, or the state file a previous run wrote:
    /// then its measured rates seed the rate meter too).
    pub initial_plan: Option<PathBuf>,
    /// CacheRoute: at shutdown, write the installed plan and the last measured per-key rates
    /// here (JSON; what `initial_plan` reads), so a restart does not begin cold.
    pub state_file: Option<PathBuf>,
    /// Largest request body accepted (bytes); larger bodies get 413.
    pub max_body_bytes: usize,
    /// How long shutdown waits for in-flight requests and streams before cutting them.
    pub drain_timeout: Duration,
    /// Longest wait for a whole request head (idle keep-alive time included); then the
    /// connection closes.
    pub head_timeout: Duration,
    /// Longest time for a whole request body after its head; then `408` and close. A client
    /// that trickles its body cannot hold a connection and its buffer longer than this.
    pub body_timeout: Duration,
    /// Client connections open at once; past it a new connection gets `503` and is closed
    /// (counted as `connections_refused`).
    pub max_connections: usize,
    /// Request body bytes buffered at once over all connections (each request's declared
    /// length is reserved while it is read and forwarded); past it `503`.
    pub max_buffered_bytes: usize,
    /// Serving threads. 0: serve on the caller's tokio runtime. N ≥ 1: N threads, each with
    /// its own single-threaded runtime, its own `SO_REUSEPORT` listener on the address and its
    /// own upstream connection pool, so a request is accepted, routed, forwarded and streamed
    /// back without waking another thread (nginx's worker model; `cacheroute route` uses one
    /// per core).
    pub workers: usize,
    /// Record every routed request as a trace line (`--record`); `None`: no recording.
    pub record: Option<RecordConfig>,
    /// The engines' model, as `model:device:precision:tpN` (`--engine`): with it, CacheRoute
    /// chooses the q_cap, W and set bounding its configuration leaves open by replaying its
    /// recent traffic through the engine model, as the simulator does (with [`Self::tuner`]).
    pub engine: Option<String>,
    /// What replays that traffic: the command line gives the simulator's
    /// (`sim::tune::replay_tuner`); the router does not import the simulator. `None` with
    /// `engine` set: no self-calibration (said in the log).
    pub tuner: Option<crate::control::TunerFactory>,
    /// The engine model's knobs where the engines differ from its defaults (a study's
    /// `fleet.knobs`: KV cache bytes, batch limits); they shape the replays and the
    /// engine-dependent policy parameters as they shape the simulator's.
    pub engine_knobs: crate::engine::KnobOverrides,
    /// How many times faster than the engine model the backends run (`cacheroute emulate
    /// --time-scale`, as a local study runs its emulators; 1 for real engines). CacheRoute's
    /// control loop works in the model's time: its interval lasts `interval_s / time_scale`
    /// wall seconds, measured rates are divided by it and the self-calibration's replays
    /// stretch the recent arrivals by it, so q_cap, W and the replays mean what they mean in
    /// the simulator. The policies' clock (`now`, completion latencies) is the model's too.
    /// Every conversion goes through [`crate::bounds::TimeScale`], range-checked when made.
    pub time_scale: crate::bounds::TimeScale,
    /// CacheRoute: share one plan with the other replicas through etcd (`--etcd`).
    pub etcd: Option<EtcdConfig>,
    /// Subscribe to every destination's KV-cache events (`--kv-events-port-offset`).
    pub kv_events: Option<KvEventsConfig>,
    /// Every backend must be `http://IP:PORT`, no host name, no base path: the EPP names its
    /// destinations to Envoy that way (set by `epp::start`; a backends file is held to it too).
    pub ip_port_backends: bool,
}

impl RouterConfig {
    /// Defaults for everything but the listen address, backends and policy.
    pub fn new(listen: SocketAddr, backends: Vec<String>, policy: PolicySpec) -> Self {
        Self {
            listen,
            backends,
            backends_file: None,
            backends_dns: None,
            dns_server: None,
            max_backends: 0,
            backends_poll: Duration::from_secs(1),
            policy,
            seed: 0x5eed,
            key_header: "x-cacheroute-key".into(),
            prefix_chars: 256,
            block_tokens: 16,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(120),
            idle_timeout: Duration::from_secs(60),
            admin_token: None,
            plan_file: None,
            initial_plan: None,
            state_file: None,
            max_body_bytes: 4 << 20,
            drain_timeout: Duration::from_secs(30),
            head_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            max_connections: 4096,
            max_buffered_bytes: 256 << 20,
            workers: 0,
            ip_port_backends: false,
            record: None,
            engine: None,
            tuner: None,
            engine_knobs: crate::engine::KnobOverrides::default(),
            time_scale: crate::bounds::TimeScale::REAL,
            etcd: None,
            kv_events: None,
        }
    }

    /// The engines' model (`--engine`), at the router's prefix block size; `None` without one.
    /// The one parse of the spec: `validate` refuses a bad one, the policy's engine-dependent
    /// parameters and the self-calibration's replays use a good one.
    pub fn engine_model(
        &self,
    ) -> Option<Result<crate::engine::EngineConfig, crate::engine::EngineError>> {
        self.engine
            .as_deref()
            .map(|e| crate::engine::engine_config(e, self.block_tokens.max(1), &self.engine_knobs))
    }

    /// Whether CacheRoute self-calibrates: planning online, autotune on, something left to
    /// choose, and an engine model to replay through.
    pub fn self_calibrates(&self) -> bool {
        match &self.policy {
            PolicySpec::Cacheroute(c) => {
                self.engine.is_some()
                    && self.tuner.is_some()
                    && self.plan_file.is_none()
                    && c.autotune
                    && c.automatic()
            }
            _ => false,
        }
    }

    /// Drop a trailing `/v1` from backend URLs (the OpenAI base-URL habit: the router adds
    /// `/v1/…` and `/health` itself, so `http://h:p/v1` would send `/v1/v1/completions`), and
    /// log a one-line note for each. Returns the notes. Other paths are left for
    /// [`RouterConfig::validate`] to refuse.
    pub fn normalize_backends(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        for b in &mut self.backends {
            if let Some(base) = without_v1(b) {
                let note = format!("backend {b}: using {base} (the router adds /v1/… and /health to the engine's base URL)");
                tracing::info!("{note}");
                notes.push(note);
                *b = base;
            }
        }
        notes
    }

    /// Whether the backends change while routing (a watched backends file, or DNS).
    pub fn discovers(&self) -> bool {
        self.backends_file.is_some() || self.backends_dns.is_some()
    }

    /// Destination slots: one per backend, or with a backends file or DNS `max_backends` (0:
    /// the larger of 64 and twice the backends at start).
    pub fn slots(&self) -> usize {
        match (self.discovers(), self.max_backends) {
            (false, _) => self.backends.len(),
            (true, 0) => (2 * self.backends.len()).max(64),
            (true, m) => m,
        }
    }

    /// Every problem with the configuration, one per line, each naming its field.
    pub fn validate(&self) -> Result<(), RouterError> {
        let mut errs = Vec::new();
        // With DNS the backends are resolved when the router starts (`discovery::initial`).
        if self.backends.is_empty() && self.backends_dns.is_none() {
            errs.push(
                "backends: at least one backend URL is needed (`--backend http://host:port`)"
                    .to_string(),
            );
        }
        if self.backends.len() > u16::MAX as usize {
            errs.push(format!("backends: at most {} backends", u16::MAX));
        }
        for (i, b) in self.backends.iter().enumerate() {
            match BackendUrl::parse(b) {
                Err(why) => errs.push(format!("backends[{i}]: {why}")),
                Ok(u) if self.ip_port_backends => {
                    if let Err(why) = u.check_ip_port() {
                        errs.push(format!("backends[{i}]: {why}"));
                    }
                }
                Ok(_) => {}
            }
        }
        if self.backends_file.is_some() && self.backends_dns.is_some() {
            errs.push(
                "backends_dns: a backends file and DNS both name the backends; keep one".into(),
            );
        }
        if let Some(name) = &self.backends_dns {
            if let Err(why) = super::backend::DnsName::parse(name) {
                errs.push(format!("backends_dns: {why}"));
            }
        } else if self.dns_server.is_some() {
            errs.push("dns_server: only used with backends_dns (`--backends-dns`)".into());
        }
        if let Some(field) = self.discovers().then(|| {
            if self.backends_file.is_some() {
                "backends_file"
            } else {
                "backends_dns"
            }
        }) {
            if self.slots() < self.backends.len() || self.slots() > u16::MAX as usize {
                errs.push(format!(
                    "max_backends: {} must be between the {} backends discovered now and {}",
                    self.slots(),
                    self.backends.len(),
                    u16::MAX
                ));
            }
            if self.plan_file.is_some() || self.initial_plan.is_some() || self.state_file.is_some()
            {
                errs.push(format!("{field}: a plan file, initial plan or state file names destinations by index, which discovery changes; use one or the other"));
            }
            if self.backends_poll.is_zero() {
                errs.push("backends_poll: must be > 0".into());
            }
        }
        if axum::http::HeaderName::from_bytes(self.key_header.as_bytes()).is_err() {
            errs.push(format!(
                "key_header: `{}` is not a valid HTTP header name",
                self.key_header
            ));
        }
        if self.prefix_chars == 0 {
            errs.push("prefix_chars: must be ≥ 1".into());
        }
        if self.block_tokens == 0 {
            errs.push("block_tokens: must be ≥ 1".into());
        }
        if let (Some(e), Some(Err(why))) = (&self.engine, self.engine_model()) {
            // Failing without the knobs too, it is the spec; otherwise the knobs.
            if engine_config(e, self.block_tokens.max(1), &Default::default()).is_err() {
                errs.push(format!(
                    "engine: `{e}` is not an engine spec ({why}); e.g. llama-3.1-8b:h100:fp8:tp1"
                ));
            } else {
                errs.push(format!(
                    "engine_knobs: the engine model `{e}` cannot take them ({why}); fix or drop the knob"
                ));
            }
        }
        for (name, d) in [
            ("health_interval", self.health_interval),
            ("health_timeout", self.health_timeout),
            ("connect_timeout", self.connect_timeout),
            ("first_byte_timeout", self.first_byte_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if d.is_zero() {
                errs.push(format!("{name}: must be > 0"));
            }
        }
        if self.max_body_bytes == 0 {
            errs.push("max_body_bytes: must be ≥ 1".into());
        }
        if self.max_connections == 0 {
            errs.push("max_connections: must be ≥ 1".into());
        }
        if self.max_buffered_bytes < self.max_body_bytes {
            errs.push(format!(
                "max_buffered_bytes: {} is below max_body_bytes {}; one largest body must fit",
                self.max_buffered_bytes, self.max_body_bytes
            ));
        }
        for (name, d) in [
            ("head_timeout", self.head_timeout),
            ("body_timeout", self.body_timeout),
        ] {
            if d.is_zero() {
                errs.push(format!("{name}: must be > 0"));
            }
        }
        if self.engine_knobs != crate::engine::KnobOverrides::default() && self.engine.is_none() {
            errs.push("engine_knobs: they adjust the engine model; give `engine` too".into());
        }
        if matches!(&self.admin_token, Some(t) if t.is_empty()) {
            errs.push(
                "admin_token: empty; pass a non-empty token or none to disable the admin API"
                    .into(),
            );
        }
        errs.extend(
            self.policy
                .problems()
                .into_iter()
                .map(|p| format!("policy.{p}")),
        );
        if let PolicySpec::Cacheroute(c) = &self.policy {
            if !(c.interval_s.is_finite() && c.interval_s > 0.0) {
                errs.push("policy.interval_s: must be > 0 seconds".into());
            }
        } else if self.plan_file.is_some()
            || self.initial_plan.is_some()
            || self.state_file.is_some()
        {
            errs.push(format!(
                "plan_file: only the cacheroute policy uses a plan, but the policy is `{}`",
                self.policy.label()
            ));
        }
        if let Some(r) = &self.record {
            errs.extend(r.problems());
        }
        if let Some(e) = &self.etcd {
            errs.extend(e.problems());
            if !matches!(self.policy, PolicySpec::Cacheroute(_)) {
                errs.push(format!(
                    "etcd: replicas share a CacheRoute plan, but the policy is `{}`",
                    self.policy.label()
                ));
            }
            if self.plan_file.is_some() || self.initial_plan.is_some() {
                errs.push("etcd: the plan comes from etcd (installed at start, then watched); drop plan_file / initial_plan".into());
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(RouterError::Config(errs.join("\n")))
        }
    }
}

/// Why the router could not start (or reload).
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("invalid router configuration:\n{0}")]
    Config(String),
    /// The settings cannot make a configuration (`RouterConfig::from_settings`): no policy, a
    /// value that is not a duration, sources that exclude each other; one line naming the
    /// field.
    #[error("{0}")]
    Settings(String),
    #[error("cannot listen on {addr}: {source}; pick a free port or use port 0")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The backends file cannot be read or is refused; the message names it and the line.
    #[error("{0}")]
    BackendsFile(String),
    /// The backends' DNS name does not resolve to a backend at start; the message names it.
    #[error("{0}")]
    BackendsDns(String),
    #[error("plan file {path}: {msg}")]
    PlanFile { path: String, msg: String },
    #[error("building the HTTP client: {0}")]
    Client(String),
    /// The recording cannot start; the message names `--record` and what to do.
    #[error("{0}")]
    Record(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trailing_v1_is_dropped_and_other_paths_are_refused() {
        let mut c = RouterConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec![
                "http://127.0.0.1:9/v1".into(),
                "http://127.0.0.1:10/v1/".into(),
                "http://127.0.0.1:11".into(),
            ],
            PolicySpec::from_name("sticky").unwrap(),
        );
        let notes = c.normalize_backends();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].contains("using http://127.0.0.1:9 "), "{notes:?}");
        assert_eq!(
            c.backends,
            [
                "http://127.0.0.1:9",
                "http://127.0.0.1:10",
                "http://127.0.0.1:11"
            ]
        );
        assert!(c.validate().is_ok());
        assert!(
            c.normalize_backends().is_empty(),
            "a second pass changes nothing"
        );
        // A base path (an engine behind a path-routing proxy) is kept.
        c.backends = vec!["http://127.0.0.1:9/replica-3/".into()];
        assert!(c.normalize_backends().is_empty());
        assert!(c.validate().is_ok());
        for bad in [
            "http://127.0.0.1:9/v1/completions",
            "http://127.0.0.1:9/v1/models",
            "http://127.0.0.1:9/proxy/v1/chat/completions",
            "http://127.0.0.1:9/health",
            "http://127.0.0.1:9/?x=1",
            "http://u@127.0.0.1:9",
        ] {
            c.backends = vec![bad.into()];
            assert!(c.normalize_backends().is_empty());
            let e = c.validate().unwrap_err().to_string();
            assert!(
                e.contains("backends[0]") && e.contains("http://HOST:PORT"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn limits_out_of_range_are_refused_with_their_field() {
        let mut c = RouterConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            vec!["http://127.0.0.1:9".into()],
            PolicySpec::from_name("sticky").unwrap(),
        );
        assert!(c.validate().is_ok());
        c.policy = PolicySpec::from_name("chwbl").unwrap();
        if let PolicySpec::Chwbl { epsilon, .. } = &mut c.policy {
            *epsilon = -1.0;
        }
        c.max_connections = 0;
        c.max_buffered_bytes = c.max_body_bytes - 1;
        c.body_timeout = Duration::ZERO;
        let e = c.validate().unwrap_err().to_string();
        for field in [
            "max_connections",
            "max_buffered_bytes",
            "body_timeout",
            "policy.epsilon",
        ] {
            assert!(e.contains(field), "{field} not named: {e}");
        }
    }
}
