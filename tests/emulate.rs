//! The engine emulator over real HTTP on loopback: cache hits and their effect on TTFT,
//! vLLM's metric definitions, SSE framing, response shapes, concurrency, prefix-cache reset,
//! errors, the time scale, and the `cacheroute emulate` command.
//!
//! Timing assertions are one-sided bounds with wide margins (real time can only be slower than
//! the model's virtual time divided by the scale), so a loaded machine does not make them flaky.

use std::time::{Duration, Instant};

use cacheroute::emulate::{self, EmulatorConfig, EmulatorHandle, TimeScale};
use cacheroute::engine::{EngineEvent, EngineRequest, KnobOverrides, Replica};
use cacheroute::workload::text::{count_tokens, text_block_hashes};
use serde_json::{json, Value};

const TINY: &str = "tiny:cpu:bf16:tp1";
const GPU8B: &str = "llama-3.1-8b:h100:fp8:tp1";

async fn start(engine: &str, scale: f64, o: KnobOverrides) -> EmulatorHandle {
    let mut cfg = EmulatorConfig::new(engine);
    cfg.time_scale = TimeScale::new(scale).unwrap();
    cfg.overrides = o;
    cfg.model_name = Some("tiny-llama".into());
    emulate::start(cfg).await.expect("emulator starts")
}

/// `n` words; `tag` makes distinct prompts.
fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn post(c: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    let bytes = r.bytes().await.expect("body");
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("JSON body ({e}): {}", String::from_utf8_lossy(&bytes)));
    (status, v)
}

