//! `cacheroute epp` against clients that misbehave on purpose, over loopback: each budget
//! `route` keeps (the body budget from a message's first byte, the body deadline,
//! `max_connections`, the head timeout) holds on the EPP too, header lists from Envoy are
//! bounded, and an immediate response ends its stream. No speed assertions.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use cacheroute::router::epp::{self, proto, EppHandle};
use cacheroute::router::RouterConfig;
use common::grpc::{call, header, message};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use proto::processing_request::Request as In;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A listener that accepts and answers nothing: a backend the EPP can name (its health probe
/// fails, so with `every_backend_up` false requests get 503, which these tests never reach).
async fn backend() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    format!("http://{addr}")
}

async fn start(edit: impl FnOnce(&mut RouterConfig)) -> EppHandle {
    let mut cfg = common::raw::one_backend(backend().await, 0);
    cfg.admin_token = Some("sekret".into());
    edit(&mut cfg);
    epp::start(cfg).await.unwrap()
}

async fn stats(h: &EppHandle) -> serde_json::Value {
    let r = reqwest::Client::new()
        .get(format!("http://{}/admin/stats", h.addr()))
        .bearer_auth("sekret")
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

/// An HTTP/2 connection to the EPP (hyper's client).
async fn h2(h: &EppHandle) -> hyper::client::conn::http2::SendRequest<StreamBodyOf> {
    let tcp = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let (tx, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    tx
}

type StreamBodyOf =
    StreamBody<tokio_stream_shim::Receiver<Result<Frame<Bytes>, std::convert::Infallible>>>;

/// A tiny `Stream` over a tokio channel (no extra crate).
mod tokio_stream_shim {
    pub struct Receiver<T>(pub tokio::sync::mpsc::Receiver<T>);
    impl<T> futures_util::Stream for Receiver<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            self.0.poll_recv(cx)
        }
    }
}

/// Open a `Process` stream whose request body is fed through the returned sender; the
/// response (bytes, grpc-status) arrives on the returned task.
async fn open_stream(
    tx: &mut hyper::client::conn::http2::SendRequest<StreamBodyOf>,
    addr: std::net::SocketAddr,
) -> (
    tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::convert::Infallible>>,
    tokio::task::JoinHandle<(Bytes, String)>,
) {
    let (feed, rx) = tokio::sync::mpsc::channel(4);
    let req = hyper::Request::post(format!("http://{addr}{}", epp::PROCESS))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(tokio_stream_shim::Receiver(rx)))
        .unwrap();
    tx.ready().await.unwrap();
    let fut = tx.send_request(req);
    let task = tokio::spawn(async move {
        let Ok(resp) = fut.await else {
            return (Bytes::new(), "reset".to_string());
        };
        let Ok(got) = resp.into_body().collect().await else {
            return (Bytes::new(), "reset".to_string());
        };
        common::grpc::answer(got)
    });
    (feed, task)
}

