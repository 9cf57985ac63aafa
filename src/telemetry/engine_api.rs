//! What differs between the serving engines' HTTP dialects where a study touches them: how a
//! prefix cache is reset between steps (route, success rule) and which `/metrics` counters
//! give the served KV hit. vLLM: `POST /reset_prefix_cache` (dev mode) answering
//! `{"success": bool}`; counters `vllm:prefix_cache_hits_total` / `_queries_total`, present
//! from the start. SGLang: `GET|POST /flush_cache` answering 200, or 400 while requests run or
//! wait; counters `sglang:cached_tokens_total` (one series per `cache_source`) /
//! `sglang:prompt_tokens_total`, which only appear once a request touched them. Pure.

use super::prom::{sum, Sample};

/// An engine's HTTP dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineApi {
    /// vLLM's (and `cacheroute emulate`'s default).
    #[default]
    Vllm,
    /// SGLang's (and `cacheroute emulate --api sglang`).
    Sglang,
}

/// Engine-neutral names of the served-hit counter deltas a live step stores (one per engine
/// and step): prompt tokens served from the prefix cache, and prompt tokens looked up.
pub const CACHE_HIT_TOKENS_DELTA: &str = "engine_cache_hit_tokens:delta";
/// See [`CACHE_HIT_TOKENS_DELTA`].
pub const CACHE_QUERY_TOKENS_DELTA: &str = "engine_cache_query_tokens:delta";

/// The names databases written before the engine-neutral ones used (for vLLM and SGLang
/// alike); still read, so old studies keep their engine-counter served hit.
pub const LEGACY_HIT_DELTA: &str = "vllm:prefix_cache_hits_total:delta";
/// See [`LEGACY_HIT_DELTA`].
pub const LEGACY_QUERY_DELTA: &str = "vllm:prefix_cache_queries_total:delta";

/// Which of the two served-hit deltas a stored telemetry metric is, under either naming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheDelta {
    HitTokens,
    QueryTokens,
}

impl CacheDelta {
    /// The delta a stored metric name stands for, if it is one.
    pub fn of_metric(name: &str) -> Option<CacheDelta> {
        match name {
            CACHE_HIT_TOKENS_DELTA | LEGACY_HIT_DELTA => Some(CacheDelta::HitTokens),
            CACHE_QUERY_TOKENS_DELTA | LEGACY_QUERY_DELTA => Some(CacheDelta::QueryTokens),
            _ => None,
        }
    }
}

/// What a cache-reset answer means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetOutcome {
    /// The cache was reset.
    Done,
    /// Not now (requests still hold blocks, or run or wait): retry later.
    Busy(String),
    /// Not at all (wrong route, engine not in the mode that serves it, …).
    Failed(String),
}

impl EngineApi {
    /// The name used in messages and on the command line (`vllm`, `sglang`).
    pub fn name(self) -> &'static str {
        match self {
            EngineApi::Vllm => "vllm",
            EngineApi::Sglang => "sglang",
        }
    }

    /// The route that resets the prefix cache (always sent as POST; SGLang takes GET too).
    pub fn reset_path(self) -> &'static str {
        match self {
            EngineApi::Vllm => "/reset_prefix_cache",
            EngineApi::Sglang => "/flush_cache",
        }
    }

    /// What the engine's answer to [`Self::reset_path`] means. vLLM answers 200 with
    /// `{"success": false}` while blocks are held (an empty or non-JSON 200 body, as older
    /// releases and the emulator before it sent, counts as done); SGLang answers 400 while
    /// requests run or wait.
    pub fn reset_outcome(self, status: u16, body: &str) -> ResetOutcome {
        let short = body.trim().chars().take(200).collect::<String>();
        match (self, status) {
            (EngineApi::Vllm, 200..=299) => {
                let success = serde_json::from_str::<serde_json::Value>(body)
                    .ok()
                    .and_then(|v| v.get("success").and_then(|s| s.as_bool()));
                if success == Some(false) {
                    ResetOutcome::Busy(format!("200 {short}"))
                } else {
                    ResetOutcome::Done
                }
            }
            (EngineApi::Sglang, 200..=299) => ResetOutcome::Done,
            (EngineApi::Sglang, 400) => ResetOutcome::Busy(format!("400 {short}")),
            (_, s) => ResetOutcome::Failed(format!("{s} {short}")),
        }
    }

    /// What to do about a reset that cannot succeed, for the error message.
    pub fn reset_hint(self) -> &'static str {
        match self {
            EngineApi::Vllm => "start vLLM with VLLM_SERVER_DEV_MODE=1 so caches can be reset between steps",
            EngineApi::Sglang => "check that the server is SGLang (fleet.engine) and that nothing else sends it requests between steps",
        }
    }

    /// The served-hit counters (hit tokens, queried tokens) in a `/metrics` payload of this
    /// engine. vLLM's must be present. SGLang's appear only after a request touched them, so
    /// absent means 0; `sglang:cached_tokens_total` has one series per `cache_source`
    /// (`device`, `host`, `storage_<backend>`, or `total` for a request without a
    /// breakdown): each request's cached tokens go to exactly one of the two groups, so the
    /// series are summed. A payload of the other engine is an error, so a wrong
    /// `fleet.engine` does not read as an idle SGLang.
    pub fn cache_counters(self, samples: &[Sample]) -> Result<(f64, f64), String> {
        let has = |prefix: &str| samples.iter().any(|s| s.name.starts_with(prefix));
        match self {
            EngineApi::Vllm => match (
                sum(samples, "vllm:prefix_cache_hits_total"),
                sum(samples, "vllm:prefix_cache_queries_total"),
            ) {
                (Some(h), Some(q)) => Ok((h, q)),
                _ if has("sglang:") => {
                    Err("it serves SGLang's metrics, not vLLM's; set fleet.engine: sglang".into())
                }
                _ => Err(
                    "no vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total counters"
                        .into(),
                ),
            },
            EngineApi::Sglang => {
                if has("vllm:") {
                    return Err(
                        "it serves vLLM's metrics, not SGLang's; set fleet.engine: vllm".into(),
                    );
                }
                Ok((
                    sum(samples, "sglang:cached_tokens_total").unwrap_or(0.0),
                    sum(samples, "sglang:prompt_tokens_total").unwrap_or(0.0),
                ))
            }
        }
    }

    /// Requests this engine has finished: vLLM's `vllm:request_success_total` (summed over
    /// finish reasons; must be present) or SGLang's `sglang:num_requests_total` (absent until
    /// the first request finishes, so absent means 0).
    pub fn request_count(self, samples: &[Sample]) -> Result<f64, String> {
        match self {
            EngineApi::Vllm => sum(samples, "vllm:request_success_total")
                .ok_or_else(|| "no vllm:request_success_total counter".into()),
            EngineApi::Sglang => Ok(sum(samples, "sglang:num_requests_total").unwrap_or(0.0)),
        }
    }
}

