//! Markdown of a study report and of a two-study comparison (tables as GitHub markdown, columns
//! padded to their widest cell). Formatting only; the numbers come from `analysis::study`.

use std::fmt::Write;

use super::{plot_files, plot_metrics, tuning_traces, StudyData, RULES, TUNING_PLOT};
use crate::analysis::model::{SeedStats, Slo, SloMetric};
use crate::analysis::study::{
    arm_ratio, paired_arm, ArmSummary, CapacityStats, StepAgg, StudySummary,
};

/// Hit agreement with a paper number: within this many percentage points.
pub const HIT_AGREE_PP: f64 = 3.0;

/// A GitHub markdown table (tabled's markdown style): columns padded to their widest cell, `|`
/// inside a cell escaped, short rows filled with empty cells.
pub(crate) fn table(header: Vec<String>, rows: Vec<Vec<String>>) -> String {
    let mut builder = tabled::builder::Builder::default();
    builder.push_record(header);
    for row in rows {
        builder.push_record(row.into_iter().map(|c| c.replace('|', "\\|")));
    }
    let mut table = builder.build();
    table.with(tabled::settings::Style::markdown());
    table.to_string()
}

pub(crate) fn num(x: f64, d: usize) -> String {
    if x.is_finite() {
        format!("{x:.d$}")
    } else {
        "—".into()
    }
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", x * 100.0)
    } else {
        "—".into()
    }
}

fn mean_sd(s: &SeedStats, d: usize) -> String {
    if !s.mean.is_finite() {
        return "—".into();
    }
    format!("{} ± {}", num(s.mean, d), num(s.sd, d))
}

/// A capacity as the reports and the terminal print it: censoring shown as a bound
/// (`≥ 200.0 (all seeds)`, `< 40 (all seeds)`), otherwise mean ± sd.
pub(crate) fn capacity_cell(c: &CapacityStats, ladder: &[f64]) -> String {
    let first = ladder.first().copied().unwrap_or(f64::NAN);
    if c.n > 0 && c.left_censored_seeds == c.n {
        return format!("< {} (all seeds)", num(first, 0));
    }
    if c.n > 0 && c.right_censored_seeds == c.n {
        return format!("≥ {} (all seeds)", num(c.mean, 1));
    }
    format!("{} ± {}", num(c.mean, 1), num(c.sd, 1))
}

pub(crate) fn censor_cell(c: &CapacityStats) -> String {
    let mut parts = Vec::new();
    if c.left_censored_seeds > 0 {
        parts.push(format!("{}/{} < first", c.left_censored_seeds, c.n));
    }
    if c.right_censored_seeds > 0 {
        parts.push(format!("{}/{} ≥ last", c.right_censored_seeds, c.n));
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// A 95% interval with its n: `[a, b] (n = 5)`; with one seed there is none; an interval cut
/// at its physical bound says so and that it is uninformative at that n.
pub(crate) fn ci_cell(ci: [f64; 2], clipped: bool, n: usize, d: usize) -> String {
    if n == 1 {
        return "— (n = 1)".into();
    }
    if !(ci[0].is_finite() && ci[1].is_finite()) {
        return "—".into();
    }
    let mut s = format!("[{}, {}] (n = {n}", num(ci[0], d), num(ci[1], d));
    if clipped {
        s.push_str(", cut at 0: uninformative");
    }
    s.push(')');
    s
}

fn ratio_cell(a: &ArmSummary, baseline: &str, slo_label: &str) -> String {
    let Some(r) = a
        .ratios
        .iter()
        .find(|r| r.baseline == baseline && r.slo_label == slo_label)
    else {
        return "—".into();
    };
    ratio_stats_cell(&r.ratio)
}

/// Paired capacity ratios as the report writes them: `1.50× [1.20, 1.80] (n = 3)`, a bound when
/// censored, undefined seeds counted.
pub(crate) fn ratio_stats_cell(r: &crate::analysis::RatioStats) -> String {
    if r.stats.n == 0 {
        return if r.paired_seeds == 0 {
            "no paired seeds".into()
        } else {
            format!(
                "undefined ({}/{} seeds: baseline < first)",
                r.undefined, r.paired_seeds
            )
        };
    }
    let mut s = format!(
        "{}× {}",
        num(r.stats.mean, 2),
        ci_cell(r.stats.ci95, r.stats.clipped, r.stats.n, 2)
    );
    if r.censored > 0 {
        let _ = write!(s, " bound ({} censored)", r.censored);
    }
    if r.undefined > 0 {
        let _ = write!(s, " ({} undefined)", r.undefined);
    }
    s
}

fn seeds_cell(seeds: &[u64]) -> String {
    let list: Vec<String> = seeds.iter().map(|s| s.to_string()).collect();
    format!("{} ({})", seeds.len(), list.join(", "))
}

/// The step an arm's fairness is shown at: the highest offered rate not above its mean
/// capacity at the first SLO (its first step when it has no passing step).
fn fairness_step(a: &ArmSummary) -> Option<&StepAgg> {
    let cap = a.capacity_qps.first().map(|c| c.mean).unwrap_or(f64::NAN);
    a.steps
        .iter()
        .rev()
        .find(|st| st.offered_qps <= cap)
        .or(a.steps.first())
}

fn by_q(a: &ArmSummary, q: f64) -> Option<&StepAgg> {
    a.steps.iter().find(|st| st.offered_qps == q)
}

fn slo_matches(a: &Slo, b: &Slo) -> bool {
    a.metric == b.metric && (a.p99_s - b.p99_s).abs() < 1e-9
}

/// The markdown report of a study: one function per section, in the order a reader meets them.
pub(crate) fn study_markdown(study: &StudyData, s: &StudySummary) -> String {
    let mut md = String::new();
    let w = &mut md;
    header(w, study, s);
    headline(w, study, s);
    glossary(w, s);
    capacity_tables(w, study, s);
    latency_tables(w, study, s);
    served_hit(w, study, s);
    imbalance(w, study, s);
    fairness(w, s);
    churn(w, s);
    self_calibration(w, study);
    against_the_paper(w, study, s);
    claims(w, study, s);
    notes(w, study);
    cost(w, study);
    method(w);
    ratio_appendix(w, study, s);
    md
}

/// The link to plot `file` (when the study has one by that name), as its own paragraph.
fn plot_link(w: &mut String, study: &StudyData, file: &str) {
    if let Some((file, what)) = plot_files(&study.slos).iter().find(|(n, _)| n == file) {
        let _ = writeln!(w, "![{what}]({}/{file})\n", study.name);
    }
}

/// Title, description, provenance and what the study compared.
fn header(w: &mut String, study: &StudyData, s: &StudySummary) {
    let _ = writeln!(w, "# Study: {}\n", study.name);
    if !study.description.is_empty() {
        let _ = writeln!(w, "{}\n", study.description.trim());
    }
    if let Some(g) = &study.generated {
        let _ = writeln!(w, "_{}_\n", g.trim());
    }
    let ladder: Vec<String> = study.ladder_qps.iter().map(|q| num(*q, 1)).collect();
    let slos: Vec<String> = study.slos.iter().map(|x| x.label()).collect();
    let arms: Vec<&str> = s.arms.iter().map(|a| a.label.as_str()).collect();
    let _ = writeln!(w, "- Policies: {}", arms.join(", "));
    if let Some(r) = reference(study, s) {
        let _ = writeln!(
            w,
            "- Reference: {r} (the capacity tables give each policy's ratio to it)"
        );
    }
    let _ = writeln!(w, "- Baselines: {}", study.baselines.join(", "));
    let _ = writeln!(w, "- Ladder (offered QPS): {}", ladder.join(", "));
    let _ = writeln!(w, "- SLOs: {}", slos.join("; "));
    let _ = writeln!(
        w,
        "- Seeds: the same seed drives the same trace for every policy (paired); intervals are \
         95% Student-t over seeds.\n"
    );
}

/// The study's reference policy when some arm runs it: `StudyData::reference`, else the first
/// policy.
fn reference<'a>(study: &'a StudyData, s: &StudySummary) -> Option<&'a str> {
    let r = study.reference.as_ref().or(study.policies.first())?;
    s.arms.iter().any(|a| a.policy == *r).then_some(r.as_str())
}

