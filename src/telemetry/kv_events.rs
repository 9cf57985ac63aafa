//! vLLM's KV-cache events on the wire: what `vllm serve --kv-events-config
//! '{"enable_kv_cache_events":true,"publisher":"zmq",…}'` publishes, decoded and encoded.
//!
//! **Frames.** A ZMQ PUB message of three frames: the topic, the batch's sequence number (8 bytes,
//! big-endian, counting from 0 per publisher), and the msgpack payload. The replay endpoint (a
//! ROUTER socket) answers a request `[start_seq as 8 bytes big-endian]` with
//! `["", topic, seq, payload]` per buffered batch from `start_seq` on, then `["", "", -1, ""]`
//! (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`, as of 0.32.0).
//!
//! **Payload.** `KVEventBatch` is a positional array `[ts, events, data_parallel_rank?]`. Each
//! event is one of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, in either of the two
//! encodings vLLM has used:
//! - **tagged map** (current): `{"type": "BlockStored", "block_hashes": […],
//!   "parent_block_hash": h | nil, "token_ids": […], "block_size": n, "lora_id": …, "medium": …,
//!   …}`; fields this decoder does not know are skipped;
//! - **tagged array** (older releases): `["BlockStored", block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium?]`, `["BlockRemoved", block_hashes, medium?]`,
//!   `["AllBlocksCleared"]`.
//!
//! A block hash (`ExternalBlockHash`) is an integer or a byte string (a digest); both become a
//! `u64` here: an integer as itself, a byte string by xxh3 of its bytes.
//!
//! Pure: bytes in, values out; the sockets are the emulator's and the router's.

use rmpv::Value;

/// One event of a batch, with the engine's own block hashes.
#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    /// Blocks now cached, in prefix order; `blocks[0]` follows `parent`.
    Stored {
        blocks: Vec<u64>,
        parent: Option<u64>,
        /// The blocks' tokens, `block_size` per block.
        token_ids: Vec<u32>,
        block_size: u32,
        /// `GPU` (or absent) for the engine's own cache; an offload tier otherwise.
        medium: Option<String>,
    },
    Removed {
        blocks: Vec<u64>,
        medium: Option<String>,
    },
    AllCleared,
}

impl WireEvent {
    /// Whether the event is about the GPU cache (the one a request's prefill reuses): medium
    /// absent or `GPU`.
    pub fn on_gpu(&self) -> bool {
        match self {
            WireEvent::Stored { medium, .. } | WireEvent::Removed { medium, .. } => medium
                .as_deref()
                .is_none_or(|m| m.eq_ignore_ascii_case("gpu")),
            WireEvent::AllCleared => true,
        }
    }
}

/// A `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The publisher's wall time, seconds.
    pub ts: f64,
    pub events: Vec<WireEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Which event encoding to write (the decoder reads both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `{"type": …, field: value, …}` (vLLM's current one).
    TaggedMap,
    /// `[tag, field, …]` (older vLLM releases).
    TaggedArray,
}

/// One published message: topic, sequence number and batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: EventBatch,
}

/// The three frames of a published message.
pub fn decode_frames(frames: &[&[u8]]) -> Result<Message, String> {
    let [topic, seq, payload] = frames else {
        return Err(format!(
            "a KV-event message has 3 frames (topic, sequence, payload), not {}",
            frames.len()
        ));
    };
    let seq: [u8; 8] = (*seq)
        .try_into()
        .map_err(|_| format!("sequence frame: 8 bytes expected, {} read", seq.len()))?;
    Ok(Message {
        topic: topic.to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload)?,
    })
}

/// A message's frames (topic, 8-byte big-endian sequence, payload).
pub fn encode_frames(topic: &[u8], seq: u64, batch: &EventBatch, enc: Encoding) -> [Vec<u8>; 3] {
    [
        topic.to_vec(),
        seq.to_be_bytes().to_vec(),
        encode_batch(batch, enc),
    ]
}

/// Decode one msgpack `KVEventBatch`.
pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, String> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| format!("payload: not msgpack: {e}"))?;
    if !rd.is_empty() {
        return Err(format!("payload: {} bytes after the batch", rd.len()));
    }
    let Value::Array(parts) = v else {
        return Err("payload: a batch is an array [ts, events, data_parallel_rank]".into());
    };
    let ts = match parts.first() {
        Some(Value::F64(t)) => *t,
        Some(Value::F32(t)) => *t as f64,
        Some(v) if v.as_i64().is_some() => v.as_i64().unwrap_or(0) as f64,
        _ => return Err("payload: the batch's first field (ts) is not a number".into()),
    };
    let events = match parts.get(1) {
        Some(Value::Array(es)) => es
            .iter()
            .enumerate()
            .map(|(i, e)| decode_event(e).map_err(|m| format!("event {i}: {m}")))
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err("payload: the batch's second field (events) is not an array".into()),
    };
    let data_parallel_rank = match parts.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or("payload: data_parallel_rank is not an integer")?,
        ),
    };
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn hash(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .ok_or_else(|| format!("{what}: integer out of range")),
        Value::Binary(b) => Ok(xxhash_rust::xxh3::xxh3_64(b)),
        _ => Err(format!("{what}: a block hash is an integer or bytes")),
    }
}

