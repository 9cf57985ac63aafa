//! The request path's upstream side: hyper's HTTP/1 client (`hyper::client::conn::http1`),
//! one exchange at a time per connection. The request is sent from the request's own task;
//! hyper's side of each connection runs in a task of its own, which is where it reads and,
//! between exchanges, watches the idle connection.
//!
//! Pool rule: idle connections are kept per client connection ([`Kept`]): one opened for a
//! request is reused only by later requests of the same client connection, and closed with
//! it. No upstream connection ever carries two clients' requests, so nothing a destination
//! writes on one — a stray response, an answer shifted by one — can reach another client.
//! (HTTP/1.1 matches answers to requests by order alone: a destination that writes a second
//! response while the next request is in flight, and answers that request late, would hand a
//! shared connection's next user the answer meant for the one before.) A connection goes back
//! to be kept only when its response body ended cleanly, the answer's framing was unambiguous
//! and the destination did not ask to close it ([`pooled_after`]), and the destination is not
//! one that writes unasked (below); it is taken again only while hyper's side of it is open,
//! and used once hyper is ready for the next request on it.
//!
//! Unsolicited bytes: any byte that arrives on an idle connection (a second response, a late
//! `408`) makes hyper end that connection with an error ("received unexpected message from
//! connection"), so it is never used again and what arrived is nobody's answer. A response
//! that arrives while a request is in flight is that request's answer (HTTP/1.1 has nothing
//! else to match them by); the real answer then arrives on an idle connection and closes it.
//! A destination that has once written unasked is marked ([`Marks`]): from then on every
//! request to it goes on a fresh connection, sent with `connection: close` and closed after,
//! and none goes back to a pool, until it passes a health probe started after the mark.
//!
//! A request on a kept connection that turns out to be closed (hyper gives the request back
//! unsent, or the connection ends before any byte of an answer — servers close idle keep-alive
//! connections) is sent again once on a new connection; any other failure goes back to the
//! caller, whose retry rule applies.

use super::backend::BackendUrl;
use super::lock::Locked;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use hyper_util::rt::TokioIo;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::TcpStream;

/// hyper's sending half of one connection.
type Sender = SendRequest<Full<Bytes>>;

/// One open connection to a destination: hyper's sending half, and how many bytes have been
/// read from it (whether a failed exchange got any answer at all).
struct Conn {
    tx: Sender,
    read: Arc<AtomicU64>,
    /// The [`Target::generation`] it was opened to.
    generation: u64,
}

/// One destination's backend: its parsed URL (where to connect, the `Host` header, the base
/// path) and a generation.
pub(crate) struct Target {
    url: BackendUrl,
    /// Unique to this target: a kept connection is reused only for the target it was opened
    /// to, never for a new backend put into the same destination slot.
    generation: u64,
}

/// Generations of [`Target`]s, unique within the process.
static TARGET_GENERATION: AtomicU64 = AtomicU64::new(1);

impl Target {
    fn new(url: &BackendUrl) -> Self {
        Target {
            url: url.clone(),
            generation: TARGET_GENERATION.fetch_add(1, Relaxed),
        }
    }
}

/// Where each destination slot is (`None`: vacant), shared by every serving worker's
/// [`Upstream`]; changed when discovery fills or empties a slot.
pub(crate) struct Targets(Box<[Mutex<Option<Arc<Target>>>]>);

impl Targets {
    /// `urls` in the first slots, `slots` in all (the rest vacant).
    pub fn new(urls: &[BackendUrl], slots: usize) -> Self {
        Self(
            (0..slots.max(urls.len()))
                .map(|d| Mutex::new(urls.get(d).map(|u| Arc::new(Target::new(u)))))
                .collect(),
        )
    }

    /// Put the backend at `url` into slot `d` (a new generation), or empty it (`None`).
    pub fn set(&self, d: usize, url: Option<&BackendUrl>) {
        if let Some(slot) = self.0.get(d) {
            *slot.locked() = url.map(|u| Arc::new(Target::new(u)));
        }
    }

    fn get(&self, d: usize) -> Option<Arc<Target>> {
        self.0.get(d).and_then(|slot| slot.locked().clone())
    }
}

/// What the upstream side knows about one destination, shared by every serving worker's
/// connections (and read by `/metrics`).
#[derive(Debug, Default)]
pub(crate) struct Marks {
    /// It wrote unsolicited bytes and has not passed a probe started since: no pooled
    /// connections to it.
    unpooled: AtomicBool,
    /// Connections closed because the destination wrote on them unasked.
    pub unsolicited: AtomicU64,
    /// Requests sent on a fresh connection, closed after, because of that mark.
    pub unpooled_requests: AtomicU64,
}