/// Per SLO the table a reader looks at first: each policy's capacity, its interval and
/// censoring, served hit, imbalance at capacity and its ratio to the reference policy; then the
/// plot. The ratios against every baseline are in the appendix.
fn capacity_tables(w: &mut String, study: &StudyData, s: &StudySummary) {
    let reference = reference(study, s);
    for (i, slo) in study.slos.iter().enumerate() {
        let _ = writeln!(w, "## SLO capacity at {}\n", slo.label());
        if let Some(r) = reference {
            let _ = writeln!(
                w,
                "× {r}: each policy's capacity over {r}'s on the same seed, mean and 95% interval \
                 over seeds (a bound where a capacity is censored). Every policy against every \
                 baseline: the appendix.\n"
            );
        }
        let mut header: Vec<String> = [
            "policy",
            "seeds",
            "capacity QPS (mean ± sd)",
            "95% CI",
            "censoring",
            "served KV hit",
            "imbalance at capacity",
        ]
        .map(String::from)
        .to_vec();
        header.extend(reference.map(|r| format!("× {r}")));
        let rows = s
            .arms
            .iter()
            .map(|a| {
                let c = &a.capacity_qps[i];
                let mut row = vec![
                    a.label.clone(),
                    a.seeds.len().to_string(),
                    capacity_cell(c, &study.ladder_qps),
                    ci_cell(c.ci95, c.ci95_clipped, c.n, 1),
                    censor_cell(c),
                    pct(a.served_kv_hit.mean),
                    a.imbalance_at_capacity
                        .get(i)
                        .map(|x| num(x.requests.mean, 2))
                        .unwrap_or("—".into()),
                ];
                if let Some(r) = reference {
                    row.push(match paired_arm(s, r, &a.sweep) {
                        Some(ra) if std::ptr::eq(ra, a) => "reference".into(),
                        Some(ra) => ratio_stats_cell(&arm_ratio(a, ra, i)),
                        None => "—".into(),
                    });
                }
                row
            })
            .collect();
        let _ = writeln!(w, "{}\n", table(header, rows));
        plot_link(w, study, &format!("capacity-slo{}.svg", i + 1));
    }
}

/// Every offered rate some arm ran, ascending.
fn offered_rates(s: &StudySummary) -> Vec<f64> {
    let mut qs: Vec<f64> = s
        .arms
        .iter()
        .flat_map(|a| a.steps.iter().map(|st| st.offered_qps))
        .collect();
    qs.sort_by(f64::total_cmp);
    qs.dedup();
    qs
}

