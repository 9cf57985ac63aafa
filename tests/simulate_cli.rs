//! `cacheroute simulate` end to end: determinism of the printed output, failure injection and
//! bad input.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");
const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/traces/mooncake_conversation_trace.jsonl"
);

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run cacheroute")
}

const SMALL: &[&str] = &[
    "simulate",
    "--workload",
    "paper",
    "--qps",
    "20",
    "--duration",
    "60",
    "--warmup",
    "10",
    "--destinations",
    "8",
    "--engine",
    "llama-3.1-8b:h100:fp8:tp1",
    "--block-size",
    "64",
    "--json",
];

#[test]
fn same_seed_same_bytes_and_every_policy_runs() {
    for policy in [
        "flat-lb",
        "sticky",
        "chwbl",
        "dualmap",
        "preble",
        "cacheroute",
        "cacheroute-affinity",
        "cacheroute-replication",
    ] {
        let mut a = SMALL.to_vec();
        a.extend(["--policy", policy]);
        let x = run(&a);
        assert!(
            x.status.success(),
            "{policy}: {}",
            String::from_utf8_lossy(&x.stderr)
        );
        let y = run(&a);
        assert_eq!(
            x.stdout, y.stdout,
            "{policy}: output differs between identical runs"
        );
        let v: serde_json::Value = serde_json::from_slice(&x.stdout).unwrap();
        let s = &v["summary"];
        assert!(s["requests"].as_u64().unwrap() > 500, "{policy}");
        assert_eq!(s["errors"], 0, "{policy}");
        let hit = s["served_kv_hit"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit));
    }
}

#[test]
fn failure_injection_is_reported() {
    let mut a = SMALL.to_vec();
    a.extend(["--policy", "sticky", "--fail", "3@20:40"]);
    let x = run(&a);
    assert!(x.status.success(), "{}", String::from_utf8_lossy(&x.stderr));
    let mut text = SMALL[..SMALL.len() - 1].to_vec();
    text.extend(["--policy", "flat-lb"]);
    let t = run(&text);
    let out = String::from_utf8_lossy(&t.stdout);
    assert!(
        out.contains("served KV hit") && out.contains("p99") && out.contains("imbalance"),
        "{out}"
    );
}

#[test]
fn the_text_names_the_last_plans_q_cap_and_w() {
    let mut json = SMALL.to_vec();
    json.extend(["--policy", "cacheroute"]);
    let v: serde_json::Value = serde_json::from_slice(&run(&json).stdout).unwrap();
    let last = &v["last_plan"];
    let (q, w) = (
        last["q_cap"].as_f64().unwrap(),
        last["warm_slots"].as_u64().unwrap(),
    );
    let mut text = SMALL[..SMALL.len() - 1].to_vec();
    text.extend(["--policy", "cacheroute"]);
    let t = run(&text);
    let out = String::from_utf8_lossy(&t.stdout);
    let line = out.lines().find(|l| l.starts_with("plan: ")).expect(&out);
    assert!(
        line.contains(&format!("q_cap {q:.2}, W {w},")),
        "{line} (last plan: q_cap {q}, W {w})"
    );
}

#[test]
fn a_real_trace_simulates() {
    let x = run(&[
        "simulate",
        "--trace",
        MOONCAKE,
        "--qps",
        "8",
        "--duration",
        "120",
        "--warmup",
        "20",
        "--destinations",
        "4",
        "--engine",
        "llama-3.1-8b:h100:fp8:tp1",
        "--policy",
        "cacheroute",
        "--json",
    ]);
    assert!(x.status.success(), "{}", String::from_utf8_lossy(&x.stderr));
    let v: serde_json::Value = serde_json::from_slice(&x.stdout).unwrap();
    assert!(v["summary"]["requests"].as_u64().unwrap() > 500);
}

