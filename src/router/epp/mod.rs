//! `cacheroute epp`: the router as an Envoy `ext_proc` endpoint picker (the Gateway API
//! Inference Extension's endpoint-picker protocol). A second front over the router's shared
//! state: the same [`Shared`] (policy object, fleet view, health checks, discovery, CacheRoute
//! control loop) that `cacheroute route` serves HTTP from, keyed and picked by the same code
//! ([`admit`], [`Shared::choose_within`]); only the wire differs.
//!
//! Per HTTP request Envoy opens one `Process` stream and sends the request's headers, then
//! (request body mode BUFFERED) its whole body. The EPP answers the headers with CONTINUE, the
//! body with the pick: the header `x-gateway-destination-endpoint: IP:PORT` and the same value in
//! dynamic metadata under `envoy.lb` (with the rest of the key's planned set after it, the
//! fallbacks Envoy may retry on). A refused request (bad JSON, no key, body over the max body
//! size) gets an immediate response with the route's status and message; 503 when nothing is
//! eligible, 429 when the EPP holds as many request bodies as it may (shed). Response headers
//! tell it what served (`x-gateway-destination-endpoint-served`, checked against the backends)
//! and the status; the stream's end (Envoy closes it when the HTTP request is done) ends the
//! request's in-flight accounting. gRPC health (`grpc.health.v1.Health/Check`): the empty
//! service is liveness, `readiness` (or the ext_proc service's name) is SERVING only while a
//! destination is up.
//!
//! gRPC is served by hyper's HTTP/2 with the messages of [`proto`]: no code generation. The
//! same port answers HTTP/1 (`/metrics`, `/health`, the admin API) with the router's handlers.

#[cfg(test)]
mod fuzz;
pub mod proto;

use super::config::{RouterConfig, RouterError};
use super::fleet::Fleet;
use super::proxy::{admit, Flight, Refusal, Routed};
use super::record::Capture;
use super::state::{Held, Shared};
use crate::policy::FleetView;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use prost::Message;
use proto::processing_request::Request as In;
use proto::processing_response::Response as Out;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The request header (and `envoy.lb` metadata key) naming the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The response header naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The subset hint's key under [`SUBSET_NAMESPACE`].
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The dynamic-metadata namespace of the pick.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The gRPC method Envoy's ext_proc filter calls.
pub const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
/// gRPC health checking.
pub const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";
/// What a gRPC message may hold beyond the largest body (headers, framing).
const FRAME_SLACK: usize = 64 << 10;

type GrpcBody = UnsyncBoxBody<Bytes, Infallible>;

/// A running EPP. Dropping it does not stop the server; call [`EppHandle::shutdown`].
pub struct EppHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    drain_timeout: Duration,
}

impl EppHandle {
    /// The bound address (the real port when the config asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The fleet view (up flags and counters).
    pub fn fleet(&self) -> &Fleet {
        &self.shared.fleet
    }

    /// Stop accepting, let open streams finish (up to the drain timeout), stop the health
    /// checks and the control loop, write the state file if one is configured. Returns whether
    /// everything drained in time.
    pub async fn shutdown(self) -> bool {
        self.shutdown_report().await.drained
    }

    /// [`EppHandle::shutdown`], also closing the recording (as `route`'s does).
    pub async fn shutdown_report(mut self) -> super::ShutdownReport {
        self.shared.begin_drain();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let drained = tokio::time::timeout(self.drain_timeout, &mut self.server)
            .await
            .is_ok();
        if !drained {
            self.server.abort();
        }
        super::lifecycle::stop(&self.shared);
        super::ShutdownReport::close(&self.shared, drained)
    }
}

/// `IP:PORT` of a backend base URL (`http://IP:PORT`), as Envoy takes it.
fn endpoint(url: &str) -> &str {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    rest.split('/').next().unwrap_or(rest)
}

/// The destination slot whose backend is at `addr`, if any.
fn slot_of(fleet: &Fleet, addr: SocketAddr) -> Option<usize> {
    fleet
        .backends()
        .into_iter()
        .find(|(_, u)| endpoint(u).parse::<SocketAddr>().ok() == Some(addr))
        .map(|(d, _)| d)
}

/// Bind, start the router's health checks, discovery and control loop, and serve ext_proc.
pub async fn start(mut cfg: RouterConfig) -> Result<EppHandle, RouterError> {
    // The EPP names destinations to Envoy as IP:PORT: so must every backend, discovered too.
    cfg.ip_port_backends = true;
    super::lifecycle::prepare(&mut cfg).await?;
    // What a request cost comes from its response body, which Envoy streams to the EPP when
    // its config says `response_body_mode: STREAMED` (deploy/envoy/epp.yaml says how).
    let (recorder, window) = super::lifecycle::open_capture(&cfg)?;
    let (listener, addr) = super::lifecycle::bind(cfg.listen).await?;
    let drain_timeout = cfg.drain_timeout;
    let shared = Shared::new(cfg, recorder, window)?;
    super::lifecycle::background(&shared)?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, shared.clone(), rx));
    Ok(EppHandle {
        addr,
        shared,
        stop: Some(tx),
        server,
        drain_timeout,
    })
}

