//! Studies: experiment specs ([`spec`]) and the runner that executes them on a backend, stores
//! every step and writes the report.

pub mod spec;
