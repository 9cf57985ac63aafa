//! Studies end to end through the binary: run, kill and resume, regenerate the report from the
//! database, compare two studies, and refuse bad input before touching anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

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

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Steps stored so far (0 when the database does not exist yet).
fn stored_steps(db: &Path) -> usize {
    if !db.exists() {
        return 0;
    }
    match cacheroute::store::BlockingStore::open(db).and_then(|st| st.load_study("tiny")) {
        Ok(study) => study.steps.len(),
        Err(_) => 0,
    }
}

/// Start `run SPEC` (one worker thread) and return once `n` steps are stored.
fn run_until_stored(spec: &Path, db: &Path, out: &Path, n: usize) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(BIN);
    // SAFETY: between fork and exec only `signal`, which is async-signal-safe. The study gets
    // SIGINT's default disposition, as under a terminal's Ctrl-C: run from a script's
    // background job (`cmd &` in a non-interactive shell) it would inherit SIGINT ignored, and
    // an ignored SIGINT stays ignored by design.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd
        .args([
            "run",
            s(spec),
            "--db",
            s(db),
            "--out",
            s(out),
            "--quiet",
            "--threads",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while stored_steps(db) < n && t0.elapsed().as_secs() < 600 {
        // A study that died (say, on a database error) would otherwise be waited on for the
        // full ten minutes and fail as "0 steps stored", its reason lost in an unread pipe.
        if let Some(status) = child.try_wait().unwrap() {
            if !status.success() {
                let mut err = String::new();
                use std::io::Read;
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                panic!("the study exited ({status}) before {n} steps were stored: {err}");
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

#[test]
fn killed_and_resumed_study_reports_exactly_what_an_uninterrupted_one_does() {
    let dir = tempfile::tempdir().unwrap();
    let (a_db, b_db) = (dir.path().join("a.db"), dir.path().join("b.db"));
    let (a_out, b_out) = (dir.path().join("a"), dir.path().join("b"));
    // Uninterrupted.
    let text = ok(&[
        "run",
        TINY,
        "--db",
        s(&a_db),
        "--out",
        s(&a_out),
        "--quiet",
        "--threads",
        "1",
    ]);
    assert!(text.contains("18 steps run"), "{text}");
    // Killed with SIGKILL once a few steps are stored, then resumed.
    let mut child = run_until_stored(Path::new(TINY), &b_db, &b_out, 3);
    child.kill().unwrap();
    let status = child.wait().unwrap();
    let partial = stored_steps(&b_db);
    assert!(
        !status.success(),
        "the run should have been killed, not finished"
    );
    assert!(
        (3..18).contains(&partial),
        "{partial} steps stored when killed"
    );
    // Without --resume the study is refused, and nothing changes.
    let o = run(&["run", TINY, "--db", s(&b_db), "--out", s(&b_out), "--quiet"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--resume"));
    let text = ok(&[
        "run",
        TINY,
        "--db",
        s(&b_db),
        "--out",
        s(&b_out),
        "--quiet",
        "--resume",
    ]);
    assert!(
        text.contains(&format!("{} already stored", partial)),
        "{text}"
    );
    assert_eq!(read(a_out.join("tiny.md")), read(b_out.join("tiny.md")));
    assert_eq!(read(a_out.join("tiny.json")), read(b_out.join("tiny.json")));
    // The report regenerates from the database alone, byte for byte.
    let c_out = dir.path().join("c");
    ok(&[
        "report",
        "--db",
        s(&b_db),
        "--study",
        "tiny",
        "--out",
        s(&c_out),
    ]);
    assert_eq!(read(a_out.join("tiny.md")), read(c_out.join("tiny.md")));
    for svg in [
        "capacity-slo1.svg",
        "p99-e2e.svg",
        "served-hit.svg",
        "imbalance.svg",
    ] {
        let t = String::from_utf8(read(c_out.join("tiny").join(svg))).unwrap();
        assert!(
            t.contains("<svg") && t.trim_end().ends_with("</svg>"),
            "{svg}"
        );
    }
    let md = String::from_utf8(read(a_out.join("tiny.md"))).unwrap();
    assert!(md.contains("## SLO capacity at e2e p99 ≤ 2 s"), "{md}");
    assert!(md.contains("CacheRoute keeps affinity hits"), "claim table");
    let json: serde_json::Value = serde_json::from_slice(&read(a_out.join("tiny.json"))).unwrap();
    let pols = json["policies"].as_array().expect("policies array");
    assert_eq!(pols.len(), 3);
    for p in pols {
        assert!(p["capacity_qps"][0]["mean"].is_number(), "{p}");
        assert!(p["served_kv_hit"]["mean"].is_number(), "{p}");
    }
    // Listing and comparing.
    let list = ok(&["report", "--db", s(&a_db)]);
    assert!(
        list.contains("tiny: 6 runs (6 complete), 18 steps"),
        "{list}"
    );
}

#[test]
fn bad_specs_fail_before_any_run_and_leave_the_database_alone() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    ok(&[
        "run",
        TINY,
        "--db",
        s(&db),
        "--out",
        s(&dir.path().join("o")),
        "--quiet",
        "--seeds",
        "1",
    ]);
    let before = read(db.clone());
    let base = std::fs::read_to_string(TINY).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (format!("{base}colour: blue\n"), "unknown field `colour`"),
        (base.replace("seeds: 2", "seeds: many"), "seeds"),
        (base.replace("ladder: [10, 20, 30]", "ladder: []"), "ladder"),
        (base.replace("p99_s: 2.0", "p99_s: 0"), "slos[0].p99_s"),
        (base.replace("replicas: 4", "replicas: 4.5"), "replicas"),
        (
            base.replace(
                "  generator:",
                "  trace: /nonexistent/trace.jsonl\n  generatorx:",
            ),
            "generatorx",
        ),
        // Numbers that would allocate until the machine gives out, and names that are not
        // file names, are refused at validation, naming the field.
        (
            base.replace("ladder: [10, 20, 30]", "ladder: [1e300]"),
            "ladder[0]",
        ),
        (
            base.replace("measure_s: 60", "measure_s: 1e15"),
            "measure_s",
        ),
        (
            base.replace("replicas: 4", "replicas: 4000000000"),
            "fleet.replicas",
        ),
        (base.replace("seeds: 2", "seeds: 4000000000"), "seeds"),
        (
            base.replace("count: 2000", "count: 4000000000"),
            "workload.generator.keys.count",
        ),
        (base.replace("name: tiny", "name: .."), "name"),
        // `refine`: a relative resolution strictly between 0 and 1.
        (
            format!("{base}refine: 0\n"),
            "refine: 0 is not a relative resolution",
        ),
        (format!("{base}refine: 1\n"), "refine: 1 is not"),
        (format!("{base}refine: -0.05\n"), "refine: -0.05 is not"),
        (format!("{base}refine: .nan\n"), "refine: NaN is not"),
        (format!("{base}refine: five percent\n"), "refine"),
        (base.replace("name: tiny", "name: my tiny study"), "name"),
        // `reference`: one of the study's policies, named with them.
        (
            format!("{base}reference: nginx\n"),
            "reference: `nginx` is not one of the study's policies (flat-lb, sticky, cacheroute)",
        ),
        // `router_replicas`: whole numbers 1 to 64, each refused value named by its place.
        (
            format!("{base}sweeps: [ {{param: router_replicas, values: [1, 0]}} ]\n"),
            "sweeps[0].values[1] (routers): 0 is outside the allowed range 1 ≤ value ≤ 64 (a whole number)",
        ),
        (
            format!("{base}sweeps: [ {{param: router_replicas, values: [65]}} ]\n"),
            "sweeps[0].values[0] (routers): 65 is outside the allowed range 1 ≤ value ≤ 64",
        ),
        (
            format!("{base}sweeps: [ {{param: q_cap, values: [4]}}, {{param: router_replicas, values: [2, 4, 1.5]}} ]\n"),
            "sweeps[1].values[2] (routers): 1.5 is outside the allowed range 1 ≤ value ≤ 64 (a whole number)",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("bad{i}.yaml"));
        std::fs::write(&f, text).unwrap();
        let out = dir.path().join(format!("out{i}"));
        let o = run_capped(&["run", s(&f), "--db", s(&db), "--out", s(&out), "--quiet"]);
        assert!(!o.status.success(), "case {i} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.starts_with("error:") && err.contains(needle),
            "case {i}: {err}"
        );
        assert_eq!(read(db.clone()), before, "case {i} changed the database");
        assert!(!out.exists(), "case {i} wrote a report");
    }
    // An unreadable trace: refused before the database is opened.
    let f = dir.path().join("trace.yaml");
    let text = base.replace("name: tiny", "name: tiny-trace").replace(
        "  generator:",
        "  trace: /nonexistent/trace.jsonl\n  unused:",
    );
    let text = text.split("  unused:").next().unwrap().to_string()
        + "policies: [ {policy: flat-lb} ]\nladder: [10]\nseeds: 1\nslos: [ {metric: e2e, p99_s: 2.0} ]\n";
    std::fs::write(&f, text).unwrap();
    let o = run(&["run", s(&f), "--db", s(&db), "--quiet"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("/nonexistent/trace.jsonl"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(read(db.clone()), before);
}

#[test]
fn a_database_from_a_newer_schema_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("new.db");
    ok(&[
        "run",
        TINY,
        "--db",
        s(&db),
        "--out",
        s(&dir.path().join("o")),
        "--quiet",
        "--seeds",
        "1",
    ]);
    // Pretend a newer cacheroute migrated it.
    let st = Command::new("python3")
        .args([
            "-c",
            "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute(\"insert into _sqlx_migrations (version, description, installed_on, success, checksum, execution_time) values (99, 'future', '2030-01-01', 1, x'00', 0)\"); c.commit(); c.execute('pragma wal_checkpoint(truncate)'); c.close()",
            s(&db),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let before = read(db.clone());
    let o = run(&["run", TINY, "--db", s(&db), "--quiet", "--resume"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("schema version 99") && err.contains("newer cacheroute"),
        "{err}"
    );
    assert_eq!(read(db), before);
}

/// (The demo itself is run by tests/readme.rs, as the README's first command.)
#[test]
fn compare_two_studies() {
    let dir = tempfile::tempdir().unwrap();
    // Two studies in one database: the tiny one and a second seed-set of it under another name.
    let db = dir.path().join("c.db");
    ok(&[
        "run",
        TINY,
        "--db",
        s(&db),
        "--out",
        s(dir.path()),
        "--quiet",
        "--seeds",
        "1",
    ]);
    let other = dir.path().join("tiny2.yaml");
    std::fs::write(
        &other,
        std::fs::read_to_string(TINY)
            .unwrap()
            .replace("name: tiny", "name: tiny-big")
            .replace("replicas: 4", "replicas: 6"),
    )
    .unwrap();
    ok(&[
        "run",
        s(&other),
        "--db",
        s(&db),
        "--out",
        s(dir.path()),
        "--quiet",
        "--seeds",
        "1",
    ]);
    // Only presentation changed (the description): the stored study is reported with the new
    // text, no step reruns; an experiment change is refused.
    let restyled = dir.path().join("tiny-restyled.yaml");
    std::fs::write(
        &restyled,
        std::fs::read_to_string(TINY)
            .unwrap()
            .replace("a short ladder.", "a short ladder, restyled."),
    )
    .unwrap();
    let text = ok(&[
        "run",
        s(&restyled),
        "--db",
        s(&db),
        "--out",
        s(dir.path()),
        "--quiet",
        "--seeds",
        "1",
        "--resume",
    ]);
    assert!(text.contains("0 steps run"), "{text}");
    assert!(String::from_utf8(read(dir.path().join("tiny.md")))
        .unwrap()
        .contains("restyled"));
    let changed = dir.path().join("tiny-changed.yaml");
    std::fs::write(
        &changed,
        std::fs::read_to_string(TINY)
            .unwrap()
            .replace("ladder: [10, 20, 30]", "ladder: [10, 20, 40]"),
    )
    .unwrap();
    let o = run(&["run", s(&changed), "--db", s(&db), "--quiet", "--resume"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("different spec"));
    let cmp = ok(&["compare", "tiny", "tiny-big", "--db", s(&db)]);
    assert!(
        cmp.contains("tiny") && cmp.contains("tiny-big") && cmp.contains("cacheroute"),
        "{cmp}"
    );
}

/// calibrate reports each seed's knee on a fixed grid, so two ladders that bracket the same
/// knee give the same q_cap; a ladder with no knee inside says so and exits non-zero.
#[test]
fn calibrate_finds_the_same_knee_whatever_the_ladder() {
    let q_cap = |ladder: &str| -> (f64, String) {
        let out = ok(&["calibrate", TINY, "--ladder", ladder, "--seeds", "2"]);
        assert!(
            out.contains("seed 1: knee at ") && out.contains("seed 2: knee at "),
            "{out}"
        );
        let q: f64 = out
            .split("q_cap: ")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|x| x.trim().parse().ok())
            .expect("a q_cap");
        assert!(out.contains("warm_slots: "), "{out}");
        (q, out)
    };
    let (a, out_a) = q_cap("20,40,400");
    let (b, out_b) = q_cap("30,25,230");
    assert!(a > 20.0 && a < 400.0, "{out_a}");
    assert_eq!(a, b, "two ladders, two answers:\n{out_a}\n{out_b}");
    // The seeds' agreement is said either way.
    assert!(
        out_a.contains("the seeds agree") || out_a.contains("the seeds disagree"),
        "{out_a}"
    );

    // Every step passes: no knee, and the message says which way to move the ladder.
    let o = Command::new(BIN)
        .args([
            "calibrate",
            "--experiment",
            TINY,
            "--ladder",
            "0.1,0.1,0.2",
            "--seeds",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        out.contains("passes every step up to 0.2 req/s: raise --ladder"),
        "{out}"
    );
    assert!(
        err.contains("no q_cap: 1 of 1 seeds have no knee inside --ladder"),
        "{err}"
    );
}

#[test]
fn refine_locates_each_capacity_between_ladder_steps() {
    let dir = tempfile::tempdir().unwrap();
    let json = |out: &Path| -> serde_json::Value {
        serde_json::from_slice(&read(out.join("tiny.json"))).unwrap()
    };
    // One seed of `spec` into `db` and `out`, with `extra` arguments.
    let one_seed = |spec: &Path, db: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec!["run", s(spec), "--db", s(db), "--out", s(out), "--quiet"];
        args.extend(["--seeds", "1"]);
        args.extend_from_slice(extra);
        ok(&args)
    };
    // Flat-LB knees between 80 and 160 req/s; Sticky and CacheRoute pass every step.
    let ladder = ("ladder: [10, 20, 30]", "ladder: [40, 80, 160]");
    let plain = tiny_with(dir.path(), &[ladder]);
    let (db0, out0) = (dir.path().join("plain.db"), dir.path().join("plain"));
    one_seed(&plain, &db0, &out0, &[]);
    let spec = tiny_with(
        dir.path(),
        &[(ladder.0, "ladder: [40, 80, 160]\nrefine: 0.05")],
    );
    let (db, out) = (dir.path().join("r.db"), dir.path().join("r"));
    one_seed(&spec, &db, &out, &[]);
    let (a, b) = (json(&out0), json(&out));
    let policy = |r: &serde_json::Value, p: &str| {
        r["policies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["label"] == p)
            .unwrap()
            .clone()
    };
    let cap = |r: &serde_json::Value, p: &str| {
        let c = &policy(r, p)["capacity_qps"][0]["per_seed"][0];
        (
            c["qps"].as_f64().unwrap(),
            c["censored"].as_str().unwrap().to_string(),
        )
    };
    assert_eq!(cap(&a, "flat-lb"), (80.0, "none".into()));
    let (knee, censored) = cap(&b, "flat-lb");
    assert!(
        knee > 80.0 && knee < 160.0 && censored == "none",
        "{knee} {censored}"
    );
    // Within 5%: the lowest rate above the knee that was measured failed, and is at most 5%
    // above it.
    let store = cacheroute::store::BlockingStore::open(&db).unwrap();
    let steps = store.load_study("tiny").unwrap().steps;
    let flat: Vec<_> = steps.iter().filter(|s| s.run.policy == "flat-lb").collect();
    let above = flat
        .iter()
        .map(|s| s.metrics.offered_qps)
        .filter(|&q| q > knee)
        .fold(f64::INFINITY, f64::min);
    assert!(above / knee <= 1.05, "{knee} then {above}");
    let probes = flat.iter().filter(|s| s.step >= 1_000_000).count();
    assert!((1..=4).contains(&probes), "{probes} probes");
    // A censored capacity stays a bound: nothing to bisect.
    for p in ["sticky", "cacheroute"] {
        assert_eq!(cap(&b, p), (160.0, "right".into()), "{p}");
        assert!(steps
            .iter()
            .filter(|s| s.run.policy == p)
            .all(|s| s.step < 3));
    }
    // The probes count towards capacity only: the per-rate rows and the ladder's served hit
    // are the plain study's.
    for p in ["flat-lb", "sticky", "cacheroute"] {
        let (x, y) = (policy(&a, p), policy(&b, p));
        assert_eq!(x["steps"], y["steps"], "{p}");
        assert_eq!(x["served_kv_hit"], y["served_kv_hit"], "{p}");
    }
    // Resumed after it finished: nothing runs again, the same report.
    let text = one_seed(&spec, &db, &out, &["--resume"]);
    assert!(text.contains("0 steps run"), "{text}");
    assert_eq!(json(&out), b);
    let again = cacheroute::store::BlockingStore::open(&db)
        .unwrap()
        .load_study("tiny")
        .unwrap()
        .steps
        .len();
    assert_eq!(again, steps.len());
}

/// Run the binary under a memory cap and a time limit: a spec that makes it allocate without
/// bound must fail this test, not the machine.
fn run_capped(args: &[&str]) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4000000; exec \"$0\" \"$@\"")
        .arg(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cacheroute");
    let t0 = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed().as_secs() > 60 {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Run `python3 -c SQL-script db`: change a database the way another tool would.
fn sqlite(db: &Path, sql: &str) {
    let st = Command::new("python3")
        .args([
            "-c",
            "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.executescript(sys.argv[2]); c.commit(); c.execute('pragma wal_checkpoint(truncate)'); c.close()",
            s(db),
            sql,
        ])
        .status()
        .unwrap();
    assert!(st.success());
}

/// `dir/tiny.yaml`: the tiny study with each `(from, to)` replaced.
fn tiny_with(dir: &Path, edits: &[(&str, &str)]) -> PathBuf {
    let text = edits
        .iter()
        .fold(std::fs::read_to_string(TINY).unwrap(), |t, (a, b)| {
            t.replace(a, b)
        });
    let f = dir.join("tiny.yaml");
    std::fs::write(&f, text).unwrap();
    f
}

#[test]
fn a_resume_must_be_the_same_study() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    let out = dir.path().join("o");
    // A spec that says `backend: local`, begun on the simulator with --backend sim.
    let spec = tiny_with(
        dir.path(),
        &[
            ("backend: sim", "backend: local"),
            ("fleet: { model:", "fleet: { engine: emulator, model:"),
        ],
    );
    let o = run(&[
        "run",
        s(&spec),
        "--backend",
        "sim",
        "--db",
        s(&db),
        "--out",
        s(&out),
        "--quiet",
        "--threads",
        "1",
        "--stop-after",
        "2",
    ]);
    assert!(!o.status.success());
    assert_eq!(stored_steps(&db), 2);
    let before = read(db.clone());
    let refused = |args: &[&str], needles: &[&str]| {
        let o = run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} should fail");
        for n in needles {
            assert!(err.contains(n), "{args:?}: missing `{n}` in {err}");
        }
        assert_eq!(read(db.clone()), before, "{args:?} changed the database");
    };
    // Resumed without the override, i.e. on the spec's `local`.
    refused(
        &["run", s(&spec), "--db", s(&db), "--quiet", "--resume"],
        &["backend: begun on `sim`, now `local`", "--backend sim"],
    );
    // An edited experiment.
    let edited = dir.path().join("edited.yaml");
    std::fs::write(
        &edited,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("measure_s: 60", "measure_s: 90"),
    )
    .unwrap();
    refused(
        &[
            "run",
            s(&edited),
            "--backend",
            "sim",
            "--db",
            s(&db),
            "--quiet",
            "--resume",
        ],
        &["spec:", "`measure_s`", "different spec"],
    );
    // The same study resumes, and its report says where it ran.
    let text = ok(&[
        "run",
        s(&spec),
        "--backend",
        "sim",
        "--db",
        s(&db),
        "--out",
        s(&out),
        "--quiet",
        "--resume",
    ]);
    assert!(text.contains("2 already stored"), "{text}");
    let md = String::from_utf8(read(out.join("tiny.md"))).unwrap();
    assert!(md.contains("_backend Sim,"), "{md}");
    // Another version of cacheroute began it.
    sqlite(&db, "UPDATE studies SET software_version = '0.0.1'");
    let before = read(db.clone());
    let o = run(&[
        "run",
        s(&spec),
        "--backend",
        "sim",
        "--db",
        s(&db),
        "--quiet",
        "--resume",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("cacheroute version: begun with 0.0.1, this is"),
        "{err}"
    );
    assert_eq!(read(db.clone()), before);
}

#[test]
fn ctrl_c_stops_the_study_and_says_how_to_resume() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.db");
    let out = dir.path().join("o");
    // Longer steps, so the study is still running when interrupted.
    let spec = tiny_with(dir.path(), &[("measure_s: 60", "measure_s: 600")]);
    let child = run_until_stored(&spec, &db, &out, 1);
    assert!(Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("interrupted — rerun with --resume: ")
            && err.contains(&format!("run {} --db {}", s(&spec), s(&db)))
            && err.contains("--resume ("),
        "{err}"
    );
    let partial = stored_steps(&db);
    assert!((1..18).contains(&partial), "{partial}");
    // What is stored is whole steps: a resume goes on from them.
    let o = run(&[
        "run",
        s(&spec),
        "--db",
        s(&db),
        "--out",
        s(&out),
        "--quiet",
        "--threads",
        "1",
        "--stop-after",
        "1",
        "--resume",
    ]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("stopped after 1 of"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(stored_steps(&db), partial + 1);
}

/// Off a terminal (stderr piped, as in CI or a log file) a study prints a plain progress line
/// every CACHEROUTE_PROGRESS_S seconds instead of drawing bars; `--quiet` prints none.
#[test]
fn progress_off_a_terminal_is_plain_lines() {
    let dir = tempfile::tempdir().unwrap();
    let run_with = |quiet: bool| {
        let mut c = Command::new(BIN);
        c.args(["run", TINY, "--out", s(dir.path())])
            .arg("--db")
            .arg(dir.path().join(format!("p{quiet}.db")))
            .env("CACHEROUTE_PROGRESS_S", "0.05");
        if quiet {
            c.arg("--quiet");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let err = run_with(false);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("tiny: ") && l.contains(" steps ("))
        .collect();
    assert!(lines.len() >= 2, "{err}");
    assert!(
        !err.contains('\r') && !err.contains("\u{1b}["),
        "no bar drawing off a terminal: {err:?}"
    );
    let quiet = run_with(true);
    assert!(!quiet.contains(" steps ("), "{quiet}");
}
