//! The HTTP layer of the emulator: vLLM's OpenAI-compatible routes with vLLM's JSON shapes,
//! SSE framing (`data: {…}\n\n` chunks, then `data: [DONE]\n\n`) and error bodies
//! (`{"error": {"message", "type", "param", "code"}}`); or, for [`EngineApi::Sglang`], SGLang's
//! routes around the same `/v1/*` (see [`router`]) and its `usage` (`prompt_tokens_details`
//! only when some prompt tokens were cached).
//!
//! Request conventions (see `docs/emulator.md`):
//! - A token is a whitespace-separated word ([`crate::workload::text`]); prompt tokens are
//!   `count_tokens(prompt)`; prefix identity is `text_block_hashes(prompt, block_tokens)`.
//! - `/v1/completions`: `prompt` is a string, a list of one string, or token ids (a list of
//!   integers, or a list of one such list: each id becomes the word of its decimal digits).
//! - `/v1/chat/completions`: the prompt text is the messages' `content` (strings, or the `text`
//!   of text parts) in order, joined by `\n`; roles and templates add no tokens, so a single
//!   user message costs exactly what the same text costs as a completion.
//! - Output length is `max_tokens` (chat: `max_completion_tokens`, else `max_tokens`), default
//!   16, with or without `ignore_eos` (the emulator never stops early); `finish_reason` is
//!   `"length"`. Generated words are deterministic in the prompt and the position.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::core::{EngineHandle, Job, TokenEvent};
use super::metrics::{render, MetricsInfo, MetricsState};
use crate::engine::{EngineConfig, RequestStats};
use crate::rng::mix64;
use crate::telemetry::engine_api::EngineApi;
use crate::workload::text::{count_tokens, text_block_hashes};
use crate::workload::trace::fmt_u64;

/// Output tokens when a request gives no `max_tokens` (OpenAI's legacy completions default).
const DEFAULT_MAX_TOKENS: u32 = 16;

/// How the emulator serves (everything but the engine, its configuration and metrics).
pub(crate) struct Serving {
    pub api: EngineApi,
    pub model_name: String,
    pub block_tokens: u32,
    pub frontend_delay: std::time::Duration,
    /// Until then the server is starting (SGLang's health routes answer 503).
    pub ready_at: tokio::time::Instant,
    /// Print a line per cache reset or flush.
    pub announce: bool,
    /// KV-cache events are published: jobs carry their blocks' token ids.
    pub kv_token_ids: bool,
}

/// Shared by every handler.
pub(crate) struct AppState {
    engine: EngineHandle,
    api: EngineApi,
    model_name: String,
    block_tokens: u32,
    frontend_delay: std::time::Duration,
    ready_at: tokio::time::Instant,
    announce: bool,
    kv_token_ids: bool,
    cfg: EngineConfig,
    info: MetricsInfo,
    metrics: Arc<Mutex<MetricsState>>,
    created: u64,
    next_request: AtomicU64,
    seed: u64,
}

impl AppState {
    pub(crate) fn new(
        engine: EngineHandle,
        serving: Serving,
        cfg: EngineConfig,
        info: MetricsInfo,
        metrics: Arc<Mutex<MetricsState>>,
    ) -> Arc<AppState> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Arc::new(AppState {
            engine,
            api: serving.api,
            model_name: serving.model_name,
            block_tokens: serving.block_tokens,
            frontend_delay: serving.frontend_delay,
            ready_at: serving.ready_at,
            announce: serving.announce,
            kv_token_ids: serving.kv_token_ids,
            cfg,
            info,
            metrics,
            created: now.as_secs(),
            next_request: AtomicU64::new(0),
            seed: mix64(now.as_nanos() as u64 ^ std::process::id() as u64),
        })
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!(
            "{prefix}-{:016x}{:016x}",
            mix64(self.seed),
            mix64(self.seed ^ n)
        )
    }
}

