//! SVG plots of a study (plotters, SVG backend only; text is written as SVG `<text>`, no font
//! files). Each function returns the SVG document as a string; the caller writes it.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::analysis::model::{Censoring, Slo, SloMetric};
use crate::analysis::study::{ArmSummary, StudySummary};

const SIZE: (u32, u32) = (900, 540);

/// A fixed palette (stable colours per policy position).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

type PlotResult = Result<(), Box<dyn std::error::Error>>;

fn finish(f: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> PlotResult) -> Result<String, String> {
    let mut s = String::new();
    {
        let root = SVGBackend::with_string(&mut s, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        f(&root).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(s)
}

fn upper(v: impl IntoIterator<Item = f64>, floor: f64) -> f64 {
    let m = v
        .into_iter()
        .filter(|x| x.is_finite())
        .fold(floor, f64::max);
    m * 1.1
}

/// One category per arm on the x axis (a segmented `0..n` would add an empty one at the end).
fn categories(
    n: usize,
) -> plotters::coord::ranged1d::SegmentedCoord<plotters::coord::types::RangedCoordusize> {
    (0..n.max(1) - 1).into_segmented()
}

/// A chart with one category per arm on x (labelled with the arms' names) and `y_desc` over
/// `0..ymax` on y: the setup of every per-arm plot.
type ArmChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<
        plotters::coord::ranged1d::SegmentedCoord<plotters::coord::types::RangedCoordusize>,
        plotters::coord::types::RangedCoordf64,
    >,
>;

fn arm_chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    title: &str,
    arms: &[ArmSummary],
    y_desc: &str,
    ymax: f64,
) -> Result<ArmChart<'a, 'b>, Box<dyn std::error::Error>> {
    let n = arms.len().max(1);
    let mut ch = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(60)
        .y_label_area_size(60)
        .build_cartesian_2d(categories(n), 0.0..ymax)?;
    ch.configure_mesh()
        .disable_x_mesh()
        .y_desc(y_desc)
        .x_labels(n)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                arms.get(*i).map(|a| a.label.clone()).unwrap_or_default()
            }
            SegmentValue::Last => String::new(),
        })
        .draw()?;
    Ok(ch)
}

/// Capacity per arm at SLO `slo_index`: mean marker with 95% CI whiskers, per-seed dots.
pub fn capacity(
    s: &StudySummary,
    slo_index: usize,
    title: &str,
    first_step: f64,
) -> Result<String, String> {
    let arms = &s.arms;
    let ymax = upper(
        arms.iter().flat_map(|a| {
            let c = &a.capacity_qps[slo_index];
            [c.ci95[1], c.mean]
                .into_iter()
                .chain(c.per_seed.iter().map(|p| p.qps))
        }),
        1.0,
    );
    finish(|root| {
        let mut ch = arm_chart(root, title, arms, "SLO capacity (QPS)", ymax)?;
        for (i, a) in arms.iter().enumerate() {
            let c = &a.capacity_qps[slo_index];
            let col = colour(i);
            let x = SegmentValue::CenterOf(i);
            if c.ci95[0].is_finite() && c.ci95[1].is_finite() {
                ch.draw_series(std::iter::once(PathElement::new(
                    vec![(x.clone(), c.ci95[0].max(0.0)), (x.clone(), c.ci95[1])],
                    col.stroke_width(2),
                )))?;
            }
            // A censored seed is a bound, drawn as one: ▲ at the last step for "≥ last"
            // (it passed every step), ▼ at the first step for "< first" (it failed even that).
            for p in &c.per_seed {
                let at = (x.clone(), p.qps);
                match p.censored {
                    Censoring::Right => {
                        ch.draw_series(std::iter::once(TriangleMarker::new(at, 6, col.filled())))?;
                    }
                    Censoring::Left => {
                        let first = first_step;
                        ch.draw_series(std::iter::once(PathElement::new(
                            vec![(x.clone(), first), (x.clone(), 0.0)],
                            col.stroke_width(1),
                        )))?;
                        ch.draw_series(std::iter::once(
                            EmptyElement::at((x.clone(), first))
                                + Polygon::new(vec![(-6, -5), (6, -5), (0, 5)], col.filled()),
                        ))?;
                    }
                    Censoring::None => {
                        ch.draw_series(std::iter::once(Circle::new(at, 3, col.mix(0.5).filled())))?;
                    }
                }
            }
            if c.mean.is_finite() {
                ch.draw_series(std::iter::once(Cross::new(
                    (x.clone(), c.mean),
                    7,
                    col.stroke_width(3),
                )))?;
            }
            // Beside the bound, how many of the policy's seeds it holds for, with the way the
            // true capacity lies: ↑ above the last step, ↓ below the first.
            let label = ("sans-serif", 13).into_font().color(&col);
            for (mark, qps) in bound_marks(c, first_step) {
                ch.draw_series(std::iter::once(
                    EmptyElement::at((x.clone(), qps)) + Text::new(mark, (9, -6), label.clone()),
                ))?;
            }
        }
        if arms
            .iter()
            .any(|a| !bound_marks(&a.capacity_qps[slo_index], first_step).is_empty())
        {
            for (k, line) in CENSOR_LEGEND.iter().enumerate() {
                root.draw(&Text::new(
                    *line,
                    (15, SIZE.1 as i32 - 34 + 16 * k as i32),
                    ("sans-serif", 12).into_font(),
                ))?;
            }
        }
        Ok(())
    })
}

