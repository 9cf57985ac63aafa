//! LPT placement (Algorithm 1, step 4): entries in placement order, each charging rate / k_b to
//! each of its k_b currently least-loaded live destinations, ties to the lower index.
//!
//! Three implementations of the same rule, with identical output (a property test compares
//! each this CPU can run with the heap):
//! - [`place_heap`], a binary heap over the live destinations: any R, any machine;
//! - `place_avx2`, for R ≤ 32 on x86-64 with AVX2 (checked at run time): the R loads live in
//!   eight 256-bit registers, padded with +∞, and each k_b = 1 entry costs one branch-free
//!   minimum tree, a compare and a masked add. A heap step is a chain of data-dependent
//!   branches (sift-down); this chain has none, so one entry costs about a third of the time
//!   (docs/planner.md has the figures). Entries with k_b > 1, and a minimum shared by several
//!   destinations, take the same scalar rule on the registers written out to memory;
//! - `place_avx512`, with AVX-512F (preferred where detected): the 32 lanes kept in
//!   (load, destination) order in four 512-bit registers, so the least loaded is the first
//!   lane and a k_b = 1 entry is a pop and a branch-free merge of its new load (an add, a
//!   maximum and a minimum long, half the minimum tree's chain) — a fifth less time for the
//!   placement of a full-admission plan than the minimum tree in the same registers.
//!
//! Pure logic: no I/O, no clock.

