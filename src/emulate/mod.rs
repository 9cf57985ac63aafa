//! `cacheroute emulate`: a vLLM- or SGLang-compatible engine emulator. It serves vLLM's
//! OpenAI-compatible endpoints (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! `/health`, `/metrics`, `/reset_prefix_cache`) with vLLM's JSON and SSE shapes and metric
//! names — or, with [`EngineApi::Sglang`], SGLang's routes (`/flush_cache` refused while
//! requests run, `/health` 503 while starting, `/health_generate`, `/get_server_info`),
//! metrics and `usage` shape (sources: `docs/emulator.md`) — while the timing
//! and the prefix cache come from the engine model ([`crate::engine::Replica`]) run in real
//! time (optionally sped up). The router, the replayer and telemetry can therefore be exercised
//! exactly as against vLLM, on one machine, without a GPU.
//!
//! Prefix identity comes from the prompt *text*, by the shared convention of
//! [`crate::workload::text`]: a token is a whitespace-separated word, and the prompt's full
//! `block_tokens`-word blocks are hashed in a chain. Prompts built by the replayer from a trace
//! therefore hit the emulator's cache exactly where the simulator's engine would.
//!
//! Pieces:
//! - [`EmulatorConfig`], [`start`], [`EmulatorHandle`]: the library API (tests start emulators
//!   in process; the study runner starts `cacheroute emulate` child processes).
//! - `core`: the engine task: one `Replica`, a virtual clock `v = real elapsed × time_scale`
//!   (the model's seconds, converted by [`TimeScale`] alone), token streaming at the model's
//!   decode cadence.
//! - `api`: the HTTP layer (axum): request parsing, vLLM response and SSE shapes, errors.
//! - `metrics`: Prometheus text with vLLM's metric names.
//! - `kv_publish`: with [`KvEventsConfig`] (vLLM's `--kv-events-config`), the cache's stores and
//!   evictions published as vLLM's KV-cache events over ZMQ after each advance of the replica.
//!
//! This is a live layer (tokio, axum); pure layers must not depend on it. Full description,
//! including what is approximated: `docs/emulator.md`.

mod api;
mod core;
mod kv_publish;
mod metrics;
mod reqlog;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

pub use crate::bounds::TimeScale;
use crate::engine::{EngineConfig, EngineError, KnobOverrides};
pub use crate::telemetry::engine_api::EngineApi;
pub use kv_publish::KvEventsConfig;

/// Default prefix-hash block, in tokens (vLLM's GPU block size).
pub const DEFAULT_BLOCK_TOKENS: u32 = 16;

/// Settings of one emulated engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EmulatorConfig {
    /// Address to listen on; port 0 picks a free port ([`EmulatorHandle::addr`] tells which).
    pub listen: SocketAddr,
    /// Engine spec, `model:device:precision:tpN[:kv-<precision>]`, e.g.
    /// `llama-3.1-8b:h100:fp8:tp1` (see `docs/engine-model.md`).
    pub engine: String,
    /// Engine knob overrides (KV cache size, max_num_seqs, …). `hash_block_tokens` is always
    /// `block_tokens`; `block_size` defaults to `block_tokens` unless set here (e.g. 128 to
    /// mimic vLLM-CPU, whose hits come in 128-token blocks).
    pub overrides: KnobOverrides,
    /// Tokens (words) per prefix-hash block of the prompt text; ≥ 1.
    pub block_tokens: u32,
    /// Virtual seconds per real second: 1 is real time, 10 runs ten times faster (checked
    /// where it is made: [`TimeScale::new`]).
    pub time_scale: TimeScale,
    /// Served model name (`model` in requests and responses, `model_name` label in metrics);
    /// `None` uses the spec's model, e.g. `llama-3.1-8b`.
    pub model_name: Option<String>,
    /// Model seconds of HTTP/tokenizer work before a request reaches the engine (scaled by
    /// `time_scale` like engine time). The engine model leaves it out; 0 by default, about
    /// 0.014 mimics vLLM-CPU as measured on this kind of machine (docs/real-vllm.md, docs/engine-model.md §5.3).
    pub frontend_delay_s: f64,
    /// Longest wait for a whole request head (idle keep-alive included), as in the router.
    pub head_timeout: std::time::Duration,
    /// Longest time for a whole request body after its head; then `408`.
    pub body_timeout: std::time::Duration,
    /// Client connections open at once; past it `503` and close.
    pub max_connections: usize,
    /// Whose HTTP dialect to speak: routes, `/metrics` names, `usage` shape.
    pub api: EngineApi,
    /// Model seconds after start during which the server is "starting" (SGLang: `/health`
    /// and `/health_generate` answer 503, as before its warm-up request finished). 0: none.
    pub startup_s: f64,
    /// Print one line on stdout per cache reset or flush and its answer (the CLI sets it).
    pub announce: bool,
    /// Write one JSON line per generation request to this file (created or truncated at
    /// start): server-side wall-clock arrival, first-token and end times (`docs/emulator.md`).
    pub request_log: Option<std::path::PathBuf>,
    /// Publish the prefix cache's changes as vLLM's KV-cache events over ZMQ (vLLM's
    /// `--kv-events-config`); `None`: off, and nothing is recorded.
    pub kv_events: Option<KvEventsConfig>,
}

