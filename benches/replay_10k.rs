//! Speed of the open-loop replayer: replays a constant (or Poisson) 10,000 req/s schedule for
//! 10 s against a trivial OpenAI-style server started in-process on loopback, and prints the
//! achieved rate against the offered one and the schedule lag (actual send − scheduled).
//! Goal (issue): achieved within 1% of offered, p99 schedule lag < 1 ms.
//!
//! Run: `cargo bench --bench replay_10k` (release profile), or with options:
//! `cargo bench --bench replay_10k -- --qps 10000 --duration 10 [--poisson] [--stream]
//! [--server-threads 1] [--client-threads N] [--per-second] [--target http://HOST:PORT]`
//! (`--target` replays against an external server instead of the in-process one; `--per-second`
//! prints the lag of each second, to see where late sends were).
//! Exit status 1 when the goal is missed.

use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::response::IntoResponse;
use axum::routing::post;
use cacheroute::loadgen::{self, ReplayConfig};
use cacheroute::workload::arrivals::{ArrivalKind, Arrivals};
use cacheroute::workload::trace::TraceRecord;

struct Opts {
    qps: f64,
    duration: f64,
    poisson: bool,
    stream: bool,
    server_threads: usize,
    client_threads: usize,
    target: Option<String>,
    per_second: bool,
}

fn opts() -> Opts {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut o = Opts {
        qps: 10_000.0,
        duration: 10.0,
        poisson: false,
        stream: false,
        server_threads: 1,
        // Half the CPUs: the server and the dispatcher thread need the rest (on 2 CPUs, 1).
        client_threads: (cpus / 2).max(1),
        target: None,
        per_second: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next()
                .unwrap_or_else(|| panic!("{name} needs a value"))
        };
        match a.as_str() {
            "--qps" => o.qps = val("--qps").parse().expect("--qps: a number"),
            "--duration" => o.duration = val("--duration").parse().expect("--duration: seconds"),
            "--server-threads" => {
                o.server_threads = val("--server-threads").parse().expect("a count")
            }
            "--client-threads" => {
                o.client_threads = val("--client-threads").parse().expect("a count")
            }
            "--target" => o.target = Some(val("--target")),
            "--poisson" => o.poisson = true,
            "--stream" => o.stream = true,
            "--per-second" => o.per_second = true,
            // `cargo bench` passes --bench; ignore it and any filter.
            _ => {}
        }
    }
    o
}

async fn completions(body: Bytes) -> impl IntoResponse {
    let stream = memchr_stream(&body);
    if stream {
        (
            [("content-type", "text/event-stream")],
            "data: {\"choices\":[{\"index\":0,\"text\":\"x\"}]}\n\n\
             data: {\"choices\":[],\"usage\":{\"prompt_tokens\":16,\"completion_tokens\":1}}\n\n\
             data: [DONE]\n\n",
        )
            .into_response()
    } else {
        (
            [("content-type", "application/json")],
            "{\"choices\":[{\"index\":0,\"text\":\"x\"}],\"usage\":{\"prompt_tokens\":16,\"completion_tokens\":1}}",
        )
            .into_response()
    }
}

fn memchr_stream(body: &[u8]) -> bool {
    body.windows(13).any(|w| w == b"\"stream\":true")
}

fn start_server(threads: usize) -> (String, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .thread_name("mock-server")
        .build()
        .expect("server runtime");
    let addr = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = l.local_addr().unwrap();
        let app = axum::Router::new().route("/v1/completions", post(completions));
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        addr
    });
    (format!("http://{addr}"), rt)
}

fn main() {
    let o = opts();
    let (target, _server) = match &o.target {
        Some(t) => (t.clone(), None),
        None => {
            let (url, rt) = start_server(o.server_threads);
            (url, Some(rt))
        }
    };
    let kind = if o.poisson {
        ArrivalKind::Poisson
    } else {
        ArrivalKind::Constant
    };
    let duration = o.duration;
    let arrivals = Arrivals::new(kind, o.qps, cacheroute::rng::seeded(1)).expect("a valid rate");
    // Constant spacing starts one gap after 0; shift it so the window [0, duration) holds
    // exactly qps × duration requests.
    let gap = if o.poisson { 0.0 } else { 1.0 / o.qps };
    let n = (o.qps * o.duration).round() as usize;
    let schedule = arrivals
        .map(move |t| t - gap)
        .take_while(move |t| *t < duration)
        .take(n)
        .enumerate()
        .map(|(i, t)| {
            (
                t,
                TraceRecord {
                    timestamp_ms: t * 1e3,
                    key: format!("k{}", i % 1000),
                    input_length: 16,
                    output_length: 1,
                    hash_ids: vec![(i % 100) as u64],
                    session: None,
                    turn: None,
                },
            )
        });
    let mut cfg = ReplayConfig::new(target.clone());
    cfg.duration_s = Some(o.duration);
    cfg.stream = o.stream;
    cfg.timeout = Duration::from_secs(30);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.client_threads.max(1))
        .enable_all()
        .thread_name("replay")
        .build()
        .expect("client runtime");
    eprintln!(
        "replaying {} req/s ({}{}) for {} s to {target} (client threads {}, server threads {}, {} CPUs)",
        o.qps,
        if o.poisson { "poisson" } else { "constant" },
        if o.stream { ", stream" } else { "" },
        o.duration,
        o.client_threads,
        if o.target.is_some() { "external".to_string() } else { o.server_threads.to_string() },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let t0 = Instant::now();
    let res = rt
        .block_on(loadgen::replay(&cfg, schedule))
        .expect("replay");
    if o.per_second {
        // Lag over time: where in the run the late sends were.
        let mut secs: Vec<Vec<f64>> = vec![Vec::new(); o.duration.ceil() as usize + 1];
        for r in &res.records {
            if let Some(l) = r.lag_s() {
                let last = secs.len() - 1;
                secs[(r.record.scheduled_s as usize).min(last)].push(l);
            }
        }
        for (i, v) in secs.iter_mut().enumerate().filter(|(_, v)| !v.is_empty()) {
            v.sort_by(f64::total_cmp);
            let late = v.iter().filter(|l| **l > 1e-3).count();
            println!(
                "second {i}: {} sent, lag p99 {:.1} µs, max {:.1} µs, {late} later than 1 ms",
                v.len(),
                v[(v.len() * 99 / 100).min(v.len() - 1)] * 1e6,
                v[v.len() - 1] * 1e6
            );
        }
    }
    let s = &res.summary;
    let ratio = s.achieved_qps / s.offered_qps;
    println!(
        "offered {:.1} req/s  achieved {:.1} req/s ({:.3}% of offered)",
        s.offered_qps,
        s.achieved_qps,
        100.0 * ratio
    );
    println!(
        "schedule lag  p50 {:.1} µs  p99 {:.1} µs  max {:.1} µs",
        s.lag_p50_s * 1e6,
        s.lag_p99_s * 1e6,
        s.lag_max_s * 1e6
    );
    println!(
        "e2e (from scheduled)  p50 {:.1} µs  p99 {:.1} µs;  ok {} of {}, errors {:?};  wall {:.2} s",
        s.e2e_p50_s * 1e6,
        s.e2e_p99_s * 1e6,
        s.ok,
        s.requests,
        s.errors,
        t0.elapsed().as_secs_f64()
    );
    let pass = (ratio - 1.0).abs() <= 0.01 && s.lag_p99_s < 1e-3 && s.error_count() == 0;
    println!(
        "goal (achieved within 1%, p99 lag < 1 ms, no errors): {}",
        if pass { "met" } else { "MISSED" }
    );
    if !pass {
        std::process::exit(1);
    }
}
