//! `cacheroute advise`: will affinity pay on this traffic? From a user's trace (or a
//! `key,rate[,prefix_tokens]` CSV), a fleet and an SLO: the reuse diagnostic
//! (`analysis::advise::diagnose` over `workload::stats`), a small paired-seed study around the
//! user's load on the simulator (every policy, a ladder of load multipliers, each step
//! simulated and measured by `step::simulate_step` exactly as a study step is), and the
//! verdict (`analysis::advise::verdicts`). Rules and formulas: `docs/advise.md`.
//!
//! What is simulated is bounded so a 1M-request trace is advised on in well under a minute:
//! each step lasts at most [`MAX_DURATION_S`] and the top step simulates at most
//! `max_requests` requests, so a high-rate trace is shortened (the first requests of the trace
//! are used) and the report says so.

use super::inputs::generated_inputs;
use super::step::{simulate_step, SimStep};
use crate::analysis::advise::{
    self as rule, AdviseReport, DiagnosticInput, DispatchChoice, Simulated,
};
use crate::analysis::capacity::{capacity, passes};
use crate::analysis::knee::{self, KneeGrid, PROBE_STEP_BASE};
use crate::analysis::model::Censoring;
use crate::analysis::model::{RunKey, Slo, StepRecord};
use crate::engine::{engine_config, EngineConfig, KnobOverrides};
use crate::plan::KeyLoad;
use crate::policy::calibrate::WarmStart;
use crate::policy::PolicySpec;
use crate::workload::arrivals::{ArrivalKind, Arrivals};
use crate::workload::gen::{GeneratorConfig, KeyDist, Workload};
use crate::workload::stats::{self, StatsOptions, TraceStats};
use crate::workload::trace::parts::{self, PartsError};
use crate::workload::trace::{ReaderOptions, TraceReader, TraceRecord};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The default ladder: load multipliers 2^(k/3), k = −3…3 (0.5× to 2× of the user's load).
pub const DEFAULT_MULTIPLIERS: [f64; 7] = [0.5, 0.63, 0.794, 1.0, 1.26, 1.587, 2.0];
/// Longest simulated step (warm-up included), seconds.
pub const MAX_DURATION_S: f64 = 1800.0;
/// The studies' warm-up, seconds: used when the request budget allows (and the floors do not
/// ask for more).
pub const MAX_WARMUP_S: f64 = 60.0;
/// Shortest warm-up, seconds.
pub const MIN_WARMUP_S: f64 = 10.0;
/// The studies' measured window, seconds: the least measured when the budget allows.
pub const STUDY_MEASURE_S: f64 = 180.0;
/// Requests the 1× step should measure when the budget allows (a p99 from 10,000 requests
/// rests on its 100 slowest).
pub const MEASURE_TARGET_REQUESTS: f64 = 10_000.0;
/// Gaps per block of the moving-block bootstrap of a trace's arrivals (seeds ≥ 2), as in
/// `experiments/burstiness-bootstrap.yaml`.
pub const BOOTSTRAP_BLOCK: usize = 32;
/// Fewest requests the lowest step may measure; fewer make its p99 meaningless.
pub const MIN_MEASURED_REQUESTS: f64 = 100.0;
/// Seeds when none are given.
pub const DEFAULT_SEEDS: u64 = 3;
/// Default bound on the requests of the whole study when the seeds are not given.
pub const DEFAULT_BUDGET_REQUESTS: u64 = 3_000_000;
/// Default cap on the requests of the top step.
pub const DEFAULT_MAX_REQUESTS: usize = 60_000;
/// Shortest measured window, seconds.
pub const MIN_MEASURE_S: f64 = 10.0;
/// Longest warm-up, seconds, however long the requests.
pub const MAX_LONG_WARMUP_S: f64 = 600.0;
/// Default prefix-cache granularity of the simulation, tokens: finer trace blocks are merged
/// into blocks of this size (as the studies use 64-token blocks).
pub const DEFAULT_CACHE_BLOCK: u32 = 64;

/// The workload advised on.
#[derive(Debug, Clone)]
pub enum Input {
    /// A JSONL trace (Mooncake files load as they are).
    Trace { path: PathBuf, read: ReaderOptions },
    /// A `key,rate[,prefix_tokens]` CSV; requests are generated from it with `generator`'s
    /// prefix structure and arrivals (its key distribution is replaced by the CSV).
    Rates {
        path: PathBuf,
        generator: Box<GeneratorConfig>,
    },
}

/// How to advise.
#[derive(Debug, Clone)]
pub struct Options {
    pub input: Input,
    /// Engine spec `model:gpu:precision:tpN` (as `simulate` and study specs name it).
    pub engine: String,
    pub replicas: usize,
    pub slo: Slo,
    /// The user's load (the ladder's 1×); default the trace's mean rate or the rates' sum.
    pub qps: Option<f64>,
    /// Ladder of load multipliers, increasing.
    pub multipliers: Vec<f64>,
    /// Paired seeds; `None`: [`DEFAULT_SEEDS`], fewer when seed 1 alone simulated so many
    /// requests that more would exceed `budget_requests`.
    pub seeds: Option<u64>,
    /// Most requests all seeds may simulate together when the seeds are not given, judged by
    /// what seed 1 simulated.
    pub budget_requests: u64,
    /// Most requests the top step simulates.
    pub max_requests: usize,
    /// Tokens per block of the trace's `hash_ids` (default: inferred, or the generator's).
    pub block_size: Option<u32>,
    /// Smallest block of the simulated prefix cache, tokens: finer trace blocks are merged
    /// ([`crate::workload::trace::coarsen_hash_ids`]); 1 keeps the trace's own.
    pub cache_block: u32,
    /// Longest request (prompt + output tokens) the engine accepts, when it has such a limit.
    pub max_model_len: Option<u32>,
    /// KV cache of each replica in bytes, as a spec's `knobs.kv_cache_bytes` (`None`: the
    /// engine model's own for the device).
    pub kv_cache_bytes: Option<f64>,
    /// Worker threads (0 = one per core).
    pub threads: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Trace files at least this large are read by two threads ([`PARALLEL_READ_BYTES`]).
    pub parallel_read_bytes: u64,
    /// Relative resolution each seed's knee is located to by bisection between its last
    /// passing and first failing ladder step (`analysis::knee`); `None`: the ladder's steps.
    pub refine: Option<f64>,
}

/// The policies every advise compares, by name (each with its default configuration as the
/// code defines it).
pub const POLICIES: [&str; 6] = [
    "flat-lb",
    "sticky",
    "chwbl",
    "dualmap",
    "preble",
    "cacheroute",
];

/// [`POLICIES`], costliest to simulate first.
const COST_ORDER: [&str; 6] = [
    "preble",
    "cacheroute",
    "dualmap",
    "flat-lb",
    "sticky",
    "chwbl",
];

/// Every problem of the options, each naming its flag.
pub fn option_problems(o: &Options) -> Vec<String> {
    use crate::bounds::{self, count, positive};
    let mut p = Vec::new();
    p.extend(count(
        "--destinations",
        o.replicas as u64,
        1,
        bounds::MAX_REPLICAS,
    ));
    p.extend(positive("--slo-p99-s", o.slo.p99_s, bounds::MAX_INTERVAL_S));
    if let Some(n) = o.seeds {
        p.extend(count("--seeds", n, 1, bounds::MAX_SEEDS));
    }
    p.extend(count(
        "--budget-requests",
        o.budget_requests,
        1000,
        u64::MAX / 2,
    ));
    if let Some(q) = o.qps {
        p.extend(positive("--qps", q, bounds::MAX_QPS));
    }
    if let Some(b) = o.kv_cache_bytes {
        // At most 1 PB per replica.
        p.extend(positive("--kv-cache-bytes", b, 1e15));
    }
    p.extend(count(
        "--max-requests",
        o.max_requests as u64,
        1000,
        bounds::MAX_REQUESTS as u64,
    ));
    if o.multipliers.is_empty() {
        p.push("--ladder: give at least one load multiplier, e.g. 0.5,1,2".into());
    }
    for (i, m) in o.multipliers.iter().enumerate() {
        p.extend(positive(&format!("--ladder[{i}]"), *m, 1000.0));
        if i > 0 && *m <= o.multipliers[i - 1] {
            p.push(format!(
                "--ladder: multipliers must increase ({} then {m})",
                o.multipliers[i - 1]
            ));
        }
    }
    if let Some(b) = o.block_size {
        p.extend(count("--block-tokens", b as u64, 1, 1 << 20));
    }
    p.extend(count("--cache-block", o.cache_block as u64, 1, 1 << 16));
    if let Some(r) = o.refine {
        if !(r > 0.0 && r < 1.0) {
            p.push(format!(
                "--refine: {r} is not a relative resolution; give a fraction between 0 and 1, e.g. 0.05 for 5%"
            ));
        }
    }
    p
}

/// What a request needs of one replica, and whether it fits.
struct Fit {
    kv_tokens: u64,
    max_model_len: Option<u32>,
    engine: String,
}

impl Fit {
    fn problem(&self, r: &TraceRecord) -> Option<String> {
        let need = r.input_length.max(1) as u64 + r.output_length.max(1) as u64 - 1;
        if let Some(m) = self.max_model_len {
            if r.input_length as u64 + r.output_length as u64 > m as u64 {
                return Some(format!(
                    "input_length {} + output_length {} = {} tokens exceeds --max-model-len {m}; drop such requests from the trace or serve a longer-context configuration",
                    r.input_length,
                    r.output_length,
                    r.input_length as u64 + r.output_length as u64
                ));
            }
        }
        (need > self.kv_tokens).then(|| {
            format!(
                "input_length {} + output_length {} needs {need} tokens of KV cache, more than one {} replica holds ({} tokens); choose a larger --engine (more GPUs per replica with tpN, fp8, a bigger GPU) or drop such requests",
                r.input_length, r.output_length, self.engine, self.kv_tokens
            )
        })
    }
}

/// Streams a trace into the statistics while checking that every request fits one replica.
struct Checked<'a, R: BufRead> {
    rd: &'a mut TraceReader<R>,
    fit: &'a Fit,
}

