//! One client connection. The common request — `POST /v1/completions` or
//! `POST /v1/chat/completions`, HTTP/1.1, a `Content-Length` body within the size limit, no
//! `Expect`, `Transfer-Encoding`, `Upgrade` or `Connection: close` — is read, handed to the proxy
//! handler and answered here, the connection kept for the next one. Anything else (another
//! path or method, a chunked body, `Expect: 100-continue`, HTTP/1.0, an oversized or malformed
//! head) hands the connection, with every byte read so far, to hyper's HTTP/1 server for the
//! rest of its life, so every edge of HTTP/1.1 keeps hyper's handling.
//!
//! Shutdown (`stop` turning true): an idle connection closes at once; a request in progress is
//! answered (its stream to the end) with `connection: close`, then the connection closes. A
//! connection handed to hyper is shut down by hyper's graceful shutdown.

use super::proxy;
use super::state::Shared;
use super::upstream::{content_length, put_header, put_length};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use std::io::{self, Write as _};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;

/// A request body's buffer grows by at most this much per read, as its bytes arrive (never
/// by its declared length at once).
const BODY_STEP: usize = 64 * 1024;
/// Longest request head read here; a longer one goes to hyper (which answers 431).
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 64;

/// Serve `tcp` until the client closes, an error, or `stop`. `_alive` is held for the
/// connection's life (the server waits for every holder to go when it drains).
pub(crate) async fn serve(
    mut tcp: TcpStream,
    s: Arc<Shared>,
    app: axum::Router,
    mut stop: watch::Receiver<bool>,
    _alive: tokio::sync::mpsc::Sender<()>,
) {
    let mut buf = BytesMut::with_capacity(8 * 1024);
    // This client connection's own upstream connections (see `upstream::Kept`).
    let kept = super::upstream::Kept::default();
    loop {
        // A whole request head, or the reason there is none.
        let (head_len, fast) = match read_head(&mut tcp, &mut buf, &mut stop, &s.cfg).await {
            Head::Complete(n, fast) => (n, fast),
            Head::Gone => return,
            Head::Other => break,
        };
        let Some(req) = fast else {
            // Not the common case: hyper takes the connection from this request's first byte.
            break;
        };
        // The body: what came with the head, then the rest, within the body budget and the
        // body deadline, the buffer growing only as bytes arrive.
        let Some(_budget) = s.reserve_body(req.body_len) else {
            let _ = refuse(&mut tcp, 503, "the router is buffering as many request bodies as it may (max_buffered_bytes); retry shortly").await;
            return;
        };
        let whole = head_len + req.body_len;
        let deadline = tokio::time::Instant::now() + s.cfg.body_timeout;
        while buf.len() < whole {
            buf.reserve((whole - buf.len()).min(BODY_STEP));
            match tokio::time::timeout_at(deadline, tcp.read_buf(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => {}
                Ok(_) => return, // closed or broken mid-body: nothing to answer
                Err(_) => {
                    s.counters
                        .body_timeouts
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let msg = format!(
                        "the request body did not arrive within {:?} (body_timeout)",
                        s.cfg.body_timeout
                    );
                    let _ = refuse(&mut tcp, 408, &msg).await;
                    return;
                }
            }
        }
        let message = buf.split_to(whole).freeze();
        let Some(mut request) = req.into_request(&message, message.slice(head_len..)) else {
            // A target or header hyper's types refuse: hyper answers it (400).
            let mut all = BytesMut::from(&message[..]);
            all.extend_from_slice(&buf);
            buf = all;
            break;
        };
        request.extensions_mut().insert(kept.clone());
        let resp = proxy::completions(axum::extract::State(s.clone()), request).await;
        let closing = *stop.borrow();
        if write_response(&mut tcp, resp, closing).await.is_err() || closing {
            return;
        }
    }
    hand_to_hyper(tcp, buf.freeze(), s, app, stop).await;
}

/// What [`read_head`] found at the start of the buffer.
enum Head {
    /// A whole head of this many bytes; the request if it is the common case.
    Complete(usize, Option<FastRequest>),
    /// Malformed, too many headers or too long: hyper answers it.
    Other,
    /// The client closed, the connection broke, the head timed out, or `stop` came while idle.
    Gone,
}

/// Read until `buf` starts with a whole request head.
async fn read_head(
    tcp: &mut TcpStream,
    buf: &mut BytesMut,
    stop: &mut watch::Receiver<bool>,
    cfg: &super::RouterConfig,
) -> Head {
    let deadline = tokio::time::Instant::now() + cfg.head_timeout;
    loop {
        if !buf.is_empty() {
            match parse_head(buf, cfg.max_body_bytes) {
                Some(h) => return h,
                None if buf.len() > MAX_HEAD => return Head::Other,
                None => {}
            }
        } else if *stop.borrow() {
            return Head::Gone;
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(8 * 1024);
        }
        let idle = buf.is_empty();
        tokio::select! {
            read = tcp.read_buf(buf) => match read {
                Ok(0) | Err(_) => return Head::Gone,
                Ok(_) => {}
            },
            _ = tokio::time::sleep_until(deadline) => return Head::Gone,
            changed = stop.changed(), if idle => {
                if changed.is_err() {
                    return Head::Gone;
                }
            }
        }
    }
}

/// What the fast path needs of a request head.
struct FastRequest {
    /// Request target's byte range in the head.
    target: (usize, usize),
    /// Header (name, value) byte ranges in the head.
    headers: Vec<((usize, usize), (usize, usize))>,
    body_len: usize,
}

/// Parse the head at the start of `buf`: `None` while incomplete.
fn parse_head(buf: &[u8], max_body: usize) -> Option<Head> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Request::new(&mut slots);
    match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            Some(Head::Complete(n, fast_request(&r, buf, max_body)))
        }
        Ok(httparse::Status::Partial) => None,
        Err(_) => Some(Head::Other),
    }
}