impl Marks {
    /// A new backend in the slot: nothing is known of it.
    pub fn reset(&self) {
        self.unpooled.store(false, Relaxed);
    }

    /// Whether connections to the destination are pooled (not marked).
    pub fn pooled(&self) -> bool {
        !self.unpooled.load(Relaxed)
    }

    /// A health probe is starting: what it passes to [`Marks::probe_passed`].
    pub fn probe_started(&self) -> u64 {
        self.unsolicited.load(Relaxed)
    }

    /// A probe that started when [`Marks::probe_started`] said `seen` has passed: the
    /// destination's connections are pooled again, unless it wrote unasked since. Returns
    /// whether the mark was lifted.
    pub fn probe_passed(&self, seen: u64) -> bool {
        self.unsolicited.load(Relaxed) == seen && self.unpooled.swap(false, Relaxed)
    }

    /// A connection was closed for unsolicited bytes; whether this newly marks the
    /// destination.
    fn wrote_unasked(&self) -> bool {
        self.unsolicited.fetch_add(1, Relaxed);
        !self.unpooled.swap(true, Relaxed)
    }
}

/// Slot `d`'s marks (past the last slot: a fresh set nobody else shares).
pub(crate) fn mark_of(marks: &[Marks], d: usize) -> &Marks {
    static NOWHERE: std::sync::LazyLock<Marks> = std::sync::LazyLock::new(Marks::default);
    marks.get(d).unwrap_or(&NOWHERE)
}

/// The destinations and how to reach them (one per serving worker; the [`Marks`] shared).
pub(crate) struct Upstream {
    targets: Arc<Targets>,
    marks: Arc<[Marks]>,
    connect_timeout: Duration,
}

/// The idle upstream connections one client connection keeps, at most one per destination:
/// used for that client connection's requests only, closed when it is dropped.
#[derive(Clone, Default)]
pub(crate) struct Kept(Arc<Mutex<Vec<(usize, Conn)>>>);

impl Kept {
    /// The kept connection to `d`'s backend of `generation` whose hyper side is still open
    /// (connections to a backend the slot held before are closed).
    fn take(&self, d: usize, generation: u64) -> Option<Conn> {
        let mut held = self.0.locked();
        held.retain(|(x, c)| *x != d || c.generation == generation);
        let i = held.iter().position(|(x, _)| *x == d)?;
        let (_, c) = held.swap_remove(i);
        (!c.tx.is_closed()).then_some(c)
    }

    /// Keep `c` to `d` after its response body ended.
    fn put(&self, d: usize, c: Conn) {
        if !c.tx.is_closed() {
            self.0.locked().push((d, c));
        }
    }
}

/// Why a send failed, in words, and whether the destination answered anything at all.
pub(crate) struct SendError {
    pub message: String,
    /// `false`: the connection could not be made, or it failed or closed before any byte of an
    /// answer — the destination's side of it is gone, so nothing is being generated for this
    /// request there. `true`: an answer began but was malformed or cut inside its head.
    pub answered: bool,
}

/// A response head.
pub(crate) struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
}

/// A request ready to send to one destination: method, target path (base path and the
/// client's path and query) and headers (`Host`, `Content-Length`, the client's less
/// hop-by-hop ones), and body.
pub(crate) struct Outgoing {
    /// The destination's backend when the request was built: it is sent there even if the
    /// slot changes meanwhile.
    target: Arc<Target>,
    method: Method,
    uri: hyper::Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Outgoing {
    fn build(&self) -> hyper::Request<Full<Bytes>> {
        let mut r = hyper::Request::new(Full::new(self.body.clone()));
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = self.uri.clone();
        *r.headers_mut() = self.headers.clone();
        r
    }
}

/// A response body being read from its connection. The connection is kept again when the
/// body has ended (and [`pooled_after`] allowed it); dropped any earlier — broken, cut, or
/// abandoned by the client — the connection is closed.
pub(crate) struct Body {
    incoming: Incoming,
    /// The connection and where it is kept again.
    conn: Option<(Conn, Kept)>,
    ended: bool,
    d: usize,
}

impl Drop for Body {
    fn drop(&mut self) {
        if self.is_end() {
            self.release();
        }
    }
}

/// A socket that counts the bytes read from it.
struct Counted {
    io: TcpStream,
    read: Arc<AtomicU64>,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.read.fetch_add(n as u64, Relaxed);
        }
        r
    }
}

