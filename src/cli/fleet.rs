//! `cacheroute fleet …`: work with the hosts of an inventory: `preflight` (reachable, GPUs as
//! the inventory says, scratch writable, engine ports free), `plan` (where a study's replicas
//! would go, with their launch commands), `up`, `status` and `down`; and `down --slurm`, which
//! cancels a study's Slurm job by its name.

use crate::fleet::{inventory, launch, ssh};
use anyhow::{Context, Result};
use std::path::PathBuf;

#[derive(clap::Subcommand, Debug)]
pub enum FleetCmd {
    /// Check every host of an inventory before anything is started on it.
    #[command(after_help = "Examples:
  cacheroute fleet preflight --inventory inventories/two-node.yaml
  cacheroute fleet preflight --inventory inventories/h100-60.yaml \\
      --experiment experiments/flagship-70b-fp8.yaml     # also the study's engine ports")]
    Preflight(FleetArgs),
    /// Show where a study's replicas go and the command each one runs.
    #[command(
        after_help = "Example:\n  cacheroute fleet plan --inventory inventories/h100-60.yaml \\\n      --experiment experiments/flagship-70b-fp8.yaml"
    )]
    Plan(StudyFleetArgs),
    /// Start a study's replicas on their hosts and wait until each is ready.
    Up(UpArgs),
    /// The replicas recorded on the hosts and whether they run, or a study's Slurm job and
    /// where its replicas are.
    #[command(after_help = "Examples:
  cacheroute fleet status --inventory inventories/two-node.yaml
  cacheroute fleet status --slurm --experiment experiments/slurm-emulated.yaml")]
    Status(TargetArgs),
    /// Stop every replica recorded on the hosts, or cancel a study's Slurm job (works after
    /// the controller was killed).
    #[command(after_help = "Examples:
  cacheroute fleet down --inventory inventories/two-node.yaml
  cacheroute fleet down --slurm --experiment experiments/slurm-emulated.yaml")]
    Down(TargetArgs),
}

/// Where the replicas are: an inventory's hosts, or a study's Slurm job.
#[derive(clap::Args, Debug)]
pub struct TargetArgs {
    /// Inventory file (inventories/*.yaml): the replicas recorded on its hosts.
    #[arg(long, required_unless_present = "slurm", conflicts_with = "slurm")]
    pub inventory: Option<PathBuf>,
    /// The study's Slurm job instead: every job of this user named as the spec's
    /// `fleet.slurm.job_name` (default `cacheroute-<study name>`), found with `squeue --name`.
    #[arg(long, requires = "experiment")]
    pub slurm: bool,
    /// Experiment spec (with --slurm: whose job).
    #[arg(long)]
    pub experiment: Option<PathBuf>,
}

impl TargetArgs {
    /// The inventory form (`--inventory`, with the spec if given).
    fn hosts(self) -> Result<FleetArgs> {
        Ok(FleetArgs {
            inventory: self
                .inventory
                .context("give --inventory, or --slurm with --experiment")?,
            experiment: self.experiment,
        })
    }
}

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Example:\n  cacheroute fleet up --inventory inventories/two-node.yaml \\\n      --experiment experiments/quickstart-local.yaml\n  cacheroute fleet down --inventory inventories/two-node.yaml"
)]
pub struct UpArgs {
    #[command(flatten)]
    pub fleet: StudyFleetArgs,
    /// Seconds to wait for every replica's /health and a one-token generation.
    #[arg(long, default_value_t = 900)]
    pub ready_timeout: u64,
}

#[derive(clap::Args, Debug)]
pub struct FleetArgs {
    /// Inventory file (inventories/*.yaml).
    #[arg(long)]
    pub inventory: PathBuf,
    /// Experiment spec: its fleet decides replicas, TP, engine and precision (preflight then
    /// also checks the study's engine ports).
    #[arg(long)]
    pub experiment: Option<PathBuf>,
}

/// An inventory and the study whose replicas it is to hold (`plan`, `up`).
#[derive(clap::Args, Debug)]
pub struct StudyFleetArgs {
    /// Inventory file (inventories/*.yaml).
    #[arg(long)]
    pub inventory: PathBuf,
    /// Experiment spec: its fleet decides replicas, TP, engine and precision.
    #[arg(long)]
    pub experiment: PathBuf,
}

impl StudyFleetArgs {
    fn fleet(&self) -> FleetArgs {
        FleetArgs {
            inventory: self.inventory.clone(),
            experiment: Some(self.experiment.clone()),
        }
    }
}

fn load(a: &FleetArgs) -> Result<(inventory::Inventory, Option<crate::experiment::spec::Spec>)> {
    let text = std::fs::read_to_string(&a.inventory)
        .with_context(|| format!("reading inventory {}", a.inventory.display()))?;
    let inv = inventory::Inventory::parse(&text, &a.inventory.display().to_string())
        .map_err(anyhow::Error::msg)?;
    let spec = a
        .experiment
        .as_deref()
        .map(super::study::load_spec)
        .transpose()?
        .map(|(s, _)| s);
    Ok((inv, spec))
}

pub fn run(cmd: FleetCmd) -> Result<()> {
    // Every command shares one SSH session per host; their masters close when it ends.
    let r = run_cmd(cmd);
    ssh::close_all();
    r
}

