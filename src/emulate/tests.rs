//! Unit tests of the emulator: agreement with the simulator on prefix-cache hits, metric text
//! details, prompt conventions.

use serde_json::{json, Value};

use super::*;
use crate::policy::PolicySpec;
use crate::sim::{simulate, SimConfig};
use crate::workload::text::prompt_text;
use crate::workload::trace::TraceRecord;

/// A trace with shared system prompts per key, multi-turn growth and unique tails, every full
/// 16-token block named by an id (as in Mooncake-style traces).
fn trace() -> Vec<TraceRecord> {
    let mut out = Vec::new();
    for i in 0..48u64 {
        let key = crate::rng::mix64(i) % 6;
        let shared_blocks = 8 + key * 4; // 128..320 tokens of system prompt
        let turn = i / 6;
        let mut ids: Vec<u64> = (0..shared_blocks).map(|j| key * 1000 + j).collect();
        // Conversation history of this key grows with the turn.
        ids.extend((0..turn * 2).map(|j| 500_000 + key * 1000 + j));
        // A unique tail.
        ids.extend((0..3).map(|j| 9_000_000 + i * 10 + j));
        let input_length = ids.len() as u32 * 16 + 5; // plus a partial block
        out.push(TraceRecord {
            timestamp_ms: i as f64 * 100_000.0,
            key: format!("k{key}"),
            input_length,
            output_length: 3 + (i % 4) as u32,
            hash_ids: ids,
            session: None,
            turn: None,
        });
    }
    out
}

#[tokio::test]
async fn emulator_and_simulator_agree_on_cached_tokens() {
    // A cache of 2,000 tokens, so LRU eviction decides some of the hits.
    let overrides = KnobOverrides {
        kv_cache_bytes: Some(2_000.0 * 65_536.0),
        ..Default::default()
    };
    let spec = "llama-3.1-8b:h100:fp8:tp1";
    let recs = trace();

    let sim = simulate(
        SimConfig {
            destinations: 1,
            engine: crate::engine::engine_config(spec, 16, &overrides).unwrap(),
            policy: PolicySpec::FlatLb,
            seed: 1,
            failures: vec![],
            horizon_s: f64::INFINITY,
            warm_start: None,
            seed_first_window: false,
            router_replicas: 1,
        },
        recs.clone(),
    )
    .unwrap();
    let mut sim_records = sim.records.clone();
    sim_records.sort_by(|a, b| a.scheduled_s.total_cmp(&b.scheduled_s));
    let sim_cached: Vec<u64> = sim_records
        .iter()
        .map(|r| r.cached_tokens.unwrap_or(0) as u64)
        .collect();

    let mut cfg = EmulatorConfig::new(spec);
    cfg.overrides = overrides;
    cfg.time_scale = TimeScale::new(50.0).unwrap();
    let h = start(cfg).await.unwrap();
    assert_eq!(
        h.engine_config(),
        &crate::engine::engine_config(
            spec,
            16,
            &KnobOverrides {
                kv_cache_bytes: Some(2_000.0 * 65_536.0),
                block_size: Some(16),
                ..Default::default()
            }
        )
        .unwrap(),
        "the emulator runs the simulator's engine configuration"
    );
    let c = reqwest::Client::new();
    let mut emu_cached = Vec::new();
    for (i, r) in recs.iter().enumerate() {
        let prompt = prompt_text(&r.hash_ids, r.input_length, 16, i as u64);
        let body = json!({"prompt": prompt, "max_tokens": r.output_length});
        let resp = c
            .post(format!("{}/v1/completions", h.base_url()))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let v: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], r.input_length);
        emu_cached.push(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    h.shutdown().await.unwrap();

    assert_eq!(emu_cached, sim_cached);
    let hits: u64 = sim_cached.iter().sum();
    let d = &sim.destinations[0];
    assert_eq!(
        hits, d.cache_hit_tokens,
        "no preemption: first admissions only"
    );
    assert!(hits > 0, "the trace reuses prefixes");
    // Both outcomes occur for keys seen before: the prefix was reused, or LRU eviction (the
    // cache holds 2,000 tokens) had dropped some of it.
    let (mut reused, mut evicted) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for (&c, r) in sim_cached.iter().zip(&recs) {
        let key: u64 = r.key[1..].parse().unwrap();
        if !seen.insert(key) {
            if c >= (8 + key * 4) * 16 {
                reused += 1;
            } else {
                evicted += 1;
            }
        }
    }
    assert!(
        reused > 0 && evicted > 0,
        "reused {reused}, evicted {evicted}"
    );
}

