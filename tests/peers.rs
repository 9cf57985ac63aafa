//! External routers as study policies (src/peer/, src/experiment/external.rs): SMG runs a short
//! local study in front of emulators beside our flat-lb, its requests reach the engines and its
//! served hit is the engines' counters'; a peer that fails to start is named with its log tail
//! and the retry command while the other policies' results are kept.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Install a peer (cached: a second when already there; scripts/test.sh installs it up front).
fn install(peer: &str) {
    let o = Command::new("bash")
        .arg(Path::new(ROOT).join("scripts/install-peers.sh"))
        .arg(peer)
        .output()
        .expect("run install-peers.sh");
    assert!(
        o.status.success(),
        "scripts/install-peers.sh {peer} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn install_smg() {
    install("smg");
}

fn spec_text() -> String {
    std::fs::read_to_string(Path::new(ROOT).join("tests/data/peers-tiny.yaml")).unwrap()
}

/// Run `cacheroute run SPEC` with a fresh database in `dir`; (success, stdout, stderr).
fn run_study(dir: &Path, text: &str) -> (bool, String, String, PathBuf) {
    let spec = dir.join("peers-tiny.yaml");
    std::fs::write(&spec, text).unwrap();
    let db = dir.join("results.db");
    let o = Command::new(BIN)
        .args(["run", "--quiet", "--db"])
        .arg(&db)
        .arg("--out")
        .arg(dir.join("reports"))
        .arg(&spec)
        .output()
        .expect("run cacheroute");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        db,
    )
}

#[test]
fn smg_runs_a_local_study_and_its_hit_comes_from_the_engines_counters() {
    install_smg();
    let dir = tempfile::tempdir().unwrap();
    let (ok, out, err, db) = run_study(dir.path(), &spec_text());
    assert!(ok, "study failed: {err}");
    assert!(out.contains("smg:cache_aware"), "{out}");
    let store = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = store.load_study("peers-tiny").unwrap();
    let run = study
        .runs
        .iter()
        .find(|r| r.key.policy == "smg:cache_aware")
        .expect("the smg run");
    assert!(run.complete);
    let step = study
        .steps
        .iter()
        .find(|s| s.run == run.key)
        .expect("the smg step");
    let tel = store.load_telemetry(study.id, None).unwrap();
    let mine = |metric: &str| -> Vec<f64> {
        let mut v: Vec<(String, f64)> = tel
            .iter()
            .filter(|t| t.run == Some(run.id) && t.metric == metric)
            .map(|t| (t.source.clone(), t.value))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.into_iter().map(|x| x.1).collect()
    };
    // Its requests reached the engines: every engine finished some (cache_aware spreads 32
    // keys over four), and together about as many as the window scheduled (the window's
    // counters also hold warm-up requests still running at its start).
    let reqs = mine(cacheroute::experiment::external::WINDOW_REQUESTS);
    assert_eq!(reqs.len(), 4, "{tel:?}");
    assert!(reqs.iter().all(|&r| r > 0.0), "{reqs:?}");
    let total: f64 = reqs.iter().sum();
    let m = &step.metrics;
    assert!(m.errors == 0, "{m:?}");
    assert!(
        total >= m.requests as f64 && total <= m.requests as f64 * 1.2 + 10.0,
        "engines finished {total} requests; the window scheduled {}",
        m.requests
    );
    // Its hit and imbalance are the engines' counters', not the replayer's view.
    let hits: f64 = mine(cacheroute::experiment::external::WINDOW_HITS)
        .iter()
        .sum();
    let queries: f64 = mine(cacheroute::experiment::external::WINDOW_QUERIES)
        .iter()
        .sum();
    assert!(queries > 0.0);
    assert!((m.served_kv_hit - hits / queries).abs() < 1e-12, "{m:?}");
    let imbalance = cacheroute::analysis::max_over_mean(&reqs);
    assert!((m.imbalance_requests - imbalance).abs() < 1e-9, "{m:?}");
    // The report marks it external with its version and exact command line.
    let md = std::fs::read_to_string(dir.path().join("reports/peers-tiny.md")).unwrap();
    assert!(md.contains("| smg:cache_aware (external) | smg 1.13.0 | `x-smg-routing-key` |"));
    assert!(md.contains("smg launch --host 127.0.0.1 --port "), "{md}");
    assert!(md.contains("--policy cache_aware"), "{md}");
}

#[test]
fn a_peer_that_fails_to_start_is_named_and_the_other_results_are_kept() {
    peer_fails_to_start("");
}

/// The same in a knee search (`search: knee`): its runs go their own way, a failed peer's the
/// same as on the fixed ladder.
#[test]
fn a_peer_that_fails_in_a_knee_search_is_named_and_the_other_results_are_kept() {
    peer_fails_to_start("search: knee\n");
}

