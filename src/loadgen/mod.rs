//! The open-loop load replayer behind `cacheroute replay` and the study runner's live steps.
//!
//! It sends each request of a schedule at its scheduled instant over real HTTP to an
//! OpenAI-compatible endpoint (the cacheroute router, vLLM, SGLang or `cacheroute emulate`),
//! whatever is still outstanding, and measures every latency from the scheduled instant
//! (docs/replayer.md: no coordinated omission). Schedule lag (actual send − scheduled) and the
//! achieved rate are reported for every run, so a client that cannot keep up shows it.
//!
//! Shape (oha's lesson): one arrival abstraction and one send loop. A schedule
//! is any iterator of `(scheduled seconds from the start, TraceRecord)` — a trace's timestamps
//! ([`schedule`]), rescaled to a ladder step's rate ([`rescale_to_qps`]), or a generated
//! workload, whose timestamps come from `workload::arrivals`. [`replay`] is the only send loop:
//!
//! - A dispatcher on its own OS thread sleeps until each due instant (`std::thread::sleep`,
//!   tens of µs of precision, where tokio's timer wheel has 1 ms) and, for everything that is
//!   due, spawns one task onto the tokio runtime. It never waits for earlier requests.
//! - An in-flight cap: a request due while `max_inflight` are outstanding is recorded at once
//!   as an `overflow` error, never delayed.
//! - Each task builds its prompt text from the record's `hash_ids` with
//!   `workload::text::prompt_text` (equal prefixes are equal text), stamps `sent_s`, sends
//!   through the one shared `reqwest` client (connection pool, plain HTTP), and reads the
//!   answer as JSON or SSE; first-token time is the first content chunk.
//!
//! Sessions with live answers ([`Sessions::Live`], module [`session`]): the turns of a trace
//! `session` go in turn order, each after the previous answer (and a think time), carrying that
//! answer's text; sessions start open loop. A failed turn abandons the rest of its session.
//!
//! Outputs: a [`ReplayRecord`] per request (the one `analysis::record::RequestRecord`, which
//! the step metrics and the store take as it is, and what only the replayer knows), and a
//! [`ReplaySummary`].
//!
//! Depends on `workload` (records, prompt text), `analysis` and `store` (their row types only);
//! must not depend on `router`, `emulate`, `sim` or `experiment`.

mod http;
mod record;
pub mod session;

pub use record::{destination_index, ReplayRecord, ReplaySummary, SessionSummary};
pub use session::{Sessions, ThinkTime};

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::HeaderName;
use tokio::sync::mpsc;

use crate::analysis::record::Status;
use crate::workload::trace::TraceRecord;
use session::{Turn, Unit};

/// Which OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions` with `prompt`.
    Completions,
    /// `POST /v1/chat/completions` with one user message.
    Chat,
}

impl Endpoint {
    pub fn path(&self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Base URL of the endpoint, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted).
    pub target: String,
    pub endpoint: Endpoint,
    /// The `model` field of each request (vLLM wants its served model name).
    pub model: String,
    /// Ask for SSE streaming (with `stream_options.include_usage`), giving TTFT and inter-token
    /// times; without it TTFT equals end-to-end.
    pub stream: bool,
    /// Header carrying each record's routing key.
    pub key_header: String,
    /// Tokens per trace block, for the prompt text (the trace's block size).
    pub block_tokens: u32,
    /// Outstanding requests allowed; a request due beyond it is an `overflow` error.
    pub max_inflight: usize,
    /// Per-request limit, from the actual send to the end of the response.
    pub timeout: Duration,
    /// Send `ignore_eos: true` so engines generate exactly `output_length` tokens.
    pub ignore_eos: bool,
    /// The nominal length of the schedule for rate figures (`None`: its span).
    pub duration_s: Option<f64>,
    /// Stop dispatching when the first this many requests to end all failed the same way
    /// (same status: `http_404`, `connect`, …; overflow is not counted): a wrong target,
    /// model or endpoint then costs seconds, not the whole schedule. 0: never.
    pub fail_fast: usize,
    /// How the turns of a trace `session` are sent: each at its own time with a synthesised
    /// prompt ([`Sessions::Trace`]), or in order, each after the previous answer and carrying
    /// its text ([`Sessions::Live`]).
    pub sessions: Sessions,
    /// Live sessions: the pause between an answer and the next turn.
    pub think_time: ThinkTime,
    /// Keep each request's prompt and answer text in its record (`prompt`, `answer`).
    pub keep_text: bool,
}

