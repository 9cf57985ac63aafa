-- cacheroute results store, schema version 1 (see docs/store.md).
--
-- Conventions: times within a run (scheduled_s, at_s, ...) are seconds as REAL (virtual
-- seconds from the trace start in simulation, seconds from the run start on real fleets); a
-- NULL time means "did not happen" (e.g. no first token). Wall-clock stamps (created_at,
-- completed_at) are ISO-8601 UTC text. 64-bit unsigned values (seeds, request ids, key hashes)
-- are stored bit-for-bit in SQLite's signed INTEGER. JSON columns are text for json_extract().

CREATE TABLE studies (
    id               INTEGER PRIMARY KEY,
    name             TEXT NOT NULL UNIQUE,
    -- The study spec as the user wrote it (YAML or JSON text).
    spec             TEXT NOT NULL,
    software_version TEXT NOT NULL,
    created_at       TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE runs (
    id               INTEGER PRIMARY KEY,
    study_id         INTEGER NOT NULL REFERENCES studies(id) ON DELETE CASCADE,
    -- Report label of the policy.
    policy           TEXT NOT NULL,
    seed             INTEGER NOT NULL,
    -- Sweep point, '' when the study has no sweep (e.g. 'q_cap=100,W=64').
    sweep            TEXT NOT NULL DEFAULT '',
    -- Resolved configuration of this run (JSON).
    config           TEXT NOT NULL,
    software_version TEXT NOT NULL,
    status           TEXT NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'complete')),
    created_at       TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    completed_at     TEXT,
    UNIQUE (study_id, policy, seed, sweep)
);

-- One row per completed ladder step. A step is written in one transaction together with its
-- requests and plans, so a row here means the whole step is present.
CREATE TABLE steps (
    run_id             INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    step               INTEGER NOT NULL CHECK (step >= 0),
    offered_qps        REAL NOT NULL,
    achieved_qps       REAL,
    completed_qps      REAL,
    requests           INTEGER NOT NULL,
    errors             INTEGER NOT NULL,
    ttft_p50_s         REAL,
    ttft_p99_s         REAL,
    e2e_p50_s          REAL,
    e2e_p99_s          REAL,
    served_kv_hit      REAL,
    imbalance_requests REAL,
    window_s           REAL,
    -- The full analysis::model::StepMetrics as JSON (NaN is written as null).
    metrics            TEXT NOT NULL,
    completed_at       TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (run_id, step)
);

CREATE TABLE requests (
    run_id           INTEGER NOT NULL,
    step             INTEGER NOT NULL,
    request_id       INTEGER NOT NULL,
    -- crate::key_hash of the routing key; the key text too when the backend knows it.
    key_hash         INTEGER NOT NULL,
    key              TEXT,
    -- Destination index that served it (the last one tried); NULL when none.
    destination      INTEGER,
    scheduled_s      REAL NOT NULL,
    sent_s           REAL,
    first_token_s    REAL,
    finish_s         REAL,
    prompt_tokens    INTEGER NOT NULL,
    output_tokens    INTEGER NOT NULL,
    cached_tokens    INTEGER NOT NULL,
    preemptions      INTEGER NOT NULL DEFAULT 0,
    retried          INTEGER NOT NULL DEFAULT 0,
    -- ok | no_destination | failed | rejected | unfinished (live backends may add more)
    status           TEXT NOT NULL,
    PRIMARY KEY (run_id, step, request_id),
    FOREIGN KEY (run_id, step) REFERENCES steps(run_id, step) ON DELETE CASCADE
) WITHOUT ROWID;

-- Installed plans (CacheRoute), in installation order within a step.
CREATE TABLE plans (
    run_id           INTEGER NOT NULL,
    step             INTEGER NOT NULL,
    seq              INTEGER NOT NULL,
    at_s             REAL NOT NULL,
    admitted         INTEGER NOT NULL,
    admitted_share   REAL,
    imbalance        REAL,
    churn            REAL,
    repair           INTEGER NOT NULL DEFAULT 0,
    build_ms         REAL,
    PRIMARY KEY (run_id, step, seq),
    FOREIGN KEY (run_id, step) REFERENCES steps(run_id, step) ON DELETE CASCADE
);

-- Telemetry samples (NVML, engine /metrics, router counters). run_id / step are NULL for
-- samples taken outside a run (e.g. while engines warm up).
CREATE TABLE telemetry (
    id               INTEGER PRIMARY KEY,
    study_id         INTEGER NOT NULL REFERENCES studies(id) ON DELETE CASCADE,
    run_id           INTEGER REFERENCES runs(id) ON DELETE CASCADE,
    step             INTEGER,
    -- Where it came from, e.g. 'nvml:gpu-3/0', 'engine:7', 'router'.
    source           TEXT NOT NULL,
    metric           TEXT NOT NULL,
    -- JSON object of label name -> value ('{}' when none).
    labels           TEXT NOT NULL DEFAULT '{}',
    value            REAL,
    at_s             REAL NOT NULL
);

CREATE INDEX telemetry_by_run ON telemetry (run_id, step, metric);
CREATE INDEX telemetry_by_study_metric ON telemetry (study_id, metric, at_s);
