//! Fleets on Slurm: a study's replicas submitted as one batch job (one task per replica,
//! started with `srun`), their nodes and ports learned from the files each task writes in a
//! directory the controller and the nodes share, readiness checked over HTTP like the ssh
//! backend's, and the job cancelled with `scancel` on every way out. A controller killed
//! without unwinding leaves the job to its `--time` limit, or to [`down`], which finds it by
//! its name (`squeue --name`).
//!
//! The job script and the `sbatch` command line are built by pure functions ([`job_script`],
//! [`task_script`], [`sbatch_args`]); the rest runs the Slurm client commands (`sbatch`,
//! `squeue`, `scontrol`, `scancel`) found on the PATH, which read `SLURM_CONF` as usual.
//! Below the study layer: a study's `fleet.slurm` section is this module's [`SlurmSettings`].

use super::inventory::{argv_shape_problem, EngineRuntime};
use super::launch::{self, sh_quote, LaunchSpec};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The `slurm:` section of a fleet: where and how the job is submitted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmSettings {
    /// `--partition` (default: the cluster's default partition).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// `--account` (default: the user's default account).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// GPUs per replica (`--gpus-per-task`); default: the fleet's TP on GPUs, none for the
    /// emulator and on CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_per_replica: Option<u32>,
    /// CPUs per replica (`--cpus-per-task`; default: the cluster's, usually 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus_per_replica: Option<u32>,
    /// The job's wall-clock limit (`--time`: `MINUTES`, `HH:MM:SS`, `D-HH[:MM[:SS]]`): the
    /// bound on how long replicas can outlive a controller killed without unwinding.
    #[serde(deserialize_with = "text_or_number")]
    pub time_limit: String,
    /// More `sbatch` options, each one argument (e.g. `--qos=high`, `--constraint=h100`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sbatch_args: Vec<String>,
    /// The job's name (default: `cacheroute-<study name>`); `fleet down --slurm` finds the
    /// job by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// A directory the controller and every node see (job script, logs, replica addresses;
    /// relative to the spec file); default: `slurm/<job name>` under the working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// How the nodes run engines, as in inventories: `path`, `{venv: DIR}`, `{conda: ENV}`
    /// or `{container: PREFIX}` (default `path`; the emulator is `cacheroute` on the PATH).
    #[serde(default = "default_engine")]
    pub engine: EngineRuntime,
    /// First engine port on each node: a node's k-th replica listens on `base_port + k`, or
    /// on the next free port `base_port + k + j·replicas`.
    #[serde(default = "default_base_port")]
    pub base_port: u16,
    /// Seconds every replica has, from when the job runs, to answer `/health` and a one-token
    /// generation (default 900: a large checkpoint loads slowly).
    #[serde(default = "default_ready_timeout_s")]
    pub ready_timeout_s: u64,
}

/// A string, or a bare number written without quotes (`time_limit: 30`).
fn text_or_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(
        untagged,
        expecting = "a Slurm time limit, e.g. `2:00:00` or 120 (minutes)"
    )]
    enum T {
        S(String),
        N(u64),
    }
    Ok(match T::deserialize(d)? {
        T::S(s) => s,
        T::N(n) => n.to_string(),
    })
}

fn default_engine() -> EngineRuntime {
    EngineRuntime::Path
}
fn default_base_port() -> u16 {
    8100
}
fn default_ready_timeout_s() -> u64 {
    900
}

/// Whether `t` has the shape of a Slurm time limit (`MINUTES`, `MINUTES:SECONDS`,
/// `HOURS:MINUTES:SECONDS`, `DAYS-HOURS`, `DAYS-HOURS:MINUTES`, `DAYS-HOURS:MINUTES:SECONDS`).
fn time_limit_ok(t: &str) -> bool {
    let num = |s: &str| !s.is_empty() && s.len() <= 6 && s.bytes().all(|b| b.is_ascii_digit());
    let (days, rest) = match t.split_once('-') {
        Some((d, r)) => (Some(d), r),
        None => (None, t),
    };
    if days.is_some_and(|d| !num(d)) {
        return false;
    }
    let parts: Vec<&str> = rest.split(':').collect();
    parts.iter().all(|p| num(p)) && parts.len() <= 3
}

