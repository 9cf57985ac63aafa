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

/// Start a CacheRoute router (1 s intervals) over `backends` with `extra` flags.
fn router(backends: &[&Proc], extra: &[&str]) -> Proc {
    let mut args = vec![
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "cacheroute",
        "--interval-s",
        "1",
        "--block-tokens",
        "16",
        "--admin-token",
        TOKEN,
    ];
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
    assert!(
        log.contains("CacheRoute self-calibrates q_cap W bounded-sets"),
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

#[test]
fn a_bad_engine_spec_is_refused_at_start() {
    let (status, _, err) = run(&[
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "cacheroute",
        "--backend",
        "http://127.0.0.1:9",
        "--engine",
        "no-such-model:h100:fp8:tp1",
    ]);
    assert!(!status.success());
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
