//! Router overhead against nginx, same backend and load, one run (driven by
//! `benches/router_vs_nginx.sh`, which starts the processes). This binary is only the load
//! client: open-loop at a fixed rate (latency from each request's scheduled send time, so no
//! coordinated omission) and closed-loop for maximum throughput, against three targets —
//! the backend directly, nginx, and `cacheroute route` — and prints a side-by-side table.
//!
//! Usage: `router_vs_nginx --direct URL --nginx URL --router URL [--rate 2000] [--secs 10]
//! [--conns 64]` (URLs are bases; the client POSTs `/v1/completions` with a routing key header).

use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BODY: &str = r#"{"model":"m","prompt":"hello world","max_tokens":1}"#;

struct Args {
    targets: Vec<(String, String)>,
    rate: f64,
    secs: f64,
    conns: usize,
}

fn args() -> Args {
    let mut a = Args {
        targets: Vec::new(),
        rate: 2000.0,
        secs: 10.0,
        conns: 64,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--direct" | "--nginx" | "--router" => {
                a.targets.push((v[i][2..].to_string(), val));
            }
            "--rate" => a.rate = val.parse().expect("--rate: requests per second"),
            "--secs" => a.secs = val.parse().expect("--secs: seconds per phase"),
            "--conns" => a.conns = val.parse().expect("--conns: concurrent connections"),
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!("unknown argument `{other}`; see the module doc"),
        }
        i += 2;
    }
    a
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(4096)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

async fn one(c: &reqwest::Client, url: &str, key: u64) -> bool {
    match c
        .post(url)
        .header("content-type", "application/json")
        .header("x-cacheroute-key", format!("user{}", key % 1000))
        .body(BODY)
        .send()
        .await
    {
        Ok(r) => {
            let ok = r.status().is_success();
            ok && r.bytes().await.is_ok()
        }
        Err(_) => false,
    }
}

/// Open loop at `rate` for `secs`: (p50 µs, p99 µs, errors, achieved rate).
async fn open_loop(url: &str, rate: f64, secs: f64) -> (f64, f64, u64, f64) {
    let c = client();
    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap(),
    ));
    let errors = Arc::new(AtomicU64::new(0));
    let n = (rate * secs) as u64;
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at).await;
        let (c, url, hist, errors) = (c.clone(), url.to_string(), hist.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let ok = one(&c, &url, i).await;
            let us = at.elapsed().as_micros() as u64;
            if ok {
                hist.lock().unwrap().saturating_record(us.max(1));
            } else {
                errors.fetch_add(1, Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let h = hist.lock().unwrap();
    (
        h.value_at_quantile(0.5) as f64,
        h.value_at_quantile(0.99) as f64,
        errors.load(Relaxed),
        n as f64 / elapsed,
    )
}

/// Closed loop with `conns` workers for `secs`: completed requests per second.
async fn closed_loop(url: &str, conns: usize, secs: f64) -> (f64, u64) {
    let c = client();
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..conns {
        let (c, url, done, errors) = (c.clone(), url.to_string(), done.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = w as u64;
            while Instant::now() < end {
                if one(&c, &url, i).await {
                    done.fetch_add(1, Relaxed);
                } else {
                    errors.fetch_add(1, Relaxed);
                }
                i += conns as u64;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    (
        done.load(Relaxed) as f64 / t0.elapsed().as_secs_f64(),
        errors.load(Relaxed),
    )
}

fn main() {
    let a = args();
    assert!(
        !a.targets.is_empty(),
        "pass --direct, --nginx and --router base URLs (see benches/router_vs_nginx.sh)"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut rows = Vec::new();
        for (name, base) in &a.targets {
            let url = format!("{base}/v1/completions");
            // Warm connections.
            let _ = open_loop(&url, a.rate.min(500.0), 1.0).await;
            let (p50, p99, err, achieved) = open_loop(&url, a.rate, a.secs).await;
            let (rps, cerr) = closed_loop(&url, a.conns, a.secs).await;
            eprintln!("{name}: p50 {p50} µs, p99 {p99} µs, {err} errors, {achieved:.0} req/s offered; max {rps:.0} req/s ({cerr} errors)");
            rows.push((name.clone(), p50, p99, err, rps, cerr));
        }
        let direct = rows.iter().find(|r| r.0 == "direct").cloned();
        println!(
            "| target | p50 at {:.0} req/s (µs) | p99 (µs) | added p50 (µs) | added p99 (µs) | errors | max req/s ({} conns) |",
            a.rate, a.conns
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for (name, p50, p99, err, rps, cerr) in &rows {
            let (ap50, ap99) = match &direct {
                Some(d) if d.0 != *name => (format!("{:.0}", p50 - d.1), format!("{:.0}", p99 - d.2)),
                _ => ("—".into(), "—".into()),
            };
            println!(
                "| {name} | {p50:.0} | {p99:.0} | {ap50} | {ap99} | {} | {rps:.0} |",
                err + cerr
            );
        }
    });
}
