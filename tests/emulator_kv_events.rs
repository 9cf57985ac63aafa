//! `cacheroute emulate` publishes KV-cache events as vLLM does (`--kv-events-config`), over
//! real ZMQ on loopback, read by the router's subscriber and block mapper: stores map to the
//! router's own hashes of the prompt text, an eviction removes them, a reset that empties the
//! cache clears all, a late subscriber learns the earlier events from the replay endpoint; the
//! command refuses a bad config naming the key and prints the bound endpoints.

use std::sync::Arc;
use std::time::Duration;

use cacheroute::emulate::{self, EmulatorConfig, EmulatorHandle, KvEventsConfig, TimeScale};
use cacheroute::engine::KnobOverrides;
use cacheroute::policy::KvEvent;
use cacheroute::router::kv_map::BlockMapper;
use cacheroute::telemetry::kv_events::WireEvent;
use cacheroute::telemetry::kv_zmq::{subscribe, Delivery, SubscriberStats};
use cacheroute::workload::text::{prompt_text, text_block_hashes};
use serde_json::json;
use tokio::sync::mpsc;

const GPU8B: &str = "llama-3.1-8b:h100:fp8:tp1";
const BLOCK: u32 = 16;

/// An emulator publishing events on free loopback ports, its KV cache `cache_tokens` tokens,
/// its KV blocks `block_size` tokens (prefix-hash blocks are always 16 words).
async fn start(cache_tokens: f64, block_size: Option<u32>) -> EmulatorHandle {
    let probe = cacheroute::engine::engine_config(GPU8B, BLOCK, &KnobOverrides::default()).unwrap();
    let mut cfg = EmulatorConfig::new(GPU8B);
    cfg.time_scale = TimeScale::new(20.0).unwrap();
    cfg.overrides = KnobOverrides {
        kv_cache_bytes: Some(cache_tokens * probe.kv_bytes_per_token()),
        block_size,
        ..KnobOverrides::default()
    };
    cfg.kv_events = KvEventsConfig::from_vllm_json(
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:0",
            "replay_endpoint":"tcp://127.0.0.1:0","topic":"kv-events"}"#,
    )
    .unwrap();
    emulate::start(cfg).await.expect("emulator starts")
}

