//! Study reports: `reports/<study>.md` (markdown tables), `reports/<study>.json`
//! (machine-readable summary) and SVG plots under `reports/<study>/` (plotters, SVG only), plus
//! [`compare`] for two studies side by side (fp8 against fp16 first).
//!
//! Input is plain data ([`StudyData`]); every number comes from [`crate::analysis`] (pure),
//! this module only formats and writes. Output is deterministic: the same data gives byte-
//! identical files (no timestamps unless passed in `StudyData::generated`), and every file is
//! written atomically (temporary file in the same directory, then rename). Layout and rules:
//! `docs/analysis.md`.

pub mod advise;
mod markdown;
pub mod plots;
mod telemetry;
mod terminal;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::analysis::model::{PlanEvent, Slo, SloMetric, StepRecord};
use crate::analysis::study::{summarize_study, ArmSummary, StudySummary};

pub use markdown::compare;
pub(crate) use markdown::{capacity_cell, censor_cell, num, ratio_stats_cell, table};
pub use telemetry::{
    telemetry_note, ArmTelemetry, DestHit, KvEventCounts, PREDICTION_TOLERANCE_PT,
};
pub use terminal::terminal_summary;

/// Everything a report is made from. Plain data; the runner fills it from the store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StudyData {
    /// Study name; the report files are `<name>.md`, `<name>.json`, `<name>/*.svg`.
    pub name: String,
    pub description: String,
    pub slos: Vec<Slo>,
    /// Offered rates of the ladder, ascending.
    pub ladder_qps: Vec<f64>,
    /// Policies (report labels) in spec order.
    pub policies: Vec<String>,
    /// Policies the others are compared against (the appendix's pairwise ratios).
    pub baselines: Vec<String>,
    /// The policy each capacity table gives every other policy's ratio to (default: the first
    /// of `policies`).
    #[serde(default)]
    pub reference: Option<String>,
    pub steps: Vec<StepRecord>,
    #[serde(default)]
    pub plans: Vec<PlanEvent>,
    /// Free-text paragraphs printed under "Notes".
    #[serde(default)]
    pub notes: Vec<String>,
    /// Rows of the claim-to-evidence table.
    #[serde(default)]
    pub claims: Vec<Claim>,
    /// Published numbers to print beside ours.
    #[serde(default)]
    pub paper: Vec<PaperRef>,
    /// Optional provenance line (e.g. backend, git commit, date) printed verbatim; the report
    /// itself never reads a clock.
    #[serde(default)]
    pub generated: Option<String>,
    /// Replica-seconds of simulated model time a knee search spent predicting its starts.
    #[serde(default)]
    pub prediction_fleet_s: f64,
}

/// One row of the claim-to-evidence table (the paper's Appendix Table 7).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    pub claim: String,
    /// Free-text evidence (experiment, hardware or simulation); the report appends the runs
    /// and seeds of `policies` found in the study.
    #[serde(default)]
    pub evidence: String,
    /// Policy labels (arm labels) whose runs back the claim.
    #[serde(default)]
    pub policies: Vec<String>,
    pub caveat: String,
}

/// A published number for one policy, printed beside the study's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PaperRef {
    /// Arm label in this study.
    pub policy: String,
    /// Served KV hit as a fraction (0.932 for 93.2%).
    #[serde(default)]
    pub served_kv_hit: Option<f64>,
    /// SLO capacity (QPS) at `slo`.
    #[serde(default)]
    pub capacity_qps: Option<f64>,
    /// The SLO the capacity refers to (matched to the study's SLO with the same metric and
    /// bound).
    #[serde(default)]
    pub slo: Option<Slo>,
    /// Where the number comes from (e.g. "Table 2").
    #[serde(default)]
    pub source: String,
}

/// Where a report went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportPaths {
    pub markdown: PathBuf,
    pub json: PathBuf,
    /// The SVG plots, in the order the markdown links them.
    pub svgs: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("study name {0:?} cannot be a file name; use letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("study {0:?} has no SLO; add at least one to `slos`")]
    NoSlo(String),
    #[error("writing {path}: {source}; check that the directory is writable")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("plotting {path}: {msg}")]
    Plot { path: PathBuf, msg: String },
    #[error("encoding the JSON summary: {0}")]
    Json(#[from] serde_json::Error),
}

/// The analysis of a study's data.
pub fn analyse(study: &StudyData) -> StudySummary {
    summarize_study(
        &study.slos,
        &study.policies,
        &study.baselines,
        &study.steps,
        &study.plans,
    )
}

/// SLO metrics that get a p99 plot: each metric some SLO bounds, e2e when none.
fn plot_metrics(slos: &[Slo]) -> Vec<SloMetric> {
    let mut m: Vec<SloMetric> = Vec::new();
    for x in [SloMetric::E2e, SloMetric::Ttft] {
        if slos.iter().any(|s| s.metric == x) {
            m.push(x);
        }
    }
    if m.is_empty() {
        m.push(SloMetric::E2e);
    }
    m
}

fn metric_name(m: SloMetric) -> &'static str {
    match m {
        SloMetric::E2e => "e2e",
        SloMetric::Ttft => "ttft",
    }
}

