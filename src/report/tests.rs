//! Golden-ish tests of the report on synthetic studies.

use std::path::Path;

use super::*;
use crate::analysis::model::{Fairness, RunKey, StepMetrics};

const LADDER: [f64; 4] = [10.0, 20.0, 30.0, 40.0];

/// p99 (e2e) of `policy` on `seed` at offered `q`; the capacities at e2e 3.5 s are
/// flat-lb 20; sticky < first on seed 1, else 10; cacheroute ≥ 40 except seed 3 (30).
fn p99(policy: &str, seed: u64, q: f64) -> f64 {
    let knee = match (policy, seed) {
        ("flat-lb", _) => 20.0,
        ("sticky", 1) => 5.0,
        ("sticky", _) => 10.0,
        ("cacheroute", 3) => 30.0,
        _ => 100.0,
    };
    if q <= knee {
        1.0 + q / 100.0
    } else {
        5.0 + q / 10.0
    }
}

fn hit(policy: &str) -> f64 {
    match policy {
        "flat-lb" => 0.641,
        "sticky" => 0.873,
        _ => 0.932,
    }
}

pub(crate) fn synthetic(name: &str) -> StudyData {
    let policies: Vec<String> = ["flat-lb", "sticky", "cacheroute"]
        .map(String::from)
        .to_vec();
    let mut steps = Vec::new();
    let mut plans = Vec::new();
    for p in &policies {
        for seed in 1..=3u64 {
            let run = RunKey {
                policy: p.clone(),
                seed,
                sweep: String::new(),
            };
            for (i, q) in LADDER.iter().enumerate() {
                let e2e = p99(p, seed, *q);
                steps.push(StepRecord {
                    run: run.clone(),
                    step: i,
                    metrics: StepMetrics {
                        offered_qps: *q,
                        achieved_qps: *q,
                        completed_qps: *q,
                        requests: (*q * 60.0) as u64,
                        errors: 0,
                        ttft_p50_s: e2e / 8.0,
                        ttft_p99_s: e2e / 4.0,
                        e2e_p50_s: e2e / 2.0,
                        e2e_p99_s: e2e,
                        served_kv_hit: hit(p) + 0.001 * seed as f64,
                        imbalance_requests: 1.0 + 0.1 * i as f64,
                        imbalance_prefill_tokens: 1.2 + 0.1 * i as f64,
                        schedule_lag_p99_s: 0.0,
                        preemptions: 0,
                        fairness: Fairness {
                            e2e_p99_by_rate_decile_s: (0..10)
                                .map(|d| {
                                    if d == 0 {
                                        f64::NAN
                                    } else {
                                        e2e * (0.5 + d as f64 / 20.0)
                                    }
                                })
                                .collect(),
                            jain_index: 0.9,
                        },
                        window_s: 60.0,
                        ..Default::default()
                    },
                });
                if p == "cacheroute" {
                    plans.push(PlanEvent {
                        run: run.clone(),
                        step: i,
                        plan: crate::analysis::record::PlanRecord {
                            at_s: 10.0 * i as f64,
                            admitted: 1000,
                            admitted_share: 0.6,
                            imbalance: 1.05,
                            churn: if i == 0 { 1.0 } else { 0.1 },
                            repair: false,
                            build_ms: Some(3.0),
                            q_cap: Some(4.0),
                            warm_slots: Some(64),
                            bounded_sets: None,
                            dispatch: None,
                            replicas: None,
                            tuning: None,
                        },
                    });
                }
            }
        }
    }
    StudyData {
        name: name.into(),
        description: "Synthetic study for report tests.".into(),
        slos: vec![
            Slo {
                metric: SloMetric::E2e,
                p99_s: 3.5,
            },
            Slo {
                metric: SloMetric::Ttft,
                p99_s: 1.0,
            },
        ],
        ladder_qps: LADDER.to_vec(),
        policies,
        baselines: vec!["flat-lb".into(), "sticky".into()],
        reference: Some("cacheroute".into()),
        steps,
        plans,
        notes: vec!["Simulated; not a hardware measurement.".into()],
        prediction_fleet_s: 0.0,
        claims: vec![Claim {
            claim: "CacheRoute at least doubles Flat-LB capacity".into(),
            evidence: "sim, 3 seeds".into(),
            policies: vec!["cacheroute".into(), "flat-lb".into()],
            caveat: "right-censored on two seeds".into(),
        }],
        paper: vec![
            PaperRef {
                policy: "cacheroute".into(),
                served_kv_hit: Some(0.932),
                capacity_qps: Some(176.0),
                slo: Some(Slo {
                    metric: SloMetric::E2e,
                    p99_s: 3.5,
                }),
                source: "Table 2".into(),
            },
            PaperRef {
                policy: "flat-lb".into(),
                served_kv_hit: Some(0.641),
                capacity_qps: Some(20.0),
                slo: None,
                source: "Table 2".into(),
            },
        ],
        generated: None,
    }
}

