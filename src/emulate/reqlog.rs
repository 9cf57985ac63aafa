//! The emulator's request log (`--request-log FILE`): one JSON line per generation request
//! with server-side wall-clock times, the truth a load generator's own latencies are checked
//! against (`benches/replayer_vs_peers.sh`).
//!
//! Off the hot path: each response body is wrapped ([`LoggedBody`]) to note when its first
//! frame and its end were handed to the HTTP server; the finished line goes through a bounded
//! channel to one writer thread (a `BufWriter`, flushed every second and at shutdown). A full
//! channel drops the line and counts it (said at shutdown) rather than slow a response down.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use hyper::body::{Body as HttpBody, Frame};

/// Lines the channel holds before it drops (a few seconds at 10k requests/s).
const CHANNEL_LINES: usize = 1 << 16;
/// How often buffered lines are written out while the emulator runs.
const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Prompt and output tokens of a generation response, put in its extensions by the handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoggedTokens {
    pub prompt: u32,
    pub output: u32,
    pub stream: bool,
}

/// One request's line.
#[derive(Debug, serde::Serialize)]
struct Line {
    /// Head read (the HTTP server handed the request over), Unix seconds.
    arrival_s: f64,
    /// First body bytes of the answer handed to the HTTP server (streamed: the first token's
    /// chunk; whole: the body); `null` for an error status or an empty body.
    first_token_s: Option<f64>,
    /// The answer's last bytes handed to the HTTP server (or the client gone).
    end_s: f64,
    path: String,
    status: u16,
    stream: bool,
    prompt_tokens: u32,
    output_tokens: u32,
    /// Every byte of the answer was handed over (false: the client went away first).
    complete: bool,
}

enum Msg {
    Line(Line),
    Stop,
}

/// The sending side, shared by every connection.
#[derive(Clone)]
pub(crate) struct RequestLog {
    tx: SyncSender<Msg>,
    dropped: Arc<AtomicU64>,
}

/// The writer thread, owned by the emulator handle.
pub(crate) struct RequestLogWriter {
    log: RequestLog,
    path: PathBuf,
    thread: std::thread::JoinHandle<std::io::Result<u64>>,
}

impl std::fmt::Debug for RequestLogWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestLogWriter")
            .field("path", &self.path)
            .finish()
    }
}

/// Create (truncate) `path` and start its writer thread.
pub(crate) fn open(path: &Path) -> std::io::Result<RequestLogWriter> {
    let file = std::fs::File::create(path)?;
    let (tx, rx) = sync_channel::<Msg>(CHANNEL_LINES);
    let thread = std::thread::Builder::new()
        .name("emulate-request-log".into())
        .spawn(move || {
            let mut out = std::io::BufWriter::with_capacity(1 << 16, file);
            let mut lines = 0u64;
            let mut flushed = std::time::Instant::now();
            loop {
                match rx.recv_timeout(FLUSH_EVERY) {
                    Ok(Msg::Line(l)) => {
                        serde_json::to_writer(&mut out, &l)?;
                        out.write_all(b"\n")?;
                        lines += 1;
                    }
                    Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {}
                }
                if flushed.elapsed() >= FLUSH_EVERY {
                    out.flush()?;
                    flushed = std::time::Instant::now();
                }
            }
            // Lines already queued when the stop came are written too.
            while let Ok(Msg::Line(l)) = rx.try_recv() {
                serde_json::to_writer(&mut out, &l)?;
                out.write_all(b"\n")?;
                lines += 1;
            }
            out.flush()?;
            Ok(lines)
        })?;
    Ok(RequestLogWriter {
        log: RequestLog {
            tx,
            dropped: Arc::new(AtomicU64::new(0)),
        },
        path: path.to_path_buf(),
        thread,
    })
}

impl RequestLogWriter {
    pub(crate) fn log(&self) -> RequestLog {
        self.log.clone()
    }

    /// Write what is queued, stop the thread; `(lines written, lines dropped)`.
    pub(crate) fn finish(self) -> Result<(u64, u64), (PathBuf, std::io::Error)> {
        let _ = self.log.tx.send(Msg::Stop);
        let dropped = self.log.dropped.load(Ordering::Relaxed);
        match self.thread.join() {
            Ok(Ok(n)) => Ok((n, dropped)),
            Ok(Err(e)) => Err((self.path, e)),
            Err(_) => Err((
                self.path,
                std::io::Error::other("the request-log writer panicked"),
            )),
        }
    }
}

impl RequestLog {
    /// Wrap `resp`'s body so that its line is sent when the body is done (or dropped).
    pub(crate) fn wrap(
        &self,
        resp: axum::response::Response,
        arrival_s: f64,
        path: String,
    ) -> axum::response::Response {
        let (mut parts, body) = resp.into_parts();
        let tokens = parts.extensions.remove::<LoggedTokens>();
        let status = parts.status.as_u16();
        let body = LoggedBody {
            inner: body,
            log: Some(self.clone()),
            arrival_s,
            first_s: None,
            ended: false,
            path,
            status,
            tokens,
        };
        axum::response::Response::from_parts(parts, Body::new(body))
    }

    fn send(&self, line: Line) {
        if let Err(TrySendError::Full(_)) = self.tx.try_send(Msg::Line(line)) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A response body that notes when its first frame and its end pass to the HTTP server.
struct LoggedBody {
    inner: Body,
    log: Option<RequestLog>,
    arrival_s: f64,
    first_s: Option<f64>,
    ended: bool,
    path: String,
    status: u16,
    tokens: Option<LoggedTokens>,
}

impl HttpBody for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let r = HttpBody::poll_frame(Pin::new(&mut self.inner), cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
                if self.first_s.is_none() && f.data_ref().is_some_and(|d| !d.is_empty()) {
                    self.first_s = Some(crate::unix_now_s());
                }
                if self.inner.is_end_stream() {
                    self.ended = true;
                }
            }
            Poll::Ready(None) => self.ended = true,
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    // The HTTP server drops the body as soon as it has taken its last frame (or the
    // connection is gone): that instant is the line's end.
    fn drop(&mut self) {
        let Some(log) = self.log.take() else { return };
        let ok = (200..300).contains(&self.status);
        let t = self.tokens.unwrap_or(LoggedTokens {
            prompt: 0,
            output: 0,
            stream: false,
        });
        log.send(Line {
            arrival_s: self.arrival_s,
            first_token_s: if ok { self.first_s } else { None },
            end_s: crate::unix_now_s(),
            path: std::mem::take(&mut self.path),
            status: self.status,
            stream: t.stream,
            prompt_tokens: t.prompt,
            output_tokens: t.output,
            complete: self.ended || self.inner.is_end_stream(),
        });
    }
}
