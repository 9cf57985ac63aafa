//! `cacheroute route`: run the live router (`crate::router`) until Ctrl-C or SIGTERM, then drain.
//! Prints `listening on http://ADDR` on one line once bound, so a parent process can read the
//! port when it asked for port 0. Flags override the optional `--config` YAML file. Everything
//! else it says (destinations down/up, plans, shutdown) is a log line on stderr.

use crate::policy::cacheroute::{ColdTail, LoadSignal};
use crate::policy::PolicySpec;
use crate::router::{self, RecordConfig, RouterConfig};
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The default `--listen`: not the emulator's or vLLM's 8000, nor SGLang's 30000.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

const ROUTE_EXAMPLES: &str = "\
Examples:
  # Two engines (vLLM, SGLang or `cacheroute emulate`), CacheRoute planning online:
  cacheroute route --backend http://127.0.0.1:8000 --backend http://127.0.0.1:8001 \\
      --policy cacheroute --q-cap 4 --warm-slots 800 --admin-token \"$TOKEN\"

  # Consistent hashing with bounded loads, every request recorded as a trace, debug logs as JSON:
  RUST_LOG=debug cacheroute route --log-format json --listen 0.0.0.0:8080 \\
      --backend http://gpu-1:8000 --backend http://gpu-2:8000 --policy chwbl --record traffic.jsonl

Logs go to stderr (RUST_LOG, --log-format); `listening on http://ADDR` is the one stdout line.
See docs/router.md.";

#[derive(clap::Args, Debug)]
#[command(after_help = ROUTE_EXAMPLES)]
pub struct RouteArgs {
    /// Exit when standard input closes (set by a parent study runner).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
    /// Address to listen on; port 0 picks a free port (the bound address is printed)
    /// [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// An engine's base URL, http://HOST:PORT (repeat for each engine; destination index =
    /// order given). A trailing /v1 is dropped; a path naming an endpoint (/v1/…, /health) is
    /// refused; another path is a base path (an engine behind a proxy).
    #[arg(long = "backend", value_name = "URL")]
    pub backends: Vec<String>,
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
    /// Policy: flat-lb, sticky, chwbl, dualmap, preble, cacheroute, cacheroute-affinity,
    /// cacheroute-replication, cacheroute-paper (Algorithm 1 as published), cacheroute-p2c-tail,
    /// cacheroute-prefix-tail (Preble's scheduling for the cold tail), cacheroute-keys (without
    /// the conversation memory).
    #[arg(long)]
    pub policy: Option<String>,
    /// YAML file with any of the fields below (flags win); see docs/router.md.
    #[arg(long)]
    pub config: Option<PathBuf>,
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
    /// First-byte timeout in seconds [default: 120].
    #[arg(long)]
    pub first_byte_timeout_s: Option<f64>,
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
    /// CacheRoute: control interval in seconds (overrides the policy's `interval_s`).
    #[arg(long)]
    pub interval_s: Option<f64>,
    /// CacheRoute: rebuild a fresh plan every interval instead of the churn-aware replan.
    #[arg(long)]
    pub fresh_plans: bool,
    /// CacheRoute: one destination's capacity in requests/s; a key is replicated on
    /// ⌈rate / q_cap⌉ destinations (overrides the policy's `q_cap`; 0 = measured total rate /
    /// live destinations).
    #[arg(long, value_name = "REQ_PER_S")]
    pub q_cap: Option<f64>,
    /// CacheRoute: warm slots W per destination; at most R·W key replicas are admitted
    /// (overrides `warm_slots`; 0 = 1024).
    #[arg(long, value_name = "W")]
    pub warm_slots: Option<u64>,
    /// CacheRoute: EWMA weight of the newest interval in measured rates, in (0, 1]
    /// (overrides `rate_alpha`) [policy default: 0.5].
    #[arg(long, value_name = "ALPHA")]
    pub rate_alpha: Option<f64>,
    /// CacheRoute: churn-aware replanning keeps placements while the plan's max/mean load is
    /// within this factor of a fresh plan's (overrides `max_imbalance`) [policy default: 1.05].
    #[arg(long, value_name = "FACTOR")]
    pub max_imbalance: Option<f64>,
    /// CacheRoute: where keys outside the plan go: chwbl (consistent hashing with bounded
    /// loads), p2c (power of two choices) or prefix (Preble's prefix-tree scheduling over every
    /// request's blocks) (overrides `cold_tail`) [policy default: chwbl].
    #[arg(long, value_name = "chwbl|p2c|prefix", value_parser = by_yaml_name::<ColdTail>)]
    pub cold_tail: Option<ColdTail>,
    /// CacheRoute: ε of a CHWBL cold tail's load bound (overrides `cold_tail_epsilon`)
    /// [policy default: 0.25].
    #[arg(long, value_name = "EPS")]
    pub cold_tail_epsilon: Option<f64>,
    /// CacheRoute: load signal for least-loaded choices: prefill (queued prompt tokens) or
    /// outstanding (requests) (overrides `load`) [policy default: prefill].
    #[arg(long, value_name = "prefill|outstanding", value_parser = by_yaml_name::<LoadSignal>)]
    pub load: Option<LoadSignal>,
    /// CacheRoute: a planned key whose every destination is over the cold tail's bound goes
    /// the cold tail's way (true), or stays on its set whatever the load (false)
    /// (overrides `bounded_sets`) [policy default: false].
    #[arg(long, value_name = "BOOL")]
    pub bounded_sets: Option<bool>,
    /// CacheRoute: byte-aware admission (value = rate × prefix tokens, slots in KV blocks)
    /// (sets `byte_aware`).
    #[arg(long)]
    pub byte_aware: bool,
    /// Seed for the policy's RNG and hash rings [default: 24301].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Seconds to wait for in-flight streams at shutdown [default: 30].
    #[arg(long)]
    pub drain_timeout_s: Option<f64>,
    /// Client connections open at once; past it 503 and close [default: 4096].
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds for a whole request body after its head; then 408 [default: 30].
    #[arg(long)]
    pub body_timeout_s: Option<f64>,
    /// Serving threads, each with its own runtime, SO_REUSEPORT listener and upstream pool
    /// [default: one per core; 0 = one shared multi-threaded runtime].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Record every routed request to this trace file (JSONL, docs/trace-format.md): key
    /// hashes, token counts, block hashes, timings — never prompt or completion text. An
    /// existing trace is appended to.
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// The engines' model, model:device:precision:tpN (e.g. llama-3.1-8b:h100:fp8:tp1): with
    /// it CacheRoute chooses whatever of q_cap, W and bounded sets is not given by replaying
    /// its recent traffic through the engine model each few intervals (docs/cacheroute.md).
    #[arg(long, value_name = "SPEC")]
    pub engine: Option<String>,
    /// The backends run this many times faster than the engine model (`cacheroute emulate
    /// --time-scale F`): CacheRoute's control loop then keeps its interval, rates and replays
    /// in the model's time [default: 1, real engines].
    #[arg(long, value_name = "F")]
    pub time_scale: Option<crate::bounds::TimeScale>,
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
}

