//! `--kv-events-port-offset N`: the router subscribes to every destination's KV-cache events
//! (vLLM's `--kv-events-config`, or `cacheroute emulate`'s) at the backend's host, port + N
//! (replay endpoint at port + N + 1), maps them into its own block hashes
//! ([`super::kv_map::BlockMapper`], the subscriptions' state in [`super::kv_map::KvFeed`]) and hands them to a policy that follows them
//! ([`crate::policy::PolicySpec::reads_kv_events`]: `dynamo`). Every destination's subscriber
//! counts what it saw ([`SubscriberStats`]): `/metrics` has them per destination, with the
//! blocks mapped and left unmapped, so that a router that fell behind or lost events says so.
//!
//! The subscriptions are made for the backends the router starts with; a destination slot
//! discovery fills later is not subscribed (docs/kv-events.md).

use super::lock::Locked;
use super::state::Shared;
use crate::policy::KvEvent;
use crate::telemetry::kv_zmq::{subscribe, Delivery};
use std::sync::Arc;

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
