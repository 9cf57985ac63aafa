//! External routers in a live study step (see [`crate::peer`]): start the peer in front of the
//! step's engines, measure it from the engines' own counters (a peer reports nothing, and the
//! replayer cannot see where it sent a request), and turn a peer that fails to start or dies
//! into a [`PeerFailed`] the runner records while the other policies carry on.
//!
//! Served hit = Σ prefix-cache hit tokens / Σ queried tokens, and imbalance = max / mean of
//! per-engine finished requests (and of uncached prompt tokens), all as counter deltas from the
//! end of the warm-up to the end of the step (every request of the measured window has
//! finished by then; requests of the warm-up still running at its end are counted too).

use crate::analysis::max_over_mean;
use crate::peer::{ExternalSpec, Running};
use crate::store::TelemetrySample;
use crate::telemetry::engine_api::EngineApi;
use anyhow::Result;
use std::time::Duration;

/// An external router failed to start, or died under a step. The runner stores it with the
/// run, skips the rest of that policy's steps and carries on with the other policies.
#[derive(Debug, Clone, thiserror::Error)]
#[error("external router {label} ({version}) failed: {error}")]
pub struct PeerFailed {
    /// `router:policy`.
    pub label: String,
    pub version: String,
    /// One line: what went wrong.
    pub error: String,
    /// The last lines of its log.
    pub log_tail: String,
    /// What fixes a missing install (`bash scripts/install-peers.sh NAME`).
    pub install: String,
}

/// Telemetry metric of a failed peer (value 1; labels `error`, `log_tail`, `install`, `version`).
pub const PEER_FAILED: &str = "external_router_failed";
/// Telemetry metric of a peer that ran a step (value 1; labels `version`, `command`, `key_header`).
pub const PEER_STARTED: &str = "external_router";

impl PeerFailed {
    fn from_peer(spec: &ExternalSpec, e: crate::peer::PeerError) -> Self {
        PeerFailed {
            label: spec.label(),
            version: crate::peer::locate(spec)
                .map(|i| i.version)
                .unwrap_or_else(|_| "not installed".into()),
            install: match &e {
                crate::peer::PeerError::NotInstalled { install, .. } => install.clone(),
                _ => String::new(),
            },
            error: e.to_string(),
            log_tail: e.log_tail().to_string(),
        }
    }

    /// The telemetry row that keeps the failure in the database.
    pub fn sample(&self) -> TelemetrySample {
        TelemetrySample {
            run: None,
            step: None,
            source: format!("peer:{}", self.label),
            metric: PEER_FAILED.into(),
            labels: vec![
                ("version".into(), self.version.clone()),
                ("error".into(), self.error.clone()),
                ("log_tail".into(), self.log_tail.clone()),
                ("install".into(), self.install.clone()),
            ],
            value: 1.0,
            at_s: 0.0,
        }
    }
}

/// Start `spec` in front of `urls` with `extra` arguments; a failure is a [`PeerFailed`].
pub fn start(
    spec: &ExternalSpec,
    urls: &[String],
    dir: &std::path::Path,
    extra: &[String],
) -> Result<Running> {
    crate::peer::start(spec, urls, dir, crate::peer::START_TIMEOUT, extra)
        .map_err(|e| PeerFailed::from_peer(spec, e).into())
}

/// The peer died under the step.
pub fn died(peer: &Running, why: String) -> anyhow::Error {
    PeerFailed {
        label: peer.what.clone(),
        version: peer.version.clone(),
        error: format!("{why} under the step; command: {}", peer.command_line),
        log_tail: peer.log_tail(12),
        install: String::new(),
    }
    .into()
}

/// An engine's counters: prefix-cache hit and queried tokens, finished requests.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub hits: f64,
    pub queries: f64,
    pub requests: f64,
}

/// Scrape every engine's [`Counters`].
pub fn scrape(
    client: &reqwest::blocking::Client,
    urls: &[String],
    api: EngineApi,
) -> Result<Vec<Counters>> {
    urls.iter()
        .map(|u| {
            let text = client
                .get(format!("{u}/metrics"))
                .send()?
                .error_for_status()?
                .text()?;
            let s = crate::telemetry::prom::parse(&text)?;
            let (hits, queries) = api
                .cache_counters(&s)
                .map_err(|e| anyhow::anyhow!("{u}/metrics: {e}"))?;
            let requests = api
                .request_count(&s)
                .map_err(|e| anyhow::anyhow!("{u}/metrics: {e}"))?;
            Ok(Counters {
                hits,
                queries,
                requests,
            })
        })
        .collect()
}

/// Scrape the engines' counters once `after` has passed (the end of the warm-up), on a thread.
pub fn scrape_at(
    urls: Vec<String>,
    api: EngineApi,
    after: Duration,
) -> std::thread::JoinHandle<Result<Vec<Counters>>> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        scrape(&client, &urls, api)
    })
}

