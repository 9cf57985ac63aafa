//! `cacheroute emulate`: run one vLLM- or SGLang-compatible engine emulator (see
//! [`crate::emulate`])
//! until Ctrl-C or SIGTERM. The first line on stdout is `listening on http://ADDR`, so a parent
//! process that asked for port 0 can read the port.

use std::io::Write;
use std::net::SocketAddr;

use anyhow::Context;

use crate::emulate::{EmulatorConfig, TimeScale, DEFAULT_BLOCK_TOKENS};
use crate::engine::KnobOverrides;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  # An 8B replica on an H100, in real time
  cacheroute emulate --listen 127.0.0.1:9001 --engine llama-3.1-8b:h100:fp8:tp1
  # The same, running ten times faster than the modelled engine
  cacheroute emulate --listen 127.0.0.1:9002 --engine llama-3.1-8b:h100:fp8:tp1 --time-scale 10")]
pub struct EmulateArgs {
    /// Exit when standard input closes (set by a parent study runner).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
    /// Address to listen on (port 0: any free port, printed on the first stdout line).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Engine spec, model:device:precision:tpN[:kv-<precision>].
    #[arg(long, default_value = "llama-3.1-8b:h100:fp8:tp1")]
    pub engine: String,
    /// Virtual seconds per real second (2 runs twice as fast as the modelled engine).
    #[arg(long, default_value_t = TimeScale::REAL)]
    pub time_scale: TimeScale,
    /// Words per prefix-hash block of the prompt text (the replayer's block size).
    #[arg(long, default_value_t = DEFAULT_BLOCK_TOKENS)]
    pub block_tokens: u32,
    /// Served model name (default: the spec's model, e.g. llama-3.1-8b).
    #[arg(long)]
    pub model_name: Option<String>,
    /// KV cache block in tokens, vLLM's `--block-size` (default: --block-tokens; 128 mimics
    /// vLLM on CPU).
    #[arg(long = "kv-block-tokens", alias = "block-size")]
    pub block_size: Option<u32>,
    /// KV cache size in bytes, replacing the size derived from device memory.
    #[arg(long)]
    pub kv_cache_bytes: Option<f64>,
    /// Most requests running at once (vLLM --max-num-seqs).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Per-step token budget (vLLM --max-num-batched-tokens).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Fraction of device memory the engine may use (vLLM --gpu-memory-utilization).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Whose HTTP dialect to speak: `vllm` or `sglang` (routes, /metrics names, usage shape).
    #[arg(long, default_value = "vllm", value_parser = parse_api)]
    pub api: crate::emulate::EngineApi,
    /// Model seconds after start during which SGLang's /health answers 503 (starting).
    #[arg(long, default_value_t = 0.0)]
    pub startup_s: f64,
    /// HTTP/tokenizer time before a request reaches the engine, model milliseconds. Default:
    /// 4 on the `cpu` device (vLLM-CPU as measured with the tiny model), else 0.
    #[arg(long)]
    pub frontend_delay_ms: Option<f64>,
    /// Write one JSON line per generation request to FILE: server-side wall-clock arrival,
    /// first-token and end times (Unix seconds), tokens, status (docs/emulator.md).
    #[arg(long, value_name = "FILE")]
    pub request_log: Option<std::path::PathBuf>,
    /// Client connections open at once; past it `503` and close (a load generator that opens
    /// one connection per request needs about rate × latency of them).
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Publish the prefix cache's stores and evictions as vLLM's KV-cache events over ZMQ,
    /// vLLM's JSON and keys: '{"enable_kv_cache_events":true,"publisher":"zmq",
    /// "endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv-events"}'
    /// (docs/kv-events.md).
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    /// KV-cache event encoding: `map` (tagged maps, vLLM 0.32's) or `array` (tagged arrays,
    /// older vLLM releases').
    #[arg(long, default_value = "map", value_parser = parse_encoding)]
    pub kv_events_encoding: crate::telemetry::kv_events::Encoding,
}

fn parse_encoding(s: &str) -> Result<crate::telemetry::kv_events::Encoding, String> {
    use crate::telemetry::kv_events::Encoding;
    match s {
        "map" => Ok(Encoding::TaggedMap),
        "array" => Ok(Encoding::TaggedArray),
        _ => Err("`map` or `array` expected".into()),
    }
}

fn parse_api(s: &str) -> Result<crate::emulate::EngineApi, String> {
    s.parse()
}

pub fn run(a: EmulateArgs) -> anyhow::Result<()> {
    if a.exit_with_parent {
        super::exit_when_stdin_closes();
    }
    let on_cpu = a
        .engine
        .parse::<crate::engine::EngineSpec>()
        .is_ok_and(|s| s.device.eq_ignore_ascii_case("cpu"));
    let kv_events = match &a.kv_events_config {
        None => None,
        Some(json) => crate::emulate::KvEventsConfig::from_vllm_json(json)
            .map_err(|e| anyhow::anyhow!("--kv-events-config: {e}"))?
            .map(|k| crate::emulate::KvEventsConfig {
                encoding: a.kv_events_encoding,
                ..k
            }),
    };
    let cfg = EmulatorConfig {
        listen: a.listen,
        engine: a.engine,
        overrides: KnobOverrides {
            block_size: a.block_size,
            kv_cache_bytes: a.kv_cache_bytes,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: a.max_num_batched_tokens,
            gpu_memory_utilization: a.gpu_memory_utilization,
            hash_block_tokens: None,
        },
        block_tokens: a.block_tokens,
        time_scale: a.time_scale,
        model_name: a.model_name,
        frontend_delay_s: match a.frontend_delay_ms {
            Some(ms) => ms / 1000.0,
            None if on_cpu => crate::engine::cards::CPU_FRONTEND_DELAY_S,
            None => 0.0,
        },
        api: a.api,
        startup_s: a.startup_s,
        announce: true,
        request_log: a.request_log,
        max_connections: a.max_connections,
        kv_events,
        ..EmulatorConfig::new("")
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let handle = crate::emulate::start(cfg.clone())
            .await
            .context("starting the emulator")?;
        let url = handle.base_url();
        let e = handle.engine_config();
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {url}")?;
        writeln!(
            out,
            "engine {} as model `{}` ({} API): KV cache {} tokens in blocks of {}, prefix hash \
             blocks of {} words, time scale {}; Ctrl-C or SIGTERM stops it",
            e.spec(),
            cfg.served_model_name(),
            cfg.api.name(),
            e.kv_capacity_tokens(),
            e.knobs().block_size,
            cfg.block_tokens,
            cfg.time_scale
        )?;
        if let Some((pub_ep, replay)) = handle.kv_event_endpoints() {
            writeln!(
                out,
                "KV-cache events on {pub_ep} (topic `{}`), replay {}",
                cfg.kv_events.as_ref().map_or("", |k| k.topic.as_str()),
                replay.unwrap_or("off")
            )?;
        }
        if let Some(path) = &cfg.request_log {
            writeln!(
                out,
                "request log: one JSON line per request in {}",
                path.display()
            )?;
        }
        out.flush()?;
        drop(out);
        wait_for_stop().await?;
        handle.shutdown().await.context("stopping the emulator")?;
        println!("emulator on {url} stopped");
        Ok(())
    })
}

async fn wait_for_stop() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    Ok(())
}