async fn complete(c: &reqwest::Client, h: &EmulatorHandle, prompt: &str) {
    let r = c
        .post(format!("{}/v1/completions", h.base_url()))
        .header("content-type", "application/json")
        .body(json!({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.bytes().await.unwrap();
}

/// Events delivered within `wait` (a resync fails the test).
async fn collect(rx: &mut mpsc::UnboundedReceiver<Delivery>, wait: Duration) -> Vec<WireEvent> {
    let mut all = Vec::new();
    let end = tokio::time::Instant::now() + wait;
    while let Ok(Some(d)) = tokio::time::timeout_at(end, rx.recv()).await {
        match d {
            Delivery::Batch(m) => {
                assert_eq!(m.topic, b"kv-events");
                assert_eq!(m.batch.data_parallel_rank, Some(0));
                all.extend(m.batch.events)
            }
            Delivery::Resync => panic!("a resync"),
        }
    }
    all
}

/// Prompt A before anyone subscribes; a late subscriber (replay from 0); prompts that evict
/// A until the subscriber has seen A's removal; then a reset of the idle engine.
async fn a_late_subscriber_maps_stores_and_sees_the_eviction(block_size: Option<u32>) {
    // 20 blocks of 16: room for one 256-word prompt (16 blocks) and its output, not two.
    let h = start(320.0, block_size).await;
    let (ep, replay) = h.kv_event_endpoints().expect("events on");
    let (ep, replay) = (ep.to_string(), replay.map(str::to_string));
    assert!(
        ep.starts_with("tcp://127.0.0.1:") && !ep.ends_with(":0"),
        "{ep}"
    );
    let c = reqwest::Client::new();
    let a = prompt_text(&[1, 2, 3], 260, BLOCK, 7);
    complete(&c, &h, &a).await;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let stats = Arc::new(SubscriberStats::default());
    tokio::spawn(subscribe(ep, replay, "kv-events".into(), tx, stats.clone()));
    // Fresh prompts until A's blocks are seen removed (the first ones may go out before the
    // subscription is in place: the replay brings them back).
    let a_router = text_block_hashes(&a, BLOCK);
    let mut mapper = BlockMapper::new(1, BLOCK);
    let mut mapped: Vec<KvEvent> = Vec::new();
    let mut prompts = vec![a.clone()];
    let mut a_removed = false;
    for i in 0..20u64 {
        let p = prompt_text(&[100 + i], 256, BLOCK, 1000 + i);
        complete(&c, &h, &p).await;
        prompts.push(p);
        for e in collect(&mut rx, Duration::from_millis(700)).await {
            if let WireEvent::Stored {
                token_ids,
                block_size,
                medium,
                blocks,
                ..
            } = &e
            {
                assert_eq!(*block_size, BLOCK);
                assert_eq!(token_ids.len(), blocks.len() * BLOCK as usize);
                assert_eq!(medium.as_deref(), Some("GPU"));
            }
            mapped.extend(mapper.map(0, &e));
        }
        a_removed = mapped.iter().any(|m| match m {
            KvEvent::Removed { blocks } => blocks.contains(&a_router[0]),
            _ => false,
        });
        if a_removed {
            break;
        }
    }
    assert!(a_removed, "{mapped:?}");
    // The first event is A's store, from the replay endpoint: exactly the router's hashes of
    // A's text (its whole cache units: 16 blocks of 16 words, or 4 units of 64 tokens).
    let unit = block_size.unwrap_or(BLOCK) as usize / BLOCK as usize;
    let full = a_router.len() / unit * unit;
    assert_eq!(
        mapped[0],
        KvEvent::Stored {
            parent: None,
            blocks: a_router[..full].to_vec()
        }
    );
    // Every store is a prefix of some prompt's router hashes; every block maps.
    for m in &mapped {
        if let KvEvent::Stored {
            parent: None,
            blocks,
        } = m
        {
            assert!(
                prompts
                    .iter()
                    .any(|p| text_block_hashes(p, BLOCK).starts_with(blocks)),
                "{m:?}"
            );
        }
    }
    assert_eq!(mapper.unmapped, 0);
    // A reset of the idle engine empties the cache: AllBlocksCleared, at once.
    let r = c
        .post(format!("{}/reset_prefix_cache", h.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let after = collect(&mut rx, Duration::from_secs(2)).await;
    assert_eq!(after, vec![WireEvent::AllCleared]);
    assert_eq!(mapper.map(0, &after[0]), Some(KvEvent::AllCleared));
    let [batches, _, replayed, resyncs, bad] = stats.snapshot();
    assert!(batches > 0 && replayed > 0, "{:?}", stats.snapshot());
    assert_eq!((resyncs, bad), (0, 0));
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_map_to_the_router_s_hashes_and_an_eviction_removes_them() {
    a_late_subscriber_maps_stores_and_sees_the_eviction(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_blocks_larger_than_the_hash_block_publish_hash_blocks() {
    // 64-token KV blocks: a cache unit is 4 hash blocks, published as 4 blocks of 16 words.
    a_late_subscriber_maps_stores_and_sees_the_eviction(Some(64)).await;
}

#[tokio::test]
async fn the_command_refuses_a_bad_config_naming_the_key_and_prints_its_endpoints() {
    let bin = env!("CARGO_BIN_EXE_cacheroute");
    for (cfg, key) in [
        (
            r#"{"enable_kv_cache_events":true,"endpont":"tcp://*:5557"}"#,
            "endpont",
        ),
        (
            r#"{"enable_kv_cache_events":true,"buffer_steps":-3}"#,
            "buffer_steps",
        ),
        (
            r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#,
            "publisher",
        ),
    ] {
        let out = tokio::process::Command::new(bin)
            .args([
                "emulate",
                "--listen",
                "127.0.0.1:0",
                "--kv-events-config",
                cfg,
            ])
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("--kv-events-config: {key}: ")),
            "{err}"
        );
    }
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(bin)
        .args(["emulate", "--listen", "127.0.0.1:0", "--kv-events-config"])
        .arg(r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","topic":"t"}"#)
        .args(["--kv-events-encoding", "array"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let l = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("a line within 30 s")
            .unwrap()
            .expect("a line");
        seen.push(l);
    }
    assert!(
        seen[2].starts_with("KV-cache events on tcp://0.0.0.0:")
            && seen[2].contains("topic `t`")
            && seen[2].ends_with("replay off"),
        "{seen:?}"
    );
    child.kill().await.unwrap();
}
