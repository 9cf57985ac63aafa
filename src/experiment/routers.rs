//! A local step's routers: the policy's N router replicas (`router_replicas`, 1 unless swept)
//! and, with N > 1, a round-robin front before them — one more `cacheroute route`, policy
//! `round-robin`, whose destinations are the N routers (it proxies the OpenAI HTTP, streaming
//! included, and passes the routing-key headers through). Ours: N `cacheroute route` children;
//! CacheRoute's share one plan through an etcd the step starts (`route --etcd`). A peer: N
//! instances of it, each in front of every engine (SMG's joined by its mesh). Each router's own
//! counters are read at the step's end ([`Routers::counters`]): what says whether the machine
//! kept up with it.

use super::child::{spawn_listening, ChildGuard, START_TIMEOUT};
use super::front::{admin_token, start_router, PlanSource, RouterWarmStart};
use super::spec::{RunPlan, Spec, StudyPolicy};
use crate::bounds::TimeScale;
use crate::store::TelemetrySample;
use anyhow::{bail, Context, Result};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The policy's router replicas.
pub(super) enum Replicas {
    /// `cacheroute route` children, their admin token and when they were started.
    Ours(Vec<ChildGuard>, String, Instant),
    Peer(Vec<crate::peer::Running>),
}

/// What a step's load goes through. Fields drop in order: the front, the replicas, then etcd.
pub(super) struct Routers {
    /// The round-robin front (N > 1).
    front: Option<ChildGuard>,
    pub(super) replicas: Replicas,
    /// The etcd CacheRoute's replicas share their plan through (N > 1).
    etcd: Option<Etcd>,
}

/// The etcd key prefix a step's CacheRoute replicas share.
const ETCD_PREFIX: &str = "/cacheroute/study";

impl Routers {
    /// Where the replayer sends: the front, or the one router.
    pub(super) fn url(&self) -> &str {
        match (&self.front, &self.replicas) {
            (Some(f), _) => &f.url,
            (None, Replicas::Ours(g, ..)) => g.first().map_or("", |g| &g.url),
            (None, Replicas::Peer(p)) => p.first().map_or("", |p| &p.url),
        }
    }

    /// The header the routers read the routing key from (the front passes it through).
    pub(super) fn key_header(&self) -> &str {
        match &self.replicas {
            Replicas::Ours(..) => crate::peer::OUR_KEY_HEADER,
            Replicas::Peer(p) => p
                .first()
                .map_or(crate::peer::OUR_KEY_HEADER, |p| p.key_header),
        }
    }

    pub(super) fn is_peer(&self) -> bool {
        matches!(self.replicas, Replicas::Peer(_))
    }

    /// The peers (empty for ours).
    pub(super) fn peers(&self) -> &[crate::peer::Running] {
        match &self.replicas {
            Replicas::Peer(p) => p,
            Replicas::Ours(..) => &[],
        }
    }

    /// Every router, front or etcd that is no longer running, as `what (pid N) exited (…)`; a
    /// peer that died is the peer's failure ([`super::external::died`]).
    pub(super) fn exited(&mut self) -> Result<Vec<String>> {
        let mut dead = Vec::new();
        if let Some(f) = &mut self.front {
            dead.extend(f.exited());
        }
        match &mut self.replicas {
            Replicas::Ours(g, ..) => dead.extend(g.iter_mut().filter_map(|g| g.exited())),
            Replicas::Peer(p) => {
                for p in p.iter_mut() {
                    if let Some(why) = p.exited() {
                        return Err(super::external::died(p, why));
                    }
                }
            }
        }
        if let Some(e) = &mut self.etcd {
            dead.extend(e.0.exited());
        }
        Ok(dead)
    }

