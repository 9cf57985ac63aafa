//! Diagnostics for every command: `tracing` events to stderr, filtered by `RUST_LOG` (default
//! `info`), as text or one JSON object per line (`--log-format json`). Results a command
//! prints (reports, summaries, `listening on …`) stay on stdout and are not log events.
//!
//! What may be logged: destinations, key hashes, counts, timings, statuses, URLs of backends.
//! Never prompt or completion text, token ids or header values (`tests/router_logs.rs` greps a
//! trace-level run's logs for a prompt's text and tokens).

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// stderr, each log line written with the progress bars cleared
/// ([`crate::progress::suspend`]).
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::progress::suspend(|| std::io::stderr().write(buf))
    }
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        crate::progress::suspend(|| std::io::stderr().write_all(buf))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// How log lines are written.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines: time, level, module, message, fields.
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, message and the fields.
    Json,
}

/// Install the global subscriber. A `RUST_LOG` that does not parse is said once (in the chosen
/// format) and `info` is used instead. Called once, first thing in `cli::main`.
pub fn init(format: LogFormat) {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => match EnvFilter::try_new(&v) {
            Ok(f) => (f, None),
            Err(e) => (EnvFilter::new("info"), Some((v, e.to_string()))),
        },
        _ => (EnvFilter::new("info"), None),
    };
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| Stderr)
        .with_ansi(false);
    let done = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
    if done.is_ok() {
        if let Some((v, e)) = bad {
            tracing::warn!("RUST_LOG={v:?} is not a valid filter ({e}); logging at info (e.g. RUST_LOG=debug or RUST_LOG=cacheroute::router=debug)");
        }
    }
}
