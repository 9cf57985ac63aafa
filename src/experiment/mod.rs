//! Studies: experiment specs ([`spec`]) and the runner ([`runner`]) that executes them on a
//! backend, stores every step and writes the report; [`report_from_store`] regenerates a
//! report from the database alone. The runner's phases: the fleet provisioned for a study
//! (`provision`), the study opened or resumed (`resume`), each run's workload ([`inputs`]),
//! one step on a backend ([`step`]), the worker pool that runs and stores the steps (`pool`)
//! and the knee phase (`refine`).

pub mod advise;
pub mod child;
pub mod engines;
pub mod external;
pub mod front;
pub mod inputs;
pub mod kv_events;
pub mod local;
mod pool;
mod provision;
mod refine;
mod resume;
pub mod routers;
pub mod runner;
mod search;
pub mod spec;
pub mod step;

use crate::report::{ArmTelemetry, StudyData};
use crate::store::{BlockingStore, StoredStudy};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Report data for a stored study: the spec snapshot stored with it gives SLOs, ladder,
/// policies, notes and claims; the steps and plans come from the database.
pub fn study_data(stored: &StoredStudy) -> Result<StudyData> {
    study_data_with(stored, None)
}

/// [`study_data`], with the presentation fields (description, notes, claims, paper numbers,
/// reference)
/// taken from `presentation` when given — a spec file whose experiment is the stored one.
pub fn study_data_with(
    stored: &StoredStudy,
    presentation: Option<&spec::Spec>,
) -> Result<StudyData> {
    let stored_spec = spec::Spec::parse(
        &stored.spec,
        &format!("the spec stored with study `{}`", stored.name),
    )
    .map_err(anyhow::Error::msg)?;
    let spec = match presentation {
        Some(p) => {
            if p.experiment() != stored_spec.experiment() {
                anyhow::bail!(
                    "the spec file differs from the one study `{}` was run with in more than description, notes, claims, paper numbers and reference",
                    stored.name
                );
            }
            p.clone()
        }
        None => stored_spec,
    };
    let mut policies: Vec<String> = Vec::new();
    for p in &spec.policies {
        let l = spec.resolved_policy(p).label();
        if !policies.contains(&l) {
            policies.push(l);
        }
    }
    Ok(StudyData {
        name: stored.name.clone(),
        description: spec.description.trim().to_string(),
        slos: spec.slos.clone(),
        ladder_qps: spec.ladder.steps(),
        policies,
        baselines: spec.baseline_labels(),
        reference: spec.reference_label(),
        steps: stored.steps.clone(),
        plans: stored.plans.clone(),
        notes: spec
            .notes
            .split("\n\n")
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        claims: spec.claims.clone(),
        paper: spec.paper.clone(),
        generated: Some(format!(
            "backend {:?}, cacheroute {}, {} runs",
            stored
                .backend
                .as_deref()
                .and_then(spec::Backend::from_name)
                .unwrap_or(spec.backend),
            stored.software_version,
            stored.runs.len()
        )),
        prediction_fleet_s: 0.0,
    })
}

/// Regenerate `<out_dir>/<study>.md|.json` (+ plots) from the database; returns the paths and
/// a short text summary for the terminal.
pub fn report_from_store(
    store: &BlockingStore,
    name: &str,
    out_dir: &Path,
    presentation: Option<&spec::Spec>,
) -> Result<(PathBuf, PathBuf, String)> {
    let stored = store.load_study(name)?;
    let mut data = study_data_with(&stored, presentation)?;
    data.prediction_fleet_s = store
        .load_telemetry(stored.id, Some(search::PREDICTION_FLEET_S))?
        .iter()
        .filter(|t| t.source == search::SOURCE)
        .map(|t| t.value)
        .sum();
    let peers = external::peer_report(store, &stored)?;
    let failed = |l: &String| peers.failed.contains(l);
    data.policies.retain(|p| !failed(p));
    data.baselines.retain(|p| !failed(p));
    data.steps.retain(|s| !failed(&s.run.policy));
    data.notes.extend(peers.note);
    if let Some(t) = telemetry_note(store, &stored)? {
        data.notes.push(t);
    }
    data.notes.extend(routers::router_report(store, &stored)?);
    let paths = crate::report::render(&data, out_dir)
        .with_context(|| format!("writing the report of `{name}`"))?;
    Ok((
        paths.markdown,
        paths.json,
        crate::report::terminal_summary(&data),
    ))
}

/// The telemetry note of a stored study (`report::telemetry_note`), or None when nothing was
/// recorded (simulated studies).
fn telemetry_note(store: &BlockingStore, stored: &StoredStudy) -> Result<Option<String>> {
    Ok(arm_telemetry(store, stored)?.map(|by_arm| crate::report::telemetry_note(&by_arm)))
}

