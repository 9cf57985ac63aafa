//! Inventories (`inventories/*.yaml`): the hosts a fleet runs on — how to reach them over SSH,
//! their GPUs, how they run engines, where they keep scratch files — and the placement of
//! engine replicas on GPU groups. Pure: parsing and arithmetic only.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// How strictly SSH host keys are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostKeyChecking {
    /// Known hosts only (the default).
    #[default]
    Strict,
    /// Accept and remember a host seen for the first time.
    AcceptNew,
    /// No checking at all: only for throwaway test hosts (e.g. a local sshd in tests).
    InsecureOff,
}

/// How a host runs engines. In YAML: `path`, `{ venv: DIR }`, `{ conda: ENV }` or
/// `{ container: "PREFIX" }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RuntimeRepr", into = "RuntimeRepr")]
pub enum EngineRuntime {
    /// A Python virtual environment: `<venv>/bin/python`.
    Venv(PathBuf),
    /// A conda environment: `conda run -n <env>`.
    Conda(String),
    /// A container command prefix, e.g. `docker run --gpus all --net host vllm/vllm-openai:v0.11`.
    Container(String),
    /// `python3` (and `cacheroute`) found on the PATH.
    Path,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "engine: `path`, {venv: DIR}, {conda: ENV} or {container: PREFIX}"
)]
enum RuntimeRepr {
    Word(String),
    Venv { venv: PathBuf },
    Conda { conda: String },
    Container { container: String },
}

impl TryFrom<RuntimeRepr> for EngineRuntime {
    type Error = String;
    fn try_from(r: RuntimeRepr) -> Result<Self, String> {
        Ok(match r {
            RuntimeRepr::Word(w) if w == "path" => EngineRuntime::Path,
            RuntimeRepr::Word(w) => return Err(format!("engine: unknown runtime `{w}`; use `path`, {{venv: DIR}}, {{conda: ENV}} or {{container: PREFIX}}")),
            RuntimeRepr::Venv { venv } => EngineRuntime::Venv(venv),
            RuntimeRepr::Conda { conda } => EngineRuntime::Conda(conda),
            RuntimeRepr::Container { container } => EngineRuntime::Container(container),
        })
    }
}

impl From<EngineRuntime> for RuntimeRepr {
    fn from(e: EngineRuntime) -> Self {
        match e {
            EngineRuntime::Path => RuntimeRepr::Word("path".into()),
            EngineRuntime::Venv(venv) => RuntimeRepr::Venv { venv },
            EngineRuntime::Conda(conda) => RuntimeRepr::Conda { conda },
            EngineRuntime::Container(container) => RuntimeRepr::Container { container },
        }
    }
}

/// GPUs of a host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpus {
    pub count: u32,
    /// As `nvidia-smi --query-gpu=name` prints it, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
}

/// One host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// A name for reports and errors.
    pub name: String,
    /// Host name or address to connect to.
    pub address: String,
    #[serde(default = "default_user")]
    pub user: String,
    #[serde(default = "default_port")]
    pub port: u16,
    /// Private key file (else the SSH agent / ~/.ssh/config decide).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    pub gpus: Gpus,
    pub engine: EngineRuntime,
    /// Directory for logs and PID files on the host.
    #[serde(default = "default_scratch")]
    pub scratch: PathBuf,
}

/// An inventory file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inventory {
    pub name: String,
    #[serde(default)]
    pub host_key_checking: HostKeyChecking,
    /// First engine port on each host; replica j on a host listens on `base_port + j`.
    #[serde(default = "default_base_port")]
    pub base_port: u16,
    pub hosts: Vec<Host>,
}

fn default_user() -> String {
    "root".into()
}
fn default_port() -> u16 {
    22
}
fn default_scratch() -> PathBuf {
    PathBuf::from("/tmp/cacheroute")
}
fn default_base_port() -> u16 {
    8100
}

/// Why `value` cannot be handed to `ssh` as (part of) its destination argument, if it
/// cannot: empty, a leading `-` (ssh would read it as an option: `-oProxyCommand=…` runs a
/// local command), or whitespace or control characters.
pub fn argv_shape_problem(value: &str) -> Option<&'static str> {
    if value.is_empty() {
        Some("must not be empty")
    } else if value.starts_with('-') {
        Some("must not start with `-` (ssh would take it for an option)")
    } else if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("must not contain spaces or control characters")
    } else {
        None
    }
}

/// Longest user name accepted (the common `useradd` limit; `LOGIN_NAME_MAX` is larger).
pub const MAX_USER_NAME: usize = 32;

