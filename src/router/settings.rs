//! The router's settings as its sources give them: [`RouterSettings`], every field optional,
//! is at once the command line's flags (`cacheroute route`, `cacheroute epp`) and the
//! `--config` YAML file (the same names in snake_case). Sources are layered field by field
//! ([`RouterSettings::over`]: flags over the file), then resolved once
//! ([`RouterConfig::from_settings`]: defaults, units, the rules between fields) and checked
//! ([`RouterConfig::validate`]).

use super::config::{EtcdConfig, RecordConfig, RouterConfig, RouterError};
use crate::policy::PolicySpec;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

/// The default `listen` of `cacheroute route`: not the emulator's or vLLM's 8000, nor
/// SGLang's 30000.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 8080));

/// The `policy` setting: a policy name (`--policy cacheroute`, `policy: chwbl`) or, in the
/// file, a policy spec map (`policy: {policy: cacheroute, interval_s: 10}`), kept as written
/// until [`RouterConfig::from_settings`] reads it, so that a bad one is refused naming the
/// field.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum PolicySetting {
    /// A policy name (`PolicySpec::from_name`).
    Name(String),
    /// A policy spec map (`PolicySpec`'s YAML form).
    Spec(yaml_serde::Value),
}

impl PolicySetting {
    /// `--policy NAME` (checked when the settings are resolved, as the file's name is).
    pub fn parse_name(name: &str) -> Result<Self, std::convert::Infallible> {
        Ok(Self::Name(name.to_string()))
    }

    /// A policy spec, as its YAML map.
    pub fn spec(p: &PolicySpec) -> Result<Self, yaml_serde::Error> {
        yaml_serde::to_value(p).map(Self::Spec)
    }

    /// The policy it names or spells out.
    fn resolve(self) -> Result<PolicySpec, RouterError> {
        match self {
            Self::Name(name) => PolicySpec::from_name(&name).map_err(RouterError::Settings),
            Self::Spec(v) => yaml_serde::from_value(v).map_err(|e| {
                RouterError::Settings(format!(
                    "config `policy`: not a policy spec (e.g. `{{policy: cacheroute, interval_s: 10}}`): {e}"
                ))
            }),
        }
    }
}

impl<'de> serde::Deserialize<'de> for PolicySetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match yaml_serde::Value::deserialize(d)? {
            yaml_serde::Value::String(name) => Self::Name(name),
            v => Self::Spec(v),
        })
    }
}

/// Declares [`RouterSettings`] from one list of fields, each `Option<…>`, with what follows
/// from the list: a `None` field is left out when written, and [`RouterSettings::over`]
/// layers two values field by field.
macro_rules! router_settings {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[$field_meta:meta])*
                pub $field:ident: Option<$ty:ty>,
            )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $(
                $(#[$field_meta])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )*
        }

        impl $name {
            /// These settings over `lower`: each field set here, else `lower`'s (flags over
            /// the config file, the config file over a front's own defaults).
            pub fn over(self, lower: Self) -> Self {
                Self {
                    $($field: self.$field.or(lower.$field),)*
                }
            }
        }
    };
}