/// `AsyncWrite` for a socket wrapper whose writes go straight to its `io` field, a
/// `TcpStream` (the client side's `Prefixed`, the upstream side's `Counted`).
macro_rules! write_through_io {
    ($t:ty) => {
        impl tokio::io::AsyncWrite for $t {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
            }
            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }
            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }
            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }
            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }
        }
    };
}
pub(super) use write_through_io;

write_through_io!(Counted);

/// Whether hyper ended a connection because bytes arrived on it while it was idle. hyper
/// names this error only in words; `tests/router_upstream.rs` (a backend that writes after
/// its answers, and the counter it must raise) fails if the words change.
fn is_unsolicited(e: &hyper::Error) -> bool {
    e.to_string() == "received unexpected message from connection"
}

impl Upstream {
    /// Over the destination slots' targets; `targets` and `marks` are shared by every
    /// `Upstream` of the router, one per destination slot.
    pub fn new(targets: Arc<Targets>, connect_timeout: Duration, marks: Arc<[Marks]>) -> Self {
        Self {
            targets,
            marks,
            connect_timeout,
        }
    }

    async fn connect(&self, d: usize, t: &Target) -> Result<Conn, SendError> {
        let at = t.url.connect();
        let fail = |m: String| SendError {
            message: m,
            answered: false,
        };
        let io = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(at)).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(fail(format!("connect to {at}: {e}"))),
            Err(_) => {
                return Err(fail(format!(
                    "connect to {at}: no answer within {:?}",
                    self.connect_timeout
                )))
            }
        };
        let _ = io.set_nodelay(true);
        let read = Arc::new(AtomicU64::new(0));
        let counted = Counted {
            io,
            read: read.clone(),
        };
        let (tx, conn) = http1::handshake(TokioIo::new(counted))
            .await
            .map_err(|e| fail(format!("connect to {at}: {}", crate::error_chain(&e))))?;
        let marks = self.marks.clone();
        let at = at.to_string();
        tokio::spawn(async move {
            match conn.await {
                Err(e) if is_unsolicited(&e) => {
                    if mark_of(&marks, d).wrote_unasked() {
                        tracing::warn!(
                            destination = d,
                            "destination {d} ({at}) wrote unsolicited bytes on an idle connection: connection closed; no pooled connections to it until it passes a health probe"
                        );
                    } else {
                        tracing::debug!(
                            destination = d,
                            "destination {d} ({at}) wrote unsolicited bytes again: connection closed"
                        );
                    }
                }
                Err(e) => tracing::debug!(
                    destination = d,
                    "connection to {at} ended: {}",
                    crate::error_chain(&e)
                ),
                Ok(()) => {}
            }
        });
        Ok(Conn {
            tx,
            read,
            generation: t.generation,
        })
    }

    /// The request for destination `d`: its base path before `pq`, `Host`, the caller's
    /// headers but for hop-by-hop ones, `Content-Length`, and the body.
    pub fn request(
        &self,
        d: usize,
        method: &Method,
        pq: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Outgoing, SendError> {
        let t = self.targets.get(d).ok_or_else(|| SendError {
            message: format!("destination {d} was removed from the backends"),
            answered: false,
        })?;
        let uri = format!("{}{pq}", t.url.base())
            .parse::<hyper::Uri>()
            .map_err(|e| SendError {
                message: format!("request target {}{pq}: {e}", t.url.base()),
                answered: true,
            })?;
        let mut out = HeaderMap::with_capacity(headers.len() + 2);
        out.insert(hyper::header::HOST, t.url.host_header().clone());
        // Headers the client's `Connection` names are this hop's too (RFC 9110 §7.6.1).
        let named = connection_named(headers.get_all(hyper::header::CONNECTION));
        for (k, v) in headers {
            if skip_header(k) || named.iter().any(|n| k.as_str() == n) {
                continue;
            }
            out.append(k.clone(), v.clone());
        }
        if !body.is_empty() || *method == Method::POST || *method == Method::PUT {
            out.insert(hyper::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        }
        Ok(Outgoing {
            target: t,
            method: method.clone(),
            uri,
            headers: out,
            body,
        })
    }

    /// Send `request` (from [`Upstream::request`]) to destination `d` and wait for the
    /// response head, on the connection to `d` that `kept` holds (its client connection's),
    /// else a new one, kept there again after the body (`None`: a new connection, closed
    /// after). The body follows from the returned [`Body`].
    pub async fn send(
        &self,
        d: usize,
        request: &Outgoing,
        kept: Option<&Kept>,
    ) -> Result<(Head, Body), SendError> {
        let t = &request.target;
        let at = t.url.connect();
        let kept = kept.filter(|_| mark_of(&self.marks, d).pooled());
        let pooled = kept.is_some();
        if !pooled {
            mark_of(&self.marks, d)
                .unpooled_requests
                .fetch_add(1, Relaxed);
        }
        let mut req = request.build();
        if !pooled {
            req.headers_mut()
                .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        }
        loop {
            let (mut c, reused) = match kept.and_then(|k| k.take(d, t.generation)) {
                Some(c) => (c, true),
                None => (self.connect(d, t).await?, false),
            };
            // A pooled connection whose last exchange hyper has not quite finished.
            if reused && c.tx.ready().await.is_err() {
                continue;
            }
            let before = c.read.load(Relaxed);
            let mut e = match c.tx.try_send_request(req).await {
                Ok(resp) => {
                    let (parts, incoming) = resp.into_parts();
                    if parts.status == StatusCode::SWITCHING_PROTOCOLS {
                        // An upgrade is not proxied: its bytes after the head are another
                        // protocol's.
                        return Err(SendError {
                            message: format!(
                                "{at}: the destination switched protocols (101); upgrades are not proxied"
                            ),
                            answered: true,
                        });
                    }
                    let keep =
                        kept.filter(|_| pooled_after(&parts, request.method == Method::HEAD));
                    let body = Body {
                        incoming,
                        conn: keep.map(|k| (c, k.clone())),
                        ended: false,
                        d,
                    };
                    let head = Head {
                        status: parts.status,
                        headers: response_headers(parts.headers),
                    };
                    return Ok((head, body));
                }
                Err(e) => e,
            };
            let answered = c.read.load(Relaxed) != before;
            let why = crate::error_chain(e.error());
            match e.take_message() {
                // Never written: safe to send on a new connection.
                Some(r) => {
                    if !reused {
                        return Err(SendError {
                            message: format!("{at}: {why}"),
                            answered: false,
                        });
                    }
                    req = r;
                }
                // Closed while idle: nothing was answered, so send it again on a new one.
                None if reused && !answered => req = request.build(),
                None => {
                    return Err(SendError {
                        message: format!("{at}: {why}"),
                        answered,
                    })
                }
            }
            if !pooled {
                req.headers_mut()
                    .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
            }
        }
    }
}

/// The response headers passed on to the client: hop-by-hop ones are this hop's business
/// (`content-length` stays, but not beside a transfer coding, which decides the length), as
/// are the headers the `Connection` header names.
fn response_headers(mut h: HeaderMap) -> HeaderMap {
    let named = connection_named(h.get_all(hyper::header::CONNECTION));
    let coded = h.contains_key(hyper::header::TRANSFER_ENCODING);
    let hop: Vec<HeaderName> = h
        .keys()
        .filter(|k| {
            (skip_header(k) && (*k != hyper::header::CONTENT_LENGTH || coded))
                || named.iter().any(|n| k.as_str() == n)
        })
        .cloned()
        .collect();
    for k in hop {
        h.remove(k);
    }
    h
}

/// Whether the connection may carry another request once this answer's body has ended: not
/// when the destination asked to close it (or spoke HTTP/1.0 without keep-alive), nor after
/// a framing anomaly — a body read until close, a `Content-Length` beside a transfer coding,
/// or a 204/304 announcing a length — where the answer's end is the destination's guess.
fn pooled_after(p: &hyper::http::response::Parts, head_request: bool) -> bool {
    let h = &p.headers;
    let mut close = p.version == Version::HTTP_10;
    for v in h.get_all(hyper::header::CONNECTION) {
        let v = v.to_str().unwrap_or("");
        if v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")) {
            close = true;
        } else if v
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("keep-alive"))
        {
            close = false;
        }
    }
    let lengths: Vec<&HeaderValue> = h.get_all(hyper::header::CONTENT_LENGTH).iter().collect();
    let length = (!lengths.is_empty()).then(|| {
        let mut all = lengths.iter().map(|v| content_length_list(v.as_bytes()));
        let first = all.next().flatten();
        first.filter(|f| all.all(|n| n == Some(*f)))
    });
    let coding = h.get(hyper::header::TRANSFER_ENCODING);
    let code = p.status.as_u16();
    if close || (coding.is_some() && length.is_some()) {
        return false;
    }
    if code == 204 || code == 304 {
        return length.is_none_or(|l| l == Some(0));
    }
    if head_request {
        return true;
    }
    match coding {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked")),
        // Without either, the body runs until the connection closes.
        None => length.is_some(),
    }
}