/// The YAML form of the router's settings (every field optional).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    backends: Option<Vec<String>>,
    backends_file: Option<PathBuf>,
    backends_dns: Option<String>,
    dns_server: Option<SocketAddr>,
    max_backends: Option<usize>,
    backends_poll_ms: Option<u64>,
    /// A policy name, or a policy spec (`{policy: cacheroute, interval_s: 10, …}`).
    policy: Option<yaml_serde::Value>,
    key_header: Option<String>,
    prefix_chars: Option<usize>,
    block_tokens: Option<u32>,
    seed: Option<u64>,
    workers: Option<usize>,
    health_interval_ms: Option<u64>,
    health_timeout_ms: Option<u64>,
    connect_timeout_ms: Option<u64>,
    first_byte_timeout_s: Option<f64>,
    idle_timeout_s: Option<f64>,
    admin_token: Option<String>,
    plan_file: Option<PathBuf>,
    initial_plan: Option<PathBuf>,
    state_file: Option<PathBuf>,
    max_body_bytes: Option<usize>,
    drain_timeout_s: Option<f64>,
    head_timeout_s: Option<f64>,
    body_timeout_s: Option<f64>,
    max_connections: Option<usize>,
    max_buffered_bytes: Option<usize>,
    record: Option<PathBuf>,
    record_max_bytes: Option<u64>,
    record_keep: Option<usize>,
    record_hold_s: Option<f64>,
    record_queue: Option<usize>,
    engine: Option<String>,
    /// The engine model's knobs (a study's `fleet.knobs`: `kv_cache_bytes`, …).
    engine_knobs: Option<crate::engine::KnobOverrides>,
    time_scale: Option<crate::bounds::TimeScale>,
    etcd: Option<String>,
    etcd_prefix: Option<String>,
    replica_id: Option<String>,
    etcd_lease_ttl_s: Option<u64>,
}

