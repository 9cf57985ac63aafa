//! The `local` backend: every ladder step runs through real HTTP on 127.0.0.1. For each step
//! the runner starts R engines (`cacheroute emulate` child processes, or engines named by URL),
//! a `cacheroute route` child process with the run's policy in front of them, replays the
//! step's trace open loop through the router, scrapes the engines' `/metrics` before and after
//! (served KV hit from the engines' own counters, read in their dialect: [`EngineApi`]), and
//! tears everything down — on success, on error (guards kill their child on drop), and on
//! Ctrl-C (the children share the terminal's process group, and also exit when the runner's
//! end of their stdin closes). Each step starts with the engines' caches reset.
//!
//! Time scale: emulators may run their engine model `time_scale`× faster than real time; the
//! schedule is compressed by the same factor and measured times are scaled back, so the step
//! is reported in model time (HTTP overheads are then magnified by the factor — keep it small).
//! Every conversion is a method of the step's [`TimeScale`] (`to_wall` for the schedule, the
//! step's length, think times and injected failures; `to_model` for the measured records), and
//! the emulators and the router are given that value as the number it writes.

use super::spec::{LocalSettings, RunPlan, Spec, StudyPolicy};
use crate::analysis::record::PlanRecord;
use crate::analysis::step::{step_metrics, Window};
use crate::bounds::TimeScale;
use crate::router::{PolicySetting, RouterSettings};
use crate::store::{RequestRow, TelemetrySample};
use crate::telemetry::engine_api::{self, EngineApi, ResetOutcome};
use crate::workload::trace::TraceRecord;
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process killed (and reaped) when dropped.
pub struct ChildGuard {
    child: Child,
    pub what: String,
    pub url: String,
}

impl ChildGuard {
    /// `what (pid N) exited (status)` when the child is no longer running.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(st)) => Some(format!(
                "{} (pid {}) exited ({st})",
                self.what,
                self.child.id()
            )),
            Err(e) => Some(format!(
                "{} (pid {}): cannot tell whether it runs: {e}",
                self.what,
                self.child.id()
            )),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn `cacheroute ARGS…` and wait for its `listening on http://ADDR` line.
pub fn spawn_listening(what: &str, args: &[String], timeout: Duration) -> Result<ChildGuard> {
    let exe = std::env::current_exe().context("locating the cacheroute binary")?;
    let mut child = Command::new(&exe)
        .args(args)
        .arg("--exit-with-parent")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let mut guard = ChildGuard {
        child,
        what: what.to_string(),
        url: String::new(),
    };
    match rx.recv_timeout(timeout) {
        Ok(Some(Ok(line))) if line.starts_with("listening on ") => {
            guard.url = line.trim_start_matches("listening on ").trim().to_string();
            Ok(guard)
        }
        other => {
            let _ = guard.child.kill();
            let mut err = String::new();
            if let Some(mut e) = guard.child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            bail!(
                "{what} did not start (first line {:?}): {}",
                other.ok().flatten().and_then(|l| l.ok()),
                err.lines().last().unwrap_or("no error output")
            )
        }
    }
}

/// Telemetry metric of a replica killed by an injected failure (value 1 at the kill time).
pub const REPLICA_KILLED: &str = "replica_killed";

/// Telemetry metric of a replica of an SSH fleet that stopped answering (its host lost, or the
/// engine gone): value 1, at the step's end when it was lost during the step, at 0 when it was
/// already unreachable when the step began (it is then left out of the step's cache resets and
/// counter scrapes; the router excludes it within one health interval).
pub const REPLICA_LOST: &str = "replica_lost";

/// How long a step waits for engines to accept a cache reset (they refuse while requests
/// still run or wait, e.g. ones cut off at the end of the previous step).
const RESET_DEADLINE: Duration = Duration::from_secs(120);

/// Every step on running engines starts with cold prefix caches, as a simulated step does:
/// each engine's reset route ([`EngineApi::reset_path`]), retried with backoff while the
/// engine says it is busy, until [`RESET_DEADLINE`].
fn reset_caches(urls: &[String], api: EngineApi) -> Result<()> {
    reset_caches_within(urls, api, RESET_DEADLINE)
}

