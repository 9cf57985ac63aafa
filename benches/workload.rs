//! Workload speed: generating the paper workload with prefix chains, computing trace stats,
//! and parsing trace lines. Rerun with `cargo bench --bench workload`.

use cacheroute::workload::gen::{GeneratorConfig, Workload};
use cacheroute::workload::stats::{self, StatsOptions};
use cacheroute::workload::trace::{encode_line, ReaderOptions, TraceReader};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

const N: u64 = 100_000;

fn bench(c: &mut Criterion) {
    let wl = Workload::from_config(GeneratorConfig::paper()).unwrap();
    let mut g = c.benchmark_group("workload");
    g.sample_size(10);
    g.throughput(Throughput::Elements(N));
    g.bench_function("gen_paper_100k_block16", |b| {
        b.iter(|| {
            wl.generate(1000.0, 1e9, 1)
                .unwrap()
                .take(N as usize)
                .map(|r| r.hash_ids.len())
                .sum::<usize>()
        })
    });
    let records: Vec<_> = wl
        .generate(1000.0, 1e9, 1)
        .unwrap()
        .take(N as usize)
        .collect();
    let mut text = Vec::new();
    let mut line = Vec::new();
    for r in &records {
        encode_line(r, &mut line);
        text.extend_from_slice(&line);
    }
    g.bench_function("parse_100k_lines_block16", |b| {
        b.iter(|| {
            TraceReader::new(&text[..], ReaderOptions::default())
                .map(|r| r.unwrap().input_length as u64)
                .sum::<u64>()
        })
    });
    g.bench_function("stats_100k_lines_block16", |b| {
        b.iter(|| {
            black_box(
                stats::compute(
                    TraceReader::new(&text[..], ReaderOptions::default()),
                    &StatsOptions::default(),
                )
                .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
