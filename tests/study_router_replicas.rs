//! Several router replicas per policy in a local study (`sweeps: [{param: router_replicas}]`):
//! real emulators, real `cacheroute route` replicas sharing CacheRoute's plan through a real
//! etcd the study starts, real SMG instances, and the round-robin front before them, over
//! loopback. What each router's own counters said is stored as telemetry and reported.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Three emulators, one short step, 1 and 2 router replicas; `{policies}` filled in.
const SPEC: &str = "name: routers-tiny
backend: local
local: { time_scale: 2 }
fleet: { engine: emulator, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: 3,
         knobs: { kv_cache_bytes: 4.0e9 } }
workload:
  generator:
    keys: { count: 500, dist: { kind: lognormal, sigma: 1.648 }, active: 16 }
    prefix: { block_size: 64, system_prompt: { dist: constant, value: 1000 }, conversations_per_key: 2,
              user_message: { dist: constant, value: 100 }, output: { dist: constant, value: 8 } }
policies: {policies}
sweeps: [ {param: router_replicas, values: [1, 2]} ]
ladder: [6]
seeds: 1
slos: [ {metric: e2e, p99_s: 2} ]
warmup_s: 6
measure_s: 12
planner: { q_cap: 4, interval_s: 2 }
";

/// Whether SMG is installed, installing it if it can (cached after the first time).
fn smg_installed() -> bool {
    let o = Command::new("bash")
        .arg(Path::new(ROOT).join("scripts/install-peers.sh"))
        .arg("smg")
        .output()
        .expect("run install-peers.sh");
    o.status.success()
}

/// `cacheroute run` of `text` with its database (`r.db`, requests stored) and report (`out/`)
/// in `dir`, with `path` as PATH when given.
fn run_study(dir: &Path, text: &str, path: Option<&Path>) -> std::process::Output {
    let spec = dir.join("routers-tiny.yaml");
    std::fs::write(&spec, text).unwrap();
    let mut cmd = Command::new(BIN);
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    cmd.args(["run", "--quiet", "--store-requests", "--db"])
        .arg(dir.join("r.db"))
        .arg("--out")
        .arg(dir.join("out"))
        .arg(&spec)
        .output()
        .unwrap()
}

/// Telemetry rows of `metric`: (policy [sweep], source) → value, summed over steps.
fn rows(db: &Path, metric: &str) -> BTreeMap<(String, String), f64> {
    let st = cacheroute::store::BlockingStore::open(db).unwrap();
    let s = st.load_study("routers-tiny").unwrap();
    let mut out = BTreeMap::new();
    for t in st.load_telemetry(s.id, Some(metric)).unwrap() {
        let run = s.runs.iter().find(|r| Some(r.id) == t.run).unwrap();
        let k = (
            format!("{} [{}]", run.key.policy, run.key.sweep),
            t.source.clone(),
        );
        *out.entry(k).or_insert(0.0) += t.value;
    }
    out
}

fn get(m: &BTreeMap<(String, String), f64>, policy: &str, source: &str) -> Option<f64> {
    m.get(&(policy.to_string(), source.to_string())).copied()
}