/// Plot file names (relative to `reports/<study>/`), in link order, with what each shows.
pub(crate) fn plot_files(slos: &[Slo]) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for (i, s) in slos.iter().enumerate() {
        v.push((
            format!("capacity-slo{}.svg", i + 1),
            format!("SLO capacity per policy, {}", s.label()),
        ));
    }
    for m in plot_metrics(slos) {
        v.push((
            format!("p99-{}.svg", metric_name(m)),
            format!("{} p99 against offered QPS", metric_name(m)),
        ));
    }
    v.push(("served-hit.svg".into(), "served KV hit per policy".into()));
    v.push((
        "imbalance.svg".into(),
        "request imbalance against offered QPS".into(),
    ));
    v
}

/// What the self-calibration section shows interval by interval, one per tuned policy: the
/// plans (repairs left out) of its first seed's middle ladder step.
pub(crate) struct TuningTrace<'a> {
    pub label: &'a str,
    pub seed: u64,
    pub qps: f64,
    pub plans: Vec<&'a PlanEvent>,
}

/// The tuned policies' traces, in the order their first tuned plan appears.
pub(crate) fn tuning_traces(study: &StudyData) -> Vec<TuningTrace<'_>> {
    let mut labels: Vec<&str> = Vec::new();
    for p in study.plans.iter().filter(|p| p.plan.tuning.is_some()) {
        if !labels.contains(&p.run.policy.as_str()) {
            labels.push(&p.run.policy);
        }
    }
    let mut out = Vec::new();
    for label in labels {
        let Some(first) = study.plans.iter().find(|p| p.run.policy == label) else {
            continue;
        };
        let mut steps: Vec<usize> = study
            .plans
            .iter()
            .filter(|p| p.run == first.run)
            .map(|p| p.step)
            .collect();
        steps.dedup();
        let step = steps[steps.len() / 2];
        out.push(TuningTrace {
            label,
            seed: first.run.seed,
            qps: study.ladder_qps.get(step).copied().unwrap_or(f64::NAN),
            plans: study
                .plans
                .iter()
                .filter(|p| p.run == first.run && p.step == step && !p.plan.repair)
                .collect(),
        });
    }
    out
}

/// File name of the self-calibration plot (written only when some plan was tuned).
pub(crate) const TUNING_PLOT: &str = "self-calibration.svg";

/// Whether `n` can name a study: it becomes a file name (`<name>.md`) and a directory.
pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n != "."
        && n != ".."
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Write `bytes` to `path` atomically (temporary sibling, then rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    let io = |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// The machine-readable summary (`reports/<study>.json`).
#[derive(Debug, Clone, Serialize)]
pub struct ReportJson<'a> {
    pub study: &'a str,
    pub description: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generated: Option<&'a str>,
    pub slos: Vec<SloJson>,
    pub ladder_qps: &'a [f64],
    pub baselines: &'a [String],
    /// How pass/fail, capacity, censoring and ratios are defined (human-readable).
    pub rules: Rules,
    pub policies: Vec<PolicyJson<'a>>,
    pub paper: &'a [PaperRef],
    pub claims: &'a [Claim],
    /// What the study cost its fleet (`fleet_seconds`: replica-seconds of model time).
    pub cost: crate::analysis::cost::StudyCost,
}

