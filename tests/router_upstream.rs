//! The router's upstream side against backends that misbehave on purpose, through the real
//! `cacheroute route` binary over loopback: a backend that writes a stray response after each
//! answer, and one that cuts a stream mid-way. No timing assertions; the counts are printed
//! (`--nocapture`).

mod common;

use common::procs::Proc;
use common::raw::read_message;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// The body of the response a straying backend writes unasked.
const STRAY: &str = r#"{"echo":"STRAY"}"#;

/// A keep-alive HTTP/1.1 response with a JSON body.
fn json_response(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A backend that answers `GET /health` with 200 and each completion with `{"echo": PROMPT}`,
/// keeping the connection alive, and then, `delay` after each answer (in the same write when
/// it is zero), writes a stray response ([`STRAY`]) on that connection while it goes on
/// reading the next request.
async fn straying_backend(delay: Duration) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, w) = s.into_split();
                let w = Arc::new(tokio::sync::Mutex::new(w));
                let mut buf = Vec::new();
                while let Some((head, body)) = read_message(&mut r, &mut buf, None).await {
                    if head.starts_with("GET /health") {
                        let ok = json_response("{}");
                        if w.lock().await.write_all(&ok).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let prompt = v["prompt"].as_str().unwrap_or_default();
                    let answer = json_response(&serde_json::json!({ "echo": prompt }).to_string());
                    let stray = json_response(STRAY);
                    if delay.is_zero() {
                        let both = [answer, stray].concat();
                        if w.lock().await.write_all(&both).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if w.lock().await.write_all(&answer).await.is_err() {
                        return;
                    }
                    let w = w.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = w.lock().await.write_all(&stray).await;
                    });
                }
            });
        }
    });
    format!("http://{addr}")
}

/// What the clients of one cell received.
#[derive(Default, Debug)]
struct Tally {
    own: usize,
    stray: usize,
    errors: usize,
    /// Another client's completion: `client i got BODY`.
    wrong: Vec<String>,
}

/// 20 sequential clients, each on its own connection, prompts `P0…P19`, `gap` apart.
async fn clients(router: &str, gap: Duration) -> Tally {
    let mut t = Tally::default();
    for i in 0..20 {
        let c = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let prompt = format!("P{i}");
        let sent = c
            .post(format!("{router}/v1/completions"))
            .header("content-type", "application/json")
            .body(serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string())
            .send()
            .await;
        let own = serde_json::json!({ "echo": prompt }).to_string();
        match sent {
            Ok(r) => {
                let status = r.status().as_u16();
                let text = r.text().await.unwrap_or_default();
                if status == 200 && text == own {
                    t.own += 1;
                } else if text == STRAY {
                    t.stray += 1;
                } else if text.contains("\"echo\"") {
                    t.wrong.push(format!("client {i} got {status} {text}"));
                } else {
                    t.errors += 1;
                }
            }
            Err(_) => t.errors += 1,
        }
        tokio::time::sleep(gap).await;
    }
    t
}

/// The value of the first sample of `name` in `/metrics` (destination 0's, for one with labels).
fn metric(router: &str, name: &str) -> Option<f64> {
    let text = reqwest::blocking::get(format!("{router}/metrics"))
        .ok()?
        .text()
        .ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labels) => &labels[labels.find('}')? + 1..],
            None => rest,
        };
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// The router on one backend as the issue's probe ran it: flat-lb, one serving worker, and
/// `extra` arguments; `env` for the process.
fn route_to(backend: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut args = vec![
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "flat-lb",
        "--workers",
        "1",
        "--backend",
        backend,
    ];
    args.extend_from_slice(extra);
    Proc::start_env(&args, env)
}

/// A backend that writes a stray response D ms after each answer, clients G ms apart: for
/// every (D, G) of the grid, no client ever receives another client's completion. Each cell
/// has its own backend and router, and the 20 cells run at once (the 200 ms gaps dominate).
#[test]
fn a_stray_response_never_hands_a_client_another_clients_completion() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let delays = [0u64, 10, 50, 100, 300];
    let gaps = [0u64, 10, 30, 200];
    let mut cells = Vec::new();
    for &d in &delays {
        for &g in &gaps {
            let backend = rt.block_on(straying_backend(Duration::from_millis(d)));
            cells.push((d, g, route_to(&backend, &[], &[])));
        }
    }
    let tallies = rt.block_on(async {
        let runs = cells.iter().map(|(_, g, router)| {
            let (url, gap) = (router.url.clone(), Duration::from_millis(*g));
            tokio::spawn(async move { clients(&url, gap).await })
        });
        let mut out = Vec::new();
        for r in runs.collect::<Vec<_>>() {
            out.push(r.await.unwrap());
        }
        out
    });
    println!("D ms  G ms  own  stray  error  wrong  unsolicited  unpooled");
    let mut wrong = Vec::new();
    for ((d, g, router), t) in cells.iter().zip(&tallies) {
        let unsolicited = metric(&router.url, "cacheroute_upstream_unsolicited_total");
        let unpooled = metric(&router.url, "cacheroute_upstream_unpooled_total");
        println!(
            "{d:>4}  {g:>4}  {:>3}  {:>5}  {:>5}  {:>5}  {:>11}  {:>8}",
            t.own,
            t.stray,
            t.errors,
            t.wrong.len(),
            unsolicited.map_or("-".into(), |v| v.to_string()),
            unpooled.map_or("-".into(), |v| v.to_string()),
        );
        wrong.extend(t.wrong.iter().map(|w| format!("D={d} G={g}: {w}")));
        assert_eq!(t.own + t.stray + t.errors + t.wrong.len(), 20);
    }
    assert!(
        wrong.is_empty(),
        "clients received another client's completion:\n{}",
        wrong.join("\n")
    );
    // Every cell's backend wrote unasked: where a stray was received, the destination's
    // answer that followed it was unsolicited, and the router counted it.
    for ((d, g, router), t) in cells.iter().zip(&tallies) {
        if t.stray > 0 {
            let n = metric(&router.url, "cacheroute_upstream_unsolicited_total").unwrap_or(0.0);
            assert!(
                n >= 1.0,
                "D={d} G={g}: {t:?} but no unsolicited bytes counted"
            );
        }
    }
}

