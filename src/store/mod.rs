//! The results store: every study, run, ladder step, request, telemetry sample and installed
//! plan in one SQLite file (`results.db`, docs/store.md), through sqlx with runtime queries and
//! the embedded migrations of `migrations/`.
//!
//! Guarantees:
//! - WAL journal, `synchronous=NORMAL`, foreign keys on, a busy timeout.
//! - A step is written in ONE transaction together with its requests and plans: a process
//!   killed at any point leaves either the whole step or none of it, so [`Store::completed_steps`]
//!   is exactly what `--resume` may skip.
//! - Opening checks the file read-only first: a file that is not SQLite, a SQLite database made
//!   by something else, or one whose schema is newer than this build is refused before anything
//!   is written, and the file is left byte-identical.
//!
//! Depends on: the plain data types of `analysis` (`model`, `record`). Must not depend on the
//! runner, the report or the live layers; pure layers (policy, plan, workload, engine,
//! analysis, sim) never import the store.
//!
//! [`Store`] is async (tokio); [`BlockingStore`] wraps it with its own current-thread runtime
//! for the synchronous simulator runner and has the same methods.

mod blocking;
mod nan_json;
#[cfg(test)]
mod tests;

pub use blocking::BlockingStore;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::SqliteRow;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, FromRow, QueryBuilder, Row, SqlSafeStr, Sqlite};

use crate::analysis::model::{PlanEvent, RunKey, StepMetrics, StepRecord};
use crate::analysis::record::{PlanRecord, RequestRecord, Status, UnknownStatus};

/// The migrations this build ships, embedded at compile time: (version, description, SQL).
/// A test checks that this list is exactly the files in `migrations/`.
const MIGRATIONS: [(i64, &str, &str); 5] = [
    (1, "init", include_str!("../../migrations/0001_init.sql")),
    (
        2,
        "study backend",
        include_str!("../../migrations/0002_study_backend.sql"),
    ),
    (
        3,
        "plan tuning",
        include_str!("../../migrations/0003_plan_tuning.sql"),
    ),
    (
        4,
        "plan bounded sets",
        include_str!("../../migrations/0004_plan_bounded_sets.sql"),
    ),
    (
        5,
        "plan dispatch",
        include_str!("../../migrations/0005_plan_dispatch.sql"),
    ),
];

/// The migrator over [`MIGRATIONS`] (as `sqlx::migrate!` would build it: same versions,
/// descriptions and checksums, so databases written by earlier builds open unchanged).
static MIGRATOR: std::sync::LazyLock<sqlx::migrate::Migrator> = std::sync::LazyLock::new(|| {
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    let migrations: Vec<Migration> = MIGRATIONS
        .iter()
        .map(|&(version, description, sql)| {
            Migration::new(
                version,
                description.into(),
                MigrationType::Simple,
                sql.into_sql_str(),
                false,
            )
        })
        .collect();
    Migrator {
        migrations: migrations.into(),
        ..Migrator::DEFAULT
    }
});

