//! The replayer against an in-process mock OpenAI server (axum on 127.0.0.1:0): open loop under
//! a stalled server, prompt text and key header at the server, SSE timing, overflow, HTTP
//! errors, timeouts and refused connections. No tight timing assertions: every bound below has
//! at least half a second of slack.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use cacheroute::analysis::record::Status;
use cacheroute::loadgen::{self, Endpoint, ReplayConfig};
use cacheroute::workload::trace::TraceRecord;

#[derive(Clone, Debug)]
struct Seen {
    key: Option<String>,
    prompt: String,
    model: String,
}

/// A mock OpenAI server: records what it sees, stalls, streams, or fails on request.
#[derive(Clone)]
struct Mock {
    seen: Arc<Mutex<Vec<Seen>>>,
    inflight: Arc<AtomicUsize>,
    max_inflight: Arc<AtomicUsize>,
    stall: Duration,
    status: u16,
    itl: Duration,
}

impl Mock {
    fn new() -> Self {
        Mock {
            seen: Arc::default(),
            inflight: Arc::default(),
            max_inflight: Arc::default(),
            stall: Duration::ZERO,
            status: 200,
            itl: Duration::from_millis(30),
        }
    }

    /// Serve on an ephemeral loopback port; returns the base URL.
    async fn start(self) -> String {
        let app = Router::new()
            .route("/v1/completions", post(handle))
            .route("/v1/chat/completions", post(handle))
            .route(
                "/v1/models",
                axum::routing::get(|| async {
                    axum::Json(serde_json::json!({"object": "list", "data": [{"id": "served-model", "object": "model"}, {"id": "other"}]}))
                }),
            )
            .with_state(self);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        format!("http://{addr}")
    }
}

