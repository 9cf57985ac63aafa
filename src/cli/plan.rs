//! `cacheroute plan` (build a plan from a rates CSV) and `cacheroute churn` (fresh LPT against
//! churn-aware replanning under rate drift). The clock for `build_ms` lives here, at the edge.

use crate::plan::export::{key_loads, plan_json};
use crate::plan::{self, KeyLoad, KeyMap, Placement, PlannerConfig};
use crate::workload::rates;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

/// Which planner variant (the paper's ablation rows).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VariantArg {
    /// The full planner: k_b by q_cap, LPT placement.
    Full,
    /// Affinity only: k_b = 1, hash placement.
    Affinity,
    /// k_b by q_cap, hash placement.
    Replication,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute plan --rates data/paper-rates.csv --destinations 30 --q-cap 6 --warm-slots 128 --out plan.json
  # After a rate change: move as few keys as possible from the previous plan
  cacheroute plan --rates new-rates.csv --destinations 30 --q-cap 6 --warm-slots 128 \\
      --previous plan.json --out plan2.json")]
pub struct PlanArgs {
    /// Rates CSV: header `key,rate` or `key,rate,prefix_tokens`.
    #[arg(long)]
    pub rates: PathBuf,
    /// Number of destinations R.
    #[arg(long)]
    pub destinations: usize,
    /// Per-destination capacity ceiling q_cap (requests/s).
    #[arg(long = "q-cap")]
    pub q_cap: f64,
    /// Warm slots per destination W (keys; KV blocks with --byte-aware).
    #[arg(long = "warm-slots")]
    pub warm_slots: u64,
    /// Previous plan (JSON written by this command): replan churn-aware against it.
    #[arg(long)]
    pub previous: Option<PathBuf>,
    /// Churn-aware bound on max/mean expected load, as a factor on a fresh LPT plan's.
    #[arg(long = "max-imbalance", default_value_t = 1.05)]
    pub max_imbalance: f64,
    /// With --previous: a previously admitted key keeps its slot unless a newcomer's rate
    /// exceeds its rate × (1 + this). 0 = admission exactly as a fresh plan.
    #[arg(long = "admission-hysteresis", default_value_t = 0.5)]
    pub admission_hysteresis: f64,
    /// Byte-aware admission: value = rate × prefix_tokens, slots counted in KV blocks.
    #[arg(long = "byte-aware")]
    pub byte_aware: bool,
    /// Tokens per KV cache block (byte-aware admission counts slots in these).
    #[arg(long = "kv-block-tokens", alias = "block-tokens", default_value_t = 16)]
    pub block_tokens: u32,
    /// Planner variant.
    #[arg(long, value_enum, default_value_t = VariantArg::Full)]
    pub variant: VariantArg,
    /// Destinations to leave out (comma-separated 0-based indices): plan repair.
    #[arg(long, value_delimiter = ',')]
    pub down: Vec<usize>,
    /// Where to write the plan JSON (nothing is written when omitted).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn check_flags(destinations: usize, q_cap: f64, warm_slots: u64, max_imbalance: f64) -> Result<()> {
    if destinations == 0 {
        bail!("--destinations must be ≥ 1 (the number of engine replicas)");
    }
    if destinations > u16::MAX as usize {
        bail!("--destinations must be ≤ {}", u16::MAX);
    }
    if let Some(e) = crate::bounds::finite_positive("--q-cap", q_cap) {
        bail!("{e} (requests/s one destination sustains before its p99 knees)");
    }
    if let Some(e) = crate::bounds::count("--warm-slots", warm_slots, 1, u64::MAX) {
        bail!("{e} (warm keys each destination can hold)");
    }
    if !(max_imbalance.is_finite() && max_imbalance >= 1.0) {
        bail!("--max-imbalance must be ≥ 1.0 (a factor on the fresh plan's max/mean load)");
    }
    Ok(())
}

fn planner_config(a: &PlanArgs) -> PlannerConfig {
    let mut c = PlannerConfig::new(a.destinations, a.q_cap, a.warm_slots);
    c.max_imbalance = a.max_imbalance;
    c.admission_hysteresis = a.admission_hysteresis;
    c.byte_aware = a.byte_aware;
    c.block_tokens = a.block_tokens;
    match a.variant {
        VariantArg::Full => {}
        VariantArg::Affinity => {
            c.replication = false;
            c.placement = Placement::Hash;
        }
        VariantArg::Replication => c.placement = Placement::Hash,
    }
    c
}

