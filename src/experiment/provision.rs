//! The fleet of a study, provisioned once for the whole study: the ssh backend's replicas on
//! an inventory's hosts, the slurm backend's job, or the local backend's real engines, each
//! stopped on every way out (success, error or panic). A fleet provisioned once cannot follow
//! a sweep of the replica count.

use super::spec::{Backend, Spec};
use crate::workload::gen::resolve;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::sync::atomic::AtomicBool;

/// Stops a provisioned fleet when dropped (success, error or panic): the ssh backend's
/// replicas on their hosts, or the slurm backend's job.
pub(super) enum FleetGuard {
    Ssh(crate::fleet::inventory::Inventory),
    Slurm(crate::fleet::slurm::SlurmJob),
}

impl FleetGuard {
    /// What the fleet is doing, for an error that happened while it ran (slurm: the job's
    /// state, log file and last lines).
    pub(super) fn describe(&self) -> Option<String> {
        match self {
            FleetGuard::Ssh(_) => None,
            FleetGuard::Slurm(job) => Some(crate::fleet::slurm::describe(job)),
        }
    }
}

impl Drop for FleetGuard {
    fn drop(&mut self) {
        let r = match self {
            FleetGuard::Ssh(inv) => {
                crate::fleet::provision::down(inv, std::time::Duration::from_secs(10))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            FleetGuard::Slurm(job) => {
                crate::fleet::slurm::cancel(job.id, &job.name).map_err(|e| e.to_string())
            }
        };
        if let Err(e) = r {
            eprintln!("error: tearing down the fleet: {e}");
        }
        crate::fleet::ssh::close_all();
    }
}

/// Provision the spec's fleet (ssh: on the inventory's hosts; slurm: as a job) and point the
/// spec's local settings at it; the guard tears the fleet down.
pub(super) fn provision_fleet(
    spec: &mut Spec,
    backend: Backend,
    base_dir: &Path,
    interrupt: Option<&'static AtomicBool>,
) -> Result<FleetGuard> {
    if sweeps_replicas(spec) {
        bail!(
            "sweeps: the {} backend provisions one fleet per study; sweep `replicas` in simulation only",
            backend.name()
        );
    }
    let mut local = spec.local.clone().unwrap_or_default();
    let (guard, urls) = if backend == Backend::Slurm {
        let s = spec
            .fleet
            .slurm
            .clone()
            .context(super::spec::SLURM_NEEDED)?;
        let name = s.job_name_for(&spec.name);
        let dir = s.dir_for(&name, base_dir);
        let (job, reps) = crate::fleet::slurm::up(
            &spec.launch(),
            &s,
            &name,
            &dir,
            std::time::Duration::from_secs(s.ready_timeout_s),
            interrupt,
        )?;
        local.agents = crate::fleet::slurm::agent_commands(&job, &reps);
        let urls = reps.iter().map(|r| r.url.clone()).collect();
        (FleetGuard::Slurm(job), urls)
    } else {
        let inv_path = resolve(
            base_dir,
            spec.fleet
                .inventory
                .as_deref()
                .context("fleet.inventory: the ssh backend needs an inventory")?,
        );
        let text = std::fs::read_to_string(&inv_path)
            .with_context(|| format!("reading inventory {}", inv_path.display()))?;
        let inv = crate::fleet::inventory::Inventory::parse(&text, &inv_path.display().to_string())
            .map_err(anyhow::Error::msg)?;
        let reps =
            crate::fleet::provision::up(&inv, &spec.launch(), std::time::Duration::from_secs(900))?;
        local.agent_hosts = Some(inv.clone());
        let urls = reps.iter().map(|r| r.url.clone()).collect();
        (FleetGuard::Ssh(inv), urls)
    };
    local.time_scale = crate::bounds::TimeScale::REAL;
    local.engine_urls = urls;
    spec.local = Some(local);
    Ok(guard)
}

/// Whether the spec sweeps the replica count.
fn sweeps_replicas(spec: &Spec) -> bool {
    spec.sweeps
        .iter()
        .any(|s| s.param == super::spec::SweepParam::Replicas)
}

/// Whether the study runs on real local engines (local backend, no emulators, no given
/// URLs); if so, check they can be started (before the database is touched).
pub(super) fn check_real_local_engines(spec: &Spec, backend: Backend) -> Result<bool> {
    let real_local_engines = backend == Backend::Local
        && spec.fleet.engine != super::spec::EngineKind::Emulator
        && spec.local.as_ref().is_none_or(|l| l.engine_urls.is_empty());
    if real_local_engines {
        if sweeps_replicas(spec) {
            bail!("sweeps: real local engines are started once per study; sweep `replicas` with emulators or in simulation");
        }
        super::engines::EnginePool::preflight(
            &spec.fleet,
            &spec.local.clone().unwrap_or_default(),
        )?;
    }
    Ok(real_local_engines)
}

/// The local backend with real engines: start them once for the study (stopped when the
/// pool drops, on every way out); each step starts from cold caches.
pub(super) fn start_pool(
    spec: &Spec,
    wanted: bool,
    progress: bool,
) -> Result<Option<super::engines::EnginePool>> {
    if !wanted {
        return Ok(None);
    }
    if progress {
        eprintln!(
            "starting {} local {:?} replica(s) (about 30-60 s)",
            spec.fleet.replicas, spec.fleet.engine
        );
    }
    Ok(Some(super::engines::EnginePool::start(
        &spec.fleet,
        &spec.local.clone().unwrap_or_default(),
        spec.launch().scale_out,
    )?))
}
