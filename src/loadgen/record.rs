//! What one replayed request became ([`ReplayRecord`]: the one `analysis::record::RequestRecord`
//! and what only the replayer knows), and the run's headline figures ([`ReplaySummary`]).

use std::collections::BTreeMap;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use crate::analysis::record::{RequestRecord, Status};
use crate::analysis::LatencyHist;
use crate::store::RequestRow;

/// One request of a replay: its [`RequestRecord`] (times in seconds from the replay's start on
/// one monotonic clock; latencies are measured from `scheduled_s`, open loop, never from
/// `sent_s`), and what only the replayer has: the key text, the destination header as
/// received, the inter-token gaps and the live sessions' bookkeeping. The record's status is
/// the live one (`Ok`, `Http`, `Timeout`, `Overflow`, `Connect`, `Failed`, `Abandoned`), its
/// `cached_tokens` is `None` when the server did not report it, and its destination is the
/// header's number ([`destination_index`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayRecord {
    /// `key` is `crate::key_hash` of [`Self::key`]; prompt tokens are the server's
    /// `usage.prompt_tokens`, else the trace's `input_length`; output tokens the server's
    /// `usage.completion_tokens`, else the content chunks counted.
    pub record: RequestRecord,
    /// Routing key, sent in the key header.
    pub key: String,
    /// The `x-cacheroute-destination` response header, when present (set it with
    /// [`Self::set_destination`], which keeps the record's number in step).
    pub destination_header: Option<String>,
    /// Largest gap between consecutive content chunks (stream only).
    pub max_itl_s: Option<f64>,
    /// Every gap between consecutive content chunks (stream only), on their way to the run's
    /// inter-token histogram; emptied when the record is collected, never written.
    pub gaps: Vec<f32>,
    /// What went wrong, for errors.
    pub error: Option<String>,
    /// Live sessions: the trace `session` this turn belongs to.
    pub session: Option<String>,
    /// Live sessions: the turn's position in its session (1-based, in the order sent).
    pub turn: Option<u32>,
    /// Live sessions: how much later than the trace's gap this turn left because the previous
    /// answer arrived after it (the think time was stretched).
    pub late_s: Option<f64>,
    /// The prompt text sent (completions; chat: the messages' contents joined), when the
    /// configuration keeps text (`ReplayConfig::keep_text`); never written.
    pub prompt: Option<String>,
    /// The answer's text as received, when kept (live sessions, `keep_text`); never written.
    pub answer: Option<String>,
}

/// The destination header as a number: its value when it is an integer, or its trailing
/// digits (`d3`, `replica-3` → 3); `None` when absent or without a number.
pub fn destination_index(header: Option<&str>) -> Option<i32> {
    let d = header?.trim();
    if let Ok(n) = d.parse::<i32>() {
        return Some(n);
    }
    let digits = d.len() - d.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    d[d.len() - digits..].parse().ok()
}

impl ReplayRecord {
    /// A request due at `scheduled_s`, not yet sent: status `Ok` until something fails.
    pub fn new(id: u64, key: &str, scheduled_s: f64, prompt_tokens: u32) -> Self {
        ReplayRecord {
            record: RequestRecord {
                id,
                key: crate::key_hash(key),
                destination: None,
                scheduled_s,
                sent_s: None,
                first_token_s: None,
                finish_s: None,
                prompt_tokens,
                output_tokens: 0,
                cached_tokens: None,
                preemptions: 0,
                retried: false,
                status: Status::Ok,
            },
            key: key.to_owned(),
            destination_header: None,
            max_itl_s: None,
            gaps: Vec::new(),
            error: None,
            session: None,
            turn: None,
            late_s: None,
            prompt: None,
            answer: None,
        }
    }

    /// The destination header as received, and the record's destination from it.
    pub fn set_destination(&mut self, header: Option<String>) {
        self.record.destination = destination_index(header.as_deref());
        self.destination_header = header;
    }