fn reset_caches_within(urls: &[String], api: EngineApi, deadline: Duration) -> Result<()> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let path = api.reset_path();
    for u in urls {
        let t0 = std::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        loop {
            let outcome = match client.post(format!("{u}{path}")).send() {
                Ok(r) => {
                    let status = r.status().as_u16();
                    api.reset_outcome(status, &r.text().unwrap_or_default())
                }
                Err(e) => ResetOutcome::Failed(e.to_string()),
            };
            match outcome {
                ResetOutcome::Done => break,
                ResetOutcome::Failed(why) => bail!(
                    "{u}: POST {path} failed ({why}); {}",
                    api.reset_hint()
                ),
                ResetOutcome::Busy(why) if t0.elapsed() + wait > deadline => bail!(
                    "{u}: POST {path} still refused after {:.0} s ({why}): requests are still running or waiting on it; {}",
                    t0.elapsed().as_secs_f64(),
                    api.reset_hint()
                ),
                ResetOutcome::Busy(_) => {
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
    Ok(())
}

/// Fetch `/metrics` of `base` and return (prefix-cache hit tokens, queried tokens).
fn scrape_cache(
    client: &reqwest::blocking::Client,
    base: &str,
    api: EngineApi,
) -> Result<(f64, f64)> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()?
        .error_for_status()
        .with_context(|| match api {
            EngineApi::Sglang => format!("{base}/metrics: start SGLang with --enable-metrics"),
            EngineApi::Vllm => format!("{base}/metrics"),
        })?
        .text()?;
    let samples = crate::telemetry::prom::parse(&text)?;
    api.cache_counters(&samples)
        .map_err(|why| anyhow::anyhow!("{base}/metrics: {why}"))
}

/// What a local step produced.
pub struct LocalStep {
    pub metrics: crate::analysis::model::StepMetrics,
    pub requests: Vec<RequestRow>,
    pub plans: Vec<PlanRecord>,
    pub telemetry: Vec<TelemetrySample>,
}

/// A warm start for the router: the previous period's per-key rates (by name) and the mean
/// request shape, planned and installed at start as in the simulator.
pub struct RouterWarmStart {
    pub rates: Vec<crate::workload::rates::KeyRate>,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
}

/// One step's load: its trace (model time), block size, offered rate and per-key rates.
pub struct StepLoad<'a> {
    pub records: Vec<TraceRecord>,
    pub block: u32,
    pub qps: f64,
    pub key_rates: &'a HashMap<u64, f64>,
}

/// Run one ladder step of `plan` on loopback, against the study's real engines when `pool` is
/// given (else emulators it starts, or `local.engine_urls`).
pub fn run_step(
    spec: &Spec,
    plan: &RunPlan,
    load: StepLoad<'_>,
    warm: Option<RouterWarmStart>,
    pool: Option<&super::engines::EnginePool>,
) -> Result<LocalStep> {
    let StepLoad {
        records,
        block,
        qps,
        key_rates,
    } = load;
    let settings: LocalSettings = spec.local.clone().unwrap_or_default();
    let clock = StepClock {
        scale: settings.time_scale,
        duration: spec.warmup_s + spec.measure_s,
    };
    let mut engines = start_engines(spec, &settings, plan, block, pool)?;
    // Router, configured by file so the policy keeps all its parameters.
    let dir =
        tempfile::tempdir().context("creating a temporary directory for the router config")?;
    let mut router = match &plan.policy {
        StudyPolicy::Ours(_) => {
            let token = admin_token(plan.key.seed);
            let started = std::time::Instant::now();
            let guard = start_router(
                spec,
                plan,
                block,
                (clock.scale, &token),
                warm,
                &engines.urls,
                dir.path(),
            )?;
            Front::Ours(guard, token, started)
        }
        StudyPolicy::External(e) => {
            Front::Peer(super::external::start(e, &engines.urls, dir.path())?)
        }
    };
    // Scrape before, replay, scrape after.
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let before = scrape_before(&client, &engines.urls, engines.api, &engines.lost)?;
    // An external router reports nothing: its window is measured on the engines' counters.
    let window_start = matches!(router, Front::Peer(_)).then(|| {
        super::external::scrape_at(
            engines.urls.clone(),
            engines.api,
            clock.scale.wall_duration(spec.warmup_s),
        )
    });
    // Injected failures are timed from the replay's start, not from before the scrapes (a slow
    // scrape of a loaded engine moved the kill earlier into the step by as long as it took).
    let failures = (spec.failures.as_slice(), engines.kill_targets.as_slice());
    let replay_started = std::time::Instant::now();
    let (result, gpu_samples, killers) =
        replay(&settings, &router, records, block, clock, failures)?;
    let kills = injected_kills(killers);
    check_none_died(&mut router, &mut engines.emulators, pool, &kills, &result)?;
    let peer_window = match (&router, window_start) {
        (Front::Peer(p), Some(h)) => {
            let start = h
                .join()
                .map_err(|_| anyhow::anyhow!("the window-start scrape panicked"))??;
            let end = super::external::scrape(&client, &engines.urls, engines.api)?;
            let d = super::external::deltas(&start, &end);
            Some((
                super::external::telemetry(p, &engines.urls, &d, clock.duration),
                d,
            ))
        }
        _ => None,
    };
    let plans = match &router {
        Front::Ours(g, token, started) => {
            let offset_s = clock
                .scale
                .model_since(replay_started.duration_since(*started));
            router_plans(&client, &g.url, token, offset_s)?
        }
        Front::Peer(_) => Vec::new(),
    };
    let after = scrape_after_and_stop(
        &client,
        (&engines.urls, engines.api),
        router,
        engines.emulators,
    );
    let window = Window {
        from_s: spec.warmup_s,
        to_s: clock.duration,
    };
    let mut metrics =
        model_time_metrics(&result, key_rates, clock.scale, plan.replicas, window, qps);
    let counters = CounterScrapes {
        urls: &engines.urls,
        before: &before,
        after: &after,
    };
    let mut telemetry = step_telemetry(gpu_samples, &kills, &counters, clock.duration);
    telemetry.extend(lost_replicas(
        &engines.urls,
        &engines.lost,
        &counters,
        &kills,
        clock.duration,
    ));
    if let Some((rows, d)) = peer_window {
        super::external::apply_counters(&mut metrics, &d);
        telemetry.extend(rows);
    }
    telemetry.extend(session_telemetry(&result, clock));
    let requests = request_rows(&result, window, clock.scale);
    Ok(LocalStep {
        metrics,
        requests,
        plans,
        telemetry,
    })
}

/// A token for the step's router's admin API (loopback only; it guards nothing a study needs
/// kept, but the router serves `/admin` only with one).
fn admin_token(seed: u64) -> String {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new().hash_one((seed, std::process::id()));
    format!("study-{h:016x}")
}

/// The records of the plans the step's router installed (`/admin/plan?history=true`), their
/// times moved from the router's start to the replay's (`offset_s` model seconds later), as
/// the simulator's plans are timed; a plan installed before the replay started (a warm start's)
/// is at 0.
fn router_plans(
    client: &reqwest::blocking::Client,
    url: &str,
    token: &str,
    offset_s: f64,
) -> Result<Vec<PlanRecord>> {
    let body = client
        .get(format!("{url}/admin/plan?history=true"))
        .bearer_auth(token)
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.bytes())
        .with_context(|| format!("reading the plans the router at {url} installed"))?;
    let v: serde_json::Value = serde_json::from_slice(&body)
        .with_context(|| format!("the router at {url} answered its plans with no JSON"))?;
    let dropped = v["history_dropped"].as_u64().unwrap_or(0);
    if dropped > 0 {
        tracing::warn!(
            "the router kept the last plans only: {dropped} earlier ones are not stored"
        );
    }
    let mut plans: Vec<PlanRecord> = serde_json::from_value(v["history"].clone())
        .context("the router's plan history is not a list of plan records")?;
    for p in &mut plans {
        p.at_s = (p.at_s - offset_s).max(0.0);
    }
    Ok(plans)
}

