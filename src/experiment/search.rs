//! The knee search of a study with `search: knee` (docs/studies.md): each run measures only
//! the ladder steps around its knee, from a start predicted off the fleet, then bisects to the
//! spec's `refine`, each step stored through the worker pool's storing loop like any other.
//!
//! Where each run starts, in order of preference:
//! 1. the knee of a stored study of the same experiment (another study in the database whose
//!    spec differs only in name, seeds, `search`, `early_verdict` or `refine`): per policy and
//!    sweep point, the median over its seeds of the ladder step at or below its lowest
//!    capacity over the SLOs;
//! 2. for our policies, the simulator's prediction on this fleet and workload: a bisection of
//!    the ladder (first seed, the spec's warm-up, a third of its window, at least 30 s; steps
//!    cut once certain to fail) for the highest step passing every SLO;
//! 3. for an external router (which the simulator cannot run), the median of the simulated
//!    policies' starts at the same sweep point, else the ladder's middle.
//!
//! Each run's start is stored (telemetry `search/start_step`, with the prediction's cost), so a
//! resumed study continues from the same one; after its first step a run's next step depends
//! only on the steps it has stored (`analysis::knee::next_ladder_step`).

use super::pool::{run_task, Sink, Task, Work};
use super::refine::refine_run;
use super::spec::{RunPlan, Search, Spec, StudyPolicy};
use super::step::{sim_step, Ctx, Done};
use crate::analysis::capacity::{capacity, passes};
use crate::analysis::knee::{is_probe, next_ladder_step};
use crate::analysis::model::{Censoring, StepMetrics, StepRecord};
use crate::progress::StudyBars;
use crate::store::{BlockingStore, RunId, StudyId, TelemetrySample};
use anyhow::{bail, Result};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Mutex};

/// Telemetry source of the search's own records.
pub const SOURCE: &str = "search";
/// A run's starting ladder index.
pub const START_STEP: &str = "start_step";
/// Replica-seconds of simulated model time spent predicting a run's start (0 when it came
/// from a stored study); stored on the first run of each policy and sweep point.
pub const PREDICTION_FLEET_S: &str = "prediction_fleet_s";

/// Where a run's start came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StartFrom {
    Stored,
    Simulated,
    Peers,
}

impl StartFrom {
    fn label(self) -> &'static str {
        match self {
            StartFrom::Stored => "stored study",
            StartFrom::Simulated => "simulated",
            StartFrom::Peers => "median of the simulated policies",
        }
    }
}

