//! `cacheroute calibrate`: q_cap is the request rate at which one destination's p99 knees. Run
//! a short ladder against a single replica serving the share of the study's keys one
//! destination would hold (its active keys ÷ replicas), with Sticky routing (one destination,
//! so routing is moot), at the study's first SLO; the highest passing step is q_cap. W is
//! suggested from the replica's KV capacity and the workload's mean prompt (half the cache for
//! warm prefixes). Runs on any backend through the study runner.

use crate::experiment::runner::{self, RunOptions};
use crate::experiment::spec::{Backend, Ladder, Seeds};
use crate::policy::PolicySpec;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// The study to calibrate for (its fleet, workload and first SLO).
    #[arg(long)]
    pub experiment: PathBuf,
    /// Backend (default: the spec's).
    #[arg(long, value_enum)]
    pub backend: Option<super::study::BackendArg>,
    /// Ladder for the single replica, req/s: start,step,stop.
    #[arg(long, default_value = "1,1,12")]
    pub ladder: String,
    /// Seeds.
    #[arg(long, default_value_t = 2)]
    pub seeds: u64,
}

pub fn run(a: CalibrateArgs) -> Result<()> {
    let (mut spec, _) = super::study::load_spec(&a.experiment)?;
    let parts: Vec<f64> = a
        .ladder
        .split(',')
        .map(|x| x.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .context("--ladder: expected start,step,stop")?;
    let [start, step, stop] = parts[..] else {
        bail!("--ladder: expected start,step,stop, e.g. 1,1,12")
    };
    let r = spec.fleet.replicas.max(1);
    let gen = spec
        .workload
        .generator
        .as_mut()
        .context("calibrate needs a generated workload (workload.generator)")?;
    let active = gen.keys.active.unwrap_or(gen.keys.count);
    gen.keys.active = Some(active.div_ceil(r).max(1));
    let slo = *spec.slos.first().context("the spec has no SLO")?;
    spec.name = format!("{}-calibrate", spec.name);
    spec.fleet.replicas = 1;
    spec.policies = vec![PolicySpec::from_name("sticky")
        .map_err(anyhow::Error::msg)?
        .into()];
    spec.baselines = Some(vec![]);
    spec.ladder = Ladder::Range { start, step, stop };
    spec.seeds = Seeds::Count(a.seeds);
    spec.slos = vec![slo];
    spec.sweeps.clear();
    spec.failures.clear();
    spec.paper.clear();
    spec.claims.clear();
    spec.notes.clear();
    let problems = spec.validate();
    if !problems.is_empty() {
        bail!("calibration spec: {}", problems.join("; "));
    }
    let dir = tempfile::tempdir()?;
    let text = yaml_serde::to_string(&spec)?;
    let opts = RunOptions {
        db: dir.path().join("calibrate.db"),
        out_dir: dir.path().join("reports"),
        backend: a.backend.map(|b| match b {
            super::study::BackendArg::Sim => Backend::Sim,
            super::study::BackendArg::Local => Backend::Local,
            super::study::BackendArg::Ssh => Backend::Ssh,
        }),
        progress: false,
        base_dir: super::config_dir(&a.experiment).to_path_buf(),
        ..Default::default()
    };
    runner::run(&spec, &text, &opts)?;
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(
        dir.path()
            .join("reports")
            .join(format!("{}.json", spec.name)),
    )?)?;
    let cap = &json["policies"][0]["capacity_qps"][0];
    let mean = cap["mean"].as_f64().unwrap_or(0.0);
    let censored = cap["censored"].as_str().unwrap_or("?");
    // W: warm prefixes in half of one replica's KV cache.
    let gen = spec.workload.generator.as_ref().expect("checked");
    let wl = crate::workload::gen::Workload::load(gen)?;
    let engine = crate::engine::engine_config(
        &spec.fleet.engine_spec(),
        gen.prefix.block_size,
        &spec.fleet.knobs.to_overrides(),
    )?;
    let ws = crate::policy::calibrate::warm_start(&wl, stop, 1)?;
    let w = crate::policy::calibrate::estimate_warm_slots(&engine, ws.mean_prompt_tokens);
    println!(
        "one {} replica serving {} keys, SLO {}: p99 knees above {mean:.1} req/s (mean over {} seeds{})",
        spec.fleet.engine_spec(),
        gen.keys.active.unwrap_or(0),
        slo.label(),
        a.seeds,
        match censored {
            "none" => String::new(),
            "left" => ", even the first step failed: lower --ladder".into(),
            "right" => ", every step passed: raise --ladder".into(),
            other => format!(", censoring {other}"),
        }
    );
    println!("suggested planner: {{ q_cap: {mean:.1}, warm_slots: {w} }}   (W = half of {} KV tokens / mean prompt {:.0} tokens)", engine.kv_capacity_tokens(), ws.mean_prompt_tokens);
    Ok(())
}