/// The emulator's routes. Both dialects: `/v1/completions`, `/v1/chat/completions`,
/// `/v1/models`, `/metrics`. vLLM: `/health`, `POST /reset_prefix_cache`, `/version`, and the
/// render endpoints of `vllm serve --enable-scale-out` (`POST /v1/completions/render`,
/// `POST /v1/chat/completions/render`: the prompt's token ids, which token-aware routers such as
/// the vLLM router's `cache_aware` ask a worker for before choosing it). SGLang
/// (`python/sglang/srt/entrypoints/http_server.py`): `/health` and `/health_generate` (503
/// while starting), `GET|POST /flush_cache[?timeout=S]`, `/get_server_info` and
/// `/server_info`, `/get_model_info` and `/model_info`.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    let r = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics));
    let r = match state.api {
        EngineApi::Vllm => r
            .route("/health", get(health))
            .route("/reset_prefix_cache", post(reset_prefix_cache))
            .route("/version", get(version))
            .route("/v1/completions/render", post(render_completion))
            .route("/v1/chat/completions/render", post(render_chat)),
        EngineApi::Sglang => r
            .route("/health", get(sglang_health))
            .route("/health_generate", get(sglang_health))
            .route("/flush_cache", get(flush_cache).post(flush_cache))
            .route("/get_server_info", get(server_info))
            .route("/server_info", get(server_info))
            .route("/get_model_info", get(model_info))
            .route("/model_info", get(model_info)),
    };
    r.fallback(not_found).with_state(state)
}

/// A vLLM-style error response.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }
    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
    fn gone() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the emulator is shutting down; retry against another engine".into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

// ---- request parsing ------------------------------------------------------------------------

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad(
            "the request body must be a JSON object, e.g. {\"prompt\": \"…\", \"max_tokens\": 16}",
            None,
        )),
        Err(e) => Err(ApiError::bad(
            format!("the request body is not valid JSON: {e}"),
            None,
        )),
    }
}

fn opt_int(m: &Map<String, Value>, key: &'static str) -> Result<Option<i64>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| {
            ApiError::bad(format!("`{key}` must be an integer, got {v}"), Some(key))
        }),
    }
}

fn opt_bool(m: &Map<String, Value>, key: &'static str) -> Result<Option<bool>, ApiError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::bad(
            format!("`{key}` must be true or false, got {v}"),
            Some(key),
        )),
    }
}

/// The parts of a request the emulator acts on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Parsed {
    pub text: String,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
}

/// Fields common to both endpoints; `max_keys` in order of precedence.
fn common(
    st: &AppState,
    m: &Map<String, Value>,
    max_keys: &[&'static str],
) -> Result<(u32, bool, bool), ApiError> {
    if let Some(model) = m.get("model").filter(|v| !v.is_null()) {
        if model.as_str() != Some(st.model_name.as_str()) {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "The model `{}` does not exist. This emulator serves `{}` (see /v1/models).",
                    model
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or(model.to_string()),
                    st.model_name
                ),
                param: Some("model"),
            });
        }
    }
    let mut max_tokens = None;
    for &k in max_keys {
        if let Some(v) = opt_int(m, k)? {
            if v < 1 || v > u32::MAX as i64 {
                return Err(ApiError::bad(
                    format!("`{k}` must be at least 1, got {v}"),
                    Some(k),
                ));
            }
            max_tokens.get_or_insert(v as u32);
        }
    }
    if let Some(n) = opt_int(m, "n")? {
        if n != 1 {
            return Err(ApiError::bad(
                format!("`n` = {n} is not supported by the emulator; send n = 1 (one request per sample)"),
                Some("n"),
            ));
        }
    }
    opt_bool(m, "ignore_eos")?; // accepted; output length is max_tokens either way
    let stream = opt_bool(m, "stream")?.unwrap_or(false);
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(ApiError::bad(
                format!(
                "`stream_options` must be an object such as {{\"include_usage\": true}}, got {v}"
            ),
                Some("stream_options"),
            ))
        }
    };
    Ok((
        max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        stream,
        include_usage,
    ))
}

fn ids_text(ids: &[Value]) -> Option<String> {
    let mut s = String::new();
    for v in ids {
        let id = v.as_u64()?;
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(&id.to_string());
    }
    Some(s)
}

