//! `cacheroute calibrate`: q_cap is the request rate at which one destination's p99 knees. Run
//! a short ladder against a single replica serving the share of the study's keys one
//! destination would hold (its active keys ÷ replicas), with Sticky routing (one destination,
//! so routing is moot), at the study's first SLO. The ladder brackets each seed's knee, which is
//! then found by bisection on a fixed grid of rates (`analysis::knee`), and the smallest seed's
//! knee is q_cap. W is suggested from the replica's KV capacity and the workload's mean prompt
//! (half the cache for warm prefixes). Runs on any backend through the study runner.

use crate::analysis::knee;
use crate::experiment::runner::{self, RunOptions};
use crate::experiment::spec::{Backend, Ladder, Seeds};
use crate::policy::PolicySpec;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(after_help = "Example:
  cacheroute calibrate experiments/flagship-70b-fp8.yaml --ladder 2,1,8")]
pub struct CalibrateArgs {
    /// The study to calibrate for (its fleet, workload and first SLO); `--experiment SPEC`
    /// says the same.
    #[arg(required_unless_present = "experiment", value_name = "SPEC")]
    pub spec: Option<PathBuf>,
    /// The study to calibrate for, as `fleet` takes it.
    #[arg(long, conflicts_with = "spec", value_name = "SPEC")]
    pub experiment: Option<PathBuf>,
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
    let path = a
        .spec
        .clone()
        .or(a.experiment.clone())
        .expect("clap requires SPEC or --experiment");
    let (mut spec, _) = super::study::load_spec(&path)?;
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
    let backend = a.backend.map(Backend::from);
    let base_dir = super::config_dir(&path).to_path_buf();
    // One study per call, in a scratch database: the highest passing step per seed.
    let mut runs = 0usize;
    let mut run_ladder = |steps: Vec<f64>, seeds: Vec<u64>| -> Result<Vec<(u64, f64, String)>> {
        runs += 1;
        let mut sp = spec.clone();
        sp.ladder = Ladder::List(steps);
        sp.seeds = Seeds::List(seeds);
        let dir = tempfile::tempdir()?;
        let text = yaml_serde::to_string(&sp)?;
        let opts = RunOptions {
            db: dir.path().join("calibrate.db"),
            out_dir: dir.path().join("reports"),
            backend,
            progress: false,
            base_dir: base_dir.clone(),
            ..Default::default()
        };
        runner::run(&sp, &text, &opts)?;
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(
            dir.path().join("reports").join(format!("{}.json", sp.name)),
        )?)?;
        let per_seed = json["policies"][0]["capacity_qps"][0]["per_seed"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        Ok(per_seed
            .iter()
            .map(|p| {
                (
                    p["seed"].as_u64().unwrap_or(0),
                    p["qps"].as_f64().unwrap_or(0.0),
                    p["censored"].as_str().unwrap_or("?").to_string(),
                )
            })
            .collect())
    };
    let ladder = Ladder::Range { start, step, stop }.steps();
    let seeds: Vec<u64> = (1..=a.seeds).collect();
    let first = run_ladder(ladder.clone(), seeds)?;
    // Each seed's knee on one fixed grid (KNEE_GRID points per doubling), whatever ladder found
    // its bracket: the largest grid point that passes, found by bisection between the highest
    // passing step and the next one. Two ladders that bracket the same knee give the same q_cap.
    let mut knees: Vec<SeedKnee> = Vec::new();
    for (seed, cap, censored) in first {
        let knee = match censored.as_str() {
            "none" => {
                let next = ladder
                    .iter()
                    .copied()
                    .find(|x| *x > cap)
                    .unwrap_or(f64::INFINITY);
                let b = knee::bisect(&KNEE_GRID, cap, next, |q| {
                    let r = run_ladder(vec![q], vec![seed])?;
                    Ok::<bool, anyhow::Error>(r.first().is_some_and(|x| x.2 != "left"))
                })?;
                // Reported on the grid, whatever ladder step the bracket started from.
                Knee::At {
                    qps: KNEE_GRID.point(KNEE_GRID.index_at_or_below(b.passes)),
                    passes_below: b.fails,
                }
            }
            "left" => Knee::Below(ladder[0]),
            _ => Knee::Above(*ladder.last().unwrap_or(&stop)),
        };
        knees.push(SeedKnee { seed, knee });
    }
    for k in &knees {
        println!("seed {}: {}", k.seed, k.knee.describe());
    }
    let found: Vec<f64> = knees
        .iter()
        .filter_map(|k| match k.knee {
            Knee::At { qps, .. } => Some(qps),
            _ => None,
        })
        .collect();
    if found.len() < knees.len() {
        bail!(
            "no q_cap: {} of {} seeds have no knee inside --ladder {start},{step},{stop} (see above); \
             widen the ladder so that its first step passes and its last fails",
            knees.len() - found.len(),
            knees.len()
        );
    }
    let mean = found.iter().copied().fold(f64::INFINITY, f64::min);
    let most = found.iter().copied().fold(0.0, f64::max);
    let agree = KNEE_GRID.index_at_or_below(most) - KNEE_GRID.index_at_or_below(mean) <= 1;
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
        "one {} replica serving {} keys, SLO {}: q_cap {mean:.2} req/s, the smallest knee of {} seeds ({}; {runs} runs)",
        spec.fleet.engine_spec(),
        gen.keys.active.unwrap_or(0),
        slo.label(),
        knees.len(),
        if agree {
            "the seeds agree within one grid step".to_string()
        } else {
            format!("the seeds disagree: knees {mean:.2} to {most:.2} req/s")
        }
    );
    println!("suggested planner: {{ q_cap: {mean:.1}, warm_slots: {w} }}   (W = half of {} KV tokens / mean prompt {:.0} tokens)", engine.kv_capacity_tokens(), ws.mean_prompt_tokens);
    Ok(())
}

/// The grid knees are reported on: 16 points per doubling of the request rate,
/// 2^(k / 16) req/s (steps of about 4.4%).
const KNEE_GRID: knee::KneeGrid = knee::KneeGrid::new(16.0);

enum Knee {
    /// Passes at `qps` (a grid point); the next grid point, or the ladder step above, fails.
    At { qps: f64, passes_below: f64 },
    /// Even the ladder's first step failed.
    Below(f64),
    /// Every step of the ladder passed.
    Above(f64),
}

impl Knee {
    fn describe(&self) -> String {
        match self {
            Knee::At { qps, passes_below } => {
                format!("knee at {qps:.2} req/s (passes there, fails at {passes_below:.2})")
            }
            Knee::Below(x) => format!("fails already at {x} req/s: lower --ladder"),
            Knee::Above(x) => format!("passes every step up to {x} req/s: raise --ladder"),
        }
    }
}

struct SeedKnee {
    seed: u64,
    knee: Knee,
}