fn secs(field: &str, v: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{field}: `{v}` is not a positive number of seconds"))
}

/// Resolve flags and the config file into a [`RouterConfig`].
pub fn config(a: &RouteArgs) -> Result<RouterConfig> {
    let file: FileConfig = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading router config {}", p.display()))?;
            yaml_serde::from_str(&text).with_context(|| {
                format!("router config {}: not a valid router YAML", p.display())
            })?
        }
        None => FileConfig::default(),
    };
    let mut policy = match (&a.policy, &file.policy) {
        (Some(name), _) => PolicySpec::from_name(name).map_err(anyhow::Error::msg)?,
        (None, Some(yaml_serde::Value::String(name))) => {
            PolicySpec::from_name(name).map_err(anyhow::Error::msg)?
        }
        (None, Some(v)) => yaml_serde::from_value(v.clone()).context(
            "config `policy`: not a policy spec (e.g. `{policy: cacheroute, interval_s: 10}`)",
        )?,
        (None, None) => bail!(
            "no policy: pass --policy (e.g. --policy cacheroute) or set `policy:` in --config"
        ),
    };
    apply_planner_flags(a, &mut policy)?;
    let mut backends = file.backends.unwrap_or_default();
    if !a.backends.is_empty() {
        backends = a.backends.clone();
    }
    let listen = a
        .listen
        .or(file.listen)
        .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("literal address"));
    let backends_file = a.backends_file.clone().or(file.backends_file);
    if backends_file.is_some() && !a.backends.is_empty() {
        bail!("--backend and a backends file: give the backends in one of them");
    }
    if let Some(f) = &backends_file {
        if !backends.is_empty() {
            bail!("router config: `backends` and `backends_file` are both set; keep one");
        }
        backends = router::read_backends_file(f)?;
    }
    let backends_dns = a.backends_dns.clone().or(file.backends_dns);
    if backends_dns.is_some() && (!backends.is_empty() || backends_file.is_some()) {
        bail!("backends DNS and a backend list or backends file: give the backends in one of them");
    }
    let mut c = RouterConfig::new(listen, backends, policy);
    c.normalize_backends();
    c.backends_file = backends_file;
    c.backends_dns = backends_dns;
    c.dns_server = a.dns_server.or(file.dns_server);
    if let Some(v) = a.max_backends.or(file.max_backends) {
        c.max_backends = v;
    }
    if let Some(v) = file.backends_poll_ms {
        c.backends_poll = Duration::from_millis(v);
    }
    if let Some(v) = a.key_header.clone().or(file.key_header) {
        c.key_header = v.to_ascii_lowercase();
    }
    if let Some(v) = a.prefix_chars.or(file.prefix_chars) {
        c.prefix_chars = v;
    }
    if let Some(v) = a.block_tokens.or(file.block_tokens) {
        c.block_tokens = v;
    }
    if let Some(v) = a.seed.or(file.seed) {
        c.seed = v;
    }
    if let Some(v) = a.health_interval_ms.or(file.health_interval_ms) {
        c.health_interval = Duration::from_millis(v);
    }
    if let Some(v) = file.health_timeout_ms {
        c.health_timeout = Duration::from_millis(v);
    }
    if let Some(v) = file.connect_timeout_ms {
        c.connect_timeout = Duration::from_millis(v);
    }
    if let Some(v) = a.first_byte_timeout_s.or(file.first_byte_timeout_s) {
        c.first_byte_timeout = secs("first_byte_timeout_s", v)?;
    }
    if let Some(v) = file.idle_timeout_s {
        c.idle_timeout = secs("idle_timeout_s", v)?;
    }
    c.admin_token = a.admin_token.clone().or(file.admin_token);
    c.plan_file = a.plan_file.clone().or(file.plan_file);
    c.initial_plan = a.initial_plan.clone().or(file.initial_plan);
    c.state_file = a.state_file.clone().or(file.state_file);
    if c.plan_file.is_some() && c.initial_plan.is_some() {
        bail!("give either plan_file (fixed plan) or initial_plan (warm start, then online), not both");
    }
    if let Some(v) = file.max_body_bytes {
        c.max_body_bytes = v;
    }
    if let Some(v) = a.drain_timeout_s.or(file.drain_timeout_s) {
        c.drain_timeout = secs("drain_timeout_s", v)?;
    }
    if let Some(v) = file.head_timeout_s {
        c.head_timeout = secs("head_timeout_s", v)?;
    }
    if let Some(v) = a.body_timeout_s.or(file.body_timeout_s) {
        c.body_timeout = secs("body_timeout_s", v)?;
    }
    if let Some(v) = a.max_connections.or(file.max_connections) {
        c.max_connections = v;
    }
    if let Some(v) = file.max_buffered_bytes {
        c.max_buffered_bytes = v;
    }
    c.record = match a.record.clone().or(file.record) {
        Some(path) => {
            let mut r = RecordConfig::new(path);
            if let Some(v) = a.record_max_bytes.or(file.record_max_bytes) {
                r.max_bytes = v;
            }
            if let Some(v) = a.record_keep.or(file.record_keep) {
                r.keep = v;
            }
            if let Some(v) = a.record_hold_s.or(file.record_hold_s) {
                r.hold = Duration::try_from_secs_f64(v).ok().with_context(|| {
                    format!("record_hold_s: `{v}` is not a number of seconds ≥ 0")
                })?;
            }
            if let Some(v) = file.record_queue {
                r.queue = v;
            }
            Some(r)
        }
        None if a.record_max_bytes.is_some()
            || a.record_keep.is_some()
            || a.record_hold_s.is_some()
            || file.record_max_bytes.is_some()
            || file.record_keep.is_some()
            || file.record_hold_s.is_some()
            || file.record_queue.is_some() =>
        {
            bail!("--record-max-bytes, --record-keep and --record-hold-s need --record FILE (or `record:` in --config)")
        }
        None => None,
    };
    c.engine = a.engine.clone().or(file.engine);
    if let Some(k) = file.engine_knobs {
        c.engine_knobs = k;
    }
    if let Some(f) = a.time_scale.or(file.time_scale) {
        c.time_scale = f;
    }
    c.etcd = match a.etcd.clone().or(file.etcd) {
        Some(url) => {
            let mut e = router::EtcdConfig::new(url);
            if let Some(p) = a.etcd_prefix.clone().or(file.etcd_prefix) {
                e.prefix = p;
            }
            if let Some(id) = a.replica_id.clone().or(file.replica_id) {
                e.replica_id = id;
            }
            if let Some(t) = a.etcd_lease_ttl_s.or(file.etcd_lease_ttl_s) {
                e.lease_ttl = Duration::from_secs(t);
            }
            Some(e)
        }
        None if a.etcd_prefix.is_some()
            || a.replica_id.is_some()
            || a.etcd_lease_ttl_s.is_some()
            || file.etcd_prefix.is_some()
            || file.replica_id.is_some()
            || file.etcd_lease_ttl_s.is_some() =>
        {
            bail!("--etcd-prefix, --replica-id and --etcd-lease-ttl-s need --etcd URL (or `etcd:` in --config)")
        }
        None => None,
    };
    // The simulator's replay is what self-calibration replays through (the router itself does
    // not import the simulator).
    c.tuner = Some(crate::sim::tune::replay_tuner());
    c.workers = a.workers.or(file.workers).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    c.validate()?;
    Ok(c)
}

