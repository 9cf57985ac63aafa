//! The SSH path against a real `sshd` on 127.0.0.1: this test starts its own daemon on a free
//! port with generated host and user keys (never touching a system sshd), gives its sessions a
//! fake `nvidia-smi` reporting two H100s, and runs the fleet preflight over it — a good host,
//! a wrong GPU count, a refused key and a busy port each give the expected answer.

mod common;

use cacheroute::fleet::inventory::Inventory;
use cacheroute::fleet::ssh::{preflight, Remote, SshError};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

struct Sshd {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keygen(path: &Path) {
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_sshd() -> Sshd {
    start_sshd_with(false)
}

/// With `broken_engine`, the host's `cacheroute` is a script that fails at start (like an
/// engine missing its model): it shadows the real binary on the sessions' PATH.
fn start_sshd_with(broken_engine: bool) -> Sshd {
    let sshd = Path::new("/usr/sbin/sshd");
    if !sshd.exists() {
        // scripts/test.sh installs openssh-server; without it this test cannot mean anything.
        panic!("/usr/sbin/sshd is missing: run the suite through scripts/test.sh (it installs openssh-server)");
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    keygen(&d.join("host_key"));
    keygen(&d.join("user_key"));
    keygen(&d.join("stranger_key"));
    std::fs::copy(d.join("user_key.pub"), d.join("authorized_keys")).unwrap();
    let bin = d.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        // Answers like the real one: names for `--query-gpu=name`, CSV samples for the agent's
        // telemetry query (timestamp,index,util,mem,power,clock,temp).
        "#!/bin/sh\ncase \"$*\" in\n*utilization.gpu*)\n  echo '2026/11/30 10:00:00.000, 0, 87, 61234, 512.5, 1980, 61'\n  echo '2026/11/30 10:00:00.000, 1, 43, 30000, [N/A], 1755, 55'\n  ;;\n*)\n  echo 'NVIDIA H100 80GB HBM3'\n  echo 'NVIDIA H100 80GB HBM3'\n  ;;\nesac\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    if broken_engine {
        let fake = bin.join("cacheroute");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho 'loading model: weights not found in /models/missing' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let port = free_port();
    let cfg = format!(
        "ListenAddress 127.0.0.1\nPort {port}\nHostKey {hk}\nPidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\n\
PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
UsePAM no\nStrictModes no\nSetEnv PATH={bin}:{exe}:/usr/local/bin:/usr/bin:/bin\n",
        hk = d.join("host_key").display(),
        d = d.display(),
        bin = bin.display(),
        exe = Path::new(env!("CARGO_BIN_EXE_cacheroute")).parent().unwrap().display()
    );
    std::fs::write(d.join("sshd_config"), cfg).unwrap();
    std::fs::create_dir_all("/run/sshd").unwrap();
    let mut child = Command::new(sshd)
        .args(["-D", "-e", "-f"])
        .arg(d.join("sshd_config"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Sshd { child, port, dir };
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("sshd did not start on port {port}");
}

fn inventory(s: &Sshd, key: &str, gpus: u32) -> Inventory {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/inventories/local-ssh.yaml"
    ))
    .unwrap();
    let mut inv = Inventory::parse(&text, "local-ssh.yaml").unwrap();
    let h = &mut inv.hosts[0];
    h.port = s.port;
    h.identity = Some(s.dir.path().join(key));
    h.gpus.count = gpus;
    h.scratch = s.dir.path().join("scratch");
    inv
}

#[test]
fn preflight_over_a_real_sshd() {
    let s = start_sshd();
    // A good host.
    let inv = inventory(&s, "user_key", 2);
    let r = Remote::new(&inv, &inv.hosts[0]);
    let rep = preflight(&r, &[free_port()]).unwrap();
    assert_eq!(rep.gpus, vec!["NVIDIA H100 80GB HBM3".to_string(); 2]);
    assert!(rep.free_disk_mib.unwrap_or(0) > 0);
    assert!(
        s.dir.path().join("scratch").is_dir(),
        "scratch created on the host"
    );
    // The inventory expects more GPUs than the host has.
    let inv4 = inventory(&s, "user_key", 4);
    let e = preflight(&Remote::new(&inv4, &inv4.hosts[0]), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("host localhost")
            && e.contains("reports 2 GPU(s) but the inventory says 4")
            && e.contains("gpus.count"),
        "{e}"
    );
    // A key the host does not accept.
    let bad = inventory(&s, "stranger_key", 2);
    let e = preflight(&Remote::new(&bad, &bad.hosts[0]), &[]).unwrap_err();
    assert!(matches!(e, SshError::Auth { .. }), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("host localhost") && e.contains("identity:"),
        "{e}"
    );
    assert!(!e.contains("BEGIN OPENSSH"), "no secret in messages");
    // An engine port already taken.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = busy.local_addr().unwrap().port();
    let e = preflight(&r, &[p]).unwrap_err().to_string();
    assert!(e.contains(&format!("port(s) {p} already in use")), "{e}");
    // The same through the CLI: one line per host, non-zero exit when one fails.
    let f = s.dir.path().join("inv.yaml");
    std::fs::write(&f, yaml_serde::to_string(&inv).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["fleet", "preflight", "--inventory"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("localhost: ok — 2 × NVIDIA H100 80GB HBM3")
    );
    std::fs::write(&f, yaml_serde::to_string(&inv4).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["fleet", "preflight", "--inventory"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr)
        .starts_with("error: host localhost: nvidia-smi reports 2 GPU(s)"));
    // Nothing listening: a clear connect error.
    let mut gone = inventory(&s, "user_key", 2);
    gone.hosts[0].port = free_port();
    let e = preflight(&Remote::new(&gone, &gone.hosts[0]), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot connect") && e.contains("port:"), "{e}");
    // The sessions this test opened in-process (one per destination) end with it.
    cacheroute::fleet::ssh::close_all();
}

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
/// Workload, policies, ladder and timing of the two-step live studies below.
const STUDY_BODY: &str = include_str!("data/two-step-study.yaml");

fn emulator_fleet_files(s: &Sshd, engine: &str) -> (std::path::PathBuf, std::path::PathBuf, u16) {
    let mut inv = inventory(s, "user_key", 2);
    // Two consecutive free ports for the two replicas.
    let base = loop {
        let p = free_port();
        if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break p;
        }
    };
    inv.base_port = base;
    let inv_path = s.dir.path().join("fleet-inv.yaml");
    std::fs::write(&inv_path, yaml_serde::to_string(&inv).unwrap()).unwrap();
    let (model, gpu, prec, tp) = {
        let p: Vec<&str> = engine.split(':').collect();
        (p[0], p[1], p[2], p[3].trim_start_matches("tp"))
    };
    let spec = format!(
        "name: fleet-test\nfleet: {{ engine: emulator, model: {model}, gpu: {gpu}, precision: {prec}, tp: {tp}, replicas: 2, inventory: {} }}\n\
policies: [ {{policy: flat-lb}} ]\nladder: [1]\nslos: [ {{metric: e2e, p99_s: 1}} ]\n",
        inv_path.display()
    );
    let spec_path = s.dir.path().join("fleet-spec.yaml");
    std::fs::write(&spec_path, spec).unwrap();
    (inv_path, spec_path, base)
}

/// `cacheroute fleet down` from a fresh controller: it succeeds and leaves no replica behind.
/// Returns what it printed.
fn fleet_down(inv: &std::path::Path, base: u16) -> String {
    let o = Command::new(BIN)
        .args(["fleet", "down", "--inventory"])
        .arg(inv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(emulators_on(base), 0, "orphaned replicas after fleet down");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn emulators_on(base: u16) -> usize {
    (0..2)
        .map(|i| {
            let o = Command::new("pgrep")
                .args(["-f", &format!("emulate --listen 0.0.0.0:{}", base + i)])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).lines().count()
        })
        .sum()
}

#[test]
fn fleet_up_status_down_survive_a_killed_controller() {
    let s = start_sshd();
    let (inv, spec, base) = emulator_fleet_files(&s, "llama-3.1-8b:h100:fp8:tp1");
    // Start the fleet, and kill -9 the controller as soon as the replicas were launched.
    let mut ctl = Command::new(BIN)
        .args(["fleet", "up", "--ready-timeout", "60", "--inventory"])
        .arg(&inv)
        .arg("--experiment")
        .arg(&spec)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let scratch = s.dir.path().join("scratch");
    let t0 = std::time::Instant::now();
    while !(scratch.join("replica-0.pid").exists() && scratch.join("replica-1.pid").exists())
        && t0.elapsed().as_secs() < 60
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    ctl.kill().unwrap();
    let _ = ctl.wait();
    // The replicas outlive their controller (they run in their own sessions)…
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(emulators_on(base), 2, "both replicas should be running");
    let st = Command::new(BIN)
        .args(["fleet", "status", "--inventory"])
        .arg(&inv)
        .output()
        .unwrap();
    let st = String::from_utf8_lossy(&st.stdout);
    assert_eq!(st.matches("running").count(), 2, "{st}");
    // …and `fleet down` from a fresh controller leaves nothing behind.
    let down = fleet_down(&inv, base);
    assert!(down.contains("stopped 2 replica(s)"), "{down}");

    // A normal `fleet up` waits until both answer.
    let o = Command::new(BIN)
        .args(["fleet", "up", "--ready-timeout", "60", "--inventory"])
        .arg(&inv)
        .arg("--experiment")
        .arg(&spec)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).matches(" ready").count(),
        2
    );
    fleet_down(&inv, base);
}

#[test]
fn an_engine_that_never_becomes_healthy_is_named_and_cleaned_up() {
    let s = start_sshd_with(true);
    let (inv, spec, base) = emulator_fleet_files(&s, "llama-3.1-8b:h100:fp8:tp1");
    let o = Command::new(BIN)
        .args(["fleet", "up", "--ready-timeout", "5", "--inventory"])
        .arg(&inv)
        .arg("--experiment")
        .arg(&spec)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    // The provisioning events (info logs) come first; the cause is the error line.
    assert!(
        err.lines()
            .find(|l| l.starts_with("error:"))
            .is_some_and(|l| l.starts_with("error: host localhost: replica 0")),
        "{err}"
    );
    assert!(
        err.contains("replica started host=localhost replica=0")
            && err.contains("replica torn down host=localhost replica=0"),
        "{err}"
    );
    assert!(
        err.contains("did not become healthy")
            && err.contains("weights not found in /models/missing"),
        "{err}"
    );
    assert_eq!(emulators_on(base), 0);
    let st = Command::new(BIN)
        .args(["fleet", "status", "--inventory"])
        .arg(&inv)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&st.stdout).contains("no replica recorded"));
}

/// Write the two-step study `name` on the ssh backend with `fleet` and run it; returns the
/// spec file, the database, the report folder and the run's output.
fn run_ssh_study(s: &Sshd, name: &str, fleet: &str) -> (PathBuf, PathBuf, PathBuf, Output) {
    let f = s.dir.path().join(format!("{name}.yaml"));
    let spec = format!("name: {name}\nbackend: ssh\nfleet: {fleet}\n{STUDY_BODY}");
    std::fs::write(&f, spec).unwrap();
    let db = s.dir.path().join(format!("{name}.db"));
    let out = s.dir.path().join("reports");
    let o = Command::new(BIN)
        .arg("run")
        .arg(&f)
        .arg("--db")
        .arg(&db)
        .arg("--out")
        .arg(&out)
        .arg("--quiet")
        .output()
        .unwrap();
    (f, db, out, o)
}

#[test]
fn a_study_runs_on_the_ssh_backend_and_tears_the_fleet_down() {
    let s = start_sshd();
    let (inv, _, base) = emulator_fleet_files(&s, "llama-3.1-8b:h100:fp8:tp1");
    let (f, db, out, o) = run_ssh_study(
        &s,
        "ssh-tiny",
        &format!(
            "{{ engine: emulator, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: 2, inventory: {} }}",
            inv.display()
        ),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = std::fs::read_to_string(out.join("ssh-tiny.md")).unwrap();
    assert!(
        md.contains(
            "| policy | engine-counter served hit | mean GPU utilisation | energy per request |"
        ),
        "{md}"
    );
    assert!(md.contains("| cacheroute | "), "{md}");
    assert_eq!(
        emulators_on(base),
        0,
        "the fleet must be torn down after the study"
    );
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("ssh-tiny").unwrap();
    assert_eq!(study.steps.len(), 2);
    for step in &study.steps {
        assert!(step.metrics.requests > 20, "{:?}", step.metrics);
        assert_eq!(step.metrics.errors, 0);
    }
    let tel = st
        .load_telemetry(
            study.id,
            Some(cacheroute::telemetry::engine_api::CACHE_QUERY_TOKENS_DELTA),
        )
        .unwrap();
    assert_eq!(tel.len(), 4, "two engines, two steps");
    // The agent ran on the host over SSH during each step and its samples reached the store.
    let util = st.load_telemetry(study.id, Some("gpu_util_pct")).unwrap();
    assert!(
        util.iter().any(|s| s.value == 87.0) && util.iter().any(|s| s.value == 43.0),
        "GPU samples from the agent must be stored for both GPUs: {util:?}"
    );
    // Mean of the two GPUs' 87% and 43%, in every arm's row.
    // (nvidia-smi has no energy counter, so energy per request stays empty.)
    let rows = md.lines().filter(|l| l.ends_with("| 65% | — |")).count();
    assert_eq!(rows, 2, "{md}");
    // No secret in the database or the report: neither the private key nor its path's content.
    let key = std::fs::read_to_string(s.dir.path().join("user_key")).unwrap();
    let body = key.lines().nth(1).unwrap();
    let db_bytes = String::from_utf8_lossy(&std::fs::read(&db).unwrap()).into_owned();
    for (what, text) in [("database", &db_bytes), ("report", &md)] {
        assert!(
            !text.contains(body) && !text.contains("PRIVATE KEY"),
            "key material in the {what}"
        );
    }

    // The controller killed with SIGKILL in the middle of a step: the replicas (in their own
    // sessions on the host) outlive it, its local router and agent streams do not, and
    // `fleet down` from a new process leaves nothing.
    let spec = std::fs::read_to_string(&f)
        .unwrap()
        .replace("name: ssh-tiny", "name: ssh-kill")
        .replace("measure_s: 8", "measure_s: 60");
    let f2 = s.dir.path().join("ssh-kill.yaml");
    std::fs::write(&f2, spec).unwrap();
    let mut ctl = Command::new(BIN)
        .args(["run"])
        .arg(&f2)
        .arg("--db")
        .arg(s.dir.path().join("kill.db"))
        .arg("--out")
        .arg(&out)
        .arg("--quiet")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while emulators_on(base) < 2 {
        assert!(t0.elapsed().as_secs() < 60, "the fleet never came up");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Provisioning waits for both replicas to answer; then the step's router and agent start.
    let running = |pat: &str| {
        let o = Command::new("pgrep").args(["-f", pat]).output().unwrap();
        String::from_utf8_lossy(&o.stdout).lines().count()
    };
    while running("^cacheroute agent --interval-ms") == 0 {
        assert!(t0.elapsed().as_secs() < 90, "the step never started");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    ctl.kill().unwrap();
    let _ = ctl.wait();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        emulators_on(base),
        2,
        "replicas outlive the killed controller"
    );
    fleet_down(&inv, base);
    let t1 = std::time::Instant::now();
    // This checkout's routers only (other checkouts on the machine may be running theirs).
    let router = format!("^{BIN} route --config");
    while running("^cacheroute agent --interval-ms") + running(&router) > 0 {
        if t1.elapsed().as_secs() > 10 {
            let o = Command::new("pgrep")
                .args(["-af", &format!("^cacheroute agent|^{BIN} route --config")])
                .output()
                .unwrap();
            panic!(
                "left running after the controller died: {}",
                String::from_utf8_lossy(&o.stdout)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// `fleet preflight`, `status` and `down` on `inv`: each must fail in one line; the lines.
fn refused_by_every_fleet_command(inv: &Path) -> Vec<String> {
    ["preflight", "status", "down"]
        .iter()
        .map(|cmd| {
            let o = Command::new(BIN)
                .args(["fleet", cmd, "--inventory"])
                .arg(inv)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            assert!(!o.status.success(), "fleet {cmd}: {err}");
            assert_eq!(
                err.trim().lines().count(),
                1,
                "fleet {cmd}, one line: {err}"
            );
            err
        })
        .collect()
}

/// An inventory written to make ssh run a local command (`user: -oProxyCommand=…`) is refused
/// with the host and field named, by every fleet command, and the command never runs. No sshd
/// is needed: nothing may get as far as ssh.
#[test]
fn an_inventory_value_that_ssh_would_read_as_an_option_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pwned = dir.path().join("pwned");
    let cases = [
        // `#` ends the shell line, so what ssh appends (`@host`) does not change the file name.
        format!("user: \"-oProxyCommand=touch {} #\"", pwned.display()),
        format!("address: \"-oProxyCommand=touch {} #\"", pwned.display()),
        "address: \"host name\"".to_string(),
        "user: \"a\\tb\"".to_string(),
    ];
    for field in &cases {
        let inv = dir.path().join("evil.yaml");
        let address = if field.starts_with("address") {
            String::new()
        } else {
            "address: 127.0.0.1".into()
        };
        std::fs::write(
            &inv,
            format!(
                "name: evil\nhosts:\n  - name: gpu-3\n    {address}\n    {field}\n    gpus: {{count: 1, model: H100}}\n    engine: {{venv: /opt/v}}\n"
            ),
        )
        .unwrap();
        for err in refused_by_every_fleet_command(&inv) {
            assert!(err.contains("gpu-3"), "{field}: {err}");
            let name = field.split(':').next().unwrap();
            assert!(err.contains(&format!(".{name} ")), "{field}: {err}");
        }
        assert!(!pwned.exists(), "{field}: the injected command ran");
    }
}

/// An inventory `user:` that passes the shape check (no `-`, space or control character) but
/// is no user name — `a/b` made ssh fail with "cannot connect (No such file or directory)"
/// from its control socket path — is refused by every fleet command in one line naming the
/// inventory file, the host and the field. No sshd is needed: nothing may get as far as ssh.
#[test]
fn an_inventory_user_that_is_not_a_posix_user_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for user in ["a/b", "..", "x%r", "bob$(id)"] {
        let inv = dir.path().join("odd.yaml");
        std::fs::write(
            &inv,
            format!(
                "name: odd\nhosts:\n  - name: gpu-3\n    address: 127.0.0.1\n    user: \"{user}\"\n    gpus: {{count: 1, model: H100}}\n    engine: {{venv: /opt/v}}\n"
            ),
        )
        .unwrap();
        for err in refused_by_every_fleet_command(&inv) {
            assert!(
                err.contains(&format!(
                    "{}: hosts[0].user (host `gpu-3`): `{user}` is not a POSIX user name",
                    inv.display()
                )),
                "{user}: {err}"
            );
            assert!(
                err.contains("set the login name of the account on that host"),
                "{err}"
            );
        }
    }
}

/// Stands in for an SGLang install on the test host: `<venv>/bin/python` that accepts only
/// SGLang's launch command line as the study writes it (`-m sglang.launch_server`,
/// `--tp-size`, fp8 KV as `fp8_e4m3`, metrics and cache report on) and serves SGLang's API with
/// `cacheroute emulate --api sglang` on the asked port. Before the server is healthy it sends
/// it one long request — a straggler still running when the study's first flush arrives.
const SGLANG_SHIM: &str = r#"#!/bin/sh
[ "$1 $2" = "-m sglang.launch_server" ] || { echo "not an SGLang launch: $*" >&2; exit 2; }
shift 2
host=; port=; name=; tp=; kv=; metrics=; report=
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host=$2; shift;;
    --port) port=$2; shift;;
    --served-model-name) name=$2; shift;;
    --tp-size) tp=$2; shift;;
    --kv-cache-dtype) kv=$2; shift;;
    --model-path|--dtype|--max-total-tokens|--page-size|--max-running-requests|--chunked-prefill-size|--mem-fraction-static|--context-length|--quantization) shift;;
    --enable-metrics) metrics=1;;
    --enable-cache-report) report=1;;
    *) echo "sglang shim: unexpected argument $1" >&2; exit 2;;
  esac
  shift
