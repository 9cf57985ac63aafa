//! `cacheroute simulate`: one policy on one simulated fleet, printing the headline metrics.

use crate::analysis::record::{RequestRecord, Status};
use crate::engine::KnobOverrides;
use crate::engine::{engine_config, Failure};
use crate::policy::calibrate::{warm_start, WarmStart};
use crate::policy::PolicySpec;
use crate::sim::{self, SimConfig};
use crate::workload::gen::Workload;
use crate::workload::trace::TraceRecord;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  # CacheRoute on the paper's 30 replicas of Llama-3.3-70B fp8 (TP-2, H100) at 100 req/s
  cacheroute simulate --workload paper --policy cacheroute --destinations 30 --qps 100

  # Your own trace, rescaled to 20 req/s, on 8 replicas of an 8B model, one replica killed at
  # 120 s and back (cold) at 200 s
  cacheroute simulate --trace traffic.jsonl --qps 20 --destinations 8 \\
      --engine llama-3.1-8b:h100:fp8:tp1 --policy sticky --fail 3@120:200")]
pub struct SimulateArgs {
    /// Trace file (JSONL; Mooncake files load as they are).
    #[arg(long, conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Built-in workload: `paper` (all 128,824 keys of the paper's lognormal σ = 1.648 rates
    /// active at once, unlike the flagship study's top 128), or a generator YAML file.
    #[arg(long)]
    pub workload: Option<String>,
    /// Policy: flat-lb, sticky, chwbl, dualmap, preble, llm-d (llm-d's router, its
    /// optimized-baseline profile), cacheroute, cacheroute-affinity,
    /// cacheroute-replication, cacheroute-paper (Algorithm 1 as published), cacheroute-p2c-tail,
    /// cacheroute-prefix-tail (Preble's scheduling for the cold tail), cacheroute-keys (without
    /// the conversation memory), dynamo (NVIDIA Dynamo's KV router through its crate, fed the
    /// engine model's KV-cache events); or a spec as a YAML flow mapping, as a study writes it:
    /// `{policy: cacheroute, cold_tail_epsilon: 1}`.
    #[arg(long, default_value = "cacheroute")]
    pub policy: String,
    /// Number of destinations (engine replicas).
    #[arg(long, default_value_t = 30)]
    pub destinations: usize,
    /// Engine: model:device:precision:tpN (e.g. llama-3.3-70b:h100:fp8:tp2).
    #[arg(long, default_value = "llama-3.3-70b:h100:fp8:tp2")]
    pub engine: String,
    /// Offered load (requests/s). With --trace, timestamps are rescaled to this mean rate.
    #[arg(long)]
    pub qps: Option<f64>,
    /// Seconds of traffic (generated workloads; with --trace, a cut-off).
    #[arg(long, default_value_t = 300.0)]
    pub duration: f64,
    /// Seconds at the start excluded from the metrics.
    #[arg(long, default_value_t = 60.0)]
    pub warmup: f64,
    /// Seed of the workload and of every random choice; same seed, same output.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Router replicas behind a round-robin front, each with its own policy state and its own
    /// view of the load; CacheRoute's share one plan, as with `route --etcd`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=crate::bounds::MAX_ROUTER_REPLICAS as i64))]
    pub router_replicas: u16,
    /// Tokens per prefix-hash block of the trace (default: the generator's, or 512 for a trace
    /// file).
    #[arg(long = "block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// CacheRoute: per-destination capacity ceiling (0 = self-calibrated; default: the
    /// policy's).
    #[arg(long = "q-cap")]
    pub q_cap: Option<f64>,
    /// CacheRoute: warm slots per destination (0 = self-calibrated; default: the policy's).
    #[arg(long = "warm-slots")]
    pub warm_slots: Option<u64>,
    /// CacheRoute: control interval, seconds (default: the policy's, 30).
    #[arg(long = "interval-s", alias = "interval")]
    pub interval: Option<f64>,
    /// CacheRoute: rebuild a fresh LPT plan every interval (the paper's Algorithm 1) instead of
    /// the churn-aware replanner.
    #[arg(long = "fresh-plans")]
    pub fresh_plans: bool,
    /// CacheRoute: start cold (no plan until the first interval closes) instead of planning at
    /// t = 0 from the workload's expected rates.
    #[arg(long = "cold-start")]
    pub cold_start: bool,
    /// Inject a failure: DEST@SECONDS or DEST@SECONDS:RECOVER_SECONDS (repeatable).
    #[arg(long = "fail")]
    pub fail: Vec<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn parse_failure(s: &str) -> Result<Failure> {
    let bad = || {
        anyhow::anyhow!(
            "--fail `{s}`: expected DEST@SECONDS or DEST@SECONDS:RECOVER_SECONDS, e.g. 3@120:300"
        )
    };
    let (d, rest) = s.split_once('@').ok_or_else(bad)?;
    let destination: usize = d.trim().parse().map_err(|_| bad())?;
    let (at, rec) = match rest.split_once(':') {
        Some((a, r)) => (a, Some(r)),
        None => (rest, None),
    };
    let at_s: f64 = at.trim().parse().map_err(|_| bad())?;
    let recover_at_s = rec
        .map(|r| r.trim().parse::<f64>().map_err(|_| bad()))
        .transpose()?;
    if recover_at_s.is_some_and(|r| r <= at_s) {
        bail!("--fail `{s}`: recovery must come after the failure");
    }
    Ok(Failure {
        destination,
        at_s,
        recover_at_s,
    })
}

pub fn run(a: SimulateArgs) -> Result<()> {
    if let Some(e) = crate::bounds::count(
        "--destinations",
        a.destinations as u64,
        1,
        crate::bounds::MAX_REPLICAS,
    ) {
        bail!(e);
    }
    if let Some(q) = a.qps {
        super::check_run_size(q, a.duration)?;
    }
    if !(a.duration.is_finite() && a.duration > 0.0) {
        bail!("--duration must be > 0 seconds");
    }
    if !(a.warmup >= 0.0 && a.warmup < a.duration) {
        bail!("--warmup must be ≥ 0 and shorter than --duration");
    }
    let mut policy = super::policy_arg("--policy", &a.policy)?;
    if let PolicySpec::Cacheroute(c) = &mut policy {
        // A flag given overrides the spec's value; one not given leaves it.
        if let Some(q) = a.q_cap {
            c.q_cap = crate::policy::setting::Setting::from_number(q);
        }
        if let Some(w) = a.warm_slots {
            c.warm_slots = crate::policy::setting::Setting::from_number(w);
        }
        c.interval_s = a.interval.unwrap_or(c.interval_s);
        c.churn_aware &= !a.fresh_plans;
    }
    // One range check of the spec as it will run, the flags' values included.
    let problems = policy.problems();
    if !problems.is_empty() {
        bail!("--policy: {}", problems.join("; "));
    }
    let failures = a
        .fail
        .iter()
        .map(|s| parse_failure(s))
        .collect::<Result<Vec<_>>>()?;
    let mut warm: Option<WarmStart> = None;
    let (trace, block): (Box<dyn Iterator<Item = TraceRecord>>, u32) = match (&a.trace, &a.workload)
    {
        (Some(p), _) => {
            let (v, _) = super::load_trace_file(p, a.qps, a.duration)?;
            (Box::new(v.into_iter()), a.block_size.unwrap_or(512))
        }
        (None, w) => {
            let cfg = super::workload_config(w.as_deref(), a.block_size)?;
            let qps = a.qps.context("--qps is needed with a generated workload")?;
            let wl = Workload::load(&cfg)?;
            let block = cfg.prefix.block_size;
            if !a.cold_start {
                warm = Some(warm_start(&wl, qps, a.seed)?);
            }
            (Box::new(wl.generate(qps, a.duration, a.seed)?), block)
        }
    };
    let engine = engine_config(&a.engine, block, &KnobOverrides::default())?;
    let cfg = SimConfig {
        destinations: a.destinations,
        engine,
        policy: policy.clone(),
        seed: a.seed,
        failures,
        horizon_s: f64::INFINITY,
        warm_start: warm,
        seed_first_window: false,
        router_replicas: a.router_replicas as usize,
    };
    let t0 = std::time::Instant::now();
    let out = sim::simulate(cfg, trace)?;
    let wall = t0.elapsed().as_secs_f64();
    // The wall-clock rate goes to stderr: stdout stays identical for the same inputs.
    eprintln!(
        "simulated {} requests in {:.2} s of wall time ({:.0} requests/s)",
        out.records.len(),
        wall,
        out.records.len() as f64 / wall.max(1e-9)
    );
    let m = out.summary(a.warmup, a.duration);
    let last_plan = out.plans.iter().rev().find(|p| !p.repair);
    if a.json {
        let v = json!({
            "policy": policy.label(),
            "destinations": a.destinations,
            "engine": a.engine,
            "seed": a.seed,
            "summary": m,
            "preemptions": out.preemptions(),
            "requests_simulated": out.records.len(),
            "plans": out.plans.len(),
            "last_plan": last_plan,
            "plan_history": out.plans,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} on {} × {} — {} requests simulated, measured {:.0}–{:.0} s",
        policy.label(),
        a.destinations,
        a.engine,
        out.records.len(),
        a.warmup,
        a.duration
    );
    println!(
        "offered {:.1} req/s, completed {:.1} req/s, errors {}",
        m.offered_qps, m.throughput_qps, m.errors
    );
    println!("served KV hit {:.1}%", 100.0 * m.served_kv_hit);
    println!("TTFT p50 {:.3} s  p99 {:.3} s", m.ttft_p50_s, m.ttft_p99_s);
    println!("e2e  p50 {:.3} s  p99 {:.3} s", m.e2e_p50_s, m.e2e_p99_s);
    println!(
        "imbalance max/mean: requests {:.2}, prefill tokens {:.2}",
        m.imbalance_requests, m.imbalance_prefill_tokens
    );
    println!("preemptions {}", out.preemptions());
    for line in notes(
        &out.records,
        &m,
        (a.warmup, a.duration),
        &failures_text(&a.fail),
    ) {
        println!("{line}");
    }
    if let Some(p) = last_plan {
        println!(
            "plan: {} keys admitted ({:.1}% of traffic), q_cap {}, W {}, {} plans installed",
            p.admitted,
            100.0 * p.admitted_share,
            p.q_cap.map_or("—".into(), |q| format!("{q:.2}")),
            p.warm_slots.map_or("—".into(), |w| w.to_string()),
            out.plans.len()
        );
    }
    Ok(())
}

fn failures_text(fail: &[String]) -> String {
    fail.join(", ")
}

/// What a reader should not miss: an overloaded fleet (completed below offered, or a p99 far
/// above its p50) and what injected failures did to requests.
fn notes(
    records: &[RequestRecord],
    m: &crate::analysis::Summary,
    (from_s, to_s): (f64, f64),
    fail: &str,
) -> Vec<String> {
    let mut v = Vec::new();
    let behind = m.offered_qps > 0.0 && m.throughput_qps < 0.95 * m.offered_qps;
    let tail = m.e2e_p50_s > 0.0 && m.e2e_p99_s > 10.0 * m.e2e_p50_s;
    // A fleet that keeps up has the same queueing early and late; under overload the queue,
    // and so TTFT, grows all run.
    let ttft_median = |lo: f64, hi: f64| {
        let mut v: Vec<f64> = records
            .iter()
            .filter(|r| r.status == Status::Ok && r.scheduled_s >= lo && r.scheduled_s < hi)
            .map(|r| r.ttft_s())
            .collect();
        crate::analysis::percentile(&mut v, 0.5)
    };
    let third = (to_s - from_s) / 3.0;
    let (early, late) = (
        ttft_median(from_s, from_s + third),
        ttft_median(to_s - third, to_s),
    );
    let backlog = late > 1.0 && late > 2.0 * early;
    if behind || tail || backlog {
        let mut why = Vec::new();
        if behind {
            why.push(format!(
                "completed {:.1} of {:.1} req/s offered",
                m.throughput_qps, m.offered_qps
            ));
        }
        if tail {
            why.push(format!(
                "e2e p99 is {:.0}× its p50",
                m.e2e_p99_s / m.e2e_p50_s
            ));
        }
        if backlog {
            why.push(format!(
                "TTFT grew through the run (median {early:.2} s in the first third, {late:.2} s \
                 in the last)"
            ));
        }
        v.push(format!(
            "overloaded: {} — the fleet cannot keep up; lower --qps or add --destinations",
            why.join(", ")
        ));
    }
    if !fail.is_empty() {
        let retried = records.iter().filter(|r| r.retried).count();
        let failed = records
            .iter()
            .filter(|r| matches!(r.status, Status::Failed | Status::NoDestination))
            .count();
        v.push(format!(
            "failures injected ({fail}): {retried} requests retried elsewhere, {failed} failed \
             (whole run, warm-up included)"
        ));
    }
    v
}
