//! Mechanism tests at fleet level: small configurations, fixed seeds.

use super::*;
use crate::analysis::record::Resolved;
use crate::engine::engine_config;
use crate::engine::KnobOverrides;
use crate::plan::KeyLoad;
use crate::policy::cacheroute::CacheRouteConfig;
use crate::policy::calibrate::warm_start;
use crate::policy::setting::Setting;
use crate::workload::gen::{GeneratorConfig, KeyDist, LengthDist, Workload};

/// A small fleet of 8B replicas with a KV cache of `kv_tokens` tokens each.
fn engine(kv_tokens: f64) -> EngineConfig {
    let o = KnobOverrides {
        kv_cache_bytes: Some(kv_tokens * 65_536.0),
        ..Default::default()
    };
    engine_config("llama-3.1-8b:h100:fp8:tp1", 64, &o).unwrap()
}

/// `active` keys out of 1000 send traffic; each has a 2k-token context and multi-turn
/// conversations, in 64-token blocks.
fn workload(active: usize, sigma: f64) -> Workload {
    workload_of(1000, Some(active), sigma)
}

fn workload_of(keys: usize, active: Option<usize>, sigma: f64) -> Workload {
    let mut c = GeneratorConfig::paper();
    c.keys.count = keys;
    c.keys.active = active;
    c.keys.dist = KeyDist::Lognormal { sigma };
    c.prefix.block_size = 64;
    c.prefix.system_prompt = LengthDist::Constant { value: 2048 };
    c.prefix.conversations_per_key = 8;
    c.prefix.user_message = LengthDist::Constant { value: 100 };
    c.prefix.output = LengthDist::Constant { value: 50 };
    Workload::load(&c).unwrap()
}

fn run(
    policy: &str,
    r: usize,
    w: &Workload,
    qps: f64,
    dur: f64,
    kv_tokens: f64,
    failures: Vec<Failure>,
) -> SimOutput {
    run_fronts(policy, r, w, qps, dur, kv_tokens, failures, 1)
}

#[allow(clippy::too_many_arguments)]
fn run_fronts(
    policy: &str,
    r: usize,
    w: &Workload,
    qps: f64,
    dur: f64,
    kv_tokens: f64,
    failures: Vec<Failure>,
    router_replicas: usize,
) -> SimOutput {
    let mut spec = if policy.starts_with('{') {
        yaml_serde::from_str(policy).unwrap()
    } else {
        PolicySpec::from_name(policy).unwrap()
    };
    if let PolicySpec::Cacheroute(c) = &mut spec {
        c.interval_s = 20.0;
    }
    let cfg = SimConfig {
        destinations: r,
        engine: engine(kv_tokens),
        policy: spec,
        seed: 7,
        failures,
        horizon_s: f64::INFINITY,
        warm_start: Some(warm_start(w, qps, 7).unwrap()),
        seed_first_window: false,
        router_replicas,
    };
    simulate(cfg, w.generate(qps, dur, 7).unwrap()).unwrap()
}

