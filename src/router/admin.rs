//! The router's own Prometheus `/metrics` (open, as scrapers expect) and the admin API behind a
//! bearer token: `GET /admin/plan` (installed plan summary; `?table=true` adds key →
//! destinations), `GET /admin/stats` (per-destination state and counters, decisions by path),
//! `POST /admin/reload` (reload the plan file, or plan now from the open rate window). Both
//! show the `--record` counters (written, dropped, late, write errors, rotations) when recording.
//!
//! The Prometheus text is written here directly (a dozen families and three latency
//! histograms per destination; no exporter crate needed).

use super::control;
use super::state::{json_error, Cmd, Counters, Shared};
use crate::policy::FleetView;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/admin/plan", get(plan))
        .route("/admin/stats", get(stats))
        .route("/admin/reload", post(reload))
}

/// `Authorization: Bearer <token>` must match the configured token.
/// Whether `given` equals `token`, in time that does not depend on where they differ nor on
/// either length: both are hashed to 128 bits with a per-process random key, and the digests
/// compared byte by byte without an early exit. (A plain comparison stops at the first
/// difference or at a length mismatch, telling a prober how much it has right.)
fn tokens_match(given: &[u8], token: &[u8]) -> bool {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let key = *KEY.get_or_init(|| std::collections::hash_map::RandomState::new().hash_one(0u64));
    let a = xxhash_rust::xxh3::xxh3_128_with_seed(given, key).to_le_bytes();
    let b = xxhash_rust::xxh3::xxh3_128_with_seed(token, key).to_le_bytes();
    let diff = a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn authorize(s: &Shared, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let Some(token) = &s.cfg.admin_token else {
        return Err(Box::new(json_error(
            StatusCode::FORBIDDEN,
            "permission_error",
            "the admin API is disabled; start the router with --admin-token (or CACHEROUTE_ADMIN_TOKEN)",
        )));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = given.is_some_and(|g| tokens_match(g.as_bytes(), token.as_bytes()));
    if ok {
        Ok(())
    } else {
        Err(Box::new(json_error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong admin token; send `Authorization: Bearer <token>`",
        )))
    }
}

#[derive(serde::Deserialize)]
struct PlanQuery {
    #[serde(default)]
    table: bool,
}

async fn plan(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<PlanQuery>,
) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return *r;
    }
    let mut v = control::summary(&s);
    if q.table {
        v["table"] = control::table(&s);
    }
    axum::Json(v).into_response()
}

async fn stats(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return *r;
    }
    let c = &s.counters;
    let dests: Vec<serde_json::Value> = (0..s.fleet.len())
        .filter(|&d| !s.fleet.is_vacant(d))
        .map(|d| {
            let x = s.fleet.dest(d);
            serde_json::json!({
                "index": d,
                "url": &*x.url(),
                "up": s.fleet.is_up(d),
                "outstanding": s.fleet.outstanding(d),
                "queued_prompt_tokens": s.fleet.queued_prefill_tokens(d),
                "requests": x.requests.load(Relaxed),
                "errors": x.errors.load(Relaxed),
                "marked_down": x.downs.load(Relaxed),
                "first_byte_timeouts": x.timeouts.load(Relaxed),
                "broken_streams": x.broken_streams.load(Relaxed),
                "upstream_pooled": s.marks[d].pooled(),
                "upstream_unsolicited": s.marks[d].unsolicited.load(Relaxed),
                "upstream_unpooled_requests": s.marks[d].unpooled_requests.load(Relaxed),
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "policy": s.label,
        "uptime_s": s.now(),
        "draining": s.draining.load(Relaxed),
        "requests": c.requests.load(Relaxed),
        "rejected": c.rejected.load(Relaxed),
        "no_destination": c.no_destination.load(Relaxed),
        "retries": c.retries.load(Relaxed),
        "failed": c.failed.load(Relaxed),
        "decisions": {
            "table_hit": c.table_hits.load(Relaxed),
            "fallback": c.fallbacks.load(Relaxed),
            "policy": c.policy_decisions.load(Relaxed),
        },
        "plans_installed": c.plans_installed.load(Relaxed),
        "plan_repairs": c.plan_repairs.load(Relaxed),
        "connections_open": s.connections.load(Relaxed),
        "connections_refused": c.connections_refused.load(Relaxed),
        "buffered_body_bytes": s.buffered.load(Relaxed),
        "buffer_refused": c.buffer_refused.load(Relaxed),
        "body_timeouts": c.body_timeouts.load(Relaxed),
        "recording": s.recording().map(|r| r.summary()),
        "destinations": dests,
    }))
    .into_response()
}

