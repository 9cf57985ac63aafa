//! The request path's upstream side: per destination a stack of idle HTTP/1.1 connections,
//! and the exchange on one of them written out directly — the request head and body in one
//! write from the request's own task, the response head parsed (`httparse`) and its body
//! (`Content-Length`, chunked, or until close) read in the same task, chunk by chunk as it
//! arrives. A connection goes back to its destination's stack when its response [`Body`] is
//! dropped after ending cleanly (and the destination did not ask to close it); dropped any
//! earlier — broken, cut, or abandoned by the client — the connection is closed.
//!
//! A request sent on an idle connection that turns out to have been closed by the destination
//! (the write fails, or the connection ends before any byte of an answer — servers close idle
//! keep-alive connections) is sent again once on a new connection; any other failure goes back
//! to the caller, whose retry rule applies.

use bytes::{Buf, Bytes, BytesMut};
use hyper::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One open HTTP/1.1 connection to a destination and the bytes read from it but not yet used.
pub(crate) struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

/// Where one destination is: `host:port` to connect to, the `Host` header, and a base path to
/// put before every request's path (empty for a plain `http://host:port`).
struct Target {
    connect: String,
    host: HeaderValue,
    base: String,
}

/// Idle connections per destination.
pub(crate) struct Upstream {
    targets: Vec<Target>,
    idle: Mutex<Vec<Vec<Conn>>>,
    connect_timeout: Duration,
    max_idle: usize,
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

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    /// `Content-Length`: bytes still to come.
    Length(u64),
    /// Chunked: in a chunk's data with this many bytes left (then its CRLF), or between chunks;
    /// `ext`: chunk-extension bytes so far (hyper's client allows 16 KiB in a body).
    Chunk {
        left: u64,
        in_data: bool,
        ext: u32,
    },
    /// Until the destination closes the connection.
    Eof,
    Done,
}

/// A response body being read from its connection; see the module doc for what happens to
/// the connection when it is dropped.
pub(crate) struct Body {
    conn: Option<Conn>,
    framing: Framing,
    reusable: bool,
    /// The stack the connection goes back to.
    home: Arc<Upstream>,
    d: usize,
}

impl Drop for Body {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            if self.framing == Framing::Done && self.reusable && c.buf.is_empty() {
                self.home.put(self.d, c);
            }
        }
    }
}

const READ_CHUNK: usize = 16 * 1024;
const MAX_HEAD: usize = 64 * 1024;
/// Most headers in a response head: hyper's client's limit (a head with more is malformed).
const MAX_HEADERS: usize = 100;

impl Upstream {
    /// From the destinations' base URLs (validated `http://host[:port][/base]`).
    pub fn new(urls: &[String], connect_timeout: Duration) -> Self {
        let targets = urls
            .iter()
            .map(|u| {
                let uri: hyper::Uri = u.parse().expect("validated backend URL");
                let host = uri.host().expect("validated backend URL has a host");
                let port = uri.port_u16().unwrap_or(80);
                let authority = uri.authority().map_or(host, |a| a.as_str());
                Target {
                    connect: format!("{host}:{port}"),
                    host: HeaderValue::from_str(authority).expect("authority is a header value"),
                    base: uri.path().trim_end_matches('/').to_string(),
                }
            })
            .collect::<Vec<_>>();
        Self {
            idle: Mutex::new(targets.iter().map(|_| Vec::new()).collect()),
            targets,
            connect_timeout,
            max_idle: 1024,
        }
    }

    /// An idle connection to `d` that is still clean (see [`idle_is_clean`]); unclean ones
    /// are closed on the way.
    fn take(&self, d: usize) -> Option<Conn> {
        loop {
            let c = self.idle.lock().expect("upstream idle")[d].pop()?;
            if idle_is_clean(&c.io) {
                return Some(c);
            }
        }
    }

    /// Give a connection back after its response body ended.
    fn put(&self, d: usize, c: Conn) {
        let mut idle = self.idle.lock().expect("upstream idle");
        if idle[d].len() < self.max_idle {
            idle[d].push(c);
        }
    }

    async fn connect(&self, d: usize) -> Result<Conn, SendError> {
        let at = &self.targets[d].connect;
        let fail = |m: String| SendError {
            message: m,
            answered: false,
        };
        let io = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(at.as_str()))
            .await
        {
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
        Ok(Conn {
            io,
            buf: BytesMut::with_capacity(READ_CHUNK),
        })
    }