/// Version of the software that writes (recorded on studies and runs).
pub const SOFTWARE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Requests per multi-row INSERT (16 bound values each, well under SQLite's variable limit).
const REQUEST_BATCH: usize = 1000;
/// Telemetry samples per multi-row INSERT (8 bound values each).
const TELEMETRY_BATCH: usize = 2000;

/// The highest schema (migration) version this build understands.
pub fn supported_schema_version() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// What can go wrong with the results database. Every message names the file and says what
/// to do.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{} is not a SQLite database ({detail}); it was left untouched; pass another --db or move it away", .db.display())]
    NotADatabase { db: PathBuf, detail: String },
    #[error("{} has schema version {found} but this cacheroute understands up to {supported}; use a newer cacheroute or another --db", .db.display())]
    SchemaTooNew {
        db: PathBuf,
        found: i64,
        supported: i64,
    },
    #[error("{} is a SQLite database not made by cacheroute (tables: {tables}); it was left untouched; pass another --db", .db.display())]
    ForeignDatabase { db: PathBuf, tables: String },
    #[error("{} has a failed schema migration (version {version}); restore it from a backup or use another --db", .db.display())]
    DirtyMigration { db: PathBuf, version: i64 },
    #[error("{}: could not bring the schema up to version {supported}: {source}; use another --db", .db.display())]
    Migrate {
        db: PathBuf,
        supported: i64,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    #[error("{}: no study named {name:?} (studies here: {known}); check the name or the --db", .db.display())]
    NoSuchStudy {
        db: PathBuf,
        name: String,
        known: String,
    },
    #[error("{}: no run with id {run}", .db.display())]
    NoSuchRun { db: PathBuf, run: i64 },
    #[error("{}: step {step} of run {run} is already recorded; resume skips completed steps (see completed_steps), or use a new study name", .db.display())]
    StepExists { db: PathBuf, run: i64, step: usize },
    #[error("{}: stored {what} is not readable: {source}; was it written by another version?", .db.display())]
    BadJson {
        db: PathBuf,
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: {context}: {source}", .db.display())]
    Sqlite {
        db: PathBuf,
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("{}: request {request} of run {run} step {step}: {source}; was it written by another version?", .db.display())]
    BadStatus {
        db: PathBuf,
        run: i64,
        step: usize,
        request: u64,
        #[source]
        source: UnknownStatus,
    },
    #[error("{}: the plans of run {run} step {step}: {detail}; was it written by another version?", .db.display())]
    BadPlan {
        db: PathBuf,
        run: i64,
        step: i64,
        detail: String,
    },
    #[error("could not start the results store's runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Row id of a study.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StudyId(pub i64);

/// Row id of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub i64);

/// Result of [`Store::create_or_get_study`].
#[derive(Debug, Clone, PartialEq)]
pub struct StudyHandle {
    pub id: StudyId,
    /// True when this call created the study.
    pub created: bool,
    /// When the study existed with a different spec: the stored spec (the caller decides
    /// whether that is an error, a resume with changed settings, or a new name).
    pub spec_conflict: Option<String>,
    /// The backend stored with the study (`None`: a study created before schema version 2).
    pub backend: Option<String>,
    /// The version of the software that created the study.
    pub software_version: String,
}

/// Result of [`Store::create_or_get_run`].
#[derive(Debug, Clone, PartialEq)]
pub struct RunHandle {
    pub id: RunId,
    /// True when this call created the run.
    pub created: bool,
    /// True when the run was already marked complete.
    pub complete: bool,
    /// When the run existed with a different config snapshot: the stored one.
    pub config_conflict: Option<String>,
}

/// One request as stored: the one [`RequestRecord`] and the key text, when the backend knows it
/// (the simulator keeps only the hash). Times are seconds (see `migrations/0001_init.sql`); a
/// `None` time is stored as NULL. The status is stored as its label ([`Status::label`]) and read
/// back through [`Status::parse`]; `cached_tokens` not reported is stored as 0 (the column has
/// no NULL) and reads back as `Some(0)`.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRow {
    pub record: RequestRecord,
    pub key: Option<String>,
}

impl From<&RequestRecord> for RequestRow {
    fn from(r: &RequestRecord) -> Self {
        RequestRow {
            record: *r,
            key: None,
        }
    }
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// One telemetry sample.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySample {
    /// The run it belongs to, `None` for samples outside any run.
    pub run: Option<RunId>,
    pub step: Option<usize>,
    /// Where it came from, e.g. `nvml:gpu-3/0`, `engine:7`, `router`.
    pub source: String,
    /// Metric name, e.g. `vllm:prefix_cache_hits_total`.
    pub metric: String,
    /// Label pairs, stored as a JSON object.
    pub labels: Vec<(String, String)>,
    pub value: f64,
    /// Sample time in seconds.
    pub at_s: f64,
}

/// A run as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRun {
    pub id: RunId,
    pub key: RunKey,
    pub config: String,
    pub software_version: String,
    pub complete: bool,
    pub steps_completed: usize,
}

/// Everything the report needs about one study.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredStudy {
    pub id: StudyId,
    pub name: String,
    pub spec: String,
    pub software_version: String,
    /// The backend it ran on (`None`: created before schema version 2; see the spec).
    pub backend: Option<String>,
    pub created_at: String,
    pub runs: Vec<StoredRun>,
    /// Ordered by run (policy, seed, sweep) then step.
    pub steps: Vec<StepRecord>,
    /// Ordered by run, step, installation order.
    pub plans: Vec<PlanEvent>,
}

/// One line of [`Store::list_studies`].
#[derive(Debug, Clone, PartialEq)]
pub struct StudySummary {
    pub name: String,
    pub created_at: String,
    pub software_version: String,
    pub runs: usize,
    pub complete_runs: usize,
    pub steps: usize,
}

/// The async results store.
#[derive(Debug, Clone)]
pub struct Store {
    pool: SqlitePool,
    path: PathBuf,
}

/// SQLite primary result codes we tell apart.
const SQLITE_BUSY: i32 = 5;
const SQLITE_CORRUPT: i32 = 11;
const SQLITE_NOTADB: i32 = 26;
/// How long [`Store::open`] keeps trying a database another program holds locked.
const OPEN_RETRY: Duration = Duration::from_secs(30);