impl<R: BufRead> Iterator for Checked<'_, R> {
    type Item = Result<TraceRecord>;
    fn next(&mut self) -> Option<Result<TraceRecord>> {
        match self.rd.next()? {
            Err(e) => Some(Err(e.into())),
            Ok(r) => match self.fit.problem(&r) {
                Some(p) => Some(Err(anyhow::anyhow!("line {}: {p}", self.rd.line()))),
                None => Some(Ok(r)),
            },
        }
    }
}

/// The workload of the study: the excerpt of a trace with a unit-rate timeline per seed, or a
/// generated workload.
enum Source {
    Trace {
        excerpt: Arc<Vec<TraceRecord>>,
        /// Per seed: arrival times (s) at 1 request/s, one per excerpt record.
        unit: HashMap<u64, Arc<Vec<f64>>>,
    },
    Rates(Box<Workload>),
}

/// Everything the ladder needs, prepared once.
struct Prepared {
    source: Source,
    engine: EngineConfig,
    whole: TraceStats,
    key_shares: Vec<f64>,
    base_qps: f64,
    warmup_s: f64,
    measure_s: f64,
    cuts: Vec<String>,
    input_words: String,
    input_requests: u64,
    input_span_s: f64,
    input_qps: f64,
    requests_used: u64,
    seed_variation: String,
    /// The records diagnosed, at the user's load (model time from 0).
    diagnosed: Vec<TraceRecord>,
    /// Paired seeds the inputs are prepared for, 1…seeds.
    seeds: u64,
}

/// The engine knobs the options give.
fn knobs(o: &Options) -> KnobOverrides {
    KnobOverrides {
        kv_cache_bytes: o.kv_cache_bytes,
        ..KnobOverrides::default()
    }
}