/// What the capacity plot says under the chart when some seed is censored.
pub const CENSOR_LEGEND: [&str; 2] = [
    "▲ ↑ k/n: k of n seeds passed every step (capacity ≥ the last step: a lower bound)",
    "▼ ↓ k/n: k of n seeds failed the first step (capacity < the first step: an upper bound)",
];

/// The bound marks of one policy's capacity: `↑ k/n` at the last step for the seeds that
/// passed every step (a lower bound), `↓ k/n` at the first step for those that failed even it
/// (an upper bound); none when no seed is censored.
pub fn bound_marks(
    c: &crate::analysis::study::CapacityStats,
    first_step: f64,
) -> Vec<(String, f64)> {
    let mut v = Vec::new();
    let right: Vec<f64> = c
        .per_seed
        .iter()
        .filter(|p| p.censored == Censoring::Right)
        .map(|p| p.qps)
        .collect();
    if !right.is_empty() {
        let at = right.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        v.push((format!("↑ {}/{}", right.len(), c.per_seed.len()), at));
    }
    let left = c
        .per_seed
        .iter()
        .filter(|p| p.censored == Censoring::Left)
        .count();
    if left > 0 {
        v.push((format!("↓ {left}/{}", c.per_seed.len()), first_step));
    }
    v
}

/// A line per arm of `y(step)` against offered QPS, optional horizontal SLO lines.
fn lines(
    s: &StudySummary,
    title: &str,
    y_desc: &str,
    y: impl Fn(&crate::analysis::study::StepAgg) -> f64,
    hlines: &[(f64, String)],
    y_floor: f64,
    y_cap: Option<f64>,
) -> Result<String, String> {
    // Values above the cap are drawn at it, so an overloaded policy does not squash the rest.
    let y = |st: &crate::analysis::study::StepAgg| {
        let v = y(st);
        match y_cap {
            Some(c) if v > c => c,
            _ => v,
        }
    };
    let xs: Vec<f64> = s
        .arms
        .iter()
        .flat_map(|a| a.steps.iter().map(|st| st.offered_qps))
        .collect();
    let xmax = upper(xs.iter().copied(), 1.0);
    let ymax = upper(
        s.arms
            .iter()
            .flat_map(|a| a.steps.iter().map(&y))
            .chain(hlines.iter().map(|h| h.0)),
        y_floor,
    );
    finish(|root| {
        let mut ch = ChartBuilder::on(root)
            .caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
        ch.configure_mesh()
            .x_desc("offered QPS")
            .y_desc(y_desc)
            .draw()?;
        for (i, a) in s.arms.iter().enumerate() {
            let col = colour(i);
            let pts: Vec<(f64, f64)> = a
                .steps
                .iter()
                .map(|st| (st.offered_qps, y(st)))
                .filter(|p| p.1.is_finite())
                .collect();
            ch.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                .label(a.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col));
            ch.draw_series(pts.iter().map(|p| Circle::new(*p, 3, col.filled())))?;
        }
        for (v, label) in hlines {
            ch.draw_series(DashedLineSeries::new(
                vec![(0.0, *v), (xmax, *v)],
                6,
                4,
                BLACK.stroke_width(1),
            ))?
            .label(label.clone())
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
        }
        ch.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    })
}