    /// The request's bytes for destination `d`: head (request line, `Host`, the caller's
    /// headers but for hop-by-hop ones, `Content-Length`) and body.
    pub fn encode(
        &self,
        d: usize,
        method: &Method,
        pq: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Vec<u8> {
        let t = &self.targets[d];
        let mut out = Vec::with_capacity(256 + body.len());
        out.extend_from_slice(method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(t.base.as_bytes());
        out.extend_from_slice(pq.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        out.extend_from_slice(t.host.as_bytes());
        out.extend_from_slice(b"\r\n");
        // Headers the client's `Connection` names are this hop's too (RFC 9110 §7.6.1).
        let named = connection_named(headers.get_all(hyper::header::CONNECTION));
        for (k, v) in headers {
            if skip_header(k) || named.iter().any(|n| k.as_str() == n) {
                continue;
            }
            put_header(&mut out, k.as_str().as_bytes(), v.as_bytes());
        }
        if !body.is_empty() || *method == Method::POST || *method == Method::PUT {
            put_length(&mut out, body.len() as u64);
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(body);
        out
    }

    /// Send `request` (from [`Upstream::encode`]; `no_body`: it is a HEAD request) to
    /// destination `d` and read the response head. The body follows from the returned
    /// [`Body`].
    pub async fn send(
        self: &Arc<Self>,
        d: usize,
        request: &[u8],
        no_body: bool,
    ) -> Result<(Head, Body), SendError> {
        loop {
            let (mut c, reused) = match self.take(d) {
                Some(c) => (c, true),
                None => (self.connect(d).await?, false),
            };
            match exchange(&mut c, request, no_body).await {
                Ok((head, framing, reusable)) => {
                    let body = Body {
                        conn: Some(c),
                        framing,
                        reusable,
                        home: self.clone(),
                        d,
                    };
                    return Ok((head, body));
                }
                // Closed while idle: nothing was answered, so send it again on a new one.
                Err(Exchange::Unanswered(_)) if reused => continue,
                Err(Exchange::Unanswered(e)) => {
                    return Err(SendError {
                        message: format!("{}: {e}", self.targets[d].connect),
                        answered: false,
                    })
                }
                Err(Exchange::Broken(e)) => {
                    return Err(SendError {
                        message: format!("{}: {e}", self.targets[d].connect),
                        answered: true,
                    })
                }
            }
        }
    }
}

/// Whether an idle connection can carry the next request: nothing arrived on it since its
/// last response ended and the destination has not closed it. A destination that wrote after
/// its response (a second response, a `408` before closing an idle connection) has made the
/// connection unusable: those bytes would be read as the next request's answer, handing one
/// client what was meant for nobody — or another client's completion. One non-blocking
/// `recv(MSG_PEEK)`, so nothing is consumed and no readiness state is trusted.
fn idle_is_clean(io: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut b = [0u8; 1];
    // SAFETY: a valid socket descriptor owned by `io`, a one-byte buffer that outlives the call.
    let n = unsafe {
        libc::recv(
            io.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
}

enum Exchange {
    /// The connection failed before any byte of an answer.
    Unanswered(String),
    /// The answer was malformed or cut inside its head.
    Broken(String),
}

/// Write the request, read until a whole (non-1xx) response head is in.
async fn exchange(
    c: &mut Conn,
    request: &[u8],
    no_body: bool,
) -> Result<(Head, Framing, bool), Exchange> {
    if let Err(e) = c.io.write_all(request).await {
        return Err(Exchange::Unanswered(format!("sending the request: {e}")));
    }
    let mut answered = false;
    loop {
        if !c.buf.is_empty() {
            answered = true;
            match parse_head(&c.buf, no_body) {
                Ok(Some((n, parsed))) => {
                    c.buf.advance(n);
                    match parsed {
                        Some(done) => return Ok(done),
                        None => continue, // an interim 1xx answer
                    }
                }
                Ok(None) if c.buf.len() > MAX_HEAD => {
                    return Err(Exchange::Broken(format!(
                        "response head longer than {MAX_HEAD} bytes"
                    )))
                }
                Ok(None) => {}
                Err(e) => return Err(Exchange::Broken(e)),
            }
        }
        c.buf.reserve(READ_CHUNK);
        match c.io.read_buf(&mut c.buf).await {
            Ok(0) if !answered => {
                return Err(Exchange::Unanswered(
                    "connection closed before any answer".into(),
                ))
            }
            Ok(0) => {
                return Err(Exchange::Broken(
                    "connection closed inside the response head".into(),
                ))
            }
            Ok(_) => {}
            Err(e) if !answered => return Err(Exchange::Unanswered(e.to_string())),
            Err(e) => return Err(Exchange::Broken(e.to_string())),
        }
    }
}

type Parsed = Option<(Head, Framing, bool)>;

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
    let digits = &v[start..end];
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

/// A response head at the start of `buf`: `Ok(None)` if incomplete, else its length and the
/// head with its body framing and whether the connection may be reused (`None` for 1xx).
fn parse_head(buf: &[u8], no_body: bool) -> Result<Option<(usize, Parsed)>, String> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut slots);
    let n = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("malformed response head: {e}")),
    };
    let code = r.code.unwrap_or(0);
    let status =
        StatusCode::from_u16(code).map_err(|_| format!("invalid response status {code}"))?;
    if code == 101 {
        // An upgrade is not proxied: its bytes after the head are another protocol's.
        return Err("the destination switched protocols (101); upgrades are not proxied".into());
    }
    if status.is_informational() {
        return Ok(Some((n, None)));
    }
    let mut headers = HeaderMap::with_capacity(r.headers.len());
    // Content-Length as hyper's client reads it: every value a list of the same number
    // (`Err(())` otherwise), looked at only where no transfer coding or status decides.
    let mut length: Option<Result<u64, ()>> = None;
    let mut chunked = false;
    let mut coded = false;
    let mut named: Vec<String> = Vec::new();
    let mut close = r.version == Some(0);
    for h in r.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| format!("invalid response header name {:?}", h.name))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| format!("invalid value of response header {}", h.name))?;
        if name == hyper::header::CONTENT_LENGTH {
            length = Some(match (length, content_length_list(h.value)) {
                (None, Some(v)) => Ok(v),
                (Some(Ok(l)), Some(v)) if l == v => Ok(v),
                _ => Err(()),
            });
        } else if name == hyper::header::TRANSFER_ENCODING {
            coded = true;
            chunked = value
                .to_str()
                .ok()
                .and_then(|v| v.rsplit(',').next())
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        } else if name == hyper::header::CONNECTION {
            named.extend(connection_named([&value]));
            let v = value.to_str().unwrap_or("");
            if v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")) {
                close = true;
            } else if v
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("keep-alive"))
            {
                close = false;
            }
        }
        // Hop-by-hop headers are this hop's business (read above where they matter); the
        // client's answer gets the rest, `content-length` included.
        if skip_header(&name) && name != hyper::header::CONTENT_LENGTH {
            continue;
        }
        headers.append(name, value);
    }
    for n in &named {
        headers.remove(n.as_str());
    }
    if coded {
        // The transfer coding decides the length; a Content-Length beside it, whatever it
        // says, is not passed on.
        headers.remove(hyper::header::CONTENT_LENGTH);
    }
    // Framing anomalies: the body is read as RFC 9112 §6.3 says, but the connection is not
    // trusted with another request (where this answer ends is the destination's guess).
    if coded && length.is_some() {
        close = true;
    }
    if (code == 204 || code == 304) && length.is_some_and(|l| l != Ok(0)) {
        close = true;
    }
    let framing = if no_body || code == 204 || code == 304 {
        Framing::Done
    } else if coded && r.version == Some(0) {
        // HTTP/1.0 has no transfer codings (RFC 9112 §6.1): the framing is unknowable.
        return Err("transfer-encoding in an HTTP/1.0 response".into());
    } else if coded && !chunked {
        // A transfer coding other than chunked last: the body runs until the connection closes.
        close = true;
        Framing::Eof
    } else if chunked {
        Framing::Chunk {
            left: 0,
            in_data: false,
            ext: 0,
        }
    } else {
        match length {
            Some(Err(())) => {
                return Err("invalid or conflicting content-length in the response".into())
            }
            Some(Ok(0)) => Framing::Done,
            Some(Ok(l)) => Framing::Length(l),
            None => {
                close = true;
                Framing::Eof
            }
        }
    };
    Ok(Some((n, Some((Head { status, headers }, framing, !close)))))
}