/// The cells of a markdown table row, trimmed.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn markdown_has_the_key_tables_and_values() {
    let dir = tempfile::tempdir().unwrap();
    let paths = render(&synthetic("flagship"), dir.path()).unwrap();
    assert_eq!(paths.markdown, dir.path().join("flagship.md"));
    let md = read(&paths.markdown);
    assert!(md.starts_with("# Study: flagship\n"));
    assert!(md.contains("## SLO capacity at e2e p99 ≤ 3.5 s"));
    assert!(md.contains("## SLO capacity at ttft p99 ≤ 1 s"));
    // flat-lb: 20 on every seed; ratio vs itself "—".
    let row = |who: &str, after: &str| {
        let start = md.find(after).unwrap();
        md[start..]
            .lines()
            .find(|l| l.starts_with(&format!("| {who} ")))
            .unwrap()
            .to_string()
    };
    let fl = row("flat-lb", "## SLO capacity at e2e");
    assert!(fl.contains("20.0 ± 0.0"), "{fl}");
    assert!(fl.contains("[20.0, 20.0]"), "{fl}");
    assert!(fl.contains("64.3%"), "{fl}"); // 0.641 + 0.002 (seed mean)
                                           // sticky: seed 1 < first (0), seeds 2, 3: 10 → mean 6.7.
    let st = row("sticky", "## SLO capacity at e2e");
    assert!(st.contains("6.7 ± 5.8"), "{st}");
    assert!(st.contains("1/3 < first"), "{st}");
    // cacheroute: 40, 40, 30, the reference; vs flat-lb 2, 2, 1.5 (two right-censored); vs
    // sticky: seed 1 undefined, seeds 2, 3: 4 and 3 (the appendix).
    let cr = row("cacheroute", "## SLO capacity at e2e");
    assert!(cr.contains("36.7 ± 5.8"), "{cr}");
    assert!(cr.contains("2/3 ≥ last"), "{cr}");
    assert_eq!(cells(&cr)[7], "reference", "{cr}");
    let cr = row("cacheroute", "## Appendix");
    assert!(cr.contains("1.83× ["), "{cr}");
    assert!(cr.contains("bound (2 censored)"), "{cr}");
    assert!(cr.contains("3.50× ["), "{cr}");
    assert!(cr.contains("(1 undefined)"), "{cr}");
    // tables are markdown
    assert!(md.contains("|---"));
    // plots linked, stable names
    for f in [
        "capacity-slo1.svg",
        "capacity-slo2.svg",
        "p99-e2e.svg",
        "p99-ttft.svg",
    ] {
        assert!(md.contains(&format!("(flagship/{f})")), "{f}");
    }
    assert!(md.contains("## end-to-end p99 (s) against offered QPS"));
    assert!(md.contains("## Fairness"));
    assert!(md.contains("## Plan churn"));
    let churn = row("cacheroute", "## Plan churn");
    assert!(
        churn.contains("| 12 ") && churn.contains("| 9 ") && churn.contains("10.0%"),
        "{churn}"
    );
    assert!(md.contains("## Against the paper"));
    assert!(row("cacheroute", "## Against the paper").contains("ours lower"));
    assert!(row("flat-lb", "## Against the paper").contains("agrees"));
    assert!(md.contains("## Claim-to-evidence"));
    let claim = md
        .lines()
        .find(|l| l.starts_with("| CacheRoute at least doubles"))
        .unwrap();
    assert!(
        claim.contains("cacheroute: 3 (1, 2, 3) seeds, 4 steps"),
        "{claim}"
    );
    assert!(claim.contains("right-censored on two seeds"));
    assert!(md.contains("Simulated; not a hardware measurement."));
}

