//! Running commands on inventory hosts over SSH, through the system `ssh` client (so
//! `~/.ssh/config`, agents and jump hosts work as users expect), with batch mode, connect
//! timeouts and the inventory's host-key policy; and the per-host preflight: reachable,
//! `nvidia-smi` reports the expected GPUs, scratch directory writable, engine ports free.
//! Every failure names the host and what to do. Secrets never appear in messages: only the
//! identity file's path is ever printed.
//!
//! Transport: one multiplexed session per host and process (the `openssh` crate, native mux:
//! a ControlMaster `ssh` process per host, each command a channel over its control socket), so
//! preflight, launch, status, teardown and the agent stream pay for one connection and one
//! authentication per host, not one per command. Sessions are opened on first use, shared by
//! every [`Remote`] of the same destination, reopened when their master has gone, and closed
//! by [`close_all`]; a master left behind by a killed controller exits after
//! [`MASTER_IDLE_EXIT`] without a client (its control directory is removed by a later run). [`Transport::PerCall`] is the old way (a fresh `ssh`
//! per command), kept for comparison (`tests/multi_host.rs`, `preflight_timing`).
//!
//! The crate is async: its futures run on one small runtime of this module's own, and the
//! blocking callers wait on a channel, so they work from plain threads and from inside another
//! runtime alike.

use super::inventory::{Host, HostKeyChecking, Inventory};
use std::collections::HashMap;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// How long a session's master connection stays up without any client (a command or a
/// stream): the bound on how long one outlives a controller killed with SIGKILL.
pub const MASTER_IDLE_EXIT: Duration = Duration::from_secs(15);

/// What went wrong on a host.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("host {host}: ssh refused authentication for user `{user}`; check `user:` and `identity:` in the inventory and that the key is authorized on the host")]
    Auth { host: String, user: String },
    #[error("host {host}: host key not trusted ({detail}); add it to known_hosts, or set host_key_checking: accept-new")]
    HostKey { host: String, detail: String },
    #[error("host {host}: cannot connect ({detail}); check `address:` and `port:` and that sshd runs there")]
    Connect { host: String, detail: String },
    #[error("host {host}: `{command}` exited {code}: {stderr}")]
    Remote {
        host: String,
        command: String,
        code: i32,
        stderr: String,
    },
    #[error("host {host}: {detail}")]
    Preflight { host: String, detail: String },
    #[error("running ssh: {0}")]
    Io(#[from] std::io::Error),
}

/// How commands reach a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// One multiplexed session per host, shared by every command (the default).
    #[default]
    Mux,
    /// A fresh `ssh` connection per command.
    PerCall,
}

/// SSH access to one host.
#[derive(Debug, Clone)]
pub struct Remote {
    pub host: Host,
    pub checking: HostKeyChecking,
    pub connect_timeout: Duration,
    pub transport: Transport,
}

/// The runtime the `openssh` futures run on.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ssh")
            .enable_all()
            .build()
            .expect("starting the ssh runtime")
    })
}

/// Run `f` on the ssh runtime and wait for it (from any thread, inside a runtime or not).
fn block<F>(f: F) -> F::Output
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    runtime().spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv().expect("an ssh task panicked")
}

/// What identifies a session: everything that goes into the master's command line.
type SessionKey = (
    String,
    String,
    u16,
    Option<std::path::PathBuf>,
    HostKeyChecking,
);

/// One slot per destination; the slot's lock is held while its session is opened, so two
/// threads never open two masters to one host.
type Slot = Arc<Mutex<Option<Arc<openssh::Session>>>>;

fn sessions() -> &'static Mutex<HashMap<SessionKey, Slot>> {
    static S: OnceLock<Mutex<HashMap<SessionKey, Slot>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Close every open session (their master connections exit). Commands after this open new
/// ones.
pub fn close_all() {
    let slots: Vec<Slot> = sessions()
        .lock()
        .expect("ssh sessions")
        .drain()
        .map(|(_, s)| s)
        .collect();
    for slot in slots {
        let taken = slot.lock().expect("ssh session").take();
        if let Some(s) = taken {
            if let Ok(s) = Arc::try_unwrap(s) {
                let _ = block(s.close());
            }
            // Still in use (a stream): its master stops when the last user drops it.
        }
    }
}