/// The prompt of a `/v1/completions` request.
pub(crate) fn completion_prompt(m: &Map<String, Value>) -> Result<String, ApiError> {
    let bad = || {
        ApiError::bad(
            "`prompt` must be a string, a list of one string, or a list of token ids; batched \
             prompts are not supported by the emulator (send one request per prompt)",
            Some("prompt"),
        )
    };
    match m.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::bad(
            "`prompt` is required, e.g. {\"prompt\": \"…\"}",
            Some("prompt"),
        )),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => Ok(s.clone()),
            [Value::Array(ids)] => ids_text(ids).ok_or_else(bad),
            ids if !ids.is_empty() => ids_text(ids).ok_or_else(bad),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// The prompt text of a `/v1/chat/completions` request: the messages' contents in order,
/// joined by `\n`.
pub(crate) fn chat_prompt(m: &Map<String, Value>) -> Result<String, ApiError> {
    let msgs = match m.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return Err(ApiError::bad(
                "`messages` must be a non-empty list of {\"role\": …, \"content\": …} objects",
                Some("messages"),
            ))
        }
    };
    let mut parts: Vec<&str> = Vec::new();
    for (i, msg) in msgs.iter().enumerate() {
        let bad = |what: &str| ApiError::bad(format!("messages[{i}]: {what}"), Some("messages"));
        let obj = msg
            .as_object()
            .ok_or_else(|| bad("must be an object with `role` and `content`"))?;
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(bad("`role` must be a string such as \"user\""));
        }
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => parts.push(s),
            Some(Value::Array(ps)) => {
                for p in ps {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => parts.push(t),
                        _ => {
                            return Err(bad(
                                "only text content parts ({\"type\": \"text\", \"text\": …}) are supported",
                            ))
                        }
                    }
                }
            }
            Some(_) => return Err(bad("`content` must be a string or a list of text parts")),
        }
    }
    Ok(parts.join("\n"))
}

/// Parse a request body for one endpoint.
fn parse(st: &AppState, kind: Kind, body: &[u8]) -> Result<Parsed, ApiError> {
    let m = parse_object(body)?;
    let (text, keys): (String, &[&'static str]) = match kind {
        Kind::Completion => (completion_prompt(&m)?, &["max_tokens"]),
        Kind::Chat => (chat_prompt(&m)?, &["max_completion_tokens", "max_tokens"]),
    };
    let (max_tokens, stream, include_usage) = common(st, &m, keys)?;
    Ok(Parsed {
        text,
        max_tokens,
        stream,
        include_usage,
    })
}

// ---- responses ------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// One response being produced.
struct Gen {
    api: EngineApi,
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    output: u32,
    seed: u64,
    include_usage: bool,
}

impl Gen {
    /// Text of output token `i`: a deterministic word, space-separated.
    fn token(&self, i: u32, out: &mut String) {
        use std::fmt::Write;
        if i > 0 || self.kind == Kind::Completion {
            out.push(' ');
        }
        let h = mix64(self.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let _ = write!(out, "g{:07x}", h & 0xfff_ffff);
    }

    fn usage(&self, stats: &RequestStats) -> Value {
        // vLLM (with --enable-prompt-tokens-details) always gives the details; SGLang (with
        // --enable-cache-report) only when some tokens were cached, else null
        // (`UsageProcessor._details_if_cached`).
        let details = match self.api {
            EngineApi::Sglang if stats.cached_tokens == 0 => Value::Null,
            _ => json!({"cached_tokens": stats.cached_tokens}),
        };
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.output,
            "completion_tokens": self.output,
            "prompt_tokens_details": details,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The SSE chunk of output token `i`.
    fn token_chunk(&self, i: u32, buf: &mut String) {
        let mut text = String::new();
        self.token(i, &mut text);
        let finish = (i + 1 == self.output).then_some("length");
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            }),
            Kind::Chat => json!({
                "index": 0, "delta": {"content": text}, "logprobs": null,
                "finish_reason": finish, "stop_reason": null,
            }),
        };
        sse(buf, &self.chunk(json!([choice])));
    }

    /// The full non-streaming response.
    fn full(&self, stats: &RequestStats) -> Value {
        let mut text = String::new();
        for i in 0..self.output {
            self.token(i, &mut text);
        }
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                "stop_reason": null, "prompt_logprobs": null,
            }),
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": null, "finish_reason": "length", "stop_reason": null,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(stats),
        })
    }
}