    /// Actual send − scheduled send (`None` when not sent).
    pub fn lag_s(&self) -> Option<f64> {
        self.record.sent_s.map(|s| s - self.record.scheduled_s)
    }
}

/// One line of a records file (`cacheroute replay --out`): the fields in the order they have
/// always been written, the record's flattened among the replayer's own.
impl Serialize for ReplayRecord {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = &self.record;
        let optional = [
            self.error.is_some(),
            self.session.is_some(),
            self.turn.is_some(),
            self.late_s.is_some(),
        ];
        let n = 13 + optional.iter().filter(|x| **x).count();
        let mut st = s.serialize_struct("ReplayRecord", n)?;
        st.serialize_field("id", &r.id)?;
        st.serialize_field("key", &self.key)?;
        st.serialize_field("key_hash", &r.key)?;
        st.serialize_field("scheduled_s", &r.scheduled_s)?;
        st.serialize_field("sent_s", &r.sent_s)?;
        st.serialize_field("first_token_s", &r.first_token_s)?;
        st.serialize_field("finish_s", &r.finish_s)?;
        st.serialize_field("prompt_tokens", &r.prompt_tokens)?;
        st.serialize_field("output_tokens", &r.output_tokens)?;
        st.serialize_field("cached_tokens", &r.cached_tokens)?;
        st.serialize_field("destination", &self.destination_header)?;
        st.serialize_field("status", &r.status)?;
        st.serialize_field("max_itl_s", &self.max_itl_s)?;
        if let Some(e) = &self.error {
            st.serialize_field("error", e)?;
        }
        if let Some(v) = &self.session {
            st.serialize_field("session", v)?;
        }
        if let Some(v) = &self.turn {
            st.serialize_field("turn", v)?;
        }
        if let Some(v) = &self.late_s {
            st.serialize_field("late_s", v)?;
        }
        st.end()
    }
}

impl From<&ReplayRecord> for RequestRow {
    fn from(r: &ReplayRecord) -> Self {
        RequestRow {
            record: r.record,
            key: Some(r.key.clone()),
        }
    }
}

/// Headline figures of a replay. Latency quantiles are over `ok` requests, from the scheduled
/// time; NaN (`null` in JSON) when there are none, and the stream-only figures (TTFT, TPOT,
/// inter-token) are NaN without streaming: a non-streamed answer arrives whole, so its first
/// token is its last.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplaySummary {
    /// Requests in the schedule.
    pub requests: u64,
    /// Requests that left (everything but overflow).
    pub sent: u64,
    pub ok: u64,
    /// Error count by status label.
    pub errors: BTreeMap<String, u64>,
    /// The rate window: the configured duration, else the schedule's span.
    pub duration_s: f64,
    /// Requests scheduled in `[0, duration_s)` / `duration_s`.
    pub offered_qps: f64,
    /// Requests scheduled in the window that actually left before `duration_s` / `duration_s`.
    pub achieved_qps: f64,
    /// Schedule lag (actual send − scheduled) over sent requests.
    pub lag_p50_s: f64,
    pub lag_p99_s: f64,
    pub lag_max_s: f64,
    /// Whether responses were streamed (TTFT, TPOT and inter-token figures need it).
    pub stream: bool,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub e2e_p50_s: f64,
    pub e2e_p99_s: f64,
    /// Time per output token after the first, per request: (end − first token) / (output
    /// tokens − 1), over requests with at least two (stream only).
    pub tpot_p50_s: f64,
    pub tpot_p99_s: f64,
    /// Every gap between consecutive content chunks of every request (stream only).
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    /// p99 over requests of their largest inter-token gap (stream only; NaN otherwise).
    pub max_itl_p99_s: f64,
    /// Prompt and output tokens of `ok` requests (the server's `usage`, else the trace's
    /// input length and the chunks counted).
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Output and prompt tokens of `ok` requests per second of wall time.
    pub output_tokens_per_s: f64,
    pub prompt_tokens_per_s: f64,
    /// Served KV hit: Σ `usage.prompt_tokens_details.cached_tokens` / Σ prompt tokens over the
    /// `ok` requests whose answer reported it (NaN when none did).
    pub served_kv_hit: f64,
    /// `ok` requests whose answer reported cached tokens.
    pub kv_hit_reported: u64,
    /// Wall time from the start until the last response ended.
    pub wall_s: f64,
    /// Live sessions (`null` otherwise): turns sent, late and abandoned.
    pub sessions: Option<SessionSummary>,
}