impl ReplayConfig {
    /// Defaults: completions, model `default`, no streaming, key header `x-cacheroute-key`,
    /// 16-token blocks, 4096 in flight, 600 s timeout, `ignore_eos`, sessions from the trace.
    pub fn new(target: impl Into<String>) -> Self {
        ReplayConfig {
            target: target.into(),
            endpoint: Endpoint::Completions,
            model: "default".into(),
            stream: false,
            key_header: "x-cacheroute-key".into(),
            block_tokens: 16,
            max_inflight: 4096,
            timeout: Duration::from_secs(600),
            ignore_eos: true,
            duration_s: None,
            fail_fast: 0,
            sessions: Sessions::Trace,
            think_time: ThinkTime::Trace,
            keep_text: false,
        }
    }

    /// `target` without a trailing `/` or `/v1`: where `/v1/…` paths go.
    fn base(&self) -> &str {
        let t = self.target.trim().trim_end_matches('/');
        t.strip_suffix("/v1").unwrap_or(t)
    }

    /// `{base}/v1/models`.
    pub fn models_url(&self) -> Result<String, ReplayError> {
        self.url()?;
        Ok(format!("{}/v1/models", self.base()))
    }

    /// The full request URL, or what is wrong with `target`.
    pub fn url(&self) -> Result<String, ReplayError> {
        let t = self.target.trim().trim_end_matches('/');
        let bad = |why: &str| ReplayError::BadTarget {
            target: self.target.clone(),
            why: why.to_owned(),
        };
        if t.starts_with("https://") {
            return Err(bad("https is not supported (engines serve plain HTTP; this build has no TLS); use http://"));
        }
        let rest = t
            .strip_prefix("http://")
            .ok_or_else(|| bad("expected http://HOST:PORT"))?;
        if rest.is_empty() || rest.starts_with('/') {
            return Err(bad("no host; expected http://HOST:PORT"));
        }
        let url = format!("{}{}", self.base(), self.endpoint.path());
        reqwest::Url::parse(&url).map_err(|e| bad(&e.to_string()))?;
        Ok(url)
    }

    /// Every problem with the configuration (empty when fine).
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = self.url() {
            p.push(e.to_string());
        }
        if HeaderName::from_bytes(self.key_header.as_bytes()).is_err() {
            p.push(format!(
                "key_header {:?} is not a valid HTTP header name; use letters, digits and '-'",
                self.key_header
            ));
        }
        if self.max_inflight == 0 {
            p.push("max_inflight must be ≥ 1".into());
        }
        if self.timeout.is_zero() {
            p.push("timeout must be > 0".into());
        }
        if self.block_tokens == 0 {
            p.push("block_tokens must be ≥ 1".into());
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                p.push(format!(
                    "duration_s {d} must be a positive number of seconds"
                ));
            }
        }
        p
    }
}

/// Why a replay could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("target {target:?}: {why}")]
    BadTarget { target: String, why: String },
    #[error("replay config: {}", .0.join("; "))]
    Config(Vec<String>),
    #[error("building the HTTP client failed: {0}")]
    Client(#[source] reqwest::Error),
    #[error("starting the tokio runtime failed: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("the dispatcher thread failed: {0}")]
    Dispatcher(String),
    #[error(
        "{url} did not name a model ({why}); pass --model NAME (the engine's served model name)"
    )]
    Model { url: String, why: String },
}

