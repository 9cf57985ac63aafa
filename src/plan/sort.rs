//! The admission order in one pass: a bucket sort of the candidates by rate (IEEE bits as
//! bucket keys), on two threads for large plans, with the small-sort and insertion-sort finish.
//! The only `unsafe` of the planner outside the SIMD kernels: the two threads write disjoint
//! buckets of shared arrays ([`SharedSlots`]) and read them after a barrier.

use super::*;

/// Plans with at least this many entries are built on two threads where that is exact: the
/// bucket sort's two halves, and the dispatch index beside the placement (on the helper
/// thread of [`pair`]; smaller plans take well under a millisecond on one).
pub(super) const PARALLEL_MIN: usize = 1 << 15;

/// The bucket range of [`bucket_sorted`]: the least and greatest IEEE bits of the candidates'
/// rates, or the input itself, when the sort also does [`scan_keys`]'s pass.
pub(super) enum SortRange<'a> {
    Known(u64, u64),
    Scan(&'a [KeyLoad]),
}

/// Buckets holding more candidates than this are sorted by merge sort, not by insertion (an
/// input of many equal rates, or a range estimated from a sample that missed its extremes).
pub(super) const INSERTION_MAX: usize = 32;

/// Candidates `candidate(0..n)` in admission order ([`by_rate_then_key`]), where `eff(i)` is
/// candidate i's rate (≥ +0): a counting sort over the rates' IEEE patterns (which order like
/// the rates; [`BucketMap`] spreads the buckets as a sample of 4,096 rates lies) puts each
/// candidate in its bucket of about two, then each bucket is sorted by insertion. Linear in n
/// for the rate distributions the planner sees, with no comparison sort of the whole array.
///
/// With [`SortRange::Scan`] the bucket range comes from the sample too (rates outside it go to
/// the end buckets: the order stays exact) and the counting pass is also the input's
/// validation and sum ([`KeyScan`]; the total rate is returned): one pass over the input
/// instead of two.
///
/// On a large input two threads share the work, and the output does not depend on it. They
/// count chunks of the input from either end (the helper from the front, the caller from the
/// back, so a helper that starts late leaves no one waiting) until they meet; both then know
/// every bucket's place; each scatters the candidates it counted (the front part's go first in
/// each bucket, as one thread would put them) and each sorts half of the buckets.
pub(super) fn bucket_sorted(
    n: usize,
    range: SortRange,
    eff: impl Fn(usize) -> f64 + Sync,
    candidate: impl Fn(usize) -> PlanEntry + Sync,
    scatter_by: Option<ScatterBy>,
) -> Result<Sorted, PlanError> {
    let scan_input = match range {
        SortRange::Scan(keys) => Some(keys),
        SortRange::Known(..) => None,
    };
    if n < 1024 {
        let scan = scan_input.map(scan_keys).transpose()?.map(|s| s.total_rate);
        let mut v: Vec<PlanEntry> = (0..n).map(candidate).collect();
        v.sort_by(by_rate_then_key);
        return Ok(Sorted {
            cands: v,
            total_rate: scan,
            scratch: Vec::new(),
        });
    }
    let step = n.div_ceil(SAMPLE);
    let (lo, hi) = match range {
        SortRange::Known(lo, hi) => (lo, hi),
        SortRange::Scan(_) => (0..n).step_by(step).fold((u64::MAX, 0), |(lo, hi), i| {
            let b = eff(i).to_bits();
            (lo.min(b), hi.max(b))
        }),
    };
    let map = BucketMap::new(
        lo,
        hi,
        (0..n).step_by(step).map(|i| eff(i).to_bits()),
        (n / 2).clamp(1, 1 << 21),
    );
    let buckets = map.buckets;
    let bucket = |i: usize| map.bucket(eff(i).to_bits());
    let parts = if n >= PARALLEL_MIN { 2 } else { 1 };
    let chunks = n.div_ceil(SCAN_CHUNK);
    // Chunks not yet counted: [front, back).
    let claims = std::sync::Mutex::new((0usize, chunks));
    let mut out: Vec<PlanEntry> = Vec::with_capacity(n);
    let mut scans: Vec<Result<KeyScan, PlanError>> = Vec::with_capacity(chunks);
    // One buffer holds each input's bucket (n) and then each part's count per bucket, turned
    // in place into its next slot in each bucket; the plan's dispatch index takes it over
    // afterwards ([`PlanTable::new_in`]), its pages already mapped.
    let mut scratch: Vec<u32> =
        Vec::with_capacity((n + parts * buckets).max(PlanTable::len_for(n)));
    let (slots, of_slots, scan_slots, count_slots) = (
        SharedSlots(out.as_mut_ptr()),
        SharedSlots(scratch.as_mut_ptr()),
        SharedSlots(scans.as_mut_ptr()),
        // SAFETY: n lies within the capacity.
        SharedSlots(unsafe { scratch.as_mut_ptr().add(n) }),
    );
    // The first bucket at or past half the candidates: the second part sorts from there.
    let mid = OnceLock::new();
    let totals: [OnceLock<u32>; 2] = Default::default();
    let barrier = pair::SpinBarrier::new(parts);
    let work = |h: usize| {
        // SAFETY: until the barrier each part touches only its own counts, which lie within
        // the scratch buffer's capacity; it sets them to zero first (zero bytes are zero).
        let hist = unsafe {
            std::ptr::write_bytes(count_slots.at(h * buckets), 0, buckets);
            std::slice::from_raw_parts_mut(count_slots.at(h * buckets), buckets)
        };
        loop {
            let c = {
                let mut cl = claims.lock().unwrap_or_else(|e| e.into_inner());
                if cl.0 == cl.1 {
                    break;
                }
                if h == 0 {
                    cl.0 += 1;
                    cl.0 - 1
                } else {
                    cl.1 -= 1;
                    cl.1
                }
            };
            let inputs = c * SCAN_CHUNK..((c + 1) * SCAN_CHUNK).min(n);
            let Some(keys) = scan_input else {
                for i in inputs {
                    let b = bucket(i);
                    hist[b as usize] += 1;
                    // SAFETY: input i lies in a chunk this thread claimed.
                    unsafe { of_slots.at(i).write(b) };
                }
                continue;
            };
            // The chunk's scan in the same loop: its sum in input order, as [`scan_chunk`]
            // takes it (which finds the first bad rate, if any).
            let (mut total_rate, mut valid) = (0.0, true);
            for (i, k) in inputs.clone().zip(&keys[inputs.clone()]) {
                let r = k.rate;
                valid &= r.is_finite() & (r >= 0.0);
                total_rate += r;
                let b = map.bucket(if r > 0.0 { r.to_bits() } else { 0 });
                hist[b as usize] += 1;
                // SAFETY: input i lies in a chunk this thread claimed.
                unsafe { of_slots.at(i).write(b) };
            }
            let scan = if valid {
                Ok(KeyScan {
                    total_rate,
                    bits_lo: 0,
                    bits_hi: 0,
                })
            } else {
                scan_chunk(&keys[inputs.clone()], inputs.start)
            };
            // SAFETY: chunk c is claimed by this thread alone; each chunk's slot is written
            // once, within `scans`' capacity.
            unsafe { scan_slots.at(c).write(scan) };
        }
        barrier.wait();
        // Both parts read the same chunk scans and stop together on a bad rate.
        if scan_input.is_some() {
            // SAFETY: every chunk was scanned before the barrier.
            let sc = unsafe { std::slice::from_raw_parts(scan_slots.at(0), chunks) };
            if sc.iter().any(|r| r.is_err()) {
                return;
            }
        }
        // Counts to cursors, in place: in each bucket the first part's candidates go first, as
        // one thread would put them. Each part turns half of the buckets, the second starting
        // from the candidates in the first half.
        let half_b = buckets / parts;
        let my_buckets = if h == 0 { 0..half_b } else { half_b..buckets };
        // SAFETY: for the reads and writes through `count_slots` below, up to the barrier, each
        // part touches only the counts of its own buckets, in both parts' arrays.
        let (pa, pb) = (
            |x: usize| count_slots.at(x),
            |x: usize| count_slots.at(buckets * (parts - 1) + x),
        );
        // SAFETY: `x` is one of this part's buckets (< `buckets`), before the barrier.
        let in_bucket = |x: usize| unsafe { *pa(x) + if parts == 2 { *pb(x) } else { 0 } };
        totals[h]
            .set(my_buckets.clone().map(in_bucket).sum())
            .expect("each part totals once");
        barrier.wait();
        let mut acc = if h == 0 {
            0
        } else {
            *totals[0].get().expect("first part totalled")
        };
        // The first bucket whose start is at or past half the candidates (the first part finds
        // it up to `half_b` included): the second part's buckets start there.
        let half_n = (n / 2) as u32;
        let mut found = h == 1 && acc >= half_n;
        for x in my_buckets {
            if !found && acc >= half_n {
                found = true;
                let _ = mid.set(x);
            }
            // SAFETY: `x` is one of this part's buckets; no other part touches its counts.
            unsafe {
                let a = *pa(x);
                *pa(x) = acc;
                acc += a;
                if parts == 2 {
                    let b = *pb(x);
                    *pb(x) = acc;
                    acc += b;
                }
            }
        }
        if h == 0 && !found && acc >= half_n {
            let _ = mid.set(half_b);
        }
        barrier.wait();
        // The first part counted the inputs before `split`, the second those after it.
        let front = claims.lock().unwrap_or_else(|e| e.into_inner()).0;
        let split = (front * SCAN_CHUNK).min(n);
        let m = mid.get().copied().unwrap_or(buckets);
        let mine = match (parts, h) {
            (1, _) => 0..buckets,
            (_, 0) => 0..m,
            _ => m..buckets,
        };
        // SAFETY: every input's bucket was written before the first barrier.
        let of = unsafe { std::slice::from_raw_parts(of_slots.at(0), n) };
        let by = scatter_by.unwrap_or(if parts == 2 && front.min(chunks - front) * 3 < chunks {
            ScatterBy::Buckets
        } else {
            ScatterBy::Inputs
        });
        match by {
            ScatterBy::Inputs => {
                // Each part writes the candidates it counted, with its own cursors.
                let inputs = if h == 0 { 0..split } else { split..n };
                let base = h * buckets;
                for i in inputs {
                    let c = count_slots.at(base + of[i] as usize);
                    // SAFETY: the cursors of this part are its alone until the barrier; slot
                    // `*c` lies in bucket b's range, reserved for this part's candidates of
                    // bucket b by the counts; each is written once, by one thread, within
                    // `out`'s capacity n.
                    unsafe {
                        slots.at(*c as usize).write(candidate(i));
                        *c += 1;
                    }
                }
            }
            ScatterBy::Buckets => {
                // One part counted much more than the other (a thread that came late): each
                // part writes the candidates of its own buckets instead, reading every input
                // in order (the first part's counted inputs with the first part's cursors,
                // the rest with the second's) and writing an input of the other part's
                // buckets to a spare entry, without a branch on the data.
                let (first, len) = (mine.start as u32, (mine.end - mine.start) as u32);
                let mut spare_cursor = 0u32;
                let mut spare = std::mem::MaybeUninit::<PlanEntry>::uninit();
                for (i, &b) in of.iter().enumerate() {
                    let own = b.wrapping_sub(first) < len;
                    let c = match (own, i < split) {
                        (true, true) => pa(b as usize),
                        (true, false) => pb(b as usize),
                        (false, _) => &mut spare_cursor,
                    };
                    // SAFETY: `c` is a cursor of one of this part's buckets (no other thread
                    // touches those until the barrier) or the spare one, which stays 0; an
                    // own slot is written once, as above.
                    unsafe {
                        let to = if own {
                            slots.at(*c as usize)
                        } else {
                            spare.as_mut_ptr()
                        };
                        to.write(candidate(i));
                        *c += own as u32;
                    }
                }
            }
        }
        barrier.wait();
        // The last part's cursors now end the buckets.
        // SAFETY: no cursor moves after the barrier above.
        let ends =
            unsafe { std::slice::from_raw_parts(count_slots.at((parts - 1) * buckets), buckets) };
        let mut s = if mine.start == 0 {
            0
        } else {
            ends[mine.start - 1] as usize
        };
        for b in mine {
            let e = ends[b] as usize;
            // SAFETY: every slot was written before the barrier above; the buckets sorted here
            // are this thread's alone.
            let v = unsafe { std::slice::from_raw_parts_mut(slots.at(s), e - s) };
            if v.len() <= INSERTION_MAX {
                small_sort(v);
            } else {
                v.sort_by(by_rate_then_key);
            }
            s = e;
        }
    };
    if parts == 2 {
        pair::join(|| work(0), || work(1));
    } else {
        work(0);
    }
    let scan = match scan_input {
        None => None,
        Some(_) => {
            // SAFETY: every chunk was scanned.
            unsafe { scans.set_len(chunks) };
            Some(fold_scans(scans.into_iter())?.total_rate)
        }
    };
    // SAFETY: all n slots were written (the bucket counts sum to n): a bad rate returned
    // above, before the scatter could have left any unwritten.
    unsafe { out.set_len(n) };
    Ok(Sorted {
        cands: out,
        total_rate: scan,
        scratch,
    })
}

