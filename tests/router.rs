//! The live router over loopback: mock engines on ephemeral ports, the router in process (and
//! once as the `cacheroute route` binary). No speed assertions; timing bounds are generous.

mod common;

use cacheroute::policy::PolicySpec;
use cacheroute::router::{self, RouterConfig, RouterHandle};
use common::mock_engine::{json_body, sse_body, MockConfig, MockEngine};
use common::raw::{one_backend, read_request};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// JSON without reqwest's `json` feature (the crate does not enable it).
trait JsonReq {
    fn json_body(self, v: &Value) -> Self;
}
impl JsonReq for reqwest::RequestBuilder {
    fn json_body(self, v: &Value) -> Self {
        self.header("content-type", "application/json")
            .body(v.to_string())
    }
}
trait JsonResp {
    async fn json_value(self) -> Result<Value, String>;
}
impl JsonResp for reqwest::Response {
    async fn json_value(self) -> Result<Value, String> {
        let b = self.bytes().await.map_err(|e| e.to_string())?;
        serde_json::from_slice(&b).map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&b)))
    }
}

async fn mocks(n: usize, cfg: MockConfig) -> Vec<MockEngine> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(MockEngine::start(&format!("m{i}"), cfg.clone()).await);
    }
    v
}

fn config(ms: &[MockEngine], policy: &str) -> RouterConfig {
    let mut c = RouterConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        ms.iter().map(|m| m.url()).collect(),
        PolicySpec::from_name(policy).unwrap(),
    );
    c.health_interval = Duration::from_millis(200);
    c.health_timeout = Duration::from_millis(500);
    c.first_byte_timeout = Duration::from_secs(5);
    c.idle_timeout = Duration::from_secs(5);
    c.drain_timeout = Duration::from_secs(10);
    c.admin_token = Some("sekret".into());
    c
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

async fn post(
    c: &reqwest::Client,
    h: &RouterHandle,
    key: &str,
    id: &str,
    body: Value,
) -> reqwest::Response {
    c.post(format!("{}/v1/completions", h.url()))
        .header("x-cacheroute-key", key)
        .header("x-test-id", id)
        .json_body(&body)
        .send()
        .await
        .unwrap()
}

