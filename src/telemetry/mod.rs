//! Telemetry: engine `/metrics` scraping ([`prom`]), vLLM's KV-cache events ([`kv_events`]) and what each engine's dialect names
//! ([`engine_api`]). Samples land in the store's telemetry
//! table, tied to study, run and step.

pub mod engine_api;
pub mod gpu;
pub mod kv_events;
pub mod kv_zmq;
pub mod nvml;
pub mod prom;
