//! Shared helpers for the live-path integration tests (servers on 127.0.0.1, ephemeral ports).
#![allow(dead_code)]

pub mod mock_engine;
pub mod procs;
pub mod raw;
pub mod study;
