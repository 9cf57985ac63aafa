use super::*;
use crate::plan::{build, KeyLoad, PlannerConfig};
use crate::policy::setting::Setting;
use crate::rng::seeded;

fn req(key: u64) -> RouteRequest<'static> {
    RouteRequest {
        key,
        blocks: &[],
        block_tokens: 16,
        prompt_tokens: 1000,
        output_tokens: 100,
        now: 0.0,
    }
}

#[test]
fn p2c_takes_the_less_loaded_of_its_two_samples() {
    // Replay the same RNG stream to know which two were sampled.
    let mut fleet = FleetState::new(10);
    for d in 0..10 {
        fleet.outstanding[d] = (d * 7 % 10) as u32;
    }
    for seed in 0..200 {
        let mut rng = seeded(seed);
        let mut shadow = seeded(seed);
        let a = shadow.random_range(0..10usize);
        let mut b = shadow.random_range(0..10usize);
        while b == a {
            b = shadow.random_range(0..10usize);
        }
        let got = p2c(&fleet, &mut rng).unwrap();
        let want = if fleet.outstanding[b] < fleet.outstanding[a] {
            b
        } else {
            a
        };
        assert_eq!(got, want);
    }
}

#[test]
fn every_policy_avoids_down_and_errors_when_none_up() {
    let names = [
        "flat-lb",
        "sticky",
        "chwbl",
        "dualmap",
        "preble",
        "llm-d",
        "cacheroute",
        "cacheroute-affinity",
    ];
    for name in names {
        let spec = PolicySpec::from_name(name).unwrap();
        let mut p = spec.build(8, 1);
        let keys: Vec<KeyLoad> = (0..50)
            .map(|k| KeyLoad {
                key: k,
                rate: 1.0 + k as f64,
                prefix_tokens: 0.0,
            })
            .collect();
        // Only CacheRoute's variants route by a plan.
        assert_eq!(
            p.planned().is_some(),
            name.starts_with("cacheroute"),
            "{name}"
        );
        if let Some(planned) = p.planned() {
            planned.install_plan(Arc::new(
                build(&PlannerConfig::new(8, 10.0, 4), &keys, None).unwrap(),
            ));
        }
        let mut fleet = FleetState::new(8);
        fleet.up[3] = false;
        fleet.up[5] = false;
        let mut rng = seeded(2);
        let blocks = [11u64, 12, 13];
        for k in 0..2000u64 {
            let r = RouteRequest {
                blocks: &blocks,
                ..req(k % 60)
            };
            let d = p.choose(&r, &fleet, &mut rng).unwrap();
            assert!(fleet.up[d], "{name} chose down destination {d}");
            fleet.outstanding[d] += 1;
        }
        fleet.up = vec![false; 8];
        assert_eq!(
            p.choose(&req(1), &fleet, &mut rng),
            Err(RouteError::NoneUp(8)),
            "{name}"
        );
    }
}

#[test]
fn sticky_moves_about_one_over_r_when_a_destination_is_added() {
    let n = 20_000u64;
    let a = sticky::Sticky::new(30, 160, 5);
    let b = sticky::Sticky::new(31, 160, 5);
    let (fa, fb) = (FleetState::new(30), FleetState::new(31));
    let mut rng = seeded(0);
    let (mut a, mut b) = (a, b);
    let moved = (0..n)
        .filter(|&k| {
            let key = ring::mix64(k);
            a.choose(&req(key), &fa, &mut rng).unwrap()
                != b.choose(&req(key), &fb, &mut rng).unwrap()
        })
        .count() as f64
        / n as f64;
    // Ideal: 1/31 ≈ 0.032. Every moved key must have moved to the new destination.
    assert!((0.02..0.05).contains(&moved), "moved {moved}");
    for k in 0..n {
        let key = ring::mix64(k);
        let (x, y) = (
            a.choose(&req(key), &fa, &mut rng).unwrap(),
            b.choose(&req(key), &fb, &mut rng).unwrap(),
        );
        if x != y {
            assert_eq!(y, 30);
        }
    }
}

#[test]
fn chwbl_never_exceeds_its_bound() {
    let mut p = chwbl::Chwbl::new(10, 100, 0.25, 3);
    let mut fleet = FleetState::new(10);
    let mut rng = seeded(1);
    // A hot key: every request has the same key, so only the bound spreads them.
    for i in 0..5000u64 {
        let cap = p.capacity(&fleet);
        let d = p.choose(&req(42), &fleet, &mut rng).unwrap();
        assert!(
            fleet.outstanding[d] < cap,
            "destination at {} ≥ cap {cap}",
            fleet.outstanding[d]
        );
        fleet.outstanding[d] += 1;
        // Occasionally finish requests.
        if i % 3 == 0 {
            let busiest = (0..10).max_by_key(|&d| fleet.outstanding[d]).unwrap();
            fleet.outstanding[busiest] -= 1;
        }
    }
    let max = *fleet.outstanding.iter().max().unwrap() as f64;
    let mean = fleet.outstanding.iter().sum::<u32>() as f64 / 10.0;
    assert!(max <= (1.25 * mean).ceil() + 1.0);
}

#[test]
fn cacheroute_keeps_admitted_keys_inside_their_set() {
    let keys: Vec<KeyLoad> = (0..200u64)
        .map(|k| KeyLoad {
            key: k,
            rate: 200.0 / (k + 1) as f64,
            prefix_tokens: 0.0,
        })
        .collect();
    let plan = Arc::new(build(&PlannerConfig::new(10, 20.0, 5), &keys, None).unwrap());
    let mut p = cacheroute::CacheRoute::new(Default::default(), 10, 1);
    p.install_plan(plan.clone());
    let mut fleet = FleetState::new(10);
    let mut rng = seeded(4);
    for i in 0..5000u64 {
        let key = i % 200;
        if i % 500 == 0 {
            // A different destination is down in each phase (and none in the first).
            fleet.up = vec![true; 10];
            if i > 0 {
                fleet.up[(i / 500 % 10) as usize] = false;
            }
        }
        let d = p.choose(&req(key), &fleet, &mut rng).unwrap();
        assert!(fleet.up[d]);
        if let Some(set) = plan.lookup(key) {
            let live: Vec<usize> = set
                .iter()
                .map(|&x| x as usize)
                .filter(|&x| fleet.up[x])
                .collect();
            if !live.is_empty() {
                assert!(live.contains(&d), "admitted key {key} left T(b)");
                let best = live.iter().map(|&x| fleet.outstanding[x]).min().unwrap();
                assert_eq!(fleet.outstanding[d], best, "not the least loaded member");
            }
        }
        fleet.outstanding[d] += 1;
        if i % 2 == 0 {
            let d2 = (i as usize * 7) % 10;
            fleet.outstanding[d2] = fleet.outstanding[d2].saturating_sub(1);
        }
    }
    assert!(p.table_hits > 0 && p.fallbacks > 0);
}