/// Serve on `listener` until `stop`, then close connections gracefully once their streams
/// end. A connection that opens with HTTP/2's preface is Envoy's (gRPC: ext_proc and health);
/// any other is HTTP/1: `/metrics`, `/health` and the admin API, the router's own handlers.
async fn serve(
    listener: tokio::net::TcpListener,
    s: Arc<Shared>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let stop = async move {
        let _ = stop.await;
    };
    let app = super::proxy::admin_app(s.clone());
    super::lifecycle::accept_until(listener, stop, |a| {
        // `max_connections` as on `route`: past it a connection is closed at once (counted
        // as refused); an HTTP/2 client cannot read an HTTP/1 refusal.
        let Some(held) = s.admit_connection() else {
            tracing::debug!("ext_proc: a connection past max_connections closed");
            drop(a);
            return;
        };
        let (s, app) = (s.clone(), app.clone());
        tokio::spawn(async move {
            let super::lifecycle::Accepted {
                tcp,
                mut stopping,
                alive,
            } = a;
            // `head_timeout` as on `route`: a connection that has not said which protocol it
            // speaks (HTTP/2's whole preface, or an HTTP/1 head) by then is closed.
            let head_timeout = s.cfg.head_timeout;
            let opened =
                tokio::time::timeout(head_timeout, opens_with_preface(&tcp, &mut stopping));
            let Ok(Some(h2)) = opened.await else {
                return;
            };
            let io = hyper_util::rt::TokioIo::new(tcp);
            if h2 {
                let streams = s.cfg.max_connections.min(u32::MAX as usize) as u32;
                let svc = hyper::service::service_fn(move |req| {
                    let s = s.clone();
                    async move { Ok::<_, Infallible>(handle(s, req).await) }
                });
                let conn =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .timer(hyper_util::rt::TokioTimer::new())
                        .max_concurrent_streams(streams)
                        // A peer that stops answering HTTP/2 pings for a head timeout is gone.
                        .keep_alive_interval(Some(head_timeout))
                        .keep_alive_timeout(head_timeout)
                        .serve_connection(io, svc);
                let conn = std::pin::pin!(conn);
                drive(conn, |c| c.graceful_shutdown(), &mut stopping).await;
            } else {
                let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    use tower::ServiceExt;
                    app.clone().oneshot(req)
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(head_timeout)
                    .serve_connection(io, svc);
                let conn = std::pin::pin!(conn);
                drive(conn, |c| c.graceful_shutdown(), &mut stopping).await;
            }
            drop(alive);
            drop(held);
        });
    })
    .await
}

/// Run a connection to its end; once the server stops, tell it (`graceful`) to finish its
/// open streams and take no more, and wait for that.
async fn drive<C: std::future::Future>(
    mut conn: std::pin::Pin<&mut C>,
    graceful: impl FnOnce(std::pin::Pin<&mut C>),
    stopping: &mut tokio::sync::watch::Receiver<bool>,
) {
    let stop = tokio::select! {
        _ = conn.as_mut() => false,
        _ = stop_signalled(stopping) => true,
    };
    if stop {
        graceful(conn.as_mut());
        let _ = conn.await;
    }
}

/// Until `stopping` turns true (its guard dropped at once: the future stays `Send`).
async fn stop_signalled(stopping: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stopping.wait_for(|v| *v).await;
}

/// HTTP/2's connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the connection opens with HTTP/2's preface (waiting for all of it); `false` as
/// soon as its first bytes are not the preface's (HTTP/1); `None` when it closed (or the
/// server stops) before that was known.
async fn opens_with_preface(
    tcp: &tokio::net::TcpStream,
    stopping: &mut tokio::sync::watch::Receiver<bool>,
) -> Option<bool> {
    let mut head = [0u8; PREFACE.len()];
    let mut seen = 0;
    loop {
        let n = tokio::select! {
            r = tcp.peek(&mut head) => r.ok()?,
            _ = stop_signalled(stopping) => return None,
        };
        if n == 0 {
            return None;
        }
        let got = head.get(..n)?;
        if !PREFACE.starts_with(got) {
            return Some(false);
        }
        if n == PREFACE.len() {
            return Some(true);
        }
        // A part of the preface so far: wait for more (peek returns at once while the bytes
        // seen are unchanged, so sleep before looking again).
        if n == seen {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen = n;
    }
}

async fn handle(s: Arc<Shared>, req: hyper::Request<Incoming>) -> hyper::Response<GrpcBody> {
    match req.uri().path() {
        PROCESS => process(s, req.into_body()),
        HEALTH_CHECK => health(&s, req.into_body()).await,
        path => {
            tracing::warn!("ext_proc: a call to unknown method {path} refused");
            grpc_response(body_of(vec![trailers(
                12,
                &format!("unknown method {path}; the EPP serves {PROCESS} and {HEALTH_CHECK}"),
            )]))
        }
    }
}

fn grpc_response(body: GrpcBody) -> hyper::Response<GrpcBody> {
    let mut r = hyper::Response::new(body);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/grpc"),
    );
    r
}