impl SlurmSettings {
    /// Every problem, each with its field path under `at` (e.g. `fleet.slurm`). Values that
    /// reach `sbatch`'s argument vector are checked for their shape.
    pub fn problems(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        for (field, value) in [
            ("partition", &self.partition),
            ("account", &self.account),
            ("job_name", &self.job_name),
        ] {
            if let Some(why) = value.as_deref().and_then(argv_shape_problem) {
                p.push(format!("{at}.{field}: {why}"));
            }
        }
        if self
            .job_name
            .as_deref()
            .is_some_and(|n| n.contains('/') || n.contains(','))
        {
            p.push(format!("{at}.job_name: must not contain `/` or `,`"));
        }
        if !time_limit_ok(&self.time_limit) {
            p.push(format!(
                "{at}.time_limit: `{}` is not a Slurm time limit; use MINUTES, HH:MM:SS or D-HH:MM:SS (e.g. `2:00:00`)",
                self.time_limit.escape_debug()
            ));
        }
        for (i, a) in self.sbatch_args.iter().enumerate() {
            if !a.starts_with('-') || a.chars().any(char::is_control) {
                p.push(format!(
                    "{at}.sbatch_args[{i}]: `{}` must be one option starting with `-`, without control characters",
                    a.escape_debug()
                ));
            }
        }
        for (field, v) in [
            ("gpus_per_replica", self.gpus_per_replica),
            ("cpus_per_replica", self.cpus_per_replica),
        ] {
            if v.is_some_and(|v| v > 1024) {
                p.push(format!("{at}.{field}: at most 1024 allowed"));
            }
        }
        if !(1..=86_400).contains(&self.ready_timeout_s) {
            p.push(format!(
                "{at}.ready_timeout_s: {} is outside 1..=86400",
                self.ready_timeout_s
            ));
        }
        if self.base_port < 1024 {
            p.push(format!("{at}.base_port: use a port ≥ 1024"));
        }
        p
    }

    /// The job's name for study `study`.
    pub fn job_name_for(&self, study: &str) -> String {
        self.job_name
            .clone()
            .unwrap_or_else(|| format!("cacheroute-{study}"))
    }

    /// The shared directory of job `name`: `dir` (relative to `spec_dir`, the spec file's
    /// directory, as every path in a spec), else `slurm/<name>` under the working directory.
    pub fn dir_for(&self, name: &str, spec_dir: &Path) -> PathBuf {
        match &self.dir {
            Some(d) => spec_dir.join(d),
            None => Path::new("slurm").join(name),
        }
    }

    /// GPUs each replica asks for.
    pub fn gpus(&self, fleet: &LaunchSpec) -> u32 {
        self.gpus_per_replica.unwrap_or(
            if fleet.engine == launch::EngineKind::Emulator || launch::on_cpu(fleet) {
                0
            } else {
                fleet.tp
            },
        )
    }
}

/// The batch script: one `srun` step with a task per replica; a replica that fails ends the
/// step (and so the job).
pub fn job_script(dir: &Path) -> String {
    let d = sh_quote(&dir.display().to_string());
    format!(
        "#!/bin/bash\n# cacheroute fleet job: one task per engine replica (see {d}/task.sh).\nexec srun --kill-on-bad-exit=1 /bin/bash {d}/task.sh\n"
    )
}

/// The marker [`task_script`] puts where the replica's port goes before it is known.
const PORT_MARK: &str = "@PORT@";