#[derive(Debug, Clone, Serialize)]
pub struct SloJson {
    pub metric: SloMetric,
    pub p99_s: f64,
    pub label: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Rules {
    pub pass: &'static str,
    pub capacity: &'static str,
    pub ratio: &'static str,
    pub missing: &'static str,
}

pub const RULES: Rules = Rules {
    pass: "a step passes when p99 <= SLO, errors <= 1% of requests and achieved rate >= 95% of offered",
    capacity: "highest offered rate such that it and every lower step pass; left-censored (qps 0) when the first step fails, right-censored (qps = last step) when all pass; mean/sd/ci95 include censored values as they are, so they are bounds when `censored` is not `none`",
    ratio: "per seed, policy capacity / baseline capacity on the same seed; undefined (excluded from mean/sd/ci95, counted in `undefined`) when the baseline is left-censored; ratios from any other censored capacity are kept and counted in `censored` (bounds, not estimates); Student-t 95% interval over defined ratios; n = 1 gives sd 0 and ci95 = [value, value]",
    missing: "null marks a value that is undefined (no data, or NaN)",
};

/// One policy (arm) in the JSON: the analysis plus `p99_s` by offered rate.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyJson<'a> {
    #[serde(flatten)]
    pub arm: &'a ArmSummary,
    /// Mean over seeds of the p99 at each offered rate.
    pub p99_s: Vec<P99Point>,
}

#[derive(Debug, Clone, Serialize)]
pub struct P99Point {
    pub offered_qps: f64,
    pub e2e: f64,
    pub ttft: f64,
}

/// The JSON summary document of a study.
pub fn json_summary<'a>(study: &'a StudyData, s: &'a StudySummary) -> ReportJson<'a> {
    ReportJson {
        study: &study.name,
        description: &study.description,
        generated: study.generated.as_deref(),
        slos: study
            .slos
            .iter()
            .map(|x| SloJson {
                metric: x.metric,
                p99_s: x.p99_s,
                label: x.label(),
            })
            .collect(),
        ladder_qps: &study.ladder_qps,
        baselines: &study.baselines,
        rules: RULES,
        policies: s
            .arms
            .iter()
            .map(|arm| PolicyJson {
                arm,
                p99_s: arm
                    .steps
                    .iter()
                    .map(|st| P99Point {
                        offered_qps: st.offered_qps,
                        e2e: st.e2e_p99_s.mean,
                        ttft: st.ttft_p99_s.mean,
                    })
                    .collect(),
            })
            .collect(),
        paper: &study.paper,
        claims: &study.claims,
        cost: crate::analysis::cost::study_cost(&study.steps, study.prediction_fleet_s),
    }
}

/// Render a study into `out_dir` (usually `reports/`): `<name>.md`, `<name>.json` and
/// `<name>/*.svg`. Deterministic and atomic per file.
pub fn render(study: &StudyData, out_dir: &Path) -> Result<ReportPaths, ReportError> {
    if !valid_name(&study.name) {
        return Err(ReportError::BadName(study.name.clone()));
    }
    if study.slos.is_empty() {
        return Err(ReportError::NoSlo(study.name.clone()));
    }
    let s = analyse(study);
    let plot_dir = out_dir.join(&study.name);
    let mut svgs = Vec::new();
    for (file, _) in plot_files(&study.slos) {
        let path = plot_dir.join(&file);
        let svg = if let Some(i) = file
            .strip_prefix("capacity-slo")
            .and_then(|r| r.strip_suffix(".svg"))
            .and_then(|r| r.parse::<usize>().ok())
        {
            plots::capacity(
                &s,
                i - 1,
                &format!(
                    "SLO capacity, {} (mean, 95% CI, seeds)",
                    study.slos[i - 1].label()
                ),
                study.ladder_qps.first().copied().unwrap_or(0.0),
            )
        } else if file == "p99-e2e.svg" {
            plots::p99(&s, SloMetric::E2e, &study.slos)
        } else if file == "p99-ttft.svg" {
            plots::p99(&s, SloMetric::Ttft, &study.slos)
        } else if file == "served-hit.svg" {
            plots::served_hit(&s)
        } else {
            plots::imbalance(&s)
        }
        .map_err(|msg| ReportError::Plot {
            path: path.clone(),
            msg,
        })?;
        write_atomic(&path, svg.as_bytes())?;
        svgs.push(path);
    }
    let traces = tuning_traces(study);
    if !traces.is_empty() {
        let path = plot_dir.join(TUNING_PLOT);
        let svg = plots::tuning(&traces).map_err(|msg| ReportError::Plot {
            path: path.clone(),
            msg,
        })?;
        write_atomic(&path, svg.as_bytes())?;
        svgs.push(path);
    }
    let md = markdown::study_markdown(study, &s);
    let markdown = out_dir.join(format!("{}.md", study.name));
    write_atomic(&markdown, md.as_bytes())?;
    let mut json = serde_json::to_string_pretty(&json_summary(study, &s))?;
    json.push('\n');
    let json_path = out_dir.join(format!("{}.json", study.name));
    write_atomic(&json_path, json.as_bytes())?;
    Ok(ReportPaths {
        markdown,
        json: json_path,
        svgs,
    })
}