/// How the two parts of [`bucket_sorted`] share the scatter (the result is the same).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum ScatterBy {
    /// Each part writes the inputs it counted.
    Inputs,
    /// Each part writes the inputs of the buckets it sorts afterwards.
    Buckets,
}

/// What [`bucket_sorted`] returns: the candidates in admission order, the input's total rate
/// when the sort also scanned it, and the memory it used and no longer needs.
pub(super) struct Sorted {
    pub(super) cands: Vec<PlanEntry>,
    pub(super) total_rate: Option<f64>,
    pub(super) scratch: Vec<u32>,
}

/// Rates sampled by [`bucket_sorted`] for its bucket range and [`BucketMap`].
pub(super) const SAMPLE: usize = 4096;

/// Where [`bucket_sorted`] puts a rate: buckets spread over the rates' IEEE bits as densely as
/// a sample of them lies. The range `lo..=hi` is cut into at most [`BucketMap::CELLS`] equal
/// cells of bit patterns; each cell gets a power of two of equal buckets, about as many as half
/// the keys the sample puts in it (at least one). A rate distribution that is dense in a few
/// octaves (many keys at low rates) thus still gets about two keys a bucket, where equal
/// buckets over the whole range would crowd the dense octaves and leave most buckets empty.
/// Rates outside `lo..=hi` go to the end buckets. Higher rates map to lower buckets.
pub(super) struct BucketMap {
    pub(super) lo: u64,
    pub(super) hi: u64,
    /// A cell covers 2^cell_shift bit patterns.
    pub(super) cell_shift: u32,
    /// Per cell: (index of its highest-rate bucket) << 6 | (shift of an offset in the cell to
    /// its bucket within the cell).
    pub(super) cells: Vec<u32>,
    /// Number of buckets.
    pub(super) buckets: usize,
}