async fn complete(c: &reqwest::Client, h: &EmulatorHandle, prompt: &str, max: u32) -> Value {
    let (s, v) = post(
        c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": max}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    v
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens")
}

/// A streamed response: the time to the first token chunk, the total time, the SSE events.
struct Streamed {
    ttft: Duration,
    total: Duration,
    events: Vec<String>,
    content_type: String,
}

async fn stream(c: &reqwest::Client, url: &str, body: &Value) -> Streamed {
    let t0 = Instant::now();
    let mut r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("request sent");
    assert_eq!(r.status().as_u16(), 200);
    let content_type = r.headers()["content-type"].to_str().unwrap().to_string();
    let mut raw = String::new();
    let mut ttft = None;
    while let Some(chunk) = r.chunk().await.expect("stream chunk") {
        raw.push_str(std::str::from_utf8(&chunk).unwrap());
        if ttft.is_none() && raw.contains("\"finish_reason\"") && has_token(&raw) {
            ttft = Some(t0.elapsed());
        }
    }
    let total = t0.elapsed();
    assert!(
        raw.ends_with("\n\n"),
        "SSE body ends with a blank line: {raw:?}"
    );
    let events = raw
        .trim_end_matches("\n\n")
        .split("\n\n")
        .map(str::to_string)
        .collect();
    Streamed {
        ttft: ttft.unwrap_or(total),
        total,
        events,
        content_type,
    }
}

/// Whether an SSE body so far holds a chunk with generated text.
fn has_token(raw: &str) -> bool {
    raw.split("\n\n").any(|e| {
        e.strip_prefix("data: ")
            .and_then(|j| serde_json::from_str::<Value>(j).ok())
            .is_some_and(|v| {
                let c = &v["choices"][0];
                c["text"].as_str().is_some_and(|t| !t.is_empty())
                    || c["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
            })
    })
}

/// One sample of `/metrics` (first series of that name).
async fn metric(c: &reqwest::Client, h: &EmulatorHandle, name: &str) -> f64 {
    let body = c
        .get(format!("{}/metrics", h.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    body.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in /metrics:\n{body}"))
}

#[tokio::test]
async fn a_repeated_prompt_is_served_from_cache_with_a_shorter_ttft() {
    let h = start(TINY, 1.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let url = format!("{}/v1/completions", h.base_url());
    // 3,000 words on the tiny CPU model: the model's cold prefill is ~70 ms, the warm one
    // (2,992 tokens cached) a few ms.
    let prompt = words("p", 3000);
    let body = json!({"prompt": prompt, "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}});
    let cold = stream(&c, &url, &body).await;
    let warm = stream(&c, &url, &body).await;
    let usage = |s: &Streamed| {
        let last = s.events[s.events.len() - 2].strip_prefix("data: ").unwrap();
        serde_json::from_str::<Value>(last).unwrap()
    };
    assert_eq!(cached(&usage(&cold)), 0);
    // Whole 16-token blocks, the last prompt token always recomputed.
    assert_eq!(cached(&usage(&warm)), 2992);
    let cfg = h.engine_config();
    let model_cold = cfg.prefill_time(3000, 0);
    assert!(
        cold.ttft.as_secs_f64() >= model_cold * 0.99,
        "cold TTFT {:?} is at least the model's {model_cold:.3} s",
        cold.ttft
    );
    assert!(
        warm.ttft < cold.ttft / 2,
        "warm TTFT {:?} well under cold {:?}",
        warm.ttft,
        cold.ttft
    );
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_move_like_vllm_counters() {
    let h = start(GPU8B, 10.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let q0 = metric(&c, &h, "vllm:prefix_cache_queries_total").await;
    let k0 = metric(&c, &h, "vllm:prefix_cache_hits_total").await;
    let t0 = metric(&c, &h, "vllm:time_to_first_token_seconds_count").await;
    let (a, b) = (words("a", 1000), words("b", 517));
    let mut hits = 0;
    for p in [&a, &b, &a, &b, &a] {
        let v = complete(&c, &h, p, 3).await;
        assert_eq!(v["usage"]["prompt_tokens"], count_tokens(p));
        hits += cached(&v);
    }
    assert_eq!(hits, 992 * 2 + 512);
    let q1 = metric(&c, &h, "vllm:prefix_cache_queries_total").await;
    let k1 = metric(&c, &h, "vllm:prefix_cache_hits_total").await;
    assert_eq!(
        q1 - q0,
        (3 * 1000 + 2 * 517) as f64,
        "queries += prompt tokens"
    );
    assert_eq!(k1 - k0, hits as f64, "hits += cached tokens");
    assert_eq!(
        metric(&c, &h, "vllm:time_to_first_token_seconds_count").await - t0,
        5.0
    );
    assert_eq!(
        metric(&c, &h, "vllm:prompt_tokens_cached_total").await,
        hits as f64
    );
    assert_eq!(metric(&c, &h, "vllm:generation_tokens_total").await, 15.0);
    assert_eq!(metric(&c, &h, "vllm:num_requests_running").await, 0.0);
    assert_eq!(metric(&c, &h, "vllm:num_requests_waiting").await, 0.0);
    // Idle: no block is held by a running request, even with prefixes cached (vLLM's meaning).
    assert_eq!(metric(&c, &h, "vllm:kv_cache_usage_perc").await, 0.0);
    let body = c
        .get(format!("{}/metrics", h.base_url()))
        .send()
        .await
        .unwrap();
    assert!(body.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = body.text().await.unwrap();
    for needle in [
        "# TYPE vllm:prefix_cache_queries_total counter",
        "vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"tiny-llama\"}",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"tiny-llama\",le=\"+Inf\"} 5.0",
        "vllm:cache_config_info{block_size=\"16\",",
        "# TYPE vllm:num_requests_running gauge",
    ] {
        assert!(text.contains(needle), "{needle} in\n{text}");
    }
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn streams_use_vllm_sse_framing() {
    let h = start(GPU8B, 10.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    // Completions, with the usage chunk.
    let s = stream(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": words("s", 300), "max_tokens": 7, "stream": true,
                "ignore_eos": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert!(s.content_type.starts_with("text/event-stream"));
    assert_eq!(s.events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = s.events[..s.events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").expect("data: prefix")).unwrap())
        .collect();
    assert_eq!(chunks.len(), 7 + 1, "one chunk per token, then usage");
    let mut text = String::new();
    for (i, ch) in chunks[..7].iter().enumerate() {
        assert_eq!(ch["object"], "text_completion");
        assert_eq!(ch["model"], "tiny-llama");
        assert!(ch["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(ch["id"], chunks[0]["id"]);
        let fr = &ch["choices"][0]["finish_reason"];
        assert_eq!(*fr, if i == 6 { json!("length") } else { Value::Null });
        text.push_str(ch["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(count_tokens(&text), 7);
    let u = &chunks[7];
    assert_eq!(u["choices"], json!([]));
    assert_eq!(u["usage"]["prompt_tokens"], 300);
    assert_eq!(u["usage"]["completion_tokens"], 7);
    assert_eq!(u["usage"]["total_tokens"], 307);
    assert!(s.total >= s.ttft);

    // Chat, without usage: role chunk first, then one delta per token.
    let s = stream(
        &c,
        &format!("{}/v1/chat/completions", h.base_url()),
        &json!({"messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
                "max_tokens": 5, "stream": true}),
    )
    .await;
    assert_eq!(s.events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = s.events[..s.events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks.len(), 1 + 5);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c.get("usage").is_none()));
    let content: String = chunks[1..]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(count_tokens(&content), 5);
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn non_streaming_responses_have_vllm_shapes() {
    let h = start(GPU8B, 10.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let v = complete(&c, &h, &words("n", 40), 6).await;
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        count_tokens(v["choices"][0]["text"].as_str().unwrap()),
        6,
        "output length = max_tokens"
    );
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // The same text as one chat message costs the same tokens and hits the same cache.
    let (s, v) = post(
        &c,
        &format!("{}/v1/chat/completions", h.base_url()),
        &json!({"messages": [{"role": "user", "content": words("n", 40)}],
                "max_completion_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        count_tokens(v["choices"][0]["message"]["content"].as_str().unwrap()),
        3
    );
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    assert_eq!(cached(&v), 32);
    // Token-id prompts and a list of one string.
    let (s, v) = post(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": [[1, 2, 3, 4]], "max_tokens": 1}),
    )
    .await;
    assert_eq!((s, v["usage"]["prompt_tokens"].clone()), (200, json!(4)));
    let (s, v) = post(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": ["x y z"]}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["usage"]["completion_tokens"], 16, "default max_tokens");
    // Other routes.
    let m: Value = serde_json::from_str(
        &c.get(format!("{}/v1/models", h.base_url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(m["data"][0]["id"], "tiny-llama");
    let health = c
        .get(format!("{}/health", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn many_concurrent_requests_all_complete() {
    // Few seats and a small cache, so requests queue and the cache evicts.
    let o = KnobOverrides {
        max_num_seqs: Some(8),
        kv_cache_bytes: Some(20_000.0 * 65_536.0),
        ..Default::default()
    };
    let h = start(GPU8B, 20.0, o).await;
    let c = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..64u32 {
        let (c, url) = (c.clone(), format!("{}/v1/completions", h.base_url()));
        tasks.push(tokio::spawn(async move {
            let prompt = format!("{} {}", words(&format!("k{}", i % 4), 512), words("u", 64));
            let body = json!({"prompt": prompt, "max_tokens": 20 + i % 5, "stream": i % 2 == 0,
                             "stream_options": {"include_usage": true}});
            if i % 2 == 0 {
                let s = stream(&c, &url, &body).await;
                assert_eq!(s.events.last().unwrap(), "data: [DONE]");
                assert_eq!(s.events.len() as u32, 20 + i % 5 + 2);
            } else {
                let (s, v) = post(&c, &url, &body).await;
                assert_eq!(s, 200, "{v}");
                assert_eq!(v["usage"]["completion_tokens"], 20 + i % 5);
            }
        }));
    }
    for t in tasks {
        t.await.expect("request task");
    }
    assert_eq!(metric(&c, &h, "vllm:request_success_total").await, 64.0);
    assert_eq!(metric(&c, &h, "vllm:num_requests_running").await, 0.0);
    assert_eq!(metric(&c, &h, "vllm:num_requests_waiting").await, 0.0);
    assert!(metric(&c, &h, "vllm:prefix_cache_hits_total").await > 0.0);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn reset_prefix_cache_empties_the_cache() {
    let h = start(GPU8B, 10.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let p = words("r", 200);
    complete(&c, &h, &p, 2).await;
    assert_eq!(cached(&complete(&c, &h, &p, 2).await), 192);
    let r = c
        .post(format!("{}/reset_prefix_cache", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(cached(&complete(&c, &h, &p, 2).await), 0);
    assert_eq!(cached(&complete(&c, &h, &p, 2).await), 192);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_input_gets_a_400_json_error() {
    let o = KnobOverrides {
        kv_cache_bytes: Some(1000.0 * 65_536.0),
        ..Default::default()
    };
    let h = start(GPU8B, 10.0, o).await;
    let c = reqwest::Client::new();
    let comp = format!("{}/v1/completions", h.base_url());
    let chat = format!("{}/v1/chat/completions", h.base_url());
    let cases: Vec<(&str, String)> = vec![
        (&comp, "{not json".into()),
        (&comp, "[1]".into()),
        (&comp, json!({"max_tokens": 3}).to_string()),
        (&comp, json!({"prompt": 7}).to_string()),
        (&comp, json!({"prompt": ["a", "b"]}).to_string()),
        (&comp, json!({"prompt": "   "}).to_string()),
        (&comp, json!({"prompt": "a", "max_tokens": 0}).to_string()),
        (
            &comp,
            json!({"prompt": "a", "max_tokens": "many"}).to_string(),
        ),
        (&comp, json!({"prompt": "a", "n": 2}).to_string()),
        (&comp, json!({"prompt": "a", "stream": "yes"}).to_string()),
        (&comp, json!({"prompt": words("big", 1200)}).to_string()),
        (&chat, json!({"messages": []}).to_string()),
        (&chat, json!({"messages": [{"content": "hi"}]}).to_string()),
        (
            &chat,
            json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
        ),
    ];
    for (url, body) in cases {
        let r = c
            .post(url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{body}");
        let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError", "{body}: {v}");
        assert_eq!(v["error"]["code"], 400);
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
    }
    // A model it does not serve: 404, like vLLM.
    let (s, v) = post(&c, &comp, &json!({"model": "other", "prompt": "a"})).await;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["param"], "model");
    // The engine is still fine.
    complete(&c, &h, "still here", 1).await;
    h.shutdown().await.unwrap();
}

/// The engine model's end-to-end time for one request on an idle replica.
fn model_e2e(h: &EmulatorHandle, prompt: &str, output: u32) -> f64 {
    let mut r = Replica::new(h.engine_config().clone());
    let req = EngineRequest {
        id: 0,
        prompt_tokens: count_tokens(prompt),
        output_tokens: output,
        block_hashes: text_block_hashes(prompt, 16),
    };
    r.submit(req, 0.0).unwrap();
    let mut ev = Vec::new();
    while let Some(t) = r.next_event_time() {
        r.advance(t, &mut ev);
    }
    match ev.last() {
        Some(EngineEvent::Finished { stats, .. }) => stats.e2e_s,
        other => panic!("finished, got {other:?}"),
    }
}

#[tokio::test]
async fn a_larger_time_scale_runs_faster() {
    let prompt = words("t", 500);
    let c = reqwest::Client::new();
    let mut took = Vec::new();
    let mut model = 0.0;
    for scale in [1.0, 20.0] {
        let h = start(GPU8B, scale, KnobOverrides::default()).await;
        model = model_e2e(&h, &prompt, 250);
        let t0 = Instant::now();
        complete(&c, &h, &prompt, 250).await;
        took.push(t0.elapsed().as_secs_f64());
        h.shutdown().await.unwrap();
    }
    assert!(model > 1.0, "the request takes {model:.2} s of model time");
    assert!(
        took[0] >= model * 0.99,
        "real time {:.3} s ≥ model {model:.3} s",
        took[0]
    );
    assert!(
        took[1] < model / 2.0,
        "×20: {:.3} s < half the model's {model:.3} s",
        took[1]
    );
}

/// Its stdout after the first line (kept open: the emulator still writes there).
type Stdout = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// `cacheroute emulate` on a free port (TINY, model `tiny-llama`) with `extra` flags: the
/// child, the URL from its first stdout line (which must be `listening on URL`) and the rest of
/// its stdout.
async fn spawn_emulator(extra: &[&str]) -> (tokio::process::Child, String, Stdout) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["emulate", "--listen", "127.0.0.1:0", "--engine", TINY])
        .args(["--model-name", "tiny-llama"])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("cacheroute emulate starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("first line within 30 s")
        .unwrap()
        .expect("a first line");
    let url = first
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("first line: {first}"))
        .to_string();
    (child, url, lines)
}

#[tokio::test]
async fn the_command_prints_its_address_first_and_serves() {
    let (mut child, url, _stdout) = spawn_emulator(&["--time-scale", "5"]).await;
    assert!(url.starts_with("http://127.0.0.1:"));
    let c = reqwest::Client::new();
    let r = c.get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let (s, v) = post(
        &c,
        &format!("{url}/v1/completions"),
        &json!({"model": "tiny-llama", "prompt": "hello world", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    child.kill().await.unwrap();
}

#[tokio::test]
async fn invalid_settings_are_reported() {
    // A time scale out of range cannot be made: refused where it is read, naming the field.
    let e = TimeScale::new(0.0).unwrap_err();
    assert!(
        e.starts_with("time_scale: 0 is outside the allowed range"),
        "{e}"
    );
    let mut cfg = EmulatorConfig::new("llama-3.1-8b:h100:fp8:tp1");
    cfg.frontend_delay_s = -1.0;
    cfg.block_tokens = 0;
    let e = emulate::start(cfg).await.unwrap_err().to_string();
    assert!(
        e.contains("frontend_delay_s") && e.contains("block_tokens"),
        "{e}"
    );
    let e = emulate::start(EmulatorConfig::new("llama-3.1-8b:a100:fp8:tp1"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("a100"), "{e}");
}

#[tokio::test]
async fn tokens_stream_at_the_decode_cadence() {
    let h = start(GPU8B, 1.0, KnobOverrides::default()).await;
    let cfg = h.engine_config().clone();
    let c = reqwest::Client::new();
    let body = json!({"prompt": words("c", 100), "max_tokens": 100, "stream": true});
    let t0 = Instant::now();
    let mut r = c
        .post(format!("{}/v1/completions", h.base_url()))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let (mut raw, mut at_half) = (String::new(), None);
    while let Some(chunk) = r.chunk().await.unwrap() {
        raw.push_str(std::str::from_utf8(&chunk).unwrap());
        if at_half.is_none() && raw.matches("\"text\"").count() >= 50 {
            at_half = Some(t0.elapsed().as_secs_f64());
        }
    }
    let end = t0.elapsed().as_secs_f64();
    let at_half = at_half.expect("50 tokens");
    // Token 50 comes no earlier than the model allows (TTFT + 49 decode steps)…
    let step = cfg.decode_step_time(1, 100);
    let earliest = cfg.prefill_time(100, 0) + 49.0 * step;
    assert!(at_half >= earliest * 0.99, "{at_half:.3} ≥ {earliest:.3}");
    // …and well before the last one (≈ 50 steps later): tokens are not bunched at the end.
    assert!(
        end - at_half > 15.0 * step,
        "token 50 at {at_half:.3} s, end at {end:.3} s, step {step:.4} s"
    );
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_frontend_delay_comes_before_the_engine() {
    let mut cfg = EmulatorConfig::new(GPU8B);
    cfg.frontend_delay_s = 0.3;
    cfg.time_scale = TimeScale::new(2.0).unwrap();
    let h = emulate::start(cfg).await.unwrap();
    let c = reqwest::Client::new();
    let t0 = Instant::now();
    let (s, _) = post(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": "one", "max_tokens": 1}),
    )
    .await;
    assert_eq!(s, 200);
    assert!(t0.elapsed() >= Duration::from_millis(150), "0.3 s at ×2");
    // The TTFT histogram counts from the request's arrival, delay included.
    let ttft_sum = metric(&c, &h, "vllm:time_to_first_token_seconds_sum").await;
    assert!(ttft_sum >= 0.15, "{ttft_sum}");
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_ends_open_streams_with_an_error_chunk() {
    let h = start(GPU8B, 1.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let mut r = c
        .post(format!("{}/v1/completions", h.base_url()))
        .body(json!({"prompt": "long one", "max_tokens": 5000, "stream": true}).to_string())
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    let reader = tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(ch)) = r.chunk().await {
            rest.push_str(std::str::from_utf8(&ch).unwrap());
        }
        rest
    });
    tokio::time::timeout(Duration::from_secs(10), h.shutdown())
        .await
        .expect("shutdown within 10 s (the model needs ~40 s for 5,000 tokens)")
        .unwrap();
    let rest = reader.await.unwrap();
    assert!(rest.contains("\"ServiceUnavailableError\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn preempted_requests_still_deliver_every_token() {
    // 16 requests that together need ~4,800 KV tokens on a 1,500-token cache: the engine
    // preempts (recompute) and every request still completes with all its tokens.
    let o = KnobOverrides {
        kv_cache_bytes: Some(1_500.0 * 65_536.0),
        ..Default::default()
    };
    let h = start(GPU8B, 20.0, o).await;
    let c = reqwest::Client::new();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (c, url) = (c.clone(), format!("{}/v1/completions", h.base_url()));
        tasks.push(tokio::spawn(async move {
            let body = json!({"prompt": words(&format!("q{i}x"), 100), "max_tokens": 200,
                              "stream": true});
            let s = stream(&c, &url, &body).await;
            assert_eq!(s.events.last().unwrap(), "data: [DONE]");
            let text: String = s.events[..s.events.len() - 1]
                .iter()
                .map(|e| {
                    let v: Value = serde_json::from_str(&e[6..]).unwrap();
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                })
                .collect();
            assert_eq!(count_tokens(&text), 200);
        }));
    }
    for t in tasks {
        t.await.expect("request task");
    }
    assert!(metric(&c, &h, "vllm:num_preemptions_total").await > 0.0);
    assert_eq!(metric(&c, &h, "vllm:request_success_total").await, 16.0);
    h.shutdown().await.unwrap();
}

/// Idle and trickling clients are closed at the head and body deadlines (the router's
/// limits), and connections past the cap get a 503: nothing a slow client does holds the
/// emulator open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_clients_are_cut_at_the_deadlines() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut cfg = EmulatorConfig::new(TINY);
    cfg.head_timeout = Duration::from_millis(600);
    cfg.body_timeout = Duration::from_millis(600);
    cfg.max_connections = 12;
    let h = emulate::start(cfg).await.unwrap();
    let mut conns = Vec::new();
    for i in 0..10 {
        let mut s = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
        if i % 2 == 1 {
            // A head, then a body that never finishes.
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n{")
                .await
                .unwrap();
        } else if i % 4 == 0 {
            // Half a head.
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        conns.push(s);
    }
    // Past the cap (10 open + these 2 fill it; the third is refused).
    let _a = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let _b = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut over = tokio::net::TcpStream::connect(h.addr()).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), over.read_to_end(&mut got)).await;
    let got = String::from_utf8_lossy(&got);
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    // Every slow connection is closed within a few seconds (trickling ones after a 408).
    let t0 = Instant::now();
    for (i, mut s) in conns.into_iter().enumerate() {
        let mut buf = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                // Keep trickling: one byte every 200 ms keeps each read alive.
                if i % 2 == 1 {
                    let _ = s.write_all(b" ").await;
                }
                let mut chunk = [0u8; 1024];
                match tokio::time::timeout(Duration::from_millis(200), s.read(&mut chunk)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return,
                    Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
                    Err(_) => {}
                }
            }
        })
        .await;
        assert!(r.is_ok(), "connection {i} still open after 5 s");
        if i % 2 == 1 {
            let text = String::from_utf8_lossy(&buf);
            assert!(text.starts_with("HTTP/1.1 408"), "connection {i}: {text}");
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(20));
    h.shutdown().await.unwrap();
}

/// `cacheroute emulate --api sglang` over HTTP: SGLang's routes (health 503 while starting,
/// `/flush_cache` refused while a request runs, then accepted), `usage` without details until
/// a prompt token is cached, and the request counters appearing only after the first request
/// (`sglang:cached_tokens_total` only after the first hit).
#[tokio::test]
async fn the_sglang_dialect_serves_sglangs_routes_metrics_and_usage() {
    let mut cfg = EmulatorConfig::new(GPU8B);
    cfg.time_scale = TimeScale::REAL;
    cfg.model_name = Some("tiny-llama".into());
    cfg.api = emulate::EngineApi::Sglang;
    cfg.startup_s = 0.4;
    let h = emulate::start(cfg).await.expect("emulator starts");
    let c = reqwest::Client::new();
    let get = |path: &str| c.get(format!("{}{path}", h.base_url())).send();
    // Starting: SGLang answers 503 on both health routes until its warm-up is done.
    assert_eq!(get("/health").await.unwrap().status().as_u16(), 503);
    assert_eq!(
        get("/health_generate").await.unwrap().status().as_u16(),
        503
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(get("/health").await.unwrap().status().as_u16(), 200);
    assert_eq!(
        get("/health_generate").await.unwrap().status().as_u16(),
        200
    );
    // vLLM's routes are not SGLang's.
    let r = c
        .post(format!("{}/reset_prefix_cache", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    let info: Value =
        serde_json::from_str(&get("/get_server_info").await.unwrap().text().await.unwrap())
            .unwrap();
    assert_eq!(info["served_model_name"], "tiny-llama");
    assert!(info["max_total_num_tokens"].as_u64().unwrap() > 0, "{info}");
    // Fresh: no request counters at all (they have no series before a request finished).
    let text = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(!text.contains("sglang:prompt_tokens_total"), "{text}");
    assert!(!text.contains("sglang:cached_tokens_total"), "{text}");
    assert!(
        text.contains("# TYPE sglang:cache_hit_rate gauge"),
        "{text}"
    );
    assert!(!text.contains("vllm:"), "{text}");
    // A first request: nothing cached, so no prompt_tokens_details (SGLang sends null).
    let p = words("s", 200);
    let v = complete(&c, &h, &p, 2).await;
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    let text = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        text.contains("sglang:prompt_tokens_total{model_name=\"tiny-llama\"} 200.0"),
        "{text}"
    );
    assert!(!text.contains("sglang:cached_tokens_total"), "{text}");
    // The same prompt again: cached tokens reported, and the counter appears.
    let v = complete(&c, &h, &p, 2).await;
    assert_eq!(cached(&v), 192, "{v}");
    let text = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        text.contains(
            "sglang:cached_tokens_total{cache_source=\"device\",model_name=\"tiny-llama\"} 192.0"
        ),
        "{text}"
    );
    // A flush while a request runs is refused with 400…
    let long = {
        let c = c.clone();
        let url = format!("{}/v1/completions", h.base_url());
        tokio::spawn(async move {
            let body =
                json!({"model": "tiny-llama", "prompt": words("busy", 50), "max_tokens": 200});
            c.post(url)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = c
        .post(format!("{}/flush_cache", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let why = r.text().await.unwrap();
    assert!(why.contains("#running-req: 1"), "{why}");
    // …and accepted with a timeout long enough for it to finish (GET works as well).
    let t0 = Instant::now();
    let r = get("/flush_cache?timeout=30").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().await.unwrap().starts_with("Cache flushed."));
    assert!(t0.elapsed() > Duration::from_millis(100), "it waited");
    assert_eq!(long.await.unwrap(), 200);
    // The cache is empty: the prompt is not a hit any more; counters are cumulative.
    let v = complete(&c, &h, &p, 2).await;
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    assert_eq!(metric(&c, &h, "sglang:cached_tokens_total").await, 192.0);
    assert_eq!(
        get("/flush_cache?timeout=-1")
            .await
            .unwrap()
            .status()
            .as_u16(),
        400
    );
    h.shutdown().await.unwrap();
}

/// The render endpoints of `vllm serve --enable-scale-out`: a prompt's token ids, one per word,
/// equal leading words giving equal leading ids (what the vLLM router's `cache_aware` routes
/// by); a completion renders as a list of one, a chat as one object; the same checks of the
/// request as generation (an unknown model is a 404).
#[tokio::test]
async fn render_endpoints_give_token_ids_that_share_a_prefix_like_the_text() {
    let h = start(GPU8B, 100.0, KnobOverrides::default()).await;
    let c = reqwest::Client::new();
    let url = format!("{}/v1/completions/render", h.base_url());
    let body = |p: &str| json!({"model": "tiny-llama", "prompt": p, "max_tokens": 4});
    let a = format!("{} {}", words("sys", 40), words("a", 8));
    let b = format!("{} {}", words("sys", 40), words("b", 8));
    let (s, ra) = post(&c, &url, &body(&a)).await;
    assert_eq!(s, 200, "{ra}");
    let (_, rb) = post(&c, &url, &body(&b)).await;
    let ids = |v: &Value| -> Vec<u64> {
        v[0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let (ia, ib) = (ids(&ra), ids(&rb));
    assert_eq!(ia.len(), 48);
    assert_eq!(ia[..40], ib[..40]);
    assert_ne!(ia[40..], ib[40..]);
    assert!(ia.iter().all(|&t| (1..=32_000).contains(&t)));
    assert_eq!(ra[0]["sampling_params"]["max_tokens"], 4);
    // Rendering is not generating: no request finished.
    assert_eq!(metric(&c, &h, "vllm:request_success_total").await, 0.0);
    // Chat: one object for the conversation.
    let (s, rc) = post(
        &c,
        &format!("{}/v1/chat/completions/render", h.base_url()),
        &json!({"model": "tiny-llama", "messages": [{"role": "user", "content": a}]}),
    )
    .await;
    assert_eq!(s, 200, "{rc}");
    assert_eq!(rc["token_ids"].as_array().unwrap().len(), 48);
    // The request is checked as for generation.
    let (s, e) = post(
        &c,
        &format!("{}/v1/completions/render", h.base_url()),
        &json!({"model": "other", "prompt": a}),
    )
    .await;
    assert_eq!(s, 404, "{e}");
    // Hostile bodies get generation's 400s, never an empty list of ids.
    for (body, param) in [
        (json!({"model": "tiny-llama", "prompt": "   "}), "prompt"),
        (json!({"model": "tiny-llama", "prompt": 7}), "prompt"),
        (json!({"model": "tiny-llama", "messages": []}), "messages"),
    ] {
        let path = if param == "messages" {
            "/v1/chat/completions/render"
        } else {
            "/v1/completions/render"
        };
        let (s, e) = post(&c, &format!("{}{path}", h.base_url()), &body).await;
        assert_eq!(
            (s, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {e}"
        );
    }
    let r = c
        .post(format!("{}/v1/completions/render", h.base_url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn read_log(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("request log written")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("JSON line ({e}): {l}")))
        .collect()
}

#[tokio::test]
async fn the_request_log_has_one_line_per_request_with_ordered_server_times() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut cfg = EmulatorConfig::new(GPU8B);
    cfg.model_name = Some("tiny-llama".into());
    cfg.request_log = Some(path.clone());
    let h = emulate::start(cfg).await.expect("emulator starts");
    let c = reqwest::Client::new();
    let before = unix_now();
    // Three whole answers, two streamed ones, one refused; routes that generate nothing are
    // not logged.
    for i in 0..3 {
        complete(&c, &h, &words(&format!("w{i}"), 40), 4).await;
    }
    let s1 = stream(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": words("s", 64), "max_tokens": 30, "stream": true}),
    )
    .await;
    let s2 = stream(
        &c,
        &format!("{}/v1/chat/completions", h.base_url()),
        &json!({"messages": [{"role": "user", "content": words("t", 64)}], "max_tokens": 30,
                "stream": true}),
    )
    .await;
    let (status, _) = post(
        &c,
        &format!("{}/v1/completions", h.base_url()),
        &json!({"prompt": "", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 400);
    let r = c.get(format!("{}/v1/models", h.base_url())).send().await;
    assert_eq!(r.unwrap().status().as_u16(), 200);
    let after = unix_now();
    h.shutdown().await.expect("clean shutdown");

    let lines = read_log(&path);
    assert_eq!(
        lines.len(),
        6,
        "one line per generation request: {lines:#?}"
    );
    for l in &lines {
        let arrival = l["arrival_s"].as_f64().unwrap();
        let end = l["end_s"].as_f64().unwrap();
        assert!(before <= arrival && arrival <= end && end <= after, "{l}");
        assert_eq!(l["complete"], true, "{l}");
        if l["status"] == 200 {
            let first = l["first_token_s"].as_f64().unwrap();
            assert!(arrival <= first && first <= end, "{l}");
        } else {
            assert_eq!(l["status"], 400, "{l}");
            assert!(l["first_token_s"].is_null(), "{l}");
        }
    }
    let whole: Vec<_> = lines.iter().filter(|l| l["stream"] == false).collect();
    assert_eq!(whole.len(), 4);
    assert!(whole
        .iter()
        .filter(|l| l["status"] == 200)
        .all(|l| l["prompt_tokens"] == 40 && l["output_tokens"] == 4));
    let streamed: Vec<_> = lines.iter().filter(|l| l["stream"] == true).collect();
    assert_eq!(streamed.len(), 2);
    assert_eq!(streamed[0]["path"], "/v1/completions");
    assert_eq!(streamed[1]["path"], "/v1/chat/completions");
    for (l, s) in streamed.iter().zip([&s1, &s2]) {
        assert_eq!(l["output_tokens"], 30);
        let arrival = l["arrival_s"].as_f64().unwrap();
        let ttft = l["first_token_s"].as_f64().unwrap() - arrival;
        let e2e = l["end_s"].as_f64().unwrap() - arrival;
        // 29 decode steps of an 8B model lie between the first token and the last.
        assert!(e2e - ttft > 0.01, "first token before the end: {l}");
        // The server's view is inside the client's (which adds the network and parsing).
        assert!(ttft <= s.ttft.as_secs_f64() + 0.002, "{l} vs {:?}", s.ttft);
        assert!(e2e <= s.total.as_secs_f64() + 0.002, "{l} vs {:?}", s.total);
    }
}

#[tokio::test]
async fn the_command_writes_its_request_log_and_refuses_an_unwritable_one() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("no-such-dir").join("requests.jsonl");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args(["emulate", "--listen", "127.0.0.1:0", "--engine", TINY])
        .arg("--request-log")
        .arg(&bad)
        .output()
        .await
        .expect("cacheroute emulate runs");
    assert!(
        !out.status.success(),
        "an unwritable request log is refused"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let first = err.lines().next().unwrap_or_default();
    assert!(
        first.contains("--request-log") && first.contains(&bad.display().to_string()),
        "one line naming the flag and the path: {err}"
    );

    let path = dir.path().join("requests.jsonl");
    let (mut child, url, _stdout) = spawn_emulator(&[
        "--time-scale",
        "20",
        "--request-log",
        path.to_str().unwrap(),
    ])
    .await;
    let c = reqwest::Client::new();
    for i in 0..4 {
        let body = json!({"prompt": words(&format!("c{i}"), 10), "max_tokens": 3,
                          "stream": i % 2 == 0});
        let r = c
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.text().await.unwrap();
    }
    // SIGTERM: the log is flushed on the way out.
    let pid = child.id().expect("running") as i32;
    // SAFETY: kill(2) on our own, not yet reaped, child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("stops within 30 s")
        .unwrap();
    assert!(status.success());
    let logged = read_log(&path);
    assert_eq!(logged.len(), 4, "{logged:#?}");
    assert_eq!(logged.iter().filter(|l| l["stream"] == true).count(), 2);
}