/// What each task runs: pick its port (the node's `SLURM_LOCALID`-th from `base_port`, or a
/// later free one), write `NODE PORT` to `replica-<i>.addr`, and become the engine, logging to
/// `replica-<i>.log`. Slurm binds the task's GPUs (`CUDA_VISIBLE_DEVICES`) itself.
pub fn task_script(fleet: &LaunchSpec, settings: &SlurmSettings, dir: &Path) -> String {
    let d = sh_quote(&dir.display().to_string());
    let env = launch::engine_env_shared(fleet)
        .iter()
        .map(|(k, v)| format!("export {k}={}\n", sh_quote(v)))
        .collect::<String>();
    let args = launch::engine_args_at(fleet, PORT_MARK, "0.0.0.0")
        .iter()
        .map(|a| sh_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
        .replace(PORT_MARK, "$p");
    format!(
        "#!/bin/bash\n\
i=$SLURM_PROCID\n\
p=$(({base} + SLURM_LOCALID))\n\
while (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; do p=$((p + SLURM_NTASKS)); done\n\
exec > {d}/replica-$i.log 2>&1 < /dev/null\n\
echo \"$SLURMD_NODENAME $p\" > {d}/replica-$i.addr.tmp && mv {d}/replica-$i.addr.tmp {d}/replica-$i.addr\n\
{env}exec {prog} {args}\n",
        base = settings.base_port,
        prog = launch::program(fleet, &settings.engine),
    )
}

/// The `sbatch` arguments that submit job `name` for `fleet` with its script in `dir`.
pub fn sbatch_args(
    fleet: &LaunchSpec,
    settings: &SlurmSettings,
    name: &str,
    dir: &Path,
) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--parsable".into(),
        format!("--job-name={name}"),
        format!("--output={}", dir.join("job-%j.log").display()),
        format!("--chdir={}", dir.display()),
        format!("--ntasks={}", fleet.replicas),
        format!("--time={}", settings.time_limit),
    ];
    if let Some(c) = settings.cpus_per_replica {
        a.push(format!("--cpus-per-task={c}"));
    }
    let g = settings.gpus(fleet);
    if g > 0 {
        a.push(format!("--gpus-per-task={g}"));
    }
    if let Some(p) = &settings.partition {
        a.push(format!("--partition={p}"));
    }
    if let Some(acc) = &settings.account {
        a.push(format!("--account={acc}"));
    }
    a.extend(settings.sbatch_args.iter().cloned());
    a.push(dir.join("job.sh").display().to_string());
    a
}

/// What went wrong with a Slurm job.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("`{command}` could not run ({detail}); install Slurm's client commands (Debian: slurm-client) or run where they are")]
    Missing { command: String, detail: String },
    #[error("slurm job {name}: sbatch refused it: {detail} (partition {partition}, account {account}); check fleet.slurm")]
    Rejected {
        name: String,
        detail: String,
        partition: String,
        account: String,
    },
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
    #[error(
        "slurm job {id} ({name}) ended ({state}) before its replicas were ready; log {log}: {tail}"
    )]
    Ended {
        id: u64,
        name: String,
        state: String,
        log: String,
        tail: String,
    },
    #[error("slurm job {id} ({name}): replica {replica} not ready within {secs} s (job {state}); log {log}: {tail}")]
    NotReady {
        id: u64,
        name: String,
        replica: usize,
        secs: u64,
        state: String,
        log: String,
        tail: String,
    },
    #[error("slurm job {id} ({name}) cannot start: pending with reason {reason}; check fleet.slurm (partition, account, time_limit, gpus_per_replica, sbatch_args); log {log}")]
    CannotStart {
        id: u64,
        name: String,
        reason: String,
        log: String,
    },
    #[error("slurm job {id} ({name}) ended under the step ({state}); the step is not stored")]
    Lost {
        id: u64,
        name: String,
        state: String,
    },
    #[error("slurm job {id} ({name}) was cancelled: interrupted while its replicas started")]
    Interrupted { id: u64, name: String },
    #[error("slurm job {id} ({name}) is still in the queue after scancel; cancel it by hand: scancel {id}")]
    Left { id: u64, name: String },
    #[error("slurm job {id} ({name}) already runs under this name; stop it first: cacheroute fleet down --slurm --experiment SPEC (or scancel {id})")]
    Exists { id: u64, name: String },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Run a Slurm client command; stdout on success, its last stderr line otherwise.