#[test]
fn preble_exploits_when_match_exceeds_miss_and_explores_otherwise() {
    let mut p = preble::Preble::new(4, Default::default());
    let mut fleet = FleetState::new(4);
    let mut rng = seeded(0);
    let prompt: Vec<u64> = (100..110).collect(); // 10 blocks of 16 tokens
    let r = |blocks: &'static [u64], prompt_tokens: u32| RouteRequest {
        blocks,
        prompt_tokens,
        block_tokens: 16,
        ..req(0)
    };
    let blocks: &'static [u64] = Box::leak(prompt.into_boxed_slice());
    // First sight: nothing matched → explore to the least cost destination (0, all equal).
    let first = p.choose(&r(blocks, 160), &fleet, &mut rng).unwrap();
    assert_eq!((p.explores, p.exploits), (1, 0));
    // Make the owner the busiest: exploit must still pick it since 8 of 10 blocks match.
    fleet.outstanding[first] = 5;
    let longer: &'static [u64] = Box::leak([&blocks[..8], &[900, 901]].concat().into_boxed_slice());
    let d = p.choose(&r(longer, 160), &fleet, &mut rng).unwrap();
    assert_eq!(d, first);
    assert_eq!(p.exploits, 1);
    // Only 2 of 10 blocks match: miss > match → explore, away from the busy owner.
    let mostly_new: &'static [u64] = Box::leak(
        [&blocks[..2], &[500, 501, 502, 503, 504, 505, 506, 507]]
            .concat()
            .into_boxed_slice(),
    );
    let d = p.choose(&r(mostly_new, 160), &fleet, &mut rng).unwrap();
    assert_eq!(p.explores, 2);
    assert_ne!(d, first);
}

#[test]
fn preble_tree_is_bounded_by_its_window() {
    let cfg = preble::PrebleConfig {
        window_s: 10.0,
        ..Default::default()
    };
    let mut p = preble::Preble::new(4, cfg);
    let fleet = FleetState::new(4);
    let mut rng = seeded(0);
    for i in 0..10_000u64 {
        let blocks = [i * 3, i * 3 + 1, i * 3 + 2];
        let r = RouteRequest {
            blocks: &blocks,
            now: i as f64 * 0.1,
            ..req(i)
        };
        p.choose(&r, &fleet, &mut rng).unwrap();
    }
    // 10 s window at 10 requests/s × 3 blocks, plus up to a quarter window between sweeps.
    assert!(p.tree_size() <= 3 * 130, "tree {}", p.tree_size());
}

#[test]
fn dualmap_switches_to_second_candidate_only_when_slo_at_risk() {
    let cfg = dualmap::DualMapConfig {
        slo_ttft_s: 1.0,
        prefill_tokens_per_s: 1000.0,
        ..Default::default()
    };
    let mut p = dualmap::DualMap::new(6, cfg, 9);
    let mut fleet = FleetState::new(6);
    let mut rng = seeded(0);
    let a = p.choose(&req(77), &fleet, &mut rng).unwrap();
    assert_eq!(
        p.choose(&req(77), &fleet, &mut rng).unwrap(),
        a,
        "stable while idle"
    );
    fleet.queued_prefill[a] = 5000; // 5 s of queued prefill at the first candidate
    let b = p.choose(&req(77), &fleet, &mut rng).unwrap();
    assert_ne!(b, a);
    fleet.queued_prefill[b] = 10_000; // the second is worse still: stay on the first
    assert_eq!(p.choose(&req(77), &fleet, &mut rng).unwrap(), a);
}

#[test]
fn policy_names_parse_and_reject() {
    for n in [
        "flat-lb",
        "sticky",
        "chwbl",
        "dualmap",
        "preble",
        "llm-d",
        "cacheroute",
        "cacheroute-replication",
    ] {
        assert_eq!(PolicySpec::from_name(n).unwrap().label(), n);
    }
    assert!(PolicySpec::from_name("random")
        .unwrap_err()
        .contains("unknown policy `random`"));
}

/// Unadmitted keys keep a home under the default (CHWBL) cold tail and scatter under P2C; the
/// bound still spills a tail key when its home is overloaded.
#[test]
fn cold_tail_keeps_unadmitted_keys_at_home_unless_overloaded() {
    use cacheroute::{CacheRouteConfig, ColdTail};
    let keys = [KeyLoad {
        key: 1,
        rate: 10.0,
        prefix_tokens: 0.0,
    }];
    let plan = Arc::new(build(&PlannerConfig::new(8, 20.0, 1), &keys, None).unwrap());
    let fleet = FleetState::new(8);
    let mut rng = seeded(9);
    let homes = |cfg: CacheRouteConfig, rng: &mut crate::rng::Rng64, fleet: &FleetState| {
        let mut p = cacheroute::CacheRoute::new(cfg, 8, 3);
        p.install_plan(plan.clone());
        (0..50)
            .map(|_| {
                let r = RouteRequest {
                    key: 777, // not in the plan
                    blocks: &[],
                    block_tokens: 16,
                    prompt_tokens: 100,
                    output_tokens: 10,
                    now: 0.0,
                };
                p.choose(&r, fleet, rng).unwrap()
            })
            .collect::<std::collections::BTreeSet<usize>>()
    };
    let chwbl = homes(CacheRouteConfig::default(), &mut rng, &fleet);
    assert_eq!(
        chwbl.len(),
        1,
        "a tail key has one home on an idle fleet: {chwbl:?}"
    );
    let p2c_cfg = CacheRouteConfig {
        cold_tail: Setting::Fixed(ColdTail::P2c),
        ..Default::default()
    };
    let scattered = homes(p2c_cfg, &mut rng, &fleet);
    assert!(
        scattered.len() > 4,
        "P2C scatters a tail key: {scattered:?}"
    );
    // The home overloaded far past the bound: the key goes elsewhere.
    let home = *chwbl.iter().next().unwrap();
    let mut busy = FleetState::new(8);
    busy.outstanding[home] = 100;
    busy.queued_prefill[home] = 100_000;
    let moved = homes(CacheRouteConfig::default(), &mut rng, &busy);
    assert!(
        !moved.contains(&home),
        "bounded load spills an overloaded home: {moved:?}"
    );
}

