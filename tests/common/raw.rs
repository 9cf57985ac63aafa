//! Raw-socket helpers for test backends that misbehave on purpose.

use std::time::Duration;

/// One whole request (head and `Content-Length` body) read by a raw test backend: its head, or
/// `None` when the peer closed or, with `idle`, sent nothing for that long.
pub async fn read_request(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
    idle: Option<Duration>,
) -> Option<String> {
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
                buf.drain(..end + 4 + len);
                return Some(head);
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