impl StoreError {
    /// The database was locked by another connection (SQLite's `SQLITE_BUSY`).
    fn is_busy(&self) -> bool {
        let code = match self {
            StoreError::Sqlite { source, .. } => sqlite_primary_code(source),
            StoreError::Migrate {
                source: sqlx::migrate::MigrateError::Execute(source),
                ..
            }
            | StoreError::Migrate {
                source: sqlx::migrate::MigrateError::ExecuteMigration(source, _),
                ..
            } => sqlite_primary_code(source),
            _ => None,
        };
        code == Some(SQLITE_BUSY)
    }
}

fn sqlite_primary_code(e: &sqlx::Error) -> Option<i32> {
    let code = e.as_database_error()?.code()?;
    code.parse::<i32>().ok().map(|c| c & 0xff)
}

impl Store {
    /// Open (or create) the database at `path` and bring its schema up to date. An existing
    /// file is first checked read-only (see the module docs); nothing is written unless it is
    /// a cacheroute database this build understands.
    pub async fn open(path: impl AsRef<Path>) -> Result<Store> {
        let path = path.as_ref().to_path_buf();
        // SQLite answers "database is locked" at once, without waiting out the busy timeout,
        // where waiting could deadlock: a connection switching a new file to WAL, or reading
        // the schema, while another program holds the write lock of its own migration. Such
        // an open is tried again, from the read-only check on, for up to OPEN_RETRY.
        let t0 = std::time::Instant::now();
        let mut pause = Duration::from_millis(5);
        loop {
            match Store::open_once(&path).await {
                Err(e) if e.is_busy() && t0.elapsed() < OPEN_RETRY => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                other => return other,
            }
        }
    }

    async fn open_once(path: &Path) -> Result<Store> {
        let path = path.to_path_buf();
        preflight(&path).await?;
        let sql = |context| {
            let db = path.clone();
            move |source| StoreError::Sqlite {
                db,
                context,
                source,
            }
        };
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(sql("opening the database"))?;
        // The whole migration is one writer's transaction: sqlx reads the applied versions,
        // then applies each missing one in its own transaction, so two programs opening one
        // new file at once (a study starting while `report` lists it) would both apply
        // migration 1 and one of them would fail. Under `BEGIN IMMEDIATE` the second waits
        // (busy timeout) and then finds every migration applied; each migration's own
        // transaction becomes a savepoint inside this one.
        let migrate_err = |source| StoreError::Migrate {
            db: path.clone(),
            supported: supported_schema_version(),
            source,
        };
        {
            let mut conn = pool.acquire().await.map_err(sql("opening the database"))?;
            let mut tx = conn
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(sql("locking the database to bring its schema up to date"))?;
            MIGRATOR.run(&mut *tx).await.map_err(migrate_err)?;
            tx.commit().await.map_err(sql("committing the schema"))?;
        }
        Ok(Store { pool, path })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Close every connection (checkpoints the WAL into the main file).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    fn sql(&self, context: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError + '_ {
        move |source| StoreError::Sqlite {
            db: self.path.clone(),
            context,
            source,
        }
    }

    /// Create the study `name` with `spec`, run on `backend`, or get it if it exists. When it
    /// exists with a different spec, [`StudyHandle::spec_conflict`] holds the stored one; the
    /// stored backend and software version come back for the caller to compare.
    pub async fn create_or_get_study(
        &self,
        name: &str,
        spec: &str,
        backend: &str,
    ) -> Result<StudyHandle> {
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(self.sql("starting a transaction"))?;
        let existing: Option<(i64, String, Option<String>, String)> = sqlx::query_as(
            "SELECT id, spec, backend, software_version FROM studies WHERE name = ?",
        )
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(self.sql("reading studies"))?;
        let handle = match existing {
            Some((id, stored, stored_backend, software_version)) => StudyHandle {
                id: StudyId(id),
                created: false,
                spec_conflict: (stored != spec).then_some(stored),
                backend: stored_backend,
                software_version,
            },
            None => {
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO studies (name, spec, software_version, backend) \
                     VALUES (?, ?, ?, ?) RETURNING id",
                )
                .bind(name)
                .bind(spec)
                .bind(SOFTWARE_VERSION)
                .bind(backend)
                .fetch_one(&mut *tx)
                .await
                .map_err(self.sql("creating a study"))?;
                StudyHandle {
                    id: StudyId(id),
                    created: true,
                    spec_conflict: None,
                    backend: Some(backend.to_owned()),
                    software_version: SOFTWARE_VERSION.to_owned(),
                }
            }
        };
        tx.commit().await.map_err(self.sql("committing a study"))?;
        Ok(handle)
    }

