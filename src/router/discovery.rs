//! Discovery without restarts: the backends from a watched file (`backends_file`) or from DNS
//! (`backends_dns`), two sources of one backend list feeding one repair path ([`apply`]).
//!
//! **The file** holds one backend base URL a line; blank lines and text after `#` are ignored.
//! It is looked at every `backends_poll`: when its identity (device, inode), size or
//! modification time changed — a tool wrote a new file and renamed it over the old one, as
//! Kubernetes ConfigMap volumes and most tools do — it is read again. A file that is
//! unreadable, empty, or has a line that is not a backend URL or repeats one is refused whole
//! with one log line naming the file and line; the backends in force are kept.
//!
//! **DNS** is asked every `backends_poll`: `http://NAME:PORT` gives a backend
//! `http://ADDR:PORT` for every A and AAAA address of NAME (a Kubernetes headless Service);
//! `srv+http://NAME` one `http://ADDR:PORT` for every SRV record of NAME, ADDR each address of
//! the record's target and PORT the record's. The resolver is the system's (resolv.conf) or
//! `dns_server`, with no cache: every interval asks again. A failed lookup (timeout, refusal),
//! an empty answer (NXDOMAIN, no records) and an SRV target without an address are all
//! refused whole with one log line (once, until the answer changes) and the backends in force
//! kept: fail static, as a ConfigMap emptied by mistake is.
//!
//! A removed backend's slot becomes vacant ([`Fleet::vacate`]): down for good, never chosen;
//! requests in flight to it finish on the connections they hold, and CacheRoute's plan is
//! repaired so only the keys it held move. An added backend fills a vacant slot — the one it
//! held before if free, so consistent-hashing policies and the plan give it back its keys —
//! and comes up when its first health probe passes.
//!
//! [`Fleet::vacate`]: super::fleet::Fleet::vacate

use super::backend::{without_v1, BackendUrl, DnsName};
use super::lock::Locked;
use super::state::{Cmd, Shared};
use crate::policy::FleetView;
use futures_util::FutureExt as _;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Parse a backends file's text: the base URLs in order, or (line number, why) for the first
/// bad line (the whole file is then refused).
/// With `ip_port`, every line must be `http://IP:PORT` (the EPP's backends).
pub(crate) fn parse(text: &str, ip_port: bool) -> Result<Vec<BackendUrl>, (usize, String)> {
    let mut urls: Vec<BackendUrl> = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let b = line.split('#').next().unwrap_or("").trim();
        if b.is_empty() {
            continue;
        }
        if b.split_whitespace().nth(1).is_some() {
            return Err((
                n,
                format!("`{b}` holds more than one word; give one base URL a line"),
            ));
        }
        let b = without_v1(b).unwrap_or_else(|| b.to_string());
        let b = BackendUrl::parse(&b).map_err(|why| (n, why))?;
        if ip_port {
            b.check_ip_port().map_err(|why| (n, why))?;
        }
        if let Some(before) = first_line.insert(b.as_str().to_string(), n) {
            return Err((
                n,
                format!("`{b}` repeats line {before}; name each backend once"),
            ));
        }
        urls.push(b);
    }
    if urls.is_empty() {
        return Err((0, "names no backend; a router needs at least one".into()));
    }
    Ok(urls)
}

/// Read and parse the file at `path`, the message naming it and the line.
pub(crate) fn read(path: &Path, ip_port: bool) -> Result<Vec<BackendUrl>, String> {
    let text = read_bounded(path)?;
    parse(&text, ip_port).map_err(|(line, why)| match line {
        0 => format!("backends file {}: {why}", path.display()),
        n => format!("backends file {} line {n}: {why}", path.display()),
    })
}

/// Largest backends file read (a line a backend: far more than `--max-backends` allows).
const MAX_FILE: u64 = 4 << 20;