/// What live sessions did in a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionSummary {
    /// Sessions in the schedule (requests with a trace `session`).
    pub sessions: u64,
    /// Their turns, and how many of those left.
    pub turns: u64,
    pub turns_sent: u64,
    /// Turns that left after their trace gap because the previous answer came after it.
    pub turns_late: u64,
    /// p99 of how late those were (NaN when none).
    pub late_p99_s: f64,
    /// Sessions cut short by a failed turn, and the turns of theirs not sent.
    pub sessions_abandoned: u64,
    pub turns_abandoned: u64,
    /// Served KV hit of the `ok` turns after the first (the ones that carry an earlier
    /// answer), over those that reported cached tokens (NaN when none).
    pub later_turns_kv_hit: f64,
}

impl SessionSummary {
    /// The figures of the session turns among `records` (`None` when there are none).
    pub fn of(records: &[ReplayRecord]) -> Option<SessionSummary> {
        let mut names = std::collections::HashSet::new();
        let mut abandoned = std::collections::HashSet::new();
        let mut late = LatencyHist::new();
        let (mut turns, mut sent, mut n_late, mut n_abandoned, mut prompt, mut cached) =
            (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        for r in records {
            let Some(s) = &r.session else { continue };
            names.insert(s.as_str());
            turns += 1;
            sent += r.record.sent_s.is_some() as u64;
            if let (Some(l), Some(_)) = (r.late_s, r.record.sent_s) {
                n_late += 1;
                late.record_s(l);
            }
            if r.record.status == Status::Abandoned {
                n_abandoned += 1;
                abandoned.insert(s.as_str());
            }
            if let (true, Some(c), true) = (
                r.record.status.is_ok(),
                r.record.cached_tokens,
                r.turn > Some(1),
            ) {
                prompt += r.record.prompt_tokens as u64;
                cached += c as u64;
            }
        }
        (turns > 0).then(|| SessionSummary {
            sessions: names.len() as u64,
            turns,
            turns_sent: sent,
            turns_late: n_late,
            late_p99_s: late.quantile_s(0.99),
            sessions_abandoned: abandoned.len() as u64,
            turns_abandoned: n_abandoned,
            later_turns_kv_hit: if prompt > 0 {
                cached as f64 / prompt as f64
            } else {
                f64::NAN
            },
        })
    }
}

impl ReplaySummary {
    /// Figures of `records` over the window `[0, duration_s)` (`None`: the schedule's span,
    /// extended by one mean gap so that n evenly spaced requests at rate r give exactly r).
    /// `itl`: the run's inter-token gaps when it streamed (`None`: not streamed).
    pub fn of(
        records: &[ReplayRecord],
        duration_s: Option<f64>,
        wall_s: f64,
        itl: Option<&LatencyHist>,
    ) -> Self {
        let stream = itl.is_some();
        let n = records.len();
        let last = records
            .iter()
            .map(|r| r.record.scheduled_s)
            .fold(0.0, f64::max);
        let dur = match duration_s {
            Some(d) if d > 0.0 => d,
            _ if n > 1 && last > 0.0 => last * n as f64 / (n - 1) as f64,
            _ => last.max(1e-9),
        };
        let (mut lag, mut ttft, mut e2e, mut max_itl, mut tpot) = (
            LatencyHist::new(),
            LatencyHist::new(),
            LatencyHist::new(),
            LatencyHist::new(),
            LatencyHist::new(),
        );
        let (mut prompt, mut output, mut hit_prompt, mut hit_cached, mut reported) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let (mut sent, mut ok, mut offered, mut achieved) = (0u64, 0u64, 0u64, 0u64);
        let mut lag_max = 0.0f64;
        let mut errors = BTreeMap::new();
        for r in records {
            let in_window = r.record.scheduled_s < dur;
            offered += in_window as u64;
            if let Some(s) = r.record.sent_s {
                sent += 1;
                achieved += (in_window && s < dur) as u64;
                let l = (s - r.record.scheduled_s).max(0.0);
                lag.record_s(l);
                lag_max = lag_max.max(l);
            }
            if r.record.status.is_ok() {
                ok += 1;
                prompt += r.record.prompt_tokens as u64;
                output += r.record.output_tokens as u64;
                if let Some(c) = r.record.cached_tokens {
                    reported += 1;
                    hit_prompt += r.record.prompt_tokens as u64;
                    hit_cached += c as u64;
                }
                if let (true, Some(t)) = (stream, r.record.first_token_s) {
                    ttft.record_s(t - r.record.scheduled_s);
                    if let (Some(f), true) = (r.record.finish_s, r.record.output_tokens > 1) {
                        tpot.record_s((f - t) / (r.record.output_tokens - 1) as f64);
                    }
                }
                if let Some(t) = r.record.finish_s {
                    e2e.record_s(t - r.record.scheduled_s);
                }
                if let Some(g) = r.max_itl_s {
                    max_itl.record_s(g);
                }
            } else {
                *errors.entry(r.record.status.label()).or_insert(0) += 1;
            }
        }
        ReplaySummary {
            requests: n as u64,
            sent,
            ok,
            errors,
            duration_s: dur,
            offered_qps: offered as f64 / dur,
            achieved_qps: achieved as f64 / dur,
            lag_p50_s: lag.quantile_s(0.50),
            lag_p99_s: lag.quantile_s(0.99),
            lag_max_s: if sent > 0 { lag_max } else { f64::NAN },
            stream,
            ttft_p50_s: ttft.quantile_s(0.50),
            ttft_p99_s: ttft.quantile_s(0.99),
            e2e_p50_s: e2e.quantile_s(0.50),
            e2e_p99_s: e2e.quantile_s(0.99),
            tpot_p50_s: tpot.quantile_s(0.50),
            tpot_p99_s: tpot.quantile_s(0.99),
            itl_p50_s: itl.map_or(f64::NAN, |h| h.quantile_s(0.50)),
            itl_p99_s: itl.map_or(f64::NAN, |h| h.quantile_s(0.99)),
            max_itl_p99_s: max_itl.quantile_s(0.99),
            prompt_tokens: prompt,
            output_tokens: output,
            output_tokens_per_s: if wall_s > 0.0 {
                output as f64 / wall_s
            } else {
                f64::NAN
            },
            prompt_tokens_per_s: if wall_s > 0.0 {
                prompt as f64 / wall_s
            } else {
                f64::NAN
            },
            served_kv_hit: if hit_prompt > 0 {
                hit_cached as f64 / hit_prompt as f64
            } else {
                f64::NAN
            },
            kv_hit_reported: reported,
            wall_s,
            sessions: SessionSummary::of(records),
        }
    }

