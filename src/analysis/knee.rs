//! Locating a knee between two ladder steps: bisection on a fixed logarithmic grid of rates,
//! between a rate that passes the SLO and a higher one that fails. Used by `cacheroute
//! calibrate` (a single replica's knee, q_cap), by `cacheroute advise` (each policy's capacity
//! per seed, to within 5%) and by studies whose spec asks for `refine:` (docs/studies.md).
//!
//! The grid is the same whatever ladder found the bracket (`per_doubling` points per doubling
//! of the rate, 2^(k / per_doubling) req/s), so two ladders that bracket the same knee probe the
//! same rates. A bisection probes only grid points strictly between the two ends; the bracket
//! it returns (a rate that passed, the lowest rate above it that failed) is at most one grid
//! step wide. Each probe is one measured step (a simulated or real run at that rate): the
//! caller passes it in, so this stays pure.
//!
//! Probes are stored beside the ladder's own steps with step indices from
//! [`PROBE_STEP_BASE`] up: they count towards capacity, never towards the per-step tables or
//! the ladder means (`analysis::study`).

/// Step index of a run's first knee probe; indices below it are the ladder's own steps.
pub const PROBE_STEP_BASE: usize = 1_000_000;

use super::capacity::{decides, passes};
use super::model::{Slo, StepMetrics};

/// Whether a stored step index is a knee probe rather than a ladder step.
pub fn is_probe(step: usize) -> bool {
    step >= PROBE_STEP_BASE
}

/// A logarithmic grid of rates: `per_doubling` points per doubling, 2^(k / per_doubling).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KneeGrid {
    per_doubling: f64,
}

impl KneeGrid {
    pub const fn new(per_doubling: f64) -> Self {
        Self { per_doubling }
    }

    /// The coarsest grid whose step is at most `resolution` (relative: 0.05 = 5%):
    /// ⌈ln 2 / ln(1 + resolution)⌉ points per doubling (15 for 5%: steps of 4.7%).
    pub fn for_resolution(resolution: f64) -> Self {
        let r = resolution.clamp(1e-6, 1.0);
        Self::new((2f64.ln() / r.ln_1p() - 1e-9).ceil().max(1.0))
    }

    /// One grid step as a ratio of rates (2^(1 / per_doubling)).
    pub fn step_ratio(&self) -> f64 {
        2f64.powf(1.0 / self.per_doubling)
    }

    /// The rate of grid index `k`.
    pub fn point(&self, k: i64) -> f64 {
        2f64.powf(k as f64 / self.per_doubling)
    }

    /// The largest grid index whose point is at most `x` (tolerant of rounding at a point).
    pub fn index_at_or_below(&self, x: f64) -> i64 {
        if !x.is_finite() {
            return 64 * self.per_doubling as i64;
        }
        let k = (x.max(1e-9).log2() * self.per_doubling + 1e-9).floor() as i64;
        if self.point(k + 1) <= x {
            k + 1
        } else {
            k
        }
    }
}

/// What a bisection found: `passes` passed (the bracket's lower end, or a probed grid point
/// above it), `fails` failed (the upper end, or a probed grid point below it), and no grid
/// point lies strictly between them. `probes` rates were measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bracket {
    pub passes: f64,
    pub fails: f64,
    pub probes: usize,
}

/// Bisect between `passes` (a rate that passed) and `fails` (a higher rate that failed) on
/// `grid`: `probe(q)` measures rate `q` and says whether it passed. Assumes the pass/fail of
/// rates is monotone between the two ends (as the capacity rule does: a step passing above a
/// failing one does not count). At most ⌈log2(n + 1)⌉ probes for the n grid points between the
/// ends; none when the ends are already within one grid step.
pub fn bisect<E>(
    grid: &KneeGrid,
    passes: f64,
    fails: f64,
    mut probe: impl FnMut(f64) -> Result<bool, E>,
) -> Result<Bracket, E> {
    let mut lo = grid.index_at_or_below(passes);
    let mut hi = grid.index_at_or_below(fails);
    if grid.point(hi) >= fails {
        hi -= 1;
    }
    // Invariant: `pass_at` passed and every grid index in (lo, hi] lies above it; `fail_at`
    // failed and every index above `hi` is at or above it.
    let (mut pass_at, mut fail_at) = (passes, fails);
    let mut probes = 0;
    while lo < hi {
        let mid = lo + (hi - lo + 1) / 2;
        let q = grid.point(mid);
        probes += 1;
        if probe(q)? {
            lo = mid;
            pass_at = q;
        } else {
            hi = mid - 1;
            fail_at = q;
        }
    }
    Ok(Bracket {
        passes: pass_at,
        fails: fail_at,
        probes,
    })
}

