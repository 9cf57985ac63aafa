//! The study runner: policies × seeds × sweep points × ladder steps on a backend, every step
//! stored atomically in SQLite as it completes, then the report. A killed study resumes with
//! `--resume` after its last completed step; since each simulated step is a deterministic
//! function of (spec, run, step), a resumed study reports exactly what an uninterrupted one
//! does.
//!
//! The simulator backend runs steps on worker threads (one per core by default); a single
//! writer thread owns the database.

use super::spec::{Backend, RunPlan, Spec};
use crate::analysis::capacity::{capacity, passes};
use crate::analysis::knee::{self, is_probe, KneeGrid, PROBE_STEP_BASE};
use crate::analysis::model::{Censoring, StepMetrics, StepRecord};
use crate::analysis::record::PlanRecord;
use crate::analysis::step::{step_metrics, Window};
use crate::engine::engine_config;
use crate::policy::calibrate::{warm_start, WarmStart};
use crate::progress::StudyBars;
use crate::sim::{self, SimConfig, SimOutput};
use crate::store::{BlockingStore, RequestRow, RunId};
use crate::workload::gen::{resolve, Workload};
use crate::workload::trace::{ReaderOptions, TraceReader, TraceRecord};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// How to run a study.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// SQLite results database.
    pub db: PathBuf,
    /// Directory for `<study>.md`, `<study>.json` and plots.
    pub out_dir: PathBuf,
    /// Continue a study already in the database after its last completed step.
    pub resume: bool,
    /// Use only the first n seeds of the spec.
    pub seeds: Option<usize>,
    /// Override the spec's backend.
    pub backend: Option<Backend>,
    /// Worker threads (0 = one per core).
    pub threads: usize,
    /// Show progress bars.
    pub progress: bool,
    /// Store every request of the measured window (large; off by default in simulation).
    pub store_requests: bool,
    /// Directory relative paths in the spec are resolved against.
    pub base_dir: PathBuf,
    /// Stop after this many steps have been stored (tests of kill-and-resume; None = all).
    pub stop_after_steps: Option<usize>,
    /// Set (e.g. by a SIGINT handler) to stop the study: no further step is started or
    /// stored, and [`run`] returns [`Interrupted`].
    pub interrupt: Option<&'static AtomicBool>,
}

/// The study was stopped through [`RunOptions::interrupt`]; what is stored is whole steps,
/// and `--resume` continues after them.
#[derive(Debug, thiserror::Error)]
#[error("interrupted after {stored} of {total} steps")]
pub struct Interrupted {
    pub stored: usize,
    pub total: usize,
}

/// The study ran, but external routers failed (to install, to start, or under a step): their
/// remaining steps were skipped, everything else is stored and reported (`outcome`), and each
/// failure is in the database with its log tail. `--resume` retries them.
#[derive(Debug, thiserror::Error)]
#[error("{} external router(s) failed: {}", failures.len(), failures.iter().map(|f| f.label.as_str()).collect::<Vec<_>>().join(", "))]
pub struct PeersFailed {
    pub failures: Vec<super::external::PeerFailed>,
    pub outcome: Outcome,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            db: PathBuf::from("results.db"),
            out_dir: PathBuf::from("reports"),
            resume: false,
            seeds: None,
            backend: None,
            threads: 0,
            progress: true,
            store_requests: false,
            base_dir: PathBuf::from("."),
            stop_after_steps: None,
            interrupt: None,
        }
    }
}

/// Stops a provisioned fleet when dropped (success, error or panic): the ssh backend's
/// replicas on their hosts, or the slurm backend's job.
enum FleetGuard {
    Ssh(crate::fleet::inventory::Inventory),
    Slurm(crate::fleet::slurm::SlurmJob),
}

impl FleetGuard {
    /// What the fleet is doing, for an error that happened while it ran (slurm: the job's
    /// state, log file and last lines).
    fn describe(&self) -> Option<String> {
        match self {
            FleetGuard::Ssh(_) => None,
            FleetGuard::Slurm(job) => Some(crate::fleet::slurm::describe(job)),
        }
    }
}

impl Drop for FleetGuard {
    fn drop(&mut self) {
        let r = match self {
            FleetGuard::Ssh(inv) => {
                crate::fleet::provision::down(inv, std::time::Duration::from_secs(10))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            FleetGuard::Slurm(job) => {
                crate::fleet::slurm::cancel(job.id, &job.name).map_err(|e| e.to_string())
            }
        };
        if let Err(e) = r {
            eprintln!("error: tearing down the fleet: {e}");
        }
        crate::fleet::ssh::close_all();
    }
}

/// What a finished study produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub steps_run: usize,
    pub steps_skipped: usize,
    pub report_md: PathBuf,
    pub report_json: PathBuf,
    pub summary: String,
}

/// The workload of a run, loaded once and shared by its steps.
enum Source {
    Generated(Box<Workload>),
    Trace {
        records: Arc<Vec<TraceRecord>>,
        native_qps: f64,
    },
}

struct Task {
    run_index: usize,
    run_id: RunId,
    step: usize,
    qps: f64,
}