    /// Each router's own counters now, as telemetry rows at model time `at_s` (source
    /// `router:I`, label `url`; the front's as `router:front`): see [`ROUTER_COUNTERS`] and
    /// [`PEER_COUNTERS`]. A router whose `/metrics` cannot be read gives no rows.
    pub(super) fn counters(
        &self,
        client: &reqwest::blocking::Client,
        at_s: f64,
    ) -> Vec<TelemetrySample> {
        let row = |source: String, url: &str, metric: &str, value: f64| TelemetrySample {
            run: None,
            step: None,
            source,
            metric: metric.to_string(),
            labels: vec![("url".into(), url.to_string())],
            value,
            at_s,
        };
        let mut out = Vec::new();
        let ours = |source: String, url: &str| -> Vec<TelemetrySample> {
            let samples = scrape(client, url).unwrap_or_default();
            if samples.is_empty() {
                return Vec::new();
            }
            ROUTER_COUNTERS
                .iter()
                .map(|(metric, family)| row(source.clone(), url, metric, sum(&samples, family)))
                .collect()
        };
        if let Some(f) = &self.front {
            out.extend(ours("router:front".into(), &f.url));
            for s in scrape(client, &f.url).unwrap_or_default() {
                if s.name != "cacheroute_destination_requests_total" {
                    continue;
                }
                if let (Some(d), Some(url)) = (s.label("destination"), s.label("url")) {
                    out.push(row(format!("router:{d}"), url, SENT_BY_FRONT, s.value));
                }
            }
        }
        match &self.replicas {
            Replicas::Ours(g, ..) => {
                for (i, g) in g.iter().enumerate() {
                    out.extend(ours(format!("router:{i}"), &g.url));
                }
            }
            Replicas::Peer(peers) => {
                for (i, p) in peers.iter().enumerate() {
                    for (metric, v) in peer_counters(&p.decisions()) {
                        out.push(row(format!("router:{i}"), &p.url, metric, v));
                    }
                }
            }
        }
        out
    }

    /// Our routers' counters of the engines' KV-cache events and of their predicted hits
    /// (`kv_events::router_telemetry`), summed over the replicas (each counts what it routed;
    /// every one receives every event, so the event counters are N times one's); none for a
    /// peer.
    pub(super) fn kv_telemetry(
        &self,
        client: &reqwest::blocking::Client,
        at_s: f64,
    ) -> Result<Vec<TelemetrySample>> {
        let Replicas::Ours(guards, ..) = &self.replicas else {
            return Ok(Vec::new());
        };
        let mut out: Vec<TelemetrySample> = Vec::new();
        for g in guards {
            for row in super::kv_events::router_telemetry(client, &g.url, at_s)? {
                match out.iter_mut().find(|r| {
                    r.source == row.source && r.metric == row.metric && r.labels == row.labels
                }) {
                    Some(r) => r.value += row.value,
                    None => out.push(row),
                }
            }
        }
        Ok(out)
    }

    /// The plans the routers installed ([`super::front::router_plans`]): the first replica's
    /// (with etcd, every replica installs the same plans); none for a peer.
    pub(super) fn plans(
        &self,
        client: &reqwest::blocking::Client,
        replay_started: Instant,
        scale: TimeScale,
    ) -> Result<Vec<crate::analysis::record::PlanRecord>> {
        match &self.replicas {
            Replicas::Ours(g, token, started) => match g.first() {
                Some(g) => {
                    let offset_s = scale.model_since(replay_started.duration_since(*started));
                    super::front::router_plans(client, &g.url, token, offset_s)
                }
                None => Ok(Vec::new()),
            },
            Replicas::Peer(_) => Ok(Vec::new()),
        }
    }
}

/// Telemetry metrics of our routers' own counters (metric, `/metrics` family summed over its
/// series): requests, failures, and what a router that the machine does not keep up with
/// shows — connections and bodies refused or timed out, KV-event gaps, resyncs and batches
/// that did not decode — and the shared plan's generation and store errors.
pub const ROUTER_COUNTERS: [(&str, &str); 13] = [
    ("router:requests", "cacheroute_router_requests_total"),
    ("router:failed", "cacheroute_router_failed_total"),
    (
        "router:connections_refused",
        "cacheroute_router_connections_refused_total",
    ),
    (
        "router:buffer_refused",
        "cacheroute_router_buffer_refused_total",
    ),
    (
        "router:body_timeouts",
        "cacheroute_router_body_timeouts_total",
    ),
    ("router:kv_event_gaps", "cacheroute_kv_event_gaps_total"),
    (
        "router:kv_event_resyncs",
        "cacheroute_kv_event_resyncs_total",
    ),
    (
        "router:kv_event_undecodable",
        "cacheroute_kv_event_undecodable_total",
    ),
    ("router:plans_installed", "cacheroute_plans_installed_total"),
    ("router:plan_generation", "cacheroute_plan_generation"),
    (
        "router:plan_store_errors",
        "cacheroute_plan_store_errors_total",
    ),
    ("router:plan_store_leader", "cacheroute_plan_store_leader"),
    (
        "router:plans_written",
        "cacheroute_plan_store_plans_written_total",
    ),
];