/// p99 against offered QPS, one table per metric some SLO bounds.
fn latency_tables(w: &mut String, study: &StudyData, s: &StudySummary) {
    let qs = offered_rates(s);
    // The latency tables carry each arm's error share beside its p99: a step whose requests
    // failed must not read as a fast one.
    let mut p99_header = vec!["offered QPS".to_string()];
    p99_header.extend(
        s.arms
            .iter()
            .flat_map(|a| [a.label.clone(), format!("{} err%", a.label)]),
    );
    for m in plot_metrics(&study.slos) {
        let (name, file) = match m {
            SloMetric::E2e => ("end-to-end", "p99-e2e.svg"),
            SloMetric::Ttft => ("TTFT", "p99-ttft.svg"),
        };
        let _ = writeln!(w, "## {name} p99 (s) against offered QPS\n");
        let _ = writeln!(
            w,
            "Mean over seeds; ✗ marks a step that fails the tightest SLO on this metric for at \
             least one seed; err% is the share of the step's requests that failed (mean over \
             seeds).\n"
        );
        let tightest = study
            .slos
            .iter()
            .enumerate()
            .filter(|(_, x)| x.metric == m)
            .min_by(|a, b| a.1.p99_s.total_cmp(&b.1.p99_s))
            .map(|(i, _)| i);
        let rows = qs
            .iter()
            .map(|&q| {
                let mut r = vec![num(q, 1)];
                for a in &s.arms {
                    r.push(match by_q(a, q) {
                        None => "—".into(),
                        Some(st) => {
                            let v = match m {
                                SloMetric::E2e => st.e2e_p99_s.mean,
                                SloMetric::Ttft => st.ttft_p99_s.mean,
                            };
                            let fail = tightest
                                .map(|i| st.pass_share.get(i).copied().unwrap_or(1.0) < 1.0)
                                .unwrap_or(false);
                            format!("{}{}", num(v, 2), if fail { " ✗" } else { "" })
                        }
                    });
                    r.push(
                        by_q(a, q)
                            .map(|st| pct(st.error_rate.mean))
                            .unwrap_or("—".into()),
                    );
                }
                r
            })
            .collect();
        let _ = writeln!(w, "{}\n", table(p99_header.clone(), rows));
        plot_link(w, study, file);
    }
}

/// Served KV hit over the ladder and by offered QPS.
fn served_hit(w: &mut String, study: &StudyData, s: &StudySummary) {
    let _ = writeln!(w, "## Served KV hit\n");
    let _ = writeln!(
        w,
        "Σ cached prompt tokens / Σ prompt tokens; per seed request-weighted over the ladder, then \
         mean ± sd over seeds; by offered QPS below.\n"
    );
    let mut header = vec!["offered QPS".to_string()];
    header.extend(s.arms.iter().map(|a| a.label.clone()));
    let mut rows = vec![{
        let mut r = vec!["all steps".to_string()];
        r.extend(s.arms.iter().map(|a| {
            format!(
                "{} ± {}",
                pct(a.served_kv_hit.mean),
                num(a.served_kv_hit.sd * 100.0, 1)
            )
        }));
        r
    }];
    for q in offered_rates(s) {
        let mut r = vec![num(q, 1)];
        r.extend(s.arms.iter().map(|a| {
            by_q(a, q)
                .map(|st| pct(st.served_kv_hit.mean))
                .unwrap_or("—".into())
        }));
        rows.push(r);
    }
    let _ = writeln!(w, "{}\n", table(header, rows));
    plot_link(w, study, "served-hit.svg");
}

/// Imbalance at capacity and over the ladder.
fn imbalance(w: &mut String, study: &StudyData, s: &StudySummary) {
    let _ = writeln!(w, "## Imbalance\n");
    let _ = writeln!(
        w,
        "max / mean per-destination load over the measured window (1 = perfectly even), mean ± sd \
         over seeds: at each seed's capacity step for the first SLO (its highest passing step; \
         its lowest step when none passes), and the mean over every step of its ladder (light \
         steps, where one replica of a hot key dominates, weigh as much as the decisive ones). \
         Per offered QPS in the plot and in the JSON.\n"
    );
    let rows = s
        .arms
        .iter()
        .map(|a| {
            let at = a.imbalance_at_capacity.first();
            vec![
                a.label.clone(),
                at.map(|x| mean_sd(&x.requests, 2)).unwrap_or("—".into()),
                at.map(|x| mean_sd(&x.prefill_tokens, 2))
                    .unwrap_or("—".into()),
                mean_sd(&a.imbalance.requests, 2),
                mean_sd(&a.imbalance.prefill_tokens, 2),
            ]
        })
        .collect();
    let _ = writeln!(
        w,
        "{}\n",
        table(
            vec![
                "policy".into(),
                "requests at capacity".into(),
                "prefill tokens at capacity".into(),
                "requests, ladder mean".into(),
                "prefill tokens, ladder mean".into()
            ],
            rows
        )
    );
    plot_link(w, study, "imbalance.svg");
}

/// Per-key latency by key-rate decile and Jain's index.
fn fairness(w: &mut String, s: &StudySummary) {
    let _ = writeln!(w, "## Fairness\n");
    let _ = writeln!(
        w,
        "Per-key e2e p99 by key-rate decile (D1 = lowest-rate tenth of keys) and Jain's index over \
         per-key mean latency, mean over seeds, at each policy's highest step not above its mean \
         capacity at the first SLO (its first step when it has none).\n"
    );
    let mut fh = vec!["policy".to_string(), "at QPS".into(), "Jain".into()];
    fh.extend((1..=10).map(|d| format!("D{d} p99 s")));
    let rows = s
        .arms
        .iter()
        .map(|a| {
            let mut r = vec![a.label.clone()];
            match fairness_step(a) {
                None => r.extend(std::iter::repeat_n("—".to_string(), 12)),
                Some(st) => {
                    r.push(num(st.offered_qps, 1));
                    r.push(st.jain_index.map(|j| num(j, 3)).unwrap_or("—".into()));
                    for d in 0..10 {
                        r.push(
                            st.fairness_e2e_p99_by_decile_s
                                .get(d)
                                .copied()
                                .flatten()
                                .map(|v| num(v, 2))
                                .unwrap_or("—".into()),
                        );
                    }
                }
            }
            r
        })
        .collect();
    let _ = writeln!(w, "{}\n", table(fh, rows));
}