impl Body {
    /// Whether the whole body has been read.
    pub fn is_end(&self) -> bool {
        self.framing == Framing::Done
    }

    /// The next piece of body data as it arrives (`None` at the end).
    pub async fn next(&mut self) -> Option<io::Result<Bytes>> {
        loop {
            let c = self.conn.as_mut()?;
            match decode(&mut self.framing, &mut c.buf) {
                Ok(Some(data)) => return Some(Ok(data)),
                Ok(None) if self.framing == Framing::Done => return None,
                Ok(None) => {}
                Err(e) => {
                    self.framing = Framing::Done;
                    self.reusable = false;
                    return Some(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
                }
            }
            // Need more bytes.
            c.buf.reserve(READ_CHUNK);
            let read = c.io.read_buf(&mut c.buf).await;
            let was = self.framing;
            if !matches!(read, Ok(n) if n > 0) {
                self.framing = Framing::Done;
                self.reusable = false;
            }
            match read {
                Ok(0) if was == Framing::Eof => return None,
                Ok(0) => {
                    return Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "connection closed before the response body ended",
                    )))
                }
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Take the next body data out of `buf` under `framing` (advancing it): `Ok(Some)` data,
/// `Ok(None)` more bytes needed (or the body has ended: `framing` is then `Done`).
fn decode(framing: &mut Framing, buf: &mut BytesMut) -> Result<Option<Bytes>, String> {
    loop {
        match *framing {
            Framing::Done => return Ok(None),
            _ if buf.is_empty() && !matches!(*framing, Framing::Chunk { in_data: false, .. }) => {
                return Ok(None)
            }
            Framing::Length(left) => {
                let n = (buf.len() as u64).min(left) as usize;
                *framing = if left == n as u64 {
                    Framing::Done
                } else {
                    Framing::Length(left - n as u64)
                };
                return Ok(Some(buf.split_to(n).freeze()));
            }
            Framing::Eof => return Ok(Some(buf.split().freeze())),
            Framing::Chunk { left, in_data, ext } if in_data && left > 0 => {
                let n = (buf.len() as u64).min(left) as usize;
                *framing = Framing::Chunk {
                    left: left - n as u64,
                    in_data: true,
                    ext,
                };
                return Ok(Some(buf.split_to(n).freeze()));
            }
            Framing::Chunk { in_data, ext, .. } => match chunk_step(buf, in_data, ext)? {
                Some(next) => *framing = next,
                None => return Ok(None),
            },
        }
    }
}

/// Chunk-extension bytes a chunked body may carry in all (hyper's client's limit).
const MAX_EXTENSIONS: u32 = 16 * 1024;
/// Longest chunk-size line: the extension limit and room for the size and spaces.
const MAX_SIZE_LINE: usize = MAX_EXTENSIONS as usize + 1024;
/// Most bytes in a trailer section (hyper's client's limit).
const MAX_TRAILERS: usize = 16 * 1024;

/// Chunked framing outside chunk data: consume a chunk's trailing CRLF, a size line, or the
/// trailer section from `buf` (`ext`: extension bytes so far). `Ok(None)`: more bytes needed.
fn chunk_step(buf: &mut BytesMut, after_data: bool, ext: u32) -> Result<Option<Framing>, String> {
    if after_data {
        if buf.len() < 2 {
            return Ok(None);
        }
        if &buf[..2] != b"\r\n" {
            return Err("chunk data not followed by CRLF".into());
        }
        buf.advance(2);
        return Ok(Some(Framing::Chunk {
            left: 0,
            in_data: false,
            ext,
        }));
    }
    let Some((size, line, more_ext)) = size_line(buf)? else {
        return Ok(None);
    };
    let ext = ext.saturating_add(more_ext);
    if ext >= MAX_EXTENSIONS {
        return Err("chunk extensions over 16 KiB".into());
    }
    if size > 0 {
        buf.advance(line);
        return Ok(Some(Framing::Chunk {
            left: size,
            in_data: true,
            ext,
        }));
    }
    // Last chunk: the trailer section up to an empty line.
    let Some(end) = trailers(&buf[line..])? else {
        return Ok(None);
    };
    buf.advance(line + end);
    Ok(Some(Framing::Done))
}

/// A chunk-size line at the start of `buf` as hyper's client reads it: hex digits, optional
/// spaces or tabs, an optional `;` extension (any bytes but a bare LF), CRLF. `Ok(None)`: more
/// bytes needed; else the size, the line's length and its extension's.
fn size_line(buf: &[u8]) -> Result<Option<(u64, usize, u32)>, String> {
    #[derive(Clone, Copy)]
    enum At {
        Start,
        Size,
        Space,
        Extension,
        Lf,
    }
    let (mut at, mut size, mut ext) = (At::Start, 0u64, 0u32);
    for (i, &b) in buf.iter().enumerate() {
        at = match (at, b) {
            (At::Start | At::Size, _) if b.is_ascii_hexdigit() => {
                let digit = u64::from((b as char).to_digit(16).unwrap_or(0));
                size = size
                    .checked_mul(16)
                    .and_then(|s| s.checked_add(digit))
                    .ok_or("chunk size overflows")?;
                At::Size
            }
            (At::Start, _) => return Err(format!("bad chunk size line (byte {b:#04x} first)")),
            (At::Size | At::Space, b' ' | b'\t') => At::Space,
            (At::Size | At::Space, b';') => At::Extension,
            (At::Size | At::Space | At::Extension, b'\r') => At::Lf,
            (At::Size | At::Space, _) => {
                return Err(format!("bad chunk size line (byte {b:#04x})"))
            }
            (At::Extension, b'\n') => return Err("chunk extension holds a bare LF".into()),
            (At::Extension, _) => {
                ext = ext.saturating_add(1);
                At::Extension
            }
            (At::Lf, b'\n') => return Ok(Some((size, i + 1, ext))),
            (At::Lf, _) => return Err("chunk size line: CR without LF".into()),
        };
    }
    if buf.len() > MAX_SIZE_LINE {
        return Err("chunk size line too long".into());
    }
    Ok(None)
}

/// The trailer section at the start of `buf` (after the last chunk's line) as hyper's client
/// reads it: lines each ended by CRLF (a CR without LF is an error), up to an empty one, that
/// parse as header fields (at most 100, 16 KiB in all). `Ok(None)`: more bytes needed; else
/// the section's length.
fn trailers(buf: &[u8]) -> Result<Option<usize>, String> {
    let mut at = 0;
    let mut lines = 0;
    loop {
        let Some(cr) = buf[at..].iter().position(|b| *b == b'\r') else {
            return if buf.len() >= MAX_TRAILERS {
                Err("chunked trailers over 16 KiB".into())
            } else {
                Ok(None)
            };
        };
        match buf.get(at + cr + 1) {
            None => return Ok(None),
            Some(b'\n') => {}
            Some(_) => return Err("chunked trailer line: CR without LF".into()),
        }
        if cr == 0 {
            at += 2;
            break;
        }
        lines += 1;
        if lines > MAX_HEADERS {
            return Err("more than 100 chunked trailers".into());
        }
        at += cr + 2;
    }
    if lines == 0 {
        return Ok(Some(at));
    }
    if at >= MAX_TRAILERS {
        return Err("chunked trailers over 16 KiB".into());
    }
    // Rare: parsed only to be as strict as hyper, never passed on.
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match httparse::parse_headers(&buf[..at], &mut slots[..lines]) {
        Ok(httparse::Status::Complete((_, fields))) => {
            for f in fields {
                if HeaderName::from_bytes(f.name.as_bytes()).is_err()
                    || HeaderValue::from_bytes(f.value).is_err()
                {
                    return Err(format!("malformed chunked trailer {:?}", f.name));
                }
            }
            Ok(Some(at))
        }
        _ => Err("malformed chunked trailers".into()),
    }
}

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `wire` piece by piece through the decoder: (data, ended?, data pieces).
    fn body_of(mut f: Framing, wire: &[&[u8]]) -> (Vec<u8>, Result<(), String>, usize) {
        let mut buf = BytesMut::new();
        let (mut out, mut pieces) = (Vec::new(), 0);
        for w in wire {
            buf.extend_from_slice(w);
            loop {
                match decode(&mut f, &mut buf) {
                    Ok(Some(b)) => {
                        out.extend_from_slice(&b);
                        pieces += 1;
                    }
                    Ok(None) => break,
                    Err(e) => return (out, Err(e), pieces),
                }
            }
        }
        let end = if f == Framing::Done {
            Ok(())
        } else {
            Err(format!("not ended: {f:?}"))
        };
        (out, end, pieces)
    }

    #[test]
    fn chunked_bodies_decode_across_any_split() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        for cut in 1..wire.len() {
            let (a, b) = wire.split_at(cut);
            let (out, end, _) = body_of(
                Framing::Chunk {
                    left: 0,
                    in_data: false,
                    ext: 0,
                },
                &[a, b],
            );
            assert_eq!(out, b"hello, world", "cut at {cut}");
            assert_eq!(end, Ok(()), "cut at {cut}");
        }
        // Without trailers.
        let (out, end, _) = body_of(
            Framing::Chunk {
                left: 0,
                in_data: false,
                ext: 0,
            },
            &[b"3\r\nabc\r\n0\r\n\r\n"],
        );
        assert_eq!((out.as_slice(), end), (&b"abc"[..], Ok(())));
        // Data is handed on as it arrives, not held for the chunk's end.
        let (out, _, pieces) = body_of(
            Framing::Chunk {
                left: 0,
                in_data: false,
                ext: 0,
            },
            &[b"a\r\n01234", b"56789\r\n0\r\n\r\n"],
        );
        assert_eq!(out, b"0123456789");
        assert_eq!(pieces, 2);
    }