/// A study whose SMG cannot start (a fake binary refusing its flags), with `extra` spec lines.
fn peer_fails_to_start(extra: &str) {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("smg");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho \"error: unexpected argument '--worker-urls' found\" >&2\nexit 2\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = spec_text().replace(
        "{router: smg, policy: cache_aware}",
        &format!(
            "{{router: smg, policy: cache_aware, binary: {}}}",
            fake.display()
        ),
    ) + extra;
    let (ok, out, err, db) = run_study(dir.path(), &text);
    assert!(!ok, "a study whose peer failed succeeded: {out}");
    // Named first, in one line; then its log tail; then how to retry.
    let first = err.lines().find(|l| l.starts_with("error")).unwrap_or("");
    assert!(
        first.contains("external router smg:cache_aware") && first.contains("exited"),
        "{err}"
    );
    assert!(err.contains("unexpected argument '--worker-urls'"), "{err}");
    assert!(err.contains("retry: ") && err.contains("--resume"), "{err}");
    // The other policy ran, was stored complete and is reported; the peer is not ranked.
    assert!(out.contains("flat-lb"), "{out}");
    let store = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = store.load_study("peers-tiny").unwrap();
    let flat = study
        .runs
        .iter()
        .find(|r| r.key.policy == "flat-lb")
        .unwrap();
    assert!(flat.complete && flat.steps_completed == 1);
    let smg = study
        .runs
        .iter()
        .find(|r| r.key.policy == "smg:cache_aware")
        .unwrap();
    assert!(!smg.complete && smg.steps_completed == 0);
    let failed = store
        .load_telemetry(
            study.id,
            Some(cacheroute::experiment::external::PEER_FAILED),
        )
        .unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].run, Some(smg.id));
    let md = std::fs::read_to_string(dir.path().join("reports/peers-tiny.md")).unwrap();
    assert!(md.contains("**smg:cache_aware failed**"), "{md}");
    assert!(md.contains("unexpected argument"), "{md}");
}

#[test]
fn cacheroute_peer_refuses_unknown_routers_and_policies_in_one_line() {
    for (args, needle) in [
        (
            ["--router", "haproxy", "--policy", "roundrobin"],
            "unknown router `haproxy`",
        ),
        (
            ["--router", "envoy", "--policy", "cache_aware"],
            "`cache_aware` is not a policy of envoy",
        ),
    ] {
        let o = Command::new(BIN)
            .arg("peer")
            .args(args)
            .args(["--worker", "http://127.0.0.1:9"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}

#[test]
fn cacheroute_peer_starts_nginx_and_stops_it_with_its_workers_on_sigterm() {
    if Command::new("sh")
        .args(["-c", "command -v nginx || test -x /usr/sbin/nginx"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        // scripts/install-peers.sh nginx needs root; the study tests above do not need nginx.
        eprintln!("skipped: no nginx (bash scripts/install-peers.sh nginx)");
        return;
    }
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["peer", "--router", "nginx", "--policy", "consistent"])
        .args(["--worker", "http://127.0.0.1:9", "--dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let url = first
        .strip_prefix("listening on ")
        .expect(&first)
        .to_string();
    let second = lines.next().unwrap().unwrap();
    assert!(second.contains("nginx:consistent (nginx ") && second.contains("-g 'daemon off;'"));
    let conf = std::fs::read_to_string(dir.path().join("nginx.conf")).unwrap();
    assert!(conf.contains("hash $http_x_cacheroute_key consistent;"));
    // It proxies (the worker is down: nginx answers 502 itself).
    let port = url.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    let pid = std::fs::read_to_string(dir.path().join("nginx.pid")).unwrap();
    let master: i32 = pid.trim().parse().unwrap();
    // SAFETY: kill(2) on our own, not yet reaped, child.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    assert!(child.wait().unwrap().success());
    // nginx's master and its workers (its process group) are gone.
    let gone = (0..40).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        // SAFETY: signal 0 only asks whether the group exists.
        let r = unsafe { libc::kill(-master, 0) };
        r != 0
    });
    assert!(gone, "nginx's process group outlived `cacheroute peer`");
}

/// The vLLM router's `cache_aware` asks each worker for the prompt's token ids
/// (`/v1/completions/render`, which the emulator serves like `vllm serve --enable-scale-out`):
/// with them it routes by prefix — its own counters say so in the report, and its served hit
/// (the engines' counters) is well above flat-lb's on the same trace. Without them it made no
/// prefix decision and its row matched flat-lb's to a tenth of a point.
#[test]
fn the_vllm_router_routes_by_prefix_and_its_own_counters_say_so() {
    install("vllm-router");
    let dir = tempfile::tempdir().unwrap();
    let text = spec_text().replace(
        "{router: smg, policy: cache_aware}",
        "{router: vllm-router, policy: cache_aware}",
    );
    let (ok, _, err, db) = run_study(dir.path(), &text);
    assert!(ok, "study failed: {err}");
    let store = cacheroute::store::BlockingStore::open(&db).unwrap();
    let study = store.load_study("peers-tiny").unwrap();
    let hit = |p: &str| {
        let run = study.runs.iter().find(|r| r.key.policy == p).unwrap();
        let step = study.steps.iter().find(|s| s.run == run.key).unwrap();
        step.metrics.served_kv_hit
    };
    let (vr, flat) = (hit("vllm-router:cache_aware"), hit("flat-lb"));
    assert!(vr > flat + 0.15, "vllm-router {vr:.3} vs flat-lb {flat:.3}");
    let md = std::fs::read_to_string(dir.path().join("reports/peers-tiny.md")).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| vllm-router:cache_aware (external) |"))
        .unwrap_or_else(|| panic!("{md}"));
    assert!(row.contains("prefix_hit "), "{row}");
    assert!(!md.contains("did not route by prefix"), "{md}");
}

/// A worker for the vLLM router whose render endpoint is `render`: answering after `delay`, or
/// absent (404). It serves what the router needs besides (`/health`, `/v1/models`, a one-token
/// completion). Fault injection: a real engine's render is late only under load.
fn render_worker(rt: &tokio::runtime::Runtime, render: Option<std::time::Duration>) -> String {
    use axum::routing::{get, post};
    use serde_json::json;
    let mut app = axum::Router::new()
        .route("/health", get(|| async { "" }))
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]})) }),
        )
        .route(
            "/v1/completions",
            post(|| async {
                axum::Json(json!({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "text": " a", "finish_reason": "length", "logprobs": null}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}))
            }),
        );
    if let Some(delay) = render {
        app = app.route(
            "/v1/completions/render",
            post(move || async move {
                tokio::time::sleep(delay).await;
                axum::Json(json!([{"request_id": "r", "token_ids": [5, 6, 7],
                    "sampling_params": {"max_tokens": 1}, "stream": false}]))
            }),
        );
    }
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(async move { axum::serve(listener, app).await });
    url
}