/// The next ladder step a knee search (`search: knee`, docs/studies.md) measures, given the
/// ladder indices measured so far with their metrics, or None when the search is done.
///
/// With nothing measured it starts at `start`. Then, with `lo` and `hi` the lowest and highest
/// index measured (the search measures a contiguous run of ladder steps):
/// 1. **down** while the lowest step fails some SLO and a lower step exists: that SLO's
///    capacity needs a passing step below its failure (or the ladder's bottom: left-censored);
/// 2. else **up** while some SLO has no failing step and a higher step exists: its capacity
///    needs a failure above its passes (or the ladder's top: right-censored);
/// 3. else done: every SLO's capacity over the measured steps is what it would be over the
///    whole ladder, provided pass and fail are monotone in the rate outside them (a step that
///    would pass above a measured failure, or fail below a measured pass, is never seen —
///    the price of not measuring it).
pub fn next_ladder_step(
    measured: &[(usize, &StepMetrics)],
    slos: &[Slo],
    ladder_len: usize,
    start: usize,
) -> Option<usize> {
    if ladder_len == 0 {
        return None;
    }
    let Some(lo) = measured.iter().map(|m| m.0).min() else {
        return Some(start.min(ladder_len - 1));
    };
    let hi = measured.iter().map(|m| m.0).max().unwrap_or(lo);
    if lo > 0 && needs_lower(measured, lo, slos) {
        return Some(lo - 1);
    }
    if hi + 1 < ladder_len && needs_higher(measured, slos) {
        return Some(hi + 1);
    }
    None
}

/// Whether a step is a measured failure of an SLO (a step cut early decides only the SLOs it
/// was cut for).
fn fails(m: &StepMetrics, s: &Slo) -> bool {
    decides(m, s) && !passes(m, s)
}

/// Whether the lowest measured step (`lo`) fails some SLO.
fn needs_lower(measured: &[(usize, &StepMetrics)], lo: usize, slos: &[Slo]) -> bool {
    measured
        .iter()
        .filter(|m| m.0 == lo)
        .any(|m| slos.iter().any(|s| fails(m.1, s)))
}

/// Whether some SLO has no failing step among the measured ones.
fn needs_higher(measured: &[(usize, &StepMetrics)], slos: &[Slo]) -> bool {
    slos.iter().any(|s| !measured.iter().any(|m| fails(m.1, s)))
}

