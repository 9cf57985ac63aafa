//! The knee phase of a study with `refine:`: once every ladder step is stored, each run's
//! capacity for each SLO is located by bisection between two ladder steps, each probe a step
//! run and stored through the worker pool's storing loop.

use super::pool::{run_task, store_steps, Sink, Task, Work};
use super::step::Done;
use crate::analysis::capacity::{capacity, decides, passes};
use crate::analysis::knee::{self, is_probe, KneeGrid, PROBE_STEP_BASE};
use crate::analysis::model::{Censoring, StepMetrics, StepRecord};
use crate::progress::StudyBars;
use crate::store::{BlockingStore, RunId};
use anyhow::{bail, Result};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Mutex};

/// The knee phase of a study with `refine:` (after every ladder step is stored): per run, in
/// parallel over runs, for each SLO, bisect between its highest passing step and the first
/// failing one (`analysis::knee`) over the steps stored so far (ladder steps and earlier
/// probes, so a resumed study continues where it stopped). Each probe is a step at a rate
/// between two ladder steps, stored from [`PROBE_STEP_BASE`] up. Returns how many probes were
/// stored and the first error.
pub(super) fn refine_knees(
    work: &Work,
    store: &BlockingStore,
    run_ids: &[RunId],
    resolution: f64,
    threads: usize,
    progress: &StudyBars,
    sink: &Sink,
) -> (usize, Option<anyhow::Error>) {
    per_run(work, store, threads, progress, sink, |i, steps, tx| {
        refine_run(work, i, run_ids[i], steps, resolution, tx, progress)
    })
}

/// A phase that runs each run's steps in turn (each depending on the last), in parallel over
/// runs: `run(i, its stored steps, the storing loop's sender)` for every run whose external
/// router has not failed; each step sent is stored by [`store_steps`]. An external router
/// that fails skips its runs (`Work::failed`); any other error stops the phase. Returns how
/// many steps were stored and the first error.
pub(super) fn per_run(
    work: &Work,
    store: &BlockingStore,
    threads: usize,
    progress: &StudyBars,
    sink: &Sink,
    run: impl Fn(usize, &[StepRecord], &mpsc::Sender<Result<Done>>) -> Result<()> + Sync,
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
            let (queue, steps, run) = (&queue, &steps, &run);
            scope.spawn(move || loop {
                let next = queue.lock().expect("queue").next();
                let Some(i) = next else { break };
                if work.stop.load(Ordering::Relaxed) {
                    break;
                }
                if work.peer_failed(&work.plans[i].key.policy) {
                    continue;
                }
                if let Err(e) = run(i, &steps[i], &tx) {
                    if e.downcast_ref::<super::external::PeerFailed>().is_some() {
                        continue;
                    }
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

/// The SLOs a step at `qps` is cut for (`analysis::early`), given the run's steps so far:
/// those its verdict can still inform, when the spec cuts steps; none otherwise.
pub(super) fn cut_for(
    spec: &super::spec::Spec,
    measured: &[StepMetrics],
    qps: f64,
) -> Vec<crate::analysis::model::Slo> {
    if spec.cuts_steps() {
        knee::undecided_slos(measured.iter(), &spec.slos, qps)
    } else {
        Vec::new()
    }
}

/// The knee probes of run `i` (see [`refine_knees`]), each sent to the storing loop.
pub(super) fn refine_run(
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
        // The first failure above the capacity: the lowest rate above it among the steps
        // that decide this SLO (a step cut for another SLO does not).
        let next = measured
            .iter()
            .filter(|m| decides(m, slo))
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
                cut_for: cut_for(work.ctx.spec, &measured, qps),
            };
            let d = run_task(work, &work.plans[i], &t).inspect_err(|e| {
                work.note_peer_failure(run_id, t.step, e);
            })?;
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