fn slurm_cmd(program: &str, args: &[String]) -> Result<Result<String, String>, SlurmError> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| SlurmError::Missing {
            command: program.into(),
            detail: e.to_string(),
        })?;
    if out.status.success() {
        Ok(Ok(String::from_utf8_lossy(&out.stdout).into_owned()))
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Ok(Err(err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no error output")
            .trim()
            .trim_start_matches("sbatch: error: ")
            .to_string()))
    }
}

fn must(program: &str, args: &[String]) -> Result<String, SlurmError> {
    slurm_cmd(program, args)?.map_err(|detail| SlurmError::Command {
        command: format!("{program} {}", args.join(" ")),
        detail,
    })
}

/// A submitted job.
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmJob {
    pub id: u64,
    pub name: String,
    pub dir: PathBuf,
}

impl SlurmJob {
    /// The job's log file (`--output`).
    pub fn log(&self) -> PathBuf {
        self.dir.join(format!("job-{}.log", self.id))
    }

    /// The log of replica `i`.
    pub fn replica_log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("replica-{i}.log"))
    }
}

/// A replica of a Slurm fleet that is up.
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmReplica {
    pub replica: usize,
    /// The Slurm node name it runs on.
    pub node: String,
    pub url: String,
}

/// The last `n` non-empty lines of a file, joined with ` | ` (`(empty)` when none).
pub fn tail(path: &Path, n: usize) -> String {
    let t = super::log_tail(path, n);
    if t.is_empty() {
        "(empty)".into()
    } else {
        t
    }
}

/// Write the scripts and submit job `name` for `fleet`; refuses when a job of that name is
/// already queued (its replicas would compete for the ports and the addresses).
pub fn submit(
    fleet: &LaunchSpec,
    settings: &SlurmSettings,
    name: &str,
    dir: &Path,
) -> Result<SlurmJob, SlurmError> {
    if let Some((id, _)) = jobs_named(name)?.first() {
        return Err(SlurmError::Exists {
            id: *id,
            name: name.into(),
        });
    }
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    for e in std::fs::read_dir(&dir)? {
        let p = e?.path();
        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if n.starts_with("replica-") {
            std::fs::remove_file(&p)?;
        }
    }
    write_exec(&dir.join("job.sh"), &job_script(&dir))?;
    write_exec(&dir.join("task.sh"), &task_script(fleet, settings, &dir))?;
    let out =
        slurm_cmd("sbatch", &sbatch_args(fleet, settings, name, &dir))?.map_err(|detail| {
            SlurmError::Rejected {
                name: name.into(),
                detail,
                partition: settings
                    .partition
                    .as_deref()
                    .map_or("(default)".into(), |p| format!("`{p}`")),
                account: settings
                    .account
                    .as_deref()
                    .map_or("(default)".into(), |a| format!("`{a}`")),
            }
        })?;
    // `--parsable` prints `ID` or `ID;CLUSTER`.
    let id = out
        .trim()
        .split(';')
        .next()
        .and_then(|i| i.parse().ok())
        .ok_or_else(|| SlurmError::Command {
            command: "sbatch --parsable".into(),
            detail: format!("unexpected answer `{}`", out.trim()),
        })?;
    let job = SlurmJob {
        id,
        name: name.into(),
        dir,
    };
    tracing::info!(
        job = id,
        name,
        replicas = fleet.replicas,
        log = %job.log().display(),
        "slurm job submitted"
    );
    Ok(job)
}

fn write_exec(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

/// The job's state and pending reason (`None` once it has left the queue).
pub fn job_state(id: u64) -> Result<Option<(String, String)>, SlurmError> {
    let args: Vec<String> = vec![
        "--noheader".into(),
        format!("--jobs={id}"),
        "--format=%T|%r".into(),
    ];
    match slurm_cmd("squeue", &args)? {
        Ok(out) => Ok(out.lines().find_map(|l| {
            let (s, r) = l.trim().split_once('|')?;
            Some((s.to_string(), r.to_string()))
        })),
        // A job that has left the controller's memory is an invalid id.
        Err(e) if e.to_ascii_lowercase().contains("invalid job id") => Ok(None),
        Err(detail) => Err(SlurmError::Command {
            command: format!("squeue {}", args.join(" ")),
            detail,
        }),
    }
}

/// This user's queued jobs named `name`, with their states.
pub fn jobs_named(name: &str) -> Result<Vec<(u64, String)>, SlurmError> {
    let mut args: Vec<String> = vec![
        "--noheader".into(),
        format!("--name={name}"),
        "--format=%i|%T".into(),
    ];
    if let Some(u) = std::env::var("USER").ok().filter(|u| !u.is_empty()) {
        args.push(format!("--user={u}"));
    }
    let out = must("squeue", &args)?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let (i, s) = l.trim().split_once('|')?;
            Some((i.parse().ok()?, s.to_string()))
        })
        .collect())
}

