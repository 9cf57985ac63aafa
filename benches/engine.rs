//! Engine-model speed: a 30-replica flagship fleet (Llama-3.3-70B fp8 TP-2 on H100) driven by a
//! minimal event loop, in simulated requests per second of wall time; plus the cost functions.
//! Also prints the derived figures (KV capacities, flagship prefill/decode times) once.
//!
//! Run: `cargo bench --bench engine` (criterion reports `thrpt` in requests/s).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hint::black_box;

use cacheroute::engine::{
    chain_hashes, EngineConfig, EngineEvent, EngineKnobs, EngineRequest, EngineSpec, Replica,
};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

const REPLICAS: usize = 30;
const REQUESTS: usize = 20_000;

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Poisson arrivals at `qps`; 3,000 keys with skewed popularity; a 2,048-token shared prefix per
/// key plus a 512–2,047-token unique suffix; 100–499 output tokens.
/// Hash ids are per `hb`-token block.
fn workload(n: usize, qps: f64, hb: u64) -> Vec<(f64, usize, EngineRequest)> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            let u = (xorshift(&mut x) >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / qps;
            let r = (xorshift(&mut x) % 1_000_000) as f64 / 1_000_000.0;
            let key = (3000.0 * r * r * r) as u64; // skewed towards low keys
            let suffix = 512 + xorshift(&mut x) % 1536;
            let mut ids: Vec<u64> = (0..2048 / hb).map(|j| key * 1000 + j).collect();
            ids.extend((0..suffix / hb).map(|j| (1 << 40) + i as u64 * 1000 + j));
            let prompt = 2048 + suffix as u32;
            let output = 100 + (xorshift(&mut x) % 400) as u32;
            let req = EngineRequest {
                id: i as u64,
                prompt_tokens: prompt,
                output_tokens: output,
                block_hashes: chain_hashes(&ids),
            };
            (t, key as usize % REPLICAS, req)
        })
        .collect()
}

/// Minimal discrete-event loop: one heap entry per replica at its next event time (stale
/// entries skipped), arrivals routed by key. Returns (finished requests, replica events).
fn simulate(cfg: &EngineConfig, arrivals: Vec<(f64, usize, EngineRequest)>) -> (usize, u64) {
    let mut reps: Vec<Replica> = (0..REPLICAS).map(|_| Replica::new(cfg.clone())).collect();
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut out = Vec::with_capacity(64);
    let mut finished = 0;
    let mut events = 0u64;
    let mut arrivals = arrivals.into_iter().peekable();
    let push = |heap: &mut BinaryHeap<_>, r: &Replica, i: usize| {
        if let Some(t) = r.next_event_time() {
            heap.push(Reverse((f64::to_bits(t), i)));
        }
    };
    loop {
        let next_ev = heap.peek().map(|Reverse((t, _))| f64::from_bits(*t));
        match (arrivals.peek().map(|a| a.0), next_ev) {
            (Some(a), e) if e.is_none_or(|e| a <= e) => {
                let (t, dest, req) = arrivals.next().unwrap();
                reps[dest].submit(req, t).unwrap();
                push(&mut heap, &reps[dest], dest);
            }
            (_, Some(_)) => {
                let Reverse((tb, i)) = heap.pop().unwrap();
                if reps[i].next_event_time().map(f64::to_bits) != Some(tb) {
                    continue; // stale
                }
                events += 1;
                reps[i].advance(f64::from_bits(tb), &mut out);
                finished += out
                    .iter()
                    .filter(|e| matches!(e, EngineEvent::Finished { .. }))
                    .count();
                out.clear();
                push(&mut heap, &reps[i], i);
            }
            (None, None) => break,
            (Some(_), None) => unreachable!(),
        }
    }
    (finished, events)
}

fn print_figures() {
    eprintln!("KV capacity (default knobs):");
    for spec in [
        "llama-3.3-70b:h100:fp8:tp2",
        "llama-3.3-70b:h100:fp16:tp2",
        "llama-3.3-70b:h200:fp8:tp2",
        "llama-3.1-8b:h100:fp8:tp1",
        "llama-3.1-8b:h100:bf16:tp1",
        "qwen2.5-32b:h100:fp8:tp1",
        "qwen2.5-32b:h100:bf16:tp2",
        "tiny:cpu:bf16:tp1",
    ] {
        let c = EngineConfig::parse(spec).unwrap();
        eprintln!(
            "  {spec:30} kv {:6.0} KiB/token  weights {:6.1} GiB  capacity {:>9} tokens = {:>7} blocks of {}",
            c.kv_bytes_per_token() / 1024.0,
            c.weight_bytes() / (1u64 << 30) as f64,
            c.kv_capacity_tokens(),
            c.kv_capacity_blocks(),
            c.knobs().block_size
        );
    }
    let f = EngineConfig::parse("llama-3.3-70b:h100:fp8:tp2").unwrap();
    eprintln!("flagship llama-3.3-70b:h100:fp8:tp2 (ms):");
    for (n, c) in [(1000, 0), (3000, 0), (8192, 0), (1000, 3000), (16, 4080)] {
        eprintln!(
            "  prefill_time({n}, {c}) = {:.2}",
            f.prefill_time(n, c) * 1e3
        );
    }
    for (b, ctx) in [
        (1u32, 3000u64),
        (32, 32 * 3300),
        (64, 64 * 3300),
        (128, 128 * 3300),
    ] {
        eprintln!(
            "  decode_step_time({b}, {ctx}) = {:.2}",
            f.decode_step_time(b, ctx) * 1e3
        );
    }
}

fn bench(c: &mut Criterion) {
    print_figures();
    let spec: EngineSpec = "llama-3.3-70b:h100:fp8:tp2".parse().unwrap();
    let mut g = c.benchmark_group("fleet");
    g.sample_size(10);
    g.throughput(Throughput::Elements(REQUESTS as u64));
    for hb in [16u32, 512] {
        let mut knobs = EngineKnobs::for_spec(&spec);
        knobs.hash_block_tokens = hb;
        let cfg = EngineConfig::with_knobs(spec.clone(), knobs).unwrap();
        let arrivals = workload(REQUESTS, 150.0, hb as u64);
        let (done, events) = simulate(&cfg, arrivals.clone());
        assert_eq!(done, REQUESTS);
        eprintln!(
            "fleet: {REPLICAS} replicas, {REQUESTS} requests at 150 QPS, hash blocks of {hb}: \
             {events} replica events ({:.2} per request)",
            events as f64 / REQUESTS as f64
        );
        g.bench_function(format!("flagship_30_replicas_150qps_hash{hb}"), |b| {
            b.iter_batched(
                || arrivals.clone(),
                |a| black_box(simulate(&cfg, a)),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
    let cfg = EngineConfig::new(spec).unwrap();
    let mut g = c.benchmark_group("cost");
    g.bench_function("decode_step_time", |b| {
        b.iter(|| black_box(&cfg).decode_step_time(black_box(64), black_box(200_000)))
    });
    g.bench_function("prefill_time", |b| {
        b.iter(|| black_box(&cfg).prefill_time(black_box(3000), black_box(1000)))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