router_settings! {
    /// The router's settings as one source gives them, every field optional: the flags of
    /// `cacheroute route` and `cacheroute epp` (`--backends-file`) and the fields of their
    /// `--config` YAML file (`backends_file`) alike. A field given nowhere takes the default
    /// its help names (`RouterConfig::from_settings`).
    #[derive(Debug, Clone, Default, PartialEq, clap::Args, serde::Serialize, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct RouterSettings {
        /// Address to listen on; port 0 picks a free port (the bound address is printed)
        /// [default: 127.0.0.1:8080].
        #[arg(long, value_name = "ADDR")]
        pub listen: Option<SocketAddr>,
        /// An engine's base URL, http://HOST:PORT (repeat for each engine; destination index =
        /// order given). A trailing /v1 is dropped; a path naming an endpoint (/v1/…, /health) is
        /// refused; another path is a base path (an engine behind a proxy).
        #[arg(long = "backend", value_name = "URL")]
        pub backends: Option<Vec<String>>,
        /// Read the backends from FILE (one base URL a line, # comments) and watch it: a file
        /// renamed over it is re-read and backends are added and removed without a restart; a bad
        /// file is refused with a log line and the backends in force kept (docs/router.md,
        /// "Discovery"). Instead of --backend.
        #[arg(long, value_name = "FILE", conflicts_with = "backends")]
        pub backends_file: Option<PathBuf>,
        /// Resolve the backends from DNS and re-resolve every second: http://NAME:PORT (every
        /// A/AAAA address of NAME, e.g. a Kubernetes headless Service) or srv+http://NAME (SRV
        /// records: each target's addresses at the record's port). A failed lookup or an empty
        /// answer keeps the backends in force with a log line (docs/router.md, "Discovery").
        /// Instead of --backend and --backends-file.
        #[arg(long, value_name = "URL", conflicts_with_all = ["backends", "backends_file"])]
        pub backends_dns: Option<String>,
        /// With --backends-dns: the DNS server to ask, IP:PORT [default: the system's, resolv.conf].
        #[arg(long, value_name = "ADDR", requires = "backends_dns")]
        pub dns_server: Option<SocketAddr>,
        /// With --backends-file or --backends-dns: destination slots, the most backends discovery
        /// may name [default: max(64, 2 × the backends at start)].
        #[arg(long, value_name = "N")]
        pub max_backends: Option<usize>,
        /// With --backends-file or --backends-dns: milliseconds between looks at the file (its
        /// identity, size and modification time) or between resolutions of the name
        /// [default: 1000].
        #[arg(long, value_name = "MS")]
        pub backends_poll_ms: Option<u64>,
        /// Policy: flat-lb, sticky, chwbl, dualmap, preble, llm-d (llm-d's router, its
        /// optimized-baseline profile), cacheroute, cacheroute-affinity,
        /// cacheroute-replication, cacheroute-paper (Algorithm 1 as published), cacheroute-p2c-tail,
        /// cacheroute-prefix-tail (Preble's scheduling for the cold tail), cacheroute-keys (without
        /// the conversation memory), dynamo (with --kv-events-port-offset). In --config also a policy spec
        /// (`{policy: cacheroute, interval_s: 10, …}`).
        #[arg(long, value_name = "POLICY", value_parser = PolicySetting::parse_name)]
        pub policy: Option<PolicySetting>,
        /// Header carrying the routing key [default: x-cacheroute-key].
        #[arg(long)]
        pub key_header: Option<String>,
        /// Without a key header or `user`, hash this many leading prompt characters [default: 256].
        #[arg(long)]
        pub prefix_chars: Option<usize>,
        /// Words per block when hashing prompt text [default: 16].
        #[arg(long)]
        pub block_tokens: Option<u32>,
        /// Health check period in milliseconds [default: 2000].
        #[arg(long)]
        pub health_interval_ms: Option<u64>,
        /// Health probe (GET /health) timeout in milliseconds [default: 1000].
        #[arg(long, value_name = "MS")]
        pub health_timeout_ms: Option<u64>,
        /// TCP connect timeout to a backend in milliseconds [default: 2000].
        #[arg(long, value_name = "MS")]
        pub connect_timeout_ms: Option<u64>,
        /// First-byte timeout in seconds [default: 120].
        #[arg(long)]
        pub first_byte_timeout_s: Option<f64>,
        /// Longest silence between two body chunks of a backend's answer once streaming, in
        /// seconds [default: 60].
        #[arg(long, value_name = "S")]
        pub idle_timeout_s: Option<f64>,
        /// Bearer token for /admin/* (disabled when unset). With CacheRoute it also keeps the
        /// names of keys sent in the key header or `user` (at most 65536) for /admin/plan?table=true.
        #[arg(long, env = "CACHEROUTE_ADMIN_TOKEN", hide_env_values = true)]
        pub admin_token: Option<String>,
        /// CacheRoute: install this plan (`cacheroute plan --out`) instead of planning online.
        #[arg(long)]
        pub plan_file: Option<PathBuf>,
        /// CacheRoute: install this plan at start, then keep planning online (warm start); a
        /// state file written by `--state-file` also seeds the measured rates.
        #[arg(long, conflicts_with = "plan_file")]
        pub initial_plan: Option<PathBuf>,
        /// CacheRoute: at shutdown write the installed plan and measured rates here, for the next
        /// start's `--initial-plan`.
        #[arg(long)]
        pub state_file: Option<PathBuf>,
        /// Seed for the policy's RNG and hash rings [default: 24301].
        #[arg(long)]
        pub seed: Option<u64>,
        /// Seconds to wait for in-flight streams at shutdown [default: 30].
        #[arg(long)]
        pub drain_timeout_s: Option<f64>,
        /// Client connections open at once; past it 503 and close [default: 4096].
        #[arg(long)]
        pub max_connections: Option<usize>,
        /// Seconds for a whole request head (idle keep-alive time included); then the connection
        /// closes [default: 30].
        #[arg(long, value_name = "S")]
        pub head_timeout_s: Option<f64>,
        /// Seconds for a whole request body after its head; then 408 [default: 30].
        #[arg(long)]
        pub body_timeout_s: Option<f64>,
        /// Largest request body accepted, in bytes; a larger one gets 413
        /// [default: 4194304 (4 MiB)].
        #[arg(long, value_name = "BYTES")]
        pub max_body_bytes: Option<usize>,
        /// Request body bytes buffered at once over all connections (each request's declared
        /// length is reserved while it is read and forwarded); past it 503. At least
        /// --max-body-bytes [default: 268435456 (256 MiB)].
        #[arg(long, value_name = "BYTES")]
        pub max_buffered_bytes: Option<usize>,
        /// Serving threads, each with its own runtime, SO_REUSEPORT listener and upstream pool
        /// [default: one per core; 0 = one shared multi-threaded runtime].
        #[arg(long)]
        pub workers: Option<usize>,
        /// Record every routed request to this trace file (JSONL, docs/trace-format.md): key
        /// hashes, token counts, block hashes, timings — never prompt or completion text. An
        /// existing trace is appended to.
        #[arg(long, value_name = "FILE")]
        pub record: Option<PathBuf>,
        /// Rotate the --record file when it reaches this many bytes [default: 268435456 (256 MiB)].
        #[arg(long, value_name = "N")]
        pub record_max_bytes: Option<u64>,
        /// Rotated --record files kept (FILE.1 newest … FILE.K) [default: 8].
        #[arg(long, value_name = "K")]
        pub record_keep: Option<usize>,
        /// Seconds a finished record waits for earlier requests still running, so the trace stays
        /// in arrival order [default: 10].
        #[arg(long, value_name = "S")]
        pub record_hold_s: Option<f64>,
        /// Records queued for the --record file's writer; one that finds the queue full is
        /// dropped and counted [default: 16384].
        #[arg(long, value_name = "N")]
        pub record_queue: Option<usize>,
        /// The engines' model, model:device:precision:tpN (e.g. llama-3.1-8b:h100:fp8:tp1): with
        /// it CacheRoute chooses whatever of q_cap, W and bounded sets is not given by replaying
        /// its recent traffic through the engine model each few intervals (docs/cacheroute.md).
        #[arg(long, value_name = "SPEC")]
        pub engine: Option<String>,
        /// The engine model's knobs where the engines differ from its defaults (a study's
        /// `fleet.knobs`: `kv_cache_bytes`, …); with `engine`. Config file only.
        #[arg(skip)]
        pub engine_knobs: Option<crate::engine::KnobOverrides>,
        /// The backends run this many times faster than the engine model (`cacheroute emulate
        /// --time-scale F`): CacheRoute's control loop then keeps its interval, rates and replays
        /// in the model's time [default: 1, real engines].
        #[arg(long, value_name = "F")]
        pub time_scale: Option<crate::bounds::TimeScale>,
        /// CacheRoute: share one plan with the other replicas through etcd v3 at this client URL
        /// (http://HOST:PORT): each replica publishes its measured rates, a leader holding a lease
        /// plans from all of them, every replica installs that plan, also before it serves
        /// (docs/router.md, "Many replicas, one plan").
        #[arg(long, value_name = "URL")]
        pub etcd: Option<String>,
        /// With --etcd: the key prefix this fleet's replicas share [default: /cacheroute/default].
        #[arg(long, value_name = "PREFIX")]
        pub etcd_prefix: Option<String>,
        /// With --etcd: this replica's name, unique among them [default: HOSTNAME-PID].
        #[arg(long, value_name = "ID")]
        pub replica_id: Option<String>,
        /// With --etcd: lease TTL in whole seconds: a replica silent this long loses its rates
        /// and the leader role [default: 10].
        #[arg(long, value_name = "S")]
        pub etcd_lease_ttl_s: Option<u64>,
        /// Subscribe to every destination's KV-cache events, published (as vLLM's
        /// --kv-events-config does, or `cacheroute emulate`'s) at the backend's port + N, with
        /// the replay endpoint at port + N + 1 (docs/kv-events.md). Needed by `dynamo`; with it,
        /// Preble's tree and CacheRoute's prefix dispatch follow the events unless their
        /// `from_events` is false.
        #[arg(long, value_name = "N")]
        pub kv_events_port_offset: Option<u16>,
        /// With --kv-events-port-offset: the topic subscribed to [default: empty, as vLLM's].
        #[arg(long, value_name = "TOPIC")]
        pub kv_events_topic: Option<String>,
    }
}