/// The vLLM router gives a worker's render answer about a second: a later answer and a missing
/// endpoint both make its decision `missing_tokens`, and its own `kv_routing_inputs` counters
/// tell them apart (`preparation_unavailable` against a failed render). The study reads them and
/// its warning names the cause — late answers (under a study's load: every worker renders
/// every request) are not mistaken for a worker without `--enable-scale-out`.
#[test]
fn the_vllm_router_s_late_render_answers_are_told_apart_from_a_missing_endpoint() {
    use cacheroute::experiment::external::decision_summary;
    use cacheroute::peer::{start, ExternalSpec, Router, START_TIMEOUT};
    install("vllm-router");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let spec = ExternalSpec {
        router: Router::VllmRouter,
        policy: "cache_aware".into(),
        binary: None,
    };
    for (render, cause) in [
        (
            Some(std::time::Duration::from_secs(3)),
            "3 of its requests for token ids were not answered within the time it waits",
        ),
        (None, "`--enable-scale-out`"),
    ] {
        let worker = render_worker(&rt, render);
        let dir = tempfile::tempdir().unwrap();
        let peer = start(
            &spec,
            std::slice::from_ref(&worker),
            dir.path(),
            START_TIMEOUT,
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", e.log_tail()));
        let client = reqwest::blocking::Client::new();
        for i in 0..3 {
            let r = client
                .post(format!("{}/v1/completions", peer.url))
                .header("content-type", "application/json")
                .body(format!(
                    r#"{{"model": "m", "prompt": "one two three {i}", "max_tokens": 1}}"#
                ))
                .send()
                .unwrap();
            assert_eq!(r.status().as_u16(), 200, "{}", r.text().unwrap());
        }
        let rows = peer.decisions();
        let (text, warn) = decision_summary("vllm-router:cache_aware", &rows);
        assert!(text.starts_with("missing_tokens 3"), "{text}");
        let warn = warn.unwrap_or_else(|| panic!("no warning: {text}"));
        assert!(warn.contains(cause), "{render:?}: {text}\n{warn}");
        if render.is_some() {
            assert!(
                text.contains("preparation_unavailable 3") && !warn.contains("--enable-scale-out"),
                "{text}\n{warn}"
            );
        }
    }
}