fn run_cmd(cmd: FleetCmd) -> Result<()> {
    match cmd {
        FleetCmd::Preflight(a) => {
            let (inv, spec) = load(&a)?;
            let placements = match &spec {
                Some(s) => inventory::place(&inv, s.fleet.replicas, s.fleet.tp)
                    .map_err(anyhow::Error::msg)?,
                None => Vec::new(),
            };
            let mut failed = 0;
            for (i, h) in inv.hosts.iter().enumerate() {
                let ports: Vec<u16> = placements
                    .iter()
                    .filter(|p| p.host == i)
                    .map(|p| p.port)
                    .collect();
                match ssh::preflight(&ssh::Remote::new(&inv, h), &ports) {
                    Ok(r) => println!(
                        "{}: ok — {} × {}, {} MiB free in {}",
                        r.host,
                        r.gpus.len(),
                        r.gpus.first().map(String::as_str).unwrap_or("?"),
                        r.free_disk_mib.unwrap_or(0),
                        h.scratch.display()
                    ),
                    Err(e) => {
                        failed += 1;
                        eprintln!("error: {e}");
                    }
                }
            }
            if failed > 0 {
                anyhow::bail!("{failed} of {} host(s) failed preflight", inv.hosts.len());
            }
            Ok(())
        }
        FleetCmd::Up(a) => {
            let (inv, spec) = load(&a.fleet.fleet())?;
            let spec = spec.context("--experiment is needed: its fleet says what to start")?;
            let reps = crate::fleet::provision::up(
                &inv,
                &spec.launch(),
                std::time::Duration::from_secs(a.ready_timeout),
            )?;
            for r in &reps {
                println!(
                    "replica {} on {}: {} ready",
                    r.placement.replica, r.host, r.url
                );
            }
            println!(
                "{} replicas up; stop them with `cacheroute fleet down --inventory {}`",
                reps.len(),
                a.fleet.inventory.display()
            );
            Ok(())
        }
        FleetCmd::Status(a) if a.slurm => slurm_status(&slurm_target(&a)?),
        FleetCmd::Status(a) => {
            let (inv, _) = load(&a.hosts()?)?;
            let st = crate::fleet::provision::status(&inv)?;
            if st.is_empty() {
                println!("no replica recorded on any host of {}", inv.name);
            }
            for r in st {
                println!(
                    "{}: replica {} (process group {}) {}",
                    r.host,
                    r.replica,
                    r.pid,
                    if r.alive {
                        "running"
                    } else {
                        "dead (stale PID file)"
                    }
                );
            }
            Ok(())
        }
        FleetCmd::Down(a) if a.slurm => slurm_down(&slurm_target(&a)?),
        FleetCmd::Down(a) => {
            let (inv, _) = load(&a.hosts()?)?;
            let n = crate::fleet::provision::down(&inv, std::time::Duration::from_secs(10))?;
            println!("stopped {n} replica(s); nothing left running");
            Ok(())
        }
        FleetCmd::Plan(a) => {
            let (inv, spec) = load(&a.fleet())?;
            let spec = spec.context("--experiment is needed to plan replicas")?;
            let placements = inventory::place(&inv, spec.fleet.replicas, spec.fleet.tp)
                .map_err(anyhow::Error::msg)?;
            for p in &placements {
                let h = &inv.hosts[p.host];
                println!(
                    "replica {} → {} ({}:{}):",
                    p.replica, h.name, h.address, p.port
                );
                println!("  {}", launch::command_line(&spec.launch(), p, &h.engine));
            }
            Ok(())
        }
    }
}

/// A study's Slurm job: its name and shared directory.
struct SlurmTarget {
    name: String,
    dir: PathBuf,
}

/// The job `--slurm --experiment SPEC` stands for.
fn slurm_target(a: &TargetArgs) -> Result<SlurmTarget> {
    let path = a
        .experiment
        .as_deref()
        .context("--slurm needs --experiment")?;
    let (spec, _) = super::study::load_spec(path)?;
    let settings = spec
        .fleet
        .slurm
        .as_ref()
        .context(crate::experiment::spec::SLURM_NEEDED)?;
    let name = settings.job_name_for(&spec.name);
    let dir = settings.dir_for(&name, super::config_dir(path));
    Ok(SlurmTarget { name, dir })
}

/// `fleet status --slurm`: the study's jobs, their states, and the replicas' addresses.
fn slurm_status(t: &SlurmTarget) -> Result<()> {
    let jobs = crate::fleet::slurm::jobs_named(&t.name)?;
    if jobs.is_empty() {
        println!("no slurm job named {} in the queue", t.name);
    }
    for (id, state) in jobs {
        println!("slurm job {id} ({}): {state}", t.name);
        for r in crate::fleet::slurm::written_addresses(&t.dir) {
            println!("  replica {} on {} port {}", r.0, r.1, r.2);
        }
    }
    Ok(())
}

/// `fleet down --slurm`: cancel the study's job(s) by name and check the queue holds none
/// after.
fn slurm_down(t: &SlurmTarget) -> Result<()> {
    let ids = crate::fleet::slurm::down(&t.name)?;
    if ids.is_empty() {
        println!(
            "no slurm job named {} in the queue; nothing to cancel",
            t.name
        );
    } else {
        let list = ids
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "cancelled slurm job(s) {list} ({}); none left in the queue",
            t.name
        );
    }
    Ok(())
}
