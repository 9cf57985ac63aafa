//! End-to-end tests of `cacheroute trace gen|import|stats`, running the built binary against
//! the real public traces vendored in `data/traces/` (see its SOURCES.md).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/traces/mooncake_conversation_trace.jsonl"
);
const AZURE_CONV: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/traces/AzureLLMInferenceTrace_conv.csv"
);

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn fail(args: &[&str]) -> String {
    let o = run(args);
    assert!(!o.status.success(), "{args:?} should fail");
    String::from_utf8(o.stderr).unwrap()
}

fn stats_json(args: &[&str]) -> serde_json::Value {
    let mut a = vec!["trace", "stats", "--json"];
    a.extend_from_slice(args);
    serde_json::from_str(&ok(&a)).unwrap()
}

fn p(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}

#[test]
fn mooncake_stats_match_the_file() {
    let s = stats_json(&[MOONCAKE]);
    assert_eq!(s["requests"], 12_031);
    assert_eq!(s["duration_s"].as_f64().unwrap().round(), 3537.0);
    // Keys derived from the first two blocks (SOURCES.md: 7,373 groups, Gini 0.315).
    assert_eq!(s["distinct_keys"], 7_373);
    assert!((s["gini"].as_f64().unwrap() - 0.315).abs() < 0.001);
    assert!((s["interarrival_cv"].as_f64().unwrap() - 3.03).abs() < 0.01);
    assert_eq!(
        s["input_length"]["mean"].as_f64().unwrap().round(),
        12_035.0
    );
    assert_eq!(s["block_size"], 512);
    // Reuse grows with the window; spreading over 30 destinations sees less of it.
    let reuse = s["reuse"].as_array().unwrap();
    let tok: Vec<f64> = reuse
        .iter()
        .map(|r| r["tokens"].as_f64().unwrap())
        .collect();
    assert!(tok.windows(2).all(|w| w[0] <= w[1]), "{tok:?}");
    for r in reuse {
        assert!(r["spread_tokens"].as_f64().unwrap() <= r["tokens"].as_f64().unwrap());
    }
    // The people's table names the same figures.
    let table = ok(&["trace", "stats", MOONCAKE]);
    assert!(table.contains("requests             12031"), "{table}");
    assert!(table.contains("| T (s) |"));
}

