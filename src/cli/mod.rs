//! The command-line layer: a thin clap front over the library. Each subcommand lives in its own
//! file; failures print one line (`error: …`) and exit non-zero.

use clap::{Parser, Subcommand};

pub mod advise;
pub mod agent;
pub mod calibrate;
pub mod emulate;
pub mod epp;
pub mod fleet;
pub mod logging;
pub mod peer;
pub mod plan;
pub mod replay;
pub mod route;
pub mod simulate;
pub mod study;
pub mod trace;

#[derive(Parser, Debug)]
#[command(
    name = "cacheroute",
    version,
    about = "Plan, route, measure and simulate prefix-affinity routing for LLM serving fleets"
)]
pub struct Cli {
    /// Log lines on stderr as `text` or one JSON object per line (`json`); levels from
    /// RUST_LOG (default `info`; e.g. RUST_LOG=debug, RUST_LOG=cacheroute::router=debug).
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    pub log_format: logging::LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the quickstart study in simulation and write its report (seconds once built).
    Demo(study::DemoArgs),
    /// Run a study: policies × seeds × sweep points × ladder steps; store results; write the report.
    Run(Box<study::RunArgs>),
    /// Regenerate a study's report from the database alone (or list the studies in it).
    Report(study::ReportArgs),
    /// Set two studies side by side (e.g. fp8 against fp16).
    Compare(study::CompareArgs),
    /// Run the routing proxy in front of OpenAI-compatible engines.
    Route(Box<route::RouteArgs>),
    /// Run the router as an Envoy ext_proc endpoint picker (Gateway API Inference Extension).
    Epp(Box<epp::EppArgs>),
    /// Run a vLLM-compatible engine emulator driven by the engine model in real time.
    Emulate(Box<emulate::EmulateArgs>),
    /// Start an external router (SMG, vLLM router, SGLang router, Envoy, nginx) as a study does.
    Peer(peer::PeerArgs),
    /// Replay a trace (or generated workload) open-loop against an endpoint.
    Replay(Box<replay::ReplayArgs>),
    /// Inventories: preflight the hosts, or show where a study's replicas go.
    #[command(subcommand)]
    Fleet(fleet::FleetCmd),
    /// Find q_cap (one destination's p99 knee) and suggest W for a study.
    Calibrate(Box<calibrate::CalibrateArgs>),
    /// GPU telemetry on this host (NVML, else nvidia-smi), one JSON sample per line.
    Agent(agent::AgentArgs),
    /// Build a CacheRoute plan (Algorithm 1) from a `key,rate[,prefix_tokens]` CSV.
    Plan(plan::PlanArgs),
    /// Write a synthetic `key,rate` CSV (lognormal or Zipf, optional whales).
    Rates(plan::RatesArgs),
    /// Plan churn under rate drift: a fresh LPT plan against the churn-aware replanner.
    Churn(plan::ChurnArgs),
    /// Simulate one policy on a fleet of engine models and print hit rate, latency, imbalance.
    Simulate(Box<simulate::SimulateArgs>),
    /// Traces: generate, import, and describe (including the reuse diagnostic).
    #[command(subcommand)]
    Trace(trace::TraceCmd),
    /// Will affinity pay on your traffic? Reuse diagnostic, a simulated A/B of every policy
    /// around your load, and a win / tie / lose verdict.
    Advise(Box<advise::AdviseArgs>),
}