#[test]
fn latency_tables_show_each_steps_error_share() {
    // Sticky's step at 30 QPS: 304 of 464 requests failed on every seed, with a p99 that
    // looks fast. The table must say so beside the latency.
    let mut study = synthetic("errors");
    for st in study.steps.iter_mut() {
        if st.run.policy == "sticky" && st.metrics.offered_qps == 30.0 {
            st.metrics.requests = 464;
            st.metrics.errors = 304;
            st.metrics.e2e_p99_s = 0.2;
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let md = read(&render(&study, dir.path()).unwrap().markdown);
    for section in [
        "## end-to-end p99 (s) against offered QPS",
        "## TTFT p99 (s) against offered QPS",
    ] {
        let rest = &md[md.find(section).expect(section)..];
        let mut lines = rest.lines().filter(|l| l.starts_with('|'));
        let header = lines.next().unwrap();
        assert!(
            header.contains("| sticky err% |") && header.contains("| flat-lb err% |"),
            "{header}"
        );
        let cells = |l: &str| -> Vec<String> {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        };
        let names = cells(header);
        let col = names.iter().position(|c| c == "sticky err%").unwrap();
        let row = lines
            .find(|l| l.starts_with("| 30.0 "))
            .expect("the 30 QPS row");
        assert_eq!(cells(row)[col], "65.5%", "{row}");
        let ok_row = rest.lines().find(|l| l.starts_with("| 20.0 ")).unwrap();
        assert_eq!(cells(ok_row)[col], "0.0%", "{ok_row}");
    }
}

#[test]
fn json_summary_has_the_documented_fields() {
    let dir = tempfile::tempdir().unwrap();
    let paths = render(&synthetic("flagship"), dir.path()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&read(&paths.json)).unwrap();
    assert_eq!(v["study"], "flagship");
    assert_eq!(v["slos"][0]["label"], "e2e p99 ≤ 3.5 s");
    let pols = v["policies"].as_array().unwrap();
    assert_eq!(pols.len(), 3);
    let cr = &pols[2];
    assert_eq!(cr["policy"], "cacheroute");
    let cap = &cr["capacity_qps"][0];
    assert!((cap["mean"].as_f64().unwrap() - 110.0 / 3.0).abs() < 1e-9);
    assert!(cap["sd"].as_f64().unwrap() > 0.0);
    assert_eq!(cap["ci95"].as_array().unwrap().len(), 2);
    assert_eq!(cap["censored"], "right");
    assert_eq!(cap["right_censored_seeds"], 2);
    assert!((cr["served_kv_hit"]["mean"].as_f64().unwrap() - 0.934).abs() < 1e-9);
    assert!(cr["served_kv_hit"]["sd"].is_number());
    let p99 = cr["p99_s"].as_array().unwrap();
    assert_eq!(p99.len(), 4);
    assert_eq!(p99[0]["offered_qps"], 10.0);
    assert!(p99[0]["e2e"].is_number());
    assert!(cr["imbalance"]["requests"]["mean"].is_number());
    let ratios = cr["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 4); // 2 baselines × 2 SLOs
    let vs_sticky = ratios
        .iter()
        .find(|r| r["baseline"] == "sticky" && r["slo_label"] == "e2e p99 ≤ 3.5 s")
        .unwrap();
    assert_eq!(vs_sticky["undefined"], 1);
    assert_eq!(vs_sticky["stats"]["mean"], 3.5);
    assert!(vs_sticky["per_seed"][0]["ratio"].is_null());
    // sticky's left-censored seed
    assert_eq!(
        pols[1]["capacity_qps"][0]["per_seed"][0]["censored"],
        "left"
    );
    // NaN decile → null
    assert!(cr["steps"][0]["fairness_e2e_p99_by_decile_s"][0].is_null());
    assert!(cr["churn"]["replan_churn_mean"].is_number());
    assert!(pols[0]["churn"].is_null());
    assert!(v["rules"]["ratio"].as_str().unwrap().contains("undefined"));
}

#[test]
fn svgs_exist_and_are_well_formed() {
    let dir = tempfile::tempdir().unwrap();
    let paths = render(&synthetic("flagship"), dir.path()).unwrap();
    let names: Vec<String> = paths
        .svgs
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "capacity-slo1.svg",
            "capacity-slo2.svg",
            "p99-e2e.svg",
            "p99-ttft.svg",
            "served-hit.svg",
            "imbalance.svg"
        ]
    );
    for p in &paths.svgs {
        assert!(p.starts_with(dir.path().join("flagship")));
        let s = read(p);
        assert!(s.trim_start().starts_with("<svg"), "{p:?}");
        assert!(s.trim_end().ends_with("</svg>"), "{p:?}");
        assert_eq!(s.matches("<svg").count(), 1);
    }
    assert!(read(&paths.svgs[0]).contains("cacheroute"));
    // no temporary files left behind
    for e in std::fs::read_dir(dir.path().join("flagship")).unwrap() {
        let n = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!n.contains(".tmp"), "{n}");
    }
}

