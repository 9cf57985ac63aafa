//! `search: knee` end to end through the binary: the same knees as the fixed ladder for less
//! fleet time, steps cut early labelled as such, a killed search resumed to the same knees,
//! a stored study's knees used as the start, and bad settings refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tiny-study.yaml");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `dir/<file>`: the tiny study on a longer ladder (Flat-LB's knee inside it, the others'
/// too), two SLOs, `refine: 0.05`, with `extra` lines appended and its name replaced.
fn spec(dir: &Path, file: &str, name: &str, extra: &str) -> PathBuf {
    let text = std::fs::read_to_string(TINY)
        .unwrap()
        .replace("name: tiny", &format!("name: {name}"))
        .replace(
            "ladder: [10, 20, 30]",
            "ladder: [20, 40, 60, 80, 100, 120, 140, 160, 180, 200]\nrefine: 0.05",
        )
        .replace(
            "slos: [ {metric: e2e, p99_s: 2.0} ]",
            "slos: [ {metric: e2e, p99_s: 2.0}, {metric: ttft, p99_s: 0.5} ]",
        );
    let f = dir.join(file);
    std::fs::write(&f, format!("{text}{extra}")).unwrap();
    f
}

fn run_study(spec: &Path, db: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec!["run", s(spec), "--db", s(db), "--out", s(out), "--quiet"];
    args.extend_from_slice(extra);
    ok(&args)
}

fn report(out: &Path, name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join(format!("{name}.json"))).unwrap()).unwrap()
}