/// `v` seconds as a positive duration, or a one-line error naming `field`.
fn secs(field: &str, v: f64) -> Result<Duration, RouterError> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            RouterError::Settings(format!(
                "{field}: `{v}` is not a positive number of seconds"
            ))
        })
}

impl RouterConfig {
    /// The configuration the (layered) settings make: the policy they name, the defaults for
    /// what they leave unset (`workers`: one per core), seconds and milliseconds as durations,
    /// the backends file read, and refused — one line naming the field — where sources of the
    /// backends or of the plan exclude each other, a value is not a duration, or a `record_…`
    /// or `etcd_…` field comes without `record` or `etcd`. Not yet validated: the caller may
    /// adjust it (a tuner, the planner flags), then calls [`RouterConfig::validate`].
    pub fn from_settings(s: RouterSettings) -> Result<Self, RouterError> {
        let policy = match s.policy {
            Some(p) => p.resolve()?,
            None => return Err(RouterError::Settings(
                "no policy: pass --policy (e.g. --policy cacheroute) or set `policy:` in --config"
                    .into(),
            )),
        };
        if policy.reads_kv_events() && s.kv_events_port_offset.is_none() {
            return Err(RouterError::Settings(format!(
                "policy `{}` routes by the engines' KV-cache events: pass \
                 --kv-events-port-offset N (each backend publishes them at its port + N, as \
                 vLLM's --kv-events-config endpoint; replay at + N + 1){}",
                policy.label(),
                if matches!(policy, PolicySpec::Dynamo(_)) {
                    ""
                } else {
                    ", or leave its from_events unset to route on its own tree"
                }
            )));
        }
        if s.kv_events_topic.is_some() && s.kv_events_port_offset.is_none() {
            return Err(RouterError::Settings(
                "kv_events_topic: set without kv_events_port_offset; set both or neither".into(),
            ));
        }
        let kv_events = s
            .kv_events_port_offset
            .map(|port_offset| super::config::KvEventsConfig {
                port_offset,
                topic: s.kv_events_topic.clone().unwrap_or_default(),
            });
        let mut backends = s.backends.unwrap_or_default();
        if let Some(f) = &s.backends_file {
            if !backends.is_empty() {
                return Err(RouterError::Settings(
                    "router config: `backends` and `backends_file` are both set; keep one".into(),
                ));
            }
            backends = super::lifecycle::read_backends_file(f)?;
        }
        if s.backends_dns.is_some() && (!backends.is_empty() || s.backends_file.is_some()) {
            return Err(RouterError::Settings(
                "backends DNS and a backend list or backends file: give the backends in one of them"
                    .into(),
            ));
        }
        let mut c = RouterConfig::new(s.listen.unwrap_or(DEFAULT_LISTEN), backends, policy);
        c.normalize_backends();
        c.kv_events = kv_events;
        c.backends_file = s.backends_file;
        c.backends_dns = s.backends_dns;
        c.dns_server = s.dns_server;
        if let Some(v) = s.max_backends {
            c.max_backends = v;
        }
        if let Some(v) = s.backends_poll_ms {
            c.backends_poll = Duration::from_millis(v);
        }
        if let Some(v) = s.key_header {
            c.key_header = v.to_ascii_lowercase();
        }
        if let Some(v) = s.prefix_chars {
            c.prefix_chars = v;
        }
        if let Some(v) = s.block_tokens {
            c.block_tokens = v;
        }
        if let Some(v) = s.seed {
            c.seed = v;
        }
        if let Some(v) = s.health_interval_ms {
            c.health_interval = Duration::from_millis(v);
        }
        if let Some(v) = s.health_timeout_ms {
            c.health_timeout = Duration::from_millis(v);
        }
        if let Some(v) = s.connect_timeout_ms {
            c.connect_timeout = Duration::from_millis(v);
        }
        if let Some(v) = s.first_byte_timeout_s {
            c.first_byte_timeout = secs("first_byte_timeout_s", v)?;
        }
        if let Some(v) = s.idle_timeout_s {
            c.idle_timeout = secs("idle_timeout_s", v)?;
        }
        c.admin_token = s.admin_token;
        c.plan_file = s.plan_file;
        c.initial_plan = s.initial_plan;
        c.state_file = s.state_file;
        if c.plan_file.is_some() && c.initial_plan.is_some() {
            return Err(RouterError::Settings(
                "give either plan_file (fixed plan) or initial_plan (warm start, then online), not both"
                    .into(),
            ));
        }
        if let Some(v) = s.max_body_bytes {
            c.max_body_bytes = v;
        }
        if let Some(v) = s.drain_timeout_s {
            c.drain_timeout = secs("drain_timeout_s", v)?;
        }
        if let Some(v) = s.head_timeout_s {
            c.head_timeout = secs("head_timeout_s", v)?;
        }
        if let Some(v) = s.body_timeout_s {
            c.body_timeout = secs("body_timeout_s", v)?;
        }
        if let Some(v) = s.max_connections {
            c.max_connections = v;
        }
        if let Some(v) = s.max_buffered_bytes {
            c.max_buffered_bytes = v;
        }
        c.record = match s.record {
            Some(path) => {
                let mut r = RecordConfig::new(path);
                if let Some(v) = s.record_max_bytes {
                    r.max_bytes = v;
                }
                if let Some(v) = s.record_keep {
                    r.keep = v;
                }
                if let Some(v) = s.record_hold_s {
                    r.hold = Duration::try_from_secs_f64(v).map_err(|_| {
                        RouterError::Settings(format!(
                            "record_hold_s: `{v}` is not a number of seconds ≥ 0"
                        ))
                    })?;
                }
                if let Some(v) = s.record_queue {
                    r.queue = v;
                }
                Some(r)
            }
            None if s.record_max_bytes.is_some()
                || s.record_keep.is_some()
                || s.record_hold_s.is_some()
                || s.record_queue.is_some() =>
            {
                return Err(RouterError::Settings("--record-max-bytes, --record-keep and --record-hold-s need --record FILE (or `record:` in --config)".into()));
            }
            None => None,
        };
        c.engine = s.engine;
        if let Some(k) = s.engine_knobs {
            c.engine_knobs = k;
        }
        if let Some(f) = s.time_scale {
            c.time_scale = f;
        }
        c.etcd = match s.etcd {
            Some(url) => {
                let mut e = EtcdConfig::new(url);
                if let Some(p) = s.etcd_prefix {
                    e.prefix = p;
                }
                if let Some(id) = s.replica_id {
                    e.replica_id = id;
                }
                if let Some(t) = s.etcd_lease_ttl_s {
                    e.lease_ttl = Duration::from_secs(t);
                }
                Some(e)
            }
            None if s.etcd_prefix.is_some()
                || s.replica_id.is_some()
                || s.etcd_lease_ttl_s.is_some() =>
            {
                return Err(RouterError::Settings("--etcd-prefix, --replica-id and --etcd-lease-ttl-s need --etcd URL (or `etcd:` in --config)".into()));
            }
            None => None,
        };
        c.workers = s.workers.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(text: &str) -> Result<RouterSettings, yaml_serde::Error> {
        yaml_serde::from_str(text)
    }

    #[test]
    fn a_set_field_wins_and_an_unset_one_keeps_the_lower_layer_s() {
        let file = yaml(
            "listen: 127.0.0.1:7000\nbackends: [http://a:1, http://b:2]\npolicy: {policy: chwbl}\n\
             seed: 7\nfirst_byte_timeout_s: 5.5\nrecord: /tmp/t.jsonl\nadmin_token: file\n",
        )
        .unwrap();
        let flags = RouterSettings {
            backends: Some(vec!["http://c:3".into()]),
            policy: Some(PolicySetting::Name("sticky".into())),
            seed: Some(9),
            workers: Some(2),
            ..Default::default()
        };
        let s = flags.over(file.clone());
        // Set above: a list, the policy (a name over a spec map), a number, a number set only
        // above.
        assert_eq!(s.backends, Some(vec!["http://c:3".to_string()]));
        assert_eq!(s.policy, Some(PolicySetting::Name("sticky".into())));
        assert_eq!((s.seed, s.workers), (Some(9), Some(2)));
        // Unset above: an address, a float, a path, a string kept from below.
        assert_eq!(s.listen, file.listen);
        assert_eq!(s.first_byte_timeout_s, Some(5.5));
        assert_eq!(s.record, Some(PathBuf::from("/tmp/t.jsonl")));
        assert_eq!(s.admin_token.as_deref(), Some("file"));
        // Nothing above: the lower layer whole; nothing below: the upper one whole.
        assert_eq!(RouterSettings::default().over(file.clone()), file);
        assert_eq!(file.clone().over(RouterSettings::default()), file);
    }

    #[test]
    fn an_unknown_field_is_refused_by_name() {
        let e = yaml("policy: sticky\nhealth_interval: 5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `health_interval`"), "{e}");
    }

