//! What `cacheroute route` says on stderr, end to end: the real binary in front of real
//! `cacheroute emulate` processes over loopback. A destination killed and restarted is logged
//! down and then up with the reason; `--log-format json` writes one JSON object per line
//! (plans installed, request events at debug); no log line at any level holds prompt text,
//! prompt token ids or completion text; wrong backends are named at start.

mod common;

use common::procs::{run, Proc};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// The router's `/health` status (200 while a destination is up, else 503).
fn health(url: &str) -> u16 {
    client()
        .get(format!("{url}/health"))
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

fn wait_for_health(url: &str, status: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while health(url) != status {
        assert!(
            Instant::now() < deadline,
            "router /health never answered {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn port_of(url: &str) -> &str {
    url.rsplit(':').next().unwrap()
}

#[test]
fn a_killed_and_restarted_destination_is_logged_down_then_up() {
    let emu = Proc::emulator();
    let addr = format!("127.0.0.1:{}", port_of(&emu.url));
    let router = Proc::start_env(
        &[
            "route",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "sticky",
            "--health-interval-ms",
            "100",
            "--backend",
            &emu.url,
        ],
        &[("RUST_LOG", "info")],
    );
    wait_for_health(&router.url, 200);
    drop(emu); // killed
    wait_for_health(&router.url, 503);
    let emu = Proc::emulator_at(&addr);
    wait_for_health(&router.url, 200);
    let (status, err) = router.terminate();
    drop(emu);
    assert!(status.success(), "{err}");
    let down = err
        .lines()
        .position(|l| l.contains(" WARN ") && l.contains("destination 0 down: probe GET"))
        .unwrap_or_else(|| panic!("no down line: {err}"));
    let up = err
        .lines()
        .position(|l| l.contains(" INFO ") && l.contains("destination 0 up: probe GET"))
        .unwrap_or_else(|| panic!("no up line: {err}"));
    assert!(down < up, "down after up: {err}");
    let down_line = err.lines().nth(down).unwrap();
    assert!(
        // The answer depends on the moment of the kill (refused, reset, a kept-alive
        // connection closed under the probe): the line names the probe and what went wrong.
        down_line.contains(&format!("http://{addr}/health"))
            && ["refused", "reset", "closed"]
                .iter()
                .any(|w| down_line.contains(w)),
        "the reason names the probe and its answer: {down_line}"
    );
    assert!(err.lines().nth(up).unwrap().contains("answered 200"));
}

/// Distinctive words: a prompt made of them, and token ids nobody else sends.
const SECRET: &str = "quokkaSECRETzebra";
const SECRET_IDS: [u32; 3] = [918_273, 645_372, 827_364];

fn secret_prompt(i: usize) -> String {
    (0..40)
        .map(|w| format!("{SECRET}{i}x{w}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every log line holding one of `needles`, raw or as JSON escapes it.
fn leaks<'a>(logs: &'a str, needles: &[String]) -> Vec<&'a str> {
    logs.lines()
        .filter(|l| {
            needles.iter().any(|n| {
                let escaped = serde_json::to_string(n).unwrap();
                l.contains(n.as_str()) || l.contains(escaped.trim_matches('"'))
            })
        })
        .collect()
}

/// A CacheRoute router (admin API on, so key names are kept) at `level` in `format` in front
/// of two emulators; requests with secret prompts, token-id prompts and a chat, streamed and
/// not, with secret key headers and `user`s, some answered by a dead destination (a retry);
/// its stderr and the completion texts.
fn secret_run(level: &str, format: &str) -> (String, Vec<String>) {
    let (e0, e1) = (Proc::emulator(), Proc::emulator());
    // A third backend that passes its first probe and then dies: the requests routed there
    // find it gone and fail over (the retry path).
    let dead_url = dies_after_first_probe();
    let router = Proc::start_env(
        &[
            "route",
            "--log-format",
            format,
            "--listen",
            "127.0.0.1:0",
            "--policy",
            "cacheroute",
            "--interval-s",
            "1",
            "--health-interval-ms",
            "60000",
            "--admin-token",
            "tok",
            "--backend",
            &e0.url,
            "--backend",
            &e1.url,
            "--backend",
            &dead_url,
        ],
        &[("RUST_LOG", level)],
    );
    let c = client();
    let mut completions = Vec::new();
    for i in 0..120 {
        let (path, body) = match i % 4 {
            0 => (
                "/v1/completions",
                json!({"model": "m", "prompt": secret_prompt(i), "max_tokens": 8}),
            ),
            1 => (
                "/v1/completions",
                json!({"model": "m", "prompt": SECRET_IDS, "max_tokens": 8, "stream": true}),
            ),
            2 => (
                "/v1/chat/completions",
                json!({"model": "m", "messages": [{"role": "user", "content": secret_prompt(i)}], "max_tokens": 8}),
            ),
            _ => (
                "/v1/completions",
                json!({"model": "m", "prompt": secret_prompt(i), "user": format!("{SECRET}-user"), "max_tokens": 8}),
            ),
        };
        let mut req = c
            .post(format!("{}{path}", router.url))
            .header("content-type", "application/json");
        if i % 4 == 1 {
            // The key's text (a tenant, an e-mail address) is not logged either.
            req = req.header("x-cacheroute-key", format!("{SECRET}-key-{}", i % 3));
        }
        let r = req.body(body.to_string()).send().unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().unwrap();
        if i % 4 == 0 {
            let v: Value = serde_json::from_str(&text).unwrap();
            completions.push(v["choices"][0]["text"].as_str().unwrap().to_string());
        }
    }
    // Let a plan be installed (and logged) before stopping.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, err) = router.terminate();
    assert!(status.success(), "{err}");
    (err, completions)
}

/// A server on loopback answering each connection's first read with the status `answer`
/// gives for the bytes read, one connection at a time; when `answer` says `last`, it then
/// closes its listener (later connections are refused). Its base URL.
fn canned_server(answer: impl Fn(&[u8]) -> (&'static str, bool) + Send + 'static) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap_or(0);
            let (status, last) = answer(&buf[..n]);
            let _ = s.write_all(
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .as_bytes(),
            );
            if last {
                break;
            }
        }
    });
    url
}

/// A server that answers its first `GET /health` with 200 (anything before it with 503), then
/// closes its listener.
fn dies_after_first_probe() -> String {
    canned_server(|req| match req.starts_with(b"GET /health") {
        true => ("200 OK", true),
        false => ("503 Service Unavailable", false),
    })
}

/// What must never be logged: the prompts' marker, the token ids, each completion token.
fn needles(completions: &[String]) -> Vec<String> {
    let mut n: Vec<String> = vec![SECRET.to_string()];
    n.extend(SECRET_IDS.iter().map(|t| t.to_string()));
    for c in completions {
        n.extend(c.split_whitespace().map(str::to_string));
    }
    n
}

#[test]
fn no_log_line_holds_prompt_text_token_ids_or_completions_at_any_level() {
    for (level, format) in [("trace", "text"), ("debug", "json")] {
        let (logs, completions) = secret_run(level, format);
        assert!(!completions.is_empty());
        // The run logged what it must (so an empty or muted log cannot pass).
        assert!(
            logs.contains("request done") && logs.contains("plan installed"),
            "{level}/{format}: expected request and plan events: {logs}"
        );
        let needles = needles(&completions);
        let found = leaks(&logs, &needles);
        assert!(
            found.is_empty(),
            "{level}/{format}: log lines leak request or response content: {found:#?}"
        );
        // The check catches a leak: a line holding the body, raw or JSON-escaped, or a
        // completion.
        let body = json!({"prompt": secret_prompt(0), "ids": SECRET_IDS}).to_string();
        let planted = format!("{logs}\nDEBUG body={body}\n{{\"body\":{}}}", json!(body));
        assert_eq!(
            leaks(&planted, &needles).len(),
            2,
            "the check must see a leak"
        );
        let planted = format!("{logs}\nDEBUG completion={}", completions[0].trim());
        assert_eq!(
            leaks(&planted, &needles).len(),
            1,
            "the check must see a leak"
        );
    }
}

#[test]
fn json_logs_parse_line_by_line_and_carry_request_fields() {
    let (logs, _) = secret_run("debug", "json");
    let mut done = 0;
    let mut plans = 0;
    for l in logs.lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}"));
        for f in ["timestamp", "level", "target", "message"] {
            assert!(v.get(f).is_some(), "no `{f}`: {l}");
        }
        match v["message"].as_str().unwrap() {
            "request done" => {
                done += 1;
                assert_eq!(v["key"].as_str().unwrap().len(), 16, "{l}");
                assert!(v["destination"].as_u64().unwrap() < 2, "{l}");
                assert_eq!(v["status"], 200, "{l}");
                assert!(v["attempt"].as_u64().unwrap() <= 1, "{l}");
                let (ttft, up, e2e) = (
                    v["ttft_ms"].as_f64().unwrap(),
                    v["upstream_ms"].as_f64().unwrap(),
                    v["e2e_ms"].as_f64().unwrap(),
                );
                assert!(up <= ttft && ttft <= e2e, "{l}");
            }
            m if m.starts_with("plan installed") => {
                plans += 1;
                assert!(v["admitted"].as_u64().unwrap() > 0, "{l}");
                assert!(v["imbalance"].as_f64().unwrap() >= 1.0, "{l}");
                assert!(v.get("q_cap").is_some() && v.get("warm_slots").is_some());
            }
            _ => {}
        }
    }
    assert_eq!(done, 120, "{logs}");
    assert!(plans >= 1, "{logs}");
    assert!(
        logs.contains("destination 2 down: a request's connection failed"),
        "{logs}"
    );
    assert!(logs.contains("attempt failed"), "{logs}");
}