#[test]
fn mooncake_import_keeps_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let out = p(dir.path(), "mc.jsonl");
    let msg = ok(&[
        "trace",
        "import",
        "--format",
        "mooncake",
        MOONCAKE,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(msg.contains("imported 12031 requests"), "{msg}");
    let a = stats_json(&[MOONCAKE]);
    let b = stats_json(&[out.to_str().unwrap()]);
    assert_eq!(a, b);
    let first = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .to_string();
    assert!(first.contains("\"key\":\"b0-1\""), "{first}");
}

#[test]
fn azure_import_and_bootstrap_arrivals() {
    let dir = tempfile::tempdir().unwrap();
    let out = p(dir.path(), "az.jsonl");
    ok(&[
        "trace",
        "import",
        "--format",
        "azure",
        AZURE_CONV,
        "-o",
        out.to_str().unwrap(),
    ]);
    let s = stats_json(&[out.to_str().unwrap()]);
    assert_eq!(s["requests"], 19_366);
    let src_cv = s["interarrival_cv"].as_f64().unwrap();
    // Bootstrapped arrivals keep the source's burstiness within 10%.
    let gen = p(dir.path(), "boot.jsonl");
    ok(&[
        "trace",
        "gen",
        "--keys",
        "500",
        "--qps",
        "50",
        "--duration",
        "400",
        "--block-size",
        "512",
        "--arrivals",
        "bootstrap",
        "--arrivals-from",
        AZURE_CONV,
        "-o",
        gen.to_str().unwrap(),
    ]);
    let g = stats_json(&[gen.to_str().unwrap()]);
    let cv = g["interarrival_cv"].as_f64().unwrap();
    assert!(
        (cv / src_cv - 1.0).abs() < 0.10,
        "bootstrap cv {cv} vs source {src_cv}"
    );
    assert!((g["mean_qps"].as_f64().unwrap() / 50.0 - 1.0).abs() < 0.1);
}

#[test]
fn gen_is_deterministic_and_scales() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (p(dir.path(), "a.jsonl"), p(dir.path(), "b.jsonl"));
    let args = |o: &Path, qps: &str| {
        vec![
            "trace".to_string(),
            "gen".into(),
            "--keys".into(),
            "2000".into(),
            "--qps".into(),
            qps.into(),
            "--duration".into(),
            "60".into(),
            "--seed".into(),
            "9".into(),
            "-o".into(),
            o.display().to_string(),
        ]
    };
    let s = |v: Vec<String>| ok(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let msg = s(args(&a, "50"));
    assert!(msg.contains("expected per-key rates"), "{msg}");
    s(args(&b, "50"));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let st = stats_json(&[a.to_str().unwrap()]);
    assert!((st["mean_qps"].as_f64().unwrap() / 50.0 - 1.0).abs() < 0.05);
    assert!((st["interarrival_cv"].as_f64().unwrap() - 1.0).abs() < 0.05);
    assert_eq!(st["block_size"], 16);
    // Multi-turn prefixes are reused in a shared cache.
    assert!(st["reuse"][4]["tokens"].as_f64().unwrap() > 0.3);
}

#[test]
fn yaml_config_and_print_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = p(dir.path(), "w.yaml");
    std::fs::write(&cfg, "keys: { count: 300, dist: { kind: zipf, exponent: 1.0 } }\narrivals: { process: gamma, cv: 1.9 }\n")
        .unwrap();
    let y = ok(&[
        "trace",
        "gen",
        "--config",
        cfg.to_str().unwrap(),
        "-o",
        "unused",
        "--print-config",
    ]);
    assert!(y.contains("exponent: 1.0") && y.contains("cv: 1.9"), "{y}");
    std::fs::write(&cfg, "keys: { cnt: 3 }\n").unwrap();
    let e = fail(&[
        "trace",
        "gen",
        "--config",
        cfg.to_str().unwrap(),
        "-o",
        p(dir.path(), "x").to_str().unwrap(),
    ]);
    assert!(e.contains("unknown field `cnt`"), "{e}");
}

/// The ablation's key settings (4 whales with 40% of traffic, 256 active keys): `trace gen`
/// prints the whales' share of the expected rates, and the written rates and trace agree.
#[test]
fn whale_share_holds_with_an_active_set() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = p(dir.path(), "w.yaml");
    std::fs::write(
        &cfg,
        "keys: { count: 20000, dist: { kind: lognormal, sigma: 1.648 }, active: 256, whales: { count: 4, share: 0.4 } }\n\
         prefix: { block_size: 64, system_prompt: { dist: constant, value: 64 } }\n",
    )
    .unwrap();
    let (trace, rates) = (p(dir.path(), "t.jsonl"), p(dir.path(), "r.csv"));
    let out = ok(&[
        "trace",
        "gen",
        "--config",
        cfg.to_str().unwrap(),
        "--qps",
        "100",
        "--duration",
        "300",
        "-o",
        trace.to_str().unwrap(),
        "--rates-out",
        rates.to_str().unwrap(),
    ]);
    assert!(
        out.contains("whales: 4 keys carry 40.00% of expected traffic (configured 40.00%)"),
        "{out}"
    );
    let text = std::fs::read_to_string(&rates).unwrap();
    let mut whales = 0.0;
    for line in text.lines().skip(1) {
        let (k, r) = line.split_once(',').unwrap();
        if ["k000000", "k000001", "k000002", "k000003"].contains(&k) {
            whales += r.parse::<f64>().unwrap();
        }
    }
    assert!((whales - 40.0).abs() < 1e-3, "whales {whales} req/s of 100");
    let s = stats_json(&[trace.to_str().unwrap()]);
    assert_eq!(s["distinct_keys"], 256);
    let largest = s["largest_key_share"].as_f64().unwrap();
    assert!((largest - 0.1).abs() < 0.01, "largest key {largest}");
}

