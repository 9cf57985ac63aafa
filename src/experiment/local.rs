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

use super::child::{spawn_listening, ChildGuard, START_TIMEOUT};
use super::front::RouterWarmStart;
use super::routers::Routers;
use super::spec::{LocalSettings, RunPlan, Spec};
use crate::analysis::record::PlanRecord;
use crate::analysis::step::{step_metrics, Window};
use crate::bounds::TimeScale;
use crate::store::{RequestRow, TelemetrySample};
use crate::telemetry::engine_api::{self, EngineApi, ResetOutcome};
use crate::workload::trace::TraceRecord;
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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

/// One step's load: its trace (model time), block size, offered rate and per-key rates.
pub struct StepLoad<'a> {
    pub records: Vec<TraceRecord>,
    pub block: u32,
    pub qps: f64,
    pub key_rates: &'a HashMap<u64, f64>,
    /// End the step once certain to fail these SLOs (`analysis::early`); empty: run it whole.
    pub cut_for: &'a [crate::analysis::model::Slo],
}

/// The early verdict of a live step: the schedule's requests in model time, each filled in as
/// it ends, watched once a second of wall time.
struct LiveCut {
    verdict: crate::analysis::early::EarlyVerdict,
    slots: Vec<crate::analysis::record::RequestRecord>,
    scale: TimeScale,
    next_check_s: f64,
    cut: Option<crate::analysis::model::Cut>,
}

impl LiveCut {
    fn new(
        records: &[TraceRecord],
        slos: &[crate::analysis::model::Slo],
        window: Window,
        scale: TimeScale,
    ) -> Self {
        // Each request as the replayer records it before it ends, still running.
        let slots: Vec<_> = records
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut rec = crate::loadgen::ReplayRecord::new(
                    i as u64,
                    &r.key,
                    r.timestamp_ms / 1000.0,
                    r.input_length,
                )
                .record;
                rec.status = crate::analysis::record::Status::Unfinished;
                rec
            })
            .collect();
        let n = slots
            .iter()
            .filter(|r| window.contains(r.scheduled_s))
            .count() as u64;
        Self {
            // A client learns of a first token only when its answer ends: TTFT counts what
            // has ended.
            verdict: crate::analysis::early::EarlyVerdict::new(slos, window, n, false),
            slots,
            scale,
            next_check_s: 0.0,
            cut: None,
        }
    }

    /// The replay's watch: `now` wall seconds from its start, a request that ended.
    fn see(&mut self, now: f64, ended: Option<&crate::loadgen::ReplayRecord>) -> bool {
        if let Some(r) = ended {
            let rec = r.record.map_times(|t| self.scale.to_model(t));
            if let Some(slot) = self.slots.get_mut(rec.id as usize) {
                *slot = rec;
            }
        }
        if now < self.next_check_s || self.cut.is_some() {
            return false;
        }
        self.next_check_s = now + 1.0;
        self.cut = self.verdict.check(self.scale.to_model(now), &self.slots);
        self.cut.is_some()
    }
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
        cut_for,
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
    let kv_events = engines.kv_events.then_some(super::kv_events::PORT_OFFSET);
    let mut router = super::routers::start(
        spec,
        plan,
        block,
        (clock.scale, kv_events),
        warm,
        &engines.urls,
        dir.path(),
    )?;
    // Scrape before, replay, scrape after.
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let before = scrape_before(&client, &engines.urls, engines.api, &engines.lost)?;
    // An external router reports nothing: its window is measured on the engines' counters.
    let window_start = router.is_peer().then(|| {
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
    let window = Window {
        from_s: spec.warmup_s,
        to_s: clock.duration,
    };
    let watch = (!cut_for.is_empty()).then(|| {
        std::sync::Arc::new(std::sync::Mutex::new(LiveCut::new(
            &records,
            cut_for,
            window,
            clock.scale,
        )))
    });
    let (result, gpu_samples, killers) = replay(
        &settings,
        &router,
        (records, block),
        clock,
        failures,
        watch.clone(),
    )?;
    let cut = watch.and_then(|w| w.lock().ok().and_then(|mut c| c.cut.take()));
    let kills = injected_kills(killers);
    check_none_died(&mut router, &mut engines.emulators, pool, &kills, &result)?;
    let peer_window = match window_start {
        Some(h) => {
            let start = h
                .join()
                .map_err(|_| anyhow::anyhow!("the window-start scrape panicked"))??;
            let end = super::external::scrape(&client, &engines.urls, engines.api)?;
            let d = super::external::deltas(&start, &end);
            Some((
                super::external::telemetry(router.peers(), &engines.urls, &d, clock.duration),
                d,
            ))
        }
        None => None,
    };
    // The routers' counters of the engines' events and of their predicted hits, before they
    // stop.
    let router_kv = if engines.kv_events {
        router.kv_telemetry(&client, clock.duration)?
    } else {
        Vec::new()
    };
    let plans = router.plans(&client, replay_started, clock.scale)?;
    let router_counters = router.counters(&client, clock.duration);
    let after = scrape_after_and_stop(
        &client,
        (&engines.urls, engines.api),
        router,
        engines.emulators,
    );
    // A cut step is measured over what ran of its window, and says so.
    let measured = match (&cut, result.cut_at_s) {
        (Some(_), Some(at)) => Window {
            from_s: window.from_s,
            to_s: clock.scale.to_model(at).clamp(window.from_s, window.to_s),
        },
        _ => window,
    };
    let mut metrics = model_time_metrics(
        &result,
        key_rates,
        clock.scale,
        plan.replicas,
        measured,
        qps,
    );
    metrics.cut = cut;
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
    telemetry.extend(router_kv);
    telemetry.extend(router_counters);
    let requests = request_rows(&result, window, clock.scale);
    Ok(LocalStep {
        metrics,
        requests,
        plans,
        telemetry,
    })
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
    /// They publish their KV-cache events at port + [`super::kv_events::PORT_OFFSET`] (the
    /// emulators a step starts).
    kv_events: bool,
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
            kv_events: false,
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
            kv_events: false,
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
        engines.push(spawn_publishing(&format!("emulator {i}"), args)?);
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
        kv_events: true,
    })
}

