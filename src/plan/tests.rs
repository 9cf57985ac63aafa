#![allow(clippy::needless_range_loop)]

use super::*;
use proptest::prelude::*;

fn keys_from(rates: &[f64]) -> Vec<KeyLoad> {
    rates
        .iter()
        .enumerate()
        .map(|(i, &rate)| KeyLoad {
            key: crate::rng::mix64(i as u64 + 1),
            rate,
            prefix_tokens: 0.0,
        })
        .collect()
}

/// The budget rule, written the obvious way: sort everything, admit while it fits.
fn reference_admission(cfg: &PlannerConfig, keys: &[KeyLoad], r_live: usize) -> Vec<(u64, usize)> {
    let mut idx: Vec<usize> = (0..keys.len()).collect();
    idx.sort_by(|&a, &b| {
        keys[b]
            .rate
            .partial_cmp(&keys[a].rate)
            .unwrap()
            .then(keys[a].key.cmp(&keys[b].key))
    });
    let budget = cfg.warm_slots * r_live as u64;
    let mut used = 0;
    let mut out = Vec::new();
    for i in idx {
        if keys[i].rate <= 0.0 {
            continue;
        }
        let k = if cfg.replication {
            ((keys[i].rate / cfg.q_cap).ceil() as usize)
                .max(1)
                .min(r_live)
        } else {
            1
        };
        if used + k as u64 <= budget {
            used += k as u64;
            out.push((keys[i].key, k));
        }
    }
    out
}