/// One keep-alive client, its requests 100 ms apart, against a backend that writes a stray
/// response 50 ms after each answer: the stray lands on the idle upstream connection kept for
/// that client, which closes it; the client gets its own answers only, and the destination is
/// marked: no connection to it is kept again (no probe passes in this test after the first).
#[test]
fn a_stray_on_a_kept_connection_closes_it_and_stops_keeping() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let backend = rt.block_on(straying_backend(Duration::from_millis(50)));
    let router = route_to(&backend, &["--health-interval-ms", "600000"], &[]);
    let answers = rt.block_on(async {
        let c = reqwest::Client::new();
        let mut out = Vec::new();
        for i in 0..10 {
            let r = c
                .post(format!("{}/v1/completions", router.url))
                .header("content-type", "application/json")
                .body(serde_json::json!({"model": "m", "prompt": format!("P{i}")}).to_string())
                .send()
                .await
                .unwrap();
            out.push((r.status().as_u16(), r.text().await.unwrap()));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out
    });
    for (i, a) in answers.iter().enumerate() {
        let own = serde_json::json!({ "echo": format!("P{i}") }).to_string();
        assert_eq!(a, &(200, own), "request {i}");
    }
    let unsolicited = metric(&router.url, "cacheroute_upstream_unsolicited_total");
    assert!(unsolicited >= Some(1.0), "{unsolicited:?}");
    assert_eq!(metric(&router.url, "cacheroute_upstream_pooled"), Some(0.0));
    let unpooled = metric(&router.url, "cacheroute_upstream_unpooled_total");
    assert!(unpooled >= Some(1.0), "{unpooled:?}");
}

/// A backend whose first completion is an SSE stream cut after one event (the connection
/// closes without the last chunk); later ones stream to their end.
async fn cutting_backend() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let cut = Arc::new(std::sync::atomic::AtomicBool::new(true));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let cut = cut.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let mut buf = Vec::new();
                while let Some((head, _)) = read_message(&mut r, &mut buf, None).await {
                    if head.starts_with("GET /health") {
                        if w.write_all(&json_response("{}")).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let event = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
                    let mut out = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                        event.len()
                    );
                    if cut.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        let _ = w.write_all(out.as_bytes()).await;
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        return; // closed mid-stream
                    }
                    let done = "data: [DONE]\n\n";
                    out.push_str(&format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len()));
                    if w.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// A stream the backend cuts is that request's error, not proof the destination is dead: the
/// next request is served (not 503 "no destination is up"), the cut is counted and logged.
#[test]
fn a_stream_cut_mid_way_does_not_mark_the_destination_down() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let backend = rt.block_on(cutting_backend());
    let router = route_to(
        &backend,
        &["--health-interval-ms", "60000"],
        &[("RUST_LOG", "info")],
    );
    let (first, second) = rt.block_on(async {
        let c = reqwest::Client::new();
        let post = || {
            c.post(format!("{}/v1/completions", router.url))
                .header("content-type", "application/json")
                .body(r#"{"model":"m","prompt":"p","stream":true}"#)
                .send()
        };
        let r = post().await.unwrap();
        let first = (r.status().as_u16(), r.text().await.is_err());
        let r = post().await.unwrap();
        let second = (r.status().as_u16(), r.text().await.unwrap_or_default());
        (first, second)
    });
    // The cut stream: its head was the backend's 200, its body ends in an error.
    assert_eq!(first, (200, true));
    assert_eq!(second.0, 200, "the next request: {}", second.1);
    assert!(second.1.ends_with("data: [DONE]\n\n"), "{}", second.1);
    assert_eq!(
        metric(&router.url, "cacheroute_destination_broken_streams_total"),
        Some(1.0)
    );
    assert_eq!(metric(&router.url, "cacheroute_destination_up"), Some(1.0));
    let (_, log) = router.terminate();
    assert!(log.contains("stream broke"), "{log}");
    assert!(!log.contains("destination 0 down"), "{log}");
}