impl BucketMap {
    pub(super) const CELLS: usize = 1024;

    /// The map for rates in `lo..=hi` with `sample` (IEEE bits), aiming at `target` buckets.
    pub(super) fn new(lo: u64, hi: u64, sample: impl Iterator<Item = u64>, target: usize) -> Self {
        let (lo, hi) = if lo > hi { (0, 0) } else { (lo, hi) };
        let span_bits = 64 - (hi - lo).leading_zeros();
        let cell_shift = span_bits.saturating_sub(Self::CELLS.trailing_zeros());
        let used = ((hi - lo) >> cell_shift) as usize + 1;
        let mut hits = vec![0u32; used];
        let mut taken = 0usize;
        for b in sample {
            hits[((b.clamp(lo, hi) - lo) >> cell_shift) as usize] += 1;
            taken += 1;
        }
        // Buckets per sampled key; each cell's count rounded to a power of two (the nearest,
        // in log terms), no finer than single bit patterns.
        let per_hit = target as f64 / taken.max(1) as f64;
        let mut first = 0usize;
        let mut cells = Vec::with_capacity(used);
        for &h in &hits {
            let want = h as f64 * per_hit;
            let p = if want > 1.0 {
                (want.log2().round() as u32).min(cell_shift)
            } else {
                0
            };
            cells.push((first, cell_shift - p));
            first += 1 << p;
        }
        let buckets = first;
        let cells = cells
            .into_iter()
            .map(|(f, sh)| ((buckets - 1 - f) as u32) << 6 | sh)
            .collect();
        BucketMap {
            lo,
            hi,
            cell_shift,
            cells,
            buckets,
        }
    }