/// Run the advice: diagnostic, simulated A/B, verdict.
pub fn advise(o: &Options) -> Result<AdviseReport> {
    let problems = option_problems(o);
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    let probe =
        engine_config(&o.engine, 16, &knobs(o)).map_err(|e| anyhow::anyhow!("--engine: {e}"))?;
    let fit = Fit {
        kv_tokens: probe.kv_capacity_tokens(),
        max_model_len: o.max_model_len,
        engine: o.engine.clone(),
    };
    let p = match &o.input {
        Input::Trace { path, read } => prepare_trace(o, path, read, &fit)?,
        Input::Rates { path, generator } => prepare_rates(o, path, generator, &fit)?,
    };
    let ladder: Vec<f64> = o.multipliers.iter().map(|m| m * p.base_qps).collect();
    // The diagnostic: residence time from the whole input's mean request, reuse within it over
    // the diagnosed span at the user's load.
    let t_res = residence(&p.engine, p.base_qps, o.replicas, &p.whole);
    let span_s = p.diagnosed.last().map_or(0.0, |r| r.timestamp_ms / 1000.0);
    let opts = StatsOptions {
        windows_s: rule::reuse_windows(t_res, span_s).to_vec(),
        destinations: o.replicas.min(u32::MAX as usize) as u32,
        block_size: Some(p.engine.knobs().hash_block_tokens),
        seed: 1,
    };
    let span_stats = stats::compute_records(&p.diagnosed, &opts);
    let diagnostic = rule::diagnose(&DiagnosticInput {
        load_qps: p.base_qps,
        replicas: o.replicas,
        engine: &p.engine,
        whole: &p.whole,
        span: &span_stats,
        key_shares: &p.key_shares,
    });
    // Seed 1 first; then, unless the seeds are given, as many more (up to DEFAULT_SEEDS) as fit
    // in the request budget at seed 1's own cost.
    let mut cuts = p.cuts.clone();
    let first = if o.seeds.is_some() { p.seeds } else { 1 };
    let mut ran = run_ladder(o, &p, &ladder, 1..=first)?;
    let mut seeds = first;
    if o.seeds.is_none() {
        let per_seed = ran.requests.max(1);
        let extra = (o.budget_requests.saturating_sub(per_seed) / per_seed).min(p.seeds - 1);
        if extra > 0 {
            ran.extend(run_ladder(o, &p, &ladder, 2..=1 + extra)?);
        }
        seeds = 1 + extra;
        if seeds < p.seeds {
            cuts.push(format!(
                "{seeds} seed(s) instead of {}: one seed simulated {:.2}M requests and --budget-requests is {:.2}M (pass --seeds {} to run them all)",
                p.seeds,
                per_seed as f64 / 1e6,
                o.budget_requests as f64 / 1e6,
                p.seeds
            ));
        }
    }
    let labels: Vec<String> = POLICIES.iter().map(|s| s.to_string()).collect();
    let baselines: Vec<String> = labels
        .iter()
        .filter(|l| *l != rule::CACHEROUTE)
        .cloned()
        .collect();
    let summary = crate::analysis::summarize_study(&[o.slo], &labels, &baselines, &ran.steps, &[]);
    let comparisons = rule::verdicts(&summary, &ladder);
    Ok(AdviseReport {
        simulated: Simulated {
            input: p.input_words.clone(),
            input_requests: p.input_requests,
            input_span_s: p.input_span_s,
            input_qps: p.input_qps,
            load_qps: p.base_qps,
            engine: o.engine.clone(),
            replicas: o.replicas,
            slo: o.slo,
            ladder_multipliers: o.multipliers.clone(),
            ladder_qps: ladder.clone(),
            seeds: (1..=seeds).collect(),
            seed_variation: p.seed_variation.clone(),
            warmup_s: p.warmup_s,
            measure_s: p.measure_s,
            requests_used: p.requests_used,
            cuts,
            steps_simulated: ran.simulated,
            steps_skipped: ran.skipped,
            knee_probes: ran.probes,
            refine: o.refine,
            requests_simulated: ran.requests,
            policies: labels,
            diagnosed_span_s: span_s,
            diagnosed_requests: p.diagnosed.len() as u64,
        },
        facts: rule::driving_facts(&diagnostic),
        diagnostic,
        policies: rule::policy_rows(&summary, &o.slo, p.base_qps),
        comparisons,
        nothing_passes: rule::nothing_passes(&summary),
        everything_passes: rule::everything_passes(&summary),
        dispatch: ran.dispatch,
    })
}

/// Warm-up and measured window of every step, and what was shortened or lengthened, in words.
///
/// - Warm-up: at least twice a long request's service time (`long_s`: the requests in flight
///   reach steady state) and [`MIN_WARMUP_S`]; wanted: also the cache residence time at 1×
///   (`t_res_s`: caches full, so evictions happen as they will), at most
///   [`MAX_LONG_WARMUP_S`]; the studies' [`MAX_WARMUP_S`] when the budget allows more. A trace
///   too short for the wanted warm-up gets the floor, and the report says so.
/// - Measured: the studies' [`STUDY_MEASURE_S`], longer when the 1× step would measure fewer
///   than [`MEASURE_TARGET_REQUESTS`]; shortened to keep the top step within `max_requests`,
///   the step within [`MAX_DURATION_S`] and within the input (`limit_s`: how long a trace's
///   requests last at the top rate), never below [`MIN_MEASURE_S`].
///
/// The floors win over the request budget; an input too short for them is an error.
fn durations(
    o: &Options,
    base_qps: f64,
    top_qps: f64,
    limit_s: f64,
    long_s: f64,
    t_res_s: f64,
) -> Result<(f64, f64, Vec<String>)> {
    let budget_s = o.max_requests as f64 / top_qps;
    let floor = (2.0 * long_s).clamp(MIN_WARMUP_S, MAX_LONG_WARMUP_S);
    if floor + MIN_MEASURE_S > limit_s * (1.0 + 1e-9) {
        bail!(
            "the input's requests last only {limit_s:.0} s at the top step ({top_qps:.3} req/s), and a step needs at least {:.0} s ({floor:.0} s of warm-up, twice a long request's {long_s:.1} s or {MIN_WARMUP_S:.0} s, + {MIN_MEASURE_S:.0} s measured); lower the top --ladder multiplier or give a longer trace",
            floor + MIN_MEASURE_S
        );
    }
    let mut notes = Vec::new();
    let wanted = floor.max(t_res_s.min(MAX_LONG_WARMUP_S));
    let mut warmup = wanted.max(MAX_WARMUP_S.min(budget_s / 4.0));
    if warmup + MIN_MEASURE_S > limit_s {
        warmup = floor.max(limit_s - MIN_MEASURE_S);
        if warmup < wanted * (1.0 - 1e-9) {
            notes.push(format!(
                "warm-up cut to {warmup:.0} s (the input's requests last {limit_s:.0} s at the top step), shorter than the cache residence time (~{t_res_s:.0} s): caches are not yet full when measuring, which flatters cache-blind spreading"
            ));
        }
    }
    let want = STUDY_MEASURE_S.max(MEASURE_TARGET_REQUESTS / base_qps);
    let measure = want
        .min(budget_s - warmup)
        .min(MAX_DURATION_S - warmup)
        .min(limit_s - warmup)
        .max(MIN_MEASURE_S);
    let total = warmup + measure;
    if total > budget_s * (1.0 + 1e-9) {
        notes.push(format!(
            "steps last {total:.0} s ({warmup:.0} s warm-up), {:.0} requests at the top step, above --max-requests {}: the warm-up must cover the cache residence time (~{t_res_s:.0} s) and twice a long request's service time (~{long_s:.1} s) to measure a steady state",
            total * top_qps,
            o.max_requests
        ));
    } else if measure < want * (1.0 - 1e-9) {
        let why = if measure >= budget_s - warmup - 1e-9 {
            format!(
                "so the top step simulates at most {} requests (--max-requests)",
                o.max_requests
            )
        } else if measure >= limit_s - warmup - 1e-9 {
            "as long as the input's requests last at the top step".to_string()
        } else {
            format!("at most {MAX_DURATION_S:.0} s a step")
        };
        notes.push(format!(
            "measured window shortened to {measure:.0} s (from {want:.0} s) {why}"
        ));
    }
    Ok((warmup, measure, notes))
}

