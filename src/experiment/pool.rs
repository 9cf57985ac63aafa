//! The worker pool of a study: its steps run on worker threads (on the simulator backend one
//! per core by default; live steps one at a time), and a single storing loop owns the
//! database, storing each finished step as it arrives and stopping the workers on an
//! interrupt, an error or the step limit. An external router that fails skips the rest of its
//! policy's steps while the other policies carry on.

use super::inputs::Source;
use super::spec::{Backend, RunPlan};
use super::step::{local_step, sim_step, Ctx, Done};
use crate::progress::StudyBars;
use crate::store::{BlockingStore, RunId};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

/// A step to run: ladder step (or knee probe) `step` of plan `run_index`, stored as run
/// `run_id`, at `qps`.
pub(super) struct Task {
    pub(super) run_index: usize,
    pub(super) run_id: RunId,
    pub(super) step: usize,
    pub(super) qps: f64,
    /// End the step once certain to fail these SLOs (`analysis::early`); empty: run it whole.
    pub(super) cut_for: Vec<crate::analysis::model::Slo>,
}

/// What the worker threads share: the study's steps, the queue of tasks, and the stop flag.
pub(super) struct Work<'a> {
    pub(super) ctx: &'a Ctx<'a>,
    pub(super) backend: Backend,
    pub(super) plans: &'a [RunPlan],
    pub(super) sources: &'a [Arc<Source>],
    pub(super) store_requests: bool,
    pub(super) queue: Mutex<std::vec::IntoIter<Task>>,
    /// Set to start no further step.
    pub(super) stop: AtomicBool,
    /// External routers that failed (run, step, why): the rest of their policy's steps are
    /// skipped while the other policies carry on.
    pub(super) failed: Mutex<Vec<(RunId, usize, super::external::PeerFailed)>>,
    /// Steps not run because their external router failed (the failed ones included).
    pub(super) not_run: std::sync::atomic::AtomicUsize,
}

impl Work<'_> {
    /// If `e` is an external router's failure, note it (run, step) so the rest of its
    /// policy's steps are skipped, and say so; any other error: false.
    pub(super) fn note_peer_failure(&self, run: RunId, step: usize, e: &anyhow::Error) -> bool {
        let Some(f) = e.downcast_ref::<super::external::PeerFailed>() else {
            return false;
        };
        self.not_run.fetch_add(1, Ordering::Relaxed);
        self.failed
            .lock()
            .expect("failed peers")
            .push((run, step, f.clone()));
        true
    }

    /// Whether policy `label`'s external router has failed in this study.
    pub(super) fn peer_failed(&self, label: &str) -> bool {
        self.failed
            .lock()
            .expect("failed peers")
            .iter()
            .any(|(_, _, f)| f.label == label)
    }
}

/// Where finished steps go: the study in the store, at most `limit` of them.
pub(super) struct Sink<'a> {
    pub(super) store: &'a BlockingStore,
    pub(super) study: crate::store::StudyId,
    pub(super) limit: usize,
    /// Set to stop the study (its options' `interrupt`).
    pub(super) interrupt: Option<&'static AtomicBool>,
}

impl Sink<'_> {
    /// Whether the study was interrupted.
    fn interrupted(&self) -> bool {
        interrupted(self.interrupt)
    }
}

/// Whether an interrupt flag (Ctrl-C's) is set; no flag: never.
pub(super) fn interrupted(flag: Option<&AtomicBool>) -> bool {
    flag.is_some_and(|i| i.load(Ordering::Relaxed))
}

/// How many steps run at once. Live steps run one at a time: parallel fleets on two cores
/// would distort latency.
pub(super) fn worker_threads(backend: Backend, threads: usize, total: usize) -> usize {
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

/// Run the tasks on `threads` worker threads and store each finished step as it arrives;
/// returns how many were stored and the first error.
pub(super) fn run_and_store(
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
            "{} step {} @ {} req/s",
            run_label(p),
            t.step,
            t.qps
        ));
        let r = run_task(work, p, &t);
        if let Err(e) = &r {
            if work.note_peer_failure(t.run_id, t.step, e) {
                bar.println(format!("error: {e:#}; its other steps are skipped"));
                continue;
            }
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

/// A run as progress lines name it: `policy seed N [sweep]`.
pub(super) fn run_label(p: &RunPlan) -> String {
    if p.key.sweep.is_empty() {
        format!("{} seed {}", p.key.policy, p.key.seed)
    } else {
        format!("{} seed {} [{}]", p.key.policy, p.key.seed, p.key.sweep)
    }
}

/// Run task `t` of plan `p` on the study's backend.
pub(super) fn run_task(work: &Work, p: &RunPlan, t: &Task) -> Result<Done> {
    let src = &work.sources[t.run_index];
    match work.backend {
        Backend::Local | Backend::Ssh | Backend::Slurm => {
            local_step(work.ctx, p, src, t.qps, &t.cut_for)
        }
        Backend::Sim => sim_step(work.ctx, p, src, t.qps, work.store_requests, &t.cut_for),
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
pub(super) fn store_steps(
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
                if sink.interrupted() {
                    stop.store(true, Ordering::Relaxed);
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if sink.interrupted() {
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