/// The SLOs whose capacity a step at `qps` can still change, given a run's steps so far: for
/// each SLO, `qps` lies strictly between its capacity over them (−∞ when left-censored) and
/// the lowest rate above that which fails it (+∞ when none). A step below the capacity or at
/// or above a failure tells that SLO nothing the monotone rule does not already assume; this
/// is what a step is cut for (`analysis::early`).
pub fn undecided_slos<'a>(
    measured: impl Iterator<Item = &'a StepMetrics> + Clone,
    slos: &[Slo],
    qps: f64,
) -> Vec<Slo> {
    slos.iter()
        .filter(|s| {
            let cap = super::capacity::capacity(measured.clone(), s);
            let pass_at = match cap.censored {
                super::model::Censoring::Left => f64::NEG_INFINITY,
                _ => cap.qps,
            };
            let fail_at = measured
                .clone()
                .filter(|m| m.offered_qps > pass_at && fails(m, s))
                .map(|m| m.offered_qps)
                .fold(f64::INFINITY, f64::min);
            pass_at < qps && qps < fail_at
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_the_same_whatever_the_ladder() {
        let g = KneeGrid::new(16.0);
        for k in -40..200 {
            assert_eq!(g.index_at_or_below(g.point(k)), k, "{k}");
            assert_eq!(g.index_at_or_below(g.point(k) * 1.01), k);
            assert_eq!(g.index_at_or_below(g.point(k) * 0.99), k - 1);
        }
        assert_eq!(g.index_at_or_below(4.0), 32);
    }

    #[test]
    fn a_resolution_gives_a_grid_no_coarser() {
        for r in [0.01, 0.02, 0.05, 0.1, 0.26, 0.5, 0.99] {
            let g = KneeGrid::for_resolution(r);
            assert!(g.step_ratio() <= 1.0 + r + 1e-12, "{r}: {}", g.step_ratio());
        }
        assert_eq!(KneeGrid::for_resolution(0.05), KneeGrid::new(15.0));
    }

    /// Bisect a knee at `knee` (rates up to it pass) between `lo` and `hi`.
    fn find(knee: f64, lo: f64, hi: f64) -> (Bracket, Vec<f64>) {
        let g = KneeGrid::for_resolution(0.05);
        let mut seen = Vec::new();
        let b = bisect::<()>(&g, lo, hi, |q| {
            seen.push(q);
            Ok(q <= knee)
        })
        .unwrap();
        (b, seen)
    }

    #[test]
    fn the_bracket_holds_the_knee_within_one_grid_step() {
        // A 1.26× ladder gap (100 → 126) holds four or five grid points: three probes at most.
        for knee in [100.0, 101.0, 104.0, 110.0, 115.5, 120.0, 125.9] {
            let (b, seen) = find(knee, 100.0, 126.0);
            assert!(b.passes <= knee && knee < b.fails, "{knee}: {b:?}");
            assert!(b.fails / b.passes <= 1.05, "{knee}: {b:?}");
            assert!(b.probes <= 3 && b.probes == seen.len(), "{knee}: {b:?}");
            assert!(seen.iter().all(|&q| 100.0 < q && q < 126.0), "{seen:?}");
        }
        // No grid point between the ends (2^(99/15) ≈ 97.0, 2^(100/15) ≈ 101.6): nothing to
        // probe.
        let (b, seen) = find(100.0, 98.0, 101.5);
        assert_eq!((b.passes, b.fails, b.probes), (98.0, 101.5, 0));
        assert!(seen.is_empty());
        // A wide gap (a coarse ladder, 2×): still within 5%, in log2(15) ≈ 4 probes.
        let (b, _) = find(173.0, 100.0, 200.0);
        assert!(b.passes <= 173.0 && 173.0 < b.fails && b.fails / b.passes <= 1.05);
        assert!(b.probes <= 4, "{b:?}");
    }

    /// A step at ladder index `i` of a monotone profile: it passes SLO `s` when `i` ≤
    /// `knees[s]` (the SLOs' p99 bounds are 1 s apart; the step's p99 is set between them).
    fn profile_step(i: usize, knees: &[i64], slos: &[Slo]) -> StepMetrics {
        // Highest bound this step meets: p99 just above the bounds of SLOs it fails.
        let mut p99 = 0.5;
        for (s, k) in knees.iter().enumerate() {
            if (i as i64) > *k {
                p99 = f64::max(p99, slos[s].p99_s + 0.5);
            }
        }
        StepMetrics {
            offered_qps: 10.0 * (i + 1) as f64,
            achieved_qps: 10.0 * (i + 1) as f64,
            requests: 1000,
            e2e_p99_s: p99,
            ttft_p99_s: p99,
            window_s: 100.0,
            ..Default::default()
        }
    }

    /// Run a search over a profile with `next` as its rule; the capacities it finds per SLO
    /// and how many steps it measured.
    fn search_with(
        next: impl Fn(&[(usize, &StepMetrics)], &[Slo], usize, usize) -> Option<usize>,
        knees: &[i64],
        slos: &[Slo],
        len: usize,
        start: usize,
    ) -> (Vec<(f64, crate::analysis::model::Censoring)>, usize) {
        let mut got: Vec<(usize, StepMetrics)> = Vec::new();
        loop {
            let view: Vec<(usize, &StepMetrics)> = got.iter().map(|(i, m)| (*i, m)).collect();
            let Some(i) = next(&view, slos, len, start) else {
                break;
            };
            assert!(got.iter().all(|g| g.0 != i), "step {i} measured twice");
            got.push((i, profile_step(i, knees, slos)));
            assert!(got.len() <= len, "the search did not stop");
        }
        let caps = slos
            .iter()
            .map(|s| {
                let c = crate::analysis::capacity::capacity(got.iter().map(|g| &g.1), s);
                (c.qps, c.censored)
            })
            .collect();
        (caps, got.len())
    }

    fn two_slos() -> Vec<Slo> {
        use crate::analysis::model::SloMetric;
        vec![
            Slo {
                metric: SloMetric::E2e,
                p99_s: 2.0,
            },
            Slo {
                metric: SloMetric::E2e,
                p99_s: 4.0,
            },
        ]
    }

    /// Every monotone profile (each SLO's knee anywhere from below the ladder to above it, the
    /// looser SLO's no lower), every start: the search finds the whole ladder's capacities, in
    /// fewer steps than the ladder unless a knee is at an end.
    #[test]
    fn the_search_finds_the_whole_ladder_s_capacities() {
        let slos = two_slos();
        let len = 7;
        for tight in -1..len as i64 {
            for loose in tight..len as i64 {
                let knees = [tight, loose];
                let whole: Vec<StepMetrics> =
                    (0..len).map(|i| profile_step(i, &knees, &slos)).collect();
                let expect: Vec<_> = slos
                    .iter()
                    .map(|s| {
                        let c = crate::analysis::capacity::capacity(whole.iter(), s);
                        (c.qps, c.censored)
                    })
                    .collect();
                for start in 0..len {
                    let (caps, n) = search_with(next_ladder_step, &knees, &slos, len, start);
                    assert_eq!(caps, expect, "knees {knees:?} start {start}");
                    // From the tight knee: the steps up to one above the loose one.
                    if start as i64 == tight.max(0) {
                        let want = ((loose + 2).min(len as i64) - tight.max(0)) as usize;
                        assert_eq!(n, want, "knees {knees:?}");
                    }
                }
            }
        }
    }

    /// The stop rule broken on purpose, two ways: stopping at the first failure of any SLO
    /// (not of every SLO), and never stepping down from a failing start. Each moves knees.
    #[test]
    fn a_broken_stop_rule_moves_the_knees() {
        let slos = two_slos();
        let len = 7;
        let stop_at_first_failure =
            |m: &[(usize, &StepMetrics)], s: &[Slo], len: usize, start: usize| {
                let any_failed = m.iter().any(|m| s.iter().any(|s| !passes(m.1, s)));
                if any_failed {
                    None
                } else {
                    next_ladder_step(m, s, len, start)
                }
            };
        let never_down = |m: &[(usize, &StepMetrics)], s: &[Slo], len: usize, start: usize| {
            match next_ladder_step(m, s, len, start) {
                Some(i) if m.iter().any(|m| m.0 > i) => None,
                n => n,
            }
        };
        // Knees at 2 (tight) and 4 (loose), started at 2.
        let knees = [2, 4];
        let (right, _) = search_with(next_ladder_step, &knees, &slos, len, 2);
        let (broken, _) = search_with(stop_at_first_failure, &knees, &slos, len, 2);
        assert_eq!(right[1].0, 50.0);
        assert_ne!(broken, right, "stopping at the first failure");
        // Started above both knees.
        let (right, _) = search_with(next_ladder_step, &knees, &slos, len, 6);
        let (broken, _) = search_with(never_down, &knees, &slos, len, 6);
        assert_eq!((right[0].0, right[1].0), (30.0, 50.0));
        assert_ne!(broken, right, "never stepping down");
    }

    /// A step at rate `q` whose p99 is `p99` (the two SLOs' bounds are 2 s and 4 s).
    fn at(q: f64, p99: f64) -> StepMetrics {
        StepMetrics {
            offered_qps: q,
            achieved_qps: q,
            requests: 1000,
            e2e_p99_s: p99,
            window_s: 100.0,
            ..Default::default()
        }
    }

    /// A step can inform an SLO only strictly between its capacity and its first failure
    /// above: 10 passes both, 20 fails the tight one, 30 fails both.
    #[test]
    fn a_step_is_cut_only_for_the_slos_it_can_still_inform() {
        let slos = two_slos();
        let m = [at(10.0, 1.0), at(20.0, 3.0), at(30.0, 5.0)];
        let u = |q: f64| undecided_slos(m.iter(), &slos, q);
        assert_eq!(u(15.0), vec![slos[0]]);
        assert_eq!(u(25.0), vec![slos[1]]);
        assert!(u(5.0).is_empty() && u(20.0).is_empty() && u(35.0).is_empty());
        // Nothing measured: every SLO. The lowest step failing: every rate below it.
        assert_eq!(undecided_slos([].iter(), &slos, 7.0), slos);
        let low = [at(10.0, 5.0)];
        assert_eq!(undecided_slos(low.iter(), &slos, 5.0), slos);
        // A step cut for the tight SLO only is no measurement of the loose one: its
        // capacity is still 10 and 20 can still inform it.
        let mut cut = at(20.0, 1.0);
        cut.cut = Some(crate::analysis::model::Cut {
            fails: vec![slos[0]],
            at_s: 50.0,
            violations: 30,
            errors: 0,
            window_requests: 1000,
        });
        let m = [at(10.0, 1.0), cut];
        assert!(!passes(&m[1], &slos[0]) && !decides(&m[1], &slos[1]));
        let cap = crate::analysis::capacity::capacity(m.iter(), &slos[1]);
        assert_eq!(cap.qps, 10.0);
        assert_eq!(undecided_slos(m.iter(), &slos, 20.0), vec![slos[1]]);
    }

    #[test]
    fn a_probe_error_stops_the_bisection() {
        let g = KneeGrid::for_resolution(0.05);
        let mut n = 0;
        let e = bisect(&g, 100.0, 126.0, |_| {
            n += 1;
            Err("engine died")
        });
        assert_eq!((e, n), (Err("engine died"), 1));
    }
}