impl std::str::FromStr for EngineApi {
    type Err = String;
    fn from_str(s: &str) -> Result<EngineApi, String> {
        match s {
            "vllm" => Ok(EngineApi::Vllm),
            "sglang" => Ok(EngineApi::Sglang),
            other => Err(format!("unknown engine API `{other}`; use vllm or sglang")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::prom::parse;

    #[test]
    fn sglang_counters_absent_on_a_fresh_server_count_as_zero() {
        // A fresh (or just flushed) SGLang: the request counters have no series yet.
        let fresh = "# HELP sglang:num_running_reqs The number of running requests.\n\
# TYPE sglang:num_running_reqs gauge\n\
sglang:num_running_reqs{engine_type=\"unified\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 0.0\n";
        let s = parse(fresh).unwrap();
        assert_eq!(EngineApi::Sglang.cache_counters(&s), Ok((0.0, 0.0)));
        // Wholly empty (multiprocess collector before the first request) is 0 too.
        assert_eq!(EngineApi::Sglang.cache_counters(&[]), Ok((0.0, 0.0)));
        // vLLM's must be there.
        assert!(EngineApi::Vllm
            .cache_counters(&s)
            .unwrap_err()
            .contains("fleet.engine: sglang"));
    }

    #[test]
    fn sglang_cached_tokens_sum_every_cache_source_once() {
        // Requests with a breakdown count under device/host/storage_*, requests without one
        // under `total` (SGLang's collector: one or the other per request, never both).
        let text = "sglang:prompt_tokens_total{model_name=\"m\"} 5000.0\n\
sglang:cached_tokens_total{cache_source=\"device\",model_name=\"m\"} 2000.0\n\
sglang:cached_tokens_total{cache_source=\"host\",model_name=\"m\"} 500.0\n\
sglang:cached_tokens_total{cache_source=\"storage_file\",model_name=\"m\"} 100.0\n\
sglang:cached_tokens_total{cache_source=\"total\",model_name=\"m\"} 300.0\n\
sglang:cached_tokens_created{cache_source=\"device\",model_name=\"m\"} 1.7e9\n\
sglang:cache_hit_rate{model_name=\"m\"} 0.93\n";
        let s = parse(text).unwrap();
        assert_eq!(EngineApi::Sglang.cache_counters(&s), Ok((2900.0, 5000.0)));
        // The gauge is never a source; a vLLM payload read as SGLang is refused.
        let v = parse("vllm:prefix_cache_hits_total{engine=\"0\"} 1.0\nvllm:prefix_cache_queries_total{engine=\"0\"} 2.0\n").unwrap();
        assert!(EngineApi::Sglang
            .cache_counters(&v)
            .unwrap_err()
            .contains("fleet.engine: vllm"));
        assert_eq!(EngineApi::Vllm.cache_counters(&v), Ok((1.0, 2.0)));
    }

    #[test]
    fn reset_answers_by_engine() {
        use ResetOutcome::*;
        let v = EngineApi::Vllm;
        assert_eq!(v.reset_outcome(200, r#"{"success":true}"#), Done);
        assert_eq!(v.reset_outcome(200, ""), Done);
        assert!(matches!(
            v.reset_outcome(200, r#"{"success": false}"#),
            Busy(_)
        ));
        assert!(matches!(v.reset_outcome(404, "Not Found"), Failed(_)));
        let s = EngineApi::Sglang;
        assert_eq!(s.reset_outcome(200, "Cache flushed.\n"), Done);
        assert!(matches!(s.reset_outcome(400, "Cache not flushed"), Busy(_)));
        assert!(matches!(s.reset_outcome(404, ""), Failed(_)));
        assert_eq!(
            CacheDelta::of_metric(LEGACY_HIT_DELTA),
            CacheDelta::of_metric(CACHE_HIT_TOKENS_DELTA)
        );
        assert_eq!("sglang".parse::<EngineApi>(), Ok(EngineApi::Sglang));
        assert!("tgi".parse::<EngineApi>().is_err());
    }
}