fn sse(buf: &mut String, v: &Value) {
    buf.push_str("data: ");
    buf.push_str(&v.to_string());
    buf.push_str("\n\n");
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(&st, Kind::Completion, &body).await
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(&st, Kind::Chat, &body).await
}

async fn generate(st: &AppState, kind: Kind, body: &[u8]) -> Response {
    match try_generate(st, kind, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The refusal of a prompt of no words.
fn empty_prompt(kind: Kind) -> ApiError {
    let param = match kind {
        Kind::Completion => "prompt",
        Kind::Chat => "messages",
    };
    ApiError::bad(
        "the prompt is empty (0 tokens; a token is a whitespace-separated word); send at least \
         one word",
        Some(param),
    )
}

/// [`parse`], refusing an empty prompt; with the prompt's token count.
fn parse_prompt(st: &AppState, kind: Kind, body: &[u8]) -> Result<(Parsed, u32), ApiError> {
    let p = parse(st, kind, body)?;
    let prompt_tokens = count_tokens(&p.text);
    if prompt_tokens == 0 {
        return Err(empty_prompt(kind));
    }
    Ok((p, prompt_tokens))
}

async fn try_generate(st: &AppState, kind: Kind, body: &[u8]) -> Result<Response, ApiError> {
    let received = tokio::time::Instant::now();
    let (p, prompt_tokens) = parse_prompt(st, kind, body)?;
    let capacity = st.cfg.kv_capacity_tokens();
    let total = prompt_tokens as u64 + p.max_tokens as u64;
    if total - 1 > capacity {
        return Err(ApiError::bad(
            format!(
                "This model's maximum context length is {capacity} tokens (the emulated KV \
                 cache). However, you requested {total} tokens ({prompt_tokens} in the prompt, \
                 {} in the completion). Please reduce the length of the prompt or completion.",
                p.max_tokens
            ),
            None,
        ));
    }
    if !st.frontend_delay.is_zero() {
        tokio::time::sleep_until(received + st.frontend_delay).await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let block_hashes = text_block_hashes(&p.text, st.block_tokens);
    let block_token_ids = st
        .kv_token_ids
        .then(|| super::kv_publish::block_token_ids(&p.text, block_hashes.len(), st.block_tokens));
    st.engine
        .submit(Job {
            prompt_tokens,
            output_tokens: p.max_tokens,
            block_hashes,
            block_token_ids,
            events: tx,
            received,
        })
        .map_err(|_| ApiError::gone())?;
    let gen = Gen {
        api: st.api,
        kind,
        id: st.request_id(match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
        model: st.model_name.clone(),
        prompt_tokens,
        output: p.max_tokens,
        seed: xxhash_rust::xxh3::xxh3_64(p.text.as_bytes()),
        include_usage: p.include_usage,
    };
    let tokens = super::reqlog::LoggedTokens {
        prompt: prompt_tokens,
        output: p.max_tokens,
        stream: p.stream,
    };
    let mut resp = if p.stream {
        stream_response(gen, rx)
    } else {
        collect(gen, rx).await?
    };
    resp.extensions_mut().insert(tokens);
    Ok(resp)
}

async fn collect(
    gen: Gen,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
) -> Result<Response, ApiError> {
    loop {
        match rx.recv().await {
            Some(TokenEvent::Tokens(_)) => {}
            Some(TokenEvent::Finished(stats)) => {
                return Ok(axum::Json(gen.full(&stats)).into_response())
            }
            Some(TokenEvent::Failed(msg)) => return Err(ApiError::bad(msg, None)),
            None => return Err(ApiError::gone()),
        }
    }
}

struct Streaming {
    gen: Gen,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    sent: u32,
    done: bool,
}

fn stream_response(gen: Gen, rx: mpsc::UnboundedReceiver<TokenEvent>) -> Response {
    let st = Streaming {
        gen,
        rx,
        sent: 0,
        done: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut buf = String::new();
        match st.rx.recv().await {
            Some(TokenEvent::Tokens(n)) => {
                for _ in 0..n {
                    if st.sent >= st.gen.output {
                        break;
                    }
                    if st.sent == 0 && st.gen.kind == Kind::Chat {
                        // vLLM opens a chat stream with the role, at the first token.
                        let role = json!([{
                            "index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": null, "finish_reason": null,
                        }]);
                        sse(&mut buf, &st.gen.chunk(role));
                    }
                    st.gen.token_chunk(st.sent, &mut buf);
                    st.sent += 1;
                }
            }
            Some(TokenEvent::Finished(stats)) => {
                if st.gen.include_usage {
                    let mut c = st.gen.chunk(json!([]));
                    c["usage"] = st.gen.usage(&stats);
                    sse(&mut buf, &c);
                }
                buf.push_str("data: [DONE]\n\n");
                st.done = true;
            }
            other => {
                let e = match other {
                    Some(TokenEvent::Failed(msg)) => ApiError::bad(msg, None),
                    _ => ApiError::gone(),
                };
                sse(&mut buf, &e.body());
                buf.push_str("data: [DONE]\n\n");
                st.done = true;
            }
        }
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(buf)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("static headers are valid")
}

// ---- other routes ---------------------------------------------------------------------------

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let id = &st.model_name;
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": id,
            "object": "model",
            "created": st.created,
            "owned_by": st.api.name(),
            "root": id,
            "parent": null,
            "max_model_len": st.cfg.kv_capacity_tokens(),
            "permission": [],
        }],
    }))
    .into_response()
}

