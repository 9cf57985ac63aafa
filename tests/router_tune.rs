//! CacheRoute's self-calibration in the live router, end to end: `cacheroute route --engine
//! SPEC` in front of real `cacheroute emulate` processes, traffic from `cacheroute replay`. With
//! the engine named, the control loop replays its recent traffic through the engine model and
//! chooses q_cap, W and bounded sets itself; `/admin/plan` and the log say what it chose and
//! why. Without `--engine` it does not, and says so; a bad engine spec is refused at start.

mod common;

use common::procs::{run, Proc};
use serde_json::Value;
use std::time::{Duration, Instant};

const TOKEN: &str = "t0ken";

/// A small multi-turn workload: 16 active keys with 256-word system prompts.
const WORKLOAD: &str = "\
keys: { count: 200, dist: { kind: lognormal, sigma: 1.648 }, active: 16 }
prefix:
  block_size: 16
  system_prompt: { dist: constant, value: 256 }
  conversations_per_key: 2
  user_message: { dist: constant, value: 32 }
  output: { dist: constant, value: 8 }
";

fn plan(url: &str) -> Value {
    reqwest::blocking::Client::new()
        .get(format!("{url}/admin/plan"))
        .bearer_auth(TOKEN)
        .send()
        .and_then(|r| r.text())
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

/// Start a CacheRoute router (1 s intervals unless `extra` says) over `backends` with `extra`
/// flags.
fn router(backends: &[&Proc], extra: &[&str]) -> Proc {
    let mut args = vec!["route", "--listen", "127.0.0.1:0", "--policy", "cacheroute"];
    if !extra.contains(&"--interval-s") {
        args.extend(["--interval-s", "1"]);
    }
    args.extend(["--block-tokens", "16", "--admin-token", TOKEN]);
    for b in backends {
        args.extend(["--backend", b.url.as_str()]);
    }
    args.extend(extra);
    Proc::start_env(&args, &[("RUST_LOG", "info")])
}

fn replay(url: &str, workload: &std::path::Path) {
    let (status, _, err) = run(&[
        "replay",
        "--target",
        url,
        "--workload",
        workload.to_str().unwrap(),
        "--qps",
        "60",
        "--duration",
        "9",
        "--block-tokens",
        "16",
    ]);
    assert!(status.success(), "{err}");
}

#[test]
fn the_router_self_calibrates_with_an_engine_model_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let wl = dir.path().join("wl.yaml");
    std::fs::write(&wl, WORKLOAD).unwrap();
    let (a, b) = (Proc::emulator(), Proc::emulator());

    let tuned = router(&[&a, &b], &["--engine", "tiny:cpu:bf16:tp1"]);
    replay(&tuned.url, &wl);
    // The next tuning can come a few intervals after the traffic: wait for a tuned plan.
    let deadline = Instant::now() + Duration::from_secs(20);
    let p = loop {
        let p = plan(&tuned.url);
        if p["self_calibration"].is_string() || Instant::now() > deadline {
            break p;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (status, log) = tuned.terminate();
    assert!(status.success(), "{log}");
    let why = p["self_calibration"]
        .as_str()
        .unwrap_or_else(|| panic!("{p}\n{log}"));
    assert!(why.contains("q_cap"), "{why}");
    assert!(p["q_cap"].as_f64().unwrap() > 0.0, "{p}");
    assert!(p["warm_slots"].as_u64().unwrap() > 0, "{p}");
    assert!(p["bounded_sets"].is_boolean(), "{p}");
    // The dispatch it chose, in its written form, and the replays it chose by.
    let d = p["dispatch"].as_str().unwrap_or_else(|| panic!("{p}"));
    assert!(
        d.parse::<cacheroute::policy::cacheroute::Dispatch>()
            .is_ok(),
        "{d}"
    );
    assert!(why.contains(" dispatch (plan+chwbl+prefill "), "{why}");
    assert!(
        log.contains("CacheRoute self-calibrates q_cap W bounded-sets dispatch"),
        "{log}"
    );
    assert!(log.contains("self-calibration: "), "{log}");
    // The engine model sized the conversation memory (as the simulator's resolve does).
    assert!(
        log.contains("per destination, twice one replica's KV cache in the engine model"),
        "{log}"
    );
    // The fixed-rate fallback was not used: its warning is for routers without a model.
    assert!(!log.contains("q_cap not set"), "{log}");

    // Without an engine model: no self-calibration, and the log says why.
    let plain = router(&[&a, &b], &[]);
    replay(&plain.url, &wl);
    let p = plan(&plain.url);
    let (status, log) = plain.terminate();
    assert!(status.success(), "{log}");
    assert_eq!(p["installed"], true, "{p}");
    assert!(p["self_calibration"].is_null(), "{p}");
    assert!(
        log.contains("CacheRoute does not self-calibrate without --engine"),
        "{log}"
    );
    assert!(
        log.contains("prefix blocks (65536 per destination, the default without --engine"),
        "{log}"
    );
}

/// `cacheroute route` (CacheRoute over one backend) with `flag`: it must not start; its stderr.
fn refused(flag: &[&str]) -> String {
    let mut args = vec![
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "cacheroute",
        "--backend",
        "http://127.0.0.1:9",
    ];
    args.extend(flag);
    let (status, _, err) = run(&args);
    assert!(!status.success(), "{flag:?} started");
    err
}

#[test]
fn a_bad_engine_spec_is_refused_at_start() {
    let err = refused(&["--engine", "no-such-model:h100:fp8:tp1"]);
    assert!(
        err.contains("engine: `no-such-model:h100:fp8:tp1` is not an engine spec"),
        "{err}"
    );
}

#[test]
fn a_memory_size_in_the_policy_is_named_as_such_even_with_an_engine_model() {
    let dir = tempfile::tempdir().unwrap();
    let a = Proc::emulator();
    let cfg = dir.path().join("router.yaml");
    std::fs::write(
        &cfg,
        format!(
            "listen: 127.0.0.1:0\nbackends: [{}]\nblock_tokens: 16\n\
             policy: {{policy: cacheroute, memory_size: 777}}\n",
            a.url
        ),
    )
    .unwrap();
    let r = Proc::start_env(
        &[
            "route",
            "--config",
            cfg.to_str().unwrap(),
            "--engine",
            "tiny:cpu:bf16:tp1",
        ],
        &[("RUST_LOG", "info")],
    );
    let (status, log) = r.terminate();
    assert!(status.success(), "{log}");
    // The given size is kept (the engine model would size it otherwise) and the log says so.
    assert!(
        log.contains("prefix blocks (777 per destination, memory_size in the policy)"),
        "{log}"
    );
}

/// The number of seconds in a self-calibration line's "replay of the last N s".
fn replayed_seconds(why: &str) -> f64 {
    let rest = why
        .split("replay of the last ")
        .nth(1)
        .unwrap_or_else(|| panic!("{why}"));
    rest.split(' ').next().unwrap().parse().unwrap()
}

/// Per-key rates the router's state file holds, summed.
fn state_rate(path: &std::path::Path) -> f64 {
    let text = std::fs::read_to_string(path).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["keys"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|k| k["rate"].as_f64().unwrap())
        .sum()
}

/// `cacheroute_plans_installed_total` from `/metrics`.
fn plans_installed(url: &str) -> f64 {
    let text = reqwest::blocking::get(format!("{url}/metrics"))
        .and_then(|r| r.text())
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("cacheroute_plans_installed_total "))
        .unwrap_or_else(|| panic!("{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Backends `--time-scale F` times faster than the engine model (a local study's emulators):
/// the router's control loop keeps the model's time. Its interval lasts `interval_s / F` wall
/// seconds, its rates are the wall rates divided by F (60 req/s sent, 15 measured at F = 4),
/// its replays stretch the recent arrivals back to the model's pace, and the policies' clock
/// runs F times faster. Each part fails if the scale is ignored: 4× fewer plans, 4× the rate,
/// a quarter of the replayed span, a quarter of the clock.
#[test]
fn a_time_scale_keeps_the_control_loop_in_the_engine_model_s_time() {
    let dir = tempfile::tempdir().unwrap();
    let wl = dir.path().join("wl.yaml");
    std::fs::write(&wl, WORKLOAD).unwrap();
    let (a, b) = (Proc::emulator(), Proc::emulator());
    let run_at = |f: &str, state: &std::path::Path| {
        let r = router(
            &[&a, &b],
            &[
                "--engine",
                "tiny:cpu:bf16:tp1",
                "--time-scale",
                f,
                "--interval-s",
                "4",
                "--state-file",
                state.to_str().unwrap(),
            ],
        );
        let t0 = Instant::now();
        replay(&r.url, &wl);
        let wall = t0.elapsed().as_secs_f64();
        let plans = plans_installed(&r.url);
        let p = plan(&r.url);
        let (status, log) = r.terminate();
        assert!(status.success(), "{log}");
        (plans, wall, p, log, state_rate(state))
    };
    let (plans, wall, p, log, rate) = run_at("4", &dir.path().join("scaled.json"));
    // 9 s of traffic: at 1 wall second an interval, about 9 plans (the cold start adds one).
    assert!(plans >= 6.0, "{plans} plans in {wall:.1} s\n{log}");
    assert!((9.0..=22.0).contains(&rate), "measured {rate} req/s\n{log}");
    let why = p["self_calibration"]
        .as_str()
        .unwrap_or_else(|| panic!("{p}\n{log}"));
    // Two intervals of the model's time (8 s), not two wall seconds.
    let span = replayed_seconds(why);
    assert!(span >= 5.0, "{why}\n{log}");
    // The policies' clock (the plans' times, Preble's window and TPOT) is the model's too: the
    // last plan came about 9 wall seconds after start, 36 of the model's.
    let at = p["installed_at_s"].as_f64().unwrap();
    assert!(
        at > 20.0,
        "installed at {at} s after {wall:.1} wall seconds\n{p}"
    );

    // The same router and traffic in real time: a quarter of the plans, four times the rate.
    let (plans1, _, p1, log1, rate1) = run_at("1", &dir.path().join("real.json"));
    assert!(plans1 <= 4.0, "{plans1} plans\n{log1}");
    let at1 = p1["installed_at_s"].as_f64().unwrap();
    assert!(at1 < 15.0, "installed at {at1} s\n{p1}");
    assert!(
        (40.0..=80.0).contains(&rate1),
        "measured {rate1} req/s\n{log1}"
    );
}

/// A time scale out of range, engine knobs without an engine, or a knob the model does not
/// have: each refused at start, naming the field.
#[test]
fn a_bad_time_scale_or_engine_knob_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (yaml, field) in [
        ("engine_knobs: { kv_cache_bytes: 6.0e9 }\n", "engine_knobs"),
        (
            "engine: tiny:cpu:bf16:tp1\nengine_knobs: { kv_bytes: 6.0e9 }\n",
            "kv_bytes",
        ),
        ("time_scale: 0\n", "time_scale"),
        (
            "engine: tiny:cpu:bf16:tp1\nengine_knobs: { kv_cache_bytes: -5 }\n",
            "engine_knobs: the engine model",
        ),
        // A bad spec with good knobs is the spec's fault, not the knobs'.
        (
            "engine: tiny:cpu:bf16:tp0\nengine_knobs: { kv_cache_bytes: 6.0e9 }\n",
            "engine: `tiny:cpu:bf16:tp0` is not an engine spec",
        ),
    ] {
        let cfg = dir.path().join("r.yaml");
        std::fs::write(
            &cfg,
            format!(
                "listen: 127.0.0.1:0\nbackends: [http://127.0.0.1:9]\npolicy: cacheroute\n{yaml}"
            ),
        )
        .unwrap();
        let (status, _, err) = run(&["route", "--config", cfg.to_str().unwrap()]);
        assert!(!status.success(), "{yaml}");
        assert!(err.contains(field), "{yaml}: {err}");
    }
    for bad in ["0", "-2", "NaN", "1e9"] {
        let err = refused(&[&format!("--time-scale={bad}")]);
        assert!(err.contains("time_scale"), "{bad}: {err}");
    }
}