/// A step's time: the emulators' time scale and the step's model duration (seconds).
#[derive(Clone, Copy)]
struct StepClock {
    scale: TimeScale,
    duration: f64,
}

/// The engines a step runs against.
struct StepEngines {
    /// Their base URLs, by destination.
    urls: Vec<String>,
    /// The dialect they speak (reset route, counters).
    api: EngineApi,
    /// Emulators started for this step (killed when dropped); empty otherwise.
    emulators: Vec<ChildGuard>,
    /// What an injected failure kills, per destination: a process (emulator) or a process
    /// group (a real engine: its server and engine-core processes).
    kill_targets: Vec<Option<String>>,
    /// Destinations of an SSH fleet that did not answer when the step began.
    lost: Vec<usize>,
}

/// Start or reuse the step's engines: the study's pool, emulators, or `local.engine_urls`.
fn start_engines(
    spec: &Spec,
    settings: &LocalSettings,
    plan: &RunPlan,
    block: u32,
    pool: Option<&super::engines::EnginePool>,
) -> Result<StepEngines> {
    if let Some(pool) = pool {
        // Real engines up for the whole study: restart any killed in an earlier step, then
        // start this step from cold caches.
        pool.ensure_ready()?;
        let kill_targets = pool
            .groups()
            .into_iter()
            .map(|g| g.map(|g| format!("-{g}")))
            .collect();
        let urls = pool.urls();
        let api = spec.fleet.engine.api();
        reset_caches(&urls, api)?;
        Ok(StepEngines {
            urls,
            api,
            emulators: Vec::new(),
            kill_targets,
            lost: Vec::new(),
        })
    } else if settings.engine_urls.is_empty() {
        start_emulators(spec, plan.replicas, block, settings.time_scale)
    } else {
        if settings.engine_urls.len() != plan.replicas {
            bail!(
                "local.engine_urls lists {} URLs but the run needs {} replicas",
                settings.engine_urls.len(),
                plan.replicas
            );
        }
        let api = spec.fleet.engine.api();
        // An SSH fleet may lose hosts: a replica that does not answer now is left out of this
        // step's resets and scrapes (and reported), the others carry the study on.
        let lost = if settings.agent_hosts.is_some() {
            unreachable(&settings.engine_urls)
        } else {
            Vec::new()
        };
        if lost.len() == settings.engine_urls.len() {
            bail!(
                "no replica of the fleet answers /health ({}); check the hosts",
                settings.engine_urls.join(", ")
            );
        }
        let live: Vec<String> = settings
            .engine_urls
            .iter()
            .enumerate()
            .filter(|(i, _)| !lost.contains(i))
            .map(|(_, u)| u.clone())
            .collect();
        reset_caches(&live, api)?;
        Ok(StepEngines {
            urls: settings.engine_urls.clone(),
            api,
            emulators: Vec::new(),
            kill_targets: Vec::new(),
            lost,
        })
    }
}

/// Destinations whose `/health` does not answer within a few seconds; each is logged.
fn unreachable(urls: &[String]) -> Vec<usize> {
    let Ok(client) = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
    else {
        return Vec::new();
    };
    urls.iter()
        .enumerate()
        .filter(|(i, u)| {
            let ok = client
                .get(format!("{u}/health"))
                .send()
                .is_ok_and(|r| r.status().is_success());
            if !ok {
                tracing::info!(replica = *i, url = %u, "replica lost: /health does not answer; the step runs without it");
            }
            !ok
        })
        .map(|(i, _)| i)
        .collect()
}

/// How long an emulator or the router may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Start `replicas` emulators of the spec's engine at time scale `scale`.
fn start_emulators(
    spec: &Spec,
    replicas: usize,
    block: u32,
    scale: TimeScale,
) -> Result<StepEngines> {
    let mut engines: Vec<ChildGuard> = Vec::new();
    for i in 0..replicas {
        let mut args: Vec<String> = vec![
            "emulate".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--engine".into(),
            spec.fleet.engine_spec(),
            "--block-tokens".into(),
            block.to_string(),
            "--time-scale".into(),
            scale.to_string(),
            "--model-name".into(),
            crate::fleet::launch::SERVED_MODEL_NAME.into(),
        ];
        let k = &spec.fleet.knobs;
        if let Some(v) = k.kv_cache_bytes {
            args.extend(["--kv-cache-bytes".into(), v.to_string()]);
        }
        if let Some(v) = k.max_num_seqs {
            args.extend(["--max-num-seqs".into(), v.to_string()]);
        }
        if let Some(v) = k.max_num_batched_tokens {
            args.extend(["--max-num-batched-tokens".into(), v.to_string()]);
        }
        engines.push(spawn_listening(
            &format!("emulator {i}"),
            &args,
            START_TIMEOUT,
        )?);
    }
    Ok(StepEngines {
        kill_targets: engines
            .iter()
            .map(|e| Some(e.child.id().to_string()))
            .collect(),
        urls: engines.iter().map(|e| e.url.clone()).collect(),
        // `cacheroute emulate` speaks vLLM's dialect unless told otherwise.
        api: EngineApi::Vllm,
        emulators: engines,
        lost: Vec::new(),
    })
}

/// What the step's load goes through: our router, or an external one.
enum Front {
    /// `cacheroute route`, its admin token and when it was started.
    Ours(ChildGuard, String, std::time::Instant),
    Peer(crate::peer::Running),
}

impl Front {
    fn url(&self) -> &str {
        match self {
            Front::Ours(g, ..) => &g.url,
            Front::Peer(p) => &p.url,
        }
    }

    /// The header the router reads the routing key from.
    fn key_header(&self) -> &str {
        match self {
            Front::Ours(..) => crate::peer::OUR_KEY_HEADER,
            Front::Peer(p) => p.key_header,
        }
    }
}