    /// Create the run `key` of `study` with its config snapshot (JSON), or get it if it
    /// exists. When it exists with a different config, [`RunHandle::config_conflict`] holds
    /// the stored one.
    pub async fn create_or_get_run(
        &self,
        study: StudyId,
        key: &RunKey,
        config: &str,
    ) -> Result<RunHandle> {
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(self.sql("starting a transaction"))?;
        let existing: Option<(i64, String, String)> = sqlx::query_as(
            "SELECT id, config, status FROM runs \
             WHERE study_id = ? AND policy = ? AND seed = ? AND sweep = ?",
        )
        .bind(study.0)
        .bind(&key.policy)
        .bind(key.seed as i64)
        .bind(&key.sweep)
        .fetch_optional(&mut *tx)
        .await
        .map_err(self.sql("reading runs"))?;
        let handle = match existing {
            Some((id, stored, status)) => RunHandle {
                id: RunId(id),
                created: false,
                complete: status == "complete",
                config_conflict: (stored != config).then_some(stored),
            },
            None => {
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO runs (study_id, policy, seed, sweep, config, software_version) \
                     VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
                )
                .bind(study.0)
                .bind(&key.policy)
                .bind(key.seed as i64)
                .bind(&key.sweep)
                .bind(config)
                .bind(SOFTWARE_VERSION)
                .fetch_one(&mut *tx)
                .await
                .map_err(self.sql("creating a run"))?;
                RunHandle {
                    id: RunId(id),
                    created: true,
                    complete: false,
                    config_conflict: None,
                }
            }
        };
        tx.commit().await.map_err(self.sql("committing a run"))?;
        Ok(handle)
    }

    /// Indices of the steps of `run` that are completely recorded (what a resume skips).
    pub async fn completed_steps(&self, run: RunId) -> Result<BTreeSet<usize>> {
        let steps: Vec<i64> = sqlx::query_scalar("SELECT step FROM steps WHERE run_id = ?")
            .bind(run.0)
            .fetch_all(&self.pool)
            .await
            .map_err(self.sql("reading completed steps"))?;
        Ok(steps.into_iter().map(|s| s as usize).collect())
    }

    /// Write step `step` of `run`: its metrics, its requests (batched multi-row inserts) and
    /// its plans, all in ONE transaction. Either all of it lands or none of it does. Fails
    /// with [`StoreError::StepExists`] if the step is already recorded.
    pub async fn record_step(
        &self,
        run: RunId,
        step: usize,
        metrics: &StepMetrics,
        requests: &[RequestRow],
        plans: &[PlanRecord],
    ) -> Result<()> {
        let metrics_json =
            serde_json::to_string(metrics).map_err(|source| StoreError::BadJson {
                db: self.path.clone(),
                what: format!("metrics of step {step}"),
                source,
            })?;
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(self.sql("starting a step transaction"))?;
        let status: Option<String> = sqlx::query_scalar("SELECT status FROM runs WHERE id = ?")
            .bind(run.0)
            .fetch_optional(&mut *tx)
            .await
            .map_err(self.sql("reading runs"))?;
        if status.is_none() {
            return Err(StoreError::NoSuchRun {
                db: self.path.clone(),
                run: run.0,
            });
        }
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM steps WHERE run_id = ? AND step = ?")
                .bind(run.0)
                .bind(step as i64)
                .fetch_optional(&mut *tx)
                .await
                .map_err(self.sql("reading steps"))?;
        if exists.is_some() {
            return Err(StoreError::StepExists {
                db: self.path.clone(),
                run: run.0,
                step,
            });
        }
        let m = metrics;
        sqlx::query(
            "INSERT INTO steps (run_id, step, offered_qps, achieved_qps, completed_qps, requests, \
             errors, ttft_p50_s, ttft_p99_s, e2e_p50_s, e2e_p99_s, served_kv_hit, \
             imbalance_requests, window_s, metrics) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(run.0)
        .bind(step as i64)
        .bind(m.offered_qps)
        .bind(m.achieved_qps)
        .bind(m.completed_qps)
        .bind(m.requests as i64)
        .bind(m.errors as i64)
        .bind(m.ttft_p50_s)
        .bind(m.ttft_p99_s)
        .bind(m.e2e_p50_s)
        .bind(m.e2e_p99_s)
        .bind(m.served_kv_hit)
        .bind(m.imbalance_requests)
        .bind(m.window_s)
        .bind(metrics_json)
        .execute(&mut *tx)
        .await
        .map_err(self.sql("writing a step"))?;

        for chunk in requests.chunks(REQUEST_BATCH) {
            let mut qb = QueryBuilder::<Sqlite>::new(
                "INSERT INTO requests (run_id, step, request_id, key_hash, key, destination, \
                 scheduled_s, sent_s, first_token_s, finish_s, prompt_tokens, output_tokens, \
                 cached_tokens, preemptions, retried, status) ",
            );
            qb.push_values(chunk, |mut b, RequestRow { record: r, key }| {
                b.push_bind(run.0)
                    .push_bind(step as i64)
                    .push_bind(r.id as i64)
                    .push_bind(r.key as i64)
                    .push_bind(key.clone())
                    .push_bind(r.destination)
                    .push_bind(r.scheduled_s)
                    .push_bind(r.sent_s.and_then(finite))
                    .push_bind(r.first_token_s.and_then(finite))
                    .push_bind(r.finish_s.and_then(finite))
                    .push_bind(r.prompt_tokens as i64)
                    .push_bind(r.output_tokens as i64)
                    .push_bind(r.cached_tokens.unwrap_or(0) as i64)
                    .push_bind(r.preemptions as i64)
                    .push_bind(r.retried)
                    .push_bind(r.status.label());
            });
            qb.build()
                .execute(&mut *tx)
                .await
                .map_err(self.sql("writing the requests of a step"))?;
        }

        if !plans.is_empty() {
            let mut qb = QueryBuilder::<Sqlite>::new(
                "INSERT INTO plans (run_id, step, seq, at_s, admitted, admitted_share, \
                 imbalance, churn, repair, build_ms, q_cap, warm_slots, tuning, bounded_sets, \
                 dispatch) ",
            );
            qb.push_values(plans.iter().enumerate(), |mut b, (seq, p)| {
                b.push_bind(run.0)
                    .push_bind(step as i64)
                    .push_bind(seq as i64)
                    .push_bind(p.at_s)
                    .push_bind(p.admitted as i64)
                    .push_bind(p.admitted_share)
                    .push_bind(p.imbalance)
                    .push_bind(p.churn)
                    .push_bind(p.repair)
                    .push_bind(p.build_ms.and_then(finite))
                    .push_bind(p.q_cap.and_then(finite))
                    .push_bind(p.warm_slots.map(|w| w.min(i64::MAX as u64) as i64))
                    .push_bind(p.tuning.clone())
                    .push_bind(p.bounded_sets)
                    .push_bind(p.dispatch.map(|d| d.to_string()));
            });
            qb.build()
                .execute(&mut *tx)
                .await
                .map_err(self.sql("writing the plans of a step"))?;
        }

        tx.commit().await.map_err(self.sql("committing a step"))?;
        Ok(())
    }

    /// Mark `run` complete (every step of its ladder is recorded).
    pub async fn mark_run_complete(&self, run: RunId) -> Result<()> {
        let done = sqlx::query(
            "UPDATE runs SET status = 'complete', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?",
        )
        .bind(run.0)
        .execute(&self.pool)
        .await
        .map_err(self.sql("marking a run complete"))?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NoSuchRun {
                db: self.path.clone(),
                run: run.0,
            });
        }
        Ok(())
    }

    /// Append telemetry samples of `study` (one transaction, batched inserts).
    pub async fn insert_telemetry(&self, study: StudyId, batch: &[TelemetrySample]) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(self.sql("starting a telemetry transaction"))?;
        for chunk in batch.chunks(TELEMETRY_BATCH) {
            let mut qb = QueryBuilder::<Sqlite>::new(
                "INSERT INTO telemetry (study_id, run_id, step, source, metric, labels, value, \
                 at_s) ",
            );
            qb.push_values(chunk, |mut b, s| {
                let labels: serde_json::Map<String, serde_json::Value> = s
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect();
                b.push_bind(study.0)
                    .push_bind(s.run.map(|r| r.0))
                    .push_bind(s.step.map(|x| x as i64))
                    .push_bind(s.source.clone())
                    .push_bind(s.metric.clone())
                    .push_bind(serde_json::Value::Object(labels).to_string())
                    .push_bind(s.value)
                    .push_bind(s.at_s);
            });
            qb.build()
                .execute(&mut *tx)
                .await
                .map_err(self.sql("writing telemetry"))?;
        }
        tx.commit()
            .await
            .map_err(self.sql("committing telemetry"))?;
        Ok(())
    }

    /// Telemetry samples of `study`, optionally of one metric, in insertion order.
    pub async fn load_telemetry(
        &self,
        study: StudyId,
        metric: Option<&str>,
    ) -> Result<Vec<TelemetrySample>> {
        let rows: Vec<TelemetryDbRow> = sqlx::query_as(
            "SELECT run_id, step, source, metric, labels, value, at_s FROM telemetry \
             WHERE study_id = ? AND (? IS NULL OR metric = ?) ORDER BY id",
        )
        .bind(study.0)
        .bind(metric)
        .bind(metric)
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("reading telemetry"))?;
        rows.into_iter()
            .map(|r| {
                let labels: serde_json::Map<String, serde_json::Value> =
                    serde_json::from_str(&r.labels).map_err(|source| StoreError::BadJson {
                        db: self.path.clone(),
                        what: "telemetry labels".into(),
                        source,
                    })?;
                Ok(TelemetrySample {
                    run: r.run_id.map(RunId),
                    step: r.step.map(|s| s as usize),
                    source: r.source,
                    metric: r.metric,
                    labels: labels
                        .into_iter()
                        .map(|(k, v)| match v {
                            serde_json::Value::String(s) => (k, s),
                            other => (k, other.to_string()),
                        })
                        .collect(),
                    value: r.value.unwrap_or(f64::NAN),
                    at_s: r.at_s,
                })
            })
            .collect()
    }

    /// The requests of one step of one run, by request id.
    pub async fn load_requests(&self, run: RunId, step: usize) -> Result<Vec<RequestRow>> {
        let rows: Vec<RequestDbRow> = sqlx::query_as(
            "SELECT request_id, key_hash, key, destination, scheduled_s, sent_s, first_token_s, \
             finish_s, prompt_tokens, output_tokens, cached_tokens, preemptions, retried, status \
             FROM requests WHERE run_id = ? AND step = ? ORDER BY request_id",
        )
        .bind(run.0)
        .bind(step as i64)
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("reading requests"))?;
        rows.into_iter()
            .map(|r| {
                let request = r.request_id as u64;
                r.into_row().map_err(|source| StoreError::BadStatus {
                    db: self.path.clone(),
                    run: run.0,
                    step,
                    request,
                    source,
                })
            })
            .collect()
    }

    /// Names and sizes of every study, oldest first.
    pub async fn list_studies(&self) -> Result<Vec<StudySummary>> {
        let rows: Vec<(String, String, String, i64, i64, i64)> = sqlx::query_as(
            "SELECT s.name, s.created_at, s.software_version, \
               (SELECT count(*) FROM runs r WHERE r.study_id = s.id), \
               (SELECT count(*) FROM runs r WHERE r.study_id = s.id AND r.status = 'complete'), \
               (SELECT count(*) FROM steps t JOIN runs r ON r.id = t.run_id \
                  WHERE r.study_id = s.id) \
             FROM studies s ORDER BY s.id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("listing studies"))?;
        Ok(rows
            .into_iter()
            .map(
                |(name, created_at, software_version, runs, complete, steps)| StudySummary {
                    name,
                    created_at,
                    software_version,
                    runs: runs as usize,
                    complete_runs: complete as usize,
                    steps: steps as usize,
                },
            )
            .collect())
    }

    /// Everything the report needs about study `name`.
    pub async fn load_study(&self, name: &str) -> Result<StoredStudy> {
        let study: Option<(i64, String, String, Option<String>, String)> = sqlx::query_as(
            "SELECT id, spec, software_version, backend, created_at FROM studies WHERE name = ?",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await
        .map_err(self.sql("reading studies"))?;
        let Some((study_id, spec, software_version, backend, created_at)) = study else {
            let known: Vec<String> = self
                .list_studies()
                .await?
                .into_iter()
                .map(|s| s.name)
                .collect();
            return Err(StoreError::NoSuchStudy {
                db: self.path.clone(),
                name: name.to_owned(),
                known: if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                },
            });
        };

        let runs: Vec<RunDbRow> = sqlx::query_as(
            "SELECT r.id, r.policy, r.seed, r.sweep, r.config, r.software_version, r.status, \
               (SELECT count(*) FROM steps t WHERE t.run_id = r.id) AS steps_completed \
             FROM runs r WHERE r.study_id = ? ORDER BY r.policy, r.seed, r.sweep",
        )
        .bind(study_id)
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("reading runs"))?;
        let runs: Vec<StoredRun> = runs.into_iter().map(StoredRun::from).collect();
        let key_of = |id: i64| {
            runs.iter()
                .find(|r| r.id.0 == id)
                .map(|r| r.key.clone())
                .ok_or(StoreError::NoSuchRun {
                    db: self.path.clone(),
                    run: id,
                })
        };

        let step_rows: Vec<(i64, i64, String)> = sqlx::query_as(
            "SELECT t.run_id, t.step, t.metrics FROM steps t JOIN runs r ON r.id = t.run_id \
             WHERE r.study_id = ? ORDER BY r.policy, r.seed, r.sweep, t.step",
        )
        .bind(study_id)
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("reading steps"))?;
        let mut steps = Vec::with_capacity(step_rows.len());
        for (run_id, step, json) in step_rows {
            let metrics: StepMetrics =
                nan_json::from_str(&json).map_err(|source| StoreError::BadJson {
                    db: self.path.clone(),
                    what: format!("metrics of run {run_id} step {step}"),
                    source,
                })?;
            steps.push(StepRecord {
                run: key_of(run_id)?,
                step: step as usize,
                metrics,
            });
        }

        let plan_rows: Vec<PlanDbRow> = sqlx::query_as(
            "SELECT p.run_id, p.step, p.at_s, p.admitted, p.admitted_share, p.imbalance, \
               p.churn, p.repair, p.build_ms, p.q_cap, p.warm_slots, p.tuning, p.bounded_sets, \
               p.dispatch \
             FROM plans p JOIN runs r ON r.id = p.run_id \
             WHERE r.study_id = ? ORDER BY r.policy, r.seed, r.sweep, p.step, p.seq",
        )
        .bind(study_id)
        .fetch_all(&self.pool)
        .await
        .map_err(self.sql("reading plans"))?;
        let mut plans = Vec::with_capacity(plan_rows.len());
        for p in plan_rows {
            let dispatch = match &p.dispatch {
                None => None,
                Some(d) => Some(d.parse().map_err(|e: String| StoreError::BadPlan {
                    db: self.path.clone(),
                    run: p.run_id,
                    step: p.step,
                    detail: format!("dispatch: {e}"),
                })?),
            };
            plans.push(PlanEvent {
                run: key_of(p.run_id)?,
                step: p.step as usize,
                plan: PlanRecord {
                    at_s: p.at_s,
                    admitted: p.admitted as usize,
                    // A NaN is written as NULL: it reads back as NaN.
                    admitted_share: p.admitted_share.unwrap_or(f64::NAN),
                    imbalance: p.imbalance.unwrap_or(f64::NAN),
                    churn: p.churn.unwrap_or(f64::NAN),
                    repair: p.repair,
                    build_ms: p.build_ms,
                    q_cap: p.q_cap,
                    warm_slots: p.warm_slots.map(|w| w.max(0) as u64),
                    bounded_sets: p.bounded_sets,
                    dispatch,
                    replicas: None,
                    tuning: p.tuning,
                },
            });
        }

        Ok(StoredStudy {
            id: StudyId(study_id),
            name: name.to_owned(),
            spec,
            software_version,
            backend,
            created_at,
            runs,
            steps,
            plans,
        })
    }
}