#[test]
fn bad_input_is_one_clear_line() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--policy",
                "nope",
            ],
            "unknown policy `nope`",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--destinations",
                "0",
            ],
            "--destinations",
        ),
        (&["simulate", "--workload", "paper", "--qps=-1"], "--qps"),
        // Numbers that would allocate without bound are refused, naming the flag.
        (
            &["simulate", "--workload", "paper", "--qps", "1e300"],
            "--qps",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--duration",
                "1e15",
            ],
            "--qps × --duration",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--destinations",
                "4000000000",
            ],
            "--destinations: 4000000000 is outside the allowed range",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--fail",
                "x",
            ],
            "--fail `x`",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--fail",
                "99@5",
            ],
            "destination 99",
        ),
        (
            &[
                "simulate",
                "--workload",
                "paper",
                "--qps",
                "10",
                "--engine",
                "llama-3.3-70b:a100:fp8:tp2",
            ],
            "unknown device `a100`",
        ),
        (
            &["simulate", "--trace", "/nonexistent.jsonl", "--qps", "10"],
            "/nonexistent.jsonl",
        ),
    ];
    for (args, needle) in cases {
        let o = run(args);
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        let first = err.lines().next().unwrap_or("");
        assert!(
            first.starts_with("error:") && first.contains(needle),
            "{args:?}: {err}"
        );
    }
}

/// The text summary says when the fleet could not keep up and what an injected failure did; a
/// fleet that keeps up gets no such line. The wall-clock rate goes to stderr only, so stdout
/// stays byte-identical for the same inputs.
#[test]
fn overload_and_failures_are_said_in_words() {
    let text: Vec<&str> = SMALL.iter().copied().filter(|a| *a != "--json").collect();
    let light = run(&text);
    assert!(light.status.success());
    let out = String::from_utf8_lossy(&light.stdout);
    assert!(!out.contains("overloaded"), "{out}");
    assert!(!out.contains("failures injected"), "{out}");
    assert!(String::from_utf8_lossy(&light.stderr).contains("requests/s"));
    assert_eq!(
        run(&text).stdout,
        light.stdout,
        "stdout must not hold timings"
    );

    // Two replicas of the 8B engine at 100 req/s of the paper workload cannot keep up.
    let mut heavy = text.clone();
    let i = heavy.iter().position(|a| *a == "8").unwrap();
    heavy[i] = "2";
    let i = heavy.iter().position(|a| *a == "20").unwrap();
    heavy[i] = "100";
    heavy.extend(["--fail", "1@20:30"]);
    let o = run(&heavy);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("overloaded: "), "{out}");
    assert!(out.contains("failures injected (1@20:30): "), "{out}");
}

/// `--policy` takes a spec as a study writes it: its fields reach the policy (the label names
/// them), a flag given overrides the spec's value, and a field out of range or unknown is one
/// line naming it, with a non-zero exit.
#[test]
fn a_policy_spec_on_the_command_line() {
    let with = |policy: &str, extra: &[&str]| {
        let mut a: Vec<&str> = SMALL.to_vec();
        a.extend(["--policy", policy]);
        a.extend(extra);
        run(&a)
    };
    let o = with(
        "{policy: cacheroute, bound_slack: 2, memory_blocks: sparse, warm_slots: 3}",
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["policy"], "cacheroute-slack2-sparse-memory");
    assert_eq!(v["last_plan"]["warm_slots"], 3);
    let o = with(
        "{policy: cacheroute, warm_slots: 3}",
        &["--warm-slots", "5"],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["last_plan"]["warm_slots"], 5,
        "the flag overrides the spec"
    );
    for (bad, names) in [
        ("{policy: cacheroute, bound_slack: -1}", "bound_slack"),
        ("{policy: cacheroute, slack: 1}", "slack"),
        ("{policy: cacheroute, memory_blocks: some}", "memory_blocks"),
        ("{policy: cacheroute", "--policy"),
        ("{policy: chwbl, epsilon: -1}", "epsilon"),
    ] {
        let o = with(bad, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{bad}");
        assert!(
            err.contains(names) && err.contains("--policy"),
            "{bad}: {err}"
        );
    }
    // A flag's value is checked with the spec's.
    let o = with("cacheroute", &["--q-cap=-1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("q_cap"), "{err}");
}

#[test]
fn router_replicas_out_of_range_are_refused_naming_the_flag() {
    for bad in ["0", "65", "-1", "two"] {
        let flag = format!("--router-replicas={bad}");
        let o = run(&["simulate", "--workload", "paper", &flag]);
        assert!(!o.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--router-replicas"), "{bad}: {err}");
    }
}
