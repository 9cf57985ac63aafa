//! Store tests on real SQLite files in a temporary directory.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Connection, SqliteConnection};

use super::*;
use crate::analysis::model::{Fairness, RunKey, StepMetrics};

fn key(policy: &str, seed: u64) -> RunKey {
    RunKey {
        policy: policy.into(),
        seed,
        sweep: String::new(),
    }
}

fn metrics(step: usize, requests: usize) -> StepMetrics {
    StepMetrics {
        offered_qps: 10.0 * (step + 1) as f64,
        achieved_qps: 9.9 * (step + 1) as f64,
        completed_qps: 9.8 * (step + 1) as f64,
        requests: requests as u64,
        errors: 1,
        ttft_p50_s: 0.25,
        ttft_p99_s: 0.75,
        e2e_p50_s: 1.5,
        e2e_p99_s: 3.25,
        served_kv_hit: 0.875,
        imbalance_requests: 1.125,
        imbalance_prefill_tokens: 1.5,
        schedule_lag_p99_s: 0.0,
        preemptions: 3,
        fairness: Fairness {
            e2e_p99_by_rate_decile_s: (0..10).map(|d| d as f64 * 0.5).collect(),
            jain_index: 0.97,
        },
        window_s: 60.0,
        ..Default::default()
    }
}

fn requests(step: usize, n: usize) -> Vec<RequestRow> {
    (0..n)
        .map(|i| {
            let t = step as f64 * 100.0 + i as f64 * 0.001;
            let failed = i % 50 == 7;
            RequestRow {
                record: RequestRecord {
                    id: i as u64,
                    // Exercise the full u64 range (stored bit-for-bit in a signed INTEGER).
                    key: u64::MAX - (i % 13) as u64,
                    destination: (!failed).then_some((i % 30) as i32),
                    scheduled_s: t,
                    sent_s: Some(t + 0.0005),
                    first_token_s: (!failed).then_some(t + 0.2),
                    finish_s: (!failed).then_some(t + 1.0),
                    prompt_tokens: 1000 + i as u32,
                    output_tokens: 100,
                    cached_tokens: Some(500),
                    preemptions: (i % 3) as u32,
                    retried: failed,
                    status: if failed {
                        Status::NoDestination
                    } else if i % 50 == 9 {
                        Status::Http(503)
                    } else {
                        Status::Ok
                    },
                },
                key: (i % 2 == 0).then(|| format!("tenant-{}", i % 13)),
            }
        })
        .collect()
}

fn plans(step: usize, n: usize) -> Vec<PlanRecord> {
    (0..n)
        .map(|i| PlanRecord {
            at_s: step as f64 * 100.0 + i as f64 * 10.0,
            admitted: 100 + i,
            admitted_share: 0.5,
            imbalance: 1.25,
            churn: 0.125,
            repair: i == 1,
            build_ms: (i != 2).then_some(2.5),
            q_cap: Some(4.0 + i as f64),
            warm_slots: (i != 0).then_some(64),
            bounded_sets: [None, Some(true), Some(false)]
                .get(i % 3)
                .copied()
                .flatten(),
            dispatch: [
                None,
                Some(crate::policy::cacheroute::Dispatch::PLANNED),
                Some("reactive+prefix+cost".parse().unwrap()),
            ][i % 3],
            replicas: None,
            tuning: (i == 1).then(|| "chose q_cap 5, W 64".to_string()),
        })
        .collect()
}

/// A new run (study `s`, policy `p`, seed 1) in `store`.
fn new_run(store: &BlockingStore) -> RunHandle {
    let study = store.create_or_get_study("s", "spec", "sim").unwrap();
    store
        .create_or_get_run(study.id, &key("p", 1), "{}")
        .unwrap()
}

/// A new database at `db` with one run in it.
fn one_run(db: &Path) -> (BlockingStore, RunHandle) {
    let store = BlockingStore::open(db).unwrap();
    let run = new_run(&store);
    (store, run)
}

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).expect("read file")
}