    #[test]
    fn malformed_chunks_are_errors() {
        let start = Framing::Chunk {
            left: 0,
            in_data: false,
            ext: 0,
        };
        // Size lines as hyper's client reads them: hex digits first, then spaces or tabs, then
        // an extension without a bare LF, then CRLF; 16 KiB of extensions in a body.
        for wire in [
            &b"3 \t;x=\xff\r\nabc\r\n0;y\r\n\r\n"[..],
            b"03\r\nabc\r\n0\r\n\r\n",
            b"3\t\r\nabc\r\n00000000000000000000\r\n\r\n",
        ] {
            let (out, end, _) = body_of(start, &[wire]);
            assert_eq!(
                (out, end),
                (b"abc".to_vec(), Ok(())),
                "{:?}",
                wire.escape_ascii()
            );
        }
        let (_, end, _) = body_of(start, &[b"0\r\nx-t: 1\r\nx-u:2\r\n\r\n"]);
        assert_eq!(end, Ok(()), "well-formed trailers");
        let long = [&b"1;"[..], &[b'e'; 9000], b"\r\nx\r\n"].concat();
        let (out, end, _) = body_of(start, &[&long]);
        assert_eq!(out, b"x");
        assert!(end.unwrap_err().starts_with("not ended"), "9000 bytes pass");
        assert!(
            body_of(start, &[&long, &long]).1.is_err(),
            "over 16 KiB of extensions"
        );
        for wire in [
            &b"zz\r\nabc\r\n"[..],
            b"3\r\nabcXX0\r\n\r\n",
            b" 3\r\nabc\r\n",
            b"+3\r\nabc\r\n",
            b"0x3\r\nabc\r\n",
            b"3 3\r\nabc\r\n",
            b"3\r\r\nabc\r\n",
            b"3;a\nb\r\nabc\r\n",
            b"3\nabc\r\n",
            b"10000000000000000\r\n",
            // Trailers hyper's client refuses.
            b"0\r\nbad trailer\r\n\r\n",
            b"0\r\nx-t: 1\nx-u: 2\r\n\r\n",
            b"0\r\nx-t:1\r\r\n\r\n",
            b"0\r\n\r\r",
        ] {
            let (_, end, _) = body_of(
                Framing::Chunk {
                    left: 0,
                    in_data: false,
                    ext: 0,
                },
                &[wire],
            );
            assert!(end.is_err(), "{:?}", String::from_utf8_lossy(wire));
        }
    }