fn body_of(frames: Vec<Frame<Bytes>>) -> GrpcBody {
    StreamBody::new(futures_util::stream::iter(
        frames.into_iter().map(Ok::<_, Infallible>),
    ))
    .boxed_unsync()
}

/// `grpc-status` (and `grpc-message`, percent-encoded) trailers.
fn trailers(code: u32, message: &str) -> Frame<Bytes> {
    let mut h = hyper::HeaderMap::new();
    h.insert("grpc-status", code.into());
    if !message.is_empty() {
        let mut enc = String::with_capacity(message.len());
        for b in message.bytes() {
            if (0x20..0x7f).contains(&b) && b != b'%' {
                enc.push(b as char);
            } else {
                enc.push_str(&format!("%{b:02X}"));
            }
        }
        if let Ok(v) = hyper::header::HeaderValue::from_str(&enc) {
            h.insert("grpc-message", v);
        }
    }
    Frame::trailers(h)
}

/// One gRPC message: the 5-byte prefix (uncompressed) and `msg`.
fn frame(msg: &impl Message) -> Bytes {
    let body = msg.encode_to_vec();
    let mut b = BytesMut::with_capacity(5 + body.len());
    b.put_u8(0);
    b.put_u32(body.len() as u32);
    b.put_slice(&body);
    b.freeze()
}