/// The prefill load signal judges a set's members by queued prompt tokens, not request counts;
/// bounded sets spill a planned key whose whole set is past the bound, pinned sets never do.
#[test]
fn load_signal_and_bounded_sets_decide_within_a_plan() {
    use cacheroute::{CacheRouteConfig, LoadSignal};
    let keys: Vec<KeyLoad> = (0..2u64)
        .map(|k| KeyLoad {
            key: k,
            rate: 50.0,
            prefix_tokens: 0.0,
        })
        .collect();
    // q_cap 30 gives each key k = 2 of 4 destinations.
    let plan = Arc::new(build(&PlannerConfig::new(4, 30.0, 4), &keys, None).unwrap());
    let set: Vec<usize> = plan
        .lookup(0)
        .unwrap()
        .iter()
        .map(|&d| d as usize)
        .collect();
    assert_eq!(set.len(), 2);
    let (a, b) = (set[0], set[1]);
    let mut fleet = FleetState::new(4);
    // a: one request with a 60k-token prompt queued; b: three short ones.
    fleet.outstanding[a] = 1;
    fleet.queued_prefill[a] = 60_000;
    fleet.outstanding[b] = 3;
    fleet.queued_prefill[b] = 300;
    let req = RouteRequest {
        key: 0,
        blocks: &[],
        block_tokens: 16,
        prompt_tokens: 500,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    let pick = |cfg: CacheRouteConfig, fleet: &FleetState, rng: &mut crate::rng::Rng64| {
        let mut p = cacheroute::CacheRoute::new(cfg, 4, 1);
        p.install_plan(plan.clone());
        p.choose(&req, fleet, rng).unwrap()
    };
    let outstanding = CacheRouteConfig {
        load: Setting::Fixed(LoadSignal::Outstanding),
        ..Default::default()
    };
    assert_eq!(pick(outstanding, &fleet, &mut rng), a);
    let prefill = CacheRouteConfig {
        load: Setting::Fixed(LoadSignal::Prefill),
        ..Default::default()
    };
    assert_eq!(pick(prefill.clone(), &fleet, &mut rng), b);
    // Both members far past the bound: pinned stays in the set, bounded leaves it.
    fleet.queued_prefill[b] = 50_000;
    let pinned = pick(prefill.clone(), &fleet, &mut rng);
    assert!(set.contains(&pinned), "pinned sets never spill");
    let bounded = CacheRouteConfig {
        bounded_sets: crate::policy::setting::Setting::Fixed(true),
        ..prefill
    };
    let spilled = pick(bounded, &fleet, &mut rng);
    assert!(
        !set.contains(&spilled),
        "a bounded set spills past the bound: {spilled}"
    );
}

/// The new CacheRoute fields are bounded and typed: out-of-range or unknown values are refused
/// naming the field.
#[test]
fn cacheroute_dispatch_fields_are_checked() {
    let parse = |y: &str| serde_json::from_str::<PolicySpec>(y);
    let ok = parse(
        r#"{"policy":"cacheroute","cold_tail":"p2c","load":"outstanding","bounded_sets":true}"#,
    )
    .unwrap();
    assert!(ok.problems().is_empty());
    for bad in [
        r#"{"policy":"cacheroute","cold_tail":"random"}"#,
        r#"{"policy":"cacheroute","load":"tokens"}"#,
        r#"{"policy":"cacheroute","bounded_sets":"yes"}"#,
        r#"{"policy":"cacheroute","cold_tail":"prefix","prefix":{"window":3}}"#,
        r#"{"policy":"cacheroute","q_cap":"often"}"#,
        r#"{"policy":"cacheroute","warm_slots":[8]}"#,
    ] {
        assert!(parse(bad).is_err(), "{bad}");
    }
    // Automatic settings: 0 or `auto`; a fixed one is range-checked naming the field.
    let auto = parse(r#"{"policy":"cacheroute","q_cap":"auto","warm_slots":0}"#).unwrap();
    assert!(auto.problems().is_empty());
    for (bad, field) in [
        (r#"{"policy":"cacheroute","q_cap":-2.5}"#, "q_cap"),
        (
            r#"{"policy":"cacheroute","warm_slots":20000000}"#,
            "warm_slots",
        ),
    ] {
        let p = parse(bad).unwrap().problems();
        assert!(p.iter().any(|e| e.starts_with(field)), "{bad}: {p:?}");
    }
    // The prefix tail's parameters are Preble's, checked alike and named under `prefix.`.
    let tail = parse(
        r#"{"policy":"cacheroute","cold_tail":"prefix","prefix":{"window_s":-1,"max_nodes":0}}"#,
    )
    .unwrap();
    let problems = tail.problems();
    assert!(
        problems.iter().any(|p| p.starts_with("prefix.window_s"))
            && problems.iter().any(|p| p.starts_with("prefix.max_nodes")),
        "{problems:?}"
    );
    let eps = parse(r#"{"policy":"cacheroute","cold_tail_epsilon":0}"#).unwrap();
    assert!(
        eps.problems()
            .iter()
            .any(|p| p.contains("cold_tail_epsilon")),
        "{:?}",
        eps.problems()
    );
    let retune = parse(r#"{"policy":"cacheroute","retune_intervals":0}"#).unwrap();
    assert!(
        retune
            .problems()
            .iter()
            .any(|p| p.contains("retune_intervals")),
        "{:?}",
        retune.problems()
    );
}

/// The conversation memory: a conversation's next turn goes back to the member of its set
/// that served the last one (without the memory: the least loaded member), unless that
/// member is at or above the set's bound; an unplanned request follows the deepest shared
/// prefix while its holder is below the tail's bound, else the ring.
#[test]
fn conversations_stay_where_their_prefix_went_within_the_bound() {
    use cacheroute::CacheRouteConfig;
    let keys = [KeyLoad {
        key: 0,
        rate: 50.0,
        prefix_tokens: 0.0,
    }];
    // q_cap 30: key 0 gets k = 2 of 4 destinations.
    let plan = Arc::new(build(&PlannerConfig::new(4, 30.0, 4), &keys, None).unwrap());
    let set: Vec<usize> = plan
        .lookup(0)
        .unwrap()
        .iter()
        .map(|&d| d as usize)
        .collect();
    let (a, b) = (set[0], set[1]);
    let make = |on: bool| {
        let mut p = cacheroute::CacheRoute::new(
            CacheRouteConfig {
                conversations: on,
                ..Default::default()
            },
            4,
            1,
        );
        p.install_plan(plan.clone());
        p
    };
    let turn = |key: u64, blocks: &'static [u64]| RouteRequest {
        key,
        blocks,
        block_tokens: 16,
        prompt_tokens: 500,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    for on in [true, false] {
        let mut p = make(on);
        let mut fleet = FleetState::new(4);
        // Turn 1 of a conversation, with `a` the less loaded member.
        fleet.queued_prefill[b] = 400;
        let first = p.choose(&turn(0, &[11, 12]), &fleet, &mut rng).unwrap();
        assert_eq!(first, a);
        // Turn 2 extends turn 1's prompt; now `b` is a little less loaded than `a`.
        fleet.queued_prefill[a] = 600;
        let second = p.choose(&turn(0, &[11, 12, 13]), &fleet, &mut rng).unwrap();
        assert_eq!(second, if on { a } else { b }, "memory on: {on}");
        // Turn 3 with `a` past the set's bound (1.25 × the set's mean): it moves.
        fleet.queued_prefill[a] = 5_000;
        let third = p
            .choose(&turn(0, &[11, 12, 13, 14]), &fleet, &mut rng)
            .unwrap();
        assert_eq!(third, b, "memory on: {on}");
        if on {
            assert_eq!(p.remembered, 1);
        }
    }
    // Unplanned keys: the shared prefix's holder while below the tail's bound.
    let mut p = make(true);
    let mut fleet = FleetState::new(4);
    let home7 = p.choose(&turn(7, &[21, 22]), &fleet, &mut rng).unwrap();
    let mut other = 8;
    while p.choose(&turn(other, &[]), &fleet, &mut rng).unwrap() == home7 {
        other += 1;
    }
    // Key `other` hashes elsewhere but shares key 7's prefix: it follows the prefix.
    assert_eq!(
        p.choose(&turn(other, &[21, 22, 23]), &fleet, &mut rng)
            .unwrap(),
        home7
    );
    // The holder loaded past the bound: the ring decides.
    fleet.queued_prefill[home7] = 100_000;
    assert_ne!(
        p.choose(&turn(other, &[21, 22, 23, 24]), &fleet, &mut rng)
            .unwrap(),
        home7
    );
}

/// A plan giving key 0 one destination of 4 (`home`), and the plan after a repair around
/// `home` (key 0 at `new_home`): (plan, moved, home, new_home).
fn one_key_and_its_move() -> (Arc<Plan>, Arc<Plan>, usize, usize) {
    let keys = [KeyLoad {
        key: 0,
        rate: 10.0,
        prefix_tokens: 0.0,
    }];
    let plan = Arc::new(build(&PlannerConfig::new(4, 30.0, 4), &keys, None).unwrap());
    let home = plan.lookup(0).unwrap()[0] as usize;
    let mut down = vec![false; 4];
    down[home] = true;
    let moved = Arc::new(crate::plan::repair(&plan, &down).unwrap());
    let new_home = moved.lookup(0).unwrap()[0] as usize;
    assert_ne!(new_home, home);
    (plan, moved, home, new_home)
}

#[test]
fn a_prefix_tail_follows_prefixes_the_plan_placed_and_learns_from_completions() {
    use cacheroute::{CacheRouteConfig, ColdTail};
    let (plan, moved, home, new_home) = one_key_and_its_move();
    let mut p = cacheroute::CacheRoute::new(
        CacheRouteConfig {
            cold_tail: Setting::Fixed(ColdTail::Prefix),
            ..Default::default()
        },
        4,
        1,
    );
    p.install_plan(plan.clone());
    let turn = |key: u64, blocks: &'static [u64]| RouteRequest {
        key,
        blocks,
        block_tokens: 16,
        prompt_tokens: blocks.len() as u32 * 16,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    let mut fleet = FleetState::new(4);
    // The planned key's request goes home, and its blocks enter the tail's tree.
    assert_eq!(
        p.choose(&turn(0, &[1, 2, 3, 4]), &fleet, &mut rng).unwrap(),
        home
    );
    // An unplanned key sharing most of that prefix follows it (exploit)…
    assert_eq!(
        p.choose(&turn(9, &[1, 2, 3, 4, 5]), &fleet, &mut rng)
            .unwrap(),
        home
    );
    // …and one sharing too little goes where the windowed cost is least: not `home`, which
    // has two prompts' prefill counted against it.
    let d = p
        .choose(&turn(9, &[1, 60, 70, 80, 90]), &fleet, &mut rng)
        .unwrap();
    assert_ne!(d, home);
    assert_eq!((p.table_hits, p.fallbacks), (1, 2));
    // A completion reaches the tail's scheduler (its TPOT estimate) without a panic for any
    // destination index, in range or not.
    let done = Completion {
        now: 1.0,
        ttft_s: 0.1,
        e2e_s: 1.0,
        output_tokens: 10,
        cached_tokens: 0,
    };
    p.on_complete(&turn(9, &[]), d, &done);
    p.on_complete(&turn(9, &[]), 99, &done);

    // The next plan moves key 0 away from `home` (as a repair around it would).
    p.install_plan(moved);
    // The conversation continues where its history is cached while that is below the bound…
    let before = p.remembered;
    assert_eq!(
        p.choose(&turn(0, &[1, 2, 3, 4, 5, 6]), &fleet, &mut rng)
            .unwrap(),
        home
    );
    assert_eq!(p.remembered, before + 1);
    // …and follows the plan once `home` is past it; a new conversation follows the plan.
    fleet.queued_prefill[home] = 100_000;
    assert_eq!(
        p.choose(&turn(0, &[1, 2, 3, 4, 5, 6, 7]), &fleet, &mut rng)
            .unwrap(),
        new_home
    );
    fleet.queued_prefill[home] = 0;
    assert_eq!(
        p.choose(&turn(0, &[40, 41, 42]), &fleet, &mut rng).unwrap(),
        new_home
    );
}

#[test]
fn the_conversation_memory_keeps_a_moved_keys_conversation_where_its_history_is() {
    use cacheroute::CacheRouteConfig;
    let (plan, moved, home, new_home) = one_key_and_its_move();
    let turn = |blocks: &'static [u64], prompt_tokens: u32| RouteRequest {
        key: 0,
        blocks,
        block_tokens: 16,
        prompt_tokens,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    for on in [true, false] {
        let mut p = cacheroute::CacheRoute::new(
            CacheRouteConfig {
                conversations: on,
                ..Default::default()
            },
            4,
            1,
        );
        let mut fleet = FleetState::new(4);
        p.install_plan(plan.clone());
        assert_eq!(
            p.choose(&turn(&[1, 2, 3], 48), &fleet, &mut rng).unwrap(),
            home
        );
        p.install_plan(moved.clone());
        // Turn 2: its history (3 of 4 blocks) is at `home`, outside the new set.
        let d = p
            .choose(&turn(&[1, 2, 3, 4], 64), &fleet, &mut rng)
            .unwrap();
        assert_eq!(d, if on { home } else { new_home }, "memory on: {on}");
        // A prompt whose remembered part is less than half of it follows the plan.
        let d = p
            .choose(&turn(&[1, 5, 6, 7], 64), &fleet, &mut rng)
            .unwrap();
        assert_eq!(d, new_home, "memory on: {on}");
        // Past the fleet's bound the history no longer holds it.
        fleet.queued_prefill[home] = 100_000;
        let d = p
            .choose(&turn(&[1, 2, 3, 4, 8], 80), &fleet, &mut rng)
            .unwrap();
        assert_eq!(d, new_home, "memory on: {on}");
    }
}

/// The cache credit: a tail conversation's holder stays past the bound by its history's
/// tokens (by at most the bound with `credit_cap: 1`); without the credit it leaves at the
/// bound.
#[test]
fn the_cache_credit_keeps_a_conversation_past_the_bound_by_its_history() {
    use cacheroute::CacheRouteConfig;
    const BLOCKS: [u64; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
    let turn = |n: usize| RouteRequest {
        key: 3,
        blocks: &BLOCKS[..n],
        block_tokens: 100,
        prompt_tokens: n as u32 * 100,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    for (credit, cap) in [(true, 1.0), (true, 0.0), (false, 0.0)] {
        let mut p = cacheroute::CacheRoute::new(
            CacheRouteConfig {
                cache_credit: credit,
                credit_cap: cap,
                // The credit alone (the default slack of one prompt would keep it home).
                bound_slack: 0.0,
                ..Default::default()
            },
            4,
            1,
        );
        let mut fleet = FleetState::new(4);
        let home = p.choose(&turn(10), &fleet, &mut rng).unwrap();
        // Bound 1.25 × (800 + 1,100) / 4 = 594 tokens; the history spares 1,000.
        fleet.queued_prefill[home] = 800;
        let d = p.choose(&turn(11), &fleet, &mut rng).unwrap();
        assert_eq!(d == home, credit, "credit: {credit}");
        // Bound 1.25 × (2,100 + 1,200) / 4 = 1,031: below the bound plus the history (1,100)
        // it stays; with the credit capped at the bound (2,062) it leaves.
        fleet.queued_prefill[home] = 2_100;
        let again = p.choose(&turn(12), &fleet, &mut rng).unwrap();
        if credit {
            assert_eq!(again == home, cap == 0.0, "credit_cap: {cap}");
        }
    }
    // The cap is named in reports when not the default; a negative one is refused.
    let capped = CacheRouteConfig {
        credit_cap: 1.0,
        ..Default::default()
    };
    assert_eq!(capped.label(), "cacheroute-credit-cap1");
    let bad = PolicySpec::Cacheroute(CacheRouteConfig {
        credit_cap: -1.0,
        ..Default::default()
    });
    assert!(bad.problems().iter().any(|p| p.contains("credit_cap")));
    // The field is a boolean, named in reports when it is off; anything else is refused.
    let off = CacheRouteConfig {
        cache_credit: false,
        ..Default::default()
    };
    assert_eq!(off.label(), "cacheroute-no-credit");
    let bad: Result<PolicySpec, _> =
        serde_json::from_str(r#"{"policy":"cacheroute","cache_credit":"yes"}"#);
    assert!(
        bad.as_ref()
            .is_err_and(|e| e.to_string().contains("boolean")),
        "{bad:?}"
    );
}

/// Prompts of 200 blocks in the crowd that passes between two turns of one conversation.
const CROWD_PROMPT_BLOCKS: u64 = 200;
/// That crowd's size: 400,000 blocks, past a memory of 4 × 2^16, within one of 4 × 2^17.
const CROWD: u64 = 2_000;

/// Whether CacheRoute with `cfg` on 4 destinations still remembers a conversation after
/// [`CROWD`] other prompts of [`CROWD_PROMPT_BLOCKS`] blocks (and then sends its next turn
/// where its first went).
fn remembered_after_a_crowd(cfg: cacheroute::CacheRouteConfig) -> bool {
    const N: u64 = CROWD_PROMPT_BLOCKS;
    // Block hashes are hashes (the memory's map does not hash them again).
    let blocks = |base: u64, n: u64| {
        (0..n)
            .map(|i| crate::rng::mix64(base + i))
            .collect::<Vec<u64>>()
    };
    fn at(key: u64, b: &[u64]) -> RouteRequest<'_> {
        RouteRequest {
            key,
            blocks: b,
            block_tokens: 16,
            prompt_tokens: 16 * b.len() as u32,
            output_tokens: 10,
            now: 0.0,
        }
    }
    let fleet = FleetState::new(4);
    let conv = blocks(1 << 40, N + 1);
    let mut p = cacheroute::CacheRoute::new(cfg, 4, 1);
    let mut rng = seeded(1);
    let first = p
        .choose(&at(7, &conv[..N as usize]), &fleet, &mut rng)
        .unwrap();
    for k in 0..CROWD {
        let b = blocks((k + 1) << 20, N);
        p.choose(&at(1_000 + k, &b), &fleet, &mut rng).unwrap();
    }
    let before = p.remembered;
    let next = p.choose(&at(7, &conv), &fleet, &mut rng).unwrap();
    let found = p.remembered == before + 1;
    if found {
        assert_eq!(next, first);
    }
    found
}

/// `memory_blocks: sparse` records about log2(n) + 1 of a prompt's n blocks (its last, and
/// those at positions 1, 2, 4, …), so a conversation is still remembered after traffic that
/// flushes a memory of every block (the default) twice over: 2,000 prompts of 200 blocks are
/// 400,000 blocks against a memory of 262,144, but only 18,000 recorded ones.
#[test]
fn the_conversation_memory_outlasts_a_crowd_of_long_prompts() {
    use cacheroute::{memory_capacity, CacheRouteConfig, MemoryBlocks};
    let small = memory_capacity(&CacheRouteConfig::default(), 4) as u64;
    assert!(CROWD * CROWD_PROMPT_BLOCKS > small);
    for (memory_blocks, found) in [(MemoryBlocks::Sparse, true), (MemoryBlocks::Every, false)] {
        let cfg = CacheRouteConfig {
            memory_blocks,
            ..Default::default()
        };
        assert_eq!(remembered_after_a_crowd(cfg), found, "{memory_blocks:?}");
    }
    let sparse = CacheRouteConfig {
        memory_blocks: MemoryBlocks::Sparse,
        ..Default::default()
    };
    assert_eq!(sparse.label(), "cacheroute-sparse-memory");
    let bad: Result<PolicySpec, _> =
        serde_json::from_str(r#"{"policy":"cacheroute","memory_blocks":"some"}"#);
    assert!(bad.is_err(), "{bad:?}");
}

/// The conversation memory holds `memory_size` blocks per destination: resolved from the
/// engine model it is twice what one replica's KV cache holds (in prefix blocks), so it
/// remembers a conversation after a crowd of long prompts that flushes the size used where
/// the engine is unknown ([`cacheroute::CONVERSATION_MEMORY`] per destination); an explicit
/// size is kept, and one outside its range is refused.
#[test]
fn the_conversation_memory_is_sized_to_the_fleets_cache() {
    use cacheroute::{memory_capacity, CacheRouteConfig, CONVERSATION_MEMORY};
    let small = memory_capacity(&CacheRouteConfig::default(), 4) as u64;
    assert_eq!(small, 4 * CONVERSATION_MEMORY as u64);
    assert!(CROWD * CROWD_PROMPT_BLOCKS > small && CROWD * CROWD_PROMPT_BLOCKS < 2 * small);
    for (memory_size, found) in [(0, false), (2 * CONVERSATION_MEMORY as u64, true)] {
        let cfg = CacheRouteConfig {
            memory_size,
            ..Default::default()
        };
        assert_eq!(
            remembered_after_a_crowd(cfg),
            found,
            "memory_size {memory_size}"
        );
    }
    // Resolved from the engine model: twice one replica's KV cache, in prefix blocks.
    let engine =
        crate::engine::engine_config("llama-3.1-8b:h100:fp8:tp1", 16, &Default::default()).unwrap();
    let per = 2 * engine.kv_capacity_tokens() / engine.knobs().hash_block_tokens as u64;
    let resolved = |c: CacheRouteConfig| match calibrate::resolve_policy(
        &PolicySpec::Cacheroute(c),
        &engine,
    ) {
        PolicySpec::Cacheroute(c) => c.memory_size,
        other => panic!("{other:?}"),
    };
    assert_eq!(resolved(CacheRouteConfig::default()), per);
    assert!(per > CONVERSATION_MEMORY as u64, "{per}");
    let explicit = CacheRouteConfig {
        memory_size: 1_000,
        ..Default::default()
    };
    assert_eq!(resolved(explicit.clone()), 1_000);
    assert_eq!(explicit.label(), "cacheroute-memory1000");
    let bad = PolicySpec::Cacheroute(CacheRouteConfig {
        memory_size: 1 << 40,
        ..Default::default()
    });
    assert!(bad.problems().iter().any(|p| p.contains("memory_size")));
}

/// `bound_slack` lets the holder of a conversation's history take a request past the bounded
/// mean by that many of the request's prompts: with one long prompt queued there (800 tokens,
/// bound 1.25 × (800 + 1,000) / 4 = 562), the next turn (its history, 900 of 1,000 tokens,
/// remembered there) leaves without slack and stays with one prompt's. A request with nothing
/// remembered gets no slack: a new key whose ring home has the same queue goes elsewhere.
/// (The cache credit is off, to see the slack alone.)
#[test]
fn the_bound_slack_keeps_a_conversation_home_past_one_queued_prompt() {
    use cacheroute::CacheRouteConfig;
    const BLOCKS: [u64; 20] = [
        1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
    ];
    let req = |key: u64, b: &'static [u64]| RouteRequest {
        key,
        blocks: b,
        block_tokens: 100,
        prompt_tokens: 100 * b.len() as u32,
        output_tokens: 10,
        now: 0.0,
    };
    let mut rng = seeded(1);
    for (slack, stays) in [(0.0, false), (1.0, true)] {
        let make = || {
            let cfg = CacheRouteConfig {
                bound_slack: slack,
                cache_credit: false,
                ..Default::default()
            };
            cacheroute::CacheRoute::new(cfg, 4, 1)
        };
        let mut p = make();
        let mut fleet = FleetState::new(4);
        let home = p.choose(&req(11, &BLOCKS[..9]), &fleet, &mut rng).unwrap();
        fleet.queued_prefill[home] = 800;
        let d = p.choose(&req(11, &BLOCKS[..10]), &fleet, &mut rng).unwrap();
        assert_eq!(d == home, stays, "bound_slack {slack}");
        // A key never seen, whose prompt nothing remembers, at a home with the same queue (the
        // home found by an identical policy on an idle fleet).
        let mut fleet = FleetState::new(4);
        let home = make()
            .choose(&req(12, &BLOCKS[10..]), &fleet, &mut rng)
            .unwrap();
        fleet.queued_prefill[home] = 800;
        let d = make()
            .choose(&req(12, &BLOCKS[10..]), &fleet, &mut rng)
            .unwrap();
        assert_ne!(
            d, home,
            "bound_slack {slack}: a cold request gets the tight bound"
        );
    }
    let bad = PolicySpec::Cacheroute(CacheRouteConfig {
        bound_slack: -1.0,
        ..Default::default()
    });
    assert!(bad.problems().iter().any(|p| p.contains("bound_slack")));
}

/// docs/cacheroute.md spells `cacheroute-paper` as a spec entry; the spelling must stay the
/// published algorithm as defaults change (it lacked `conversations: false` once the memory
/// became the default, and studies that used it ran the memory).
#[test]
fn the_documented_spec_spelling_of_cacheroute_paper_is_cacheroute_paper() {
    let doc = include_str!("../../docs/cacheroute.md");
    let start = doc
        .find("in a spec write\n`")
        .expect("the spelling in docs/cacheroute.md")
        + 17;
    let end = start + doc[start..].find('`').unwrap();
    let spelled: PolicySpec = yaml_serde::from_str(&doc[start..end].replace('\n', " "))
        .unwrap_or_else(|e| panic!("{}: {e}", &doc[start..end]));
    assert_eq!(
        spelled,
        PolicySpec::from_name("cacheroute-paper").unwrap(),
        "{}",
        &doc[start..end]
    );
    // The study script's variant is the same spelling.
    let script = include_str!("../../scripts/defaults-table.py");
    let line = script
        .lines()
        .find(|l| l.contains("cold_tail: p2c"))
        .unwrap();
    let entry = line.trim().trim_end_matches(',').trim_matches('"');
    let scripted: PolicySpec = yaml_serde::from_str(entry).unwrap();
    assert_eq!(scripted, spelled, "{entry}");
}

/// `load: cost` is the request's predicted time to first token in idle-prefill tokens: an
/// idle destination costs 0; a queue costs what it would with `prefill` when nothing decodes
/// beside it; running decodes slow the prefill down, and a full batch adds the wait for a slot.
/// Unknown constants read as the queued prefill.
#[test]
fn the_cost_signal_prices_queued_prefill_running_decodes_and_the_wait_for_a_slot() {
    use cacheroute::CostModel;
    let engine = crate::engine::EngineConfig::parse("llama-3.1-8b:h100:fp8:tp1").unwrap();
    let m = calibrate::cost_model(&engine);
    assert!(m.known(), "{m:?}");
    assert_eq!(m.load_tokens(0, 0, 1000, 100), 0);
    // A queue alone: its tokens (rounding aside).
    let q = m.load_tokens(5000, 0, 1000, 100);
    assert!((4999..=5000).contains(&q), "{q}");
    // Decodes running beside it cost more than the queue alone, and more with more of them.
    let (d8, d32) = (
        m.load_tokens(5000, 8, 1000, 100),
        m.load_tokens(5000, 32, 1000, 100),
    );
    assert!(q < d8 && d8 < d32, "{q} {d8} {d32}");
    // Every slot taken: a request waits for one, about its output's worth of decode steps per
    // max_seqs requests ahead.
    let full = m.max_seqs;
    let before = m.load_tokens(0, full - 1, 1000, 100);
    let past = m.load_tokens(0, full + 9, 1000, 100);
    assert!(past > before + 1000, "{before} {past}");
    // Not known: the queued prefill.
    assert_eq!(CostModel::default().load_tokens(5000, 32, 1000, 100), 5000);
}

/// Within a planned set, `load: cost` prefers the member whose queue is a little longer but
/// that runs far fewer decodes; `load: prefill` takes the shorter queue.
#[test]
fn the_cost_signal_sees_the_decodes_the_prefill_signal_misses() {
    use cacheroute::{CacheRouteConfig, LoadSignal};
    let engine = crate::engine::EngineConfig::parse("llama-3.1-8b:h100:fp8:tp1").unwrap();
    let keys = [KeyLoad {
        key: 0,
        rate: 50.0,
        prefix_tokens: 0.0,
    }];
    let plan = Arc::new(build(&PlannerConfig::new(2, 30.0, 4), &keys, None).unwrap());
    let mut fleet = FleetState::new(2);
    // 0: 200 queued tokens beside 300 running decodes (on this engine they slow a prefill
    // chunk by about a tenth: 200 queued cost about 300); 1: 250 queued tokens, 1 request.
    fleet.outstanding[0] = 300;
    fleet.queued_prefill[0] = 200;
    fleet.outstanding[1] = 1;
    fleet.queued_prefill[1] = 250;
    let req = RouteRequest {
        key: 0,
        blocks: &[],
        block_tokens: 16,
        prompt_tokens: 500,
        output_tokens: 200,
        now: 0.0,
    };
    let pick = |load| {
        let cfg = CacheRouteConfig {
            load: Setting::Fixed(load),
            cost: calibrate::cost_model(&engine),
            ..Default::default()
        };
        let mut p = cacheroute::CacheRoute::new(cfg, 2, 1);
        p.install_plan(plan.clone());
        p.choose(&req, &fleet, &mut seeded(1)).unwrap()
    };
    assert_eq!(plan.lookup(0).unwrap().len(), 2);
    assert_eq!(pick(LoadSignal::Prefill), 0);
    assert_eq!(pick(LoadSignal::Cost), 1);
}

/// With the reactive dispatch in force (no plan), a planned key goes the prefix-aware tail's
/// way, not to its set; the control loop's dispatch never overrides a configured part.
#[test]
fn a_reactive_dispatch_ignores_the_plan_and_a_configured_part_wins() {
    use cacheroute::{CacheRouteConfig, ColdTail, Dispatch};
    let keys = [KeyLoad {
        key: 0,
        rate: 1.0,
        prefix_tokens: 0.0,
    }];
    let plan = Arc::new(build(&PlannerConfig::new(4, 30.0, 4), &keys, None).unwrap());
    let home = plan.lookup(0).unwrap()[0] as usize;
    let mut fleet = FleetState::new(4);
    // The planned home is the busiest destination; everything else idle.
    fleet.outstanding[home] = 5;
    fleet.queued_prefill[home] = 5000;
    let blocks = [11u64, 12, 13];
    let req = RouteRequest {
        key: 0,
        blocks: &blocks,
        block_tokens: 16,
        prompt_tokens: 48,
        output_tokens: 10,
        now: 0.0,
    };
    let mut p = cacheroute::CacheRoute::new(CacheRouteConfig::default(), 4, 1);
    p.install_plan(plan.clone());
    assert_eq!(p.dispatch(), Dispatch::PLANNED);
    // Under the plan the key's conversations go home, busy or not; the prefix tree (kept while
    // the tail is left to the control loop) sees them go there.
    let other = [[21u64, 22, 23], [31, 32, 33], [41, 42, 43]];
    for b in &other {
        let r = RouteRequest { blocks: b, ..req };
        assert_eq!(p.choose(&r, &fleet, &mut seeded(1)).unwrap(), home);
    }
    assert_eq!(p.choose(&req, &fleet, &mut seeded(1)).unwrap(), home);
    p.set_dispatch(Dispatch::REACTIVE);
    assert_eq!(p.dispatch(), Dispatch::REACTIVE);
    // A new prompt: the prefix tail explores, away from the destination it knows is loaded.
    let fresh = [51u64, 52, 53];
    let d = p
        .choose(
            &RouteRequest {
                blocks: &fresh,
                ..req
            },
            &fleet,
            &mut seeded(1),
        )
        .unwrap();
    assert_ne!(d, home, "the reactive dispatch followed the plan");
    // A prompt whose history is at home follows it there (the tree, warm from the plan).
    assert_eq!(p.choose(&req, &fleet, &mut seeded(1)).unwrap(), home);
    // A configured tail stays: the control loop's reactive choice keeps CHWBL.
    let cfg = CacheRouteConfig {
        cold_tail: Setting::Fixed(ColdTail::Chwbl),
        ..Default::default()
    };
    let mut p = cacheroute::CacheRoute::new(cfg, 4, 1);
    p.set_dispatch(Dispatch::REACTIVE);
    assert_eq!(p.dispatch().cold_tail, ColdTail::Chwbl);
    assert!(!p.dispatch().plan);
}

/// The dispatch's written form reads back, and a wrong one is refused saying what to write;
/// the cold tail and load signal settings read `auto` or a name, and refuse another word
/// listing the names.
#[test]
fn dispatch_and_named_settings_read_back_and_refuse_what_they_do_not_know() {
    use cacheroute::{ColdTail, Dispatch, LoadSignal};
    for d in [
        Dispatch::PLANNED,
        Dispatch::REACTIVE,
        Dispatch {
            plan: true,
            cold_tail: ColdTail::P2c,
            load: LoadSignal::Cost,
        },
    ] {
        assert_eq!(d.to_string().parse::<Dispatch>(), Ok(d));
    }
    assert_eq!(Dispatch::PLANNED.to_string(), "plan+chwbl+prefill");
    for bad in [
        "",
        "plan",
        "plan+chwbl",
        "plan+chwbl+prefill+x",
        "maybe+chwbl+prefill",
        "plan+ring+prefill",
        "plan+chwbl+queue",
    ] {
        let e = bad.parse::<Dispatch>().unwrap_err();
        assert!(e.contains("PLAN+TAIL+LOAD"), "{bad}: {e}");
    }
    assert_eq!(
        Setting::<LoadSignal>::parse_named("auto"),
        Ok(Setting::Auto)
    );
    assert_eq!(
        Setting::<LoadSignal>::parse_named("cost"),
        Ok(Setting::Fixed(LoadSignal::Cost))
    );
    let e = Setting::<ColdTail>::parse_named("ring").unwrap_err();
    assert!(
        e.contains("`ring`") && e.contains("auto, p2c, chwbl, prefix"),
        "{e}"
    );
    // In a spec: absent and `auto` automatic, a name fixed, a typo refused naming it.
    let c: cacheroute::CacheRouteConfig = yaml_serde::from_str("load: auto").unwrap();
    assert!(c.load.is_auto() && c.cold_tail.is_auto() && c.plan.is_auto());
    let c: cacheroute::CacheRouteConfig =
        yaml_serde::from_str("load: outstanding\ncold_tail: prefix\nplan: false").unwrap();
    assert_eq!(c.load, Setting::Fixed(LoadSignal::Outstanding));
    assert_eq!(
        c.default_dispatch(),
        Dispatch::REACTIVE.with_load(LoadSignal::Outstanding)
    );
    let e = yaml_serde::from_str::<cacheroute::CacheRouteConfig>("load: prefil").unwrap_err();
    assert!(e.to_string().contains("`prefil`"), "{e}");
    // Written back: fixed parts by name, automatic ones left out.
    let back = serde_json::to_value(&c).unwrap();
    assert_eq!(back["load"], "outstanding");
    assert!(
        serde_json::to_value(cacheroute::CacheRouteConfig::default()).unwrap()["load"].is_null()
    );
}

/// An unset `from_events` follows the engines' KV-cache events wherever they are available
/// (a subscribed router, the simulator) and keeps the approximate tree elsewhere; a value
/// the spec gives is kept either way. Were the default changed, this fails.
#[test]
fn from_events_defaults_on_where_the_events_are_available() {
    let spec = |y: &str| -> PolicySpec { yaml_serde::from_str(y).unwrap() };
    for y in [
        "{policy: cacheroute}",
        "{policy: cacheroute, cold_tail: prefix}",
    ] {
        assert!(spec(y).with_events(true).reads_kv_events(), "{y}");
        assert!(!spec(y).with_events(false).reads_kv_events(), "{y}");
        // Unsubscribed, the spec is left as written (its label and equality unchanged).
        assert_eq!(spec(y).with_events(false), spec(y), "{y}");
    }
    // Preble is the baseline as published: its own tree unless told otherwise.
    for y in [
        "{policy: preble}",
        "{policy: preble, from_events: false}",
        "{policy: cacheroute, prefix: {from_events: false}}",
        "{policy: cacheroute, cold_tail: p2c}",
        "{policy: cacheroute-paper}",
    ] {
        let s = if y.contains("paper") {
            PolicySpec::from_name("cacheroute-paper").unwrap()
        } else {
            spec(y)
        };
        assert!(!s.clone().with_events(true).reads_kv_events(), "{y}");
        assert_eq!(s.clone().with_events(true).label(), s.label(), "{y}");
    }
    // Explicitly on: on without the events too (the router then refuses to start unsubscribed).
    assert!(spec("{policy: preble, from_events: true}").reads_kv_events());
    // Policies that do not read the events are untouched.
    for n in ["flat-lb", "sticky", "llm-d", "dualmap"] {
        let s = PolicySpec::from_name(n).unwrap();
        assert_eq!(s.clone().with_events(true), s, "{n}");
    }
}