fn hashes(v: Option<&Value>, what: &str) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(a)) => a.iter().map(|h| hash(h, what)).collect(),
        _ => Err(format!("{what}: an array of block hashes expected")),
    }
}

fn opt_hash(v: Option<&Value>, what: &str) -> Result<Option<u64>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(h) => hash(h, what).map(Some),
    }
}

fn tokens(v: Option<&Value>) -> Result<Vec<u32>, String> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| "token_ids: a token id is a u32".to_string())
            })
            .collect(),
        _ => Err("token_ids: an array expected".into()),
    }
}

fn opt_str(v: Option<&Value>) -> Option<String> {
    v.and_then(|v| v.as_str()).map(str::to_owned)
}

fn decode_event(v: &Value) -> Result<WireEvent, String> {
    match v {
        Value::Map(kv) => {
            let get = |k: &str| {
                kv.iter()
                    .find(|(key, _)| key.as_str() == Some(k))
                    .map(|(_, v)| v)
            };
            let tag = get("type")
                .and_then(|t| t.as_str())
                .ok_or("a tagged map without a string `type`")?;
            match tag {
                "BlockStored" => Ok(WireEvent::Stored {
                    blocks: hashes(get("block_hashes"), "block_hashes")?,
                    parent: opt_hash(get("parent_block_hash"), "parent_block_hash")?,
                    token_ids: tokens(get("token_ids"))?,
                    block_size: block_size(get("block_size"))?,
                    medium: opt_str(get("medium")),
                }),
                "BlockRemoved" => Ok(WireEvent::Removed {
                    blocks: hashes(get("block_hashes"), "block_hashes")?,
                    medium: opt_str(get("medium")),
                }),
                "AllBlocksCleared" => Ok(WireEvent::AllCleared),
                other => Err(format!("unknown event type `{other}`")),
            }
        }
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(|t| t.as_str())
                .ok_or("a tagged array without a string tag first")?;
            match tag {
                "BlockStored" => Ok(WireEvent::Stored {
                    blocks: hashes(a.get(1), "block_hashes")?,
                    parent: opt_hash(a.get(2), "parent_block_hash")?,
                    token_ids: tokens(a.get(3))?,
                    block_size: block_size(a.get(4))?,
                    medium: opt_str(a.get(6)),
                }),
                "BlockRemoved" => Ok(WireEvent::Removed {
                    blocks: hashes(a.get(1), "block_hashes")?,
                    medium: opt_str(a.get(2)),
                }),
                "AllBlocksCleared" => Ok(WireEvent::AllCleared),
                other => Err(format!("unknown event type `{other}`")),
            }
        }
        _ => Err("an event is a tagged map or a tagged array".into()),
    }
}

fn block_size(v: Option<&Value>) -> Result<u32, String> {
    v.and_then(|v| v.as_u64())
        .and_then(|x| u32::try_from(x).ok())
        .filter(|&x| x > 0)
        .ok_or_else(|| "block_size: a positive integer expected".to_string())
}

