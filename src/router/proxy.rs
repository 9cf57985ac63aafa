//! The request path: bounded body read, routing key, policy choice, forwarding with one retry,
//! byte-exact streaming passthrough, and JSON errors.
//!
//! Failures before the first byte follow `failure`: the one retry loop here asks
//! [`AttemptError::retryable`] whether another destination may take the request,
//! [`AttemptError::health`] what the destination suffers and [`AttemptError::answer`] what the
//! client gets. Once the first byte is on its way, the response is the backend's, and a later
//! failure (idle timeout, reset) cuts the stream: counted and logged, the destination stays up.

use super::failure::{no_destination, Answer, AttemptError, Health, ATTEMPTS};
use super::lock::Locked;
use super::record::Capture;
use super::state::{json_error, Shared};
use super::upstream::{Body as UpstreamBody, Kept};
use crate::policy::{Completion, RouteRequest};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use serde::Deserialize;
use std::borrow::Cow;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

/// The axum app: proxy routes, health, the `extra` routes (metrics, admin), JSON fallbacks.
pub(crate) fn app(shared: Arc<Shared>, extra: Router<Arc<Shared>>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::<Body>))
        .route("/v1/chat/completions", post(completions::<Body>))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .merge(extra)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

/// The HTTP side of a front that forwards nothing itself (the EPP): `/health`, `/metrics` and
/// the admin API, the very handlers of [`app`], and the same JSON fallbacks.
pub(crate) fn admin_app(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .merge(super::admin::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared)
}

/// The service for one client connection: the two completion routes go straight to their
/// handler (the request path), everything else through the axum app.
pub(crate) fn service(
    s: Arc<Shared>,
    app: Router,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl std::future::Future<Output = Result<Response, std::convert::Infallible>> + Send,
> + Clone {
    // The client connection's own upstream connections (see `Kept`).
    let kept = Kept::default();
    hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        let (s, app) = (s.clone(), app.clone());
        req.extensions_mut().insert(kept.clone());
        async move {
            let direct = req.method() == Method::POST
                && matches!(req.uri().path(), "/v1/completions" | "/v1/chat/completions");
            if direct {
                Ok(completions(State(s), req).await)
            } else {
                use tower::ServiceExt;
                app.oneshot(req.map(Body::new)).await
            }
        }
    })
}