/// p99 of `metric` (mean over seeds) against offered QPS, with the SLOs on that metric.
pub fn p99(s: &StudySummary, metric: SloMetric, slos: &[Slo]) -> Result<String, String> {
    let name = match metric {
        SloMetric::E2e => "end-to-end",
        SloMetric::Ttft => "TTFT",
    };
    let h: Vec<(f64, String)> = slos
        .iter()
        .filter(|x| x.metric == metric)
        .map(|x| (x.p99_s, format!("SLO {} s", x.p99_s)))
        .collect();
    // Clip at 4× the loosest SLO on this metric: above it only "fails" matters.
    let cap = h
        .iter()
        .map(|x| x.0)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        .map(|m| 4.0 * m);
    let title = match cap {
        Some(c) => format!("{name} p99 against offered QPS (mean over seeds; clipped at {c} s)"),
        None => format!("{name} p99 against offered QPS (mean over seeds)"),
    };
    lines(
        s,
        &title,
        &format!("{name} p99 (s)"),
        |st| match metric {
            SloMetric::E2e => st.e2e_p99_s.mean,
            SloMetric::Ttft => st.ttft_p99_s.mean,
        },
        &h,
        1.0,
        cap,
    )
}

/// Request imbalance (max/mean) against offered QPS.
pub fn imbalance(s: &StudySummary) -> Result<String, String> {
    lines(
        s,
        "request imbalance (max / mean per destination)",
        "imbalance",
        |st| st.imbalance_requests.mean,
        &[(1.0, "perfect balance".into())],
        1.0,
        None,
    )
}

/// Served KV hit per arm (bars: mean over seeds; whisker: 95% CI), percent.
pub fn served_hit(s: &StudySummary) -> Result<String, String> {
    let arms: &[ArmSummary] = &s.arms;
    finish(|root| {
        let title = "served KV hit (mean over seeds, 95% CI)";
        let mut ch = arm_chart(root, title, arms, "served KV hit (%)", 100.0)?;
        for (i, a) in arms.iter().enumerate() {
            let col = colour(i);
            let h = a.served_kv_hit;
            if !h.mean.is_finite() {
                continue;
            }
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), h.mean * 100.0),
                ],
                col.mix(0.7).filled(),
            );
            bar.set_margin(0, 0, 12, 12);
            ch.draw_series(std::iter::once(bar))?;
            if h.ci95[0].is_finite() {
                let x = SegmentValue::CenterOf(i);
                ch.draw_series(std::iter::once(PathElement::new(
                    vec![
                        (x.clone(), (h.ci95[0] * 100.0).max(0.0)),
                        (x, (h.ci95[1] * 100.0).min(100.0)),
                    ],
                    BLACK.stroke_width(2),
                )))?;
            }
        }
        Ok(())
    })
}

/// A panel of the self-calibration plot: its title, its y range and the value of a plan.
type Series = (
    &'static str,
    f64,
    fn(&crate::analysis::record::PlanRecord) -> Option<f64>,
);

/// The self-calibration's choices interval by interval: W (top) and q_cap (bottom) against the
/// plan's time in the step, a line per tuned policy (its first seed's middle ladder step).
pub(crate) fn tuning(traces: &[crate::report::TuningTrace<'_>]) -> Result<String, String> {
    let xmax = upper(
        traces
            .iter()
            .flat_map(|t| t.plans.iter().map(|p| p.plan.at_s)),
        1.0,
    );
    let w_max = upper(
        traces.iter().flat_map(|t| {
            t.plans
                .iter()
                .filter_map(|p| p.plan.warm_slots.map(|w| w as f64))
        }),
        1.0,
    );
    let q_max = upper(
        traces
            .iter()
            .flat_map(|t| t.plans.iter().filter_map(|p| p.plan.q_cap)),
        1.0,
    );
    finish(|root| {
        let panels = root.split_evenly((2, 1));
        let series: [Series; 2] = [
            ("W (warm slots per destination)", w_max, |p| {
                p.warm_slots.map(|w| w as f64)
            }),
            ("q_cap (req/s per slot)", q_max, |p| {
                p.q_cap.filter(|q| q.is_finite())
            }),
        ];
        for (panel, (desc, ymax, y)) in panels.iter().zip(series) {
            let mut ch = ChartBuilder::on(panel)
                .caption(format!("{desc}, chosen per interval"), ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(60)
                .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
            ch.configure_mesh()
                .x_desc("time in step (s)")
                .y_desc(desc.split(' ').next().unwrap_or(desc))
                .draw()?;
            for (i, t) in traces.iter().enumerate() {
                let col = colour(i);
                let pts: Vec<(f64, f64)> = t
                    .plans
                    .iter()
                    .filter_map(|p| y(&p.plan).map(|v| (p.plan.at_s, v)))
                    .collect();
                let label = format!("{} (seed {}, {:.0} req/s)", t.label, t.seed, t.qps);
                ch.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))?
                    .label(label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col));
                ch.draw_series(pts.iter().map(|p| Circle::new(*p, 3, col.filled())))?;
            }
            ch.configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()?;
        }
        Ok(())
    })
}
