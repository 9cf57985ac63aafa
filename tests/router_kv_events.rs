//! The router subscribed to its destinations' KV-cache events (`--kv-events-port-offset`),
//! end to end on loopback: two emulators publish as vLLM does, the router maps every stored
//! block, `dynamo` routes by them — a prompt goes where the engines say its prefix is cached —
//! and `/metrics` shows each destination's counters. Without the events dynamo is refused.

mod common;

use cacheroute::emulate::{self, EmulatorConfig, EmulatorHandle, KvEventsConfig, TimeScale};
use cacheroute::engine::KnobOverrides;
use cacheroute::policy::PolicySpec;
use cacheroute::router::KvEventsConfig as RouterKvEvents;
use cacheroute::router::{self, RouterConfig};
use cacheroute::workload::text::prompt_text;
use common::metrics_text;
use serde_json::json;
use std::time::Duration;

const GPU8B: &str = "llama-3.1-8b:h100:fp8:tp1";
const OFFSET: u16 = 1000;

fn free_port() -> u16 {
    // A port whose + OFFSET and + OFFSET + 1 are free too.
    loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < 60_000
            && std::net::TcpListener::bind(("127.0.0.1", p + OFFSET)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", p + OFFSET + 1)).is_ok()
        {
            return p;
        }
    }
}

async fn emulator() -> EmulatorHandle {
    emulator_with_blocks(16).await
}

/// An emulator publishing its events, hashing `block_tokens` words a block.
async fn emulator_with_blocks(block_tokens: u32) -> EmulatorHandle {
    let port = free_port();
    let mut cfg = EmulatorConfig::new(GPU8B);
    cfg.block_tokens = block_tokens;
    cfg.listen = format!("127.0.0.1:{port}").parse().unwrap();
    cfg.time_scale = TimeScale::new(20.0).unwrap();
    cfg.overrides = KnobOverrides::default();
    cfg.kv_events = KvEventsConfig::from_vllm_json(&format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:{}",
            "replay_endpoint":"tcp://127.0.0.1:{}"}}"#,
        port + OFFSET,
        port + OFFSET + 1
    ))
    .unwrap();
    emulate::start(cfg).await.expect("emulator starts")
}

async fn complete(c: &reqwest::Client, url: &str, prompt: &str) -> usize {
    complete_as(c, url, prompt).await.unwrap_or(usize::MAX)
}

