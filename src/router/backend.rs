//! A backend's base URL, parsed once: the one type the start-up check, the backends file, DNS
//! discovery and the upstream client share, so nothing downstream can refuse what the check
//! passed.
//!
//! Accepted: `http://HOST[:PORT][/BASE]`, HOST an IPv4 address, a bracketed IPv6 address or a
//! DNS name (letters, digits, `-`, `_`, `.`), PORT 1–65535 (80 when none), BASE a path of
//! URI characters that names no endpoint (`/v1/…`, `/health`, `/metrics`: the router adds
//! those itself); at most [`MAX_URL`] bytes of printable ASCII. A trailing `/` is dropped.
//! Every accepted value is also accepted by hyper's `Uri` (the upstream client), by
//! `reqwest::Url` (health probes, metric scrapes) and as a `Host` header value: the parse
//! checks all three, and the derived parts (where to connect, the `Host` header, the base
//! path) are kept from it.
//!
//! Also [`DnsName`], a `backends_dns` value (a name to look up, not an address).

use hyper::http::HeaderValue;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// Longest backend URL accepted, in bytes.
pub(crate) const MAX_URL: usize = 2048;

/// A parsed backend base URL (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BackendUrl {
    /// The URL as the router names it (no trailing `/`).
    text: Arc<str>,
    /// `host:port` to connect to.
    connect: String,
    /// The `Host` header: the URL's authority.
    host: HeaderValue,
    /// The path put before every request's path (empty for a plain `http://host:port`).
    base: String,
    /// The address, when HOST is one (the EPP names destinations to Envoy as `IP:PORT`).
    socket: Option<SocketAddr>,
}

impl BackendUrl {
    /// Parse `given`, or say in one line what is wrong with it and what to give instead.
    pub(crate) fn parse(given: &str) -> Result<BackendUrl, String> {
        if given.len() > MAX_URL {
            return Err(format!(
                "a {}-byte backend URL is over the {MAX_URL}-byte limit; give the engine's base URL, http://HOST:PORT",
                given.len()
            ));
        }
        let shown = || given.escape_debug().to_string();
        if let Some(c) = given.chars().find(|c| !c.is_ascii_graphic()) {
            return Err(format!(
                "`{}` holds {:?}; a backend URL is printable ASCII without spaces or control characters",
                shown(),
                c
            ));
        }
        let text = given.trim_end_matches('/');
        let uri: hyper::Uri = text
            .parse()
            .map_err(|e| format!("`{}` is not a URL ({e})", shown()))?;
        let plain = || {
            format!(
                "`{}` must be a plain http:// URL with a host (engines serve plain HTTP)",
                shown()
            )
        };
        if !uri
            .scheme_str()
            .is_some_and(|s| s.eq_ignore_ascii_case("http"))
        {
            return Err(plain());
        }
        let Some(authority) = uri.authority() else {
            return Err(plain());
        };
        let endpoint = || {
            format!("`{}` names an endpoint, a query or a user; give the engine's base URL, http://HOST:PORT (the router adds /v1/… and /health itself)", shown())
        };
        if authority.as_str().contains('@')
            || uri.query().is_some()
            || text.contains(['?', '#'])
            || is_endpoint_path(uri.path())
        {
            return Err(endpoint());
        }
        let host = authority.host();
        let ip = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(v6) => Some(
                v6.parse::<std::net::Ipv6Addr>()
                    .map(IpAddr::V6)
                    .map_err(|_| format!("`{}`: `{host}` is not an IPv6 address", shown()))?,
            ),
            None => {
                let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
                if host.is_empty() || !host.chars().all(name_char) {
                    return Err(format!(
                        "`{}`: `{host}` is neither an address nor a DNS name",
                        shown()
                    ));
                }
                host.parse::<IpAddr>().ok()
            }
        };
        let port = match authority.port() {
            None if authority.as_str().ends_with(':') => {
                return Err(format!("`{}`: the port after `:` is missing", shown()))
            }
            None => 80,
            Some(p) => match p.as_u16() {
                0 => return Err(format!("`{}`: port 0 is not a port (1-65535)", shown())),
                p => p,
            },
        };
        // Health probes and metric scrapes go through reqwest: it must take the URL too.
        if let Err(e) = reqwest::Url::parse(text) {
            return Err(format!("`{}` is not a URL ({e})", shown()));
        }
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|_| format!("`{}`: `{authority}` cannot be a Host header", shown()))?;
        Ok(BackendUrl {
            text: text.into(),
            connect: format!("{host}:{port}"),
            host: host_header,
            base: uri.path().trim_end_matches('/').to_string(),
            socket: ip.map(|ip| SocketAddr::new(ip, port)),
        })
    }

    /// The URL, without a trailing `/`.
    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }

    /// `host:port` to connect to.
    pub(crate) fn connect(&self) -> &str {
        &self.connect
    }

    /// The `Host` header value.
    pub(crate) fn host_header(&self) -> &HeaderValue {
        &self.host
    }

    /// The base path before every request's path (`""` for none).
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// `IP:PORT`, when the URL is `http://IP:PORT` with no base path (what the EPP can name to
    /// Envoy).
    pub(crate) fn ip_port(&self) -> Option<SocketAddr> {
        self.socket.filter(|_| self.base.is_empty())
    }

    /// [`BackendUrl::ip_port`], or why the EPP cannot take this backend.
    pub(crate) fn check_ip_port(&self) -> Result<SocketAddr, String> {
        self.ip_port().ok_or_else(|| {
            format!(
                "`{self}`: the EPP names destinations to Envoy as IP:PORT; give http://IP:PORT (no host name, no base path)"
            )
        })
    }
}

