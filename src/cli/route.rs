//! `cacheroute route`: run the live router (`crate::router`) until Ctrl-C or SIGTERM, then drain.
//! Prints `listening on http://ADDR` on one line once bound, so a parent process can read the
//! port when it asked for port 0. Flags override the optional `--config` YAML file. Everything
//! else it says (destinations down/up, plans, shutdown) is a log line on stderr.

use crate::policy::cacheroute::{ColdTail, LoadSignal};
use crate::policy::setting::Setting;
use crate::policy::PolicySpec;
use crate::router::{self, RouterConfig, RouterSettings};
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

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
    /// YAML file of settings: any flag below but CacheRoute's planner flags, by its name in
    /// snake_case (`backends: [URL, …]` for --backend), `policy` also as a policy spec, and
    /// `engine_knobs`; a flag given wins over its field. See docs/router.md.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The settings, as flags (over the --config file's).
    #[command(flatten)]
    pub settings: RouterSettings,
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
    /// request's blocks) or auto (the self-calibration chooses; chwbl without --engine) (overrides
    /// `cold_tail`) [policy default: auto].
    #[arg(long, value_name = "auto|chwbl|p2c|prefix", value_parser = Setting::<ColdTail>::parse_named)]
    pub cold_tail: Option<Setting<ColdTail>>,
    /// CacheRoute: ε of a CHWBL cold tail's load bound (overrides `cold_tail_epsilon`)
    /// [policy default: 0.25].
    #[arg(long, value_name = "EPS")]
    pub cold_tail_epsilon: Option<f64>,
    /// CacheRoute: load signal for least-loaded choices: prefill (queued prompt tokens),
    /// outstanding (requests), cost (predicted time to first token, needs --engine) or auto
    /// (the self-calibration chooses; prefill without --engine) (overrides `load`)
    /// [policy default: auto].
    #[arg(long, value_name = "auto|prefill|outstanding|cost", value_parser = Setting::<LoadSignal>::parse_named)]
    pub load: Option<Setting<LoadSignal>>,
    /// CacheRoute: a planned key whose every destination is over the cold tail's bound goes
    /// the cold tail's way (true), or stays on its set whatever the load (false)
    /// (overrides `bounded_sets`) [policy default: false].
    #[arg(long, value_name = "BOOL")]
    pub bounded_sets: Option<bool>,
    /// CacheRoute: byte-aware admission (value = rate × prefix tokens, slots in KV blocks)
    /// (sets `byte_aware`).
    #[arg(long)]
    pub byte_aware: bool,
}

/// Largest `--config` file read.
const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// The `--config` file's settings, read bounded.
fn read_settings(p: &Path) -> Result<RouterSettings> {
    use std::io::Read;
    let reading = || format!("reading router config {}", p.display());
    let mut bytes = Vec::new();
    std::fs::File::open(p)
        .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes))
        .with_context(reading)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        bail!(
            "router config {}: over {MAX_CONFIG_BYTES} bytes; a router config is a few settings",
            p.display()
        );
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        .with_context(reading)?;
    yaml_serde::from_str(&text)
        .with_context(|| format!("router config {}: not a valid router YAML", p.display()))
}

/// Resolve flags and the config file into a [`RouterConfig`].
pub fn config(a: &RouteArgs) -> Result<RouterConfig> {
    config_over(a, RouterSettings::default())
}

