//! The live router against backends and clients that misbehave on purpose: raw sockets over
//! loopback, one check per hole a hostile peer could use. No speed assertions.

mod common;

use cacheroute::router::{self, RouterHandle};
use common::raw::{one_backend, read_request};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// One well-formed completion request to the router.
async fn post_completion(h: &RouterHandle) -> reqwest::Response {
    client()
        .post(format!("{}/v1/completions", h.url()))
        .header("content-type", "application/json")
        .body(r#"{"model":"m","prompt":"p"}"#)
        .send()
        .await
        .unwrap()
}

/// The value of header `name` in a request head.
fn header(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

/// What a poisoning backend writes on a connection after each proper answer.
#[derive(Clone, Copy)]
enum Poison {
    /// A second, unasked-for response.
    ExtraResponse,
    /// A `408` as if the idle connection timed out, then close.
    Timeout408,
}

/// A backend that answers each request with its `x-test-id` as the body, then 30 ms later
/// writes `poison` on the same connection.
async fn poisoning_backend(poison: Poison) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(head) = read_request(&mut s, &mut buf, None).await {
                    let id = header(&head, "x-test-id").unwrap_or_default();
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{id}",
                        id.len()
                    );
                    if s.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    match poison {
                        Poison::ExtraResponse => {
                            let stale = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nSTALE";
                            if s.write_all(stale.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        Poison::Timeout408 => {
                            let _ = s
                                .write_all(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
                                .await;
                            return;
                        }
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

async fn post_id(c: &reqwest::Client, h: &RouterHandle, id: &str) -> (u16, String) {
    let r = c
        .post(format!("{}/v1/completions", h.url()))
        .header("x-test-id", id)
        .header("content-type", "application/json")
        .body(r#"{"model":"m","prompt":"p"}"#)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_a_backend_writes_after_its_answer_never_reach_the_next_client() {
    for poison in [Poison::ExtraResponse, Poison::Timeout408] {
        let url = poisoning_backend(poison).await;
        for workers in [0, 2] {
            let h = router::start(one_backend(url.clone(), workers))
                .await
                .unwrap();
            let c = client();
            for i in 0..6 {
                let id = format!("client-{i}");
                let (status, body) = post_id(&c, &h, &id).await;
                assert_eq!((status, body.as_str()), (200, id.as_str()), "request {i}");
                // Let the poison land on the idle connection before the next request.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(h.shutdown().await);
        }
    }
}

/// A backend that answers `GET /health` with 200 and any other request with `answer`, then
/// closes.
async fn fixed_backend(answer: &'static [u8]) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(head) = read_request(&mut s, &mut buf, None).await {
                    if head.starts_with("GET /health") {
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if s.write_all(ok).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let _ = s.write_all(answer).await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    return;
                }
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_and_upgrades_stay_on_their_hop() {
    // Headers the backend's Connection header names are not passed on.
    let url = fixed_backend(
        b"HTTP/1.1 200 OK\r\nx-hop: secret\r\nconnection: x-hop\r\nx-end: 1\r\ncontent-length: 2\r\n\r\nok",
    )
    .await;
    let h = router::start(one_backend(url, 0)).await.unwrap();
    let r = post_completion(&h).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-hop").is_none(), "{:?}", r.headers());
    assert_eq!(r.headers()["x-end"], "1");
    assert!(h.shutdown().await);

    // A 101 from the backend is an upstream error, not a chunked body of another protocol.
    let url = fixed_backend(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n\x81\x05hello",
    )
    .await;
    let h = router::start(one_backend(url, 0)).await.unwrap();
    let r = post_completion(&h).await;
    assert_eq!(r.status(), 502);
    let body = r.text().await.unwrap();
    assert!(body.contains("switched protocols"), "{body}");
    assert!(h.shutdown().await);
}

/// A backend that records each request head it receives.
async fn recording_backend() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(head) = read_request(&mut s, &mut buf, None).await {
                    log.lock().unwrap().push(head);
                    if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_the_client_names_in_connection_are_not_forwarded() {
    let (url, seen) = recording_backend().await;
    let h = router::start(one_backend(url, 0)).await.unwrap();
    let r = client()
        .post(format!("{}/v1/completions", h.url()))
        .header("content-type", "application/json")
        .header("connection", "keep-alive, x-hop-secret")
        .header("x-hop-secret", "s3cret")
        .header("x-kept", "1")
        .body(r#"{"model":"m","prompt":"p"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let heads: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|h| h.starts_with("POST"))
        .cloned()
        .collect();
    assert_eq!(heads.len(), 1);
    assert!(header(&heads[0], "x-hop-secret").is_none(), "{}", heads[0]);
    assert_eq!(header(&heads[0], "x-kept").as_deref(), Some("1"));
    assert!(h.shutdown().await);
}

/// Send `raw` on a fresh connection to the router and read until it closes or 2 s pass.
async fn raw_exchange(h: &RouterHandle, raw: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    s.write_all(raw).await.unwrap();
    read_for(&mut s, Duration::from_secs(2)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_lengths_that_are_not_plain_digits_get_hypers_400() {
    let (url, seen) = recording_backend().await;
    let h = router::start(one_backend(url, 0)).await.unwrap();
    let body = r#"{"model":"m","prompt":"p"}"#; // 26 bytes
    for cl in ["+26", "\u{a0}26", "26\u{2003}", "0x1a", "26, 26"] {
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {cl}\r\n\r\n{body}"
        );
        let answer = raw_exchange(&h, req.as_bytes()).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "content-length {cl:?}: {answer}"
        );
    }
    // Plain digits, with the spaces and tabs the grammar allows, are served.
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: \t26 \r\n\r\n{body}"
    );
    let answer = raw_exchange(&h, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let posts = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|h| h.starts_with("POST"))
        .count();
    assert_eq!(posts, 1, "only the well-formed request reached the backend");
    assert!(h.shutdown().await);
}

async fn stats(h: &RouterHandle) -> serde_json::Value {
    let r = client()
        .get(format!("{}/admin/stats", h.url()))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

/// Read what arrives on `s` until it closes or `within` passes.
async fn read_for(s: &mut tokio::net::TcpStream, within: Duration) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    let until = tokio::time::Instant::now() + within;
    while let Ok(Ok(n)) = tokio::time::timeout_at(until, s.read(&mut chunk)).await {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&out).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_at_its_deadline_and_bodies_share_a_budget() {
    let (url, _) = recording_backend().await;
    let mut cfg = one_backend(url, 0);
    cfg.admin_token = Some("sekret".into());
    cfg.body_timeout = Duration::from_millis(800);
    cfg.max_body_bytes = 4 << 20;
    cfg.max_buffered_bytes = 8 << 20;
    let h = router::start(cfg).await.unwrap();
    let head = |len: usize| {
        format!("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{{")
    };
    // Two 4 MiB bodies fill the budget; a third is refused at once, before any buffer grows.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
        s.write_all(head(4 << 20).as_bytes()).await.unwrap();
        slow.push(s);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let st = stats(&h).await;
    assert_eq!(st["buffered_body_bytes"], 8 << 20, "{st}");
    let mut third = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    third.write_all(head(4 << 20).as_bytes()).await.unwrap();
    let answer = read_for(&mut third, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("max_buffered_bytes"), "{answer}");
    // The trickling clients: one byte every 300 ms keeps each read alive, but not the body.
    let t0 = tokio::time::Instant::now();
    let mut answers = Vec::new();
    for mut s in slow {
        let trickle = async {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if s.write_all(b" ").await.is_err() {
                    break;
                }
            }
        };
        tokio::select! {
            _ = trickle => {}
            _ = tokio::time::sleep(Duration::from_secs(3)) => {}
        }
        answers.push(read_for(&mut s, Duration::from_millis(500)).await);
    }
    assert!(t0.elapsed() < Duration::from_secs(8));
    for a in &answers {
        assert!(a.starts_with("HTTP/1.1 408"), "{a}");
    }
    let st = stats(&h).await;
    assert_eq!(st["buffered_body_bytes"], 0, "budget given back: {st}");
    assert_eq!(st["buffer_refused"], 1, "{st}");
    assert_eq!(st["body_timeouts"], 2, "{st}");
    assert!(h.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_get_503_and_a_freed_slot_serves_again() {
    let (url, _) = recording_backend().await;
    for workers in [0, 2] {
        let mut cfg = one_backend(url.clone(), workers);
        cfg.admin_token = Some("sekret".into());
        cfg.max_connections = 4;
        let h = router::start(cfg).await.unwrap();
        // Four idle connections hold every slot.
        let mut idle = Vec::new();
        for _ in 0..4 {
            idle.push(tokio::net::TcpStream::connect(h.addr()).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut fifth = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
        let answer = read_for(&mut fifth, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("max_connections"), "{answer}");
        // Free one slot: the next connection is served (stats itself needs a slot).
        drop(idle.pop());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let st = stats(&h).await;
        assert!(st["connections_refused"].as_u64().unwrap() >= 1, "{st}");
        drop(idle);
        assert!(h.shutdown().await);
    }
}