async fn reload(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return *r;
    }
    if !s.uses_plan {
        return json_error(
            StatusCode::CONFLICT,
            "invalid_request_error",
            format!(
                "policy `{}` has no plan to reload; only cacheroute plans",
                s.label
            ),
        );
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    if !s.send_control(Cmd::Reload(tx)) {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the control loop is not running (router shutting down)",
        );
    }
    match rx.await {
        Ok(Ok(v)) => axum::Json(v).into_response(),
        Ok(Err(e)) => json_error(StatusCode::UNPROCESSABLE_ENTITY, "reload_error", e),
        Err(_) => json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the control loop stopped before answering",
        ),
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&s),
    )
        .into_response()
}

/// The Prometheus text of `/metrics`.
fn render(s: &Shared) -> String {
    let c = &s.counters;
    let mut o = String::with_capacity(4096);
    let fam = |o: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    // A metric family with one unlabelled sample.
    let scalar = |o: &mut String, name: &str, kind: &str, help: &str, v: &dyn std::fmt::Display| {
        fam(o, name, kind, help);
        let _ = writeln!(o, "{name} {v}");
    };
    let n = s.fleet.len();
    let per_dest = |o: &mut String, name: &str, f: &dyn Fn(usize) -> String| {
        for d in (0..n).filter(|&d| !s.fleet.is_vacant(d)) {
            let _ = writeln!(
                o,
                "{name}{{destination=\"{d}\",url=\"{}\"}} {}",
                s.fleet.dest(d).url(),
                f(d)
            );
        }
    };
    scalar(
        &mut o,
        "cacheroute_router_requests_total",
        "counter",
        "Requests received by the router.",
        &c.requests.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_router_rejected_total",
        "counter",
        "Requests answered 4xx by the router itself.",
        &c.rejected.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_router_no_destination_total",
        "counter",
        "Requests answered 503 because no destination was up.",
        &c.no_destination.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_router_retries_total",
        "counter",
        "Attempts retried on another destination.",
        &c.retries.load(Relaxed),
    );
    for (name, kind, help, v) in [
        (
            "cacheroute_router_connections_open",
            "gauge",
            "Client connections open.",
            s.connections.load(Relaxed) as u64,
        ),
        (
            "cacheroute_router_connections_refused_total",
            "counter",
            "Connections answered 503 because max_connections were open.",
            c.connections_refused.load(Relaxed),
        ),
        (
            "cacheroute_router_buffered_body_bytes",
            "gauge",
            "Request body bytes reserved in buffers.",
            s.buffered.load(Relaxed) as u64,
        ),
        (
            "cacheroute_router_buffer_refused_total",
            "counter",
            "Requests answered 503 because their body did not fit max_buffered_bytes.",
            c.buffer_refused.load(Relaxed),
        ),
        (
            "cacheroute_router_body_timeouts_total",
            "counter",
            "Requests answered 408 because their body did not arrive within body_timeout.",
            c.body_timeouts.load(Relaxed),
        ),
    ] {
        scalar(&mut o, name, kind, help, &v);
    }
    if let Some(r) = s.recording() {
        let r = r.summary();
        for (name, kind, help, v) in [
            (
                "cacheroute_router_records_written_total",
                "counter",
                "Requests written to the --record trace.",
                r.written,
            ),
            (
                "cacheroute_router_records_dropped_total",
                "counter",
                "Records dropped because the queue to the --record writer was full.",
                r.dropped,
            ),
            (
                "cacheroute_router_records_late_total",
                "counter",
                "Records written with their timestamp moved up to keep the trace sorted.",
                r.late,
            ),
            (
                "cacheroute_router_record_write_errors_total",
                "counter",
                "Failed writes, flushes or rotations of the --record trace.",
                r.write_errors,
            ),
            (
                "cacheroute_router_record_rotations_total",
                "counter",
                "Rotations of the --record trace file.",
                r.rotations,
            ),
            (
                "cacheroute_router_records_held",
                "gauge",
                "Finished records waiting for earlier requests before being written.",
                r.held,
            ),
        ] {
            scalar(&mut o, name, kind, help, &v);
        }
    }
    scalar(
        &mut o,
        "cacheroute_router_failed_total",
        "counter",
        "Requests that failed after the retry.",
        &c.failed.load(Relaxed),
    );
    fam(
        &mut o,
        "cacheroute_destination_requests_total",
        "counter",
        "Attempts sent to each destination.",
    );
    per_dest(&mut o, "cacheroute_destination_requests_total", &|d| {
        s.fleet.dest(d).requests.load(Relaxed).to_string()
    });
    fam(
        &mut o,
        "cacheroute_destination_errors_total",
        "counter",
        "Failed attempts per destination.",
    );
    per_dest(&mut o, "cacheroute_destination_errors_total", &|d| {
        s.fleet.dest(d).errors.load(Relaxed).to_string()
    });
    fam(
        &mut o,
        "cacheroute_destination_first_byte_timeouts_total",
        "counter",
        "Attempts answered 504 for no first byte within the first-byte timeout (not retried).",
    );
    per_dest(
        &mut o,
        "cacheroute_destination_first_byte_timeouts_total",
        &|d| s.fleet.dest(d).timeouts.load(Relaxed).to_string(),
    );
    fam(
        &mut o,
        "cacheroute_destination_broken_streams_total",
        "counter",
        "Responses that broke once begun (a stream cut mid-way); they fail that request and mark nothing down.",
    );
    per_dest(
        &mut o,
        "cacheroute_destination_broken_streams_total",
        &|d| s.fleet.dest(d).broken_streams.load(Relaxed).to_string(),
    );
    fam(
        &mut o,
        "cacheroute_upstream_unsolicited_total",
        "counter",
        "Upstream connections closed because the destination wrote bytes on them unasked (while idle, or after its answer).",
    );
    per_dest(&mut o, "cacheroute_upstream_unsolicited_total", &|d| {
        s.marks[d].unsolicited.load(Relaxed).to_string()
    });
    fam(
        &mut o,
        "cacheroute_upstream_unpooled_total",
        "counter",
        "Requests sent on a fresh connection, closed after, because the destination wrote unasked and has not passed a probe since.",
    );
    per_dest(&mut o, "cacheroute_upstream_unpooled_total", &|d| {
        s.marks[d].unpooled_requests.load(Relaxed).to_string()
    });
    fam(
        &mut o,
        "cacheroute_upstream_pooled",
        "gauge",
        "1 when connections to the destination are pooled; 0 after it wrote unasked, until it passes a probe.",
    );
    per_dest(&mut o, "cacheroute_upstream_pooled", &|d| {
        u8::from(s.marks[d].pooled()).to_string()
    });
    fam(
        &mut o,
        "cacheroute_destination_outstanding",
        "gauge",
        "Requests in flight per destination.",
    );
    per_dest(&mut o, "cacheroute_destination_outstanding", &|d| {
        s.fleet.outstanding(d).to_string()
    });
    fam(
        &mut o,
        "cacheroute_destination_queued_prompt_tokens",
        "gauge",
        "Prompt tokens sent whose first byte has not come back.",
    );
    per_dest(
        &mut o,
        "cacheroute_destination_queued_prompt_tokens",
        &|d| s.fleet.queued_prefill_tokens(d).to_string(),
    );
    fam(
        &mut o,
        "cacheroute_destination_up",
        "gauge",
        "1 when the destination may receive requests.",
    );
    per_dest(&mut o, "cacheroute_destination_up", &|d| {
        u8::from(s.fleet.is_up(d)).to_string()
    });
    for (name, help, pick) in [
        (
            "cacheroute_router_ttft_seconds",
            "Completion requests: arrival at the router to the destination's first body byte.",
            (|l| &l.ttft) as fn(&super::latency::Latencies) -> &super::latency::Hist,
        ),
        (
            "cacheroute_router_e2e_seconds",
            "Completion requests: arrival at the router to the end of the response (errors included).",
            |l| &l.e2e,
        ),
        (
            "cacheroute_router_upstream_seconds",
            "Each attempt: sending to the destination to its response head and first body byte, or the attempt's failure.",
            |l| &l.upstream,
        ),
    ] {
        fam(&mut o, name, "histogram", help);
        for d in (0..n).filter(|&d| !s.fleet.is_vacant(d)) {
            let labels = format!(
                "destination=\"{d}\",url=\"{}\",policy=\"{}\"",
                s.fleet.dest(d).url(),
                s.label
            );
            pick(&s.fleet.dest(d).latency).write(&mut o, name, &labels);
        }
    }
    fam(
        &mut o,
        "cacheroute_decisions_total",
        "counter",
        "Routing decisions by path.",
    );
    for (path, v) in [
        ("table_hit", &c.table_hits),
        ("fallback", &c.fallbacks),
        ("policy", &c.policy_decisions),
    ] {
        let _ = writeln!(
            o,
            "cacheroute_decisions_total{{path=\"{path}\",policy=\"{}\"}} {}",
            s.label,
            v.load(Relaxed)
        );
    }
    scalar(
        &mut o,
        "cacheroute_plans_installed_total",
        "counter",
        "Plans installed (built, loaded or repaired).",
        &c.plans_installed.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_plan_repairs_total",
        "counter",
        "Plans repaired after a destination went down.",
        &c.plan_repairs.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_plan_failures_total",
        "counter",
        "Control intervals whose planning failed.",
        &c.plan_failures.load(Relaxed),
    );
    scalar(
        &mut o,
        "cacheroute_plan_build_seconds_last",
        "gauge",
        "Time the last plan took to build.",
        &Counters::get_f64(&c.plan_build_seconds_last),
    );
    scalar(
        &mut o,
        "cacheroute_plan_build_seconds_total",
        "counter",
        "Total time spent building plans.",
        &Counters::get_f64(&c.plan_build_seconds_sum),
    );
    scalar(
        &mut o,
        "cacheroute_plan_churn",
        "gauge",
        "Fraction of admitted keys whose destination set changed at the last install.",
        &Counters::get_f64(&c.plan_churn_last),
    );
    scalar(
        &mut o,
        "cacheroute_plan_admitted_keys",
        "gauge",
        "Keys admitted to the installed plan.",
        &c.plan_admitted.load(Relaxed),
    );
    super::etcd::metrics(s, &mut o);
    o
}