/// Check an existing file read-only before the read-write open: a non-SQLite file, a SQLite
/// database made by something else, a newer schema or a failed migration are refused here,
/// so that nothing (not even the WAL switch) touches them.
async fn preflight(path: &Path) -> Result<()> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(StoreError::NotADatabase {
                db: path.to_path_buf(),
                detail: format!("cannot read it: {e}"),
            })
        }
    };
    if meta.is_dir() {
        return Err(StoreError::NotADatabase {
            db: path.to_path_buf(),
            detail: "it is a directory".into(),
        });
    }
    if meta.len() == 0 {
        // SQLite treats an empty file as an empty database.
        return Ok(());
    }
    let mut header = [0u8; 16];
    let read = {
        use std::io::Read;
        std::fs::File::open(path)
            .and_then(|mut f| f.read(&mut header))
            .map_err(|e| StoreError::NotADatabase {
                db: path.to_path_buf(),
                detail: format!("cannot read it: {e}"),
            })?
    };
    if read < header.len() || &header != b"SQLite format 3\0" {
        return Err(StoreError::NotADatabase {
            db: path.to_path_buf(),
            detail: "no SQLite header".into(),
        });
    }

    let sql_err = |context: &'static str| {
        let db = path.to_path_buf();
        move |source: sqlx::Error| match sqlite_primary_code(&source) {
            Some(SQLITE_NOTADB) | Some(SQLITE_CORRUPT) => StoreError::NotADatabase {
                db,
                detail: source.to_string(),
            },
            _ => StoreError::Sqlite {
                db,
                context,
                source,
            },
        }
    };
    let options = SqliteConnectOptions::new()
        .filename(path)
        .read_only(true)
        .create_if_missing(false)
        .busy_timeout(Duration::from_secs(30));
    let mut conn = SqliteConnection::connect_with(&options)
        .await
        .map_err(sql_err("opening the database read-only"))?;
    let checked = check_schema(&mut conn, path, &sql_err).await;
    // Closing a read-only connection writes nothing.
    let _ = conn.close().await;
    checked
}