struct Done {
    run_id: RunId,
    step: usize,
    metrics: StepMetrics,
    requests: Vec<RequestRow>,
    plans: Vec<PlanRecord>,
    telemetry: Vec<crate::store::TelemetrySample>,
}

fn load_trace(path: &Path) -> Result<(Vec<TraceRecord>, f64)> {
    let f = std::fs::File::open(path)
        .with_context(|| format!("workload.trace: cannot open {}", path.display()))?;
    let mut v = Vec::new();
    for r in TraceReader::new(std::io::BufReader::new(f), ReaderOptions::default()) {
        v.push(r.with_context(|| format!("workload.trace {}", path.display()))?);
    }
    if v.len() < 2 {
        bail!(
            "workload.trace {}: needs at least two requests",
            path.display()
        );
    }
    let span = (v.last().unwrap().timestamp_ms - v[0].timestamp_ms) / 1000.0;
    let native = if span > 0.0 {
        (v.len() - 1) as f64 / span
    } else {
        1.0
    };
    Ok((v, native))
}

/// Everything a step needs besides the run plan.
struct Ctx<'a> {
    spec: &'a Spec,
    engine_spec: String,
    knobs: crate::engine::KnobOverrides,
    /// Real engines the local backend started for the whole study.
    pool: Option<&'a super::engines::EnginePool>,
    /// The slurm backend's job: a step it did not survive is an error, not a result.
    slurm_job: Option<&'a crate::fleet::slurm::SlurmJob>,
}

/// A step's inputs: the trace (model time, starting at 0), its block size, the control loop's
/// warm start (generated workloads) and every key's expected rate (for fairness deciles).
pub struct StepInputs {
    pub block: u32,
    pub records: Box<dyn Iterator<Item = TraceRecord>>,
    pub warm: Option<WarmStart>,
    pub key_rates: HashMap<u64, f64>,
}

/// The inputs of a step of a generated workload: `duration_s` seconds at `qps` with `seed`, the
/// generator's expected rates as the control loop's warm start and as the keys' rates.
pub fn generated_inputs(wl: &Workload, qps: f64, duration_s: f64, seed: u64) -> Result<StepInputs> {
    let key_rates: HashMap<u64, f64> = wl
        .expected_rates(qps, seed)
        .into_iter()
        .filter(|r| r.rate > 0.0)
        .map(|r| (crate::key_hash(&r.key), r.rate))
        .collect();
    Ok(StepInputs {
        block: wl.config().prefix.block_size,
        records: Box::new(wl.generate(qps, duration_s, seed)?),
        warm: Some(warm_start(wl, qps, seed)?),
        key_rates,
    })
}

fn step_inputs(spec: &Spec, seed: u64, src: &Source, qps: f64) -> Result<StepInputs> {
    let duration = spec.warmup_s + spec.measure_s;
    Ok(match src {
        Source::Generated(wl) => generated_inputs(wl, qps, duration, seed)?,
        Source::Trace {
            records,
            native_qps,
        } => {
            let f = native_qps / qps;
            let t0 = records[0].timestamp_ms;
            let recs: Vec<TraceRecord> = records
                .iter()
                .map(|r| TraceRecord {
                    timestamp_ms: (r.timestamp_ms - t0) * f,
                    ..r.clone()
                })
                .take_while(|r| r.timestamp_ms / 1000.0 < duration)
                .collect();
            let mut key_rates: HashMap<u64, f64> = HashMap::new();
            for r in &recs {
                *key_rates.entry(crate::key_hash(&r.key)).or_default() += 1.0 / duration;
            }
            StepInputs {
                block: spec.workload.trace_block_size.unwrap_or(512),
                records: Box::new(recs.into_iter()),
                warm: None,
                key_rates,
            }
        }
    })
}

/// One simulated ladder step: the fleet, the policy, the seed, and the window measured.
pub struct SimStep<'a> {
    pub engine: crate::engine::EngineConfig,
    pub replicas: usize,
    pub policy: &'a crate::policy::PolicySpec,
    pub seed: u64,
    pub failures: Vec<crate::engine::Failure>,
    pub warm: Option<WarmStart>,
    /// Seconds at the start left out of the metrics.
    pub warmup_s: f64,
    /// Seconds measured after the warm-up.
    pub measure_s: f64,
    /// The largest SLO bound of the study: requests still running `max(10 × it, 60 s)` after
    /// the last arrival are cut off (an overloaded step would otherwise run for ever).
    pub max_slo_s: f64,
    /// The step's target rate.
    pub qps: f64,
}