/// Run `sql` statements on a plain connection (not through the store) and close it.
fn raw_exec(path: &Path, sql: &'static str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true);
        let mut c = SqliteConnection::connect_with(&options).await.unwrap();
        sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        c.close().await.unwrap();
    });
}

fn raw_scalar_i64(path: &Path, sql: &'static str) -> i64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = raw_connection_async(path).await;
        let v: i64 = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
        c.close().await.unwrap();
        v
    })
}

async fn raw_connection_async(path: &Path) -> SqliteConnection {
    SqliteConnection::connect_with(&SqliteConnectOptions::new().filename(path))
        .await
        .unwrap()
}

fn integrity_check(path: &Path) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = raw_connection_async(path).await;
        let mut out: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check")
            .fetch_all(&mut c)
            .await
            .unwrap();
        let fk: Vec<(String, i64)> = sqlx::query_as("PRAGMA foreign_key_check")
            .fetch_all(&mut c)
            .await
            .unwrap()
            .into_iter()
            .map(|r: (String, i64, String, i64)| (r.0, r.1))
            .collect();
        out.extend(
            fk.iter()
                .map(|(t, id)| format!("foreign key: {t} row {id}")),
        );
        c.close().await.unwrap();
        out
    })
}

#[test]
fn round_trip_of_steps_plans_requests_and_telemetry() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    let store = BlockingStore::open(&db).unwrap();
    assert_eq!(
        raw_scalar_i64_store(&store, "PRAGMA foreign_keys"),
        1,
        "foreign keys on"
    );

    let study = store
        .create_or_get_study("flagship", "name: flagship\n", "sim")
        .unwrap();
    assert!(study.created);
    let a = store
        .create_or_get_run(study.id, &key("cacheroute", u64::MAX), "{\"q_cap\":100}")
        .unwrap();
    let b = store
        .create_or_get_run(study.id, &key("flat-lb", 1), "{}")
        .unwrap();
    assert!(a.created && !a.complete);

    let mut m0 = metrics(0, 300);
    m0.fairness.e2e_p99_by_rate_decile_s[3] = f64::NAN;
    let (r0, r1) = (requests(0, 300), requests(1, 2500));
    store.record_step(a.id, 0, &m0, &r0, &plans(0, 3)).unwrap();
    store
        .record_step(a.id, 1, &metrics(1, 2500), &r1, &plans(1, 1))
        .unwrap();
    store
        .record_step(b.id, 0, &metrics(0, 10), &requests(0, 10), &[])
        .unwrap();
    store.mark_run_complete(b.id).unwrap();

    let telemetry: Vec<TelemetrySample> = (0..5)
        .map(|i| TelemetrySample {
            run: (i > 0).then_some(a.id),
            step: (i > 1).then_some(0),
            source: format!("engine:{i}"),
            metric: if i % 2 == 0 {
                "vllm:prefix_cache_hits_total"
            } else {
                "power_w"
            }
            .into(),
            labels: vec![
                ("gpu".into(), i.to_string()),
                ("model".into(), "70b".into()),
            ],
            value: i as f64 * 1.5,
            at_s: 1000.0 + i as f64,
        })
        .collect();
    store.insert_telemetry(study.id, &telemetry).unwrap();
    store.insert_telemetry(study.id, &[]).unwrap();

    assert_eq!(store.load_requests(a.id, 0).unwrap(), r0);
    assert_eq!(store.load_requests(a.id, 1).unwrap(), r1);
    assert_eq!(store.load_telemetry(study.id, None).unwrap(), telemetry);
    let power = store.load_telemetry(study.id, Some("power_w")).unwrap();
    assert_eq!(power.len(), 2);

    let loaded = store.load_study("flagship").unwrap();
    assert_eq!(loaded.spec, "name: flagship\n");
    assert_eq!(loaded.software_version, SOFTWARE_VERSION);
    assert_eq!(loaded.backend.as_deref(), Some("sim"));
    assert_eq!(loaded.runs.len(), 2);
    let run_a = &loaded.runs[0];
    assert_eq!(run_a.key, key("cacheroute", u64::MAX));
    assert_eq!(run_a.config, "{\"q_cap\":100}");
    assert_eq!((run_a.complete, run_a.steps_completed), (false, 2));
    assert_eq!(
        (loaded.runs[1].complete, loaded.runs[1].steps_completed),
        (true, 1)
    );

    assert_eq!(loaded.steps.len(), 3);
    let s0 = &loaded.steps[0];
    assert_eq!((s0.run.clone(), s0.step), (key("cacheroute", u64::MAX), 0));
    // NaN does not compare equal: check it, then compare the rest exactly.
    let mut back = s0.metrics.clone();
    assert!(back.fairness.e2e_p99_by_rate_decile_s[3].is_nan());
    back.fairness.e2e_p99_by_rate_decile_s[3] = 0.0;
    let mut expect = m0.clone();
    expect.fairness.e2e_p99_by_rate_decile_s[3] = 0.0;
    assert_eq!(back, expect);
    assert_eq!(loaded.steps[1].metrics, metrics(1, 2500));
    assert_eq!(loaded.steps[2].run, key("flat-lb", 1));

    assert_eq!(loaded.plans.len(), 4);
    let p = &loaded.plans[2];
    assert_eq!((p.step, p.plan.admitted, p.plan.repair), (0, 102, false));
    assert!(
        p.plan.build_ms.is_none(),
        "missing build time reads back as absent"
    );
    assert!(loaded.plans[1].plan.repair);
    assert_eq!(loaded.plans[3].step, 1);
    assert_eq!(loaded.plans[0].plan.build_ms, Some(2.5));
    assert_eq!(loaded.plans[1].plan.q_cap, Some(5.0));
    assert_eq!(loaded.plans[0].plan.warm_slots, None);
    // Every stored plan is exactly the record written (the replicas are not stored).
    let written = plans(0, 3);
    assert_eq!(loaded.plans[0].plan, written[0]);
    assert_eq!(loaded.plans[1].plan, written[1]);
    // Bounded, pinned and unknown sets each read back as written.
    let sets: Vec<Option<bool>> = loaded.plans[..3]
        .iter()
        .map(|p| p.plan.bounded_sets)
        .collect();
    assert_eq!(sets, [None, Some(true), Some(false)]);
    assert_eq!(
        loaded.plans[1].plan.tuning.as_deref(),
        Some("chose q_cap 5, W 64")
    );

    let list = store.list_studies().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(
        (list[0].runs, list[0].complete_runs, list[0].steps),
        (2, 1, 3)
    );

    // Reopening finds everything; the same spec is no conflict, another one is reported.
    drop(store);
    let store = BlockingStore::open(&db).unwrap();
    let again = store
        .create_or_get_study("flagship", "name: flagship\n", "sim")
        .unwrap();
    assert_eq!(
        (again.id, again.created, again.spec_conflict),
        (study.id, false, None)
    );
    let other = store
        .create_or_get_study("flagship", "name: changed\n", "local")
        .unwrap();
    assert_eq!(other.spec_conflict.as_deref(), Some("name: flagship\n"));
    // The stored backend and version come back; the caller decides (nothing is rewritten).
    assert_eq!(other.backend.as_deref(), Some("sim"));
    assert_eq!(other.software_version, SOFTWARE_VERSION);
    let run = store
        .create_or_get_run(study.id, &key("flat-lb", 1), "{\"x\":1}")
        .unwrap();
    assert_eq!((run.id, run.created, run.complete), (b.id, false, true));
    assert_eq!(run.config_conflict.as_deref(), Some("{}"));

    let err = store.load_study("nope").unwrap_err().to_string();
    assert!(err.contains("no study named \"nope\""), "{err}");
    assert!(err.contains("flagship"), "{err}");
}