/// Token id of one word under the emulator's convention (a token is a word): from the word
/// alone, so prompts with equal leading words have equal leading ids; in 1..=32000 (a plausible
/// vocabulary; 0 is never used).
fn token_id(word: &str) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(word.as_bytes()) % 32_000) as u32 + 1
}

/// What vLLM's render endpoints answer for one prompt (`GenerateRequest`): an id, the token
/// ids and the sampling parameters the generation would use, as JSON text (in a list of one
/// when `list`); `None` for a prompt of no words (refused as for generation).
///
/// Written straight into the answer rather than through a JSON value: the vLLM router asks
/// *every* worker to render *every* request before it chooses one, so a fleet of N emulators
/// renders each prompt N times, and a study at time scale f asks for that f times faster. A
/// value per token id (one allocation each, for ~10k-word prompts) made the render answer
/// several times dearer than the request it describes; past the router's deadline (about 1 s)
/// it routes without the ids (`missing_tokens`). See docs/peers.md.
fn rendered(st: &AppState, p: &Parsed, list: bool) -> Option<String> {
    let mut out = String::with_capacity(p.text.len() / 2 + 160);
    if list {
        out.push('[');
    }
    out.push_str("{\"request_id\":\"");
    out.push_str(&st.request_id("render"));
    out.push_str("\",\"token_ids\":[");
    let mut n = 0usize;
    for w in p.text.split_ascii_whitespace() {
        if n > 0 {
            out.push(',');
        }
        push_decimal(&mut out, token_id(w));
        n += 1;
    }
    if n == 0 {
        return None;
    }
    out.push_str("],\"sampling_params\":{\"max_tokens\":");
    push_decimal(&mut out, p.max_tokens);
    out.push_str("},\"stream\":");
    out.push_str(if p.stream { "true" } else { "false" });
    out.push('}');
    if list {
        out.push(']');
    }
    Some(out)
}

/// Append `v` in decimal.
fn push_decimal(out: &mut String, v: u32) {
    let mut buf = [0u8; 20];
    // Only ASCII digits are written.
    out.push_str(std::str::from_utf8(fmt_u64(v as u64, &mut buf)).unwrap_or_default());
}

/// A render endpoint: `list` wraps the answer in a list (completions: one entry per prompt,
/// the emulator takes one; chat: the rendered conversation alone).
fn render_response(st: &AppState, kind: Kind, body: &[u8], list: bool) -> Response {
    let p = match parse(st, kind, body) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    match rendered(st, &p, list) {
        Some(text) => ([(header::CONTENT_TYPE, "application/json")], text).into_response(),
        None => empty_prompt(kind).into_response(),
    }
}

/// `POST /v1/completions/render`: a list, one entry per prompt (the emulator takes one).
async fn render_completion(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    render_response(&st, Kind::Completion, &body, true)
}

