//! The `local` backend end to end: emulators and the router as child processes on 127.0.0.1,
//! the replayer through real HTTP. The same study on `sim` and on `local` agrees per policy,
//! and a destination killed mid-step fails over while the study completes.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
/// Workload, policies, ladder and timing of the two-step live studies below.
const STUDY_BODY: &str = include_str!("data/two-step-study.yaml");
const SPEC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/local-tiny.yaml");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn ok(args: &[&str]) {
    let o = run(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `cacheroute run SPEC --quiet` with its database (`s.db`) and report (`out/`) in `dir`.
fn run_quiet(spec: &Path, dir: &Path) {
    let d = |x: &str| dir.join(x).display().to_string();
    ok(&[
        "run",
        spec.to_str().unwrap(),
        "--db",
        &d("s.db"),
        "--out",
        &d("out"),
        "--quiet",
    ]);
}

/// Run the live study `name` (`local: { LOCAL }`, `replicas` emulated Llama-3.1-8B replicas,
/// then `body`) into `dir` as [`run_quiet`] does, and check that no child is left.
fn run_emulated(dir: &Path, name: &str, local: &str, replicas: usize, body: &str) {
    let spec = format!(
        "name: {name}\nbackend: local\nlocal: {{ {local} }}\n\
         fleet: {{ engine: emulator, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: {replicas} }}\n\
         {body}"
    );
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(&f, spec).unwrap();
    run_quiet(&f, dir);
    no_children_left();
}

fn summary(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Every engine and router the runner started is gone once it returned. Only this build's
/// binary counts: other checkouts on the machine may be running studies of their own.
fn no_children_left() {
    for _ in 0..50 {
        let o = Command::new("pgrep")
            .args(["-af", "exit-with-parent"])
            .output()
            .expect("pgrep");
        let out = String::from_utf8_lossy(&o.stdout);
        if !out.lines().any(|l| l.contains(BIN)) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("child processes of the study runner are still running");
}

/// The tests here look for the runner's children by name: one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// End-to-end latencies (s) of the `ok` requests of `policy`'s one step in `db`, sorted.
fn e2e_latencies(db: &Path, policy: &str) -> Vec<f64> {
    let st = cacheroute::store::BlockingStore::open(db).unwrap();
    let study = st.load_study("local-tiny").unwrap();
    let run = study.runs.iter().find(|r| r.key.policy == policy).unwrap();
    let mut v: Vec<f64> = common::study::request_records(&st, run.id, 0)
        .into_iter()
        .filter(|r| r.status.is_ok())
        .filter_map(|r| r.finish_s.map(|f| f - r.scheduled_s))
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Whether local latencies agree with simulated ones: the median within 25% and the p90
/// (nearest rank) within 50%. Not the p99: a step holds about 520 measured requests, so its
/// p99 is set by the five slowest, which on a shared 2-core host are scheduling stalls of the
/// emulators (doubled by the time scale), not the queueing the engine model predicts. The p90
/// rests on about 50 requests and still sees queueing (flat-lb's p90 is 35% above
/// CacheRoute's here), but it also carries the host's own cost: the router, the replayer and
/// the emulators are debug builds sharing two cores. On a quiet 2-core host, fresh clones put
/// the local p90 32-48% above the simulated one in some runs (flat-lb 0.306 and 0.325 s
/// against 0.231 s; CacheRoute 0.243 and 0.253 s against 0.171 s) while the median agreed
/// within 25%; queueing the model does not predict moves the p90 far more than that (the
/// test below).
fn latencies_agree(sim: &[f64], local: &[f64]) -> Result<(), String> {
    let q = |v: &[f64], p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    if sim.len() < 100 || local.len() < 100 {
        return Err(format!(
            "too few requests to compare ({} simulated, {} local)",
            sim.len(),
            local.len()
        ));
    }
    for (name, p, within) in [("p50", 0.5, 0.25), ("p90", 0.9, 0.5)] {
        let (s, l) = (q(sim, p), q(local, p));
        if (l - s).abs() > within * s {
            return Err(format!(
                "e2e {name} sim {s:.3} s, local {l:.3} s (more than {:.0}% apart)",
                within * 100.0
            ));
        }
    }
    Ok(())
}

#[test]
fn the_latency_agreement_check_fails_when_sim_and_local_differ() {
    // A simulated step: 520 requests between 0.16 and 0.18 s, the slowest 5% up to 0.3 s.
    let sim: Vec<f64> = (0..520)
        .map(|i| {
            if i < 494 {
                0.16 + 0.02 * i as f64 / 494.0
            } else {
                0.18 + 0.12 * (i - 494) as f64 / 26.0
            }
        })
        .collect();
    assert_eq!(latencies_agree(&sim, &sim), Ok(()));
    // Host overhead of 10% everywhere and stalls on the five slowest: agreement.
    let mut noisy: Vec<f64> = sim.iter().map(|x| x * 1.1).collect();
    for x in noisy.iter_mut().rev().take(5) {
        *x *= 2.0;
    }
    assert_eq!(latencies_agree(&sim, &noisy), Ok(()));
    // A slower data path (every request 1.4×): refused at the median.
    let slow: Vec<f64> = sim.iter().map(|x| x * 1.4).collect();
    assert!(latencies_agree(&sim, &slow).unwrap_err().contains("p50"));
    // Queueing the model does not predict (the slowest 20% take 0.5 s): refused at p90.
    let mut queued = sim.clone();
    for x in queued.iter_mut().rev().take(104) {
        *x = 0.5;
    }
    assert!(latencies_agree(&sim, &queued).unwrap_err().contains("p90"));
    // The slowest 10% and more take 60% longer than simulated: refused at p90.
    let mut tail = sim.clone();
    for x in tail.iter_mut().rev().take(60) {
        *x *= 1.6;
    }
    assert!(latencies_agree(&sim, &tail).unwrap_err().contains("p90"));
    // Too few requests to say anything.
    assert!(latencies_agree(&sim[..50], &sim[..50]).is_err());
}

#[test]
fn sim_and_local_agree_and_a_killed_engine_fails_over() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    ok(&[
        "run",
        SPEC,
        "--backend",
        "sim",
        "--db",
        &d("s.db"),
        "--out",
        &d("sim"),
        "--quiet",
        "--store-requests",
    ]);
    ok(&[
        "run",
        SPEC,
        "--db",
        &d("l.db"),
        "--out",
        &d("local"),
        "--quiet",
        "--store-requests",
    ]);
    no_children_left();
    let (s, l) = (
        summary(&dir.path().join("sim/local-tiny.json")),
        summary(&dir.path().join("local/local-tiny.json")),
    );
    for (ps, pl) in s["policies"]
        .as_array()
        .unwrap()
        .iter()
        .zip(l["policies"].as_array().unwrap())
    {
        let name = ps["policy"].as_str().unwrap();
        let (hs, hl) = (
            ps["served_kv_hit"]["mean"].as_f64().unwrap(),
            pl["served_kv_hit"]["mean"].as_f64().unwrap(),
        );
        assert!(
            (hs - hl).abs() <= 0.05,
            "{name}: served hit sim {hs} local {hl}"
        );
        let sim = e2e_latencies(&dir.path().join("s.db"), name);
        if let Err(first) = latencies_agree(&sim, &e2e_latencies(&dir.path().join("l.db"), name)) {
            // A pass rule over repeats: one more local run of the same study (same seed, same
            // trace) must agree. A data path that really differs fails both; one run slowed
            // by the host (a build beside it) does not fail the suite.
            // One repeat serves every policy that needs it (a second `run` into the same
            // database would be refused as a study with results).
            if !dir.path().join("l2.db").exists() {
                ok(&[
                    "run",
                    SPEC,
                    "--db",
                    &d("l2.db"),
                    "--out",
                    &d("local2"),
                    "--quiet",
                    "--store-requests",
                ]);
                no_children_left();
            }
            if let Err(second) =
                latencies_agree(&sim, &e2e_latencies(&dir.path().join("l2.db"), name))
            {
                panic!(
                    "{name}: two local runs disagree with the simulation: {first}; then {second}"
                );
            }
            eprintln!("{name}: first local run disagreed ({first}); a second agreed");
        }
    }
    // The engines' own counters were scraped into the telemetry table.
    let st = cacheroute::store::BlockingStore::open(dir.path().join("l.db")).unwrap();
    let study = st.load_study("local-tiny").unwrap();
    let tel = st
        .load_telemetry(
            study.id,
            Some(cacheroute::telemetry::engine_api::CACHE_QUERY_TOKENS_DELTA),
        )
        .unwrap();
    assert_eq!(tel.len(), 2 * 4, "one sample per engine per step");
    assert!(tel.iter().all(|t| t.value > 0.0));
    // The router's plans are stored as the simulator's are: each with its settings (q_cap is
    // the spec's), timed within the step, about as many as the simulated run planned.
    let plans_of = |db: &str| {
        let st = cacheroute::store::BlockingStore::open(dir.path().join(db)).unwrap();
        let study = st.load_study("local-tiny").unwrap();
        study.plans
    };
    let (sim_plans, local_plans) = (plans_of("s.db"), plans_of("l.db"));
    assert!(
        local_plans.iter().all(|p| p.run.policy == "cacheroute"),
        "{local_plans:?}"
    );
    assert!(local_plans.len() >= 3, "{local_plans:?}");
    assert!(
        local_plans.len().abs_diff(sim_plans.len()) <= 2,
        "{} local plans, {} simulated",
        local_plans.len(),
        sim_plans.len()
    );
    // The warm start is a plan file the runner writes (no settings recorded), at 0; every plan
    // the router built itself says what it was built with.
    let built: Vec<_> = local_plans
        .iter()
        .filter(|p| p.plan.q_cap.is_some())
        .collect();
    assert!(built.len() + 1 >= local_plans.len(), "{local_plans:?}");
    assert!(built.len() >= 2, "{local_plans:?}");
    for p in &local_plans {
        assert!((0.0..=60.0).contains(&p.plan.at_s), "{p:?}");
    }
    for p in built {
        assert_eq!(p.plan.q_cap, Some(8.0), "{p:?}");
        assert!(p.plan.warm_slots.is_some_and(|w| w > 0), "{p:?}");
    }

    // Kill engine 1 a third of the way into the step.
    let spec = std::fs::read_to_string(SPEC)
        .unwrap()
        .replace("name: local-tiny", "name: local-kill")
        + "failures: [ { destination: 1, at_s: 20 } ]\n";
    let f = dir.path().join("kill.yaml");
    std::fs::write(&f, spec).unwrap();
    ok(&[
        "run",
        f.to_str().unwrap(),
        "--db",
        &d("k.db"),
        "--out",
        &d("kill"),
        "--quiet",
        "--store-requests",
    ]);
    no_children_left();
    let st = cacheroute::store::BlockingStore::open(dir.path().join("k.db")).unwrap();
    let study = st.load_study("local-kill").unwrap();
    for run in &study.runs {
        let reqs = common::study::request_records(&st, run.id, 0);
        assert!(reqs.len() > 300, "{}", reqs.len());
        let errors = reqs.iter().filter(|r| !r.status.is_ok()).count();
        // Only requests already streaming from the killed engine may fail (at most a handful).
        assert!(
            errors * 20 < reqs.len(),
            "{} of {} failed",
            errors,
            reqs.len()
        );
        // Within a health interval (0.5 s real = 1 s model at time scale 2) nothing goes to it.
        let late = reqs
            .iter()
            .filter(|r| r.scheduled_s > 22.0 && r.destination == Some(1))
            .count();
        assert_eq!(
            late, 0,
            "{}: requests sent to the killed engine",
            run.key.policy
        );
    }
}

/// Pids of the runner's children whose command line contains `pattern`.
fn children(parent: u32, pattern: &str) -> Vec<u32> {
    let o = Command::new("pgrep")
        .args(["-P", &parent.to_string(), "-f", pattern])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_step_whose_router_and_engines_died_is_an_error_not_a_result() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("d.db");
    // The runner ignores SIGINT (a job started from a script) in its own process group; a
    // Ctrl-C to the group then kills the step's emulators and router, not the runner.
    let runner = Command::new("sh")
        .arg("-c")
        .arg("trap '' INT; exec \"$0\" \"$@\"")
        .arg(BIN)
        .args([
            "run",
            SPEC,
            "--db",
            db.to_str().unwrap(),
            "--out",
            dir.path().join("out").to_str().unwrap(),
            "--quiet",
        ])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = runner.id();
    let t0 = std::time::Instant::now();
    while children(pid, "route --config").is_empty() && t0.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let router = children(pid, "route --config");
    assert_eq!(router.len(), 1, "the first step's router did not start");
    // Into the measured window of the first step (warm-up is 7.5 s real at time scale 2).
    std::thread::sleep(std::time::Duration::from_secs(10));
    assert!(Command::new("kill")
        .args(["-INT", "--", &format!("-{pid}")])
        .status()
        .unwrap()
        .success());
    let o = runner.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the runner exited 0: {err}");
    assert!(
        err.contains(&format!("router (pid {}) exited", router[0]))
            && err.contains("emulator 0 (pid")
            && err.contains("the step is not stored"),
        "{err}"
    );
    no_children_left();
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("local-tiny").unwrap();
    assert!(study.steps.is_empty(), "{} steps stored", study.steps.len());
}

/// A `cacheroute emulate` child process, its stdout lines collected (it prints one line per
/// cache reset or flush), killed when dropped.
struct Emulator {
    child: std::process::Child,
    url: String,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_emulator(args: &[&str]) -> Emulator {
    use std::io::BufRead;
    let mut child = Command::new(BIN)
        .args(["emulate", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start emulate");
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = out.next().unwrap().unwrap();
    let url = first.trim_start_matches("listening on ").to_string();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = lines.clone();
    std::thread::spawn(move || {
        for line in out.map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    Emulator { child, url, lines }
}

/// The study path against SGLang-API engines (`fleet.engine: sglang`, given by URL): every
/// step starts with `/flush_cache` — the first one refused with 400 while a straggler request
/// still runs, and retried until it is accepted — the request counters are read by SGLang's
/// names (absent before the first request: 0), and the report has the engine-counter served
/// hit. On the code before #21 the first reset (POST /reset_prefix_cache) failed the study.
#[test]
fn a_study_runs_against_sglang_api_engines_with_a_flush_per_step() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let emus: Vec<Emulator> = (0..2)
        .map(|_| {
            start_emulator(&[
                "--api",
                "sglang",
                "--engine",
                "llama-3.1-8b:h100:fp8:tp1",
                "--model-name",
                "cacheroute-model",
                "--block-tokens",
                "64",
            ])
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        r#"name: local-sglang
backend: local
local: {{ engine_urls: [{}, {}] }}
fleet: {{ engine: sglang, model: llama-3.1-8b, gpu: h100, precision: fp8, tp: 1, replicas: 2 }}
{STUDY_BODY}"#,
        emus[0].url, emus[1].url
    );
    let f = dir.path().join("sglang.yaml");
    std::fs::write(&f, spec).unwrap();
    // A straggler still running on engine 0 when the study's first flush arrives.
    let straggler = {
        let url = format!("{}/v1/completions", emus[0].url);
        std::thread::spawn(move || {
            let body = serde_json::json!({"model": "cacheroute-model", "prompt": "straggler", "max_tokens": 1500});
            reqwest::blocking::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .map(|r| r.status().as_u16())
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    run_quiet(&f, dir.path());
    assert_eq!(straggler.join().unwrap().unwrap(), 200);
    // Engine 0: refused while the straggler ran, then one accepted flush per step.
    let log0 = emus[0].lines.lock().unwrap().clone();
    let flushes: Vec<&String> = log0
        .iter()
        .filter(|l| l.starts_with("flush_cache"))
        .collect();
    assert!(
        flushes
            .first()
            .is_some_and(|l| l.starts_with("flush_cache: 400"))
            && flushes[0].contains("#running-req: 1"),
        "{log0:?}"
    );
    for e in &emus {
        let log = e.lines.lock().unwrap();
        let ok = log
            .iter()
            .filter(|l| l.starts_with("flush_cache: 200"))
            .count();
        assert_eq!(ok, 2, "one flush per step: {log:?}");
    }
    // The engines' counters, by SGLang's names, in the store and in the report.
    let st = cacheroute::store::BlockingStore::open(dir.path().join("s.db")).unwrap();
    assert_eq!(st.load_study("local-sglang").unwrap().steps.len(), 2);
    let (h, q) = common::study::engine_counter_deltas(&dir.path().join("s.db"), "local-sglang");
    assert_eq!((q.len(), h.len()), (4, 4), "two engines, two steps");
    assert!(q.iter().all(|&v| v > 0.0), "{q:?}");
    let (hits, queries) = (h.iter().sum::<f64>(), q.iter().sum::<f64>());
    assert!(hits > 0.2 * queries, "hits {hits} of {queries}");
    let md = std::fs::read_to_string(dir.path().join("out/local-sglang.md")).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| cacheroute | ") && l.ends_with("| — | — |"))
        .unwrap_or_else(|| panic!("engine telemetry row for cacheroute:\n{md}"));
    assert!(row.contains('%'), "{row}");
    no_children_left();
}

#[test]
fn a_study_replays_live_sessions_and_stores_their_figures() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    run_emulated(
        dir.path(),
        "local-sessions",
        "time_scale: 4, sessions: live",
        2,
        STUDY_BODY,
    );
    let db = dir.path().join("s.db");
    let rows = |m: &str| common::study::telemetry_values(&db, "local-sessions", m);
    // One row per run and step: every turn of the generated conversations was sent, none
    // abandoned, and the later turns hit the cache on the emulator (the earlier prompt).
    let sent = rows("session_turns_sent");
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent.iter().all(|&n| n >= 20.0), "{sent:?}");
    assert!(rows("session_turns_abandoned").iter().all(|&n| n == 0.0));
    assert_eq!(rows("session_turns_late").len(), 2);
    let hit = rows("session_later_turns_kv_hit");
    assert!(hit.iter().all(|&h| h > 0.3), "{hit:?}");
    // The report says so per policy.
    let report = std::fs::read_to_string(dir.path().join("out/local-sessions.md")).unwrap();
    let line = report
        .lines()
        .find(|l| l.starts_with("Live sessions"))
        .unwrap_or_else(|| panic!("no live-session line in the report:\n{report}"));
    assert!(
        line.contains(&format!("flat-lb: {} turns sent", sent[0])) && line.contains("cacheroute: "),
        "{line}"
    );
}

/// A study whose policies follow the engines' KV-cache events (`dynamo`; CacheRoute's prefix
/// dispatch by default where the router is subscribed) beside `llm-d`: the emulators publish
/// their events, the router subscribes, every step is stored with a served hit, and the
/// router's KV-event counters and predicted hit per destination are stored as the step's
/// telemetry and shown in the report.
#[test]
fn a_study_with_event_following_policies_stores_the_router_s_kv_counters() {
    use cacheroute::experiment::kv_events as kv;
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let body = STUDY_BODY.replace(
        "policies: [ {policy: flat-lb}, {policy: cacheroute} ]",
        "policies: [ {policy: dynamo}, {policy: llm-d}, {policy: cacheroute} ]",
    );
    assert_ne!(body, STUDY_BODY, "the study body's policies line moved");
    run_emulated(dir.path(), "local-kv", "time_scale: 4", 3, &body);
    let db = dir.path().join("s.db");
    let st = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = st.load_study("local-kv").unwrap();
    // A step per policy, each with a served hit.
    assert_eq!(study.steps.len(), 3, "{:?}", study.steps.len());
    for s in &study.steps {
        assert!(
            s.metrics.served_kv_hit > 0.1,
            "{}: served hit {}",
            s.run.policy,
            s.metrics.served_kv_hit
        );
    }
    let rows = |m: &str| common::study::telemetry_values(&db, "local-kv", m);
    // Per policy and destination: events received, none lost for good or undecodable, every
    // stored block mapped.
    let batches = rows(kv::BATCHES);
    assert_eq!(batches.len(), 3 * 3, "{batches:?}");
    assert!(batches.iter().all(|&b| b > 0.0), "{batches:?}");
    assert!(rows(kv::RESYNCS).iter().all(|&x| x == 0.0));
    assert!(rows(kv::UNDECODABLE).iter().all(|&x| x == 0.0));
    let (mapped, unmapped) = (rows(kv::MAPPED), rows(kv::UNMAPPED));
    assert_eq!(mapped.len(), 3);
    assert!(mapped.iter().all(|&x| x > 0.0) && unmapped.iter().all(|&x| x == 0.0));
    assert!(rows(kv::PREDICTED_TOKENS).iter().sum::<f64>() > 0.0);
    // The report shows the counters per policy and predicted against served per destination.
    let report = std::fs::read_to_string(dir.path().join("out/local-kv.md")).unwrap();
    assert!(
        report.contains("The engines' KV-cache events as the router received them"),
        "{report}"
    );
    for p in ["dynamo", "llm-d", "cacheroute"] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with(&format!("| {p} | ")) && l.matches(" | ").count() == 7),
            "no KV-event row for {p}:\n{report}"
        );
        for d in 0..3 {
            assert!(
                report
                    .lines()
                    .any(|l| l.starts_with(&format!("| {p} | {d} | ")) && !l.ends_with("| — |")),
                "{p}, destination {d}: no predicted and served hit:\n{report}"
            );
        }
    }
    // Per policy, over its destinations, the exact index's predicted hit is the engines'
    // served hit within the report's tolerance. (Not per destination here: a destination gets
    // about 16 requests in this 12-second step, and one whose prefix's events reach the router
    // after the next decision for it — a debug build on two shared cores, at time scale 4 —
    // moves its row by 5 to 10 points; the per-destination check is the router test's,
    // tests/router_kv_events.rs, and a full study's rows agree within 0.8 points,
    // docs/kv-events.md.)
    use cacheroute::telemetry::engine_api as api;
    let all = st.load_telemetry(study.id, None).unwrap();
    for run in &study.runs {
        let sum = |metric: &str, prefix: &str| -> f64 {
            all.iter()
                .filter(|t| t.run == Some(run.id) && t.metric == metric)
                .filter(|t| t.source.starts_with(prefix))
                .map(|t| t.value)
                .sum()
        };
        let h = cacheroute::report::DestHit {
            routed: sum(kv::PROMPT_TOKENS, "router:"),
            predicted: sum(kv::PREDICTED_TOKENS, "router:"),
            hits: sum(api::CACHE_HIT_TOKENS_DELTA, "engine:"),
            queries: sum(api::CACHE_QUERY_TOKENS_DELTA, "engine:"),
        };
        assert_eq!(
            h.agrees(),
            Some(true),
            "{}: predicted and served hit over the fleet {:?} ({h:?})",
            run.key.policy,
            h.rates()
        );
    }
}
