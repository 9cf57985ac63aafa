//! A tiny OpenAI-compatible mock engine for tests: `POST /v1/completions` and
//! `/v1/chat/completions` (non-streaming JSON, or `"stream": true` SSE of N chunks with a
//! delay between them), `GET /v1/models`, `GET /health`. It records every completion request
//! (headers of interest and body), can stall (accept requests and never answer), can report
//! itself unhealthy, and can be killed (listener closed and every open connection dropped).
//!
//! Plain hyper on a hand-written accept loop, so that killing really drops connections.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error>;

/// How the mock answers.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// SSE chunks per streaming response (before `data: [DONE]`).
    pub chunks: usize,
    /// Delay before each SSE chunk.
    pub chunk_delay: Duration,
    /// Delay before a non-streaming answer (and before the streaming headers).
    pub first_delay: Duration,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            chunks: 4,
            chunk_delay: Duration::from_millis(5),
            first_delay: Duration::ZERO,
        }
    }
}

/// One recorded completion request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    /// Value of the `x-test-id` header, if any.
    pub test_id: Option<String>,
    /// Value of the `x-cacheroute-key` header, if any.
    pub key: Option<String>,
    pub body: Bytes,
}

struct State {
    name: String,
    cfg: MockConfig,
    stall: AtomicBool,
    healthy: AtomicBool,
    hits: AtomicU64,
    seen: Mutex<Vec<Seen>>,
}

/// A running mock engine.
pub struct MockEngine {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

/// The SSE chunk `i` a streaming mock named `name` sends.
pub fn sse_chunk(name: &str, i: usize) -> String {
    format!("data: {{\"id\":\"cmpl-{name}\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\" tok{i}\"}}]}}\n\n")
}

/// The whole SSE body a streaming mock named `name` sends with `chunks` chunks.
pub fn sse_body(name: &str, chunks: usize) -> String {
    let mut s: String = (0..chunks).map(|i| sse_chunk(name, i)).collect();
    s.push_str("data: [DONE]\n\n");
    s
}

/// The non-streaming body of a mock named `name`.
pub fn json_body(name: &str) -> String {
    format!("{{\"id\":\"cmpl-{name}\",\"object\":\"text_completion\",\"model\":\"mock\",\"choices\":[{{\"index\":0,\"text\":\"hello from {name}\",\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":3,\"total_tokens\":4}}}}")
}

impl MockEngine {
    /// Start on 127.0.0.1 with an ephemeral port.
    pub async fn start(name: &str, cfg: MockConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind mock");
        let addr = listener.local_addr().expect("mock addr");
        let state = Arc::new(State {
            name: name.to_string(),
            cfg,
            stall: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            hits: AtomicU64::new(0),
            seen: Mutex::new(Vec::new()),
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            // Connections live in this set: aborting the accept task drops them all.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let (tcp, _) = match listener.accept().await {
                    Ok(x) => x,
                    Err(_) => continue,
                };
                let _ = tcp.set_nodelay(true);
                let st = st.clone();
                conns.spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Self { addr, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Completion requests received.
    pub fn hits(&self) -> u64 {
        self.state.hits.load(SeqCst)
    }
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }
    /// Accept completion requests and never answer them (health still answers).
    pub fn set_stall(&self, on: bool) {
        self.state.stall.store(on, SeqCst);
    }
    /// Make `/health` answer 503 (or 200 again).
    pub fn set_healthy(&self, on: bool) {
        self.state.healthy.store(on, SeqCst);
    }
    /// Close the listener and drop every open connection.
    pub fn kill(&self) {
        self.task.abort();
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn full(status: StatusCode, ctype: &str, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(
            Full::new(Bytes::from(body))
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .unwrap()
}

async fn handle(st: Arc<State>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    match (req.method().as_str(), path.as_str()) {
        ("GET", "/health") => Ok(if st.healthy.load(SeqCst) {
            full(StatusCode::OK, "application/json", "{}".into())
        } else {
            full(
                StatusCode::SERVICE_UNAVAILABLE,
                "application/json",
                "{}".into(),
            )
        }),
        ("GET", "/v1/models") => Ok(full(
            StatusCode::OK,
            "application/json",
            format!(
                "{{\"object\":\"list\",\"data\":[{{\"id\":\"mock\",\"owned_by\":\"{}\"}}]}}",
                st.name
            ),
        )),
        ("POST", "/v1/completions") | ("POST", "/v1/chat/completions") => {
            let h = |n: &str| {
                req.headers()
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from)
            };
            let (test_id, key) = (h("x-test-id"), h("x-cacheroute-key"));
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            st.hits.fetch_add(1, SeqCst);
            st.seen.lock().unwrap().push(Seen {
                path,
                test_id,
                key,
                body: body.clone(),
            });
            if st.stall.load(SeqCst) {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(st.cfg.first_delay).await;
            let stream = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("stream").and_then(|s| s.as_bool()))
                .unwrap_or(false);
            if !stream {
                return Ok(full(
                    StatusCode::OK,
                    "application/json",
                    json_body(&st.name),
                ));
            }
            let n = st.cfg.chunks;
            let delay = st.cfg.chunk_delay;
            let name = st.name.clone();
            let chunks = futures_util::stream::unfold(0usize, move |i| {
                let name = name.clone();
                async move {
                    if i > n {
                        return None;
                    }
                    tokio::time::sleep(delay).await;
                    let s = if i < n {
                        sse_chunk(&name, i)
                    } else {
                        "data: [DONE]\n\n".to_string()
                    };
                    Some((Ok::<_, std::io::Error>(Frame::data(Bytes::from(s))), i + 1))
                }
            });
            Ok(Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .body(BodyExt::boxed_unsync(StreamBody::new(chunks)))
                .unwrap())
        }
        _ => Ok(full(
            StatusCode::NOT_FOUND,
            "application/json",
            "{\"error\":\"not found\"}".into(),
        )),
    }
}
