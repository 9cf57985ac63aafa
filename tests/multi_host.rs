//! A fleet on hosts that are really apart: each host a network namespace with its own address,
//! link and `sshd` (tests/common/netns.rs), real vLLM (the CPU build, the tiny model) started on
//! them over SSH by `fleet up` and by `run --backend ssh`. A host's link is cut in the middle
//! of a step: its replica is excluded within one health interval, the step completes with the
//! loss in the database and the report, and the study goes on without it. The controller is
//! SIGKILLed in the middle of a study: `fleet down` from a new process leaves nothing in any
//! namespace. `scripts/test.sh` installs vLLM, the model and openssh-server first.
//!
//! `preflight_timing` (ignored by default) measures preflight of the flagship inventory's
//! layout (eight hosts) over one connection per command against one multiplexed session per
//! host, on namespace hosts; docs/fleets.md has the command and the figures.

mod common;

use common::netns::Hosts;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
/// Namespaces, links and addresses are machine-wide: the tests take turns.
static NETNS: Mutex<()> = Mutex::new(());

fn bin_dir() -> PathBuf {
    Path::new(BIN).parent().unwrap().to_path_buf()
}

/// An inventory of `hosts` (insecure host keys: throwaway test hosts), `gpus[i]` GPUs each.
fn inventory(hosts: &Hosts, gpus: &[u32], model: &str, engine: &str) -> String {
    let mut s =
        String::from("name: netns\nhost_key_checking: insecure-off\nbase_port: 8100\nhosts:\n");
    for (i, h) in hosts.hosts.iter().enumerate() {
        s.push_str(&format!(
            "  - {{ name: h{i}, address: {}, user: root, identity: {}, gpus: {{ count: {}, model: {model} }}, engine: {engine}, scratch: {} }}\n",
            h.address,
            hosts.user_key().display(),
            gpus[i],
            h.dir.join("scratch").display()
        ));
    }
    s
}

fn cacheroute(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run cacheroute")
}

