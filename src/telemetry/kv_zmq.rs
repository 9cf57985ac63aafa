//! KV-cache events over ZMQ, as vLLM publishes them (`--kv-events-config` with the `zmq`
//! publisher): a [`Publisher`] (the emulator's: PUB socket plus the ROUTER replay endpoint and
//! its buffer of recent batches) and a [`subscribe`] task (the router's: SUB socket, sequence
//! checking, replay of a gap, resync when a gap cannot be replayed). Frames and payloads are
//! [`super::kv_events`]'s.
//!
//! **Sequence.** Batches are numbered from 0 per publisher. A subscriber expects each next
//! number; a jump is a gap (ZMQ PUB drops when a subscriber is slow, and a subscriber that
//! joins late has missed the start). With a replay endpoint the subscriber asks for the
//! missing batches (`["", start_seq]` from a DEALER; the publisher answers each buffered batch
//! from `start_seq` on as `["", topic, seq, payload]`, then `["", "", -1, ""]`) and delivers
//! them in order before the new one; without one, or when the buffer no longer holds them, it
//! delivers [`Delivery::Resync`]: the consumer forgets what it knew of that publisher's cache,
//! which is then rebuilt from new events. A number lower than expected means the publisher
//! restarted: a resync too. Each case is counted ([`SubscriberStats`]).

use super::kv_events::{decode_frames, encode_frames, Encoding, EventBatch, Message};
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zeromq::{
    DealerSocket, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

/// The sequence number vLLM's replay endpoint ends a replay with (−1 as 8 bytes).
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long a subscriber waits for a replay's answer.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>())
        .expect("at least one frame")
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The replay buffer, whether or not a panic elsewhere poisoned its lock (it holds whole
/// batches only).
fn locked(b: &Buffer) -> std::sync::MutexGuard<'_, VecDeque<(u64, Bytes)>> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

/// Publishes KV-event batches as vLLM does.
pub struct Publisher {
    sock: PubSocket,
    topic: Vec<u8>,
    enc: Encoding,
    seq: u64,
    buffer: Buffer,
    buffer_steps: usize,
    replay: Option<tokio::task::JoinHandle<()>>,
    /// The PUB socket's bound endpoint (`tcp://host:port`, the port resolved).
    pub endpoint: String,
    /// The replay endpoint's, when there is one.
    pub replay_endpoint: Option<String>,
}

impl Publisher {
    /// Bind the PUB socket at `endpoint` (e.g. `tcp://127.0.0.1:0`) and, given one, the replay
    /// ROUTER at `replay`, keeping the last `buffer_steps` batches for it.
    pub async fn bind(
        endpoint: &str,
        replay: Option<&str>,
        topic: &str,
        buffer_steps: usize,
        enc: Encoding,
    ) -> Result<Self, String> {
        let mut sock = PubSocket::new();
        let bound = sock
            .bind(endpoint)
            .await
            .map_err(|e| format!("KV events: binding {endpoint}: {e}"))?;
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let (replay, replay_endpoint) = match replay {
            None => (None, None),
            Some(r) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(r)
                    .await
                    .map_err(|e| format!("KV events: binding the replay endpoint {r}: {e}"))?;
                let task = tokio::spawn(serve_replay(router, buffer.clone(), topic.into()));
                (Some(task), Some(bound.to_string()))
            }
        };
        Ok(Self {
            sock,
            topic: topic.as_bytes().to_vec(),
            enc,
            seq: 0,
            buffer,
            buffer_steps,
            replay,
            endpoint: bound.to_string(),
            replay_endpoint,
        })
    }

    /// Publish `batch` under the next sequence number (returned).
    pub async fn publish(&mut self, batch: &EventBatch) -> Result<u64, String> {
        let seq = self.seq;
        self.seq += 1;
        let [topic, seq_b, payload] = encode_frames(&self.topic, seq, batch, self.enc);
        let payload = Bytes::from(payload);
        self.remember(seq, payload.clone());
        let m = ZmqMessage::try_from(vec![Bytes::from(topic), Bytes::from(seq_b), payload])
            .expect("three frames");
        self.sock
            .send(m)
            .await
            .map_err(|e| format!("KV events: publishing batch {seq}: {e}"))?;
        Ok(seq)
    }

    /// Skip `n` sequence numbers without sending them (a batch the network lost, for tests of
    /// a subscriber's gap handling; the batches are kept for replay as if sent).
    pub fn lose_next(&mut self, batch: &EventBatch) {
        let seq = self.seq;
        self.seq += 1;
        let [_, _, payload] = encode_frames(&self.topic, seq, batch, self.enc);
        self.remember(seq, Bytes::from(payload));
    }

    /// Keep batch `seq` for the replay endpoint (the last `buffer_steps`).
    fn remember(&self, seq: u64, payload: Bytes) {
        let mut b = locked(&self.buffer);
        b.push_back((seq, payload));
        while b.len() > self.buffer_steps {
            b.pop_front();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(t) = self.replay.take() {
            t.abort();
        }
    }
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: Vec<u8>) {
    while let Ok(req) = router.recv().await {
        let frames = req.into_vec();
        let (id, start) = match frames.as_slice() {
            [id, empty, start] if empty.is_empty() && start.len() == 8 => {
                let mut s = [0u8; 8];
                s.copy_from_slice(start);
                (id.clone(), u64::from_be_bytes(s))
            }
            _ => continue, // not a replay request: ignored, as vLLM does
        };
        let batches: Vec<(u64, Bytes)> = locked(&buffer)
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let m = ZmqMessage::try_from(vec![
                id.clone(),
                Bytes::new(),
                Bytes::from(topic.clone()),
                Bytes::from(seq.to_be_bytes().to_vec()),
                payload,
            ])
            .expect("frames");
            if router.send(m).await.is_err() {
                break;
            }
        }
        let end = msg(vec![
            id.to_vec(),
            Vec::new(),
            Vec::new(),
            END_SEQ.to_vec(),
            Vec::new(),
        ]);
        let _ = router.send(end).await;
    }
}

/// What a subscriber hands its consumer.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// The next batch, in sequence order.
    Batch(Message),
    /// Events were lost beyond repair: forget this publisher's cache and rebuild from here.
    Resync,
}