/// Largest request body the emulator reads (bytes); larger gets `413`.
pub const MAX_BODY_BYTES: usize = 4 << 20;

impl EmulatorConfig {
    /// Defaults for an engine spec: `127.0.0.1:0`, 16-token blocks, real time.
    pub fn new(engine: impl Into<String>) -> EmulatorConfig {
        EmulatorConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            engine: engine.into(),
            overrides: KnobOverrides::default(),
            block_tokens: DEFAULT_BLOCK_TOKENS,
            time_scale: TimeScale::REAL,
            model_name: None,
            frontend_delay_s: 0.0,
            head_timeout: std::time::Duration::from_secs(30),
            body_timeout: std::time::Duration::from_secs(30),
            max_connections: 4096,
            api: EngineApi::Vllm,
            startup_s: 0.0,
            announce: false,
            request_log: None,
            kv_events: None,
        }
    }

    /// The engine configuration this emulator runs (validated): the spec with the overrides,
    /// `hash_block_tokens = block_tokens` and, unless overridden, `block_size = block_tokens`.
    pub fn engine_config(&self) -> Result<EngineConfig, EmulateError> {
        let mut problems = Vec::new();
        if self.block_tokens == 0 {
            problems.push("block_tokens: must be ≥ 1 (e.g. 16)".to_string());
        }
        if !(self.frontend_delay_s.is_finite() && self.frontend_delay_s >= 0.0) {
            problems.push(format!(
                "frontend_delay_s: must be a finite number ≥ 0, got {}",
                self.frontend_delay_s
            ));
        }
        if !(self.startup_s.is_finite() && self.startup_s >= 0.0) {
            problems.push(format!(
                "startup_s: must be a finite number ≥ 0, got {}",
                self.startup_s
            ));
        }
        if self.head_timeout.is_zero() || self.body_timeout.is_zero() {
            problems.push("head_timeout, body_timeout: must be > 0".to_string());
        }
        if self.max_connections == 0 {
            problems.push("max_connections: must be ≥ 1".to_string());
        }
        if let Some(name) = &self.model_name {
            if name.trim().is_empty() {
                problems.push("model_name: must not be empty".to_string());
            }
        }
        if !problems.is_empty() {
            return Err(EmulateError::Config(problems.join("; ")));
        }
        let mut o = self.overrides.clone();
        o.block_size = Some(o.block_size.unwrap_or(self.block_tokens));
        o.hash_block_tokens = None;
        Ok(crate::engine::engine_config(
            &self.engine,
            self.block_tokens,
            &o,
        )?)
    }

    /// The served model name (explicit, or the spec's model).
    pub fn served_model_name(&self) -> String {
        match &self.model_name {
            Some(n) => n.clone(),
            None => self
                .engine
                .split(':')
                .next()
                .unwrap_or("emulated")
                .to_string(),
        }
    }
}