/// The next whole gRPC message in `buf`, `None` until one has arrived, or the gRPC status and
/// message to close the stream with.
fn next_message(buf: &mut BytesMut, limit: usize) -> Result<Option<Bytes>, (u32, String)> {
    let Some(&[flag, a, b, c, d]) = buf.get(..5) else {
        return Ok(None);
    };
    if flag != 0 {
        return Err((
            12,
            "a compressed gRPC message; configure Envoy's ext_proc cluster without gRPC compression".into(),
        ));
    }
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if len > limit {
        return Err((
            8,
            format!("a {len}-byte gRPC message is over the EPP's limit of {limit} bytes (max_body_bytes plus 64 KiB)"),
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    buf.advance(5);
    Ok(Some(buf.split_to(len).freeze()))
}

/// The request side of a `Process` stream: bytes as they arrive, whole `ProcessingRequest`s
/// out (the hand-written part of the EPP's gRPC, fuzzed against tonic's decoder in
/// `fuzz.rs`).
struct Reader {
    /// Bytes read that do not yet make a whole gRPC message.
    buf: BytesMut,
    /// The largest message taken.
    limit: usize,
}

impl Reader {
    fn new(limit: usize) -> Self {
        Reader {
            buf: BytesMut::new(),
            limit,
        }
    }

    /// Bytes as they arrived.
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held that are not yet a whole message.
    fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next whole message, `None` until one has arrived, or the gRPC status and message
    /// to close the stream with: 8 for a message over the limit, 12 for a compressed one, 3
    /// for one that is no `ProcessingRequest`.
    fn next(&mut self) -> Result<Option<proto::ProcessingRequest>, (u32, String)> {
        let Some(msg) = next_message(&mut self.buf, self.limit)? else {
            return Ok(None);
        };
        proto::ProcessingRequest::decode(msg)
            .map(Some)
            .map_err(|e| {
                (
                    3,
                    format!("a malformed ProcessingRequest ({e}); stream closed"),
                )
            })
    }

    /// The stream ended: whether inside a message (status 3).
    fn end(&self) -> Result<(), (u32, String)> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err((3, "the stream ended inside a gRPC message".to_string()))
        }
    }

    /// Drop what is held (the stream is closing).
    fn clear(&mut self) {
        self.buf = BytesMut::new();
    }
}

/// `grpc.health.v1.Health/Check`: `""` is liveness (SERVING unless draining); `readiness` or
/// the ext_proc service is readiness (SERVING while a destination is up); other names are
/// NOT_FOUND.
async fn health(s: &Shared, body: Incoming) -> hyper::Response<GrpcBody> {
    let limited = http_body_util::Limited::new(body, FRAME_SLACK);
    let mut bytes = match limited.collect().await {
        Ok(b) => BytesMut::from(b.to_bytes()),
        Err(e) => {
            return grpc_response(body_of(vec![trailers(
                3,
                &format!("health check request unreadable: {e}"),
            )]))
        }
    };
    let req = match next_message(&mut bytes, FRAME_SLACK) {
        Ok(Some(m)) => proto::HealthCheckRequest::decode(m).map_err(|e| e.to_string()),
        Ok(None) => Err("no HealthCheckRequest message".into()),
        Err((_, m)) => Err(m),
    };
    let req = match req {
        Ok(r) => r,
        Err(m) => {
            tracing::warn!("grpc health: a malformed request refused: {m}");
            return grpc_response(body_of(vec![trailers(3, &m)]));
        }
    };
    let draining = s.draining.load(Relaxed);
    let serving = match req.service.as_str() {
        "" | "liveness" => !draining,
        "readiness" | "envoy.service.ext_proc.v3.ExternalProcessor" => {
            !draining && s.fleet.live() > 0
        }
        other => {
            return grpc_response(body_of(vec![trailers(
                5,
                &format!("unknown service {other:?}; ask for \"\" (liveness) or \"readiness\""),
            )]))
        }
    };
    let resp = proto::HealthCheckResponse {
        status: if serving { 1 } else { 2 },
    };
    grpc_response(body_of(vec![Frame::data(frame(&resp)), trailers(0, "")]))
}

/// The `Process` stream: its answer is a body that reads Envoy's messages as hyper polls it
/// and yields the answer to each, then the closing trailers. No task and no channel of its
/// own: the stream's messages are read and answered on the task hyper polls the answer on.
fn process<B>(s: Arc<Shared>, body: B) -> hyper::Response<GrpcBody>
where
    B: hyper::body::Body<Data = Bytes> + Unpin + Send + 'static,
{
    grpc_response(ProcessBody::new(s, body).boxed_unsync())
}

/// The answer side of one `Process` stream (see [`process`]).
///
/// Budgets, as `route` keeps them for a request body: the bytes of a gRPC message that has
/// not yet arrived whole count against `max_buffered_bytes` from its first byte (past it the
/// stream ends with RESOURCE_EXHAUSTED), and a message must arrive whole within
/// `body_timeout` of its first byte (else DEADLINE_EXCEEDED). An immediate response (a
/// refusal) is the stream's last answer.
struct ProcessBody<B> {
    incoming: B,
    /// What was read, into messages.
    reader: Reader,
    /// The body budget `buf` holds (`None`: nothing held).
    held: Option<Held>,
    /// When the message now arriving in `buf` must be whole (`None`: none is arriving).
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    ex: Exchange,
    /// The gRPC status and message the stream closes with, once decided.
    closing: Option<(u32, String)>,
    /// The trailers were yielded.
    done: bool,
}

/// What one buffered message asks for.
enum Step {
    /// An answer to send.
    Answer(Bytes),
    /// Nothing to send (an observability-mode message); read on.
    Quiet,
    /// No whole message buffered.
    More,
}

impl<B> ProcessBody<B> {
    fn new(s: Arc<Shared>, incoming: B) -> Self {
        let limit = s.cfg.max_body_bytes + FRAME_SLACK;
        ProcessBody {
            incoming,
            reader: Reader::new(limit),
            held: s.reserve_body(0),
            deadline: None,
            ex: Exchange::new(s),
            closing: None,
            done: false,
        }
    }

    /// Answer the next whole message in the buffer, if any; decides `closing` when the stream
    /// must end.
    fn step(&mut self) -> Step {
        let req = match self.reader.next() {
            Ok(Some(r)) => r,
            Ok(None) => return Step::More,
            Err((8, m)) => {
                // A body too large to hold: refused with the route's 413 without reading it;
                // the stream ends there.
                tracing::warn!("ext_proc: request refused: {m}");
                let r = Refusal::too_large(&self.ex.s);
                let resp = immediate(r.status.as_u16(), &r.body(), "cacheroute_body_too_large");
                self.closing = Some((0, String::new()));
                return Step::Answer(frame(&resp));
            }
            Err((code, m)) => {
                tracing::warn!("ext_proc: stream refused: {m}");
                self.closing = Some((code, m));
                return Step::More;
            }
        };
        // A whole message: the next one's deadline starts with its first byte, and its bytes
        // leave the reader's hold before the exchange reserves its body (never counted twice).
        self.deadline = None;
        self.hold_buffered();
        let observe = req.observability_mode;
        match self.ex.on(req) {
            Ok(resp) => {
                if matches!(resp.response, Some(Out::ImmediateResponse(_))) {
                    // Envoy answers the client with it and is done with the stream.
                    self.closing = Some((0, String::new()));
                }
                if observe {
                    Step::Quiet
                } else {
                    Step::Answer(frame(&resp))
                }
            }
            Err((code, m)) => {
                tracing::warn!("ext_proc: {m}; stream closed");
                self.closing = Some((code, m));
                Step::More
            }
        }
    }

    /// Make the budget held match the bytes buffered; false (and `closing` decided) when the
    /// budget cannot hold them.
    fn hold_buffered(&mut self) -> bool {
        let n = self.reader.buffered();
        if self.held.as_mut().is_some_and(|h| h.resize(n)) || (n == 0 && self.held.is_none()) {
            return true;
        }
        let m = format!(
            "{n} bytes of an incoming gRPC message do not fit the EPP's body budget (max_buffered_bytes {}); retry shortly",
            self.ex.s.cfg.max_buffered_bytes
        );
        tracing::warn!("ext_proc: {m}; stream closed");
        self.closing = Some((8, m));
        false
    }
}

impl<B> hyper::body::Body for ProcessBody<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if let Some((code, message)) = this.closing.take() {
                this.done = true;
                this.reader.clear();
                this.held = None;
                this.deadline = None;
                this.ex.end();
                return Poll::Ready(Some(Ok(trailers(code, &message))));
            }
            match this.step() {
                Step::Answer(b) => return Poll::Ready(Some(Ok(Frame::data(b)))),
                Step::Quiet => continue,
                Step::More if this.closing.is_some() => continue,
                Step::More => {}
            }
            if this.reader.buffered() == 0 {
                this.deadline = None;
            } else if this.deadline.is_none() {
                let t = this.ex.s.cfg.body_timeout;
                this.deadline = Some(Box::pin(tokio::time::sleep(t)));
            }
            match std::pin::Pin::new(&mut this.incoming).poll_frame(cx) {
                Poll::Pending => {
                    if let Some(d) = this.deadline.as_mut() {
                        if std::future::Future::poll(d.as_mut(), cx).is_ready() {
                            this.ex.s.counters.body_timeouts.fetch_add(1, Relaxed);
                            let m = format!(
                                "a gRPC message did not arrive whole within {:?} of its first byte (body_timeout)",
                                this.ex.s.cfg.body_timeout
                            );
                            tracing::warn!("ext_proc: {m}; stream closed");
                            this.closing = Some((4, m));
                            continue;
                        }
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        this.reader.push(&d);
                        this.hold_buffered();
                    }
                }
                Poll::Ready(Some(Err(_))) => {
                    this.closing = Some((1, "the stream was reset".into()));
                }
                Poll::Ready(None) => match this.reader.end() {
                    Ok(()) => this.closing = Some((0, String::new())),
                    Err((code, m)) => {
                        tracing::warn!("ext_proc: {m}");
                        this.closing = Some((code, m));
                    }
                },
            }
        }
    }
}