impl std::fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// `b` without a trailing `/v1` (`http://h:p/v1` → `http://h:p`), when it has one after a
/// bare host: the OpenAI base-URL habit, taken rather than refused.
pub(crate) fn without_v1(b: &str) -> Option<String> {
    let base = b.trim().trim_end_matches('/').strip_suffix("/v1")?;
    BackendUrl::parse(base)
        .ok()
        .filter(|u| u.base.is_empty())
        .map(|u| u.as_str().to_string())
}

/// Whether a backend URL's path is (or holds) an OpenAI or health endpoint rather than a
/// base path: `/v1/…`, `/health`, `/metrics`. A plain base path (an engine behind a proxy at
/// `/replica-3`) is kept; a trailing `/v1` is dropped by [`without_v1`].
fn is_endpoint_path(path: &str) -> bool {
    path.trim_end_matches('/')
        .split('/')
        .any(|seg| matches!(seg, "v1" | "health" | "metrics"))
}

/// A `backends_dns` value: which name, which record type, which port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DnsName {
    /// As given (for log lines).
    pub spec: String,
    /// The name asked for.
    pub host: String,
    /// `None`: SRV records (each names its port); `Some`: A/AAAA records at this port.
    pub port: Option<u16>,
}

impl DnsName {
    /// `http://NAME[:PORT]` (port 80 when none) or `srv+http://NAME`; NAME a DNS name, not an
    /// address; no path.
    pub(crate) fn parse(spec: &str) -> Result<DnsName, String> {
        let (srv, rest) = if let Some(r) = spec.strip_prefix("srv+http://") {
            (true, r)
        } else if let Some(r) = spec.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(format!(
                "`{spec}` is neither http://NAME:PORT (A/AAAA records) nor srv+http://NAME (SRV records)"
            ));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('/') || rest.contains('@') || rest.contains('?') {
            return Err(format!(
                "`{spec}`: give a name (and for http:// a port), no path or user"
            ));
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some(_) if srv => {
                return Err(format!(
                    "`{spec}`: an SRV record names the port; drop `:PORT`"
                ))
            }
            Some((h, p)) => match p.parse::<u16>() {
                Ok(p) if p > 0 => (h, Some(p)),
                _ => return Err(format!("`{spec}`: `{p}` is not a port (1-65535)")),
            },
            None if srv => (rest, None),
            None => (rest, Some(80)),
        };
        let bad_char = |c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
        if host.is_empty()
            || host.starts_with('.')
            || host.contains("..")
            || host.contains(bad_char)
        {
            return Err(format!("`{spec}`: `{host}` is not a DNS name"));
        }
        if host.parse::<IpAddr>().is_ok() {
            return Err(format!(
                "`{spec}`: `{host}` is an address, not a name; give it with --backend"
            ));
        }
        Ok(DnsName {
            spec: spec.to_string(),
            host: host.to_string(),
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_urls_parse_into_their_parts() {
        let u = BackendUrl::parse("http://127.0.0.1:9001/").unwrap();
        assert_eq!(
            (u.as_str(), u.connect(), u.base()),
            ("http://127.0.0.1:9001", "127.0.0.1:9001", "")
        );
        assert_eq!(u.ip_port(), Some("127.0.0.1:9001".parse().unwrap()));
        let u = BackendUrl::parse("http://vllm-0.vllm:8000/replica-3/").unwrap();
        assert_eq!(
            (u.connect(), u.base(), u.host_header().to_str().unwrap()),
            ("vllm-0.vllm:8000", "/replica-3", "vllm-0.vllm:8000")
        );
        assert_eq!(u.ip_port(), None);
        let u = BackendUrl::parse("HTTP://[::1]").unwrap();
        assert_eq!(u.connect(), "[::1]:80");
        assert_eq!(u.ip_port(), Some("[::1]:80".parse().unwrap()));
        assert_eq!(without_v1("http://h:1/v1/").as_deref(), Some("http://h:1"));
        assert_eq!(without_v1("http://h:1/x/v1"), None);
    }

    /// What reqwest's parser took and hyper's `Uri` refused (the router then panicked when it
    /// built the upstream target), and what neither should take.
    #[test]
    fn what_any_consumer_would_refuse_is_refused_here_with_a_reason() {
        let long = format!("http://127.0.0.1:9/{}", "a".repeat(70_000));
        for (bad, why) in [
            ("http://127.0.0.1:9/<r>", "not a URL"),
            ("http://127.0.0.1:9/`", "not a URL"),
            ("http://127.0.0.1:9/a b", "printable ASCII"),
            ("\u{1}http://127.0.0.1:9", "printable ASCII"),
            ("http://127.0.0.1:9\u{7f}", "printable ASCII"),
            ("\0\0http://127.0.0.1:9", "printable ASCII"),
            ("http://127.0.0.1:9\t", "printable ASCII"),
            ("http://bücher:9", "printable ASCII"),
            (long.as_str(), "byte limit"),
            ("http://127.0.0.1:0", "port 0"),
            ("http://127.0.0.1:", "port"),
            ("http://127.0.0.1:70000", "not a URL"),
            ("http://a%41:9", "not a URL"),
            ("http://a!b:9", "neither an address"),
            ("http://[zz]:9", "IPv6"),
            ("https://127.0.0.1:9", "plain http://"),
            ("127.0.0.1:9", "plain http://"),
            ("http://u@127.0.0.1:9", "endpoint, a query or a user"),
            ("http://127.0.0.1:9/?x", "endpoint, a query or a user"),
            ("http://127.0.0.1:9/#x", "endpoint, a query or a user"),
            ("http://127.0.0.1:9/v1/models", "endpoint"),
            ("http://127.0.0.1:9/metrics", "endpoint"),
        ] {
            let e = BackendUrl::parse(bad).expect_err(bad);
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.len() < 400, "{bad:?}: the message is one short line: {e}");
        }
    }

    proptest::proptest! {
        /// Whatever is accepted, the upstream client, the probes and the Host header take.
        #[test]
        fn what_is_accepted_every_consumer_takes(s in "http://[ -~]{0,40}") {
            if let Ok(u) = BackendUrl::parse(&s) {
                proptest::prop_assert!(u.as_str().parse::<hyper::Uri>().is_ok());
                let probe = format!("{u}/health");
                proptest::prop_assert!(reqwest::Url::parse(&probe).is_ok());
                let path = format!("{}/v1/completions", u.base());
                proptest::prop_assert!(path.parse::<hyper::Uri>().is_ok(), "{}", path);
                proptest::prop_assert!(u.connect().contains(':'));
            }
        }
    }
}
