//! Raw-socket helpers for test backends that misbehave on purpose.

use cacheroute::policy::PolicySpec;
use cacheroute::router::RouterConfig;
use std::time::Duration;

/// A sticky router in front of one backend at `url`, on `workers` serving threads (0: the
/// caller's runtime), probing it every 30 s (the first probe at start).
pub fn one_backend(url: String, workers: usize) -> RouterConfig {
    let mut cfg = RouterConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![url],
        PolicySpec::from_name("sticky").unwrap(),
    );
    cfg.workers = workers;
    cfg.health_interval = Duration::from_secs(30);
    cfg
}

/// One whole request (head and `Content-Length` body) read by a raw test backend: its head, or
/// `None` when the peer closed or, with `idle`, sent nothing for that long.
pub async fn read_request(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
    idle: Option<Duration>,
) -> Option<String> {
    read_message(s, buf, idle).await.map(|(head, _)| head)
}

/// [`read_request`] from any reader, with the request's body.
pub async fn read_message(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
    buf: &mut Vec<u8>,
    idle: Option<Duration>,
) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                let body = buf[end + 4..end + 4 + len].to_vec();
                buf.drain(..end + 4 + len);
                return Some((head, body));
            }
        }
        let mut chunk = [0u8; 4096];
        let read = s.read(&mut chunk);
        let n = match idle {
            Some(d) => tokio::time::timeout(d, read).await.ok()?,
            None => read.await,
        }
        .ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}