/// One completion; the destination the router chose (`None` from an engine itself).
async fn complete_as(c: &reqwest::Client, url: &str, prompt: &str) -> Option<usize> {
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(json!({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let d = r
        .headers()
        .get("x-cacheroute-destination")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    r.bytes().await.unwrap();
    d
}

fn router_config(urls: Vec<String>, policy: PolicySpec) -> RouterConfig {
    let mut cfg = RouterConfig::new("127.0.0.1:0".parse().unwrap(), urls, policy);
    cfg.block_tokens = 16;
    cfg.kv_events = Some(RouterKvEvents {
        port_offset: OFFSET,
        topic: String::new(),
    });
    cfg
}

/// Distinct prompts with long prefixes (4 blocks of 16 words and more).
fn prompts(n: u64, seed: u64) -> Vec<String> {
    (0..n)
        .map(|i| {
            let k = 1000 * seed + 100 * i;
            prompt_text(&[k + 1, k + 2, k + 3, k + 4], 64, 16, i)
        })
        .collect()
}

fn metric(text: &str, name: &str, dest: Option<usize>) -> u64 {
    text.lines()
        .find(|l| {
            l.starts_with(name)
                && dest.is_none_or(|d| l.contains(&format!("destination=\"{d}\"")))
                && !l.starts_with('#')
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} {dest:?} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_routes_by_the_engines_events_and_metrics_count_them() {
    let emus = [emulator().await, emulator().await];
    let mut cfg = RouterConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        emus.iter().map(|e| e.base_url()).collect(),
        PolicySpec::from_name("dynamo").unwrap(),
    );
    cfg.block_tokens = 16;
    cfg.kv_events = Some(RouterKvEvents {
        port_offset: OFFSET,
        topic: String::new(),
    });
    let h = router::start(cfg).await.expect("router starts");
    let c = reqwest::Client::new();
    // Prompts with long distinct prefixes: the first of each goes wherever load says; once
    // its blocks are stored (and the events are in), its repeats go to the holder.
    let prompts: Vec<String> = (0..6)
        .map(|i| {
            prompt_text(
                &[100 * i + 1, 100 * i + 2, 100 * i + 3, 100 * i + 4],
                64,
                16,
                i,
            )
        })
        .collect();
    let mut home = Vec::new();
    for p in &prompts {
        home.push(complete(&c, &h.url(), p).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut followed = 0;
    for (p, &d) in prompts.iter().zip(&home) {
        for _ in 0..3 {
            followed += usize::from(complete(&c, &h.url(), p).await == d);
        }
    }
    let m = c
        .get(format!("{}/metrics", h.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for d in 0..2 {
        assert!(
            metric(&m, "cacheroute_kv_event_batches_total", Some(d)) > 0,
            "{m}"
        );
        assert_eq!(metric(&m, "cacheroute_kv_event_resyncs_total", Some(d)), 0);
        assert_eq!(
            metric(&m, "cacheroute_kv_event_undecodable_total", Some(d)),
            0
        );
    }
    assert!(metric(&m, "cacheroute_kv_blocks_mapped_total", None) >= 6 * 4);
    assert_eq!(
        metric(&m, "cacheroute_kv_blocks_unmapped_total", None),
        0,
        "{m}"
    );
    // Both destinations got first prompts (balance), and the repeats followed the cache.
    assert!(home.contains(&0) && home.contains(&1), "{home:?}");
    assert!(
        followed >= 16,
        "{followed} of 18 repeats went to their prefix's holder"
    );
    h.shutdown().await;
}

/// `from_events: true` demands the events: without the subscription the router refuses to
/// start, naming the flag (unset, it would start on its own tree).
#[test]
fn from_events_true_without_the_engines_events_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("router.yaml");
    for policy in [
        "{policy: preble, from_events: true}",
        "{policy: cacheroute, prefix: {from_events: true}}",
    ] {
        std::fs::write(&cfg, format!("policy: {policy}\n")).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
            .args(["route", "--config", cfg.to_str().unwrap()])
            .args(["--backend", "http://127.0.0.1:9"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{policy}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--kv-events-port-offset") && err.contains("from_events unset"),
            "{policy}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{policy}: {err}");
        // Left unset, the same policy starts unsubscribed, on its own tree.
        let unset: PolicySpec = yaml_serde::from_str(&policy.replace("true", "null")).unwrap();
        let settings = router::RouterSettings {
            policy: Some(router::PolicySetting::spec(&unset).unwrap()),
            backends: Some(vec!["http://127.0.0.1:9".into()]),
            ..Default::default()
        };
        let cfg = RouterConfig::from_settings(settings).unwrap();
        assert!(
            !cfg.policy.reads_kv_events() && cfg.kv_events.is_none(),
            "{policy}"
        );
    }
}

#[test]
fn dynamo_without_the_engines_events_is_refused_naming_the_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cacheroute"))
        .args([
            "route",
            "--policy",
            "dynamo",
            "--backend",
            "http://127.0.0.1:9",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kv-events-port-offset"), "{err}");
}

/// The prompts' prefixes are cached on destination 1 behind the router's back (sent to the
/// engine itself): only a tree built from the engines' events knows. Preble and CacheRoute's
/// prefix dispatch, left at their default, follow them where the router is subscribed; with
/// `from_events: false` they keep the router's own tree, which knows nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_events_are_followed_by_default_where_the_router_is_subscribed() {
    let c = reqwest::Client::new();
    for (policy, follows) in [
        // Preble, the baseline as published, keeps its own tree unless told to follow them.
        ("{policy: preble, from_events: true}", true),
        ("{policy: preble}", false),
        ("{policy: cacheroute, cold_tail: prefix}", true),
        (
            "{policy: cacheroute, cold_tail: prefix, prefix: {from_events: false}}",
            false,
        ),
    ] {
        let emus = [emulator().await, emulator().await];
        let spec: PolicySpec = yaml_serde::from_str(policy).unwrap();
        let h = router::start(router_config(
            emus.iter().map(|e| e.base_url()).collect(),
            spec,
        ))
        .await
        .expect("router starts");
        let ps = prompts(6, 7);
        for p in &ps {
            complete_as(&c, &emus[1].base_url(), p).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut on_1 = 0;
        for p in &ps {
            on_1 += usize::from(complete(&c, &h.url(), p).await == 1);
        }
        if follows {
            assert_eq!(
                on_1, 6,
                "{policy}: the prefixes cached on 1 were not followed"
            );
        } else {
            assert!(
                on_1 < 6,
                "{policy}: the router's own tree cannot know of them"
            );
        }
        h.shutdown().await;
    }
}

/// Per destination, the prompt tokens the router's exact index predicted cached match the
/// engine's own prefix-cache counters (within the report's tolerance) on an emulator fleet;
/// a router hashing other blocks than the engines' (a wrong mapping) predicts nothing and the
/// check fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_hit_matches_the_engines_counters_and_a_wrong_mapping_parts_them() {
    use cacheroute::report::DestHit;
    let c = reqwest::Client::new();
    for (engine_blocks, agree) in [(16, true), (32, false)] {
        let emus = [
            emulator_with_blocks(engine_blocks).await,
            emulator_with_blocks(engine_blocks).await,
        ];
        let h = router::start(router_config(
            emus.iter().map(|e| e.base_url()).collect(),
            PolicySpec::from_name("dynamo").unwrap(),
        ))
        .await
        .expect("router starts");
        let ps = prompts(8, 3);
        for round in 0..3 {
            for p in &ps {
                complete(&c, &h.url(), p).await;
            }
            // The events of a round are in before the next.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let _ = round;
        }
        let m = metrics_text(&c, &h.url()).await;
        for (d, e) in emus.iter().enumerate() {
            let em = metrics_text(&c, &e.base_url()).await;
            let engine = |name: &str| {
                em.lines()
                    .find(|l| l.starts_with(name))
                    .and_then(|l| l.rsplit(' ').next())
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or_else(|| panic!("{name} in\n{em}"))
            };
            let hit = DestHit {
                routed: metric(&m, "cacheroute_destination_prompt_tokens_total", Some(d)) as f64,
                predicted: metric(
                    &m,
                    "cacheroute_destination_predicted_cached_tokens_total",
                    Some(d),
                ) as f64,
                hits: engine("vllm:prefix_cache_hits_total"),
                queries: engine("vllm:prefix_cache_queries_total"),
            };
            assert!(
                hit.routed > 0.0 && hit.hits > 0.0,
                "destination {d}: {hit:?}"
            );
            assert_eq!(
                hit.agrees(),
                Some(agree),
                "engine blocks {engine_blocks}, destination {d}: {hit:?} {:?}",
                hit.rates()
            );
        }
        h.shutdown().await;
    }
}

/// Discovery adds a destination after start: its events are subscribed (its counters appear
/// on `/metrics` and count); discovery removes one: its subscription ends, its counters leave
/// `/metrics` and its blocks leave the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_discovery_adds_are_subscribed_and_removed_ones_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends");
    let write = |urls: &[String]| {
        let tmp = file.with_extension("tmp");
        std::fs::write(&tmp, urls.join("\n") + "\n").unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    let emus = [emulator().await, emulator().await];
    let urls: Vec<String> = emus.iter().map(|e| e.base_url()).collect();
    write(&urls[..1]);
    let mut cfg = router_config(Vec::new(), PolicySpec::from_name("dynamo").unwrap());
    cfg.backends_file = Some(file.clone());
    cfg.backends_poll = Duration::from_millis(100);
    cfg.health_interval = Duration::from_millis(200);
    let h = router::start(cfg).await.expect("router starts");
    let c = reqwest::Client::new();
    let endpoint = |i: usize| {
        let port: u16 = urls[i].rsplit(':').next().unwrap().parse().unwrap();
        format!("endpoint=\"tcp://127.0.0.1:{}\"", port + OFFSET)
    };
    let line = |m: &str, name: &str, i: usize| {
        m.lines()
            .find(|l| l.starts_with(name) && l.contains(&endpoint(i)))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
    };
    let m = metrics_text(&c, &h.url()).await;
    assert!(
        line(&m, "cacheroute_kv_event_batches_total", 0).is_some(),
        "{m}"
    );
    assert_eq!(
        line(&m, "cacheroute_kv_event_batches_total", 1),
        None,
        "{m}"
    );
    // Added: subscribed, and what it stores is followed (prompts sent to it directly: dynamo
    // would send them all to the first, which holds their prefixes).
    write(&urls);
    let t0 = std::time::Instant::now();
    for round in 5.. {
        // New prompts each round: a store is published once, when first made.
        for p in &prompts(2, round) {
            complete_as(&c, &urls[1], p).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let m = metrics_text(&c, &h.url()).await;
        let known = m
            .lines()
            .find(|l| l.starts_with("cacheroute_kv_blocks_known") && l.contains(&endpoint(1)))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
        if line(&m, "cacheroute_kv_event_batches_total", 1).is_some_and(|b| b > 0)
            && known.is_some_and(|k| k > 0)
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the added destination's events were not followed:\n{m}"
        );
    }
    // Removed: its subscription ends and its blocks are forgotten.
    write(&urls[1..]);
    let t0 = std::time::Instant::now();
    loop {
        let m = metrics_text(&c, &h.url()).await;
        if line(&m, "cacheroute_kv_event_batches_total", 0).is_none()
            && !m
                .lines()
                .any(|l| l.starts_with("cacheroute_kv_blocks_known") && l.contains(&endpoint(0)))
        {
            assert!(
                line(&m, "cacheroute_kv_event_batches_total", 1).is_some(),
                "{m}"
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the removed destination is still subscribed:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.shutdown().await;
}
