//! `cacheroute trace gen|import|stats`: generate synthetic traffic, import public traces, and
//! describe a trace (including the reuse diagnostic). A thin layer over `workload::*`;
//! outputs are written to a temporary sibling and renamed, so a failure leaves nothing behind.

use crate::workload::gen::{ArrivalSpec, DriftConfig, GeneratorConfig, KeyDist, Whales, Workload};
use crate::workload::import::{self, AzureOptions};
use crate::workload::rates;
use crate::workload::stats::{self, StatsOptions};
use crate::workload::trace::{ReaderOptions, TraceReader, TraceRecord, TraceWriter};
use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum TraceCmd {
    /// Generate a synthetic trace (default: the paper workload, 128,824 keys, σ = 1.648).
    Gen(Box<GenArgs>),
    /// Convert a Mooncake JSONL, an Azure LLM inference CSV or a `key,rate` CSV into a trace.
    Import(Box<ImportArgs>),
    /// Describe a trace: size, rate, key skew, burstiness, lengths, and the reuse diagnostic.
    Stats(StatsArgs),
}

#[derive(Args, Debug)]
pub struct ReadArgs {
    /// Keyless (Mooncake) lines get a key from their first N block ids (0: a missing key is an error).
    #[arg(long, default_value_t = 2)]
    pub key_blocks: usize,
    /// Skip malformed or invalid lines (counted and reported) instead of failing.
    #[arg(long)]
    pub skip_bad: bool,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:
  cacheroute trace gen --qps 100 --duration 300 -o paper.jsonl          # the paper workload
  cacheroute trace gen --config shape.yaml --qps 20 --duration 600 -o mine.jsonl")]
pub struct GenArgs {
    /// Output trace (JSONL).
    #[arg(short, long)]
    pub out: PathBuf,
    /// YAML generator config (the same shape as an experiment spec's `workload:` section);
    /// flags below override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Total requests per second.
    #[arg(long, default_value_t = 100.0)]
    pub qps: f64,
    /// Seconds of traffic.
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,
    /// Seed of the keys, lengths and arrivals; same seed, same trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Number of keys.
    #[arg(long)]
    pub keys: Option<usize>,
    /// Lognormal σ of key rates.
    #[arg(long, conflicts_with_all = ["zipf", "rates_csv"])]
    pub sigma: Option<f64>,
    /// Zipf exponent of key rates.
    #[arg(long, conflicts_with = "rates_csv")]
    pub zipf: Option<f64>,
    /// Relative key rates from a `key,rate[,prefix_tokens]` CSV.
    #[arg(long)]
    pub rates_csv: Option<PathBuf>,
    /// Number of whale keys …
    #[arg(long, requires = "whale_share")]
    pub whales: Option<usize>,
    /// … carrying this share of all traffic together.
    #[arg(long, requires = "whales")]
    pub whale_share: Option<f64>,
    /// Tokens per prefix-hash block (16 vLLM-like, 512 Mooncake-like).
    #[arg(long = "block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// Arrival process.
    #[arg(long, value_enum)]
    pub arrivals: Option<ArrivalArg>,
    /// Coefficient of variation for gamma arrivals.
    #[arg(long, default_value_t = 1.9)]
    pub cv: f64,
    /// Gap source for bootstrap/replay arrivals: an Azure CSV (`.csv`) or a JSONL trace.
    #[arg(long)]
    pub arrivals_from: Option<PathBuf>,
    /// Block length (gaps) of the moving-block bootstrap.
    #[arg(long, default_value_t = 32)]
    pub bootstrap_block: usize,
    /// Lognormal random-walk σ of key rates per interval …
    #[arg(long, requires = "drift_intervals")]
    pub drift_sigma: Option<f64>,
    /// … over this many equal intervals.
    #[arg(long, requires = "drift_sigma")]
    pub drift_intervals: Option<u32>,
    /// Also write the generator's expected per-key rates (start of run) as a `key,rate` CSV.
    #[arg(long)]
    pub rates_out: Option<PathBuf>,
    /// Print the effective config as YAML and exit.
    #[arg(long)]
    pub print_config: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum ArrivalArg {
    Poisson,
    Gamma,
    Constant,
    Bootstrap,
    Replay,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum ImportFormat {
    Mooncake,
    Azure,
    Rates,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:
  cacheroute trace import --format mooncake conversation_trace.jsonl -o conv.jsonl
  cacheroute trace import --format rates data/paper-rates.csv --qps 100 -o paper.jsonl")]
pub struct ImportArgs {
    /// Input format.
    #[arg(long, value_enum)]
    pub format: ImportFormat,
    /// Input file.
    pub file: PathBuf,
    /// Output trace (JSONL).
    #[arg(short, long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub read: ReadArgs,
    /// Azure: number of synthesized keys.
    #[arg(long, default_value_t = 1000)]
    pub keys: usize,
    /// Azure: lognormal σ of synthesized key popularity.
    #[arg(long, default_value_t = 1.648)]
    pub sigma: f64,
    /// Azure: tokens of each request's prompt that are its key's shared prefix.
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: u32,
    /// Azure / rates: tokens per prefix-hash block.
    #[arg(long = "block-tokens", alias = "block-size", default_value_t = 16)]
    pub block_size: u32,
    /// Rates: seed of the arrivals and lengths.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Rates: total requests per second of the generated trace.
    #[arg(long, default_value_t = 100.0)]
    pub qps: f64,
    /// Rates: seconds of traffic.
    #[arg(long, default_value_t = 600.0)]
    pub duration: f64,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:
  cacheroute trace stats paper.jsonl
  cacheroute trace stats conv.jsonl --destinations 8      # reuse as one of 8 replicas sees it")]
pub struct StatsArgs {
    /// Trace file (JSONL; Mooncake files load as they are).
    pub file: PathBuf,
    #[command(flatten)]
    pub read: ReadArgs,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Reuse windows T, seconds.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1.0, 10.0, 60.0, 300.0, 1800.0])]
    pub windows: Vec<f64>,
    /// Destinations R for the cache-blind spreading view.
    #[arg(long, default_value_t = 30)]
    pub destinations: u32,
    /// Tokens per prefix-hash block (default: inferred from the first records).
    #[arg(long = "block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// Seed of the spreading assignment.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

pub fn run(cmd: TraceCmd) -> anyhow::Result<()> {
    match cmd {
        TraceCmd::Gen(a) => run_gen(*a),
        TraceCmd::Import(a) => run_import(*a),
        TraceCmd::Stats(a) => run_stats(a),
    }
}

/// A file written through a temporary sibling and renamed into place on `commit`; dropped
/// uncommitted, the temporary is removed.
struct AtomicOut {
    tmp: PathBuf,
    path: PathBuf,
    w: Option<BufWriter<std::fs::File>>,
}

impl AtomicOut {
    fn create(path: &Path) -> anyhow::Result<Self> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let name = path.file_name().and_then(|s| s.to_str()).unwrap_or("out");
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        let f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        Ok(AtomicOut {
            tmp,
            path: path.to_path_buf(),
            w: Some(BufWriter::with_capacity(1 << 20, f)),
        })
    }

    fn writer(&mut self) -> &mut BufWriter<std::fs::File> {
        self.w.as_mut().expect("open")
    }

    fn commit(mut self) -> anyhow::Result<()> {
        let w = self.w.take().expect("open");
        let f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", self.tmp.display()))?;
        f.sync_all().ok();
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("renaming into {}", self.path.display()))?;
        Ok(())
    }
}

impl Drop for AtomicOut {
    fn drop(&mut self) {
        if self.w.is_some() {
            self.w = None;
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Write records to `out` atomically; returns (count, last timestamp ms).
fn write_records<E>(
    out: &Path,
    records: impl Iterator<Item = Result<TraceRecord, E>>,
) -> anyhow::Result<(u64, f64)>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let mut f = AtomicOut::create(out)?;
    let mut w = TraceWriter::new(f.writer());
    let mut last = 0.0;
    for r in records {
        let r = r?;
        last = r.timestamp_ms;
        w.write(&r)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    let n = w.written() as u64;
    drop(w);
    if n == 0 {
        bail!("no requests to write; {} was not created", out.display());
    }
    f.commit()?;
    Ok((n, last))
}

fn gen_config(a: &GenArgs) -> anyhow::Result<GeneratorConfig> {
    let mut cfg = match &a.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            yaml_serde::from_str::<GeneratorConfig>(&text)
                .with_context(|| format!("{}: not a valid workload config", p.display()))?
                .relative_to(super::config_dir(p))
        }
        None => GeneratorConfig::paper(),
    };
    if let Some(n) = a.keys {
        cfg.keys.count = n;
    }
    if let Some(s) = a.sigma {
        cfg.keys.dist = KeyDist::Lognormal { sigma: s };
    }
    if let Some(e) = a.zipf {
        cfg.keys.dist = KeyDist::Zipf { exponent: e };
    }
    if let Some(p) = &a.rates_csv {
        cfg.keys.dist = KeyDist::Csv { path: p.clone() };
    }
    if let (Some(count), Some(share)) = (a.whales, a.whale_share) {
        cfg.keys.whales = Some(Whales { count, share });
    }
    if let Some(b) = a.block_size {
        cfg.prefix.block_size = b;
    }
    if let Some(kind) = a.arrivals {
        let from = || {
            a.arrivals_from.clone().context(
                "--arrivals bootstrap/replay needs --arrivals-from FILE (Azure CSV or JSONL trace)",
            )
        };
        cfg.arrivals = match kind {
            ArrivalArg::Poisson => ArrivalSpec::Poisson,
            ArrivalArg::Gamma => ArrivalSpec::Gamma { cv: a.cv },
            ArrivalArg::Constant => ArrivalSpec::Constant,
            ArrivalArg::Bootstrap => ArrivalSpec::Bootstrap {
                from: from()?,
                block: a.bootstrap_block,
            },
            ArrivalArg::Replay => ArrivalSpec::Replay { from: from()? },
        };
    }
    if let (Some(sigma), Some(intervals)) = (a.drift_sigma, a.drift_intervals) {
        cfg.drift = Some(DriftConfig { sigma, intervals });
    }
    Ok(cfg)
}

fn run_gen(a: GenArgs) -> anyhow::Result<()> {
    let cfg = gen_config(&a)?;
    if a.print_config {
        print!("{}", yaml_serde::to_string(&cfg)?);
        return Ok(());
    }
    super::check_run_size(a.qps, a.duration)?;
    let wl = Workload::load(&cfg)?;
    let gen = wl.generate(a.qps, a.duration, a.seed)?;
    let (n, last) = write_records(&a.out, gen.map(Ok::<_, std::io::Error>))?;
    let rates: Vec<f64> = wl.key_weights(a.seed).iter().map(|w| w * a.qps).collect();
    let e = stats::skew_of_rates(&rates);
    println!(
        "wrote {n} requests over {:.1} s ({:.2} QPS) to {}",
        last / 1000.0,
        n as f64 / a.duration,
        a.out.display()
    );
    println!(
        "expected per-key rates (generator, not sampled counts): {} keys, gini {:.3}, top-4% share {:.1}%, largest key {:.3}%",
        e.keys,
        e.gini,
        e.top4pct_share * 100.0,
        e.largest_key_share * 100.0
    );
    if let Some(wh) = &cfg.keys.whales {
        let n = wh.count.min(rates.len());
        let total: f64 = rates.iter().sum();
        println!(
            "whales: {n} keys carry {:.2}% of expected traffic (configured {:.2}%)",
            100.0 * rates[..n].iter().sum::<f64>() / total.max(f64::MIN_POSITIVE),
            100.0 * wh.share
        );
    }
    if let Some(p) = &a.rates_out {
        let mut buf = Vec::new();
        rates::write_rates_csv(&mut buf, &wl.expected_rates(a.qps, a.seed))?;
        super::write_atomic(p, &buf)?;
        println!("wrote expected per-key rates to {}", p.display());
    }
    Ok(())
}

fn open(path: &Path) -> anyhow::Result<BufReader<std::fs::File>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    Ok(BufReader::with_capacity(1 << 20, f))
}

fn reader_opts(r: &ReadArgs) -> ReaderOptions {
    ReaderOptions {
        key_blocks: r.key_blocks,
        skip_bad: r.skip_bad,
    }
}

fn report_skipped<R: BufRead>(rd: &TraceReader<R>) {
    if rd.skipped() > 0 {
        eprintln!("skipped {} bad line(s); first:", rd.skipped());
        for (line, e) in rd.first_skipped() {
            eprintln!("  line {line}: {e}");
        }
    }
}

fn run_import(a: ImportArgs) -> anyhow::Result<()> {
    let input = a.file.display().to_string();
    let (n, last) = match a.format {
        ImportFormat::Mooncake => {
            let mut rd = TraceReader::new(open(&a.file)?, reader_opts(&a.read));
            let res = write_records(&a.out, rd.by_ref()).with_context(|| input.clone());
            report_skipped(&rd);
            res?
        }
        ImportFormat::Azure => {
            let opts = AzureOptions {
                keys: a.keys,
                sigma: a.sigma,
                prefix_tokens: a.prefix_tokens,
                block_size: a.block_size,
                seed: a.seed,
            };
            let rows = import::read_azure(open(&a.file)?);
            write_records(&a.out, import::azure_records(rows, &opts))
                .with_context(|| input.clone())?
        }
        ImportFormat::Rates => {
            let mut cfg = GeneratorConfig::paper();
            cfg.keys.dist = KeyDist::Csv {
                path: a.file.clone(),
            };
            cfg.prefix.block_size = a.block_size;
            super::check_run_size(a.qps, a.duration)?;
            let wl = Workload::load(&cfg).map_err(|e| match e {
                // The file is this command's argument, not a config field: name it as given.
                crate::workload::gen::GenError::Rates { path, source } => {
                    anyhow::anyhow!("{}: {source}", path.display())
                }
                e => e.into(),
            })?;
            let gen = wl.generate(a.qps, a.duration, a.seed)?;
            write_records(&a.out, gen.map(Ok::<_, std::io::Error>))?
        }
    };
    println!(
        "imported {n} requests over {:.1} s from {input} to {}",
        last / 1000.0,
        a.out.display()
    );
    Ok(())
}

fn run_stats(a: StatsArgs) -> anyhow::Result<()> {
    let opts = StatsOptions {
        windows_s: a.windows.clone(),
        destinations: a.destinations,
        block_size: a.block_size,
        seed: a.seed,
    };
    if a.windows.iter().any(|w| !(w.is_finite() && *w >= 0.0)) {
        bail!("--windows: every window must be a number of seconds ≥ 0");
    }
    if a.destinations == 0 {
        bail!("--destinations must be ≥ 1");
    }
    let mut rd = TraceReader::new(open(&a.file)?, reader_opts(&a.read));
    let res = stats::compute(rd.by_ref(), &opts).with_context(|| a.file.display().to_string());
    report_skipped(&rd);
    let s = res?;
    let mut out = std::io::stdout().lock();
    if a.json {
        let mut v = serde_json::to_value(&s)?;
        v["skipped_lines"] = rd.skipped().into();
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        writeln!(out, "{}", a.file.display())?;
        write!(out, "{}", stats::render(&s))?;
        if rd.skipped() > 0 {
            writeln!(out, "skipped lines        {}", rd.skipped())?;
        }
    }
    Ok(())
}