#[test]
fn router_replicas_split_what_a_router_learns_but_not_what_it_shares() {
    let w = workload(64, 1.0);
    let hit = |o: &SimOutput| o.summary(60.0, 240.0).served_kv_hit;
    let dests = |o: &SimOutput| o.records.iter().map(|r| r.destination).collect::<Vec<_>>();
    // A consistent-hash ring is the same in every replica: the same decisions, request by
    // request, with one router or three.
    let one = run_fronts("sticky", 8, &w, 16.0, 240.0, 200_000.0, vec![], 1);
    let three = run_fronts("sticky", 8, &w, 16.0, 240.0, 200_000.0, vec![], 3);
    assert_eq!(dests(&one), dests(&three));
    // Preble's own prefix tree is learned from each replica's own decisions: three replicas
    // each see a third of a key's requests, and the fleet keeps less of its prefixes.
    // (Its default, the baseline as published; were it the events, this fails.)
    let one = run_fronts("preble", 8, &w, 16.0, 240.0, 200_000.0, vec![], 1);
    let three = run_fronts("preble", 8, &w, 16.0, 240.0, 200_000.0, vec![], 3);
    assert!(
        hit(&three) < hit(&one) - 0.02,
        "preble, its own tree: {} with three replicas, {} with one",
        hit(&three),
        hit(&one)
    );
    // Following the engine model's KV-cache events, which every replica sees, the fleet
    // keeps its prefixes whatever the replicas, as well as one router does alone.
    let ev = "{policy: preble, from_events: true}";
    let one_ev = run_fronts(ev, 8, &w, 16.0, 240.0, 200_000.0, vec![], 1);
    let three_ev = run_fronts(ev, 8, &w, 16.0, 240.0, 200_000.0, vec![], 3);
    assert!(
        hit(&three_ev) > hit(&three) + 0.02 && hit(&three_ev) > hit(&one_ev) - 0.01,
        "preble on the events: {} with three replicas, {} with one; its own tree {} with three",
        hit(&three_ev),
        hit(&one_ev),
        hit(&three)
    );
    // CacheRoute's replicas install one plan from all of the traffic: admitted keys keep
    // their homes whatever replica routes them.
    let mut spec = PolicySpec::from_name("cacheroute-paper").unwrap();
    if let PolicySpec::Cacheroute(c) = &mut spec {
        c.interval_s = 20.0;
    }
    let plan_hit = |n: usize| {
        let cfg = SimConfig {
            destinations: 8,
            engine: engine(200_000.0),
            policy: spec.clone(),
            seed: 7,
            failures: vec![],
            horizon_s: f64::INFINITY,
            warm_start: Some(warm_start(&w, 16.0, 7).unwrap()),
            seed_first_window: false,
            router_replicas: n,
        };
        let o = simulate(cfg, w.generate(16.0, 240.0, 7).unwrap()).unwrap();
        (hit(&o), o.plans.len())
    };
    let ((h1, p1), (h3, p3)) = (plan_hit(1), plan_hit(3));
    assert_eq!(p1, p3, "one plan a control interval, whatever the replicas");
    assert!(
        h3 > h1 - 0.03,
        "cacheroute-paper: {h3} with three replicas, {h1} with one"
    );
}

#[test]
fn flat_lb_hit_rate_falls_as_the_fleet_grows() {
    // Eq. 1: at fixed load, a key revisits a given destination every ≈ R/λ_b seconds.
    let w = workload(64, 1.0);
    let hits: Vec<f64> = [2, 8, 32]
        .iter()
        .map(|&r| {
            run("flat-lb", r, &w, 16.0, 240.0, 200_000.0, vec![])
                .summary(30.0, 240.0)
                .served_kv_hit
        })
        .collect();
    assert!(
        hits[0] > hits[1] + 0.03 && hits[1] > hits[2] + 0.03,
        "hit should fall with R: {hits:?}"
    );
}

#[test]
fn sticky_imbalance_grows_with_key_skew() {
    let flat = run(
        "sticky",
        8,
        &workload_of(100, None, 0.3),
        12.0,
        200.0,
        200_000.0,
        vec![],
    )
    .summary(40.0, 200.0);
    let skewed = run(
        "sticky",
        8,
        &workload_of(100, None, 2.2),
        12.0,
        200.0,
        200_000.0,
        vec![],
    )
    .summary(40.0, 200.0);
    assert!(
        skewed.imbalance_requests > flat.imbalance_requests + 0.3,
        "{} vs {}",
        skewed.imbalance_requests,
        flat.imbalance_requests
    );
}

#[test]
fn cacheroute_keeps_stickys_hits_with_flat_lbs_balance() {
    let w = workload(64, 1.648);
    let (r, qps, dur, kv) = (8, 24.0, 300.0, 60_000.0);
    let s = |p: &str| run(p, r, &w, qps, dur, kv, vec![]).summary(60.0, dur);
    let (flat, sticky, cr) = (s("flat-lb"), s("sticky"), s("cacheroute"));
    assert!(
        cr.served_kv_hit >= sticky.served_kv_hit - 0.02,
        "hit: cacheroute {} sticky {}",
        cr.served_kv_hit,
        sticky.served_kv_hit
    );
    assert!(
        cr.served_kv_hit > flat.served_kv_hit + 0.05,
        "hit: cacheroute {} flat {}",
        cr.served_kv_hit,
        flat.served_kv_hit
    );
    assert!(
        cr.imbalance_requests <= flat.imbalance_requests + 0.15
            && sticky.imbalance_requests > cr.imbalance_requests + 0.3,
        "imbalance: cacheroute {} flat {} sticky {}",
        cr.imbalance_requests,
        flat.imbalance_requests,
        sticky.imbalance_requests
    );
}