/// Write the router's config into `dir` (with the warm start's initial plan for cacheroute)
/// and start the router in front of `urls`.
fn start_router(
    spec: &Spec,
    plan: &RunPlan,
    block: u32,
    (scale, admin_token): (TimeScale, &str),
    warm: Option<RouterWarmStart>,
    urls: &[String],
    dir: &std::path::Path,
) -> Result<ChildGuard> {
    let StudyPolicy::Ours(ours) = &plan.policy else {
        bail!(
            "{}: an external router is not `cacheroute route`",
            plan.key.policy
        );
    };
    let cfg_path = dir.join("router.yaml");
    let mut cfg = router_config(spec, ours, plan.key.seed, block, scale, urls)?;
    cfg.admin_token = Some(admin_token.to_string());
    if let (crate::policy::PolicySpec::Cacheroute(c), Some(w)) = (ours, warm) {
        cfg.initial_plan = Some(write_initial_plan(spec, plan, c, block, &w, dir)?);
    }
    std::fs::write(&cfg_path, yaml_serde::to_string(&cfg)?)?;
    spawn_listening(
        "router",
        &[
            "route".into(),
            "--config".into(),
            cfg_path.display().to_string(),
        ],
        START_TIMEOUT,
    )
}

/// The study's router configuration (what `cacheroute route --config` reads), the initial plan
/// aside: the policy as the simulated study resolves it, the engines' time scale, and the
/// fleet's engine model with the spec's knobs where the model knows the fleet, so that the
/// router's controller self-calibrates as the simulated study's does, in the model's time.
fn router_config(
    spec: &Spec,
    ours: &crate::policy::PolicySpec,
    seed: u64,
    block: u32,
    scale: TimeScale,
    urls: &[String],
) -> Result<RouterSettings> {
    let engine = fleet_engine(spec, block).ok();
    Ok(RouterSettings {
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        backends: Some(urls.to_vec()),
        policy: Some(PolicySetting::spec(&router_policy(ours, engine.as_ref()))?),
        block_tokens: Some(block),
        seed: Some(seed),
        health_interval_ms: Some(500),
        first_byte_timeout_s: Some(600.0),
        time_scale: Some(scale),
        engine: engine.is_some().then(|| spec.fleet.engine_spec()),
        engine_knobs: engine.is_some().then(|| spec.fleet.knobs.to_overrides()),
        ..Default::default()
    })
}

/// The fleet's engine model (the spec's engine with its knobs) at the study's block size, as
/// the simulated study builds it.
fn fleet_engine(spec: &Spec, block: u32) -> Result<crate::engine::EngineConfig> {
    Ok(crate::engine::engine_config(
        &spec.fleet.engine_spec(),
        block,
        &spec.fleet.knobs.to_overrides(),
    )?)
}

/// The policy the study's router runs: the engine-dependent parameters left at 0 (CacheRoute's
/// conversation memory, Preble's prefill profile) set from the fleet's engine model, exactly
/// as the simulated study sets them; unchanged where the engine model has no entry for the
/// fleet (the router then keeps its own defaults).
fn router_policy(
    ours: &crate::policy::PolicySpec,
    engine: Option<&crate::engine::EngineConfig>,
) -> crate::policy::PolicySpec {
    match engine {
        Some(engine) => crate::policy::calibrate::resolve_policy(ours, engine),
        None => ours.clone(),
    }
}

/// Plan the warm start `w` as the simulator does, write it to `dir/initial-plan.json` and
/// return the path for the router config.
fn write_initial_plan(
    spec: &Spec,
    plan: &RunPlan,
    c: &crate::policy::cacheroute::CacheRouteConfig,
    block: u32,
    w: &RouterWarmStart,
    dir: &std::path::Path,
) -> Result<std::path::PathBuf> {
    let engine = fleet_engine(spec, block)?;
    let pc = crate::policy::calibrate::planner_for(
        c,
        &engine,
        plan.replicas,
        w.mean_prompt_tokens,
        w.mean_output_tokens,
    );
    let keys = crate::plan::export::key_loads(&w.rates);
    let p = crate::plan::build(&pc, &keys, None)?;
    let path = dir.join("initial-plan.json");
    std::fs::write(
        &path,
        serde_json::to_vec(&crate::plan::export::plan_json(&p, &w.rates, &pc))?,
    )?;
    Ok(path)
}

/// A thread that kills an engine at an injected failure's time; it returns (destination,
/// model time, whether the kill succeeded).
type Killer = std::thread::JoinHandle<(usize, f64, bool)>;

/// Injected failures: kill engine processes at their (model) times.
fn schedule_failures(
    failures: &[crate::engine::Failure],
    kill_targets: &[Option<String>],
    scale: TimeScale,
) -> Vec<Killer> {
    let mut killers = Vec::new();
    for fl in failures {
        let Some(Some(target)) = kill_targets.get(fl.destination).cloned() else {
            continue;
        };
        let at = scale.wall_duration(fl.at_s);
        let (dest, at_s) = (fl.destination, fl.at_s);
        killers.push(std::thread::spawn(move || {
            std::thread::sleep(at);
            let killed = Command::new("kill")
                .args(["-KILL", "--", &target])
                .status()
                .is_ok_and(|s| s.success());
            (dest, at_s, killed)
        }));
    }
    killers
}

/// Each injected failure that killed its engine, as (destination, model time); the step
/// records them (the report lists them).
fn injected_kills(killers: Vec<Killer>) -> Vec<(usize, f64)> {
    let mut kills = Vec::new();
    for k in killers {
        if let Ok((dest, at_s, true)) = k.join() {
            kills.push((dest, at_s));
        }
    }
    kills
}

/// Every engine's prefix-cache counters before the step (`None`: a lost replica).
fn scrape_before(
    client: &reqwest::blocking::Client,
    urls: &[String],
    api: EngineApi,
    lost: &[usize],
) -> Result<Vec<Option<(f64, f64)>>> {
    urls.iter()
        .enumerate()
        .map(|(i, u)| {
            if lost.contains(&i) {
                Ok(None)
            } else {
                scrape_cache(client, u, api).map(Some)
            }
        })
        .collect()
}