/// The address Slurm reaches `node` at (`NodeAddr`; the name itself if none is given).
fn node_addr(node: &str) -> String {
    let args: Vec<String> = vec![
        "show".into(),
        "node".into(),
        "--oneliner".into(),
        node.into(),
    ];
    slurm_cmd("scontrol", &args)
        .ok()
        .and_then(Result::ok)
        .and_then(|o| {
            o.split_whitespace()
                .find_map(|w| w.strip_prefix("NodeAddr=").map(String::from))
        })
        .filter(|a| !a.is_empty() && argv_shape_problem(a).is_none())
        .unwrap_or_else(|| node.to_string())
}

/// Pending reasons that waiting does not cure: the job asks for what its partition, account
/// or QOS never allows.
const NEVER_STARTS: [&str; 9] = [
    "BadConstraints",
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSNotAllowed",
    "QOSMaxWallDurationPerJobLimit",
];

const ENDED: [&str; 9] = [
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
];

/// What [`wait_ready`] knows of a starting job and its replicas.
struct Watch<'a> {
    job: &'a SlurmJob,
    /// Replicas whose address is known.
    found: Vec<Option<SlurmReplica>>,
    ready: Vec<bool>,
    /// The job's last seen state and reason (`left the queue` once gone).
    state: (String, String),
    running_since: Option<Instant>,
}

impl Watch<'_> {
    /// Read the job's state: an error when it has ended, or is pending for a reason waiting
    /// does not cure; a new pending reason and the start are logged.
    fn check_state(&mut self) -> Result<(), SlurmError> {
        let job = self.job;
        let before = std::mem::replace(
            &mut self.state,
            job_state(job.id)?.unwrap_or_else(|| ("left the queue".into(), String::new())),
        );
        let (state, reason) = &self.state;
        if state == "RUNNING" && self.running_since.is_none() {
            self.running_since = Some(Instant::now());
            tracing::info!(job = job.id, name = %job.name, "slurm job running");
        }
        let new_reason = before.0 != "PENDING" || before.1 != *reason;
        if state == "PENDING" && new_reason && reason != "None" {
            tracing::info!(job = job.id, name = %job.name, %reason, "slurm job pending");
            if NEVER_STARTS.iter().any(|r| reason.starts_with(r)) {
                return Err(SlurmError::CannotStart {
                    id: job.id,
                    name: job.name.clone(),
                    reason: reason.clone(),
                    log: job.log().display().to_string(),
                });
            }
        }
        if state == "left the queue" || ENDED.contains(&state.as_str()) {
            let mut tail_text = tail(&job.log(), 3);
            if let Some(i) = self.ready.iter().position(|r| !r) {
                let rl = job.replica_log(i);
                if rl.exists() {
                    tail_text.push_str(&format!(
                        "; replica {i} log {}: {}",
                        rl.display(),
                        tail(&rl, 3)
                    ));
                }
            }
            return Err(SlurmError::Ended {
                id: job.id,
                name: job.name.clone(),
                state: state.clone(),
                log: job.log().display().to_string(),
                tail: tail_text,
            });
        }
        Ok(())
    }

    /// Learn the addresses replicas have written, and ask the unready ones for `/health`
    /// and a one-token generation. Whether all are ready.
    fn poll_replicas(&mut self, client: &reqwest::blocking::Client) -> bool {
        let job = self.job;
        for i in 0..self.found.len() {
            if self.found[i].is_none() {
                self.found[i] = read_address(job, i);
            }
            if let (Some(r), false) = (&self.found[i], self.ready[i]) {
                if super::provision::ready(client, &r.url) {
                    self.ready[i] = true;
                    tracing::info!(job = job.id, replica = i, node = %r.node, url = %r.url, "replica ready");
                }
            }
        }
        self.ready.iter().all(|r| *r)
    }

    /// The error of a replica not ready `timeout` after the job started: the first unready
    /// one, with its log's last lines (the job's if it has none).
    fn not_ready(&self, timeout: Duration) -> SlurmError {
        let job = self.job;
        let i = self.ready.iter().position(|r| !r).unwrap_or(0);
        let log = Some(job.replica_log(i))
            .filter(|l| l.exists())
            .unwrap_or_else(|| job.log());
        let (state, reason) = &self.state;
        SlurmError::NotReady {
            id: job.id,
            name: job.name.clone(),
            replica: i,
            secs: timeout.as_secs(),
            state: if reason.is_empty() || reason == "None" {
                state.clone()
            } else {
                format!("{state}, reason {reason}")
            },
            tail: tail(&log, 3),
            log: log.display().to_string(),
        }
    }
}

