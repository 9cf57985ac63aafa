//! One request/response exchange with an OpenAI-compatible endpoint: the request body (prompt
//! text from the trace's `hash_ids` by the shared convention in `workload::text`), and the
//! response read as JSON or as SSE (`eventsource-stream`), with first-token and inter-token
//! times taken as chunks arrive.

use std::time::Instant;

use futures_util::StreamExt;
use reqwest::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use serde::Deserialize;

use super::record::ReplayRecord;
use super::{Endpoint, ReplayConfig};
use crate::analysis::record::Status;
use crate::workload::text::prompt_text;
use crate::workload::trace::TraceRecord;

/// The JSON body of request `id` for `rec`, its prompt synthesised from the trace.
pub(crate) fn request_body(cfg: &ReplayConfig, id: u64, rec: &TraceRecord) -> Vec<u8> {
    let prompt = prompt_text(
        &rec.hash_ids,
        rec.input_length,
        cfg.block_tokens,
        prompt_unique(id),
    );
    body_of(cfg, rec, std::slice::from_ref(&prompt))
}

/// The per-request value that makes the tail of request `id`'s prompt unique.
pub(crate) fn prompt_unique(id: u64) -> u64 {
    crate::rng::mix64(id ^ 0x5e9d_0f1a_7c3b_2d41)
}

/// The JSON body for `rec` whose conversation so far is `parts` (user and assistant texts
/// alternating, starting with a user text; one part for a single request): completions get
/// them as one prompt ([`joined`](super::session::joined)), chat as messages.
pub(crate) fn body_of(cfg: &ReplayConfig, rec: &TraceRecord, parts: &[String]) -> Vec<u8> {
    let mut v = match cfg.endpoint {
        Endpoint::Completions => serde_json::json!({
            "model": cfg.model,
            "prompt": super::session::joined(parts),
            "max_tokens": rec.output_length.max(1),
            "stream": cfg.stream,
        }),
        Endpoint::Chat => {
            let messages: Vec<serde_json::Value> = parts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    serde_json::json!({
                        "role": if i % 2 == 0 { "user" } else { "assistant" },
                        "content": p,
                    })
                })
                .collect();
            serde_json::json!({
                "model": cfg.model,
                "messages": messages,
                "max_tokens": rec.output_length.max(1),
                "stream": cfg.stream,
            })
        }
    };
    let o = v.as_object_mut().expect("built as an object");
    if cfg.stream {
        o.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
    }
    if cfg.ignore_eos {
        o.insert("ignore_eos".into(), true.into());
    }
    serde_json::to_vec(&v).expect("a JSON value always serializes")
}

#[derive(Deserialize, Default)]
struct Body {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<Message>,
    #[serde(default)]
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl Body {
    /// The generated text this body carries (completion `text`, chat `delta` or `message`).
    fn push_text(&self, out: &mut String) {
        for c in &self.choices {
            for t in [
                c.text.as_deref(),
                c.delta.as_ref().and_then(|d| d.content.as_deref()),
                c.message.as_ref().and_then(|d| d.content.as_deref()),
            ]
            .into_iter()
            .flatten()
            {
                out.push_str(t);
            }
        }
    }

    /// Whether this (stream) chunk carries generated content.
    fn has_content(&self) -> bool {
        self.choices.iter().any(|c| {
            c.text.as_deref().is_some_and(|t| !t.is_empty())
                || c.delta
                    .as_ref()
                    .and_then(|d| d.content.as_deref())
                    .is_some_and(|t| !t.is_empty())
        })
    }
}

fn apply_usage(r: &mut ReplayRecord, u: &Usage) {
    if let Some(p) = u.prompt_tokens {
        r.record.prompt_tokens = p;
    }
    if let Some(c) = u.completion_tokens {
        r.record.output_tokens = c;
    }
    if let Some(c) = u
        .prompt_tokens_details
        .as_ref()
        .and_then(|d| d.cached_tokens)
    {
        r.record.cached_tokens = Some(c);
    }
}

/// A failed exchange: the status to record and what happened.
pub(crate) type Failure = (Status, String);

pub(crate) fn transport(e: reqwest::Error) -> Failure {
    let kind = if e.is_connect() {
        Status::Connect
    } else if e.is_timeout() {
        Status::Timeout
    } else {
        Status::Failed
    };
    // The source chain says why (e.g. "Connection refused").
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    if kind == Status::Connect {
        msg.push_str("; is the server up and listening at the target address?");
    }
    (kind, msg)
}

/// Everything one exchange needs that is shared by all requests.
pub(crate) struct Exchange<'a> {
    pub client: &'a reqwest::Client,
    pub url: &'a str,
    pub key_header: &'a HeaderName,
    pub stream: bool,
    pub start: Instant,
    /// Keep the answer's text in the record (`answer`).
    pub keep_answer: bool,
}