fn raw_scalar_i64_store(store: &BlockingStore, sql: &'static str) -> i64 {
    store
        .runtime
        .block_on(sqlx::query_scalar(sql).fetch_one(&store.store.pool))
        .unwrap()
}

#[test]
fn wal_mode_and_sim_conversions() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    let store = BlockingStore::open(&db).unwrap();
    let mode: String = store
        .runtime
        .block_on(sqlx::query_scalar("PRAGMA journal_mode").fetch_one(&store.store.pool))
        .unwrap();
    assert_eq!(mode, "wal");

    let rec = crate::analysis::record::RequestRecord {
        id: 9,
        key: 77,
        destination: None,
        scheduled_s: 1.5,
        sent_s: Some(1.5),
        first_token_s: None,
        finish_s: None,
        prompt_tokens: 10,
        output_tokens: 0,
        cached_tokens: Some(0),
        preemptions: 0,
        retried: false,
        status: crate::analysis::record::Status::NoDestination,
    };
    let row = RequestRow::from(&rec);
    assert_eq!(row.record.destination, None);
    assert_eq!(
        (row.record.first_token_s, row.record.finish_s),
        (None, None)
    );
    assert_eq!(row.record.sent_s, Some(1.5));
    assert_eq!(row.record.status.label(), "no_destination");
    // The stored label is the record's serde spelling.
    assert_eq!(
        serde_json::to_value(rec.status).unwrap(),
        serde_json::Value::String(row.record.status.label())
    );
    // Written and read back, the row is the record it was.
    let run = new_run(&store);
    store
        .record_step(run.id, 0, &metrics(0, 1), std::slice::from_ref(&row), &[])
        .unwrap();
    assert_eq!(store.load_requests(run.id, 0).unwrap(), vec![row]);
}