async fn check_schema<F, M>(conn: &mut SqliteConnection, path: &Path, sql_err: &M) -> Result<()>
where
    M: Fn(&'static str) -> F,
    F: FnOnce(sqlx::Error) -> StoreError,
{
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
         ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(sql_err("reading the schema"))?;
    if tables.is_empty() {
        return Ok(());
    }
    if !tables.iter().any(|t| t == "_sqlx_migrations") {
        return Err(StoreError::ForeignDatabase {
            db: path.to_path_buf(),
            tables: tables.join(", "),
        });
    }
    let applied: Vec<(i64, bool)> =
        sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut *conn)
            .await
            .map_err(sql_err("reading the schema version"))?;
    let supported = supported_schema_version();
    if let Some(&(found, _)) = applied.iter().rev().find(|(v, _)| *v > supported) {
        return Err(StoreError::SchemaTooNew {
            db: path.to_path_buf(),
            found,
            supported,
        });
    }
    if let Some(&(version, _)) = applied.iter().find(|(_, ok)| !ok) {
        return Err(StoreError::DirtyMigration {
            db: path.to_path_buf(),
            version,
        });
    }
    Ok(())
}

/// A row struct read by column name (what `#[derive(sqlx::FromRow)]` would write, without
/// the sqlx macros crate).
macro_rules! db_row {
    (struct $name:ident { $($field:ident: $ty:ty,)* }) => {
        struct $name {
            $($field: $ty,)*
        }
        impl<'r> FromRow<'r, SqliteRow> for $name {
            fn from_row(row: &'r SqliteRow) -> Result<Self, sqlx::Error> {
                Ok($name {
                    $($field: row.try_get(stringify!($field))?,)*
                })
            }
        }
    };
}

