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