#[test]
fn an_unknown_stored_status_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (store, run) = one_run(&dir.path().join("results.db"));
    store
        .record_step(run.id, 0, &metrics(0, 3), &requests(0, 3), &[])
        .unwrap();
    // A label no version of cacheroute writes (a hand-edited or foreign row).
    store
        .runtime
        .block_on(
            sqlx::query("UPDATE requests SET status = 'lost' WHERE request_id = 1")
                .execute(&store.store.pool),
        )
        .unwrap();
    let err = store.load_requests(run.id, 0).unwrap_err();
    assert!(matches!(err, StoreError::BadStatus { .. }), "{err}");
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    for part in ["results.db", "request 1 of run", "step 0", "`lost`"] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
}

#[test]
fn an_unreadable_stored_dispatch_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (store, run) = one_run(&dir.path().join("results.db"));
    store
        .record_step(run.id, 0, &metrics(0, 3), &requests(0, 3), &plans(0, 3))
        .unwrap();
    assert!(store.load_study("s").is_ok());
    // A dispatch no version writes (a hand-edited row, or a newer version's cold tail).
    store
        .runtime
        .block_on(
            sqlx::query("UPDATE plans SET dispatch = 'planned+mystery+prefill' WHERE seq = 1")
                .execute(&store.store.pool),
        )
        .unwrap();
    let err = store.load_study("s").unwrap_err();
    assert!(matches!(err, StoreError::BadPlan { .. }), "{err}");
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    for part in [
        "results.db",
        "plans of run",
        "step 0",
        "dispatch",
        "mystery",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
}