/// Errors starting or stopping an emulator.
#[derive(Debug, thiserror::Error)]
pub enum EmulateError {
    /// Settings out of range (every problem listed).
    #[error("emulator settings: {0}")]
    Config(String),
    /// The engine spec or knobs are invalid.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {error}; pick a free port (or port 0 for any)")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error (in the message, not chained).
        error: std::io::Error,
    },
    /// The request log could not be created or written.
    #[error("request log {path} (--request-log): {error}; choose a writable path")]
    RequestLog {
        /// The file asked for.
        path: std::path::PathBuf,
        /// The OS error (in the message, not chained).
        error: std::io::Error,
    },
    /// The KV-event sockets could not be bound.
    #[error("{0} (--kv-events-config)")]
    KvEvents(String),
    /// The HTTP server failed while running.
    #[error("emulator HTTP server on {addr} failed: {error}")]
    Serve {
        /// The bound address.
        addr: SocketAddr,
        /// The error (in the message, not chained).
        error: std::io::Error,
    },
}

/// A running emulator. Dropping it stops the server and the engine (without waiting); call
/// [`EmulatorHandle::shutdown`] to stop and wait.
#[derive(Debug)]
pub struct EmulatorHandle {
    addr: SocketAddr,
    shutdown: tokio::sync::watch::Sender<bool>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    engine: Option<tokio::task::JoinHandle<()>>,
    config: EngineConfig,
    request_log: Option<reqlog::RequestLogWriter>,
    kv_endpoints: Option<(String, Option<String>)>,
}

impl EmulatorHandle {
    /// The bound address (the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL clients use (`/v1/completions` etc. go after it).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound KV-event endpoints (PUB, replay), when events are published: `tcp://HOST:PORT`
    /// with the port resolved (a configured port 0 picks a free one).
    pub fn kv_event_endpoints(&self) -> Option<(&str, Option<&str>)> {
        self.kv_endpoints
            .as_ref()
            .map(|(p, r)| (p.as_str(), r.as_deref()))
    }

    /// The engine configuration being emulated.
    pub fn engine_config(&self) -> &EngineConfig {
        &self.config
    }

    /// Stop: the engine stops at once (open streams end with an error chunk), the server stops
    /// accepting and finishes open connections. Waits for both.
    pub async fn shutdown(mut self) -> Result<(), EmulateError> {
        let _ = self.shutdown.send(true);
        if let Some(e) = self.engine.take() {
            let _ = e.await;
        }
        let mut served = Ok(());
        if let Some(s) = self.server.take() {
            if let Ok(Err(error)) = s.await {
                served = Err(EmulateError::Serve {
                    addr: self.addr,
                    error,
                });
            }
        }
        if let Some(w) = self.request_log.take() {
            let done = tokio::task::spawn_blocking(move || w.finish())
                .await
                .unwrap_or(Ok((0, 0)));
            match done {
                Ok((_, 0)) => {}
                Ok((written, dropped)) => eprintln!(
                    "request log: {dropped} lines dropped (the writer fell behind), {written} written"
                ),
                Err((path, error)) => return Err(EmulateError::RequestLog { path, error }),
            }
        }
        served
    }
}

impl Drop for EmulatorHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Start an emulator on the current tokio runtime: validate the settings, bind, spawn the
/// engine task and the HTTP server. Returns once the socket is bound (requests may be sent at
/// once).
pub async fn start(cfg: EmulatorConfig) -> Result<EmulatorHandle, EmulateError> {
    let engine_cfg = cfg.engine_config()?;
    let request_log = match &cfg.request_log {
        Some(path) => Some(
            reqlog::open(path).map_err(|error| EmulateError::RequestLog {
                path: path.clone(),
                error,
            })?,
        ),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|error| EmulateError::Bind {
            addr: cfg.listen,
            error,
        })?;
    let addr = listener.local_addr().map_err(|error| EmulateError::Bind {
        addr: cfg.listen,
        error,
    })?;
    let (kv_tx, kv_endpoints) = match &cfg.kv_events {
        Some(k) => {
            let (tx, p, r) = kv_publish::start(k).await.map_err(EmulateError::KvEvents)?;
            (Some(tx), Some((p, r)))
        }
        None => (None, None),
    };
    let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
    let model_name = cfg.served_model_name();
    let info = metrics::MetricsInfo::new(&model_name, &engine_cfg);
    let state = Arc::new(Mutex::new(metrics::MetricsState::for_api(cfg.api)));
    let (engine, engine_task) = core::spawn(
        engine_cfg.clone(),
        cfg.time_scale,
        state.clone(),
        kv_tx.map(|tx| (tx, cfg.block_tokens)),
        shutdown_rx.clone(),
    );
    let app = api::router(api::AppState::new(
        engine,
        api::Serving {
            api: cfg.api,
            model_name,
            block_tokens: cfg.block_tokens,
            frontend_delay: cfg.time_scale.wall_duration(cfg.frontend_delay_s),
            ready_at: tokio::time::Instant::now() + cfg.time_scale.wall_duration(cfg.startup_s),
            announce: cfg.announce,
            kv_token_ids: cfg.kv_events.is_some(),
        },
        engine_cfg.clone(),
        info,
        state,
    ));
    let limits = Limits {
        head_timeout: cfg.head_timeout,
        body_timeout: cfg.body_timeout,
        max_connections: cfg.max_connections,
    };
    let log = request_log.as_ref().map(|w| w.log());
    let server = tokio::spawn(serve(listener, app, limits, log, shutdown_rx));
    Ok(EmulatorHandle {
        addr,
        shutdown,
        server: Some(server),
        engine: Some(engine_task),
        config: engine_cfg,
        request_log,
        kv_endpoints,
    })
}