async fn handle(State(m): State<Mock>, headers: HeaderMap, body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON body");
    let prompt = v["prompt"]
        .as_str()
        .or_else(|| v["messages"][0]["content"].as_str())
        .expect("a prompt or a user message")
        .to_owned();
    let words = prompt.split_ascii_whitespace().count();
    m.seen.lock().unwrap().push(Seen {
        key: headers
            .get("x-cacheroute-key")
            .map(|h| h.to_str().unwrap().to_owned()),
        prompt,
        model: v["model"].as_str().unwrap_or_default().to_owned(),
    });
    let now = m.inflight.fetch_add(1, Ordering::SeqCst) + 1;
    m.max_inflight.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(m.stall).await;
    m.inflight.fetch_sub(1, Ordering::SeqCst);
    if m.status != 200 {
        return (
            StatusCode::from_u16(m.status).unwrap(),
            "overloaded, try later",
        )
            .into_response();
    }
    let max_tokens = v["max_tokens"].as_u64().unwrap_or(1);
    let usage = serde_json::json!({
        "prompt_tokens": words,
        "completion_tokens": max_tokens,
        "prompt_tokens_details": {"cached_tokens": 3},
    });
    if v["stream"].as_bool() == Some(true) {
        // A role-only first chunk (no content), then one token per chunk, then usage, [DONE].
        let itl = m.itl;
        let chunks = futures_util::stream::unfold(0u64, move |i| {
            let usage = usage.clone();
            async move {
                let data = if i == 0 {
                    serde_json::json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                } else if i <= max_tokens {
                    tokio::time::sleep(itl).await;
                    serde_json::json!({"choices": [{"index": 0, "text": format!(" t{i}")}]})
                } else if i == max_tokens + 1 {
                    serde_json::json!({"choices": [], "usage": usage})
                } else if i == max_tokens + 2 {
                    return Some((
                        Ok::<_, std::io::Error>(Bytes::from("data: [DONE]\n\n")),
                        i + 1,
                    ));
                } else {
                    return None;
                };
                Some((Ok(Bytes::from(format!("data: {data}\n\n"))), i + 1))
            }
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-cacheroute-destination", "2")
            .body(Body::from_stream(chunks))
            .unwrap();
    }
    let mut r = axum::Json(serde_json::json!({
        "choices": [{"index": 0, "text": "done"}],
        "usage": usage,
    }))
    .into_response();
    r.headers_mut()
        .insert("x-cacheroute-destination", "2".parse().unwrap());
    r
}

fn rec(key: &str, hash_ids: &[u64], input: u32, output: u32) -> TraceRecord {
    TraceRecord {
        timestamp_ms: 0.0,
        key: key.into(),
        input_length: input,
        output_length: output,
        hash_ids: hash_ids.to_vec(),
        session: None,
        turn: None,
    }
}

fn cfg(target: &str) -> ReplayConfig {
    let mut c = ReplayConfig::new(target);
    c.block_tokens = 16;
    c.timeout = Duration::from_secs(20);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_server_does_not_delay_later_sends() {
    let mut mock = Mock::new();
    mock.stall = Duration::from_millis(1500);
    let max_inflight = mock.max_inflight.clone();
    let url = mock.start().await;
    // 8 requests over 0.35 s; every response takes ≥ 1.5 s.
    let sched: Vec<_> = (0..8)
        .map(|i| (i as f64 * 0.05, rec(&format!("k{i}"), &[i], 16, 1)))
        .collect();
    let res = loadgen::replay(&cfg(&url), sched).await.unwrap();
    assert_eq!(res.records.len(), 8);
    // Open loop: all 8 were at the server together, before the first stall ended.
    assert_eq!(max_inflight.load(Ordering::SeqCst), 8);
    for r in &res.records {
        assert_eq!(r.record.status, Status::Ok, "{r:?}");
        let lag = r.lag_s().unwrap();
        assert!(
            (0.0..1.0).contains(&lag),
            "request {} left {lag} s late",
            r.record.id
        );
        // Latency is from the scheduled time and includes the stall.
        assert!(
            r.record.finish_s.unwrap() - r.record.scheduled_s >= 1.5,
            "{r:?}"
        );
    }
    let s = &res.summary;
    assert_eq!((s.requests, s.sent, s.ok), (8, 8, 8));
    assert!(s.e2e_p50_s >= 1.5 && s.lag_p99_s < 1.0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_hash_ids_are_equal_text_and_the_key_header_arrives() {
    let mock = Mock::new();
    let seen = mock.seen.clone();
    let url = mock.start().await;
    let sched = vec![
        (0.0, rec("alpha", &[1, 2], 32, 4)),
        (0.01, rec("beta", &[1, 2], 32, 4)),
        (0.02, rec("gamma", &[1, 3], 32, 4)),
    ];
    let res = loadgen::replay(&cfg(&url), sched).await.unwrap();
    let by_key: HashMap<String, String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.key.clone().expect("key header"), s.prompt.clone()))
        .collect();
    assert_eq!(by_key.len(), 3, "keys seen: {:?}", by_key.keys());
    assert_eq!(by_key["alpha"], by_key["beta"]);
    assert_ne!(by_key["alpha"], by_key["gamma"]);
    let first_block = |s: &str| s.split(' ').take(16).collect::<Vec<_>>().join(" ");
    assert_eq!(first_block(&by_key["alpha"]), first_block(&by_key["gamma"]));
    assert_eq!(by_key["alpha"].split(' ').count(), 32);
    for r in &res.records {
        assert_eq!(r.record.status, Status::Ok, "{r:?}");
        assert_eq!((r.record.prompt_tokens, r.record.output_tokens), (32, 4));
        assert_eq!(r.record.cached_tokens, Some(3));
        assert_eq!(r.record.destination, Some(2));
        assert_eq!(r.record.key, cacheroute::key_hash(&r.key));
        // Non-streaming: the first token is the whole answer.
        assert_eq!(r.record.first_token_s, r.record.finish_s);
    }

    // The chat endpoint carries the same text as its user message.
    let mut c = cfg(&url);
    c.endpoint = Endpoint::Chat;
    let res = loadgen::replay(&c, vec![(0.0, rec("delta", &[1, 2], 32, 4))])
        .await
        .unwrap();
    assert_eq!(res.records[0].record.status, Status::Ok);
    let seen = seen.lock().unwrap();
    let d = seen
        .iter()
        .find(|s| s.key.as_deref() == Some("delta"))
        .unwrap();
    assert_eq!(d.prompt, by_key["alpha"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_measures_ttft_inter_token_and_usage() {
    let mock = Mock::new();
    let url = mock.start().await;
    let mut c = cfg(&url);
    c.stream = true;
    let res = loadgen::replay(&c, vec![(0.0, rec("k", &[7], 20, 5))])
        .await
        .unwrap();
    let r = &res.records[0];
    assert_eq!(r.record.status, Status::Ok, "{r:?}");
    let (ttft, e2e) = (r.record.first_token_s.unwrap(), r.record.finish_s.unwrap());
    assert!(r.record.scheduled_s < ttft && ttft < e2e, "{r:?}");
    // Five tokens 30 ms apart: four gaps after the first token.
    assert!(e2e - ttft >= 0.1, "{r:?}");
    assert!(r.max_itl_s.unwrap() >= 0.025, "{r:?}");
    assert_eq!((r.record.prompt_tokens, r.record.output_tokens), (20, 5));
    assert_eq!(r.record.cached_tokens, Some(3));
    assert_eq!(r.destination_header.as_deref(), Some("2"));
    assert!(res.summary.ttft_p50_s < res.summary.e2e_p50_s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_is_counted_as_errors_not_delay() {
    let mut mock = Mock::new();
    mock.stall = Duration::from_millis(1000);
    let url = mock.start().await;
    let mut c = cfg(&url);
    c.max_inflight = 2;
    let sched: Vec<_> = (0..6)
        .map(|i| (i as f64 * 0.01, rec("k", &[1], 8, 1)))
        .collect();
    let res = loadgen::replay(&c, sched).await.unwrap();
    let st: Vec<_> = res.records.iter().map(|r| r.record.status).collect();
    assert_eq!(&st[..2], &[Status::Ok, Status::Ok]);
    assert!(st[2..].iter().all(|s| *s == Status::Overflow), "{st:?}");
    for r in &res.records[2..] {
        assert_eq!(r.record.sent_s, None);
        // Refused at its scheduled time, not after the stall.
        assert!(
            r.record.finish_s.unwrap() - r.record.scheduled_s < 0.5,
            "{r:?}"
        );
        assert!(r.error.as_deref().unwrap().contains("in-flight cap"));
    }
    assert_eq!(res.summary.errors.get("overflow"), Some(&4));
    assert_eq!(res.summary.sent, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_and_timeouts_are_recorded() {
    let mut mock = Mock::new();
    mock.status = 503;
    let url = mock.start().await;
    let res = loadgen::replay(&cfg(&url), vec![(0.0, rec("k", &[1], 8, 1))])
        .await
        .unwrap();
    let r = &res.records[0];
    assert_eq!(r.record.status, Status::Http(503));
    assert!(r.error.as_deref().unwrap().contains("overloaded"));
    assert_eq!(res.summary.errors.get("http_503"), Some(&1));

    let mut mock = Mock::new();
    mock.stall = Duration::from_secs(3);
    let url = mock.start().await;
    let mut c = cfg(&url);
    c.timeout = Duration::from_millis(200);
    let res = loadgen::replay(&c, vec![(0.0, rec("k", &[1], 8, 1))])
        .await
        .unwrap();
    assert_eq!(res.records[0].record.status, Status::Timeout);
    assert!(
        res.summary.wall_s < 2.5,
        "timed out requests must not wait for the server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_an_error_not_a_hang() {
    // A port that was just free: nothing listens on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sched: Vec<_> = (0..3)
        .map(|i| (i as f64 * 0.01, rec("k", &[1], 8, 1)))
        .collect();
    let res = tokio::time::timeout(
        Duration::from_secs(30),
        loadgen::replay(&cfg(&format!("http://127.0.0.1:{port}")), sched),
    )
    .await
    .expect("a refused connection must not hang the replay")
    .unwrap();
    for r in &res.records {
        assert_eq!(r.record.status, Status::Connect, "{r:?}");
        assert!(r.record.sent_s.is_some() && r.record.finish_s.is_some());
    }
    assert_eq!(res.summary.errors.get("connect"), Some(&3));
    assert!(res.summary.e2e_p99_s.is_nan());
}

#[test]
fn a_bad_target_is_refused_with_a_fix() {
    let e = loadgen::replay_blocking(&ReplayConfig::new("localhost:8000"), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("http://HOST:PORT"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_replays_a_trace_and_writes_records() {
    let mock = Mock::new();
    let seen = mock.seen.clone();
    let url = mock.start().await;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let out = dir.path().join("records.jsonl");
    let lines: Vec<String> = (0..5)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "key": "k{}", "input_length": 8, "output_length": 2, "hash_ids": [{}]}}"#,
                1000 + i * 20,
                i % 2,
                i % 2
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let args = [
        "replay",
        "--target",
        &url,
        "--trace",
        trace.to_str().unwrap(),
        "--block-size",
        "4",
        "--stream",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["requests"], 5);
    assert_eq!(s["ok"], 5);
    // No --model: the first id of the target's /v1/models.
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|x| x.model == "served-model"));
    // Served KV hit from usage.prompt_tokens_details.cached_tokens: 3 of 8 prompt tokens.
    assert!(
        (s["served_kv_hit"].as_f64().unwrap() - 3.0 / 8.0).abs() < 1e-9,
        "{s}"
    );
    assert_eq!(s["kv_hit_reported"], 5);
    assert_eq!(s["output_tokens"], 10);
    assert!(s["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    // Streamed, 2 tokens 30 ms apart: TPOT and every inter-token gap ≈ 30 ms.
    assert_eq!(s["stream"], true);
    for f in ["tpot_p50_s", "itl_p50_s", "itl_p99_s"] {
        let v = s[f].as_f64().unwrap();
        assert!((0.025..0.5).contains(&v), "{f} {v}: {s}");
    }
    assert!(s["ttft_p50_s"].as_f64().unwrap() < s["e2e_p50_s"].as_f64().unwrap());
    let recs: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 5);
    assert_eq!(recs[2]["status"], "ok");
    assert_eq!(recs[2]["key"], "k0");
    // The trace is shifted to start at 0 and keeps its 20 ms spacing.
    assert!((recs[2]["scheduled_s"].as_f64().unwrap() - 0.04).abs() < 1e-9);
    assert_eq!(seen.lock().unwrap().len(), 5);

    // A missing source is refused with a fix.
    let o = tokio::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["replay", "--target", &url])
        .output()
        .await
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--trace FILE or --workload"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_signal_cuts_the_schedule_and_keeps_what_was_sent() {
    let url = Mock::new().start().await;
    // 100 requests over 10 s; stop after about 0.3 s.
    let sched: Vec<_> = (0..100)
        .map(|i| (i as f64 * 0.1, rec("k", &[1], 8, 1)))
        .collect();
    let t0 = std::time::Instant::now();
    let res = loadgen::replay_until(
        &cfg(&url),
        sched,
        tokio::time::sleep(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the stop must not wait for the schedule"
    );
    assert!(res.interrupted);
    let n = res.records.len();
    assert!((1..50).contains(&n), "{n} requests dispatched");
    assert!(res.records.iter().all(|r| r.record.status == Status::Ok));
    assert!(res.summary.duration_s < 5.0, "{:?}", res.summary);
}

/// A trace of `n` requests `gap_ms` apart, 16-token prompts, 4 output tokens.
fn trace_file(dir: &std::path::Path, n: usize, gap_ms: usize) -> std::path::PathBuf {
    let p = dir.join("t.jsonl");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "key": "k{}", "input_length": 32, "output_length": 4, "hash_ids": [{}, {}]}}"#,
                i * gap_ms,
                i % 4,
                i % 4,
                100 + i
            )
        })
        .collect();
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

#[test]
fn replay_uses_the_served_model_and_stops_early_when_every_request_fails_alike() {
    use common::procs::{run, Proc};
    let emu = Proc::emulator(); // serves model `m` and answers 404 to any other
    let dir = tempfile::tempdir().unwrap();
    let trace = trace_file(dir.path(), 200, 10);
    let t = trace.to_str().unwrap();
    let base = [
        "replay",
        "--target",
        &emu.url,
        "--trace",
        t,
        "--block-size",
        "16",
    ];

    // No --model: the emulator's own, every request served; the summary says what it measured.
    let (st, out, err) = run(&base);
    assert!(st.success(), "{err}");
    assert!(err.contains("model m (the first at "), "{err}");
    assert!(out.contains("ok 200  errors 0"), "{out}");
    assert!(
        out.contains("ttft       -   (not measured: pass --stream"),
        "e2e is not labelled TTFT without --stream: {out}"
    );
    assert!(!out.contains("tpot") && !out.contains("itl "), "{out}");
    assert!(
        out.contains("kv hit     ") && out.contains("% served"),
        "{out}"
    );
    assert!(out.contains("tokens/s   output "), "{out}");

    // --stream: TTFT, TPOT and ITL lines.
    let mut args = base.to_vec();
    args.extend(["--stream", "--duration", "0.5"]);
    let (st, out, err) = run(&args);
    assert!(st.success(), "{err}");
    for l in ["ttft       p50 ", "tpot       p50 ", "itl        p50 "] {
        assert!(out.contains(l), "{l}: {out}");
    }

    // A model the engine does not serve: the first 20 fail alike, the run stops there.
    let mut args = base.to_vec();
    args.extend(["--model", "default", "--json"]);
    let t0 = std::time::Instant::now();
    let (st, out, err) = run(&args);
    assert!(!st.success());
    let last = err.trim().lines().last().unwrap();
    assert!(
        last.starts_with("error: the first 20 requests all failed with http_404 (")
            && last.contains("does not exist")
            && last.contains("stopped early"),
        "{err}"
    );
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        s["requests"].as_u64().unwrap() < 200,
        "the schedule (2 s) was cut: {s}"
    );
    assert!(t0.elapsed() < std::time::Duration::from_secs(30));

    // --fail-fast 0 replays every request whatever happens.
    let mut args = base.to_vec();
    args.extend([
        "--model",
        "default",
        "--json",
        "--fail-fast",
        "0",
        "--duration",
        "0.5",
    ]);
    let (st, out, _) = run(&args);
    assert!(st.success());
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["requests"], 50);
    assert_eq!(s["errors"]["http_404"], 50);
    assert!(s["served_kv_hit"].is_null(), "{s}");

    // A target without /v1/models and no --model: one line that says what to pass.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let (st, _, err) = run(&["replay", "--target", &url, "--trace", t]);
    assert!(!st.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("{url}/v1/models did not name a model"))
            && err.contains("pass --model NAME"),
        "{err}"
    );
}

// ---- Live sessions against `cacheroute emulate` (real HTTP, the project's engine emulator) ----

/// A session turn: trace time `ms`, its session and turn, lengths as the generator grows them
/// (each turn's prompt = the previous prompt + answer + an 8-token message).
fn turn(ms: f64, session: &str, turn: u32, output: u32) -> TraceRecord {
    let input = 32 + (turn - 1) * (output + 8);
    let base = session.bytes().map(u64::from).sum::<u64>() * 1000;
    TraceRecord {
        timestamp_ms: ms,
        key: format!("key-{session}"),
        input_length: input,
        output_length: output,
        hash_ids: (0..input.div_ceil(16) as u64).map(|i| base + i).collect(),
        session: Some(session.into()),
        turn: Some(turn),
    }
}

/// `sessions` sessions of 3 turns; session i starts at i × 50 ms, its turns 100 ms apart.
fn session_schedule(sessions: usize, output: u32) -> Vec<(f64, TraceRecord)> {
    let mut v: Vec<(f64, TraceRecord)> = (0..sessions)
        .flat_map(|i| {
            (1..=3u32).map(move |k| {
                let ms = i as f64 * 50.0 + (k - 1) as f64 * 100.0;
                (ms / 1000.0, turn(ms, &format!("s{i}"), k, output))
            })
        })
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// An emulator whose every answer takes at least `delay_ms` (its front-end delay, real time).
fn slow_emulator(delay_ms: &str) -> common::procs::Proc {
    common::procs::Proc::start(&[
        "emulate",
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "tiny:cpu:bf16:tp1",
        "--block-tokens",
        "16",
        "--frontend-delay-ms",
        delay_ms,
        "--model-name",
        "m",
    ])
}

fn live_cfg(url: &str) -> ReplayConfig {
    let mut c = cfg(url);
    c.model = "m".into();
    c.sessions = loadgen::Sessions::Live;
    c.keep_text = true;
    c
}

/// Records of session `s` in turn order.
fn turns_of<'a>(rs: &'a [loadgen::ReplayRecord], s: &str) -> Vec<&'a loadgen::ReplayRecord> {
    let mut v: Vec<_> = rs
        .iter()
        .filter(|r| r.session.as_deref() == Some(s))
        .collect();
    v.sort_by_key(|r| r.turn);
    v
}

/// The emulator's answer to `prompt` asked directly (its text is a function of the prompt).
async fn answer_to(url: &str, prompt: &str, max_tokens: u32) -> String {
    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
    let bytes = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_sessions_send_turns_after_answers_with_the_answer_in_the_prompt() {
    let emu = slow_emulator("300");
    // Streamed and not: the answer text is collected either way.
    for stream in [false, true] {
        let mut c = live_cfg(&emu.url);
        c.stream = stream;
        let res = loadgen::replay(&c, session_schedule(4, 6)).await.unwrap();
        assert_eq!(res.records.len(), 12);
        for i in 0..4 {
            let t = turns_of(&res.records, &format!("s{i}"));
            assert_eq!(t.len(), 3);
            for r in &t {
                assert_eq!(r.record.status, Status::Ok, "{r:?}");
            }
            // Open loop across sessions: each first turn left at its own time (i × 50 ms),
            // while the earlier sessions' first answers (≥ 300 ms) were still outstanding.
            assert!(t[0].lag_s().unwrap() < 0.1, "{:?}", t[0]);
            if i > 0 {
                let s0 = turns_of(&res.records, "s0");
                assert!(t[0].record.sent_s.unwrap() < s0[0].record.finish_s.unwrap());
            }
            for w in t.windows(2) {
                let (a, b) = (w[0], w[1]);
                // Turn n+1 never before turn n's answer.
                assert!(
                    b.record.sent_s.unwrap() >= a.record.finish_s.unwrap(),
                    "{a:?} {b:?}"
                );
                // The trace's gap (100 ms) is shorter than the answer (≥ 300 ms): late, by
                // the answer's overrun.
                let late = b.late_s.expect("a late turn");
                assert!(late > 0.15 && late < 1.0, "{b:?}");
                // Its prompt is the previous prompt + the answer as received + a new message.
                let (pa, aa, pb) = (
                    a.prompt.as_deref().unwrap(),
                    a.answer.as_deref().unwrap(),
                    b.prompt.as_deref().unwrap(),
                );
                assert_eq!(cacheroute::workload::text::count_tokens(aa), 6);
                let carried = format!("{pa}{aa}");
                assert!(pb.starts_with(&carried), "{pb:?} lacks {carried:?}");
                assert_eq!(
                    cacheroute::workload::text::count_tokens(&pb[carried.len()..]),
                    8
                );
                // The engine counted exactly that prompt …
                assert_eq!(
                    b.record.prompt_tokens,
                    cacheroute::workload::text::count_tokens(pb)
                );
            }
            // … and answered that prompt: the same text asked directly gives the same answer
            // (the emulator's answer is a function of the prompt it received).
            let last = t[2];
            assert_eq!(
                answer_to(&emu.url, last.prompt.as_deref().unwrap(), 6).await,
                *last.answer.as_ref().unwrap()
            );
        }
        let s = res.summary.sessions.as_ref().expect("session figures");
        assert_eq!(
            (s.sessions, s.turns, s.turns_sent, s.turns_late),
            (4, 12, 12, 8)
        );
        assert_eq!((s.sessions_abandoned, s.turns_abandoned), (0, 0));
        // The emulator caches prompt blocks: later turns hit the earlier turn's prompt.
        assert!(s.later_turns_kv_hit > 0.3, "{s:?}");
    }

    // Without the mode nothing changes: every turn at its own time (before the previous
    // answer), its prompt synthesised from the trace.
    let mut c = cfg(&emu.url);
    c.model = "m".into();
    c.keep_text = true;
    let res = loadgen::replay(&c, session_schedule(1, 6)).await.unwrap();
    let t = &res.records;
    assert!(
        t[1].record.sent_s.unwrap() < t[0].record.finish_s.unwrap(),
        "{t:?}"
    );
    assert!(res.summary.sessions.is_none() && t.iter().all(|r| r.late_s.is_none()));
    let (a, b) = (&t[0], &t[1]);
    assert!(!b
        .prompt
        .as_deref()
        .unwrap()
        .contains(a.answer.as_deref().unwrap().trim()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_chat_sessions_send_the_conversation_as_messages() {
    let emu = slow_emulator("20");
    let mut c = live_cfg(&emu.url);
    c.endpoint = Endpoint::Chat;
    let res = loadgen::replay(&c, session_schedule(1, 5)).await.unwrap();
    let t = turns_of(&res.records, "s0");
    for w in t.windows(2) {
        let (a, b) = (w[0], w[1]);
        assert_eq!(b.record.status, Status::Ok, "{b:?}");
        // The emulator reads a chat as its messages' contents joined by newlines: user,
        // assistant (the answer as received), user.
        let pb = b.prompt.as_deref().unwrap();
        let expect = format!(
            "{}\n{}\n",
            a.prompt.as_deref().unwrap(),
            a.answer.as_deref().unwrap()
        );
        assert!(pb.starts_with(&expect), "{pb:?}");
        assert_eq!(
            b.record.prompt_tokens,
            cacheroute::workload::text::count_tokens(pb)
        );
        // It answered that conversation (the same text asked directly: the same words).
        assert_eq!(
            answer_to(&emu.url, pb, 5).await.trim(),
            b.answer.as_deref().unwrap().trim()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_drops_the_turns_still_waiting_for_their_time() {
    let emu = slow_emulator("10");
    let mut c = live_cfg(&emu.url);
    c.think_time = loadgen::ThinkTime::Fixed(2.0);
    let stop = tokio::time::sleep(Duration::from_millis(600));
    let res = loadgen::replay_until(&c, session_schedule(3, 4), stop)
        .await
        .unwrap();
    assert!(res.interrupted);
    // Every first turn was sent and answered; the later ones were still thinking at the stop:
    // not sent, not recorded, not counted as errors.
    assert_eq!(res.records.len(), 3, "{:?}", res.records);
    assert!(res
        .records
        .iter()
        .all(|r| r.turn == Some(1) && r.record.status == Status::Ok));
    assert_eq!(res.summary.error_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_think_time_follows_each_answer() {
    let emu = slow_emulator("50");
    let mut c = live_cfg(&emu.url);
    c.think_time = loadgen::ThinkTime::Fixed(0.4);
    let res = loadgen::replay(&c, session_schedule(2, 4)).await.unwrap();
    for s in ["s0", "s1"] {
        let t = turns_of(&res.records, s);
        for w in t.windows(2) {
            let (a, b) = (w[0], w[1]);
            assert_eq!(b.record.status, Status::Ok, "{b:?}");
            // Never before the answer + the think time; latency counted from then.
            let ready = a.record.finish_s.unwrap() + 0.4;
            assert!(b.record.sent_s.unwrap() >= ready - 1e-6, "{a:?} {b:?}");
            assert!((b.record.scheduled_s - ready).abs() < 1e-6, "{b:?}");
            assert!(b.late_s.is_none());
        }
    }
    assert_eq!(res.summary.sessions.as_ref().unwrap().turns_late, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_abandons_the_rest_of_its_session_only() {
    let emu = slow_emulator("10");
    let mut sched = session_schedule(3, 4);
    // Session s1's second turn asks for more tokens than the emulated KV cache holds: the
    // engine refuses it (400), and s1 has no answer to continue from.
    for (_, r) in &mut sched {
        if r.session.as_deref() == Some("s1") && r.turn == Some(2) {
            r.output_length = 50_000_000;
        }
    }
    let res = loadgen::replay(&live_cfg(&emu.url), sched).await.unwrap();
    let t = turns_of(&res.records, "s1");
    assert_eq!(t[0].record.status, Status::Ok);
    assert_eq!(t[1].record.status, Status::Http(400), "{:?}", t[1]);
    assert_eq!(t[2].record.status, Status::Abandoned);
    assert!(t[2].record.sent_s.is_none());
    let why = t[2].error.as_deref().unwrap();
    assert!(why.contains("turn 2 of session s1 ended http_400"), "{why}");
    for s in ["s0", "s2"] {
        assert!(turns_of(&res.records, s)
            .iter()
            .all(|r| r.record.status == Status::Ok));
    }
    let s = res.summary.sessions.as_ref().unwrap();
    assert_eq!((s.turns, s.turns_sent), (9, 8));
    assert_eq!((s.sessions_abandoned, s.turns_abandoned), (1, 1));
    assert_eq!(res.summary.errors.get("abandoned"), Some(&1));
    assert_eq!(res.summary.errors.get("http_400"), Some(&1));
}

#[test]
fn the_cli_replays_live_sessions_and_refuses_bad_session_flags() {
    let emu = slow_emulator("20");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sessions.jsonl");
    let mut text = String::new();
    for (_, r) in session_schedule(2, 4) {
        text.push_str(&serde_json::to_string(&r).unwrap());
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    let p = path.to_str().unwrap();
    let live = [
        "replay",
        "--target",
        &emu.url,
        "--trace",
        p,
        "--block-tokens",
        "16",
        "--sessions",
        "live",
    ];
    let (st, out, err) =
        common::procs::run(&[&live[..], &["--think-time-s", "0.1", "--json"]].concat());
    assert!(st.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["sessions"]["turns_sent"], 6, "{v}");
    assert_eq!(v["sessions"]["sessions"], 2, "{v}");
    let (st, out, _) = common::procs::run(&live);
    assert!(st.success());
    assert!(out.contains("sessions   2 live: turns 6  sent 6"), "{out}");
    for (args, needle) in [
        (vec!["--think-time-s", "1"], "--think-time-s"),
        (
            vec!["--sessions", "live", "--think-time-s", "exp:0"],
            "--think-time-s",
        ),
        (vec!["--sessions", "sometimes"], "--sessions"),
    ] {
        let mut a = vec!["replay", "--target", &emu.url, "--trace", p];
        a.extend(args);
        let (st, _, err) = common::procs::run(&a);
        assert!(!st.success());
        let first = err.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        assert!(first.contains(needle), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_times_plus_the_start_are_the_servers_wall_clock() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut ecfg = cacheroute::emulate::EmulatorConfig::new("llama-3.1-8b:h100:fp8:tp1");
    ecfg.time_scale = cacheroute::emulate::TimeScale::new(20.0).unwrap();
    ecfg.model_name = Some("m".into());
    ecfg.request_log = Some(log.clone());
    let h = cacheroute::emulate::start(ecfg).await.unwrap();
    let mut c = cfg(&h.base_url());
    c.model = "m".into();
    c.stream = true;
    let sched: Vec<_> = (0..6)
        .map(|i| (0.1 + i as f64 * 0.08, rec(&format!("k{i}"), &[i], 16, 3)))
        .collect();
    let res = loadgen::replay(&c, sched).await.unwrap();
    h.shutdown().await.unwrap();
    let mut arrivals: Vec<f64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["arrival_s"]
                .as_f64()
                .unwrap()
        })
        .collect();
    arrivals.sort_by(f64::total_cmp);
    assert_eq!(arrivals.len(), 6);
    for (r, a) in res.records.iter().zip(&arrivals) {
        assert_eq!(r.record.status, Status::Ok, "{r:?}");
        // The server saw each request after it was due and after the replayer sent it, and
        // (80 ms apart) before the next was due.
        let due = res.start_unix_s + r.record.scheduled_s;
        let sent = res.start_unix_s + r.record.sent_s.unwrap();
        assert!(
            due - 0.002 <= *a && sent - 0.002 <= *a && *a < due + 0.08,
            "{r:?} arrived {a}"
        );
    }
}
