//! Router overhead against nginx, same backend and load, one run (driven by
//! `benches/router_vs_nginx.sh`, which starts the processes). This binary is only the load
//! client: open-loop at a fixed rate (each request sent on schedule in its own task, so no
//! coordinated omission; latency from its send) and closed-loop for maximum throughput, against
//! three targets —
//! the backend directly, nginx, and `cacheroute route` — and prints a side-by-side table.
//!
//! Usage: `router_vs_nginx --direct URL --nginx URL --router URL [--rate 2000] [--secs 10]
//! [--conns 64] [--rounds 5]` (URLs are bases; the client POSTs `/v1/completions` with a routing
//! key header). The `secs` of each phase are split into `rounds` slices run round-robin over
//! the targets (direct, nginx, router, direct, …), so a slow drift of the shared machine
//! (other processes, frequency) hits every target alike instead of whichever ran last; the
//! slices' histograms and counts are pooled.

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
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        targets: Vec::new(),
        rate: 2000.0,
        secs: 10.0,
        conns: 64,
        rounds: 5,
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
            "--rounds" => a.rounds = val.parse().expect("--rounds: slices per phase"),
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

/// Open loop at `rate` for `secs`, recording each request's latency into `hist`: returns
/// (errors, requests, seconds).
async fn open_loop(
    url: &str,
    rate: f64,
    secs: f64,
    hist: &Arc<Mutex<Histogram<u64>>>,
) -> (u64, u64, f64) {
    let c = client();
    let errors = Arc::new(AtomicU64::new(0));
    let n = (rate * secs) as u64;
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let at = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(at).await;
        let (c, url, hist, errors) = (c.clone(), url.to_string(), hist.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            // From the moment this request is sent: the send never waits for earlier answers
            // (every request is its own task), so a slow target cannot delay later sends
            // (no coordinated omission), while the client's own timer lateness (tokio timers
            // have millisecond resolution) stays out of every target's figure.
            let t0 = Instant::now();
            let ok = one(&c, &url, i).await;
            let us = t0.elapsed().as_micros() as u64;
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
    (errors.load(Relaxed), n, start.elapsed().as_secs_f64())
}

/// Closed loop with `conns` workers for `secs`: (completed requests, errors, seconds).
async fn closed_loop(url: &str, conns: usize, secs: f64) -> (u64, u64, f64) {
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
        done.load(Relaxed),
        errors.load(Relaxed),
        t0.elapsed().as_secs_f64(),
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
        #[derive(Default, Clone)]
        struct Acc {
            errors: u64,
            sent: u64,
            open_s: f64,
            done: u64,
            closed_s: f64,
        }
        let urls: Vec<String> = a
            .targets
            .iter()
            .map(|(_, b)| format!("{b}/v1/completions"))
            .collect();
        let hists: Vec<Arc<Mutex<Histogram<u64>>>> = urls
            .iter()
            .map(|_| {
                Arc::new(Mutex::new(
                    Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap(),
                ))
            })
            .collect();
        let mut acc = vec![Acc::default(); urls.len()];
        // Warm connections (not recorded).
        for url in &urls {
            let scratch = Arc::new(Mutex::new(
                Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap(),
            ));
            let _ = open_loop(url, a.rate.min(500.0), 1.0, &scratch).await;
        }
        let slice = a.secs / a.rounds.max(1) as f64;
        for r in 0..a.rounds.max(1) {
            for (i, url) in urls.iter().enumerate() {
                let (err, n, s) = open_loop(url, a.rate, slice, &hists[i]).await;
                let (done, cerr, cs) = closed_loop(url, a.conns, slice).await;
                let x = &mut acc[i];
                x.errors += err + cerr;
                x.sent += n;
                x.open_s += s;
                x.done += done;
                x.closed_s += cs;
                eprintln!(
                    "round {}: {}: max {:.0} req/s",
                    r + 1,
                    a.targets[i].0,
                    done as f64 / cs
                );
            }
        }
        let rows: Vec<(String, f64, f64, u64, f64)> = a
            .targets
            .iter()
            .zip(&hists)
            .zip(&acc)
            .map(|(((name, _), h), x)| {
                let h = h.lock().unwrap();
                (
                    name.clone(),
                    h.value_at_quantile(0.5) as f64,
                    h.value_at_quantile(0.99) as f64,
                    x.errors,
                    x.done as f64 / x.closed_s,
                )
            })
            .collect();
        let direct = rows.iter().find(|r| r.0 == "direct").cloned();
        println!(
            "| target | p50 at {:.0} req/s (µs) | p99 (µs) | added p50 (µs) | added p99 (µs) | errors | max req/s ({} conns) |",
            a.rate, a.conns
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for (name, p50, p99, err, rps) in &rows {
            let (ap50, ap99) = match &direct {
                Some(d) if d.0 != *name => (format!("{:.0}", p50 - d.1), format!("{:.0}", p99 - d.2)),
                _ => ("—".into(), "—".into()),
            };
            println!("| {name} | {p50:.0} | {p99:.0} | {ap50} | {ap99} | {err} | {rps:.0} |");
        }
        let get = |n: &str| rows.iter().find(|r| r.0 == n).map(|r| r.4);
        if let (Some(router), Some(nginx)) = (get("router"), get("nginx")) {
            println!(
                "router throughput / nginx: {:.0}% ({} rounds of {:.1} s per phase, interleaved)",
                100.0 * router / nginx,
                a.rounds,
                slice
            );
        }
    });
}