/// The window's per-engine deltas.
pub fn deltas(start: &[Counters], end: &[Counters]) -> Vec<Counters> {
    start
        .iter()
        .zip(end)
        .map(|(a, b)| Counters {
            hits: b.hits - a.hits,
            queries: b.queries - a.queries,
            requests: b.requests - a.requests,
        })
        .collect()
}

/// Served hit and imbalance of `m` from the engines' window deltas `d`.
pub fn apply_counters(m: &mut crate::analysis::model::StepMetrics, d: &[Counters]) {
    let hits: f64 = d.iter().map(|c| c.hits).sum();
    let queries: f64 = d.iter().map(|c| c.queries).sum();
    m.served_kv_hit = if queries > 0.0 {
        hits / queries
    } else {
        f64::NAN
    };
    let req: Vec<f64> = d.iter().map(|c| c.requests).collect();
    let prefill: Vec<f64> = d.iter().map(|c| (c.queries - c.hits).max(0.0)).collect();
    m.imbalance_requests = max_over_mean(&req);
    m.imbalance_prefill_tokens = max_over_mean(&prefill);
}

/// The step's rows: the peer's version and exact command line (its first replica's, with the
/// number of replicas), each replica's own decision counters, and each engine's window deltas.
pub fn telemetry(
    peers: &[Running],
    urls: &[String],
    d: &[Counters],
    at_s: f64,
) -> Vec<TelemetrySample> {
    let mut t = Vec::new();
    if let Some(peer) = peers.first() {
        t.push(TelemetrySample {
            run: None,
            step: None,
            source: format!("peer:{}", peer.what),
            metric: PEER_STARTED.into(),
            labels: vec![
                ("version".into(), peer.version.clone()),
                ("command".into(), peer.command_line.clone()),
                ("key_header".into(), peer.key_header.into()),
                ("replicas".into(), peers.len().to_string()),
            ],
            value: 1.0,
            at_s: 0.0,
        });
    }
    for (i, peer) in peers.iter().enumerate() {
        for (series, v) in peer.decisions() {
            t.push(TelemetrySample {
                run: None,
                step: None,
                source: format!("peer:{}", peer.what),
                metric: PEER_DECISIONS.into(),
                labels: vec![("series".into(), series), ("replica".into(), i.to_string())],
                value: v,
                at_s,
            });
        }
    }
    for (i, c) in d.iter().enumerate() {
        for (metric, v) in [
            (WINDOW_HITS, c.hits),
            (WINDOW_QUERIES, c.queries),
            (WINDOW_REQUESTS, c.requests),
        ] {
            t.push(TelemetrySample {
                run: None,
                step: None,
                source: format!("engine:{i}"),
                metric: metric.into(),
                labels: vec![("url".into(), urls[i].clone())],
                value: v,
                at_s,
            });
        }
    }
    t
}

/// Telemetry metric of a peer's own routing-decision counters at the end of a step (warm-up
/// included; label `series`: the Prometheus series, e.g.
/// `vllm_router_prefix_routing_decisions_total{…,outcome="prefix_hit"}`).
pub const PEER_DECISIONS: &str = "peer_decisions";