#[test]
fn a_killed_destination_gets_nothing_while_down() {
    let w = workload(100, 1.0);
    for policy in [
        "flat-lb",
        "sticky",
        "chwbl",
        "cacheroute",
        "preble",
        "dualmap",
        "llm-d",
    ] {
        let f = vec![Failure {
            destination: 1,
            at_s: 60.0,
            recover_at_s: Some(120.0),
        }];
        let out = run(policy, 4, &w, 10.0, 180.0, 100_000.0, f);
        let before = out
            .records
            .iter()
            .filter(|r| r.scheduled_s < 60.0 && r.destination == Some(1))
            .count();
        assert!(
            before > 0,
            "{policy}: destination 1 served nothing before the failure"
        );
        for r in out
            .records
            .iter()
            .filter(|r| r.scheduled_s >= 60.0 && r.scheduled_s < 120.0)
        {
            assert_ne!(
                r.destination,
                Some(1),
                "{policy}: request {} went to the down destination",
                r.id
            );
            assert_eq!(
                r.status,
                Status::Ok,
                "{policy}: request {} scheduled while one was down failed",
                r.id
            );
        }
        // What was on it when it died: retried elsewhere if it had no first token, else failed.
        for r in out.records.iter().filter(|r| r.retried) {
            assert_ne!(r.destination, Some(1));
        }
        assert_eq!(out.destinations[1].failures, 1);
        let after = out
            .records
            .iter()
            .filter(|r| r.scheduled_s >= 130.0 && r.destination == Some(1))
            .count();
        assert!(
            after > 0,
            "{policy}: nothing routed to destination 1 after recovery"
        );
        assert!(
            out.records.iter().all(|r| r.status != Status::Unfinished),
            "{policy}: unfinished requests"
        );
    }
}

#[test]
fn same_inputs_same_output() {
    let w = workload(100, 1.648);
    let f = || {
        vec![Failure {
            destination: 2,
            at_s: 50.0,
            recover_at_s: Some(80.0),
        }]
    };
    let a = run("cacheroute", 6, &w, 15.0, 120.0, 50_000.0, f());
    let b = run("cacheroute", 6, &w, 15.0, 120.0, 50_000.0, f());
    assert_eq!(format!("{:?}", a.records), format!("{:?}", b.records));
    assert_eq!(a.destinations, b.destinations);
    assert_eq!(a.plans, b.plans);
    assert!(a.plans.len() > 2);
    assert!(a.plans.iter().any(|p| p.repair));
}

#[test]
fn an_overloaded_step_fails_the_rate_rule_and_a_light_one_passes_it() {
    use crate::analysis::capacity::verdict;
    use crate::analysis::model::{Slo, SloMetric};
    use crate::analysis::step::{step_metrics, Window};
    // One replica; every request eventually finishes (no horizon), so only a rule that counts
    // completions inside the window can see that the replica fell behind.
    let w = workload(64, 1.0);
    let window = Window {
        from_s: 10.0,
        to_s: 40.0,
    };
    // An SLO no step can break, so the rate rule alone decides.
    let slo = Slo {
        metric: SloMetric::E2e,
        p99_s: 1e9,
    };
    let rates = std::collections::HashMap::new();
    let step = |qps: f64| {
        let out = run("flat-lb", 1, &w, qps, 40.0, 200_000.0, vec![]);
        assert!(out.records.iter().all(|r| r.status == Status::Ok));
        step_metrics(out.records.iter().copied(), &rates, 1, window, qps)
    };
    let light = step(2.0);
    assert!(verdict(&light, &slo).rate_ok, "light step: {light:?}");
    let heavy = step(400.0);
    let v = verdict(&heavy, &slo);
    assert!(
        !v.rate_ok && v.latency_ok && v.errors_ok,
        "overloaded step: achieved {} of {} offered",
        heavy.achieved_qps,
        heavy.requests as f64 / heavy.window_s
    );
}

