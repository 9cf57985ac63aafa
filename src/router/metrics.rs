//! The router's own Prometheus `/metrics` (open, as scrapers expect): every family is one row
//! of [`FAMILIES`] — its name, type, help and how its samples are read from the router's
//! state — and [`render`] writes them all in that order (then the `--etcd` plan store's, rows
//! of the same shape from `etcd`). Adding a family is adding a row; no exporter crate is needed.

use super::latency::{Hist, Latencies};
use super::record::RecordSummary;
use super::state::{Counters, Shared};
use crate::policy::FleetView;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// A family's Prometheus type.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's value: a count, or a measured figure (written as Rust writes an `f64`).
pub(crate) enum V {
    N(u64),
    X(f64),
}

impl std::fmt::Display for V {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            V::N(n) => n.fmt(f),
            V::X(x) => x.fmt(f),
        }
    }
}

impl From<bool> for V {
    fn from(b: bool) -> Self {
        V::N(u64::from(b))
    }
}

/// One of the router's counters (or `f64` figures).
type Field = fn(&Counters) -> &AtomicU64;

/// How a family's samples are read.
enum Read {
    /// One unlabelled sample: a router counter.
    Count(Field),
    /// One unlabelled sample: a router figure kept as `f64` bits.
    Measure(Field),
    /// One unlabelled sample read from the state.
    One(fn(&Shared) -> V),
    /// One unlabelled sample of the `--record` counters; no family when not recording.
    Recording(fn(&RecordSummary) -> u64),
    /// One sample per destination slot in use, labelled `destination` and `url`.
    PerDest(fn(&Shared, usize) -> V),
    /// One histogram per destination slot in use, labelled `destination`, `url`, `policy`.
    Latency(fn(&Latencies) -> &Hist),
    /// One sample per routing path, labelled `path` and `policy`.
    ByPath(&'static [(&'static str, Field)]),
}

/// One metric family.
struct Family {
    name: &'static str,
    kind: Kind,
    help: &'static str,
    read: Read,
}

/// A family with one unlabelled sample, from a part of the state `render` does not see
/// (the `--etcd` plan store's).
pub(crate) struct Scalar {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    pub value: V,
}

const fn row(name: &'static str, kind: Kind, help: &'static str, read: Read) -> Family {
    Family {
        name,
        kind,
        help,
        read,
    }
}

use Kind::{Counter, Gauge, Histogram};
use Read::{ByPath, Count, Latency, Measure, One, PerDest, Recording};

