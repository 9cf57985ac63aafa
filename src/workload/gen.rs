//! Synthetic traffic, deterministic by seed: key popularity (lognormal, Zipf or a `key,rate`
//! CSV, optional whales), per-key prefix structure (a system prompt shared by the key's
//! conversations, several concurrent conversations per key, multi-turn growth), lengths from
//! distributions, chained block ids, an arrival process, and drift of key rates.
//!
//! Scaling: key identities and relative rates depend only on the seed, never on the QPS, so a
//! ladder of QPS steps keeps the same keys hot. The key of each successive request comes from
//! its own RNG stream, so (without drift) step 2× QPS sees the same key sequence at half the
//! spacing.
//!
//! Pure except [`Workload::load`], which reads the files a config names (rates CSV, gap
//! sources) once, up front. No clock; randomness comes from `crate::rng` streams derived from
//! the seed.

use super::arrivals::{ArrivalError, ArrivalKind, Arrivals};
use super::rates::{self, KeyRate};
use super::trace::TraceRecord;
use crate::bounds;
use crate::rng::{derive, Rng64};
use rand::RngExt;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use super::rates::{PAPER_KEYS, PAPER_SIGMA};
use crate::rng::{mix64, Alias};

/// The generator's configuration: an experiment spec's `workload:` section. Every field has a
/// default; the default is the paper preset ([`GeneratorConfig::paper`]).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GeneratorConfig {
    pub keys: KeysConfig,
    pub prefix: PrefixConfig,
    pub arrivals: ArrivalSpec,
    /// Per-interval lognormal random walk of key rates; none by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift: Option<DriftConfig>,
}

/// Key popularity.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KeysConfig {
    /// Number of keys (ignored for `csv`, which names its own keys).
    pub count: usize,
    pub dist: KeyDist,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub whales: Option<Whales>,
    /// Active set: only the `active` highest-rate keys send traffic (their weights renormalised),
    /// as in the paper's top-K128 / top-K256 studies. None = every key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<usize>,
}

/// Distribution of per-key rates.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum KeyDist {
    /// Rates ∝ lognormal(0, σ) draws.
    Lognormal { sigma: f64 },
    /// Rates ∝ rank^(-exponent), ranks shuffled over keys.
    Zipf { exponent: f64 },
    /// Relative rates from a `key,rate[,prefix_tokens]` CSV.
    Csv { path: PathBuf },
}

/// `count` keys (the first ones) carrying `share` of all traffic between them.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Whales {
    pub count: usize,
    pub share: f64,
}

/// Prefix structure and lengths.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixConfig {
    /// Tokens per block (16 like vLLM, 512 like Mooncake).
    pub block_size: u32,
    /// Tokens of a prefix common to every request of every key (a fleet-wide instruction
    /// template), before the key's own system prompt. 0 = none.
    pub shared_prefix: u32,
    /// Length of each key's system prompt (drawn once per key), shared by its conversations.
    pub system_prompt: LengthDist,
    /// Concurrent conversations per key; each request continues one of them at random.
    pub conversations_per_key: u32,
    /// Mean turns per conversation (geometric, ≥ 1).
    pub mean_turns: f64,
    /// New user message appended each turn.
    pub user_message: LengthDist,
    /// Answer length; each turn's prompt appends the previous answer.
    pub output: LengthDist,
    /// A conversation that would exceed this many prompt tokens ends; a fresh one starts.
    pub max_context: u32,
}

/// A token-length distribution (values are rounded and clamped to `min..=max`).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum LengthDist {
    Constant {
        value: u32,
    },
    Lognormal {
        median: f64,
        sigma: f64,
        min: u32,
        max: u32,
    },
    Uniform {
        min: u32,
        max: u32,
    },
}

/// Arrival process as configured (files named, not yet loaded).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Default)]
#[serde(tag = "process", rename_all = "snake_case", deny_unknown_fields)]
pub enum ArrivalSpec {
    #[default]
    Poisson,
    Gamma {
        cv: f64,
    },
    Constant,
    /// Moving-block bootstrap of real gaps from an Azure CSV (`.csv`) or a JSONL trace.
    Bootstrap {
        from: PathBuf,
        #[serde(default = "default_block")]
        block: usize,
    },
    /// A trace's (or Azure CSV's) own gaps, in order, rescaled to the target rate.
    Replay {
        from: PathBuf,
    },
}