db_row! {
    struct RequestDbRow {
        request_id: i64,
        key_hash: i64,
        key: Option<String>,
        destination: Option<i32>,
        scheduled_s: f64,
        sent_s: Option<f64>,
        first_token_s: Option<f64>,
        finish_s: Option<f64>,
        prompt_tokens: i64,
        output_tokens: i64,
        cached_tokens: i64,
        preemptions: i64,
        retried: bool,
        status: String,
    }
}

impl RequestDbRow {
    /// The stored row as the one record (and its key text); the status label must name a
    /// [`Status`].
    fn into_row(self) -> Result<RequestRow, UnknownStatus> {
        let r = self;
        Ok(RequestRow {
            record: RequestRecord {
                id: r.request_id as u64,
                key: r.key_hash as u64,
                destination: r.destination,
                scheduled_s: r.scheduled_s,
                sent_s: r.sent_s,
                first_token_s: r.first_token_s,
                finish_s: r.finish_s,
                prompt_tokens: r.prompt_tokens as u32,
                output_tokens: r.output_tokens as u32,
                cached_tokens: Some(r.cached_tokens as u32),
                preemptions: r.preemptions as u32,
                retried: r.retried,
                status: Status::parse(&r.status)?,
            },
            key: r.key,
        })
    }
}

