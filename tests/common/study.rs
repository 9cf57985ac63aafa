//! Reading a finished study's results back from its database.

use std::path::Path;

/// The engine-counter deltas a live study stored, one per engine and step: (hit tokens,
/// queried tokens), both in the store's order.
pub fn engine_counter_deltas(db: &Path, study: &str) -> (Vec<f64>, Vec<f64>) {
    use cacheroute::telemetry::engine_api as api;
    let st = cacheroute::store::BlockingStore::open(db).unwrap();
    let s = st.load_study(study).unwrap();
    let load = |m: &str| -> Vec<f64> {
        st.load_telemetry(s.id, Some(m))
            .unwrap()
            .iter()
            .map(|t| t.value)
            .collect()
    };
    (
        load(api::CACHE_HIT_TOKENS_DELTA),
        load(api::CACHE_QUERY_TOKENS_DELTA),
    )
}