/// The `(replica, node, port)` every task of a job in `dir` has written, by replica.
pub fn written_addresses(dir: &Path) -> Vec<(usize, String, u16)> {
    let mut out: Vec<(usize, String, u16)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let i = name
                .strip_prefix("replica-")?
                .strip_suffix(".addr")?
                .parse()
                .ok()?;
            let (node, port) = parse_address(&std::fs::read_to_string(e.path()).ok()?)?;
            Some((i, node, port))
        })
        .collect();
    out.sort();
    out
}

/// Replica `i`'s address, once its task has written `NODE PORT`.
fn read_address(job: &SlurmJob, i: usize) -> Option<SlurmReplica> {
    let text = std::fs::read_to_string(job.dir.join(format!("replica-{i}.addr"))).ok()?;
    let (node, port) = parse_address(&text)?;
    let addr = node_addr(&node);
    let url = if addr.contains(':') {
        format!("http://[{addr}]:{port}")
    } else {
        format!("http://{addr}:{port}")
    };
    tracing::info!(job = job.id, replica = i, node = %node, %url, "replica placed");
    Some(SlurmReplica {
        replica: i,
        node,
        url,
    })
}

/// `NODE PORT`, as a task writes it.
fn parse_address(text: &str) -> Option<(String, u16)> {
    let mut w = text.split_whitespace();
    Some((w.next()?.to_string(), w.next()?.parse().ok()?))
}