/// Why `user` is not a POSIX user name, if it is not: a portable one uses only letters,
/// digits, `.`, `_` and `-` (the portable filename character set), does not start with `-`,
/// and is not `.` or `..`; at most [`MAX_USER_NAME`] characters. ssh would pass anything else
/// on (a `/` even ends in "No such file or directory" from its control socket path).
pub fn user_name_problem(user: &str) -> Option<String> {
    if let Some(c) = user
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(format!(
            "is not a POSIX user name: `{}` is not allowed (letters, digits, `.`, `_` and `-` only)",
            c.escape_debug()
        ))
    } else if user == "." || user == ".." {
        Some("is not a POSIX user name".into())
    } else if user.starts_with('-') {
        Some("is not a POSIX user name: it must not start with `-`".into())
    } else if user.len() > MAX_USER_NAME {
        Some(format!(
            "is not a POSIX user name: {} characters, more than {MAX_USER_NAME}",
            user.len()
        ))
    } else {
        None
    }
}

impl Inventory {
    /// Parse and validate YAML; `source` names the file in errors.
    pub fn parse(text: &str, source: &str) -> Result<Inventory, String> {
        let inv: Inventory = yaml_serde::from_str(text).map_err(|e| format!("{source}: {e}"))?;
        let p = inv.validate();
        if p.is_empty() {
            Ok(inv)
        } else {
            Err(format!("{source}: {}", p.join("; ")))
        }
    }

    /// Every problem with its field path.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.hosts.is_empty() {
            p.push("hosts: list at least one host".into());
        }
        for (i, h) in self.hosts.iter().enumerate() {
            if h.name.trim().is_empty() {
                p.push(format!("hosts[{i}].name: must not be empty"));
            }
            if self.hosts[..i].iter().any(|o| o.name == h.name) {
                p.push(format!("hosts[{i}].name: `{}` appears twice", h.name));
            }
            for (field, value) in [("address", &h.address), ("user", &h.user)] {
                if let Some(why) = argv_shape_problem(value) {
                    p.push(format!(
                        "hosts[{i}].{field} (host `{}`): `{}` {why}",
                        h.name,
                        value.escape_debug()
                    ));
                }
            }
            if h.user.contains('@') {
                p.push(format!(
                    "hosts[{i}].user (host `{}`): must not contain `@`; put the host in `address:`",
                    h.name
                ));
            } else if argv_shape_problem(&h.user).is_none() {
                if let Some(why) = user_name_problem(&h.user) {
                    p.push(format!(
                        "hosts[{i}].user (host `{}`): `{}` {why}; set the login name of the account on that host",
                        h.name,
                        h.user.escape_debug()
                    ));
                }
            }
            if h.gpus.count == 0 {
                p.push(format!("hosts[{i}].gpus.count: must be ≥ 1"));
            }
            if !h.scratch.is_absolute() {
                p.push(format!(
                    "hosts[{i}].scratch: must be an absolute path on the host"
                ));
            }
        }
        p
    }
}

/// Where one replica runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Replica index (destination index in the router).
    pub replica: usize,
    /// Index into the inventory's hosts.
    pub host: usize,
    /// GPU indices on that host (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Vec<u32>,
    pub port: u16,
}

