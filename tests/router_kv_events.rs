//! The router subscribed to its destinations' KV-cache events (`--kv-events-port-offset`),
//! end to end on loopback: two emulators publish as vLLM does, the router maps every stored
//! block, `dynamo` routes by them — a prompt goes where the engines say its prefix is cached —
//! and `/metrics` shows each destination's counters. Without the events dynamo is refused.

use cacheroute::emulate::{self, EmulatorConfig, EmulatorHandle, KvEventsConfig, TimeScale};
use cacheroute::engine::KnobOverrides;
use cacheroute::policy::PolicySpec;
use cacheroute::router::KvEventsConfig as RouterKvEvents;
use cacheroute::router::{self, RouterConfig};
use cacheroute::workload::text::prompt_text;
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
    let port = free_port();
    let mut cfg = EmulatorConfig::new(GPU8B);
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
    let r = c
        .post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(json!({"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let d = r.headers()["x-cacheroute-destination"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    r.bytes().await.unwrap();
    d
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