    /// Total errors of every kind.
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: u64, sched: f64, sent: Option<f64>, status: Status) -> ReplayRecord {
        let mut r = ReplayRecord::new(id, "k", sched, 10);
        r.record.sent_s = sent;
        r.record.first_token_s = sent.map(|s| s + 0.01);
        r.record.finish_s = Some(sched + 0.1);
        r.record.output_tokens = 2;
        r.record.cached_tokens = Some(4);
        r.record.status = status;
        r.set_destination(Some("replica-3".into()));
        r
    }

    #[test]
    fn summary_counts_rates_lag_and_errors() {
        let rs = vec![
            rec(0, 0.0, Some(0.001), Status::Ok),
            rec(1, 0.25, Some(0.252), Status::Ok),
            rec(2, 0.5, None, Status::Overflow),
            rec(3, 0.75, Some(0.75), Status::Http(503)),
        ];
        let s = ReplaySummary::of(&rs, Some(1.0), 1.2, None);
        assert_eq!((s.requests, s.sent, s.ok), (4, 3, 2));
        // Served KV hit over ok requests: 2 × 4 cached of 2 × 10 prompt tokens.
        assert!((s.served_kv_hit - 0.4).abs() < 1e-12);
        assert_eq!((s.kv_hit_reported, s.output_tokens), (2, 4));
        assert!((s.output_tokens_per_s - 4.0 / 1.2).abs() < 1e-9);
        // Not streamed: no TTFT (the first token is the whole answer), TPOT or ITL.
        assert!(s.ttft_p50_s.is_nan() && s.tpot_p50_s.is_nan() && s.itl_p50_s.is_nan());
        assert!(s.e2e_p50_s > 0.0);
        // Streamed: TTFT and TPOT from the records, ITL from the run's histogram.
        let mut itl = LatencyHist::new();
        itl.record_s(0.02);
        let s = ReplaySummary::of(&rs, Some(1.0), 1.2, Some(&itl));
        assert!((s.ttft_p50_s - 0.011).abs() < 1e-3, "{}", s.ttft_p50_s);
        // (finish − first token) / (2 − 1): 0.1 − 0.011.
        assert!((s.tpot_p50_s - 0.089).abs() < 1e-3, "{}", s.tpot_p50_s);
        assert!((s.itl_p50_s - 0.02).abs() < 1e-3);
        let mut none = rs.clone();
        for r in &mut none {
            r.record.cached_tokens = None;
        }
        assert!(ReplaySummary::of(&none, Some(1.0), 1.2, None)
            .served_kv_hit
            .is_nan());
        assert_eq!(s.offered_qps, 4.0);
        assert_eq!(s.achieved_qps, 3.0);
        assert_eq!(s.errors.get("overflow"), Some(&1));
        assert_eq!(s.errors.get("http_503"), Some(&1));
        assert_eq!(s.error_count(), 2);
        assert!((s.lag_max_s - 0.002).abs() < 1e-9);
        // No duration: the span extended by one mean gap.
        let s = ReplaySummary::of(&rs, None, 1.2, None);
        assert!((s.duration_s - 1.0).abs() < 1e-9);
    }

