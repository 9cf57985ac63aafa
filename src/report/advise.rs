//! The `cacheroute advise` report: a short terminal text and a markdown file, both from an
//! [`AdviseReport`] (the numbers come from `analysis::advise`; this only formats).

use std::fmt::Write;

use super::{capacity_cell, num, ratio_stats_cell, table};
use crate::analysis::advise::{
    seconds, AdviseReport, Comparison, Diagnostic, Outcome, KNEE_RESOLUTION, VERDICT_MARGIN,
};
use crate::analysis::model::{Censoring, SeedStats};

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", 100.0 * x)
    } else {
        "—".into()
    }
}

fn mean(s: &SeedStats) -> f64 {
    s.mean
}

/// A ratio or a bound: `0.79×`, `≥ 2.00×`, `≤ 0.50×`, `1.10–1.40×`.
fn ratio_words(low: f64, high: f64) -> String {
    if !high.is_finite() {
        format!("≥ {}×", num(low, 2))
    } else if low <= 0.0 {
        format!("≤ {}×", num(high, 2))
    } else if (high - low).abs() <= 1e-9 * high.abs() {
        format!("{}×", num(low, 2))
    } else {
        format!("{}–{}×", num(low, 2), num(high, 2))
    }
}

/// The interval a verdict rests on: `[0.75, 0.86] (n = 3)`, `[1.87, ∞) (n = 2)`, `(n = 1)`.
pub fn interval_words(c: &Comparison) -> String {
    let n = c.per_seed.len();
    if n == 1 {
        return "(n = 1)".into();
    }
    let [lo, hi] = c.interval;
    if hi.is_finite() {
        format!("[{}, {}] (n = {n})", num(lo, 2), num(hi, 2))
    } else {
        format!("[{}, ∞) (n = {n})", num(lo, 2))
    }
}

/// A policy's knee over the seeds of a comparison, req/s: the mean, or a bound when censored
/// (`< 50` below the first step, `≥ 200` above the top).
fn knee_words(knees: &[(f64, Censoring)], first_step: f64) -> String {
    let n = knees.len().max(1);
    let mean = knees.iter().map(|k| k.0).sum::<f64>() / n as f64;
    let left = knees.iter().filter(|k| k.1 == Censoring::Left).count();
    let right = knees.iter().filter(|k| k.1 == Censoring::Right).count();
    if left == knees.len() {
        format!("< {}", num(first_step, 1))
    } else if right == knees.len() {
        format!("≥ {}", num(mean, 1))
    } else if left + right > 0 {
        // Some seeds censored: each seed's, bounds as bounds.
        knees
            .iter()
            .map(|k| knee_words(&[*k], first_step))
            .collect::<Vec<_>>()
            .join(" / ")
    } else {
        num(mean, 1)
    }
}

/// The verdict of one comparison in a line, with the ratio and interval it rests on and both
/// policies' refined knees: `LOSE 0.81× [0.75, 0.86] (n = 3): cacheroute 53.2 vs preble 66.0
/// req/s`.
pub fn comparison_cell(c: &Comparison, first_step: f64) -> String {
    if c.outcome == Outcome::NoPass {
        return format!("{} (neither passes the first step)", c.outcome.word());
    }
    let n = c.per_seed.len().max(1) as f64;
    let low = c.per_seed.iter().map(|p| p.ratio_low).sum::<f64>() / n;
    let high = c.per_seed.iter().map(|p| p.ratio_high).sum::<f64>() / n;
    let subject: Vec<(f64, Censoring)> = c
        .per_seed
        .iter()
        .map(|p| (p.subject_qps, p.subject_censored))
        .collect();
    let baseline: Vec<(f64, Censoring)> = c
        .per_seed
        .iter()
        .map(|p| (p.baseline_qps, p.baseline_censored))
        .collect();
    format!(
        "{} {} {}: {} {} vs {} {} req/s",
        c.outcome.word(),
        ratio_words(low, high),
        interval_words(c),
        c.subject_policy,
        knee_words(&subject, first_step),
        c.baseline_policy,
        knee_words(&baseline, first_step)
    )
}