/// Simulate one step and measure its window, as every simulated study step is measured
/// (`docs/analysis.md`); the simulator's output comes back for callers that store requests or
/// plans.
pub fn simulate_step(
    step: SimStep,
    records: impl Iterator<Item = TraceRecord>,
    key_rates: &HashMap<u64, f64>,
) -> Result<(StepMetrics, SimOutput)> {
    let duration = step.warmup_s + step.measure_s;
    let cfg = SimConfig {
        destinations: step.replicas,
        engine: step.engine,
        policy: step.policy.clone(),
        seed: step.seed,
        failures: step.failures,
        horizon_s: duration + (10.0 * step.max_slo_s).max(60.0),
        warm_start: step.warm,
        seed_first_window: false,
    };
    let out: SimOutput = sim::simulate(cfg, records)?;
    let window = Window {
        from_s: step.warmup_s,
        to_s: duration,
    };
    let metrics = step_metrics(
        out.records.iter().copied(),
        key_rates,
        step.replicas,
        window,
        step.qps,
    );
    Ok((metrics, out))
}

/// Simulate one step: `warmup_s + measure_s` seconds at `qps`, seeded by the run's seed so
/// every policy sees the same trace.
fn sim_step(
    ctx: &Ctx,
    plan: &RunPlan,
    src: &Source,
    qps: f64,
    store_requests: bool,
) -> Result<Done> {
    let spec = ctx.spec;
    let max_slo = spec.slos.iter().map(|s| s.p99_s).fold(0.0, f64::max);
    let super::spec::StudyPolicy::Ours(policy) = &plan.policy else {
        bail!(
            "{}: external routers run on the local or ssh backend",
            plan.key.policy
        );
    };
    let inp = step_inputs(spec, plan.key.seed, src, qps)?;
    let engine = engine_config(&ctx.engine_spec, inp.block, &ctx.knobs)?;
    let step = SimStep {
        engine,
        replicas: plan.replicas,
        policy,
        seed: plan.key.seed,
        failures: spec.failures.clone(),
        warm: inp.warm,
        warmup_s: spec.warmup_s,
        measure_s: spec.measure_s,
        max_slo_s: max_slo,
        qps,
    };
    let (metrics, out) = simulate_step(step, inp.records, &inp.key_rates)?;
    let window = Window {
        from_s: spec.warmup_s,
        to_s: spec.warmup_s + spec.measure_s,
    };
    let requests = if store_requests {
        out.records
            .iter()
            .filter(|r| window.contains(r.scheduled_s))
            .map(RequestRow::from)
            .collect()
    } else {
        Vec::new()
    };
    let plans = out.plans.clone();
    Ok(Done {
        run_id: RunId(0),
        step: 0,
        metrics,
        requests,
        plans,
        telemetry: Vec::new(),
    })
}

/// Run one step through real HTTP on loopback.
fn local_step(ctx: &Ctx, plan: &RunPlan, src: &Source, qps: f64) -> Result<Done> {
    let inp = step_inputs(ctx.spec, plan.key.seed, src, qps)?;
    let recs: Vec<TraceRecord> = inp.records.collect();
    let warm = match (src, &inp.warm) {
        (Source::Generated(wl), Some(w)) => Some(super::local::RouterWarmStart {
            rates: wl
                .expected_rates(qps, plan.key.seed)
                .into_iter()
                .filter(|r| r.rate > 0.0)
                .collect(),
            mean_prompt_tokens: w.mean_prompt_tokens,
            mean_output_tokens: w.mean_output_tokens,
        }),
        _ => None,
    };
    let s = super::local::run_step(
        ctx.spec,
        plan,
        super::local::StepLoad {
            records: recs,
            block: inp.block,
            qps,
            key_rates: &inp.key_rates,
        },
        warm,
        ctx.pool,
    )?;
    // (The study's error then says what the job is doing and quotes its log.)
    if let Some(job) = ctx.slurm_job {
        crate::fleet::slurm::check_running(job)?;
    }
    Ok(Done {
        run_id: RunId(0),
        step: 0,
        metrics: s.metrics,
        requests: s.requests,
        plans: s.plans,
        telemetry: s.telemetry,
    })
}

/// What makes resuming `stored` with `spec` on `backend` a different study: another backend,
/// another cacheroute version, or a spec whose experiment differs (presentation fields —
/// description, notes, claims, paper numbers — may change: they change the report, not the
/// measurements). Each entry names what differs and both values.
fn resume_differences(
    stored: &crate::store::StudyHandle,
    spec: &Spec,
    backend: Backend,
) -> Vec<String> {
    let mut d = Vec::new();
    let old = stored
        .spec_conflict
        .as_deref()
        .map(|t| Spec::parse(t, "the stored spec"));
    // Studies from before the backend was stored ran on their spec's backend.
    let stored_backend = stored.backend.clone().or_else(|| match &old {
        Some(Ok(o)) => Some(o.backend.name().to_owned()),
        _ => Some(spec.backend.name().to_owned()),
    });
    if let Some(b) = stored_backend.filter(|b| b != backend.name()) {
        d.push(format!(
            "backend: begun on `{b}`, now `{}` (pass --backend {b})",
            backend.name()
        ));
    }
    if stored.software_version != crate::store::SOFTWARE_VERSION {
        d.push(format!(
            "cacheroute version: begun with {}, this is {}",
            stored.software_version,
            crate::store::SOFTWARE_VERSION
        ));
    }
    match old {
        None => {}
        Some(Err(e)) => d.push(format!("spec: the stored one does not parse ({e})")),
        Some(Ok(o)) => {
            let fields = spec_fields_differing(&o.experiment(), &spec.experiment());
            if !fields.is_empty() {
                d.push(format!(
                    "spec: a different spec than the study was begun with ({} changed)",
                    fields.join(", ")
                ));
            }
        }
    }
    d
}