    /// A complete, final response head.
    fn head_of(h: &[u8]) -> (Head, Framing, bool) {
        let (_, parsed) = parse_head(h, false).unwrap().unwrap();
        parsed.unwrap()
    }

    #[test]
    fn heads_give_status_headers_framing_and_reuse() {
        let h = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nrest";
        let (n, _) = parse_head(h, false).unwrap().unwrap();
        assert_eq!(&h[n..], b"rest");
        let (head, framing, reuse) = head_of(h);
        assert_eq!(head.status, 200);
        assert_eq!(head.headers["content-type"], "text/event-stream");
        let start = Framing::Chunk {
            left: 0,
            in_data: false,
            ext: 0,
        };
        assert_eq!((framing, reuse), (start, true));
        let (head, framing, _) =
            head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n");
        assert_eq!(framing, start);
        assert!(!head.headers.contains_key("content-length"));
        let (head, framing, reuse) = head_of(
            b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\nkeep-alive: timeout=5\r\nserver: x\r\n\r\n",
        );
        assert_eq!((framing, reuse), (Framing::Length(12), false));
        let names: Vec<&str> = head.headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            ["content-length", "server"],
            "hop-by-hop headers dropped"
        );
        // Headers the Connection header names are hop-by-hop too, wherever they stand.
        let (head, _, _) = head_of(
            b"HTTP/1.1 200 OK\r\nx-hop: 1\r\ncontent-length: 1\r\nconnection: X-Hop, x-other\r\nx-other: 2\r\nx-end: 3\r\n\r\n",
        );
        let mut names: Vec<&str> = head.headers.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-length", "x-end"]);
        let (_, framing, reuse) = head_of(b"HTTP/1.0 200 OK\r\n\r\n");
        assert_eq!((framing, reuse), (Framing::Eof, false));
        let (_, framing, reuse) = head_of(b"HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!((framing, reuse), (Framing::Done, true));
        // An interim 100 is skipped; an incomplete head asks for more; garbage is an error.
        let (n, parsed) = parse_head(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200", false)
            .unwrap()
            .unwrap();
        assert_eq!((n, parsed.is_none()), (25, true));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-le", false)
            .unwrap()
            .is_none());
        assert!(parse_head(b"NOT HTTP\r\n\r\n", false).is_err());
        let twice = b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n";
        assert!(parse_head(twice, false).is_err());
    }

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

