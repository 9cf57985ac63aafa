//! Workloads: per-key rates, the trace format, arrival processes, synthetic generation,
//! importers and statistics. Pure logic: readers take `BufRead`, writers take `Write`,
//! randomness is passed in (`crate::rng`), no clock. Nothing here depends on the live layers.

pub mod arrivals;
pub mod gen;
pub mod import;
pub mod rates;
pub mod stats;
pub mod text;
pub mod trace;