async fn not_found(State(s): State<Arc<Shared>>, req: Request) -> Response {
    s.counters.rejected.fetch_add(1, Relaxed);
    json_error(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!(
            "no route for {} {}; the router serves POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics and /admin/*",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(State(s): State<Arc<Shared>>, req: Request) -> Response {
    s.counters.rejected.fetch_add(1, Relaxed);
    json_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    let live = s.fleet.live();
    let n = s.fleet.occupied();
    let draining = s.draining.load(Relaxed);
    let status = if live > 0 && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let state = if draining {
        "draining"
    } else if live > 0 {
        "ok"
    } else {
        "no destination up"
    };
    let mut body = serde_json::json!({"status": state, "destinations_up": live, "destinations": n});
    if let Some(st) = &s.plan_store {
        super::json::set(&mut body, "plan_store", st.health());
    }
    (status, axum::Json(body)).into_response()
}

/// The parts of an OpenAI request body the router looks at; everything else is passed through
/// untouched (the body is forwarded as received).
///
/// `P` is `serde_json::Value` when the prompt text is needed and `IgnoredAny` (validated,
/// not built) when the routing key comes from the header and the policy needs no prompt.
#[derive(Deserialize)]
struct Peek<'a, P> {
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    prompt: Option<P>,
    #[serde(default)]
    messages: Option<P>,
}

/// Prompt text: `prompt` (a string, the first of a list, or token ids joined by spaces) or the
/// `messages`' text contents joined by spaces.
fn prompt_text(p: &Peek<serde_json::Value>) -> Option<String> {
    use serde_json::Value;
    fn from_prompt(v: &Value) -> Option<String> {
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Array(a) if a.iter().all(Value::is_number) && !a.is_empty() => Some(
                a.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            Value::Array(a) => a.first().and_then(from_prompt),
            _ => None,
        }
    }
    if let Some(v) = &p.prompt {
        return from_prompt(v);
    }
    let msgs = p.messages.as_ref()?.as_array()?;
    let mut out = String::new();
    for m in msgs {
        match m.get("content") {
            Some(Value::String(s)) => {
                if !out.is_empty() {
                    out.push(' ');
                }
                out.push_str(s);
            }
            Some(Value::Array(parts)) => {
                for part in parts {
                    if let Some(t) = part.get("text").and_then(Value::as_str) {
                        if !out.is_empty() {
                            out.push(' ');
                        }
                        out.push_str(t);
                    }
                }
            }
            _ => {}
        }
    }
    (!out.is_empty()).then_some(out)
}

/// What a front (the proxy, the EPP) learned about a request before routing it.
pub(crate) struct Routed {
    key: u64,
    /// The key's text when it came from the header or `user` and names are kept for the
    /// admin API (never a prompt prefix).
    name: Option<Box<str>>,
    /// Full-block hashes for prefix-aware policies (empty for the others).
    blocks: Vec<u64>,
    prompt_tokens: u32,
    output_tokens: u32,
    /// `--record` only: the requested `max_completion_tokens` / `max_tokens`, and the block
    /// ids written to the trace (full blocks, then a partial one).
    max_tokens: Option<u64>,
    ids: Vec<u64>,
}

impl Routed {
    /// The capture of this request for `--record` and the self-calibration's window, when the
    /// router keeps either (the block ids go to it: nothing else reads them).
    pub(crate) fn capture(&mut self, s: &Shared, arrived: Instant) -> Option<Capture> {
        let rec = s.recorder.as_ref()?;
        let ids = std::mem::take(&mut self.ids);
        Some(rec.begin(arrived, self.key, self.prompt_tokens, ids, self.max_tokens))
    }

    /// The request as the policy sees it.
    pub(crate) fn request<'a>(&'a self, s: &Shared) -> RouteRequest<'a> {
        RouteRequest {
            key: self.key,
            blocks: &self.blocks,
            block_tokens: s.cfg.block_tokens,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            now: s.now(),
        }
    }

    /// Prompt tokens, the load a destination takes on with this request.
    pub(crate) fn tokens(&self) -> u64 {
        self.prompt_tokens as u64
    }

    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// What a policy that learns from completions (Preble) is told when this request ends.
    fn completion(&self) -> CompletionFacts {
        CompletionFacts {
            key: self.key,
            blocks: self.blocks.clone(),
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
        }
    }
}

/// A request refused before routing: the status and the one-line message (counted as
/// rejected when made).
pub(crate) struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    fn new(s: &Shared, status: StatusCode, message: String) -> Self {
        s.counters.rejected.fetch_add(1, Relaxed);
        Refusal { status, message }
    }

    /// A body over the router's max body size (413).
    pub(crate) fn too_large(s: &Shared) -> Self {
        Refusal::new(
            s,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body exceeds {} bytes; shorten the prompt or raise the router's max body size",
                s.cfg.max_body_bytes
            ),
        )
    }

    /// The OpenAI-style JSON error body.
    pub(crate) fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": "invalid_request_error", "code": self.status.as_u16()}})
    }

    fn into_response(self) -> Response {
        json_error(self.status, "invalid_request_error", self.message)
    }
}

/// Read a request's routing facts from its headers and body (bounded before this) and queue
/// its key for the control loop: what every front does before asking the policy.
pub(crate) fn admit(s: &Shared, headers: &HeaderMap, body: &[u8]) -> Result<Routed, Refusal> {
    let mut routed = inspect(s, headers, body)?;
    if let Some(p) = &s.pending {
        p.locked()
            .push((routed.key, routed.prompt_tokens, routed.name.take()));
    }
    Ok(routed)
}

fn rejected(s: &Shared, msg: String) -> Refusal {
    Refusal::new(s, StatusCode::BAD_REQUEST, msg)
}