fn check_measured(o: &Options, base: f64, measure_s: f64, what: &str) -> Result<()> {
    let lowest = o.multipliers[0] * base;
    let n = lowest * measure_s;
    if n < MIN_MEASURED_REQUESTS {
        bail!(
            "{what}: only {n:.0} requests would be measured at the lowest step ({lowest:.3} req/s for {measure_s:.0} s), too few for a p99; give a longer trace, raise the lowest --ladder multiplier or --qps, or raise --max-requests"
        );
    }
    Ok(())
}

/// How many trace blocks make one simulated cache block, and the simulated block's tokens.
fn coarsening(block: u32, cache_block: u32) -> (usize, u32) {
    if block >= cache_block {
        (1, block)
    } else {
        let k = cache_block.div_ceil(block.max(1));
        (k as usize, k * block)
    }
}

/// The long-request service time of the whole input's lengths on `engine`.
fn long_s(engine: &EngineConfig, whole: &TraceStats) -> f64 {
    rule::long_request_s(
        engine,
        whole.input_length.p99,
        whole.output_length.p99,
        whole.input_length.mean,
        whole.output_length.mean,
    )
}

/// The cache residence time at the user's load, with the mean request of `whole`.
fn residence(engine: &EngineConfig, base: f64, replicas: usize, whole: &TraceStats) -> f64 {
    rule::residence_time_s(
        engine.kv_capacity_tokens() as f64,
        base,
        replicas,
        whole.input_length.mean,
        whole.output_length.mean,
    )
}

fn open_trace(
    path: &PathBuf,
    read: &ReaderOptions,
) -> Result<TraceReader<std::io::BufReader<std::fs::File>>> {
    let f = std::fs::File::open(path)
        .with_context(|| format!("--trace: cannot open {}", path.display()))?;
    Ok(TraceReader::new(
        std::io::BufReader::with_capacity(1 << 20, f),
        read.clone(),
    ))
}

/// Trace files at least this large are read by two threads, one half each.
pub const PARALLEL_READ_BYTES: u64 = 128 << 20;