#[test]
fn rendering_is_deterministic() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let study = synthetic("flagship");
    let pa = render(&study, a.path()).unwrap();
    let pb = render(&study, b.path()).unwrap();
    for (x, y) in [(pa.markdown, pb.markdown), (pa.json, pb.json)]
        .into_iter()
        .chain(pa.svgs.into_iter().zip(pb.svgs))
    {
        assert_eq!(
            std::fs::read(&x).unwrap(),
            std::fs::read(&y).unwrap(),
            "{x:?}"
        );
    }
    // rendering again over the same directory replaces the files with identical bytes
    let md = std::fs::read(a.path().join("flagship.md")).unwrap();
    render(&study, a.path()).unwrap();
    assert_eq!(md, std::fs::read(a.path().join("flagship.md")).unwrap());
}

#[test]
fn bad_names_and_missing_slos_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = synthetic("../x");
    assert!(matches!(
        render(&s, dir.path()),
        Err(ReportError::BadName(_))
    ));
    s.name = "ok".into();
    s.slos.clear();
    assert!(matches!(render(&s, dir.path()), Err(ReportError::NoSlo(_))));
}

#[test]
fn generated_claims_when_none_are_given_and_no_churn_without_plans() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = synthetic("auto");
    s.claims.clear();
    s.plans.clear();
    s.paper.clear();
    s.generated = Some("sim backend, commit abc123".into());
    let md = read(&render(&s, dir.path()).unwrap().markdown);
    assert!(md.contains("_sim backend, commit abc123_"));
    // One row per non-baseline policy, against the strongest baseline only.
    let rows: Vec<&str> = md
        .lines()
        .filter(|l| l.starts_with("| ") && l.contains(" SLO capacity at e2e"))
        .collect();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(
        rows[0].starts_with("| cacheroute / flat-lb SLO capacity at e2e p99 ≤ 3.5 s: 1.83×"),
        "{rows:?}"
    );
    assert!(!md.contains("| sticky / flat-lb SLO capacity"));
    assert!(!md.contains("## Plan churn"));
    assert!(!md.contains("## Against the paper"));
}

