//! A hostile client of `cacheroute epp`, one case at a time, over loopback; what it saw on one
//! line. `scripts/epp-hostile.sh` runs every case against an EPP binary and reads the EPP's
//! memory from /proc (docs/epp.md, "Budgets").
//!
//!   cargo run --example epp_hostile -- ADDR CASE
//!
//! CASE: `partial` (20 connections x 10 streams, each holding a gRPC message one byte short
//! of a 4 MiB + 64 KiB one, held for 5 s), `connections` (60 silent connections and 100
//! half-sent HTTP/1 heads: how many are closed at once and how many within 35 s), `headers`
//! (a header list of 40,000 names), `body` (a 100 MB body in 1 MiB messages).

use bytes::{BufMut, Bytes, BytesMut};
use cacheroute::router::epp::{proto, PROCESS};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use prost::Message;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Feed = tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::convert::Infallible>>;

struct Rx(tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, std::convert::Infallible>>);
impl futures_util::Stream for Rx {
    type Item = Result<Frame<Bytes>, std::convert::Infallible>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

fn message(r: proto::processing_request::Request) -> Bytes {
    let m = proto::ProcessingRequest {
        request: Some(r),
        metadata_context: None,
        observability_mode: false,
    }
    .encode_to_vec();
    let mut b = BytesMut::new();
    b.put_u8(0);
    b.put_u32(m.len() as u32);
    b.put_slice(&m);
    b.freeze()
}

fn headers(n: usize) -> proto::HttpHeaders {
    proto::HttpHeaders {
        headers: Some(proto::HeaderMap {
            headers: (0..n)
                .map(|i| proto::HeaderValue {
                    key: if i == 0 {
                        ":method".into()
                    } else {
                        format!("x-h-{i}")
                    },
                    value: String::new(),
                    raw_value: b"POST".to_vec(),
                })
                .collect(),
        }),
        end_of_stream: false,
    }
}

/// One `Process` call with a streamed body: its feed and (answers' bytes, grpc-status).
/// An HTTP/2 connection to the EPP at `addr`.
async fn h2<B>(addr: &str) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (tx, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    tx
}

async fn open(addr: &str) -> (Feed, tokio::task::JoinHandle<(usize, String)>) {
    let mut tx = h2(addr).await;
    let (feed, rx) = tokio::sync::mpsc::channel(4);
    let req = hyper::Request::post(format!("http://{addr}{PROCESS}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(Rx(rx)))
        .expect("request");
    let task = tokio::spawn(async move {
        let Ok(resp) = tx.send_request(req).await else {
            return (0, "reset".into());
        };
        match resp.into_body().collect().await {
            Ok(got) => {
                let status = got
                    .trailers()
                    .and_then(|t| t.get("grpc-status"))
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("none")
                    .to_string();
                (got.to_bytes().len(), status)
            }
            Err(_) => (0, "reset".into()),
        }
    });
    (feed, task)
}

/// Answers in a `Process` answer's bytes that are immediate responses.
fn immediate_responses(mut out: Bytes) -> usize {
    let mut n = 0;
    while out.len() >= 5 {
        let len = u32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        let m = out.split_to((5 + len).min(out.len()));
        if let Ok(r) = proto::ProcessingResponse::decode(&m[5..]) {
            n += usize::from(matches!(
                r.response,
                Some(proto::processing_response::Response::ImmediateResponse(_))
            ));
        }
    }
    n
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(addr), Some(case)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: epp_hostile ADDR partial|connections|headers|body");
        std::process::exit(2);
    };
    match case.as_str() {
        "partial" => {
            let len = (4 << 20) + (64 << 10);
            let mut held = Vec::new();
            for _ in 0..20 {
                for _ in 0..10 {
                    let (feed, task) = open(addr).await;
                    let mut b = BytesMut::with_capacity(len);
                    b.put_u8(0);
                    b.put_u32(len as u32);
                    b.resize(5 + len - 1, b'x');
                    let whole = b.freeze();
                    for piece in whole.chunks(1 << 20) {
                        let _ = feed
                            .send(Ok(Frame::data(Bytes::copy_from_slice(piece))))
                            .await;
                    }
                    held.push((feed, task));
                }
            }
            tokio::time::sleep(Duration::from_secs(5)).await;
            let mut closed: std::collections::BTreeMap<String, usize> = Default::default();
            let mut open_streams = 0;
            for (_, t) in &held {
                if !t.is_finished() {
                    open_streams += 1;
                }
            }
            for (feed, t) in held {
                if t.is_finished() {
                    *closed
                        .entry(t.await.map(|x| x.1).unwrap_or_default())
                        .or_default() += 1;
                }
                drop(feed);
            }
            println!("partial: 200 streams, {open_streams} still held after 5 s, closed by status {closed:?}");
        }
        "connections" => {
            let mut conns = Vec::new();
            for i in 0..160 {
                let mut s = tokio::net::TcpStream::connect(addr.as_str())
                    .await
                    .expect("connect");
                if i >= 60 {
                    let _ = s
                        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nx-a:")
                        .await;
                }
                conns.push(s);
            }
            let t0 = Instant::now();
            let mut closed_at = vec![None; conns.len()];
            while t0.elapsed() < Duration::from_secs(35) {
                for (i, s) in conns.iter_mut().enumerate() {
                    if closed_at[i].is_some() {
                        continue;
                    }
                    let mut b = [0u8; 512];
                    if let Ok(Ok(0) | Err(_)) =
                        tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await
                    {
                        closed_at[i] = Some(t0.elapsed());
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let within = |s: u64| {
                closed_at
                    .iter()
                    .flatten()
                    .filter(|d| d.as_secs() < s)
                    .count()
            };
            println!(
                "connections: 160 opened (60 silent, 100 half-sent heads); closed within 1 s: {}, within 35 s: {}, still open: {}",
                within(1),
                within(35),
                closed_at.iter().filter(|c| c.is_none()).count()
            );
        }
        "headers" => {
            let (feed, task) = open(addr).await;
            let _ = feed
                .send(Ok(Frame::data(message(
                    proto::processing_request::Request::RequestHeaders(headers(40_000)),
                ))))
                .await;
            drop(feed);
            let (bytes, status) = task.await.unwrap_or((0, "join".into()));
            println!("headers: 40,000 names: {bytes} answer bytes, grpc-status {status}");
        }
        "body" => {
            let mut body = BytesMut::new();
            body.extend_from_slice(&message(
                proto::processing_request::Request::RequestHeaders(headers(1)),
            ));
            let piece = Bytes::from(vec![b'x'; 1 << 20]);
            for i in 0..100 {
                body.extend_from_slice(&message(proto::processing_request::Request::RequestBody(
                    proto::HttpBody {
                        body: piece.clone(),
                        end_of_stream: i == 99,
                    },
                )));
            }
            let mut tx = h2(addr).await;
            let req = hyper::Request::post(format!("http://{addr}{PROCESS}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(Full::new(body.freeze()))
                .expect("request");
            let got = match tx.send_request(req).await {
                Ok(r) => r.into_body().collect().await.map(|c| c.to_bytes()).ok(),
                Err(_) => None,
            };
            let n = got.map_or(0, immediate_responses);
            println!("body: 100 MB in 1 MiB messages: {n} immediate responses");
        }
        other => {
            eprintln!("unknown case {other}");
            std::process::exit(2);
        }
    }
}
