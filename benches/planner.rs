//! Planner construction time: the paper's setting (128,824 keys, R = 30) and 10M keys.
//! Compare with `python3 scripts/plan_heapq.py data/paper-rates.csv` on the same input.

use cacheroute::plan::{build, replan, KeyLoad, PlannerConfig};
use cacheroute::workload::rates;
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

fn paper_keys(n: usize, seed: u64) -> Vec<KeyLoad> {
    let mut rng = cacheroute::rng::seeded(seed);
    let r = rates::lognormal_rates(n, 1.648, 150.0, &mut rng);
    r.iter()
        .enumerate()
        .map(|(i, &rate)| KeyLoad {
            key: cacheroute::key_hash(&rates::key_name(i)),
            rate,
            prefix_tokens: 0.0,
        })
        .collect()
}

fn bench_planner(c: &mut Criterion) {
    let cfg = PlannerConfig::new(30, 6.0, 128);
    // The bundled file's exact input, when present (same as the Python comparison).
    let keys = std::fs::read("data/paper-rates.csv")
        .ok()
        .and_then(|b| rates::read_rates_csv(&b[..]).ok())
        .map(|r| cacheroute::plan::export::key_loads(&r))
        .unwrap_or_else(|| paper_keys(128_824, 1));
    c.bench_function("plan/paper_128824_keys_R30", |b| {
        b.iter(|| build(black_box(&cfg), black_box(&keys), None).unwrap())
    });

    let mut drifted = keys.clone();
    let mut rng = cacheroute::rng::seeded(2);
    let mut rs: Vec<f64> = drifted.iter().map(|k| k.rate).collect();
    rates::drift_step(&mut rs, 0.3, &mut rng);
    for (k, r) in drifted.iter_mut().zip(rs) {
        k.rate = r;
    }
    let prev = build(&cfg, &keys, None).unwrap().key_sets();
    c.bench_function("plan/churn_aware_replan_128824_keys_R30", |b| {
        b.iter(|| replan(black_box(&cfg), black_box(&drifted), &prev, None).unwrap())
    });

    let big = paper_keys(10_000_000, 3);
    let mut g = c.benchmark_group("plan_10m");
    g.sample_size(10);
    g.bench_function("plan/10M_keys_R30", |b| {
        b.iter(|| build(black_box(&cfg), black_box(&big), None).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench_planner);
criterion_main!(benches);