/// The file's text, refused unread past [`MAX_FILE`] bytes.
fn read_bounded(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let named = |e: String| format!("backends file {}: {e}", path.display());
    let f = std::fs::File::open(path).map_err(|e| named(e.to_string()))?;
    let mut bytes = Vec::new();
    f.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| named(e.to_string()))?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(named(format!(
            "over {MAX_FILE} bytes; a backends file names one base URL a line"
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        named(format!(
            "not UTF-8 text (a bad byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// What tells one version of the file from another.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

fn identity(path: &Path) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Identity {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        modified: m.modified().ok(),
    })
}

/// What a source says when looked at.
enum Look {
    /// Nothing new since the last look.
    Same,
    /// The backends it names now.
    Backends(Vec<BackendUrl>),
    /// Why what it says now is refused (the message names the source).
    Refused(String),
}

/// Where the backends come from while routing.
enum Source {
    File {
        path: std::path::PathBuf,
        seen: Option<Identity>,
        /// Only `http://IP:PORT` lines (the EPP's).
        ip_port: bool,
    },
    Dns {
        dns: Box<Dns>,
        /// The last answer or refusal, told once.
        last: Option<Result<Vec<BackendUrl>, String>>,
    },
}

impl Source {
    /// What it is, for log lines.
    fn name(&self) -> String {
        match self {
            Source::File { path, .. } => format!("backends file {}", path.display()),
            Source::Dns { dns, .. } => format!("backends DNS {}", dns.name.spec),
        }
    }

    async fn look(&mut self) -> Look {
        match self {
            Source::File {
                path,
                seen,
                ip_port,
            } => {
                let now = identity(path);
                if now == *seen {
                    return Look::Same;
                }
                *seen = now;
                // A rename may land just after a tool truncated or created the file: read what
                // is there now; a later change is seen on a later tick.
                match read(path, *ip_port) {
                    Ok(urls) => Look::Backends(urls),
                    Err(why) => Look::Refused(why),
                }
            }
            Source::Dns { dns, last } => {
                let now = dns.resolve().await;
                if last.as_ref() == Some(&now) {
                    return Look::Same;
                }
                if matches!(last, Some(Err(_))) && now.is_ok() {
                    tracing::info!("backends DNS {}: resolves again", dns.name.spec);
                }
                *last = Some(now.clone());
                match now {
                    Ok(urls) => Look::Backends(urls),
                    Err(why) => Look::Refused(why),
                }
            }
        }
    }
}

/// The backends the configured source names at start (`None` without discovery), or why the
/// router cannot start.
pub(crate) async fn initial(
    cfg: &super::RouterConfig,
) -> Option<Result<Vec<String>, super::RouterError>> {
    let texts = |urls: Vec<BackendUrl>| urls.iter().map(|u| u.as_str().to_string()).collect();
    if let Some(path) = &cfg.backends_file {
        return Some(
            read(path, cfg.ip_port_backends)
                .map(texts)
                .map_err(super::RouterError::BackendsFile),
        );
    }
    let spec = cfg.backends_dns.as_ref()?;
    let dns = Dns::new(spec, cfg.dns_server).map_err(super::RouterError::BackendsDns);
    Some(match dns {
        Ok(dns) => dns.resolve().await.map(texts).map_err(|why| {
            super::RouterError::BackendsDns(format!(
                "{why}; a router needs at least one backend to start"
            ))
        }),
        Err(e) => Err(e),
    })
}

/// Watch the backends file or DNS until the router stops (a background task).
pub(crate) fn spawn(shared: &Arc<Shared>) {
    let mut source = if let Some(path) = shared.cfg.backends_file.clone() {
        Source::File {
            seen: identity(&path),
            path,
            ip_port: shared.cfg.ip_port_backends,
        }
    } else if let Some(spec) = &shared.cfg.backends_dns {
        match Dns::new(spec, shared.cfg.dns_server) {
            Ok(dns) => Source::Dns {
                dns: Box::new(dns),
                // What it resolved to at start is in force.
                last: Some(Ok(shared
                    .fleet
                    .backends()
                    .into_iter()
                    .filter_map(|(_, u)| BackendUrl::parse(&u).ok())
                    .collect())),
            },
            Err(why) => {
                tracing::warn!("backends DNS {spec}: {why}; not re-resolved");
                return;
            }
        }
    } else {
        return;
    };
    let s = shared.clone();
    let task = tokio::spawn(async move {
        let mut last_slot: HashMap<Arc<str>, usize> = s
            .fleet
            .backends()
            .into_iter()
            .map(|(d, u)| (u, d))
            .collect();
        let mut tick = tokio::time::interval(s.cfg.backends_poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let in_force = s.fleet.occupied();
            // A panic in one look is that reload's failure, not the watcher's end.
            let looked = std::panic::AssertUnwindSafe(source.look())
                .catch_unwind()
                .await;
            let Ok(looked) = looked else {
                tracing::warn!(
                    "{}: reading it failed unexpectedly; the {in_force} backends in force are kept",
                    source.name()
                );
                continue;
            };
            match looked {
                Look::Same => {}
                Look::Backends(urls) => {
                    let applied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        apply(&s, &urls, &mut last_slot, &source.name())
                    }))
                    .unwrap_or_else(|_| Err("applying it failed unexpectedly".into()));
                    if let Err(why) = applied {
                        tracing::warn!(
                            "{}: {why}; the {in_force} backends in force are kept",
                            source.name()
                        );
                    }
                }
                Look::Refused(why) => {
                    tracing::warn!("{why}; the {in_force} backends in force are kept")
                }
            }
        }
    });
    shared.background.locked().push(task);
}

