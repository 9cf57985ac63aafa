//! The GPU fleet: inventories and replica placement ([`inventory`]), engine launch commands for
//! vLLM and SGLang ([`launch`]), and provisioning over SSH ([`provision`], [`ssh`]).
//!
//! Below the study layer: nothing here imports `experiment/` or `cli/` (a study's fleet spec
//! converts into [`launch::LaunchSpec`]); the test at the end of this file checks it.

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

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// Paths a fleet module must not name: the study layer and the command line above it.
    fn forbidden() -> Vec<String> {
        ["experiment", "cli"]
            .iter()
            .flat_map(|m| [format!("crate::{m}"), format!("super::super::{m}")])
            .collect()
    }

    /// Every `file:line: text` under `dir` (Rust files, recursively) that names a forbidden path.
    fn layer_violations(dir: &Path) -> Vec<String> {
        let mut files: Vec<PathBuf> = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        files.sort();
        let bad = forbidden();
        let mut out = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            for (i, line) in text.lines().enumerate() {
                if bad.iter().any(|b| line.contains(b.as_str())) {
                    out.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
                }
            }
        }
        out
    }

    #[test]
    fn fleet_code_never_imports_the_study_layer_or_the_cli() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/fleet");
        let v = layer_violations(&dir);
        assert!(
            v.is_empty(),
            "fleet/ must not import experiment/ or cli/:\n{}",
            v.join("\n")
        );
        // The scan finds such an import when there is one.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("sub")).unwrap();
        std::fs::write(
            tmp.path().join("ok.rs"),
            "use crate::engine::KnobOverrides;\n",
        )
        .unwrap();
        let bad = format!(
            "use {}::spec::Fleet;\nfn f() {{ {}::run(); }}\n",
            forbidden()[0],
            forbidden()[2]
        );
        std::fs::write(tmp.path().join("sub/bad.rs"), bad).unwrap();
        let v = layer_violations(tmp.path());
        assert_eq!(v.len(), 2, "{v:?}");
        assert!(
            v[0].contains("bad.rs:1:") && v[1].contains("bad.rs:2:"),
            "{v:?}"
        );
    }
}