/// A subscriber's counters.
#[derive(Debug, Default)]
pub struct SubscriberStats {
    /// Batches delivered (replayed ones included).
    pub batches: AtomicU64,
    /// Sequence gaps seen.
    pub gaps: AtomicU64,
    /// Batches recovered from the replay endpoint.
    pub replayed: AtomicU64,
    /// Resyncs delivered (a gap the replay could not fill, or a publisher restart).
    pub resyncs: AtomicU64,
    /// Messages that could not be decoded (dropped, counted).
    pub undecodable: AtomicU64,
}

impl SubscriberStats {
    /// (batches, gaps, replayed, resyncs, undecodable).
    pub fn snapshot(&self) -> [u64; 5] {
        [
            &self.batches,
            &self.gaps,
            &self.replayed,
            &self.resyncs,
            &self.undecodable,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }
}

/// Subscribe to `endpoint` (topic prefix `topic`), with replay from `replay` when given, and
/// deliver in order to `out` until it is closed. Connection failures are retried by ZMQ.
pub async fn subscribe(
    endpoint: String,
    replay: Option<String>,
    topic: String,
    out: tokio::sync::mpsc::UnboundedSender<Delivery>,
    stats: Arc<SubscriberStats>,
) -> Result<(), String> {
    let mut sub = SubSocket::new();
    sub.connect(&endpoint)
        .await
        .map_err(|e| format!("KV events: connecting to {endpoint}: {e}"))?;
    sub.subscribe(&topic)
        .await
        .map_err(|e| format!("KV events: subscribing to {endpoint}: {e}"))?;
    let mut dealer = match &replay {
        None => None,
        Some(r) => {
            let mut d = DealerSocket::new();
            d.connect(r)
                .await
                .map_err(|e| format!("KV events: connecting to the replay endpoint {r}: {e}"))?;
            Some(d)
        }
    };
    let mut expected: Option<u64> = None;
    let send = |d: Delivery| out.send(d).is_ok();
    loop {
        let m = match sub.recv().await {
            Ok(m) => m,
            Err(_) => return Ok(()),
        };
        let frames: Vec<Bytes> = m.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let m = match decode_frames(&refs) {
            Ok(m) => m,
            Err(_) => {
                stats.undecodable.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        // The first batch from a publisher seen mid-stream, or a jump: ask for what came
        // before it (a late subscriber learns the recent cache this way).
        let from = match expected {
            None if m.seq > 0 => Some(0),
            Some(e) if m.seq > e => Some(e),
            Some(e) if m.seq < e => {
                // Lower than expected: the publisher restarted.
                stats.resyncs.fetch_add(1, Ordering::Relaxed);
                if !send(Delivery::Resync) {
                    return Ok(());
                }
                None
            }
            _ => None,
        };
        if let Some(from) = from {
            if expected.is_some() {
                stats.gaps.fetch_add(1, Ordering::Relaxed);
            }
            let got = match dealer.as_mut() {
                Some(d) => replay_range(d, from, m.seq, &stats).await,
                None => Vec::new(),
            };
            let complete =
                got.len() as u64 == m.seq - from && got.iter().zip(from..).all(|(b, s)| b.seq == s);
            if complete {
                for b in got {
                    stats.replayed.fetch_add(1, Ordering::Relaxed);
                    stats.batches.fetch_add(1, Ordering::Relaxed);
                    if !send(Delivery::Batch(b)) {
                        return Ok(());
                    }
                }
            } else if expected.is_some() || replay.is_some() {
                // A gap nothing could fill (a late start without replay is no loss to report:
                // the consumer had nothing yet).
                stats.resyncs.fetch_add(1, Ordering::Relaxed);
                if !send(Delivery::Resync) {
                    return Ok(());
                }
            }
        }
        expected = Some(m.seq + 1);
        stats.batches.fetch_add(1, Ordering::Relaxed);
        if !send(Delivery::Batch(m)) {
            return Ok(());
        }
    }
}

/// Ask the replay endpoint for batches `from..until` (the answer runs to the buffer's end; the
/// ones at or past `until` are dropped: they arrive on the PUB socket too).
async fn replay_range(
    d: &mut DealerSocket,
    from: u64,
    until: u64,
    stats: &SubscriberStats,
) -> Vec<Message> {
    if d.send(msg(vec![Vec::new(), from.to_be_bytes().to_vec()]))
        .await
        .is_err()
    {
        return Vec::new();
    }
    let mut got = Vec::new();
    loop {
        let m = match tokio::time::timeout(REPLAY_TIMEOUT, d.recv()).await {
            Ok(Ok(m)) => m,
            _ => return got,
        };
        let frames = m.into_vec();
        // ["", topic, seq, payload]
        let rest: Vec<&[u8]> = frames.iter().skip(1).map(|f| f.as_ref()).collect();
        if rest.get(1) == Some(&&END_SEQ[..]) {
            return got;
        }
        match decode_frames(&rest) {
            Ok(b) if b.seq >= from && b.seq < until => got.push(b),
            Ok(_) => {}
            Err(_) => {
                stats.undecodable.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}
