//! The request path's upstream connections: per destination, a stack of idle HTTP/1
//! connections (hyper's connection-level client), one taken per request and given back when
//! that request's response body has ended cleanly.
//!
//! Why not a general-purpose pooled client: the request path knows its destinations up front
//! (no URL parsing or connector per request), a connection is reused by the next request as
//! soon as its answer has been read (no extra task per request to watch for that), and a
//! serving worker keeps its own `Upstream` so its connections live on its own thread.

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::http::{HeaderValue, Request, Response};
use std::sync::Mutex;
use std::time::Duration;

/// A connection to one destination, ready for (or busy with) one request at a time.
pub(crate) type Conn = SendRequest<Full<Bytes>>;

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

/// Why a send failed, in words.
pub(crate) struct SendError {
    pub message: String,
}

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

    /// The request target for `pq` (path and query) at destination `d`.
    pub fn uri(&self, d: usize, pq: &str) -> Result<hyper::Uri, String> {
        let base = &self.targets[d].base;
        let parsed = if base.is_empty() {
            hyper::Uri::try_from(pq)
        } else {
            hyper::Uri::try_from(format!("{base}{pq}"))
        };
        parsed.map_err(|e| format!("bad request path {pq}: {e}"))
    }

    /// The `Host` header for destination `d`.
    pub fn host(&self, d: usize) -> HeaderValue {
        self.targets[d].host.clone()
    }

    fn take(&self, d: usize) -> Option<Conn> {
        let mut idle = self.idle.lock().expect("upstream idle");
        let stack = &mut idle[d];
        while let Some(c) = stack.pop() {
            if !c.is_closed() {
                return Some(c);
            }
        }
        None
    }

    /// Give a connection back after its response body ended.
    pub fn put(&self, d: usize, c: Conn) {
        if c.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().expect("upstream idle");
        if idle[d].len() < self.max_idle {
            idle[d].push(c);
        }
    }

    async fn connect(&self, d: usize) -> Result<Conn, SendError> {
        let at = &self.targets[d].connect;
        let fail = |m: String| SendError { message: m };
        let tcp = match tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect(at.as_str()),
        )
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
        let _ = tcp.set_nodelay(true);
        let (tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| fail(format!("HTTP handshake with {at}: {e}")))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(tx)
    }

    /// Send `req` to destination `d` on an idle connection (or a new one) and wait for the
    /// response head. A request that an idle connection could not take (it was closing) is
    /// sent again on the next one; it never reached the destination.
    pub async fn send(
        &self,
        d: usize,
        mut req: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, Conn), SendError> {
        loop {
            let (mut c, reused) = match self.take(d) {
                Some(c) => (c, true),
                None => (self.connect(d).await?, false),
            };
            if let Err(e) = c.ready().await {
                if reused {
                    continue;
                }
                return Err(SendError {
                    message: error_chain(&e),
                });
            }
            match c.try_send_request(req).await {
                Ok(resp) => return Ok((resp, c)),
                Err(mut e) => match e.take_message() {
                    Some(back) if reused => req = back,
                    _ => {
                        return Err(SendError {
                            message: error_chain(e.error()),
                        })
                    }
                },
            }
        }
    }
}

/// An error and its sources, `: `-joined.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        msg.push_str(&format!(": {x}"));
        src = x.source();
    }
    msg
}