/// Top-level fields of two specs that differ (as serialized).
fn spec_fields_differing(a: &Spec, b: &Spec) -> Vec<String> {
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) =
        (serde_json::to_value(a), serde_json::to_value(b))
    else {
        return vec!["the whole spec".into()];
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("`{k}`"))
        .collect()
}

/// Run a study. `spec_text` is stored verbatim as the study's snapshot.
pub fn run(spec: &Spec, spec_text: &str, opts: &RunOptions) -> Result<Outcome> {
    let backend = opts.backend.unwrap_or(spec.backend);
    let original = spec;
    let mut spec = spec.clone();
    // The ssh and slurm backends: provision the fleet once for the whole study, run every
    // step through the local router against it, and tear it down on every way out (the
    // guard's drop).
    let _fleet_guard = match backend {
        Backend::Ssh | Backend::Slurm => Some(provision_fleet(&mut spec, backend, opts)?),
        Backend::Sim | Backend::Local => None,
    };
    limit_seeds(&mut spec, opts.seeds)?;
    if backend == Backend::Sim {
        if let Some((i, e)) = spec
            .policies
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.external().map(|e| (i, e)))
        {
            bail!("{}", super::spec::external_on_sim(i, e));
        }
    }
    // Everything that can fail on input fails here, before the database is touched.
    let plans = spec.expand();
    let ladder = spec.ladder.steps();
    let sources = load_sources(&spec, &plans, &opts.base_dir)?;
    let real_local_engines = check_real_local_engines(&spec, backend)?;
    let store = BlockingStore::open(&opts.db)?;
    let study = open_study(&store, original, spec_text, backend, opts)?;
    let pending = pending_tasks(&store, study.id, &spec, &plans, &ladder)?;
    let total = pending.tasks.len();
    let pool = start_pool(&spec, real_local_engines && total > 0, opts.progress)?;
    let ctx = Ctx {
        spec: &spec,
        engine_spec: spec.fleet.engine_spec(),
        knobs: spec.fleet.knobs.to_overrides(),
        pool: pool.as_ref(),
        slurm_job: match &_fleet_guard {
            Some(FleetGuard::Slurm(job)) => Some(job),
            _ => None,
        },
    };
    let progress = StudyBars::new(&spec.name, total, opts.progress);
    let limit = opts.stop_after_steps.unwrap_or(usize::MAX);
    let work = Work {
        ctx: &ctx,
        backend,
        plans: &plans,
        sources: &sources,
        store_requests: opts.store_requests,
        queue: Mutex::new(pending.tasks.into_iter()),
        stop: AtomicBool::new(limit == 0),
        failed: Mutex::new(Vec::new()),
        not_run: std::sync::atomic::AtomicUsize::new(0),
    };
    let threads = worker_threads(backend, opts.threads, total);
    let sink = Sink {
        store: &store,
        study: study.id,
        limit,
        opts,
    };
    let (stored, first_err) = run_and_store(&work, threads, &progress, &sink);
    progress.finish();
    let failed = work.failed.lock().expect("failed peers").clone();
    let not_run = work.not_run.load(Ordering::Relaxed);
    store_peer_failures(&store, study.id, &failed)?;
    // A failed step on a provisioned fleet says what the fleet was doing (slurm: the job).
    check_all_stored(opts, stored, total - not_run, first_err).map_err(|e| {
        match _fleet_guard
            .as_ref()
            .filter(|_| !opts.interrupted())
            .and_then(FleetGuard::describe)
        {
            Some(why) => e.context(why),
            None => e,
        }
    })?;
    if let Some(resolution) = spec.refine {
        // The knees between ladder steps (`refine:`), each probe a step like the others.
        let knees = StudyBars::new(&format!("{} knees", spec.name), 0, opts.progress);
        let sink = Sink {
            limit: limit.saturating_sub(stored),
            ..sink
        };
        let (_, first_err) = refine_knees(
            &work,
            &store,
            &pending.run_ids,
            resolution,
            threads,
            &knees,
            &sink,
        );
        knees.finish();
        if opts.interrupted() {
            return Err(Interrupted {
                stored,
                total: total - not_run,
            }
            .into());
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if sink.limit == 0 || work.stop.load(Ordering::Relaxed) {
            bail!("stopped while locating the knees (as asked); continue with --resume");
        }
    }
    let failed_labels: Vec<&str> = failed.iter().map(|(_, _, f)| f.label.as_str()).collect();
    mark_runs_complete(
        &store,
        &pending.run_ids,
        &plans,
        ladder.len(),
        &failed_labels,
    )?;
    let (md, json, summary) =
        super::report_from_store(&store, &spec.name, &opts.out_dir, Some(original))?;
    let outcome = Outcome {
        steps_run: stored,
        steps_skipped: pending.skipped,
        report_md: md,
        report_json: json,
        summary,
    };
    if failed.is_empty() {
        Ok(outcome)
    } else {
        Err(PeersFailed {
            failures: failed.into_iter().map(|(_, _, f)| f).collect(),
            outcome,
        }
        .into())
    }
}

