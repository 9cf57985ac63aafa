//! A child process a study starts (an emulator, our router, an agent) that listens: started
//! with a piped stdout, its `listening on URL` line awaited, killed when its guard is dropped.

use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process killed (and reaped) when dropped.
pub struct ChildGuard {
    pub(super) child: Child,
    pub what: String,
    pub url: String,
}

impl ChildGuard {
    /// `what (pid N) exited (status)` when the child is no longer running.
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(st)) => Some(format!(
                "{} (pid {}) exited ({st})",
                self.what,
                self.child.id()
            )),
            Err(e) => Some(format!(
                "{} (pid {}): cannot tell whether it runs: {e}",
                self.what,
                self.child.id()
            )),
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawn `cacheroute ARGS…` and wait for its `listening on http://ADDR` line.
pub fn spawn_listening(what: &str, args: &[String], timeout: Duration) -> Result<ChildGuard> {
    let exe = std::env::current_exe().context("locating the cacheroute binary")?;
    let mut child = Command::new(&exe)
        .args(args)
        .arg("--exit-with-parent")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let mut guard = ChildGuard {
        child,
        what: what.to_string(),
        url: String::new(),
    };
    match rx.recv_timeout(timeout) {
        Ok(Some(Ok(line))) if line.starts_with("listening on ") => {
            guard.url = line.trim_start_matches("listening on ").trim().to_string();
            Ok(guard)
        }
        other => {
            let _ = guard.child.kill();
            let mut err = String::new();
            if let Some(mut e) = guard.child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            bail!(
                "{what} did not start (first line {:?}): {}",
                other.ok().flatten().and_then(|l| l.ok()),
                err.lines().last().unwrap_or("no error output")
            )
        }
    }
}

/// How long an emulator or the router may take to start listening.
pub(super) const START_TIMEOUT: Duration = Duration::from_secs(60);