    /// The bucket of a rate with IEEE bits `b`.
    #[inline]
    pub(super) fn bucket(&self, b: u64) -> u32 {
        let d = b.clamp(self.lo, self.hi) - self.lo;
        let e = self.cells[(d >> self.cell_shift) as usize];
        let within = (d & ((1u64 << self.cell_shift) - 1)) >> (e & 63);
        (e >> 6) - within as u32
    }
}

/// A buffer's start while both threads of [`bucket_sorted`] write disjoint slots of it.
pub(super) struct SharedSlots<T>(*mut T);
impl<T> Clone for SharedSlots<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedSlots<T> {}
impl<T> SharedSlots<T> {
    /// Slot `i` (a method, so closures capture the whole wrapper, not the bare pointer). Safe:
    /// it only computes the address; whoever dereferences it owes `i` < the buffer's capacity.
    pub(super) fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}
// SAFETY: the threads write disjoint slots, and read them only after a barrier.
unsafe impl<T> Send for SharedSlots<T> {}
// SAFETY: as for Send: disjoint writes, reads after a barrier.
unsafe impl<T> Sync for SharedSlots<T> {}

/// Whether `a` goes after `b` in admission order ([`by_rate_then_key`] is `Greater`), without
/// a branch.
#[inline]
pub(super) fn goes_after(a: &PlanEntry, b: &PlanEntry) -> bool {
    let (ra, rb) = (a.rate.to_bits(), b.rate.to_bits());
    (ra < rb) | ((ra == rb) & (a.key > b.key))
}