/// The CacheRoute flags over the policy spec (flags win over the YAML); refused with any other
/// policy.
fn apply_planner_flags(a: &RouteArgs, policy: &mut PolicySpec) -> Result<()> {
    let given: Vec<&str> = [
        ("--interval-s", a.interval_s.is_some()),
        ("--fresh-plans", a.fresh_plans),
        ("--q-cap", a.q_cap.is_some()),
        ("--warm-slots", a.warm_slots.is_some()),
        ("--rate-alpha", a.rate_alpha.is_some()),
        ("--max-imbalance", a.max_imbalance.is_some()),
        ("--cold-tail", a.cold_tail.is_some()),
        ("--cold-tail-epsilon", a.cold_tail_epsilon.is_some()),
        ("--load", a.load.is_some()),
        ("--bounded-sets", a.bounded_sets.is_some()),
        ("--byte-aware", a.byte_aware),
    ]
    .into_iter()
    .filter_map(|(f, set)| set.then_some(f))
    .collect();
    let PolicySpec::Cacheroute(c) = policy else {
        if given.is_empty() {
            return Ok(());
        }
        bail!(
            "{} apply only to the cacheroute policies (the policy is {})",
            given.join(", "),
            policy.label()
        );
    };
    if let Some(i) = a.interval_s {
        c.interval_s = i;
    }
    if a.fresh_plans {
        c.churn_aware = false;
    }
    if let Some(v) = a.q_cap {
        c.q_cap = v;
    }
    if let Some(v) = a.warm_slots {
        c.warm_slots = v;
    }
    if let Some(v) = a.rate_alpha {
        c.rate_alpha = v;
    }
    if let Some(v) = a.max_imbalance {
        c.max_imbalance = v;
    }
    if let Some(v) = a.cold_tail {
        c.cold_tail = v;
    }
    if let Some(v) = a.cold_tail_epsilon {
        c.cold_tail_epsilon = v;
    }
    if let Some(v) = a.load {
        c.load = v;
    }
    if let Some(v) = a.bounded_sets {
        c.bounded_sets = Some(v);
    }
    if a.byte_aware {
        c.byte_aware = true;
    }
    Ok(())
}