/// Every family of `/metrics`, in the order written.
#[rustfmt::skip]
const FAMILIES: &[Family] = &[
    row("cacheroute_router_requests_total", Counter, "Requests received by the router.", Count(|c| &c.requests)),
    row("cacheroute_router_rejected_total", Counter, "Requests answered 4xx by the router itself.", Count(|c| &c.rejected)),
    row("cacheroute_router_no_destination_total", Counter, "Requests answered 503 because no destination was up.", Count(|c| &c.no_destination)),
    row("cacheroute_router_retries_total", Counter, "Attempts retried on another destination.", Count(|c| &c.retries)),
    row("cacheroute_router_connections_open", Gauge, "Client connections open.", One(|s| V::N(s.connections.load(Relaxed) as u64))),
    row("cacheroute_router_connections_refused_total", Counter, "Connections answered 503 because max_connections were open.", Count(|c| &c.connections_refused)),
    row("cacheroute_router_buffered_body_bytes", Gauge, "Request body bytes reserved in buffers.", One(|s| V::N(s.buffered.load(Relaxed) as u64))),
    row("cacheroute_router_buffer_refused_total", Counter, "Requests answered 503 because their body did not fit max_buffered_bytes.", Count(|c| &c.buffer_refused)),
    row("cacheroute_router_body_timeouts_total", Counter, "Requests answered 408 because their body did not arrive within body_timeout.", Count(|c| &c.body_timeouts)),
    row("cacheroute_router_records_written_total", Counter, "Requests written to the --record trace.", Recording(|r| r.written)),
    row("cacheroute_router_records_dropped_total", Counter, "Records dropped because the queue to the --record writer was full.", Recording(|r| r.dropped)),
    row("cacheroute_router_records_late_total", Counter, "Records written with their timestamp moved up to keep the trace sorted.", Recording(|r| r.late)),
    row("cacheroute_router_record_write_errors_total", Counter, "Failed writes, flushes or rotations of the --record trace.", Recording(|r| r.write_errors)),
    row("cacheroute_router_record_rotations_total", Counter, "Rotations of the --record trace file.", Recording(|r| r.rotations)),
    row("cacheroute_router_records_held", Gauge, "Finished records waiting for earlier requests before being written.", Recording(|r| r.held)),
    row("cacheroute_router_failed_total", Counter, "Requests that failed after the retry.", Count(|c| &c.failed)),
    row("cacheroute_destination_requests_total", Counter, "Attempts sent to each destination.", PerDest(|s, d| V::N(s.fleet.dest(d).requests.load(Relaxed)))),
    row("cacheroute_destination_prompt_tokens_total", Counter, "Prompt tokens of the requests routed to each destination.", PerDest(|s, d| V::N(s.fleet.dest(d).prompt_tokens.load(Relaxed)))),
    row("cacheroute_destination_predicted_cached_tokens_total", Counter, "Of those, the tokens the router's exact index (the engines' KV-cache events) held at the destination when it was chosen; 0 without --kv-events-port-offset.", PerDest(|s, d| V::N(s.fleet.dest(d).predicted_cached_tokens.load(Relaxed)))),
    row("cacheroute_destination_errors_total", Counter, "Failed attempts per destination.", PerDest(|s, d| V::N(s.fleet.dest(d).errors.load(Relaxed)))),
    row("cacheroute_destination_first_byte_timeouts_total", Counter, "Attempts answered 504 for no first byte within the first-byte timeout (not retried).", PerDest(|s, d| V::N(s.fleet.dest(d).timeouts.load(Relaxed)))),
    row("cacheroute_destination_broken_streams_total", Counter, "Responses that broke once begun (a stream cut mid-way); they fail that request and mark nothing down.", PerDest(|s, d| V::N(s.fleet.dest(d).broken_streams.load(Relaxed)))),
    row("cacheroute_upstream_unsolicited_total", Counter, "Upstream connections closed because the destination wrote bytes on them unasked (while idle, or after its answer).", PerDest(|s, d| V::N(s.mark(d).unsolicited.load(Relaxed)))),
    row("cacheroute_upstream_unpooled_total", Counter, "Requests sent on a fresh connection, closed after, because the destination wrote unasked and has not passed a probe since.", PerDest(|s, d| V::N(s.mark(d).unpooled_requests.load(Relaxed)))),
    row("cacheroute_upstream_pooled", Gauge, "1 when connections to the destination are pooled; 0 after it wrote unasked, until it passes a probe.", PerDest(|s, d| V::from(s.mark(d).pooled()))),
    row("cacheroute_destination_outstanding", Gauge, "Requests in flight per destination.", PerDest(|s, d| V::N(s.fleet.outstanding(d) as u64))),
    row("cacheroute_destination_queued_prompt_tokens", Gauge, "Prompt tokens sent whose first byte has not come back.", PerDest(|s, d| V::N(s.fleet.queued_prefill_tokens(d)))),
    row("cacheroute_destination_up", Gauge, "1 when the destination may receive requests.", PerDest(|s, d| V::from(s.fleet.is_up(d)))),
    row("cacheroute_router_ttft_seconds", Histogram, "Completion requests: arrival at the router to the destination's first body byte.", Latency(|l| &l.ttft)),
    row("cacheroute_router_e2e_seconds", Histogram, "Completion requests: arrival at the router to the end of the response (errors included).", Latency(|l| &l.e2e)),
    row("cacheroute_router_upstream_seconds", Histogram, "Each attempt: sending to the destination to its response head and first body byte, or the attempt's failure.", Latency(|l| &l.upstream)),
    row("cacheroute_decisions_total", Counter, "Routing decisions by path.", ByPath(&[("table_hit", |c| &c.table_hits), ("fallback", |c| &c.fallbacks), ("policy", |c| &c.policy_decisions)])),
    row("cacheroute_plans_installed_total", Counter, "Plans installed (built, loaded or repaired).", Count(|c| &c.plans_installed)),
    row("cacheroute_plan_repairs_total", Counter, "Plans repaired after a destination went down.", Count(|c| &c.plan_repairs)),
    row("cacheroute_plan_failures_total", Counter, "Control intervals whose planning failed.", Count(|c| &c.plan_failures)),
    row("cacheroute_plan_build_seconds_last", Gauge, "Time the last plan took to build.", Measure(|c| &c.plan_build_seconds_last)),
    row("cacheroute_plan_build_seconds_total", Counter, "Total time spent building plans.", Measure(|c| &c.plan_build_seconds_sum)),
    row("cacheroute_plan_churn", Gauge, "Fraction of admitted keys whose destination set changed at the last install.", Measure(|c| &c.plan_churn_last)),
    row("cacheroute_plan_admitted_keys", Gauge, "Keys admitted to the installed plan.", Count(|c| &c.plan_admitted)),
];