#[test]
fn resume_sees_exactly_the_recorded_steps() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    let run = {
        let store = BlockingStore::open(&db).unwrap();
        let study = store.create_or_get_study("s", "spec", "sim").unwrap();
        let run = store
            .create_or_get_run(study.id, &key("p", 1), "{}")
            .unwrap();
        assert!(store.completed_steps(run.id).unwrap().is_empty());
        for step in [0, 1, 3] {
            store
                .record_step(run.id, step, &metrics(step, 20), &requests(step, 20), &[])
                .unwrap();
        }
        run.id
    };
    let store = BlockingStore::open(&db).unwrap();
    let study = store.create_or_get_study("s", "spec", "sim").unwrap();
    let again = store
        .create_or_get_run(study.id, &key("p", 1), "{}")
        .unwrap();
    assert_eq!((again.id, again.created), (run, false));
    let done = store.completed_steps(run).unwrap();
    assert_eq!(done.into_iter().collect::<Vec<_>>(), vec![0, 1, 3]);

    // Recording a completed step again is refused and changes nothing.
    let err = store
        .record_step(run, 1, &metrics(1, 5), &requests(1, 5), &[])
        .unwrap_err();
    assert!(
        matches!(err, StoreError::StepExists { step: 1, .. }),
        "{err}"
    );
    assert_eq!(store.load_requests(run, 1).unwrap().len(), 20);

    store
        .record_step(run, 2, &metrics(2, 20), &requests(2, 20), &[])
        .unwrap();
    store.mark_run_complete(run).unwrap();
    assert_eq!(store.completed_steps(run).unwrap().len(), 4);
    assert!(matches!(
        store.mark_run_complete(RunId(999)),
        Err(StoreError::NoSuchRun { run: 999, .. })
    ));
    assert!(matches!(
        store.record_step(RunId(999), 0, &metrics(0, 1), &requests(0, 1), &[]),
        Err(StoreError::NoSuchRun { run: 999, .. })
    ));
}

#[test]
fn a_step_that_fails_midway_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, run) = one_run(&dir.path().join("results.db"));
    // A duplicate request id in the third batch: the step row and the first two batches are
    // already written inside the transaction when the insert fails.
    let mut rows = requests(0, 3 * REQUEST_BATCH);
    rows[2 * REQUEST_BATCH + 5].record.id = 3;
    let err = store
        .record_step(run.id, 0, &metrics(0, rows.len()), &rows, &plans(0, 2))
        .unwrap_err();
    assert!(matches!(err, StoreError::Sqlite { .. }), "{err}");
    assert!(store.completed_steps(run.id).unwrap().is_empty());
    for table in ["steps", "requests", "plans"] {
        let n = count(&store, table);
        assert_eq!(n, 0, "{table} after a failed step");
    }
    // The store is still usable, and the step can be written properly.
    store
        .record_step(run.id, 0, &metrics(0, 10), &requests(0, 10), &plans(0, 2))
        .unwrap();
    assert_eq!(count(&store, "requests"), 10);
}

fn count(store: &BlockingStore, table: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM {table}");
    store
        .runtime
        .block_on(sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&store.store.pool))
        .unwrap()
}

/// Environment variable that turns [`crash_child_writer`] into the writer of
/// [`sigkill_mid_step_leaves_only_whole_steps`]; without it that test does nothing.
const CRASH_CHILD_DB: &str = "CACHEROUTE_STORE_CRASH_CHILD_DB";
const CRASH_REQUESTS: usize = 20_000;
const CRASH_PLANS: usize = 3;

/// Helper process for the SIGKILL test (a no-op unless `CACHEROUTE_STORE_CRASH_CHILD_DB` is
/// set): writes large steps forever, printing `committed N` after each commit.
#[test]
fn crash_child_writer() {
    let Some(db) = std::env::var_os(CRASH_CHILD_DB) else {
        return;
    };
    let store = BlockingStore::open(&db).unwrap();
    let study = store.create_or_get_study("crash", "spec", "sim").unwrap();
    let run = store
        .create_or_get_run(study.id, &key("p", 7), "{}")
        .unwrap();
    let done = store.completed_steps(run.id).unwrap();
    let start = done.last().map_or(0, |s| s + 1);
    for step in start..start + 10_000 {
        store
            .record_step(
                run.id,
                step,
                &metrics(step, CRASH_REQUESTS),
                &requests(step, CRASH_REQUESTS),
                &plans(step, CRASH_PLANS),
            )
            .unwrap();
        println!("committed {step}");
    }
}