/// Order `v[i]` and `v[i + 1]`, swapping them only if they are out of order (so equal ones
/// keep their order), with selects instead of a branch.
#[inline]
pub(super) fn order_pair(v: &mut [PlanEntry], i: usize) {
    let (a, b) = (v[i], v[i + 1]);
    let swap = goes_after(&a, &b);
    let (lo, hi) = if swap { (b, a) } else { (a, b) };
    v[i] = lo;
    v[i + 1] = hi;
}

/// Sort the few entries of one bucket by [`by_rate_then_key`], stably: two or three by
/// exchanges of neighbours without branches on the data, more by insertion.
#[inline]
pub(super) fn small_sort(v: &mut [PlanEntry]) {
    match v.len() {
        0 | 1 => {}
        2 => order_pair(v, 0),
        3 => {
            order_pair(v, 0);
            order_pair(v, 1);
            order_pair(v, 0);
        }
        _ => insertion_sort(v),
    }
}

/// Insertion sort by [`by_rate_then_key`] for the few entries of one bucket.
#[inline]
pub(super) fn insertion_sort(v: &mut [PlanEntry]) {
    for i in 1..v.len() {
        let x = v[i];
        let mut j = i;
        while j > 0 && by_rate_then_key(&v[j - 1], &x) == Ordering::Greater {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
    }
}
