//! cacheroute: plan, route, measure and simulate prefix-affinity routing for LLM serving fleets.
//!
//! Layering (docs/architecture.md): `plan`, `policy`, `workload`, `engine` and `analysis` are pure logic
//! (no I/O of their own except explicit readers/writers, no clock, no global RNG); `sim` composes
//! them on a virtual clock; the live layers sit on top and never the other way round.
//!
//! `unsafe` is forbidden in every module but five: `plan` (the two-thread bucket sort and the
//! SIMD kernels), `process`, `experiment`, `peer` and `cli` (signals and `poll` on processes
//! this program started); each block there says why it is sound in a `SAFETY:` comment, which
//! clippy enforces (`[lints]` in Cargo.toml).

#[forbid(unsafe_code)]
pub mod analysis;
#[forbid(unsafe_code)]
pub mod bounds;
pub mod cli;
#[forbid(unsafe_code)]
pub mod control;
#[forbid(unsafe_code)]
pub mod emulate;
#[forbid(unsafe_code)]
pub mod engine;
pub mod experiment;
#[forbid(unsafe_code)]
pub mod fleet;
#[forbid(unsafe_code)]
pub mod loadgen;
pub mod peer;
pub mod plan;
#[forbid(unsafe_code)]
pub mod policy;
pub mod process;
#[forbid(unsafe_code)]
pub mod progress;
#[forbid(unsafe_code)]
pub mod report;
#[forbid(unsafe_code)]
pub mod rng;
#[forbid(unsafe_code)]
pub mod router;
#[forbid(unsafe_code)]
pub mod sim;
#[forbid(unsafe_code)]
pub mod store;
#[forbid(unsafe_code)]
pub mod telemetry;
#[forbid(unsafe_code)]
pub mod workload;

/// `e` and its sources joined by `: ` (libraries' own messages often say only "error sending
/// request" or "failed to connect"; their sources say what happened), each said once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        let m = x.to_string();
        if !msg.contains(&m) {
            msg.push_str(": ");
            msg.push_str(&m);
        }
        src = x.source();
    }
    msg
}

/// The system clock as seconds since the Unix epoch (0 before it): the wall-clock stamp of
/// live telemetry and logs, comparable across processes and hosts. Pure logic takes its time
/// as an argument instead.
pub fn unix_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Stable 64-bit hash of a routing key. Every layer (planner tables, policies, simulator,
/// router) identifies a key by this value so that a key maps identically everywhere.
pub fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}