#[test]
fn sigkill_mid_step_leaves_only_whole_steps() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "store::tests::crash_child_writer",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_CHILD_DB, &db)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // libtest prints `test NAME ... ` without a newline, so the first report shares its line.
    let mut last_committed = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some((_, n)) = line.split_once("committed ") {
            last_committed = n.trim().parse::<usize>().ok();
            // The child is now inside the next step's transaction (20k requests, about
            // 0.1 s in a debug build), so the kill lands mid-step.
            if last_committed == Some(2) {
                break;
            }
        }
    }
    assert_eq!(
        last_committed,
        Some(2),
        "the child stopped before committing 3 steps"
    );
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();

    assert_eq!(integrity_check(&db), vec!["ok".to_string()]);
    let store = BlockingStore::open(&db).unwrap();
    let study = store.create_or_get_study("crash", "spec", "sim").unwrap();
    let run = store
        .create_or_get_run(study.id, &key("p", 7), "{}")
        .unwrap();
    let done: Vec<usize> = store.completed_steps(run.id).unwrap().into_iter().collect();
    assert!(done.len() >= 3, "{done:?}");
    assert_eq!(done, (0..done.len()).collect::<Vec<_>>());
    // Only whole steps: every recorded step has all its requests and plans, nothing else.
    for &step in &done {
        assert_eq!(
            store.load_requests(run.id, step).unwrap().len(),
            CRASH_REQUESTS
        );
    }
    assert_eq!(
        count(&store, "requests"),
        (done.len() * CRASH_REQUESTS) as i64
    );
    assert_eq!(count(&store, "plans"), (done.len() * CRASH_PLANS) as i64);

    // Resume: continue after the last completed step.
    let next = done.len();
    store
        .record_step(run.id, next, &metrics(next, 10), &requests(next, 10), &[])
        .unwrap();
    store.mark_run_complete(run.id).unwrap();
    drop(store);
    assert_eq!(integrity_check(&db), vec!["ok".to_string()]);
}

#[test]
fn newer_schema_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    {
        let store = BlockingStore::open(&db).unwrap();
        store.create_or_get_study("s", "spec", "sim").unwrap();
    }
    // A later cacheroute applied migration 6.
    raw_exec(
        &db,
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (6, 'six', 1, x'00', 0);",
    );
    assert_eq!(
        raw_scalar_i64(&db, "SELECT max(version) FROM _sqlx_migrations"),
        6
    );
    let before = bytes(&db);
    let err = BlockingStore::open(&db).unwrap_err();
    assert!(matches!(
        err,
        StoreError::SchemaTooNew {
            found: 6,
            supported: 5,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(
        msg.ends_with(
            "results.db has schema version 6 but this cacheroute understands up to 5; \
             use a newer cacheroute or another --db"
        ),
        "{msg}"
    );
    assert_eq!(bytes(&db), before, "the database file changed");
    // The read-only check may leave SQLite's (empty) WAL side file, never content in it.
    let wal = dir.path().join("results.db-wal");
    assert!(!wal.exists() || bytes(&wal).is_empty());
}

#[test]
fn a_file_that_is_not_a_database_is_refused_and_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "notes.db",
            b"name: flagship\npolicies: [cacheroute]\n".repeat(200),
        ),
        ("short.db", b"SQLite".to_vec()),
        // The right magic but garbage after it.
        ("garbage.db", {
            let mut v = b"SQLite format 3\0".to_vec();
            v.extend((0..8192u32).map(|i| (i * 7 + 3) as u8));
            v
        }),
    ];
    for (name, content) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, &content).unwrap();
        let err = BlockingStore::open(&path).unwrap_err();
        assert!(
            matches!(err, StoreError::NotADatabase { .. }),
            "{name}: {err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(name) && msg.contains("not a SQLite database"),
            "{msg}"
        );
        assert_eq!(bytes(&path), content, "{name} changed");
    }
    let err = BlockingStore::open(dir.path()).unwrap_err();
    assert!(err.to_string().contains("directory"), "{err}");
}