/// Telemetry metric of the requests the round-robin front sent to each router replica (source
/// `router:I`, from the front's `cacheroute_destination_requests_total`).
pub const SENT_BY_FRONT: &str = "router:sent_by_front";

/// Telemetry metrics of a peer's own counters (metric, counter family, text of the series
/// counted): the vLLM router's decisions made without the prompt's token ids and its requests
/// for them answered too late (`crate::peer::decision_counters`).
pub const PEER_COUNTERS: [(&str, &str, &str); 2] = [
    (
        "router:decisions_without_token_ids",
        "vllm_router_prefix_routing_decisions_total",
        "outcome=\"missing_tokens\"",
    ),
    (
        "router:renders_late",
        "vllm_router_kv_routing_inputs_total",
        "result=\"preparation_unavailable\"",
    ),
];

/// [`PEER_COUNTERS`] in a peer's decision counters (series, value). A labelled counter shows a
/// series only once it counted: its family present, an absent series is 0; the family absent,
/// the peer does not expose it (no entry; the report says so).
fn peer_counters(decisions: &[(String, f64)]) -> Vec<(&'static str, f64)> {
    PEER_COUNTERS
        .iter()
        .filter(|(_, family, _)| decisions.iter().any(|(s, _)| s.starts_with(family)))
        .map(|(metric, family, key)| {
            let v = decisions
                .iter()
                .filter(|(s, _)| s.starts_with(family) && s.contains(key))
                .map(|(_, v)| v)
                .sum();
            (*metric, v)
        })
        .collect()
}

fn scrape(
    client: &reqwest::blocking::Client,
    url: &str,
) -> Result<Vec<crate::telemetry::prom::Sample>> {
    let text = client
        .get(format!("{url}/metrics"))
        .send()?
        .error_for_status()?
        .text()?;
    Ok(crate::telemetry::prom::parse(&text)?)
}

fn sum(samples: &[crate::telemetry::prom::Sample], family: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == family)
        .map(|s| s.value)
        .filter(|v| v.is_finite())
        .sum()
}

/// Start the step's routers in front of `urls`, their configs and logs under `dir`.
pub(super) fn start(
    spec: &Spec,
    plan: &RunPlan,
    block: u32,
    // `kv_events`: the engines publish their KV-cache events at port + this offset.
    (scale, kv_events): (TimeScale, Option<u16>),
    warm: Option<RouterWarmStart>,
    urls: &[String],
    dir: &std::path::Path,
) -> Result<Routers> {
    let n = plan.router_replicas.max(1);
    let mut etcd = None;
    let replicas = match &plan.policy {
        StudyPolicy::Ours(ours) => {
            let token = admin_token(plan.key.seed);
            let started = Instant::now();
            let mut guards = Vec::with_capacity(n);
            if n == 1 {
                let own = PlanSource::Own(warm);
                guards.push(start_router(
                    spec,
                    plan,
                    block,
                    (scale, &token, kv_events),
                    own,
                    urls,
                    dir,
                )?);
            } else {
                // CacheRoute's replicas share one plan through etcd (`route` refuses a warm
                // start's initial plan beside it: the leader's first plan comes one interval
                // in). The other policies have no plan: N independent replicas.
                let shared = matches!(ours, crate::policy::PolicySpec::Cacheroute(_));
                if shared {
                    etcd = Some(Etcd::start(dir)?);
                }
                for i in 0..n {
                    let sub = dir.join(format!("router-{i}"));
                    std::fs::create_dir_all(&sub)?;
                    let source = match &etcd {
                        Some(Etcd(e)) => PlanSource::Etcd {
                            url: e.url.clone(),
                            prefix: ETCD_PREFIX.into(),
                            replica_id: format!("router-{i}"),
                        },
                        None => PlanSource::Own(None),
                    };
                    guards.push(start_router(
                        spec,
                        plan,
                        block,
                        (scale, &token, kv_events),
                        source,
                        urls,
                        &sub,
                    )?);
                }
            }
            Replicas::Ours(guards, token, started)
        }
        StudyPolicy::External(e) => {
            let mut peers = Vec::with_capacity(n);
            // SMG's gateways share their cache-aware trees through its mesh.
            let mesh: Vec<u16> = if e.router == crate::peer::Router::Smg && n > 1 {
                (0..n)
                    .map(|_| crate::peer::free_port())
                    .collect::<Result<_, _>>()?
            } else {
                Vec::new()
            };
            for i in 0..n {
                let extra = if mesh.is_empty() {
                    Vec::new()
                } else {
                    crate::peer::smg_mesh_args(&mesh, i)
                };
                let sub = if n == 1 {
                    dir.to_path_buf()
                } else {
                    dir.join(format!("router-{i}"))
                };
                std::fs::create_dir_all(&sub)?;
                peers.push(super::external::start(e, urls, &sub, &extra)?);
            }
            Replicas::Peer(peers)
        }
    };
    let mut routers = Routers {
        front: None,
        replicas,
        etcd,
    };
    if n > 1 {
        let backends: Vec<String> = match &routers.replicas {
            Replicas::Ours(g, ..) => g.iter().map(|g| g.url.clone()).collect(),
            Replicas::Peer(p) => p.iter().map(|p| p.url.clone()).collect(),
        };
        routers.front = Some(start_front(&backends)?);
    }
    Ok(routers)
}

