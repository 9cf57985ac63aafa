//! `--kv-events-port-offset N`: the router subscribes to every destination's KV-cache events
//! (vLLM's `--kv-events-config`, or `cacheroute emulate`'s) at the backend's host, port + N
//! (replay endpoint at port + N + 1), maps them into its own block hashes
//! ([`super::kv_map::BlockMapper`]) and hands them to a policy that follows them
//! ([`crate::policy::PolicySpec::reads_kv_events`]: `dynamo`). Every destination's subscriber
//! counts what it saw ([`SubscriberStats`]): `/metrics` has them per destination, with the
//! blocks mapped and left unmapped, so that a router that fell behind or lost events says so.
//!
//! The subscriptions are made for the backends the router starts with; a destination slot
//! discovery fills later is not subscribed (docs/kv-events.md).

use super::kv_map::BlockMapper;
use super::lock::Locked;
use super::state::Shared;
use crate::policy::KvEvent;
use crate::telemetry::kv_zmq::{subscribe, Delivery, SubscriberStats};
use std::fmt::Write;
use std::sync::{Arc, Mutex};

/// One destination's subscription.
pub(crate) struct KvDest {
    /// `tcp://host:port` subscribed.
    pub endpoint: String,
    /// Its replay endpoint.
    pub replay: String,
    pub stats: Arc<SubscriberStats>,
}

/// The router's KV-event subscriptions.
pub(crate) struct KvFeed {
    /// Per destination slot (the backends the router started with).
    pub dests: Vec<KvDest>,
    pub mapper: Mutex<BlockMapper>,
}

/// `host:port` + `offset` as ZMQ endpoints (events, replay), or why not.
pub(crate) fn endpoints(connect: &str, offset: u16) -> Result<(String, String), String> {
    let (host, port) = connect
        .rsplit_once(':')
        .ok_or_else(|| format!("`{connect}` has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("`{connect}`: `{port}` is not a port"))?;
    let at = |extra: u16| {
        port.checked_add(offset)
            .and_then(|p| p.checked_add(extra))
            .ok_or_else(|| {
                format!("kv_events_port_offset: {port} + {offset} + {extra} is past port 65535")
            })
    };
    Ok((
        format!("tcp://{host}:{}", at(0)?),
        format!("tcp://{host}:{}", at(1)?),
    ))
}

impl KvFeed {
    /// The feed for `connects` (each destination's `host:port`), events at port + `offset`.
    pub(crate) fn new(connects: &[&str], offset: u16, block_tokens: u32) -> Result<Self, String> {
        let dests = connects
            .iter()
            .map(|c| {
                endpoints(c, offset).map(|(endpoint, replay)| KvDest {
                    endpoint,
                    replay,
                    stats: Arc::default(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            mapper: Mutex::new(BlockMapper::new(dests.len(), block_tokens)),
            dests,
        })
    }
}

/// Start the subscriptions (one subscriber and one consumer task per destination).
pub(super) fn spawn(shared: &Arc<Shared>) {
    let (Some(feed), Some(cfg)) = (shared.kv.clone(), shared.cfg.kv_events.as_ref()) else {
        return;
    };
    let feeds_policy = shared.cfg.policy.reads_kv_events();
    let mut tasks = Vec::new();
    for (d, dest) in feed.dests.iter().enumerate() {
        let (events, replay) = (dest.endpoint.clone(), dest.replay.clone());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tasks.push(tokio::spawn({
            let (topic, stats) = (cfg.topic.clone(), dest.stats.clone());
            async move {
                if let Err(e) = subscribe(events, Some(replay), topic, tx, stats).await {
                    tracing::warn!(destination = d, "KV events: {e}");
                }
            }
        }));
        let (shared, feed) = (shared.clone(), feed.clone());
        tasks.push(tokio::spawn(async move {
            while let Some(delivery) = rx.recv().await {
                let events: Vec<KvEvent> = {
                    let mut m = feed.mapper.locked();
                    match delivery {
                        Delivery::Resync => vec![m.resync(d)],
                        Delivery::Batch(b) => {
                            b.batch.events.iter().filter_map(|e| m.map(d, e)).collect()
                        }
                    }
                };
                if feeds_policy && !events.is_empty() {
                    shared.policy.locked().policy.on_kv_events(d, &events);
                }
            }
        }));
    }
    shared.background.locked().extend(tasks);
}

/// The feed's `/metrics` families (after the router's own), when subscribed.
pub(super) fn write_metrics(o: &mut String, feed: &KvFeed) {
    let families: [(&str, &str, usize); 5] = [
        ("cacheroute_kv_event_batches_total", "KV-event batches delivered per destination (replayed ones included).", 0),
        ("cacheroute_kv_event_gaps_total", "Sequence gaps in a destination's KV events.", 1),
        ("cacheroute_kv_event_replayed_total", "KV-event batches recovered from a destination's replay endpoint.", 2),
        ("cacheroute_kv_event_resyncs_total", "Times a destination's cache view was dropped and rebuilt (a gap the replay could not fill, an engine restart).", 3),
        ("cacheroute_kv_event_undecodable_total", "KV-event messages dropped because they did not decode.", 4),
    ];
    for (name, help, i) in families {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
        for (d, x) in feed.dests.iter().enumerate() {
            let v = x.stats.snapshot().get(i).copied().unwrap_or(0);
            let _ = writeln!(
                o,
                "{name}{{destination=\"{d}\",endpoint=\"{}\"}} {v}",
                x.endpoint
            );
        }
    }
    let m = feed.mapper.locked();
    let _ = writeln!(
        o,
        "# HELP cacheroute_kv_blocks_known Blocks the router knows a destination holds, from its KV events.\n# TYPE cacheroute_kv_blocks_known gauge"
    );
    for (d, x) in feed.dests.iter().enumerate() {
        let _ = writeln!(
            o,
            "cacheroute_kv_blocks_known{{destination=\"{d}\",endpoint=\"{}\"}} {}",
            x.endpoint,
            m.known(d)
        );
    }
    for (name, help, v) in [
        ("cacheroute_kv_blocks_mapped_total", "Stored blocks mapped to the router's block hashes.", m.mapped),
        ("cacheroute_kv_blocks_unmapped_total", "Stored blocks left out: a token outside the vocabulary, another block size, an unknown parent.", m.unmapped),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_the_backend_port_plus_the_offset() {
        assert_eq!(
            endpoints("10.0.0.5:8000", 1000).unwrap(),
            ("tcp://10.0.0.5:9000".into(), "tcp://10.0.0.5:9001".into())
        );
        assert!(endpoints("h:65535", 1)
            .unwrap_err()
            .contains("past port 65535"));
        assert!(endpoints("h", 1).unwrap_err().contains("no port"));
    }
}