/// A DNS name and the resolver that asks for it.
pub(crate) struct Dns {
    name: DnsName,
    resolver: TokioResolver,
}

impl Dns {
    fn new(spec: &str, server: Option<SocketAddr>) -> Result<Dns, String> {
        let name = DnsName::parse(spec)?;
        let provider = TokioRuntimeProvider::default();
        let mut builder = match server {
            Some(at) => {
                let mut ns = NameServerConfig::udp_and_tcp(at.ip());
                for c in &mut ns.connections {
                    c.port = at.port();
                }
                let mut b = TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![ns]),
                    provider,
                );
                // Only what the given server says (no /etc/hosts).
                b.options_mut().use_hosts_file = ResolveHosts::Never;
                b
            }
            None => TokioResolver::builder(provider)
                .map_err(|e| format!("the system's DNS configuration (resolv.conf): {e}"))?,
        };
        let o = builder.options_mut();
        // Every interval asks again; a dead server is given up on within one lookup.
        o.cache_size = 0;
        o.timeout = Duration::from_secs(2);
        o.attempts = 1;
        o.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        let resolver = builder
            .build()
            .map_err(|e| format!("building the DNS resolver: {e}"))?;
        Ok(Dns { name, resolver })
    }

    /// The backends the name resolves to now, sorted, or why not (naming the name).
    async fn resolve(&self) -> Result<Vec<BackendUrl>, String> {
        let n = &self.name;
        let mut urls: Vec<BackendUrl> = Vec::new();
        match n.port {
            Some(port) => {
                for ip in self.addresses(&n.host).await? {
                    urls.push(url(ip, port)?);
                }
            }
            None => {
                let srv = self
                    .resolver
                    .srv_lookup(n.host.as_str())
                    .await
                    .map_err(|e| {
                        format!(
                            "backends DNS {}: SRV lookup of {} failed: {e}",
                            n.spec, n.host
                        )
                    })?;
                let records: Vec<(String, u16)> = srv
                    .answers()
                    .iter()
                    .filter_map(|r| match &r.data {
                        RData::SRV(s) => Some((s.target.to_string(), s.port)),
                        _ => None,
                    })
                    .collect();
                if records.is_empty() {
                    return Err(format!(
                        "backends DNS {}: {} has no SRV record",
                        n.spec, n.host
                    ));
                }
                for (target, port) in records {
                    let ips = self.addresses(&target).await.map_err(|why| {
                        format!("{why} (the target of an SRV record of {})", n.host)
                    })?;
                    for ip in ips {
                        urls.push(url(ip, port)?);
                    }
                }
            }
        }
        urls.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        urls.dedup();
        Ok(urls)
    }

    /// Every A and AAAA address of `host`; an empty answer is an error.
    async fn addresses(&self, host: &str) -> Result<Vec<IpAddr>, String> {
        let spec = &self.name.spec;
        let ips: Vec<IpAddr> = self
            .resolver
            .lookup_ip(host)
            .await
            .map_err(|e| format!("backends DNS {spec}: {host} does not resolve: {e}"))?
            .iter()
            .collect();
        if ips.is_empty() {
            return Err(format!("backends DNS {spec}: {host} has no address"));
        }
        Ok(ips)
    }
}

