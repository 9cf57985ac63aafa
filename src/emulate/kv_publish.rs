//! The emulator's KV-cache events, published as vLLM publishes them (`--kv-events-config`).
//!
//! The engine model's prefix cache logs what it stores and evicts
//! ([`crate::engine::Replica::record_kv_events`]), named by the chain hashes of the prompt's
//! `block_tokens`-word hash blocks (the router's own hashes). After each advance of the replica
//! the engine task turns the log into one [`EventBatch`] — `BlockStored` with those hashes,
//! the parent's, the blocks' words as token ids of the word vocabulary and `block_size =
//! block_tokens`; `BlockRemoved`; `AllBlocksCleared` for a reset that empties the cache — and
//! hands it to a publisher task (PUB socket and replay endpoint:
//! [`crate::telemetry::kv_zmq::Publisher`]). An advance that changed nothing publishes nothing,
//! as vLLM publishes only non-empty batches.
//!
//! The token ids come from the prompt text: a request's full blocks are held, by hash, while it
//! is in the engine (a store only ever names blocks of a request being computed), and let go
//! when it finishes.

use std::collections::HashMap;

use tokio::sync::mpsc;

use crate::engine::{CacheChange, Replica};
use crate::telemetry::kv_events::{Encoding, EventBatch, WireEvent};
use crate::telemetry::kv_zmq::Publisher;
use crate::workload::text::word_token_id;

/// vLLM's `KVEventsConfig` defaults (`vllm/config/kv_events.py`, 0.32.0).
const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// Where and how to publish (vLLM's `--kv-events-config`, enabled, with the `zmq` publisher).
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// PUB endpoint to bind, `tcp://HOST:PORT` (`*` as the host binds every interface).
    pub endpoint: String,
    /// ROUTER endpoint answering replay requests, if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Topic frame of every message.
    pub topic: String,
    /// Event encoding: tagged maps (vLLM 0.32's) or tagged arrays (older releases').
    pub encoding: Encoding,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.into(),
            replay_endpoint: None,
            buffer_steps: DEFAULT_BUFFER_STEPS,
            topic: String::new(),
            encoding: Encoding::TaggedMap,
        }
    }
}

/// vLLM's keys, in its order.
const KEYS: [&str; 8] = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
];

impl KvEventsConfig {
    /// Read vLLM's `--kv-events-config` JSON: `None` when events are off
    /// (`enable_kv_cache_events` false or absent, or the `null` publisher). An unknown key or a
    /// bad value is refused, naming the key. `hwm` and `max_queue_size` are checked and
    /// otherwise ignored (the publisher never queues: a slow subscriber loses batches and asks
    /// the replay endpoint).
    pub fn from_vllm_json(json: &str) -> Result<Option<KvEventsConfig>, String> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or("a JSON object expected, e.g. {\"enable_kv_cache_events\":true}")?;
        let mut cfg = KvEventsConfig::default();
        let mut enabled = false;
        let mut publisher: Option<String> = None;
        for (k, v) in obj {
            let bad = |what: &str| format!("{k}: {what} expected, got {v}");
            match k.as_str() {
                "enable_kv_cache_events" => {
                    enabled = v.as_bool().ok_or_else(|| bad("true or false"))?
                }
                "publisher" => match v.as_str() {
                    Some(p @ ("zmq" | "null")) => publisher = Some(p.into()),
                    _ => return Err(bad("\"zmq\" (or \"null\")")),
                },
                "endpoint" => {
                    cfg.endpoint = tcp_endpoint(v).ok_or_else(|| bad("\"tcp://HOST:PORT\""))?
                }
                "replay_endpoint" => {
                    cfg.replay_endpoint = match v {
                        serde_json::Value::Null => None,
                        v => Some(
                            tcp_endpoint(v).ok_or_else(|| bad("\"tcp://HOST:PORT\" or null"))?,
                        ),
                    }
                }
                "buffer_steps" => {
                    cfg.buffer_steps = v
                        .as_u64()
                        .filter(|&n| n >= 1)
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| bad("an integer ≥ 1"))?
                }
                "hwm" | "max_queue_size" => {
                    v.as_u64().ok_or_else(|| bad("an integer ≥ 0"))?;
                }
                "topic" => cfg.topic = v.as_str().ok_or_else(|| bad("a string"))?.into(),
                _ => {
                    return Err(format!(
                        "{k}: unknown key (vLLM's keys: {})",
                        KEYS.join(", ")
                    ))
                }
            }
        }
        // vLLM: the publisher defaults to "zmq" when events are enabled, "null" otherwise.
        let zmq = publisher.map_or(enabled, |p| p == "zmq");
        Ok((enabled && zmq).then_some(cfg))
    }
}