/// Per policy, per SLO, per seed: (capacity, censoring).
fn capacities(r: &serde_json::Value) -> Vec<(String, usize, u64, f64, String)> {
    let mut v = Vec::new();
    for p in r["policies"].as_array().unwrap() {
        for (i, c) in p["capacity_qps"].as_array().unwrap().iter().enumerate() {
            for x in c["per_seed"].as_array().unwrap() {
                v.push((
                    p["label"].as_str().unwrap().to_string(),
                    i,
                    x["seed"].as_u64().unwrap(),
                    x["qps"].as_f64().unwrap(),
                    x["censored"].as_str().unwrap().to_string(),
                ));
            }
        }
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

fn fleet_seconds(r: &serde_json::Value) -> f64 {
    r["cost"]["fleet_seconds"].as_f64().unwrap()
}

#[test]
fn the_knee_search_finds_the_fixed_ladder_s_knees_for_less_fleet_time() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = spec(dir.path(), "fixed.yaml", "fixed", "");
    let knee = spec(dir.path(), "knee.yaml", "knee", "search: knee\n");
    let (db_f, db_k) = (dir.path().join("f.db"), dir.path().join("k.db"));
    let out = dir.path().join("out");
    run_study(&fixed, &db_f, &out, &[]);
    run_study(&knee, &db_k, &out, &[]);
    let (f, k) = (report(&out, "fixed"), report(&out, "knee"));
    // Every knee inside the ladder, so the comparison means something.
    let caps = capacities(&f);
    assert!(
        caps.iter().filter(|c| c.4 == "none").count() >= caps.len() / 2,
        "{caps:?}"
    );
    assert_eq!(capacities(&k), caps, "the same knees, seed by seed");
    let (cf, ck) = (&f["cost"], &k["cost"]);
    assert!(
        fleet_seconds(&k) < 0.75 * fleet_seconds(&f),
        "knee {ck} fixed {cf}"
    );
    assert!(ck["steps"].as_u64() < cf["steps"].as_u64());
    assert_eq!(cf["cut"], 0, "a fixed ladder runs every step whole");
    assert!(ck["cut"].as_u64().unwrap() > 0, "{ck}");
    assert!(ck["prediction_fleet_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(cf["prediction_fleet_seconds"], 0.0);
    // The cost and the cut steps are in the report, labelled.
    let md = std::fs::read_to_string(out.join("knee.md")).unwrap();
    assert!(md.contains("## Cost"), "{md}");
    assert!(md.contains("Steps cut early"), "{md}");
    assert!(md.contains("cut early as certain to fail"), "{md}");
    // Each cut step's stored figures say it was cut, and for which SLOs.
    let store = cacheroute::store::BlockingStore::open(&db_k).unwrap();
    let steps = store.load_study("knee").unwrap().steps;
    let cut: Vec<_> = steps.iter().filter(|s| s.metrics.cut.is_some()).collect();
    assert!(!cut.is_empty());
    for c in cut {
        let k = c.metrics.cut.as_ref().unwrap();
        assert!(!k.fails.is_empty());
        // Inside the window, or in the drain after it (up to the horizon: 10 × the SLO or
        // 60 s after it).
        assert!(k.at_s > 20.0 && k.at_s < 20.0 + 60.0 + 60.0, "{k:?}");
        assert!(k.violations + k.errors > 0, "{k:?}");
    }
}

#[test]
fn a_killed_knee_search_resumes_to_the_same_knees() {
    let dir = tempfile::tempdir().unwrap();
    let knee = spec(dir.path(), "knee.yaml", "knee", "search: knee\n");
    let (a_db, b_db) = (dir.path().join("a.db"), dir.path().join("b.db"));
    let (a_out, b_out) = (dir.path().join("a"), dir.path().join("b"));
    run_study(&knee, &a_db, &a_out, &["--seeds", "1"]);
    // Stopped after 4 steps (the search's ladder steps, or its first probes), then resumed.
    let o = run(&[
        "run",
        s(&knee),
        "--db",
        s(&b_db),
        "--out",
        s(&b_out),
        "--quiet",
        "--seeds",
        "1",
        "--threads",
        "1",
        "--stop-after",
        "4",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--resume"), "{err}");
    let stored = cacheroute::store::BlockingStore::open(&b_db)
        .unwrap()
        .load_study("knee")
        .unwrap()
        .steps
        .len();
    assert_eq!(stored, 4);
    let text = run_study(&knee, &b_db, &b_out, &["--seeds", "1", "--resume"]);
    assert!(text.contains("4 already stored"), "{text}");
    let (a, b) = (report(&a_out, "knee"), report(&b_out, "knee"));
    assert_eq!(capacities(&a), capacities(&b));
    assert_eq!(a["cost"]["steps"], b["cost"]["steps"]);
    // Resumed once more: nothing left to run.
    let text = run_study(&knee, &b_db, &b_out, &["--seeds", "1", "--resume"]);
    assert!(text.contains("0 steps run"), "{text}");
}

/// A knee search beside a stored study of the same experiment starts at its knees: it
/// predicts nothing, and finds the same knees.
#[test]
fn a_stored_study_s_knees_are_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = spec(dir.path(), "fixed.yaml", "fixed", "");
    let knee = spec(dir.path(), "knee.yaml", "knee", "search: knee\n");
    let db = dir.path().join("r.db");
    let out = dir.path().join("out");
    run_study(&fixed, &db, &out, &["--seeds", "1"]);
    run_study(&knee, &db, &out, &["--seeds", "1"]);
    let (f, k) = (report(&out, "fixed"), report(&out, "knee"));
    assert_eq!(capacities(&k), capacities(&f));
    assert_eq!(k["cost"]["prediction_fleet_seconds"], 0.0, "{}", k["cost"]);
    let store = cacheroute::store::BlockingStore::open(&db).unwrap();
    let id = store.load_study("knee").unwrap().id;
    let starts = store.load_telemetry(id, Some("start_step")).unwrap();
    assert_eq!(starts.len(), 3);
    assert!(starts.iter().all(|t| t
        .labels
        .iter()
        .any(|(k, v)| k == "from" && v == "stored study")));
    // Another workload is another experiment: its knees are not used.
    let other = spec(dir.path(), "other.yaml", "other", "search: knee\n");
    let text = std::fs::read_to_string(&other)
        .unwrap()
        .replace("value: 200", "value: 300");
    std::fs::write(&other, text).unwrap();
    run_study(&other, &db, &out, &["--seeds", "1"]);
    let o = report(&out, "other");
    assert!(o["cost"]["prediction_fleet_seconds"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_search_settings_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    for (extra, field) in [
        ("search: bisect\n", "search"),
        ("search: 3\n", "search"),
        ("early_verdict: maybe\n", "early_verdict"),
    ] {
        let f = spec(dir.path(), "bad.yaml", "bad", extra);
        let o = run(&["run", s(&f), "--db", s(&db), "--out", s(dir.path())]);
        assert!(!o.status.success(), "{extra}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(field), "{extra}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra}: {err}");
        assert!(!db.exists(), "{extra}: the database was touched");
    }
}

/// A live step (emulators behind the router) certain to fail is cut: nothing more is sent,
/// what still runs is ended, and it is stored as cut with its wall time, shorter than a whole
/// step's.
#[test]
fn a_live_step_certain_to_fail_is_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    let spec_text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/local-tiny.yaml"
    ))
    .unwrap()
    .replace(
        "policies: [ {policy: flat-lb}, {policy: cacheroute} ]",
        "policies: [ {policy: flat-lb} ]",
    )
    .replace("ladder: [12]", "ladder: [12, 200]\nsearch: knee");
    let spec = dir.path().join("live.yaml");
    std::fs::write(&spec, spec_text).unwrap();
    let (db, out) = (dir.path().join("l.db"), dir.path().join("out"));
    run_study(&spec, &db, &out, &[]);
    let steps = cacheroute::store::BlockingStore::open(&db)
        .unwrap()
        .load_study("local-tiny")
        .unwrap()
        .steps;
    let at = |q: f64| steps.iter().find(|s| s.metrics.offered_qps == q).unwrap();
    let (light, heavy) = (at(12.0), at(200.0));
    assert!(light.metrics.cut.is_none(), "{:?}", light.metrics);
    let cut = heavy
        .metrics
        .cut
        .as_ref()
        .expect("the overloaded step is cut");
    // Cut inside its window (15 s warm-up, 45 s measured, model time), well before its end.
    assert!(cut.at_s > 15.0 && cut.at_s < 60.0, "{cut:?}");
    assert!(light.metrics.wall_s > 0.0 && heavy.metrics.wall_s > 0.0);
    assert!(
        heavy.metrics.wall_s < light.metrics.wall_s,
        "cut {} s, whole {} s",
        heavy.metrics.wall_s,
        light.metrics.wall_s
    );
    assert!(heavy.metrics.fleet_s > 0.0 && heavy.metrics.fleet_s < light.metrics.fleet_s);
    let r = report(&out, "local-tiny");
    assert!(r["cost"]["wall_s"].as_f64().unwrap() > 0.0, "{}", r["cost"]);
    let md = std::fs::read_to_string(out.join("local-tiny.md")).unwrap();
    assert!(
        md.contains("Steps cut early") && md.contains("of wall time"),
        "{md}"
    );
}