/// Replay the step's trace open loop through the router, compressed by the time scale, with
/// GPU telemetry from every host for the length of the step (ssh backend).
fn replay(
    settings: &LocalSettings,
    router: &Front,
    records: Vec<TraceRecord>,
    block: u32,
    clock: StepClock,
    (failures, kill_targets): (&[crate::engine::Failure], &[Option<String>]),
) -> Result<(
    crate::loadgen::ReplayResult,
    Vec<TelemetrySample>,
    Vec<Killer>,
)> {
    let scale = clock.scale;
    let mut rcfg = crate::loadgen::ReplayConfig::new(router.url().to_owned());
    rcfg.key_header = router.key_header().to_owned();
    rcfg.model = crate::fleet::launch::SERVED_MODEL_NAME.into();
    rcfg.stream = true;
    rcfg.block_tokens = block;
    rcfg.timeout = Duration::from_secs_f64(settings.request_timeout_s.unwrap_or(600.0));
    rcfg.duration_s = Some(scale.to_wall(clock.duration));
    rcfg.sessions = settings.sessions;
    rcfg.think_time = settings
        .think_time_s
        .unwrap_or_default()
        .map_secs(|s| scale.to_wall(s));
    let schedule = records
        .into_iter()
        .map(move |r| (scale.to_wall(r.timestamp_ms / 1000.0), r));
    // Slurm: local commands (`srun --overlap …`); ssh: a channel of each host's session.
    let mut agents: Vec<AgentStream> = settings
        .agents
        .iter()
        .filter_map(|a| AgentStream::start_command(a).ok())
        .collect();
    if let Some(inv) = &settings.agent_hosts {
        agents.extend(
            inv.hosts
                .iter()
                .filter_map(|h| AgentStream::start_ssh(inv, h, scale.to_wall(clock.duration)).ok()),
        );
    }
    let killers = schedule_failures(failures, kill_targets, scale);
    let result = crate::loadgen::replay_blocking(&rcfg, schedule)?;
    let gpu_samples: Vec<TelemetrySample> =
        agents.into_iter().flat_map(AgentStream::finish).collect();
    Ok((result, gpu_samples, killers))
}

/// A process that died under the step (other than by an injected failure) makes its
/// failures an artefact, not a measurement: the step is an error and is not stored.
fn check_none_died(
    router: &mut Front,
    emulators: &mut [ChildGuard],
    pool: Option<&super::engines::EnginePool>,
    kills: &[(usize, f64)],
    result: &crate::loadgen::ReplayResult,
) -> Result<()> {
    let mut dead: Vec<String> = Vec::new();
    match router {
        Front::Ours(g, ..) => dead.extend(g.exited()),
        Front::Peer(p) => {
            if let Some(why) = p.exited() {
                return Err(super::external::died(p, why));
            }
        }
    }
    for (i, e) in emulators.iter_mut().enumerate() {
        if !kills.iter().any(|(d, _)| *d == i) {
            dead.extend(e.exited());
        }
    }
    if let Some(pool) = pool {
        for (i, why) in pool.exited() {
            if !kills.iter().any(|(d, _)| *d == i) {
                dead.push(why);
            }
        }
    }
    if !dead.is_empty() {
        bail!(
            "{} during the step; the step is not stored ({} of {} requests failed); rerun with --resume",
            dead.join(", "),
            result
                .records
                .iter()
                .filter(|r| !r.record.status.is_ok())
                .count(),
            result.records.len()
        );
    }
    Ok(())
}

/// Every engine's counters after the step, then stop the router and the step's emulators.
/// A killed engine has no counters left to read: its delta is unknown, not zero.
fn scrape_after_and_stop(
    client: &reqwest::blocking::Client,
    (urls, api): (&[String], EngineApi),
    router: Front,
    emulators: Vec<ChildGuard>,
) -> Vec<Option<(f64, f64)>> {
    let after: Vec<Option<(f64, f64)>> = urls
        .iter()
        .map(|u| scrape_cache(client, u, api).ok())
        .collect();
    drop(router);
    drop(emulators);
    after
}

/// The step's metrics over the measured window, back in model time.
fn model_time_metrics(
    result: &crate::loadgen::ReplayResult,
    key_rates: &HashMap<u64, f64>,
    scale: TimeScale,
    replicas: usize,
    window: Window,
    qps: f64,
) -> crate::analysis::model::StepMetrics {
    let records = result
        .records
        .iter()
        .map(|r| r.record.map_times(|t| scale.to_model(t)));
    step_metrics(records, key_rates, replicas, window, qps)
}

/// The engines' prefix-cache counters before and after a step, by destination.
struct CounterScrapes<'a> {
    urls: &'a [String],
    before: &'a [Option<(f64, f64)>],
    after: &'a [Option<(f64, f64)>],
}

/// The step's telemetry: GPU samples, a [`REPLICA_KILLED`] row per injected kill, and each
/// engine's counter deltas (at the step's end, model time `duration`).
fn step_telemetry(
    gpu_samples: Vec<TelemetrySample>,
    kills: &[(usize, f64)],
    counters: &CounterScrapes<'_>,
    duration: f64,
) -> Vec<TelemetrySample> {
    let urls = counters.urls;
    let mut telemetry = gpu_samples;
    for &(dest, at_s) in kills {
        telemetry.push(TelemetrySample {
            run: None,
            step: None,
            source: format!("engine:{dest}"),
            metric: REPLICA_KILLED.into(),
            labels: vec![("url".into(), urls.get(dest).cloned().unwrap_or_default())],
            value: 1.0,
            at_s,
        });
    }
    for (i, (b, a)) in counters.before.iter().zip(counters.after).enumerate() {
        let (Some(b), Some(a)) = (b, a) else { continue };
        for (metric, v) in [
            (engine_api::CACHE_HIT_TOKENS_DELTA, a.0 - b.0),
            (engine_api::CACHE_QUERY_TOKENS_DELTA, a.1 - b.1),
        ] {
            telemetry.push(TelemetrySample {
                run: None,
                step: None,
                source: format!("engine:{i}"),
                metric: metric.to_string(),
                labels: vec![("url".into(), urls[i].clone())],
                value: v,
                at_s: duration,
            });
        }
    }
    telemetry
}