/// A `tcp://HOST:PORT` string.
fn tcp_endpoint(v: &serde_json::Value) -> Option<String> {
    let s = v.as_str()?;
    let rest = s.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then(|| s.to_string())
}

/// The address to bind for a configured endpoint: vLLM's wildcard host `*` is every interface.
pub(crate) fn bind_address(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => endpoint.to_string(),
    }
}

/// Bind the sockets and start the publisher task; it publishes every batch sent to the returned
/// channel, in order, until the channel closes. Returns the bound endpoints too.
pub(crate) async fn start(
    cfg: &KvEventsConfig,
) -> Result<(mpsc::UnboundedSender<EventBatch>, String, Option<String>), String> {
    let replay = cfg.replay_endpoint.as_deref().map(bind_address);
    let mut p = Publisher::bind(
        &bind_address(&cfg.endpoint),
        replay.as_deref(),
        &cfg.topic,
        cfg.buffer_steps,
        cfg.encoding,
    )
    .await?;
    let (endpoint, replay) = (p.endpoint.clone(), p.replay_endpoint.clone());
    let (tx, mut rx) = mpsc::unbounded_channel::<EventBatch>();
    tokio::spawn(async move {
        while let Some(b) = rx.recv().await {
            // A send error is a socket gone: nothing to publish to any more.
            if p.publish(&b).await.is_err() {
                break;
            }
        }
    });
    Ok((tx, endpoint, replay))
}

/// The engine task's side: the replica's change log turned into batches.
pub(crate) struct KvTap {
    block_tokens: u32,
    /// Token ids of the full blocks of the requests in the engine, by chain hash, with how
    /// many requests hold each.
    tokens: HashMap<u64, (u32, Box<[u32]>)>,
    changes: Vec<CacheChange>,
    /// A reset emptied the cache: `AllBlocksCleared` goes first in the next batch.
    cleared: bool,
    out: mpsc::UnboundedSender<EventBatch>,
}

impl KvTap {
    /// Start logging `replica`'s cache changes for `out`.
    pub(crate) fn new(
        replica: &mut Replica,
        block_tokens: u32,
        out: mpsc::UnboundedSender<EventBatch>,
    ) -> Self {
        replica.record_kv_events();
        Self {
            block_tokens,
            tokens: HashMap::new(),
            changes: Vec::new(),
            cleared: false,
            out,
        }
    }

    /// A request entered the engine: keep its blocks' token ids (`block_tokens` per hash).
    pub(crate) fn hold(&mut self, hashes: &[u64], token_ids: &[u32]) {
        let b = self.block_tokens as usize;
        for (i, &h) in hashes.iter().enumerate() {
            let e = self.tokens.entry(h).or_insert_with(|| {
                let ids = token_ids.get(i * b..(i + 1) * b).unwrap_or(&[]);
                (0, ids.into())
            });
            e.0 += 1;
        }
    }

    /// A request left the engine.
    pub(crate) fn release(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(e) = self.tokens.get_mut(h) {
                e.0 -= 1;
                if e.0 == 0 {
                    self.tokens.remove(h);
                }
            }
        }
    }

    /// Publish what the cache did since the last call (nothing when it did nothing).
    pub(crate) fn publish(&mut self, replica: &mut Replica) {
        replica.drain_kv_changes(&mut self.changes);
        if self.changes.is_empty() && !self.cleared {
            return;
        }
        let mut events = Vec::with_capacity(self.changes.len() + 1);
        if std::mem::take(&mut self.cleared) {
            events.push(WireEvent::AllCleared);
        }
        let b = self.block_tokens as usize;
        for c in self.changes.drain(..) {
            events.push(match c {
                CacheChange::Stored { parent, hashes } => {
                    let mut token_ids = Vec::with_capacity(hashes.len() * b);
                    for h in &hashes {
                        match self.tokens.get(h) {
                            Some((_, ids)) if ids.len() == b => token_ids.extend_from_slice(ids),
                            // Not expected (a store names a held request's blocks): `<unk>`.
                            _ => token_ids.resize(token_ids.len() + b, 0),
                        }
                    }
                    WireEvent::Stored {
                        blocks: hashes,
                        parent,
                        token_ids,
                        block_size: self.block_tokens,
                        medium: Some("GPU".into()),
                    }
                }
                CacheChange::Removed { hashes } => WireEvent::Removed {
                    blocks: hashes,
                    medium: Some("GPU".into()),
                },
            });
        }
        let _ = self.out.send(EventBatch {
            ts: crate::unix_now_s(),
            events,
            // vLLM's single engine annotates its batches with rank 0.
            data_parallel_rank: Some(0),
        });
    }

    /// Reset the prefix cache (every unit no request uses). A reset that empties the cache is
    /// published as vLLM's `AllBlocksCleared`; one that leaves units in use (vLLM would refuse
    /// it) as the removal of those it dropped. Earlier changes go out first.
    pub(crate) fn reset(&mut self, replica: &mut Replica) -> u32 {
        self.publish(replica);
        let n = replica.clear_prefix_cache();
        replica.drain_kv_changes(&mut self.changes);
        if replica.cache().cached_units() == 0 {
            self.changes.clear();
            self.cleared = true;
        }
        n
    }
}

