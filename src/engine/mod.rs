//! The engine model: a first-principles, vLLM-like model of one serving replica, shared by the
//! simulator (`sim`) and the engine emulator. Pure: no I/O, no clock of its own (time is passed
//! in as `f64` seconds), no randomness; the same inputs give the same outputs bit for bit.
//! Every formula and constant, with its source, is in `docs/engine-model.md`.
//!
//! Pieces:
//! - [`cards`]: model cards (Llama-3.3-70B, Llama-3.1-8B, Qwen2.5-32B, `tiny`), device cards
//!   (`h100`, `h200`, `cpu`), [`Precision`].
//! - [`EngineSpec`]: `model:device:precision:tpN[:kv-<precision>]`, e.g.
//!   `llama-3.3-70b:h100:fp8:tp2`; `FromStr`, `Display`, serde as that string.
//! - [`EngineConfig`]: derived numbers (`kv_bytes_per_token`, `kv_capacity_tokens`,
//!   `kv_capacity_blocks`) and costs (`prefill_time(new, cached)`,
//!   `decode_step_time(batch, context)`, `step_time`), built from a spec and [`EngineKnobs`].
//!   [`calibrate_flagship`] fits MFU, bandwidth efficiency and step overhead once.
//! - [`PrefixCache`]: paged KV blocks and the chain-hashed prefix cache with an O(1) LRU over
//!   unreferenced units.
//! - [`Replica`]: continuous batching with chunked prefill, KV-limited admission, preemption,
//!   prefix reuse; event-driven.
//! - [`chain_hashes`]: trace `hash_ids` → chain hashes.
//!
//! # Driving a replica
//!
//! ```
//! use cacheroute::engine::{chain_hashes, EngineConfig, EngineEvent, EngineRequest, Replica};
//!
//! let cfg = EngineConfig::parse("llama-3.3-70b:h100:fp8:tp2").unwrap();
//! let mut replica = Replica::new(cfg);
//! let mut events = Vec::new();
//! // An arrival at t = 0: route it, then submit (this may cut a running decode segment short).
//! let hashes = chain_hashes(&(0..200).collect::<Vec<u64>>());
//! let req = EngineRequest { id: 7, prompt_tokens: 3200, output_tokens: 300, block_hashes: hashes };
//! replica.submit(req, 0.0).unwrap();
//! // Event loop: the simulator keeps one entry per replica at `next_event_time()` in its heap,
//! // refreshed after every `submit` and `advance` on that replica.
//! while let Some(t) = replica.next_event_time() {
//!     replica.advance(t, &mut events);
//! }
//! let EngineEvent::Finished { stats, .. } = events.last().unwrap() else { panic!() };
//! assert_eq!(stats.output_tokens, 300);
//! assert!(stats.ttft_s > 0.0 && stats.e2e_s > stats.ttft_s);
//! ```
//!
//! Rules for the caller: times given to one replica never decrease; after `submit` or
//! `advance`, re-read `next_event_time()` (a submit to an idle replica asks for an event at
//! `now`; a submit during a run of decode steps moves its end earlier). Counters, queue lengths,
//! `queued_prefill_tokens()` and `kv_usage()` are as of the last event processed.

pub mod cards;
mod config;
mod failure;
pub mod kv;
mod replica;
mod spec;

pub use cards::{DeviceCard, ModelCard, Precision};
pub use config::{
    calibrate_flagship, engine_config, Calibration, EngineConfig, EngineKnobs, KnobOverrides,
    FLAGSHIP_POINTS,
};
pub use failure::Failure;
pub use kv::{CacheChange, PrefixCache};
pub use replica::{EngineCounters, EngineEvent, EngineRequest, Replica, RequestStats};
pub use spec::EngineSpec;