/// One HTTP request as the EPP follows it through its `Process` stream.
struct Exchange {
    s: Arc<Shared>,
    arrived: Instant,
    headers: hyper::HeaderMap,
    /// The subset hint as a mask over destination slots (`None`: no hint).
    subset: Option<Vec<bool>>,
    body: BytesMut,
    /// The body bytes held from the router's budget.
    held: Vec<Held>,
    routed: Option<Routed>,
    flight: Option<Flight>,
    /// `--record` / self-calibration: the request's record, submitted when the stream ends.
    capture: Option<Capture>,
    /// A piece of the response body has been seen (Envoy streams bodies to the EPP only when
    /// configured to); until then the response headers stand for the first byte.
    body_seen: bool,
    /// The response headers came.
    responded: bool,
}

impl Drop for Exchange {
    /// Envoy may reset a stream it is done with rather than end it (with the shipped config,
    /// once the response headers are answered): hyper then drops the body unpolled, and the
    /// request leaves flight here, as it would have in [`Exchange::end`].
    fn drop(&mut self) {
        self.end();
    }
}

fn common(mutation: Option<proto::HeaderMutation>) -> Option<proto::CommonResponse> {
    Some(proto::CommonResponse {
        status: 0,
        header_mutation: mutation,
        clear_route_cache: false,
    })
}

fn reply(r: Out) -> proto::ProcessingResponse {
    proto::ProcessingResponse {
        response: Some(r),
        dynamic_metadata: None,
    }
}

/// An immediate response: `status` and a JSON body.
fn immediate(status: u16, body: &serde_json::Value, details: &str) -> proto::ProcessingResponse {
    reply(Out::ImmediateResponse(proto::ImmediateResponse {
        status: Some(proto::HttpStatus {
            code: status as i32,
        }),
        headers: Some(proto::HeaderMutation {
            set_headers: vec![proto::set_header("content-type", "application/json")],
            remove_headers: Vec::new(),
        }),
        body: body.to_string().into_bytes(),
        details: details.into(),
    }))
}

