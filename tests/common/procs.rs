//! The real binary as child processes: `cacheroute emulate` backends and `cacheroute route`,
//! each killed when its handle drops, their `listening on http://ADDR` line read for the URL.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");

/// A running `cacheroute` child process.
pub struct Proc {
    pub child: Child,
    pub url: String,
    /// stderr, read as it comes by a thread (a chatty child never blocks on a full pipe).
    stderr: Option<std::thread::JoinHandle<String>>,
    /// What that thread has read so far.
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

/// Read `e` to its end on a thread, into `seen` as it comes.
fn drain(
    mut e: ChildStderr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n @ 1..) = e.read(&mut buf) {
            seen.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        let all = seen.lock().unwrap();
        String::from_utf8_lossy(&all).into_owned()
    })
}

impl Proc {
    /// Start `cacheroute ARGS` and wait (up to 60 s) for its `listening on` line. Panics with
    /// its stderr when it exits first.
    pub fn start(args: &[&str]) -> Proc {
        Proc::start_env(args, &[])
    }

    /// [`Proc::start`] with environment variables set (e.g. `RUST_LOG`).
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut child = Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cacheroute starts");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = tx.send(first);
            for _ in lines {} // keep the pipe drained
        });
        let mut p = Proc {
            child,
            url: String::new(),
            stderr: None,
            seen: Default::default(),
        };
        let stderr = p.child.stderr.take();
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(line)) if line.starts_with("listening on ") => {
                p.url = line["listening on ".len()..].trim().to_string();
                p.stderr = stderr.map(|e| drain(e, p.seen.clone()));
                p
            }
            other => {
                let _ = p.child.kill();
                let mut err = String::new();
                if let Some(mut e) = stderr {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("cacheroute {args:?} did not start ({other:?}): {err}");
            }
        }
    }

    /// A fast engine emulator (the tiny CPU engine, 50× faster than its model) serving `m`.
    pub fn emulator() -> Proc {
        Proc::emulator_at("127.0.0.1:0")
    }

    /// [`Proc::emulator`] listening on `addr` (e.g. to restart one on the port it had).
    pub fn emulator_at(addr: &str) -> Proc {
        Proc::emulator_scaled(addr, "50")
    }

    /// The tiny CPU engine's emulator serving `m` on `addr`, `time_scale` times faster than the
    /// model (below 1: slower, for streams still running when something happens).
    pub fn emulator_scaled(addr: &str, time_scale: &str) -> Proc {
        Proc::start(&[
            "emulate",
            "--listen",
            addr,
            "--engine",
            "tiny:cpu:bf16:tp1",
            "--time-scale",
            time_scale,
            "--model-name",
            "m",
        ])
    }

    /// Its stderr so far.
    pub fn log_so_far(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    /// Wait (up to `secs`) for a stderr line that `ok` holds of; panics with the log if none.
    pub fn wait_for_line(&self, secs: u64, what: &str, ok: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let log = self.log_so_far();
            if log.lines().any(&ok) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no line {what} in {secs} s: {log}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Send SIGTERM and wait (up to 60 s) for the exit; its status and stderr.
    pub fn terminate(mut self) -> (ExitStatus, String) {
        // SAFETY: signalling our own child by its pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                break s;
            }
            assert!(Instant::now() < deadline, "no exit within 60 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = self
            .stderr
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        (status, err)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What `child` wrote to its piped stderr, read to the end (the child has exited).
pub fn stderr_of(child: &mut Child) -> String {
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    err
}

/// `cacheroute ARGS` to completion: (status, stdout, stderr).
pub fn run(args: &[&str]) -> (ExitStatus, String, String) {
    let o = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cacheroute runs");
    (
        o.status,
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}
