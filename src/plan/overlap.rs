//! Full admission with its two threads kept busy: admission, LPT placement and the dispatch
//! index overlapped with the end of the bucket sort. The plan is exactly the sequential one
//! (a test builds both ways and compares them to the bit).
//!
//! Keys are sorted by two threads, each owning half of the buckets (`bucket_sorted`). The
//! first thread's half holds the highest rates, so once it is sorted:
//! 1. the first thread admits its half in order (budget rule; k_b for replicated keys) and
//!    starts placing it by LPT (loads start at 0: every live destination starts at the same
//!    cold-tail load, added when the plan is complete — the sequential path does the same);
//! 2. the second thread, its half sorted, continues admission from where the first stopped
//!    (skipping, and closing the gap behind, keys whose k_b no longer fits), then builds the
//!    dispatch index while the first thread places the second half.
//!
//! When the first half does not admit whole and in order (a replicated key skipped there),
//! both threads stop after the sort and the sequential path runs on the sorted keys.

use super::{lpt, replicas_for, Admission, PlanEntry, PlanTable, PlannerConfig, SharedSlots};
use std::sync::{Barrier, Mutex, OnceLock};

/// The first half's admission.
#[derive(Clone, Copy)]
struct First {
    /// Every key of the first half up to `admitted` was admitted, none skipped.
    whole: bool,
    admitted: usize,
    used: u64,
    rate: f64,
    /// Admission ended inside the first half (budget full, or keys sending nothing).
    stopped: bool,
}

/// The second half's admission: keys admitted (moved to the front of the half), and the
/// running totals after them.
#[derive(Clone, Copy)]
struct Second {
    admitted: usize,
    used: u64,
    rate: f64,
}

/// What the overlapped path hands back besides the admission.
pub(super) struct Placed {
    pub dests: Vec<u16>,
    /// Per destination, the placed shares only (cold tail not yet added).
    pub loads: Vec<f64>,
    pub table: PlanTable,
}

/// Shared state of one overlapped build.
pub(super) struct Overlap<'a> {
    cfg: &'a PlannerConfig,
    r_live: usize,
    budget: u64,
    down: &'a [bool],
    total_rate: f64,
    first: OnceLock<First>,
    second: OnceLock<Second>,
    placed: Mutex<Option<(Vec<u16>, Vec<f64>)>>,
    table: OnceLock<PlanTable>,
}

impl<'a> Overlap<'a> {
    pub(super) fn new(
        cfg: &'a PlannerConfig,
        r_live: usize,
        down: &'a [bool],
        total_rate: f64,
    ) -> Self {
        Overlap {
            cfg,
            r_live,
            budget: cfg.warm_slots.saturating_mul(r_live as u64),
            down,
            total_rate,
            first: OnceLock::new(),
            second: OnceLock::new(),
            placed: Mutex::new(None),
            table: OnceLock::new(),
        }
    }

    /// k_b of a key of this rate (> 0).
    fn k_of(&self, rate: f64) -> u16 {
        if self.cfg.replication {
            replicas_for(rate, self.cfg.q_cap, self.r_live) as u16
        } else {
            1
        }
    }

    /// Thread `h`'s part, run by `bucket_sorted` once that thread's buckets are sorted; the
    /// second thread's buckets start at slot `from` of `n`.
    pub(super) fn run(
        &self,
        h: usize,
        barrier: &Barrier,
        slots: SharedSlots,
        from: usize,
        n: usize,
    ) {
        if h == 0 {
            // SAFETY: slots [0, from) are this thread's buckets, written and sorted; nothing
            // else touches them until the barrier below.
            let part = unsafe { std::slice::from_raw_parts_mut(slots.at(0), from) };
            let mut f = First {
                whole: true,
                admitted: 0,
                used: 0,
                rate: 0.0,
                stopped: false,
            };
            for e in part.iter_mut() {
                if e.rate == 0.0 {
                    f.stopped = true;
                    break;
                }
                let k = self.k_of(e.rate);
                if f.used + k as u64 > self.budget {
                    // Skipped: later keys would move forward; the sequential path does that.
                    f.whole = false;
                    break;
                }
                f.used += k as u64;
                e.k = k;
                f.rate += e.rate;
                f.admitted += 1;
                if f.used == self.budget {
                    f.stopped = true;
                    break;
                }
            }
            let _ = self.first.set(f);
            barrier.wait();
            if !f.whole {
                return;
            }
            let mut loads = vec![0.0; self.down.len()];
            let mut dests = Vec::new();
            lpt::place(
                &part[..f.admitted],
                &mut dests,
                &mut loads,
                self.down,
                self.total_rate,
            );
            barrier.wait();
            let s = *self
                .second
                .get()
                .expect("second half admitted before the barrier");
            // SAFETY: the second thread finished writing its half before the barrier; from here
            // on both threads only read.
            let rest = unsafe { std::slice::from_raw_parts(slots.at(from), s.admitted) };
            lpt::place(rest, &mut dests, &mut loads, self.down, self.total_rate);
            *self.placed.lock().expect("placement lock") = Some((dests, loads));
        } else {
            barrier.wait();
            let f = *self
                .first
                .get()
                .expect("first half admitted before the barrier");
            if !f.whole {
                return;
            }
            let mut s = Second {
                admitted: 0,
                used: f.used,
                rate: f.rate,
            };
            if !f.stopped {
                // SAFETY: slots [from, n) are this thread's buckets, written and sorted.
                let part = unsafe { std::slice::from_raw_parts_mut(slots.at(from), n - from) };
                for j in 0..part.len() {
                    let c = part[j];
                    if c.rate == 0.0 {
                        break;
                    }
                    let k = self.k_of(c.rate);
                    if s.used + k as u64 <= self.budget {
                        s.used += k as u64;
                        part[s.admitted] = PlanEntry { k, ..c };
                        s.admitted += 1;
                        s.rate += c.rate;
                        if s.used == self.budget {
                            break;
                        }
                    }
                }
            }
            let _ = self.second.set(s);
            barrier.wait();
            // Admitted: [0, f.admitted) and, when the first half admitted whole and did not
            // stop, [from, from + s.admitted) right after it.
            let total = f.admitted + s.admitted;
            // SAFETY: both halves are final (the barrier above); both threads only read.
            let all = unsafe { std::slice::from_raw_parts(slots.at(0), total) };
            let _ = self.table.set(PlanTable::new(all));
        }
    }

    /// After the sort: the admission and placement done, or (when the first half did not admit
    /// whole) the sorted keys for the sequential path.
    pub(super) fn finish(
        self,
        mut sorted: Vec<PlanEntry>,
    ) -> Result<(Admission, Option<Placed>), Vec<PlanEntry>> {
        let f = match self.first.get() {
            Some(f) if f.whole => *f,
            _ => return Err(sorted),
        };
        let s = *self.second.get().expect("second half admitted");
        sorted.truncate(f.admitted + s.admitted);
        let (dests, loads) = self
            .placed
            .into_inner()
            .expect("placement lock")
            .expect("placed");
        let table = self.table.into_inner().expect("indexed");
        Ok((
            Admission {
                entries: sorted,
                slots_used: s.used,
                admitted_rate: s.rate,
                total_rate: self.total_rate,
            },
            Some(Placed {
                dests,
                loads,
                table,
            }),
        ))
    }
}