fn error_body(status: u16, kind: &str, message: &str) -> serde_json::Value {
    serde_json::json!({"error": {"message": message, "type": kind, "code": status}})
}

impl Exchange {
    fn new(s: Arc<Shared>) -> Self {
        Exchange {
            s,
            arrived: Instant::now(),
            headers: hyper::HeaderMap::new(),
            subset: None,
            body: BytesMut::new(),
            held: Vec::new(),
            routed: None,
            flight: None,
            capture: None,
            body_seen: false,
            responded: false,
        }
    }

    /// The answer to one message, or the gRPC status and message the stream is refused with.
    fn on(
        &mut self,
        req: proto::ProcessingRequest,
    ) -> Result<proto::ProcessingResponse, (u32, String)> {
        let Some(r) = req.request else {
            return Err((3, "a ProcessingRequest with none of request_headers, request_body, response_headers, response_body or trailers set".into()));
        };
        Ok(match r {
            In::RequestHeaders(h) => {
                self.s.counters.requests.fetch_add(1, Relaxed);
                self.arrived = Instant::now();
                self.headers = to_header_map(h.headers.as_ref()).map_err(|m| (8, m))?;
                if let Some(m) = &req.metadata_context {
                    self.subset = self.subset_mask(m);
                }
                if h.end_of_stream {
                    // No body (e.g. GET /v1/models): no key, so the next live destination.
                    let only = self.subset.as_deref();
                    match self.s.rotate_within(None, only) {
                        Ok(d) => {
                            let (mutation, meta) = self.pick_answer(d, &[]);
                            let mut resp = reply(Out::RequestHeaders(proto::HeadersResponse {
                                response: common(Some(mutation)),
                            }));
                            resp.dynamic_metadata = Some(meta);
                            resp
                        }
                        Err(_) => self.none_eligible(),
                    }
                } else {
                    reply(Out::RequestHeaders(proto::HeadersResponse {
                        response: common(None),
                    }))
                }
            }
            In::RequestBody(b) => self.on_body(b),
            In::ResponseHeaders(h) => self.on_response(h)?,
            In::ResponseBody(b) => self.on_response_body(b),
            In::RequestTrailers(_) => reply(Out::RequestTrailers(proto::TrailersResponse {
                header_mutation: None,
            })),
            In::ResponseTrailers(_) => reply(Out::ResponseTrailers(proto::TrailersResponse {
                header_mutation: None,
            })),
        })
    }

    /// The subset hint in `m` as a mask over slots (a hint that names no backend of ours
    /// leaves every slot out).
    fn subset_mask(&self, m: &proto::Metadata) -> Option<Vec<bool>> {
        use proto::value::Kind;
        let v = m
            .filter_metadata
            .get(SUBSET_NAMESPACE)?
            .fields
            .get(SUBSET)?;
        let mut names: Vec<String> = Vec::new();
        match &v.kind {
            Some(Kind::ListValue(l)) => {
                for x in &l.values {
                    if let Some(Kind::StringValue(s)) = &x.kind {
                        names.push(s.clone());
                    }
                }
            }
            Some(Kind::StringValue(s)) => names.extend(s.split(',').map(|x| x.trim().to_string())),
            _ => {}
        }
        let mut mask = vec![false; self.s.fleet.len()];
        for n in names {
            if let Some(d) = n.parse().ok().and_then(|a| slot_of(&self.s.fleet, a)) {
                if let Some(m) = mask.get_mut(d) {
                    *m = true;
                }
            }
        }
        Some(mask)
    }

