//! `cacheroute advise` end to end with the built binary: the verdict on a whale-heavy workload
//! (affinity and CacheRoute win against Flat-LB) and on a workload with no shared prefixes
//! (nothing to win: tie or lose), the rates input, and every kind of bad input (one clear line,
//! a non-zero exit, never a panic). Small traces and fleets, so each runs in seconds in a debug
//! build.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");

/// Four 8B replicas (whales: sixteen), a 1 s e2e SLO, a five-step ladder.
const ENGINE: &str = "llama-3.1-8b:h100:fp8:tp1";
const LADDER: &str = "0.5,0.71,1,1.41,2";

/// 64 active keys, two whales with 40% of the traffic between them, 6k-token per-key system
/// prompts, short answers: reuse that spreading over 16 replicas loses and a pinned whale that
/// overloads its home unless it is replicated (the paper's ablation, small).
const WHALES: &str = "\
keys: { count: 2000, dist: { kind: lognormal, sigma: 1.648 }, active: 64, whales: { count: 2, share: 0.4 } }
prefix:
  block_size: 64
  system_prompt: { dist: lognormal, median: 6000, sigma: 0.4, min: 512, max: 16000 }
  conversations_per_key: 16
  mean_turns: 3
  user_message: { dist: lognormal, median: 400, sigma: 0.6, min: 16, max: 4096 }
  output: { dist: lognormal, median: 25, sigma: 0.5, min: 1, max: 200 }
  max_context: 24000
";

/// Every one of 2,000 keys active, a 64-token per-key prompt and ~3k tokens of request-unique
/// content, single turns: almost nothing to reuse (the paper's 32B regimes, small).
const LOW_REUSE: &str = "\
keys: { count: 2000, dist: { kind: lognormal, sigma: 1.648 } }
prefix:
  block_size: 64
  system_prompt: { dist: constant, value: 64 }
  conversations_per_key: 64
  mean_turns: 1
  user_message: { dist: lognormal, median: 3000, sigma: 0.5, min: 64, max: 12000 }
  output: { dist: lognormal, median: 25, sigma: 0.5, min: 1, max: 200 }
  max_context: 16384