/// Parse and validate the body; derive the routing key.
fn inspect(s: &Shared, headers: &HeaderMap, body: &[u8]) -> Result<Routed, Refusal> {
    if std::str::from_utf8(body).is_err() {
        return Err(rejected(
            s,
            "request body is not valid UTF-8; send a UTF-8 JSON object".into(),
        ));
    }
    let bad_json = |e: serde_json::Error| {
        rejected(
            s,
            format!("request body is not a valid OpenAI request JSON object: {e}"),
        )
    };
    let header_key = headers.get(&s.key_header).filter(|v| !v.is_empty());
    let recording = s.recorder.is_some();
    let (user, text, max_tokens) =
        if header_key.is_some() && !s.needs_blocks && s.pending.is_none() && !recording {
            let peek: Peek<serde::de::IgnoredAny> =
                serde_json::from_slice(body).map_err(bad_json)?;
            (None, None, peek.max_completion_tokens.or(peek.max_tokens))
        } else {
            let peek: Peek<serde_json::Value> = serde_json::from_slice(body).map_err(bad_json)?;
            let text = prompt_text(&peek);
            (
                peek.user,
                text,
                peek.max_completion_tokens.or(peek.max_tokens),
            )
        };
    let mut name = None;
    let key = match header_key {
        Some(v) => match v.to_str() {
            Ok(k) => {
                if s.keep_names {
                    name = Some(super::state::key_name(k));
                }
                crate::key_hash(k)
            }
            Err(_) => {
                return Err(rejected(
                    s,
                    format!(
                        "header `{}` must be visible ASCII; percent-encode other bytes",
                        s.cfg.key_header
                    ),
                ))
            }
        },
        None => match (&user, &text) {
            (Some(u), _) if !u.is_empty() => {
                if s.keep_names {
                    name = Some(super::state::key_name(u));
                }
                crate::key_hash(u)
            }
            (_, Some(t)) => {
                let end = t
                    .char_indices()
                    .nth(s.cfg.prefix_chars)
                    .map_or(t.len(), |(i, _)| i);
                crate::key_hash(&t[..end])
            }
            _ => {
                return Err(rejected(
                    s,
                    format!(
                        "no routing key: send header `{}`, a non-empty `user`, or a `prompt`/`messages` with text",
                        s.cfg.key_header
                    ),
                ))
            }
        },
    };
    let (blocks, prompt_tokens, ids) = match &text {
        Some(t) if recording => {
            // One pass gives the routing blocks, the count and the trace's block ids.
            let tb = crate::workload::text::text_blocks(t, s.cfg.block_tokens);
            let blocks = if s.needs_blocks {
                tb.ids.get(..tb.full).unwrap_or(&tb.ids).to_vec()
            } else {
                Vec::new()
            };
            (blocks, tb.tokens, tb.ids)
        }
        Some(t) if s.needs_blocks || s.pending.is_some() => (
            if s.needs_blocks {
                crate::workload::text::text_block_hashes(t, s.cfg.block_tokens)
            } else {
                Vec::new()
            },
            crate::workload::text::count_tokens(t),
            Vec::new(),
        ),
        _ => (Vec::new(), 0, Vec::new()),
    };
    let output_tokens = max_tokens.unwrap_or(0).min(u32::MAX as u64) as u32;
    Ok(Routed {
        key,
        name,
        blocks,
        prompt_tokens,
        output_tokens,
        max_tokens,
        ids,
    })
}

