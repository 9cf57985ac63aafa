//! Simulator speed: simulated requests per second of wall time (one core), for the flagship
//! engine (Llama-3.3-70B fp8 TP-2 on H100) at R = 8, 30 and 60 destinations and 1k or 128,824
//! keys, per-destination load held at ~3.3 req/s. Records are generated before timing.

use cacheroute::engine::engine_config;
use cacheroute::engine::KnobOverrides;
use cacheroute::policy::calibrate::warm_start;
use cacheroute::policy::PolicySpec;
use cacheroute::sim::{simulate, SimConfig};
use cacheroute::workload::gen::{GeneratorConfig, Workload};
use cacheroute::workload::trace::TraceRecord;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn bench_sim(c: &mut Criterion) {
    let mut g = c.benchmark_group("simulate");
    g.sample_size(10);
    for block in [16u32, 64, 512] {
        for (keys, r) in [
            (128_824usize, 30usize),
            (1_000, 30),
            (128_824, 8),
            (128_824, 60),
        ] {
            let mut cfg = GeneratorConfig::paper();
            cfg.keys.count = keys;
            cfg.prefix.block_size = block;
            let wl = Workload::load(&cfg).unwrap();
            let qps = 3.3 * r as f64;
            let duration = 60_000.0 / qps; // 60k requests
            let records: Vec<TraceRecord> = wl.generate(qps, duration, 1).unwrap().collect();
            let engine = engine_config(
                "llama-3.3-70b:h100:fp8:tp2",
                block,
                &KnobOverrides::default(),
            )
            .unwrap();
            let warm = warm_start(&wl, qps, 1).unwrap();
            g.throughput(Throughput::Elements(records.len() as u64));
            for policy in ["flat-lb", "cacheroute"] {
                let name = format!("{policy}/block{block}/keys{keys}/R{r}");
                g.bench_function(&name, |b| {
                    b.iter(|| {
                        let sim = SimConfig {
                            destinations: r,
                            engine: engine.clone(),
                            policy: PolicySpec::from_name(policy).unwrap(),
                            seed: 1,
                            failures: vec![],
                            horizon_s: f64::INFINITY,
                            warm_start: Some(warm.clone()),
                            seed_first_window: false,
                            router_replicas: 1,
                        };
                        simulate(sim, records.iter().cloned()).unwrap()
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, bench_sim);
criterion_main!(benches);
