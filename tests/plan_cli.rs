//! End-to-end tests of `cacheroute plan`, `cacheroute churn` and `cacheroute rates`: the built
//! binary on real files, good and bad input.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const PAPER_RATES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/paper-rates.csv");

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

fn plan_args<'a>(rates: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "plan",
        "--rates",
        rates,
        "--destinations",
        "30",
        "--q-cap",
        "6",
        "--warm-slots",
        "128",
        "--out",
        out,
    ]
}

/// A failing run: non-zero exit, a one-line error naming `needle`, and no output file.
fn assert_fails(args: &[&str], out: &Path, needle: &str) {
    let o = run(args);
    assert!(!o.status.success(), "{args:?} should fail");
    let err = String::from_utf8_lossy(&o.stderr);
    let first = err.lines().next().unwrap_or("");
    assert!(
        first.starts_with("error:"),
        "first line should be the error: {err}"
    );
    assert!(
        first.contains(needle),
        "error should name `{needle}`: {err}"
    );
    assert!(!out.exists(), "no output may be written on failure");
    let dir = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

#[test]
fn plan_on_the_bundled_paper_rates() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let o = run(&plan_args(PAPER_RATES, out.to_str().unwrap()));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("admitted 3840 keys"), "{stdout}");
    assert!(stdout.contains("max/mean"), "{stdout}");
    assert!(stdout.contains("built in"), "{stdout}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["admitted"], 3840);
    assert_eq!(v["slots_used"], 3840);
    assert_eq!(v["table"].as_object().unwrap().len(), 3840);
    assert_eq!(v["loads"].as_array().unwrap().len(), 30);
    assert!(v["build_ms"].as_f64().unwrap() > 0.0);
    for (_, ds) in v["table"].as_object().unwrap() {
        for d in ds.as_array().unwrap() {
            assert!(d.as_u64().unwrap() < 30);
        }
    }
    // Replanning against itself on unchanged rates moves nothing.
    let out2 = dir.path().join("plan2.json");
    let mut a = plan_args(PAPER_RATES, out2.to_str().unwrap());
    a.extend(["--previous", out.to_str().unwrap()]);
    let o = run(&a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v2: serde_json::Value = serde_json::from_slice(&std::fs::read(&out2).unwrap()).unwrap();
    assert_eq!(v2["churn"].as_f64().unwrap(), 0.0);
    assert_eq!(v2["table"], v["table"]);
}

#[test]
fn plan_repair_and_byte_aware_from_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let rates = dir.path().join("r.csv");
    std::fs::write(
        &rates,
        "key,rate,prefix_tokens\na,10,16000\nb,5,160\nc,4,16000\nd,1,16\n",
    )
    .unwrap();
    let out = dir.path().join("p.json");
    let o = run(&[
        "plan",
        "--rates",
        rates.to_str().unwrap(),
        "--destinations",
        "2",
        "--q-cap",
        "100",
        "--warm-slots",
        "505",
        "--byte-aware",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let keys: Vec<&String> = v["table"].as_object().unwrap().keys().collect();
    assert!(
        keys.contains(&&"a".to_string())
            && keys.contains(&&"b".to_string())
            && !keys.contains(&&"c".to_string())
    );
    let o = run(&[
        "plan",
        "--rates",
        rates.to_str().unwrap(),
        "--destinations",
        "3",
        "--q-cap",
        "100",
        "--warm-slots",
        "5",
        "--down",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    for (_, ds) in v["table"].as_object().unwrap() {
        assert!(!ds.as_array().unwrap().contains(&serde_json::json!(1)));
    }
    assert_eq!(v["loads"][1], 0.0);
}

#[test]
fn bad_rates_files_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let cases = [
        ("missing.csv", "key,rate\na,1\nb\n", "line 3"),
        ("negative.csv", "key,rate\na,1\nb,-2\n", "line 3"),
        ("nan.csv", "key,rate\na,NaN\n", "line 2"),
        ("dup.csv", "key,rate\na,1\nb,2\na,3\n", "duplicate key `a`"),
        ("empty.csv", "", "empty"),
        ("header.csv", "name,qps\na,1\n", "header"),
    ];
    for (name, text, needle) in cases {
        let f = dir.path().join(name);
        std::fs::write(&f, text).unwrap();
        assert_fails(
            &plan_args(f.to_str().unwrap(), out.to_str().unwrap()),
            &out,
            needle,
        );
    }
    assert_fails(
        &plan_args("/nonexistent/rates.csv", out.to_str().unwrap()),
        &out,
        "/nonexistent/rates.csv",
    );
}

#[test]
fn bad_flags_name_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let o = out.to_str().unwrap();
    for (flag, needle) in [
        ("--destinations", "--destinations"),
        ("--q-cap", "--q-cap"),
        ("--warm-slots", "--warm-slots"),
    ] {
        let mut a = plan_args(PAPER_RATES, o);
        let i = a.iter().position(|x| *x == flag).unwrap();
        a[i + 1] = "0";
        assert_fails(&a, &out, needle);
    }
    let mut a = plan_args(PAPER_RATES, o);
    a.extend(["--down", "30"]);
    assert_fails(&a, &out, "--down 30");
    let bad_prev = dir.path().join("prev.json");
    std::fs::write(&bad_prev, "{not json").unwrap();
    let mut a = plan_args(PAPER_RATES, o);
    a.extend(["--previous", bad_prev.to_str().unwrap()]);
    assert_fails(&a, &out, "not valid JSON");
}

#[test]
fn churn_command_prints_fresh_and_churn_aware() {
    let o = run(&["churn", "--keys", "20000", "--warm-slots", "32", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = &v["intervals"][0];
    let fresh = row["fresh"]["churn"].as_f64().unwrap();
    let aware = row["churn_aware"]["churn"].as_f64().unwrap();
    assert!(fresh > 0.5, "a fresh LPT plan moves most keys: {fresh}");
    assert!(aware < 0.10, "churn-aware stays under 10%: {aware}");
    assert!(!row["churn_aware"]["fell_back"].as_bool().unwrap());
}

#[test]
fn rates_command_writes_a_paper_shaped_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.csv");
    let o = run(&[
        "rates",
        "--keys",
        "5000",
        "--whales",
        "3",
        "--whale-share",
        "0.2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let r = cacheroute::workload::rates::read_rates_csv(std::io::BufReader::new(
        std::fs::File::open(&out).unwrap(),
    ))
    .unwrap();
    assert_eq!(r.len(), 5000);
    let total: f64 = r.iter().map(|k| k.rate).sum();
    assert!((total - 150.0).abs() < 1e-3 * 150.0);
    assert!((r[0].rate / total - 0.2 / 3.0).abs() < 1e-3);
}

/// `route --plan-file`/`--initial-plan` on `n` backends that need not exist (a refused plan
/// stops the router before it listens): stderr.
fn route_with_plan(flag: &str, plan: &Path, n: usize) -> String {
    let mut a = vec![
        "route".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--policy".into(),
        "cacheroute".into(),
    ];
    for i in 0..n {
        a.extend(["--backend".into(), format!("http://127.0.0.1:{}", 9 + i)]);
    }
    a.extend([flag.to_string(), plan.display().to_string()]);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let o = run(&a);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{a:?} accepted: {err}");
    assert!(!out.contains("listening on"), "{out}");
    err
}

/// A key maps to one set of distinct destinations below the fleet's size: `[0,0,1,1]` (once
/// accepted by every reader) and an index past the fleet are refused by `plan --previous` and
/// by the router, naming the file and the key.
#[test]
fn a_plan_file_is_checked_key_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let o = out.to_str().unwrap();
    let dup = dir.path().join("dup.json");
    std::fs::write(
        &dup,
        r#"{"destinations": 2, "table": {"k0": [1], "k1": [0, 0, 1, 1]}}"#,
    )
    .unwrap();
    let why = "table entry `k1` lists destination 0 more than once; a key maps to a set of distinct destinations: list each once";
    let mut a = plan_args(PAPER_RATES, o);
    a.extend(["--previous", dup.to_str().unwrap()]);
    assert_fails(&a, &out, &format!("previous plan {}: {why}", dup.display()));
    for flag in ["--plan-file", "--initial-plan"] {
        let err = route_with_plan(flag, &dup, 2);
        assert!(
            err.trim_end()
                .ends_with(&format!("error: plan file {}: {why}", dup.display())),
            "{err}"
        );
    }
    // An index past the fleet: the router's backends, or the file's own `destinations`.
    let past = dir.path().join("past.json");
    std::fs::write(&past, r#"{"table": {"k1": [0, 2]}}"#).unwrap();
    let err = route_with_plan("--plan-file", &past, 2);
    assert!(
        err.contains("table entry `k1` holds `2`, not a destination index below 2"),
        "{err}"
    );
    std::fs::write(&past, r#"{"destinations": 30, "table": {"k1": [0, 30]}}"#).unwrap();
    let mut a = plan_args(PAPER_RATES, o);
    a.extend(["--previous", past.to_str().unwrap()]);
    assert_fails(
        &a,
        &out,
        "table entry `k1` holds `30`, not a destination index below 30",
    );
}

/// A plan file past the key cap (2^20, the real one) is refused before it is held, naming the
/// file and the count (that one at the cap loads is a unit test of `plan::file`, on a small
/// cap). Once, a plan of any size was read whole (10 million keys: 4.7 GB and still loading
/// after a minute).
#[test]
fn a_plan_file_past_the_key_cap_is_refused_naming_the_file_and_the_count() {
    let cap = cacheroute::bounds::MAX_PLAN_KEYS;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let big = dir.path().join("big.json");
    let mut s = String::with_capacity(cap * 14 + 64);
    s.push_str(r#"{"destinations": 30, "table": {"#);
    for i in 0..=cap {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"k{i}\":[{}]", i % 30));
    }
    s.push_str("}}");
    std::fs::write(&big, s).unwrap();
    let mut a = plan_args(PAPER_RATES, out.to_str().unwrap());
    a.extend(["--previous", big.to_str().unwrap()]);
    assert_fails(
        &a,
        &out,
        &format!(
            "previous plan {}: holds {} keys in `table`, more than the {cap} a plan file may hold; a plan lists the admitted keys (at most destinations × warm slots), so this is not one",
            big.display(),
            cap + 1
        ),
    );
}

/// One range for a rate (finite, 0 ≤ rate ≤ 100000 requests/s) and one message, wherever a
/// rates file is read: `plan`, `advise`, `trace import --format rates`; `rates --qps` is held
/// to the same range. `plan` and `trace import` once accepted a rate of 1e308 that `advise`
/// refused.
#[test]
fn a_rate_out_of_range_is_refused_alike_by_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let o = out.to_str().unwrap();
    let max = cacheroute::bounds::MAX_RATE;
    for bad in ["1e308", "100000.5", "inf", "-1"] {
        let f = dir.path().join("rates.csv");
        std::fs::write(&f, format!("key,rate\na,1\nb,{bad}\n")).unwrap();
        let why = format!(
            "{}: line 3: rate: {bad} is outside the allowed range 0 ≤ value ≤ {max} requests/s; fix the row",
            f.display()
        );
        assert_fails(&plan_args(f.to_str().unwrap(), o), &out, &why);
        let imported = dir.path().join("t.jsonl");
        let r = run(&[
            "trace",
            "import",
            "--format",
            "rates",
            f.to_str().unwrap(),
            "--qps",
            "10",
            "--duration",
            "2",
            "-o",
            imported.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success() && err.contains(&why),
            "import {bad}: {err}"
        );
        assert_eq!(err.matches("line 3").count(), 1, "said once: {err}");
        assert!(!imported.exists());
        let r = run(&[
            "advise",
            "--rates",
            f.to_str().unwrap(),
            "--engine",
            "llama-3.1-8b:h100:bf16:tp1",
            "--slo-p99-s",
            "2",
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success() && err.contains(&why),
            "advise {bad}: {err}"
        );
    }
    let f = dir.path().join("max.csv");
    std::fs::write(&f, format!("key,rate\na,{max}\n")).unwrap();
    let r = run(&plan_args(f.to_str().unwrap(), o));
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let r = run(&["rates", "--keys", "5", "--qps", "1e308", "--out", o]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success()
            && err.contains(&format!(
                "--qps: 1e308 is outside the allowed range 0 ≤ value ≤ {max} requests/s"
            )),
        "{err}"
    );
}
