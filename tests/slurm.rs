//! The slurm backend against a real single-node Slurm (Debian's `slurmctld`, `slurmd` and
//! `munge`, installed by `scripts/test.sh`): each test starts its own `munged`, `slurmctld`
//! and `slurmd` from a `slurm.conf` it writes in a temporary directory (own ports, state and
//! spool directories, own munge socket and key; never a system Slurm), runs `cacheroute` with
//! `SLURM_CONF` pointing there, and stops the daemons at the end. Engines are the project's
//! emulator (`cacheroute emulate`, found on the PATH of the job's tasks). The tests run one at
//! a time (a lock): together about 60-70 s here.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
/// Workload, policies, ladder and timing of a two-step live study.
const STUDY_BODY: &str = include_str!("data/two-step-study.yaml");

/// One Slurm test at a time: each starts its own cluster, and the studies measure latency.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A single-node Slurm cluster of this test's own.
struct Cluster {
    dir: tempfile::TempDir,
    daemons: Vec<Child>,
    conf: PathBuf,
    /// Directory of a fake `nvidia-smi` (two H100s at 87% and 43%) for the GPU agent.
    fake_bin: PathBuf,
}

fn which(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port() -> u16 {
    cacheroute::peer::free_port().unwrap()
}

fn id_of(what: &str, user: &str) -> u32 {
    let o = Command::new("id").args([what, user]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

fn short_hostname() -> String {
    let o = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

impl Cluster {
    fn start() -> Cluster {
        for d in ["slurmctld", "slurmd", "munged", "sbatch"] {
            // scripts/test.sh installs them; without them this test cannot mean anything.
            assert!(
                which(d),
                "{d} is missing: run the suite through scripts/test.sh (it installs slurmctld, slurmd, munge and slurm-client)"
            );
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        assert!(
            euid == 0,
            "the Slurm tests start slurmd, which runs jobs as their users: run them as root"
        );
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // munged checks that its socket's directory is reachable by everyone.
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (uid, gid) = (id_of("-u", "munge"), id_of("-g", "munge"));
        for sub in ["munge", "run"] {
            std::fs::create_dir(d.join(sub)).unwrap();
            std::os::unix::fs::chown(d.join(sub), Some(uid), Some(gid)).unwrap();
        }
        std::fs::set_permissions(d.join("munge"), std::fs::Permissions::from_mode(0o700)).unwrap();
        let key = d.join("munge/munge.key");
        let mut bytes = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut bytes)
            .unwrap();
        std::fs::write(&key, bytes).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&key, Some(uid), Some(gid)).unwrap();
        for sub in ["state", "spool", "log", "bin"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let sock = d.join("run/munge.sock");
        let mut daemons = Vec::new();
        let munged = Command::new("munged")
            .arg("--foreground")
            .arg(format!("--socket={}", sock.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!(
                "--log-file={}",
                d.join("munge/munged.log").display()
            ))
            .arg(format!("--pid-file={}", d.join("run/munged.pid").display()))
            .arg(format!(
                "--seed-file={}",
                d.join("munge/munged.seed").display()
            ))
            .uid(uid)
            .gid(gid)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        daemons.push(munged);
        let t0 = Instant::now();
        while !sock.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "munged did not start; its log: {}; if it says /dev/null is not a character device, restore it: mknod -m 666 /dev/null c 1 3",
                std::fs::read_to_string(d.join("munge/munged.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let node = short_hostname();
        let conf = d.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=crtest\nSlurmctldHost={node}(127.0.0.1)\nSlurmctldPort={cp}\nSlurmdPort={dp}\n\
SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={sock}\n\
StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/run/slurmctld.pid\n\
SlurmdPidFile={d}/run/slurmd.pid\nSlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
SlurmdParameters=config_overrides\nReturnToService=2\nKillWait=2\nMinJobAge=2\nSchedulerParameters=sched_interval=1\n\
MpiDefault=none\nNodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n\
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP\n\
PartitionName=short Nodes={node} MaxTime=5 State=UP\n",
                cp = free_port(),
                dp = free_port(),
                sock = sock.display(),
                d = d.display(),
            ),
        )
        .unwrap();
        for daemon in ["slurmctld", "slurmd"] {
            let c = Command::new(daemon)
                .args(["-D", "-f"])
                .arg(&conf)
                .env("SLURM_CONF", &conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            daemons.push(c);
        }
        let smi = d.join("bin/nvidia-smi");
        std::fs::write(&smi, include_str!("data/fake-nvidia-smi")).unwrap();
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        let c = Cluster {
            fake_bin: d.join("bin"),
            dir,
            daemons,
            conf,
        };
        // Ready when the node is idle.
        let t0 = Instant::now();
        loop {
            let o = c.cmd("sinfo").args(["-h", "-o", "%T"]).output().unwrap();
            if String::from_utf8_lossy(&o.stdout).trim() == "idle" {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the Slurm node never became idle: {}{}",
                String::from_utf8_lossy(&o.stderr),
                std::fs::read_to_string(c.dir.path().join("log/slurmctld.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    /// A command with this cluster's configuration, `cacheroute` and the fake `nvidia-smi` on
    /// its PATH (sbatch passes the environment on to the job).
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        let path = format!(
            "{}:{}:{}",
            self.fake_bin.display(),
            Path::new(BIN).parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        c.env("SLURM_CONF", &self.conf)
            .env("PATH", path)
            .current_dir(self.dir.path());
        c
    }

    /// `srun` steps of the `cacheroute agent` for job `name`'s job, by this controller.
    fn agent_steps(&self, name: &str) -> usize {
        self.jobs(name)
            .iter()
            .map(|id| running(&format!("srun --jobid={id} --overlap")).len())
            .sum()
    }

    /// Job ids queued under `name`.
    fn jobs(&self, name: &str) -> Vec<String> {
        let o = self
            .cmd("squeue")
            .args(["-h", "-o", "%i", "--name", name])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .map(String::from)
            .collect()
    }

    /// Write the two-step study `name` with `slurm` as its fleet's Slurm section (and
    /// `replace` applied to the body) into `specs/`; its job's directory is `jobs/<name>`
    /// (given relative to the spec) unless `slurm` says `dir:`. Returns the spec file and the
    /// replicas' base port.
    fn spec(&self, name: &str, slurm: &str, replace: &[(&str, &str)]) -> (PathBuf, u16) {
        let base = loop {
            let p = free_port();
            if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
                break p;
            }
        };
        let mut body = STUDY_BODY.to_string();
        for (a, b) in replace {
            body = body.replace(a, b);
        }
        let dir = if slurm.contains("dir:") {
            String::new()
        } else {
            format!("dir: ../jobs/{name}, ")
        };
        let text = format!(
            "name: {name}\nfleet: {{ engine: emulator, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: 2, \
slurm: {{ time_limit: 10, base_port: {base}, {dir}{slurm} }} }}\n{body}",
        );
        std::fs::create_dir_all(self.dir.path().join("specs")).unwrap();
        let f = self.dir.path().join("specs").join(format!("{name}.yaml"));
        std::fs::write(&f, text).unwrap();
        (f, base)
    }

    /// `cacheroute run SPEC --backend slurm` (not waited for).
    fn run_study(&self, spec: &Path) -> Command {
        let mut c = self.cmd(BIN);
        c.arg("run")
            .arg(spec)
            .args(["--backend", "slurm", "--quiet", "--db"])
            .arg(spec.with_extension("db"))
            .arg("--out")
            .arg(self.dir.path().join("reports"));
        c
    }

    /// Start study `name` with 5 s steps and wait until its first step runs (the GPU agent's
    /// step is in the job); returns the controller, the spec and the replicas' base port.
    fn short_study_in_its_first_step(&self, name: &str) -> (Child, PathBuf, u16) {
        let (spec, base) = self.spec(
            name,
            "partition: debug",
            &[
                ("warmup_s: 4", "warmup_s: 1"),
                ("measure_s: 8", "measure_s: 4"),
            ],
        );
        let ctl = self
            .run_study(&spec)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let job = format!("cacheroute-{name}");
        wait_until(60, "the first step starts", || {
            emulators_on(base) == 2 && self.agent_steps(&job) > 0
        });
        (ctl, spec, base)
    }

    fn fleet_down(&self, spec: &Path) -> Output {
        self.cmd(BIN)
            .args(["fleet", "down", "--slurm", "--experiment"])
            .arg(spec)
            .output()
            .unwrap()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Whatever a failed test left queued goes first, then the daemons.
        let _ = self.cmd("scancel").args(["--full", "--user=root"]).status();
        std::thread::sleep(Duration::from_millis(500));
        for c in self.daemons.iter_mut().rev() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        }
        for c in self.daemons.iter_mut().rev() {
            let t0 = Instant::now();
            while matches!(c.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Processes whose command line contains `pat`.
fn running(pat: &str) -> Vec<String> {
    let o = Command::new("pgrep").args(["-af", pat]).output().unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| !l.contains("pgrep"))
        .map(String::from)
        .collect()
}

fn emulators_on(base: u16) -> usize {
    (0..2)
        .map(|i| running(&format!("emulate --listen 0.0.0.0:{}", base + i)).len())
        .sum()
}

/// The `error: …` line of a command that must have failed, and its whole stderr.
fn error_line(o: &Output) -> (String, String) {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"))
        .to_string();
    (line, err)
}

/// Wait (up to `secs`) until `f` holds.
fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed().as_secs() < secs, "{what} within {secs} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_study_runs_on_the_slurm_backend_and_leaves_no_job() {
    let _one = lock();
    let t0 = Instant::now();
    let c = Cluster::start();
    let (spec, base) = c.spec("slurm-tiny", "partition: debug", &[]);
    let o = c.run_study(&spec).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // The provisioning events, at info, with job and replica.
    for event in [
        "slurm job submitted job=",
        "replica placed job=",
        "replica=1",
        "replica ready job=",
        "slurm job cancelled; fleet torn down job=",
    ] {
        assert!(err.contains(event), "no `{event}` in: {err}");
    }
    assert!(c.jobs("cacheroute-slurm-tiny").is_empty(), "job left");
    assert_eq!(emulators_on(base), 0, "replicas left");
    let db = spec.with_extension("db");
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("slurm-tiny").unwrap();
    assert_eq!(study.steps.len(), 2);
    for step in &study.steps {
        assert!(step.metrics.requests > 20, "{:?}", step.metrics);
        assert_eq!(step.metrics.errors, 0, "{:?}", step.metrics);
    }
    let (h, q) = common::study::engine_counter_deltas(&db, "slurm-tiny");
    assert_eq!((q.len(), h.len()), (4, 4), "two engines, two steps");
    assert!(q.iter().all(|&v| v > 0.0), "{q:?}");
    // The GPU agent ran as a step of the job on its node; the report reads its samples (the
    // mean of 87% and 43%).
    let md = std::fs::read_to_string(c.dir.path().join("reports/slurm-tiny.md")).unwrap();
    assert_eq!(
        md.lines().filter(|l| l.ends_with("| 65% | — |")).count(),
        2,
        "{md}"
    );

    // SIGTERM to the controller: the study stops after its current step (short steps here)
    // and the job is cancelled.
    let (ctl, _, base2) = c.short_study_in_its_first_step("slurm-term");
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(ctl.id() as libc::pid_t, libc::SIGTERM) };
    let o = ctl.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(err.contains("fleet torn down"), "{err}");
    assert!(c.jobs("cacheroute-slurm-term").is_empty(), "job left");
    assert_eq!(emulators_on(base2), 0, "replicas left");

    // SIGTERM while the job waits in the queue (the node is taken by another job): the job
    // is cancelled and the controller says so.
    let busy = c
        .cmd("sbatch")
        .args([
            "--parsable",
            "--job-name=cr-busy",
            "--cpus-per-task=8",
            "--time=2",
        ])
        .args(["--output=/dev/null", "--wrap=sleep 120"])
        .output()
        .unwrap();
    assert!(
        busy.status.success(),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    let (spec3, _) = c.spec("slurm-queued", "partition: debug", &[]);
    let mut ctl = c.run_study(&spec3);
    let mut ctl = ctl
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The study's log, read as it comes: the signal goes only once the job is queued and the
    // study has logged why it waits (Slurm names no reason until its scheduler has looked at
    // the job, which may be after the job shows in the queue).
    let log = std::sync::Arc::new(Mutex::new(String::new()));
    let reader = {
        let log = log.clone();
        let stderr = ctl.stderr.take().unwrap();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let mut l = log.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        })
    };
    wait_until(
        30,
        "the study's job is queued and its pending reason logged",
        || {
            c.jobs("cacheroute-slurm-queued").len() == 1
                && log.lock().unwrap().contains("slurm job pending job=")
        },
    );
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(ctl.id() as libc::pid_t, libc::SIGTERM) };
    let status = ctl.wait().unwrap();
    reader.join().unwrap();
    let err = log.lock().unwrap().clone();
    let (line, err) = error_line(&Output {
        status,
        stdout: Vec::new(),
        stderr: err.into_bytes(),
    });
    assert!(
        line.contains(
            "(cacheroute-slurm-queued) was cancelled: interrupted while its replicas started"
        ),
        "{err}"
    );
    assert!(
        err.contains("slurm job pending job=") && err.contains(" reason="),
        "pending reason logged: {err}"
    );
    assert!(c.jobs("cacheroute-slurm-queued").is_empty(), "job left");
    assert!(c
        .cmd("scancel")
        .args(["--name=cr-busy"])
        .status()
        .unwrap()
        .success());
    eprintln!(
        "slurm study and SIGTERM: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_killed_controller_leaves_a_job_that_fleet_down_cancels() {
    let _one = lock();
    let t0 = Instant::now();
    let c = Cluster::start();
    let (spec, base) = c.spec(
        "slurm-kill",
        // The job's directory by default: slurm/<job name> under the working directory.
        "job_name: cr-kill-test, dir: ~",
        &[("measure_s: 8", "measure_s: 60")],
    );
    let mut ctl = c
        .run_study(&spec)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(60, "the study's first step starts", || {
        emulators_on(base) == 2 && c.agent_steps("cr-kill-test") > 0
    });
    std::thread::sleep(Duration::from_secs(1));
    let id = c.jobs("cr-kill-test").pop().unwrap();
    assert!(
        c.dir
            .path()
            .join(format!("slurm/cr-kill-test/job-{id}.log"))
            .exists(),
        "the job's log in its default directory"
    );
    let o = Command::new("pgrep")
        .args(["-P", &ctl.id().to_string(), "-f", "route --config"])
        .output()
        .unwrap();
    let routers: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(routers.len(), 1, "the step's router");
    ctl.kill().unwrap();
    let _ = ctl.wait();
    std::thread::sleep(Duration::from_millis(500));
    // The job outlives its controller (until its time limit)…
    assert_eq!(
        c.jobs("cr-kill-test").len(),
        1,
        "the job should still be queued"
    );
    assert_eq!(emulators_on(base), 2, "its replicas should still run");
    // `fleet status --slurm` from a new process sees it and where its replicas are.
    let o = c
        .cmd(BIN)
        .args(["fleet", "status", "--slurm", "--experiment"])
        .arg(&spec)
        .output()
        .unwrap();
    let st = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        st.starts_with(&format!("slurm job {id} (cr-kill-test): RUNNING\n"))
            && st.contains(&format!("  replica 0 on {} port ", short_hostname()))
            && st.contains("  replica 1 on "),
        "{st}"
    );
    // (`time_limit: 10` in the spec: Slurm ends the job by then in any case.)
    let o = c
        .cmd("squeue")
        .args(["-h", "-o", "%l", "--name", "cr-kill-test"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "10:00");
    // …and `fleet down --slurm` from a new process finds it by name and cancels it.
    let o = c.fleet_down(&spec);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.starts_with("cancelled slurm job(s) ") && out.contains("(cr-kill-test); none left"),
        "{out}"
    );
    assert!(c.jobs("cr-kill-test").is_empty(), "job left");
    assert_eq!(emulators_on(base), 0, "replicas left");
    // The controller's router and its agent step went with it and the job.
    wait_until(10, "router and agent gone", || {
        routers
            .iter()
            .all(|p| !Path::new(&format!("/proc/{p}")).exists())
            && running(&format!("--jobid={id} ")).is_empty()
    });
    // Nothing more to cancel.
    let o = c.fleet_down(&spec);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("no slurm job named cr-kill-test"));
    eprintln!(
        "slurm SIGKILL and fleet down: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn a_job_that_cannot_start_is_named_in_one_line() {
    let _one = lock();
    let t0 = Instant::now();
    let c = Cluster::start();
    // A partition the cluster does not have: sbatch refuses the job.
    let (spec, _) = c.spec("slurm-bad", "partition: nosuch", &[]);
    let o = c.run_study(&spec).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.starts_with("error: slurm job cacheroute-slurm-bad: sbatch refused it: ")
            && err.contains("Invalid partition")
            && err.contains("partition `nosuch`"),
        "{err}"
    );
    eprint!("bad partition: {err}");
    assert!(c.jobs("cacheroute-slurm-bad").is_empty());
    // A job that starts but whose engines cannot: the error names the job, its log and the
    // replica's last log lines, and the job is gone.
    let text = std::fs::read_to_string(&spec)
        .unwrap()
        .replace("name: slurm-bad", "name: slurm-noengine")
        .replace("engine: emulator", "engine: vllm")
        .replace(
            "partition: nosuch",
            "gpus_per_replica: 0, engine: {venv: /nonexistent/venv}",
        );
    let spec2 = spec.with_file_name("slurm-noengine.yaml");
    std::fs::write(&spec2, text).unwrap();
    let (line, _) = error_line(&c.run_study(&spec2).output().unwrap());
    assert!(
        line.contains("(cacheroute-slurm-noengine) ended")
            && line.contains("before its replicas were ready; log ")
            // `dir: ../jobs/slurm-bad`, relative to the spec file.
            && line.contains(&format!(
                "log {}/jobs/slurm-bad/job-",
                c.dir.path().canonicalize().unwrap().display()
            ))
            && line.contains("/nonexistent/venv/bin/python"),
        "{line}"
    );
    eprintln!("engine that cannot start: {line}");
    assert!(c.jobs("cacheroute-slurm-noengine").is_empty());
    // Engines that start but never answer: after `ready_timeout_s` from the job's start the
    // error names the replica, the job's state and the replica's log; the job is cancelled.
    let venv = c.dir.path().join("slow-venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    let py = venv.join("bin/python");
    std::fs::write(
        &py,
        "#!/bin/sh\necho 'loading model weights from /models/huge'\nexec sleep 301\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (slow, _) = c.spec(
        "slurm-slow",
        &format!(
            "gpus_per_replica: 0, ready_timeout_s: 2, engine: {{venv: {}}}",
            venv.display()
        ),
        &[],
    );
    let text = std::fs::read_to_string(&slow)
        .unwrap()
        .replace("engine: emulator", "engine: vllm");
    std::fs::write(&slow, text).unwrap();
    let (line, _) = error_line(&c.run_study(&slow).output().unwrap());
    assert!(
        line.starts_with("error: slurm job ")
            && line.contains("(cacheroute-slurm-slow): replica ")
            && line.contains(" not ready within 2 s (job RUNNING); log ")
            && line.contains("/replica-")
            && line.ends_with(".log: loading model weights from /models/huge"),
        "{line}"
    );
    eprintln!("engine never ready: {line}");
    assert!(c.jobs("cacheroute-slurm-slow").is_empty());
    assert!(
        running("sleep 301").is_empty(),
        "the engines are gone with the job"
    );
    // A job its partition never starts (a time limit over the partition's): named with the
    // reason, and cancelled.
    let (spec3, _) = c.spec("slurm-short", "partition: short", &[]);
    let (line, err) = error_line(&c.run_study(&spec3).output().unwrap());
    assert!(
        // Slurm 22.05 gives PartitionConfig as the first reason, PartitionTimeLimit later.
        line.contains("(cacheroute-slurm-short) cannot start: pending with reason Partition")
            && line.contains("check fleet.slurm"),
        "{err}"
    );
    eprintln!("job that never starts: {line}");
    assert!(c.jobs("cacheroute-slurm-short").is_empty());
    // A replica that dies mid-study ends the job (srun --kill-on-bad-exit); the study stops
    // with the job, its state and its log named.
    let (ctl, spec4, base) = c.short_study_in_its_first_step("slurm-dies");
    assert!(Command::new("pkill")
        .args([
            "-KILL",
            "-f",
            &format!("emulate --listen 0.0.0.0:{}", base + 1)
        ])
        .status()
        .unwrap()
        .success());
    let (line, err) = error_line(&ctl.wait_with_output().unwrap());
    assert!(
        line.starts_with("error: slurm job ")
            && line.contains("(cacheroute-slurm-dies)")
            && line.contains("/job-")
            && line.contains(".log: ")
            // The step it ended under is an error, not a stored result.
            && line.contains("ended under the step (left the queue); the step is not stored"),
        "{err}"
    );
    assert!(
        err.contains("WARN cacheroute::fleet::slurm: slurm job lost job="),
        "{err}"
    );
    eprintln!("replica died: {line}");
    let st = cacheroute::store::BlockingStore::open(spec4.with_extension("db")).unwrap();
    assert!(st.load_study("slurm-dies").unwrap().steps.is_empty());
    assert!(c.jobs("cacheroute-slurm-dies").is_empty());
    assert_eq!(emulators_on(base), 0);
    // A spec without a `slurm:` section on the slurm backend.
    let text = std::fs::read_to_string(&spec).unwrap();
    let (head, rest) = text.split_once(", slurm: {").unwrap();
    let plain = spec.with_file_name("no-slurm.yaml");
    std::fs::write(
        &plain,
        format!("{head}{}", &rest[rest.find('}').unwrap() + 1..]),
    )
    .unwrap();
    let (line, _) = error_line(&c.run_study(&plain).output().unwrap());
    assert!(
        line.starts_with("error: fleet.slurm: the slurm backend needs a `slurm:` section"),
        "{line}"
    );
    // A spec field of the wrong shape is refused before anything is submitted.
    let bad = std::fs::read_to_string(&spec)
        .unwrap()
        .replace("time_limit: 10", "time_limit: soon");
    std::fs::write(&spec, bad).unwrap();
    let o = c.run_study(&spec).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("fleet.slurm.time_limit: `soon`"), "{err}");
    eprintln!("slurm failures: {:.1} s", t0.elapsed().as_secs_f64());
}