/// The knee phase of a study with `refine:` (after every ladder step is stored): per run, in
/// parallel over runs, for each SLO, bisect between its highest passing step and the first
/// failing one (`analysis::knee`) over the steps stored so far (ladder steps and earlier
/// probes, so a resumed study continues where it stopped). Each probe is a step at a rate
/// between two ladder steps, stored from [`PROBE_STEP_BASE`] up. Returns how many probes were
/// stored and the first error.
fn refine_knees(
    work: &Work,
    store: &BlockingStore,
    run_ids: &[RunId],
    resolution: f64,
    threads: usize,
    progress: &StudyBars,
    sink: &Sink,
) -> (usize, Option<anyhow::Error>) {
    let stored = match store.load_study(&work.ctx.spec.name) {
        Ok(s) => s,
        Err(e) => return (0, Some(e.into())),
    };
    let steps: Vec<Vec<StepRecord>> = work
        .plans
        .iter()
        .map(|p| {
            stored
                .steps
                .iter()
                .filter(|s| s.run == p.key)
                .cloned()
                .collect()
        })
        .collect();
    work.stop.store(sink.limit == 0, Ordering::Relaxed);
    let queue = Mutex::new(0..work.plans.len());
    let (tx, rx) = mpsc::channel::<Result<Done>>();
    std::thread::scope(|scope| {
        for _ in 0..threads.min(work.plans.len()).max(1) {
            let tx = tx.clone();
            let (queue, steps) = (&queue, &steps);
            scope.spawn(move || loop {
                let next = queue.lock().expect("queue").next();
                let Some(i) = next else { break };
                if work.stop.load(Ordering::Relaxed) {
                    break;
                }
                if work.peer_failed(&work.plans[i].key.policy) {
                    continue;
                }
                let r = refine_run(work, i, run_ids[i], &steps[i], resolution, &tx, progress);
                if let Err(e) = r {
                    if !work.stop.swap(true, Ordering::Relaxed) {
                        let _ = tx.send(Err(e));
                    }
                    break;
                }
            });
        }
        drop(tx);
        store_steps(rx, work, progress.overall(), sink)
    })
}

/// The knee probes of run `i` (see [`refine_knees`]), each sent to the storing loop.
fn refine_run(
    work: &Work,
    i: usize,
    run_id: RunId,
    steps: &[StepRecord],
    resolution: f64,
    tx: &mpsc::Sender<Result<Done>>,
    progress: &StudyBars,
) -> Result<()> {
    let mut measured: Vec<StepMetrics> = steps.iter().map(|s| s.metrics.clone()).collect();
    let mut index = PROBE_STEP_BASE + steps.iter().filter(|s| is_probe(s.step)).count();
    let grid = KneeGrid::for_resolution(resolution);
    for slo in &work.ctx.spec.slos {
        let cap = capacity(measured.iter(), slo);
        let next = measured
            .iter()
            .map(|m| m.offered_qps)
            .filter(|&q| q > cap.qps)
            .fold(f64::INFINITY, f64::min);
        if cap.censored != Censoring::None || !next.is_finite() {
            continue;
        }
        knee::bisect(&grid, cap.qps, next, |qps| {
            if work.stop.load(Ordering::Relaxed) {
                bail!("stopped");
            }
            progress.overall().inc_length(1);
            let t = Task {
                run_index: i,
                run_id,
                step: index,
                qps,
            };
            let d = run_task(work, &work.plans[i], &t)?;
            index += 1;
            let pass = passes(&d.metrics, slo);
            measured.push(d.metrics.clone());
            tx.send(Ok(d))
                .map_err(|_| anyhow::anyhow!("the study stopped storing steps"))?;
            Ok(pass)
        })?;
    }
    Ok(())
}

/// Keep each failed peer in the database, with the run and step it failed at.
fn store_peer_failures(
    store: &BlockingStore,
    study: crate::store::StudyId,
    failed: &[(RunId, usize, super::external::PeerFailed)],
) -> Result<()> {
    let rows: Vec<_> = failed
        .iter()
        .map(|(run, step, f)| crate::store::TelemetrySample {
            run: Some(*run),
            step: Some(*step),
            ..f.sample()
        })
        .collect();
    if !rows.is_empty() {
        store.insert_telemetry(study, &rows)?;
    }
    Ok(())
}

/// Whether the spec sweeps the replica count.
fn sweeps_replicas(spec: &Spec) -> bool {
    spec.sweeps
        .iter()
        .any(|s| s.param == super::spec::SweepParam::Replicas)
}