/// The first `n` bytes of a gRPC message announcing `len` bytes.
fn partial_message(len: u32, n: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + n);
    b.put_u8(0);
    b.put_u32(len);
    b.resize(5 + n, 0x41);
    b.freeze()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incomplete_grpc_message_counts_against_the_body_budget_from_its_first_byte() {
    // 2 MiB bodies, 8 MiB of budget: four messages one byte short of whole fill it.
    let h = start(|c| {
        c.max_body_bytes = 2 << 20;
        c.max_buffered_bytes = 8 << 20;
    })
    .await;
    let mut tx = h2(&h).await;
    let len = 2 << 20;
    let mut feeds = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (feed, task) = open_stream(&mut tx, h.addr()).await;
        // Sent in 256 KiB pieces, as a client streams it.
        let whole = partial_message(len, len as usize - 1);
        for piece in whole.chunks(256 << 10) {
            if feed
                .send(Ok(Frame::data(Bytes::copy_from_slice(piece))))
                .await
                .is_err()
            {
                break;
            }
        }
        feeds.push(feed);
        tasks.push(task);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = stats(&h).await;
    let buffered = st["buffered_body_bytes"].as_u64().unwrap();
    assert!(
        buffered <= 8 << 20,
        "the EPP holds {buffered} bytes, over max_buffered_bytes: {st}"
    );
    assert!(
        buffered >= 3 * (2 << 20),
        "the held streams' bytes are not counted: {st}"
    );
    // The streams past the budget ended with RESOURCE_EXHAUSTED, naming the budget.
    let mut refused = 0;
    for t in tasks.iter_mut() {
        if t.is_finished() {
            let (_, status) = t.await.unwrap();
            assert_eq!(status, "8");
            refused += 1;
        }
    }
    assert!(refused >= 6, "only {refused} of 10 streams refused: {st}");
    assert!(st["buffer_refused"].as_u64().unwrap() >= 6, "{st}");
    // Every stream gone: the budget is all given back.
    drop(feeds);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = stats(&h).await;
    assert_eq!(st["buffered_body_bytes"], 0, "{st}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_does_not_complete_within_the_body_timeout_ends_its_stream() {
    let h = start(|c| c.body_timeout = Duration::from_millis(700)).await;
    let mut tx = h2(&h).await;
    let (feed, task) = open_stream(&mut tx, h.addr()).await;
    let t0 = std::time::Instant::now();
    feed.send(Ok(Frame::data(partial_message(1000, 10))))
        .await
        .unwrap();
    let (_, status) = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the stream was not ended by the body timeout")
        .unwrap();
    assert_eq!(status, "4", "not DEADLINE_EXCEEDED");
    assert!(t0.elapsed() >= Duration::from_millis(600));
    let st = stats(&h).await;
    assert_eq!(st["body_timeouts"], 1, "{st}");
    assert_eq!(st["buffered_body_bytes"], 0, "{st}");
    drop(feed);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_and_the_head_timeout_hold_on_the_epp() {
    let h = start(|c| {
        c.max_connections = 6;
        c.head_timeout = Duration::from_millis(1500);
    })
    .await;
    // Ten silent connections: six are admitted, four closed at once.
    let mut silent = Vec::new();
    for _ in 0..10 {
        silent.push(tokio::net::TcpStream::connect(h.addr()).await.unwrap());
    }
    let closed = futures_util::future::join_all(silent.iter_mut().map(|s| async move {
        let mut b = [0u8; 16];
        matches!(
            tokio::time::timeout(Duration::from_millis(300), s.read(&mut b)).await,
            Ok(Ok(0) | Err(_))
        )
    }))
    .await;
    let closed_at_once = closed.iter().filter(|&&c| c).count();
    assert_eq!(
        closed_at_once, 4,
        "past max_connections 6 of 10 silent connections"
    );
    // Within the head timeout every silent or half-said connection is closed, whether it said
    // nothing, part of HTTP/2's preface or part of an HTTP/1 head.
    let mut half = Vec::new();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    for bytes in [&b"PRI * HTTP/2"[..], &b"GET /health HTTP/1.1\r\nhost:"[..]] {
        let mut s = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
        s.write_all(bytes).await.unwrap();
        half.push(s);
    }
    let t0 = std::time::Instant::now();
    for s in silent.iter_mut().chain(half.iter_mut()) {
        let mut b = [0u8; 256];
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut b).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {} // hyper's 408 to the half-sent HTTP/1 head
                }
            }
        })
        .await;
        assert!(
            r.is_ok(),
            "a connection was still open 10 s after its head timeout"
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
    // Counted: every connection is closed now, and the refusals are on the books.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let st = stats(&h).await;
    assert_eq!(st["connections_open"], 1, "the stats request's own: {st}");
    assert_eq!(st["connections_refused"], 4, "{st}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_list_over_the_bound_is_refused_with_a_grpc_status() {
    let h = start(|_| {}).await;
    let addr = h.addr().to_string();
    for (what, headers) in [
        (
            "names",
            (0..40_000)
                .map(|i| header(&format!("x-h-{i}"), "v"))
                .collect::<Vec<_>>(),
        ),
        ("bytes", vec![header("x-big", &"v".repeat(70_000))]),
    ] {
        for response in [false, true] {
            let list = proto::HttpHeaders {
                headers: Some(proto::HeaderMap {
                    headers: headers.clone(),
                }),
                end_of_stream: false,
            };
            let msg = if response {
                message(In::ResponseHeaders(list))
            } else {
                message(In::RequestHeaders(list))
            };
            let (out, status) = call(&addr, msg).await;
            assert_eq!(
                status, "8",
                "{what}, response {response}: not RESOURCE_EXHAUSTED"
            );
            assert!(out.is_empty(), "{what}: answered before refusing");
        }
    }
    // The EPP still answers.
    let ok = message(In::RequestHeaders(proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: vec![header(":method", "POST")],
        }),
        end_of_stream: false,
    }));
    let (_, status) = call(&addr, ok).await;
    assert_eq!(status, "0");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_response_is_the_streams_last_answer() {
    let h = start(|c| c.max_body_bytes = 4 << 20).await;
    let addr = h.addr().to_string();
    // A 100 MB body in 1 MiB messages: one 413, then the stream ends.
    let mut body = BytesMut::new();
    body.extend_from_slice(&message(In::RequestHeaders(proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: vec![header(":method", "POST")],
        }),
        end_of_stream: false,
    })));
    let piece = Bytes::from(vec![b'x'; 1 << 20]);
    for i in 0..100 {
        body.extend_from_slice(&message(In::RequestBody(proto::HttpBody {
            body: piece.clone(),
            end_of_stream: i == 99,
        })));
    }
    let (out, status) = call(&addr, body.freeze()).await;
    assert_eq!(status, "0");
    let answers = common::grpc::answers(out);
    let immediate: Vec<_> = answers
        .iter()
        .filter(|a| {
            matches!(
                a.response,
                Some(proto::processing_response::Response::ImmediateResponse(_))
            )
        })
        .collect();
    assert_eq!(immediate.len(), 1, "{} answers", answers.len());
    assert!(
        matches!(
            answers.last().and_then(|a| a.response.as_ref()),
            Some(proto::processing_response::Response::ImmediateResponse(r))
                if r.status.as_ref().map(|s| s.code) == Some(413)
        ),
        "the 413 is not the last answer"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_peer_that_stops_answering_pings_is_closed_and_one_that_answers_is_kept() {
    let h = start(|c| c.head_timeout = Duration::from_millis(800)).await;
    // The whole preface and an empty SETTINGS frame, then silence: no SETTINGS ack, no PING ack.
    let mut mute = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    mute.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    // hyper's client answers pings on its own, as Envoy does.
    let mut answering = h2(&h).await;
    let t0 = std::time::Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut b = [0u8; 512];
        loop {
            match mute.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {} // the server's SETTINGS and PINGs
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "a mute HTTP/2 peer was still connected after 10 s"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(700),
        "closed before its head timeout"
    );
    // The answering client, idle as long, still gets its stream answered on the same connection.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (feed, task) = open_stream(&mut answering, h.addr()).await;
    feed.send(Ok(Frame::data(message(In::RequestHeaders(
        proto::HttpHeaders {
            headers: Some(proto::HeaderMap {
                headers: vec![header(":method", "POST")],
            }),
            end_of_stream: false,
        },
    )))))
    .await
    .unwrap();
    drop(feed);
    let (out, status) = task.await.unwrap();
    assert_eq!(status, "0", "the answering peer's connection was cut");
    assert!(!out.is_empty());
    h.shutdown().await;
}