/// Errors of the engine model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The spec string does not have 4 or 5 `:`-separated parts.
    #[error(
        "engine spec `{spec}`: expected model:device:precision:tpN[:kv-<precision>] \
         (e.g. llama-3.3-70b:h100:fp8:tp2), got {parts} part(s)"
    )]
    SpecShape {
        /// The spec as given.
        spec: String,
        /// Number of parts found.
        parts: usize,
    },
    /// One part of the spec names nothing known.
    #[error("engine spec `{spec}`: unknown {part} `{value}`; valid choices: {valid}")]
    BadSpec {
        /// The spec as given.
        spec: String,
        /// Which part (model, device, precision, tensor parallel, kv precision).
        part: String,
        /// The offending value.
        value: String,
        /// What would be accepted.
        valid: String,
    },
    /// Knobs out of range (all problems listed).
    #[error("engine `{spec}`: invalid settings: {problems}")]
    InvalidKnobs {
        /// The spec.
        spec: String,
        /// Every problem, `;`-separated.
        problems: String,
    },
    /// The weights leave no room for a KV cache.
    #[error(
        "engine `{spec}`: no memory left for the KV cache ({weight_gib:.1} GiB of weights, \
         {memory_gib:.1} GiB usable); use fp8 weights, a larger tensor-parallel degree or a \
         larger device"
    )]
    NoKvMemory {
        /// The spec.
        spec: String,
        /// Weight bytes, GiB.
        weight_gib: f64,
        /// Usable memory (utilisation × memory × TP), GiB.
        memory_gib: f64,
    },
    /// A request can never fit in this replica's KV cache.
    #[error(
        "request {id}: {tokens} prompt+output tokens exceed the replica's KV capacity of \
         {capacity} tokens; shorten the request or use a configuration with more KV memory"
    )]
    RequestTooLarge {
        /// Request id.
        id: u64,
        /// Prompt + output − 1 tokens.
        tokens: u64,
        /// KV capacity in tokens.
        capacity: u64,
    },
    /// A request with an empty prompt.
    #[error("request {id}: the prompt has 0 tokens; every request needs at least one")]
    EmptyPrompt {
        /// Request id.
        id: u64,
    },
}

/// Seed of the first chain hash, so that chains never collide with raw ids.
const CHAIN_SEED: u64 = 0x6361_6368_6572_6f75; // "cacherou"

/// Chain hashes of a trace's per-block `hash_ids`: `h₀ = H(seed, id₀)`, `hᵢ = H(hᵢ₋₁, idᵢ)`
/// (xxh3-64 keyed by the previous hash). Equal leading ids give equal hashes; an id reused at
/// another position or after another prefix gives a different hash.
pub fn chain_hashes(ids: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(ids.len());
    chain_hashes_into(ids.iter().copied(), &mut out);
    out
}

/// [`chain_hashes`] appending into a reused buffer.
pub fn chain_hashes_into(ids: impl IntoIterator<Item = u64>, out: &mut Vec<u64>) {
    // A keyed 128-bit multiply-fold per block (the mixing step of wyhash): a few
    // nanoseconds, where a general-purpose hash call per block dominated simulation time.
    let mut prev = CHAIN_SEED;
    for id in ids {
        prev = chain_next(prev, id);
        out.push(prev);
    }
}

/// The chain hash of block `id` after the block whose chain hash is `prev` (`None`: the first
/// block of a prompt): one step of [`chain_hashes`].
#[inline]
pub fn chain_step(prev: Option<u64>, id: u64) -> u64 {
    chain_next(prev.unwrap_or(CHAIN_SEED), id)
}

#[inline]
fn chain_next(prev: u64, id: u64) -> u64 {
    let a = (prev ^ 0xa076_1d64_78bd_642f) as u128;
    let b = (id ^ 0xe703_7ed1_a0b4_28db) as u128;
    let m = a.wrapping_mul(b);
    ((m >> 64) as u64 ^ m as u64).wrapping_add(prev.rotate_left(23))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_hashes_depend_on_the_whole_prefix() {
        let a = chain_hashes(&[1, 2, 3]);
        let b = chain_hashes(&[1, 2, 4]);
        let c = chain_hashes(&[9, 2, 3]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same id at the same position after a different prefix: different hash.
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        // Same id at another position: different hash.
        let d = chain_hashes(&[5, 5]);
        assert_ne!(d[0], d[1]);
    }
}
