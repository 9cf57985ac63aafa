//! A dnsmasq (Debian's `dnsmasq-base`, installed by scripts/test.sh; a real DNS server, never
//! a system one) that a test starts on a loopback port and controls: A records from a hosts
//! file re-read on SIGHUP, SRV and other records from options (a restart changes them).
//! tests/router_discovery_dns.rs and tests/deploy_manifests.rs.

use std::io::Read;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A dnsmasq answering for names under one domain only (NXDOMAIN for any other name there; no
/// upstream), from a hosts file and the given records, on 127.0.0.1:`port` (UDP and TCP).
pub struct Dnsmasq {
    child: Child,
    pub port: u16,
    domain: String,
    hosts: PathBuf,
}

fn dnsmasq_bin() -> &'static str {
    if Path::new("/usr/sbin/dnsmasq").exists() {
        "/usr/sbin/dnsmasq"
    } else {
        "dnsmasq"
    }
}

/// A loopback port free for UDP and TCP just now.
fn free_port() -> u16 {
    loop {
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = u.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

impl Dnsmasq {
    /// Start on a free port, answering for `domain` (e.g. `test`, `cluster.local`) with `hosts`
    /// (the text of a hosts file, kept in `dir`) and `records` (extra dnsmasq options:
    /// `--srv-host=…`, `--host-record=…`).
    pub fn start(dir: &Path, domain: &str, hosts: &str, records: &[String]) -> Dnsmasq {
        // A free port can be taken between its choice and dnsmasq's bind (by another test, or
        // by this one's own readiness probe below): then another port.
        for _ in 0..10 {
            match Dnsmasq::try_start_on(dir, free_port(), domain, hosts, records) {
                Ok(d) => return d,
                Err(e) if e.contains("Address already in use") => continue,
                Err(e) => panic!("{e}"),
            }
        }
        panic!("dnsmasq found no free port in 10 tries")
    }

    /// Start on `port`, retrying a bind that lost a race with the readiness probe.
    fn start_on(dir: &Path, port: u16, domain: &str, hosts: &str, records: &[String]) -> Dnsmasq {
        let mut last = String::new();
        for _ in 0..10 {
            match Dnsmasq::try_start_on(dir, port, domain, hosts, records) {
                Ok(d) => return d,
                Err(e) if e.contains("Address already in use") => {
                    last = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("{e}"),
            }
        }
        panic!("{last}")
    }

    fn try_start_on(
        dir: &Path,
        port: u16,
        domain: &str,
        hosts: &str,
        records: &[String],
    ) -> Result<Dnsmasq, String> {
        let file = dir.join("hosts");
        write_hosts(&file, hosts);
        // dnsmasq started as root runs as `nobody` and re-reads the hosts file as it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut args: Vec<String> = [
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--pid-file",
            "--log-facility=-",
            "--log-queries",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(format!("--port={port}"));
        args.push(format!("--local=/{domain}/"));
        args.push(format!("--addn-hosts={}", file.display()));
        args.extend(records.iter().cloned());
        let mut child = Command::new(dnsmasq_bin())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dnsmasq starts (scripts/test.sh installs dnsmasq-base)");
        // Up once its UDP port is taken.
        let t0 = Instant::now();
        while UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            if let Some(st) = child.try_wait().unwrap() {
                let err = super::procs::stderr_of(&mut child);
                return Err(format!("dnsmasq exited ({st}): {err}"));
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "dnsmasq not up");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Its log is not read; drop the pipe's reader end to a thread so it never blocks.
        let mut e = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = e.read_to_end(&mut sink);
        });
        Ok(Dnsmasq {
            child,
            port,
            domain: domain.to_string(),
            hosts: file,
        })
    }

    /// IP:PORT, for `--dns-server`.
    pub fn server(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// New A records: the hosts file rewritten and re-read (SIGHUP).
    pub fn set_hosts(&self, hosts: &str) {
        write_hosts(&self.hosts, hosts);
        // SAFETY: signalling our own child by its pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGHUP);
        }
    }

    /// New records: stopped and started again on the same port (dnsmasq reads
    /// `--srv-host` only at start).
    pub fn restart(mut self, dir: &Path, hosts: &str, records: &[String]) -> Dnsmasq {
        let (port, domain) = (self.port, self.domain.clone());
        let _ = self.child.kill();
        let _ = self.child.wait();
        Dnsmasq::start_on(dir, port, &domain, hosts, records)
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_hosts(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Hosts-file lines giving `name` each address of `ips`.
pub fn hosts(name: &str, ips: &[&str]) -> String {
    ips.iter().map(|ip| format!("{ip} {name}\n")).collect()
}