/// What a peer's own decision counters say, summed over its steps: one line per counter
/// (`outcome` or `decision` label → total), then how its requests for token ids ended (the vLLM
/// router's `kv_routing_inputs`, `result` label → total), and a warning when most of its
/// decisions were made without the input it routes by (the vLLM router's `missing_tokens`), so
/// that its row is not read as its algorithm's result. The warning names the cause the counters
/// show: render answers that came after the router stopped waiting for them
/// (`preparation_unavailable`), or workers that do not serve `/v1/completions/render`.
pub fn decision_summary(label: &str, rows: &[(String, f64)]) -> (String, Option<String>) {
    use std::collections::BTreeMap;
    let label_value = |series: &str, key: &str| {
        let i = series.find(key)? + key.len();
        series[i..].split('"').next().map(str::to_string)
    };
    // Counters with an `outcome` or `decision` label say how it decided; others (e.g. one per
    // worker) are shown by their metric name only when there is nothing else.
    let mut labelled: BTreeMap<String, f64> = BTreeMap::new();
    let mut named: BTreeMap<String, f64> = BTreeMap::new();
    let mut inputs: BTreeMap<String, f64> = BTreeMap::new();
    for (series, v) in rows {
        if let Some(r) = label_value(series, "result=\"") {
            *inputs.entry(r).or_default() += v;
            continue;
        }
        let outcome = ["outcome=\"", "decision=\""]
            .iter()
            .find_map(|k| label_value(series, k));
        match outcome {
            Some(o) => *labelled.entry(o).or_default() += v,
            None => {
                *named
                    .entry(series.split('{').next().unwrap_or(series).to_string())
                    .or_default() += v
            }
        }
    }
    let by = if labelled.is_empty() { named } else { labelled };
    let total: f64 = by.values().sum();
    let join = |m: &BTreeMap<String, f64>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v:.0}"))
            .collect::<Vec<_>>()
            .join(" · ")
    };
    let mut text = join(&by);
    if !inputs.is_empty() {
        if !text.is_empty() {
            text.push_str("; ");
        }
        text.push_str("token ids asked of workers: ");
        text.push_str(&join(&inputs));
    }
    let missing = by.get("missing_tokens").copied().unwrap_or(0.0);
    let late = inputs
        .get("preparation_unavailable")
        .copied()
        .unwrap_or(0.0);
    let failed: f64 = inputs
        .iter()
        .filter(|(k, _)| *k != "render" && *k != "preparation_unavailable")
        .map(|(_, v)| v)
        .sum();
    let warn = (total > 0.0 && missing * 2.0 > total).then(|| {
        let why = if late > 0.0 && late >= failed {
            format!(
                "{late:.0} of its requests for token ids were not answered within the time it waits for them (about 1 s): it asks *every* worker for every request's token ids (`/v1/completions/render`), so the engines render requests/s × replicas prompts a second (times `local.time_scale` for emulators), and past what the machine serves the answers come late. Lower the ladder or the time scale for it, or run it on more cores"
            )
        } else {
            "it asks each worker for the prompt's token ids at `/v1/completions/render`; vLLM serves it with `--enable-scale-out`, which a study running the vLLM router adds".to_string()
        };
        format!(
            "**{label} did not route by prefix**: {missing:.0} of its {total:.0} decisions were `missing_tokens` ({why}). Its row is load balancing, not its cache-aware algorithm."
        )
    });
    (text, warn)
}

/// Telemetry metrics of the measured window's engine-counter deltas (external routers).
pub const WINDOW_HITS: &str = "window:prefix_cache_hits:delta";
pub const WINDOW_QUERIES: &str = "window:prefix_cache_queries:delta";
pub const WINDOW_REQUESTS: &str = "window:requests_finished:delta";

/// What the report says about a study's external routers: which failed (their runs are not
/// complete; they are left out of the ranking), and a note naming each one's version and exact
/// command line, and each failure with its log tail and the command that retries it.
pub struct PeerReport {
    pub failed: Vec<String>,
    pub note: Option<String>,
}