pub(crate) async fn completions<B>(State(s): State<Arc<Shared>>, req: hyper::Request<B>) -> Response
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    s.counters.requests.fetch_add(1, Relaxed);
    // Arrival: the recording's timestamp, TTFT and end-to-end latency start here.
    let arrived = Instant::now();
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > s.cfg.max_body_bytes as u64 {
            return too_large(&s);
        }
    }
    let limited = http_body_util::Limited::new(body, s.cfg.max_body_bytes);
    let collect = http_body_util::BodyExt::collect(limited);
    let Ok(collected) = tokio::time::timeout(s.cfg.body_timeout, collect).await else {
        s.counters.body_timeouts.fetch_add(1, Relaxed);
        return Refusal::new(
            &s,
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {:?} (body_timeout)",
                s.cfg.body_timeout
            ),
        )
        .into_response();
    };
    let bytes = match collected {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            if e.is::<http_body_util::LengthLimitError>() {
                return too_large(&s);
            }
            return Refusal::new(
                &s,
                StatusCode::BAD_REQUEST,
                format!("could not read the request body: {e}"),
            )
            .into_response();
        }
    };
    let mut routed = match admit(&s, &parts.headers, &bytes) {
        Ok(r) => r,
        Err(refusal) => return refusal.into_response(),
    };
    let capture = routed.capture(&s, arrived);
    let pq = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |x| x.as_str())
        .to_string();
    let span = tracing::debug_span!("request", key = %KeyHex(Some(routed.key)), path = %pq);
    let req = Forward {
        method: Method::POST,
        pq,
        headers: parts.headers,
        body: bytes,
        arrived,
        kept: parts.extensions.get::<Kept>().cloned(),
    };
    forward_with_retry(s, req, Some(routed), capture)
        .instrument(span)
        .await
}

/// A key hash as the 16 hex digits plans, state files and traces use (`-` for none).
struct KeyHex(Option<u64>);

impl std::fmt::Display for KeyHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(k) => write!(f, "{k:016x}"),
            None => f.write_str("-"),
        }
    }
}

fn too_large(s: &Shared) -> Response {
    Refusal::too_large(s).into_response()
}

async fn models(State(s): State<Arc<Shared>>, req: Request) -> Response {
    s.counters.requests.fetch_add(1, Relaxed);
    let arrived = Instant::now();
    let (parts, _) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |x| x.as_str())
        .to_string();
    let req = Forward {
        method: Method::GET,
        pq,
        headers: parts.headers,
        body: Bytes::new(),
        arrived,
        kept: parts.extensions.get::<Kept>().cloned(),
    };
    forward_with_retry(s, req, None, None).await
}

/// A response ready to go back: headers known and the first body chunk in hand.
struct Ready {
    status: StatusCode,
    headers: HeaderMap,
    first: Option<Bytes>,
    rest: UpstreamBody,
}

/// What a policy that learns from completions (Preble) is told of a request when its flight
/// ends.
struct CompletionFacts {
    key: u64,
    blocks: Vec<u64>,
    prompt_tokens: u32,
    output_tokens: u32,
}

/// In-flight accounting for one attempt; released on drop (body finished, client gone, or
/// attempt failed). The EPP holds one per pick until Envoy reports the response.
pub(crate) struct Flight {
    s: Arc<Shared>,
    d: usize,
    queued: u64,
    /// When this attempt began, and the seconds from then to its first byte (0 before it).
    attempt_started: Instant,
    ttft_from_attempt: f64,
    ok: bool,
    /// The request's arrival at the router, its key hash (`None`: not a completion, kept out
    /// of the latency histograms), which attempt this is (0, or 1 for the retry) and the
    /// status answered.
    arrived: Instant,
    key: Option<u64>,
    attempt: u8,
    status: u16,
    /// Arrival → first byte, once seen (completions only).
    ttft_from_arrival: Option<std::time::Duration>,
    completion: Option<CompletionFacts>,
    /// `--record`: the request's record, submitted when this is dropped.
    capture: Option<Capture>,
}

impl Flight {
    /// `d` takes on `routed`'s request: counted in flight (and its prompt tokens queued) until
    /// the returned flight is dropped.
    pub(crate) fn begin(s: &Arc<Shared>, d: usize, routed: &Routed, arrived: Instant) -> Self {
        Flight::new(s, d, routed.tokens(), arrived, Some(routed.key))
    }

    /// The response began with `status`: first byte seen, and (for a policy that learns from
    /// completions) what to tell it when the flight ends.
    pub(crate) fn answered(&mut self, status: u16, routed: Option<&Routed>) {
        self.first_byte();
        self.status = status;
        self.ok = status < 500;
        if self.s.needs_completion {
            self.completion = routed.map(Routed::completion);
        }
    }

    /// The destination this flight is on.
    pub(crate) fn destination(&self) -> usize {
        self.d
    }

