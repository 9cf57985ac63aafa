//! `--kv-events-port-offset N`: the router subscribes to every destination's KV-cache events
//! (vLLM's `--kv-events-config`, or `cacheroute emulate`'s) at the backend's host, port + N
//! (replay endpoint at port + N + 1), maps them into its own block hashes
//! ([`super::kv_map::BlockMapper`], the subscriptions' state in [`super::kv_map::KvFeed`]) and hands them to a policy that follows them
//! ([`crate::policy::PolicySpec::reads_kv_events`]: `dynamo`, `from_events`). Every
//! destination's subscriber counts what it saw ([`SubscriberStats`]): `/metrics` has them per
//! destination, with the blocks mapped and left unmapped, so that a router that fell behind or
//! lost events says so.
//!
//! The subscriptions follow the fleet: the backends the router starts with, and every change
//! discovery makes ([`super::kv_map::KvFeed::changed`]) — a backend added to a slot is
//! subscribed; a slot vacated (or given another backend) ends its subscription, and its blocks
//! leave the index (the policy is told the destination's cache is gone).
//!
//! [`SubscriberStats`]: crate::telemetry::kv_zmq::SubscriberStats

use super::backend::BackendUrl;
use super::kv_map::{endpoints, KvDest, KvFeed};
use super::lock::Locked;
use super::state::Shared;
use crate::policy::KvEvent;
use crate::telemetry::kv_zmq::{subscribe, Delivery};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Subscribe to the backends in force and follow discovery's changes until the router stops.
pub(super) fn spawn(shared: &Arc<Shared>) {
    let Some(feed) = shared.kv.clone() else {
        return;
    };
    follow(shared, &feed);
    let s = shared.clone();
    let watcher = tokio::spawn(async move {
        loop {
            feed.changed.notified().await;
            follow(&s, &feed);
        }
    });
    shared.background.locked().push(watcher);
}

/// Bring the subscriptions in line with the fleet's slots: end those whose slot is vacant or
/// holds another backend, subscribe the slots that hold one without.
fn follow(shared: &Arc<Shared>, feed: &Arc<KvFeed>) {
    let feeds_policy = shared.cfg.policy.reads_kv_events();
    let slots = feed.dests.locked().len();
    let held: Vec<Option<String>> = (0..slots)
        .map(|d| {
            (!shared.fleet.is_vacant(d))
                .then(|| BackendUrl::parse(&shared.fleet.dest(d).url()).ok())
                .flatten()
                .map(|b| b.connect().to_string())
        })
        .collect();
    for (d, want) in held.into_iter().enumerate() {
        let have = feed
            .dests
            .locked()
            .get(d)
            .and_then(|x| x.as_ref().map(|x| x.connect.clone()));
        if have == want {
            continue;
        }
        if have.is_some() {
            feed.end(d, |cleared| {
                if feeds_policy {
                    shared.policy.locked().policy.on_kv_events(d, &[cleared]);
                }
            });
            tracing::info!(
                destination = d,
                "KV events: unsubscribed; its blocks are forgotten"
            );
        }
        let Some(connect) = want else { continue };
        match endpoints(&connect, feed.offset) {
            Ok((endpoint, replay)) => {
                let sub = start(shared, feed, d, connect, endpoint, replay, feeds_policy);
                if let Some(x) = feed.dests.locked().get_mut(d) {
                    *x = Some(sub);
                }
            }
            Err(why) => tracing::warn!(destination = d, "KV events: not subscribed: {why}"),
        }
    }
}

/// Slot `d`'s subscription: a subscriber task and a consumer task mapping its batches and
/// handing them to the policy.
fn start(
    shared: &Arc<Shared>,
    feed: &Arc<KvFeed>,
    d: usize,
    connect: String,
    endpoint: String,
    replay: String,
    feeds_policy: bool,
) -> KvDest {
    let stats = Arc::default();
    let live = Arc::new(AtomicBool::new(true));
    let topic = shared
        .cfg
        .kv_events
        .as_ref()
        .map(|k| k.topic.clone())
        .unwrap_or_default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let subscriber = tokio::spawn({
        let (events, replay, stats) = (endpoint.clone(), replay.clone(), Arc::clone(&stats));
        async move {
            if let Err(e) = subscribe(events, Some(replay), topic, tx, stats).await {
                tracing::warn!(destination = d, "KV events: {e}");
            }
        }
    });
    let consumer = tokio::spawn({
        let (shared, feed, live) = (shared.clone(), feed.clone(), live.clone());
        async move {
            while let Some(delivery) = rx.recv().await {
                // Mapped and delivered under the mapper's lock, so that nothing of a
                // subscription that ended reaches the index or the policy after its end.
                let mut m = feed.mapper.locked();
                if !live.load(Ordering::Acquire) {
                    break;
                }
                let events: Vec<KvEvent> = match delivery {
                    Delivery::Resync => vec![m.resync(d)],
                    Delivery::Batch(b) => {
                        b.batch.events.iter().filter_map(|e| m.map(d, e)).collect()
                    }
                };
                if feeds_policy && !events.is_empty() {
                    shared.policy.locked().policy.on_kv_events(d, &events);
                }
            }
        }
    });
    tracing::info!(destination = d, endpoint = %endpoint, "KV events: subscribed");
    KvDest {
        connect,
        endpoint,
        stats,
        live,
        tasks: vec![subscriber.abort_handle(), consumer.abort_handle()],
    }
}