#[test]
fn router_replicas_share_one_plan_through_etcd_behind_a_round_robin_front() {
    let smg = smg_installed();
    if !smg {
        eprintln!(
            "\n*** SKIPPING the SMG half: `bash scripts/install-peers.sh smg` failed (offline?); only CacheRoute's replicas are tested ***\n"
        );
    }
    let policies = if smg {
        "[ {policy: cacheroute}, {router: smg, policy: cache_aware} ]"
    } else {
        "[ {policy: cacheroute} ]"
    };
    let dir = tempfile::tempdir().unwrap();
    let o = run_study(dir.path(), &SPEC.replace("{policies}", policies), None);
    let db = dir.path().join("r.db");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "study failed: {err}");

    let sent = rows(&db, "router:sent_by_front");
    let requests = rows(&db, "router:requests");
    let generation = rows(&db, "router:plan_generation");
    let leader = rows(&db, "router:plan_store_leader");
    let written = rows(&db, "router:plans_written");
    let cr1 = "cacheroute [routers=1]";
    let cr2 = "cacheroute [routers=2]";
    // One router, no front, no etcd: its own plan (generation 0: none shared).
    assert!(
        get(&requests, cr1, "router:0").unwrap() > 10.0,
        "{requests:?}"
    );
    assert_eq!(get(&requests, cr1, "router:front"), None, "{requests:?}");
    assert_eq!(get(&generation, cr1, "router:0"), Some(0.0));
    // Two replicas behind the front: the front sent each about half, and each served them.
    let front = get(&requests, cr2, "router:front").unwrap();
    let (a, b) = (
        get(&requests, cr2, "router:0").unwrap(),
        get(&requests, cr2, "router:1").unwrap(),
    );
    assert!(a > 10.0 && b > 10.0, "both replicas served: {a} {b}");
    assert!(
        a.min(b) >= 0.4 * (a + b) && a + b >= front,
        "round robin: {a} {b} of {front}"
    );
    let sent0 = get(&sent, cr2, "router:0").unwrap();
    assert!(sent0 > 10.0 && sent0 <= a, "{sent:?}");
    // One plan from etcd: one leader wrote it, both installed it (the follower one it never
    // wrote), the same generation or one behind at the step's end.
    let (ga, gb) = (
        get(&generation, cr2, "router:0").unwrap(),
        get(&generation, cr2, "router:1").unwrap(),
    );
    assert!(
        ga >= 1.0 && gb >= 1.0 && (ga - gb).abs() <= 1.0,
        "{ga} {gb}"
    );
    let leaders = get(&leader, cr2, "router:0").unwrap() + get(&leader, cr2, "router:1").unwrap();
    assert_eq!(leaders, 1.0, "{leader:?}");
    let follower = if get(&leader, cr2, "router:0") == Some(1.0) {
        "router:1"
    } else {
        "router:0"
    };
    assert_eq!(get(&written, cr2, follower), Some(0.0), "{written:?}");
    // The replayer saw the engine that served each request (the front keeps the replica's
    // destination header): engine 2 exists, a third router replica does not.
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("routers-tiny").unwrap();
    let run = study
        .runs
        .iter()
        .find(|r| r.key.policy == "cacheroute" && r.key.sweep == "routers=2")
        .unwrap();
    let dests: std::collections::BTreeSet<Option<i32>> = st
        .load_requests(run.id, 0)
        .unwrap()
        .iter()
        .map(|r| r.record.destination)
        .collect();
    assert!(dests.contains(&Some(2)), "{dests:?}");
    // The report's router table, with the verdict.
    let md = std::fs::read_to_string(dir.path().join("out/routers-tiny.md")).unwrap();
    assert!(md.contains("Routers' own counters"), "{md}");
    assert!(
        md.contains("| cacheroute [routers=2] | front |")
            && md.contains("| cacheroute [routers=2] | 1 |"),
        "{md}"
    );
    if smg {
        // Two SMG instances, each with every engine, behind the same front.
        let s2 = "smg:cache_aware [routers=2]";
        let (a, b) = (
            get(&sent, s2, "router:0").unwrap(),
            get(&sent, s2, "router:1").unwrap(),
        );
        assert!(a > 10.0 && a.min(b) >= 0.4 * (a + b), "{sent:?}");
        assert!(get(&requests, s2, "router:front").unwrap() >= a + b);
        assert_eq!(get(&sent, "smg:cache_aware [routers=1]", "router:0"), None);
        assert!(md.contains("| smg:cache_aware [routers=2] | 1 |"), "{md}");
        // SMG's two gateways ran with its mesh (one gateway alone without it).
        let st = cacheroute::store::BlockingStore::open(&db).unwrap();
        let study = st.load_study("routers-tiny").unwrap();
        let commands: BTreeMap<String, String> = st
            .load_telemetry(study.id, Some("external_router"))
            .unwrap()
            .iter()
            .map(|t| {
                let run = study.runs.iter().find(|r| Some(r.id) == t.run).unwrap();
                let cmd = t.labels.iter().find(|(k, _)| k == "command").unwrap();
                (run.key.sweep.clone(), cmd.1.clone())
            })
            .collect();
        assert!(
            commands["routers=2"].contains("--enable-mesh --mesh-server-name gateway-0"),
            "{commands:?}"
        );
        assert!(
            !commands["routers=1"].contains("--enable-mesh"),
            "{commands:?}"
        );
    }
    // The etcd the study started is gone with its step (its data directory with it).
    let o = Command::new("pgrep")
        .args(["-af", "etcd-data"])
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let data = line
            .split_whitespace()
            .find(|w| w.ends_with("/etcd-data"))
            .unwrap_or("");
        assert!(
            data.is_empty() || Path::new(data).exists(),
            "an etcd outlived its step: {line}"
        );
    }
}

#[test]
fn without_etcd_cacheroute_s_replicas_are_refused_saying_how_to_install_it() {
    let dir = tempfile::tempdir().unwrap();
    let text = SPEC
        .replace("{policies}", "[ {policy: cacheroute} ]")
        .replace("values: [1, 2]", "values: [2]");
    // A PATH without etcd (the study starts everything else by its own path).
    let o = run_study(dir.path(), &text, Some(dir.path()));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("no `etcd` is on PATH") && err.contains("apt-get install etcd-server"),
        "{err}"
    );
}
