//! `cacheroute run`, `report`, `compare` and `demo`: studies from spec to report.

use crate::experiment::runner::{self, RunOptions};
use crate::experiment::spec::{Backend, Spec};
use crate::store::BlockingStore;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// The simulator, in process.
    Sim,
    /// Emulators or engines on 127.0.0.1.
    Local,
    /// Engines on the inventory's hosts (`fleet.inventory`).
    Ssh,
    /// Engines in a Slurm job (`fleet.slurm`).
    Slurm,
}

impl From<BackendArg> for Backend {
    fn from(b: BackendArg) -> Backend {
        match b {
            BackendArg::Sim => Backend::Sim,
            BackendArg::Local => Backend::Local,
            BackendArg::Ssh => Backend::Ssh,
            BackendArg::Slurm => Backend::Slurm,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineArg {
    Vllm,
    Sglang,
    Emulator,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute run experiments/flagship-70b-fp8.yaml              # simulated; report in reports/
  cacheroute run experiments/quickstart-local.yaml --backend local --db local.db
  cacheroute run experiments/slurm-emulated.yaml --backend slurm --db slurm.db  # a Slurm job
  cacheroute run experiments/flagship-70b-fp8.yaml --resume     # continue a stopped study")]
pub struct RunArgs {
    /// Experiment spec (YAML); `--experiment SPEC` says the same.
    #[arg(required_unless_present = "experiment", value_name = "SPEC")]
    pub spec: Option<PathBuf>,
    /// Experiment spec (YAML), as `calibrate` and `fleet` take it.
    #[arg(long, conflicts_with = "spec", value_name = "SPEC")]
    pub experiment: Option<PathBuf>,
    /// Override the spec's backend.
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Override the spec's `fleet.engine` (e.g. run a real-vLLM study against emulators of the
    /// same engine model); the stored spec records the override.
    #[arg(long, value_enum)]
    pub engine: Option<EngineArg>,
    /// Results database (SQLite; created if missing).
    #[arg(long, default_value = "results.db")]
    pub db: PathBuf,
    /// Continue a study already in the database after its last completed step.
    #[arg(long)]
    pub resume: bool,
    /// Use only the first N seeds of the spec.
    #[arg(long)]
    pub seeds: Option<usize>,
    /// Where the report goes.
    #[arg(long, default_value = "reports")]
    pub out: PathBuf,
    /// Worker threads for simulated steps (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Store every request of each measured window (large).
    #[arg(long = "store-requests")]
    pub store_requests: bool,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Stop after this many steps are stored (for testing kill-and-resume).
    #[arg(long = "stop-after", hide = true)]
    pub stop_after: Option<usize>,
}

/// Read and validate a spec; returns it with its text.
pub fn load_spec(path: &Path) -> Result<(Spec, String)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading experiment spec {}", path.display()))?;
    let spec = Spec::parse(&text, &path.display().to_string()).map_err(anyhow::Error::msg)?;
    Ok((spec, text))
}

fn options(a: &RunArgs, base_dir: PathBuf) -> RunOptions {
    RunOptions {
        db: a.db.clone(),
        out_dir: a.out.clone(),
        resume: a.resume,
        seeds: a.seeds,
        backend: a.backend.map(Backend::from),
        threads: a.threads,
        progress: !a.quiet,
        store_requests: a.store_requests,
        base_dir,
        stop_after_steps: a.stop_after,
        interrupt: None,
    }
}

/// Set by the first SIGINT (Ctrl-C) or SIGTERM while a study runs.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Catch the first SIGINT and the first SIGTERM in [`INTERRUPTED`] (a second one kills as
/// usual), so the study stops after its current step and its fleet is torn down. A signal
/// that is ignored (a job started by a script) stays ignored. Returns the flag when installed.
fn catch_sigint() -> Option<&'static std::sync::atomic::AtomicBool> {
    let mut any = false;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction with a handler that only stores to an atomic (async-signal-safe).
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                || old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
            new.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut new.sa_mask);
            any |= libc::sigaction(sig, &new, std::ptr::null_mut()) == 0;
        }
    }
    any.then_some(&INTERRUPTED)
}

