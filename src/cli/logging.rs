//! Diagnostics for every command: `tracing` events to stderr, filtered by `RUST_LOG` (default
//! `info`), as text or one JSON object per line (`--log-format json`). Results a command
//! prints (reports, summaries, `listening on …`) stay on stdout and are not log events.
//!
//! What may be logged: destinations, key hashes, counts, timings, statuses, URLs of backends.
//! Never prompt or completion text, token ids or header values (`tests/router_logs.rs` greps a
//! trace-level run's logs for a prompt's text and tokens).

use clap::ValueEnum;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

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
        Ok(v) if !v.trim().is_empty() => match filter(&v) {
            Ok(f) => (f, None),
            Err(e) => (default_filter(), Some((v, e))),
        },
        _ => (default_filter(), None),
    };
    // The builder's own filter lets everything through (its default is INFO); `filter` decides.
    let b = tracing_subscriber::fmt()
        .with_max_level(tracing::level_filters::LevelFilter::TRACE)
        .with_writer(|| Stderr)
        .with_ansi(false);
    let done = match format {
        LogFormat::Text => b.finish().with(filter).try_init(),
        LogFormat::Json => b
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .finish()
            .with(filter)
            .try_init(),
    };
    if done.is_ok() {
        if let Some((v, e)) = bad {
            tracing::warn!("RUST_LOG={v:?} is not a valid filter ({e}); logging at info (e.g. RUST_LOG=debug or RUST_LOG=cacheroute::router=debug)");
        }
    }
}

fn default_filter() -> Targets {
    Targets::new().with_default(tracing::Level::INFO)
}

/// `RUST_LOG` as comma-separated directives: a level (`debug`) for everything, or
/// `target=level` (`cacheroute::router=debug`); levels are `off`, `error`, `warn`, `info`,
/// `debug`, `trace`. Span and field filters (`[span{field}]`) are not supported and refused.
fn filter(v: &str) -> Result<Targets, String> {
    if v.contains('[') || v.contains('{') {
        return Err("span and field filters are not supported; use LEVEL or TARGET=LEVEL".into());
    }
    v.parse::<Targets>().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn rust_log_directives_parse_and_bad_ones_are_refused() {
        let f = filter("warn,cacheroute::router=debug").unwrap();
        assert!(f.would_enable("cacheroute::router::proxy", &Level::DEBUG));
        assert!(!f.would_enable("cacheroute::router::proxy", &Level::TRACE));
        assert!(!f.would_enable("sqlx::query", &Level::INFO));
        assert!(f.would_enable("sqlx::query", &Level::WARN));
        assert!(filter("debug").unwrap().would_enable("x", &Level::DEBUG));
        assert!(filter("cacheroute=loud").is_err());
        assert!(filter("info,[span{field=1}]=debug").is_err());
        assert!(default_filter().would_enable("x", &Level::INFO));
        assert!(!default_filter().would_enable("x", &Level::DEBUG));
    }
}
