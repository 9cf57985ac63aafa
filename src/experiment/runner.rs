//! The study runner: policies × seeds × sweep points × ladder steps on a backend, every step
//! stored atomically in SQLite as it completes, then the report. A killed study resumes with
//! `--resume` after its last completed step; since each simulated step is a deterministic
//! function of (spec, run, step), a resumed study reports exactly what an uninterrupted one
//! does.
//!
//! This file orchestrates a study ([`run`]): its options, the order of its phases, the checks
//! at its end and what it produced. The phases live beside it: the fleet provisioned for the
//! study (`provision`), the study opened or resumed with its steps not yet stored (`resume`),
//! each run's workload (`inputs`), one step on a backend (`step`), the worker pool that runs
//! the steps and stores each as it completes (`pool`), and the knee phase (`refine`).

use super::inputs::load_sources;
use super::pool::{run_and_store, worker_threads, Sink, Work};
use super::provision::{check_real_local_engines, provision_fleet, start_pool, FleetGuard};
use super::refine::refine_knees;
use super::resume::{open_study, pending_tasks};
use super::search;
use super::spec::{Backend, RunPlan, Search, Spec};
use super::step::Ctx;
use crate::analysis::knee::is_probe;
use crate::progress::StudyBars;
use crate::store::{BlockingStore, RunId};
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

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

impl RunOptions {
    /// Whether the study was interrupted through [`RunOptions::interrupt`].
    fn interrupted(&self) -> bool {
        super::pool::interrupted(self.interrupt)
    }
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

/// What a finished study produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub steps_run: usize,
    pub steps_skipped: usize,
    pub report_md: PathBuf,
    pub report_json: PathBuf,
    pub summary: String,
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
        Backend::Ssh | Backend::Slurm => Some(provision_fleet(
            &mut spec,
            backend,
            &opts.base_dir,
            opts.interrupt,
        )?),
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
    let study = open_study(&store, original, spec_text, backend, opts.resume, &opts.db)?;
    let mut pending = pending_tasks(&store, study.id, &spec, &plans, &ladder)?;
    let knee_search = spec.search == Search::Knee;
    if knee_search {
        // Which ladder steps a run measures is found as it goes (`search`); what is stored
        // already, probes included, is skipped.
        pending.tasks.clear();
        pending.skipped = 0;
        for id in &pending.run_ids {
            pending.skipped += store.completed_steps(*id)?.len();
        }
    }
    let total = pending.tasks.len();
    let pool = start_pool(
        &spec,
        real_local_engines && (total > 0 || knee_search),
        opts.progress,
    )?;
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
    let threads = worker_threads(
        backend,
        opts.threads,
        if knee_search { plans.len() } else { total },
    );
    let sink = Sink {
        store: &store,
        study: study.id,
        limit,
        interrupt: opts.interrupt,
    };
    let starts = if knee_search {
        search::starts(&work, &store, study.id, &pending.run_ids, &ladder, threads)?
    } else {
        Vec::new()
    };
    let (stored, first_err) = if knee_search {
        search::search_knees(
            &work,
            &store,
            &pending.run_ids,
            &starts,
            &ladder,
            threads,
            &progress,
            &sink,
        )
    } else {
        run_and_store(&work, threads, &progress, &sink)
    };
    progress.finish();
    let failed = work.failed.lock().expect("failed peers").clone();
    let not_run = work.not_run.load(Ordering::Relaxed);
    store_peer_failures(&store, study.id, &failed)?;
    // A failed step on a provisioned fleet says what the fleet was doing (slurm: the job).
    check_all_stored(
        opts,
        stored,
        if knee_search {
            stored
        } else {
            total.saturating_sub(not_run)
        },
        first_err,
    )
    .map_err(|e| {
        match _fleet_guard
            .as_ref()
            .filter(|_| !opts.interrupted())
            .and_then(FleetGuard::describe)
        {
            Some(why) => e.context(why),
            None => e,
        }
    })?;
    if knee_search && (stored >= limit || work.stop.load(Ordering::Relaxed)) {
        bail!("stopped after {stored} steps (as asked); continue with --resume");
    }
    if let (Some(resolution), false) = (spec.refine, knee_search) {
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
                total: total.saturating_sub(not_run),
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
    let complete = Completion {
        study: &spec.name,
        ladder_len: ladder.len(),
        starts: knee_search.then_some(starts.as_slice()),
        slos: &spec.slos,
    };
    mark_runs_complete(&store, &pending.run_ids, &plans, &complete, &failed_labels)?;
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

/// What a complete run has: every ladder step, or (a knee search, with each run's start) the
/// steps its search needed.
struct Completion<'a> {
    study: &'a str,
    ladder_len: usize,
    starts: Option<&'a [usize]>,
    slos: &'a [crate::analysis::model::Slo],
}

/// Mark every run complete, checking it has the steps it needs.
fn mark_runs_complete(
    store: &BlockingStore,
    run_ids: &[RunId],
    plans: &[RunPlan],
    complete: &Completion,
    failed_peers: &[&str],
) -> Result<()> {
    let stored = match complete.starts {
        Some(_) => Some(store.load_study(complete.study)?.steps),
        None => None,
    };
    for (i, id) in run_ids.iter().enumerate() {
        if failed_peers.contains(&plans[i].key.policy.as_str()) {
            continue;
        }
        let whole = match (complete.starts, &stored) {
            (Some(starts), Some(steps)) => {
                let mine: Vec<_> = steps
                    .iter()
                    .filter(|s| s.run == plans[i].key)
                    .cloned()
                    .collect();
                search::search_done(&mine, complete.slos, complete.ladder_len, starts[i])
            }
            _ => {
                let done = store.completed_steps(*id)?;
                done.iter().filter(|s| !is_probe(**s)).count() == complete.ladder_len
            }
        };
        if whole {
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