done
[ "$tp" = 1 ] && [ "$kv" = fp8_e4m3 ] && [ -n "$metrics" ] && [ -n "$report" ] || { echo "sglang shim: bad command line (tp=$tp kv=$kv metrics=$metrics report=$report)" >&2; exit 2; }
cacheroute emulate --listen "$host:$port" --api sglang --engine llama-3.1-8b:h100:fp8:tp1 --model-name "$name" --block-tokens 64 --startup-s 1 &
emu=$!
until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" != 000 ]; do sleep 0.05; done
curl -s -o /dev/null -H 'content-type: application/json' -d "{\"model\":\"$name\",\"prompt\":\"straggler\",\"max_tokens\":2500}" "http://127.0.0.1:$port/v1/completions" &
wait $emu
"#;

/// The ssh backend with `fleet.engine: sglang`: the fleet starts from SGLang's command line,
/// provisioning waits out `/health`'s 503, every step starts with `/flush_cache` (the first
/// refused with 400 while the straggler runs, retried until accepted), the request counters
/// are read by SGLang's names, the report has the engine-counter served hit, and the fleet is
/// torn down.
#[test]
fn a_sglang_study_runs_on_the_ssh_backend_with_a_flush_per_step() {
    use std::os::unix::fs::PermissionsExt;
    let s = start_sshd();
    let venv = s.dir.path().join("sglang-venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    let py = venv.join("bin/python");
    std::fs::write(&py, SGLANG_SHIM).unwrap();
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (inv, _, base) = emulator_fleet_files(&s, "llama-3.1-8b:h100:fp8:tp1");
    let mut i = Inventory::parse(&std::fs::read_to_string(&inv).unwrap(), "inv").unwrap();
    i.hosts[0].engine = cacheroute::fleet::inventory::EngineRuntime::Venv(venv.clone());
    std::fs::write(&inv, yaml_serde::to_string(&i).unwrap()).unwrap();
    let (_, db, out, o) = run_ssh_study(
        &s,
        "ssh-sglang",
        &format!(
            "{{ engine: sglang, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: 2, inventory: {} }}",
            inv.display()
        ),
    );
    let scratch = s.dir.path().join("scratch");
    let log = |r: usize| {
        std::fs::read_to_string(scratch.join(format!("replica-{r}.log"))).unwrap_or_default()
    };
    assert!(
        o.status.success(),
        "{}\nreplica 0: {}",
        String::from_utf8_lossy(&o.stderr),
        log(0)
    );
    assert_eq!(emulators_on(base), 0, "the fleet must be torn down");
    for r in 0..2 {
        let text = log(r);
        let flushes: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("flush_cache"))
            .collect();
        // Replica 0 (flushed first) refused while its straggler ran, then accepted (replica
        // 1's straggler ended while the runner waited on replica 0); one accepted flush per
        // step on each.
        if r == 0 {
            assert!(
                flushes.first().is_some_and(
                    |l| l.starts_with("flush_cache: 400") && l.contains("#running-req: 1")
                ),
                "replica {r}: {text}"
            );
        }
        assert_eq!(
            flushes
                .iter()
                .filter(|l| l.starts_with("flush_cache: 200"))
                .count(),
            2,
            "replica {r}: {text}"
        );
    }
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("ssh-sglang").unwrap();
    assert_eq!(study.steps.len(), 2);
    for step in &study.steps {
        assert_eq!(step.metrics.errors, 0, "{:?}", step.metrics);
    }
    let (h, q) = common::study::engine_counter_deltas(&db, "ssh-sglang");
    assert_eq!((q.len(), h.len()), (4, 4), "two engines, two steps");
    assert!(q.iter().all(|&v| v > 0.0), "{q:?}");
    assert!(h.iter().sum::<f64>() > 0.0, "{h:?}");
    let md = std::fs::read_to_string(out.join("ssh-sglang.md")).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| cacheroute | ") && l.ends_with("| 65% | — |"))
        .unwrap_or_else(|| panic!("engine telemetry row for cacheroute:\n{md}"));
    let hit = row.split('|').nth(2).unwrap().trim();
    assert!(hit.ends_with('%') && hit != "0.0%", "{row}");
}