impl Exchange<'_> {
    fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Send `body` and read the answer into `r` (times, tokens, destination). On success
    /// `finish_s` is set; on failure the caller records the status and the time.
    pub async fn run(&self, body: Vec<u8>, key: &str, r: &mut ReplayRecord) -> Result<(), Failure> {
        let key_value = HeaderValue::from_bytes(key.as_bytes()).map_err(|_| {
            (
                Status::Failed,
                format!("key {key:?} is not a valid HTTP header value; use printable keys"),
            )
        })?;
        let resp = self
            .client
            .post(self.url)
            .header(CONTENT_TYPE, "application/json")
            .header(self.key_header.clone(), key_value)
            .body(body)
            .send()
            .await
            .map_err(transport)?;
        r.set_destination(
            resp.headers()
                .get("x-cacheroute-destination")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
        );
        let status = resp.status();
        if !status.is_success() {
            let text = resp.bytes().await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text[..text.len().min(300)]).into_owned();
            return Err((Status::Http(status.as_u16()), text));
        }
        if !self.stream {
            let bytes = resp.bytes().await.map_err(transport)?;
            let now = self.now_s();
            let b: Body = serde_json::from_slice(&bytes).map_err(|e| bad_json(&bytes, e))?;
            r.record.first_token_s = Some(now);
            r.record.finish_s = Some(now);
            if self.keep_answer {
                let mut a = String::new();
                b.push_text(&mut a);
                r.answer = Some(a);
            }
            if let Some(u) = &b.usage {
                apply_usage(r, u);
            }
            return Ok(());
        }
        let mut events = eventsource_stream::Eventsource::eventsource(resp.bytes_stream());
        let (mut chunks, mut last, mut usage_seen) = (0u32, 0.0f64, false);
        let mut answer = self.keep_answer.then(String::new);
        while let Some(ev) = events.next().await {
            let ev = ev.map_err(|e| match e {
                eventsource_stream::EventStreamError::Transport(t) => transport(t),
                other => (Status::Failed, format!("reading the SSE stream: {other}")),
            })?;
            let now = self.now_s();
            let data = ev.data.trim();
            if data == "[DONE]" {
                break;
            }
            if data.is_empty() {
                continue;
            }
            let b: Body = serde_json::from_str(data).map_err(|e| bad_json(data.as_bytes(), e))?;
            if let Some(u) = &b.usage {
                apply_usage(r, u);
                usage_seen = true;
            }
            if let Some(a) = answer.as_mut() {
                b.push_text(a);
            }
            if b.has_content() {
                match r.record.first_token_s {
                    None => r.record.first_token_s = Some(now),
                    Some(_) => {
                        let g = now - last;
                        r.max_itl_s = Some(r.max_itl_s.map_or(g, |m: f64| m.max(g)));
                        r.gaps.push(g as f32);
                    }
                }
                last = now;
                chunks += 1;
            }
        }
        r.record.finish_s = Some(self.now_s());
        r.answer = answer;
        if !usage_seen {
            r.record.output_tokens = chunks;
        }
        Ok(())
    }
}

fn bad_json(bytes: &[u8], e: serde_json::Error) -> Failure {
    let head = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
    (
        Status::Failed,
        format!("response is not OpenAI-style JSON ({e}): {head:?}; is --target an OpenAI-compatible endpoint?"),
    )
}