/// A server answering 404 to everything (an engine's base URL given with a wrong path).
fn not_found_server() -> String {
    canned_server(|_| ("404 Not Found", false))
}

/// A loopback URL where nothing listens (connections are refused).
fn refused_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

/// A flat-lb router in front of `backends`.
fn flat_lb(backends: &[&str]) -> Proc {
    let mut args = vec!["route", "--listen", "127.0.0.1:0", "--policy", "flat-lb"];
    for b in backends {
        args.extend(["--backend", b]);
    }
    Proc::start(&args)
}

#[test]
fn backends_that_all_fail_their_first_probe_are_named_at_start() {
    let nf = not_found_server();
    let dead_url = refused_url();
    let router = flat_lb(&[&format!("{nf}/v1"), &dead_url]);
    wait_for_health(&router.url, 503);
    std::thread::sleep(Duration::from_millis(200));
    let (_, err) = router.terminate();
    let warn = err
        .lines()
        .find(|l| l.contains("every backend failed its first health probe"))
        .unwrap_or_else(|| panic!("no warning: {err}"));
    assert!(
        warn.contains(&format!("{nf}/health answered 404")),
        "{warn}"
    );
    assert!(
        warn.contains(&format!("{dead_url}/health")) && warn.contains("refused"),
        "{warn}"
    );
    // The /v1 was dropped, with a note.
    assert!(
        err.contains(&format!("backend {nf}/v1: using {nf} ")),
        "{err}"
    );

    // One of two up: no such warning.
    let emu = Proc::emulator();
    let router = flat_lb(&[&emu.url, &dead_url]);
    wait_for_health(&router.url, 200);
    std::thread::sleep(Duration::from_millis(300));
    let (_, err) = router.terminate();
    assert!(err.contains("destination 1 down"), "{err}");
    assert!(!err.contains("every backend failed"), "{err}");
}