    #[test]
    fn settings_written_read_back_the_same() {
        let policy = PolicySpec::from_name("cacheroute").unwrap();
        let s = RouterSettings {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            backends: Some(vec!["http://127.0.0.1:9".into(), "http://h:10/base".into()]),
            policy: Some(PolicySetting::spec(&policy).unwrap()),
            block_tokens: Some(64),
            first_byte_timeout_s: Some(600.0),
            time_scale: Some(crate::bounds::TimeScale::new(8.0).unwrap()),
            record: Some("/tmp/t.jsonl".into()),
            record_hold_s: Some(0.25),
            engine: Some("llama-3.1-8b:h100:fp8:tp1".into()),
            engine_knobs: Some(yaml_serde::from_str("kv_cache_bytes: 6.0e9").unwrap()),
            initial_plan: Some("/tmp/plan.json".into()),
            ..Default::default()
        };
        let text = yaml_serde::to_string(&s).unwrap();
        // Unset fields are left out.
        let keys: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with([' ', '-']))
            .filter_map(|l| l.split(':').next())
            .collect();
        assert_eq!(
            keys,
            [
                "listen",
                "backends",
                "policy",
                "block_tokens",
                "first_byte_timeout_s",
                "initial_plan",
                "record",
                "record_hold_s",
                "engine",
                "engine_knobs",
                "time_scale"
            ],
            "{text}"
        );
        let back = yaml(&text).unwrap();
        assert_eq!(back, s, "{text}");
        // The spec map resolves to the policy written.
        let PolicySetting::Spec(_) = back.policy.as_ref().unwrap() else {
            panic!("{text}")
        };
        assert_eq!(RouterConfig::from_settings(back).unwrap().policy, policy);
        // A name stays a name.
        let s = RouterSettings {
            policy: Some(PolicySetting::Name("chwbl".into())),
            ..Default::default()
        };
        let text = yaml_serde::to_string(&s).unwrap();
        assert_eq!(text.trim(), "policy: chwbl");
        assert_eq!(yaml(&text).unwrap(), s);
    }

    #[test]
    fn resolution_fills_defaults_and_converts_units() {
        let c = RouterConfig::from_settings(
            yaml(
                "policy: sticky\nbackends: [http://127.0.0.1:9/v1]\nhealth_timeout_ms: 250\n\
                 idle_timeout_s: 1.5\nkey_header: X-Key\nworkers: 0\n",
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(c.listen, DEFAULT_LISTEN);
        assert_eq!(c.backends, ["http://127.0.0.1:9"]);
        assert_eq!(c.health_timeout, Duration::from_millis(250));
        assert_eq!(c.idle_timeout, Duration::from_millis(1500));
        assert_eq!((c.key_header.as_str(), c.workers), ("x-key", 0));
        assert!(c.validate().is_ok());
        for (text, needle) in [
            ("backends: [http://h:1]\n", "no policy: pass --policy"),
            ("policy: nope\n", "nope"),
            (
                "policy: {policy: sticky, colour: 1}\n",
                "config `policy`: not a policy spec",
            ),
            (
                "policy: sticky\nhead_timeout_s: 0\n",
                "head_timeout_s: `0` is not a positive number of seconds",
            ),
            (
                "policy: sticky\nrecord: t\nrecord_hold_s: -1\n",
                "record_hold_s: `-1` is not a number of seconds ≥ 0",
            ),
            ("policy: sticky\nrecord_queue: 5\n", "need --record FILE"),
            ("policy: sticky\nreplica_id: a\n", "need --etcd URL"),
            (
                "policy: cacheroute\nplan_file: a\ninitial_plan: b\n",
                "not both",
            ),
            (
                "policy: sticky\nbackends: [http://h:1]\nbackends_dns: http://h:1\n",
                "backends DNS and a backend list",
            ),
            (
                "policy: dynamo\n",
                "policy `dynamo` routes by the engines' KV-cache events",
            ),
        ] {
            let e = RouterConfig::from_settings(yaml(text).unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle) && !e.contains('\n'), "{text}: {e}");
        }
    }
}