impl Body {
    /// Whether the whole body has been read.
    pub fn is_end(&self) -> bool {
        self.ended || self.incoming.is_end_stream()
    }

    /// The connection kept again (if it may be).
    fn release(&mut self) {
        if let Some((c, kept)) = self.conn.take() {
            kept.put(self.d, c);
        }
    }

    /// The next piece of body data as it arrives (`None` at the end).
    pub async fn next(&mut self) -> Option<io::Result<Bytes>> {
        loop {
            if self.ended {
                return None;
            }
            let frame = std::future::poll_fn(|cx| Pin::new(&mut self.incoming).poll_frame(cx));
            match frame.await {
                Some(Ok(f)) => match f.into_data() {
                    Ok(b) => return Some(Ok(b)),
                    Err(_) => continue, // trailers: not passed on
                },
                Some(Err(e)) => {
                    self.ended = true;
                    self.conn = None;
                    let kind = if e.is_incomplete_message() {
                        io::ErrorKind::UnexpectedEof
                    } else {
                        io::ErrorKind::InvalidData
                    };
                    return Some(Err(io::Error::new(kind, crate::error_chain(&e))));
                }
                None => {
                    self.ended = true;
                    self.release();
                    return None;
                }
            }
        }
    }
}

/// Header names listed in `Connection` values other than `close` and `keep-alive`, in lower
/// case: hop-by-hop headers a proxy removes (RFC 9110 §7.6.1). Empty in the common case.
fn connection_named<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> Vec<String> {
    let mut out = Vec::new();
    for v in values {
        for t in v.to_str().unwrap_or("").split(',') {
            let t = t.trim();
            if !t.is_empty()
                && !t.eq_ignore_ascii_case("close")
                && !t.eq_ignore_ascii_case("keep-alive")
            {
                out.push(t.to_ascii_lowercase());
            }
        }
    }
    out
}