/// This process's command line with `--resume` added (once), quoted for a POSIX shell.
fn resume_command() -> String {
    let mut args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--resume") {
        args.push("--resume".into());
    }
    crate::peer::shell_line(&args)
}

impl RunArgs {
    /// The spec path, given positionally or with `--experiment` (clap requires one).
    pub fn spec_path(&self) -> &std::path::Path {
        self.spec
            .as_deref()
            .or(self.experiment.as_deref())
            .expect("clap requires SPEC or --experiment")
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let (mut spec, mut text) = load_spec(a.spec_path())?;
    if let Some(e) = a.engine {
        use crate::experiment::spec::EngineKind;
        spec.fleet.engine = match e {
            EngineArg::Vllm => EngineKind::Vllm,
            EngineArg::Sglang => EngineKind::Sglang,
            EngineArg::Emulator => EngineKind::Emulator,
        };
        text = yaml_serde::to_string(&spec).context("serializing the overridden spec")?;
    }
    let mut opts = options(&a, super::config_dir(a.spec_path()).to_path_buf());
    opts.interrupt = catch_sigint();
    let t0 = std::time::Instant::now();
    let (out, peers_failed) = match runner::run(&spec, &text, &opts) {
        Ok(out) => (out, None),
        Err(e) => match e.downcast::<runner::PeersFailed>() {
            Ok(p) => (p.outcome, Some(p.failures)),
            Err(e) => match e.downcast_ref::<runner::Interrupted>() {
                Some(i) => bail!(
                    "interrupted — rerun with --resume: {} ({} of {} steps stored this time; the rest run on resume)",
                    resume_command(),
                    i.stored,
                    i.total
                ),
                None => return Err(e),
            },
        },
    };
    print!("{}", out.summary);
    println!(
        "{}: {} steps run, {} already stored, {:.1} s; results in {}",
        spec.name,
        out.steps_run,
        out.steps_skipped,
        t0.elapsed().as_secs_f64(),
        a.db.display()
    );
    println!(
        "report: {} (and {})",
        out.report_md.display(),
        out.report_json.display()
    );
    match peers_failed {
        None => Ok(()),
        Some(f) => {
            let (details, retry) = peer_failures_message(&f, &resume_command());
            eprint!("{details}");
            bail!(
                "external router(s) failed: {} (the other policies' results are stored and reported); retry: {retry}",
                f.iter().map(|f| f.label.as_str()).collect::<Vec<_>>().join(", ")
            )
        }
    }
}

/// What a study whose external routers failed prints: each failure in one line, then its log
/// tail; and the command that retries them (installs first where one was missing).
fn peer_failures_message(
    failures: &[crate::experiment::external::PeerFailed],
    resume: &str,
) -> (String, String) {
    let mut m = String::new();
    for f in failures {
        m.push_str(&format!("error: {f}\n"));
        if !f.log_tail.is_empty() {
            m.push_str(&format!("  last lines of {}'s log:\n", f.label));
            for l in f.log_tail.lines() {
                m.push_str(&format!("    {l}\n"));
            }
        }
    }
    let mut retry: Vec<&str> = failures
        .iter()
        .map(|f| f.install.as_str())
        .filter(|i| !i.is_empty())
        .collect();
    retry.dedup();
    retry.push(resume);
    (m, retry.join(" && "))
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute report --db results.db                              # list the studies
  cacheroute report --db results.db --study flagship-70b-fp8     # rewrite its report")]
pub struct ReportArgs {
    /// Results database.
    #[arg(long, default_value = "results.db")]
    pub db: PathBuf,
    /// Study name (omit to list the studies in the database).
    #[arg(long)]
    pub study: Option<String>,
    /// Where the report goes.
    #[arg(long, default_value = "reports")]
    pub out: PathBuf,
    /// Take description, notes, claims and paper numbers from this spec file (its experiment
    /// must be the stored one).
    #[arg(long)]
    pub spec: Option<PathBuf>,
}

fn open_existing(db: &Path) -> Result<BlockingStore> {
    if !db.exists() {
        bail!(
            "{} does not exist; run a study first (`cacheroute run experiments/X.yaml --db {}`)",
            db.display(),
            db.display()
        );
    }
    Ok(BlockingStore::open(db)?)
}

pub fn report(a: ReportArgs) -> Result<()> {
    let store = open_existing(&a.db)?;
    let Some(name) = a.study else {
        let list = store.list_studies()?;
        if list.is_empty() {
            println!("{} holds no study", a.db.display());
        }
        for s in list {
            println!(
                "{}: {} runs ({} complete), {} steps, created {}",
                s.name, s.runs, s.complete_runs, s.steps, s.created_at
            );
        }
        return Ok(());
    };
    let presentation = a
        .spec
        .as_deref()
        .map(load_spec)
        .transpose()?
        .map(|(s, _)| s);
    let (md, json, summary) =
        crate::experiment::report_from_store(&store, &name, &a.out, presentation.as_ref())?;
    print!("{summary}");
    println!("report: {} (and {})", md.display(), json.display());
    Ok(())
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Example:
  cacheroute compare flagship-70b-fp8 flagship-70b-fp16 --db results.db --out reports/compare.md")]
pub struct CompareArgs {
    /// First study (e.g. flagship-70b-fp8).
    pub a: String,
    /// Second study (e.g. flagship-70b-fp16).
    pub b: String,
    /// Results database holding both.
    #[arg(long, default_value = "results.db")]
    pub db: PathBuf,
    /// Also write the comparison to this markdown file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn compare(a: CompareArgs) -> Result<()> {
    let store = open_existing(&a.db)?;
    let da = crate::experiment::study_data(&store.load_study(&a.a)?)?;
    let db = crate::experiment::study_data(&store.load_study(&a.b)?)?;
    let md = crate::report::compare(&da, &db);
    print!("{md}");
    if let Some(out) = &a.out {
        super::write_atomic(out, md.as_bytes())?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// The quickstart spec, embedded so `demo` works from any directory.
pub const QUICKSTART: &str = include_str!("../../experiments/quickstart.yaml");

#[derive(clap::Args, Debug)]
#[command(after_help = "Example:
  cacheroute demo            # writes reports/quickstart.md and its plots")]
pub struct DemoArgs {
    /// Where the report goes.
    #[arg(long, default_value = "reports")]
    pub out: PathBuf,
    /// Results database for the demo (replaced on every run).
    #[arg(long, default_value = "reports/quickstart.db")]
    pub db: PathBuf,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

pub fn demo(a: DemoArgs) -> Result<()> {
    let spec =
        Spec::parse(QUICKSTART, "experiments/quickstart.yaml").map_err(anyhow::Error::msg)?;
    // The demo's own database is rebuilt each time (it is nobody else's file).
    for suffix in ["", "-wal", "-shm"] {
        let p = PathBuf::from(format!("{}{suffix}", a.db.display()));
        if p.exists() {
            std::fs::remove_file(&p)
                .with_context(|| format!("removing the previous demo database {}", p.display()))?;
        }
    }
    if let Some(dir) = a.db.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let opts = RunOptions {
        db: a.db.clone(),
        out_dir: a.out.clone(),
        progress: !a.quiet,
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    let out = runner::run(&spec, QUICKSTART, &opts)?;
    print!("{}", out.summary);
    println!(
        "quickstart: {} simulated steps in {:.1} s",
        out.steps_run,
        t0.elapsed().as_secs_f64()
    );
    println!("report: {}", out.report_md.display());
    Ok(())
}