/// The parsed head's request, if it is the common case (see the module docs); byte ranges
/// are relative to `buf`, which starts with the head.
fn fast_request(r: &httparse::Request, buf: &[u8], max_body: usize) -> Option<FastRequest> {
    if r.method? != "POST" || r.version? != 1 {
        return None;
    }
    let target = r.path?;
    let path = target.split('?').next().unwrap_or(target);
    if !matches!(path, "/v1/completions" | "/v1/chat/completions") {
        return None;
    }
    let range = |s: &[u8]| {
        let start = s.as_ptr() as usize - buf.as_ptr() as usize;
        (start, start + s.len())
    };
    let mut body_len = None;
    let mut headers = Vec::with_capacity(r.headers.len());
    for h in r.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("content-length") {
            // Anything but plain digits goes to hyper, whose verdict (400) stands; so does a
            // second Content-Length, even an equal one (hyper refuses different ones and keeps
            // one of equal ones, where the handler would have seen both).
            if body_len.is_some() {
                return None;
            }
            body_len = Some(usize::try_from(content_length(h.value)?).ok()?);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
            || name.eq_ignore_ascii_case("upgrade")
        {
            return None;
        } else if name.eq_ignore_ascii_case("connection") {
            let v = std::str::from_utf8(h.value).ok()?;
            if v.split(',')
                .any(|t| !t.trim().eq_ignore_ascii_case("keep-alive"))
            {
                return None;
            }
        }
        headers.push((range(name.as_bytes()), range(h.value)));
    }
    let body_len = body_len?;
    if body_len > max_body {
        return None;
    }
    Some(FastRequest {
        target: range(target.as_bytes()),
        headers,
        body_len,
    })
}

