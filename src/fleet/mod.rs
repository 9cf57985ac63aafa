//! The GPU fleet: inventories and replica placement ([`inventory`]), engine launch commands for
//! vLLM and SGLang ([`launch`]), and provisioning over SSH ([`provision`], [`ssh`]).
//!
//! Below the study layer: nothing here imports `experiment/` or `cli/` (a study's fleet spec
//! converts into [`launch::LaunchSpec`]); `tests/architecture.rs` checks it against docs/architecture.md.

pub mod inventory;
pub mod launch;
pub mod provision;
pub mod slurm;
pub mod ssh;

/// How to run `cacheroute agent` next to a fleet's engines for the length of a step as a local
/// command (`srun --jobid … cacheroute agent …` on a Slurm fleet) whose stdout is the agent's
/// JSON lines. On an SSH fleet the agent runs over the host's multiplexed session instead.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentCommand {
    /// The host (or Slurm node) the samples are from.
    pub host: String,
    pub program: String,
    pub args: Vec<String>,
}

/// The agent's command line on a fleet host.
pub const AGENT_LINE: [&str; 4] = ["cacheroute", "agent", "--interval-ms", "500"];

/// The last `n` non-empty lines of a log file, trimmed and joined with ` | ` (empty when the
/// file is missing or blank): what errors quote of an engine's or a job's log.
pub fn log_tail(path: &std::path::Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