/// A stationary workload whose two whales need k_b = 3 (10 req/s each, q_cap 4): every plan
/// the control loop installs after the warm start keeps the warm-start plan's replication.
/// (With the rate meter starting at zero, the plans at 20 s and 40 s saw 50% and 75% of the
/// rates and gave the whales k_b = 2.)
#[test]
fn stationary_workload_keeps_its_warm_start_replication() {
    let mut c = GeneratorConfig::paper();
    c.keys.count = 200;
    c.keys.active = Some(32);
    c.keys.dist = KeyDist::Lognormal { sigma: 0.3 };
    c.keys.whales = Some(crate::workload::gen::Whales {
        count: 2,
        share: 0.5,
    });
    c.prefix.block_size = 64;
    c.prefix.system_prompt = LengthDist::Constant { value: 256 };
    c.prefix.user_message = LengthDist::Constant { value: 32 };
    c.prefix.output = LengthDist::Constant { value: 8 };
    let w = Workload::load(&c).unwrap();
    let (qps, dur) = (40.0, 130.0);
    let mut spec = PolicySpec::from_name("cacheroute").unwrap();
    if let PolicySpec::Cacheroute(c) = &mut spec {
        c.interval_s = 20.0;
        c.q_cap = Setting::Fixed(4.0);
        c.warm_slots = Setting::Fixed(64);
    }
    let cfg = SimConfig {
        destinations: 8,
        engine: engine(100_000.0),
        policy: spec,
        seed: 7,
        failures: vec![],
        horizon_s: f64::INFINITY,
        warm_start: Some(warm_start(&w, qps, 7).unwrap()),
        seed_first_window: false,
        router_replicas: 1,
    };
    let out = simulate(cfg, w.generate(qps, dur, 7).unwrap()).unwrap();
    let plans: Vec<_> = out.plans.iter().filter(|p| !p.repair).collect();
    assert!(plans.len() >= 6, "{} plans", plans.len());
    let first = plans[0];
    assert_eq!(first.at_s, 0.0);
    // Every active key is admitted and the whales are replicated.
    assert_eq!(first.admitted, 32);
    let replicas = first.replicas.expect("the controller records Σ k_b");
    assert!(replicas >= 36, "Σ k_b {replicas}");
    for p in &plans[1..] {
        assert_eq!(
            (p.admitted, p.replicas),
            (first.admitted, first.replicas),
            "plan at {} s: admitted keys and Σ k_b differ from the warm start's",
            p.at_s
        );
    }
}

/// Self-calibration: a tuned plan says what it chose and why, the values it chose are the ones
/// planned with, and explicit q_cap / W / bounded sets are never tuned.
#[test]
fn self_calibration_records_its_choice_and_explicit_values_win() {
    let w = workload(40, 1.0);
    let out = run("cacheroute", 4, &w, 40.0, 100.0, 200_000.0, vec![]);
    let tuned: Vec<&PlanRecord> = out.plans.iter().filter(|p| p.tuning.is_some()).collect();
    assert!(!tuned.is_empty(), "no tuned plan: {:?}", out.plans);
    let note = tuned[0].tuning.as_deref().unwrap();
    assert!(
        note.contains("predicted p99") && note.contains("replays"),
        "{note}"
    );
    // The dispatch the plan was in force with is the one the note names.
    let d = tuned[0]
        .dispatch
        .expect("a tuned plan records its dispatch");
    assert!(note.contains(&format!("{d} dispatch")), "{note} vs {d}");
    assert!(
        note.contains(&format!("W {}", tuned[0].warm_slots.unwrap())),
        "the note names the W planned with: {note} vs {:?}",
        tuned[0].warm_slots
    );
    // Explicit values: nothing tuned, the configured values planned with.
    let mut spec = PolicySpec::from_name("cacheroute").unwrap();
    if let PolicySpec::Cacheroute(c) = &mut spec {
        c.interval_s = 20.0;
        c.q_cap = Setting::Fixed(7.5);
        c.warm_slots = Setting::Fixed(9);
        c.bounded_sets = Setting::Fixed(false);
        c.plan = Setting::Fixed(true);
        c.cold_tail = Setting::Fixed(crate::policy::cacheroute::ColdTail::Chwbl);
        c.load = Setting::Fixed(crate::policy::cacheroute::LoadSignal::Prefill);
    }
    let cfg = SimConfig {
        destinations: 4,
        engine: engine(200_000.0),
        policy: spec,
        seed: 7,
        failures: vec![],
        horizon_s: f64::INFINITY,
        warm_start: Some(warm_start(&w, 40.0, 7).unwrap()),
        seed_first_window: false,
        router_replicas: 1,
    };
    let out = simulate(cfg, w.generate(40.0, 100.0, 7).unwrap()).unwrap();
    assert!(out.plans.iter().all(|p| p.tuning.is_none()));
    assert!(out
        .plans
        .iter()
        .all(|p| p.q_cap == Some(7.5) && p.warm_slots == Some(9)));
}