/// Read a previous plan (a `plan --out` file or a router's state file) as destination sets
/// keyed by key hash. Its fleet may differ from this one's: indices are checked against the
/// file's own `destinations`.
pub fn read_previous(path: &std::path::Path) -> Result<KeyMap<Vec<u16>>> {
    plan::file::read_plan_path(path, plan::file::Fleet::Any)
        .map(|f| f.sets)
        .map_err(|e| anyhow::anyhow!("previous plan {}: {e}", path.display()))
}

pub fn run(a: PlanArgs) -> Result<()> {
    check_flags(a.destinations, a.q_cap, a.warm_slots, a.max_imbalance)?;
    if let Some(&d) = a.down.iter().find(|&&d| d >= a.destinations) {
        bail!(
            "--down {d}: destination indices are 0-based and must be < --destinations {}",
            a.destinations
        );
    }
    let file = std::fs::File::open(&a.rates)
        .with_context(|| format!("opening rates file {}", a.rates.display()))?;
    let rates = rates::read_rates_csv(std::io::BufReader::new(file))
        .with_context(|| format!("{}", a.rates.display()))?;
    if a.byte_aware && rates.iter().all(|r| r.prefix_tokens.is_none()) {
        bail!(
            "--byte-aware needs a `prefix_tokens` column in {}",
            a.rates.display()
        );
    }
    let previous = a.previous.as_deref().map(read_previous).transpose()?;
    let cfg = planner_config(&a);
    let keys = key_loads(&rates);
    let down: Vec<bool> = (0..a.destinations).map(|d| a.down.contains(&d)).collect();
    let down = if a.down.is_empty() {
        None
    } else {
        Some(down.as_slice())
    };
    let t0 = Instant::now();
    let mut plan = match &previous {
        Some(prev) => plan::replan(&cfg, &keys, prev, down)?,
        None => plan::build(&cfg, &keys, down)?,
    };
    plan.build_ms = t0.elapsed().as_secs_f64() * 1e3;
    if let Some(out) = &a.out {
        // The JSON of a 128,824-key plan takes a third of a second: only when it is written.
        let bytes = serde_json::to_vec_pretty(&plan_json(&plan, &rates, &cfg))?;
        super::write_atomic(out, &bytes)?;
    }
    println!(
        "plan: {} keys, R = {}, q_cap = {}, W = {}{}",
        rates.len(),
        a.destinations,
        a.q_cap,
        a.warm_slots,
        if a.byte_aware {
            " (byte-aware: W in KV blocks)"
        } else {
            ""
        }
    );
    println!(
        "admitted {} keys ({:.1}% of traffic), slots {}/{}",
        plan.admitted(),
        100.0 * plan.admitted_share(),
        plan.slots_used,
        plan.slot_budget
    );
    println!(
        "expected load max/mean {:.3} (cold tail {:.3} req/s per destination)",
        plan.imbalance(),
        plan.cold_tail_per_dest
    );
    if let Some(c) = plan.churn {
        println!(
            "churn {:.2}% of admitted keys moved{}",
            100.0 * c,
            if plan.fell_back_to_fresh {
                " (bound not reachable: fresh plan used)"
            } else {
                ""
            }
        );
    }
    println!("built in {:.2} ms", plan.build_ms);
    if let Some(out) = &a.out {
        println!("wrote {}", out.display());
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute churn                                  # the paper's keys, one drift step
  cacheroute churn --intervals 6 --warm-slots 32    # six drift steps")]
pub struct ChurnArgs {
    /// Number of keys.
    #[arg(long, default_value_t = 128_824)]
    pub keys: usize,
    /// Lognormal σ of key rates (1.648: the paper's distribution).
    #[arg(long, default_value_t = 1.648)]
    pub sigma: f64,
    /// Total offered rate (requests/s).
    #[arg(long, default_value_t = 150.0)]
    pub qps: f64,
    /// σ of the lognormal rate drift per interval.
    #[arg(long, default_value_t = 0.3)]
    pub drift: f64,
    /// Intervals of drift.
    #[arg(long, default_value_t = 1)]
    pub intervals: usize,
    /// Number of destinations (engine replicas).
    #[arg(long, default_value_t = 30)]
    pub destinations: usize,
    /// Per-destination capacity ceiling, req/s: a key gets ⌈rate / q_cap⌉ destinations.
    #[arg(long = "q-cap", default_value_t = 6.0)]
    pub q_cap: f64,
    /// Warm slots per destination (the plan admits at most destinations × W key copies).
    #[arg(long = "warm-slots", default_value_t = 128)]
    pub warm_slots: u64,
    /// Largest max/mean expected load a replan may keep, relative to a fresh plan's.
    #[arg(long = "max-imbalance", default_value_t = 1.05)]
    pub max_imbalance: f64,
    /// Admission hysteresis of the churn-aware replanner.
    #[arg(long = "admission-hysteresis", default_value_t = 0.5)]
    pub admission_hysteresis: f64,
    /// Seed of the keys' rates and of the drift.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run_churn(a: ChurnArgs) -> Result<()> {
    check_flags(a.destinations, a.q_cap, a.warm_slots, a.max_imbalance)?;
    if a.keys == 0 {
        bail!("--keys must be ≥ 1");
    }
    let mut rng = crate::rng::seeded(a.seed);
    let mut r = rates::lognormal_rates(a.keys, a.sigma, a.qps, &mut rng);
    let named = rates::named(&r);
    let mut cfg = PlannerConfig::new(a.destinations, a.q_cap, a.warm_slots);
    cfg.max_imbalance = a.max_imbalance;
    cfg.admission_hysteresis = a.admission_hysteresis;
    let keys0 = key_loads(&named);
    let first = plan::build(&cfg, &keys0, None)?;
    let mut prev_fresh = first.key_sets();
    let mut prev_aware = first.key_sets();
    let mut rows = Vec::new();
    for interval in 1..=a.intervals {
        let before: Vec<f64> = r.clone();
        rates::drift_step(&mut r, a.drift, &mut rng);
        let keys: Vec<KeyLoad> = keys0
            .iter()
            .zip(&r)
            .map(|(k, &rate)| KeyLoad { rate, ..*k })
            .collect();
        let k_changed = before
            .iter()
            .zip(&r)
            .filter(|(x, y)| {
                plan::replicas_for(**x, a.q_cap, a.destinations)
                    != plan::replicas_for(**y, a.q_cap, a.destinations)
            })
            .count() as f64
            / a.keys as f64;
        let t0 = Instant::now();
        let fresh = plan::build(&cfg, &keys, None)?;
        let fresh_ms = t0.elapsed().as_secs_f64() * 1e3;
        let fresh_churn = plan::churn(&prev_fresh, &fresh);
        let t0 = Instant::now();
        let aware = plan::replan(&cfg, &keys, &prev_aware, None)?;
        let aware_ms = t0.elapsed().as_secs_f64() * 1e3;
        // Admission turnover: admitted now, not admitted before (moves that no placement avoids).
        let newly = aware
            .entries
            .iter()
            .filter(|e| !prev_aware.contains_key(&e.key))
            .count() as f64
            / aware.admitted().max(1) as f64;
        rows.push(json!({
            "interval": interval,
            "admitted": fresh.admitted(),
            "k_changed_share": k_changed,
            "newly_admitted_share": newly,
            "fresh": {"churn": fresh_churn, "imbalance": fresh.imbalance(), "build_ms": fresh_ms},
            "churn_aware": {"churn": aware.churn.unwrap_or(0.0), "imbalance": aware.imbalance(), "admitted_share": aware.admitted_share(), "fresh_admitted_share": fresh.admitted_share(), "fell_back": aware.fell_back_to_fresh, "build_ms": aware_ms},
        }));
        prev_fresh = fresh.key_sets();
        prev_aware = aware.key_sets();
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"keys": a.keys, "sigma": a.sigma, "drift": a.drift, "destinations": a.destinations, "intervals": rows})
            )?
        );
        return Ok(());
    }
    println!(
        "{} keys (lognormal σ = {}), {} req/s, R = {}, q_cap = {}, W = {}, drift σ = {} per interval",
        a.keys, a.sigma, a.qps, a.destinations, a.q_cap, a.warm_slots, a.drift
    );
    println!("interval | admitted | k_b changed | fresh churn | fresh max/mean | churn-aware churn | newly admitted | churn-aware max/mean | traffic admitted (fresh)");
    for row in &rows {
        println!(
            "{:>8} | {:>8} | {:>10.2}% | {:>10.1}% | {:>14.4} | {:>16.2}% | {:>13.2}% | {:>20.4} | {:.1}% ({:.1}%){}",
            row["interval"],
            row["admitted"],
            100.0 * row["k_changed_share"].as_f64().unwrap(),
            100.0 * row["fresh"]["churn"].as_f64().unwrap(),
            row["fresh"]["imbalance"].as_f64().unwrap(),
            100.0 * row["churn_aware"]["churn"].as_f64().unwrap(),
            100.0 * row["newly_admitted_share"].as_f64().unwrap(),
            row["churn_aware"]["imbalance"].as_f64().unwrap(),
            100.0 * row["churn_aware"]["admitted_share"].as_f64().unwrap(),
            100.0 * row["churn_aware"]["fresh_admitted_share"].as_f64().unwrap(),
            if row["churn_aware"]["fell_back"].as_bool().unwrap() { " fell back" } else { "" }
        );
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute rates --out rates.csv                                   # data/paper-rates.csv
  cacheroute rates --keys 2048 --zipf 1.0 --qps 60 --whales 4 --whale-share 0.3 --out zipf.csv")]
pub struct RatesArgs {
    /// Number of keys.
    #[arg(long, default_value_t = 128_824)]
    pub keys: usize,
    /// Lognormal σ (1.648: the paper's Gini 0.756). Ignored with --zipf.
    #[arg(long, default_value_t = 1.648)]
    pub sigma: f64,
    /// Zipf exponent instead of a lognormal.
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Total rate (requests/s) the keys' rates sum to.
    #[arg(long, default_value_t = 150.0)]
    pub qps: f64,
    /// Number of whale keys …
    #[arg(long, default_value_t = 0)]
    pub whales: usize,
    /// … carrying this share of all traffic together.
    #[arg(long = "whale-share", default_value_t = 0.0)]
    pub whale_share: f64,
    /// Seed of the rates.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output CSV (`key,rate`).
    #[arg(long)]
    pub out: PathBuf,
}

/// `cacheroute rates`: write a synthetic `key,rate` CSV.
pub fn run_rates(a: RatesArgs) -> Result<()> {
    if a.keys == 0 {
        bail!("--keys must be ≥ 1");
    }
    if let Some(e) = crate::bounds::rate("--qps", a.qps) {
        bail!("{e}; give the total rate of the generated keys");
    }
    if a.qps == 0.0 {
        bail!("--qps must be > 0 (the total rate of the generated keys, requests/s)");
    }
    if !(0.0..1.0).contains(&a.whale_share) {
        bail!("--whale-share must be in [0, 1)");
    }
    let mut rng = crate::rng::seeded(a.seed);
    let mut r = match a.zipf {
        Some(s) if s.is_finite() && s > 0.0 => rates::zipf_rates(a.keys, s, a.qps, &mut rng),
        Some(_) => bail!("--zipf must be an exponent > 0"),
        None => rates::lognormal_rates(a.keys, a.sigma, a.qps, &mut rng),
    };
    rates::add_whales(&mut r, a.whales, a.whale_share);
    let mut buf = Vec::with_capacity(a.keys * 24);
    rates::write_rates_csv(&mut buf, &rates::named(&r))?;
    super::write_atomic(&a.out, &buf)?;
    println!(
        "wrote {} keys to {} (total {} req/s, Gini {:.3}, top 4% {:.1}%, largest key {:.3}%)",
        a.keys,
        a.out.display(),
        a.qps,
        rates::gini(&r),
        100.0 * rates::top_share(&r, 0.04),
        100.0 * r.iter().cloned().fold(0.0, f64::max) / a.qps
    );
    Ok(())
}
