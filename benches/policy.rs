//! Per-decision cost of each policy at R = 30 with paper-shaped keys (no I/O; the fleet
//! view is a plain vector as in the simulator).

use cacheroute::plan::{build, KeyLoad, PlannerConfig};
use cacheroute::policy::{FleetState, PolicySpec, RouteRequest};
use cacheroute::workload::rates;
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::Arc;

fn bench_policies(c: &mut Criterion) {
    let n = 128_824;
    let mut rng = cacheroute::rng::seeded(1);
    let r = rates::lognormal_rates(n, 1.648, 150.0, &mut rng);
    let keys: Vec<KeyLoad> = r
        .iter()
        .enumerate()
        .map(|(i, &rate)| KeyLoad {
            key: cacheroute::key_hash(&rates::key_name(i)),
            rate,
            prefix_tokens: 0.0,
        })
        .collect();
    let plan = Arc::new(build(&PlannerConfig::new(30, 6.0, 128), &keys, None).unwrap());
    // Requests drawn by rate, as traffic would arrive.
    let mut cum = Vec::with_capacity(n);
    let mut s = 0.0;
    for k in &keys {
        s += k.rate;
        cum.push(s);
    }
    let reqs: Vec<u64> = (0..4096)
        .map(|i| {
            let u = (cacheroute::policy::ring::mix64(i) >> 11) as f64 / (1u64 << 53) as f64 * s;
            keys[cum.partition_point(|&c| c < u).min(n - 1)].key
        })
        .collect();
    let blocks: Vec<u64> = (0..64).collect();
    let mut fleet = FleetState::new(30);
    for d in 0..30 {
        fleet.outstanding[d] = (d as u32 * 7) % 11;
    }
    let mut g = c.benchmark_group("decision");
    for name in [
        "flat-lb",
        "sticky",
        "chwbl",
        "cacheroute",
        "dualmap",
        "preble",
    ] {
        let mut p = PolicySpec::from_name(name).unwrap().build(30, 1);
        if let Some(planned) = p.planned() {
            planned.install_plan(plan.clone());
        }
        let mut rng = cacheroute::rng::seeded(9);
        let mut i = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) & 4095;
                let req = RouteRequest {
                    key: reqs[i],
                    blocks: &blocks[..(i & 63)],
                    block_tokens: 16,
                    prompt_tokens: 1024,
                    output_tokens: 128,
                    now: i as f64 * 1e-3,
                };
                black_box(p.choose(black_box(&req), &fleet, &mut rng).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_policies);
criterion_main!(benches);