/// The tuner sees what a pinned plan does to one hot key: with every request on one key at
/// far more than one replica sustains, it never keeps that key on a single pinned replica.
#[test]
fn tuning_avoids_pinning_a_hot_key_to_one_replica() {
    let w = workload(1, 1.0);
    let records: Vec<TraceRecord> = w.generate(60.0, 40.0, 3).unwrap().collect();
    let key = crate::key_hash(&records[0].key);
    let rates = vec![KeyLoad {
        key,
        rate: 60.0,
        prefix_tokens: 2148.0,
    }];
    // Start from q_cap far above the key's rate (k = 1) and pinned sets.
    let policy = CacheRouteConfig::default();
    let eng = engine(200_000.0);
    let t = tune::tune(&tune::TuneInput {
        engine: &eng,
        destinations: 4,
        policy: &policy,
        window: &records,
        rates: &rates,
        current: Some(Resolved {
            q_cap: 1000.0,
            warm_slots: 8,
            bounded_sets: false,
            dispatch: Default::default(),
        }),
        seed: 1,
    });
    let k = crate::plan::replicas_for(60.0, t.settings.q_cap, 4);
    assert!(
        k > 1 || t.settings.bounded_sets,
        "kept the hot key on one pinned replica: {t:?}"
    );
}

/// Hysteresis: when no candidate predicts a clearly better tail (a light load every candidate
/// serves alike), the values in force stay, although the tie-break alone would pick smaller
/// ones.
#[test]
fn tuning_keeps_the_values_in_force_without_a_clear_gain() {
    let w = workload(40, 1.0);
    let records: Vec<TraceRecord> = w.generate(2.0, 60.0, 5).unwrap().collect();
    assert!(records.len() >= 50);
    let mut rates: Vec<KeyLoad> = Vec::new();
    for r in &records {
        let key = crate::key_hash(&r.key);
        match rates.iter_mut().find(|k| k.key == key) {
            Some(k) => k.rate += 1.0 / 60.0,
            None => rates.push(KeyLoad {
                key,
                rate: 1.0 / 60.0,
                prefix_tokens: 2148.0,
            }),
        }
    }
    // The dispatch fixed: this is about q_cap, W and the sets.
    let policy = CacheRouteConfig {
        plan: Setting::Fixed(true),
        cold_tail: Setting::Fixed(crate::policy::cacheroute::ColdTail::Chwbl),
        load: Setting::Fixed(crate::policy::cacheroute::LoadSignal::Prefill),
        ..CacheRouteConfig::default()
    };
    let eng = engine(200_000.0);
    // q_cap is the engine model's for this window's shape (not searched): in force within
    // 25% of it, it stays.
    let shape = WarmStart::from_sample(Vec::new(), &records);
    let est = crate::policy::calibrate::estimate_q_cap(
        &eng,
        shape.mean_prompt_tokens,
        shape.mean_output_tokens,
    );
    let tune_from = |q: f64| {
        tune::tune(&tune::TuneInput {
            engine: &eng,
            destinations: 4,
            policy: &policy,
            window: &records,
            rates: &rates,
            current: Some(Resolved {
                q_cap: q,
                warm_slots: 2,
                bounded_sets: false,
                dispatch: Default::default(),
            }),
            seed: 1,
        })
    };
    let t = tune_from(est * 1.2);
    assert_eq!(
        (
            t.settings.q_cap,
            t.settings.warm_slots,
            t.settings.bounded_sets
        ),
        (est * 1.2, 2, false),
        "{}",
        t.why
    );
    assert!(t.why.starts_with("kept"), "{}", t.why);
    // A q_cap in force 2× the estimate follows it; W and sets still stay.
    let t = tune_from(est * 2.0);
    assert_eq!(
        (
            t.settings.q_cap,
            t.settings.warm_slots,
            t.settings.bounded_sets
        ),
        (est, 2, false),
        "{}",
        t.why
    );
}