#[test]
fn a_foreign_sqlite_database_is_refused_and_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("other.db");
    raw_exec(
        &db,
        "CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL); \
         INSERT INTO invoices (total) VALUES (12.5);",
    );
    let before = bytes(&db);
    let err = BlockingStore::open(&db).unwrap_err();
    assert!(matches!(err, StoreError::ForeignDatabase { .. }), "{err}");
    assert!(err.to_string().contains("invoices"), "{err}");
    assert_eq!(bytes(&db), before);
}

#[test]
fn an_empty_file_becomes_a_new_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("results.db");
    std::fs::write(&db, b"").unwrap();
    let store = BlockingStore::open(&db).unwrap();
    assert!(store.list_studies().unwrap().is_empty());
    assert_eq!(supported_schema_version(), 5);
}

/// The embedded migration list is exactly the files in `migrations/`, in order, with the
/// descriptions `sqlx` derives from their names (a migration file added without a line in
/// `MIGRATIONS` would never run).
#[test]
fn embedded_migrations_are_the_migrations_directory() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".sql"))
        .collect();
    files.sort();
    let listed: Vec<String> = super::MIGRATIONS
        .iter()
        .map(|(v, d, _)| format!("{v:04}_{}.sql", d.replace(' ', "_")))
        .collect();
    assert_eq!(listed, files, "update MIGRATIONS in src/store/mod.rs");
    for ((_, _, sql), f) in super::MIGRATIONS.iter().zip(&files) {
        assert_eq!(*sql, std::fs::read_to_string(dir.join(f)).unwrap(), "{f}");
    }
    // The check can fail: a fourth file is not in the list.
    let mut more = files.clone();
    more.push("0004_next.sql".into());
    assert_ne!(listed, more);
}

/// Two programs opening one new database at once (a study starting while `report` lists the
/// same file) must both get a whole schema: the migration is one writer's transaction, so the
/// second sees either nothing or every migration applied, never half of them.
#[test]
fn concurrent_opens_of_a_new_database_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..40 {
        let path = dir.path().join(format!("race-{round}.db"));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (path, barrier) = (path.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    BlockingStore::open(&path)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        for h in handles {
            if let Err(e) = h.join().unwrap() {
                panic!("round {round}: {e}");
            }
        }
        let store = BlockingStore::open(&path).unwrap();
        assert_eq!(
            raw_scalar_i64_store(
                &store,
                "SELECT count(*) FROM _sqlx_migrations WHERE success"
            ),
            supported_schema_version()
        );
    }
}

/// Only "database is locked" is retried on open: a lock held by another connection is busy,
/// a file that is not a database is not (it is refused at once).
#[test]
fn only_a_locked_database_counts_as_busy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locked.db");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt.block_on(async {
        let opts = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let mut holder = SqliteConnection::connect_with(&opts).await.unwrap();
        sqlx::query("CREATE TABLE t (x)")
            .execute(&mut holder)
            .await
            .unwrap();
        sqlx::query("BEGIN EXCLUSIVE")
            .execute(&mut holder)
            .await
            .unwrap();
        let mut other = SqliteConnection::connect_with(&opts.busy_timeout(Duration::ZERO))
            .await
            .unwrap();
        sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&mut other)
            .await
            .unwrap_err()
    });
    let busy = StoreError::Sqlite {
        db: path.clone(),
        context: "test",
        source: err,
    };
    assert!(busy.is_busy(), "{busy}");
    let not_db = StoreError::NotADatabase {
        db: path,
        detail: "no SQLite header".into(),
    };
    assert!(!not_db.is_busy());
}
