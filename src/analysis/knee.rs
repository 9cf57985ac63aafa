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