/// The self-calibration chooses the dispatch from what it replays: one very hot key, which a
/// reactive router piles onto the replica that holds its prefix, keeps the plan (it replicates
/// the key over k_b replicas); single-turn prompts of mostly request-unique content, where a
/// plan has nothing to hold, go reactive. Fails if the choice were fixed either way.
#[test]
fn the_replay_picks_the_dispatch_per_workload() {
    use crate::policy::cacheroute::Dispatch;
    let eng = engine(200_000.0);
    let tune_on = |records: &[TraceRecord], qps_window_s: f64| {
        let mut rates: Vec<KeyLoad> = Vec::new();
        for r in records {
            let key = crate::key_hash(&r.key);
            match rates.iter_mut().find(|k| k.key == key) {
                Some(k) => k.rate += 1.0 / qps_window_s,
                None => rates.push(KeyLoad {
                    key,
                    rate: 1.0 / qps_window_s,
                    prefix_tokens: 0.0,
                }),
            }
        }
        let policy = match crate::policy::calibrate::resolve_policy(
            &PolicySpec::Cacheroute(CacheRouteConfig::default()),
            &eng,
        ) {
            PolicySpec::Cacheroute(c) => c,
            _ => unreachable!(),
        };
        tune::tune(&tune::TuneInput {
            engine: &eng,
            destinations: 4,
            policy: &policy,
            window: records,
            rates: &rates,
            current: None,
            seed: 1,
        })
    };
    // One key at 60 req/s on 4 replicas.
    let hot: Vec<TraceRecord> = workload(1, 1.0).generate(60.0, 40.0, 3).unwrap().collect();
    let t = tune_on(&hot, 40.0);
    // Many keys, ~3k tokens of unique content behind a short per-key prompt, single turns.
    let mut c = GeneratorConfig::paper();
    c.keys.count = 5000;
    c.keys.active = Some(2000);
    c.keys.dist = KeyDist::Lognormal { sigma: 1.6 };
    c.prefix.block_size = 64;
    c.prefix.system_prompt = LengthDist::Constant { value: 300 };
    c.prefix.conversations_per_key = 64;
    c.prefix.mean_turns = 1.0;
    c.prefix.user_message = LengthDist::Constant { value: 3000 };
    c.prefix.output = LengthDist::Constant { value: 25 };
    let cold: Vec<TraceRecord> = Workload::load(&c)
        .unwrap()
        .generate(12.0, 60.0, 3)
        .unwrap()
        .collect();
    let t2 = tune_on(&cold, 60.0);
    assert_eq!(t.settings.dispatch, Dispatch::PLANNED, "{}", t.why);
    assert_eq!(t2.settings.dispatch, Dispatch::REACTIVE, "{}", t2.why);
}