/// The first model id `GET {target}/v1/models` lists (`data[0].id`): what an engine serves,
/// for requests whose `model` was not given.
pub async fn first_model(cfg: &ReplayConfig) -> Result<String, ReplayError> {
    let url = cfg.models_url()?;
    let why = |why: String| ReplayError::Model {
        url: url.clone(),
        why,
    };
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(cfg.timeout.min(Duration::from_secs(10)))
        .build()
        .map_err(ReplayError::Client)?;
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| why(http::transport(e).1))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| why(http::transport(e).1))?;
    if !status.is_success() {
        return Err(why(format!("answered {status}")));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| why(format!("not JSON: {e}")))?;
    v["data"]
        .as_array()
        .and_then(|a| a.first())
        .and_then(|m| m["id"].as_str())
        .map(str::to_owned)
        .ok_or_else(|| why("no `data[0].id` in its answer".into()))
}

/// What a replay produced.
#[derive(Debug, Clone)]
pub struct ReplayResult {
    /// One per dispatched request, in schedule order (`records[i].id == i`; a live-session
    /// run cut short lacks the later turns it had not sent yet).
    pub records: Vec<ReplayRecord>,
    pub summary: ReplaySummary,
    /// The stop signal of [`replay_until`] fired: the schedule was cut short, and the rate
    /// window ends at the stop.
    pub interrupted: bool,
    /// The run stopped by itself ([`ReplayConfig::fail_fast`]): why, in one line.
    pub aborted: Option<String>,
    /// The watch of [`replay_watched`] ended the run at this many seconds from its start:
    /// nothing more was sent, and requests still running were ended there (`unfinished`).
    pub cut_at_s: Option<f64>,
    /// The system clock (Unix seconds) at the replay's time origin: record times (`scheduled_s`,
    /// `sent_s`, …) plus this are wall-clock times, comparable with a server's own log.
    pub start_unix_s: f64,
}

/// A trace's own schedule: each record at its timestamp (ms → s).
pub fn schedule(
    records: impl IntoIterator<Item = TraceRecord>,
) -> impl Iterator<Item = (f64, TraceRecord)> {
    records.into_iter().map(|r| (r.timestamp_ms / 1000.0, r))
}

/// Rescale a sorted trace in place so it starts at 0 with a mean rate of `qps` requests/s
/// (inter-arrival shape kept). A trace with one request or zero span is left at 0.
pub fn rescale_to_qps(records: &mut [TraceRecord], qps: f64) {
    let Some(first) = records.first() else {
        return;
    };
    let t0 = first.timestamp_ms;
    let span = records.last().map_or(0.0, |r| r.timestamp_ms) - t0;
    let f = if span > 0.0 && records.len() > 1 {
        let native = (records.len() - 1) as f64 / (span / 1000.0);
        native / qps
    } else {
        0.0
    };
    for r in records.iter_mut() {
        r.timestamp_ms = (r.timestamp_ms - t0) * f;
    }
}

/// The shared, immutable side of a replay.
struct Shared {
    client: reqwest::Client,
    url: String,
    key_header: HeaderName,
    cfg: ReplayConfig,
    start: Instant,
    inflight: AtomicUsize,
    /// Set by the stop signal: dispatch no more.
    stop: AtomicBool,
    /// Set (true) when a watch cuts the run: requests still running end at once.
    cut: tokio::sync::watch::Sender<bool>,
    /// Session turns not sent and not recorded because the run stopped first.
    dropped: AtomicU64,
}