pub fn run(a: RouteArgs) -> Result<()> {
    if a.exit_with_parent {
        super::exit_when_stdin_closes();
    }
    let cfg = config(&a)?;
    // With serving workers, this runtime only runs health checks and waits for signals.
    let rt = if cfg.workers > 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    }
    .context("starting the async runtime")?;
    rt.block_on(async move {
        // Signals are caught from before the router binds: one that comes the instant
        // `listening on` is printed drains it like any later one.
        let stop = shutdown_signal()?;
        let label = cfg.policy.label();
        let record = cfg.record.clone();
        let watched = cfg.backends_file.clone();
        let resolved = cfg.backends_dns.clone();
        let etcd = cfg.etcd.clone();
        let handle = router::start(cfg).await?;
        let n = handle.backends().len();
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "listening on {}", handle.url())?;
            out.flush()?;
        }
        tracing::info!(
            "routing across {n} backends with policy {label}; Ctrl-C or SIGTERM drains and stops"
        );
        if let Some(f) = &watched {
            tracing::info!(
                "watching {} for backends (a file renamed over it is re-read)",
                f.display()
            );
        }
        if let Some(d) = &resolved {
            tracing::info!("resolving {d} for backends (re-resolved every interval)");
        }
        if let Some(e) = &etcd {
            tracing::info!(
                "sharing the plan through etcd {} as replica {} (keys under {}, lease {} s)",
                e.endpoint,
                e.replica_id,
                e.prefix,
                e.lease_ttl.as_secs()
            );
        }
        log_recording_start(record.as_ref());
        stop.await;
        tracing::info!("draining in-flight requests…");
        log_stopped(handle.shutdown_report().await);
        Ok(())
    })
}

/// The start line of a recording (`route` and `epp`).
pub(crate) fn log_recording_start(record: Option<&router::RecordConfig>) {
    if let Some(r) = record {
        tracing::info!(
            "recording requests to {} (rotated at {} bytes, {} old files kept)",
            r.path.display(),
            r.max_bytes,
            r.keep
        );
    }
}

/// The last lines of a router or EPP: drained or cut, and what the recording wrote.
pub(crate) fn log_stopped(report: router::ShutdownReport) {
    if report.drained {
        tracing::info!("drained; stopped");
    } else {
        tracing::warn!("drain timeout reached; remaining streams were cut");
    }
    if let Some(r) = report.recording {
        tracing::info!(
            "recorded {} requests to {} ({} dropped, {} late, {} write errors, {} rotations)",
            r.written,
            r.path.display(),
            r.dropped,
            r.late,
            r.write_errors,
            r.rotations
        );
    }
}

