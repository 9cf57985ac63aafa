//! Telemetry: engine `/metrics` scraping ([`prom`]). Samples land in the store's telemetry
//! table, tied to study, run and step.

pub mod gpu;
pub mod prom;