/// A [`REPLICA_LOST`] row for each replica unreachable when the step began (`lost`, at 0) and
/// each one whose counters could not be read after it (lost during the step, at its end),
/// injected kills aside; each loss is logged.
fn lost_replicas(
    urls: &[String],
    lost: &[usize],
    counters: &CounterScrapes<'_>,
    kills: &[(usize, f64)],
    duration: f64,
) -> Vec<TelemetrySample> {
    let mut out = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let at_s = if lost.contains(&i) {
            0.0
        } else if counters.before[i].is_some()
            && counters.after[i].is_none()
            && !kills.iter().any(|(d, _)| *d == i)
        {
            tracing::info!(replica = i, url = %url, "replica lost during the step: its /metrics no longer answers; the router excluded it");
            duration
        } else {
            continue;
        };
        out.push(TelemetrySample {
            run: None,
            step: None,
            source: format!("engine:{i}"),
            metric: REPLICA_LOST.into(),
            labels: vec![("url".into(), url.clone())],
            value: 1.0,
            at_s,
        });
    }
    out
}

/// Telemetry metrics of live sessions, one row each per step (source `replayer`, at the step's
/// end): turns sent, late and abandoned, abandoned sessions, and the served hit of the turns
/// after the first from the answers' `cached_tokens`.
pub const SESSION_METRICS: [&str; 5] = [
    "session_turns_sent",
    "session_turns_late",
    "sessions_abandoned",
    "session_turns_abandoned",
    "session_later_turns_kv_hit",
];

/// The step's live-session figures as telemetry rows (none without live sessions).
fn session_telemetry(
    result: &crate::loadgen::ReplayResult,
    clock: StepClock,
) -> Vec<TelemetrySample> {
    let Some(s) = &result.summary.sessions else {
        return Vec::new();
    };
    let values = [
        s.turns_sent as f64,
        s.turns_late as f64,
        s.sessions_abandoned as f64,
        s.turns_abandoned as f64,
        s.later_turns_kv_hit,
    ];
    SESSION_METRICS
        .iter()
        .zip(values)
        .filter(|(_, v)| v.is_finite())
        .map(|(m, value)| TelemetrySample {
            run: None,
            step: None,
            source: "replayer".into(),
            metric: m.to_string(),
            labels: Vec::new(),
            value,
            at_s: clock.duration,
        })
        .collect()
}

/// The replayer's rows of the measured window, back in model time: each record is converted
/// once, and the window (model seconds) is applied to the converted record.
fn request_rows(
    result: &crate::loadgen::ReplayResult,
    window: Window,
    scale: TimeScale,
) -> Vec<RequestRow> {
    result
        .records
        .iter()
        .filter_map(|r| {
            let record = r.record.map_times(|t| scale.to_model(t));
            window.contains(record.scheduled_s).then(|| RequestRow {
                record,
                key: Some(r.key.clone()),
            })
        })
        .collect()
}

/// `cacheroute agent` running on a host for the length of a step: as a step of the fleet's
/// Slurm job (a local `srun` process), or over SSH (a channel of the host's multiplexed
/// session).
struct AgentStream {
    host: String,
    source: AgentSource,
    t0: f64,
}

enum AgentSource {
    Command {
        child: Child,
        lines: std::sync::mpsc::Receiver<String>,
    },
    Ssh(crate::fleet::ssh::LineStream),
}

impl AgentStream {
    fn start_command(a: &crate::fleet::AgentCommand) -> Result<AgentStream> {
        let mut child = Command::new(&a.program)
            .args(&a.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let out = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(AgentStream {
            host: a.host.clone(),
            source: AgentSource::Command { child, lines: rx },
            t0: crate::unix_now_s(),
        })
    }

    /// Start the agent over SSH for a step of `step_s` seconds. It stops by itself a minute
    /// after the step should have ended (`--count`), so an agent whose channel can no longer
    /// tell it to stop (its host cut off, the controller killed) does not outlive the study
    /// for long.
    fn start_ssh(
        inv: &crate::fleet::inventory::Inventory,
        h: &crate::fleet::inventory::Host,
        step_s: f64,
    ) -> Result<AgentStream> {
        let rounds = ((step_s + 60.0) * 2.0).ceil() as u64;
        let line = crate::fleet::AGENT_LINE.join(" ");
        let stream = crate::fleet::ssh::Remote::new(inv, h)
            .stream_lines(&format!("{line} --count {rounds}"))?;
        Ok(AgentStream {
            host: h.name.clone(),
            source: AgentSource::Ssh(stream),
            t0: crate::unix_now_s(),
        })
    }

    /// Stop the agent and turn its samples into telemetry (seconds from the step's start).
    fn finish(self) -> Vec<TelemetrySample> {
        let lines: Vec<String> = match self.source {
            AgentSource::Command { mut child, lines } => {
                // SIGTERM first: `srun` passes it to the agent's step and ends it; then SIGKILL.
                crate::process::stop(
                    &mut child,
                    crate::process::Scope::Process,
                    Duration::from_secs(3),
                );
                lines.try_iter().collect()
            }
            AgentSource::Ssh(stream) => stream.stop(),
        };
        let mut out = Vec::new();
        for l in lines {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&l) else {
                continue;
            };
            let gpu = v["gpu"].as_u64().unwrap_or(0);
            let t = v["t"].as_f64().unwrap_or(self.t0) - self.t0;
            for m in [
                "util_pct",
                "mem_used_mib",
                "power_w",
                "energy_j",
                "sm_clock_mhz",
                "temp_c",
            ] {
                if let Some(x) = v[m].as_f64() {
                    out.push(TelemetrySample {
                        run: None,
                        step: None,
                        source: format!("gpu:{}:{gpu}", self.host),
                        metric: format!("gpu_{m}"),
                        labels: vec![
                            ("host".into(), self.host.clone()),
                            ("gpu".into(), gpu.to_string()),
                        ],
                        value: x,
                        at_s: t,
                    });
                }
            }
        }
        out
    }
}