#[test]
fn metric_text_uses_prometheus_number_forms_and_escapes_labels() {
    let cfg =
        crate::engine::engine_config("tiny:cpu:bf16:tp1", 16, &KnobOverrides::default()).unwrap();
    let info = metrics::MetricsInfo::new("a \"quoted\" name", &cfg);
    let mut m = metrics::MetricsState::default();
    m.ttft.observe(0.003);
    m.ttft.observe(100.0);
    let text = metrics::render(&info, &m);
    assert!(text.contains(r#"model_name="a \"quoted\" name""#), "{text}");
    assert!(text.contains("le=\"0.001\"} 0.0"));
    assert!(text.contains("le=\"0.005\"} 1.0"));
    assert!(text.contains("le=\"160.0\"} 2.0"));
    assert!(text.contains("le=\"+Inf\"} 2.0"));
    assert!(text.contains("vllm:time_to_first_token_seconds_sum{"));
    assert!(
        text.contains("block_size=\"128\""),
        "the tiny CPU card's block"
    );
}

#[test]
fn chat_prompt_is_the_contents_joined_by_newlines() {
    let m = json!({"messages": [
        {"role": "system", "content": "s1 s2"},
        {"role": "assistant", "content": null},
        {"role": "user", "content": [{"type": "text", "text": "u1"}, {"type": "text", "text": "u2"}]},
    ]});
    let p = api::chat_prompt(m.as_object().unwrap()).unwrap();
    assert_eq!(p, "s1 s2\nu1\nu2");
    assert_eq!(crate::workload::text::count_tokens(&p), 4);
}

#[test]
fn block_size_follows_block_tokens_unless_overridden() {
    let mut c = EmulatorConfig::new("tiny:cpu:bf16:tp1");
    c.block_tokens = 32;
    let e = c.engine_config().unwrap();
    assert_eq!(
        (e.knobs().block_size, e.knobs().hash_block_tokens),
        (32, 32)
    );
    c.overrides.block_size = Some(128);
    let e = c.engine_config().unwrap();
    assert_eq!((e.knobs().block_size, e.cache_unit_tokens()), (128, 128));
    assert_eq!(c.served_model_name(), "tiny");
}

/// The SGLang dialect's `/metrics` for a fixed state: two finished requests (2,000 prompt
/// tokens, 896 of them cached, 32 generated), one running, a quarter of the KV pool in use.
fn sglang_exposition() -> String {
    let cfg =
        crate::engine::engine_config("tiny:cpu:bf16:tp1", 16, &KnobOverrides::default()).unwrap();
    let info = metrics::MetricsInfo::new("cacheroute-model", &cfg);
    let mut m = metrics::MetricsState::for_api(EngineApi::Sglang);
    m.running = 1;
    m.kv_usage = 0.25;
    m.counters.cache_query_tokens = 3000;
    m.counters.cache_hit_tokens = 896;
    m.finished_prompt_tokens = 2000;
    m.generation_tokens = 32;
    m.cached_prompt_tokens = 896;
    m.success = 2;
    m.ttft.observe(0.05);
    m.ttft.observe(0.3);
    m.e2e.observe(0.5);
    m.e2e.observe(1.5);
    metrics::render_sglang(&info, &m)
}

/// Golden: names, types and labels as SGLang's `python/sglang/srt/metrics/collector.py`
/// defines them (SchedulerMetricsCollector gauges, TokenizerMetricsCollector counters with
/// `cached_tokens_total`'s `cache_source` label, its TTFT and e2e buckets), in the form its
/// multiprocess collector serves (see `docs/emulator.md`). Regenerate only after re-checking
/// against that file.
#[test]
fn golden_sglang_exposition() {
    let golden = include_str!("../../tests/data/sglang-collector-exposition.txt");
    let text = sglang_exposition();
    if text != golden {
        let _ = std::fs::write(
            std::env::temp_dir().join("sglang-collector-exposition.actual.txt"),
            &text,
        );
    }
    assert_eq!(text, golden);
    // What a study reads from it.
    let s = crate::telemetry::prom::parse(&text).unwrap();
    assert_eq!(EngineApi::Sglang.cache_counters(&s), Ok((896.0, 2000.0)));
}