/// Recompute loads from the entries and check every structural invariant.
fn check_plan(cfg: &PlannerConfig, keys: &[KeyLoad], p: &Plan) {
    let r = cfg.destinations;
    let r_live = p.down.iter().filter(|d| !**d).count();
    let total: f64 = keys.iter().map(|k| k.rate).sum();
    let admitted: f64 = p.entries.iter().map(|e| e.rate).sum();
    let cold = (total - admitted).max(0.0) / r_live as f64;
    let mut loads: Vec<f64> = p.down.iter().map(|&d| if d { 0.0 } else { cold }).collect();
    for i in 0..p.entries.len() {
        let e = p.entries[i];
        let ds = p.dests_of(i);
        assert_eq!(ds.len(), e.k as usize);
        let mut s = ds.to_vec();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), ds.len(), "destinations distinct");
        for &d in ds {
            assert!((d as usize) < r, "in range");
            assert!(!p.down[d as usize], "never a down destination");
            loads[d as usize] += e.rate / e.k as f64;
        }
        assert_eq!(p.lookup(e.key), Some(ds));
    }
    for d in 0..r {
        assert!(
            (loads[d] - p.loads[d]).abs() <= 1e-9 * (1.0 + total),
            "load of {d}: {} vs {}",
            loads[d],
            p.loads[d]
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn admission_is_the_budget_rule(
        rates in prop::collection::vec(0.0f64..50.0, 1..300),
        r in 1usize..12,
        q_cap in 0.5f64..20.0,
        w in 1u64..20,
        replication in any::<bool>(),
    ) {
        let keys = keys_from(&rates);
        let mut cfg = PlannerConfig::new(r, q_cap, w);
        cfg.replication = replication;
        let p = build(&cfg, &keys, None).unwrap();
        let got: Vec<(u64, usize)> = p.entries.iter().map(|e| (e.key, e.k as usize)).collect();
        prop_assert_eq!(got, reference_admission(&cfg, &keys, r));
        prop_assert!(p.slots_used <= p.slot_budget);
        prop_assert_eq!(p.slots_used, p.entries.iter().map(|e| e.k as u64).sum::<u64>());
        check_plan(&cfg, &keys, &p);
    }

    #[test]
    fn k_rule_and_lpt_choice(
        rates in prop::collection::vec(0.01f64..100.0, 1..200),
        r in 1usize..10,
        q_cap in 1.0f64..30.0,
        w in 1u64..30,
    ) {
        let keys = keys_from(&rates);
        let cfg = PlannerConfig::new(r, q_cap, w);
        let p = build(&cfg, &keys, None).unwrap();
        // Replay LPT: each key's set must be k destinations with the smallest running loads.
        let mut loads = vec![p.cold_tail_per_dest; r];
        for i in 0..p.entries.len() {
            let e = p.entries[i];
            prop_assert_eq!(e.k as usize, ((e.rate / q_cap).ceil() as usize).max(1).min(r));
            let ds = p.dests_of(i);
            let mut sorted = loads.clone();
            sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let kth = sorted[e.k as usize - 1];
            for &d in ds {
                prop_assert!(loads[d as usize] <= kth + 1e-9, "chose a destination that was not among the k least loaded");
            }
            for &d in ds {
                loads[d as usize] += e.rate / e.k as f64;
            }
        }
        check_plan(&cfg, &keys, &p);
    }

    #[test]
    fn down_destinations_get_nothing(
        rates in prop::collection::vec(0.01f64..100.0, 1..200),
        r in 2usize..10,
        down_bits in any::<u16>(),
    ) {
        let keys = keys_from(&rates);
        let mut down: Vec<bool> = (0..r).map(|d| down_bits & (1 << d) != 0).collect();
        if down.iter().all(|d| *d) { down[0] = false; }
        let cfg = PlannerConfig::new(r, 5.0, 8);
        let p = build(&cfg, &keys, Some(&down)).unwrap();
        check_plan(&cfg, &keys, &p);
        for d in 0..r { if down[d] { prop_assert_eq!(p.loads[d], 0.0); } }
    }

    #[test]
    fn churn_aware_respects_bound(
        rates in prop::collection::vec(0.01f64..100.0, 2..250),
        noise in prop::collection::vec(0.5f64..2.0, 250),
        r in 2usize..10,
        w in 2u64..30,
    ) {
        let keys = keys_from(&rates);
        let mut cfg = PlannerConfig::new(r, 40.0, w);
        cfg.max_imbalance = 1.05;
        cfg.admission_hysteresis = 0.0;
        let old = build(&cfg, &keys, None).unwrap();
        let drifted: Vec<f64> = rates.iter().zip(&noise).map(|(a, b)| a * b).collect();
        let keys2 = keys_from(&drifted);
        let fresh = build(&cfg, &keys2, None).unwrap();
        let p = replan(&cfg, &keys2, &old.key_sets(), None).unwrap();
        check_plan(&cfg, &keys2, &p);
        // Same admission as a fresh plan.
        let a: Vec<u64> = p.entries.iter().map(|e| e.key).collect();
        let b: Vec<u64> = fresh.entries.iter().map(|e| e.key).collect();
        prop_assert_eq!(a, b);
        if !p.fell_back_to_fresh {
            prop_assert!(p.imbalance() <= fresh.imbalance() * 1.05 + 1e-9);
        }
        let c = p.churn.unwrap();
        prop_assert!((0.0..=1.0).contains(&c));
        prop_assert!((c - churn(&old.key_sets(), &p)).abs() < 1e-12);
    }

    #[test]
    fn repair_moves_only_the_removed_destinations_keys(
        rates in prop::collection::vec(0.01f64..100.0, 1..200),
        r in 2usize..10,
        q_cap in 1.0f64..50.0,
        gone in 0usize..10,
    ) {
        let gone = gone % r;
        let keys = keys_from(&rates);
        let cfg = PlannerConfig::new(r, q_cap, 10);
        let p = build(&cfg, &keys, None).unwrap();
        let mut down = vec![false; r];
        down[gone] = true;
        let q = repair(&p, &down).unwrap();
        prop_assert_eq!(p.entries.len(), q.entries.len());
        for i in 0..p.entries.len() {
            let before = p.dests_of(i);
            let after = q.dests_of(i);
            prop_assert!(!after.contains(&(gone as u16)));
            if !before.contains(&(gone as u16)) {
                prop_assert_eq!(before, after, "a key that did not use the removed destination moved");
            } else {
                for &d in before { if d as usize != gone { prop_assert!(after.contains(&d)); } }
            }
        }
        // Loads are consistent with the repaired sets.
        let total: f64 = keys.iter().map(|k| k.rate).sum();
        let mut loads = vec![0.0; r];
        for d in 0..r { if d != gone { loads[d] = q.cold_tail_per_dest; } }
        for i in 0..q.entries.len() {
            let e = q.entries[i];
            for &d in q.dests_of(i) { loads[d as usize] += e.rate / e.k as f64; }
        }
        for d in 0..r { prop_assert!((loads[d] - q.loads[d]).abs() < 1e-9 * (1.0 + total)); }
    }
}

#[test]
fn skipped_key_lets_smaller_keys_in() {
    // R = 2, W = 2 → C = 4. Rates 10, 7, 1, 1 with q_cap 3: k = 2 (capped at R), 2, 1, 1.
    let keys = keys_from(&[10.0, 7.0, 1.0, 1.0, 0.5]);
    let cfg = PlannerConfig::new(2, 3.0, 2);
    let p = build(&cfg, &keys, None).unwrap();
    let ks: Vec<u16> = p.entries.iter().map(|e| e.k).collect();
    assert_eq!(ks, vec![2, 2]);
    // W = 3 → C = 6: 10 (2) + 7 (2) + 1 + 1 = 6, 0.5 skipped for lack of slots.
    let p = build(&PlannerConfig::new(2, 3.0, 3), &keys, None).unwrap();
    assert_eq!(p.admitted(), 4);
    // q_cap 4, C = 2: 10 → k = 3 capped at R = 2, which fills the budget.
    let p = build(&PlannerConfig::new(2, 4.0, 1), &keys, None).unwrap();
    assert_eq!(
        p.entries.iter().map(|e| e.rate).collect::<Vec<_>>(),
        vec![10.0]
    );
    // R = 3, C = 3.
    let p = build(&PlannerConfig::new(3, 4.0, 1), &keys, None).unwrap();
    // 10 → k = 3 uses all three slots.
    assert_eq!(p.admitted(), 1);
    let p = build(&PlannerConfig::new(3, 6.0, 1), &keys, None).unwrap();
    // 10 → k=2, 7 → k=2 does not fit (2+2 > 3), 1 → k=1 fits.
    assert_eq!(
        p.entries.iter().map(|e| e.rate).collect::<Vec<_>>(),
        vec![10.0, 1.0]
    );
}

#[test]
fn cold_tail_starts_every_destination() {
    let keys = keys_from(&[5.0, 1.0, 1.0, 1.0]);
    let p = build(&PlannerConfig::new(2, 10.0, 1), &keys, None).unwrap();
    // Admitted: 5.0 and one 1.0; cold tail 2.0 → 1.0 per destination.
    assert_eq!(p.admitted(), 2);
    assert!((p.cold_tail_per_dest - 1.0).abs() < 1e-12);
    let mut l = p.loads.clone();
    l.sort_by(|a, b| a.partial_cmp(b).unwrap());
    assert_eq!(l, vec![2.0, 6.0]);
}

#[test]
fn bad_parameters_are_named() {
    let keys = keys_from(&[1.0]);
    let e = |c: PlannerConfig| build(&c, &keys, None).unwrap_err().to_string();
    assert!(e(PlannerConfig::new(0, 1.0, 1)).contains("destinations"));
    assert!(e(PlannerConfig::new(1, 0.0, 1)).contains("q-cap"));
    assert!(e(PlannerConfig::new(1, f64::NAN, 1)).contains("q-cap"));
    assert!(e(PlannerConfig::new(1, 1.0, 0)).contains("warm-slots"));
    let bad = vec![KeyLoad {
        key: 1,
        rate: f64::NAN,
        prefix_tokens: 0.0,
    }];
    assert!(build(&PlannerConfig::new(1, 1.0, 1), &bad, None)
        .unwrap_err()
        .to_string()
        .contains("key 0"));
}

#[test]
fn byte_aware_prefers_value_per_block() {
    // Key a: rate 10, prefix 16 000 tokens (1000 blocks). Key b: rate 5, prefix 160 (10 blocks).
    // Budget 2 destinations × 505 blocks = 1010 blocks: by rate, a would be admitted first and
    // b after it (1010 fits both); with 600 per destination a alone fits but b is worth more
    // per block.
    let keys = vec![
        KeyLoad {
            key: 1,
            rate: 10.0,
            prefix_tokens: 16_000.0,
        },
        KeyLoad {
            key: 2,
            rate: 5.0,
            prefix_tokens: 160.0,
        },
        KeyLoad {
            key: 3,
            rate: 4.0,
            prefix_tokens: 16_000.0,
        },
    ];
    let mut c = PlannerConfig::new(2, 100.0, 505);
    c.byte_aware = true;
    let p = build(&c, &keys, None).unwrap();
    let got: Vec<u64> = p.entries.iter().map(|e| e.key).collect();
    // Densities: a = 10·16000/1000 = 160, b = 5·160/10 = 80, c = 64 per block. a (1000) + b (10)
    // = 1010 = budget; c does not fit.
    assert_eq!(got, vec![1, 2]);
    assert_eq!(p.slots_used, 1010);
    c.warm_slots = 400; // 800 blocks: a does not fit, b and nothing else.
    let p = build(&c, &keys, None).unwrap();
    assert_eq!(p.entries.iter().map(|e| e.key).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn large_paper_shaped_plan_is_consistent() {
    let mut rng = crate::rng::seeded(7);
    let rates = crate::workload::rates::lognormal_rates(20_000, 1.648, 200.0, &mut rng);
    let keys = keys_from(&rates);
    let cfg = PlannerConfig::new(30, 2.0, 64);
    let p = build(&cfg, &keys, None).unwrap();
    check_plan(&cfg, &keys, &p);
    assert!(
        p.imbalance() < 1.01,
        "LPT should balance a smooth distribution: {}",
        p.imbalance()
    );
    let got: Vec<(u64, usize)> = p.entries.iter().map(|e| (e.key, e.k as usize)).collect();
    assert_eq!(got, reference_admission(&cfg, &keys, 30));
}

/// Full admission (the budget holds nearly every key) sorts by buckets of rate bits: the order
/// and the plan are still the budget rule's, with tied rates, zero rates and replication.
#[test]
fn full_admission_is_the_budget_rule() {
    let mut rng = crate::rng::seeded(5);
    let mut rates = crate::workload::rates::lognormal_rates(20_000, 1.648, 2_000.0, &mut rng);
    for (i, r) in rates.iter_mut().enumerate() {
        // Three significant digits: many exact ties; every 97th key sends nothing.
        let scale = 10f64.powi(2 - r.log10().floor() as i32);
        *r = if i % 97 == 0 {
            0.0
        } else {
            (*r * scale).round() / scale
        };
    }
    let keys = keys_from(&rates);
    for (q_cap, w) in [(2.0, 700), (50.0, 650), (2.0, 10_000)] {
        let cfg = PlannerConfig::new(30, q_cap, w);
        let p = build(&cfg, &keys, None).unwrap();
        check_plan(&cfg, &keys, &p);
        let got: Vec<(u64, usize)> = p.entries.iter().map(|e| (e.key, e.k as usize)).collect();
        assert_eq!(
            got,
            reference_admission(&cfg, &keys, 30),
            "q_cap {q_cap}, W {w}"
        );
    }
}

/// Above [`PARALLEL_MIN`] the bucket sort runs on two threads and the index is built beside
/// the placement: the order is still exactly a stable sort's (tied rates, repeated keys, zero
/// rates: equal candidates keep their input order), and the plan still the budget rule's.
#[test]
fn two_thread_bucket_sort_is_a_stable_sort() {
    let n = PARALLEL_MIN * 2 + 17;
    let mut rng = crate::rng::seeded(11);
    let rates = crate::workload::rates::lognormal_rates(n, 1.648, 500.0, &mut rng);
    let cand: Vec<PlanEntry> = rates
        .iter()
        .enumerate()
        .map(|(i, &r)| PlanEntry {
            // Every 5th candidate repeats an earlier key; rates rounded to 2 digits tie often.
            key: if i % 5 == 4 { (i / 7) as u64 } else { i as u64 },
            rate: if i % 89 == 0 {
                0.0
            } else {
                (r * 100.0).round() / 100.0
            },
            input_index: i as u32,
            k: 1,
        })
        .collect();
    let (lo, hi) = cand.iter().fold((u64::MAX, 0u64), |(lo, hi), c| {
        (lo.min(c.rate.to_bits()), hi.max(c.rate.to_bits()))
    });
    let mut want = cand.clone();
    want.sort_by(by_rate_then_key);
    // Either way of sharing the scatter (each part its counted inputs, or each its buckets,
    // as when one thread came late to the count), and the way the counts choose.
    for by in [None, Some(ScatterBy::Inputs), Some(ScatterBy::Buckets)] {
        let range = SortRange::Known(lo, hi);
        let sorted = bucket_sorted(n, range, |i| cand[i].rate, |i| cand[i], by).unwrap();
        assert!(sorted.total_rate.is_none());
        assert!(sorted.cands == want, "{by:?}: order differs");
    }

    let keys = keys_from(&rates);
    let cfg = PlannerConfig::new(30, 2.0, (n / 30) as u64);
    let p = build(&cfg, &keys, None).unwrap();
    check_plan(&cfg, &keys, &p);
    let got: Vec<(u64, usize)> = p.entries.iter().map(|e| (e.key, e.k as usize)).collect();
    assert_eq!(got, reference_admission(&cfg, &keys, 30));
}

/// 5,000 paper-shaped rates (300 req/s) with 5 whales carrying 30%, and the RNG after them.
fn whale_rates() -> (Vec<f64>, crate::rng::Rng64) {
    let mut rng = crate::rng::seeded(9);
    let mut rates = crate::workload::rates::lognormal_rates(5_000, 1.648, 300.0, &mut rng);
    crate::workload::rates::add_whales(&mut rates, 5, 0.3);
    (rates, rng)
}

#[test]
fn hash_placement_ablation_is_less_balanced() {
    let (rates, _) = whale_rates();
    let keys = keys_from(&rates);
    let full = build(&PlannerConfig::new(30, 10.0, 40), &keys, None).unwrap();
    let mut aff = PlannerConfig::new(30, 10.0, 40);
    aff.replication = false;
    aff.placement = Placement::Hash;
    let aff = build(&aff, &keys, None).unwrap();
    let mut rep = PlannerConfig::new(30, 10.0, 40);
    rep.placement = Placement::Hash;
    let rep = build(&rep, &keys, None).unwrap();
    check_plan(&PlannerConfig::new(30, 10.0, 40), &keys, &full);
    assert!(
        aff.imbalance() > rep.imbalance(),
        "{} {}",
        aff.imbalance(),
        rep.imbalance()
    );
    assert!(
        rep.imbalance() > full.imbalance(),
        "{} {}",
        rep.imbalance(),
        full.imbalance()
    );
    assert!(aff.entries.iter().all(|e| e.k == 1));
}

#[test]
fn admission_hysteresis_keeps_incumbents() {
    let mut rng = crate::rng::seeded(11);
    let mut rates = crate::workload::rates::lognormal_rates(20_000, 1.648, 150.0, &mut rng);
    let keys = keys_from(&rates);
    let mut cfg = PlannerConfig::new(30, 6.0, 32);
    let first = build(&cfg, &keys, None).unwrap();
    crate::workload::rates::drift_step(&mut rates, 0.3, &mut rng);
    let keys2 = keys_from(&rates);
    cfg.admission_hysteresis = 0.0;
    let plain = replan(&cfg, &keys2, &first.key_sets(), None).unwrap();
    cfg.admission_hysteresis = 0.5;
    let sticky = replan(&cfg, &keys2, &first.key_sets(), None).unwrap();
    check_plan(&cfg, &keys2, &sticky);
    assert!(sticky.slots_used <= sticky.slot_budget);
    assert!(
        sticky.churn.unwrap() < plain.churn.unwrap() / 2.0,
        "{:?} vs {:?}",
        sticky.churn,
        plain.churn
    );
    // The admitted set is still the budget rule over boosted rates: no unadmitted key beats an
    // admitted incumbent by more than the hysteresis, nor an admitted newcomer at all.
    let prev = first.key_sets();
    let admitted: std::collections::HashSet<u64> = sticky.entries.iter().map(|e| e.key).collect();
    let min_eff = sticky
        .entries
        .iter()
        .map(|e| e.rate * if prev.contains_key(&e.key) { 1.5 } else { 1.0 })
        .fold(f64::INFINITY, f64::min);
    for k in &keys2 {
        if !admitted.contains(&k.key) {
            let eff = k.rate * if prev.contains_key(&k.key) { 1.5 } else { 1.0 };
            assert!(eff <= min_eff + 1e-12);
        }
    }
}

/// Replanning an ablation row keeps it that row: hash placement stays hash placement (the
/// same sets and loads as a fresh hash build of the new rates, not an LPT-repaired plan), and
/// the affinity row keeps k_b = 1.
#[test]
fn replan_keeps_the_variants_placement() {
    let (mut rates, mut rng) = whale_rates();
    let keys = keys_from(&rates);
    crate::workload::rates::drift_step(&mut rates, 0.3, &mut rng);
    let drifted = keys_from(&rates);
    for replication in [true, false] {
        let mut cfg = PlannerConfig::new(30, 10.0, 40);
        cfg.placement = Placement::Hash;
        cfg.replication = replication;
        cfg.admission_hysteresis = 0.0;
        let before = build(&cfg, &keys, None).unwrap();
        let hash = build(&cfg, &drifted, None).unwrap();
        let lpt = build(
            &PlannerConfig {
                placement: Placement::Lpt,
                ..cfg.clone()
            },
            &drifted,
            None,
        )
        .unwrap();
        assert!(hash.imbalance() > lpt.imbalance() * 1.2, "{replication}");
        let re = replan(&cfg, &drifted, &before.key_sets(), None).unwrap();
        assert_eq!(
            re.key_sets(),
            hash.key_sets(),
            "replication {replication}: replan moved keys off their hash placement"
        );
        assert!(
            (re.imbalance() - hash.imbalance()).abs() < 1e-9,
            "replication {replication}: imbalance {} vs hash build {} (LPT {})",
            re.imbalance(),
            hash.imbalance(),
            lpt.imbalance()
        );
        if !replication {
            assert!(re.entries.iter().all(|e| e.k == 1));
        }
        // Churn is only what hash placement itself implies (admission and k_b changes).
        assert_eq!(re.churn, Some(churn(&before.key_sets(), &hash)));
    }
}

/// The sort that is also the input's pass (large plans admitting every key): the same order
/// as a stable sort and the same validation and sum as [`scan_keys`], whatever the rates — with
/// extremes the range sample misses, with long runs of equal rates (a bucket sorted by merge
/// sort), and with bad rates in either thread's part.
#[test]
fn the_sort_that_scans_the_input_is_exact() {
    let n = PARALLEL_MIN * 3 + 5;
    let mut rng = crate::rng::seeded(5);
    let base = crate::workload::rates::lognormal_rates(n, 1.648, 500.0, &mut rng);
    let shapes: Vec<(&str, Vec<f64>)> = vec![
        ("lognormal", base.clone()),
        // Extremes between the sampled rates (every ⌈n/4096⌉-th): far outside the range seen.
        ("unsampled extremes", {
            let mut r = base.clone();
            for i in [1usize, 2, 3, n - 2] {
                r[i] = 1e6 * i as f64;
            }
            r[5] = 1e-300;
            r
        }),
        // Most rates equal: one bucket of tens of thousands.
        (
            "equal rates",
            (0..n)
                .map(|i| if i % 7 == 0 { base[i] } else { 0.25 })
                .collect(),
        ),
        (
            "zeros",
            (0..n)
                .map(|i| if i % 3 == 0 { 0.0 } else { base[i] })
                .collect(),
        ),
    ];
    for (name, rates) in shapes {
        let keys: Vec<KeyLoad> = rates
            .iter()
            .enumerate()
            .map(|(i, &rate)| KeyLoad {
                // Repeated keys: equal (rate, key) pairs keep their input order.
                key: if i % 11 == 10 {
                    (i / 13) as u64
                } else {
                    i as u64
                },
                rate,
                prefix_tokens: 0.0,
            })
            .collect();
        let eff = |i: usize| keys[i].rate.max(0.0);
        let cand = |i: usize| PlanEntry {
            key: keys[i].key,
            rate: eff(i),
            input_index: i as u32,
            k: 1,
        };
        let sorted = bucket_sorted(n, SortRange::Scan(&keys), eff, cand, None).unwrap();
        let (got, scan) = (sorted.cands, sorted.total_rate);
        let mut want: Vec<PlanEntry> = (0..n).map(cand).collect();
        want.sort_by(by_rate_then_key);
        assert!(got == want, "{name}: order differs");
        let (a, b) = (scan.unwrap(), scan_keys(&keys).unwrap().total_rate);
        assert_eq!(a.to_bits(), b.to_bits(), "{name}");
        // And the whole plan (distinct keys) agrees with the reference admission.
        let keys = keys_from(&rates);
        let cfg = PlannerConfig::new(30, 2.0, n as u64);
        let p = build(&cfg, &keys, None).unwrap();
        check_plan(&cfg, &keys, &p);
        let got: Vec<(u64, usize)> = p.entries.iter().map(|e| (e.key, e.k as usize)).collect();
        assert_eq!(got, reference_admission(&cfg, &keys, 30), "{name}");
    }
    // Bad rates: the first one is named, wherever it lies.
    for bad in [vec![n - 3], vec![7, n - 3], vec![n / 2 + 1, n - 1]] {
        let mut keys = keys_from(&base);
        for (j, &i) in bad.iter().enumerate() {
            keys[i].rate = if j == 0 { f64::NAN } else { -1.0 };
        }
        let cfg = PlannerConfig::new(30, 2.0, n as u64);
        match build(&cfg, &keys, None) {
            Err(PlanError::BadRate { index, .. }) => assert_eq!(index, bad[0], "{bad:?}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

/// Mean keys per non-empty bucket of `map` over `bits`.
fn occupancy(map: &BucketMap, bits: &[u64]) -> f64 {
    let mut hits = vec![0u32; map.buckets];
    for &b in bits {
        hits[map.bucket(b) as usize] += 1;
    }
    bits.len() as f64 / hits.iter().filter(|&&h| h > 0).count() as f64
}

/// The bucket map orders like the rates (a higher rate never goes to a later bucket, every
/// bucket within range, rates outside the sampled range included) and, from a sample of a
/// Zipf-shaped distribution (most keys in the lowest few octaves of 20), gives about two
/// keys a bucket. Without the sample's density (an empty sample: one bucket a cell, as
/// equal-width buckets over the range would do) the same keys crowd many to a bucket.
#[test]
fn bucket_map_orders_like_the_rates_and_spreads_a_dense_range() {
    let n = 100_000usize;
    let rates: Vec<f64> = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(1.1)).collect();
    let mut bits: Vec<u64> = rates.iter().map(|r| r.to_bits()).collect();
    let sample: Vec<u64> = bits.iter().step_by(n / SAMPLE).copied().collect();
    let (lo, hi) = (*sample.iter().min().unwrap(), *sample.iter().max().unwrap());
    let map = BucketMap::new(lo, hi, sample.iter().copied(), n / 2);
    assert!(map.buckets >= n / 4 && map.buckets <= n, "{}", map.buckets);
    let spread = occupancy(&map, &bits);
    assert!(spread < 3.0, "{spread}");
    let flat = BucketMap::new(lo, hi, std::iter::empty(), n / 2);
    assert!(
        occupancy(&flat, &bits) > 3.0 * spread,
        "{}",
        occupancy(&flat, &bits)
    );
    // Order: rates (and some outside the sampled range, and zero) by decreasing bits.
    bits.extend([0, lo - 1, hi + 1, f64::MAX.to_bits()]);
    bits.sort_unstable_by(|a, b| b.cmp(a));
    let buckets: Vec<u32> = bits.iter().map(|&b| map.bucket(b)).collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
    assert!(buckets.iter().all(|&b| (b as usize) < map.buckets));
}

/// The dispatch index takes over memory that is large enough and at most twice too large,
/// and finds every key either way.
#[test]
fn the_index_reuses_memory_that_fits() {
    let entries: Vec<PlanEntry> = (0..1000u64)
        .map(|i| PlanEntry {
            key: crate::rng::mix64(i),
            rate: 1.0,
            input_index: i as u32,
            k: 1,
        })
        .collect();
    let len = PlanTable::len_for(entries.len());
    for (cap, reused) in [
        (len, true),
        (2 * len, true),
        (len - 1, false),
        (2 * len + 1, false),
    ] {
        let memory: Vec<u32> = Vec::with_capacity(cap);
        let (at, cap) = (memory.as_ptr(), memory.capacity());
        let t = PlanTable::new_in(&entries, memory);
        // A new allocation is exactly as large as the table (and may reuse the address).
        let kept = t.slots.capacity() == cap && t.slots.as_ptr() == at;
        assert_eq!(kept, reused, "capacity {cap}");
        assert_eq!(t.slots.len(), len);
        for (i, e) in entries.iter().enumerate() {
            assert_eq!(t.get(e.key, &entries), Some(i));
        }
        assert_eq!(t.get(crate::rng::mix64(5000), &entries), None);
    }
}