/// Provision the spec's fleet (ssh: on the inventory's hosts; slurm: as a job) and point the
/// spec's local settings at it; the guard tears the fleet down.
fn provision_fleet(spec: &mut Spec, backend: Backend, opts: &RunOptions) -> Result<FleetGuard> {
    if sweeps_replicas(spec) {
        bail!(
            "sweeps: the {} backend provisions one fleet per study; sweep `replicas` in simulation only",
            backend.name()
        );
    }
    let mut local = spec.local.clone().unwrap_or_default();
    let (guard, urls) = if backend == Backend::Slurm {
        let s = spec
            .fleet
            .slurm
            .clone()
            .context(super::spec::SLURM_NEEDED)?;
        let name = s.job_name_for(&spec.name);
        let dir = s.dir_for(&name, &opts.base_dir);
        let (job, reps) = crate::fleet::slurm::up(
            &spec.launch(),
            &s,
            &name,
            &dir,
            std::time::Duration::from_secs(s.ready_timeout_s),
            opts.interrupt,
        )?;
        local.agents = crate::fleet::slurm::agent_commands(&job, &reps);
        let urls = reps.iter().map(|r| r.url.clone()).collect();
        (FleetGuard::Slurm(job), urls)
    } else {
        let inv_path = resolve(
            &opts.base_dir,
            spec.fleet
                .inventory
                .as_deref()
                .context("fleet.inventory: the ssh backend needs an inventory")?,
        );
        let text = std::fs::read_to_string(&inv_path)
            .with_context(|| format!("reading inventory {}", inv_path.display()))?;
        let inv = crate::fleet::inventory::Inventory::parse(&text, &inv_path.display().to_string())
            .map_err(anyhow::Error::msg)?;
        let reps =
            crate::fleet::provision::up(&inv, &spec.launch(), std::time::Duration::from_secs(900))?;
        local.agent_hosts = Some(inv.clone());
        let urls = reps.iter().map(|r| r.url.clone()).collect();
        (FleetGuard::Ssh(inv), urls)
    };
    local.time_scale = crate::bounds::TimeScale::REAL;
    local.engine_urls = urls;
    spec.local = Some(local);
    Ok(guard)
}

/// Keep only the first `seeds` seeds of the spec (`--seeds`).
fn limit_seeds(spec: &mut Spec, seeds: Option<usize>) -> Result<()> {
    if let Some(n) = seeds {
        if n == 0 {
            bail!("--seeds must be ≥ 1");
        }
        spec.seeds = super::spec::Seeds::List(spec.seeds.list().into_iter().take(n).collect());
    }
    Ok(())
}

/// Each run's workload: the spec's trace, or its generator (loaded once per distinct one).
fn load_sources(spec: &Spec, plans: &[RunPlan], base_dir: &Path) -> Result<Vec<Arc<Source>>> {
    let mut sources: Vec<Arc<Source>> = Vec::with_capacity(plans.len());
    let mut cache: HashMap<String, Arc<Source>> = HashMap::new();
    let trace = match &spec.workload.trace {
        Some(p) => {
            let (v, native) = load_trace(&resolve(base_dir, p))?;
            Some(Arc::new(Source::Trace {
                records: Arc::new(v),
                native_qps: native,
            }))
        }
        None => None,
    };
    for p in plans {
        let src = match (&trace, &p.generator) {
            (Some(t), _) => t.clone(),
            (None, Some(g)) => {
                let g = g.relative_to(base_dir);
                let k = yaml_serde::to_string(&g).unwrap_or_default();
                match cache.get(&k) {
                    Some(s) => s.clone(),
                    None => {
                        let wl =
                            Workload::load(&g).with_context(|| "workload.generator".to_string())?;
                        let s = Arc::new(Source::Generated(Box::new(wl)));
                        cache.insert(k, s.clone());
                        s
                    }
                }
            }
            (None, None) => bail!("workload: give `generator` or `trace`"),
        };
        sources.push(src);
    }
    Ok(sources)
}

/// Whether the study runs on real local engines (local backend, no emulators, no given
/// URLs); if so, check they can be started (before the database is touched).
fn check_real_local_engines(spec: &Spec, backend: Backend) -> Result<bool> {
    let real_local_engines = backend == Backend::Local
        && spec.fleet.engine != super::spec::EngineKind::Emulator
        && spec.local.as_ref().is_none_or(|l| l.engine_urls.is_empty());
    if real_local_engines {
        if sweeps_replicas(spec) {
            bail!("sweeps: real local engines are started once per study; sweep `replicas` with emulators or in simulation");
        }
        super::engines::EnginePool::preflight(
            &spec.fleet,
            &spec.local.clone().unwrap_or_default(),
        )?;
    }
    Ok(real_local_engines)
}

/// Create the study in the store, or (with `--resume`) get it back, provided it was begun
/// exactly as it is asked for now.
fn open_study(
    store: &BlockingStore,
    spec: &Spec,
    spec_text: &str,
    backend: Backend,
    opts: &RunOptions,
) -> Result<crate::store::StudyHandle> {
    let study = store.create_or_get_study(&spec.name, spec_text, backend.name())?;
    if !study.created && !opts.resume {
        bail!(
            "study `{}` already has results in {}; pass --resume to continue it, or --db another file",
            spec.name,
            opts.db.display()
        );
    }
    if !study.created {
        let differences = resume_differences(&study, spec, backend);
        if !differences.is_empty() {
            bail!(
                "study `{}` in {} cannot be resumed as asked: {}; resume it exactly as it was begun, or use another --db or study name",
                spec.name,
                opts.db.display(),
                differences.join("; ")
            );
        }
    }
    Ok(study)
}