/// Each run's start (ladder index), from the store when a resumed study has them, else
/// predicted and stored.
pub(super) fn starts(
    work: &Work,
    store: &BlockingStore,
    study: StudyId,
    run_ids: &[RunId],
    ladder: &[f64],
    threads: usize,
) -> Result<Vec<usize>> {
    let stored: BTreeMap<i64, usize> = store
        .load_telemetry(study, Some(START_STEP))?
        .into_iter()
        .filter(|t| t.source == SOURCE)
        .filter_map(|t| Some((t.run?.0, t.value as usize)))
        .collect();
    if run_ids.iter().all(|r| stored.contains_key(&r.0)) {
        return Ok(run_ids.iter().map(|r| stored[&r.0]).collect());
    }
    let spec = work.ctx.spec;
    let from_store = stored_knees(store, spec, ladder)?;
    // One prediction per policy and sweep point, on the first seed.
    let mut groups: Vec<(String, String)> = Vec::new();
    for p in work.plans {
        let g = (p.key.policy.clone(), p.key.sweep.clone());
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let simulate: Vec<usize> = groups
        .iter()
        .filter(|g| !from_store.contains_key(*g))
        .filter_map(|g| {
            work.plans
                .iter()
                .position(|p| p.key.policy == g.0 && p.key.sweep == g.1)
                .filter(|&i| matches!(work.plans[i].policy, StudyPolicy::Ours(_)))
        })
        .collect();
    let predicted = predict(work, &simulate, ladder, threads)?;
    let mut by_group: BTreeMap<(String, String), (usize, StartFrom, f64)> = BTreeMap::new();
    for g in &groups {
        if let Some(&k) = from_store.get(g) {
            by_group.insert(g.clone(), (k, StartFrom::Stored, 0.0));
        }
    }
    for (i, k, fleet_s) in &predicted {
        let p = &work.plans[*i];
        by_group.insert(
            (p.key.policy.clone(), p.key.sweep.clone()),
            (*k, StartFrom::Simulated, *fleet_s),
        );
    }
    for g in &groups {
        if by_group.contains_key(g) {
            continue;
        }
        let mut same_point: Vec<usize> = by_group
            .iter()
            .filter(|(k, v)| k.1 == g.1 && v.1 == StartFrom::Simulated)
            .map(|(_, v)| v.0)
            .collect();
        same_point.sort_unstable();
        let k = same_point
            .get(same_point.len().saturating_sub(1) / 2)
            .copied()
            .unwrap_or(ladder.len() / 2);
        by_group.insert(g.clone(), (k, StartFrom::Peers, 0.0));
    }
    let mut rows = Vec::new();
    let mut out = Vec::with_capacity(run_ids.len());
    let mut costed: Vec<(String, String)> = Vec::new();
    for (p, run) in work.plans.iter().zip(run_ids) {
        let g = (p.key.policy.clone(), p.key.sweep.clone());
        let (k, from, fleet_s) = by_group[&g];
        let k = stored.get(&run.0).copied().unwrap_or(k);
        out.push(k);
        if stored.contains_key(&run.0) {
            continue;
        }
        let labels = vec![("from".to_string(), from.label().to_string())];
        rows.push(TelemetrySample {
            run: Some(*run),
            step: None,
            source: SOURCE.into(),
            metric: START_STEP.into(),
            labels: labels.clone(),
            value: k as f64,
            at_s: 0.0,
        });
        if !costed.contains(&g) {
            costed.push(g);
            rows.push(TelemetrySample {
                run: Some(*run),
                step: None,
                source: SOURCE.into(),
                metric: PREDICTION_FLEET_S.into(),
                labels,
                value: fleet_s,
                at_s: 0.0,
            });
        }
        tracing::info!(
            "{}: knee search starts at {} req/s ({})",
            super::pool::run_label(p),
            ladder[k],
            from.label()
        );
    }
    store.insert_telemetry(study, &rows)?;
    Ok(out)
}

/// The spec with what a knee does not depend on cleared: two studies whose experiments are
/// equal after this measure the same knees.
fn knee_experiment(spec: &Spec) -> Spec {
    Spec {
        name: String::new(),
        search: Search::Ladder,
        early_verdict: None,
        refine: None,
        seeds: super::spec::Seeds::Count(1),
        ..spec.experiment()
    }
}

/// Per policy and sweep point, the starting index from another stored study of the same
/// experiment (see the module docs), when one exists.
fn stored_knees(
    store: &BlockingStore,
    spec: &Spec,
    ladder: &[f64],
) -> Result<BTreeMap<(String, String), usize>> {
    let want = knee_experiment(spec);
    let mut out = BTreeMap::new();
    for s in store.list_studies()? {
        if s.name == spec.name {
            continue;
        }
        let stored = store.load_study(&s.name)?;
        let Ok(other) = Spec::parse(&stored.spec, "a stored spec") else {
            continue;
        };
        if knee_experiment(&other) != want {
            continue;
        }
        let mut per_seed: BTreeMap<(String, String), BTreeMap<u64, Vec<&StepMetrics>>> =
            BTreeMap::new();
        for st in &stored.steps {
            per_seed
                .entry((st.run.policy.clone(), st.run.sweep.clone()))
                .or_default()
                .entry(st.run.seed)
                .or_default()
                .push(&st.metrics);
        }
        for (g, seeds) in per_seed {
            if out.contains_key(&g) {
                continue;
            }
            let mut ks: Vec<usize> = seeds
                .values()
                .map(|steps| {
                    let cap = spec
                        .slos
                        .iter()
                        .map(|slo| {
                            let c = capacity(steps.iter().copied(), slo);
                            match c.censored {
                                Censoring::Left => 0.0,
                                _ => c.qps,
                            }
                        })
                        .fold(f64::INFINITY, f64::min);
                    index_at_or_below(ladder, cap)
                })
                .collect();
            ks.sort_unstable();
            if let Some(&k) = ks.get(ks.len().saturating_sub(1) / 2) {
                out.insert(g, k);
            }
        }
    }
    Ok(out)
}

/// The highest ladder index whose rate is at most `qps` (0 when none is).
fn index_at_or_below(ladder: &[f64], qps: f64) -> usize {
    ladder
        .iter()
        .rposition(|&q| q <= qps * (1.0 + 1e-9))
        .unwrap_or(0)
}

/// The simulator's start for each plan of `plans` (see the module docs): (plan, ladder
/// index, simulated replica-seconds spent), on worker threads.
fn predict(
    work: &Work,
    plans: &[usize],
    ladder: &[f64],
    threads: usize,
) -> Result<Vec<(usize, usize, f64)>> {
    if plans.is_empty() {
        return Ok(Vec::new());
    }
    let mut spec = work.ctx.spec.clone();
    spec.measure_s = (spec.measure_s / 3.0).max(30.0).min(spec.measure_s);
    spec.search = Search::Knee;
    spec.early_verdict = Some(true);
    let ctx = Ctx {
        spec: &spec,
        engine_spec: work.ctx.engine_spec.clone(),
        knobs: work.ctx.knobs.clone(),
        pool: None,
        slurm_job: None,
    };
    let queue = Mutex::new(plans.iter().copied());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(plans.len()).max(1) {
            scope.spawn(|| loop {
                let next = queue.lock().expect("queue").next();
                let Some(i) = next else { break };
                let r = predict_one(&ctx, &work.plans[i], &work.sources[i], ladder);
                let failed = r.is_err();
                results
                    .lock()
                    .expect("results")
                    .push(r.map(|(k, f)| (i, k, f)));
                if failed {
                    break;
                }
            });
        }
    });
    let mut out = results
        .into_inner()
        .expect("results")
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    out.sort_by_key(|r| r.0);
    Ok(out)
}