fn dest_of(r: &reqwest::Response) -> usize {
    r.headers()["x-cacheroute-destination"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

async fn admin(c: &reqwest::Client, h: &RouterHandle, path: &str) -> Value {
    c.get(format!("{}{path}", h.url()))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
        .json_value()
        .await
        .unwrap()
}

/// `POST /admin/reload` with the admin token.
async fn reload(c: &reqwest::Client, h: &RouterHandle) -> reqwest::Response {
    c.post(format!("{}/admin/reload", h.url()))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
}

async fn assert_json_error(r: reqwest::Response, status: u16) {
    assert_eq!(r.status().as_u16(), status);
    let v: Value = r.json_value().await.expect("error body is JSON");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(v["error"]["type"].as_str().is_some(), "{v}");
}

/// `n` mock engines streaming `chunks` SSE chunks 100 ms apart, behind a flat-lb router serving
/// on `workers` threads of its own (0: on the test's runtime).
async fn streaming_fleet(
    n: usize,
    chunks: usize,
    workers: usize,
) -> (Vec<MockEngine>, RouterHandle) {
    let cfg = MockConfig {
        chunks,
        chunk_delay: Duration::from_millis(100),
        first_delay: Duration::ZERO,
    };
    let ms = mocks(n, cfg).await;
    let h = router::start(RouterConfig {
        workers,
        ..config(&ms, "flat-lb")
    })
    .await
    .unwrap();
    (ms, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_byte_exact_and_unbuffered() {
    // On the caller's runtime, and on two serving workers of their own (SO_REUSEPORT).
    for workers in [0, 2] {
        streaming_is_byte_exact_and_unbuffered_with(workers).await;
    }
}

async fn streaming_is_byte_exact_and_unbuffered_with(workers: usize) {
    let (ms, h) = streaming_fleet(1, 10, workers).await;
    let c = client();
    let t0 = Instant::now();
    let r = post(
        &c,
        &h,
        "k",
        "s1",
        json!({"model": "m", "prompt": "hi", "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(dest_of(&r), 0);
    let mut body = Vec::new();
    let mut arrivals = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(chunk) = s.next().await {
        body.extend_from_slice(&chunk.unwrap());
        arrivals.push(t0.elapsed());
    }
    assert_eq!(String::from_utf8(body).unwrap(), sse_body("m0", 10));
    // The mock produces its last bytes about 1.1 s after the first; unbuffered passthrough
    // delivers the first chunk long before that.
    let first = arrivals[0];
    let last = *arrivals.last().unwrap();
    assert!(
        last.saturating_sub(first) > Duration::from_millis(500),
        "first chunk at {first:?}, last at {last:?}: the router buffered the stream"
    );
    assert!(
        arrivals.len() >= 5,
        "only {} reads: chunks were merged",
        arrivals.len()
    );

    // Non-streaming: the backend's body verbatim.
    let r = post(&c, &h, "k", "s2", json!({"model": "m", "prompt": "hi"})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), json_body("m0"));

    // Chat completions and models pass through too.
    let r = c
        .post(format!("{}/v1/chat/completions", h.url()))
        .json_body(&json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(ms[0].seen().last().unwrap().path, "/v1/chat/completions");
    let r = c
        .get(format!("{}/v1/models", h.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("\"mock\""));
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_choice_is_observed_at_the_backends() {
    for policy in [
        "flat-lb",
        "sticky",
        "chwbl",
        "dualmap",
        "preble",
        "cacheroute",
        "cacheroute-affinity",
        "cacheroute-replication",
        "cacheroute-prefix-tail",
    ] {
        let ms = mocks(3, MockConfig::default()).await;
        let mut cfg = config(&ms, policy);
        if let PolicySpec::Cacheroute(c) = &mut cfg.policy {
            c.interval_s = 0.2;
        }
        let h = router::start(cfg).await.unwrap();
        let c = client();
        let mut by_key: std::collections::HashMap<String, Vec<usize>> = Default::default();
        for i in 0..60 {
            let key = format!("key{}", i % 4);
            let id = format!("{policy}-{i}");
            let prompt = format!("{key} shared prefix words here {}", "w ".repeat(40));
            let r = post(
                &c,
                &h,
                &key,
                &id,
                json!({"model": "m", "prompt": prompt, "max_tokens": 8}),
            )
            .await;
            assert_eq!(r.status(), 200, "{policy}");
            let d = dest_of(&r);
            // The destination the router named is the backend that saw the request.
            assert!(
                ms[d]
                    .seen()
                    .iter()
                    .any(|s| s.test_id.as_deref() == Some(id.as_str())),
                "{policy}: request {id} routed to {d} but not seen there"
            );
            by_key.entry(key).or_default().push(d);
            if policy.starts_with("cacheroute") && i % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(120)).await;
            }
        }
        let total: u64 = ms.iter().map(|m| m.hits()).sum();
        assert_eq!(total, 60, "{policy}");
        if policy == "sticky" {
            for (k, ds) in &by_key {
                assert!(ds.iter().all(|d| *d == ds[0]), "sticky moved {k}: {ds:?}");
            }
        }
        if policy.starts_with("cacheroute") {
            // The control loop planned from measured rates; admitted keys follow the table.
            let stats = admin(&c, &h, "/admin/stats").await;
            assert!(
                stats["decisions"]["table_hit"].as_u64().unwrap() > 0,
                "{policy}: {stats}"
            );
            // A plan is rebuilt every 0.2 s: a check whose plan changed while its request was
            // in flight is taken again.
            let mut checked = 0;
            for _attempt in 0..20 {
                let plan = admin(&c, &h, "/admin/plan?table=true").await;
                assert_eq!(plan["installed"], true, "{policy}: {plan}");
                let table = plan["table"].as_object().unwrap();
                let mut seen = Vec::new();
                for i in 0..4 {
                    // Keys sent in the header are shown by name (the admin API is on).
                    let key = format!("key{i}");
                    if let Some(set) = table.get(&key) {
                        let set: Vec<usize> = set
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|d| d.as_u64().unwrap() as usize)
                            .collect();
                        let r =
                            post(&c, &h, &key, "after", json!({"model": "m", "prompt": "x"})).await;
                        seen.push((key, set, dest_of(&r)));
                    }
                }
                let again = admin(&c, &h, "/admin/plan").await;
                if again["installed_at_s"] != plan["installed_at_s"] {
                    continue;
                }
                for (key, set, d) in &seen {
                    assert!(
                        set.contains(d),
                        "{policy}: {key} left its planned set {set:?} for {d}"
                    );
                }
                checked = seen.len();
                break;
            }
            assert!(
                checked > 0,
                "{policy}: no admitted key checked under a steady plan"
            );
        }
        assert!(h.shutdown().await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_destination_loses_no_request_and_traffic_fails_over() {
    let cfg = MockConfig {
        first_delay: Duration::from_millis(20),
        ..Default::default()
    };
    let ms = std::sync::Arc::new(mocks(3, cfg).await);
    let h = std::sync::Arc::new(router::start(config(&ms, "sticky")).await.unwrap());
    let c = client();
    let t0 = Instant::now();
    let run_for = Duration::from_millis(2500);
    let mut tasks = Vec::new();
    for w in 0..6 {
        let (c, h) = (c.clone(), h.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let mut i = 0;
            while t0.elapsed() < run_for {
                let key = format!("user{}", (w * 7 + i) % 23);
                let r = post(
                    &c,
                    &h,
                    &key,
                    &format!("{w}-{i}"),
                    json!({"model": "m", "prompt": "p"}),
                )
                .await;
                out.push((r.status().as_u16(), dest_of(&r)));
                i += 1;
            }
            out
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = ms[1].hits();
    ms[1].kill();
    // Within one health interval (200 ms) plus slack, destination 1 is down and gets nothing.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stats = admin(&c, &h, "/admin/stats").await;
    assert_eq!(stats["destinations"][1]["up"], false, "{stats}");
    let sent_then = stats["destinations"][1]["requests"].as_u64().unwrap();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let stats = admin(&c, &h, "/admin/stats").await;
    assert_eq!(
        stats["destinations"][1]["requests"].as_u64().unwrap(),
        sent_then,
        "traffic still went to the dead destination: {stats}"
    );
    assert!(before > 0, "destination 1 got no traffic before the kill");
    assert!(all.len() > 50);
    assert!(
        all.iter().all(|(s, _)| *s == 200),
        "lost requests: {:?}",
        all.iter().filter(|x| x.0 != 200).collect::<Vec<_>>()
    );
    assert!(all.iter().any(|(_, d)| *d != 1));
}

/// A stalled (slow) destination: each request sent there gets a 504 after the first-byte
/// timeout and is not sent to a second engine (it may still be generating there); the
/// destination stays up while its health probes pass, and the others serve normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_destination_times_requests_out_without_retrying_or_being_marked_down() {
    let ms = mocks(2, MockConfig::default()).await;
    ms[0].set_stall(true);
    let mut cfg = config(&ms, "flat-lb");
    cfg.first_byte_timeout = Duration::from_millis(300);
    let h = router::start(cfg).await.unwrap();
    let c = client();
    let mut timed_out = 0;
    for i in 0..12 {
        let r = post(
            &c,
            &h,
            &format!("k{i}"),
            &i.to_string(),
            json!({"model": "m", "prompt": "p"}),
        )
        .await;
        if r.status() == 504 {
            timed_out += 1;
            let v: Value = r.json_value().await.unwrap();
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.contains("not retried"), "{m}");
        } else {
            assert_eq!(r.status(), 200);
            assert_eq!(dest_of(&r), 1);
        }
    }
    assert!(timed_out > 0, "the stalled destination was never tried");
    // One engine per request: no request was generated twice.
    assert_eq!(ms[0].hits() + ms[1].hits(), 12);
    assert_eq!(ms[0].hits(), timed_out);
    let stats = admin(&c, &h, "/admin/stats").await;
    assert_eq!(stats["retries"], 0, "{stats}");
    assert_eq!(stats["destinations"][0]["up"], true, "{stats}");
    assert_eq!(stats["destinations"][0]["marked_down"], 0, "{stats}");
    assert_eq!(
        stats["destinations"][0]["first_byte_timeouts"].as_u64(),
        Some(timed_out)
    );
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_json_4xx_and_the_router_keeps_serving() {
    let ms = mocks(2, MockConfig::default()).await;
    let h = router::start(config(&ms, "cacheroute")).await.unwrap();
    let c = client();
    let url = format!("{}/v1/completions", h.url());
    let send = |body: Vec<u8>| {
        c.post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    assert_json_error(
        send(b"{\"prompt\": \"unterminated".to_vec()).await.unwrap(),
        400,
    )
    .await;
    assert_json_error(send(b"[1, 2, 3]".to_vec()).await.unwrap(), 400).await;
    // A 10 MB body: the router answers 413 from the Content-Length alone, before reading the
    // body, and closes; a client still writing then sees a broken pipe, so read the answer
    // over a raw connection that announces the body and waits.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            10 << 20
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let _ = tcp.write_all(&vec![b'a'; 64 << 10]).await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            tcp.read_to_end(&mut buf),
        )
        .await;
        let text = String::from_utf8_lossy(&buf);
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(text.contains("\"error\""), "{text}");
    }
    if let Ok(r) = send(vec![b'a'; 10 << 20]).await {
        assert_json_error(r, 413).await;
    }
    assert_json_error(
        send(b"{\"prompt\": \"\xff\xfe bad\"}".to_vec())
            .await
            .unwrap(),
        400,
    )
    .await;
    assert_json_error(send(b"{\"model\": \"m\"}".to_vec()).await.unwrap(), 400).await;
    assert_json_error(send(b"{\"prompt\": 5}".to_vec()).await.unwrap(), 400).await;
    let r = c
        .post(&url)
        .header("x-cacheroute-key", "")
        .json_body(&json!({"model": "m"}))
        .send()
        .await
        .unwrap();
    assert_json_error(r, 400).await;
    assert_json_error(
        c.get(format!("{}/v2/nothing", h.url()))
            .send()
            .await
            .unwrap(),
        404,
    )
    .await;
    assert_json_error(c.get(&url).send().await.unwrap(), 405).await;
    // Admin needs the token.
    assert_json_error(
        c.get(format!("{}/admin/stats", h.url()))
            .send()
            .await
            .unwrap(),
        401,
    )
    .await;
    assert_json_error(
        c.get(format!("{}/admin/stats", h.url()))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap(),
        401,
    )
    .await;
    assert_eq!(
        ms[0].hits() + ms[1].hits(),
        0,
        "a bad request reached a backend"
    );
    // Still serving: user-keyed, prompt-keyed and chat requests.
    for body in [
        json!({"model": "m", "prompt": "p", "user": "alice"}),
        json!({"model": "m", "prompt": "a prompt without any key"}),
        json!({"model": "m", "prompt": [1, 2, 3]}),
        json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ] {
        let r = c.post(&url).json_body(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{body}");
    }
    let m = metrics_text(&c, &h).await;
    assert!(m.contains("cacheroute_router_rejected_total 10"), "{m}");
    assert!(
        m.contains("cacheroute_destination_outstanding{destination=\"0\""),
        "{m}"
    );
    assert!(
        m.contains("cacheroute_decisions_total{path=\"fallback\",policy=\"cacheroute\"} 4"),
        "{m}"
    );
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_destination_up_gives_503() {
    let ms = mocks(2, MockConfig::default()).await;
    let h = router::start(config(&ms, "chwbl")).await.unwrap();
    let c = client();
    for m in &ms {
        m.kill();
    }
    let mut last = 0;
    for i in 0..4 {
        let r = post(
            &c,
            &h,
            "k",
            &i.to_string(),
            json!({"model": "m", "prompt": "p"}),
        )
        .await;
        last = r.status().as_u16();
        assert!(last == 502 || last == 503, "{last}");
        let v: Value = r.json_value().await.unwrap();
        assert!(v["error"]["message"].is_string());
    }
    assert_eq!(last, 503);
    let r = c.get(format!("{}/health", h.url())).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_streams() {
    // On the caller's runtime, and on two serving workers of their own (SO_REUSEPORT).
    for workers in [0, 2] {
        graceful_shutdown_drains_streams_with(workers).await;
    }
}

async fn graceful_shutdown_drains_streams_with(workers: usize) {
    let (_ms, h) = streaming_fleet(2, 8, workers).await;
    let url = h.url();
    let c = client();
    let mut streams = Vec::new();
    for i in 0..3 {
        let r = post(
            &c,
            &h,
            &format!("k{i}"),
            "d",
            json!({"model": "m", "prompt": "p", "stream": true}),
        )
        .await;
        assert_eq!(r.status(), 200);
        let name = format!("m{}", dest_of(&r));
        streams.push(tokio::spawn(async move {
            let mut body = Vec::new();
            let mut s = r.bytes_stream();
            while let Some(b) = s.next().await {
                body.extend_from_slice(&b.expect("stream cut during drain"));
            }
            (String::from_utf8(body).unwrap(), name)
        }));
    }
    let t0 = Instant::now();
    let drained = h.shutdown().await;
    assert!(drained);
    assert!(
        t0.elapsed() > Duration::from_millis(300),
        "shutdown did not wait for streams"
    );
    for s in streams {
        let (body, name) = s.await.unwrap();
        assert_eq!(body, sse_body(&name, 8));
    }
    // Closed for new connections.
    assert!(reqwest::Client::new()
        .get(format!("{url}/health"))
        .send()
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_file_is_installed_and_reloadable() {
    let ms = mocks(3, MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    std::fs::write(
        &path,
        json!({"destinations": 3, "table": {"alpha": [2], "beta": [0, 1]}}).to_string(),
    )
    .unwrap();
    let mut cfg = config(&ms, "cacheroute");
    cfg.plan_file = Some(path.clone());
    let h = router::start(cfg).await.unwrap();
    let c = client();
    for i in 0..10 {
        let r = post(
            &c,
            &h,
            "alpha",
            &i.to_string(),
            json!({"model": "m", "prompt": "p"}),
        )
        .await;
        assert_eq!(dest_of(&r), 2);
        let r = post(
            &c,
            &h,
            "beta",
            &i.to_string(),
            json!({"model": "m", "prompt": "p"}),
        )
        .await;
        assert!(dest_of(&r) < 2);
    }
    let plan = admin(&c, &h, "/admin/plan?table=true").await;
    assert_eq!(plan["source"], "file");
    assert_eq!(plan["table"]["alpha"], json!([2]));
    std::fs::write(
        &path,
        json!({"destinations": 3, "table": {"alpha": [1]}}).to_string(),
    )
    .unwrap();
    let r = reload(&c, &h).await;
    assert_eq!(r.status(), 200);
    let r = post(&c, &h, "alpha", "x", json!({"model": "m", "prompt": "p"})).await;
    assert_eq!(dest_of(&r), 1);
    // A bad file is refused with a reason, and the old plan stays.
    std::fs::write(
        &path,
        json!({"destinations": 3, "table": {"alpha": [7]}}).to_string(),
    )
    .unwrap();
    let r = reload(&c, &h).await;
    assert_json_error(r, 422).await;
    let r = post(&c, &h, "alpha", "y", json!({"model": "m", "prompt": "p"})).await;
    assert_eq!(dest_of(&r), 1);
    // Every plan installed is in the history, oldest first, as its record: the two files'
    // (a file's plan has no settings), not the refused one.
    let plan = admin(&c, &h, "/admin/plan?history=true").await;
    let history = plan["history"].as_array().expect("history");
    assert_eq!(history.len(), 2, "{plan}");
    assert_eq!(history[0]["admitted"], 2, "{plan}");
    assert_eq!(history[1]["admitted"], 1, "{plan}");
    assert!(history[1]["churn"].as_f64().unwrap() > 0.0, "{plan}");
    assert!(history[1]["q_cap"].is_null(), "{plan}");
    assert_eq!(plan["history_dropped"], 0);
    assert!(plan.get("history").is_some() && plan["installed_at_s"] == history[1]["at_s"]);
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_prints_its_address_and_routes() {
    use tokio::io::AsyncBufReadExt;
    let ms = mocks(2, MockConfig::default()).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["route", "--listen", "127.0.0.1:0", "--policy", "sticky"])
        .args(["--backend", &ms[0].url(), "--backend", &ms[1].url()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let url = line.strip_prefix("listening on ").expect(&line).to_string();
    let r = client()
        .post(format!("{url}/v1/completions"))
        .json_body(&json!({"model": "m", "prompt": "p", "user": "bob"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    child.kill().await.unwrap();

    // A bad configuration fails with a one-line cause.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args([
            "route",
            "--policy",
            "nope",
            "--backend",
            "http://127.0.0.1:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_workers_share_one_port_and_refuse_a_taken_one() {
    let ms = mocks(2, MockConfig::default()).await;
    let h = router::start(RouterConfig {
        workers: 2,
        ..config(&ms, "sticky")
    })
    .await
    .unwrap();
    // Many connections at once: every request is answered, by the key's destination.
    let mut tasks = Vec::new();
    for i in 0..64 {
        let url = h.url();
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let r = c
                .post(format!("{url}/v1/completions"))
                .header("x-cacheroute-key", format!("k{}", i % 4))
                .json_body(&json!({"model": "m", "prompt": "p"}))
                .send()
                .await
                .unwrap();
            (i % 4, r.status().as_u16(), dest_of(&r))
        }));
    }
    let mut by_key = std::collections::HashMap::new();
    for t in tasks {
        let (k, status, d) = t.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(*by_key.entry(k).or_insert(d), d, "sticky key {k} moved");
    }
    // A second router on the same address fails to start instead of sharing the port.
    let e = router::start(RouterConfig {
        workers: 2,
        listen: h.addr(),
        ..config(&ms, "sticky")
    })
    .await
    .err()
    .expect("the port is taken");
    assert!(e.to_string().contains("cannot listen on"), "{e}");
    assert!(h.shutdown().await);
}

const CLOSING_BODY: &str = r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}"#;

/// A bare HTTP/1.1 backend on a raw socket: answers every request with a small JSON body and
/// closes each connection after it has been idle for 200 ms (as engines' servers close idle
/// keep-alive connections). Records (connection number, request line, Host header).
async fn closing_backend() -> (String, Arc<Mutex<Vec<(usize, String, String)>>>) {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<(usize, String, String)>>> = Default::default();
    let log = seen.clone();
    tokio::spawn(async move {
        let mut conn_no = 0;
        while let Ok((mut s, _)) = l.accept().await {
            conn_no += 1;
            let (n, log) = (conn_no, log.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                // Idle for 200 ms, or the peer closed: close.
                while let Some(head) =
                    read_request(&mut s, &mut buf, Some(Duration::from_millis(200))).await
                {
                    let line = head.lines().next().unwrap().to_string();
                    let host = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("host:")
                                .map(|v| v.trim().to_string())
                        })
                        .unwrap_or_default();
                    log.lock().unwrap().push((n, line, host));
                    let body = CLOSING_BODY;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_closed_by_the_backend_are_not_failures() {
    let (url, seen) = closing_backend().await;
    let addr = url.trim_start_matches("http://").to_string();
    for workers in [0, 2] {
        seen.lock().unwrap().clear();
        let mut cfg = one_backend(format!("{url}/base/"), workers);
        cfg.health_interval = Duration::from_secs(30);
        cfg.admin_token = Some("sekret".into());
        let h = router::start(cfg).await.unwrap();
        let c = client();
        for i in 0..4 {
            let r = post(
                &c,
                &h,
                "k",
                &format!("r{i}"),
                json!({"model": "m", "prompt": "x"}),
            )
            .await;
            assert_eq!(r.status(), 200, "workers {workers}, request {i}");
            assert_eq!(r.text().await.unwrap(), CLOSING_BODY);
            // Long enough for the backend to close the router's idle connection.
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        let stats = admin(&c, &h, "/admin/stats").await;
        assert_eq!(stats["destinations"][0]["marked_down"], 0, "{stats}");
        assert_eq!(stats["destinations"][0]["errors"], 0, "{stats}");
        assert_eq!(stats["retries"], 0, "{stats}");
        let got: Vec<_> = seen.lock().unwrap().clone();
        let posts: Vec<_> = got.iter().filter(|s| s.1.starts_with("POST")).collect();
        assert_eq!(posts.len(), 4, "{got:?}");
        // The base path is kept, the Host header names the destination, and every request
        // after an idle close went out on a new connection.
        for p in &posts {
            assert_eq!(p.1, "POST /base/v1/completions HTTP/1.1");
            assert_eq!(p.2, addr);
        }
        let conns: std::collections::HashSet<usize> = posts.iter().map(|p| p.0).collect();
        assert_eq!(conns.len(), 4, "{got:?}");
        // Back to back, the second request reuses the first one's connection. On a loaded
        // machine the pair can straddle the backend's idle close: up to three pairs, at least
        // one must reuse.
        let mut reused = false;
        for attempt in 0..3 {
            let before = seen.lock().unwrap().len();
            for i in 0..2 {
                let r = post(
                    &c,
                    &h,
                    "k",
                    &format!("b{attempt}-{i}"),
                    json!({"model": "m", "prompt": "x"}),
                )
                .await;
                assert_eq!(r.text().await.unwrap(), CLOSING_BODY);
            }
            let got: Vec<_> = seen.lock().unwrap().clone();
            let last: Vec<usize> = got[before..]
                .iter()
                .filter(|s| s.1.starts_with("POST"))
                .map(|s| s.0)
                .collect();
            assert_eq!(last.len(), 2, "{got:?}");
            if last[0] == last[1] {
                reused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        assert!(
            reused,
            "no reuse in three back-to-back pairs: {:?}",
            seen.lock().unwrap()
        );
        assert!(h.shutdown().await);
    }
}

/// A response read from a raw connection: status, lower-case headers, body.
type RawResponse = (u16, Vec<(String, String)>, Vec<u8>);

/// A raw client connection; bytes read past the last response stay in `buf`.
struct Raw {
    s: tokio::net::TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    async fn connect(addr: std::net::SocketAddr) -> Self {
        Raw {
            s: tokio::net::TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.s.write_all(bytes).await.unwrap();
    }

    /// Send `request` and read its response.
    async fn exchange(&mut self, request: &str) -> RawResponse {
        self.send(request.as_bytes()).await;
        self.response().await
    }

    /// Read up to `n` bytes as they come, within `secs` (0 when the router closed).
    async fn read_some(&mut self, n: usize, secs: u64, what: &str) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut b = vec![0u8; n];
        let k = tokio::time::timeout(Duration::from_secs(secs), self.s.read(&mut b))
            .await
            .expect(what)
            .unwrap_or(0);
        b.truncate(k);
        b
    }

    async fn more(&mut self) {
        let got = self.read_some(8192, 10, "response within 10 s").await;
        assert!(!got.is_empty(), "connection closed inside a response");
        self.buf.extend_from_slice(&got);
    }

    /// One HTTP/1.1 response (interim 1xx answers skipped), its body by `content-length` or
    /// chunked.
    async fn response(&mut self) -> RawResponse {
        loop {
            let (n, status, headers) = loop {
                let mut slots = [httparse::EMPTY_HEADER; 64];
                let mut r = httparse::Response::new(&mut slots);
                if let httparse::Status::Complete(n) =
                    r.parse(&self.buf).expect("valid response head")
                {
                    let headers: Vec<(String, String)> = r
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_ascii_lowercase(),
                                String::from_utf8_lossy(h.value).to_string(),
                            )
                        })
                        .collect();
                    break (n, r.code.unwrap(), headers);
                }
                self.more().await;
            };
            self.buf.drain(..n);
            if (100..200).contains(&status) {
                continue;
            }
            let get = |k: &str| headers.iter().find(|h| h.0 == k).map(|h| h.1.clone());
            let mut body = Vec::new();
            if let Some(len) = get("content-length") {
                let len: usize = len.parse().unwrap();
                while self.buf.len() < len {
                    self.more().await;
                }
                body.extend(self.buf.drain(..len));
            } else {
                assert_eq!(get("transfer-encoding").as_deref(), Some("chunked"));
                loop {
                    let line_end = loop {
                        if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                            break i;
                        }
                        self.more().await;
                    };
                    let size = usize::from_str_radix(
                        std::str::from_utf8(&self.buf[..line_end]).unwrap().trim(),
                        16,
                    )
                    .unwrap();
                    while self.buf.len() < line_end + 2 + size + 2 {
                        self.more().await;
                    }
                    body.extend_from_slice(&self.buf[line_end + 2..line_end + 2 + size]);
                    self.buf.drain(..line_end + 2 + size + 2);
                    if size == 0 {
                        break;
                    }
                }
            }
            return (status, headers, body);
        }
    }
}

fn raw_post(path: &str, key: &str, extra: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\nx-cacheroute-key: {key}\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Requests outside the common shape (chunked body, `Expect`, other paths, `Connection:
/// close`) and pipelined ones are answered correctly, alone and mixed with common ones on one
/// connection, in both serving modes; an idle keep-alive connection is closed at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_connections_mix_every_request_shape() {
    let ms = mocks(2, MockConfig::default()).await;
    let body = json!({"model": "m", "prompt": "hello", "max_tokens": 3}).to_string();
    let post = |key: &str, extra: &str, body: &str| raw_post("/v1/completions", key, extra, body);
    for workers in [0, 2] {
        let mut cfg = config(&ms, "sticky");
        cfg.workers = workers;
        let h = router::start(cfg).await.unwrap();
        let answers = |r: &RawResponse| {
            let v: Value = serde_json::from_slice(&r.2).expect("JSON body");
            let dest = r.1.iter().find(|x| x.0 == "x-cacheroute-destination");
            (
                r.0,
                v["choices"][0]["text"].as_str().map(String::from),
                dest.is_some(),
            )
        };
        let mut s = Raw::connect(h.addr()).await;
        // Two common requests in one write (pipelined): two answers, in order.
        let two = post("a", "x-test-id: p1\r\n", &body)
            + &raw_post(
                "/v1/chat/completions",
                "a",
                "x-test-id: p2\r\n",
                &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            );
        s.send(two.as_bytes()).await;
        for _ in 0..2 {
            let (status, text, dest) = answers(&s.response().await);
            assert_eq!((status, dest), (200, true), "workers {workers}");
            assert!(text.unwrap().starts_with("hello from m"));
        }
        // A chunked request body on the same connection.
        let chunked = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: router\r\nx-cacheroute-key: a\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        );
        let r = s.exchange(&chunked).await;
        assert_eq!(answers(&r).0, 200, "chunked request, workers {workers}");
        // Another path, then a common request again.
        let r = s
            .exchange("GET /health HTTP/1.1\r\nhost: router\r\n\r\n")
            .await;
        assert_eq!(r.0, 200);
        let v: Value = serde_json::from_slice(&r.2).unwrap();
        assert_eq!(v["status"], "ok");
        let r = s.exchange(&post("b", "", &body)).await;
        assert_eq!((answers(&r).0, answers(&r).2), (200, true));
        // Malformed JSON on the common path: a JSON 400, and the connection serves on.
        let mut s2 = Raw::connect(h.addr()).await;
        let r = s2.exchange(&post("c", "", "{not json")).await;
        assert_eq!(r.0, 400);
        let v: Value = serde_json::from_slice(&r.2).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(s2.exchange(&post("c", "", &body)).await.0, 200);
        // Expect: 100-continue, answered with an interim 100 before the body is sent.
        let mut s3 = Raw::connect(h.addr()).await;
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: router\r\nx-cacheroute-key: d\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s3.send(head.as_bytes()).await;
        let interim = s3.read_some(64, 5, "100 Continue within 5 s").await;
        assert!(
            interim.starts_with(b"HTTP/1.1 100"),
            "{:?}",
            String::from_utf8_lossy(&interim)
        );
        s3.send(body.as_bytes()).await;
        assert_eq!(s3.response().await.0, 200);
        // Connection: close: answered, then closed by the router.
        let mut s4 = Raw::connect(h.addr()).await;
        assert_eq!(
            s4.exchange(&post("e", "connection: close\r\n", &body))
                .await
                .0,
            200
        );
        assert!(s4.read_some(16, 5, "closed within 5 s").await.is_empty());
        // A target hyper's URI type refuses (`"`): hyper's 400, not a silent close.
        let mut s5 = Raw::connect(h.addr()).await;
        let quoted = raw_post("/v1/completions?q=\"", "g", "", &body);
        assert_eq!(s5.exchange(&quoted).await.0, 400);
        // Shutdown: an idle keep-alive connection that took the common path is closed, and
        // shutdown does not wait for it.
        let mut idle = Raw::connect(h.addr()).await;
        assert_eq!(idle.exchange(&post("f", "", &body)).await.0, 200);
        let t0 = Instant::now();
        assert!(h.shutdown().await, "drained, workers {workers}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        let rest = idle
            .read_some(16, 5, "idle connection closed at shutdown")
            .await;
        assert!(rest.is_empty());
        drop((s, s2, s3));
    }
}

/// A backend answering every request with a `Content-Length` JSON body written in two parts
/// 50 ms apart (so the router streams it); counts its connections.
async fn split_body_backend() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = conns.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while read_request(&mut s, &mut buf, None).await.is_some() {
                    let body = CLOSING_BODY.as_bytes();
                    let (a, b) = body.split_at(body.len() / 2);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                        body.len()
                    );
                    let mut first = head.into_bytes();
                    first.extend_from_slice(a);
                    if s.write_all(&first).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    if s.write_all(b).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), conns)
}

/// A body streamed with its `Content-Length` reaches the client whole, counts as a success,
/// and its upstream connection is kept for the next request of the same client connection,
/// in both serving modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_streamed_with_its_length_ends_cleanly() {
    let (url, conns) = split_body_backend().await;
    for workers in [0, 2] {
        let before = conns.load(std::sync::atomic::Ordering::SeqCst);
        let h = router::start(one_backend(url.clone(), workers))
            .await
            .unwrap();
        // One client connection: upstream connections are kept per client connection.
        let mut s = Raw::connect(h.addr()).await;
        let body = json!({"model": "m", "prompt": "x"}).to_string();
        for _ in 0..3 {
            let r = s
                .exchange(&raw_post("/v1/completions", "k", "", &body))
                .await;
            assert_eq!(r.0, 200);
            assert_eq!(r.2, CLOSING_BODY.as_bytes());
        }
        let d = h.fleet().dest(0);
        assert_eq!(
            d.errors.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "workers {workers}"
        );
        assert_eq!(d.requests.load(std::sync::atomic::Ordering::SeqCst), 3);
        // Health checks use their own client; the three requests shared one connection.
        drop(s);
        let used = conns.load(std::sync::atomic::Ordering::SeqCst) - before;
        assert!(
            used <= 2,
            "{used} upstream connections for 3 requests, workers {workers}"
        );
        assert!(h.shutdown().await);
    }
}

/// Send `n` requests over `keys` keys as fast as one client goes.
async fn burst(c: &reqwest::Client, h: &RouterHandle, n: usize, keys: usize) {
    for i in 0..n {
        let r = post(
            c,
            h,
            &format!("k{}", i % keys),
            &i.to_string(),
            json!({"model": "m", "prompt": "p"}),
        )
        .await;
        assert_eq!(r.status(), 200);
    }
}

/// Poll `/admin/plan` until a plan is installed or `within` passes.
async fn wait_for_plan(c: &reqwest::Client, h: &RouterHandle, within: Duration) -> Option<Value> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        let p = admin(c, h, "/admin/plan?table=true").await;
        if p["installed"] == true {
            return Some(p);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cacheroute_plans_once_traffic_is_seen_not_after_its_first_interval() {
    let ms = mocks(3, MockConfig::default()).await;
    let mut cfg = config(&ms, "cacheroute");
    if let PolicySpec::Cacheroute(c) = &mut cfg.policy {
        c.interval_s = 120.0;
    }
    let h = router::start(cfg).await.unwrap();
    let c = client();
    let t0 = Instant::now();
    burst(&c, &h, 300, 6).await;
    let p = wait_for_plan(&c, &h, Duration::from_secs(5))
        .await
        .expect("a plan within seconds of the first traffic, not after the 120 s interval");
    assert_eq!(p["source"], "measured");
    assert!(p["admitted"].as_u64().unwrap() >= 6, "{p}");
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_the_state_file_starts_with_the_last_plan() {
    let ms = mocks(3, MockConfig::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state.json");
    let mut cfg = config(&ms, "cacheroute");
    cfg.state_file = Some(state.clone());
    let h = router::start(cfg.clone()).await.unwrap();
    let c = client();
    burst(&c, &h, 300, 6).await;
    let first = wait_for_plan(&c, &h, Duration::from_secs(5))
        .await
        .expect("first plan");
    let table = first["table"].clone();
    assert!(h.shutdown().await);

    // The file: the plan's table and the rates it was built from, by key hash.
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(doc["format"], "cacheroute-router-state/1");
    let keys = doc["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 6, "{doc}");
    assert!(keys.iter().all(|k| k["rate"].as_f64().unwrap() > 0.0));

    // A new router warm-starts from it: the same table before any request.
    let mut cfg2 = cfg.clone();
    cfg2.state_file = None;
    cfg2.initial_plan = Some(state.clone());
    let h2 = router::start(cfg2).await.unwrap();
    let p = admin(&c, &h2, "/admin/plan?table=true").await;
    assert_eq!(p["installed"], true);
    assert_eq!(p["source"], "file");
    assert_eq!(p["table"], table);
    // A key with one home goes there on the first request.
    let (name, dests) = table
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, d)| d.as_array().unwrap().len() == 1)
        .map(|(n, d)| (n.clone(), d[0].as_u64().unwrap() as usize))
        .expect("a key with one destination");
    let key = (0..6)
        .map(|i| format!("k{i}"))
        .find(|k| *k == name)
        .expect("table names are the keys' names, kept through the state file");
    let r = post(&c, &h2, &key, "w", json!({"model": "m", "prompt": "p"})).await;
    assert_eq!(dest_of(&r), dests);
    assert!(h2.shutdown().await);

    // A state file written to break the parser is refused at start with its field named.
    std::fs::write(
        &state,
        json!({"format": "cacheroute-router-state/1", "destinations": 3,
               "keys": [{"key": "zz", "destinations": [0], "rate": 1.0}]})
        .to_string(),
    )
    .unwrap();
    let mut bad = cfg.clone();
    bad.state_file = None;
    bad.initial_plan = Some(state.clone());
    let e = router::start(bad).await.err().expect("refused").to_string();
    assert!(e.contains("keys[0].key"), "{e}");
}

/// The router's `/metrics` text.
async fn metrics_text(c: &reqwest::Client, h: &RouterHandle) -> String {
    common::metrics_text(c, &h.url()).await
}

/// Sum over destinations of the samples `{name}{…}` in a Prometheus text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_tables_name_keys_seen_with_a_name_and_metrics_have_latency_histograms() {
    let ms = mocks(3, MockConfig::default()).await;
    let h = router::start(config(&ms, "cacheroute")).await.unwrap();
    let c = client();
    // Keys from the prompt's prefix (no header, no `user`) and from `user`.
    for i in 0..60 {
        let body = if i % 2 == 0 {
            json!({"model": "m", "prompt": format!("private prompt text {}", i % 3)})
        } else {
            json!({"model": "m", "prompt": "p", "user": "tenant-7"})
        };
        let r = c
            .post(format!("{}/v1/completions", h.url()))
            .json_body(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    burst(&c, &h, 240, 6).await;
    // Plan now from everything sent (the early first plan may have seen only part of it on
    // a loaded machine).
    let r = reload(&c, &h).await;
    assert_eq!(r.status(), 200);
    let p = wait_for_plan(&c, &h, Duration::from_secs(10))
        .await
        .expect("a plan");
    let table = p["table"].as_object().unwrap();
    for k in (0..6)
        .map(|i| format!("k{i}"))
        .chain(["tenant-7".to_string()])
    {
        assert!(table.contains_key(&k), "{k} not named: {p}");
    }
    let hex: Vec<&String> = table
        .keys()
        .filter(|k| k.len() == 16 && k.bytes().all(|b| b.is_ascii_hexdigit()))
        .collect();
    assert_eq!(hex.len(), 3, "prompt-prefix keys stay hashes: {p}");
    assert!(
        !table.keys().any(|k| k.contains("private")),
        "prompt text is never a name: {p}"
    );

    let m = metrics_text(&c, &h).await;
    for name in [
        "cacheroute_router_ttft_seconds",
        "cacheroute_router_e2e_seconds",
        "cacheroute_router_upstream_seconds",
    ] {
        assert!(m.contains(&format!("# TYPE {name} histogram")), "{m}");
        let count = metric_sum(&m, &format!("{name}_count"));
        assert_eq!(count, 300.0, "{name}: one sample per request");
        let inf: f64 = m
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket{{")) && l.contains("le=\"+Inf\""))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum();
        assert_eq!(inf, count, "{name}: +Inf bucket = count");
        assert!(metric_sum(&m, &format!("{name}_sum")) > 0.0);
        // Bounded labels: per destination and policy, never per key.
        let series: Vec<&str> = m
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_count{{")))
            .collect();
        assert_eq!(series.len(), 3, "{series:?}");
        assert!(
            series[0].contains("destination=\"0\"") && series[0].contains("policy=\"cacheroute\"")
        );
        assert!(!m.contains("key="), "no key label");
    }
    assert!(h.shutdown().await);
}
