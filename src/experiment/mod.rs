//! Studies: experiment specs ([`spec`]) and the runner ([`runner`]) that executes them on a
//! backend, stores every step and writes the report; [`report_from_store`] regenerates a
//! report from the database alone.

pub mod advise;
pub mod engines;
pub mod external;
pub mod local;
pub mod runner;
pub mod spec;

use crate::report::StudyData;
use crate::store::{BlockingStore, StoredStudy};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Report data for a stored study: the spec snapshot stored with it gives SLOs, ladder,
/// policies, notes and claims; the steps and plans come from the database.
pub fn study_data(stored: &StoredStudy) -> Result<StudyData> {
    study_data_with(stored, None)
}

/// [`study_data`], with the presentation fields (description, notes, claims, paper numbers)
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
                    "the spec file differs from the one study `{}` was run with in more than description, notes, claims and paper numbers",
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
    let peers = external::peer_report(store, &stored)?;
    let failed = |l: &String| peers.failed.contains(l);
    data.policies.retain(|p| !failed(p));
    data.baselines.retain(|p| !failed(p));
    data.steps.retain(|s| !failed(&s.run.policy));
    data.notes.extend(peers.note);
    if let Some(t) = telemetry_note(store, &stored)? {
        data.notes.push(t);
    }
    let paths = crate::report::render(&data, out_dir)
        .with_context(|| format!("writing the report of `{name}`"))?;
    Ok((
        paths.markdown,
        paths.json,
        crate::report::terminal_summary(&data),
    ))
}

/// A markdown table of what the engines and GPUs reported, per arm (live backends only):
/// served hit from the engines' own prefix-cache counters, mean GPU utilisation, and energy per
/// request from the GPUs' cumulative energy counters.
fn telemetry_note(store: &BlockingStore, stored: &StoredStudy) -> Result<Option<String>> {
    use std::collections::BTreeMap;
    let all = store.load_telemetry(stored.id, None)?;
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
    #[derive(Default)]
    struct Acc {
        hits: f64,
        queries: f64,
        util: (f64, u64),
        energy: f64,
        requests: u64,
        /// Injected failures: (replica, model time), per step.
        kills: Vec<(String, usize, f64)>,
        /// Replicas of an SSH fleet lost: (replica, step, whether already at the step's start).
        lost: Vec<(String, usize, bool)>,
        /// Live sessions, summed over steps: turns sent, late, sessions and turns abandoned;
        /// and the later turns' hit per step.
        sessions: Option<[f64; 4]>,
        later_hit: Vec<f64>,
    }
    let mut by_arm: BTreeMap<String, Acc> = BTreeMap::new();
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
        match CacheDelta::of_metric(&t.metric) {
            Some(CacheDelta::HitTokens) => a.hits += t.value,
            Some(CacheDelta::QueryTokens) => a.queries += t.value,
            None => {}
        }
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
    let mut t = String::from("Engine and GPU telemetry (live backends): served hit from the engines' own prefix-cache counters (vLLM `prefix_cache_*`, SGLang `cached_tokens`/`prompt_tokens`) over whole steps; GPU utilisation and energy from `cacheroute agent` where it ran.\n\n| policy | engine-counter served hit | mean GPU utilisation | energy per request |\n| --- | --- | --- | --- |\n");
    for (arm, a) in &by_arm {
        let hit = if a.queries > 0.0 {
            format!("{:.1}%", 100.0 * a.hits / a.queries)
        } else {
            "—".into()
        };
        let util = if a.util.1 > 0 {
            format!("{:.0}%", a.util.0 / a.util.1 as f64)
        } else {
            "—".into()
        };
        let energy = if a.requests > 0 && a.energy > 0.0 {
            format!("{:.1} J", a.energy / a.requests as f64)
        } else {
            "—".into()
        };
        t.push_str(&format!("| {arm} | {hit} | {util} | {energy} |\n"));
    }
    let kills: Vec<String> = by_arm
        .iter()
        .flat_map(|(arm, a)| {
            a.kills.iter().map(move |(replica, step, at)| {
                format!("{arm}: replica {replica} killed at {at:.0} s of step {step}")
            })
        })
        .collect();
    let sessions: Vec<String> = by_arm
        .iter()
        .filter_map(|(arm, a)| {
            let [sent, late, sessions, turns] = a.sessions?;
            let hit = if a.later_hit.is_empty() {
                String::new()
            } else {
                format!(
                    "; later turns' hit {:.1}% (answers' `cached_tokens`)",
                    100.0 * a.later_hit.iter().sum::<f64>() / a.later_hit.len() as f64
                )
            };
            Some(format!(
                "{arm}: {sent:.0} turns sent, {late:.0} late, {sessions:.0} sessions abandoned ({turns:.0} turns){hit}"
            ))
        })
        .collect();
    if !sessions.is_empty() {
        t.push_str(&format!(
            "\nLive sessions (each turn after the previous answer, carrying it; docs/replayer.md), over whole steps: {}.\n",
            sessions.join("; ")
        ));
    }
    if !kills.is_empty() {
        t.push_str(&format!(
            "\nInjected failures (the router failed over; requests in flight on the replica are counted as errors): {}.\n",
            kills.join("; ")
        ));
    }
    let lost: Vec<String> = by_arm
        .iter()
        .flat_map(|(arm, a)| {
            a.lost.iter().map(move |(replica, step, at_start)| {
                if *at_start {
                    format!("{arm}: replica {replica} unreachable for all of step {step}")
                } else {
                    format!("{arm}: replica {replica} lost during step {step}")
                }
            })
        })
        .collect();
    if !lost.is_empty() {
        t.push_str(&format!(
            "\nLost replicas (stopped answering; the router excluded them, requests in flight on them are counted as errors): {}.\n",
            lost.join("; ")
        ));
    }
    Ok(Some(t))
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