    fn on_body(&mut self, b: proto::HttpBody) -> proto::ProcessingResponse {
        let continue_body = || {
            reply(Out::RequestBody(proto::BodyResponse {
                response: common(None),
            }))
        };
        if self.routed.is_some() {
            return continue_body();
        }
        if self.body.len() + b.body.len() > self.s.cfg.max_body_bytes {
            let r = Refusal::too_large(&self.s);
            return immediate(r.status.as_u16(), &r.body(), "cacheroute_body_too_large");
        }
        match self.s.reserve_body(b.body.len()) {
            Some(h) => self.held.push(h),
            None => {
                let msg = "the EPP holds as many request bodies as it may (max_buffered_bytes); retry shortly";
                return immediate(
                    429,
                    &error_body(429, "rate_limit_error", msg),
                    "cacheroute_shed",
                );
            }
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return continue_body();
        }
        let mut routed = match admit(&self.s, &self.headers, &self.body) {
            Ok(r) => r,
            Err(r) => return immediate(r.status.as_u16(), &r.body(), "cacheroute_refused"),
        };
        let only = self.subset.take();
        let picked = self
            .s
            .choose_within(&routed.request(&self.s), None, only.as_deref());
        let d = match picked {
            Ok(d) => d,
            Err(_) => {
                self.subset = only;
                return self.none_eligible();
            }
        };
        // The fallbacks: the rest of the key's planned set that is up (and in the subset).
        let mut fallbacks = Vec::new();
        let plan = self.s.plan();
        if let Some(set) = plan.as_ref().and_then(|p| p.lookup(routed.key())) {
            for &x in set.iter() {
                let x = x as usize;
                let allowed = only
                    .as_ref()
                    .is_none_or(|o| o.get(x).copied().unwrap_or(false));
                if x != d && allowed && self.s.fleet.is_up(x) {
                    fallbacks.push(x);
                }
            }
        }
        self.subset = only;
        self.flight = Some(Flight::begin(&self.s, d, &routed, self.arrived));
        self.capture = routed.capture(&self.s, self.arrived);
        self.routed = Some(routed);
        // The body is on its way upstream: its budget is given back.
        self.held.clear();
        self.body = BytesMut::new();
        let (mutation, meta) = self.pick_answer(d, &fallbacks);
        let mut resp = reply(Out::RequestBody(proto::BodyResponse {
            response: common(Some(mutation)),
        }));
        resp.dynamic_metadata = Some(meta);
        resp
    }

    /// The header mutation and `envoy.lb` metadata naming `d` (then `fallbacks`).
    fn pick_answer(&self, d: usize, fallbacks: &[usize]) -> (proto::HeaderMutation, proto::Struct) {
        let primary = endpoint(&self.s.fleet.dest(d).url()).to_string();
        let mut list = primary.clone();
        for &f in fallbacks {
            list.push(',');
            list.push_str(endpoint(&self.s.fleet.dest(f).url()));
        }
        (
            proto::HeaderMutation {
                set_headers: vec![proto::set_header(DESTINATION, &primary)],
                remove_headers: Vec::new(),
            },
            proto::namespaced(LB_NAMESPACE, DESTINATION, list),
        )
    }

    fn none_eligible(&self) -> proto::ProcessingResponse {
        self.s.counters.no_destination.fetch_add(1, Relaxed);
        let msg = match &self.subset {
            Some(m) if !m.iter().any(|&x| x) => {
                "the subset hint names no backend of this EPP".to_string()
            }
            Some(_) => "no destination of the subset hint is up".to_string(),
            None => format!(
                "no destination is up (0 of {} pass health checks); check the engines' /health",
                self.s.fleet.occupied()
            ),
        };
        immediate(
            503,
            &error_body(503, "no_destination", &msg),
            "cacheroute_no_destination",
        )
    }

    /// Envoy closed the `Process` stream: it is done with the request (the response ended,
    /// or the request was cut or refused), so the request's in-flight accounting ends here.
    fn end(&mut self) {
        if let Some(f) = self.flight.take() {
            tracing::debug!(
                destination = f.destination(),
                ms = self.arrived.elapsed().as_secs_f64() * 1e3,
                "ext_proc: stream ended; request out of flight"
            );
        }
        self.held.clear();
        if let Some(mut c) = self.capture.take() {
            // Without response bodies the EPP cannot tell a cut stream from a whole one: a
            // response that began is taken as complete when Envoy ends the stream.
            if self.responded && !self.body_seen {
                c.complete();
            }
            // Dropped here: the request's record is submitted.
        }
    }

    /// A piece of the response body (only when Envoy's config streams response bodies): what
    /// the request cost (`usage`, at the end of a JSON body or an SSE stream) and when its first
    /// byte came. Passed on unchanged.
    fn on_response_body(&mut self, b: proto::HttpBody) -> proto::ProcessingResponse {
        if let Some(c) = &mut self.capture {
            if !self.body_seen {
                c.first_byte();
            }
            c.chunk(&b.body);
            if b.end_of_stream {
                c.complete();
            }
        }
        self.body_seen = true;
        reply(Out::ResponseBody(proto::BodyResponse {
            response: common(None),
        }))
    }