#[test]
fn compare_sets_two_studies_side_by_side() {
    let fp8 = synthetic("fp8");
    let mut fp16 = synthetic("fp16");
    // fp16: every step fails the e2e SLO, hit lower.
    for s in &mut fp16.steps {
        s.metrics.e2e_p99_s = 60.0;
        s.metrics.served_kv_hit *= 0.5;
    }
    let md = compare(&fp8, &fp16);
    assert!(md.starts_with("# Compare: fp8 (A) and fp16 (B)"));
    assert!(md.contains("## SLO capacity at e2e p99 ≤ 3.5 s"));
    let row = md.lines().find(|l| l.starts_with("| cacheroute ")).unwrap();
    assert!(row.contains("< 10 (all seeds)"), "{row}");
    assert!(row.contains("| 0.00× |"), "{row}");
    // A's own capacity 0 → undefined: compare the other way round.
    let back = compare(&fp16, &fp8);
    let row = back.lines().find(|l| l.starts_with("| flat-lb ")).unwrap();
    assert!(row.contains("undefined"), "{row}");
    assert!(md.contains("## Served KV hit"));
    let hit = md
        .split("## Served KV hit")
        .nth(1)
        .unwrap()
        .lines()
        .find(|l| l.starts_with("| cacheroute "))
        .unwrap();
    assert!(hit.contains("0.50×"), "{hit}");
}

#[test]
fn intervals_state_n_and_are_cut_at_zero_where_they_say_little() {
    use crate::analysis::capacity::seed_stats;
    // Two spread seeds: the t interval reaches far below 0; a capacity cannot.
    let s = seed_stats(&[16.0, 264.0]).at_least(0.0);
    assert!(s.clipped && s.ci95[0] == 0.0 && s.ci95[1] > 264.0);
    let cell = markdown::ci_cell(s.ci95, s.clipped, s.n, 1);
    assert!(
        cell.contains("n = 2") && cell.contains("uninformative"),
        "{cell}"
    );
    // Tight seeds keep their interval, with n beside it.
    let t = seed_stats(&[100.0, 101.0, 99.0]).at_least(0.0);
    assert!(!t.clipped);
    assert_eq!(
        markdown::ci_cell(t.ci95, t.clipped, t.n, 1),
        "[97.5, 102.5] (n = 3)"
    );
    assert_eq!(markdown::ci_cell([5.0, 5.0], false, 1, 1), "— (n = 1)");
}

#[test]
fn the_terminal_prints_censored_capacities_as_bounds_like_the_report() {
    let data = synthetic("t");
    let out = crate::report::terminal_summary(&data);
    let report = markdown::study_markdown(&data, &analyse(&data));
    // sticky seed 1 fails the first step: the sticky row is a mean with a censoring note;
    // flat-lb passes up to 20 on every seed; cacheroute ≥ 40 on two of three seeds.
    let line = |p: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(p))
            .unwrap()
            .to_string()
    };
    assert!(line("flat-lb").contains("20.0 ± 0.0"), "{out}");
    assert!(line("cacheroute").contains("2/3 ≥ last"), "{out}");
    assert!(line("sticky").contains("1/3 < first"), "{out}");
    assert!(report.contains("2/3 ≥ last"));
    // A study where every seed passes every step prints a bound, never a bare number.
    let mut all = synthetic("all");
    all.steps
        .retain(|s| s.run.policy == "cacheroute" && s.run.seed != 3);
    let out = crate::report::terminal_summary(&all);
    assert!(out.contains("≥ 40.0 (all seeds)"), "{out}");
    assert!(!out.contains("40.0 ± 0.0"), "{out}");
}