fn default_block() -> usize {
    32
}

/// Drift: the run is cut into `intervals` equal intervals; at each boundary every key's rate
/// takes one mean-preserving lognormal step with this σ.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DriftConfig {
    pub sigma: f64,
    pub intervals: u32,
}

impl Default for KeysConfig {
    fn default() -> Self {
        KeysConfig {
            count: PAPER_KEYS,
            dist: KeyDist::Lognormal { sigma: PAPER_SIGMA },
            whales: None,
            active: None,
        }
    }
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_size: 16,
            shared_prefix: 0,
            system_prompt: LengthDist::Lognormal {
                median: 1024.0,
                sigma: 0.6,
                min: 64,
                max: 8192,
            },
            conversations_per_key: 4,
            mean_turns: 4.0,
            user_message: LengthDist::Lognormal {
                median: 120.0,
                sigma: 0.8,
                min: 4,
                max: 4096,
            },
            output: LengthDist::Lognormal {
                median: 250.0,
                sigma: 0.7,
                min: 1,
                max: 2048,
            },
            max_context: 16_384,
        }
    }
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        Self::paper()
    }
}

impl GeneratorConfig {
    /// The paper's flagship workload: 128,824 keys with lognormal(σ = 1.648) rates, Poisson
    /// arrivals, system prompts of ~1k tokens, 4 conversations per key of ~4 turns, 16-token
    /// blocks. Setup costs O(keys); each record costs O(blocks of its prompt).
    pub fn paper() -> Self {
        GeneratorConfig {
            keys: KeysConfig::default(),
            prefix: PrefixConfig::default(),
            arrivals: ArrivalSpec::Poisson,
            drift: None,
        }
    }

    /// The config with its relative file paths (`keys.dist.path`, `arrivals.from`) taken
    /// relative to `base`: the directory of the file the config was written in (a study spec
    /// or a generator YAML). Paths only; nothing is read.
    pub fn relative_to(&self, base: &Path) -> GeneratorConfig {
        let mut g = self.clone();
        if let KeyDist::Csv { path } = &mut g.keys.dist {
            *path = resolve(base, path);
        }
        match &mut g.arrivals {
            ArrivalSpec::Bootstrap { from, .. } | ArrivalSpec::Replay { from } => {
                *from = resolve(base, from)
            }
            _ => {}
        }
        g
    }

    /// Every problem with its field path (empty when valid).
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        match &self.keys.dist {
            KeyDist::Lognormal { sigma } => {
                p.extend(bounds::non_negative("keys.dist.sigma", *sigma, 20.0))
            }
            KeyDist::Zipf { exponent } => {
                p.extend(bounds::non_negative("keys.dist.exponent", *exponent, 20.0))
            }
            KeyDist::Csv { .. } => {}
        }
        if !matches!(self.keys.dist, KeyDist::Csv { .. }) {
            p.extend(bounds::count(
                "keys.count",
                self.keys.count as u64,
                1,
                bounds::MAX_KEYS,
            ));
            let conversations =
                (self.keys.count as u64).saturating_mul(self.prefix.conversations_per_key as u64);
            if conversations > bounds::MAX_CONVERSATIONS {
                p.push(format!(
                    "keys.count × prefix.conversations_per_key: {conversations} conversations; at most {} (fewer keys or conversations per key)",
                    bounds::MAX_CONVERSATIONS
                ));
            }
        }
        if let Some(a) = self.keys.active {
            p.extend(bounds::count("keys.active", a as u64, 1, bounds::MAX_KEYS));
        }
        if let Some(w) = &self.keys.whales {
            if !(0.0..1.0).contains(&w.share) {
                p.push(format!("keys.whales.share: {} must be in [0, 1)", w.share));
            }
            if w.count == 0 {
                p.push("keys.whales.count: must be ≥ 1".into());
            }
            if let Some(a) = self.keys.active.filter(|&a| a > 0 && a < w.count) {
                p.push(format!(
                    "keys.active: {a} is less than keys.whales.count {}; whales always send traffic, so raise active or lower the whale count",
                    w.count
                ));
            }
        }
        if let Some(w) = &self.keys.whales {
            p.extend(bounds::count(
                "keys.whales.count",
                w.count as u64,
                1,
                bounds::MAX_KEYS,
            ));
        }
        let x = &self.prefix;
        let tokens =
            |field: &str, v: u32, lo: u64| bounds::count(field, v as u64, lo, bounds::MAX_TOKENS);
        p.extend(tokens("prefix.block_size", x.block_size, 1));
        p.extend(tokens("prefix.shared_prefix", x.shared_prefix, 0));
        p.extend(bounds::count(
            "prefix.conversations_per_key",
            x.conversations_per_key as u64,
            1,
            100_000,
        ));
        p.extend(bounds::real(
            "prefix.mean_turns",
            x.mean_turns,
            1.0,
            false,
            10_000.0,
        ));
        p.extend(tokens("prefix.max_context", x.max_context, 1));
        for (name, d) in [
            ("system_prompt", &x.system_prompt),
            ("user_message", &x.user_message),
            ("output", &x.output),
        ] {
            if let Some(e) = d.problem() {
                p.push(format!("prefix.{name}: {e}"));
            }
        }
        match &self.arrivals {
            ArrivalSpec::Gamma { cv } => p.extend(bounds::positive("arrivals.cv", *cv, 100.0)),
            ArrivalSpec::Bootstrap { block, .. } => {
                p.extend(bounds::count("arrivals.block", *block as u64, 1, 1_000_000))
            }
            _ => {}
        }
        if let Some(d) = &self.drift {
            p.extend(bounds::non_negative("drift.sigma", d.sigma, 10.0));
            p.extend(bounds::count(
                "drift.intervals",
                d.intervals as u64,
                1,
                100_000,
            ));
        }
        p
    }
}