/// Parse arguments, run, and return the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    logging::init(cli.log_format);
    let json_logs = cli.log_format == logging::LogFormat::Json;
    let result = match cli.command {
        Command::Plan(a) => plan::run(a),
        Command::Churn(a) => plan::run_churn(a),
        Command::Rates(a) => plan::run_rates(a),
        Command::Trace(c) => trace::run(c),
        Command::Simulate(a) => simulate::run(*a),
        Command::Demo(a) => study::demo(a),
        Command::Agent(a) => agent::run(a),
        Command::Fleet(c) => fleet::run(c),
        Command::Calibrate(a) => calibrate::run(*a),
        Command::Route(a) => route::run(*a),
        Command::Epp(a) => epp::run(*a),
        Command::Emulate(a) => emulate::run(*a),
        Command::Peer(a) => peer::run(a),
        Command::Replay(a) => replay::run(*a),
        Command::Run(a) => study::run(*a),
        Command::Report(a) => study::report(a),
        Command::Compare(a) => study::compare(a),
        Command::Advise(a) => advise::run(*a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            // One line first: the cause chain joined, most specific last.
            let msg = format!("{e:#}");
            if json_logs {
                tracing::error!("{}", msg.replace('\n', " "));
            } else {
                eprintln!("error: {}", msg.replace('\n', " "));
            }
            if e.downcast_ref::<advise::NoVerdict>().is_some() {
                3
            } else {
                1
            }
        }
    }
}

/// Write a file atomically: to a temporary sibling, then rename, so a failure never leaves a
/// half-written output behind.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp{}",
        path.file_name().and_then(|s| s.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming into {}", path.display()))?;
    Ok(())
}

/// For child processes of a study runner: exit when the parent's end of our stdin closes, so a
/// runner killed with SIGKILL never leaves an engine or router behind.
pub fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        use std::io::Read;
        let mut buf = [0u8; 256];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => std::process::exit(0),
                Ok(_) => {}
            }
        }
    });
}

/// The generator config named by a `--workload` flag: `paper` (or nothing) for the paper preset,
/// else a YAML file; `--block-tokens` overrides its block size; validated.
pub fn workload_config(
    name: Option<&str>,
    block_size: Option<u32>,
) -> anyhow::Result<crate::workload::gen::GeneratorConfig> {
    use anyhow::Context;
    let mut cfg = match name {
        None | Some("paper") => crate::workload::gen::GeneratorConfig::paper(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading workload {path}"))?;
            let cfg: crate::workload::gen::GeneratorConfig =
                yaml_serde::from_str(&text).with_context(|| format!("workload {path}"))?;
            cfg.relative_to(config_dir(std::path::Path::new(path)))
        }
    };
    if let Some(b) = block_size {
        cfg.prefix.block_size = b;
    }
    let problems = cfg.validate();
    if !problems.is_empty() {
        anyhow::bail!("workload: {}", problems.join("; "));
    }
    Ok(cfg)
}

/// The policy a `--policy` flag names: a name (`PolicySpec::from_name`), or a spec as a YAML
/// flow mapping, as a study's `policies:` entry is written (`{policy: cacheroute,
/// cold_tail_epsilon: 1}`). Not range-checked here: the caller checks `problems()` once, after
/// its own flags have changed the spec.
pub fn policy_arg(flag: &str, text: &str) -> anyhow::Result<crate::policy::PolicySpec> {
    if !text.trim_start().starts_with('{') {
        return crate::policy::PolicySpec::from_name(text)
            .map_err(|e| anyhow::anyhow!("{flag}: {e}"));
    }
    yaml_serde::from_str(text).map_err(|e| anyhow::anyhow!("{flag} `{text}`: {e}"))
}

/// The directory that relative paths inside the configuration file `file` are taken from.
pub(crate) fn config_dir(file: &std::path::Path) -> &std::path::Path {
    file.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
}

/// Refuse a generated run of `--qps` × `--duration` that is too large (see
/// [`crate::workload::gen::run_size_problem`]).
pub(crate) fn check_run_size(qps: f64, duration_s: f64) -> anyhow::Result<()> {
    match crate::workload::gen::run_size_problem("--qps", qps, "--duration", duration_s) {
        Some(e) => anyhow::bail!(e),
        None => Ok(()),
    }
}