#[cfg(test)]
mod tests {
    use super::tokens_match;
    use crate::router::config::{EtcdConfig, RecordConfig, RouterConfig};
    use crate::router::state::Shared;
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    /// A router state with every value `/metrics` shows set to a distinct figure: three
    /// destination slots (one vacant, one down), recording on, an etcd plan store.
    fn fixed_state(dir: &std::path::Path) -> std::sync::Arc<Shared> {
        let backends = (0..3)
            .map(|d| format!("http://127.0.0.1:{}", 9 + d))
            .collect();
        let policy = crate::policy::PolicySpec::from_name("cacheroute").expect("policy");
        let mut rc = RouterConfig::new("127.0.0.1:0".parse().unwrap(), backends, policy);
        rc.record = Some(RecordConfig::new(dir.join("trace.jsonl")));
        rc.etcd = Some(EtcdConfig::new("http://127.0.0.1:9"));
        let recorder =
            crate::router::record::Recorder::open(rc.record.as_ref(), None).expect("recorder");
        let s = Shared::new(rc, Some(recorder), None).expect("state");
        let c = &s.counters;
        for (i, a) in [
            &c.requests,
            &c.rejected,
            &c.no_destination,
            &c.retries,
            &c.failed,
            &c.table_hits,
            &c.fallbacks,
            &c.policy_decisions,
            &c.plans_installed,
            &c.plan_repairs,
            &c.plan_failures,
            &c.plan_admitted,
            &c.connections_refused,
            &c.buffer_refused,
            &c.body_timeouts,
        ]
        .into_iter()
        .enumerate()
        {
            a.store(100 + i as u64, Relaxed);
        }
        c.plan_build_seconds_last.store(0.25f64.to_bits(), Relaxed);
        c.plan_build_seconds_sum.store(1.5f64.to_bits(), Relaxed);
        c.plan_churn_last.store(0.125f64.to_bits(), Relaxed);
        s.connections.store(7, Relaxed);
        s.buffered.store(4096, Relaxed);
        for d in 0..3 {
            let x = s.fleet.dest(d);
            let k = 10 * (d as u64 + 1);
            x.requests.store(k, Relaxed); // `begin` below adds one
            x.errors.store(k + 2, Relaxed);
            x.timeouts.store(k + 3, Relaxed);
            x.broken_streams.store(k + 4, Relaxed);
            s.marks[d].unsolicited.store(k + 5, Relaxed);
            s.marks[d].unpooled_requests.store(k + 6, Relaxed);
            s.fleet.begin(d, k + 7);
            for ms in [3, 40, 700, 9000] {
                let t = Duration::from_millis(ms * (d as u64 + 1));
                x.latency.ttft.record(t);
                x.latency.e2e.record(2 * t);
                x.latency.upstream.record(t / 2);
            }
        }
        s.fleet.mark_down(1);
        s.fleet.vacate(2);
        s
    }

    /// `/metrics` renders a fixed state to the very text it rendered before its families
    /// were declared as rows (`testdata/metrics.prom`, captured from the hand-written
    /// version).
    #[test]
    fn metrics_text_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let s = fixed_state(dir.path());
        let got = super::render(&s);
        let want = include_str!("testdata/metrics.prom");
        if got != want {
            let at = std::env::temp_dir().join("cacheroute-metrics.prom");
            std::fs::write(&at, &got).unwrap();
            let line = got
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(got.lines().count().min(want.lines().count()));
            panic!(
                "/metrics differs from testdata/metrics.prom at line {} (whole text in {}): got {:?}, want {:?}",
                line + 1,
                at.display(),
                got.lines().nth(line),
                want.lines().nth(line)
            );
        }
    }

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(tokens_match(b"sekret", b"sekret"));
        for wrong in [&b""[..], b"s", b"sekre", b"sekret!", b"Sekret", b"tekret"] {
            assert!(!tokens_match(wrong, b"sekret"), "{wrong:?}");
        }
    }
}