/// The steps a study has still to run.
struct Pending {
    tasks: Vec<Task>,
    /// Every run's id, by plan.
    run_ids: Vec<RunId>,
    /// Steps already stored.
    skipped: usize,
}

/// Create or get every run of `plans` and list its steps not yet stored.
fn pending_tasks(
    store: &BlockingStore,
    study: crate::store::StudyId,
    spec: &Spec,
    plans: &[RunPlan],
    ladder: &[f64],
) -> Result<Pending> {
    let mut tasks: Vec<Task> = Vec::new();
    let mut run_ids = Vec::with_capacity(plans.len());
    let mut skipped = 0;
    for (i, p) in plans.iter().enumerate() {
        let config = serde_json::json!({
            "policy": p.policy,
            "replicas": p.replicas,
            "sweep": p.key.sweep,
            "engine": spec.fleet.engine_spec(),
        })
        .to_string();
        let h = store.create_or_get_run(study, &p.key, &config)?;
        run_ids.push(h.id);
        let done = store.completed_steps(h.id)?;
        for (s, &qps) in ladder.iter().enumerate() {
            if done.contains(&s) {
                skipped += 1;
            } else {
                tasks.push(Task {
                    run_index: i,
                    run_id: h.id,
                    step: s,
                    qps,
                });
            }
        }
    }
    Ok(Pending {
        tasks,
        run_ids,
        skipped,
    })
}

/// The local backend with real engines: start them once for the study (stopped when the
/// pool drops, on every way out); each step starts from cold caches.
fn start_pool(
    spec: &Spec,
    wanted: bool,
    progress: bool,
) -> Result<Option<super::engines::EnginePool>> {
    if !wanted {
        return Ok(None);
    }
    if progress {
        eprintln!(
            "starting {} local {:?} replica(s) (about 30-60 s)",
            spec.fleet.replicas, spec.fleet.engine
        );
    }
    Ok(Some(super::engines::EnginePool::start(
        &spec.fleet,
        &spec.local.clone().unwrap_or_default(),
        spec.launch().scale_out,
    )?))
}

/// How many steps run at once. Live steps run one at a time: parallel fleets on two cores
/// would distort latency.
fn worker_threads(backend: Backend, threads: usize, total: usize) -> usize {
    if backend != Backend::Sim {
        1
    } else if threads > 0 {
        threads
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    }
    .min(total.max(1))
}

/// What the worker threads share: the study's steps, the queue of tasks, and the stop flag.
struct Work<'a> {
    ctx: &'a Ctx<'a>,
    backend: Backend,
    plans: &'a [RunPlan],
    sources: &'a [Arc<Source>],
    store_requests: bool,
    queue: Mutex<std::vec::IntoIter<Task>>,
    /// Set to start no further step.
    stop: AtomicBool,
    /// External routers that failed (run, step, why): the rest of their policy's steps are
    /// skipped while the other policies carry on.
    failed: Mutex<Vec<(RunId, usize, super::external::PeerFailed)>>,
    /// Steps not run because their external router failed (the failed ones included).
    not_run: std::sync::atomic::AtomicUsize,
}

impl Work<'_> {
    /// Whether policy `label`'s external router has failed in this study.
    fn peer_failed(&self, label: &str) -> bool {
        self.failed
            .lock()
            .expect("failed peers")
            .iter()
            .any(|(_, _, f)| f.label == label)
    }
}

/// Where finished steps go: the study in the store, at most `limit` of them.
struct Sink<'a> {
    store: &'a BlockingStore,
    study: crate::store::StudyId,
    limit: usize,
    opts: &'a RunOptions,
}

impl RunOptions {
    /// Whether the study was interrupted through [`RunOptions::interrupt`].
    fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|i| i.load(Ordering::Relaxed))
    }
}

/// Run the tasks on `threads` worker threads and store each finished step as it arrives;
/// returns how many were stored and the first error.
fn run_and_store(
    work: &Work,
    threads: usize,
    progress: &StudyBars,
    sink: &Sink,
) -> (usize, Option<anyhow::Error>) {
    let (tx, rx) = mpsc::channel::<Result<Done>>();
    std::thread::scope(|scope| {
        for w in 0..threads {
            let tx = tx.clone();
            let bar = progress.worker_bar(w);
            scope.spawn(move || worker(work, bar, tx));
        }
        drop(tx);
        store_steps(rx, work, progress.overall(), sink)
    })
}