/// `POST /v1/chat/completions/render`: one entry, the rendered conversation.
async fn render_chat(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    render_response(&st, Kind::Chat, &body, false)
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn version() -> Response {
    axum::Json(json!({"version": format!("cacheroute-emulate {}", env!("CARGO_PKG_VERSION"))}))
        .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let body = {
        let m = st.metrics.lock().unwrap_or_else(|p| p.into_inner());
        match st.api {
            EngineApi::Vllm => render(&st.info, &m),
            EngineApi::Sglang => super::metrics::render_sglang(&st.info, &m),
        }
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// vLLM 0.32 (`vllm/entrypoints/serve/dev/cache/api_router.py`) answers `{"success": bool}`;
/// the emulator drops what no running request uses and always succeeds.
async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.reset_prefix_cache().await {
        Ok(n) => {
            st.say(&format!(
                "reset_prefix_cache: success ({n} cache units dropped)"
            ));
            axum::Json(json!({"success": true})).into_response()
        }
        Err(_) => ApiError::gone().into_response(),
    }
}

impl AppState {
    fn say(&self, line: &str) {
        if self.announce {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    }
}

/// SGLang's `/health` and `/health_generate`: 503 while starting, then 200 with an empty body
/// (the emulator's engine cannot hang, so its one-token health generation is not run).
async fn sglang_health(State(st): State<Arc<AppState>>) -> StatusCode {
    if tokio::time::Instant::now() < st.ready_at {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// The `timeout` query of SGLang's `/flush_cache`: seconds (≥ 0) to wait for the engine to
/// become idle.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct FlushQuery {
    timeout: Option<String>,
}

/// SGLang's `GET|POST /flush_cache[?timeout=S]`: the whole radix cache goes, but only while
/// no request runs or waits; otherwise, after waiting up to `timeout` seconds (default 0) for
/// that, 400 with the scheduler's reason.
async fn flush_cache(
    State(st): State<Arc<AppState>>,
    axum::extract::Query(q): axum::extract::Query<FlushQuery>,
) -> Response {
    let timeout = match q.timeout.as_deref().map(str::parse::<f64>) {
        None => 0.0,
        Some(Ok(t)) if t.is_finite() && t >= 0.0 => t,
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"object": "error", "message": "timeout: must be a number >= 0 (seconds)", "type": "Bad Request", "param": null, "code": 400})),
            )
                .into_response()
        }
    };
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs_f64(timeout);
    loop {
        match st.engine.flush_if_idle().await {
            Err(_) => return ApiError::gone().into_response(),
            Ok(Ok(n)) => {
                st.say(&format!("flush_cache: 200 ({n} cache units dropped)"));
                return (
                    StatusCode::OK,
                    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
                )
                    .into_response();
            }
            Ok(Err(busy)) if tokio::time::Instant::now() >= until => {
                let why = format!(
                    "Cache not flushed because there are pending requests. #queue-req: {}, #running-req: {}",
                    busy.waiting, busy.running
                );
                st.say(&format!("flush_cache: 400 ({why})"));
                return (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response();
            }
            Ok(Err(_)) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
}

/// SGLang's `/get_server_info` (`/server_info`): its server arguments, scheduler info and
/// version; here the ones that describe what is emulated.
async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    let k = st.cfg.knobs();
    let m = st.metrics.lock().unwrap_or_else(|p| p.into_inner()).clone();
    axum::Json(json!({
        "model_path": st.cfg.spec().to_string(),
        "served_model_name": st.model_name,
        "tp_size": st.cfg.spec().tp,
        "page_size": k.block_size,
        "max_running_requests": k.max_num_seqs,
        "chunked_prefill_size": k.max_num_batched_tokens,
        "max_total_num_tokens": st.cfg.kv_capacity_tokens(),
        "enable_metrics": true,
        "enable_cache_report": true,
        "disable_radix_cache": false,
        "internal_states": [{"num_running_reqs": m.running, "num_queue_reqs": m.waiting}],
        "version": format!("cacheroute-emulate {}", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}

/// SGLang's `/get_model_info` (`/model_info`).
async fn model_info(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "model_path": st.cfg.spec().to_string(),
        "tokenizer_path": null,
        "is_generation": true,
    }))
    .into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"detail": "Not Found"})),
    )
        .into_response()
}