impl FastRequest {
    /// The request for the proxy handler; header values share the bytes of `head` (which
    /// starts with the head; byte ranges are relative to it).
    fn into_request(
        self,
        head: &Bytes,
        body: Bytes,
    ) -> Option<hyper::Request<http_body_util::Full<Bytes>>> {
        let uri = hyper::Uri::from_maybe_shared(head.slice(self.target.0..self.target.1)).ok()?;
        let mut headers = HeaderMap::with_capacity(self.headers.len());
        for ((n0, n1), (v0, v1)) in self.headers {
            let name = HeaderName::from_bytes(head.get(n0..n1)?).ok()?;
            let value = HeaderValue::from_maybe_shared(head.slice(v0..v1)).ok()?;
            headers.append(name, value);
        }
        let mut req = hyper::Request::new(http_body_util::Full::new(body));
        *req.method_mut() = hyper::Method::POST;
        *req.uri_mut() = uri;
        *req.headers_mut() = headers;
        Some(req)
    }
}

/// Write `resp`: by its `content-length` if it has one, else by the body's exact size if
/// known, else chunked, each piece written as it comes. `closing`: say `connection: close`.
/// An error (the client went away, or the body broke mid-stream) means the connection must
/// close, the response unfinished.
async fn write_response(tcp: &mut TcpStream, resp: Response, closing: bool) -> io::Result<()> {
    let (parts, mut body) = resp.into_parts();
    let declared: Option<u64> = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    // 204 and 304 answers carry no body and no length.
    let bodiless = matches!(parts.status.as_u16(), 204 | 304);
    let length = if bodiless {
        Some(0)
    } else {
        declared.or_else(|| hyper::body::Body::size_hint(&body).exact())
    };
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or("Unknown")
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    for (k, v) in &parts.headers {
        if *k == header::CONTENT_LENGTH
            || *k == header::TRANSFER_ENCODING
            || *k == header::CONNECTION
        {
            continue;
        }
        put_header(&mut out, k.as_str().as_bytes(), v.as_bytes());
    }
    if !parts.headers.contains_key(header::DATE) {
        put_header(
            &mut out,
            b"date",
            httpdate::fmt_http_date(std::time::SystemTime::now()).as_bytes(),
        );
    }
    match length {
        _ if bodiless => {}
        Some(n) => put_length(&mut out, n),
        None => put_header(&mut out, b"transfer-encoding", b"chunked"),
    }
    if closing {
        put_header(&mut out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    if bodiless {
        return tcp.write_all(&out).await;
    }
    let mut left = length;
    // Each piece goes out as it arrives, the head with the first, so that a whole small answer
    // is one write.
    loop {
        let piece = match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) if d.is_empty() => continue,
                Ok(d) => Some(d),
                Err(_) => continue, // trailers are not passed on
            },
            Some(Err(e)) => {
                if !out.is_empty() {
                    let _ = tcp.write_all(&out).await;
                }
                return Err(io::Error::other(e));
            }
            None => None,
        };
        let Some(d) = piece else {
            return match left {
                Some(0) => tcp.write_all(&out).await,
                Some(_) => {
                    let _ = tcp.write_all(&out).await;
                    Err(io::Error::other("response body shorter than its length"))
                }
                None => {
                    out.extend_from_slice(b"0\r\n\r\n");
                    tcp.write_all(&out).await
                }
            };
        };
        match &mut left {
            Some(l) => {
                if d.len() as u64 > *l {
                    return Err(io::Error::other("response body longer than its length"));
                }
                *l -= d.len() as u64;
                out.extend_from_slice(&d);
                // At the length the answer is complete and goes out now; the body is still
                // polled to its end (the next frame is its end), so that the upstream side
                // sees a clean finish.
            }
            None => {
                let _ = write!(out, "{:x}\r\n", d.len());
                out.extend_from_slice(&d);
                out.extend_from_slice(b"\r\n");
                if hyper::body::Body::is_end_stream(&body) {
                    out.extend_from_slice(b"0\r\n\r\n");
                    return tcp.write_all(&out).await;
                }
            }
        }
        tcp.write_all(&out).await?;
        out.clear();
    }
}