/// Plan churn, when some arm planned.
fn churn(w: &mut String, s: &StudySummary) {
    if !s.arms.iter().any(|a| a.churn.is_some()) {
        return;
    }
    let _ = writeln!(w, "## Plan churn\n");
    let _ = writeln!(
        w,
        "Churn = share of admitted keys whose destination set changed against the plan \
         replaced. The first plan of a run and repairs after failures are counted apart.\n"
    );
    let rows = s
        .arms
        .iter()
        .filter_map(|a| a.churn.as_ref().map(|c| (a, c)))
        .map(|(a, c)| {
            let o = |x: Option<f64>| x.map(pct).unwrap_or("—".into());
            vec![
                a.label.clone(),
                c.plans.to_string(),
                c.replans.to_string(),
                o(c.replan_churn_mean),
                o(c.replan_churn_max),
                c.repairs.to_string(),
                o(c.repair_churn_mean),
                format!("{} / {}", num(c.build_ms_mean, 1), num(c.build_ms_max, 1)),
                pct(c.admitted_share_mean),
                format!(
                    "{} / {}",
                    num(c.plan_imbalance_mean, 2),
                    num(c.plan_imbalance_max, 2)
                ),
            ]
        })
        .collect();
    let header = [
        "policy",
        "plans",
        "replans",
        "replan churn mean",
        "replan churn max",
        "repairs",
        "repair churn mean",
        "build ms mean / max",
        "admitted share",
        "planned imbalance mean / max",
    ]
    .map(String::from)
    .to_vec();
    let _ = writeln!(w, "{}\n", table(header, rows));
}

/// The published numbers beside ours, when the study gives some.
fn against_the_paper(w: &mut String, study: &StudyData, s: &StudySummary) {
    if study.paper.is_empty() {
        return;
    }
    let _ = writeln!(w, "## Against the paper\n");
    let _ = writeln!(
        w,
        "Hit agrees when within {HIT_AGREE_PP} percentage points; capacity agrees when the \
         paper's number lies inside our 95% CI.\n"
    );
    let rows = study
        .paper
        .iter()
        .map(|p| {
            let arm = s.arms.iter().find(|a| a.label == p.policy);
            let mut r = vec![p.policy.clone(), p.source.clone()];
            r.extend(paper_hit_cells(p, arm));
            r.extend(paper_capacity_cells(study, p, arm));
            r
        })
        .collect();
    let header = [
        "policy",
        "source",
        "paper hit",
        "our hit",
        "hit",
        "paper capacity",
        "our capacity [95% CI]",
        "capacity",
    ]
    .map(String::from)
    .to_vec();
    let _ = writeln!(w, "{}\n", table(header, rows));
}

/// Paper hit, our hit, and whether they agree.
fn paper_hit_cells(p: &super::PaperRef, arm: Option<&ArmSummary>) -> [String; 3] {
    match (p.served_kv_hit, arm) {
        (Some(h), Some(a)) if a.served_kv_hit.mean.is_finite() => {
            let d = (a.served_kv_hit.mean - h) * 100.0;
            [
                pct(h),
                pct(a.served_kv_hit.mean),
                format!(
                    "{:+.1} pp, {}",
                    d,
                    if d.abs() <= HIT_AGREE_PP {
                        "agrees"
                    } else {
                        "differs"
                    }
                ),
            ]
        }
        (Some(h), _) => [pct(h), "—".into(), "no data".into()],
        (None, _) => ["—".into(), "—".into(), "—".into()],
    }
}

/// Paper capacity, ours with its interval, and whether the paper's lies inside it.
fn paper_capacity_cells(
    study: &StudyData,
    p: &super::PaperRef,
    arm: Option<&ArmSummary>,
) -> [String; 3] {
    let cap = arm.and_then(|a| {
        let i = match &p.slo {
            Some(slo) => study.slos.iter().position(|x| slo_matches(x, slo))?,
            None => 0,
        };
        Some((a.capacity_qps.get(i)?, study.slos[i].label()))
    });
    match (p.capacity_qps, cap) {
        (Some(pc), Some((c, label))) => {
            let inside = pc >= c.ci95[0] && pc <= c.ci95[1];
            let mut v = if inside {
                "agrees".to_string()
            } else if c.mean < pc {
                "ours lower".to_string()
            } else {
                "ours higher".to_string()
            };
            if c.left_censored_seeds + c.right_censored_seeds > 0 {
                v.push_str(" (censored: a bound)");
            }
            [
                format!("{} ({label})", num(pc, 1)),
                format!(
                    "{} {}",
                    capacity_cell(c, &study.ladder_qps),
                    ci_cell(c.ci95, c.ci95_clipped, c.n, 1)
                ),
                v,
            ]
        }
        (Some(pc), None) => [num(pc, 1), "—".into(), "no matching SLO or data".into()],
        (None, _) => ["—".into(), "—".into(), "—".into()],
    }
}

