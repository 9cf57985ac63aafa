//! Opening a study in the store, and resuming one: a study begun before is continued only
//! with `--resume` and only as it was begun (same backend, cacheroute version and experiment),
//! and only its steps not yet stored are run.

use super::pool::Task;
use super::spec::{Backend, RunPlan, Spec};
use crate::store::{BlockingStore, RunId};
use anyhow::{bail, Result};
use std::path::Path;

/// Create the study in the store, or (with `--resume`) get it back, provided it was begun
/// exactly as it is asked for now.
pub(super) fn open_study(
    store: &BlockingStore,
    spec: &Spec,
    spec_text: &str,
    backend: Backend,
    resume: bool,
    db: &Path,
) -> Result<crate::store::StudyHandle> {
    let study = store.create_or_get_study(&spec.name, spec_text, backend.name())?;
    if !study.created && !resume {
        bail!(
            "study `{}` already has results in {}; pass --resume to continue it, or --db another file",
            spec.name,
            db.display()
        );
    }
    if !study.created {
        let differences = resume_differences(&study, spec, backend);
        if !differences.is_empty() {
            bail!(
                "study `{}` in {} cannot be resumed as asked: {}; resume it exactly as it was begun, or use another --db or study name",
                spec.name,
                db.display(),
                differences.join("; ")
            );
        }
    }
    Ok(study)
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

/// The steps a study has still to run.
pub(super) struct Pending {
    pub(super) tasks: Vec<Task>,
    /// Every run's id, by plan.
    pub(super) run_ids: Vec<RunId>,
    /// Steps already stored.
    pub(super) skipped: usize,
}

/// Create or get every run of `plans` and list its steps not yet stored.
pub(super) fn pending_tasks(
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
                    // A fixed ladder knows nothing of a step's neighbours: every SLO.
                    cut_for: if spec.cuts_steps() {
                        spec.slos.clone()
                    } else {
                        Vec::new()
                    },
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