/// Wait until every replica of `job` has written its address and answers `/health` and a
/// one-token generation. A pending job is waited for as long as it is queued (its reason is
/// logged when it changes), unless the reason is one waiting does not cure ([`NEVER_STARTS`]);
/// `timeout` counts from when it runs. Stops with the job's state and log when the job ends
/// first, when the timeout passes, or when `interrupt` is set.
pub fn wait_ready(
    job: &SlurmJob,
    replicas: usize,
    timeout: Duration,
    interrupt: Option<&AtomicBool>,
) -> Result<Vec<SlurmReplica>, SlurmError> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client");
    let mut w = Watch {
        job,
        found: vec![None; replicas],
        ready: vec![false; replicas],
        state: (String::new(), String::new()),
        running_since: None,
    };
    let mut last_state_check: Option<Instant> = None;
    loop {
        if interrupt.is_some_and(|i| i.load(Ordering::Relaxed)) {
            return Err(SlurmError::Interrupted {
                id: job.id,
                name: job.name.clone(),
            });
        }
        if last_state_check.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            last_state_check = Some(Instant::now());
            w.check_state()?;
        }
        if w.poll_replicas(&client) {
            return Ok(w.found.into_iter().flatten().collect());
        }
        if w.running_since.is_some_and(|t| t.elapsed() > timeout) {
            return Err(w.not_ready(timeout));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `cacheroute agent` on each node of the job's replicas, as a step of the job sharing its
/// resources (`srun --overlap`), so it sees the job's GPUs.
pub fn agent_commands(job: &SlurmJob, replicas: &[SlurmReplica]) -> Vec<super::AgentCommand> {
    let mut nodes: Vec<&str> = replicas.iter().map(|r| r.node.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
        .into_iter()
        .map(|node| {
            let mut args = vec![
                format!("--jobid={}", job.id),
                "--overlap".into(),
                "--nodes=1".into(),
                "--ntasks=1".into(),
                format!("--nodelist={node}"),
                "--quiet".into(),
            ];
            args.extend(super::AGENT_LINE.iter().map(|a| a.to_string()));
            super::AgentCommand {
                host: node.to_string(),
                program: "srun".into(),
                args,
            }
        })
        .collect()
}

/// An error unless the job is still running (its replicas with it); a job that is not is
/// logged as lost.
pub fn check_running(job: &SlurmJob) -> Result<(), SlurmError> {
    let state = job_state(job.id)?.map_or_else(|| "left the queue".to_string(), |(s, _)| s);
    if state == "RUNNING" {
        return Ok(());
    }
    tracing::warn!(job = job.id, name = %job.name, %state, "slurm job lost");
    Err(SlurmError::Lost {
        id: job.id,
        name: job.name.clone(),
        state,
    })
}

/// What the job is doing now, for an error that happened while it ran: its id, name, state,
/// log file and the log's last lines.
pub fn describe(job: &SlurmJob) -> String {
    let state = match job_state(job.id) {
        Ok(Some((s, _))) => s,
        Ok(None) => "left the queue".into(),
        Err(e) => format!("state unknown: {e}"),
    };
    format!(
        "slurm job {} ({}) {state}; log {}: {}",
        job.id,
        job.name,
        job.log().display(),
        tail(&job.log(), 3)
    )
}

/// Submit the fleet and wait until it is ready; the job is cancelled on any failure.
pub fn up(
    fleet: &LaunchSpec,
    settings: &SlurmSettings,
    name: &str,
    dir: &Path,
    timeout: Duration,
    interrupt: Option<&AtomicBool>,
) -> Result<(SlurmJob, Vec<SlurmReplica>), SlurmError> {
    let job = submit(fleet, settings, name, dir)?;
    match wait_ready(&job, fleet.replicas, timeout, interrupt) {
        Ok(r) => Ok((job, r)),
        Err(e) => {
            if let Err(c) = cancel(job.id, &job.name) {
                tracing::error!("{c}");
            }
            Err(e)
        }
    }
}

/// How long [`cancel`] waits for a job to leave the queue (Slurm's `KillWait` is 30 s by
/// default).
const CANCEL_WAIT: Duration = Duration::from_secs(90);

/// `scancel` job `id` and wait until it has left the queue (its processes are gone then).
pub fn cancel(id: u64, name: &str) -> Result<(), SlurmError> {
    must("scancel", &[id.to_string()])?;
    let t0 = Instant::now();
    while let Some((state, _)) = job_state(id)? {
        if t0.elapsed() > CANCEL_WAIT {
            tracing::warn!(
                job = id,
                state,
                "slurm job still in the queue after scancel"
            );
            return Err(SlurmError::Left {
                id,
                name: name.into(),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    tracing::info!(job = id, name, "slurm job cancelled; fleet torn down");
    Ok(())
}

/// Cancel every job of this user named `name` (the controller that submitted them may be
/// gone) and wait until none is left. Returns the ids cancelled.
pub fn down(name: &str) -> Result<Vec<u64>, SlurmError> {
    let jobs = jobs_named(name)?;
    for (id, _) in &jobs {
        cancel(*id, name)?;
    }
    if let Some((id, _)) = jobs_named(name)?.first() {
        return Err(SlurmError::Left {
            id: *id,
            name: name.into(),
        });
    }
    Ok(jobs.into_iter().map(|(i, _)| i).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::KnobOverrides;

    fn fleet(engine: launch::EngineKind) -> LaunchSpec {
        LaunchSpec {
            engine,
            model: "llama-3.3-70b".into(),
            gpu: "h100".into(),
            precision: "fp8".into(),
            tp: 2,
            replicas: 4,
            checkpoint: None,
            knobs: KnobOverrides::default(),
            max_model_len: None,
            scale_out: false,
        }
    }

    fn settings() -> SlurmSettings {
        yaml_serde::from_str(
            "{partition: gpu, account: lab, time_limit: '2:00:00', sbatch_args: [--qos=high]}",
        )
        .unwrap()
    }

    #[test]
    fn sbatch_line_and_task_script_of_a_vllm_fleet() {
        let f = fleet(launch::EngineKind::Vllm);
        let dir = Path::new("/shared/jobs/x");
        assert_eq!(
            sbatch_args(&f, &settings(), "cacheroute-flagship", dir).join(" "),
            "--parsable --job-name=cacheroute-flagship --output=/shared/jobs/x/job-%j.log --chdir=/shared/jobs/x \
--ntasks=4 --time=2:00:00 --gpus-per-task=2 --partition=gpu --account=lab --qos=high /shared/jobs/x/job.sh"
        );
        let t = task_script(&f, &settings(), dir);
        assert!(t.contains("p=$((8100 + SLURM_LOCALID))"), "{t}");
        assert!(
            t.contains("export VLLM_NO_USAGE_STATS=1\nexport VLLM_SERVER_DEV_MODE=1\nexec python3 -m vllm.entrypoints.cli.main serve nvidia/Llama-3.3-70B-Instruct-FP8 --served-model-name cacheroute-model --host 0.0.0.0 --port $p --tensor-parallel-size 2 "),
            "{t}"
        );
        // Slurm binds the GPUs: the script never sets CUDA_VISIBLE_DEVICES.
        assert!(!t.contains("CUDA_VISIBLE_DEVICES"), "{t}");
        assert!(
            job_script(dir).contains("srun --kill-on-bad-exit=1 /bin/bash /shared/jobs/x/task.sh")
        );
        // The emulator asks for no GPU and listens on the task's port.
        let e = fleet(launch::EngineKind::Emulator);
        assert!(!sbatch_args(&e, &settings(), "n", dir)
            .iter()
            .any(|a| a.starts_with("--gpus")));
        assert!(task_script(&e, &settings(), dir)
            .contains("exec cacheroute emulate --listen 0.0.0.0:$p "));
    }

    #[test]
    fn every_bad_field_is_named() {
        let mut s = settings();
        s.partition = Some("-oops".into());
        s.account = Some("a b".into());
        s.job_name = Some("x/y".into());
        s.time_limit = "two hours".into();
        s.sbatch_args = vec!["qos=high".into(), "--x\n#SBATCH".into()];
        s.base_port = 80;
        s.ready_timeout_s = 0;
        let p = s.problems("fleet.slurm").join("; ");
        for needle in [
            "fleet.slurm.partition: must not start with `-`",
            "fleet.slurm.account: must not contain spaces",
            "fleet.slurm.job_name: must not contain `/`",
            "fleet.slurm.time_limit: `two hours`",
            "fleet.slurm.sbatch_args[0]",
            "fleet.slurm.sbatch_args[1]",
            "fleet.slurm.base_port",
            "fleet.slurm.ready_timeout_s: 0 is outside",
        ] {
            assert!(p.contains(needle), "missing `{needle}` in {p}");
        }
        for ok in ["30", "30:00", "2:00:00", "1-0", "1-12:00", "1-12:00:00"] {
            assert!(time_limit_ok(ok), "{ok}");
        }
        for bad in ["", "1:2:3:4", "-5", "1-", "h", "1-1:1:1:1"] {
            assert!(!time_limit_ok(bad), "{bad}");
        }
        assert!(settings().problems("fleet.slurm").is_empty());
        let e =
            yaml_serde::from_str::<SlurmSettings>("{time_limit: 5, partiton: gpu}").unwrap_err();
        assert!(e.to_string().contains("partiton"), "{e}");
    }
}
