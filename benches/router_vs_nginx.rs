//! Router overhead against nginx, same backend and load, one run (driven by
//! `benches/router_vs_nginx.sh`, which starts the processes). This binary is only the load
//! client: open-loop at a fixed rate (each request sent on schedule in its own task, so no
//! coordinated omission; latency from its send) and closed-loop for maximum throughput, against
//! three targets —
//! the backend directly, nginx, and `cacheroute route` — and prints a side-by-side table.
//!
//! Usage: `router_vs_nginx --direct URL --nginx URL --router URL [--rate 2000] [--secs 10]
//! [--conns 64] [--rounds 20]` (URLs are bases; the client POSTs `/v1/completions` with a routing
//! key header). Each phase (open loop first, then closed loop) is split into `rounds` slices of
//! `secs / rounds` seconds run round-robin over the targets, the order rotated every round, so
//! a drift of the shared machine (other processes, frequency) hits every target alike; the
//! slices' histograms and counts are pooled. Each target keeps one client (its warm keep-alive
//! connections) for the whole run. Besides the pooled table, the router and nginx are compared
//! round by round (paired): the median of the per-round differences in p50 and p99 and how
//! many rounds the router's p99 was at or below nginx's. With `--record FILE` the run's figures
//! are appended to FILE (one tab-separated line per run) and every run recorded there is
//! summarised: the router's pooled p99 minus nginx's, mean and 95% Student-t interval over the
//! runs (each run restarts every process, so the runs are independent samples), and the
//! throughput ratio.

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
    /// Append this run's figures to this file and summarise every run in it.
    record: Option<String>,
    /// Append every target's figures to this file and summarise each target over its runs.
    record_all: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        targets: Vec::new(),
        rate: 2000.0,
        secs: 10.0,
        conns: 64,
        rounds: 20,
        record: None,
        record_all: None,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--direct" | "--nginx" | "--router" => {
                a.targets.push((v[i][2..].to_string(), val));
            }
            "--target" => {
                let (name, url) = val
                    .split_once('=')
                    .expect("--target NAME=URL (e.g. smg=http://127.0.0.1:8001)");
                a.targets.push((name.to_string(), url.to_string()));
            }
            "--record-all" => a.record_all = Some(val),
            "--rate" => a.rate = val.parse().expect("--rate: requests per second"),
            "--secs" => a.secs = val.parse().expect("--secs: seconds per phase"),
            "--conns" => a.conns = val.parse().expect("--conns: concurrent connections"),
            "--rounds" => a.rounds = val.parse().expect("--rounds: slices per phase"),
            "--record" => a.record = Some(val),
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
    let key = format!("user{}", key % 1000);
    // The key in the header each router reads (ours, Envoy and nginx: x-cacheroute-key; SMG:
    // x-smg-routing-key; the vLLM router: x-session-id).
    match c
        .post(url)
        .header("content-type", "application/json")
        .header("x-cacheroute-key", &key)
        .header("x-smg-routing-key", &key)
        .header("x-session-id", &key)
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
    c: &reqwest::Client,
    url: &str,
    rate: f64,
    secs: f64,
    hist: &Arc<Mutex<Histogram<u64>>>,
) -> (u64, u64, f64) {
    let errors = Arc::new(AtomicU64::new(0));
    let n = (rate * secs) as u64;
    // Sends are paced by a thread of their own sleeping until each due instant (tens of µs of
    // precision; tokio's timers have 1 ms, which would release the requests in bursts of two
    // or three every millisecond instead of one every 500 µs at 2k req/s).
    let rt = tokio::runtime::Handle::current();
    let start = Instant::now() + Duration::from_millis(50);
    let (c, url, hist2, errors2) = (c.clone(), url.to_string(), hist.clone(), errors.clone());
    let pacer = std::thread::spawn(move || {
        // Wake within a µs of each due instant rather than the default 50 µs slack.
        // SAFETY: prctl with PR_SET_TIMERSLACK only sets this thread's timer slack.
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
        }
        let mut tasks = Vec::with_capacity(n as usize);
        for i in 0..n {
            let at = start + Duration::from_secs_f64(i as f64 / rate);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            let (c, url, hist, errors) = (c.clone(), url.clone(), hist2.clone(), errors2.clone());
            tasks.push(rt.spawn(async move {
                // From the moment this request is sent: the send never waits for earlier
                // answers (every request is its own task), so a slow target cannot delay
                // later sends (no coordinated omission).
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
        tasks
    });
    let tasks = tokio::task::spawn_blocking(move || pacer.join().expect("pacer thread"))
        .await
        .expect("pacer join");
    for t in tasks {
        let _ = t.await;
    }
    (errors.load(Relaxed), n, start.elapsed().as_secs_f64())
}

/// Closed loop with `conns` workers for `secs`: (completed requests, errors, seconds).
async fn closed_loop(c: &reqwest::Client, url: &str, conns: usize, secs: f64) -> (u64, u64, f64) {
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
        let clients: Vec<reqwest::Client> = urls.iter().map(|_| client()).collect();
        let new_hist = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
        // Warm connections (not recorded).
        for (c, url) in clients.iter().zip(&urls) {
            let scratch = Arc::new(Mutex::new(new_hist()));
            let _ = open_loop(c, url, a.rate.min(500.0), 1.0, &scratch).await;
            let _ = closed_loop(c, url, a.conns, 0.5).await;
        }
        let rounds = a.rounds.max(1);
        let slice = a.secs / rounds as f64;
        let n = urls.len();
        // Per round and target: (p50, p99) of that slice alone.
        let mut per_round: Vec<Vec<(f64, f64)>> = vec![vec![(0.0, 0.0); n]; rounds];
        for (r, row) in per_round.iter_mut().enumerate() {
            for k in 0..n {
                let i = (r + k) % n;
                let h = Arc::new(Mutex::new(new_hist()));
                let (err, sent, s) = open_loop(&clients[i], &urls[i], a.rate, slice, &h).await;
                let h = h.lock().unwrap();
                row[i] = (h.value_at_quantile(0.5) as f64, h.value_at_quantile(0.99) as f64);
                hists[i].lock().unwrap().add(&*h).unwrap();
                let x = &mut acc[i];
                x.errors += err;
                x.sent += sent;
                x.open_s += s;
            }
        }
        for (r, row) in per_round.iter().enumerate() {
            for k in 0..n {
                let i = (r + k) % n;
                let (done, cerr, cs) = closed_loop(&clients[i], &urls[i], a.conns, slice).await;
                let x = &mut acc[i];
                x.errors += cerr;
                x.done += done;
                x.closed_s += cs;
                eprintln!(
                    "round {}: {}: p99 {:.0} µs at {:.0} req/s, max {:.0} req/s",
                    r + 1,
                    a.targets[i].0,
                    row[i].1,
                    a.rate,
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
        if let (Some(path), Some(d)) = (&a.record_all, &direct) {
            record_all_and_summarise(path, &rows, (d.1, d.2), a.rate);
        }
        let get = |n: &str| rows.iter().find(|r| r.0 == n).map(|r| r.4);
        if let (Some(router), Some(nginx)) = (get("router"), get("nginx")) {
            println!(
                "router throughput / nginx: {:.0}% ({} rounds of {:.2} s per phase, interleaved)",
                100.0 * router / nginx,
                rounds,
                slice
            );
        }
        let idx = |name: &str| a.targets.iter().position(|t| t.0 == name);
        if let (Some(ri), Some(ni)) = (idx("router"), idx("nginx")) {
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                let m = v.len() / 2;
                if v.len() % 2 == 1 {
                    v[m]
                } else {
                    (v[m - 1] + v[m]) / 2.0
                }
            };
            let d50: Vec<f64> = per_round.iter().map(|x| x[ri].0 - x[ni].0).collect();
            let d99: Vec<f64> = per_round.iter().map(|x| x[ri].1 - x[ni].1).collect();
            let at_or_below = d99.iter().filter(|d| **d <= 0.0).count();
            let m99 = median(d99);
            println!(
                "paired by round, router minus nginx: p50 median {:+.0} µs, p99 median {:+.0} µs; router p99 at or below nginx's in {} of {} rounds",
                median(d50),
                m99,
                at_or_below,
                rounds
            );
            if let Some(path) = &a.record {
                let (r, n) = (&rows[ri], &rows[ni]);
                record_and_summarise(
                    path,
                    &RunFigures {
                        p50: [r.1, n.1],
                        p99: [r.2, n.2],
                        rps: [r.4, n.4],
                        paired_p99_median: m99,
                        at_or_below,
                        rounds,
                    },
                );
            }
        }
    });
}

/// One run's figures, router first and nginx second.
struct RunFigures {
    p50: [f64; 2],
    p99: [f64; 2],
    rps: [f64; 2],
    paired_p99_median: f64,
    at_or_below: usize,
    rounds: usize,
}

const RECORD_HEADER: &str = "router_p50_us\tnginx_p50_us\trouter_p99_us\tnginx_p99_us\trouter_rps\tnginx_rps\tpaired_p99_median_us\trounds_at_or_below\trounds";

/// Append `f` to the tab-separated file at `path` (header first when new) and print the
/// summary over every run in it.
fn record_and_summarise(path: &str, f: &RunFigures) {
    use std::io::Write;
    let fresh = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("--record {path}: {e}"));
    if fresh {
        writeln!(out, "{RECORD_HEADER}").expect("write record");
    }
    writeln!(
        out,
        "{}\t{}\t{}\t{}\t{:.0}\t{:.0}\t{}\t{}\t{}",
        f.p50[0],
        f.p50[1],
        f.p99[0],
        f.p99[1],
        f.rps[0],
        f.rps[1],
        f.paired_p99_median,
        f.at_or_below,
        f.rounds
    )
    .expect("write record");
    drop(out);
    let text = std::fs::read_to_string(path).expect("read record");
    let runs: Vec<Vec<f64>> = text
        .lines()
        .skip(1)
        .enumerate()
        .map(|(i, l)| {
            let v: Vec<f64> = l.split('\t').filter_map(|x| x.parse().ok()).collect();
            assert_eq!(v.len(), 9, "{path} line {}: expected 9 numbers", i + 2);
            v
        })
        .collect();
    let diff: Vec<f64> = runs.iter().map(|v| v[2] - v[3]).collect();
    let ratio: Vec<f64> = runs.iter().map(|v| v[4] / v[5]).collect();
    let d = cacheroute::analysis::capacity::seed_stats(&diff);
    let t = cacheroute::analysis::capacity::seed_stats(&ratio);
    let below = diff.iter().filter(|x| **x <= 0.0).count();
    let rounds_below: f64 = runs.iter().map(|v| v[7]).sum();
    let rounds_all: f64 = runs.iter().map(|v| v[8]).sum();
    println!(
        "over {} runs in {path}: router p99 minus nginx p99 (pooled per run) mean {:+.1} µs, 95% CI [{:+.1}, {:+.1}], router at or below nginx in {} of {} runs and in {:.0} of {:.0} rounds; throughput router / nginx mean {:.0}%, 95% CI [{:.0}%, {:.0}%]",
        d.n,
        d.mean,
        d.ci95[0],
        d.ci95[1],
        below,
        d.n,
        rounds_below,
        rounds_all,
        100.0 * t.mean,
        100.0 * t.ci95[0],
        100.0 * t.ci95[1]
    );
}

/// Append each target's figures of this run to `path` (`run`, target, p50, p99, added p50 and
/// p99 against the direct backend, max req/s) and print, per target, the mean and 95%
/// Student-t interval over every run in the file.
fn record_all_and_summarise(
    path: &str,
    rows: &[(String, f64, f64, u64, f64)],
    direct: (f64, f64),
    rate: f64,
) {
    use std::io::Write;
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let run = old
        .lines()
        .skip(1)
        .filter_map(|l| l.split('\t').next()?.parse::<u64>().ok())
        .max()
        .map_or(1, |r| r + 1);
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("--record-all {path}: {e}"));
    if old.is_empty() {
        writeln!(
            out,
            "run\ttarget\tp50_us\tp99_us\tadded_p50_us\tadded_p99_us\tmax_rps"
        )
        .expect("write record");
    }
    for (name, p50, p99, _, rps) in rows {
        writeln!(
            out,
            "{run}\t{name}\t{p50}\t{p99}\t{}\t{}\t{rps:.0}",
            p50 - direct.0,
            p99 - direct.1
        )
        .expect("write record");
    }
    drop(out);
    let text = std::fs::read_to_string(path).expect("read record");
    let mut by_target: Vec<(String, Vec<[f64; 3]>)> = Vec::new();
    for l in text.lines().skip(1) {
        let f: Vec<&str> = l.split('\t').collect();
        let num = |i: usize| {
            f.get(i)
                .and_then(|x| x.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        let v = [num(4), num(5), num(6)];
        match by_target.iter_mut().find(|(t, _)| t == f[1]) {
            Some((_, xs)) => xs.push(v),
            None => by_target.push((f[1].to_string(), vec![v])),
        }
    }
    let cell = |xs: &[f64]| {
        let s = cacheroute::analysis::capacity::seed_stats(xs);
        if s.n > 1 {
            format!("{:.0} [{:.0}, {:.0}]", s.mean, s.ci95[0], s.ci95[1])
        } else {
            format!("{:.0}", s.mean)
        }
    };
    println!("every target over the runs in {path} (mean and 95% Student-t interval over runs; added = minus the direct backend's, same run):");
    println!("| target | runs | added p50 at {rate:.0} req/s (µs) | added p99 (µs) | max req/s |");
    println!("| --- | --- | --- | --- | --- |");
    for (t, xs) in &by_target {
        let col = |k: usize| xs.iter().map(|x| x[k]).collect::<Vec<f64>>();
        if t == "direct" {
            println!("| {t} | {} | — | — | {} |", xs.len(), cell(&col(2)));
        } else {
            println!(
                "| {t} | {} | {} | {} | {} |",
                xs.len(),
                cell(&col(0)),
                cell(&col(1)),
                cell(&col(2))
            );
        }
    }
}