    /// `d` takes on a request of `queued` prompt tokens: counted in flight (and its tokens
    /// queued) until the flight is dropped, which ends both.
    fn new(s: &Arc<Shared>, d: usize, queued: u64, arrived: Instant, key: Option<u64>) -> Self {
        s.fleet.begin(d, queued);
        Flight {
            s: s.clone(),
            d,
            queued,
            attempt_started: Instant::now(),
            ttft_from_attempt: 0.0,
            ok: false,
            arrived,
            key,
            attempt: 0,
            status: 0,
            ttft_from_arrival: None,
            completion: None,
            capture: None,
        }
    }

    fn first_byte(&mut self) {
        if self.queued > 0 {
            self.s.fleet.first_byte(self.d, self.queued);
            self.queued = 0;
        }
        self.ttft_from_attempt = self.attempt_started.elapsed().as_secs_f64();
        if self.key.is_some() {
            let t = self.arrived.elapsed();
            self.s.fleet.dest(self.d).latency.ttft.record(t);
            self.ttft_from_arrival = Some(t);
        }
    }

    /// `--record`: the request's record goes with this flight, answered `status` here.
    fn record(&mut self, capture: Option<Capture>, status: StatusCode) {
        if let Some(mut c) = capture {
            c.first_byte();
            c.answered(Some(self.d), status.as_u16());
            self.capture = Some(c);
        }
    }

    /// A piece of the body on its way to the client.
    #[inline]
    fn chunk(&mut self, b: &[u8]) {
        if let Some(c) = &mut self.capture {
            c.chunk(b);
        }
    }