/// Hop-by-hop headers (RFC 9110 §7.6.1), those the upstream request sets itself, and
/// `expect` (the router has the whole body before it forwards).
pub(crate) fn skip_header(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
            | "expect"
    )
}

/// A `Content-Length` value as RFC 9110 §8.6 writes it: ASCII digits only, with optional
/// spaces or tabs around them (no sign, no other whitespace, no list), within `u64`. Both
/// directions use it; where it says `None` the request goes to hyper, whose verdict stands.
pub(super) fn content_length(v: &[u8]) -> Option<u64> {
    let start = v.iter().position(|b| *b != b' ' && *b != b'\t')?;
    let end = v.iter().rposition(|b| *b != b' ' && *b != b'\t')? + 1;
    let digits = v.get(start..end)?;
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    digits.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add((d - b'0') as u64)
    })
}

/// A response's `Content-Length` value as hyper's client reads it: a comma-separated list
/// of [`content_length`] values, all the same number (RFC 9110 §8.6 lets a recipient take
/// such a list as that number).
fn content_length_list(v: &[u8]) -> Option<u64> {
    let mut items = v.split(|b| *b == b',').map(content_length);
    let first = items.next()??;
    items.all(|n| n == Some(first)).then_some(first)
}

/// `name: value` and the line end, onto an HTTP/1.1 head (both directions use it).
pub(super) fn put_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `content-length: n` onto an HTTP/1.1 head.
pub(super) fn put_length(out: &mut Vec<u8>, n: u64) {
    use std::io::Write as _;
    let _ = write!(out, "content-length: {n}\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_lengths_are_digits_only() {
        for (v, want) in [
            (&b"17"[..], Some(17)),
            (b" \t017 ", Some(17)),
            (b"0", Some(0)),
            (b"18446744073709551615", Some(u64::MAX)),
            (b"18446744073709551616", None),
            (b"+17", None),
            (b"-1", None),
            (b"1 7", None),
            (b"17,17", None),
            (b"", None),
            (b"  ", None),
            ("\u{a0}17".as_bytes(), None),
            ("17\u{2003}".as_bytes(), None),
            (b"0x11", None),
            (b"17\r", None),
        ] {
            assert_eq!(content_length(v), want, "{:?}", String::from_utf8_lossy(v));
        }
    }
}
