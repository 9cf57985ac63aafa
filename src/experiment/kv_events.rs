//! The engines' KV-cache events in a local study: the emulators a step starts publish them
//! (vLLM's `--kv-events-config`, each at its HTTP port + [`PORT_OFFSET`], replay at + 1), our
//! router subscribes (`kv_events_port_offset`), and at the step's end the router's counters —
//! what it received of each destination's events, and per destination the prompt tokens it
//! routed and those its exact index predicted cached — are stored as the step's telemetry
//! ([`router_telemetry`]) beside the engines' own prefix-cache counters, for the report.

use crate::store::TelemetrySample;
use anyhow::{Context, Result};

/// Each emulator publishes at its HTTP port + this (replay endpoint at + 1).
pub const PORT_OFFSET: u16 = 1000;

/// The router's per-destination families stored as step telemetry (source `router:D`).
pub const PER_DEST: [&str; 7] = [
    BATCHES,
    GAPS,
    REPLAYED,
    RESYNCS,
    UNDECODABLE,
    PROMPT_TOKENS,
    PREDICTED_TOKENS,
];
/// Router-wide families stored (source `router`).
pub const ROUTER_WIDE: [&str; 2] = [MAPPED, UNMAPPED];

pub const BATCHES: &str = "cacheroute_kv_event_batches_total";
pub const GAPS: &str = "cacheroute_kv_event_gaps_total";
pub const REPLAYED: &str = "cacheroute_kv_event_replayed_total";
pub const MAPPED: &str = "cacheroute_kv_blocks_mapped_total";
pub const RESYNCS: &str = "cacheroute_kv_event_resyncs_total";
pub const UNDECODABLE: &str = "cacheroute_kv_event_undecodable_total";
pub const UNMAPPED: &str = "cacheroute_kv_blocks_unmapped_total";
pub const PROMPT_TOKENS: &str = "cacheroute_destination_prompt_tokens_total";
pub const PREDICTED_TOKENS: &str = "cacheroute_destination_predicted_cached_tokens_total";

/// A loopback port for an emulator whose event ports (+ [`PORT_OFFSET`], + 1) are free too.
pub fn free_port() -> Result<u16> {
    for _ in 0..200 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")
            .context("finding a free port for an emulator")?;
        let p = l.local_addr()?.port();
        let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
        if p < u16::MAX - PORT_OFFSET - 1 && free(p + PORT_OFFSET) && free(p + PORT_OFFSET + 1) {
            return Ok(p);
        }
    }
    anyhow::bail!(
        "no loopback port with {PORT_OFFSET} and {} above it free for an emulator's KV events",
        PORT_OFFSET + 1
    )
}

/// The emulator's arguments that listen on `port` and publish its KV-cache events there
/// + [`PORT_OFFSET`] (the `--listen` they replace).
pub fn emulator_args(port: u16) -> Vec<String> {
    vec![
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--kv-events-config".into(),
        format!(
            r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:{}","replay_endpoint":"tcp://127.0.0.1:{}"}}"#,
            port + PORT_OFFSET,
            port + PORT_OFFSET + 1
        ),
    ]
}

/// The router's KV-event and prediction counters from its `/metrics`, as telemetry at
/// `at_s` (the step's end; the router started with the step, so its counters are the step's).
pub fn router_telemetry(
    client: &reqwest::blocking::Client,
    router: &str,
    at_s: f64,
) -> Result<Vec<TelemetrySample>> {
    let text = client
        .get(format!("{router}/metrics"))
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.text())
        .with_context(|| format!("reading the router's KV-event counters at {router}/metrics"))?;
    let samples =
        crate::telemetry::prom::parse(&text).with_context(|| format!("{router}/metrics"))?;
    Ok(samples
        .into_iter()
        .filter_map(|s| {
            let source = if PER_DEST.contains(&s.name.as_str()) {
                format!("router:{}", s.label("destination")?)
            } else if ROUTER_WIDE.contains(&s.name.as_str()) {
                "router".to_string()
            } else {
                return None;
            };
            Some(TelemetrySample {
                run: None,
                step: None,
                source,
                labels: s
                    .labels
                    .into_iter()
                    .filter(|(k, _)| k != "destination")
                    .collect(),
                metric: s.name,
                value: s.value,
                at_s,
            })
        })
        .collect())
}

/// Add a stored router sample ([`router_telemetry`]'s) to its arm's sums; other samples are
/// left alone.
pub fn add_router_sample(a: &mut crate::report::ArmTelemetry, t: &TelemetrySample) {
    let dest = t
        .source
        .strip_prefix("router:")
        .and_then(|d| d.parse::<usize>().ok());
    if dest.is_none() && t.source != "router" {
        return;
    }
    let k = a.kv_events.get_or_insert_with(Default::default);
    let v = t.value;
    match t.metric.as_str() {
        BATCHES => k.batches += v,
        GAPS => k.gaps += v,
        REPLAYED => k.replayed += v,
        RESYNCS => k.resyncs += v,
        UNDECODABLE => k.undecodable += v,
        MAPPED => k.mapped_blocks += v,
        UNMAPPED => k.unmapped_blocks += v,
        PROMPT_TOKENS | PREDICTED_TOKENS => {
            let Some(d) = dest else { return };
            let h = a.per_dest.entry(d).or_default();
            if t.metric == PROMPT_TOKENS {
                h.routed += v;
            } else {
                h.predicted += v;
            }
        }
        _ => {}
    }
}