/// The engine model's KV-cache events reach a policy that reads them (Dynamo's router), in an
/// order its own index accepts (every store extends a prefix the destination holds), and only
/// then: other policies' replicas record nothing.
#[test]
fn kv_events_reach_a_policy_that_reads_them() {
    use crate::policy::dynamo::{Dynamo, DynamoConfig};
    use crate::policy::{FleetView, KvEvent, RouteError};
    use std::sync::{Arc, Mutex};

    type Log = Arc<Mutex<Vec<(usize, KvEvent)>>>;
    struct Recorder {
        inner: Dynamo,
        log: Log,
        /// Pass the events on (else the router routes blind, by load alone).
        forward: bool,
    }
    impl Policy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn choose(
            &mut self,
            req: &RouteRequest,
            fleet: &dyn FleetView,
            rng: &mut crate::rng::Rng64,
        ) -> Result<usize, RouteError> {
            self.inner.choose(req, fleet, rng)
        }
        fn on_complete(&mut self, req: &RouteRequest, dest: usize, done: &Completion) {
            self.inner.on_complete(req, dest, done)
        }
        fn on_kv_events(&mut self, dest: usize, events: &[KvEvent]) {
            let mut log = self.log.lock().unwrap();
            log.extend(events.iter().map(|e| (dest, e.clone())));
            if self.forward {
                self.inner.on_kv_events(dest, events)
            }
        }
    }

    let w = workload(64, 1.0);
    // A small cache (evictions) and a failure (a cleared destination).
    let cfg = |policy: PolicySpec| SimConfig {
        destinations: 8,
        engine: engine(40_000.0),
        policy,
        seed: 7,
        failures: vec![Failure {
            destination: 2,
            at_s: 10.0,
            recover_at_s: Some(12.0),
        }],
        horizon_s: f64::INFINITY,
        warm_start: None,
        seed_first_window: false,
        router_replicas: 1,
    };
    let flat = Simulator::new(cfg(PolicySpec::FlatLb)).unwrap();
    assert!(flat.replicas.iter().all(|r| !r.cache().recording()));

    let spec = PolicySpec::Dynamo(DynamoConfig::default());
    let dynamo = |forward: bool| {
        let mut sim = Simulator::new(cfg(spec.clone())).unwrap();
        assert!(sim.replicas.iter().all(|r| r.cache().recording()));
        let log: Log = Arc::default();
        sim.fronts[0].policy = Box::new(Recorder {
            inner: Dynamo::new(8, DynamoConfig::default()),
            log: log.clone(),
            forward,
        });
        (sim, log)
    };
    let (sim, log) = dynamo(true);
    let trace: Vec<TraceRecord> = w.generate(40.0, 20.0, 7).unwrap().collect();
    let prompts: std::collections::HashSet<u64> = trace
        .iter()
        .flat_map(|r| chain_hashes(&r.hash_ids))
        .collect();
    let out = sim.run(trace.clone()).unwrap();
    let log = log.lock().unwrap();
    let count = |f: fn(&KvEvent) -> bool| log.iter().filter(|(_, e)| f(e)).count();
    assert!(
        count(|e| matches!(e, KvEvent::Stored { .. })) > 100,
        "{}",
        log.len()
    );
    assert!(
        count(|e| matches!(e, KvEvent::Removed { .. })) > 10,
        "{}",
        log.len()
    );
    assert_eq!(
        log.iter()
            .filter(|(d, e)| *d == 2 && *e == KvEvent::AllCleared)
            .count(),
        1
    );
    // Replayed into a model of each destination's cache: every stored block is a prompt's, and
    // follows a parent the destination holds; every removed block was held.
    let mut held: Vec<std::collections::HashSet<u64>> = vec![Default::default(); 8];
    for (d, e) in log.iter() {
        match e {
            KvEvent::Stored { parent, blocks } => {
                assert!(parent.is_none_or(|p| held[*d].contains(&p)), "{e:?}");
                for b in blocks {
                    assert!(prompts.contains(b) && held[*d].insert(*b), "{e:?}");
                }
            }
            KvEvent::Removed { blocks } => {
                for b in blocks {
                    assert!(held[*d].remove(b), "{e:?}");
                }
            }
            KvEvent::AllCleared => held[*d].clear(),
        }
    }
    // The router used them: more of the prompts hit the cache than with the events withheld
    // (or under flat-lb).
    let hit = |o: &SimOutput| o.summary(0.0, 30.0).served_kv_hit;
    let blind = dynamo(false).0.run(trace.clone()).unwrap();
    let flat = flat.run(trace).unwrap();
    assert!(
        hit(&out) > hit(&blind) + 0.2,
        "{} {}",
        hit(&out),
        hit(&blind)
    );
    assert!(hit(&out) > hit(&flat) + 0.2, "{} {}", hit(&out), hit(&flat));
}
