//! `cacheroute trace …` (in progress: owned by the workload work).

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum TraceCmd {
    /// Describe a trace.
    Stats {
        /// Trace file (JSONL).
        file: std::path::PathBuf,
    },
}

pub fn run(cmd: TraceCmd) -> anyhow::Result<()> {
    match cmd {
        TraceCmd::Stats { file } => anyhow::bail!("trace stats {}: not built yet", file.display()),
    }
}