/// [`PeerReport`] of a stored study from its telemetry.
pub fn peer_report(
    store: &crate::store::BlockingStore,
    stored: &crate::store::StoredStudy,
) -> Result<PeerReport> {
    use std::collections::BTreeMap;
    let label = |s: &TelemetrySample, k: &str| {
        s.labels
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let policy_of = |run: Option<crate::store::RunId>| {
        stored
            .runs
            .iter()
            .find(|r| Some(r.id) == run)
            .map(|r| r.key.policy.clone())
    };
    let mut decisions: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for s in store.load_telemetry(stored.id, Some(PEER_DECISIONS))? {
        if let Some(p) = policy_of(s.run) {
            decisions
                .entry(p)
                .or_default()
                .push((label(&s, "series"), s.value));
        }
    }
    let mut started: BTreeMap<String, (String, String, String)> = BTreeMap::new();
    for s in store.load_telemetry(stored.id, Some(PEER_STARTED))? {
        if let Some(p) = policy_of(s.run) {
            started.entry(p).or_insert_with(|| {
                (
                    label(&s, "version"),
                    label(&s, "command"),
                    label(&s, "key_header"),
                )
            });
        }
    }
    let mut failures: BTreeMap<String, TelemetrySample> = BTreeMap::new();
    for s in store.load_telemetry(stored.id, Some(PEER_FAILED))? {
        let incomplete = stored
            .runs
            .iter()
            .any(|r| Some(r.id) == s.run && !r.complete);
        if let (Some(p), true) = (policy_of(s.run), incomplete) {
            failures.insert(p, s);
        }
    }
    if started.is_empty() && failures.is_empty() {
        return Ok(PeerReport {
            failed: Vec::new(),
            note: None,
        });
    }
    let mut t = String::from("External routers (started by the study in front of the same engines, for the same paired-seed traces; served hit and imbalance from the engines' own counters over the measured window):

| policy | version | routing key header | its own decision counters (all steps) | command line (last step's ports) |
| --- | --- | --- | --- | --- |
");
    let mut warnings = Vec::new();
    for (p, (v, cmd, h)) in &started {
        let (d, warn) = decision_summary(p, decisions.get(p).map_or(&[][..], |v| &v[..]));
        warnings.extend(warn);
        let d = if d.is_empty() { "—".to_string() } else { d };
        t.push_str(&format!(
            "| {p} (external) | {v} | `{h}` | {d} | `{cmd}` |
"
        ));
    }
    for (p, s) in &failures {
        if !started.contains_key(p) {
            t.push_str(&format!(
                "| {p} (external) | {} | — | — | failed |
",
                label(s, "version")
            ));
        }
    }
    for w in &warnings {
        t.push_str(&format!(
            "
{w}
"
        ));
    }
    for (p, s) in &failures {
        let install = label(s, "install");
        t.push_str(&format!(
            "
**{p} failed** at step {} and is left out of the ranking: {}

Last lines of its log:

```
{}```

Retry: {}`cacheroute run SPEC --resume` (the other policies' results stay in the database).
",
            s.step.unwrap_or(0),
            label(s, "error"),
            label(s, "log_tail"),
            if install.is_empty() {
                String::new()
            } else {
                format!("`{install}`, then ")
            }
        ));
    }
    Ok(PeerReport {
        failed: failures.into_keys().collect(),
        note: Some(t),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_routed_without_its_input_is_called_out() {
        let series = |o: &str| {
            format!(
                "vllm_router_prefix_routing_decisions_total{{policy=\"cache_aware\",stage=\"regular\",outcome=\"{o}\"}}"
            )
        };
        // Two steps' worth: all missing_tokens → the warning, naming the counts.
        let rows = vec![
            (series("missing_tokens"), 300.0),
            (series("missing_tokens"), 40.0),
        ];
        let (text, warn) = decision_summary("vllm-router:cache_aware", &rows);
        assert_eq!(text, "missing_tokens 340");
        let w = warn.expect("a warning");
        assert!(
            w.contains("340 of its 340 decisions") && w.contains("--enable-scale-out"),
            "{w}"
        );
        // Mostly prefix decisions → no warning.
        let rows = vec![
            (series("prefix_hit"), 280.0),
            (series("prefix_miss"), 60.0),
            (series("missing_tokens"), 5.0),
            (
                "vllm_router_policy_decisions_total{worker=\"http://a\"}".into(),
                345.0,
            ),
        ];
        let (text, warn) = decision_summary("vllm-router:cache_aware", &rows);
        assert_eq!(text, "missing_tokens 5 · prefix_hit 280 · prefix_miss 60");
        assert!(warn.is_none());
        // Its token-id requests came back late: the warning says so, not the missing flag.
        let input = |r: &str| {
            format!("vllm_router_kv_routing_inputs_total{{transport=\"http\",result=\"{r}\"}}")
        };
        let rows = vec![
            (series("missing_tokens"), 656.0),
            (series("prefix_hit"), 59.0),
            (input("render"), 436.0),
            (input("preparation_unavailable"), 1152.0),
        ];
        let (text, warn) = decision_summary("vllm-router:cache_aware", &rows);
        assert_eq!(
            text,
            "missing_tokens 656 · prefix_hit 59; token ids asked of workers: \
             preparation_unavailable 1152 · render 436"
        );
        let w = warn.expect("a warning");
        assert!(
            w.contains("656 of its 715 decisions")
                && w.contains("1152 of its requests for token ids were not answered")
                && !w.contains("--enable-scale-out"),
            "{w}"
        );
        // Renders that failed outright point at the endpoint.
        let rows = vec![
            (series("missing_tokens"), 10.0),
            (input("render_unavailable"), 20.0),
        ];
        let w = decision_summary("vllm-router:cache_aware", &rows)
            .1
            .expect("a warning");
        assert!(w.contains("--enable-scale-out"), "{w}");
        // A counter without an outcome label is named by its metric.
        let (text, warn) =
            decision_summary("smg:cache_aware", &[("smg_decisions_total".into(), 7.0)]);
        assert_eq!(text, "smg_decisions_total 7");
        assert!(warn.is_none());
    }

    #[test]
    fn hit_and_imbalance_come_from_the_counters() {
        let mut m = crate::analysis::model::StepMetrics {
            served_kv_hit: 0.99,
            ..Default::default()
        };
        let start = vec![Counters::default(); 2];
        let end = vec![
            Counters {
                hits: 60.0,
                queries: 100.0,
                requests: 30.0,
            },
            Counters {
                hits: 0.0,
                queries: 100.0,
                requests: 10.0,
            },
        ];
        apply_counters(&mut m, &deltas(&start, &end));
        assert!((m.served_kv_hit - 0.3).abs() < 1e-12);
        assert!((m.imbalance_requests - 1.5).abs() < 1e-12);
        // uncached tokens 40 and 100: max / mean = 100 / 70
        assert!((m.imbalance_prefill_tokens - 100.0 / 70.0).abs() < 1e-12);
    }
}