/// A trace file read whole, rescaled to `qps` if given (else shifted to start at 0), cut at
/// `duration_s`; and whether anything was cut (`replay` and `simulate`).
pub(crate) fn load_trace_file(
    path: &std::path::Path,
    qps: Option<f64>,
    duration_s: f64,
) -> anyhow::Result<(Vec<crate::workload::trace::TraceRecord>, bool)> {
    use crate::workload::trace::{ReaderOptions, TraceReader};
    use anyhow::Context;
    let f =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let reader = TraceReader::new(std::io::BufReader::new(f), ReaderOptions::default());
    let mut v = Vec::new();
    for r in reader {
        v.push(r.with_context(|| format!("{}", path.display()))?);
    }
    if v.is_empty() {
        anyhow::bail!("trace {} has no requests", path.display());
    }
    match qps {
        Some(q) => crate::loadgen::rescale_to_qps(&mut v, q),
        None => {
            let t0 = v[0].timestamp_ms;
            for r in v.iter_mut() {
                r.timestamp_ms -= t0;
            }
        }
    }
    let n = v.len();
    v.retain(|r| r.timestamp_ms / 1000.0 < duration_s);
    let cut = v.len() < n;
    Ok((v, cut))
}

/// What `--help` promises a newcomer: every leaf subcommand ends with an example, and every
/// option and argument a user can see says what it is.
#[cfg(test)]
pub(crate) fn help_gaps(cmd: &clap::Command, path: &str) -> Vec<String> {
    let mut gaps = Vec::new();
    let here = format!("{path} {}", cmd.get_name()).trim().to_string();
    let leaf = cmd.get_subcommands().next().is_none();
    if leaf {
        let after = cmd
            .get_after_help()
            .map(|s| s.to_string())
            .unwrap_or_default();
        if !after.contains("Example") {
            gaps.push(format!("{here}: no example in --help"));
        }
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || id == "help" || id == "version" {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                gaps.push(format!("{here}: {id} has no description"));
            }
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            gaps.extend(help_gaps(sub, &here));
        }
    }
    gaps
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    #[test]
    fn every_command_explains_itself() {
        let gaps = super::help_gaps(&super::Cli::command(), "");
        assert!(gaps.is_empty(), "{}", gaps.join("\n"));
    }

    /// The example lines of every `--help` (`cacheroute …`, `\` continuations joined, a
    /// trailing `# comment` dropped).
    fn examples(cmd: &clap::Command, out: &mut Vec<String>) {
        if let Some(after) = cmd.get_after_help() {
            let mut pending = String::new();
            for line in after.to_string().lines() {
                let t = line.trim();
                let t = t.split(" #").next().unwrap_or(t).trim();
                if pending.is_empty() && !t.starts_with("cacheroute ") {
                    continue;
                }
                match t.strip_suffix('\\') {
                    Some(head) => {
                        pending.push_str(head);
                        pending.push(' ');
                    }
                    None => {
                        pending.push_str(t);
                        out.push(std::mem::take(&mut pending));
                    }
                }
            }
        }
        for sub in cmd.get_subcommands() {
            examples(sub, out);
        }
    }

    /// Every example in `--help` parses: its flags exist and its values fit them.
    #[test]
    fn every_help_example_parses() {
        let mut ex = Vec::new();
        examples(&super::Cli::command(), &mut ex);
        assert!(ex.len() >= 20, "{ex:?}");
        let bad: Vec<String> = ex
            .iter()
            .filter_map(|e| {
                super::Cli::try_parse_from(e.split_whitespace())
                    .err()
                    .map(|err| format!("`{e}`: {}", err.to_string().lines().next().unwrap_or("")))
            })
            .collect();
        assert!(bad.is_empty(), "{}", bad.join("\n"));
        // The check can fail: a flag that does not exist.
        assert!(super::Cli::try_parse_from("cacheroute demo --no-such-flag".split(' ')).is_err());
    }

    /// The check can fail: a command without an example or an option without a description.
    #[test]
    fn a_command_without_examples_is_found() {
        let bare = clap::Command::new("bare")
            .arg(clap::Arg::new("x").long("x"))
            .arg(clap::Arg::new("y").long("y").help("what y is"));
        let gaps = super::help_gaps(&bare, "");
        assert_eq!(
            gaps,
            vec!["bare: no example in --help", "bare: x has no description"]
        );
    }
}