use super::PlanEntry;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Min-heap item: (load, destination); ties go to the lower index, deterministically.
#[derive(Clone, Copy, PartialEq)]
struct Slot {
    load: f64,
    dest: u16,
}
impl Eq for Slot {}
impl Ord for Slot {
    fn cmp(&self, other: &Self) -> Ordering {
        // BinaryHeap is a max-heap: reverse so the least loaded is on top.
        other
            .load
            .total_cmp(&self.load)
            .then_with(|| other.dest.cmp(&self.dest))
    }
}
impl PartialOrd for Slot {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Place `entries` (appends their destinations to `dests`, k_b each, in entry order), charging
/// `loads` (one per destination, the cold-tail start; `down` ones are never chosen). `k_b` of
/// every entry is at most the number of live destinations; `bound` is at least every load the
/// placement can reach (the total rate, cold tail included).
pub(super) fn place(
    entries: &[PlanEntry],
    dests: &mut Vec<u16>,
    loads: &mut [f64],
    down: &[bool],
    bound: f64,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd_applies(loads, down, bound) {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F was detected on this CPU just above.
                unsafe { place_avx512(entries, dests, loads, down) };
                return;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was detected on this CPU just above.
                unsafe { place_avx2(entries, dests, loads, down) };
                return;
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bound;
    place_heap(entries, dests, loads, down)
}

/// The register kernel's preconditions: R ≤ 32 and loads that stay finite and ≥ +0 (so
/// IEEE equality and minimum order them as the heap's total order does: no −0, no NaN, and
/// no live load reaching the +∞ of the padding and of down destinations: `bound`, far below
/// the largest float, leaves room for rounding).
#[cfg(target_arch = "x86_64")]
fn simd_applies(loads: &[f64], down: &[bool], bound: f64) -> bool {
    loads.len() <= 32
        && bound < f64::MAX / 4.0
        && loads
            .iter()
            .zip(down)
            .all(|(&l, &d)| d || (l.is_finite() && l.is_sign_positive()))
}

/// The reference placement: a binary heap over the live destinations.
pub(super) fn place_heap(
    entries: &[PlanEntry],
    dests: &mut Vec<u16>,
    loads: &mut [f64],
    down: &[bool],
) {
    let mut heap: BinaryHeap<Slot> = (0..loads.len())
        .filter(|&d| !down[d])
        .map(|d| Slot {
            load: loads[d],
            dest: d as u16,
        })
        .collect();
    let mut popped: Vec<Slot> = Vec::with_capacity(loads.len());
    for e in entries {
        let share = e.rate / e.k as f64;
        if e.k == 1 {
            let mut top = heap.peek_mut().expect("live destinations");
            top.load += share;
            dests.push(top.dest);
        } else {
            popped.clear();
            for _ in 0..e.k {
                popped.push(heap.pop().expect("k ≤ live destinations"));
            }
            for mut s in popped.drain(..) {
                s.load += share;
                dests.push(s.dest);
                heap.push(s);
            }
        }
    }
    for s in heap.into_vec() {
        loads[s.dest as usize] = s.load;
    }
}

/// The scalar rule on written-out loads (`l`, +∞ where nothing may be chosen): charge `share`
/// to the `k` least loaded, ties to the lower index, in that order (as the heap pops them).
fn charge_k_least(l: &mut [f64; 32], k: u16, share: f64, dests: &mut Vec<u16>) {
    let mut taken = 0u32;
    let first = dests.len();
    for _ in 0..k {
        let mut best = usize::MAX;
        for d in 0..32 {
            if taken & (1 << d) == 0 && l[d].is_finite() && (best == usize::MAX || l[d] < l[best]) {
                best = d;
            }
        }
        taken |= 1 << best;
        dests.push(best as u16);
    }
    for &d in &dests[first..] {
        l[d as usize] += share;
    }
}

/// The register kernels' shared loop: the live loads in 32 lanes (+∞ where nothing may be
/// chosen: down destinations, padding), loaded into registers by `fill` and written back by
/// `spill`. For an entry with k_b = 1, `least` adds its share to the one least-loaded lane and
/// returns that lane, or returns `None` when several lanes share the minimum; that entry, and
/// every entry with k_b > 1, takes the scalar rule on the lanes written out.
///
/// # Safety
/// `fill`, `spill` and `least` may use only instructions the CPU has (the callers' target
/// features, which this function, always inlined, compiles with).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn place_in_registers<V>(
    entries: &[PlanEntry],
    dests: &mut Vec<u16>,
    loads: &mut [f64],
    down: &[bool],
    fill: impl Fn(&[f64; 32]) -> V,
    spill: impl Fn(&V, &mut [f64; 32]),
    mut least: impl FnMut(&mut V, f64) -> Option<u32>,
) {
    let mut mem = [f64::INFINITY; 32];
    for (d, (&l, &dn)) in loads.iter().zip(down).enumerate() {
        if !dn {
            mem[d] = l;
        }
    }
    // Each k_b = 1 entry writes its destination through a pointer: `dests` keeps room for one
    // destination per entry not yet placed (reserved here, and again after the scalar rule,
    // which pushes).
    dests.reserve(entries.len());
    let mut v = fill(&mem);
    for (i, e) in entries.iter().enumerate() {
        let share = e.rate / e.k as f64;
        if e.k == 1 {
            if let Some(d) = least(&mut v, share) {
                let n = dests.len();
                // SAFETY: room for this entry's destination was reserved (see above).
                unsafe {
                    *dests.as_mut_ptr().add(n) = d as u16;
                    dests.set_len(n + 1);
                }
                continue;
            }
        }
        spill(&v, &mut mem);
        charge_k_least(&mut mem, e.k, share, dests);
        dests.reserve(entries.len() - i - 1);
        v = fill(&mem);
    }
    spill(&v, &mut mem);
    for (d, l) in loads.iter_mut().enumerate() {
        if !down[d] {
            *l = mem[d];
        }
    }
}

/// [`place`] with the loads in eight AVX2 registers (see the module comment).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn place_avx2(
    entries: &[PlanEntry],
    dests: &mut Vec<u16>,
    loads: &mut [f64],
    down: &[bool],
) {
    use std::arch::x86_64::*;
    // SAFETY: in the closures, loads and stores touch the 32 lanes in bounds; AVX2 is enabled.
    unsafe {
        place_in_registers(
            entries,
            dests,
            loads,
            down,
            |mem: &[f64; 32]| -> [__m256d; 8] {
                let p = mem.as_ptr();
                std::array::from_fn(|j| _mm256_loadu_pd(p.add(4 * j)))
            },
            |v: &[__m256d; 8], mem: &mut [f64; 32]| {
                for (j, r) in v.iter().enumerate() {
                    _mm256_storeu_pd(mem.as_mut_ptr().add(4 * j), *r);
                }
            },
            |v: &mut [__m256d; 8], share: f64| {
                // The minimum over 32 lanes: a tree of three register minima, then across
                // the halves and the pairs of the last register.
                let a = _mm256_min_pd(
                    _mm256_min_pd(_mm256_min_pd(v[0], v[1]), _mm256_min_pd(v[2], v[3])),
                    _mm256_min_pd(_mm256_min_pd(v[4], v[5]), _mm256_min_pd(v[6], v[7])),
                );
                let b = _mm256_min_pd(a, _mm256_permute2f128_pd(a, a, 1));
                let m = _mm256_min_pd(b, _mm256_permute_pd(b, 5));
                let eq: [__m256d; 8] = std::array::from_fn(|j| _mm256_cmp_pd(v[j], m, _CMP_EQ_OQ));
                let mut mask = 0u32;
                for (j, q) in eq.iter().enumerate() {
                    mask |= (_mm256_movemask_pd(*q) as u32) << (4 * j);
                }
                if mask & (mask - 1) != 0 {
                    return None;
                }
                // One least-loaded destination: add the share in its lane only.
                let s = _mm256_set1_pd(share);
                for j in 0..8 {
                    v[j] = _mm256_add_pd(v[j], _mm256_and_pd(eq[j], s));
                }
                Some(mask.trailing_zeros())
            },
        )
    }
}

