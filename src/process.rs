//! Stopping child processes this crate started (engines, peer routers, telemetry agents): SIGTERM,
//! a grace period, then SIGKILL; always reaped. One way to stop, used by every live layer that
//! starts processes.
//!
//! Live layer (signals, the clock); imports nothing from the crate.

use std::process::Child;
use std::time::{Duration, Instant};

/// What a stop signals: the child alone, or the process group it leads (a child started with
/// `process_group(0)`), so that the processes it started go with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Process,
    Group,
}

/// Send `sig` to `c` (or to the group it leads). Call only while `c` has not been reaped: after
/// that its pid may name another process.
pub fn signal(c: &Child, scope: Scope, sig: libc::c_int) {
    let pid = c.id() as libc::pid_t;
    let target = match scope {
        Scope::Process => pid,
        Scope::Group => -pid,
    };
    // SAFETY: kill(2) touches no memory of ours; `target` is our own unreaped child or the
    // group it leads (a group id is not reused while any member is alive).
    unsafe {
        libc::kill(target, sig);
    }
}

/// Whether `c` has exited (it is reaped here) and, for a group, no member is left.
fn gone(c: &mut Child, scope: Scope) -> bool {
    if !matches!(c.try_wait(), Ok(Some(_))) {
        return false;
    }
    match scope {
        Scope::Process => true,
        Scope::Group => {
            let pgid = -(c.id() as libc::pid_t);
            // SAFETY: kill(2) with signal 0 sends nothing; it asks whether the group has a member.
            let alive = unsafe { libc::kill(pgid, 0) } == 0;
            !alive
        }
    }
}

/// SIGTERM, then SIGKILL once `grace` has passed with anything left; the child is reaped.
pub fn stop(c: &mut Child, scope: Scope, grace: Duration) {
    if gone(c, scope) {
        return;
    }
    signal(c, scope, libc::SIGTERM);
    let t0 = Instant::now();
    while !gone(c, scope) {
        if t0.elapsed() >= grace {
            // The leader may already be reaped (a group's member is what is left): signal the
            // group by id then, never the reaped pid alone.
            match (scope, c.try_wait()) {
                (Scope::Group, _) => signal(c, Scope::Group, libc::SIGKILL),
                (Scope::Process, Ok(None)) => signal(c, Scope::Process, libc::SIGKILL),
                _ => {}
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.wait();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    /// Alive and not a zombie.
    fn running(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
            .is_some_and(|r| !r.starts_with('Z'))
    }

    /// A group whose leader and member both ignore SIGTERM: the stop must SIGKILL them after
    /// the grace, member included (fails with a stop that only sends SIGTERM, or only to the
    /// leader).
    #[test]
    fn a_group_that_ignores_sigterm_is_killed_whole_after_the_grace() {
        let mut c = Command::new("sh")
            .args([
                "-c",
                "trap '' TERM; sh -c \"trap '' TERM; while :; do sleep 1; done\" & echo $!; wait",
            ])
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let member: u32 = line.trim().parse().unwrap();
        assert!(running(member));
        stop(&mut c, Scope::Group, Duration::from_millis(300));
        let t1 = Instant::now();
        while running(member) && t1.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!running(member), "the group's member outlived the stop");
    }

    /// A child that exits on SIGTERM is stopped without waiting out the grace.
    #[test]
    fn a_child_that_obeys_sigterm_is_reaped() {
        let mut c = Command::new("sleep").arg("30").spawn().unwrap();
        stop(&mut c, Scope::Process, Duration::from_secs(30));
        assert!(matches!(c.try_wait(), Ok(Some(_))));
    }
}