#[test]
fn a_backend_naming_an_endpoint_is_refused_in_one_line() {
    let (st, _, err) = run(&[
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "sticky",
        "--backend",
        "http://127.0.0.1:9/v1/completions",
    ]);
    assert!(!st.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: ")
            && err.contains("backends[0]: `http://127.0.0.1:9/v1/completions` names an endpoint")
            && err.contains("http://HOST:PORT"),
        "{err}"
    );
}

#[test]
fn a_bad_rust_log_is_said_once_and_info_is_used() {
    let (st, _, err) = run(&[
        "route",
        "--policy",
        "nope",
        "--backend",
        "http://127.0.0.1:9",
    ]);
    assert!(!st.success());
    assert!(err.starts_with("error: unknown policy `nope`"), "{err}");
    let o = std::process::Command::new(common::procs::BIN)
        .args([
            "route",
            "--policy",
            "nope",
            "--backend",
            "http://127.0.0.1:9",
        ])
        .args(["--log-format", "json"])
        .env("RUST_LOG", "cacheroute=loud")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert_eq!(lines[0]["level"], "WARN");
    assert!(lines[0]["message"]
        .as_str()
        .unwrap()
        .contains("RUST_LOG=\"cacheroute=loud\" is not a valid filter"));
    assert_eq!(lines[1]["level"], "ERROR");
    assert!(lines[1]["message"]
        .as_str()
        .unwrap()
        .starts_with("unknown policy `nope`"));
}

/// Start `cacheroute ARGS`, read its `listening on` line and send SIGTERM the instant it is
/// read: (exit status, stderr).
fn sigterm_on_listening(args: &[&str]) -> (std::process::ExitStatus, String) {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(common::procs::BIN)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // SAFETY: signalling our own child by its pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    assert!(line.starts_with("listening on "), "{line:?}");
    let status = child.wait().unwrap();
    (status, common::procs::stderr_of(&mut child))
}

#[test]
fn sigterm_the_instant_listening_is_printed_drains_route_and_epp() {
    let e = Proc::emulator();
    let route = [
        "route",
        "--listen",
        "127.0.0.1:0",
        "--policy",
        "flat-lb",
        "--backend",
        &e.url,
    ];
    let mut epp = route;
    epp[0] = "epp";
    // The window the handler was once missing in is short: try it many times.
    for args in [&route[..], &epp[..]] {
        for i in 0..20 {
            let (status, err) = sigterm_on_listening(args);
            assert!(
                status.success() && err.contains("drained; stopped"),
                "{} try {i}: {status}: {err}",
                args[0]
            );
        }
    }
}

#[test]
fn each_front_shows_its_own_default_listen_address_in_help() {
    for (cmd, own, other) in [
        ("route", "127.0.0.1:8080", "127.0.0.1:9002"),
        ("epp", "127.0.0.1:9002", "127.0.0.1:8080"),
    ] {
        let (st, out, err) = run(&[cmd, "--help"]);
        assert!(st.success(), "{err}");
        // The --listen entry: its line and the help lines under it, up to the next flag.
        let at = out.find("--listen <ADDR>").expect("--listen in help");
        let rest = &out[at + 2..];
        let entry = &rest[..rest.find("\n  -").unwrap_or(rest.len())];
        assert!(
            entry.contains(&format!("[default: {own}]")),
            "{cmd} --help: {entry}"
        );
        assert!(!entry.contains(other), "{cmd} --help: {entry}");
    }
}
