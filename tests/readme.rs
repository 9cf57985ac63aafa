//! Every command in the README's `sh` blocks runs, against the binary this suite built, so none
//! can rot. `cargo run --release -- ARGS` and `cacheroute ARGS` both run that binary with ARGS,
//! in a scratch directory that sees the repository's `data/` and `experiments/` (so the demo's
//! report does not land in the checkout). Two lines are not run, by name: `bash scripts/test.sh`
//! (this suite itself) and `cargo install --path .` (a second full release build; the test
//! checks the package has the `cacheroute` binary it would install). Any other line fails the
//! test until it is given a meaning here.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The commands of every ```sh block: comments dropped, `\` continuations joined.
fn commands(readme: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in readme.lines() {
        let t = line.trim();
        if !in_sh {
            in_sh = t == "```sh";
            continue;
        }
        if t == "```" {
            in_sh = false;
            assert!(
                pending.is_empty(),
                "a command ends its block with `\\`: {pending}"
            );
            continue;
        }
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            pending.push_str(head.trim_end());
            pending.push(' ');
            continue;
        }
        pending.push_str(t);
        out.push(std::mem::take(&mut pending));
    }
    out
}

enum Step {
    Run(Vec<String>),
    Skip(&'static str),
}

fn meaning(cmd: &str) -> Result<Step, String> {
    let words: Vec<String> = cmd.split_whitespace().map(String::from).collect();
    if cmd == "bash scripts/test.sh" {
        return Ok(Step::Skip("the test suite itself"));
    }
    if cmd.starts_with("cargo install --path .") {
        let toml = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
        assert!(
            toml.contains("[[bin]]\nname = \"cacheroute\""),
            "`cargo install --path .` would not install a `cacheroute` binary"
        );
        return Ok(Step::Skip("a second release build"));
    }
    if let Some(rest) = cmd
        .strip_prefix("cargo run --profile quick -- ")
        .or_else(|| cmd.strip_prefix("cargo run --release -- "))
    {
        return Ok(Step::Run(
            rest.split_whitespace().map(String::from).collect(),
        ));
    }
    if words.first().map(String::as_str) == Some("cacheroute") {
        return Ok(Step::Run(words[1..].to_vec()));
    }
    Err(format!(
        "README command not understood by tests/readme.rs: `{cmd}` (give it a meaning there)"
    ))
}

fn link(dir: &Path, name: &str) {
    std::os::unix::fs::symlink(repo().join(name), dir.join(name)).unwrap();
}

#[test]
fn every_readme_command_runs() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let cmds = commands(&readme);
    assert!(
        cmds.iter().any(|c| c.ends_with("-- demo")),
        "the README's first command (the demo) is missing: {cmds:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    link(dir.path(), "data");
    link(dir.path(), "experiments");
    let mut ran = 0;
    for cmd in &cmds {
        match meaning(cmd).unwrap_or_else(|e| panic!("{e}")) {
            Step::Skip(why) => eprintln!("not run ({why}): {cmd}"),
            Step::Run(args) => {
                eprintln!("running: {cmd}");
                let out = Command::new(env!("CARGO_BIN_EXE_cacheroute"))
                    .args(&args)
                    .current_dir(dir.path())
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "README command failed: `{cmd}`\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                ran += 1;
            }
        }
    }
    assert!(ran >= 2, "only {ran} README commands ran: {cmds:?}");
    // What the README says the demo writes.
    assert!(dir.path().join("reports/quickstart.md").is_file());
}

/// The parser and the mapping can fail: a block with an unknown command, and a block whose
/// last line continues into nothing.
#[test]
fn an_unknown_readme_command_is_refused() {
    let cmds = commands("text\n```sh\n# comment\nls -la \\\n  /tmp\ncacheroute plan --help\n```\n");
    assert_eq!(cmds, vec!["ls -la /tmp", "cacheroute plan --help"]);
    assert!(meaning(&cmds[0]).is_err());
    assert!(matches!(meaning(&cmds[1]), Ok(Step::Run(a)) if a == ["plan", "--help"]));
    let r = std::panic::catch_unwind(|| commands("```sh\nls \\\n```\n"));
    assert!(r.is_err());
}