    /// Response headers: what served (checked against the backends) and the status.
    fn on_response(
        &mut self,
        h: proto::HttpHeaders,
    ) -> Result<proto::ProcessingResponse, (u32, String)> {
        let headers = to_header_map(h.headers.as_ref()).map_err(|m| (8, m))?;
        let status = headers
            .get(STATUS)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u16>().ok())
            .unwrap_or(200);
        let mut served = None;
        if let Some(v) = headers.get(SERVED) {
            let text = v.to_str().unwrap_or("");
            // Envoy may name several hosts (retries): the last one answered.
            let last = text.rsplit(',').next().unwrap_or("").trim();
            match last.parse().ok().and_then(|a| slot_of(&self.s.fleet, a)) {
                Some(d) => served = Some(d),
                None => tracing::warn!(
                    header = SERVED,
                    value = %text.chars().take(128).collect::<String>(),
                    "ext_proc: response header {SERVED} names no backend of this EPP; refused (the pick stands)"
                ),
            }
        }
        let mut mutation = None;
        let routed = self.routed.as_ref();
        if let Some(f) = self.flight.as_mut() {
            let d = served.unwrap_or(f.destination());
            if d != f.destination() {
                tracing::debug!(
                    picked = f.destination(),
                    served = d,
                    "ext_proc: Envoy served on a fallback"
                );
            }
            // The response began: first byte and status. The flight itself (in flight,
            // end-to-end latency) ends with the stream (`end`).
            f.answered(status, routed);
            if let Some(c) = &mut self.capture {
                c.answered(Some(d), status);
                c.first_byte();
            }
            self.responded = true;
            mutation = Some(proto::HeaderMutation {
                set_headers: vec![proto::set_header(
                    "x-cacheroute-destination",
                    &d.to_string(),
                )],
                remove_headers: Vec::new(),
            });
        }
        Ok(reply(Out::ResponseHeaders(proto::HeadersResponse {
            response: common(mutation),
        })))
    }
}

/// Where [`to_header_map`] keeps the `:status` pseudo header.
const STATUS: &str = "x-cacheroute-upstream-status";

/// Most header entries one message from Envoy may carry (hyper's own limit for a request
/// head `route` reads; Envoy's default is 100).
pub(crate) const MAX_HEADERS: usize = 100;
/// Most bytes of names and values one message from Envoy may carry (the longest request
/// head `route` reads).
pub(crate) const MAX_HEADER_BYTES: usize = 64 << 10;

/// Envoy's header list as an HTTP header map (`:status` kept as a plain entry; other pseudo
/// headers and names or values HTTP cannot carry are left out), or why it is refused: more
/// than [`MAX_HEADERS`] entries or [`MAX_HEADER_BYTES`] bytes.
fn to_header_map(m: Option<&proto::HeaderMap>) -> Result<hyper::HeaderMap, String> {
    let list = m.map(|m| m.headers.as_slice()).unwrap_or(&[]);
    if list.len() > MAX_HEADERS {
        return Err(format!(
            "a header list of {} entries is over the EPP's limit of {MAX_HEADERS}",
            list.len()
        ));
    }
    let bytes: usize = list
        .iter()
        .map(|h| h.key.len() + h.value.len() + h.raw_value.len())
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return Err(format!(
            "a header list of {bytes} bytes is over the EPP's limit of {MAX_HEADER_BYTES}"
        ));
    }
    let mut out = hyper::HeaderMap::with_capacity(list.len());
    for h in list {
        let key = if h.key == ":status" {
            STATUS
        } else if h.key.starts_with(':') {
            continue;
        } else {
            h.key.as_str()
        };
        let value = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        if let (Ok(k), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(key.as_bytes()),
            hyper::header::HeaderValue::from_bytes(value),
        ) {
            // `try_append`: a map that cannot grow is refused, never a panic.
            out.try_append(k, v)
                .map_err(|e| format!("the header list cannot be held ({e})"))?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_host_port_of_the_base_url() {
        assert_eq!(endpoint("http://127.0.0.1:8001"), "127.0.0.1:8001");
        assert_eq!(endpoint("http://10.0.0.1:80/base"), "10.0.0.1:80");
    }

    #[test]
    fn frames_split_whole_messages_and_refuse_oversized_and_compressed_ones() {
        let resp = proto::HealthCheckResponse { status: 1 };
        let f = frame(&resp);
        let mut buf = BytesMut::from(&f[..3]);
        assert_eq!(next_message(&mut buf, 100), Ok(None));
        buf.extend_from_slice(&f[3..]);
        buf.extend_from_slice(&f[..]);
        let m = next_message(&mut buf, 100).unwrap().unwrap();
        assert_eq!(proto::HealthCheckResponse::decode(m).unwrap(), resp);
        assert!(next_message(&mut buf, 100).unwrap().is_some());
        assert!(buf.is_empty());
        let mut big = BytesMut::from(&[0u8, 0, 0, 1, 0][..]);
        assert_eq!(next_message(&mut big, 100).unwrap_err().0, 8);
        let mut zipped = BytesMut::from(&[1u8, 0, 0, 0, 0][..]);
        assert_eq!(next_message(&mut zipped, 100).unwrap_err().0, 12);
    }
}