/// Bisect the ladder's indices for the highest step passing every SLO, simulated.
fn predict_one(
    ctx: &Ctx,
    plan: &RunPlan,
    src: &super::inputs::Source,
    ladder: &[f64],
) -> Result<(usize, f64)> {
    let (mut lo, mut hi) = (-1i64, ladder.len() as i64);
    let mut fleet_s = 0.0;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        let d =
            sim_step(ctx, plan, src, ladder[mid as usize], false, &ctx.spec.slos).map_err(|e| {
                e.context(format!(
                    "predicting the knee of {} at {} req/s",
                    plan.key.policy, ladder[mid as usize]
                ))
            })?;
        fleet_s += d.metrics.fleet_s;
        if ctx.spec.slos.iter().all(|s| passes(&d.metrics, s)) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((lo.max(0) as usize, fleet_s))
}

/// The search phase (the ladder steps around each knee, then the bisection to `resolution`),
/// per run in parallel over runs, each step sent to the storing loop. Returns how many steps
/// were stored and the first error.
#[allow(clippy::too_many_arguments)]
pub(super) fn search_knees(
    work: &Work,
    store: &BlockingStore,
    run_ids: &[RunId],
    starts: &[usize],
    ladder: &[f64],
    threads: usize,
    progress: &StudyBars,
    sink: &Sink,
) -> (usize, Option<anyhow::Error>) {
    super::refine::per_run(work, store, threads, progress, sink, |i, steps, tx| {
        search_run(work, i, run_ids[i], steps, starts[i], ladder, tx, progress)
    })
}

/// The search of run `i`: ladder steps until `next_ladder_step` is done, then the knees'
/// bisection (`refine`).
#[allow(clippy::too_many_arguments)]
fn search_run(
    work: &Work,
    i: usize,
    run_id: RunId,
    stored: &[StepRecord],
    start: usize,
    ladder: &[f64],
    tx: &mpsc::Sender<Result<Done>>,
    progress: &StudyBars,
) -> Result<()> {
    let plan = &work.plans[i];
    let slos = &work.ctx.spec.slos;
    let mut have: Vec<StepRecord> = stored.to_vec();
    loop {
        let ladder_steps: Vec<(usize, &StepMetrics)> = have
            .iter()
            .filter(|s| !is_probe(s.step))
            .map(|s| (s.step, &s.metrics))
            .collect();
        let Some(k) = next_ladder_step(&ladder_steps, slos, ladder.len(), start) else {
            break;
        };
        if work.stop.load(Ordering::Relaxed) {
            bail!("stopped");
        }
        progress.overall().inc_length(1);
        let measured: Vec<StepMetrics> = have.iter().map(|s| s.metrics.clone()).collect();
        let t = Task {
            run_index: i,
            run_id,
            step: k,
            qps: ladder[k],
            cut_for: super::refine::cut_for(work.ctx.spec, &measured, ladder[k]),
        };
        let d = run_task(work, plan, &t).inspect_err(|e| {
            work.note_peer_failure(run_id, k, e);
        })?;
        have.push(StepRecord {
            run: plan.key.clone(),
            step: k,
            metrics: d.metrics.clone(),
        });
        tx.send(Ok(d))
            .map_err(|_| anyhow::anyhow!("the study stopped storing steps"))?;
    }
    if let Some(resolution) = work.ctx.spec.refine {
        refine_run(work, i, run_id, &have, resolution, tx, progress)?;
    }
    Ok(())
}

/// Whether run `steps` (its stored steps) has finished its search: no further ladder step to
/// measure. (Its bisection is checked the way every study's is: by running it again, which
/// probes nothing once done.)
pub(super) fn search_done(
    steps: &[StepRecord],
    slos: &[crate::analysis::model::Slo],
    ladder_len: usize,
    start: usize,
) -> bool {
    let ladder_steps: Vec<(usize, &StepMetrics)> = steps
        .iter()
        .filter(|s| !is_probe(s.step))
        .map(|s| (s.step, &s.metrics))
        .collect();
    next_ladder_step(&ladder_steps, slos, ladder_len, start).is_none()
}
