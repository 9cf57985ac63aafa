//! `cacheroute route --record FILE` end to end: the real binary in front of real `cacheroute
//! emulate` backends over loopback HTTP. What is recorded (hashes and counts, never text), that
//! the project's trace reader and replayer take the files, rotation, continuing a recording,
//! and paths that are refused before the router listens.

mod common;

use cacheroute::policy::PolicySpec;
use cacheroute::router::{self, RecordConfig, RouterConfig};
use common::mock_engine::{MockConfig, MockEngine};
use common::procs::{run, Proc};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MARKER: &str = "SECRET-7f3a9c";

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The recorded lines of a file as JSON (every field, the recording's own included).
fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// `cacheroute trace stats --json FILE`: must exit 0; its request count.
fn stats_requests(path: &Path) -> u64 {
    let (st, out, err) = run(&["trace", "stats", "--json", path.to_str().unwrap()]);
    assert!(st.success(), "trace stats {}: {err}", path.display());
    let v: Value = serde_json::from_str(&out).unwrap();
    v["requests"].as_u64().unwrap()
}

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn hex16(k: &str) -> String {
    format!("{:016x}", cacheroute::key_hash(k))
}

/// One request as sent, and what its record must say.
struct Sent {
    body: Value,
    header_key: Option<String>,
    stream: bool,
    /// Words of the prompt text as the router joins it.
    tokens: usize,
    max_tokens: u64,
    /// `usage` reaches the router (non-stream, or stream with include_usage).
    usage: bool,
    /// The routing key the router hashes.
    key: String,
}

/// A mix of request shapes, every prompt carrying the marker; the first 32 words are shared
/// by the completions (two full blocks of 16).
fn traffic() -> Vec<Sent> {
    let shared = format!("{MARKER} {}", words("shared", 31));
    let mut v = Vec::new();
    for i in 0..12usize {
        let prompt = format!("{shared} {}", words(&format!("u{i}x"), 3 + 7 * i));
        let tokens = 32 + 3 + 7 * i;
        let max_tokens = 2 + (i as u64 % 5);
        let mut body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens});
        let (mut header_key, mut key) = (None, prompt.chars().take(256).collect::<String>());
        match i % 4 {
            0 => {}
            1 => {
                body["user"] = json!(format!("alice+{MARKER}@example.com"));
                key = format!("alice+{MARKER}@example.com");
            }
            2 => {
                header_key = Some(format!("tenant-{MARKER}"));
                key = format!("tenant-{MARKER}");
            }
            _ => {}
        }
        let stream = i % 3 == 2;
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        v.push(Sent {
            body,
            header_key,
            stream,
            tokens,
            max_tokens,
            usage: true,
            key,
        });
    }
    // Chat: streamed without usage (output from max_tokens), and content parts.
    for i in 0..4usize {
        let a = format!("{MARKER} {}", words(&format!("c{i}y"), 5 + i));
        let b = words(&format!("d{i}z"), 20);
        let content = if i % 2 == 0 {
            json!(a.clone())
        } else {
            json!([{"type": "text", "text": a.clone()}])
        };
        let stream = i < 2;
        let mut body = json!({"model": "m", "max_tokens": 3, "user": format!("bob-{MARKER}"),
            "messages": [{"role": "system", "content": content}, {"role": "user", "content": b}]});
        if stream {
            body["stream"] = json!(true);
        }
        v.push(Sent {
            body,
            header_key: None,
            stream,
            tokens: 1 + 5 + i + 20,
            max_tokens: 3,
            usage: !stream,
            key: format!("bob-{MARKER}"),
        });
    }
    v
}