    /// The body ended cleanly.
    fn ended(&mut self) {
        if let Some(c) = &mut self.capture {
            c.complete();
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if self.queued > 0 {
            self.s.fleet.first_byte(self.d, self.queued);
        }
        self.s.fleet.end(self.d);
        if !self.ok {
            self.s.fleet.dest(self.d).errors.fetch_add(1, Relaxed);
        }
        if self.key.is_some() {
            let e2e = self.arrived.elapsed();
            self.s.fleet.dest(self.d).latency.e2e.record(e2e);
            tracing::debug!(
                key = %KeyHex(self.key),
                destination = self.d,
                attempt = self.attempt,
                status = self.status,
                ttft_ms = self.ttft_from_arrival.map_or(f64::NAN, |t| t.as_secs_f64() * 1e3),
                upstream_ms = self.ttft_from_attempt * 1e3,
                e2e_ms = e2e.as_secs_f64() * 1e3,
                complete = self.ok,
                "request done"
            );
        }
        if let Some(c) = self.completion.take() {
            let now = self.s.now();
            let rr = RouteRequest {
                key: c.key,
                blocks: &c.blocks,
                block_tokens: self.s.cfg.block_tokens,
                prompt_tokens: c.prompt_tokens,
                output_tokens: c.output_tokens,
                now,
            };
            let done = Completion {
                now,
                ttft_s: self.s.model_secs(self.ttft_from_attempt),
                e2e_s: self
                    .s
                    .model_secs(self.attempt_started.elapsed().as_secs_f64()),
                output_tokens: c.output_tokens,
                cached_tokens: 0,
            };
            if let Ok(mut st) = self.s.policy.lock() {
                st.policy.on_complete(&rr, self.d, &done);
            }
        }
    }
}

/// A request as it is forwarded: method, path and query, headers, body, when it arrived, and
/// its client connection's upstream connections (`None`: a new one, closed after).
struct Forward {
    method: Method,
    pq: String,
    headers: HeaderMap,
    body: Bytes,
    arrived: Instant,
    kept: Option<Kept>,
}

/// The last failed attempt: where, which (0, or 1 for the retry), and why.
struct Failure {
    d: usize,
    attempt: u8,
    error: AttemptError<Ready>,
}

/// Forward `req` to a destination the policy (or the rotation, for a request without a key)
/// chooses; on a failure the retry rule ([`AttemptError::retryable`]) allows, once more to
/// another with the failed one hidden. The first response in hand is streamed back;
/// otherwise [`give_up`] answers.
async fn forward_with_retry(
    s: Arc<Shared>,
    req: Forward,
    routed: Option<Routed>,
    mut capture: Option<Capture>,
) -> Response {
    let key = routed.as_ref().map(|r| r.key);
    let mut last: Option<Failure> = None;
    for attempt in 0..ATTEMPTS {
        let skip = last.as_ref().map(|f| f.d);
        let chosen = match &routed {
            Some(r) => s.choose(&r.request(&s), skip),
            None => s.rotate(skip),
        };
        let Ok(d) = chosen else { break };
        if attempt > 0 {
            s.counters.retries.fetch_add(1, Relaxed);
        }
        let tokens = routed.as_ref().map_or(0, Routed::tokens);
        let mut flight = Flight::new(&s, d, tokens, req.arrived, key);
        flight.attempt = attempt;
        let sent = Instant::now();
        let result = attempt_once(&s, d, &req).await;
        s.fleet.dest(d).latency.upstream.record(sent.elapsed());
        match result {
            Ok(ready) => {
                flight.first_byte();
                flight.record(capture.take(), ready.status);
                if s.needs_completion {
                    flight.completion = routed.as_ref().map(Routed::completion);
                }
                return respond(&s, d, ready, flight);
            }
            Err(error) => {
                attempt_failed(&s, d, error.health());
                // Not the request's end: no `request done`, no end-to-end latency.
                flight.key = None;
                drop(flight);
                let retry = error.retryable();
                tracing::debug!(
                    destination = d,
                    attempt,
                    status = error.status().as_u16(),
                    retry,
                    upstream_ms = sent.elapsed().as_secs_f64() * 1e3,
                    "attempt failed: {}",
                    error.message()
                );
                last = Some(Failure { d, attempt, error });
                if !retry {
                    break;
                }
            }
        }
    }
    s.counters.failed.fetch_add(1, Relaxed);
    give_up(&s, last, req.arrived, key, capture)
}

/// An attempt's failure as its destination suffers it ([`AttemptError::health`]).
fn attempt_failed(s: &Shared, d: usize, health: Health) {
    match health {
        Health::Down(why) => s.destination_failed(d, &why),
        Health::Slow => {
            s.fleet.dest(d).timeouts.fetch_add(1, Relaxed);
        }
        Health::Broke(why) => s.stream_broke(d, &why),
        Health::Unchanged => {}
    }
}

/// The answer to a request no attempt could serve: the last failure's ([`AttemptError::answer`]:
/// the destination's own 5xx passed on, or a JSON error), or a 503 when no destination was up.
fn give_up(
    s: &Arc<Shared>,
    last: Option<Failure>,
    arrived: Instant,
    key: Option<u64>,
    mut capture: Option<Capture>,
) -> Response {
    let error = match last {
        None => {
            s.counters.no_destination.fetch_add(1, Relaxed);
            tracing::debug!("no destination up: answered 503");
            if let Some(c) = &mut capture {
                c.answered(None, StatusCode::SERVICE_UNAVAILABLE.as_u16());
            }
            no_destination(s.fleet.occupied())
        }
        Some(Failure { d, attempt, error }) => match error.answer(d, &s.fleet.dest(d).url()) {
            Answer::PassOn(ready) => {
                let mut flight = Flight::new(s, d, 0, arrived, key);
                flight.attempt = attempt;
                flight.record(capture, ready.status);
                return respond(s, d, ready, flight);
            }
            Answer::Error(e) => {
                if let Some(c) = &mut capture {
                    c.answered(Some(d), e.status.as_u16());
                }
                if key.is_some() {
                    let e2e = arrived.elapsed();
                    s.fleet.dest(d).latency.e2e.record(e2e);
                    tracing::debug!(
                        key = %KeyHex(key),
                        destination = d,
                        status = e.status.as_u16(),
                        e2e_ms = e2e.as_secs_f64() * 1e3,
                        "request failed"
                    );
                }
                e
            }
        },
    };
    json_error(error.status, error.kind, error.message)
}

/// One attempt at destination `d`: send, wait for headers and the first body chunk.
async fn attempt_once(s: &Shared, d: usize, req: &Forward) -> Result<Ready, AttemptError<Ready>> {
    let up = s.upstream();
    let t0 = Instant::now();
    let limit = s.cfg.first_byte_timeout;
    let request = up
        .request(d, &req.method, &req.pq, &req.headers, req.body.clone())
        .map_err(|e| {
            // Not answered: the destination was removed (discovery) since it was chosen, and
            // nothing was sent.
            if e.answered {
                AttemptError::BadTarget(e.message)
            } else {
                AttemptError::Removed(e.message)
            }
        })?;
    let sent = up.send(d, &request, req.kept.as_ref());
    let (head, mut rest) = match tokio::time::timeout(limit, sent).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) if !e.answered => return Err(AttemptError::Connection(e.message)),
        Ok(Err(e)) => return Err(AttemptError::Malformed(e.message)),
        Err(_) => return Err(AttemptError::NoResponse(limit)),
    };
    let left = limit.saturating_sub(t0.elapsed());
    let first = loop {
        match tokio::time::timeout(left, rest.next()).await {
            Ok(Some(Ok(b))) if b.is_empty() => continue,
            Ok(Some(Ok(b))) => break Some(b),
            Ok(None) => break None,
            Ok(Some(Err(e))) => return Err(AttemptError::BodyBroke(e.to_string())),
            Err(_) => return Err(AttemptError::NoFirstByte(limit)),
        }
    };
    let ready = Ready {
        status: head.status,
        headers: head.headers,
        first,
        rest,
    };
    if matches!(ready.status.as_u16(), 502..=504) {
        return Err(AttemptError::Answered {
            status: ready.status,
            answer: ready,
        });
    }
    Ok(ready)
}