/// Each seed's knee of one policy in a comparison, req/s: `< 80.2, 106.4` (a bound when censored).
fn seed_knees(c: &Comparison, subject: bool, first_step: f64) -> String {
    c.per_seed
        .iter()
        .map(|p| {
            let (q, cens) = if subject {
                (p.subject_qps, p.subject_censored)
            } else {
                (p.baseline_qps, p.baseline_censored)
            };
            knee_words(&[(q, cens)], first_step)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The headline verdicts: affinity and CacheRoute, each against both baselines.
pub fn headline(r: &AdviseReport) -> String {
    if r.nothing_passes {
        return format!(
            "no verdict: no policy meets {} even at {}× of the load ({} req/s)",
            r.simulated.slo.label(),
            num(r.simulated.ladder_multipliers[0], 2),
            num(r.simulated.ladder_qps[0], 3)
        );
    }
    let mut parts = Vec::new();
    for c in &r.comparisons {
        parts.push(format!(
            "{} {} vs {}",
            c.subject,
            c.outcome.word().to_lowercase(),
            c.against
        ));
    }
    parts.join("; ")
}

fn diagnostic_rows(d: &Diagnostic) -> Vec<(String, String)> {
    vec![
        (
            "recoverable reuse (ideal cache)".into(),
            format!("{} of prompt tokens", pct(d.recoverable_reuse)),
        ),
        (
            "cache residence time T_res".into(),
            format!(
                "{} (KV {} tokens per replica; {:.0} prompt + {:.0} output tokens per request at {} req/s over {} replicas)",
                seconds(d.residence_s),
                d.kv_tokens_per_replica,
                d.mean_prompt_tokens,
                d.mean_output_tokens,
                num(d.load_qps, 3),
                d.replicas
            ),
        ),
        (
            "reuse within T_res".into(),
            format!(
                "{} with each key on one warm cache; {} at one of {} replicas under cache-blind spreading",
                pct(d.reuse_within_residence),
                pct(d.reuse_spread),
                d.replicas
            ),
        ),
        (
            "affinity can win back".into(),
            format!(
                "{} of prompt tokens; prefill is {} of a request's service time, so ≈ {} of the work",
                pct(d.affinity_gap),
                pct(d.prefill_share),
                pct(d.work_affinity_can_save)
            ),
        ),
        (
            "key skew".into(),
            format!(
                "{} keys, Gini {:.3}, top-1% {}, top-4% {}, hottest key {} ({:.2}× one replica's share; {} key(s) above 1/R)",
                d.keys,
                d.gini,
                pct(d.top1pct_share),
                pct(d.top4pct_share),
                pct(d.largest_key_share),
                d.hottest_key_in_replicas,
                d.keys_above_one_replica
            ),
        ),
        (
            "revisit per key per replica R/λ_b".into(),
            format!(
                "median {} (traffic-weighted) vs T_res {}: {} of traffic revisits every replica within T_res, {} revisits a single home within it",
                seconds(d.revisit_spread_median_s),
                seconds(d.residence_s),
                pct(d.traffic_survives_spread),
                pct(d.traffic_survives_home)
            ),
        ),
        (
            "inter-arrival CV".into(),
            format!("{:.2}", d.interarrival_cv),
        ),
    ]
}

/// How the knees were located: `12 knee probes (knees to 5%)` or `knees at the ladder's steps`.
fn probes_words(r: &AdviseReport) -> String {
    match r.simulated.refine {
        Some(f) => format!(
            "{} knee probes (knees to {}%)",
            r.simulated.knee_probes,
            num(100.0 * f, 0)
        ),
        None => "knees at the ladder's steps".into(),
    }
}

fn ladder_words(r: &AdviseReport) -> String {
    let s = &r.simulated;
    let m = &s.ladder_multipliers;
    format!(
        "{}×–{}× of {} req/s ({}–{} req/s, {} steps)",
        num(m[0], 2),
        num(m[m.len() - 1], 2),
        num(s.load_qps, 3),
        num(s.ladder_qps[0], 3),
        num(s.ladder_qps[s.ladder_qps.len() - 1], 3),
        m.len()
    )
}

/// The terminal report.
pub fn render_text(r: &AdviseReport) -> String {
    let s = &r.simulated;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "cacheroute advise — {} on {} × {}, SLO {}",
        s.input,
        s.replicas,
        s.engine,
        s.slo.label()
    );
    let _ = writeln!(
        o,
        "simulated: {}; {} seed(s); {:.0} s per step ({:.0} s warm-up + {:.0} s measured); {} steps run, {} skipped above a failure, {}; {} requests",
        ladder_words(r),
        s.seeds.len(),
        s.warmup_s + s.measure_s,
        s.warmup_s,
        s.measure_s,
        s.steps_simulated,
        s.steps_skipped,
        probes_words(r),
        s.requests_simulated
    );
    for c in &s.cuts {
        let _ = writeln!(o, "note: {c}");
    }
    let _ = writeln!(
        o,
        "\nreuse diagnostic ({} requests, {} at your load)",
        s.diagnosed_requests,
        seconds(s.diagnosed_span_s)
    );
    for (k, v) in diagnostic_rows(&r.diagnostic) {
        let _ = writeln!(o, "  {k:<36} {v}");
    }
    let _ = writeln!(
        o,
        "\nsimulated A/B ({}; at 1× = {} req/s)",
        s.slo.label(),
        num(s.load_qps, 3)
    );
    let _ = writeln!(
        o,
        "  {:<11} {:<26} {:>8} {:>10} {:>9} {:>11} {:>10}",
        "policy", "capacity (req/s)", "× load", "× flat-lb", "hit @1×", "p99 @1×", "imb. @1×"
    );
    for p in &r.policies {
        let pass = if p.pass_share_at_load >= 1.0 {
            " "
        } else {
            "✗"
        };
        let _ = writeln!(
            o,
            "  {:<11} {:<26} {:>7}× {:>10} {:>9} {:>9} s{} {:>10}",
            p.policy,
            capacity_cell(&p.capacity, &s.ladder_qps),
            num(p.capacity_x_load, 2),
            p.vs_flat_lb
                .as_ref()
                .map_or("—".into(), |r| format!("{}×", num(r.stats.mean, 2))),
            pct(mean(&p.served_kv_hit_at_load)),
            num(mean(&p.p99_at_load_s), 2),
            pass,
            num(mean(&p.imbalance_at_load), 2)
        );
    }
    let _ = writeln!(o, "\nverdict");
    if r.nothing_passes {
        let _ = writeln!(o, "  {}", headline(r));
    } else {
        for c in &r.comparisons {
            let _ = writeln!(
                o,
                "  {:<18} vs {:<26} {}",
                c.subject,
                c.against,
                comparison_cell(c, s.ladder_qps[0])
            );
        }
        if r.everything_passes {
            let _ = writeln!(
                o,
                "  (every policy passes every step: the fleet has headroom beyond {}×; raise --qps to find the knees)",
                num(s.ladder_multipliers[s.ladder_multipliers.len() - 1], 2)
            );
        }
    }
    let _ = writeln!(o, "  why: {}", r.facts);
    if let Some(d) = &r.dispatch {
        let _ = writeln!(o, "  CacheRoute's dispatch: {}", dispatch_words(d));
    }
    o
}

/// Which dispatch CacheRoute's self-calibration ran at the user's load, and why.
pub fn dispatch_words(d: &crate::analysis::advise::DispatchChoice) -> String {
    let shares: Vec<String> = d
        .shares
        .iter()
        .map(|(k, s)| format!("{k} ({} of plans)", pct(*s)))
        .collect();
    let mut w = format!(
        "at {} req/s the self-calibration ran {}",
        num(d.load_qps, 2),
        shares.join(", ")
    );
    match &d.tuning {
        Some(t) => w.push_str(&format!("; its last tuning: {t}")),
        None => w.push_str(
            " (nothing was tuned: the simulated step ends before a control interval of \
             measured traffic closes; lengthen the input or raise --max-requests)",
        ),
    }
    w
}

/// The markdown report (`--out`).
pub fn render_markdown(r: &AdviseReport) -> String {
    let s = &r.simulated;
    let mut o = String::new();
    let _ = writeln!(o, "# cacheroute advise\n");
    let _ = writeln!(
        o,
        "{} on {} × `{}`, SLO {}.\n",
        s.input,
        s.replicas,
        s.engine,
        s.slo.label()
    );
    let _ = writeln!(o, "**Verdict:** {}.\n", headline(r));
    let _ = writeln!(o, "**Why:** {}\n", r.facts);
    if let Some(d) = &r.dispatch {
        let _ = writeln!(o, "**CacheRoute's dispatch:** {}.\n", dispatch_words(d));
    }
    if !r.nothing_passes {
        let rows = r
            .comparisons
            .iter()
            .map(|c| {
                vec![
                    c.subject.clone(),
                    c.against.clone(),
                    c.outcome.word().to_string(),
                    ratio_stats_cell(&c.ratio),
                    interval_words(c),
                    format!(
                        "{}: {}; {}: {}",
                        c.subject_policy,
                        seed_knees(c, true, s.ladder_qps[0]),
                        c.baseline_policy,
                        seed_knees(c, false, s.ladder_qps[0])
                    ),
                ]
            })
            .collect();
        o.push_str(&table(
            vec![
                "policy".into(),
                "against".into(),
                "verdict".into(),
                "capacity ratio (paired seeds, 95% CI)".into(),
                "interval the verdict rests on".into(),
                "knees per seed (req/s)".into(),
            ],
            rows,
        ));
        o.push_str("\n\n");
        if r.everything_passes {
            o.push_str("Every policy passes every step: the fleet has headroom beyond the ladder's top; raise `--qps` to find the knees.\n\n");
        }
    }
    let _ = writeln!(
        o,
        "Rule: per seed, each policy's SLO capacity is its knee, located by bisection between the highest ladder step it and every lower step pass and the first that fails, to within {}% (a bound when it passes every step or fails the first); a comparison is a **win** when the 95% interval of the paired capacity ratio lies wholly above {}, a **loss** when wholly below {}, else a **tie** (a censored capacity widens the interval to every ratio it allows). Affinity is the better of Sticky and CHWBL; the best reactive baseline is the best of Flat-LB, DualMap and Preble (docs/advise.md).\n",
        num(100.0 * KNEE_RESOLUTION, 0),
        num(1.0 + VERDICT_MARGIN, 2),
        num(1.0 - VERDICT_MARGIN, 2)
    );
    let _ = writeln!(o, "## Reuse diagnostic\n");
    let _ = writeln!(
        o,
        "Over {} requests ({} at the load of {} req/s); skew and lengths over the whole input.\n",
        s.diagnosed_requests,
        seconds(s.diagnosed_span_s),
        num(s.load_qps, 3)
    );
    o.push_str(&table(
        vec!["figure".into(), "value".into()],
        diagnostic_rows(&r.diagnostic)
            .into_iter()
            .map(|(k, v)| vec![k, v])
            .collect(),
    ));
    o.push_str("\n\nT_res = C / ((λ/R)·(p̄ + ō)): how long an unreferenced prefix survives in one replica's LRU KV cache of C tokens when every prompt and output token of its λ/R requests per second is written into it.\n\n");
    let _ = writeln!(o, "## Simulated A/B\n");
    let rows = r
        .policies
        .iter()
        .map(|p| {
            vec![
                p.policy.clone(),
                capacity_cell(&p.capacity, &s.ladder_qps),
                format!(
                    "[{}, {}] (n = {})",
                    num(p.capacity.ci95[0], 1),
                    num(p.capacity.ci95[1], 1),
                    p.capacity.n
                ),
                format!("{}×", num(p.capacity_x_load, 2)),
                pct(p.served_kv_hit_at_load.mean),
                format!(
                    "{} s{}",
                    num(p.p99_at_load_s.mean, 2),
                    if p.pass_share_at_load >= 1.0 {
                        ""
                    } else {
                        " ✗"
                    }
                ),
                num(p.imbalance_at_load.mean, 2),
                p.vs_flat_lb.as_ref().map_or("—".into(), ratio_stats_cell),
            ]
        })
        .collect();
    o.push_str(&table(
        vec![
            "policy".into(),
            "capacity req/s (mean ± sd)".into(),
            "95% CI".into(),
            "× load".into(),
            "served hit at 1×".into(),
            format!("p99 at 1× ({})", s.slo.label()),
            "imbalance at 1×".into(),
            "× flat-lb (paired seeds)".into(),
        ],
        rows,
    ));
    o.push_str("\n\n");
    let _ = writeln!(o, "## What was simulated\n");
    let mut lines = vec![
        format!("- Input: {}", s.input),
        format!(
            "- Load (1×): {} req/s{}",
            num(s.load_qps, 3),
            if s.input_requests > 0 {
                format!(
                    "; the input has {} requests over {} ({} req/s)",
                    s.input_requests,
                    seconds(s.input_span_s),
                    num(s.input_qps, 3)
                )
            } else {
                format!("; the rates sum to {} req/s", num(s.input_qps, 3))
            }
        ),
        format!("- Fleet: {} × `{}`", s.replicas, s.engine),
        format!("- Ladder: {}", ladder_words(r)),
        format!(
            "- Steps: {:.0} s each ({:.0} s warm-up, {:.0} s measured); {} steps simulated, {} skipped (above a failed step and past 1×, where they cannot change a capacity), {}; {} requests simulated",
            s.warmup_s + s.measure_s,
            s.warmup_s,
            s.measure_s,
            s.steps_simulated,
            s.steps_skipped,
            probes_words(r),
            s.requests_simulated
        ),
        format!(
            "- Seeds: {} — {}",
            s.seeds
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            s.seed_variation
        ),
        format!(
            "- Policies: {} (each with its default configuration)",
            s.policies.join(", ")
        ),
    ];
    for c in &s.cuts {
        lines.push(format!("- Note: {c}"));
    }
    o.push_str(&lines.join("\n"));
    o.push('\n');
    o
}