/// Turn `ssh`'s stderr on a failed connection into an error naming the host.
fn classify_ssh_failure(host: &Host, stderr: &str) -> SshError {
    let name = host.name.clone();
    let low = stderr.to_ascii_lowercase();
    if low.contains("permission denied") || low.contains("authentication") {
        return SshError::Auth {
            host: name,
            user: host.user.clone(),
        };
    }
    if low.contains("host key") {
        return SshError::HostKey {
            host: name,
            detail: last_line(stderr),
        };
    }
    SshError::Connect {
        host: name,
        detail: last_line(stderr),
    }
}

/// A remote command's output lines as they come, until [`LineStream::stop`] (or drop).
pub struct LineStream {
    pub lines: std::sync::mpsc::Receiver<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    child: Option<std::process::Child>,
}

impl LineStream {
    /// End the remote command's channel (the command ends on its next write) and return what
    /// was not read yet.
    pub fn stop(mut self) -> Vec<String> {
        self.end();
        self.lines.try_iter().collect()
    }

    fn end(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = block(t);
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LineStream {
    fn drop(&mut self) {
        self.end();
    }
}

impl Remote {
    pub fn new(inv: &Inventory, host: &Host) -> Remote {
        Remote {
            host: host.clone(),
            checking: inv.host_key_checking,
            connect_timeout: Duration::from_secs(10),
            transport: Transport::Mux,
        }
    }

    /// The same host reached with `transport`.
    pub fn with_transport(mut self, transport: Transport) -> Remote {
        self.transport = transport;
        self
    }

    /// Checked again here: a Host built in code skips the inventory's validation.
    fn check_shape(&self) -> Result<(), SshError> {
        for (field, value) in [("address", &self.host.address), ("user", &self.host.user)] {
            if let Some(why) = super::inventory::argv_shape_problem(value) {
                return Err(SshError::Preflight {
                    host: self.host.name.clone(),
                    detail: format!("{field} `{}` {why}", value.escape_debug()),
                });
            }
        }
        Ok(())
    }

    /// The `ssh` argument vector for running `command` on a connection of its own.
    pub fn ssh_args(&self, command: &str) -> Vec<String> {
        let h = &self.host;
        let mut a: Vec<String> = vec![
            "-o".into(),
            "BatchMode=yes".into(),
            "-o".into(),
            format!("ConnectTimeout={}", self.connect_timeout.as_secs().max(1)),
            "-o".into(),
            "LogLevel=ERROR".into(),
            "-p".into(),
            h.port.to_string(),
        ];
        match self.checking {
            HostKeyChecking::Strict => a.extend(["-o".into(), "StrictHostKeyChecking=yes".into()]),
            HostKeyChecking::AcceptNew => {
                a.extend(["-o".into(), "StrictHostKeyChecking=accept-new".into()])
            }
            HostKeyChecking::InsecureOff => a.extend([
                "-o".into(),
                "StrictHostKeyChecking=no".into(),
                "-o".into(),
                "UserKnownHostsFile=/dev/null".into(),
            ]),
        }
        if let Some(id) = &h.identity {
            a.extend([
                "-i".into(),
                id.display().to_string(),
                "-o".into(),
                "IdentitiesOnly=yes".into(),
            ]);
        }
        // Options end before the destination, so no inventory value is ever read as one.
        a.push("--".into());
        a.push(format!("{}@{}", h.user, h.address));
        a.push(command.to_string());
        a
    }

    fn key(&self) -> SessionKey {
        let h = &self.host;
        (
            h.user.clone(),
            h.address.clone(),
            h.port,
            h.identity.clone(),
            self.checking,
        )
    }

    /// Open the master connection to the host.
    fn connect(&self) -> Result<openssh::Session, SshError> {
        let h = &self.host;
        let mut b = openssh::SessionBuilder::default();
        b.user(h.user.clone())
            .port(h.port)
            .connect_timeout(self.connect_timeout.max(Duration::from_secs(1)))
            .control_directory(Self::control_dir())
            .control_persist(openssh::ControlPersist::IdleFor(
                std::num::NonZeroUsize::new(MASTER_IDLE_EXIT.as_secs() as usize).expect("non-zero"),
            ))
            .server_alive_interval(Duration::from_secs(5))
            .known_hosts_check(match self.checking {
                HostKeyChecking::Strict => openssh::KnownHosts::Strict,
                HostKeyChecking::AcceptNew => openssh::KnownHosts::Add,
                HostKeyChecking::InsecureOff => openssh::KnownHosts::Accept,
            });
        if self.checking == HostKeyChecking::InsecureOff {
            b.user_known_hosts_file("/dev/null");
        }
        if let Some(id) = &h.identity {
            b.keyfile(id);
        }
        let address = h.address.clone();
        match block(async move { b.connect_mux(address).await }) {
            Ok(s) => Ok(s),
            Err(openssh::Error::Connect(e)) => Err(classify_ssh_failure(h, &e.to_string())),
            Err(e) => Err(SshError::Connect {
                host: h.name.clone(),
                detail: crate::error_chain(&e),
            }),
        }
    }

    /// Where the sessions' control sockets live: `$TMPDIR/cacheroute-ssh` (short, as socket paths
    /// must be), one `.ssh-connection*` directory per session. Directories of masters that have
    /// exited (their socket gone, e.g. after a killed controller) are removed here once they are
    /// a minute old.
    fn control_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join("cacheroute-ssh");
        if std::fs::create_dir_all(&dir).is_ok() {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|d| d > Duration::from_secs(60)));
            if old && !p.join("master").exists() {
                let _ = std::fs::remove_dir_all(&p);
            }
        }
        dir
    }

    /// This host's shared session, opened when there is none (or its master has gone); `fresh`
    /// opens a new one in any case.
    fn session(&self, fresh: bool) -> Result<Arc<openssh::Session>, SshError> {
        let slot = sessions()
            .lock()
            .expect("ssh sessions")
            .entry(self.key())
            .or_default()
            .clone();
        let mut s = slot.lock().expect("ssh session");
        if fresh {
            *s = None;
        }
        // A master that exited (idle, or its connection lost) removed its control socket.
        if let Some(x) = s.as_ref().filter(|x| x.control_socket().exists()) {
            return Ok(x.clone());
        }
        let x = Arc::new(self.connect()?);
        *s = Some(x.clone());
        Ok(x)
    }

    /// Run `command` on the host; a failure of ssh itself is classified (auth, host key,
    /// connect), a failure of the command is `Remote`.
    pub fn run(&self, command: &str) -> Result<Output, SshError> {
        self.check_shape()?;
        match self.transport {
            Transport::PerCall => self.run_per_call(command),
            Transport::Mux => self.run_mux(command),
        }
    }

    fn run_mux(&self, command: &str) -> Result<Output, SshError> {
        let mut fresh = false;
        loop {
            let session = self.session(fresh)?;
            let cmd = command.to_string();
            let out = block(async move {
                session
                    .arc_raw_command(cmd)
                    .stdin(openssh::Stdio::null())
                    .output()
                    .await
            });
            match out {
                Ok(out) => return self.command_result(command, out),
                // The master could not be reached through its socket, so the command was not
                // started: reopen once. (A failure after it started is not retried: a launch
                // must not run twice.)
                Err(openssh::Error::SshMux(_)) if !fresh => {
                    fresh = true;
                }
                Err(e) => {
                    return Err(SshError::Connect {
                        host: self.host.name.clone(),
                        detail: format!("running `{command}`: {}", crate::error_chain(&e)),
                    })
                }
            }
        }
    }

    fn command_result(&self, command: &str, out: Output) -> Result<Output, SshError> {
        if out.status.success() {
            return Ok(out);
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        Err(SshError::Remote {
            host: self.host.name.clone(),
            command: command.to_string(),
            code: out.status.code().unwrap_or(-1),
            stderr: last_line(&stderr),
        })
    }

    fn run_per_call(&self, command: &str) -> Result<Output, SshError> {
        let out = Command::new("ssh")
            .args(self.ssh_args(command))
            .stdin(Stdio::null())
            .output()?;
        if out.status.success() || out.status.code() != Some(255) {
            return self.command_result(command, out);
        }
        Err(classify_ssh_failure(
            &self.host,
            &String::from_utf8_lossy(&out.stderr),
        ))
    }

    /// `run`, returning stdout as text.
    pub fn run_text(&self, command: &str) -> Result<String, SshError> {
        Ok(String::from_utf8_lossy(&self.run(command)?.stdout).into_owned())
    }

    /// Start `command` on the host and deliver its stdout line by line.
    pub fn stream_lines(&self, command: &str) -> Result<LineStream, SshError> {
        self.check_shape()?;
        let (tx, rx) = std::sync::mpsc::channel();
        if self.transport == Transport::PerCall {
            let mut child = Command::new("ssh")
                .args(self.ssh_args(command))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()?;
            let out = child.stdout.take().expect("piped");
            std::thread::spawn(move || {
                use std::io::BufRead;
                for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
            return Ok(LineStream {
                lines: rx,
                stop: None,
                task: None,
                child: Some(child),
            });
        }
        let mut fresh = false;
        let mut child = loop {
            let session = self.session(fresh)?;
            let cmd = command.to_string();
            let spawned = block(async move {
                openssh::Session::to_raw_command(session, cmd)
                    .stdin(openssh::Stdio::null())
                    .stdout(openssh::Stdio::piped())
                    .stderr(openssh::Stdio::null())
                    .spawn()
                    .await
            });
            match spawned {
                Ok(c) => break c,
                Err(openssh::Error::SshMux(_)) if !fresh => fresh = true,
                Err(e) => {
                    return Err(SshError::Connect {
                        host: self.host.name.clone(),
                        detail: format!("starting `{command}`: {}", crate::error_chain(&e)),
                    })
                }
            }
        };
        let out = child.stdout().take().expect("piped");
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let task = runtime().spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(out).lines();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    l = lines.next_line() => match l {
                        Ok(Some(l)) => {
                            if tx.send(l).is_err() {
                                break;
                            }
                        }
                        _ => break,
                    },
                }
            }
            // Dropping the child closes its channel: the remote command's output pipe closes.
            drop(lines);
            drop(child);
        });
        Ok(LineStream {
            lines: rx,
            stop: Some(stop),
            task: Some(task),
            child: None,
        })
    }
}

fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .trim()
        .to_string()
}

/// What preflight found on a host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostReport {
    pub host: String,
    pub gpus: Vec<String>,
    pub free_disk_mib: Option<u64>,
}

/// Check one host before anything is started on it: reachable and authenticated; `nvidia-smi`
/// present and reporting the inventory's GPU count and model; the scratch directory writable;
/// the engine ports free.
pub fn preflight(remote: &Remote, ports: &[u16]) -> Result<HostReport, SshError> {
    let h = &remote.host;
    remote.run("true")?;
    let smi = remote.run_text("nvidia-smi --query-gpu=name --format=csv,noheader").map_err(|e| match e {
        SshError::Remote { .. } => SshError::Preflight {
            host: h.name.clone(),
            detail: "nvidia-smi is missing or failed; install the NVIDIA driver or fix the host's PATH".into(),
        },
        other => other,
    })?;
    let gpus: Vec<String> = smi
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if gpus.len() != h.gpus.count as usize {
        return Err(SshError::Preflight {
            host: h.name.clone(),
            detail: format!(
                "nvidia-smi reports {} GPU(s) but the inventory says {}; fix `gpus.count` or the host",
                gpus.len(),
                h.gpus.count
            ),
        });
    }
    if let Some(bad) = gpus.iter().find(|g| !g.contains(h.gpus.model.as_str())) {
        return Err(SshError::Preflight {
            host: h.name.clone(),
            detail: format!(
                "GPU `{bad}` is not the inventory's `{}`; fix `gpus.model`",
                h.gpus.model
            ),
        });
    }
    let scratch = super::launch::sh_quote(&h.scratch.display().to_string());
    let df = remote
        .run_text(&format!(
            "mkdir -p {scratch} && test -w {scratch} && df -Pm {scratch} | tail -1"
        ))
        .map_err(|e| match e {
            SshError::Remote { stderr, .. } => SshError::Preflight {
                host: h.name.clone(),
                detail: format!(
                    "scratch directory {} is not writable ({stderr}); fix `scratch:`",
                    h.scratch.display()
                ),
            },
            other => other,
        })?;
    let free_disk_mib = df.split_whitespace().nth(3).and_then(|x| x.parse().ok());
    if !ports.is_empty() {
        let list = ports
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        // A port is busy when something accepts on it (bash's /dev/tcp, no extra tools needed).
        let busy = remote.run_text(&format!(
            "for p in {list}; do (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null && echo $p; done; true"
        ))?;
        let busy: Vec<&str> = busy.split_whitespace().collect();
        if !busy.is_empty() {
            return Err(SshError::Preflight {
                host: h.name.clone(),
                detail: format!(
                    "port(s) {} already in use; stop what holds them or change `base_port`",
                    busy.join(", ")
                ),
            });
        }
    }
    Ok(HostReport {
        host: h.name.clone(),
        gpus,
        free_disk_mib,
    })
}