pub(crate) async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&s),
    )
        .into_response()
}

fn head(o: &mut String, name: &str, kind: Kind, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {}", kind.as_str());
}

/// The Prometheus text of `/metrics`.
fn render(s: &Shared) -> String {
    let mut o = String::with_capacity(4096);
    let c = &s.counters;
    let recording = s.recording().map(|r| r.summary());
    let dests = || (0..s.fleet.len()).filter(|&d| !s.fleet.is_vacant(d));
    for f in FAMILIES {
        let name = f.name;
        if matches!(f.read, Recording(_)) && recording.is_none() {
            continue;
        }
        head(&mut o, name, f.kind, f.help);
        let _ = match &f.read {
            Count(a) => writeln!(o, "{name} {}", a(c).load(Relaxed)),
            Measure(a) => writeln!(o, "{name} {}", Counters::get_f64(a(c))),
            One(v) => writeln!(o, "{name} {}", v(s)),
            Recording(v) => writeln!(o, "{name} {}", recording.as_ref().map_or(0, *v)),
            PerDest(v) => dests().try_for_each(|d| {
                let url = s.fleet.dest(d).url();
                writeln!(o, "{name}{{destination=\"{d}\",url=\"{url}\"}} {}", v(s, d))
            }),
            Latency(pick) => {
                for d in dests() {
                    let x = s.fleet.dest(d);
                    let labels = format!(
                        "destination=\"{d}\",url=\"{}\",policy=\"{}\"",
                        x.url(),
                        s.label
                    );
                    pick(&x.latency).write(&mut o, name, &labels);
                }
                Ok(())
            }
            ByPath(paths) => paths.iter().try_for_each(|(path, a)| {
                let v = a(c).load(Relaxed);
                writeln!(o, "{name}{{path=\"{path}\",policy=\"{}\"}} {v}", s.label)
            }),
        };
    }
    if let Some(feed) = &s.kv {
        super::kv_map::write_metrics(&mut o, feed);
    }
    for x in s
        .plan_store
        .as_ref()
        .map(|st| store_rows(&st.view()))
        .into_iter()
        .flatten()
    {
        head(&mut o, x.name, x.kind, x.help);
        let _ = writeln!(o, "{} {}", x.name, x.value);
    }
    o
}

/// The plan store's Prometheus families (`--etcd`), written after the router's own.
fn store_rows(v: &super::etcd::StoreView) -> [Scalar; 7] {
    let row = |name, kind, help, value| Scalar {
        name,
        kind,
        help,
        value,
    };
    #[rustfmt::skip]
    let rows = [
        row("cacheroute_plan_store_up", Gauge, "1 while etcd answers; 0: routing on the last plan (fail static).", V::from(v.up)),
        row("cacheroute_plan_store_leader", Gauge, "1 while this replica leads (merges the rates and writes the shared plan).", V::from(v.leader)),
        row("cacheroute_plan_generation", Gauge, "Generation of the shared plan in force (0: none yet).", V::N(v.generation)),
        row("cacheroute_plan_age_seconds", Gauge, "Seconds since the shared plan in force was installed (NaN: none yet).", V::X(v.age_s)),
        row("cacheroute_plan_store_refused_total", Counter, "Plans read from etcd and refused (not JSON, wrong schema, unknown destinations, oversized).", V::N(v.refused)),
        row("cacheroute_plan_store_errors_total", Counter, "etcd calls that failed.", V::N(v.errors)),
        row("cacheroute_plan_store_plans_written_total", Counter, "Plans this replica wrote as the leader.", V::N(v.written)),
    ];
    rows
}

#[cfg(test)]
mod tests {
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
            s.mark(d).unsolicited.store(k + 5, Relaxed);
            s.mark(d).unpooled_requests.store(k + 6, Relaxed);
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
}