";

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A generated trace from a generator config.
fn gen(dir: &Path, name: &str, config: &str, qps: &str, duration: &str) -> PathBuf {
    let cfg = dir.join(format!("{name}.yaml"));
    std::fs::write(&cfg, config).unwrap();
    let out = dir.join(format!("{name}.jsonl"));
    let o = run(&[
        "trace",
        "gen",
        "--config",
        cfg.to_str().unwrap(),
        "--qps",
        qps,
        "--duration",
        duration,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    out
}

/// Run advise with `--json` and return the report.
fn advise_json(args: &[&str]) -> serde_json::Value {
    let mut a = vec!["advise", "--json"];
    a.extend_from_slice(args);
    let o = run(&a);
    assert!(
        o.status.success(),
        "{a:?}: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The outcome of `subject` (`affinity` or `cacheroute`) against `against` (`flat-lb` or
/// `best reactive`).
fn outcome(report: &serde_json::Value, subject: &str, against: &str) -> String {
    report["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["subject"].as_str().unwrap().starts_with(subject)
                && c["against"].as_str().unwrap().starts_with(against)
        })
        .unwrap_or_else(|| panic!("no comparison {subject} vs {against}: {report}"))["outcome"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A bad input: exit status `code`, the first stderr line an `error:` naming every `needle`, no
/// panic.
fn refused(args: &[&str], code: i32, needles: &[&str]) -> String {
    let o = run(args);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let first = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("{args:?}: no error line in {err}"));
    for n in needles {
        assert!(first.contains(n), "{args:?}: `{n}` not in `{first}`");
    }
    first.to_string()
}

#[test]
fn whales_make_affinity_and_cacheroute_win_against_flat_lb() {
    let dir = tempfile::tempdir().unwrap();
    let trace = gen(dir.path(), "whales", WHALES, "160", "120");
    let r = advise_json(&[
        "--trace",
        trace.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "16",
        "--slo-p99-s",
        "1.0",
        "--ladder",
        LADDER,
        "--seeds",
        "3",
        "--max-requests",
        "4000",
    ]);
    // Three seeds: Flat-LB's knee differs much between seeds (one fails the first step), and
    // with two the 95% interval of the ratio (t, 1 df) is too wide to call anything.
    assert_eq!(outcome(&r, "affinity", "flat-lb"), "win", "{r}");
    assert_eq!(outcome(&r, "cacheroute", "flat-lb"), "win", "{r}");
    assert_ne!(outcome(&r, "cacheroute", "best reactive"), "lose", "{r}");
    // The diagnostic says why: reuse spreading loses, and whales beyond one replica's share.
    let d = &r["diagnostic"];
    assert!(d["affinity_gap"].as_f64().unwrap() > 0.15, "{d}");
    assert!(d["hottest_key_in_replicas"].as_f64().unwrap() > 1.0, "{d}");
    let facts = r["facts"].as_str().unwrap();
    assert!(
        facts.contains("win back") && facts.contains("hottest key"),
        "{facts}"
    );
    assert_eq!(r["simulated"]["seeds"].as_array().unwrap().len(), 3);
    assert_eq!(r["nothing_passes"], false);
    // Which dispatch CacheRoute ran at the user's load: these steps (4,000 requests, 25 s)
    // end before a control interval with measured traffic closes, so nothing was tuned and the
    // report says so.
    let d = &r["dispatch"];
    assert_eq!(d["shares"][0][0], "plan+chwbl+prefill", "{d}");
    assert!(d["tuning"].is_null(), "{d}");
}

/// Advise's arguments on a LOW_REUSE trace at 20 req/s over four replicas, two seeds.
fn low_reuse_args(dir: &Path) -> Vec<String> {
    let trace = gen(dir, "low", LOW_REUSE, "20", "300");
    [
        "--trace",
        trace.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "4",
        "--slo-p99-s",
        "1.0",
        "--ladder",
        LADDER,
        "--seeds",
        "2",
        "--max-requests",
        "4000",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

#[test]
fn without_shared_prefixes_nothing_wins() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("advice.md");
    let mut args = low_reuse_args(dir.path());
    args.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
    let r = advise_json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for subject in ["affinity", "cacheroute"] {
        for against in ["flat-lb", "best reactive"] {
            let o = outcome(&r, subject, against);
            assert!(o == "tie" || o == "lose", "{subject} vs {against}: {o}");
        }
    }
    assert!(r["diagnostic"]["recoverable_reuse"].as_f64().unwrap() < 0.05);
    // Which dispatch CacheRoute's self-calibration ran at the user's load (the shares of the
    // step's plans) and the replays it chose by.
    let d = &r["dispatch"];
    let shares = d["shares"].as_array().unwrap_or_else(|| panic!("{r}"));
    let total: f64 = shares.iter().map(|s| s[1].as_f64().unwrap()).sum();
    assert!((total - 1.0).abs() < 1e-9, "{d}");
    let why = d["tuning"].as_str().unwrap_or_else(|| panic!("{d}"));
    assert!(why.contains(" dispatch (plan+chwbl+prefill "), "{why}");
    assert!(r["facts"].as_str().unwrap().contains("little reuse"));
    // The markdown report: the verdict, the diagnostic, what was simulated.
    let md = std::fs::read_to_string(&out).unwrap();
    for s in [
        "**Verdict:**",
        "## Reuse diagnostic",
        "cache residence time",
        "## Simulated A/B",
        "## What was simulated",
        "moving-block bootstrap",
        "**CacheRoute's dispatch:** at ",
        "its last tuning: ",
    ] {
        assert!(md.contains(s), "`{s}` not in the report:\n{md}");
    }
}

/// The number in `s` after `prefix` (up to the next space).
fn number_after(s: &str, prefix: &str) -> f64 {
    let rest = &s[s
        .find(prefix)
        .unwrap_or_else(|| panic!("`{prefix}` not in `{s}`"))
        + prefix.len()..];
    let word = rest.split_whitespace().next().unwrap();
    word.parse()
        .unwrap_or_else(|_| panic!("`{word}` after `{prefix}` in `{s}`"))
}

#[test]
fn the_verdict_line_prints_the_refined_knees_and_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["advise".to_string()];
    args.extend(low_reuse_args(dir.path()));
    let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o.stderr));
    let t = text(&o.stdout);
    // Knees were located between ladder steps.
    let probes = number_after(&t, "skipped above a failure, ");
    assert!(
        probes > 0.0 && t.contains("knee probes (knees to 5%)"),
        "{t}"
    );
    // `cacheroute vs flat-lb  TIE 0.83× [0.00, 1.81] (n = 2): cacheroute 19.7 vs flat-lb 23.7
    // req/s`: the outcome, the ratio, the interval it rests on, both knees.
    let line = t
        .lines()
        .find(|l| l.trim_start().starts_with("cacheroute") && l.contains("vs flat-lb"))
        .unwrap_or_else(|| panic!("no verdict line in {t}"));
    let verdict = line.split_once("vs flat-lb").unwrap().1.trim();
    let word = verdict.split_whitespace().next().unwrap();
    assert!(["WIN", "TIE", "LOSE"].contains(&word), "{line}");
    let interval = &verdict[verdict.find('[').expect("an interval")..];
    assert!(
        interval.contains(", ") && interval.contains("(n = 2):"),
        "{line}"
    );
    assert!(line.ends_with(" req/s"), "{line}");
    let knee = number_after(verdict, ": cacheroute ");
    let flat = number_after(verdict, " vs flat-lb ");
    // The same knees as the capacity column of the A/B table (mean over seeds) …
    let row = |p: &str| {
        t.lines()
            .find(|l| l.trim_start().starts_with(p) && l.contains('±'))
            .unwrap_or_else(|| panic!("no row {p} in {t}"))
            .to_string()
    };
    assert_eq!(number_after(&row("cacheroute"), "cacheroute"), knee, "{t}");
    assert_eq!(number_after(&row("flat-lb"), "flat-lb"), flat, "{t}");
    // … and refined: some policy's knee is off the ladder's steps (10, 14.2, 20, 28.2, 40).
    let ladder: Vec<f64> = LADDER
        .split(',')
        .map(|m| m.parse::<f64>().unwrap() * 20.0)
        .collect();
    let off = cacheroute::experiment::advise::POLICIES
        .iter()
        .map(|p| number_after(&row(p), p))
        .filter(|k| ladder.iter().all(|l| (l - k).abs() > 0.06 * l))
        .count();
    assert!(off > 0, "{t}");
}

#[test]
fn rates_input_generates_each_seed_and_gives_a_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("rates.csv");
    // Two whales and 30 small keys: 40 req/s in all.
    let mut s = String::from("key,rate\nwhale-a,10\nwhale-b,10\n");
    for i in 0..30 {
        s.push_str(&format!("k{i},{}\n", 20.0 / 30.0));
    }
    std::fs::write(&csv, s).unwrap();
    let shape = dir.path().join("shape.yaml");
    std::fs::write(&shape, WHALES).unwrap();
    let r = advise_json(&[
        "--rates",
        csv.to_str().unwrap(),
        "--workload",
        shape.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "4",
        "--slo-p99-s",
        "1.0",
        "--ladder",
        LADDER,
        "--seeds",
        "1",
        "--max-requests",
        "2000",
    ]);
    assert!((r["simulated"]["load_qps"].as_f64().unwrap() - 40.0).abs() < 1e-9);
    assert!(r["simulated"]["seed_variation"]
        .as_str()
        .unwrap()
        .contains("generates its own requests"));
    assert_eq!(r["diagnostic"]["keys"], 32);
    assert_eq!(r["comparisons"].as_array().unwrap().len(), 4);
    // --qps sets the load instead of the rates' sum.
    let text_out = run(&[
        "advise",
        "--rates",
        csv.to_str().unwrap(),
        "--workload",
        shape.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "4",
        "--slo-p99-s",
        "1.0",
        "--ladder",
        "1",
        "--seeds",
        "1",
        "--qps",
        "20",
        "--max-requests",
        "2000",
    ]);
    assert!(text_out.status.success(), "{}", text(&text_out.stderr));
    let t = text(&text_out.stdout);
    assert!(t.contains("of 20.000 req/s"), "{t}");
    assert!(t.contains("verdict") && t.contains("why:"), "{t}");
    // Without --seeds, seeds beyond the first only as the request budget allows.
    let r = advise_json(&[
        "--rates",
        csv.to_str().unwrap(),
        "--workload",
        shape.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "4",
        "--slo-p99-s",
        "1.0",
        "--ladder",
        "1",
        "--max-requests",
        "2000",
        "--budget-requests",
        "1000",
    ]);
    assert_eq!(r["simulated"]["seeds"].as_array().unwrap().len(), 1);
    assert!(
        r["simulated"]["cuts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c.as_str().unwrap().contains("1 seed(s) instead of 3")),
        "{}",
        r["simulated"]
    );
}

#[test]
fn an_slo_no_policy_meets_is_a_verdict_with_exit_status_3() {
    let dir = tempfile::tempdir().unwrap();
    let trace = gen(dir.path(), "low", LOW_REUSE, "20", "300");
    let o = run(&[
        "advise",
        "--trace",
        trace.to_str().unwrap(),
        "--engine",
        ENGINE,
        "--destinations",
        "4",
        "--slo-p99-s",
        "0.01",
        "--ladder",
        "0.5,1",
        "--seeds",
        "1",
        "--max-requests",
        "2000",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(
        out.contains("no verdict: no policy meets e2e p99 ≤ 0.01 s"),
        "{out}"
    );
    let err = text(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: no verdict") && err.contains("--slo-p99-s"),
        "{err}"
    );
}

/// A small valid trace with its lines given.
fn write_trace(dir: &Path, name: &str, lines: &[String]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

fn line(t_ms: u64, key: &str, input: u32, output: u32) -> String {
    let blocks: Vec<String> = (0..input.div_ceil(512).min(4))
        .map(|i| i.to_string())
        .collect();
    format!(
        "{{\"timestamp\":{t_ms},\"key\":\"{key}\",\"input_length\":{input},\"output_length\":{output},\"hash_ids\":[{}]}}",
        blocks.join(",")
    )
}

const BASE: &[&str] = &[
    "--engine",
    ENGINE,
    "--destinations",
    "2",
    "--slo-p99-s",
    "2",
];

fn advise_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["advise"];
    a.extend_from_slice(BASE);
    a.extend_from_slice(extra);
    a
}

#[test]
fn bad_traces_are_refused_naming_the_line_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Unreadable.
    let missing = d.join("nope.jsonl");
    refused(
        &advise_args(&["--trace", missing.to_str().unwrap()]),
        1,
        &["--trace", "cannot open", "nope.jsonl"],
    );
    // A malformed line.
    let bad = write_trace(
        d,
        "bad.jsonl",
        &[
            line(0, "a", 100, 10),
            line(10, "a", 100, 10),
            "{\"timestamp\": 20, \"key\": ".into(),
        ],
    );
    refused(
        &advise_args(&["--trace", bad.to_str().unwrap()]),
        1,
        &["line 3", "not valid JSON", "--skip-bad"],
    );
    // A request no replica can hold: 2M prompt tokens against ~1M of KV.
    let big = write_trace(
        d,
        "big.jsonl",
        &[
            line(0, "a", 100, 10),
            line(10, "a", 2_000_000, 10),
            line(20, "a", 100, 10),
        ],
    );
    refused(
        &advise_args(&["--trace", big.to_str().unwrap()]),
        1,
        &[
            "line 2",
            "KV cache",
            "llama-3.1-8b:h100:fp8:tp1",
            "--engine",
        ],
    );
    // Longer than the engine's context.
    let long = write_trace(
        d,
        "long.jsonl",
        &[
            line(0, "a", 100, 10),
            line(10, "a", 100, 10),
            line(20, "a", 5000, 100),
        ],
    );
    refused(
        &advise_args(&["--trace", long.to_str().unwrap(), "--max-model-len", "4096"]),
        1,
        &["line 3", "--max-model-len 4096"],
    );
    // No rate: every request at one instant.
    let flat = write_trace(
        d,
        "flat.jsonl",
        &[
            line(5, "a", 100, 10),
            line(5, "b", 100, 10),
            line(5, "c", 100, 10),
        ],
    );
    refused(
        &advise_args(&["--trace", flat.to_str().unwrap()]),
        1,
        &["different times"],
    );
    // Too short for a p99 at the lowest step.
    let short: Vec<String> = (0..20).map(|i| line(i * 1000, "a", 100, 10)).collect();
    let short = write_trace(d, "short.jsonl", &short);
    refused(
        &advise_args(&["--trace", short.to_str().unwrap()]),
        1,
        &["last only", "longer trace"],
    );
    // An empty file.
    let empty = write_trace(d, "empty.jsonl", &[]);
    refused(
        &advise_args(&["--trace", empty.to_str().unwrap()]),
        1,
        &["no requests"],
    );
}

#[test]
fn bad_rates_and_flags_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let csv = d.join("r.csv");
    std::fs::write(&csv, "key,rate\na,1\nb,x\n").unwrap();
    refused(
        &advise_args(&["--rates", csv.to_str().unwrap()]),
        1,
        &["--rates", "line 3", "rate `x`"],
    );
    let zero = d.join("zero.csv");
    std::fs::write(&zero, "key,rate\na,0\n").unwrap();
    refused(
        &advise_args(&["--rates", zero.to_str().unwrap()]),
        1,
        &["sum to 0"],
    );
    let ok = d.join("ok.csv");
    std::fs::write(&ok, "key,rate\na,1\n").unwrap();
    let r = ok.to_str().unwrap();
    refused(
        &advise_args(&["--rates", r, "--seeds", "0"]),
        1,
        &["--seeds"],
    );
    refused(
        &advise_args(&["--rates", r, "--ladder", "1,0.5"]),
        1,
        &["--ladder", "increase"],
    );
    refused(
        &[
            "advise",
            "--rates",
            r,
            "--destinations",
            "0",
            "--slo-p99-s",
            "1",
        ],
        1,
        &["--destinations"],
    );
    refused(
        &[
            "advise",
            "--rates",
            r,
            "--engine",
            "llama-9b:h100:fp8:tp1",
            "--slo-p99-s",
            "1",
        ],
        1,
        &["--engine", "llama-9b"],
    );
    // Neither input, or both.
    let o = run(&["advise", "--slo-p99-s", "1"]);
    assert_eq!(o.status.code(), Some(2), "clap's usage error");
    assert!(text(&o.stderr).contains("--trace"), "{}", text(&o.stderr));
}