/// A worker thread: run tasks from the queue until it is empty or the study stops, sending
/// each result.
fn worker(work: &Work, bar: indicatif::ProgressBar, tx: mpsc::Sender<Result<Done>>) {
    loop {
        if work.stop.load(Ordering::Relaxed) {
            break;
        }
        let next = work.queue.lock().expect("queue").next();
        let Some(t) = next else { break };
        let p = &work.plans[t.run_index];
        if work.peer_failed(&p.key.policy) {
            work.not_run.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        bar.set_message(format!(
            "{} seed {}{} step {} @ {} req/s",
            p.key.policy,
            p.key.seed,
            if p.key.sweep.is_empty() {
                String::new()
            } else {
                format!(" [{}]", p.key.sweep)
            },
            t.step,
            t.qps
        ));
        let r = run_task(work, p, &t);
        if let Some(f) = r
            .as_ref()
            .err()
            .and_then(|e| e.downcast_ref::<super::external::PeerFailed>())
        {
            bar.println(format!("error: {f}; its other steps are skipped"));
            work.not_run.fetch_add(1, Ordering::Relaxed);
            work.failed
                .lock()
                .expect("failed peers")
                .push((t.run_id, t.step, f.clone()));
            continue;
        }
        if r.is_err() {
            // No further step after a failed one (the main thread stops too).
            work.stop.store(true, Ordering::Relaxed);
        }
        if tx.send(r).is_err() {
            break;
        }
    }
}

/// Run task `t` of plan `p` on the study's backend.
fn run_task(work: &Work, p: &RunPlan, t: &Task) -> Result<Done> {
    let src = &work.sources[t.run_index];
    match work.backend {
        Backend::Local | Backend::Ssh | Backend::Slurm => local_step(work.ctx, p, src, t.qps),
        Backend::Sim => sim_step(work.ctx, p, src, t.qps, work.store_requests),
    }
    .map(|d| Done {
        run_id: t.run_id,
        step: t.step,
        ..d
    })
    .with_context(|| {
        format!(
            "{} seed {} step {} ({} req/s)",
            p.key.policy, p.key.seed, t.step, t.qps
        )
    })
}

/// The storing loop: store each finished step (up to the limit) until the workers are done,
/// stopping them on an interrupt, an error or the limit. Returns how many steps were stored
/// and the first error.
fn store_steps(
    rx: mpsc::Receiver<Result<Done>>,
    work: &Work,
    overall: &indicatif::ProgressBar,
    sink: &Sink,
) -> (usize, Option<anyhow::Error>) {
    let stop = &work.stop;
    let mut stored = 0usize;
    let mut first_err: Option<anyhow::Error> = None;
    loop {
        let r = match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if sink.opts.interrupted() {
                    stop.store(true, Ordering::Relaxed);
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if sink.opts.interrupted() {
            // A step that ended after the interrupt is not stored: its engines may have
            // got the same Ctrl-C.
            stop.store(true, Ordering::Relaxed);
            continue;
        }
        match r {
            Ok(d) => {
                if stored >= sink.limit {
                    continue;
                }
                if let Err(e) = store_step(sink, d) {
                    first_err.get_or_insert(e.into());
                    stop.store(true, Ordering::Relaxed);
                }
                stored += 1;
                overall.inc(1);
                if stored >= sink.limit {
                    stop.store(true, Ordering::Relaxed);
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
                stop.store(true, Ordering::Relaxed);
            }
        }
    }
    (stored, first_err)
}

/// Store one finished step and its telemetry.
fn store_step(sink: &Sink, d: Done) -> crate::store::Result<()> {
    let mut tel = d.telemetry;
    for t in tel.iter_mut() {
        t.run = Some(d.run_id);
        t.step = Some(d.step);
    }
    sink.store
        .record_step(d.run_id, d.step, &d.metrics, &d.requests, &d.plans)
        .and_then(|_| {
            if tel.is_empty() {
                Ok(())
            } else {
                sink.store.insert_telemetry(sink.study, &tel)
            }
        })
}

/// Fail unless all `total` steps were stored: the study was interrupted, a step failed, or
/// it stopped after `stop_after_steps`.
fn check_all_stored(
    opts: &RunOptions,
    stored: usize,
    total: usize,
    first_err: Option<anyhow::Error>,
) -> Result<()> {
    if opts.interrupted() {
        return Err(Interrupted { stored, total }.into());
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if stored < total {
        bail!("stopped after {stored} of {total} steps (as asked); continue with --resume");
    }
    Ok(())
}

/// Mark every run complete, checking it has all `steps` steps.
fn mark_runs_complete(
    store: &BlockingStore,
    run_ids: &[RunId],
    plans: &[RunPlan],
    steps: usize,
    failed_peers: &[&str],
) -> Result<()> {
    for (i, id) in run_ids.iter().enumerate() {
        if failed_peers.contains(&plans[i].key.policy.as_str()) {
            continue;
        }
        let done = store.completed_steps(*id)?;
        if done.iter().filter(|s| !is_probe(**s)).count() == steps {
            store.mark_run_complete(*id)?;
        } else {
            bail!(
                "run {:?} is missing steps after the study finished",
                plans[i].key
            );
        }
    }
    Ok(())
}