/// Place `replicas` replicas of `tp` GPUs each: every replica on one host, on consecutive GPUs,
/// filling hosts in inventory order. Says what cannot be placed.
pub fn place(inv: &Inventory, replicas: usize, tp: u32) -> Result<Vec<Placement>, String> {
    if tp == 0 {
        return Err("tensor-parallel degree must be ≥ 1".into());
    }
    let slots: usize = inv.hosts.iter().map(|h| (h.gpus.count / tp) as usize).sum();
    if slots < replicas {
        let gpus: u32 = inv.hosts.iter().map(|h| h.gpus.count).sum();
        let stranded: Vec<String> = inv
            .hosts
            .iter()
            .filter(|h| h.gpus.count % tp != 0)
            .map(|h| format!("{} leaves {} GPU(s) unused", h.name, h.gpus.count % tp))
            .collect();
        return Err(format!(
            "cannot place {replicas} replicas of TP-{tp}: inventory `{}` has {gpus} GPUs in {} hosts, room for {slots} replicas{}; add hosts or lower fleet.replicas",
            inv.name,
            inv.hosts.len(),
            if stranded.is_empty() { String::new() } else { format!(" ({})", stranded.join(", ")) }
        ));
    }
    let mut out = Vec::with_capacity(replicas);
    'hosts: for (hi, h) in inv.hosts.iter().enumerate() {
        for j in 0..h.gpus.count / tp {
            if out.len() == replicas {
                break 'hosts;
            }
            out.push(Placement {
                replica: out.len(),
                host: hi,
                gpus: (j * tp..(j + 1) * tp).collect(),
                port: inv.base_port + j as u16,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(hosts: &[(u32,)]) -> Inventory {
        Inventory {
            name: "t".into(),
            host_key_checking: HostKeyChecking::Strict,
            base_port: 8100,
            hosts: hosts
                .iter()
                .enumerate()
                .map(|(i, h)| Host {
                    name: format!("h{i}"),
                    address: format!("h{i}.example"),
                    user: "u".into(),
                    port: 22,
                    identity: None,
                    labels: Default::default(),
                    gpus: Gpus {
                        count: h.0,
                        model: "NVIDIA H100 80GB HBM3".into(),
                    },
                    engine: EngineRuntime::Path,
                    scratch: "/tmp/x".into(),
                })
                .collect(),
        }
    }

    #[test]
    fn sixty_gpus_hold_thirty_tp2_replicas() {
        let p = place(&inv(&[(8,); 8]), 30, 2).unwrap();
        assert_eq!(p.len(), 30);
        assert_eq!(
            p[0],
            Placement {
                replica: 0,
                host: 0,
                gpus: vec![0, 1],
                port: 8100
            }
        );
        assert_eq!(p[3].gpus, vec![6, 7]);
        assert_eq!((p[4].host, p[4].port), (1, 8100));
        assert_eq!(p[29].host, 7);
        // Every GPU pair is on one host and no GPU is used twice.
        let mut seen = std::collections::HashSet::new();
        for x in &p {
            for g in &x.gpus {
                assert!(seen.insert((x.host, *g)));
            }
        }
    }

    #[test]
    fn what_cannot_be_placed_is_said() {
        let e = place(&inv(&[(3,), (8,)]), 6, 2).unwrap_err();
        assert!(
            e.contains("room for 5 replicas") && e.contains("h0 leaves 1 GPU(s) unused"),
            "{e}"
        );
    }

    #[test]
    fn shipped_inventories_parse() {
        for f in ["h100-60.yaml", "two-node.yaml", "local-ssh.yaml"] {
            let path = format!("{}/inventories/{f}", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).unwrap();
            let i = Inventory::parse(&text, &path).unwrap();
            assert!(!i.hosts.is_empty());
        }
        let big = Inventory::parse(
            &std::fs::read_to_string(format!(
                "{}/inventories/h100-60.yaml",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap(),
            "h100-60",
        )
        .unwrap();
        assert_eq!(place(&big, 30, 2).unwrap().len(), 30);
        assert_eq!(big.hosts.iter().map(|h| h.gpus.count).sum::<u32>(), 60);
    }

    #[test]
    fn bad_inventories_name_the_field() {
        let e = Inventory::parse("name: x\nhosts: []\n", "x.yaml").unwrap_err();
        assert!(e.contains("hosts: list at least one host"), "{e}");
        let e = Inventory::parse(
            "name: x\nhosts:\n  - {name: a, address: a, gpus: {count: 0, model: m}, engine: path, scratch: rel}\n",
            "x.yaml",
        )
        .unwrap_err();
        assert!(
            e.contains("hosts[0].gpus.count") && e.contains("hosts[0].scratch"),
            "{e}"
        );
        assert!(Inventory::parse("name: x\nhostz: []\n", "x.yaml")
            .unwrap_err()
            .contains("hostz"));
    }

    #[test]
    fn user_names_follow_posix() {
        for ok in [
            "root",
            "ubuntu",
            "a.b_c-d",
            "svc-01",
            "_x",
            "A1",
            &"u".repeat(32),
        ] {
            assert_eq!(user_name_problem(ok), None, "{ok}");
        }
        for bad in ["a/b", "..", ".", "a:b", "a$", "é", "x%r", &"u".repeat(33)] {
            assert!(user_name_problem(bad).is_some(), "{bad}");
        }
        let e = Inventory::parse(
            "name: x\nhosts:\n  - {name: gpu-1, address: h, user: a/b, gpus: {count: 1, model: m}, engine: path}\n",
            "x.yaml",
        )
        .unwrap_err();
        assert_eq!(
            e,
            "x.yaml: hosts[0].user (host `gpu-1`): `a/b` is not a POSIX user name: `/` is not allowed (letters, digits, `.`, `_` and `-` only); set the login name of the account on that host"
        );
    }
}