/// vLLM processes in any host's namespace.
fn vllm_in(hosts: &Hosts) -> Vec<String> {
    let mut v = hosts.processes_matching("vllm.entrypoints");
    v.extend(hosts.processes_matching("VLLM::EngineCore"));
    v
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `fleet down` from a new process: it succeeds and no vLLM is left in any namespace.
fn fleet_down(hosts: &Hosts, inv: &Path) -> String {
    let o = cacheroute(&["fleet", "down", "--inventory", inv.to_str().unwrap()]);
    assert!(
        o.status.success(),
        "fleet down: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    wait_until(
        "no vLLM left in any namespace",
        Duration::from_secs(10),
        || vllm_in(hosts).is_empty(),
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The study: two real replicas (one per host), flat-lb then cacheroute, one step each of
/// `warmup_s` + `measure_s` seconds.
fn study(
    dir: &Path,
    name: &str,
    inv: &Path,
    ckpt: &Path,
    (warmup_s, measure_s): (u32, u32),
) -> PathBuf {
    let spec = format!(
        "name: {name}\nbackend: ssh\n\
fleet: {{ engine: vllm, model: tiny, gpu: cpu, precision: bf16, tp: 1, replicas: 2, inventory: {inv}, checkpoint: {ckpt}, knobs: {{ kv_cache_bytes: 12582912 }} }}\n\
local: {{ request_timeout_s: 10 }}\n\
workload:\n  generator:\n    keys: {{ count: 200, dist: {{ kind: lognormal, sigma: 0.3 }}, active: 16 }}\n    prefix: {{ block_size: 128, system_prompt: {{ dist: constant, value: 640 }}, conversations_per_key: 1, mean_turns: 1, user_message: {{ dist: constant, value: 40 }}, output: {{ dist: constant, value: 8 }} }}\n\
policies: [ {{policy: flat-lb}}, {{policy: cacheroute}} ]\nladder: [4]\nseeds: 1\nslos: [ {{metric: e2e, p99_s: 2.0}} ]\nwarmup_s: {warmup_s}\nmeasure_s: {measure_s}\n\
planner: {{ q_cap: 3, warm_slots: 8, interval_s: 10 }}\n",
        inv = inv.display(),
        ckpt = ckpt.display()
    );
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(&f, spec).unwrap();
    f
}

/// SIGKILLs a controller the test spawned if the test fails while it runs (disarmed once the
/// test has reaped it).
struct KillOnDrop(Option<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            // SAFETY: signalling our own, not yet reaped, child by its PID.
            unsafe {
                libc::kill(p as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// Routers started by this test's binary (not those of other checkouts on the machine).
fn routers_running() -> usize {
    let o = Command::new("pgrep")
        .args(["-f", &format!("^{BIN} route --config")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).lines().count()
}

/// Requests a host's vLLM has finished (`vllm:request_success_total`, every finish reason but
/// an abort: a client that gave up), read from its own /metrics; 0 when it cannot be read.
fn served_by(address: &str) -> f64 {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(
        &format!("{address}:8100").parse().unwrap(),
        Duration::from_secs(1),
    ) else {
        return 0.0;
    };
    // A busy 2-core machine can take seconds to answer /metrics; a short timeout would read a
    // cut body as "nothing served".
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .filter(|l| l.starts_with("vllm:request_success_total") && !l.contains("abort"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A step is under way: the agent runs on the hosts over SSH for exactly its length.
fn step_running(hosts: &Hosts) -> bool {
    !hosts.processes_matching("cacheroute agent").is_empty()
}

#[test]
fn real_vllm_on_two_namespace_hosts_survives_a_cut_link_and_a_killed_controller() {
    let (venv, ckpt) = common::require_vllm_install();
    let _g = NETNS.lock().unwrap_or_else(|e| e.into_inner());
    let hosts = Hosts::new("crmh", &[1, 1], "CPU", &bin_dir());
    let dir = hosts.dir.path().to_path_buf();
    let inv = dir.join("inv.yaml");
    std::fs::write(
        &inv,
        inventory(
            &hosts,
            &[1, 1],
            "CPU",
            &format!("{{ venv: {} }}", venv.display()),
        ),
    )
    .unwrap();
    let inv_s = inv.to_str().unwrap();

    // 1. `fleet up`: one real vLLM per host, each running in its host's namespace.
    let up_spec = study(&dir, "mh-up", &inv, &ckpt, (4, 10));
    let o = cacheroute(&[
        "fleet",
        "up",
        "--ready-timeout",
        "240",
        "--inventory",
        inv_s,
        "--experiment",
        up_spec.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "fleet up: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    for (i, h) in hosts.hosts.iter().enumerate() {
        assert!(
            out.contains(&format!("on h{i}: http://{}:8100 ready", h.address)),
            "{out}"
        );
        let here = common::netns::pids_in(&h.ns)
            .into_iter()
            .filter(|&p| common::netns::cmdline(p).contains("vllm.entrypoints.openai.api_server"))
            .count();
        assert_eq!(here, 1, "one vLLM server in {}", h.ns);
    }
    let st = cacheroute(&["fleet", "status", "--inventory", inv_s]);
    assert_eq!(
        String::from_utf8_lossy(&st.stdout)
            .matches("running")
            .count(),
        2
    );
    let down = fleet_down(&hosts, &inv);
    assert!(down.contains("stopped 2 replica(s)"), "{down}");

    // 2. A study over SSH; host 1's link is cut in the middle of the first step.
    // 30 s measured: the cut waits for host 1's own counter, which a slow machine reaches late
    // in the window; the requests scheduled 3 s after it must still be many. No warm-up: the
    // stored records are the measured window's, and every request host 1's counter shows it
    // finished must be among them (with a warm-up, a slow host 1 finished only warm-up
    // requests before the cut, and the records showed it serving none).
    let spec = study(&dir, "mh-cut", &inv, &ckpt, (0, 30));
    let db = dir.join("cut.db");
    let reports = dir.join("reports");
    let ctl = Command::new(BIN)
        .arg("run")
        .arg(&spec)
        .arg("--db")
        .arg(&db)
        .arg("--out")
        .arg(&reports)
        .args(["--quiet", "--store-requests"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut guard = KillOnDrop(Some(ctl.id()));
    wait_until("the first step", Duration::from_secs(300), || {
        step_running(&hosts)
    });
    let router_seen = Instant::now();
    // Cut once host 1's vLLM has itself finished 3 requests and 8 s have passed: its own
    // counter proves it was serving (a slow machine's late load start or slow first request
    // cannot cut it before it served anything), and the clock puts the cut early in the 30 s
    // window, so the requests scheduled 3 s after it are many however slowly host 1 serves.
    // What was read is kept for the failure messages below.
    let base = served_by(&hosts.hosts[1].address);
    let mut seen: Vec<(f64, f64)> = Vec::new();
    wait_until(
        "host 1 serving in the measured window",
        Duration::from_secs(60),
        || {
            let n = served_by(&hosts.hosts[1].address);
            let t = router_seen.elapsed().as_secs_f64();
            if seen.last().is_none_or(|&(_, m)| m != n) {
                seen.push(((t * 10.0).round() / 10.0, n));
            }
            n >= base + 3.0 && t >= 8.0
        },
    );
    assert!(
        step_running(&hosts),
        "the first step ended before the cut: host 1 served (s, total) {seen:?} from {base}"
    );
    hosts.cut(1);
    let cut_after_s = router_seen.elapsed().as_secs_f64();
    let o = ctl.wait_with_output().unwrap();
    guard.0 = None;
    let err = String::from_utf8_lossy(&o.stderr);
    // The fleet is torn down at the end: host 0 cleanly; host 1 cannot be reached, which the
    // teardown says (and `fleet down` later cleans).
    assert!(o.status.success(), "the study must go on: {err}");
    assert!(
        err.contains("tearing down the fleet") && err.contains("host h1"),
        "{err}"
    );
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let s = st.load_study("mh-cut").unwrap();
    assert_eq!(s.steps.len(), 2, "both steps ran");
    let lost = st
        .load_telemetry(s.id, Some(cacheroute::experiment::local::REPLICA_LOST))
        .unwrap();
    assert!(
        lost.iter()
            .any(|t| t.source == "engine:1" && t.at_s > 0.0 && t.step == Some(0)),
        "lost during the first step: {lost:?} (cut {cut_after_s:.1} s after the agent appeared; host 1 served (s, total) {seen:?} from {base})"
    );
    assert!(
        lost.iter().any(|t| t.source == "engine:1"
            && t.at_s == 0.0
            && t.step == Some(0)
            && t.run != lost[0].run),
        "unreachable for the second run's step: {lost:?} (cut {cut_after_s:.1} s after the agent appeared; host 1 served (s, total) {seen:?} from {base})"
    );
    assert!(lost.iter().all(|t| t.source == "engine:1"), "{lost:?}");
    // Excluded within one health interval: every request scheduled 3 s after the cut (0.5 s
    // interval + 1 s probe timeout + margin) was served, by replica 0.
    let first_run = s.runs.iter().find(|r| r.key.policy == "flat-lb").unwrap();
    let rows = common::study::request_records(&st, first_run.id, 0);
    let late: Vec<_> = rows
        .iter()
        .filter(|r| r.scheduled_s > cut_after_s + 3.0)
        .collect();
    let last = rows.iter().map(|r| r.scheduled_s).fold(0.0, f64::max);
    assert!(
        late.len() > 5,
        "requests after the cut: {} (cut {cut_after_s:.1} s after the agent appeared; the last request scheduled at {last:.1} s; host 1 served (s, total) {seen:?})",
        late.len()
    );
    for r in &late {
        assert!(
            r.status.is_ok() && r.destination == Some(0),
            "after the cut: {r:?}"
        );
    }
    // Before the cut both hosts served.
    let to_host1: Vec<_> = rows
        .iter()
        .filter(|r| r.destination == Some(1))
        .map(|r| {
            (
                (r.scheduled_s * 10.0).round() / 10.0,
                (r.e2e_s() * 10.0).round() / 10.0,
                r.status,
            )
        })
        .collect();
    assert!(
        rows.iter()
            .any(|r| r.destination == Some(1) && r.status.is_ok()),
        "host 1 served none of the first step's requests: (scheduled s, e2e s, status) {to_host1:?} (cut {cut_after_s:.1} s after the agent appeared; host 1 served (s, total) {seen:?} from {base})"
    );
    // The second step ran on the remaining host.
    let second = s
        .runs
        .iter()
        .find(|r| r.key.policy == "cacheroute")
        .unwrap();
    let rows2 = common::study::request_records(&st, second.id, 0);
    let ok2 = rows2.iter().filter(|r| r.status.is_ok()).count();
    assert!(
        ok2 * 10 >= rows2.len() * 9 && ok2 > 20,
        "second step: {ok2} of {} ok",
        rows2.len()
    );
    let md = std::fs::read_to_string(reports.join("mh-cut.md")).unwrap();
    assert!(
        md.contains("Lost replicas") && md.contains("flat-lb: replica 1 lost during step 0"),
        "{md}"
    );
    // Host 0 is clean; host 1's replica is still there, out of reach.
    assert!(hosts
        .processes_matching("vllm.entrypoints")
        .iter()
        .all(|p| p.starts_with("crmh1")));
    hosts.restore(1);
    fleet_down(&hosts, &inv);

    // 3. The controller SIGKILLed in the middle of a study: nothing is left anywhere after
    // `fleet down` from a new process.
    let spec = study(&dir, "mh-kill", &inv, &ckpt, (4, 60));
    let mut ctl = Command::new(BIN)
        .arg("run")
        .arg(&spec)
        .arg("--db")
        .arg(dir.join("kill.db"))
        .arg("--out")
        .arg(&reports)
        .arg("--quiet")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = KillOnDrop(Some(ctl.id()));
    wait_until("the study's first step", Duration::from_secs(300), || {
        step_running(&hosts) && routers_running() > 0
    });
    std::thread::sleep(Duration::from_secs(3));
    ctl.kill().unwrap();
    let _ = ctl.wait();
    guard.0 = None;
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        hosts
            .processes_matching("vllm.entrypoints.openai.api_server")
            .len(),
        2,
        "the replicas outlive the killed controller"
    );
    fleet_down(&hosts, &inv);
    let t0 = Instant::now();
    loop {
        let agents = hosts.processes_matching("cacheroute agent");
        let routers = routers_running();
        let masters: usize = hosts.hosts.iter().map(|h| masters_to(&h.address)).sum();
        if agents.is_empty() && routers == 0 && masters == 0 {
            break;
        }
        assert!(
            t0.elapsed() < cacheroute::fleet::ssh::MASTER_IDLE_EXIT + Duration::from_secs(15),
            "left after the killed controller: agents {agents:?}, {routers} router(s), {masters} ssh master connection(s)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `ssh` master processes (multiplexed sessions) connected to `address`.
fn masters_to(address: &str) -> usize {
    let o = Command::new("pgrep")
        .args(["-f", &format!("ssh .*-M -f -N .* {address}$")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).lines().count()
}

/// Preflight of the flagship inventory's layout (seven 8-GPU hosts and one 4-GPU host, the
/// flagship's 30 TP-2 replicas' ports) on eight namespace hosts: one `ssh` connection per
/// command against one multiplexed session per host. Prints both; asserts only that both
/// pass. Run with
/// `cargo test --test multi_host -- --ignored --nocapture preflight_timing` (the figures are
/// ssh's, not the build profile's).
#[test]
#[ignore]
fn preflight_timing() {
    use cacheroute::fleet::inventory::{place, Inventory};
    use cacheroute::fleet::ssh::{close_all, preflight, Remote, Transport};
    let _g = NETNS.lock().unwrap_or_else(|e| e.into_inner());
    let gpus = [8, 8, 8, 8, 8, 8, 8, 4];
    let model = "NVIDIA H100 80GB HBM3";
    let hosts = Hosts::new("crpf", &gpus, model, &bin_dir());
    let text = inventory(
        &hosts,
        &gpus,
        &format!("'{model}'"),
        "{ venv: /opt/vllm/.venv }",
    );
    let inv = Inventory::parse(&text, "netns").unwrap();
    let placements = place(&inv, 30, 2).unwrap();
    let ports = |i: usize| -> Vec<u16> {
        placements
            .iter()
            .filter(|p| p.host == i)
            .map(|p| p.port)
            .collect()
    };
    let pass = |t: Transport| -> f64 {
        let t0 = Instant::now();
        for (i, h) in inv.hosts.iter().enumerate() {
            let r = Remote::new(&inv, h).with_transport(t);
            preflight(&r, &ports(i)).unwrap();
        }
        let s = t0.elapsed().as_secs_f64();
        close_all();
        s
    };
    // One warm-up of each, then the median of five.
    pass(Transport::PerCall);
    pass(Transport::Mux);
    let median = |t: Transport| {
        let mut v: Vec<f64> = (0..5).map(|_| pass(t)).collect();
        v.sort_by(f64::total_cmp);
        v[2]
    };
    let per_call = median(Transport::PerCall);
    let mux = median(Transport::Mux);
    println!(
        "preflight, 8 hosts (flagship layout, 30 TP-2 replicas' ports), median of 5:\n  one connection per command: {:.0} ms\n  one multiplexed session per host: {:.0} ms ({:.1}× faster)",
        per_call * 1000.0,
        mux * 1000.0,
        per_call / mux
    );
}