/// A backend base URL for an address and port (an SRV record's port 0 is refused).
fn url(ip: IpAddr, port: u16) -> Result<BackendUrl, String> {
    BackendUrl::parse(&match ip {
        IpAddr::V4(a) => format!("http://{a}:{port}"),
        IpAddr::V6(a) => format!("http://[{a}]:{port}"),
    })
}

/// Make the fleet hold exactly `urls`: remove those gone, add the new ones to vacant slots
/// (each to the slot it last held when free). Every slot is chosen before anything changes:
/// refused, changing nothing, when they do not fit.
fn apply(
    s: &Shared,
    urls: &[BackendUrl],
    last_slot: &mut HashMap<Arc<str>, usize>,
    from: &str,
) -> Result<(), String> {
    let slots = s.fleet.len();
    let current = s.fleet.backends();
    let removed: Vec<(usize, Arc<str>)> = current
        .iter()
        .filter(|(_, u)| !urls.iter().any(|x| x.as_str() == &**u))
        .cloned()
        .collect();
    let added: Vec<&BackendUrl> = urls
        .iter()
        .filter(|x| !current.iter().any(|(_, u)| x.as_str() == &**u))
        .collect();
    if removed.is_empty() && added.is_empty() {
        return Ok(());
    }
    // The slots the new ones go to: vacant now, or vacated by this change.
    let mut free: Vec<bool> = (0..slots)
        .map(|d| s.fleet.is_vacant(d) || removed.iter().any(|(x, _)| *x == d))
        .collect();
    let mut placed: Vec<(usize, &BackendUrl)> = Vec::with_capacity(added.len());
    for u in &added {
        let is_free = |d: usize| free.get(d).copied().unwrap_or(false);
        let held_by_other = |d: usize| last_slot.iter().any(|(x, &e)| e == d && **x != *u.as_str());
        let Some(d) = last_slot
            .get(u.as_str())
            .copied()
            .filter(|&d| is_free(d))
            .or_else(|| (0..slots).find(|&d| is_free(d) && !held_by_other(d)))
            .or_else(|| (0..slots).find(|&d| is_free(d)))
        else {
            return Err(format!(
                "names {} backends, more than the {slots} destination slots (--max-backends)",
                urls.len()
            ));
        };
        if let Some(f) = free.get_mut(d) {
            *f = false;
        }
        placed.push((d, u));
    }
    for (d, u) in &removed {
        s.targets.set(*d, None);
        s.fleet.vacate(*d);
        tracing::info!(
            destination = d,
            url = %u,
            live = s.fleet.live(),
            "destination {d} removed ({u}): no longer in the {from}; requests in flight to it finish"
        );
    }
    for (d, u) in placed {
        if let Some(m) = s.marks.get(d) {
            m.reset();
        }
        s.targets.set(d, Some(u));
        s.fleet.fill(d, u.as_str());
        last_slot.insert(u.as_str().into(), d);
        tracing::info!(
            destination = d,
            url = %u,
            "destination {d} added ({u}) from the {from}: up when its first health probe passes"
        );
    }
    if !removed.is_empty() {
        s.send_control(Cmd::Repair);
    }
    if let Some(kv) = &s.kv {
        // The KV-event subscriptions follow (`kv_feed`).
        kv.changed.notify_one();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{parse, MAX_FILE};
    use crate::router::backend::DnsName;

    #[test]
    fn a_dns_name_is_http_name_port_or_srv_and_anything_else_is_named() {
        let a = DnsName::parse("http://vllm.default.svc.cluster.local:8000").unwrap();
        assert_eq!(
            (a.host.as_str(), a.port),
            ("vllm.default.svc.cluster.local", Some(8000))
        );
        assert_eq!(DnsName::parse("http://vllm/").unwrap().port, Some(80));
        let s = DnsName::parse("srv+http://_http._tcp.vllm.default.svc.cluster.local").unwrap();
        assert_eq!(
            (s.host.as_str(), s.port),
            ("_http._tcp.vllm.default.svc.cluster.local", None)
        );
        for (bad, why) in [
            ("vllm:8000", "neither"),
            ("https://vllm:8000", "neither"),
            ("http://vllm:8000/v1", "no path"),
            ("http://vllm:0", "not a port"),
            ("http://vllm:http", "not a port"),
            ("srv+http://_http._tcp.vllm:8000", "drop `:PORT`"),
            ("http://10.0.0.1:8000", "an address"),
            ("http://vl lm:8000", "not a DNS name"),
            ("http://:8000", "not a DNS name"),
        ] {
            let e = DnsName::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn an_oversized_or_binary_backends_file_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        let line = "http://10.0.0.1:8000\n";
        std::fs::write(&big, line.repeat((MAX_FILE as usize / line.len()) + 1)).unwrap();
        let e = super::read(&big, false).unwrap_err();
        assert!(e.contains("over 4194304 bytes"), "{e}");
        let bin = dir.path().join("bin");
        std::fs::write(&bin, b"http://10.0.0.1:8000\n\xff\xfe\n").unwrap();
        let e = super::read(&bin, false).unwrap_err();
        assert!(e.contains("not UTF-8") && e.contains("offset 21"), "{e}");
        // A small good file is read.
        let ok = dir.path().join("ok");
        std::fs::write(&ok, "http://10.0.0.1:8000\n").unwrap();
        assert_eq!(super::read(&ok, false).unwrap().len(), 1);
    }

    #[test]
    fn a_backends_file_parses_with_comments_and_names_its_bad_line() {
        let ok = "# fleet\nhttp://10.0.0.1:8000\n\n  http://10.0.0.2:8000/v1  # gpu-2\nhttp://10.0.0.3:8000/\n";
        let parsed: Vec<String> = parse(ok, false)
            .unwrap()
            .iter()
            .map(|u| u.as_str().to_string())
            .collect();
        assert_eq!(
            parsed,
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://10.0.0.3:8000"
            ]
        );
        let (line, why) = parse("http://a:1\nhttp://b:2\nhttp://a:1/\n", false).unwrap_err();
        assert_eq!(line, 3);
        assert!(why.contains("repeats line 1"), "{why}");
        let (line, why) = parse("http://a:1\nnot a url\n", false).unwrap_err();
        assert_eq!(line, 2, "{why}");
        let (line, why) = parse("http://a:1\nhttp://b:2/v1/completions\n", false).unwrap_err();
        assert_eq!(line, 2);
        assert!(why.contains("endpoint"), "{why}");
        let (line, why) = parse("https://a:1\n", false).unwrap_err();
        assert_eq!(line, 1, "{why}");
        assert_eq!(parse("# nothing\n\n", false).unwrap_err().0, 0);
        assert_eq!(parse("", false).unwrap_err().0, 0);
    }
}