/// The round-robin front before `routers`.
fn start_front(routers: &[String]) -> Result<ChildGuard> {
    let mut args: Vec<String> = [
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "round-robin",
    ]
    .map(String::from)
    .into();
    for r in routers {
        args.extend(["--backend".into(), r.clone()]);
    }
    args.extend(
        [
            "--health-interval-ms",
            "500",
            "--first-byte-timeout-s",
            "600",
        ]
        .map(String::from),
    );
    spawn_listening("round-robin front", &args, START_TIMEOUT)
}

/// A single-member etcd on loopback ports of its own, its data in the step's directory,
/// stopped when dropped.
struct Etcd(ChildGuard);

/// What fixes a missing etcd.
pub const ETCD_INSTALL: &str = "apt-get install etcd-server";

impl Etcd {
    fn start(dir: &std::path::Path) -> Result<Etcd> {
        let Some(bin) = find_on_path("etcd") else {
            bail!(
                "router_replicas: CacheRoute's router replicas share their plan through etcd, and no `etcd` is on PATH; install it (`{ETCD_INSTALL}` on Debian) and rerun with --resume"
            );
        };
        let port = || -> Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (client, peer) = (port()?, port()?);
        let (c, p) = (
            format!("http://127.0.0.1:{client}"),
            format!("http://127.0.0.1:{peer}"),
        );
        let log = std::fs::File::create(dir.join("etcd.log"))?;
        let mut cmd = Command::new(&bin);
        cmd.args(["--name", "study", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args([
                "--listen-peer-urls",
                &p,
                "--initial-advertise-peer-urls",
                &p,
            ])
            .args(["--initial-cluster", &format!("study={p}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut guard = ChildGuard {
            child,
            what: "etcd".into(),
            url: c,
        };
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let t0 = Instant::now();
        loop {
            if let Some(why) = guard.exited() {
                bail!("{why}; its log: {}", dir.join("etcd.log").display());
            }
            let up = http
                .post(format!("{}/v3/kv/range", guard.url))
                .body(r#"{"key":"AA=="}"#)
                .send()
                .is_ok_and(|r| r.status().is_success());
            if up {
                return Ok(Etcd(guard));
            }
            if t0.elapsed() > START_TIMEOUT {
                bail!(
                    "etcd did not answer within {} s; its log: {}",
                    START_TIMEOUT.as_secs(),
                    dir.join("etcd.log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `name` in a directory of PATH.
fn find_on_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|f| f.is_file())
}

/// The report's note on the routers' own counters (live studies; `None` when no router's
/// counters were stored): per policy and router, each counter summed over the steps (the
/// shared plan's generation: its highest), and whether any router was machine-limited.
pub fn router_report(
    store: &crate::store::BlockingStore,
    stored: &crate::store::StoredStudy,
) -> Result<Option<String>> {
    use std::collections::BTreeMap;
    let mut by: BTreeMap<(String, String), BTreeMap<String, f64>> = BTreeMap::new();
    for s in store.load_telemetry(stored.id, None)? {
        if !s.metric.starts_with("router:") {
            continue;
        }
        let Some(run) = stored.runs.iter().find(|r| Some(r.id) == s.run) else {
            continue;
        };
        let label = if run.key.sweep.is_empty() {
            run.key.policy.clone()
        } else {
            format!("{} [{}]", run.key.policy, run.key.sweep)
        };
        let router = s.source.trim_start_matches("router:").to_string();
        let v = by.entry((label, router)).or_default();
        let x = v.entry(s.metric.clone()).or_default();
        *x = if s.metric == "router:plan_generation" {
            x.max(s.value)
        } else {
            *x + s.value
        };
    }
    if by.is_empty() {
        return Ok(None);
    }
    let mut t = String::from(
        "Routers' own counters, summed over each policy's steps (`router_replicas`: N replicas behind a round-robin front, `front`; counters a router does not expose are `not exposed`). A router the machine did not keep up with shows it here: connections or bodies refused or timed out, KV-event gaps, resyncs or undecodable batches, plan-store errors (ours); decisions made without the prompt's token ids and token-id renders answered too late (the vLLM router's).\n\n\
         | policy | router | sent by the front | requests | failed | refused or timed out | KV-event gaps · resyncs · undecodable | plan-store errors | shared plan generation | decisions without token ids | renders late |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut limited = Vec::new();
    for ((label, router), v) in &by {
        let get = |m: &str| v.get(m).copied();
        let show = |x: Option<f64>| x.map_or("not exposed".to_string(), |x| format!("{x:.0}"));
        let refused = [
            "router:connections_refused",
            "router:buffer_refused",
            "router:body_timeouts",
        ]
        .iter()
        .map(|m| get(m))
        .try_fold(0.0, |a, x| x.map(|x| a + x));
        let events = [
            "router:kv_event_gaps",
            "router:kv_event_resyncs",
            "router:kv_event_undecodable",
        ]
        .iter()
        .map(|m| get(m).map(|x| format!("{x:.0}")))
        .collect::<Option<Vec<_>>>()
        .map_or("not exposed".to_string(), |x| x.join(" · "));
        let ours = get("router:requests").is_some();
        let not_needed = |x: Option<f64>| match (ours, x) {
            (true, _) => "— (needs none)".to_string(),
            (false, x) => show(x),
        };
        let bad: f64 = [
            refused.unwrap_or(0.0),
            get("router:kv_event_gaps").unwrap_or(0.0),
            get("router:kv_event_resyncs").unwrap_or(0.0),
            get("router:kv_event_undecodable").unwrap_or(0.0),
            get("router:plan_store_errors").unwrap_or(0.0),
            get("router:decisions_without_token_ids").unwrap_or(0.0),
            get("router:renders_late").unwrap_or(0.0),
        ]
        .iter()
        .sum();
        if bad > 0.0 {
            limited.push(format!("{label} router {router}"));
        }
        t.push_str(&format!(
            "| {label} | {router} | {} | {} | {} | {} | {events} | {} | {} | {} | {} |\n",
            get(SENT_BY_FRONT).map_or("—".to_string(), |x| format!("{x:.0}")),
            show(get("router:requests")),
            show(get("router:failed")),
            show(refused),
            show(get("router:plan_store_errors")),
            show(get("router:plan_generation")),
            not_needed(get("router:decisions_without_token_ids")),
            not_needed(get("router:renders_late")),
        ));
    }
    t.push('\n');
    if limited.is_empty() {
        t.push_str("No router's own counters show it machine-limited (every such counter it exposes is 0).\n");
    } else {
        t.push_str(&format!(
            "**Machine-limited** by their own counters (a non-zero counter above): {}. Their rows measure this machine as much as the policy.\n",
            limited.join(", ")
        ));
    }
    Ok(Some(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_s_counters_are_zero_when_counted_none_and_absent_when_not_exposed() {
        let decision = |o: &str| {
            format!("vllm_router_prefix_routing_decisions_total{{policy=\"cache_aware\",outcome=\"{o}\"}}")
        };
        let input = |r: &str| format!("vllm_router_kv_routing_inputs_total{{result=\"{r}\"}}");
        // The vLLM router routing by prefix: both families there, neither bad series: zeros.
        let fine = vec![(decision("prefix_hit"), 755.0), (input("render"), 26460.0)];
        assert_eq!(
            peer_counters(&fine),
            [
                ("router:decisions_without_token_ids", 0.0),
                ("router:renders_late", 0.0)
            ]
        );
        // Machine-limited: the bad series summed (two stages of decisions).
        let late = vec![
            (decision("missing_tokens"), 600.0),
            (decision("missing_tokens").replace("cache_aware", "x"), 56.0),
            (input("preparation_unavailable"), 1152.0),
        ];
        assert_eq!(
            peer_counters(&late),
            [
                ("router:decisions_without_token_ids", 656.0),
                ("router:renders_late", 1152.0)
            ]
        );
        // A peer without these families (SMG): nothing, read as not exposed.
        assert!(peer_counters(&[("smg_decisions_total".into(), 7.0)]).is_empty());
        assert!(peer_counters(&[]).is_empty());
    }
}