impl LengthDist {
    fn problem(&self) -> Option<String> {
        match self {
            LengthDist::Constant { value } => {
                bounds::count("value", *value as u64, 0, bounds::MAX_TOKENS)
            }
            LengthDist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => bounds::positive("median", *median, bounds::MAX_TOKENS as f64)
                .or_else(|| bounds::non_negative("sigma", *sigma, 10.0))
                .or_else(|| bounds::count("max", *max as u64, 0, bounds::MAX_TOKENS))
                .or_else(|| (min > max).then(|| format!("min {min} > max {max}"))),
            LengthDist::Uniform { min, max } => {
                bounds::count("max", *max as u64, 0, bounds::MAX_TOKENS)
                    .or_else(|| (min > max).then(|| format!("min {min} > max {max}")))
            }
        }
    }

    /// Draw one length.
    pub fn sample(&self, rng: &mut Rng64) -> u32 {
        match self {
            LengthDist::Constant { value } => *value,
            LengthDist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                let z: f64 = StandardNormal.sample(rng);
                let v = (median * (sigma * z).exp()).round();
                (v.max(*min as f64).min(*max as f64)) as u32
            }
            LengthDist::Uniform { min, max } => rng.random_range(*min..=*max),
        }
    }
}

/// `p` if absolute, else `base/p`: the one rule for paths written in a configuration file
/// (relative to the file's directory).
pub fn resolve(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// Why a run of `qps` req/s for `duration_s` seconds is too large to generate (rate above
/// [`bounds::MAX_QPS`], or more than [`bounds::MAX_REQUESTS`] requests), naming the two
/// settings as the caller calls them (`--qps`, `ladder[3]`…).
pub fn run_size_problem(
    rate_field: &str,
    qps: f64,
    duration_field: &str,
    duration_s: f64,
) -> Option<String> {
    bounds::positive(rate_field, qps, bounds::MAX_QPS).or_else(|| {
        let n = qps * duration_s;
        (n > bounds::MAX_REQUESTS).then(|| {
            format!(
                "{rate_field} × {duration_field}: {} req/s × {} s = {} requests; at most {} per run (lower the rate or the duration)",
                bounds::show(qps),
                bounds::show(duration_s),
                bounds::show(n.round()),
                bounds::show(bounds::MAX_REQUESTS)
            )
        })
    })
}

/// Errors preparing a workload.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error("invalid workload config:\n  {}", .0.join("\n  "))]
    Invalid(Vec<String>),
    #[error("keys.dist.path {path}: {source}")]
    Rates {
        path: PathBuf,
        #[source]
        source: rates::RatesError,
    },
    #[error("keys.dist.path {path}: {source}")]
    RatesIo {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("arrivals.from {path}: {source}")]
    Gaps {
        path: PathBuf,
        #[source]
        source: super::import::ImportError,
    },
    #[error("arrivals: {0}")]
    Arrivals(#[from] ArrivalError),
    #[error("duration {0} s must be a positive finite number")]
    BadDuration(f64),
    #[error("{0}")]
    OutOfRange(String),
}

/// A config with its input files loaded: cheap to run many times (ladder steps, seeds).
#[derive(Debug, Clone)]
pub struct Workload {
    cfg: GeneratorConfig,
    names: Arc<[String]>,
    csv_rates: Option<Arc<[f64]>>,
    gaps: Option<Arc<[f64]>>,
}

impl Workload {
    /// Validate the config and read the files it names.
    pub fn load(cfg: &GeneratorConfig) -> Result<Self, GenError> {
        let problems = cfg.validate();
        if !problems.is_empty() {
            return Err(GenError::Invalid(problems));
        }
        let (names, csv_rates) = match &cfg.keys.dist {
            KeyDist::Csv { path } => {
                let f = std::fs::File::open(path).map_err(|source| GenError::RatesIo {
                    path: path.clone(),
                    source,
                })?;
                let rows = rates::read_rates_csv(std::io::BufReader::new(f)).map_err(|source| {
                    GenError::Rates {
                        path: path.clone(),
                        source,
                    }
                })?;
                let names: Vec<String> = rows.iter().map(|r| r.key.clone()).collect();
                let r: Vec<f64> = rows.iter().map(|r| r.rate).collect();
                (names, Some(r.into()))
            }
            _ => ((0..cfg.keys.count).map(rates::key_name).collect(), None),
        };
        let gaps = match &cfg.arrivals {
            ArrivalSpec::Bootstrap { from, .. } | ArrivalSpec::Replay { from } => Some(
                super::import::load_gaps(from)
                    .map_err(|source| GenError::Gaps {
                        path: from.clone(),
                        source,
                    })?
                    .into(),
            ),
            _ => None,
        };
        Ok(Workload {
            cfg: cfg.clone(),
            names: names.into(),
            csv_rates,
            gaps,
        })
    }

    /// Build from an in-memory config that names no files (e.g. the paper preset).
    pub fn from_config(cfg: GeneratorConfig) -> Result<Self, GenError> {
        Self::load(&cfg)
    }

    pub fn config(&self) -> &GeneratorConfig {
        &self.cfg
    }

    /// Key names, index-aligned with the weights.
    pub fn key_names(&self) -> &[String] {
        &self.names
    }

    /// Relative key weights (sum 1) at the start of a run with this seed. Independent of QPS.
    pub fn key_weights(&self, seed: u64) -> Vec<f64> {
        let n = self.names.len();
        let mut rng = derive(seed, "workload/key-rates");
        let mut w = match (&self.cfg.keys.dist, &self.csv_rates) {
            (_, Some(r)) => r.to_vec(),
            (KeyDist::Lognormal { sigma }, _) => rates::lognormal_rates(n, *sigma, 1.0, &mut rng),
            (KeyDist::Zipf { exponent }, _) => rates::zipf_rates(n, *exponent, 1.0, &mut rng),
            (KeyDist::Csv { .. }, None) => vec![1.0; n],
        };
        rates::normalize(&mut w, 1.0);
        // Whales are the first keys; `share` is their share of the offered traffic, so they are
        // added after the active-set cut and its renormalisation, never before (adding them
        // first and renormalising over the active set inflates their share: 40% became 86%
        // with 256 active keys).
        let whales = self
            .cfg
            .keys
            .whales
            .as_ref()
            .map_or(0, |wh| wh.count.min(n));
        if let Some(k) = self.cfg.keys.active {
            if k < n {
                // Keep the whales and the k − whales largest other weights (ties by index).
                let mut keep = vec![false; n];
                keep[..whales.min(k)].fill(true);
                let others = k.saturating_sub(whales);
                if others > 0 {
                    let mut idx: Vec<usize> = (whales..n).collect();
                    if others < idx.len() {
                        idx.select_nth_unstable_by(others - 1, |&a, &b| {
                            w[b].total_cmp(&w[a]).then(a.cmp(&b))
                        });
                    }
                    for &i in &idx[..others.min(idx.len())] {
                        keep[i] = true;
                    }
                }
                for (x, kept) in w.iter_mut().zip(keep) {
                    if !kept {
                        *x = 0.0;
                    }
                }
                rates::normalize(&mut w, 1.0);
            }
        }
        if let Some(wh) = &self.cfg.keys.whales {
            rates::add_whales(&mut w, wh.count, wh.share);
        }
        w
    }

    /// The generator's expected per-key rates (req/s) at `qps` for this seed, at the start of
    /// the run (before any drift): the planner's input.
    pub fn expected_rates(&self, qps: f64, seed: u64) -> Vec<KeyRate> {
        self.key_weights(seed)
            .into_iter()
            .zip(self.names.iter())
            .map(|(w, k)| KeyRate {
                key: k.clone(),
                rate: w * qps,
                prefix_tokens: None,
            })
            .collect()
    }

    /// Expected per-key rates for every drift interval (one entry without drift).
    pub fn expected_rates_by_interval(&self, qps: f64, seed: u64) -> Vec<Vec<f64>> {
        let mut w = self.key_weights(seed);
        let mut out = Vec::new();
        let mut rng = derive(seed, "workload/drift");
        let intervals = self.cfg.drift.as_ref().map_or(1, |d| d.intervals.max(1));
        for i in 0..intervals {
            if i > 0 {
                rates::drift_step(
                    &mut w,
                    self.cfg.drift.as_ref().map_or(0.0, |d| d.sigma),
                    &mut rng,
                );
            }
            out.push(w.iter().map(|x| x * qps).collect());
        }
        out
    }

    /// The arrival process of this config at `qps`.
    pub fn arrivals(&self, qps: f64, seed: u64) -> Result<Arrivals, ArrivalError> {
        let kind = match &self.cfg.arrivals {
            ArrivalSpec::Poisson => ArrivalKind::Poisson,
            ArrivalSpec::Gamma { cv } => ArrivalKind::Gamma { cv: *cv },
            ArrivalSpec::Constant => ArrivalKind::Constant,
            ArrivalSpec::Bootstrap { block, .. } => ArrivalKind::Gaps {
                gaps: self.gaps.clone().expect("loaded"),
                block: Some(*block),
            },
            ArrivalSpec::Replay { .. } => ArrivalKind::Gaps {
                gaps: self.gaps.clone().expect("loaded"),
                block: None,
            },
        };
        Arrivals::new(kind, qps, derive(seed, "workload/arrivals"))
    }

    /// The records of a run: `qps` requests/s for `duration_s` seconds, in timestamp order.
    pub fn generate(&self, qps: f64, duration_s: f64, seed: u64) -> Result<Generator, GenError> {
        if !(duration_s.is_finite() && duration_s > 0.0) {
            return Err(GenError::BadDuration(duration_s));
        }
        // The stream is lazy (callers may take a prefix of a very long run), so only the rate is
        // bounded here; callers that collect a run check its size with [`run_size_problem`].
        if let Some(e) = bounds::positive("rate (req/s)", qps, bounds::MAX_QPS) {
            return Err(GenError::OutOfRange(e));
        }
        let arrivals = self.arrivals(qps, seed)?;
        let weights = self.key_weights(seed);
        let alias = Alias::new(&weights);
        let n = self.names.len();
        let c = self.cfg.prefix.conversations_per_key as usize;
        let (drift_every, drift_sigma) = match &self.cfg.drift {
            Some(d) if d.intervals > 1 => (duration_s / d.intervals as f64, d.sigma),
            _ => (f64::INFINITY, 0.0),
        };
        Ok(Generator {
            cfg: self.cfg.prefix.clone(),
            names: self.names.clone(),
            seed,
            arrivals,
            key_rng: derive(seed, "workload/keys"),
            conv_rng: derive(seed, "workload/conversations"),
            drift_rng: derive(seed, "workload/drift"),
            weights,
            alias,
            slots: vec![Slot::default(); n * c],
            sys_len: vec![u32::MAX; n],
            next_conv: 0,
            duration_s,
            drift_every,
            drift_sigma,
            next_drift: drift_every,
            generated: 0,
        })
    }
}

/// Convenience: load `cfg` and generate a run.
pub fn generate(
    cfg: &GeneratorConfig,
    qps: f64,
    duration_s: f64,
    seed: u64,
) -> Result<Generator, GenError> {
    Workload::load(cfg)?.generate(qps, duration_s, seed)
}

#[derive(Clone, Default)]
struct Slot {
    conv: u64,
    turns_left: u32,
    turn: u32,
    /// Tokens of context so far (system prompt + earlier turns and answers); 0 = no conversation.
    context: u32,
}

/// Iterator over the records of one generated run, in timestamp order.
pub struct Generator {
    cfg: PrefixConfig,
    names: Arc<[String]>,
    seed: u64,
    arrivals: Arrivals,
    key_rng: Rng64,
    conv_rng: Rng64,
    drift_rng: Rng64,
    weights: Vec<f64>,
    alias: Alias,
    slots: Vec<Slot>,
    sys_len: Vec<u32>,
    next_conv: u64,
    duration_s: f64,
    drift_every: f64,
    drift_sigma: f64,
    next_drift: f64,
    generated: u64,
}

const STEP: u64 = 0xD6E8_FEB8_6659_FD93;

impl Generator {
    /// Current relative key weights (change at drift boundaries).
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Records produced so far.
    pub fn generated(&self) -> u64 {
        self.generated
    }

    fn system_len(&mut self, k: usize) -> u32 {
        if self.sys_len[k] == u32::MAX {
            // Per-key draw from a per-key stream: independent of QPS and of request order.
            let mut rng = crate::rng::seeded(mix64(self.seed ^ mix64(k as u64 ^ 0x5157_0000_0000)));
            self.sys_len[k] = self
                .cfg
                .shared_prefix
                .saturating_add(self.cfg.system_prompt.sample(&mut rng))
                .min(self.cfg.max_context);
        }
        self.sys_len[k]
    }

    fn new_conversation(&mut self, k: usize) -> Slot {
        let sys = self.system_len(k);
        let p = 1.0 / self.cfg.mean_turns;
        let turns = if p >= 1.0 {
            1
        } else {
            let u: f64 = self.conv_rng.random::<f64>();
            1 + ((1.0 - u).ln() / (1.0 - p).ln()).floor().min(1e6) as u32
        };
        self.next_conv += 1;
        Slot {
            conv: mix64(self.seed ^ mix64(self.next_conv)),
            turns_left: turns,
            turn: 0,
            context: sys,
        }
    }

    fn fill_ids(&self, k: usize, conv: u64, sys: u32, prompt: u32, ids: &mut Vec<u64>) {
        let b = self.cfg.block_size;
        let full = prompt / b;
        let partial = prompt % b;
        let sys_base = mix64(self.seed.rotate_left(17) ^ mix64(k as u64 ^ 0xA11C_E000_0000_0000));
        let sys_full = sys / b;
        // Blocks wholly inside the fleet-wide shared prefix are the same for every key.
        let shared_full = self.cfg.shared_prefix.min(sys) / b;
        let shared_base = mix64(self.seed.rotate_left(29) ^ 0x5EA2_ED00_0000_0000);
        ids.reserve(full as usize + 1);
        for j in 0..full {
            let base = if j < shared_full {
                shared_base
            } else if j < sys_full {
                sys_base
            } else {
                conv
            };
            ids.push(mix64(base.wrapping_add((j as u64).wrapping_mul(STEP))));
        }
        if partial > 0 {
            let base = if full < sys_full || prompt <= sys {
                sys_base
            } else {
                conv
            };
            ids.push(mix64(
                base ^ mix64(((full as u64) << 20) ^ partial as u64 ^ 0xF00D_0000_0000_0000),
            ));
        }
    }
}

impl Iterator for Generator {
    type Item = TraceRecord;

    fn next(&mut self) -> Option<TraceRecord> {
        let t = self.arrivals.next()?;
        if t >= self.duration_s {
            return None;
        }
        while t >= self.next_drift {
            rates::drift_step(&mut self.weights, self.drift_sigma, &mut self.drift_rng);
            self.alias = Alias::new(&self.weights);
            self.next_drift += self.drift_every;
        }
        let k = self.alias.sample(&mut self.key_rng);
        let c = self.cfg.conversations_per_key as usize;
        let si = k * c + self.conv_rng.random_range(0..c);
        let user = self.cfg.user_message.sample(&mut self.conv_rng);
        let output = self.cfg.output.sample(&mut self.conv_rng);
        let mut slot = std::mem::take(&mut self.slots[si]);
        if slot.context == 0
            || slot.turns_left == 0
            || slot.context.saturating_add(user) > self.cfg.max_context
        {
            slot = self.new_conversation(k);
        }
        let sys = self.system_len(k);
        let prompt = slot
            .context
            .saturating_add(user)
            .min(self.cfg.max_context)
            .max(1);
        let mut ids = Vec::new();
        self.fill_ids(k, slot.conv, sys, prompt, &mut ids);
        slot.turn += 1;
        slot.turns_left -= 1;
        slot.context = prompt.saturating_add(output);
        let rec = TraceRecord {
            timestamp_ms: (t * 1000.0 * 1000.0).round() / 1000.0,
            key: self.names[k].clone(),
            input_length: prompt,
            output_length: output,
            hash_ids: ids,
            session: Some(format!("{:016x}", slot.conv)),
            turn: Some(slot.turn),
        };
        self.slots[si] = slot;
        self.generated += 1;
        Some(rec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> GeneratorConfig {
        let mut c = GeneratorConfig::paper();
        c.keys.count = 200;
        c
    }

    #[test]
    fn deterministic_sorted_and_scaled() {
        let w = Workload::from_config(small()).unwrap();
        let a: Vec<_> = w.generate(20.0, 50.0, 7).unwrap().collect();
        let b: Vec<_> = w.generate(20.0, 50.0, 7).unwrap().collect();
        assert_eq!(a, b);
        assert!(a.windows(2).all(|p| p[0].timestamp_ms <= p[1].timestamp_ms));
        assert!(a.len() > 800 && a.len() < 1200, "{}", a.len());
        // 2× QPS: same keys in the same order at half the spacing (Poisson, no drift).
        let c: Vec<_> = w.generate(40.0, 25.0, 7).unwrap().collect();
        let n = a.len().min(c.len()) - 5;
        for i in 0..n {
            assert_eq!(a[i].key, c[i].key);
            assert!((a[i].timestamp_ms / 2.0 - c[i].timestamp_ms).abs() < 0.01);
        }
        // Expected rates scale, hot keys stay hot.
        let r1 = w.expected_rates(10.0, 7);
        let r2 = w.expected_rates(100.0, 7);
        for (x, y) in r1.iter().zip(&r2) {
            assert_eq!(x.key, y.key);
            assert!((x.rate * 10.0 - y.rate).abs() < 1e-9);
        }
    }

    #[test]
    fn prefix_structure() {
        let mut cfg = small();
        cfg.keys.count = 3;
        cfg.prefix.system_prompt = LengthDist::Constant { value: 100 };
        cfg.prefix.conversations_per_key = 1;
        cfg.prefix.mean_turns = 1000.0;
        cfg.prefix.max_context = 100_000;
        let recs: Vec<_> = generate(&cfg, 5.0, 40.0, 3).unwrap().collect();
        // Same key: the system prompt's 6 full blocks are shared.
        let k0: Vec<_> = recs.iter().filter(|r| r.key == recs[0].key).collect();
        assert!(k0.len() > 3);
        for r in &k0 {
            assert_eq!(r.hash_ids[..6], k0[0].hash_ids[..6]);
        }
        // Multi-turn growth: each turn's prompt extends the previous prompt + answer, and the
        // previous prompt's full blocks are a prefix of the next.
        for p in k0.windows(2) {
            assert!(p[1].input_length > p[0].input_length + p[0].output_length);
            let full = (p[0].input_length / 16) as usize;
            assert_eq!(p[0].hash_ids[..full], p[1].hash_ids[..full]);
            assert_eq!(p[1].turn.unwrap(), p[0].turn.unwrap() + 1);
        }
        // Different keys share nothing.
        let other = recs.iter().find(|r| r.key != recs[0].key).unwrap();
        assert_ne!(other.hash_ids[0], recs[0].hash_ids[0]);
        assert_eq!(
            recs[0].hash_ids.len(),
            recs[0].input_length.div_ceil(16) as usize
        );
    }

    #[test]
    fn whales_and_drift() {
        let mut cfg = small();
        cfg.keys.whales = Some(Whales {
            count: 2,
            share: 0.5,
        });
        cfg.drift = Some(DriftConfig {
            sigma: 0.3,
            intervals: 4,
        });
        let w = Workload::from_config(cfg).unwrap();
        let wt = w.key_weights(1);
        assert!((wt[0] - 0.25).abs() < 1e-9);
        let by = w.expected_rates_by_interval(10.0, 1);
        assert_eq!(by.len(), 4);
        assert!(by[0] != by[3]);
        let recs: Vec<_> = w.generate(10.0, 100.0, 1).unwrap().collect();
        let whale = recs
            .iter()
            .filter(|r| r.key == "k000000" || r.key == "k000001")
            .count();
        let share = whale as f64 / recs.len() as f64;
        assert!(share > 0.3 && share < 0.7, "{share}");
    }

    /// Generate a trace and measure the whales' share of its requests: `share` is the share of
    /// offered traffic whether or not an active set is configured (the composed pipeline, not
    /// `add_whales` alone).
    #[test]
    fn whale_share_is_share_of_offered_traffic() {
        for active in [None, Some(256)] {
            let mut cfg = small();
            cfg.keys.count = 20_000;
            cfg.keys.active = active;
            cfg.keys.whales = Some(Whales {
                count: 4,
                share: 0.4,
            });
            cfg.prefix.system_prompt = LengthDist::Constant { value: 64 };
            cfg.prefix.user_message = LengthDist::Constant { value: 16 };
            cfg.prefix.output = LengthDist::Constant { value: 1 };
            cfg.prefix.block_size = 64;
            let w = Workload::from_config(cfg).unwrap();
            let wt = w.key_weights(3);
            let expected: f64 = wt[..4].iter().sum();
            assert!(
                (expected - 0.4).abs() < 1e-9,
                "{active:?}: weights {expected}"
            );
            let live = wt.iter().filter(|&&x| x > 0.0).count();
            assert_eq!(live, active.unwrap_or(20_000), "{active:?}: keys sending");
            let whales: Vec<&str> = w.key_names()[..4].iter().map(String::as_str).collect();
            let (mut n, mut hits) = (0usize, 0usize);
            for r in w.generate(1000.0, 100.0, 3).unwrap() {
                n += 1;
                hits += whales.contains(&r.key.as_str()) as usize;
            }
            let share = hits as f64 / n as f64;
            assert!(
                (share - 0.4).abs() <= 0.01,
                "{active:?}: whales carry {:.2}% of {n} requests, configured 40%",
                share * 100.0
            );
        }
    }

    #[test]
    fn active_set_must_hold_the_whales() {
        let mut c = small();
        c.keys.active = Some(2);
        c.keys.whales = Some(Whales {
            count: 4,
            share: 0.4,
        });
        let e = Workload::load(&c).unwrap_err().to_string();
        assert!(e.contains("keys.active: 2"), "{e}");
    }

    #[test]
    fn validation_lists_every_problem() {
        let mut c = GeneratorConfig::paper();
        c.prefix.block_size = 0;
        c.arrivals = ArrivalSpec::Gamma { cv: -1.0 };
        c.drift = Some(DriftConfig {
            sigma: 0.3,
            intervals: 0,
        });
        let e = Workload::load(&c).unwrap_err().to_string();
        assert!(
            e.contains("prefix.block_size")
                && e.contains("arrivals.cv")
                && e.contains("drift.intervals"),
            "{e}"
        );
    }

    #[test]
    fn yaml_section_roundtrip() {
        let y = "keys: { count: 1000, dist: { kind: zipf, exponent: 1.1 } }\n\
                 arrivals: { process: gamma, cv: 1.9 }\nprefix: { block_size: 512 }\n";
        let c: GeneratorConfig = yaml_serde::from_str(y).unwrap();
        assert_eq!(c.prefix.block_size, 512);
        assert_eq!(c.prefix.conversations_per_key, 4);
        assert_eq!(c.arrivals, ArrivalSpec::Gamma { cv: 1.9 });
        let back: GeneratorConfig =
            yaml_serde::from_str(&yaml_serde::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(yaml_serde::from_str::<GeneratorConfig>("keyz: {}\n").is_err());
    }

    #[test]
    fn alias_matches_weights() {
        let a = Alias::new(&[1.0, 3.0, 0.0, 6.0]);
        let mut rng = crate::rng::seeded(2);
        let mut c = [0usize; 4];
        for _ in 0..100_000 {
            c[a.sample(&mut rng)] += 1;
        }
        assert_eq!(c[2], 0);
        assert!((c[3] as f64 / 1e5 - 0.6).abs() < 0.01);
        assert!((c[0] as f64 / 1e5 - 0.1).abs() < 0.01);
    }
}