/// What the engines and GPUs reported, summed per arm (live backends only; None when the study
/// has no telemetry): engine prefix-cache counters, GPU utilisation and energy, injected
/// failures, lost replicas and live sessions.
fn arm_telemetry(
    store: &BlockingStore,
    stored: &StoredStudy,
) -> Result<Option<std::collections::BTreeMap<String, ArmTelemetry>>> {
    use std::collections::BTreeMap;
    let mut all = store.load_telemetry(stored.id, None)?;
    // The knee search's own records are no engine's telemetry.
    all.retain(|t| t.source != search::SOURCE);
    if all.is_empty() {
        return Ok(None);
    }
    let run_key: std::collections::HashMap<i64, (String, String)> = stored
        .runs
        .iter()
        .map(|r| (r.id.0, (r.key.policy.clone(), r.key.sweep.clone())))
        .collect();
    let mut steps_req: std::collections::HashMap<(i64, usize), u64> =
        std::collections::HashMap::new();
    for s in &stored.steps {
        if let Some(r) = stored.runs.iter().find(|r| r.key == s.run) {
            steps_req.insert((r.id.0, s.step), s.metrics.requests);
        }
    }
    let mut by_arm: BTreeMap<String, ArmTelemetry> = BTreeMap::new();
    let mut energy_span: std::collections::HashMap<(i64, usize, String), (f64, f64)> =
        std::collections::HashMap::new();
    for t in &all {
        let (Some(run), Some(step)) = (t.run, t.step) else {
            continue;
        };
        let Some((policy, sweep)) = run_key.get(&run.0) else {
            continue;
        };
        let arm = crate::analysis::study::arm_label(policy, sweep);
        let a = by_arm.entry(arm).or_default();
        use crate::telemetry::engine_api::CacheDelta;
        let engine = t
            .source
            .strip_prefix("engine:")
            .and_then(|d| d.parse::<usize>().ok());
        match CacheDelta::of_metric(&t.metric) {
            Some(CacheDelta::HitTokens) => {
                a.hits += t.value;
                if let Some(d) = engine {
                    a.per_dest.entry(d).or_default().hits += t.value;
                }
            }
            Some(CacheDelta::QueryTokens) => {
                a.queries += t.value;
                if let Some(d) = engine {
                    a.per_dest.entry(d).or_default().queries += t.value;
                }
            }
            None => {}
        }
        kv_events::add_router_sample(a, t);
        match t.metric.as_str() {
            "gpu_util_pct" => {
                a.util.0 += t.value;
                a.util.1 += 1;
            }
            m if local::SESSION_METRICS[..4].contains(&m) => {
                let i = local::SESSION_METRICS
                    .iter()
                    .position(|x| *x == m)
                    .unwrap_or(0);
                a.sessions.get_or_insert([0.0; 4])[i] += t.value;
            }
            m if m == local::SESSION_METRICS[4] => a.later_hit.push(t.value),
            local::REPLICA_KILLED => a.kills.push((
                t.source.trim_start_matches("engine:").to_string(),
                step,
                t.at_s,
            )),
            local::REPLICA_LOST => a.lost.push((
                t.source.trim_start_matches("engine:").to_string(),
                step,
                t.at_s == 0.0,
            )),
            "gpu_energy_j" => {
                let e = energy_span
                    .entry((run.0, step, t.source.clone()))
                    .or_insert((f64::INFINITY, f64::NEG_INFINITY));
                e.0 = e.0.min(t.value);
                e.1 = e.1.max(t.value);
            }
            _ => {}
        }
    }
    for ((run, step, _), (lo, hi)) in &energy_span {
        if let Some((policy, sweep)) = run_key.get(run) {
            let a = by_arm
                .entry(crate::analysis::study::arm_label(policy, sweep))
                .or_default();
            a.energy += (hi - lo).max(0.0);
            let _ = step;
        }
    }
    for ((run, step), n) in &steps_req {
        if energy_span.keys().any(|(r, s, _)| r == run && s == step) {
            if let Some((policy, sweep)) = run_key.get(run) {
                by_arm
                    .entry(crate::analysis::study::arm_label(policy, sweep))
                    .or_default()
                    .requests += n;
            }
        }
    }
    Ok(Some(by_arm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::model::RunKey;
    use crate::store::TelemetrySample;

    /// Engine-counter deltas stored under the engine-neutral names, and under the
    /// `vllm:prefix_cache_*` names databases written before them used, give the same served hit.
    #[test]
    fn engine_counter_hit_reads_new_and_legacy_delta_names() {
        use crate::telemetry::engine_api as api;
        let dir = tempfile::tempdir().unwrap();
        let store = BlockingStore::open(dir.path().join("r.db")).unwrap();
        let study = store.create_or_get_study("s", "name: s\n", "ssh").unwrap();
        let mut rows = Vec::new();
        for (policy, hit, query) in [
            (
                "new",
                api::CACHE_HIT_TOKENS_DELTA,
                api::CACHE_QUERY_TOKENS_DELTA,
            ),
            ("old", api::LEGACY_HIT_DELTA, api::LEGACY_QUERY_DELTA),
        ] {
            let key = RunKey {
                policy: policy.into(),
                seed: 1,
                sweep: String::new(),
            };
            let run = store.create_or_get_run(study.id, &key, "{}").unwrap();
            for (metric, value) in [(hit, 750.0), (query, 1000.0)] {
                rows.push(TelemetrySample {
                    run: Some(run.id),
                    step: Some(0),
                    source: "engine:0".into(),
                    metric: metric.into(),
                    labels: Vec::new(),
                    value,
                    at_s: 10.0,
                });
            }
        }
        store.insert_telemetry(study.id, &rows).unwrap();
        let stored = store.load_study("s").unwrap();
        let note = telemetry_note(&store, &stored).unwrap().unwrap();
        assert!(note.contains("| new | 75.0% |"), "{note}");
        assert!(note.contains("| old | 75.0% |"), "{note}");
        assert_eq!(local::engine_served_hit(&rows[2..]), Some(0.75));
    }
}