/// The serving limits (the router's, for the same attacks).
#[derive(Debug, Clone, Copy)]
struct Limits {
    head_timeout: std::time::Duration,
    body_timeout: std::time::Duration,
    max_connections: usize,
}

/// Serve `app` on `listener` until `stop`: hyper's HTTP/1 server per connection with a
/// header-read timeout, every request body read whole within the body timeout and size limit
/// before the app sees it, connections past the cap answered `503` and closed; on stop,
/// graceful shutdown of every connection.
async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: Limits,
    log: Option<reqlog::RequestLog>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    let open = Arc::new(AtomicUsize::new(0));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let tcp = tokio::select! {
            a = listener.accept() => match a {
                Ok((tcp, _)) => tcp,
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = async { let _ = stop.wait_for(|s| *s).await; } => break,
        };
        while conns.try_join_next().is_some() {}
        // Small SSE chunks must leave at once: without TCP_NODELAY, Nagle's algorithm holds a
        // token chunk behind an unacknowledged one (a 40 ms stall with delayed ACKs).
        let _ = tcp.set_nodelay(true);
        if open.fetch_add(1, SeqCst) >= limits.max_connections {
            open.fetch_sub(1, SeqCst);
            conns.spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut tcp = tcp;
                let body = r#"{"error":{"message":"too many connections (max_connections)","type":"server_busy","code":503}}"#;
                let out = format!("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}", body.len());
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), tcp.write_all(out.as_bytes())).await;
            });
            continue;
        }
        let (app, open, mut stop, log) = (app.clone(), open.clone(), stop.clone(), log.clone());
        conns.spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    let log = log.clone();
                    async move {
                        // The head has been read: the request's arrival.
                        let arrival_s = crate::unix_now_s();
                        let logged = log.filter(|_| {
                            req.method() == hyper::Method::POST
                                && req.uri().path().ends_with("completions")
                        });
                        let path = req.uri().path().to_string();
                        let resp = bounded(app, req, limits).await;
                        Ok::<_, std::convert::Infallible>(match logged {
                            Some(l) => l.wrap(resp, arrival_s, path),
                            None => resp,
                        })
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.head_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            open.fetch_sub(1, SeqCst);
        });
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// Read `req`'s body whole (within the body timeout and [`MAX_BODY_BYTES`]), then hand it to
/// the app; `408`/`413` otherwise.
async fn bounded(
    app: axum::Router,
    req: hyper::Request<hyper::body::Incoming>,
    limits: Limits,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let (parts, body) = req.into_parts();
    let error = |status: axum::http::StatusCode, msg: &str| {
        let body = serde_json::json!({"error": {"message": msg, "type": "invalid_request_error", "code": status.as_u16()}});
        (status, axum::Json(body)).into_response()
    };
    let limited = http_body_util::Limited::new(body, MAX_BODY_BYTES);
    let bytes = match tokio::time::timeout(limits.body_timeout, limited.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return error(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                "request body too large",
            )
        }
        Ok(Err(e)) => {
            return error(
                axum::http::StatusCode::BAD_REQUEST,
                &format!("could not read the request body: {e}"),
            )
        }
        Err(_) => {
            return error(
                axum::http::StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive within the body timeout",
            )
        }
    };
    let req = hyper::Request::from_parts(parts, axum::body::Body::from(bytes));
    match app.oneshot(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    }
}