/// [`config`] with `defaults` below the file: a front's own defaults (the EPP's `listen`).
pub(crate) fn config_over(a: &RouteArgs, defaults: RouterSettings) -> Result<RouterConfig> {
    let file = match &a.config {
        Some(p) => read_settings(p)?,
        None => RouterSettings::default(),
    };
    let settings = a.settings.clone().over(file).over(defaults);
    // The one rule between sources: a backend list on the command line and a backends file.
    if a.settings.backends.is_some() && settings.backends_file.is_some() {
        bail!("--backend and a backends file: give the backends in one of them");
    }
    let mut c = RouterConfig::from_settings(settings)?;
    apply_planner_flags(a, &mut c.policy)?;
    // The simulator's replay is what self-calibration replays through (the router itself does
    // not import the simulator).
    c.tuner = Some(crate::sim::tune::replay_tuner());
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
        c.q_cap = Setting::from_number(v);
    }
    if let Some(v) = a.warm_slots {
        c.warm_slots = Setting::from_number(v);
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
        c.bounded_sets = Setting::Fixed(v);
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use clap::Parser;
    use std::time::Duration;

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
    fn a_flag_overrides_its_config_field_and_the_field_stays_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        let trace = dir.path().join("t.jsonl");
        std::fs::write(
            &yaml,
            format!(
                "policy: {{policy: chwbl, epsilon: 0.5}}\nbackends: [http://127.0.0.1:9, http://127.0.0.1:10]\n\
                 seed: 7\nfirst_byte_timeout_s: 5\nkey_header: X-File\nhead_timeout_s: 3\n\
                 record: {}\nrecord_keep: 2\n",
                trace.display()
            ),
        )
        .unwrap();
        let y = yaml.to_str().unwrap();
        let parse = |extra: &[&str]| {
            let mut v = vec!["cacheroute", "route", "--config", y];
            v.extend_from_slice(extra);
            match crate::cli::Cli::try_parse_from(v).unwrap().command {
                crate::cli::Command::Route(a) => config(&a).unwrap(),
                _ => unreachable!(),
            }
        };
        // The file alone.
        let c = parse(&[]);
        assert!(matches!(c.policy, PolicySpec::Chwbl { epsilon, .. } if epsilon == 0.5));
        assert_eq!(c.backends.len(), 2);
        assert_eq!((c.seed, c.key_header.as_str()), (7, "x-file"));
        assert_eq!(c.first_byte_timeout, Duration::from_secs(5));
        assert_eq!(c.head_timeout, Duration::from_secs(3));
        let r = c.record.unwrap();
        assert_eq!((r.path.as_path(), r.keep), (trace.as_path(), 2));
        // Flags over it, field by field: a name over a spec, a list, numbers, a duration.
        let c = parse(&[
            "--policy",
            "sticky",
            "--backend",
            "http://127.0.0.1:11",
            "--seed",
            "9",
            "--first-byte-timeout-s",
            "1.5",
            "--head-timeout-s",
            "4",
            "--record-keep",
            "3",
        ]);
        assert!(
            matches!(c.policy, PolicySpec::Sticky { .. }),
            "{:?}",
            c.policy
        );
        assert_eq!(c.backends, ["http://127.0.0.1:11"]);
        assert_eq!(c.seed, 9);
        assert_eq!(c.first_byte_timeout, Duration::from_millis(1500));
        assert_eq!(c.head_timeout, Duration::from_secs(4));
        // What no flag gave stays the file's.
        assert_eq!(c.key_header, "x-file");
        let r = c.record.unwrap();
        assert_eq!((r.path.as_path(), r.keep), (trace.as_path(), 3));
    }

    #[test]
    fn an_unknown_config_field_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        // A planner flag is not a field: its place is the policy spec.
        std::fs::write(&yaml, "policy: cacheroute\nq_cap: 4\n").unwrap();
        let e = format!(
            "{:#}",
            config(&args(&["--config", yaml.to_str().unwrap()])).unwrap_err()
        );
        assert!(
            e.contains("not a valid router YAML") && e.contains("unknown field `q_cap`"),
            "{e}"
        );
        // A file past the bound is refused unread.
        std::fs::write(&yaml, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let e = format!(
            "{:#}",
            config(&args(&["--config", yaml.to_str().unwrap()])).unwrap_err()
        );
        assert!(e.contains("over 4194304 bytes"), "{e}");
        let e = format!(
            "{:#}",
            config(&args(&["--config", "/nonexistent/r.yaml"])).unwrap_err()
        );
        assert!(
            e.contains("reading router config /nonexistent/r.yaml"),
            "{e}"
        );
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
        assert_eq!(
            (p.q_cap, p.warm_slots, p.rate_alpha),
            (Setting::Fixed(2.0), Setting::Fixed(100), 0.3)
        );
        assert_eq!(p.cold_tail, Setting::Fixed(ColdTail::P2c));
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
        assert_eq!(
            (p.q_cap, p.warm_slots, p.rate_alpha),
            (Setting::Fixed(5.5), Setting::Fixed(800), 0.7)
        );
        assert_eq!((p.max_imbalance, p.cold_tail_epsilon), (1.2, 0.5));
        assert_eq!(p.cold_tail, Setting::Fixed(ColdTail::Chwbl));
        assert_eq!(p.load, Setting::Fixed(LoadSignal::Outstanding));
        assert_eq!(p.bounded_sets, Setting::Fixed(true));
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
    fn the_kv_event_flags_make_a_subscription_and_dynamo_needs_them() {
        let c = config(&args(&[
            "--policy",
            "dynamo",
            "--kv-events-port-offset",
            "1000",
            "--kv-events-topic",
            "kv-events",
        ]))
        .unwrap();
        let k = c.kv_events.unwrap();
        assert_eq!((k.port_offset, k.topic.as_str()), (1000, "kv-events"));
        // Any policy may subscribe (the counters alone); the topic defaults to vLLM's, empty.
        let c = config(&args(&[
            "--policy",
            "chwbl",
            "--kv-events-port-offset",
            "7",
        ]))
        .unwrap();
        assert_eq!(c.kv_events.unwrap().topic, "");
        let dir = tempfile::tempdir().unwrap();
        let yaml = dir.path().join("r.yaml");
        std::fs::write(&yaml, "policy: dynamo\nkv_events_port_offset: 3\n").unwrap();
        let c = config(&args(&["--config", yaml.to_str().unwrap()])).unwrap();
        assert_eq!(c.kv_events.unwrap().port_offset, 3);
        for (extra, needle) in [
            (&["--policy", "dynamo"][..], "--kv-events-port-offset N"),
            (
                &["--policy", "chwbl", "--kv-events-topic", "t"],
                "kv_events_topic: set without kv_events_port_offset",
            ),
        ] {
            let e = format!("{:#}", config(&args(extra)).unwrap_err());
            assert!(e.contains(needle), "{extra:?}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn the_default_listen_address_is_not_the_emulators() {
        let c = config(&args(&["--policy", "sticky"])).unwrap();
        assert_eq!(c.listen, router::DEFAULT_LISTEN);
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