/// Pass 1 over a trace: the whole trace's statistics (no reuse windows), every request checked
/// against the fleet, and the bad lines skipped (with `--skip-bad`). A large file is read in
/// two halves on two threads (`workload::trace::parts`: split at a line boundary; not with
/// `--skip-bad`, whose skipping of out-of-order lines needs the previous line) and the halves'
/// statistics joined ([`stats::StatsAcc::join`]); errors name the file's line either way.
fn whole_trace(
    o: &Options,
    path: &PathBuf,
    read: &ReaderOptions,
    fit: &Fit,
) -> Result<(TraceStats, usize)> {
    let opts = StatsOptions {
        windows_s: Vec::new(),
        destinations: o.replicas.min(u32::MAX as usize) as u32,
        block_size: o.block_size,
        seed: 1,
    };
    let threads = if o.threads > 0 {
        o.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    let size = std::fs::metadata(path)
        .with_context(|| format!("--trace: cannot open {}", path.display()))?
        .len();
    let split = if threads > 1 && !read.skip_bad && size >= o.parallel_read_bytes {
        parts::line_boundary(path, size / 2)
            .map_err(parts_error)?
            .filter(|&s| s < size)
    } else {
        None
    };
    let Some(split) = split else {
        let mut rd = open_trace(path, read)?;
        let s = stats::compute(Checked { rd: &mut rd, fit }, &opts)?;
        return Ok((s, rd.skipped()));
    };
    // Tokens per block from the first records, as `stats::compute` infers it.
    let block = match o.block_size {
        Some(b) => b,
        None => {
            let head: Vec<TraceRecord> = open_trace(path, read)?
                .take(4096)
                .collect::<std::result::Result<_, _>>()?;
            stats::infer_block_size(head.iter())
        }
    };
    let (mut acc, second) = parts::read_in_two(
        path,
        read,
        split,
        size,
        || stats::StatsAcc::new(opts.clone(), block),
        |acc, r| match fit.problem(r) {
            Some(p) => Err(p),
            None => {
                acc.add(r);
                Ok(())
            }
        },
    )
    .map_err(parts_error)?;
    acc.join(second);
    Ok((acc.finish(), 0))
}

/// An error of reading the trace in halves, as one read of it reports it: the file is the one
/// `--trace` names, and a request that does not fit is named by its line.
fn parts_error(e: PartsError) -> anyhow::Error {
    match e {
        PartsError::Open { path, source } => {
            anyhow::Error::new(source).context(format!("--trace: cannot open {}", path.display()))
        }
        PartsError::Io(e) => e.into(),
        PartsError::Trace(e) => e.into(),
        PartsError::Refused { line, msg } => anyhow::anyhow!("line {line}: {msg}"),
    }
}

fn prepare_trace(o: &Options, path: &PathBuf, read: &ReaderOptions, fit: &Fit) -> Result<Prepared> {
    // Pass 1: the whole trace's statistics (no reuse windows: sizes, skew, lengths,
    // burstiness), every request checked against the fleet.
    let (whole, bad_lines) =
        whole_trace(o, path, read, fit).with_context(|| format!("trace {}", path.display()))?;
    if whole.requests < 3 || whole.duration_s <= 0.0 {
        bail!(
            "trace {}: {} request(s) over {:.3} s — a rate needs at least three requests at different times",
            path.display(),
            whole.requests,
            whole.duration_s
        );
    }
    let base = o.qps.unwrap_or(whole.mean_qps);
    let (k, block) = coarsening(o.block_size.unwrap_or(whole.block_size), o.cache_block);
    let engine =
        engine_config(&o.engine, block, &knobs(o)).map_err(|e| anyhow::anyhow!("--engine: {e}"))?;
    let top = o.multipliers.last().copied().unwrap_or(1.0) * base;
    let limit_s = (whole.requests - 1) as f64 / top;
    let t_res = residence(&engine, base, o.replicas, &whole);
    let (warmup_s, measure_s, mut cuts) =
        durations(o, base, top, limit_s, long_s(&engine, &whole), t_res)
            .with_context(|| format!("trace {}", path.display()))?;
    check_measured(o, base, measure_s, &format!("trace {}", path.display()))?;
    // Pass 2: the excerpt, the first requests, enough for the top step (and spanning some
    // time: a trace quantized to seconds can start with many requests at one instant), in
    // simulated cache blocks.
    let want = ((top * (warmup_s + measure_s)).ceil() as usize + 1).min(whole.requests as usize);
    let mut excerpt: Vec<TraceRecord> = Vec::with_capacity(want);
    for r in open_trace(path, read)? {
        let mut r = r.with_context(|| format!("trace {}", path.display()))?;
        if excerpt.len() >= want && r.timestamp_ms > excerpt[0].timestamp_ms {
            break;
        }
        r.hash_ids = crate::workload::trace::coarsen_hash_ids(&r.hash_ids, k);
        excerpt.push(r);
    }
    let n_ex = excerpt.len();
    let t0 = excerpt[0].timestamp_ms;
    let span_ms = excerpt[n_ex - 1].timestamp_ms - t0;
    if span_ms <= 0.0 {
        bail!(
            "trace {}: its first {n_ex} requests share one timestamp; nothing to rescale",
            path.display()
        );
    }
    if (n_ex as u64) < whole.requests {
        cuts.insert(
            0,
            format!(
                "used the first {n_ex} of {} requests ({:.0} s of {:.0} s of the trace)",
                whole.requests,
                span_ms / 1000.0,
                whole.duration_s
            ),
        );
    }
    if k > 1 {
        cuts.push(format!(
            "prefix reuse simulated in blocks of {block} tokens (the trace's {}-token blocks merged {k} by {k}), as the studies do",
            block / k as u32
        ));
    }
    // Unit-rate timelines: seed 1 replays the trace's own arrival times; later seeds bootstrap
    // its gaps in blocks (rescaled to the same span).
    let native = (n_ex - 1) as f64 / (span_ms / 1000.0);
    let mut unit = HashMap::new();
    unit.insert(
        1,
        Arc::new(
            excerpt
                .iter()
                .map(|r| (r.timestamp_ms - t0) / 1000.0 * native)
                .collect::<Vec<f64>>(),
        ),
    );
    let gaps: Arc<[f64]> = excerpt
        .windows(2)
        .map(|w| (w[1].timestamp_ms - w[0].timestamp_ms) / 1000.0)
        .collect();
    let seeds = o.seeds.unwrap_or(DEFAULT_SEEDS);
    for seed in 2..=seeds {
        let mut a = Arrivals::new(
            ArrivalKind::Gaps {
                gaps: gaps.clone(),
                block: Some(BOOTSTRAP_BLOCK),
            },
            1.0,
            crate::rng::derive(seed, "advise/bootstrap"),
        )?;
        let mut t = 0.0;
        let mut v = Vec::with_capacity(n_ex);
        for i in 0..n_ex {
            if i > 0 {
                t += a.next_gap();
            }
            v.push(t);
        }
        let scale = (n_ex - 1) as f64 / t.max(f64::MIN_POSITIVE);
        for x in v.iter_mut() {
            *x *= scale;
        }
        unit.insert(seed, Arc::new(v));
    }
    let diagnosed: Vec<TraceRecord> = excerpt
        .iter()
        .zip(unit[&1].iter())
        .map(|(r, u)| TraceRecord {
            timestamp_ms: u / base * 1000.0,
            ..r.clone()
        })
        .collect();
    let n = whole.requests as f64;
    let key_shares = whole.key_counts.iter().map(|&c| c as f64 / n).collect();
    let skipped = if bad_lines > 0 {
        format!(", {bad_lines} bad line(s) skipped")
    } else {
        String::new()
    };
    Ok(Prepared {
        source: Source::Trace {
            excerpt: Arc::new(excerpt),
            unit,
        },
        engine,
        key_shares,
        base_qps: base,
        warmup_s,
        measure_s,
        cuts,
        input_words: format!("trace {}{skipped}", path.display()),
        input_requests: whole.requests,
        input_span_s: whole.duration_s,
        input_qps: whole.mean_qps,
        requests_used: n_ex as u64,
        seed_variation: format!(
            "seed 1 replays the trace's own arrival times (rescaled to each step's rate); seeds 2–{} replay the same requests in the same order with a moving-block bootstrap of the trace's inter-arrival gaps (blocks of {BOOTSTRAP_BLOCK}); every seed also seeds the policies' own randomness (P2C draws, hash rings)",
            seeds.max(2)
        ),
        diagnosed,
        whole,
        seeds,
    })
}

fn prepare_rates(
    o: &Options,
    path: &PathBuf,
    generator: &GeneratorConfig,
    fit: &Fit,
) -> Result<Prepared> {
    let f = std::fs::File::open(path)
        .with_context(|| format!("--rates: cannot open {}", path.display()))?;
    let rows = crate::workload::rates::read_rates_csv(std::io::BufReader::new(f))
        .with_context(|| format!("--rates {}", path.display()))?;
    let sum: f64 = rows.iter().map(|r| r.rate).sum();
    if sum.is_nan() || sum <= 0.0 {
        bail!(
            "--rates {}: the rates sum to 0; give at least one key a positive rate",
            path.display()
        );
    }
    let mut cfg = generator.clone();
    cfg.keys.dist = KeyDist::Csv { path: path.clone() };
    if let Some(b) = o.block_size {
        cfg.prefix.block_size = b;
    }
    let given_block = cfg.prefix.block_size;
    cfg.prefix.block_size = coarsening(given_block, o.cache_block).1;
    let wl = Workload::load(&cfg).with_context(|| format!("--rates {}", path.display()))?;
    let base = o.qps.unwrap_or(sum);
    let engine = engine_config(&o.engine, cfg.prefix.block_size, &knobs(o))
        .map_err(|e| anyhow::anyhow!("--engine: {e}"))?;
    let top = o.multipliers.last().copied().unwrap_or(1.0) * base;
    // The request shape first (a sample at the user's load), for the warm-up floor.
    let sample: Vec<TraceRecord> = wl.generate(base, 1e9, 1)?.take(4096).collect();
    let shape = stats::compute_records(
        &sample,
        &StatsOptions {
            windows_s: Vec::new(),
            destinations: 1,
            block_size: Some(cfg.prefix.block_size),
            seed: 1,
        },
    );
    let (warmup_s, measure_s, mut cuts) = durations(
        o,
        base,
        top,
        f64::INFINITY,
        long_s(&engine, &shape),
        residence(&engine, base, o.replicas, &shape),
    )?;
    check_measured(o, base, measure_s, &format!("--rates {}", path.display()))?;
    let d = warmup_s + measure_s;
    let seeds = o.seeds.unwrap_or(DEFAULT_SEEDS);
    if cfg.prefix.block_size != given_block {
        cuts.push(format!(
            "prefix reuse simulated in blocks of {} tokens (generated instead of {given_block}), as the studies do",
            cfg.prefix.block_size
        ));
    }
    // The diagnosed span: seed 1 at the user's load, as long as the top step has requests.
    let diagnosed: Vec<TraceRecord> = wl
        .generate(base, d * o.multipliers.last().copied().unwrap_or(1.0), 1)?
        .collect();
    for r in &diagnosed {
        if let Some(p) = fit.problem(r) {
            bail!(
                "--rates {}: a generated request of key `{}`: {p} (or lower the generator's max_context)",
                path.display(),
                r.key
            );
        }
    }
    let whole = stats::compute_records(
        &diagnosed,
        &StatsOptions {
            windows_s: Vec::new(),
            destinations: o.replicas.min(u32::MAX as usize) as u32,
            block_size: Some(cfg.prefix.block_size),
            seed: 1,
        },
    );
    Ok(Prepared {
        key_shares: wl.key_weights(1),
        source: Source::Rates(Box::new(wl)),
        engine,
        base_qps: base,
        warmup_s,
        measure_s,
        cuts,
        input_words: format!("rates {} ({} keys)", path.display(), rows.len()),
        input_requests: 0,
        input_span_s: 0.0,
        input_qps: sum,
        requests_used: 0,
        seed_variation:
            "each seed generates its own requests from the rates (key draws, conversations, arrivals), as a study's generated workload does, and seeds the policies' own randomness"
                .into(),
        diagnosed,
        whole,
        seeds,
    })
}

/// One step's inputs.
struct StepIn {
    records: Box<dyn Iterator<Item = TraceRecord>>,
    warm: Option<WarmStart>,
    key_rates: HashMap<u64, f64>,
}

fn step_input(p: &Prepared, seed: u64, qps: f64) -> Result<StepIn> {
    let d = p.warmup_s + p.measure_s;
    match &p.source {
        Source::Rates(wl) => {
            let i = generated_inputs(wl, qps, d, seed)?;
            Ok(StepIn {
                records: i.records,
                warm: i.warm,
                key_rates: i.key_rates,
            })
        }
        Source::Trace { excerpt, unit } => {
            let u = unit[&seed].clone();
            let n = u.partition_point(|&x| x / qps < d);
            let mut counts: HashMap<u64, f64> = HashMap::new();
            for r in &excerpt[..n] {
                *counts.entry(crate::key_hash(&r.key)).or_default() += 1.0;
            }
            let key_rates: HashMap<u64, f64> =
                counts.into_iter().map(|(k, c)| (k, c / d)).collect();
            // The control loop's warm start: the step's own per-key rates, as a deployment's
            // previous period would have measured them (a study's generated workload gives its
            // expected rates the same way).
            let mut rates: Vec<KeyLoad> = key_rates
                .iter()
                .map(|(&key, &rate)| KeyLoad {
                    key,
                    rate,
                    prefix_tokens: 0.0,
                })
                .collect();
            rates.sort_by_key(|k| k.key);
            let warm = WarmStart::from_sample(rates, excerpt[..n.min(2000)].iter());
            let ex = excerpt.clone();
            let records = (0..n).map(move |i| TraceRecord {
                timestamp_ms: u[i] / qps * 1000.0,
                ..ex[i].clone()
            });
            Ok(StepIn {
                records: Box::new(records),
                warm: Some(warm),
                key_rates,
            })
        }
    }
}

/// A run's steps (knee probes included), how many of its ladder steps were skipped, the
/// requests it simulated, and how many knee probes it ran.
type RunResult = (Vec<StepRecord>, usize, u64, usize, Option<DispatchChoice>);

/// One run (policy × seed) up its ladder; a step above 1× after a failed step is skipped (it
/// cannot change the capacity). Then, with `refine`, the knee between the highest passing step
/// and the first failing one by bisection (`analysis::knee`; a censored capacity stays a bound,
/// nothing to bisect), each probe a step like the others, stored from
/// [`PROBE_STEP_BASE`] up.
fn run_one(
    o: &Options,
    p: &Prepared,
    ladder: &[f64],
    policy: &str,
    seed: u64,
    bar: &indicatif::ProgressBar,
) -> Result<RunResult> {
    let spec = PolicySpec::from_name(policy).map_err(anyhow::Error::msg)?;
    let label = spec.label();
    let mut out = Vec::new();
    let mut requests = 0u64;
    let mut dispatch = None;
    // Simulate and measure one step at `q`, stored as step `index`; whether it passes.
    let mut measure = |q: f64, index: usize, out: &mut Vec<StepRecord>| -> Result<bool> {
        let inp = step_input(p, seed, q)?;
        let step = SimStep {
            engine: p.engine.clone(),
            replicas: o.replicas,
            policy: &spec,
            seed,
            failures: Vec::new(),
            warm: inp.warm,
            warmup_s: p.warmup_s,
            measure_s: p.measure_s,
            max_slo_s: o.slo.p99_s,
            qps: q,
            cut_for: &[],
            router_replicas: 1,
        };
        let (metrics, sim) = simulate_step(step, inp.records, &inp.key_rates)
            .with_context(|| format!("{label} seed {seed} at {q:.3} req/s"))?;
        requests += sim.records.len() as u64;
        if seed == 1 && (q - p.base_qps).abs() <= 1e-9 * p.base_qps.max(1.0) {
            dispatch = rule::dispatch_choice(&sim.plans, q);
        }
        let pass = passes(&metrics, &o.slo);
        out.push(StepRecord {
            run: RunKey {
                policy: label.clone(),
                seed,
                sweep: String::new(),
            },
            step: index,
            metrics,
        });
        bar.inc(1);
        Ok(pass)
    };
    let mut failed = false;
    let mut skipped = 0;
    for (i, (&q, &m)) in ladder.iter().zip(&o.multipliers).enumerate() {
        if failed && m > 1.0 {
            skipped += 1;
            bar.inc(1);
            continue;
        }
        failed |= !measure(q, i, &mut out)?;
    }
    let mut probes = 0;
    if let Some(r) = o.refine {
        let cap = capacity(out.iter().map(|s| &s.metrics), &o.slo);
        let next = out
            .iter()
            .map(|s| s.metrics.offered_qps)
            .filter(|&q| q > cap.qps)
            .fold(f64::INFINITY, f64::min);
        if cap.censored == Censoring::None && next.is_finite() {
            let mut k = 0;
            let b = knee::bisect(&KneeGrid::for_resolution(r), cap.qps, next, |q| {
                bar.inc_length(1);
                k += 1;
                measure(q, PROBE_STEP_BASE + k - 1, &mut out)
            })?;
            probes = b.probes;
        }
    }
    Ok((out, skipped, requests, probes, dispatch))
}

/// What [`run_ladder`] ran: the steps (knee probes included), how many ladder steps were
/// simulated and skipped, the knee probes, and the requests simulated.
#[derive(Default)]
struct Ladder {
    steps: Vec<StepRecord>,
    simulated: usize,
    skipped: usize,
    probes: usize,
    requests: u64,
    dispatch: Option<DispatchChoice>,
}

impl Ladder {
    fn extend(&mut self, more: Ladder) {
        self.steps.extend(more.steps);
        self.simulated += more.simulated;
        self.skipped += more.skipped;
        self.probes += more.probes;
        self.requests += more.requests;
        self.dispatch = self.dispatch.take().or(more.dispatch);
        self.steps
            .sort_by(|a, b| a.run.cmp(&b.run).then(a.step.cmp(&b.step)));
    }
}

/// Every policy × seed up the ladder, on worker threads.
fn run_ladder(
    o: &Options,
    p: &Prepared,
    ladder: &[f64],
    seeds: std::ops::RangeInclusive<u64>,
) -> Result<Ladder> {
    // The costliest policies first (Preble's prefix tree, then CacheRoute's control loop and
    // self-calibration, measured at 3.5× and 2× a Flat-LB run), so the last run to finish is a
    // cheap one (the order of the results does not depend on it).
    let runs: Vec<(&str, u64)> = COST_ORDER
        .iter()
        .flat_map(|&pol| seeds.clone().map(move |s| (pol, s)))
        .collect();
    let total = runs.len() * ladder.len();
    let bar = if o.progress {
        indicatif::ProgressBar::new(total as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "advise [{bar:30}] {pos}/{len} steps {elapsed_precise}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let _shown = o
        .progress
        .then(|| crate::progress::Shown::new(None, &bar, "advise"));
    let threads = if o.threads > 0 {
        o.threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
    .min(runs.len())
    .max(1);
    let queue = Mutex::new(runs.into_iter());
    let results: Mutex<Vec<Result<RunResult>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let next = queue.lock().expect("queue").next();
                let Some((policy, seed)) = next else { break };
                let r = run_one(o, p, ladder, policy, seed, &bar);
                let stop = r.is_err();
                results.lock().expect("results").push(r);
                if stop {
                    break;
                }
            });
        }
    });
    bar.finish_and_clear();
    let mut l = Ladder::default();
    for r in results.into_inner().expect("results") {
        let (s, k, n, probes, d) = r?;
        l.dispatch = l.dispatch.take().or(d);
        l.steps.extend(s);
        l.skipped += k;
        l.requests += n;
        l.probes += probes;
    }
    // A fixed order (threads finish in any order).
    l.steps
        .sort_by(|a, b| a.run.cmp(&b.run).then(a.step.cmp(&b.step)));
    l.simulated = l.steps.len() - l.probes;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::model::SloMetric;

    fn opts(max_requests: usize) -> Options {
        Options {
            input: Input::Trace {
                path: PathBuf::from("x.jsonl"),
                read: ReaderOptions::default(),
            },
            engine: "llama-3.1-8b:h100:fp8:tp1".into(),
            replicas: 4,
            slo: Slo {
                metric: SloMetric::E2e,
                p99_s: 1.0,
            },
            qps: None,
            multipliers: DEFAULT_MULTIPLIERS.to_vec(),
            seeds: None,
            budget_requests: DEFAULT_BUDGET_REQUESTS,
            max_requests,
            block_size: None,
            cache_block: DEFAULT_CACHE_BLOCK,
            max_model_len: None,
            kv_cache_bytes: None,
            threads: 1,
            progress: false,
            parallel_read_bytes: PARALLEL_READ_BYTES,
            refine: Some(crate::analysis::advise::KNEE_RESOLUTION),
        }
    }

    use crate::workload::trace::parts::tests::trace_file;

    fn fit() -> Fit {
        Fit {
            kv_tokens: 1_000_000,
            max_model_len: None,
            engine: "e".into(),
        }
    }

    type Whole = Result<(TraceStats, usize)>;

    /// Pass 1 read sequentially and in two halves.
    fn both_ways(path: &PathBuf) -> (Whole, Whole) {
        let mut seq = opts(60_000);
        seq.threads = 1;
        let mut par = opts(60_000);
        par.threads = 2;
        par.parallel_read_bytes = 0;
        let read = ReaderOptions::default();
        (
            whole_trace(&seq, path, &read, &fit()),
            whole_trace(&par, path, &read, &fit()),
        )
    }

    #[test]
    fn a_trace_read_in_two_halves_gives_the_same_statistics() {
        let dir = tempfile::tempdir().unwrap();
        let p = trace_file(dir.path(), 1001, &[]);
        let (a, b) = both_ways(&p);
        let (a, b) = (a.unwrap().0, b.unwrap().0);
        assert_eq!(a.requests, 1001);
        assert!((a.interarrival_cv - b.interarrival_cv).abs() < 1e-9);
        let strip = |s: &TraceStats| TraceStats {
            interarrival_cv: 0.0,
            key_counts: vec![],
            ..s.clone()
        };
        assert_eq!(strip(&a), strip(&b));
    }

    /// The halves' errors are read in `workload::trace::parts`; a request no replica holds is
    /// named by its file line either way.
    #[test]
    fn a_request_that_fits_no_replica_is_named_by_its_line_either_way() {
        let dir = tempfile::tempdir().unwrap();
        let p = trace_file(
            dir.path(),
            1000,
            &[(
                950,
                "{\"timestamp\":9500,\"key\":\"x\",\"input_length\":5000000,\"output_length\":5,\"hash_ids\":[1]}",
            )],
        );
        let (a, b) = both_ways(&p);
        for e in [a.unwrap_err(), b.unwrap_err()] {
            let e = format!("{e:#}");
            assert!(e.contains("line 950: input_length 5000000"), "{e}");
            assert!(e.contains("KV cache"), "{e}");
        }
    }

    #[test]
    fn steps_are_the_studies_when_the_budget_allows() {
        // 10 req/s, top 20 req/s, 60k requests: 60 s warm-up, 1000 s measured (10k requests).
        let (w, m, notes) = durations(&opts(60_000), 10.0, 20.0, f64::INFINITY, 1.0, 5.0).unwrap();
        assert_eq!((w, m), (60.0, 1000.0));
        assert!(notes.is_empty(), "{notes:?}");
        // 100 req/s: the studies' 180 s measured.
        let (w, m, _) = durations(&opts(60_000), 100.0, 200.0, f64::INFINITY, 1.0, 5.0).unwrap();
        assert_eq!((w, m), (60.0, 180.0));
    }

    #[test]
    fn the_budget_shortens_the_window_but_never_below_the_floors() {
        // 1000 req/s, top 2000: 60k requests allow 30 s in all.
        let (w, m, notes) =
            durations(&opts(60_000), 1000.0, 2000.0, f64::INFINITY, 1.0, 5.0).unwrap();
        assert_eq!((w, m), (10.0, 20.0));
        assert!(notes[0].contains("--max-requests"), "{notes:?}");
        // Long requests (30 s) and a long residence (45 s): the warm-up floors win.
        let (w, m, notes) =
            durations(&opts(60_000), 1000.0, 2000.0, f64::INFINITY, 30.0, 45.0).unwrap();
        assert_eq!((w, m), (60.0, MIN_MEASURE_S));
        assert!(notes[0].contains("above --max-requests"), "{notes:?}");
        let (w, _, _) =
            durations(&opts(60_000), 1000.0, 2000.0, f64::INFINITY, 1.0, 100.0).unwrap();
        assert_eq!(w, 100.0);
    }

    #[test]
    fn a_short_trace_cuts_the_warm_up_to_its_floor_or_is_refused() {
        // The trace lasts 50 s at the top step; residence 100 s: warm-up cut to 40 s, noted.
        let (w, m, notes) = durations(&opts(60_000), 10.0, 20.0, 50.0, 1.0, 100.0).unwrap();
        assert_eq!((w, m), (40.0, 10.0));
        assert!(notes.iter().any(|n| n.contains("warm-up cut")), "{notes:?}");
        // 15 s is less than the 10 s + 10 s floor.
        let e = durations(&opts(60_000), 10.0, 20.0, 15.0, 1.0, 100.0).unwrap_err();
        assert!(e.to_string().contains("longer trace"), "{e}");
    }

    #[test]
    fn finer_trace_blocks_are_merged_into_cache_blocks() {
        assert_eq!(coarsening(16, 64), (4, 64));
        assert_eq!(coarsening(512, 64), (1, 512));
        assert_eq!(coarsening(48, 64), (2, 96));
        assert_eq!(coarsening(16, 1), (1, 16));
    }

    #[test]
    fn options_are_checked_naming_each_flag() {
        let mut o = opts(60_000);
        o.multipliers = vec![1.0, 0.5, -1.0];
        o.seeds = Some(0);
        o.replicas = 0;
        o.kv_cache_bytes = Some(-1.0);
        let p = option_problems(&o).join("; ");
        for s in [
            "--ladder",
            "increase",
            "--seeds",
            "--destinations",
            "--kv-cache-bytes",
        ] {
            assert!(p.contains(s), "{s}: {p}");
        }
        assert!(option_problems(&opts(60_000)).is_empty());
    }
}