#[test]
fn bad_input_is_reported_and_nothing_is_half_written() {
    let dir = tempfile::tempdir().unwrap();
    let good = r#"{"timestamp":1,"key":"a","input_length":20,"output_length":1,"hash_ids":[1,2]}"#;
    let write = |name: &str, text: &str| {
        let f = p(dir.path(), name);
        std::fs::write(&f, text).unwrap();
        f.display().to_string()
    };
    let bad = write(
        "bad.jsonl",
        &format!("{good}\n{good}\n{{\"timestamp\": 2, oops\n{good}\n"),
    );
    let e = fail(&["trace", "stats", &bad]);
    assert!(
        e.starts_with("error: ") && e.contains("line 3: not valid JSON"),
        "{e}"
    );
    let s = stats_json(&["--skip-bad", &bad]);
    assert_eq!(s["requests"], 3);
    assert_eq!(s["skipped_lines"], 1);

    let empty = write("empty.jsonl", "");
    assert!(fail(&["trace", "stats", &empty]).contains("no requests"));
    let neg = write(
        "neg.jsonl",
        &good.replace("\"timestamp\":1", "\"timestamp\":-1"),
    );
    assert!(fail(&["trace", "stats", &neg]).contains("line 1: field `timestamp`"));
    let back = write(
        "back.jsonl",
        &format!(
            "{good}\n{}\n",
            good.replace("\"timestamp\":1", "\"timestamp\":0")
        ),
    );
    assert!(fail(&["trace", "stats", &back])
        .contains("line 2: timestamp 0 ms is earlier than 1 ms on line 1"));
    let missing = write(
        "missing.jsonl",
        r#"{"timestamp":1,"key":"a","input_length":20,"hash_ids":[1]}"#,
    );
    assert!(fail(&["trace", "stats", &missing]).contains("missing field `output_length`"));

    // A failing import leaves no output and no temporary behind.
    let out = p(dir.path(), "out").join("t.jsonl");
    let e = fail(&[
        "trace",
        "import",
        "--format",
        "mooncake",
        &bad,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(e.contains("line 3"), "{e}");
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(out.parent().unwrap()).unwrap().count(), 0);
}

#[test]
fn trace_gen_refuses_hostile_numbers_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = p(dir.path(), "t.jsonl");
    let o = out.to_str().unwrap();
    for (args, needle) in [
        (vec!["trace", "gen", "-o", o, "--qps", "1e300"], "--qps"),
        (
            vec!["trace", "gen", "-o", o, "--duration", "1e15"],
            "--duration",
        ),
        (
            vec!["trace", "gen", "-o", o, "--keys", "4000000000"],
            "keys.count",
        ),
    ] {
        let err = fail(&args);
        assert!(
            err.starts_with("error:")
                && err.contains(needle)
                && (err.contains("allowed") || err.contains("at most")),
            "{args:?}: {err}"
        );
        assert!(!out.exists(), "{args:?} wrote {o}");
    }
}