    #[test]
    fn framing_anomalies_are_read_but_never_pooled() {
        // Content-Length beside chunked: chunked wins, the connection is not reused.
        let (_, framing, reuse) =
            head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n");
        assert!(matches!(framing, Framing::Chunk { .. }) && !reuse);
        // A 204/304 announcing a body length.
        for h in [
            &b"HTTP/1.1 204 No Content\r\ncontent-length: 7\r\n\r\n"[..],
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\n",
        ] {
            let (_, framing, reuse) = head_of(h);
            assert_eq!((framing, reuse), (Framing::Done, false));
        }
        // An unknown (or not-last chunked) transfer coding: until close, never pooled.
        for h in [
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 3\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n",
        ] {
            let (head, framing, reuse) = head_of(h);
            assert_eq!((framing, reuse), (Framing::Eof, false));
            assert!(!head.headers.contains_key("content-length"));
        }
        // Content-Length as hyper's client reads it: a list of one number is that number; a
        // transfer coding or a 204/304 decides whatever it says (never pooled).
        let (_, framing, reuse) = head_of(b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\n");
        assert_eq!((framing, reuse), (Framing::Length(2), true));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: 2,3\r\n\r\n", false).is_err());
        // At most 100 headers, as hyper's client reads.
        let mut many = b"HTTP/1.1 204 No Content\r\n".to_vec();
        for i in 0..MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: {i}\r\n").as_bytes());
        }
        assert!(parse_head(&[&many[..], b"\r\n"].concat(), false).is_ok());
        many.extend_from_slice(b"x-one-more: 1\r\n\r\n");
        assert!(parse_head(&many, false).is_err());
        // HTTP/1.0 has no transfer codings.
        assert!(parse_head(
            b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            false
        )
        .is_err());
        for h in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\ntransfer-encoding: chunked\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\ntransfer-encoding: gzip\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\ncontent-length: -0\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 0,1\r\n\r\n",
        ] {
            let (_, _, reuse) = head_of(h);
            assert!(!reuse, "{:?}", String::from_utf8_lossy(h));
        }
        // A 101 is refused rather than streamed on as a body.
        assert!(parse_head(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
            false
        )
        .is_err());
    }
}
