//! The router's own Prometheus `/metrics` (open, as scrapers expect) and the admin API behind a
//! bearer token: `GET /admin/plan` (installed plan summary; `?table=true` adds key →
//! destinations, `?history=true` the record of every plan installed since start),
//! `GET /admin/stats` (per-destination state and counters, decisions by path),
//! `POST /admin/reload` (reload the plan file, or plan now from the open rate window). Both
//! show the `--record` counters (written, dropped, late, write errors, rotations) when recording;
//! the `/metrics` text is `metrics`'.

use super::control;
use super::state::{json_error, Cmd, Shared};
use crate::policy::FleetView;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/metrics", get(super::metrics::metrics))
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
    #[serde(default)]
    history: bool,
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
        super::json::set(&mut v, "table", control::table(&s));
    }
    if q.history {
        let (records, dropped) = control::history(&s);
        super::json::set(&mut v, "history", records);
        super::json::set(&mut v, "history_dropped", dropped.into());
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
                "upstream_pooled": s.mark(d).pooled(),
                "upstream_unsolicited": s.mark(d).unsolicited.load(Relaxed),
                "upstream_unpooled_requests": s.mark(d).unpooled_requests.load(Relaxed),
            })
        })
        .collect();
    axum::Json(serde_json::json!({
        "policy": s.label,
        "uptime_s": s.uptime(),
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

#[cfg(test)]
mod tests {
    use super::tokens_match;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(tokens_match(b"sekret", b"sekret"));
        for wrong in [&b""[..], b"s", b"sekre", b"sekret!", b"Sekret", b"tekret"] {
            assert!(!tokens_match(wrong, b"sekret"), "{wrong:?}");
        }
    }
}
