//! `cacheroute advise`: will affinity pay on this traffic? A thin layer over
//! `experiment::advise` (the diagnostic, the simulated A/B and the verdict) and
//! `report::advise` (the text). Exit status: 0 with a verdict, 1 on bad input (2 on a usage
//! error, as for every command), 3 when no policy meets the SLO at any load of the ladder (no
//! verdict; the report is still printed).

use crate::analysis::model::{Slo, SloMetric};
use crate::experiment::advise::{
    self, Input, Options, DEFAULT_BUDGET_REQUESTS, DEFAULT_CACHE_BLOCK, DEFAULT_MAX_REQUESTS,
    DEFAULT_MULTIPLIERS,
};
use crate::workload::trace::ReaderOptions;
use anyhow::{Context, Result};
use clap::ValueEnum;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute advise --trace traffic.jsonl --engine llama-3.1-8b:h100:fp8:tp1 --destinations 8 \\
      --slo-p99-s 4 --slo-metric ttft --out advice.md
  cacheroute advise --rates data/paper-rates.csv --engine llama-3.3-70b:h100:fp8:tp2 \\
      --destinations 30 --slo-p99-s 3.5")]
#[command(group(clap::ArgGroup::new("input").required(true).args(["trace", "rates"])))]
pub struct AdviseArgs {
    /// Your traffic: a JSONL trace (Mooncake files load as they are).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Your traffic as per-key rates: a `key,rate[,prefix_tokens]` CSV (rates in req/s).
    #[arg(long)]
    pub rates: Option<PathBuf>,
    /// With --rates: a generator YAML giving the requests' shape (prompts, conversations,
    /// arrivals; its key distribution is replaced by the CSV). Default: the paper preset.
    #[arg(long, requires = "rates")]
    pub workload: Option<String>,
    /// Engine of every replica: model:device:precision:tpN (e.g. llama-3.1-8b:h100:fp8:tp1).
    #[arg(long, default_value = "llama-3.3-70b:h100:fp8:tp2")]
    pub engine: String,
    /// Number of replicas R.
    #[arg(long, default_value_t = 30)]
    pub destinations: usize,
    /// The SLO: p99 latency bound in seconds.
    #[arg(long = "slo-p99-s")]
    pub slo_p99_s: f64,
    /// Which latency the SLO bounds.
    #[arg(long = "slo-metric", value_enum, default_value_t = MetricArg::E2e)]
    pub slo_metric: MetricArg,
    /// Your load (the ladder's 1×), req/s. Default: the trace's mean rate, or the sum of the rates.
    #[arg(long)]
    pub qps: Option<f64>,
    /// Load multipliers of the ladder, increasing (default 0.5,0.63,0.794,1,1.26,1.587,2).
    #[arg(long, value_delimiter = ',')]
    pub ladder: Option<Vec<f64>>,
    /// Paired seeds (default 3, fewer when seed 1 alone simulated so many requests that more
    /// would exceed --budget-requests).
    #[arg(long)]
    pub seeds: Option<u64>,
    /// Most requests all seeds may simulate together when --seeds is not given, judged by
    /// what seed 1 simulated.
    #[arg(long = "budget-requests", default_value_t = DEFAULT_BUDGET_REQUESTS)]
    pub budget_requests: u64,
    /// Most requests the top step simulates (longer or faster traces are cut or shortened).
    #[arg(long = "max-requests", default_value_t = DEFAULT_MAX_REQUESTS)]
    pub max_requests: usize,
    /// Tokens per block of the trace's hash_ids (default: inferred; the generator's with --rates).
    #[arg(long = "block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// Smallest prefix-cache block simulated, tokens: finer trace blocks are merged (as the
    /// studies simulate 64-token blocks; about twice as fast as 16). 1 keeps the trace's blocks.
    #[arg(long = "cache-block", default_value_t = DEFAULT_CACHE_BLOCK)]
    pub cache_block: u32,
    /// Longest request (prompt + output tokens) your engine accepts, e.g. vLLM's --max-model-len.
    #[arg(long = "max-model-len")]
    pub max_model_len: Option<u32>,
    /// KV cache of each replica in bytes, as a study spec's knobs.kv_cache_bytes or vLLM's
    /// --kv-cache-memory-bytes (default: the engine model's own for the device).
    #[arg(long = "kv-cache-bytes")]
    pub kv_cache_bytes: Option<f64>,
    #[command(flatten)]
    pub read: super::trace::ReadArgs,
    /// Also write the report as markdown to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Locate each seed's knee to this relative resolution by bisection between its last
    /// passing and first failing ladder step (each probe one more simulated step).
    #[arg(long, default_value_t = crate::analysis::advise::KNEE_RESOLUTION)]
    pub refine: f64,
    /// Judge on the ladder's steps alone (no bisection between them).
    #[arg(long = "no-refine", conflicts_with = "refine")]
    pub no_refine: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum MetricArg {
    E2e,
    Ttft,
}

/// No policy meets the SLO at any load of the ladder: the report is printed, the exit status
/// is 3.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NoVerdict(pub String);

pub fn run(a: AdviseArgs) -> Result<()> {
    let input = match (&a.trace, &a.rates) {
        (Some(t), _) => Input::Trace {
            path: t.clone(),
            read: ReaderOptions {
                key_blocks: a.read.key_blocks,
                skip_bad: a.read.skip_bad,
            },
        },
        (None, Some(r)) => Input::Rates {
            path: r.clone(),
            generator: Box::new(super::workload_config(a.workload.as_deref(), None)?),
        },
        (None, None) => anyhow::bail!("give --trace FILE or --rates FILE"),
    };
    let opts = Options {
        input,
        engine: a.engine.clone(),
        replicas: a.destinations,
        slo: Slo {
            metric: match a.slo_metric {
                MetricArg::E2e => SloMetric::E2e,
                MetricArg::Ttft => SloMetric::Ttft,
            },
            p99_s: a.slo_p99_s,
        },
        qps: a.qps,
        multipliers: a
            .ladder
            .clone()
            .unwrap_or_else(|| DEFAULT_MULTIPLIERS.to_vec()),
        seeds: a.seeds,
        budget_requests: a.budget_requests,
        max_requests: a.max_requests,
        block_size: a.block_size,
        cache_block: a.cache_block,
        max_model_len: a.max_model_len,
        kv_cache_bytes: a.kv_cache_bytes,
        threads: a.threads,
        progress: !a.json,
        parallel_read_bytes: advise::PARALLEL_READ_BYTES,
        refine: (!a.no_refine).then_some(a.refine),
    };
    let report = advise::advise(&opts)?;
    let out = if a.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        crate::report::advise::render_text(&report)
    };
    print_out(&out)?;
    if let Some(out) = &a.out {
        super::write_atomic(
            out,
            crate::report::advise::render_markdown(&report).as_bytes(),
        )
        .with_context(|| format!("--out {}", out.display()))?;
        if !a.json {
            print_out(&format!("wrote {}\n", out.display()))?;
        }
    }
    if report.nothing_passes {
        return Err(NoVerdict(format!(
            "no verdict: no policy meets {} even at the lowest load ({:.3} req/s); loosen --slo-p99-s, add --destinations, or lower --qps",
            report.simulated.slo.label(),
            report.simulated.ladder_qps[0]
        ))
        .into());
    }
    Ok(())
}

/// Write to stdout; a closed pipe (`advise … | head`) is not an error.
fn print_out(s: &str) -> Result<()> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing stdout"),
        _ => Ok(()),
    }
}