    #[test]
    fn conversions_keep_the_fields() {
        let mut r = rec(7, 1.0, Some(1.002), Status::Ok);
        assert_eq!(r.record.destination, Some(3));
        let row = RequestRow::from(&r);
        assert_eq!(row.record.destination, Some(3));
        assert_eq!(row.record.status.label(), "ok");
        assert_eq!(row.record.cached_tokens, Some(4));
        assert_eq!(row.key.as_deref(), Some("k"));
        assert!((r.record.schedule_lag_s().unwrap() - 0.002).abs() < 1e-9);
        r.record.status = Status::Overflow;
        r.record.sent_s = None;
        r.record.finish_s = Some(1.0001);
        r.set_destination(Some("none".into()));
        assert!(!r.record.status.is_ok() && r.record.destination.is_none());
        assert!(r.record.schedule_lag_s().unwrap() < 0.001);
        assert_eq!(RequestRow::from(&r).record.status.label(), "overflow");
    }

    #[test]
    fn a_records_line_keeps_its_fields_and_their_order() {
        let mut r = rec(7, 1.0, Some(1.5), Status::Http(503));
        r.error = Some("busy".into());
        r.turn = Some(2);
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            format!(
                "{{\"id\":7,\"key\":\"k\",\"key_hash\":{},\"scheduled_s\":1.0,\"sent_s\":1.5,\
                 \"first_token_s\":1.51,\"finish_s\":1.1,\"prompt_tokens\":10,\
                 \"output_tokens\":2,\"cached_tokens\":4,\"destination\":\"replica-3\",\
                 \"status\":\"http_503\",\"max_itl_s\":null,\"error\":\"busy\",\"turn\":2}}",
                crate::key_hash("k")
            )
        );
    }
}