/// Answer `status` with a JSON error and `connection: close` (the caller then closes).
pub(crate) async fn refuse(tcp: &mut TcpStream, status: u16, message: &str) -> io::Result<()> {
    let code =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::SERVICE_UNAVAILABLE);
    let body =
        serde_json::json!({"error": {"message": message, "type": "router_limit", "code": status}})
            .to_string();
    let mut out = Vec::with_capacity(256 + body.len());
    let _ = write!(
        out,
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nconnection: close\r\n",
        code.as_str(),
        code.canonical_reason().unwrap_or("")
    );
    put_length(&mut out, body.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.as_bytes());
    tokio::time::timeout(Duration::from_secs(1), tcp.write_all(&out))
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
}

/// Serve the rest of the connection with hyper's HTTP/1 server, `prefix` (bytes already read)
/// first.
async fn hand_to_hyper(
    tcp: TcpStream,
    prefix: Bytes,
    s: Arc<Shared>,
    app: axum::Router,
    mut stop: watch::Receiver<bool>,
) {
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(s.cfg.head_timeout)
        .serve_connection(
            hyper_util::rt::TokioIo::new(Prefixed { prefix, io: tcp }),
            proxy::service(s, app),
        );
    tokio::pin!(conn);
    let stopped = async move {
        let _ = stop.wait_for(|v| *v).await;
    };
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stopped => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// A connection whose first bytes were already read.
struct Prefixed {
    prefix: Bytes,
    io: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(out.remaining());
            let taken = self.prefix.split_to(n);
            out.put_slice(&taken);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, out)
    }
}

super::upstream::write_through_io!(Prefixed);

#[cfg(test)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    fn fast(head: &str) -> Option<FastRequest> {
        match parse_head(head.as_bytes(), 1000) {
            Some(Head::Complete(n, f)) => {
                assert_eq!(n, head.len());
                f
            }
            _ => panic!("{head:?} is a whole head"),
        }
    }

    #[test]
    fn only_the_common_request_takes_the_fast_path() {
        let ok = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\n";
        let r = fast(ok).expect("common case");
        assert_eq!(r.body_len, 5);
        assert_eq!(r.headers.len(), 3);
        let req = r
            .into_request(
                &Bytes::copy_from_slice(ok.as_bytes()),
                Bytes::from_static(b"hello"),
            )
            .unwrap();
        assert_eq!(req.uri().path(), "/v1/completions");
        assert_eq!(req.headers()["host"], "x");
        assert!(
            fast("POST /v1/chat/completions?x=1 HTTP/1.1\r\ncontent-length: 0\r\n\r\n").is_some()
        );
        assert!(parse_head(b"POST /v1/completions HTTP/1.1\r\ncontent-le", 1000).is_none());
        // httparse takes a `"` in the target, hyper's URI type does not: no request here.
        let quoted = "POST /v1/completions?q=\" HTTP/1.1\r\ncontent-length: 0\r\n\r\n";
        let r = fast(quoted).expect("the head is the common shape");
        assert!(r
            .into_request(&Bytes::copy_from_slice(quoted.as_bytes()), Bytes::new())
            .is_none());
        assert!(matches!(
            parse_head(b"POST /v1/completions HTTP/1.1\r\nbad header\r\n\r\n", 1000),
            Some(Head::Other)
        ));
        for other in [
            "GET /v1/completions HTTP/1.1\r\ncontent-length: 5\r\n\r\n",
            "POST /v1/models HTTP/1.1\r\ncontent-length: 5\r\n\r\n",
            "POST /v1/completions HTTP/1.0\r\ncontent-length: 5\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\nconnection: close\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: 1001\r\n\r\n",
            "POST /v1/completions HTTP/1.1\r\ncontent-length: x\r\n\r\n",
        ] {
            assert!(fast(other).is_none(), "{other:?} must go to hyper");
        }
    }
}
