//! Reading a finished study's results back from its database.

use std::path::Path;

/// The values a study stored under telemetry `metric`, in the store's order.
pub fn telemetry_values(db: &Path, study: &str, metric: &str) -> Vec<f64> {
    let st = cacheroute::store::BlockingStore::open(db).unwrap();
    let s = st.load_study(study).unwrap();
    st.load_telemetry(s.id, Some(metric))
        .unwrap()
        .iter()
        .map(|t| t.value)
        .collect()
}

/// The engine-counter deltas a live study stored, one per engine and step: (hit tokens,
/// queried tokens), both in the store's order.
pub fn engine_counter_deltas(db: &Path, study: &str) -> (Vec<f64>, Vec<f64>) {
    use cacheroute::telemetry::engine_api as api;
    (
        telemetry_values(db, study, api::CACHE_HIT_TOKENS_DELTA),
        telemetry_values(db, study, api::CACHE_QUERY_TOKENS_DELTA),
    )
}

/// The request records a study stored for step `step` of run `run`, by request id.
pub fn request_records(
    st: &cacheroute::store::BlockingStore,
    run: cacheroute::store::RunId,
    step: usize,
) -> Vec<cacheroute::analysis::record::RequestRecord> {
    st.load_requests(run, step)
        .unwrap()
        .into_iter()
        .map(|r| r.record)
        .collect()
}