/// Catch SIGTERM and Ctrl-C (SIGINT) from now on (the handlers are installed when this is
/// called, inside the runtime); the future ends when either arrives.
pub(crate) fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("catching Ctrl-C (SIGINT)")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// A value named as the policy's YAML names it (`p2c`, `outstanding`, …): one spelling for
/// flags and config files.
fn by_yaml_name<T: serde::de::DeserializeOwned>(v: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(v.to_string())).map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use clap::Parser;

    /// The `cacheroute …` command lines of a help text's examples (continuation lines joined,
    /// `VAR=value` prefixes and quotes dropped), each parsed as the CLI would; how many.
    pub(crate) fn examples_parse(help: &str) -> usize {
        let joined = help.replace("\\\n", " ");
        let mut n = 0;
        for line in joined.lines() {
            let Some(at) = line.find("cacheroute ") else {
                continue;
            };
            if line.trim_start().starts_with('#') {
                continue;
            }
            let words: Vec<String> = line[at..]
                .split_whitespace()
                .map(|w| w.trim_matches('"').to_string())
                .collect();
            if let Err(e) = crate::cli::Cli::try_parse_from(&words) {
                panic!("example `{}` does not parse: {e}", words.join(" "));
            }
            n += 1;
        }
        n
    }

    #[test]
    fn the_help_examples_parse() {
        assert_eq!(examples_parse(ROUTE_EXAMPLES), 2);
        let c = match crate::cli::Cli::try_parse_from(
            "cacheroute route --backend http://127.0.0.1:8000 --backend http://127.0.0.1:8001 --policy cacheroute --q-cap 4 --warm-slots 800"
                .split(' '),
        )
        .unwrap()
        .command
        {
            crate::cli::Command::Route(a) => config(&a).unwrap(),
            _ => unreachable!(),
        };
        assert_eq!(c.backends.len(), 2);
    }

    fn args(extra: &[&str]) -> RouteArgs {
        let mut v = vec!["cacheroute", "route", "--backend", "http://127.0.0.1:9"];
        v.extend_from_slice(extra);
        match crate::cli::Cli::try_parse_from(v).unwrap().command {
            crate::cli::Command::Route(a) => *a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_backends_file_comes_from_the_yaml_and_excludes_a_backend_list() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("backends");
        std::fs::write(&list, "http://127.0.0.1:9 # one\nhttp://127.0.0.1:10/v1\n").unwrap();
        let yaml = dir.path().join("r.yaml");
        std::fs::write(
            &yaml,
            format!(
                "policy: chwbl\nbackends_file: {}\nmax_backends: 5\nbackends_poll_ms: 250\n",
                list.display()
            ),
        )
        .unwrap();
        let parse = |v: &[&str]| match crate::cli::Cli::try_parse_from(v).unwrap().command {
            crate::cli::Command::Route(a) => config(&a),
            _ => unreachable!(),
        };
        let c = parse(&["cacheroute", "route", "--config", yaml.to_str().unwrap()]).unwrap();
        assert_eq!(c.backends, ["http://127.0.0.1:9", "http://127.0.0.1:10"]);
        assert_eq!(c.backends_file.as_deref(), Some(list.as_path()));
        assert_eq!((c.slots(), c.backends_poll.as_millis()), (5, 250));
        // A backend list beside it is refused, named.
        let e = parse(&[
            "cacheroute",
            "route",
            "--config",
            yaml.to_str().unwrap(),
            "--backend",
            "http://127.0.0.1:11",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("backends file"), "{e}");
        // Fewer slots than the file's backends.
        std::fs::write(
            &yaml,
            format!(
                "policy: chwbl\nbackends_file: {}\nmax_backends: 1\n",
                list.display()
            ),
        )
        .unwrap();
        let e = parse(&["cacheroute", "route", "--config", yaml.to_str().unwrap()]).unwrap_err();
        assert!(format!("{e:#}").contains("max_backends"), "{e:#}");
    }

    #[test]
    fn planner_flags_override_the_yaml_policy() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        std::fs::write(
            &yaml,
            "policy: {policy: cacheroute, q_cap: 2.0, warm_slots: 100, rate_alpha: 0.3, cold_tail: p2c}\n",
        )
        .unwrap();
        let y = yaml.to_str().unwrap();
        let c = config(&args(&["--config", y])).unwrap();
        let PolicySpec::Cacheroute(p) = &c.policy else {
            panic!()
        };
        assert_eq!((p.q_cap, p.warm_slots, p.rate_alpha), (2.0, 100, 0.3));
        assert_eq!(p.cold_tail, ColdTail::P2c);
        let c = config(&args(&[
            "--config",
            y,
            "--q-cap",
            "5.5",
            "--warm-slots",
            "800",
            "--rate-alpha",
            "0.7",
            "--max-imbalance",
            "1.2",
            "--cold-tail",
            "chwbl",
            "--cold-tail-epsilon",
            "0.5",
            "--load",
            "outstanding",
            "--bounded-sets",
            "true",
            "--byte-aware",
        ]))
        .unwrap();
        let PolicySpec::Cacheroute(p) = &c.policy else {
            panic!()
        };
        assert_eq!((p.q_cap, p.warm_slots, p.rate_alpha), (5.5, 800, 0.7));
        assert_eq!((p.max_imbalance, p.cold_tail_epsilon), (1.2, 0.5));
        assert_eq!(p.cold_tail, ColdTail::Chwbl);
        assert_eq!(p.load, LoadSignal::Outstanding);
        assert_eq!(p.bounded_sets, Some(true));
        assert!(p.byte_aware);
        // Out of range: refused at start with the field named.
        let e = config(&args(&["--policy", "cacheroute", "--rate-alpha", "2"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("policy.rate_alpha"), "{e}");
        // Another policy: refused, naming the flags.
        let e = config(&args(&[
            "--policy",
            "sticky",
            "--q-cap",
            "3",
            "--byte-aware",
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--q-cap, --byte-aware apply only to the cacheroute policies"),
            "{e}"
        );
    }

    #[test]
    fn the_etcd_flags_and_fields_make_a_shared_plan_config_and_are_refused_alone() {
        let c = config(&args(&[
            "--policy",
            "cacheroute",
            "--etcd",
            "http://127.0.0.1:2379/",
            "--etcd-prefix",
            "/cacheroute/prod",
            "--replica-id",
            "r-1",
            "--etcd-lease-ttl-s",
            "4",
        ]))
        .unwrap();
        let e = c.etcd.unwrap();
        assert_eq!(
            (
                e.endpoint.as_str(),
                e.prefix.as_str(),
                e.replica_id.as_str()
            ),
            ("http://127.0.0.1:2379", "/cacheroute/prod", "r-1")
        );
        assert_eq!(e.lease_ttl.as_secs(), 4);
        // The YAML's fields; defaults for the rest.
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        std::fs::write(
            &yaml,
            "policy: cacheroute\netcd: http://127.0.0.1:2379\nreplica_id: a\n",
        )
        .unwrap();
        let e = config(&args(&["--config", yaml.to_str().unwrap()]))
            .unwrap()
            .etcd
            .unwrap();
        assert_eq!(
            (e.prefix.as_str(), e.lease_ttl.as_secs()),
            ("/cacheroute/default", 10)
        );
        for (extra, needle) in [
            (
                &["--policy", "cacheroute", "--replica-id", "a"][..],
                "need --etcd",
            ),
            (
                &["--policy", "chwbl", "--etcd", "http://127.0.0.1:2379"],
                "etcd: replicas share a CacheRoute plan",
            ),
            (
                &["--policy", "cacheroute", "--etcd", "127.0.0.1:2379"],
                "etcd: `127.0.0.1:2379`",
            ),
            (
                &[
                    "--policy",
                    "cacheroute",
                    "--etcd",
                    "http://h:1",
                    "--etcd-prefix",
                    "cr/",
                ],
                "etcd_prefix",
            ),
            (
                &[
                    "--policy",
                    "cacheroute",
                    "--etcd",
                    "http://h:1",
                    "--replica-id",
                    "a/b",
                ],
                "replica_id",
            ),
            (
                &[
                    "--policy",
                    "cacheroute",
                    "--etcd",
                    "http://h:1",
                    "--etcd-lease-ttl-s",
                    "1",
                ],
                "etcd_lease_ttl_s",
            ),
        ] {
            let e = format!("{:#}", config(&args(extra)).unwrap_err());
            assert!(e.contains(needle), "{extra:?}: {e}");
        }
    }

    #[test]
    fn the_default_listen_address_is_not_the_emulators() {
        let c = config(&args(&["--policy", "sticky"])).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        let emu = crate::cli::Cli::try_parse_from(["cacheroute", "emulate"]).unwrap();
        let crate::cli::Command::Emulate(e) = emu.command else {
            unreachable!()
        };
        assert_ne!(e.listen.port(), c.listen.port());
    }

    #[test]
    fn cold_tail_and_load_take_the_yaml_names_only() {
        for (flag, bad) in [("--cold-tail", "round-robin"), ("--load", "tokens")] {
            let e = crate::cli::Cli::try_parse_from([
                "cacheroute",
                "route",
                "--backend",
                "http://h:1",
                flag,
                bad,
            ])
            .unwrap_err()
            .to_string();
            assert!(e.contains(flag) && e.contains(bad), "{e}");
        }
    }
}
