//! Write speed of the results store: one ladder step of 10,000 requests (plus its metrics row
//! and a few plans) in one transaction, into a real SQLite file in WAL mode.
//!
//! Run: `cargo bench --bench store` (requests/s are in criterion's "thrpt" line).

use std::hint::black_box;

use cacheroute::analysis::model::{RunKey, StepMetrics};
use cacheroute::analysis::record::{PlanRecord, RequestRecord, Status};
use cacheroute::store::{BlockingStore, RequestRow};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

const REQUESTS: usize = 10_000;

fn requests(n: usize) -> Vec<RequestRow> {
    (0..n)
        .map(|i| {
            let t = i as f64 * 0.01;
            RequestRow {
                record: RequestRecord {
                    id: i as u64,
                    key: cacheroute::key_hash(&format!("key-{}", i % 997)),
                    destination: Some((i % 30) as i32),
                    scheduled_s: t,
                    sent_s: Some(t),
                    first_token_s: Some(t + 0.2),
                    finish_s: Some(t + 1.5),
                    prompt_tokens: 2000,
                    output_tokens: 200,
                    cached_tokens: Some(1500),
                    preemptions: 0,
                    retried: false,
                    status: Status::Ok,
                },
                key: None,
            }
        })
        .collect()
}

fn bench_record_step(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = BlockingStore::open(dir.path().join("bench.db")).expect("open");
    let study = store
        .create_or_get_study("bench", "spec", "sim")
        .expect("study");
    let run = store
        .create_or_get_run(
            study.id,
            &RunKey {
                policy: "cacheroute".into(),
                seed: 1,
                sweep: String::new(),
            },
            "{}",
        )
        .expect("run");
    let rows = requests(REQUESTS);
    let plans: Vec<PlanRecord> = (0..4)
        .map(|i| PlanRecord {
            at_s: i as f64 * 10.0,
            admitted: 1000,
            admitted_share: 0.6,
            imbalance: 1.1,
            churn: 0.05,
            repair: false,
            build_ms: Some(3.0),
            q_cap: Some(4.0),
            warm_slots: Some(64),
            bounded_sets: None,
            dispatch: None,
            replicas: Some(1000),
            tuning: None,
        })
        .collect();
    let metrics = StepMetrics {
        offered_qps: 100.0,
        requests: REQUESTS as u64,
        window_s: 100.0,
        ..StepMetrics::default()
    };

    let mut step = 0usize;
    let mut group = c.benchmark_group("store");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    group.sample_size(20);
    group.bench_function("record_step_10k_requests", |b| {
        b.iter_batched(
            || {
                step += 1;
                step
            },
            |s| {
                store
                    .record_step(run.id, s, &metrics, black_box(&rows), &plans)
                    .expect("record_step")
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, bench_record_step);
criterion_main!(benches);