/// A study whose CacheRoute plans were tuned gets a "Self-calibration" section with the chosen
/// values, the reversal count (an oscillating W counts) and the tuner's reasons; a study
/// without tuned plans has none.
#[test]
fn tuned_plans_are_reported_with_their_reasons_and_reversals() {
    let dir = tempfile::tempdir().unwrap();
    let plain = read(&render(&synthetic("plain"), dir.path()).unwrap().markdown);
    assert!(!plain.contains("## Self-calibration"));
    assert!(!dir
        .path()
        .join("plain")
        .join("self-calibration.svg")
        .exists());
    let mut s = synthetic("tuned");
    // The listing shows the first run's middle step: tune that one.
    let mut first = s.plans[0].clone();
    let mut steps: Vec<usize> = s
        .plans
        .iter()
        .filter(|p| p.run == first.run)
        .map(|p| p.step)
        .collect();
    steps.dedup();
    first.step = steps[steps.len() / 2];
    s.plans
        .retain(|p| p.run != first.run || p.step != first.step);
    // One step of one run: W 64 → 32 → 64 (one reversal), each tuned.
    for (i, w) in [64u64, 32, 64].into_iter().enumerate() {
        s.plans.push(PlanEvent {
            plan: crate::analysis::record::PlanRecord {
                at_s: 30.0 * (i + 1) as f64,
                warm_slots: Some(w),
                bounded_sets: None,
                tuning: Some(format!("moved to q_cap 4, W {w}: because")),
                ..first.plan.clone()
            },
            ..first.clone()
        });
    }
    s.plans.sort_by(|a, b| {
        (a.run.seed, a.step)
            .cmp(&(b.run.seed, b.step))
            .then(a.plan.at_s.total_cmp(&b.plan.at_s))
    });
    let md = read(&render(&s, dir.path()).unwrap().markdown);
    assert!(md.contains("## Self-calibration"), "{md}");
    let row = md
        .lines()
        .find(|l| l.starts_with("| cacheroute ") && l.contains(" of "))
        .unwrap();
    assert!(row.contains("32 – 64"), "{row}");
    let reversals = row
        .trim_end()
        .trim_end_matches('|')
        .rsplit('|')
        .next()
        .unwrap()
        .trim();
    assert_eq!(reversals, "1", "{row}");
    assert!(md.contains("moved to q_cap 4, W 32: because"));
    // The values per interval are also drawn: the plot is linked and holds the three points
    // of W (at 30, 60 and 90 s) as markers.
    assert!(md.contains("![q_cap and W chosen per interval](tuned/self-calibration.svg)"));
    let svg = read(&dir.path().join("tuned").join("self-calibration.svg"));
    assert!(svg.contains("W (warm slots per destination), chosen per interval"));
    assert!(
        svg.matches("<circle").count() >= 6,
        "three W and three q_cap markers"
    );
}

/// The headline says, per SLO, who has the highest capacity, the next one and how many paired
/// seeds agree; the glossary has a line per policy; the capacity plot draws censored seeds as
/// bounds (▲ for "≥ last") and has no empty category.
#[test]
fn the_headline_names_the_winner_and_how_sure() {
    let dir = tempfile::tempdir().unwrap();
    let s = synthetic("head");
    let paths = render(&s, dir.path()).unwrap();
    let md = read(&paths.markdown);
    let head = md.split("## Headline").nth(1).unwrap();
    let head = head.split("## ").next().unwrap();
    let first = head
        .lines()
        .find(|l| l.starts_with("- At e2e p99 ≤ 3.5 s"))
        .unwrap();
    assert!(
        first.contains("**cacheroute** has the highest SLO capacity"),
        "{first}"
    );
    assert!(first.contains("next is "), "{first}");
    assert!(first.contains("paired seeds"), "{first}");
    assert!(head.contains("- `flat-lb`: load balancing"), "{head}");
    assert!(head.contains("- `cacheroute`: planned homes"), "{head}");
    let svg = read(&dir.path().join("head").join("capacity-slo1.svg"));
    let labels: Vec<&str> = svg
        .split("<text")
        .skip(1)
        .filter_map(|t| t.split('>').nth(1))
        .map(|t| t.split('<').next().unwrap_or("").trim())
        .collect();
    assert!(!labels.contains(&""), "an empty category label: {labels:?}");
    assert!(
        svg.contains("<polygon"),
        "right-censored seeds are drawn as ▲"
    );
}

