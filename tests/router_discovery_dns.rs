//! Discovery by DNS: `cacheroute route --backends-dns` resolves its backends from A/AAAA or SRV
//! records, re-resolves them every interval and adds and removes backends while it routes.
//! Everything is real: a dnsmasq (a real DNS server, Debian's dnsmasq-base, installed by
//! scripts/test.sh) on a loopback port that the test controls (a hosts file re-read on SIGHUP
//! for A records; a restart with new records for SRV), the `cacheroute route` binary asking
//! it (`--dns-server`), `cacheroute emulate` processes as the backends, HTTP over loopback.
//! No speed assertions; the waits are generous deadlines.

mod common;

use common::dnsmasq::{hosts, Dnsmasq};
use common::procs::{self, Proc};
use serde_json::{json, Value};
use std::net::UdpSocket;
use std::path::Path;
use std::time::{Duration, Instant};

/// `cacheroute route` with its backends from `spec` asked of `server`, re-resolved every
/// 100 ms, health checks every 300 ms.
fn router(dir: &Path, spec: &str, server: &str) -> Proc {
    let cfg = dir.join("router.yaml");
    std::fs::write(&cfg, "backends_poll_ms: 100\nhealth_interval_ms: 300\n").unwrap();
    Proc::start(&[
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "flat-lb",
        "--backends-dns",
        spec,
        "--dns-server",
        server,
        "--config",
        cfg.to_str().unwrap(),
        "--admin-token",
        "sekret",
    ])
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn stats(c: &reqwest::blocking::Client, r: &Proc) -> Value {
    let t = c
        .get(format!("{}/admin/stats", r.url))
        .bearer_auth("sekret")
        .send()
        .unwrap()
        .text()
        .unwrap();
    serde_json::from_str(&t).unwrap()
}

/// The router's backends in force: (slot, URL).
fn backends(c: &reqwest::blocking::Client, r: &Proc) -> Vec<(u64, String)> {
    let mut v: Vec<(u64, String)> = stats(c, r)["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["index"].as_u64().unwrap(),
                d["url"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

fn urls(b: &[(u64, String)]) -> Vec<String> {
    let mut u: Vec<String> = b.iter().map(|(_, u)| u.clone()).collect();
    u.sort();
    u
}

/// Wait (up to 20 s) until the router's backends are `want` (any order).
fn until_backends(c: &reqwest::blocking::Client, r: &Proc, want: &[&str]) -> Instant {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let t0 = Instant::now();
    loop {
        let now = urls(&backends(c, r));
        if now == want {
            return Instant::now();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "backends {now:?}, waiting for {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One completion: (status, the URL of the backend that served it, body).
fn complete(
    c: &reqwest::blocking::Client,
    r: &Proc,
    key: &str,
    tokens: u32,
    stream: bool,
) -> (u16, String, String) {
    let resp = c
        .post(format!("{}/v1/completions", r.url))
        .header("x-cacheroute-key", key)
        .header("content-type", "application/json")
        .body(
            json!({"model": "m", "prompt": format!("hello {key}"), "max_tokens": tokens, "stream": stream})
                .to_string(),
        )
        .send()
        .unwrap();
    let status = resp.status().as_u16();
    let d: Option<u64> = resp
        .headers()
        .get("x-cacheroute-destination")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let url = d
        .and_then(|d| backends(c, r).into_iter().find(|(x, _)| *x == d))
        .map(|(_, u)| u)
        .unwrap_or_default();
    let body = resp.text().unwrap_or_else(|e| format!("body failed: {e}"));
    (status, url, body)
}

/// Send completions until one is served by `url` (up to 20 s); every one must succeed.
fn until_served_by(c: &reqwest::blocking::Client, r: &Proc, url: &str) -> usize {
    let t0 = Instant::now();
    for sent in 0.. {
        let (status, by, body) = complete(c, r, &format!("probe{sent}"), 2, false);
        assert_eq!(status, 200, "{body}");
        if by == url {
            return sent + 1;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{url} got no traffic after {sent} requests"
        );
    }
    unreachable!()
}

/// `n` completions, none served by `gone`.
fn none_served_by(c: &reqwest::blocking::Client, r: &Proc, gone: &str, n: usize) {
    for i in 0..n {
        let (status, by, body) = complete(c, r, &format!("after{i}"), 2, false);
        assert_eq!(status, 200, "{body}");
        assert_ne!(by, gone, "request {i} went to the removed backend");
    }
}

#[test]
fn a_records_add_and_remove_backends_and_streams_on_the_removed_one_finish() {
    // Three emulators on one port at three loopback addresses, as pods of a headless Service
    // are. Slow (a tenth of the tiny engine's speed): a 300-token stream runs for seconds.
    let e0 = Proc::emulator_scaled("127.0.0.1:0", "0.1");
    let port = e0.url.rsplit(':').next().unwrap().to_string();
    let e1 = Proc::emulator_scaled(&format!("127.0.0.2:{port}"), "0.1");
    let e2 = Proc::emulator_scaled(&format!("127.0.0.3:{port}"), "0.1");
    let (u0, u1, u2) = (e0.url.clone(), e1.url.clone(), e2.url.clone());
    let dir = tempfile::tempdir().unwrap();
    let dns = Dnsmasq::start(
        dir.path(),
        "test",
        &hosts("pool.test", &["127.0.0.1", "127.0.0.2"]),
        &[],
    );
    let r = router(
        dir.path(),
        &format!("http://pool.test:{port}"),
        &dns.server(),
    );
    let c = http();
    assert_eq!(urls(&backends(&c, &r)), [u0.clone(), u1.clone()]);

    // Six streams in flight over e0 and e1 (flat-lb takes the less loaded of two).
    let (tx, rx) = std::sync::mpsc::channel();
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let (c, url, tx) = (c.clone(), r.url.clone(), tx.clone());
            std::thread::spawn(move || {
                let resp = c
                    .post(format!("{url}/v1/completions"))
                    .header("x-cacheroute-key", format!("s{i}"))
                    .header("content-type", "application/json")
                    .body(
                        json!({"model": "m", "prompt": "hello", "max_tokens": 300, "stream": true})
                            .to_string(),
                    )
                    .send()
                    .unwrap();
                let status = resp.status().as_u16();
                let dest = resp
                    .headers()
                    .get("x-cacheroute-destination")
                    .map(|v| v.to_str().unwrap().to_string());
                tx.send(dest).unwrap();
                (status, resp.text().unwrap_or_else(|e| format!("cut: {e}")))
            })
        })
        .collect();
    let slots: Vec<Option<String>> = (0..6)
        .map(|_| rx.recv_timeout(Duration::from_secs(30)).unwrap())
        .collect();
    let slot0 = backends(&c, &r)
        .into_iter()
        .find(|(_, u)| *u == u0)
        .unwrap()
        .0
        .to_string();
    assert!(
        slots.iter().any(|s| s.as_deref() == Some(slot0.as_str())),
        "no stream went to the backend about to leave: {slots:?}"
    );

    // e0 leaves the answer, e2 joins it.
    dns.set_hosts(&hosts("pool.test", &["127.0.0.2", "127.0.0.3"]));
    let seen = until_backends(&c, &r, &[&u1, &u2]);
    assert!(
        streams.iter().any(|s| !s.is_finished()),
        "the streams ended before the change was seen; the test shows nothing"
    );
    let n = until_served_by(&c, &r, &u2);
    eprintln!(
        "the added backend got its first request {:.0} ms after the change was seen, after {n} requests (re-resolved every 100 ms, health every 300 ms)",
        seen.elapsed().as_secs_f64() * 1e3
    );
    none_served_by(&c, &r, &u0, 30);
    // Every stream, those on e0 included, finished whole.
    for s in streams {
        let (status, body) = s.join().unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(
            body.trim_end().ends_with("data: [DONE]"),
            "a stream was cut: {body}"
        );
    }
    let st = stats(&c, &r);
    assert_eq!(st["failed"], 0, "{st}");

    // The name stops resolving (NXDOMAIN): the backends in force are kept, routing goes on.
    dns.set_hosts("127.0.0.9 other.test\n");
    r.wait_for_line(30, "for the name gone", |l| {
        l.contains("pool.test does not resolve")
    });
    std::thread::sleep(Duration::from_millis(500)); // five more looks: still one line
    assert_eq!(urls(&backends(&c, &r)), [u1.clone(), u2.clone()]);
    none_served_by(&c, &r, &u0, 4);
    // Back: e0 returns to the slot it held.
    dns.set_hosts(&hosts(
        "pool.test",
        &["127.0.0.1", "127.0.0.2", "127.0.0.3"],
    ));
    until_backends(&c, &r, &[&u0, &u1, &u2]);
    assert!(
        backends(&c, &r).contains(&(slot0.parse().unwrap(), u0.clone())),
        "{:?}",
        backends(&c, &r)
    );
    let (status, err) = r.terminate();
    assert!(status.success(), "{err}");
    let nx: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("pool.test does not resolve"))
        .collect();
    assert_eq!(nx.len(), 1, "one line for the name gone: {err}");
    assert!(nx[0].contains("the 2 backends in force are kept"), "{err}");
    assert!(err.contains("resolves again"), "{err}");
}

#[test]
fn srv_records_name_ports_and_a_broken_answer_or_a_silent_server_keeps_the_backends() {
    let e0 = Proc::emulator();
    let e1 = Proc::emulator();
    let e2 = Proc::emulator();
    let port = |p: &Proc| p.url.rsplit(':').next().unwrap().to_string();
    let srv = |targets: &[(&str, &Proc)]| -> Vec<String> {
        let mut v = Vec::new();
        for (name, p) in targets {
            v.push(format!(
                "--srv-host=_http._tcp.pool.test,{name},{}",
                port(p)
            ));
        }
        v
    };
    let dir = tempfile::tempdir().unwrap();
    let addrs = hosts("e0.test", &["127.0.0.1"])
        + &hosts("e1.test", &["127.0.0.1"])
        + &hosts("e2.test", &["127.0.0.1"]);
    let dns = Dnsmasq::start(
        dir.path(),
        "test",
        &addrs,
        &srv(&[("e0.test", &e0), ("e1.test", &e1)]),
    );
    let r = router(dir.path(), "srv+http://_http._tcp.pool.test", &dns.server());
    let c = http();
    assert_eq!(
        urls(&backends(&c, &r)),
        urls(&[(0, e0.url.clone()), (1, e1.url.clone())])
    );
    until_served_by(&c, &r, &e0.url);

    // New records: e0 gone, e2 in.
    let dns = dns.restart(
        dir.path(),
        &addrs,
        &srv(&[("e1.test", &e1), ("e2.test", &e2)]),
    );
    until_backends(&c, &r, &[&e1.url, &e2.url]);
    until_served_by(&c, &r, &e2.url);
    none_served_by(&c, &r, &e0.url, 20);

    // An SRV record whose target has no address: refused whole, the backends kept.
    let dns = dns.restart(
        dir.path(),
        &addrs,
        &srv(&[("e0.test", &e0), ("ghost.test", &e1)]),
    );
    r.wait_for_line(30, "for the SRV target without an address", |l| {
        l.contains("ghost.test") && l.contains("backends in force are kept")
    });
    assert_eq!(
        urls(&backends(&c, &r)),
        urls(&[(0, e1.url.clone()), (1, e2.url.clone())])
    );
    none_served_by(&c, &r, &e0.url, 4);

    // A server that takes the query and never answers: the same.
    let port_dns = dns.port;
    drop(dns);
    let silent = UdpSocket::bind(("127.0.0.1", port_dns)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 512];
    assert!(
        silent.recv_from(&mut buf).is_ok(),
        "the router did not ask the silent server"
    );
    // A lookup gives up after its 2 s timeouts; then the refusal is logged.
    r.wait_for_line(30, "for the silent server", |l| {
        l.contains("backends DNS srv+http://_http._tcp.pool.test")
            && l.contains("timed out")
            && l.contains("backends in force are kept")
    });
    assert_eq!(
        urls(&backends(&c, &r)),
        urls(&[(0, e1.url.clone()), (1, e2.url.clone())])
    );
    none_served_by(&c, &r, &e0.url, 4);
    let st = stats(&c, &r);
    assert_eq!(st["failed"], 0, "{st}");
    let (status, err) = r.terminate();
    assert!(status.success(), "{err}");
    let ghost: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("ghost.test") && l.contains("the target of an SRV record"))
        .collect();
    assert_eq!(
        ghost.len(),
        1,
        "one line for the target without an address: {err}"
    );
    assert!(ghost[0].contains("backends in force are kept"), "{err}");
    assert!(
        err.lines().any(
            |l| l.contains("backends DNS srv+http://_http._tcp.pool.test")
                && l.contains("backends in force are kept")
                && !l.contains("ghost")
        ),
        "no line for the silent server: {err}"
    );
}

#[test]
fn a_name_that_does_not_resolve_at_start_is_one_line_and_a_failed_start() {
    let dir = tempfile::tempdir().unwrap();
    let dns = Dnsmasq::start(dir.path(), "test", &hosts("pool.test", &["127.0.0.1"]), &[]);
    let server = dns.server();
    for (spec, what) in [
        ("http://nowhere.test:8000", "nowhere.test does not resolve"),
        (
            "srv+http://_http._tcp.pool.test",
            "SRV lookup of _http._tcp.pool.test failed",
        ),
        ("http://pool.test:8000/v1", "no path"),
        ("pool.test:8000", "neither http://NAME:PORT"),
    ] {
        let (status, _, err) = procs::run(&[
            "route",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "flat-lb",
            "--backends-dns",
            spec,
            "--dns-server",
            &server,
        ]);
        assert!(!status.success(), "{spec}: {err}");
        assert!(err.contains(what), "{spec}: {err}");
        assert!(err.contains(spec), "{spec}: the message names it: {err}");
    }
    // --dns-server alone, and DNS beside a backend list.
    let (status, _, err) = procs::run(&[
        "route",
        "--policy",
        "flat-lb",
        "--backend",
        "http://127.0.0.1:9",
        "--dns-server",
        &server,
    ]);
    assert!(!status.success() && err.contains("--backends-dns"), "{err}");
    let (status, _, err) = procs::run(&[
        "route",
        "--policy",
        "flat-lb",
        "--backend",
        "http://127.0.0.1:9",
        "--backends-dns",
        "http://pool.test:9",
    ]);
    assert!(!status.success() && err.contains("--backends-dns"), "{err}");
}