/// Encode a batch as msgpack, its events in `enc`.
pub fn encode_batch(batch: &EventBatch, enc: Encoding) -> Vec<u8> {
    let hs = |b: &[u64]| Value::Array(b.iter().map(|&h| Value::from(h)).collect());
    let opt = |s: &Option<String>| s.as_deref().map_or(Value::Nil, Value::from);
    let events = batch
        .events
        .iter()
        .map(|e| {
            let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
                WireEvent::Stored {
                    blocks,
                    parent,
                    token_ids,
                    block_size,
                    medium,
                } => (
                    "BlockStored",
                    vec![
                        ("block_hashes", hs(blocks)),
                        ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                        (
                            "token_ids",
                            Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                        ),
                        ("block_size", Value::from(*block_size)),
                        ("lora_id", Value::Nil),
                        ("medium", opt(medium)),
                    ],
                ),
                WireEvent::Removed { blocks, medium } => (
                    "BlockRemoved",
                    vec![("block_hashes", hs(blocks)), ("medium", opt(medium))],
                ),
                WireEvent::AllCleared => ("AllBlocksCleared", vec![]),
            };
            match enc {
                Encoding::TaggedMap => Value::Map(
                    std::iter::once((Value::from("type"), Value::from(tag)))
                        .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                        // vLLM 0.32's `BlockStored` requires `lora_name` (no default).
                        .chain(
                            matches!(e, WireEvent::Stored { .. })
                                .then(|| (Value::from("lora_name"), Value::Nil)),
                        )
                        .collect(),
                ),
                Encoding::TaggedArray => Value::Array(
                    std::iter::once(Value::from(tag))
                        .chain(fields.into_iter().map(|(_, v)| v))
                        .collect(),
                ),
            }
        })
        .collect();
    let mut parts = vec![Value::F64(batch.ts), Value::Array(events)];
    if let Some(r) = batch.data_parallel_rank {
        parts.push(Value::from(r));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(parts)).expect("writing to a Vec");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> EventBatch {
        EventBatch {
            ts: 1.5,
            events: vec![
                WireEvent::Stored {
                    blocks: vec![11, 12],
                    parent: None,
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    medium: Some("GPU".into()),
                },
                WireEvent::Stored {
                    blocks: vec![13],
                    parent: Some(12),
                    token_ids: (32..48).collect(),
                    block_size: 16,
                    medium: None,
                },
                WireEvent::Removed {
                    blocks: vec![11],
                    medium: Some("CPU".into()),
                },
                WireEvent::AllCleared,
            ],
            data_parallel_rank: Some(0),
        }
    }

    #[test]
    fn both_encodings_round_trip() {
        for enc in [Encoding::TaggedMap, Encoding::TaggedArray] {
            let b = batch();
            assert_eq!(decode_batch(&encode_batch(&b, enc)).unwrap(), b, "{enc:?}");
            let f = encode_frames(b"kv-events", 7, &b, enc);
            let m = decode_frames(&[&f[0], &f[1], &f[2]]).unwrap();
            assert_eq!((m.topic.as_slice(), m.seq), (&b"kv-events"[..], 7));
        }
    }

    /// Bytes as vLLM 0.32.0's msgspec writes them (the tagged-map encoding with every field,
    /// a byte-string hash as its sha256 digests are), built by hand here with rmpv.
    #[test]
    fn a_current_vllm_batch_with_digest_hashes_and_unknown_fields_decodes() {
        let digest = vec![0xab_u8; 32];
        let ev = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::Binary(digest.clone())]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array((0..16u32).map(Value::from).collect()),
            ),
            (Value::from("block_size"), Value::from(16)),
            (Value::from("lora_id"), Value::Nil),
            (Value::from("medium"), Value::from("GPU")),
            (Value::from("lora_name"), Value::Nil),
            (Value::from("group_idx"), Value::from(0)),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(
            &mut bytes,
            &Value::Array(vec![Value::F64(2.0), Value::Array(vec![ev])]),
        )
        .unwrap();
        let b = decode_batch(&bytes).unwrap();
        assert_eq!(b.data_parallel_rank, None);
        match &b.events[0] {
            WireEvent::Stored { blocks, .. } => {
                assert_eq!(blocks, &vec![xxhash_rust::xxh3::xxh3_64(&digest)])
            }
            e => panic!("{e:?}"),
        }
        assert!(b.events[0].on_gpu());
    }

    #[test]
    fn broken_payloads_are_refused_naming_the_part() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0x92, 0xcb], "not msgpack"),
            (encode_value(Value::from(3)), "a batch is an array"),
            (
                encode_value(Value::Array(vec![Value::from("x")])),
                "first field (ts)",
            ),
            (
                encode_value(Value::Array(vec![Value::F64(1.0), Value::from(2)])),
                "second field (events)",
            ),
            (
                encode_value(Value::Array(vec![
                    Value::F64(1.0),
                    Value::Array(vec![Value::Array(vec![Value::from("BlockEaten")])]),
                ])),
                "event 0: unknown event type `BlockEaten`",
            ),
            (
                encode_value(Value::Array(vec![
                    Value::F64(1.0),
                    Value::Array(vec![Value::Array(vec![
                        Value::from("BlockStored"),
                        Value::Array(vec![Value::from("h")]),
                    ])]),
                ])),
                "block_hashes",
            ),
            (
                encode_value(Value::Array(vec![
                    Value::F64(1.0),
                    Value::Array(vec![Value::Array(vec![
                        Value::from("BlockStored"),
                        Value::Array(vec![Value::from(1)]),
                        Value::Nil,
                        Value::Array(vec![]),
                        Value::from(0),
                    ])]),
                ])),
                "block_size",
            ),
        ];
        for (bytes, want) in cases {
            let err = decode_batch(&bytes).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
            assert!(!err.contains('\n'));
        }
        let err = decode_frames(&[b"t", b"123", b""]).unwrap_err();
        assert!(err.contains("8 bytes"), "{err}");
        let err = decode_frames(&[b"t"]).unwrap_err();
        assert!(err.contains("3 frames"), "{err}");
    }

    fn encode_value(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }
}