/// The claim-to-evidence table: the study's claims, or one generated row per non-baseline arm.
fn claims(w: &mut String, study: &StudyData, s: &StudySummary) {
    let _ = writeln!(w, "## Claim-to-evidence\n");
    let rows: Vec<Vec<String>> = if study.claims.is_empty() {
        generated_claims(study, s)
    } else {
        study
            .claims
            .iter()
            .map(|c| {
                let ev = evidence_of(s, &c.policies);
                let e = match (c.evidence.is_empty(), ev.is_empty()) {
                    (true, _) => ev,
                    (false, true) => c.evidence.clone(),
                    (false, false) => format!("{}; {ev}", c.evidence),
                };
                vec![c.claim.clone(), e, c.caveat.clone()]
            })
            .collect()
    };
    let _ = writeln!(
        w,
        "{}\n",
        table(
            vec![
                "claim".into(),
                "runs and seeds behind it".into(),
                "caveat".into()
            ],
            rows
        )
    );
}

/// The runs and seeds behind arms `labels`.
fn evidence_of(s: &StudySummary, labels: &[String]) -> String {
    labels
        .iter()
        .map(|l| match s.arms.iter().find(|a| &a.label == l) {
            Some(a) => format!(
                "{l}: {} seeds, {} steps",
                seeds_cell(&a.seeds),
                a.steps.len()
            ),
            None => format!("{l}: no runs in this study"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One generated claim row per non-baseline arm, against the strongest baseline at the first
/// SLO (the highest mean capacity), not against every baseline.
fn generated_claims(study: &StudyData, s: &StudySummary) -> Vec<Vec<String>> {
    let slo = &study.slos[0];
    let strongest = study
        .baselines
        .iter()
        .filter_map(|b| s.arms.iter().find(|a| &a.label == b))
        .max_by(|x, y| x.capacity_qps[0].mean.total_cmp(&y.capacity_qps[0].mean))
        .map(|a| a.label.clone());
    s.arms
        .iter()
        .filter(|a| !study.baselines.contains(&a.label))
        .flat_map(|a| {
            strongest
                .iter()
                .filter(|b| **b != a.policy)
                .map(|b| {
                    let c = &a.capacity_qps[0];
                    vec![
                        format!(
                            "{} / {b} SLO capacity at {}: {}",
                            a.label,
                            slo.label(),
                            ratio_cell(a, b, &slo.label())
                        ),
                        evidence_of(s, &[a.label.clone(), b.clone()]),
                        format!(
                            "this study's workload and fleet only; {} seeds; censoring {}",
                            c.n,
                            censor_cell(c)
                        ),
                    ]
                })
                .collect::<Vec<_>>()
        })
        .filter(|_| !study.baselines.is_empty())
        .collect()
}

/// The study's free-text notes.
fn notes(w: &mut String, study: &StudyData) {
    if study.notes.is_empty() {
        return;
    }
    let _ = writeln!(w, "## Notes\n");
    for n in &study.notes {
        let _ = writeln!(w, "{}\n", n.trim());
    }
}

/// What the study cost its fleet (`analysis::cost`), and the steps cut early.
fn cost(w: &mut String, study: &StudyData) {
    let c = crate::analysis::cost::study_cost(&study.steps, study.prediction_fleet_s);
    if c.total.steps == 0 {
        return;
    }
    let _ = writeln!(w, "## Cost\n");
    let _ = write!(
        w,
        "Fleet time: {} replica-seconds of model time ({} replica-hours) in {} steps ({} knee \
         probes, {} cut early as certain to fail)",
        num(c.total.fleet_seconds, 0),
        num(c.total.fleet_seconds / 3600.0, 2),
        c.total.steps,
        c.total.probes,
        c.total.cut
    );
    if c.total.wall_s > 0.0 {
        let _ = write!(w, "; {} s of wall time", num(c.total.wall_s, 0));
    }
    let _ = writeln!(w, ".");
    if c.total.uncosted > 0 {
        let _ = writeln!(
            w,
            "{} steps were stored before their cost was kept: they are counted, their seconds \
             are not.",
            c.total.uncosted
        );
    }
    if c.prediction_fleet_seconds > 0.0 {
        let _ = writeln!(
            w,
            "Predicting where each knee search starts took {} replica-seconds of simulated \
             model time (on a live backend, off the fleet).",
            num(c.prediction_fleet_seconds, 0)
        );
    }
    let _ = writeln!(w, "\n| policy | fleet replica-s | steps | probes | cut |");
    let _ = writeln!(w, "|---|---:|---:|---:|---:|");
    for (label, a) in &c.by_arm {
        let _ = writeln!(
            w,
            "| {label} | {} | {} | {} | {} |",
            num(a.fleet_seconds, 0),
            a.steps,
            a.probes,
            a.cut
        );
    }
    let cut: Vec<_> = study
        .steps
        .iter()
        .filter(|s| s.metrics.cut.is_some())
        .collect();
    if !cut.is_empty() {
        let _ = writeln!(
            w,
            "\nSteps cut early (their figures cover the window up to the cut and are in no other \
             table; each fails the SLOs named, and decides no other):\n"
        );
        let _ = writeln!(
            w,
            "| policy | seed | offered QPS | fails | cut at (s) | late or past the bound | errors | window requests |"
        );
        let _ = writeln!(w, "|---|---:|---:|---|---:|---:|---:|---:|");
        for s in cut {
            let Some(k) = &s.metrics.cut else { continue };
            let fails: Vec<String> = k.fails.iter().map(|f| f.label()).collect();
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                crate::analysis::study::arm_label(&s.run.policy, &s.run.sweep),
                s.run.seed,
                num(s.metrics.offered_qps, 1),
                fails.join("; "),
                num(k.at_s, 1),
                k.violations,
                k.errors,
                k.window_requests
            );
        }
    }
    let _ = writeln!(w);
}

/// How pass, capacity and ratios are defined.
fn method(w: &mut String) {
    let _ = writeln!(w, "## Method\n");
    let _ = writeln!(w, "- Pass: {}.", RULES.pass);
    let _ = writeln!(w, "- Capacity: {}.", RULES.capacity);
    let _ = writeln!(w, "- Ratios: {}.", RULES.ratio);
    let _ = writeln!(
        w,
        "- Latency percentiles: HDR histograms (µs, 3 significant digits), measured from the \
         scheduled send time; \"—\" marks no data."
    );
}

/// The appendix: per SLO, every policy's capacity ratio against every baseline (the JSON's
/// `ratios`).
fn ratio_appendix(w: &mut String, study: &StudyData, s: &StudySummary) {
    if study.baselines.is_empty() {
        return;
    }
    let _ = writeln!(w, "\n## Appendix: capacity ratios against each baseline\n");
    let _ = writeln!(
        w,
        "× b: the policy's capacity over baseline b's on the same seed, mean and 95% interval over \
         seeds (rules under Method); — where a policy is the baseline itself."
    );
    for slo in &study.slos {
        let _ = writeln!(w, "\n### At {}\n", slo.label());
        let mut header = vec!["policy".to_string()];
        header.extend(study.baselines.iter().map(|b| format!("× {b}")));
        let rows = s
            .arms
            .iter()
            .map(|a| {
                let mut r = vec![a.label.clone()];
                r.extend(
                    study
                        .baselines
                        .iter()
                        .map(|b| ratio_cell(a, b, &slo.label())),
                );
                r
            })
            .collect();
        let _ = writeln!(w, "{}", table(header, rows));
    }
}

fn cap_by_label<'a>(s: &'a StudySummary, arm: &str, slo: &Slo) -> Option<&'a CapacityStats> {
    s.arms
        .iter()
        .find(|a| a.label == arm)?
        .capacity_qps
        .iter()
        .find(|c| slo_matches(&c.slo, slo))
}

/// Two studies side by side (capacity per policy per SLO, served hit, ratio b/a of the means).
/// The ratio is of seed means, not paired per seed (the two studies may differ in fleet or
/// precision, so their seeds are not paired runs); it is undefined when A's mean capacity is 0
/// (all seeds < first step).
pub fn compare(a: &StudyData, b: &StudyData) -> String {
    let (sa, sb) = (super::analyse(a), super::analyse(b));
    let mut labels: Vec<String> = sa.arms.iter().map(|x| x.label.clone()).collect();
    for x in &sb.arms {
        if !labels.contains(&x.label) {
            labels.push(x.label.clone());
        }
    }
    let mut slos: Vec<Slo> = a.slos.clone();
    for x in &b.slos {
        if !slos.iter().any(|y| slo_matches(x, y)) {
            slos.push(*x);
        }
    }
    let mut md = String::new();
    let w = &mut md;
    let _ = writeln!(w, "# Compare: {} (A) and {} (B)\n", a.name, b.name);
    for (n, d) in [(&a.name, &a.description), (&b.name, &b.description)] {
        if !d.is_empty() {
            let _ = writeln!(w, "- {n}: {}", d.trim());
        }
    }
    let _ = writeln!(
        w,
        "\nRatios are B mean / A mean (not paired per seed); undefined when A's capacity is 0.\n"
    );
    for slo in &slos {
        let _ = writeln!(w, "## SLO capacity at {}\n", slo.label());
        let rows = labels
            .iter()
            .map(|l| {
                let ca = cap_by_label(&sa, l, slo);
                let cb = cap_by_label(&sb, l, slo);
                let cell = |c: Option<&CapacityStats>, st: &StudyData| {
                    c.map(|c| {
                        format!(
                            "{} {} ({})",
                            capacity_cell(c, &st.ladder_qps),
                            ci_cell(c.ci95, c.ci95_clipped, c.n, 1),
                            censor_cell(c)
                        )
                    })
                    .unwrap_or("—".into())
                };
                let ratio = match (ca, cb) {
                    (Some(x), Some(y)) if x.mean > 0.0 && y.mean.is_finite() => {
                        format!("{}×", num(y.mean / x.mean, 2))
                    }
                    (Some(_), Some(_)) => "undefined".into(),
                    _ => "—".into(),
                };
                vec![l.clone(), cell(ca, a), cell(cb, b), ratio]
            })
            .collect();
        let _ = writeln!(w, "{}\n", table(ab_header(a, b, &["B / A"]), rows));
    }
    let _ = writeln!(w, "## Served KV hit\n");
    let hit = |s: &StudySummary, l: &str| {
        s.arms
            .iter()
            .find(|x| x.label == l)
            .map(|x| x.served_kv_hit.mean)
    };
    let rows = labels
        .iter()
        .map(|l| {
            let (ha, hb) = (hit(&sa, l), hit(&sb, l));
            let c = |h: Option<f64>| h.map(pct).unwrap_or("—".into());
            let (d, r) = match (ha, hb) {
                (Some(x), Some(y)) => (
                    format!("{:+.1} pp", (y - x) * 100.0),
                    if x > 0.0 {
                        format!("{}×", num(y / x, 2))
                    } else {
                        "undefined".into()
                    },
                ),
                _ => ("—".into(), "—".into()),
            };
            vec![l.clone(), c(ha), c(hb), d, r]
        })
        .collect();
    let _ = writeln!(w, "{}", table(ab_header(a, b, &["B − A", "B / A"]), rows));
    md
}

/// The header of a two-study table: the policy, study A's and study B's columns, then `more`.
fn ab_header(a: &StudyData, b: &StudyData, more: &[&str]) -> Vec<String> {
    let mut h = vec![
        "policy".to_string(),
        format!("A: {}", a.name),
        format!("B: {}", b.name),
    ];
    h.extend(more.iter().map(|m| m.to_string()));
    h
}

/// What CacheRoute's self-calibration chose: per policy, how many plans were tuned, the values
/// chosen over the whole study, how often W turned back (a sign of oscillation), and for the
/// first seed's middle ladder step the values interval by interval with the tuner's reason.
fn self_calibration(w: &mut String, study: &StudyData) {
    let traces = tuning_traces(study);
    let labels: Vec<&str> = traces.iter().map(|t| t.label).collect();
    if labels.is_empty() {
        return;
    }
    let _ = writeln!(w, "## Self-calibration\n");
    let _ = writeln!(
        w,
        "CacheRoute chose q_cap, W and pinned or bounded sets itself (docs/cacheroute.md). \
         Reversals: within a step, how often W moved up after moving down or the reverse \
         (summed over steps; 0 = no oscillation).\n"
    );
    let rows = labels
        .iter()
        .map(|label| tuning_row(study, label))
        .collect();
    let header = [
        "policy",
        "tuned plans",
        "q_cap chosen",
        "W chosen",
        "W reversals",
    ]
    .map(String::from)
    .to_vec();
    let _ = writeln!(w, "{}\n", table(header, rows));
    let _ = writeln!(
        w,
        "![q_cap and W chosen per interval]({}/{TUNING_PLOT})\n",
        study.name
    );
    for t in &traces {
        let _ = writeln!(
            w,
            "{}, seed {}, {} req/s, interval by interval:\n",
            t.label,
            t.seed,
            num(t.qps, 0)
        );
        let rows = t
            .plans
            .iter()
            .map(|p| {
                let p = &p.plan;
                vec![
                    num(p.at_s, 0),
                    p.q_cap.map_or_else(|| "—".into(), |q| num(q, 2)),
                    p.warm_slots.map(|x| x.to_string()).unwrap_or("—".into()),
                    p.tuning
                        .clone()
                        .unwrap_or_else(|| "— (not a tuning interval)".into()),
                ]
            })
            .collect();
        let header = ["at s", "q_cap", "W", "tuning"].map(String::from).to_vec();
        let _ = writeln!(w, "{}\n", table(header, rows));
    }
}

/// One policy's row of the self-calibration table: plans tuned, the q_cap and W chosen over
/// the study, and W's reversals.
fn tuning_row(study: &StudyData, label: &str) -> Vec<String> {
    let plans: Vec<&crate::analysis::model::PlanEvent> = study
        .plans
        .iter()
        .filter(|p| p.run.policy == *label)
        .collect();
    let tuned = plans.iter().filter(|p| p.plan.tuning.is_some()).count();
    let mut ws: Vec<u64> = plans.iter().filter_map(|p| p.plan.warm_slots).collect();
    ws.sort_unstable();
    ws.dedup();
    let mut qs: Vec<f64> = plans
        .iter()
        .filter_map(|p| p.plan.q_cap)
        .filter(|q| q.is_finite())
        .collect();
    qs.sort_by(f64::total_cmp);
    qs.dedup();
    let reversals = w_reversals(&plans);
    let range = |lo: String, hi: String| {
        if lo == hi {
            lo
        } else {
            format!("{lo} – {hi}")
        }
    };
    vec![
        label.to_string(),
        format!("{tuned} of {}", plans.len()),
        match (qs.first(), qs.last()) {
            (Some(a), Some(b)) => range(num(*a, 2), num(*b, 2)),
            _ => "—".into(),
        },
        match (ws.first(), ws.last()) {
            (Some(a), Some(b)) => range(a.to_string(), b.to_string()),
            _ => "—".into(),
        },
        reversals.to_string(),
    ]
}

/// How often W turned back within a step (up after down, or down after up), summed over the
/// steps of `plans` (in run and step order).
fn w_reversals(plans: &[&crate::analysis::model::PlanEvent]) -> usize {
    let mut reversals = 0usize;
    let mut i = 0;
    while i < plans.len() {
        let (run, step) = (&plans[i].run, plans[i].step);
        let mut last: Option<u64> = None;
        let mut dir = 0i8;
        while i < plans.len() && plans[i].run == *run && plans[i].step == step {
            if let (Some(prev), Some(cur)) = (last, plans[i].plan.warm_slots) {
                let d = (cur > prev) as i8 - (cur < prev) as i8;
                if d != 0 {
                    if dir != 0 && d != dir {
                        reversals += 1;
                    }
                    dir = d;
                }
            }
            if plans[i].plan.warm_slots.is_some() {
                last = plans[i].plan.warm_slots;
            }
            i += 1;
        }
    }
    reversals
}

/// The paragraph a newcomer reads first: at each SLO, which policy has the highest capacity, by
/// how much over the next, and how sure (how many paired seeds agree).
fn headline(w: &mut String, study: &StudyData, s: &StudySummary) {
    if s.arms.is_empty() {
        return;
    }
    let _ = writeln!(w, "## Headline\n");
    let first = study.ladder_qps.first().copied().unwrap_or(f64::NAN);
    for (i, slo) in study.slos.iter().enumerate() {
        let mut ranked: Vec<&ArmSummary> = s.arms.iter().collect();
        ranked.sort_by(|a, b| b.capacity_qps[i].mean.total_cmp(&a.capacity_qps[i].mean));
        let top = ranked[0];
        let c = &top.capacity_qps[i];
        if c.n > 0
            && s.arms.iter().all(|a| {
                let c = &a.capacity_qps[i];
                c.left_censored_seeds == c.n
            })
        {
            let _ = writeln!(
                w,
                "- At {}: no policy passes even the first step ({} req/s).",
                slo.label(),
                num(first, 1)
            );
            continue;
        }
        let tied: Vec<&str> = ranked
            .iter()
            .filter(|a| a.capacity_qps[i].mean == c.mean)
            .map(|a| a.label.as_str())
            .collect();
        let bound = c.n > 0 && c.right_censored_seeds == c.n;
        let cap = if bound {
            format!("at least {}", num(c.mean, 1))
        } else {
            capacity_cell(c, &study.ladder_qps)
        };
        let mut line = if tied.len() > 1 {
            format!(
                "- At {}: **{}** tie for the highest SLO capacity, {cap} req/s",
                slo.label(),
                tied.join("** and **")
            )
        } else {
            format!(
                "- At {}: **{}** has the highest SLO capacity, {cap} req/s",
                slo.label(),
                top.label
            )
        };
        if bound {
            line.push_str(" (every step passed: raise the ladder to find the knee)");
        }
        if let Some(next) = ranked.iter().find(|a| a.capacity_qps[i].mean < c.mean) {
            let d = &next.capacity_qps[i];
            let _ = write!(
                line,
                "; next is {}, {} req/s ({})",
                next.label,
                capacity_cell(d, &study.ladder_qps),
                lead_words(c, d)
            );
        }
        let _ = writeln!(w, "{line}.");
    }
    let _ = writeln!(w);
}

/// How far capacity `c` leads `d`: the ratio of the means and how many paired seeds agree.
fn lead_words(c: &CapacityStats, d: &CapacityStats) -> String {
    let (mut ahead, mut level, mut behind) = (0, 0, 0);
    for p in &c.per_seed {
        if let Some(q) = d.per_seed.iter().find(|q| q.seed == p.seed) {
            match p.qps.total_cmp(&q.qps) {
                std::cmp::Ordering::Greater => ahead += 1,
                std::cmp::Ordering::Equal => level += 1,
                std::cmp::Ordering::Less => behind += 1,
            }
        }
    }
    let n = ahead + level + behind;
    let ratio = if d.mean > 0.0 {
        format!("{}×", num(c.mean / d.mean, 2))
    } else {
        "—".into()
    };
    let sure = if n == 0 {
        "no paired seeds".to_string()
    } else if ahead == n {
        format!("ahead on all {n} paired seeds")
    } else if behind == 0 {
        format!("ahead on {ahead} and level on {level} of {n} paired seeds")
    } else {
        format!(
            "ahead on {ahead}, level on {level} and behind on {behind} of {n} paired \
             seeds: not a clear lead"
        )
    };
    format!("{ratio} by means; {sure}")
}

/// What each policy in the study does, one line each.
fn glossary(w: &mut String, s: &StudySummary) {
    let mut seen: Vec<&str> = Vec::new();
    let mut lines = Vec::new();
    for a in &s.arms {
        if seen.contains(&a.policy.as_str()) {
            continue;
        }
        seen.push(&a.policy);
        if let Some(d) = policy_gloss(&a.policy) {
            lines.push(format!("- `{}`: {d}", a.policy));
        }
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(w, "Policies:\n\n{}\n", lines.join("\n"));
}

/// One line on what a policy does (docs/policies.md has the rules in full).
pub(crate) fn policy_gloss(policy: &str) -> Option<&'static str> {
    Some(match policy {
        "flat-lb" => "load balancing, no affinity: the less loaded of two random replicas",
        "sticky" => "consistent hashing of the key: always the same replica, whatever its load",
        "chwbl" => "consistent hashing with bounded loads: the key's replica unless it is overloaded, then the next on the ring",
        "dualmap" => "two hash homes per key; the second only when the first would break the SLO",
        "preble" => "prefix-tree routing: follow the longest cached prefix unless load says explore",
        "cacheroute" => "planned homes for the keys worth one (self-calibrated), bounded-load hashing for the rest",
        "cacheroute-paper" => "CacheRoute as published: fixed q_cap and W from the engine model, pinned sets, P2C for the rest",
        "cacheroute-p2c-tail" => "CacheRoute with P2C (no affinity) for unadmitted keys",
        "cacheroute-affinity" => "ablation: one hashed home per admitted key (no replication, no LPT)",
        "cacheroute-replication" => "ablation: hashed homes replicated by rate (no LPT balance)",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::table;

    #[test]
    fn tables_pad_columns_escape_pipes_and_fill_short_rows() {
        let t = table(
            vec!["policy".into(), "hit".into()],
            vec![
                vec!["a|b".into(), "≥ 4.0".into()],
                vec!["cacheroute".into()],
            ],
        );
        assert_eq!(
            t,
            "| policy     | hit   |\n|------------|-------|\n| a\\|b       | ≥ 4.0 |\n| cacheroute |       |"
        );
    }
}