/// Engine-counter served hit over a step from its telemetry deltas (either naming).
pub fn engine_served_hit(t: &[TelemetrySample]) -> Option<f64> {
    use engine_api::CacheDelta;
    let (mut h, mut q) = (0.0, 0.0);
    for s in t {
        match CacheDelta::of_metric(&s.metric) {
            Some(CacheDelta::HitTokens) => h += s.value,
            Some(CacheDelta::QueryTokens) => q += s.value,
            None => {}
        }
    }
    (q > 0.0).then(|| h / q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};

    #[test]
    fn the_study_s_router_runs_the_policy_the_simulated_study_runs() {
        use crate::policy::PolicySpec;
        let spec = |fleet: &str| {
            Spec::parse(
                &format!(
                    "name: t\nbackend: local\nfleet: {fleet}\n\
                     policies: [ {{policy: cacheroute}}, {{policy: preble}}, {{policy: cacheroute, memory_size: 777}} ]\n\
                     ladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2}} ]\n"
                ),
                "t.yaml",
            )
            .unwrap()
        };
        let ours = |s: &Spec, i: usize| match &s.policies[i] {
            StudyPolicy::Ours(p) => p.clone(),
            StudyPolicy::External(_) => unreachable!(),
        };
        // The policy as router_config gives it, the fleet's engine model built from the spec.
        let policy =
            |s: &Spec, i: usize| router_policy(&ours(s, i), fleet_engine(s, 64).ok().as_ref());
        // peers-local's fleet: 6 GB of KV per replica, not an H100's whole memory.
        let s = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4, knobs: { kv_cache_bytes: 6.0e9 } }");
        let engine = fleet_engine(&s, 64).unwrap();
        let blocks = 2 * engine.kv_capacity_tokens() / engine.knobs().hash_block_tokens as u64;
        assert!((1_000..100_000).contains(&blocks), "{blocks}");
        match policy(&s, 0) {
            PolicySpec::Cacheroute(c) => assert_eq!(c.memory_size, blocks),
            p => panic!("{p:?}"),
        }
        match policy(&s, 1) {
            PolicySpec::Preble(c) => {
                assert!(c.prefill_b_s_per_token > 0.0 && c.tpot_s > 0.0, "{c:?}")
            }
            p => panic!("{p:?}"),
        }
        // A size the spec gives is kept.
        match policy(&s, 2) {
            PolicySpec::Cacheroute(c) => assert_eq!(c.memory_size, 777),
            p => panic!("{p:?}"),
        }
        // Without the knob the H100's own KV space (larger) sizes it: the knob reaches the
        // policy.
        let whole = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4 }");
        match policy(&whole, 0) {
            PolicySpec::Cacheroute(c) => {
                assert!(c.memory_size > blocks, "{} {blocks}", c.memory_size)
            }
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn the_study_s_router_keeps_the_model_s_time_and_the_fleet_s_engine_model() {
        let spec = |fleet: &str| {
            Spec::parse(
                &format!(
                    "name: t\nbackend: local\nlocal: {{ time_scale: 8 }}\nfleet: {fleet}\n\
                     policies: [ {{policy: cacheroute}} ]\nplanner: {{ q_cap: 4, interval_s: 10 }}\n\
                     ladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2}} ]\n"
                ),
                "t.yaml",
            )
            .unwrap()
        };
        let s = spec("{ engine: emulator, model: qwen2.5-32b, gpu: h100, precision: fp8, tp: 1, replicas: 4, knobs: { kv_cache_bytes: 6.0e9 } }");
        let run = &s.expand()[0];
        let StudyPolicy::Ours(ours) = &run.policy else {
            unreachable!()
        };
        let urls = vec!["http://127.0.0.1:1".to_string()];
        let scale = s.local.as_ref().unwrap().time_scale;
        let settings = router_config(&s, ours, 3, 64, scale, &urls).unwrap();
        // What `cacheroute route --config` reads: the same settings.
        let written = yaml_serde::to_string(&settings).unwrap();
        let read: RouterSettings = yaml_serde::from_str(&written).unwrap();
        assert_eq!(read, settings, "{written}");
        let cfg = serde_json::to_value(&settings).unwrap();
        // The policy's interval and q_cap stay in the model's time; the router is told the scale.
        assert_eq!(cfg["time_scale"], 8.0, "{cfg}");
        assert_eq!(cfg["policy"]["interval_s"], 10.0, "{cfg}");
        assert_eq!(cfg["policy"]["q_cap"], 4.0, "{cfg}");
        // The fleet's engine model with the spec's knobs: the router self-calibrates through it.
        assert_eq!(cfg["engine"], s.fleet.engine_spec(), "{cfg}");
        assert_eq!(cfg["engine_knobs"]["kv_cache_bytes"], 6.0e9, "{cfg}");
        let knobs: crate::engine::KnobOverrides =
            serde_json::from_value(cfg["engine_knobs"].clone()).unwrap();
        assert_eq!(knobs, s.fleet.knobs.to_overrides());
    }

    /// A loopback HTTP server answering its requests, in order, with `answers` (the last one
    /// repeated); returns its base URL and the request lines it received.
    fn canned(answers: Vec<(u16, &'static str)>) -> (String, Arc<Mutex<Vec<String>>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for (i, conn) in l.incoming().enumerate() {
                let Ok(mut c) = conn else { return };
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && c.read(&mut b).unwrap_or(0) == 1 {
                    head.push(b[0]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                log.lock()
                    .unwrap()
                    .push(text.lines().next().unwrap_or("").to_string());
                let (status, body) = answers[i.min(answers.len() - 1)];
                let _ = write!(
                    c,
                    "HTTP/1.1 {status} X\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        (url, seen)
    }

    #[test]
    fn vllm_reset_answering_success_false_is_a_failure() {
        // vLLM 0.32 answers 200 with {"success": false} while blocks are held.
        let (url, seen) = canned(vec![(200, r#"{"success": false}"#)]);
        let e = reset_caches_within(
            std::slice::from_ref(&url),
            EngineApi::Vllm,
            Duration::from_millis(400),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("POST /reset_prefix_cache still refused")
                && e.contains(r#"{"success": false}"#),
            "{e}"
        );
        let seen = seen.lock().unwrap();
        assert!(seen.len() >= 2, "retried: {seen:?}");
        assert!(seen
            .iter()
            .all(|l| l.starts_with("POST /reset_prefix_cache ")));
        // Success (and an older release's empty 200) is done at once.
        let (url, seen) = canned(vec![(200, r#"{"success":true}"#)]);
        reset_caches(&[url], EngineApi::Vllm).unwrap();
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    #[test]
    fn sglang_flush_is_retried_while_the_engine_is_busy() {
        let busy = "Cache not flushed: requests are running or waiting.\n";
        let (url, seen) = canned(vec![(400, busy), (400, busy), (200, "Cache flushed.\n")]);
        reset_caches(std::slice::from_ref(&url), EngineApi::Sglang).unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen.iter().all(|l| l.starts_with("POST /flush_cache ")));
        // Busy past the deadline: a clear error naming the engine and the answer.
        let (url, _) = canned(vec![(400, busy)]);
        let e = reset_caches_within(
            std::slice::from_ref(&url),
            EngineApi::Sglang,
            Duration::from_millis(300),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with(&format!("{url}: POST /flush_cache still refused"))
                && e.contains("400 Cache not flushed")
                && !e.contains('\n'),
            "{e}"
        );
        // Any other answer fails at once (e.g. not an SGLang server).
        let (url, seen) = canned(vec![(404, "{\"detail\":\"Not Found\"}")]);
        let e = reset_caches(&[url], EngineApi::Sglang)
            .unwrap_err()
            .to_string();
        assert!(e.contains("failed (404"), "{e}");
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// `local.time_scale` is read as a [`TimeScale`]: the one range, refused as the spec is
    /// read with the one-line error; real engines still need 1.
    #[test]
    fn a_study_s_time_scale_is_read_in_the_one_range() {
        let parse = |local: &str, engine: &str| {
            Spec::parse(
                &format!(
                    "name: t\nbackend: local\nlocal: {local}\nfleet: {{ engine: {engine}, model: tiny, gpu: cpu, precision: bf16, tp: 1, replicas: 1 }}\n\
                     policies: [ {{policy: cacheroute}} ]\nladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2}} ]\n"
                ),
                "t.yaml",
            )
        };
        for bad in ["0", "-1", "10001", ".nan", ".inf"] {
            let e = parse(&format!("{{ time_scale: {bad} }}"), "emulator").unwrap_err();
            assert!(
                e.contains("time_scale: ") && e.contains("0 < value ≤ 10000") && !e.contains('\n'),
                "{bad}: {e}"
            );
        }
        for good in ["0.5", "10000"] {
            let s = parse(&format!("{{ time_scale: {good} }}"), "emulator").unwrap();
            let scale = s.local.unwrap().time_scale;
            assert_eq!(scale.to_string(), good);
        }
        let e = parse("{ time_scale: 4 }", "vllm").unwrap_err();
        assert!(
            e.contains("local.time_scale: 4 — real engines run in real time"),
            "{e}"
        );
        assert!(parse("{ time_scale: 1 }", "vllm").is_ok());
    }

    /// A replayed record is converted to the model's time once: its row and the step's
    /// metrics both see it at wall time × scale, inside or outside the window by that time.
    #[test]
    fn a_step_s_records_are_converted_to_model_time_once() {
        use crate::analysis::record::{RequestRecord, Status};
        let rec = |id: u64, at: f64| crate::loadgen::ReplayRecord {
            record: RequestRecord {
                id,
                key: 7,
                destination: Some(0),
                scheduled_s: at,
                sent_s: Some(at),
                first_token_s: Some(at + 0.125),
                finish_s: Some(at + 0.25),
                prompt_tokens: 10,
                output_tokens: 2,
                cached_tokens: Some(0),
                preemptions: 0,
                retried: false,
                status: Status::Ok,
            },
            key: "k".into(),
            destination_header: None,
            max_itl_s: None,
            gaps: Vec::new(),
            error: None,
            session: None,
            turn: None,
            late_s: None,
            prompt: None,
            answer: None,
        };
        // Wall 0.5, 1 and 3 s at scale 4: model 2, 4 and 12 s; the window is [3, 10).
        let records = vec![rec(0, 0.5), rec(1, 1.0), rec(2, 3.0)];
        let result = crate::loadgen::ReplayResult {
            summary: crate::loadgen::ReplaySummary::of(&records, None, 3.25, None),
            records,
            interrupted: false,
            aborted: None,
            start_unix_s: 0.0,
        };
        let scale = TimeScale::new(4.0).unwrap();
        let window = Window {
            from_s: 3.0,
            to_s: 10.0,
        };
        let rows = request_rows(&result, window, scale);
        assert_eq!(rows.len(), 1);
        let r = &rows[0].record;
        assert_eq!(r.id, 1);
        assert_eq!(
            (r.scheduled_s, r.sent_s, r.first_token_s, r.finish_s),
            (4.0, Some(4.0), Some(4.5), Some(5.0))
        );
        let m = model_time_metrics(&result, &HashMap::new(), scale, 1, window, 1.0);
        assert_eq!(m.requests, 1);
        assert!((m.e2e_p50_s - 1.0).abs() < 0.05, "{}", m.e2e_p50_s);
    }
}