/// Stream `ready` back to the client, chunk by chunk, with the idle timeout.
fn respond(s: &Shared, d: usize, ready: Ready, mut flight: Flight) -> Response {
    let Ready {
        status,
        headers,
        first,
        rest,
    } = ready;
    let mut out = headers;
    // A destination header already there came from a router behind this one (a front before
    // router replicas): the engine it names is the one that served, so it is kept.
    out.entry(HeaderName::from_static("x-cacheroute-destination"))
        .or_insert(HeaderValue::from(d));
    flight.ok = false;
    flight.status = status.as_u16();
    if let Some(b) = &first {
        flight.chunk(b);
    }
    let is_5xx = status.is_server_error();
    // A whole response already in hand (the backend's body ended with its first piece):
    // answer it in one piece, without a streaming body.
    if rest.is_end() {
        flight.ok = !is_5xx;
        flight.ended();
        drop(flight);
        drop(rest); // its connection back to the pool
        let mut resp = Response::new(Body::from(first.unwrap_or_default()));
        *resp.status_mut() = status;
        *resp.headers_mut() = out;
        return resp;
    }
    let idle = s.cfg.idle_timeout;
    struct St {
        first: Option<Bytes>,
        rest: UpstreamBody,
        flight: Flight,
        done: bool,
        is_5xx: bool,
    }
    let st = St {
        first,
        rest,
        flight,
        done: false,
        is_5xx,
    };
    let stream = futures_util::stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        if let Some(b) = st.first.take() {
            return Some((Ok(b), st));
        }
        match tokio::time::timeout(idle, st.rest.next()).await {
            Ok(Some(Ok(b))) => {
                st.flight.chunk(&b);
                Some((Ok(b), st))
            }
            Ok(None) => {
                st.flight.ok = !st.is_5xx;
                st.flight.ended();
                drop(st); // the body ended: its connection goes back to the pool
                None
            }
            Ok(Some(Err(e))) => {
                st.done = true;
                st.flight
                    .s
                    .stream_broke(st.flight.d, &format!("the response broke mid-stream: {e}"));
                Some((
                    Err(std::io::Error::other(format!(
                        "destination {} broke mid-response: {e}",
                        st.flight.d
                    ))),
                    st,
                ))
            }
            Err(_) => {
                st.done = true;
                Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "destination {} sent nothing for {idle:?}; stream cut",
                            st.flight.d
                        ),
                    )),
                    st,
                ))
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = status;
    *resp.headers_mut() = out;
    resp
}