/// Start an emulator with `args` that publishes its KV-cache events
/// ([`super::kv_events::emulator_args`]); a port taken between its choice and the start is
/// chosen again (twice more).
fn spawn_publishing(what: &str, args: Vec<String>) -> Result<ChildGuard> {
    let mut tries = 0;
    loop {
        let mut a = args.clone();
        a.extend(super::kv_events::emulator_args(
            super::kv_events::free_port()?,
        ));
        match spawn_listening(what, &a, START_TIMEOUT) {
            Err(e) if tries < 2 && format!("{e:#}").contains("in use") => tries += 1,
            r => return r,
        }
    }
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
    router: &Routers,
    (records, block): (Vec<TraceRecord>, u32),
    clock: StepClock,
    (failures, kill_targets): (&[crate::engine::Failure], &[Option<String>]),
    watch: Option<std::sync::Arc<std::sync::Mutex<LiveCut>>>,
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
    let result = match watch {
        None => crate::loadgen::replay_blocking(&rcfg, schedule)?,
        Some(w) => crate::loadgen::replay_blocking_watched(
            &rcfg,
            schedule,
            Box::new(move |now, ended| w.lock().is_ok_and(|mut c| c.see(now, ended))),
        )?,
    };
    let gpu_samples: Vec<TelemetrySample> =
        agents.into_iter().flat_map(AgentStream::finish).collect();
    Ok((result, gpu_samples, killers))
}

/// A process that died under the step (other than by an injected failure) makes its
/// failures an artefact, not a measurement: the step is an error and is not stored.
fn check_none_died(
    router: &mut Routers,
    emulators: &mut [ChildGuard],
    pool: Option<&super::engines::EnginePool>,
    kills: &[(usize, f64)],
    result: &crate::loadgen::ReplayResult,
) -> Result<()> {
    let mut dead: Vec<String> = router.exited()?;
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
    router: Routers,
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
    use crate::experiment::front::router_plans;
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};

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

    /// The step's router's plan history is read as plan records, timed from the replay's
    /// start; an answer that is refused, not JSON or not a list of records is an error naming
    /// what was wrong, never a silent empty list.
    #[test]
    fn the_router_s_plans_are_read_back_and_a_bad_answer_is_an_error() {
        let client = reqwest::blocking::Client::new();
        let rec = |at: f64| {
            format!(
                r#"{{"at_s":{at},"admitted":3,"admitted_share":0.5,"imbalance":1.0,"churn":1.0,"repair":false,"q_cap":8.0,"warm_slots":4,"bounded_sets":true}}"#
            )
        };
        let good: &'static str = Box::leak(
            format!(
                r#"{{"installed":true,"history":[{},{}],"history_dropped":0}}"#,
                rec(1.0),
                rec(5.0)
            )
            .into_boxed_str(),
        );
        let (url, seen) = canned(vec![(200, good)]);
        let plans = router_plans(&client, &url, "t", 2.0).unwrap();
        let at: Vec<f64> = plans.iter().map(|p| p.at_s).collect();
        assert_eq!(at, [0.0, 3.0], "before the replay: at 0");
        assert_eq!(plans[1].bounded_sets, Some(true));
        assert_eq!(
            seen.lock().unwrap()[0],
            "GET /admin/plan?history=true HTTP/1.1"
        );
        for (status, body, says) in [
            (403, "{}", "reading the plans"),
            (200, "<html>", "no JSON"),
            (200, r#"{"history": 3}"#, "not a list of plan records"),
            (
                200,
                r#"{"history": [{"at_s": "soon"}]}"#,
                "not a list of plan records",
            ),
        ] {
            let (url, _) = canned(vec![(status, body)]);
            let e = format!("{:#}", router_plans(&client, &url, "t", 0.0).unwrap_err());
            assert!(e.contains(says), "{status} {body}: {e}");
        }
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
        let rec = |id: u64, at: f64| {
            let mut r = crate::loadgen::ReplayRecord::new(id, "k", at, 10);
            r.record.destination = Some(0);
            r.record.sent_s = Some(at);
            r.record.first_token_s = Some(at + 0.125);
            r.record.finish_s = Some(at + 0.25);
            r.record.output_tokens = 2;
            r.record.cached_tokens = Some(0);
            r
        };
        // Wall 0.5, 1 and 3 s at scale 4: model 2, 4 and 12 s; the window is [3, 10).
        let records = vec![rec(0, 0.5), rec(1, 1.0), rec(2, 3.0)];
        let result = crate::loadgen::ReplayResult {
            summary: crate::loadgen::ReplaySummary::of(&records, None, 3.25, None),
            records,
            interrupted: false,
            cut_at_s: None,
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
