//! Studies: experiment specs ([`spec`]) and the runner ([`runner`]) that executes them on a
//! backend, stores every step and writes the report; [`report_from_store`] regenerates a
//! report from the database alone.

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
            spec.backend,
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
    let data = study_data_with(&stored, presentation)?;
    let paths = crate::report::render(&data, out_dir)
        .with_context(|| format!("writing the report of `{name}`"))?;
    Ok((paths.markdown, paths.json, terminal_summary(&data)))
}

/// A compact per-SLO table for the terminal.
pub fn terminal_summary(data: &StudyData) -> String {
    let s = crate::report::analyse(data);
    let mut out = String::new();
    for (i, slo) in data.slos.iter().enumerate() {
        out.push_str(&format!("SLO {}:\n", slo.label()));
        out.push_str(&format!(
            "  {:<34} {:>18} {:>10} {:>10}\n",
            "policy", "capacity (req/s)", "served hit", "imbalance"
        ));
        for arm in &s.arms {
            let c = &arm.capacity_qps[i];
            out.push_str(&format!(
                "  {:<34} {:>9.1} ± {:<6.1} {:>9.1}% {:>10.2}\n",
                arm.label,
                c.mean,
                c.sd,
                100.0 * arm.served_kv_hit.mean,
                arm.imbalance.requests.mean
            ));
        }
    }
    out
}