/// The token ids of `text`'s first `blocks` full blocks of `block_tokens` words: each word's id
/// in the word vocabulary, `<unk>` (0) for a word outside it.
pub(crate) fn block_token_ids(text: &str, blocks: usize, block_tokens: u32) -> Vec<u32> {
    text.split_ascii_whitespace()
        .take(blocks * block_tokens as usize)
        .map(|w| word_token_id(w).unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_s_json_is_read_with_its_defaults() {
        let c = KvEventsConfig::from_vllm_json(r#"{"enable_kv_cache_events":true}"#)
            .unwrap()
            .unwrap();
        assert_eq!(c, KvEventsConfig::default());
        assert_eq!(bind_address(&c.endpoint), "tcp://0.0.0.0:5557");
        let c = KvEventsConfig::from_vllm_json(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:0",
                "replay_endpoint":"tcp://*:5558","buffer_steps":5,"hwm":10,"max_queue_size":10,
                "topic":"kv-events"}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                c.endpoint.as_str(),
                c.replay_endpoint.as_deref(),
                c.buffer_steps,
                c.topic.as_str()
            ),
            ("tcp://127.0.0.1:0", Some("tcp://*:5558"), 5, "kv-events")
        );
        // Off: not enabled, or the null publisher.
        for off in [
            "{}",
            r#"{"enable_kv_cache_events":false,"publisher":"zmq"}"#,
            r#"{"enable_kv_cache_events":true,"publisher":"null"}"#,
        ] {
            assert_eq!(KvEventsConfig::from_vllm_json(off), Ok(None), "{off}");
        }
    }

    #[test]
    fn a_bad_key_or_value_is_refused_naming_the_key() {
        for (json, key) in [
            (
                r#"{"enable_kv_cache_events":true,"endpont":"tcp://*:1"}"#,
                "endpont",
            ),
            (
                r#"{"enable_kv_cache_events":"yes"}"#,
                "enable_kv_cache_events",
            ),
            (
                r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#,
                "publisher",
            ),
            (
                r#"{"enable_kv_cache_events":true,"endpoint":"ipc:///tmp/x"}"#,
                "endpoint",
            ),
            (
                r#"{"enable_kv_cache_events":true,"replay_endpoint":"tcp://*"}"#,
                "replay_endpoint",
            ),
            (
                r#"{"enable_kv_cache_events":true,"buffer_steps":0}"#,
                "buffer_steps",
            ),
            (r#"{"enable_kv_cache_events":true,"hwm":-1}"#, "hwm"),
            (r#"{"enable_kv_cache_events":true,"topic":3}"#, "topic"),
        ] {
            let e = KvEventsConfig::from_vllm_json(json).unwrap_err();
            assert!(e.starts_with(&format!("{key}: ")), "{json}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        assert!(KvEventsConfig::from_vllm_json("[1]").is_err());
        assert!(KvEventsConfig::from_vllm_json("{").is_err());
    }

    #[test]
    fn block_token_ids_are_the_words_ids_unknown_as_unk() {
        assert_eq!(
            block_token_ids("w000 w001 hello w002 w003", 1, 3),
            vec![8, 9, 0]
        );
        assert_eq!(block_token_ids("w000 w001", 0, 3), Vec::<u32>::new());
    }
}