/// The capacity table a reader meets first has one ratio column, to the study's reference
/// policy (the paired ratios of the analysis, reference on the left); the ratios against every
/// baseline come after the method, as an appendix; a reference no arm runs gives no column.
#[test]
fn the_capacity_table_leads_with_the_reference_and_the_pairwise_ratios_are_an_appendix() {
    use crate::analysis::study::{arm_ratio, paired_arm};
    let data = synthetic("lead");
    let s = analyse(&data);
    let md = markdown::study_markdown(&data, &s);
    let section = |md: &str, from: &str, to: &str| -> String {
        let a = md.find(from).unwrap();
        let b = a + md[a..].find(to).unwrap();
        md[a..b].to_string()
    };
    let lead = section(&md, "## SLO capacity at e2e", "![");
    let header = cells(lead.lines().find(|l| l.starts_with("| policy")).unwrap());
    assert_eq!(header.len(), 8, "{header:?}");
    assert_eq!(header[7], "× cacheroute");
    assert!(
        !lead.contains("× flat-lb") && !lead.contains("× sticky"),
        "{lead}"
    );
    assert!(md.contains("- Reference: cacheroute"), "{md}");
    // flat-lb over cacheroute: 20/40, 20/40, 20/30 (two from a censored capacity).
    let fl = cells(lead.lines().find(|l| l.starts_with("| flat-lb ")).unwrap());
    assert!(
        fl[7].starts_with("0.56× [") && fl[7].contains("bound (2 censored)"),
        "{fl:?}"
    );
    let (flat, cr) = (&s.arms[0], &s.arms[2]);
    assert!(std::ptr::eq(paired_arm(&s, "cacheroute", "").unwrap(), cr));
    let r = arm_ratio(flat, cr, 0);
    assert_eq!(r.per_seed.len(), 3);
    assert!((r.stats.mean - (0.5 + 0.5 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
    // The same rules as the stored baseline ratios: cacheroute over flat-lb computed here is
    // the summary's.
    let stored = cr.ratios.iter().find(|b| b.baseline == "flat-lb").unwrap();
    assert_eq!(arm_ratio(cr, flat, 0), stored.ratio);
    // The appendix: after the method, one table per SLO, a column per baseline.
    let (method, appendix) = (
        md.find("## Method").unwrap(),
        md.find("## Appendix: capacity ratios against each baseline")
            .unwrap(),
    );
    assert!(method < appendix);
    let headers: Vec<Vec<String>> = md[appendix..]
        .lines()
        .filter(|l| l.starts_with("| policy"))
        .map(cells)
        .collect();
    assert_eq!(headers, vec![vec!["policy", "× flat-lb", "× sticky"]; 2]);
    assert!(md[appendix..].contains("### At ttft p99 ≤ 1 s"));

    // Another reference: its row says so, the others are over it.
    let mut other = synthetic("other");
    other.reference = Some("sticky".into());
    let md = markdown::study_markdown(&other, &analyse(&other));
    let lead = section(&md, "## SLO capacity at e2e", "![");
    let header = cells(lead.lines().find(|l| l.starts_with("| policy")).unwrap());
    assert_eq!(header[7], "× sticky");
    let st = cells(lead.lines().find(|l| l.starts_with("| sticky ")).unwrap());
    assert_eq!(st[7], "reference");
    let cr = cells(
        lead.lines()
            .find(|l| l.starts_with("| cacheroute "))
            .unwrap(),
    );
    assert!(
        cr[7].starts_with("3.50× [") && cr[7].contains("(1 undefined)"),
        "{cr:?}"
    );
    // None: the first policy. A reference no arm runs: no column, no line.
    other.reference = None;
    let md = markdown::study_markdown(&other, &analyse(&other));
    let lead = section(&md, "## SLO capacity at e2e", "![");
    let header = cells(lead.lines().find(|l| l.starts_with("| policy")).unwrap());
    assert_eq!(header[7], "× flat-lb");
    assert!(md.contains("- Reference: flat-lb"));
    other.reference = Some("nginx".into());
    let md = markdown::study_markdown(&other, &analyse(&other));
    let lead = section(&md, "## SLO capacity at e2e", "![");
    let header = cells(lead.lines().find(|l| l.starts_with("| policy")).unwrap());
    assert_eq!(header.len(), 7, "{header:?}");
    assert!(!md.contains("- Reference:"));
}

/// Every policy with a censored seed gets a bound mark in the capacity plot, with how many
/// seeds it holds for (↑ passed every step, ↓ failed the first), and the legend says what the
/// marks mean; a plot without censoring has neither.
#[test]
fn the_capacity_plot_marks_censored_seeds_as_bounds_for_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let svg = |data: &StudyData| read(&render(data, dir.path()).unwrap().svgs[0]);
    let marks = |svg: &str| -> Vec<String> {
        let mut v: Vec<String> = svg
            .split(['>', '<'])
            .map(str::trim)
            .filter(|t| t.starts_with("↑ ") || t.starts_with("↓ "))
            .map(String::from)
            .collect();
        v.sort();
        v
    };
    // cacheroute ≥ last on 2 of 3 seeds, sticky < first on 1 of 3, flat-lb uncensored.
    let base = svg(&synthetic("marks"));
    assert_eq!(marks(&base), ["↑ 2/3", "↓ 1/3"], "{base}");
    assert!(base.contains("a lower bound") && base.contains("an upper bound"));
    // flat-lb passing every step too: a mark for it as well.
    let mut both = synthetic("both");
    for st in both.steps.iter_mut().filter(|s| s.run.policy == "flat-lb") {
        st.metrics.e2e_p99_s = 1.0;
    }
    assert_eq!(marks(&svg(&both)), ["↑ 2/3", "↑ 3/3", "↓ 1/3"]);
    // No censored seed: no mark, no legend.
    let mut none = synthetic("none");
    none.steps.retain(|s| s.run.policy == "flat-lb");
    let plain = svg(&none);
    assert!(
        marks(&plain).is_empty() && !plain.contains("lower bound"),
        "{plain}"
    );
}

/// A swept arm's ratio is to the reference's arm of the same sweep point (as the baseline
/// ratios pair them), and the reference's swept arm is itself a reference row.
#[test]
fn swept_arms_are_compared_with_the_reference_of_their_sweep_point() {
    let mut data = synthetic("swept");
    // A sweep point `w=1` of flat-lb and cacheroute, where cacheroute fails even the first step.
    let swept: Vec<StepRecord> = data
        .steps
        .iter()
        .filter(|s| s.run.policy != "sticky")
        .cloned()
        .map(|mut s| {
            s.run.sweep = "w=1".into();
            if s.run.policy == "cacheroute" {
                s.metrics.e2e_p99_s = 60.0;
            }
            s
        })
        .collect();
    data.steps.extend(swept);
    let md = markdown::study_markdown(&data, &analyse(&data));
    let lead = &md[md.find("## SLO capacity at e2e").unwrap()..];
    let lead = &lead[..lead.find("![").unwrap()];
    let ratio = |who: &str| cells(lead.lines().find(|l| l.starts_with(who)).unwrap())[7].clone();
    assert!(ratio("| flat-lb ").starts_with("0.56× ["), "{lead}");
    assert_eq!(
        ratio("| flat-lb [w=1] "),
        "undefined (3/3 seeds: baseline < first)",
        "{lead}"
    );
    assert!(ratio("| sticky ").starts_with("0.19× ["), "{lead}");
    assert_eq!(ratio("| cacheroute [w=1] "), "reference", "{lead}");
    assert_eq!(ratio("| cacheroute "), "reference", "{lead}");
}