db_row! {
    struct RunDbRow {
        id: i64,
        policy: String,
        seed: i64,
        sweep: String,
        config: String,
        software_version: String,
        status: String,
        steps_completed: i64,
    }
}

impl From<RunDbRow> for StoredRun {
    fn from(r: RunDbRow) -> Self {
        StoredRun {
            id: RunId(r.id),
            key: RunKey {
                policy: r.policy,
                seed: r.seed as u64,
                sweep: r.sweep,
            },
            config: r.config,
            software_version: r.software_version,
            complete: r.status == "complete",
            steps_completed: r.steps_completed as usize,
        }
    }
}

db_row! {
    struct PlanDbRow {
        run_id: i64,
        step: i64,
        at_s: f64,
        admitted: i64,
        admitted_share: Option<f64>,
        imbalance: Option<f64>,
        churn: Option<f64>,
        repair: bool,
        build_ms: Option<f64>,
        q_cap: Option<f64>,
        warm_slots: Option<i64>,
        tuning: Option<String>,
        bounded_sets: Option<bool>,
        dispatch: Option<String>,
    }
}

db_row! {
    struct TelemetryDbRow {
        run_id: Option<i64>,
        step: Option<i64>,
        source: String,
        metric: String,
        labels: String,
        value: Option<f64>,
        at_s: f64,
    }
}