/// Decrements the in-flight count when a request task ends, however it ends.
struct InflightGuard(Arc<Shared>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

fn new_record(id: u64, scheduled_s: f64, rec: &TraceRecord) -> ReplayRecord {
    ReplayRecord::new(id, &rec.key, scheduled_s, rec.input_length)
}

/// The first requests to end, while they all failed the same way ([`ReplayConfig::fail_fast`]).
struct FailFast {
    limit: usize,
    /// Requests ended so far (overflow not counted) and the status they all had; `None` once
    /// one differed (the check is then off).
    seen: Option<(usize, String)>,
}

impl FailFast {
    /// Whether `r` completes `limit` equal failures: then why, in one line.
    fn note(&mut self, r: &ReplayRecord) -> Option<String> {
        if self.limit == 0 || r.record.status == Status::Overflow {
            return None;
        }
        let (n, label) = self.seen.as_mut()?;
        let l = r.record.status.label();
        if r.record.status.is_ok() || (*n > 0 && *label != l) {
            self.seen = None;
            return None;
        }
        *n += 1;
        *label = l;
        (*n == self.limit).then(|| {
            format!(
                "the first {n} requests all failed with {label} ({}); stopped early — check --target, --model and --endpoint",
                r.error.as_deref().unwrap_or("no detail").trim()
            )
        })
    }
}

/// Count one more request in flight unless the cap is reached (then `false`).
fn admit(sh: &Shared) -> bool {
    if sh.inflight.load(Ordering::Acquire) >= sh.cfg.max_inflight {
        return false;
    }
    sh.inflight.fetch_add(1, Ordering::AcqRel);
    true
}

/// The record of a request refused at `t` by the in-flight cap.
fn overflow(sh: &Shared, turn: &Turn, t: f64) -> ReplayRecord {
    let mut r = new_record(turn.id, t, &turn.rec);
    r.record.status = Status::Overflow;
    r.record.finish_s = Some(sh.start.elapsed().as_secs_f64());
    r.error = Some(format!(
        "{} requests already in flight at the scheduled time; raise the in-flight cap or lower the rate",
        sh.cfg.max_inflight
    ));
    r
}

/// One admitted request: send `body` at once, read, and return its record.
async fn exchange(
    sh: &Arc<Shared>,
    id: u64,
    scheduled_s: f64,
    rec: &TraceRecord,
    body: Vec<u8>,
) -> ReplayRecord {
    let _guard = InflightGuard(sh.clone());
    let mut r = new_record(id, scheduled_s, rec);
    r.record.sent_s = Some(sh.start.elapsed().as_secs_f64());
    let ex = http::Exchange {
        client: &sh.client,
        url: &sh.url,
        key_header: &sh.key_header,
        stream: sh.cfg.stream,
        start: sh.start,
        keep_answer: sh.cfg.keep_text || sh.cfg.sessions == Sessions::Live,
    };
    let mut cut = sh.cut.subscribe();
    let res = tokio::select! {
        res = tokio::time::timeout(sh.cfg.timeout, ex.run(body, &rec.key, &mut r)) => Some(res),
        _ = cut.wait_for(|c| *c) => None,
    };
    let fail = match res {
        None => Some((
            Status::Unfinished,
            "still running when the run was cut".to_string(),
        )),
        Some(Ok(Ok(()))) => None,
        Some(Ok(Err(f))) => Some(f),
        Some(Err(_)) => Some((
            Status::Timeout,
            format!(
                "no complete response within {:?}; raise the request timeout or lower the rate",
                sh.cfg.timeout
            ),
        )),
    };
    if let Some((status, msg)) = fail {
        r.record.status = status;
        r.error = Some(msg);
        r.record.finish_s = Some(sh.start.elapsed().as_secs_f64());
    }
    r
}

/// One request on its own (already admitted): its prompt synthesised from the trace.
async fn send_one(sh: Arc<Shared>, turn: Turn, tx: mpsc::UnboundedSender<ReplayRecord>) {
    let body = http::request_body(&sh.cfg, turn.id, &turn.rec);
    let mut r = exchange(&sh, turn.id, turn.t, &turn.rec, body).await;
    if sh.cfg.keep_text {
        r.prompt = Some(prompt_text_of(&sh.cfg, turn.id, &turn.rec));
    } else {
        r.answer = None;
    }
    let _ = tx.send(r);
}

fn prompt_text_of(cfg: &ReplayConfig, id: u64, rec: &TraceRecord) -> String {
    crate::workload::text::prompt_text(
        &rec.hash_ids,
        rec.input_length,
        cfg.block_tokens,
        http::prompt_unique(id),
    )
}

/// Sleep until `t` seconds from the start, in slices so a stop (or a dropped replay) is
/// noticed; `false` when the run stopped meanwhile.
async fn sleep_until_s(sh: &Shared, t: f64, tx: &mpsc::UnboundedSender<ReplayRecord>) -> bool {
    let due = sh.start + Duration::from_secs_f64(t.max(0.0));
    loop {
        if sh.stop.load(Ordering::Relaxed) || tx.is_closed() {
            return false;
        }
        let now = Instant::now();
        if due <= now {
            return true;
        }
        tokio::time::sleep((due - now).min(Duration::from_millis(20))).await;
    }
}

/// A live session: its first turn (already admitted) at once, then each later turn after the
/// previous answer (and the think time), its prompt the conversation so far plus the new user
/// message. A turn that fails abandons the rest of the session (recorded as `abandoned`).
async fn send_session(
    sh: Arc<Shared>,
    name: String,
    turns: Vec<Turn>,
    tx: mpsc::UnboundedSender<ReplayRecord>,
) {
    let cfg = &sh.cfg;
    let chat = cfg.endpoint == Endpoint::Chat;
    let mut parts: Vec<String> = Vec::new();
    // The previous turn: (due, trace time, answer time, trace input + output lengths).
    let mut prev: Option<(f64, f64, f64, u32)> = None;
    let mut failed: Option<String> = None;
    let n = turns.len();
    for (k, turn) in turns.into_iter().enumerate() {
        let label = |r: &mut ReplayRecord| {
            r.session = Some(name.clone());
            r.turn = Some(k as u32 + 1);
        };
        if let Some(why) = &failed {
            let _ = tx.send(abandoned(&sh, &turn, &name, k, why));
            continue;
        }
        let (due, late) = match prev {
            None => (turn.t, None),
            Some((pdue, ptrace, answer, _)) => {
                session::next_due(cfg.think_time, turn.id, pdue, ptrace, answer, turn.t)
            }
        };
        if k > 0 {
            if !sleep_until_s(&sh, due, &tx).await {
                sh.dropped.fetch_add((n - k) as u64, Ordering::Relaxed);
                return;
            }
            if !admit(&sh) {
                let mut r = overflow(&sh, &turn, due);
                label(&mut r);
                failed = Some(abandon_why(&name, k, &r));
                let _ = tx.send(r);
                continue;
            }
        }
        let message = match prev {
            None => prompt_text_of(cfg, turn.id, &turn.rec),
            Some((.., context)) => session::new_message(
                &turn.rec,
                context,
                cfg.block_tokens,
                http::prompt_unique(turn.id),
            ),
        };
        parts.push(message);
        let body = http::body_of(cfg, &turn.rec, &parts);
        let mut r = exchange(&sh, turn.id, due, &turn.rec, body).await;
        label(&mut r);
        r.late_s = late;
        if cfg.keep_text {
            r.prompt = Some(if chat {
                parts.join("\n")
            } else {
                session::joined(&parts)
            });
        }
        // The answer goes on into the conversation; the record keeps a copy only when asked.
        let answer = if cfg.keep_text {
            r.answer.clone()
        } else {
            r.answer.take()
        };
        if r.record.status.is_ok() {
            parts.push(answer.unwrap_or_default());
            prev = Some((
                due,
                turn.t,
                r.record.finish_s.unwrap_or(due),
                turn.rec.input_length + turn.rec.output_length,
            ));
        } else {
            failed = Some(abandon_why(&name, k, &r));
        }
        let _ = tx.send(r);
    }
}

/// The record of turn `k` (0-based) of session `name`, not sent because of `why`.
fn abandoned(sh: &Shared, turn: &Turn, name: &str, k: usize, why: &str) -> ReplayRecord {
    let mut r = new_record(turn.id, turn.t, &turn.rec);
    r.record.status = Status::Abandoned;
    r.record.finish_s = Some(sh.start.elapsed().as_secs_f64());
    r.error = Some(why.to_owned());
    r.session = Some(name.to_owned());
    r.turn = Some(k as u32 + 1);
    r
}

/// Why the rest of a session is not sent, after its turn `k` (0-based) ended as `r`.
fn abandon_why(name: &str, k: usize, r: &ReplayRecord) -> String {
    format!(
        "turn {} of session {name} ended {} (request {}), so there is no answer to continue from; the rest of the session is not sent",
        k + 1,
        r.record.status.label(),
        r.record.id
    )
}

/// The dispatcher: the one send loop. Runs on its own thread; returns the number of
/// requests (ids) it handed out.
fn dispatch<I>(
    units: I,
    sh: Arc<Shared>,
    rt: tokio::runtime::Handle,
    tx: mpsc::UnboundedSender<ReplayRecord>,
) -> u64
where
    I: Iterator<Item = (f64, Unit)>,
{
    let mut ids = 0u64;
    for (t, unit) in units {
        // Out-of-order or invalid times are sent at once (and show up as lag).
        let t = if t.is_finite() { t.max(0.0) } else { 0.0 };
        let due = sh.start + Duration::from_secs_f64(t);
        loop {
            // Stopped, or the replay future was dropped (cancelled): send no more.
            if sh.stop.load(Ordering::Relaxed) || tx.is_closed() {
                return ids;
            }
            let now = Instant::now();
            if due <= now {
                break;
            }
            // Long gaps are slept in slices so a stop is seen within 20 ms.
            std::thread::sleep((due - now).min(Duration::from_millis(20)));
        }
        ids += unit.ids();
        match unit {
            Unit::One(mut turn) => {
                turn.t = t;
                if admit(&sh) {
                    rt.spawn(send_one(sh.clone(), turn, tx.clone()));
                } else {
                    let _ = tx.send(overflow(&sh, &turn, t));
                }
            }
            Unit::Session(name, mut turns) => {
                turns[0].t = t;
                if admit(&sh) {
                    rt.spawn(send_session(sh.clone(), name, turns, tx.clone()));
                } else {
                    // The first turn overflowed: the session never starts.
                    let mut first = overflow(&sh, &turns[0], t);
                    first.session = Some(name.clone());
                    first.turn = Some(1);
                    let why = abandon_why(&name, 0, &first);
                    let _ = tx.send(first);
                    for (k, turn) in turns.iter().enumerate().skip(1) {
                        let _ = tx.send(abandoned(&sh, turn, &name, k, &why));
                    }
                }
            }
        }
    }
    ids
}

/// Replay `schedule` against `cfg.target`, open loop, on the current tokio runtime (a
/// multi-thread runtime is best at high rates). Returns when every request has ended.
///
/// The schedule is `(seconds from the start, record)` in non-decreasing time; it is consumed
/// lazily on a dispatcher thread, so it may be long (a generator), but must be `Send`.
pub async fn replay<I>(cfg: &ReplayConfig, schedule: I) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
{
    replay_until(cfg, schedule, std::future::pending()).await
}

/// A watch over a replay: called with the seconds since the start and each request as it
/// ends (and with none once a second); `true` cuts the run.
pub type Watch<'a> = Box<dyn FnMut(f64, Option<&ReplayRecord>) -> bool + Send + 'a>;

/// [`replay`] that `watch` can cut short: once it says so, nothing more is sent and requests
/// still running are ended at once (recorded `unfinished`); the result's `cut_at_s` says when.
pub async fn replay_watched<I>(
    cfg: &ReplayConfig,
    schedule: I,
    watch: Watch<'_>,
) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
{
    replay_inner(cfg, schedule, std::future::pending(), Some(watch)).await
}

/// [`replay`] that stops dispatching when `stop` completes (e.g. `tokio::signal::ctrl_c()`):
/// requests already sent are still awaited (at most the request timeout), the rest of the
/// schedule is dropped, and the result says `interrupted`.
pub async fn replay_until<I, F>(
    cfg: &ReplayConfig,
    schedule: I,
    stop: F,
) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
    F: Future<Output = ()>,
{
    replay_inner(cfg, schedule, stop, None).await
}

async fn replay_inner<I, F>(
    cfg: &ReplayConfig,
    schedule: I,
    stop: F,
    mut watch: Option<Watch<'_>>,
) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
    F: Future<Output = ()>,
{
    let problems = cfg.validate();
    if !problems.is_empty() {
        return Err(ReplayError::Config(problems));
    }
    let url = cfg.url()?;
    let key_header = HeaderName::from_bytes(cfg.key_header.as_bytes())
        .map_err(|_| ReplayError::Config(vec!["bad key_header".into()]))?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(usize::MAX)
        .pool_idle_timeout(Duration::from_secs(90))
        .connect_timeout(cfg.timeout.min(Duration::from_secs(10)))
        .build()
        .map_err(ReplayError::Client)?;
    // Live sessions need the whole schedule to chain each session's turns: read it before
    // the clock starts.
    let units: Box<dyn Iterator<Item = (f64, Unit)> + Send> = match cfg.sessions {
        Sessions::Live => Box::new(session::group(schedule.into_iter()).into_iter()),
        Sessions::Trace => Box::new(session::singles(schedule.into_iter())),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let lead = Duration::from_millis(5);
    let start_unix_s = (std::time::SystemTime::now() + lead)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let sh = Arc::new(Shared {
        client,
        url,
        key_header,
        cfg: cfg.clone(),
        // A small lead so the first requests are not late by the thread's start-up.
        start: Instant::now() + lead,
        inflight: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        cut: tokio::sync::watch::channel(false).0,
        dropped: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Handle::current();
    let sh2 = sh.clone();
    let dispatcher = std::thread::Builder::new()
        .name("cacheroute-replay-dispatch".into())
        .spawn(move || dispatch(units, sh2, rt, tx))
        .map_err(|e| ReplayError::Dispatcher(e.to_string()))?;
    let mut records = Vec::new();
    let mut stopped_at: Option<f64> = None;
    let mut stop = std::pin::pin!(stop);
    let mut itl = crate::analysis::LatencyHist::new();
    let mut fail_fast = FailFast {
        limit: cfg.fail_fast,
        seen: Some((0, String::new())),
    };
    let mut aborted = None;
    let mut cut_at: Option<f64> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick(), if watch.is_some() && cut_at.is_none() => {
                cut_at = watch_says_cut(&sh, &mut watch, None);
            }
            r = rx.recv() => match r {
                Some(mut r) => {
                    if cut_at.is_none() {
                        cut_at = watch_says_cut(&sh, &mut watch, Some(&r));
                    }
                    // Inter-token gaps go into one histogram here, not into every record.
                    if r.record.status.is_ok() {
                        for g in &r.gaps {
                            itl.record_s(*g as f64);
                        }
                    }
                    r.gaps = Vec::new();
                    if let Some(why) = fail_fast.note(&r) {
                        if stopped_at.is_none() {
                            sh.stop.store(true, Ordering::Relaxed);
                            stopped_at = Some(sh.start.elapsed().as_secs_f64());
                            aborted = Some(why);
                        }
                    }
                    records.push(r);
                }
                None => break,
            },
            _ = &mut stop, if stopped_at.is_none() => {
                sh.stop.store(true, Ordering::Relaxed);
                stopped_at = Some(sh.start.elapsed().as_secs_f64());
            }
        }
    }
    // The channel closes only after the dispatcher returned (it held a sender).
    let scheduled = dispatcher
        .join()
        .map_err(|_| ReplayError::Dispatcher("the schedule iterator panicked".into()))?;
    debug_assert_eq!(
        scheduled as usize,
        records.len() + sh.dropped.load(Ordering::Relaxed) as usize
    );
    let wall_s = sh.start.elapsed().as_secs_f64();
    records.sort_unstable_by_key(|r| r.record.id);
    let window = match (stopped_at.or(cut_at), cfg.duration_s) {
        (Some(t), Some(d)) => Some(t.min(d)),
        (Some(t), None) => Some(t),
        (None, d) => d,
    };
    let summary = ReplaySummary::of(&records, window, wall_s, cfg.stream.then_some(&itl));
    Ok(ReplayResult {
        records,
        summary,
        interrupted: stopped_at.is_some() && aborted.is_none(),
        aborted,
        cut_at_s: cut_at,
        start_unix_s,
    })
}

/// Ask the watch (when there is one) about `ended` now; when it says cut, stop sending, end
/// what still runs, and return when (seconds from the start).
fn watch_says_cut(
    sh: &Shared,
    watch: &mut Option<Watch<'_>>,
    ended: Option<&ReplayRecord>,
) -> Option<f64> {
    let now = sh.start.elapsed().as_secs_f64();
    let w = watch.as_mut()?;
    if !w(now, ended) {
        return None;
    }
    sh.stop.store(true, Ordering::Relaxed);
    sh.cut.send_replace(true);
    Some(now)
}

/// [`replay`] on a fresh multi-thread runtime with one worker per CPU (for callers without
/// one). Must not be called from inside a tokio runtime.
pub fn replay_blocking<I>(cfg: &ReplayConfig, schedule: I) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
{
    replay_runtime()?.block_on(replay(cfg, schedule))
}

/// A multi-thread runtime with one worker per CPU, for the blocking replays.
fn replay_runtime() -> Result<tokio::runtime::Runtime, ReplayError> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("cacheroute-replay")
        .build()
        .map_err(ReplayError::Runtime)
}

/// [`replay_watched`] on a fresh multi-thread runtime (see [`replay_blocking`]).
pub fn replay_blocking_watched<I>(
    cfg: &ReplayConfig,
    schedule: I,
    watch: Watch<'_>,
) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = (f64, TraceRecord)>,
    I::IntoIter: Send + 'static,
{
    replay_runtime()?.block_on(replay_watched(cfg, schedule, watch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(ts: f64) -> TraceRecord {
        TraceRecord {
            timestamp_ms: ts,
            key: "k".into(),
            input_length: 4,
            output_length: 2,
            hash_ids: vec![1],
            session: None,
            turn: None,
        }
    }

    #[test]
    fn urls_and_validation() {
        let mut c = ReplayConfig::new("http://127.0.0.1:8000/");
        assert_eq!(c.url().unwrap(), "http://127.0.0.1:8000/v1/completions");
        c.target = "http://h:1/v1".into();
        c.endpoint = Endpoint::Chat;
        assert_eq!(c.url().unwrap(), "http://h:1/v1/chat/completions");
        assert!(c.validate().is_empty());
        c.target = "https://h".into();
        c.max_inflight = 0;
        c.key_header = "bad header".into();
        let p = c.validate();
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("https"));
        c.target = "127.0.0.1:8000".into();
        assert!(c
            .url()
            .unwrap_err()
            .to_string()
            .contains("http://HOST:PORT"));
    }

    #[test]
    fn rescale_keeps_shape_and_sets_rate() {
        let mut v: Vec<_> = [1000.0, 1500.0, 3000.0].into_iter().map(tr).collect();
        rescale_to_qps(&mut v, 10.0);
        // 2 gaps over 2 s natively = 1 req/s; at 10 req/s the span is 0.2 s.
        let ts: Vec<f64> = schedule(v).map(|(t, _)| t).collect();
        assert!((ts[0] - 0.0).abs() < 1e-12);
        assert!((ts[1] - 0.05).abs() < 1e-12);
        assert!((ts[2] - 0.2).abs() < 1e-12);
    }

    #[test]
    fn bodies_carry_prompt_and_options() {
        let mut c = ReplayConfig::new("http://x:1");
        c.stream = true;
        c.block_tokens = 2;
        let b: serde_json::Value =
            serde_json::from_slice(&http::request_body(&c, 0, &tr(0.0))).unwrap();
        assert_eq!(b["max_tokens"], 2);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(
            crate::workload::text::count_tokens(b["prompt"].as_str().unwrap()),
            4
        );
        c.endpoint = Endpoint::Chat;
        c.stream = false;
        c.ignore_eos = false;
        let b: serde_json::Value =
            serde_json::from_slice(&http::request_body(&c, 0, &tr(0.0))).unwrap();
        assert!(b["messages"][0]["content"].is_string());
        assert!(b.get("stream_options").is_none() && b.get("ignore_eos").is_none());
    }
}
