//! Workloads: per-key rates, traces, synthetic generation, import and statistics. Pure logic:
//! readers take `BufRead`, randomness is passed in.

pub mod rates;