/// [`place`] with the 32 lanes (live loads, +∞ for down destinations and padding) kept in
/// four AVX-512 registers in (load, destination) order, with each lane's destination in four
/// more. The least loaded destination is then lane 0: an entry with k_b = 1 takes it, and its
/// new load `nv` goes back into the order by a merge without branches on the data. With `old`
/// the lanes before, `next` the lanes after the first (`old` moved down one lane, +∞ last) and
/// p the number of lanes of `next` below `nv`, the new order is `next` before p, `nv` at p and
/// `old` after it: lane by lane, min(max(old, nv), next). A step is thus one add, one maximum
/// and one minimum long (a minimum tree over 32 lanes, the other kernels' step, is twice
/// that); the destinations follow the same lanes by two masked blends. Where the new load
/// equals another lane's, the two masks also compare destinations (the loads' order alone does
/// not place it). An entry with k_b > 1 charges several lanes: it takes the scalar rule on the
/// lanes written out, which are then put back in order.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn place_avx512(
    entries: &[PlanEntry],
    dests: &mut Vec<u16>,
    loads: &mut [f64],
    down: &[bool],
) {
    use std::arch::x86_64::*;
    // Written out: the load of each destination (lane d = destination d, +∞ where nothing
    // may be chosen), and the same lanes in (load, destination) order.
    let mut by_dest = [f64::INFINITY; 32];
    for (d, (&l, &dn)) in loads.iter().zip(down).enumerate() {
        if !dn {
            by_dest[d] = l;
        }
    }
    let ordered = |by_dest: &[f64; 32]| -> ([f64; 32], [u64; 32]) {
        let mut lanes: [(f64, u64); 32] = std::array::from_fn(|d| (by_dest[d], d as u64));
        lanes.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        (lanes.map(|x| x.0), lanes.map(|x| x.1))
    };
    // SAFETY: in this block, loads and stores touch the 32 lanes of local arrays; AVX-512F is
    // enabled; `dests` has room for each entry's destination written through its pointer
    // (reserved here, and again after the scalar rule, which pushes).
    unsafe {
        let fill = |l: &[f64; 32], d: &[u64; 32]| -> ([__m512d; 4], [__m512i; 4]) {
            (
                std::array::from_fn(|j| _mm512_loadu_pd(l.as_ptr().add(8 * j))),
                std::array::from_fn(|j| _mm512_loadu_si512(d.as_ptr().add(8 * j).cast())),
            )
        };
        let spill = |v: &[__m512d; 4], x: &[__m512i; 4], by_dest: &mut [f64; 32]| {
            let (mut l, mut d) = ([0.0f64; 32], [0u64; 32]);
            for j in 0..4 {
                _mm512_storeu_pd(l.as_mut_ptr().add(8 * j), v[j]);
                _mm512_storeu_si512(d.as_mut_ptr().add(8 * j).cast(), x[j]);
            }
            for (&l, &d) in l.iter().zip(&d) {
                by_dest[d as usize] = l;
            }
        };
        let (l, d) = ordered(&by_dest);
        let (mut v, mut x) = fill(&l, &d);
        let inf = _mm512_set1_pd(f64::INFINITY);
        dests.reserve(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let share = e.rate / e.k as f64;
            if e.k == 1 {
                let first = _mm_cvtsd_f64(_mm512_castpd512_pd128(v[0]));
                let dest = _mm_cvtsi128_si64(_mm512_castsi512_si128(x[0]));
                let nv = _mm512_set1_pd(first + share);
                let ties = (_mm512_cmp_pd_mask::<_CMP_EQ_OQ>(v[0], nv) & 0xfe)
                    | _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(v[1], nv)
                    | _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(v[2], nv)
                    | _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(v[3], nv);
                {
                    let next = [
                        _mm512_castsi512_pd(_mm512_alignr_epi64::<1>(
                            _mm512_castpd_si512(v[1]),
                            _mm512_castpd_si512(v[0]),
                        )),
                        _mm512_castsi512_pd(_mm512_alignr_epi64::<1>(
                            _mm512_castpd_si512(v[2]),
                            _mm512_castpd_si512(v[1]),
                        )),
                        _mm512_castsi512_pd(_mm512_alignr_epi64::<1>(
                            _mm512_castpd_si512(v[3]),
                            _mm512_castpd_si512(v[2]),
                        )),
                        _mm512_castsi512_pd(_mm512_alignr_epi64::<1>(
                            _mm512_castpd_si512(inf),
                            _mm512_castpd_si512(v[3]),
                        )),
                    ];
                    let next_d = [
                        _mm512_alignr_epi64::<1>(x[1], x[0]),
                        _mm512_alignr_epi64::<1>(x[2], x[1]),
                        _mm512_alignr_epi64::<1>(x[3], x[2]),
                        _mm512_alignr_epi64::<1>(x[3], x[3]),
                    ];
                    let nd = _mm512_set1_epi64(dest);
                    for j in 0..4 {
                        // Lanes after p keep theirs; lanes before p take the next lane's.
                        let mut after = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(v[j], nv);
                        let mut before = _mm512_cmp_pd_mask::<_CMP_LT_OQ>(next[j], nv);
                        if ties != 0 {
                            // A lane whose load equals the new one is before or after it by
                            // destination (the values merge alike either way).
                            after |= _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(v[j], nv)
                                & _mm512_cmpgt_epu64_mask(x[j], nd);
                            before |= _mm512_cmp_pd_mask::<_CMP_EQ_OQ>(next[j], nv)
                                & _mm512_cmplt_epu64_mask(next_d[j], nd);
                        }
                        x[j] = _mm512_mask_blend_epi64(
                            before,
                            _mm512_mask_blend_epi64(after, nd, x[j]),
                            next_d[j],
                        );
                        v[j] = _mm512_min_pd(_mm512_max_pd(v[j], nv), next[j]);
                    }
                    let n = dests.len();
                    *dests.as_mut_ptr().add(n) = dest as u16;
                    dests.set_len(n + 1);
                    continue;
                }
            }
            // k_b > 1: the scalar rule, and the lanes put back in order.
            spill(&v, &x, &mut by_dest);
            charge_k_least(&mut by_dest, e.k, share, dests);
            dests.reserve(entries.len() - i - 1);
            let (l, d) = ordered(&by_dest);
            (v, x) = fill(&l, &d);
        }
        spill(&v, &x, &mut by_dest);
    }
    for (d, l) in loads.iter_mut().enumerate() {
        if !down[d] {
            *l = by_dest[d];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entries_of(rates: &[(f64, u16)]) -> Vec<PlanEntry> {
        let mut v: Vec<PlanEntry> = rates
            .iter()
            .enumerate()
            .map(|(i, &(rate, k))| PlanEntry {
                key: i as u64,
                rate,
                input_index: i as u32,
                k,
            })
            .collect();
        v.sort_by(|a, b| b.rate.total_cmp(&a.rate).then(a.key.cmp(&b.key)));
        v
    }

    fn run(
        f: impl Fn(&[PlanEntry], &mut Vec<u16>, &mut [f64], &[bool]),
        entries: &[PlanEntry],
        loads: &[f64],
        down: &[bool],
    ) -> (Vec<u16>, Vec<f64>) {
        let mut d = Vec::new();
        let mut l = loads.to_vec();
        f(entries, &mut d, &mut l, down);
        (d, l)
    }

    proptest! {
        // The dispatching placement (the register kernel where it applies) gives exactly the
        // heap's plan: same destinations in the same order, same loads to the bit. Rates drawn
        // from a few values make ties common; k_b > 1 and down destinations included.
        #[test]
        fn the_register_kernel_places_exactly_as_the_heap(
            raw in prop::collection::vec((0u8..6, 0.0f64..5.0, 1u16..4), 1..300),
            r in 1usize..=32,
            cold in prop_oneof![Just(0.0f64), 0.0f64..3.0],
            down_bits in any::<u32>(),
        ) {
            let mut down: Vec<bool> = (0..r).map(|d| down_bits & (1 << d) != 0).collect();
            if down.iter().all(|&x| x) {
                down[0] = false;
            }
            let live = down.iter().filter(|&&x| !x).count() as u16;
            let rates: Vec<(f64, u16)> = raw
                .iter()
                .map(|&(bucket, x, k)| {
                    let rate = if bucket < 3 { bucket as f64 + 1.0 } else { x };
                    (rate, k.min(live))
                })
                .collect();
            let entries = entries_of(&rates);
            let loads: Vec<f64> = down.iter().map(|&d| if d { 0.0 } else { cold }).collect();
            let total: f64 = cold + rates.iter().map(|r| r.0).sum::<f64>();
            let heap = run(place_heap, &entries, &loads, &down);
            let fast = run(|e, d, l, dn| place(e, d, l, dn, total), &entries, &loads, &down);
            prop_assert_eq!(&heap.0, &fast.0);
            let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&heap.1), bits(&fast.1));
            // Each register kernel this CPU has, not only the one `place` picks.
            #[cfg(target_arch = "x86_64")]
            for (name, has) in [
                ("avx2", std::arch::is_x86_feature_detected!("avx2")),
                ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
            ] {
                if !has || !simd_applies(&loads, &down, total) {
                    continue;
                }
                let kernel = run(
                    |e, d, l, dn| unsafe {
                        // SAFETY: the feature was detected just above.
                        if name == "avx2" {
                            place_avx2(e, d, l, dn)
                        } else {
                            place_avx512(e, d, l, dn)
                        }
                    },
                    &entries,
                    &loads,
                    &down,
                );
                prop_assert_eq!(&heap.0, &kernel.0, "{}", name);
                prop_assert_eq!(bits(&heap.1), bits(&kernel.1), "{}", name);
            }
        }
    }

    /// The comparison above can fail: a placement that breaks ties toward the higher index
    /// differs from the heap on a plan with a tie.
    #[test]
    fn the_comparison_sees_a_wrong_tie_rule() {
        let entries = entries_of(&[(1.0, 1), (1.0, 1), (1.0, 1)]);
        let wrong = |e: &[PlanEntry], d: &mut Vec<u16>, l: &mut [f64], _: &[bool]| {
            for x in e {
                let best = (0..l.len())
                    .rev()
                    .min_by(|&a, &b| l[a].total_cmp(&l[b]))
                    .unwrap();
                l[best] += x.rate;
                d.push(best as u16);
            }
        };
        let down = [false, false];
        let heap = run(place_heap, &entries, &[0.0, 0.0], &down);
        let bad = run(wrong, &entries, &[0.0, 0.0], &down);
        let fast = run(
            |e, d, l, dn| place(e, d, l, dn, 3.0),
            &entries,
            &[0.0, 0.0],
            &down,
        );
        assert_eq!(heap.0, vec![0, 1, 0]);
        assert_ne!(heap.0, bad.0);
        assert_eq!(heap.0, fast.0);
    }

    /// Rates near the largest float (loads that overflow to +∞) take the heap through
    /// `place`, which then places exactly as the heap: no down destination is chosen.
    #[test]
    fn overflowing_loads_take_the_heap() {
        let entries = entries_of(&[
            (f64::MAX / 2.0, 1),
            (f64::MAX / 2.0, 1),
            (f64::MAX, 1),
            (1.0, 1),
        ]);
        let down = [false, true, false];
        let total = f64::INFINITY;
        let heap = run(place_heap, &entries, &[0.0; 3], &down);
        let fast = run(
            |e, d, l, dn| place(e, d, l, dn, total),
            &entries,
            &[0.0; 3],
            &down,
        );
        assert_eq!(heap.0, fast.0);
        assert!(fast.0.iter().all(|&d| d != 1), "{:?}", fast.0);
    }

    /// Loads outside the kernel's preconditions (R > 32, a non-finite load) take the heap.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn preconditions() {
        assert!(simd_applies(&[0.0; 32], &[false; 32], 1.0));
        assert!(!simd_applies(&[0.0; 33], &[false; 33], 1.0));
        assert!(!simd_applies(&[-0.0, 1.0], &[false, false], 1.0));
        assert!(simd_applies(&[-0.0, 1.0], &[true, false], 1.0));
        assert!(!simd_applies(&[f64::INFINITY, 1.0], &[false, false], 1.0));
        assert!(!simd_applies(&[0.0, 1.0], &[false, false], f64::MAX));
    }
}
