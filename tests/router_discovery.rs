//! Discovery without restarts: the router reads its backends from a watched file
//! (`--backends-file`), and a file renamed over it adds and removes backends while it routes.
//! Real HTTP over loopback: mock engines (small real HTTP servers) behind the router in
//! process, and once the `cacheroute route` binary in front of `cacheroute emulate` processes.
//! No speed assertions; the waits are generous deadlines.

mod common;

use cacheroute::policy::PolicySpec;
use cacheroute::router::{self, RouterConfig, RouterHandle};
use common::mock_engine::{sse_body, MockConfig, MockEngine};
use common::procs::Proc;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// Write `text` to `path` as tools and Kubernetes ConfigMaps do: a new file renamed over it.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn lines(urls: &[String]) -> String {
    let mut s = String::from("# backends, one base URL a line\n");
    for u in urls {
        s.push_str(u);
        s.push('\n');
    }
    s
}

fn config(file: &Path, policy: &str) -> RouterConfig {
    let mut c = RouterConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        Vec::new(),
        PolicySpec::from_name(policy).unwrap(),
    );
    c.backends_file = Some(file.to_path_buf());
    c.backends_poll = Duration::from_millis(100);
    c.health_interval = Duration::from_millis(300);
    c.health_timeout = Duration::from_millis(500);
    c.first_byte_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(10);
    c.admin_token = Some("sekret".into());
    c
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// One request: (status, destination, body).
async fn complete(c: &reqwest::Client, h: &str, key: &str, stream: bool) -> (u16, usize, String) {
    let r = c
        .post(format!("{h}/v1/completions"))
        .header("x-cacheroute-key", key)
        .header("content-type", "application/json")
        .body(json!({"model": "m", "prompt": "hello", "stream": stream}).to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let d = r
        .headers()
        .get("x-cacheroute-destination")
        .map_or(usize::MAX, |v| v.to_str().unwrap().parse().unwrap());
    let body = r
        .text()
        .await
        .unwrap_or_else(|e| format!("body failed: {e}"));
    (status, d, body)
}

async fn admin(c: &reqwest::Client, h: &RouterHandle, path: &str) -> Value {
    let b = c
        .get(format!("{}{path}", h.url()))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    serde_json::from_slice(&b).unwrap()
}

/// Wait (up to 20 s) until `ok` holds of the router's backends.
async fn until_backends(h: &RouterHandle, what: &str, ok: impl Fn(&[(usize, String)]) -> bool) {
    let t0 = Instant::now();
    loop {
        let b = h.backends();
        if ok(&b) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what}: backends {b:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_added_gets_traffic_one_removed_gets_none_and_its_streams_finish() {
    // Streams of 40 chunks 100 ms apart: those on the removed backend are still running when
    // it leaves the file.
    let cfg = MockConfig {
        chunks: 40,
        chunk_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let ms = [
        MockEngine::start("m0", cfg.clone()).await,
        MockEngine::start("m1", cfg.clone()).await,
        MockEngine::start("m2", cfg.clone()).await,
    ];
    let urls: Vec<String> = ms.iter().map(|m| m.url()).collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends.txt");
    replace(&file, &lines(&urls[..2]));
    let h = router::start(config(&file, "flat-lb")).await.unwrap();
    let c = client();
    assert_eq!(
        h.backends(),
        vec![(0, urls[0].clone()), (1, urls[1].clone())]
    );

    // Six streams in flight over m0 and m1 (flat-lb takes the less loaded of two).
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let (c, u) = (c.clone(), h.url());
            tokio::spawn(async move { complete(&c, &u, &format!("s{i}"), true).await })
        })
        .collect();
    let t0 = Instant::now();
    while ms[0].hits() + ms[1].hits() < 6 {
        assert!(t0.elapsed() < Duration::from_secs(20), "streams not sent");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ms[0].hits() > 0, "no stream went to m0");
    let to_m0 = ms[0].hits();

    // m0 leaves, m2 joins.
    replace(&file, &lines(&[urls[1].clone(), urls[2].clone()]));
    until_backends(&h, "m0 removed and m2 added", |b| {
        b.iter().all(|(_, u)| *u != urls[0]) && b.iter().any(|(_, u)| *u == urls[2])
    })
    .await;
    let removed_at = Instant::now();
    // The removal came while m0's streams ran.
    assert!(
        streams.iter().any(|s| !s.is_finished()),
        "the streams ended before the removal was seen; the test shows nothing"
    );
    // m2 took slot 2, the lowest vacant slot no backend held before (slot 0 stays m0's).
    assert!(
        h.backends().contains(&(2, urls[2].clone())),
        "{:?}",
        h.backends()
    );
    // Wait for traffic on it.
    let mut sent = 0;
    while ms[2].hits() == 0 {
        let (status, _, body) = complete(&c, &h.url(), &format!("k{sent}"), false).await;
        assert_eq!(status, 200, "{body}");
        sent += 1;
        assert!(
            removed_at.elapsed() < Duration::from_secs(20),
            "m2 got no traffic after {sent} requests"
        );
    }
    eprintln!(
        "m2 got its first request {:.0} ms after the file change was seen (health interval 300 ms)",
        removed_at.elapsed().as_secs_f64() * 1e3
    );
    // From now on nothing reaches m0.
    for i in 0..30 {
        let (status, d, body) = complete(&c, &h.url(), &format!("after{i}"), false).await;
        assert_eq!(status, 200, "{body}");
        let url = h.backends().into_iter().find(|(x, _)| *x == d).unwrap().1;
        assert_ne!(url, urls[0], "request {i} went to the removed backend");
    }
    assert_eq!(ms[0].hits(), to_m0, "the removed backend got requests");
    // Every stream, those on m0 included, finished whole.
    for s in streams {
        let (status, _, body) = s.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(
            body == sse_body("m0", 40) || body == sse_body("m1", 40),
            "a stream was cut: {body}"
        );
    }
    // /admin/stats and /metrics show the backends in force only.
    let stats = admin(&c, &h, "/admin/stats").await;
    let shown: Vec<&str> = stats["destinations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["url"].as_str().unwrap())
        .collect();
    assert_eq!(shown.len(), 2, "{stats}");
    assert!(!shown.contains(&urls[0].as_str()), "{stats}");
    assert_eq!(stats["failed"], 0, "{stats}");
    let metrics = c
        .get(format!("{}/metrics", h.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics.contains(&urls[0]),
        "/metrics names the removed backend"
    );
    assert!(
        metrics.contains(&urls[2]),
        "/metrics misses the added backend"
    );

    // m0 back: it gets its old slot.
    back_in_its_slot(h, &file, &urls, 0).await;
}

/// Every backend of `urls` back in the file: the one that left takes slot `slot`, the one it
/// held. Then the router stops.
async fn back_in_its_slot(h: RouterHandle, file: &Path, urls: &[String], slot: usize) {
    replace(file, &lines(urls));
    until_backends(&h, "the removed backend back", |b| b.len() == urls.len()).await;
    assert!(
        h.backends().contains(&(slot, urls[slot].clone())),
        "{:?}",
        h.backends()
    );
    assert!(h.shutdown().await);
}

#[test]
fn a_malformed_replacement_is_refused_with_one_line_and_routing_goes_on() {
    let e0 = Proc::emulator();
    let e1 = Proc::emulator();
    let e2 = Proc::emulator();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends");
    replace(&file, &lines(&[e0.url.clone(), e1.url.clone()]));
    let f = file.to_str().unwrap();
    let cfg = dir.path().join("router.yaml");
    std::fs::write(&cfg, "backends_poll_ms: 100\nhealth_interval_ms: 300\n").unwrap();
    let r = Proc::start(&[
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "flat-lb",
        "--backends-file",
        f,
        "--config",
        cfg.to_str().unwrap(),
        "--admin-token",
        "sekret",
    ]);
    let c = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let backends = || -> Vec<String> {
        let v: Value = serde_json::from_str(
            &c.get(format!("{}/admin/stats", r.url))
                .bearer_auth("sekret")
                .send()
                .unwrap()
                .text()
                .unwrap(),
        )
        .unwrap();
        v["destinations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["url"].as_str().unwrap().to_string())
            .collect()
    };
    let route = |n: usize| {
        for i in 0..n {
            let resp = c
                .post(format!("{}/v1/completions", r.url))
                .header("content-type", "application/json")
                .body(json!({"model": "m", "prompt": format!("p{i}"), "max_tokens": 2}).to_string())
                .send()
                .unwrap();
            assert_eq!(resp.status(), 200, "{}", resp.text().unwrap());
        }
    };
    route(4);
    let before = vec![e0.url.clone(), e1.url.clone()];
    assert_eq!(backends(), before);
    let bad = [
        // A line that is not a backend URL.
        (format!("{}\nnot-a-url\n", e2.url), "line 2: `not-a-url`"),
        // The same backend twice.
        (format!("{}\n{}\n{}/\n", e0.url, e2.url, e0.url), "line 3: "),
        // An endpoint, not a base URL.
        (
            format!("{}/v1/completions\n", e2.url),
            "/v1/completions` names an endpoint",
        ),
        // Nothing at all.
        ("# emptied by mistake\n".to_string(), "names no backend"),
        // What a lenient URL parser takes and the upstream client does not (the router used to
        // remove the backends gone from the file, then panic in discovery and stay deaf to
        // every later file), and what no parser should take.
        (
            format!("{}\n{}/<r>\n", e2.url, e0.url),
            "/<r>` is not a URL",
        ),
        (format!("{}/a`b\n", e2.url), "/a`b` is not a URL"),
        (format!("\0\0{}\n", e2.url), "holds '\\0'"),
        (format!("\u{1}{}\n", e2.url), "holds '\\u{1}'"),
        (format!("{}\u{7f}\n", e2.url), "holds '\\u{7f}'"),
        (format!("{}/{}\n", e2.url, "a".repeat(70_000)), "byte limit"),
    ];
    for (text, _) in &bad {
        replace(&file, text);
        // Two polls and more pass; the file stays refused and the backends stay.
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(backends(), before, "after {text:?}");
        route(4);
    }
    // A good file still takes effect afterwards.
    replace(&file, &lines(&[e1.url.clone(), e2.url.clone()]));
    let t0 = Instant::now();
    while backends() != [e1.url.clone(), e2.url.clone()] {
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", backends());
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, err) = r.terminate();
    assert!(status.success(), "{err}");
    for (text, what) in &bad {
        let refused: Vec<&str> = err
            .lines()
            .filter(|l| l.contains(&format!("backends file {f}")) && l.contains(what))
            .collect();
        assert_eq!(
            refused.len(),
            1,
            "one line for {text:?} naming the file and {what}: {err}"
        );
        assert!(refused[0].contains("backends in force are kept"), "{err}");
    }
}

/// `cacheroute route` (flat-lb, a free port) with `backends`, run to its end: its exit status
/// and stderr.
fn route_with(backends: &[&str]) -> (std::process::ExitStatus, String) {
    let mut args = vec!["route", "--listen", "127.0.0.1:0", "--policy", "flat-lb"];
    args.extend_from_slice(backends);
    let (status, _, err) = common::procs::run(&args);
    (status, err)
}

#[test]
fn a_backend_url_the_upstream_client_cannot_take_is_refused_at_start_in_one_line() {
    let long = format!("http://127.0.0.1:9/{}", "a".repeat(70_000));
    for bad in [
        "http://127.0.0.1:9/<r>",
        "http://127.0.0.1:9/`",
        "\u{1}http://127.0.0.1:9",
        "http://127.0.0.1:9\u{7f}",
        long.as_str(),
    ] {
        let (status, err) = route_with(&["--backend", bad]);
        assert_eq!(status.code(), Some(1), "{bad:.60?}: {err:.2000}");
        assert!(!err.contains("panicked"), "{err:.2000}");
        assert!(err.contains("backends[0]: "), "{err:.2000}");
        assert!(err.len() < 1000, "not one short message: {err:.2000}");
    }
    // A backends file with such a line fails the start the same way, naming the line.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends");
    std::fs::write(&file, "http://127.0.0.1:9\nhttp://127.0.0.1:10/<r>\n").unwrap();
    let (status, err) = route_with(&["--backends-file", file.to_str().unwrap()]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("backends file {} line 2", file.display()))
            && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn a_wrong_backends_file_at_start_is_one_line_and_a_failed_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends");
    std::fs::write(&file, "http://127.0.0.1:9\nhttp://127.0.0.1:9\n").unwrap();
    let (status, err) = route_with(&["--backends-file", file.to_str().unwrap()]);
    assert!(!status.success());
    assert!(
        err.contains(&format!("backends file {} line 2", file.display()))
            && err.contains("repeats line 1"),
        "{err}"
    );
}

/// Each admitted key's planned set, by key name.
fn table(plan: &Value) -> Vec<(String, Vec<u64>)> {
    let mut v: Vec<(String, Vec<u64>)> = plan["table"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, s)| {
            (
                k.clone(),
                s.as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect(),
            )
        })
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cacheroute_moves_only_the_removed_destinations_keys_and_gives_its_slot_back() {
    let ms = [
        MockEngine::start("m0", MockConfig::default()).await,
        MockEngine::start("m1", MockConfig::default()).await,
        MockEngine::start("m2", MockConfig::default()).await,
        MockEngine::start("m3", MockConfig::default()).await,
    ];
    let urls: Vec<String> = ms.iter().map(|m| m.url()).collect();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backends.txt");
    replace(&file, &lines(&urls));
    let mut cfg = config(&file, "cacheroute");
    if let PolicySpec::Cacheroute(c) = &mut cfg.policy {
        // One plan from the first traffic, then none but repairs during the test.
        c.interval_s = 3600.0;
    }
    let h = router::start(cfg).await.unwrap();
    let c = client();
    // 40 keys, 300 requests: the first plan is built as soon as 100 were seen.
    for i in 0..300 {
        let (status, _, body) = complete(&c, &h.url(), &format!("key{}", i % 40), false).await;
        assert_eq!(status, 200, "{body}");
    }
    let t0 = Instant::now();
    let before = loop {
        let p = admin(&c, &h, "/admin/plan?table=true").await;
        if p["installed"] == true {
            break table(&p);
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no plan: {p}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let gone = 1u64;
    let on_gone = before.iter().filter(|(_, s)| s.contains(&gone)).count();
    assert!(on_gone > 0 && on_gone < before.len(), "{before:?}");

    let installed = admin(&c, &h, "/admin/stats").await["plans_installed"]
        .as_u64()
        .unwrap();
    // Destination 1 leaves the file.
    let mut kept = urls.clone();
    kept.remove(gone as usize);
    replace(&file, &lines(&kept));
    until_backends(&h, "destination 1 removed", |b| b.len() == 3).await;
    let t0 = Instant::now();
    let after = loop {
        let s = admin(&c, &h, "/admin/stats").await;
        if s["plans_installed"].as_u64().unwrap() > installed {
            let p = admin(&c, &h, "/admin/plan?table=true").await;
            assert_eq!(p["source"], "repair", "{p}");
            break table(&p);
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no new plan: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        before.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        after.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        "the repair changed which keys are admitted"
    );
    let mut moved = 0;
    for ((k, was), (_, now)) in before.iter().zip(&after) {
        assert!(
            !now.contains(&gone),
            "{k} still planned on the removed destination"
        );
        if was.contains(&gone) {
            moved += 1;
        } else {
            assert_eq!(
                was, now,
                "{k} moved though the removed destination held none of it"
            );
        }
    }
    assert_eq!(moved, on_gone);
    let hits = ms[gone as usize].hits();
    for i in 0..80 {
        let (status, d, body) = complete(&c, &h.url(), &format!("key{}", i % 40), false).await;
        assert_eq!(status, 200, "{body}");
        assert_ne!(d as u64, gone);
    }
    assert_eq!(ms[gone as usize].hits(), hits);

    // Back in the file: it takes the slot it held, so the plan's index for it is its own.
    back_in_its_slot(h, &file, &urls, gone as usize).await;
}