#[test]
fn paths_in_a_generator_config_are_relative_to_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(AZURE_CONV, p(dir.path(), "gaps.csv")).unwrap();
    let cfg = p(dir.path(), "workload.yaml");
    std::fs::write(
        &cfg,
        "keys: { count: 100 }\narrivals: { process: bootstrap, from: gaps.csv }\n",
    )
    .unwrap();
    let out = p(dir.path(), "t.jsonl");
    // The test runs in the crate root, not beside the config.
    let msg = ok(&[
        "trace",
        "gen",
        "--config",
        cfg.to_str().unwrap(),
        "--qps",
        "5",
        "--duration",
        "20",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(msg.contains("wrote "), "{msg}");
}

/// A trace line's size and its block ids against its prompt length are bounded in the one
/// reader every command uses, with one message each: `trace stats`, `trace import`, `advise`
/// and `simulate` refuse alike a line just over the 4 MiB cap (a 55 MB line with 7 M ids
/// against input_length 100 was once read by `trace stats` into 696 MB), a line with more ids
/// than prompt tokens, and `input_length: 1e308` (naming the field, not only the line).
#[test]
fn bad_lines_are_refused_alike_by_every_reader() {
    let dir = tempfile::tempdir().unwrap();
    let good = |ts: u32| {
        format!("{{\"timestamp\":{ts},\"key\":\"a\",\"input_length\":100,\"output_length\":5,\"hash_ids\":[1,2]}}\n")
    };
    let cap = cacheroute::workload::trace::MAX_LINE_BYTES;
    // Line 2: a good request padded with spaces to just over the cap.
    let mut long = String::from(
        "{\"timestamp\":1,\"key\":\"a\",\"input_length\":100,\"output_length\":5,\"hash_ids\":[1]",
    );
    long.push_str(&" ".repeat(cap + 1 - long.len() - 1));
    long.push('}');
    assert_eq!(long.len(), cap + 1);
    let ids: Vec<String> = (0..101).map(|i| i.to_string()).collect();
    let cases = [
        (
            "long.jsonl",
            format!("{}{long}\n{}", good(0), good(2)),
            format!("line 2: longer than the {cap} bytes a trace line may hold ({} bytes); a request's line holds its lengths and at most one hash id per prompt token: fix the line or pass --skip-bad to skip it", cap + 1),
        ),
        (
            "ids.jsonl",
            format!(
                "{}{{\"timestamp\":1,\"key\":\"a\",\"input_length\":100,\"output_length\":5,\"hash_ids\":[{}]}}\n{}",
                good(0),
                ids.join(","),
                good(2)
            ),
            "line 2: field `hash_ids`: 101 block ids for input_length 100: a block holds at least one prompt token, so a request has at most input_length ids (⌈input_length / block tokens⌉); fix the line or pass --skip-bad to skip it".to_string(),
        ),
        (
            "huge-len.jsonl",
            format!(
                "{}{}{}",
                good(0),
                good(1).replace("\"input_length\":100", "\"input_length\":1e308"),
                good(2)
            ),
            "line 2: field `input_length`: 1e308 is not a token count (a whole number in 0..=4294967295); fix the line or pass --skip-bad to skip it".to_string(),
        ),
    ];
    for (name, text, why) in &cases {
        let f = p(dir.path(), name);
        std::fs::write(&f, text).unwrap();
        let f = f.to_str().unwrap();
        let out = p(dir.path(), "out.jsonl");
        let o = out.to_str().unwrap();
        let runs: [&[&str]; 4] = [
            &["trace", "stats", f],
            &["trace", "import", "--format", "mooncake", f, "-o", o],
            &[
                "advise",
                "--trace",
                f,
                "--engine",
                "llama-3.1-8b:h100:fp8:tp1",
                "--slo-p99-s",
                "2",
            ],
            &[
                "simulate",
                "--trace",
                f,
                "--destinations",
                "2",
                "--engine",
                "llama-3.1-8b:h100:fp8:tp1",
                "--policy",
                "sticky",
            ],
        ];
        for args in runs {
            let err = fail(args);
            assert!(err.contains(why.as_str()), "{args:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        assert!(!out.exists(), "nothing half-written");
        // --skip-bad skips and counts the line.
        let s = stats_json(&["--skip-bad", f]);
        assert_eq!(s["skipped_lines"], 1, "{name}");
        assert_eq!(s["requests"], 2, "{name}");
    }
}
