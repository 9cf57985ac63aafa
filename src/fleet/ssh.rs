//! Running commands on inventory hosts over SSH, through the system `ssh` client (so
//! `~/.ssh/config`, agents and jump hosts work as users expect), with batch mode, connect
//! timeouts and the inventory's host-key policy; and the per-host preflight: reachable,
//! `nvidia-smi` reports the expected GPUs, scratch directory writable, engine ports free.
//! Every failure names the host and what to do. Secrets never appear in messages: only the
//! identity file's path is ever printed.

use super::inventory::{Host, HostKeyChecking, Inventory};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

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

/// SSH access to one host.
#[derive(Debug, Clone)]
pub struct Remote {
    pub host: Host,
    pub checking: HostKeyChecking,
    pub connect_timeout: Duration,
}

impl Remote {
    pub fn new(inv: &Inventory, host: &Host) -> Remote {
        Remote {
            host: host.clone(),
            checking: inv.host_key_checking,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// The `ssh` argument vector for running `command`.
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

    /// Run `command` on the host; a failure of ssh itself is classified (auth, host key,
    /// connect), a failure of the command is `Remote`.
    pub fn run(&self, command: &str) -> Result<Output, SshError> {
        // Checked again here: a Host built in code skips the inventory's validation.
        for (field, value) in [("address", &self.host.address), ("user", &self.host.user)] {
            if let Some(why) = super::inventory::argv_shape_problem(value) {
                return Err(SshError::Preflight {
                    host: self.host.name.clone(),
                    detail: format!("{field} `{}` {why}", value.escape_debug()),
                });
            }
        }
        let out = Command::new("ssh")
            .args(self.ssh_args(command))
            .stdin(Stdio::null())
            .output()?;
        if out.status.success() {
            return Ok(out);
        }
        let code = out.status.code().unwrap_or(-1);
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let host = self.host.name.clone();
        if code == 255 {
            let low = stderr.to_ascii_lowercase();
            if low.contains("permission denied") || low.contains("authentication") {
                return Err(SshError::Auth {
                    host,
                    user: self.host.user.clone(),
                });
            }
            if low.contains("host key") {
                return Err(SshError::HostKey {
                    host,
                    detail: last_line(&stderr),
                });
            }
            return Err(SshError::Connect {
                host,
                detail: last_line(&stderr),
            });
        }
        Err(SshError::Remote {
            host,
            command: command.to_string(),
            code,
            stderr: last_line(&stderr),
        })
    }

    /// `run`, returning stdout as text.
    pub fn run_text(&self, command: &str) -> Result<String, SshError> {
        Ok(String::from_utf8_lossy(&self.run(command)?.stdout).into_owned())
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