/// Send each request in turn; (destination header, response body text) of each.
fn send_all(router: &str, sent: &[Sent]) -> Vec<(u64, String)> {
    let c = client();
    sent.iter()
        .map(|s| {
            let path = if s.body.get("messages").is_some() {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let mut rq = c
                .post(format!("{router}{path}"))
                .header("content-type", "application/json")
                .body(s.body.to_string());
            if let Some(k) = &s.header_key {
                rq = rq.header("x-cacheroute-key", k);
            }
            let r = rq.send().unwrap();
            assert_eq!(r.status(), 200);
            let d = r.headers()["x-cacheroute-destination"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let text = r.text().unwrap();
            if s.stream {
                assert!(text.contains("data: [DONE]"), "{text}");
            }
            (d, text)
        })
        .collect()
}

fn wait_for_lines(path: &Path, n: usize, within: Duration) -> Vec<Value> {
    let deadline = Instant::now() + within;
    loop {
        let got = std::fs::read_to_string(path)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if got >= n {
            return lines(path);
        }
        assert!(
            Instant::now() < deadline,
            "{got} of {n} records in {} after {within:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Generated words of the emulator's answers (` gXXXXXXX`), from JSON bodies and SSE chunks.
fn generated_words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| w.len() == 8 && w.starts_with('g'))
        .map(str::to_string)
        .collect()
}

#[test]
fn requests_are_recorded_as_hashes_and_counts_never_text() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rec.jsonl");
    let (e0, e1) = (Proc::emulator(), Proc::emulator());
    let router = Proc::start(&[
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "dualmap",
        "--backend",
        &e0.url,
        "--backend",
        &e1.url,
        "--admin-token",
        "t",
        "--workers",
        "1",
        "--record",
        file.to_str().unwrap(),
    ]);
    let sent = traffic();
    let t0 = Instant::now();
    let answers = send_all(&router.url, &sent);
    // Flushed within about a second, without a shutdown: a router killed now loses nothing.
    let recs = wait_for_lines(&file, sent.len(), Duration::from_secs(15));
    let stats: Value = serde_json::from_str(
        &client()
            .get(format!("{}/admin/stats", router.url))
            .bearer_auth("t")
            .send()
            .unwrap()
            .text()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(stats["recording"]["written"], sent.len() as u64, "{stats}");
    assert_eq!(stats["recording"]["dropped"], 0);
    let metrics = client()
        .get(format!("{}/metrics", router.url))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        metrics.contains(&format!(
            "cacheroute_router_records_written_total {}",
            sent.len()
        )),
        "{metrics}"
    );
    drop(router); // SIGKILL: nothing more is written, nothing is lost
    let elapsed_ms = t0.elapsed().as_secs_f64() * 1e3;

    // No text: neither the prompts' marker nor any generated word.
    let raw = std::fs::read_to_string(&file).unwrap();
    assert!(!raw.contains(MARKER), "prompt text recorded:\n{raw}");
    assert!(!raw.contains("shared1"), "prompt text recorded:\n{raw}");
    let mut generated = 0;
    for (_, text) in &answers {
        for w in generated_words(text) {
            generated += 1;
            assert!(!raw.contains(&w), "completion text `{w}` recorded");
        }
    }
    assert!(
        generated > 20,
        "the check saw the completions ({generated} words)"
    );

    assert_eq!(recs.len(), sent.len());
    assert_eq!(stats_requests(&file), sent.len() as u64);
    let mut prev = 0.0;
    for (i, (r, s)) in recs.iter().zip(&sent).enumerate() {
        let ts = r["timestamp"].as_f64().unwrap();
        assert!(ts >= prev && ts <= elapsed_ms + 5_000.0, "line {i}: {ts}");
        prev = ts;
        // The key is the routing key's hash: the header, the user, or the prompt's prefix.
        assert_eq!(r["key"], hex16(&s.key), "line {i}");
        assert_eq!(r["input_length"], s.tokens as u64, "line {i}: {r}");
        assert_eq!(r["output_length"], s.max_tokens, "line {i}: {r}");
        assert_eq!(
            r["output_from"],
            if s.usage { "usage" } else { "max_tokens" },
            "line {i}"
        );
        let ids = r["hash_ids"].as_array().unwrap();
        assert_eq!(ids.len(), s.tokens.div_ceil(16), "line {i}: {r}");
        assert_eq!(r["destination"], answers[i].0, "line {i}");
        assert_eq!(r["status"], 200);
        assert!(r.get("complete").is_none(), "line {i}: {r}");
        assert!(r["ttft_ms"].as_f64().unwrap() <= r["e2e_ms"].as_f64().unwrap());
    }
    // The shared 32-word prefix is two equal leading block ids; the rest differ.
    let first: Vec<&Value> = recs[..12].iter().map(|r| &r["hash_ids"]).collect();
    for h in &first {
        assert_eq!(h[0], first[0][0]);
        assert_eq!(h[1], first[0][1]);
    }
    assert_ne!(first[1][2], first[2][2]);
}

fn rotated(p: &Path, i: usize) -> PathBuf {
    PathBuf::from(format!("{}.{i}", p.display()))
}

/// A sticky router with one emulator, recording to `file` with `extra` flags; `n` requests
/// with keys `{tag}0`, `{tag}1`, …; then SIGTERM. Returns its stderr.
fn record_run(backend: &str, file: &Path, extra: &[&str], tag: &str, n: usize) -> String {
    let mut args = vec![
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "sticky",
        "--backend",
        backend,
        "--record",
        file.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let router = Proc::start(&args);
    let c = client();
    for i in 0..n {
        let r = c
            .post(format!("{}/v1/completions", router.url))
            .header("x-cacheroute-key", format!("{tag}{i}"))
            .header("content-type", "application/json")
            .body(json!({"model": "m", "prompt": words("p", 20 + i), "max_tokens": 2}).to_string())
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let (status, err) = router.terminate();
    assert!(status.success(), "{err}");
    assert!(
        err.contains(&format!("recorded {n} requests to")),
        "no shutdown summary: {err}"
    );
    err
}

/// Every file of a rotated recording, oldest first (`FILE.k` … `FILE.1`, `FILE`).
fn recording_files(file: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = (1..100)
        .map(|i| rotated(file, i))
        .take_while(|p| p.exists())
        .collect();
    v.reverse();
    v.push(file.to_path_buf());
    v
}

#[test]
fn rotation_keeps_valid_files_and_a_restart_appends() {
    let dir = tempfile::tempdir().unwrap();
    let e = Proc::emulator();
    // Lines are ~200-300 bytes: a few records per 700-byte file.
    let file = dir.path().join("rot.jsonl");
    let err = record_run(
        &e.url,
        &file,
        &["--record-max-bytes", "700", "--record-keep", "50"],
        "k",
        12,
    );
    assert!(err.contains("0 dropped"), "{err}");
    let files = recording_files(&file);
    assert!(files.len() >= 4, "{files:?}");
    let mut total = 0;
    let mut prev = 0.0;
    for f in &files {
        assert!(
            std::fs::metadata(f).unwrap().len() <= 700,
            "{}",
            f.display()
        );
        let n = stats_requests(f);
        assert!(n >= 1);
        total += n;
        // Concatenated oldest first, the files are one sorted trace.
        for r in lines(f) {
            let ts = r["timestamp"].as_f64().unwrap();
            assert!(ts >= prev, "{}: {ts} < {prev}", f.display());
            prev = ts;
        }
    }
    assert_eq!(total, 12, "every request in exactly one file");

    // A restart on the same file continues it: later timestamps, one recording.
    record_run(
        &e.url,
        &file,
        &["--record-max-bytes", "700", "--record-keep", "50"],
        "again",
        3,
    );
    let all: Vec<Value> = recording_files(&file)
        .iter()
        .flat_map(|f| lines(f))
        .collect();
    assert_eq!(all.len(), 15);
    for w in all.windows(2) {
        assert!(w[1]["timestamp"].as_f64() >= w[0]["timestamp"].as_f64());
    }
    assert_eq!(all[14]["key"], hex16("again2"));

    // At most K rotated files: the oldest go, the newest stay.
    let small = dir.path().join("small.jsonl");
    record_run(
        &e.url,
        &small,
        &["--record-max-bytes", "700", "--record-keep", "2"],
        "s",
        12,
    );
    assert!(rotated(&small, 1).exists() && rotated(&small, 2).exists());
    assert!(
        !rotated(&small, 3).exists(),
        "more than 2 rotated files kept"
    );
    let kept: Vec<Value> = recording_files(&small)
        .iter()
        .flat_map(|f| lines(f))
        .collect();
    assert!(kept.len() < 12);
    assert_eq!(kept.last().unwrap()["key"], hex16("s11"));
    for f in recording_files(&small) {
        stats_requests(&f);
    }
}

#[test]
fn unusable_record_paths_are_refused_before_listening() {
    let dir = tempfile::tempdir().unwrap();
    let not_trace = dir.path().join("router.yaml");
    std::fs::write(
        &not_trace,
        "policy: sticky\nbackends: [http://127.0.0.1:1]\n",
    )
    .unwrap();
    let missing = dir.path().join("no/such/dir/rec.jsonl");
    for (path, why) in [
        (missing.as_path(), "does not exist"),
        (dir.path(), "is a directory"),
        (not_trace.as_path(), "is not a trace"),
    ] {
        let (st, out, err) = run(&[
            "route",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "sticky",
            "--backend",
            "http://127.0.0.1:1",
            "--record",
            path.to_str().unwrap(),
        ]);
        assert!(!st.success(), "{}: accepted", path.display());
        assert!(!out.contains("listening on"), "{out}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(
            err.starts_with(&format!("error: --record {}", path.display())) && err.contains(why),
            "{err}"
        );
        // Only advice `route` can follow: it has no --skip-bad (it was offered once).
        assert!(!err.contains("--skip-bad"), "{err}");
        if path == not_trace.as_path() {
            assert!(
                err.trim_end().ends_with(
                    "exists and is not a trace (line 1: not valid JSON (expected value at line 1 column 1)); move it away or record to another file (an existing trace is appended to)"
                ),
                "{err}"
            );
        }
    }
    assert!(!missing.parent().unwrap().exists());
    assert_eq!(
        std::fs::read_to_string(&not_trace).unwrap(),
        "policy: sticky\nbackends: [http://127.0.0.1:1]\n",
        "a file that is not a trace is left alone"
    );
    // Rotation flags without a file to rotate.
    let (st, _, err) = run(&[
        "route",
        "--policy",
        "sticky",
        "--backend",
        "http://127.0.0.1:1",
        "--record-max-bytes",
        "1000",
    ]);
    assert!(!st.success());
    assert!(err.contains("need --record FILE"), "{err}");
}

#[test]
fn a_recording_replays_through_the_router() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.jsonl");
    let again = dir.path().join("again.jsonl");
    let (e0, e1) = (Proc::emulator(), Proc::emulator());
    let route = |file: &Path| {
        Proc::start(&[
            "route",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "chwbl",
            "--backend",
            &e0.url,
            "--backend",
            &e1.url,
            "--record",
            file.to_str().unwrap(),
        ])
    };
    let router = route(&first);
    let sent = traffic();
    send_all(&router.url, &sent);
    let (st, err) = router.terminate();
    assert!(st.success(), "{err}");
    let recorded = lines(&first);
    assert_eq!(recorded.len(), sent.len());

    // Replayed at its own timestamps through a second recording router.
    let router = route(&again);
    let (st, out, err) = run(&[
        "replay",
        "--target",
        &router.url,
        "--trace",
        first.to_str().unwrap(),
        "--block-size",
        "16",
        "--model",
        "m",
        "--json",
    ]);
    assert!(st.success(), "replay: {err}");
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["requests"], sent.len() as u64, "{summary}");
    assert_eq!(summary["ok"], sent.len() as u64, "{summary}");
    let (st, err) = router.terminate();
    assert!(st.success(), "{err}");

    // The second recording has the first's lengths, keys (hashed once more: the replayer
    // sends the recorded key as the key header) and prefix sharing.
    let replayed = lines(&again);
    assert_eq!(replayed.len(), recorded.len());
    let shape = |v: &[Value]| {
        let mut s: Vec<(u64, u64)> = v
            .iter()
            .map(|r| {
                (
                    r["input_length"].as_u64().unwrap(),
                    r["output_length"].as_u64().unwrap(),
                )
            })
            .collect();
        s.sort();
        s
    };
    assert_eq!(shape(&recorded), shape(&replayed));
    let keys = |v: &[Value], rehash: bool| {
        let mut k: Vec<String> = v
            .iter()
            .map(|r| {
                let k = r["key"].as_str().unwrap();
                if rehash {
                    hex16(k)
                } else {
                    k.to_string()
                }
            })
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(&recorded, true), keys(&replayed, false));
    let distinct_first_blocks = |v: &[Value]| {
        v.iter()
            .map(|r| r["hash_ids"][0].as_u64().unwrap())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    assert_eq!(
        distinct_first_blocks(&recorded),
        distinct_first_blocks(&replayed)
    );
}

/// `n` requests sent from their own threads 15 ms apart, the earliest asking for the most
/// tokens, so they finish in about the reverse order of their arrival.
fn overlapping(router: &str, n: usize) {
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let url = format!("{router}/v1/completions");
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(15 * i as u64));
                let r = client()
                    .post(url)
                    .header("x-cacheroute-key", format!("o{i}"))
                    .header("content-type", "application/json")
                    .body(
                        json!({"model": "m", "prompt": words("q", 8), "max_tokens": 4 * (n - i)})
                            .to_string(),
                    )
                    .send()
                    .unwrap();
                assert_eq!(r.status(), 200);
                r.text().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn requests_finishing_out_of_order_are_written_in_arrival_order() {
    let dir = tempfile::tempdir().unwrap();
    // Slow enough (4 tokens ≈ 35 ms) that each answer ends before the one sent 15 ms earlier.
    let e = Proc::emulator_scaled("127.0.0.1:0", "0.25");
    let n = 12;
    for (hold, late) in [("10", false), ("0", true)] {
        let file = dir.path().join(format!("hold{hold}.jsonl"));
        let router = Proc::start(&[
            "route",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "sticky",
            "--backend",
            &e.url,
            "--record",
            file.to_str().unwrap(),
            "--record-hold-s",
            hold,
        ]);
        overlapping(&router.url, n);
        let (st, err) = router.terminate();
        assert!(st.success(), "{err}");
        assert_eq!(stats_requests(&file), n as u64, "a sorted trace");
        let recs = lines(&file);
        // They did finish out of order: some request ended before an earlier one.
        let ends: Vec<(f64, f64)> = recs
            .iter()
            .map(|r| {
                let t = r["timestamp"].as_f64().unwrap() - r["clamped_ms"].as_f64().unwrap_or(0.0);
                (t, t + r["e2e_ms"].as_f64().unwrap())
            })
            .collect();
        let mut by_arrival = ends.clone();
        by_arrival.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            by_arrival.windows(2).any(|w| w[1].1 < w[0].1),
            "no request finished before an earlier one: {ends:?}"
        );
        let clamped = recs
            .iter()
            .filter(|r| r.get("clamped_ms").is_some())
            .count();
        if late {
            // No hold: each is written as it finishes, its timestamp moved up and flagged.
            assert!(clamped > 0 && !err.contains(" 0 late"), "{err}");
        } else {
            // Held until the earlier ones finished: exact arrival times, in order.
            assert_eq!(clamped, 0, "{recs:?}");
            assert!(err.contains(" 0 late"), "{err}");
            // Every request once; the order is the router's arrival order (the timestamps,
            // checked sorted above), which a loaded machine may not keep from the send order.
            let mut keys: Vec<String> = recs
                .iter()
                .map(|r| r["key"].as_str().unwrap().into())
                .collect();
            let mut sent: Vec<String> = (0..n).map(|i| hex16(&format!("o{i}"))).collect();
            keys.sort();
            sent.sort();
            assert_eq!(keys, sent, "every request once");
        }
    }
}

/// A stream still running when the drain timeout cuts it is recorded, marked incomplete, before
/// the recording closes (serving workers, as the CLI runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_at_shutdown_is_recorded_as_incomplete() {
    let slow = MockConfig {
        chunks: 10_000,
        chunk_delay: Duration::from_millis(20),
        first_delay: Duration::ZERO,
    };
    let m = MockEngine::start("m0", slow).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cut.jsonl");
    let mut cfg = RouterConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![m.url()],
        PolicySpec::from_name("sticky").unwrap(),
    );
    cfg.workers = 1;
    cfg.drain_timeout = Duration::from_millis(500);
    cfg.record = Some(RecordConfig::new(&file));
    let h = router::start(cfg).await.unwrap();
    let c = reqwest::Client::new();
    let send = |key: &str, stream: bool| {
        c.post(format!("{}/v1/completions", h.url()))
            .header("x-cacheroute-key", key)
            .header("content-type", "application/json")
            .body(
                json!({"model": "m", "prompt": "a b c", "max_tokens": 4, "stream": stream})
                    .to_string(),
            )
            .send()
    };
    let r = send("done", false).await.unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    let mut cut = send("cut", true).await.unwrap();
    assert!(cut.chunk().await.unwrap().is_some(), "the stream has begun");
    let report = h.shutdown_report().await;
    assert!(
        !report.drained,
        "the 200 s stream outlived the drain timeout"
    );
    let rec = report.recording.expect("recording");
    assert_eq!((rec.written, rec.dropped), (2, 0), "{rec:?}");
    let recs = lines(&file);
    assert_eq!(recs[0]["key"], hex16("done"));
    assert!(recs[0].get("complete").is_none(), "{}", recs[0]);
    assert_eq!(recs[1]["key"], hex16("cut"));
    assert_eq!(recs[1]["complete"], false, "{}", recs[1]);
    assert_eq!(recs[1]["status"], 200);
    assert_eq!(recs[1]["output_from"], "max_tokens");
}
