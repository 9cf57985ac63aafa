//! What one replayed request became ([`ReplayRecord`]), the run's headline figures
//! ([`ReplaySummary`]), and the conversions into the analysis and store types.

use std::collections::{BTreeMap, HashMap};

use serde::{Serialize, Serializer};

use crate::analysis::step::RequestObs;
use crate::analysis::LatencyHist;
use crate::store::RequestRow;

/// How a replayed request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayStatus {
    /// A 2xx response, read to its end.
    Ok,
    /// The server answered with this non-2xx HTTP status.
    Http(u16),
    /// No complete answer within the request timeout (counted from the actual send).
    Timeout,
    /// Not sent: the in-flight cap was reached at its scheduled time. Counted as an error,
    /// never delayed.
    Overflow,
    /// The connection could not be made (refused, unreachable, connect timeout).
    Connect,
    /// Anything else: a transport error mid-response or a body that is not the expected JSON.
    Failed,
    /// Not sent: an earlier turn of its session failed (live sessions), so there was no answer
    /// to continue from. Counted as an error.
    Abandoned,
}

impl ReplayStatus {
    /// The stored label: `ok`, `http_<code>`, `timeout`, `overflow`, `connect`, `failed`,
    /// `abandoned`.
    pub fn label(&self) -> String {
        match self {
            ReplayStatus::Ok => "ok".into(),
            ReplayStatus::Http(c) => format!("http_{c}"),
            ReplayStatus::Timeout => "timeout".into(),
            ReplayStatus::Overflow => "overflow".into(),
            ReplayStatus::Connect => "connect".into(),
            ReplayStatus::Failed => "failed".into(),
            ReplayStatus::Abandoned => "abandoned".into(),
        }
    }

    pub fn is_ok(&self) -> bool {
        *self == ReplayStatus::Ok
    }
}

impl Serialize for ReplayStatus {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

/// One request of a replay. Times are seconds from the replay's start on one monotonic clock;
/// latencies are measured from `scheduled_s` (open loop), never from `sent_s`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayRecord {
    /// Position in the schedule (0-based).
    pub id: u64,
    /// Routing key, sent in the key header.
    pub key: String,
    /// `crate::key_hash(key)`.
    pub key_hash: u64,
    /// When the request was due.
    pub scheduled_s: f64,
    /// When it actually left (`None`: never sent, e.g. overflow).
    pub sent_s: Option<f64>,
    /// First content chunk (stream), or the full response (non-stream).
    pub first_token_s: Option<f64>,
    /// End of the response, or when the failure was seen (for overflow: when it was refused).
    pub finish_s: Option<f64>,
    /// Prompt tokens: the server's `usage.prompt_tokens`, else the trace's `input_length`.
    pub prompt_tokens: u32,
    /// Output tokens: the server's `usage.completion_tokens`, else the content chunks counted.
    pub output_tokens: u32,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reports it.
    pub cached_tokens: Option<u32>,
    /// The `x-cacheroute-destination` response header, when present.
    pub destination: Option<String>,
    pub status: ReplayStatus,
    /// Largest gap between consecutive content chunks (stream only).
    pub max_itl_s: Option<f64>,
    /// Every gap between consecutive content chunks (stream only), on their way to the run's
    /// inter-token histogram; emptied when the record is collected, never written.
    #[serde(skip)]
    pub gaps: Vec<f32>,
    /// What went wrong, for errors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Live sessions: the trace `session` this turn belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Live sessions: the turn's position in its session (1-based, in the order sent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// Live sessions: how much later than the trace's gap this turn left because the previous
    /// answer arrived after it (the think time was stretched).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub late_s: Option<f64>,
    /// The prompt text sent (completions; chat: the messages' contents joined), when the
    /// configuration keeps text (`ReplayConfig::keep_text`); never written.
    #[serde(skip)]
    pub prompt: Option<String>,
    /// The answer's text as received, when kept (live sessions, `keep_text`); never written.
    #[serde(skip)]
    pub answer: Option<String>,
}

impl ReplayRecord {
    /// Actual send − scheduled send (`None` when not sent).
    pub fn lag_s(&self) -> Option<f64> {
        self.sent_s.map(|s| s - self.scheduled_s)
    }

    /// The destination as a number: the header's value when it is an integer, or its trailing
    /// digits (`d3`, `replica-3` → 3); `None` when absent or without a number.
    pub fn destination_index(&self) -> Option<i32> {
        let d = self.destination.as_deref()?.trim();
        if let Ok(n) = d.parse::<i32>() {
            return Some(n);
        }
        let digits = d.len() - d.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        d[d.len() - digits..].parse().ok()
    }

    /// As an analysis observation. `key_rates` maps key hash → requests/s (missing: NaN, i.e.
    /// the in-window rate). An overflowed request carries the lag of the moment it was refused
    /// (it was dispatched on time and is counted as an error, not as a missing send).
    pub fn obs(&self, key_rates: &HashMap<u64, f64>) -> RequestObs {
        let lag = self
            .sent_s
            .or(if self.status == ReplayStatus::Overflow {
                self.finish_s
            } else {
                None
            })
            .map(|t| t - self.scheduled_s);
        RequestObs {
            key: self.key_hash,
            key_rate: key_rates.get(&self.key_hash).copied().unwrap_or(f64::NAN),
            destination: self.destination_index().unwrap_or(-1),
            scheduled_s: self.scheduled_s,
            first_token_s: self.first_token_s.unwrap_or(f64::NAN),
            finish_s: self.finish_s.unwrap_or(f64::NAN),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens.unwrap_or(0),
            ok: self.status.is_ok(),
            lag_s: lag,
            preemptions: 0,
        }
    }
}

/// Observations from replay records (the live counterpart of `analysis::step::obs_from_sim`).
pub fn obs_from_replay<'a>(
    records: &'a [ReplayRecord],
    key_rates: &'a HashMap<u64, f64>,
) -> impl Iterator<Item = RequestObs> + 'a {
    records.iter().map(move |r| r.obs(key_rates))
}

impl From<&ReplayRecord> for RequestRow {
    fn from(r: &ReplayRecord) -> Self {
        RequestRow {
            id: r.id,
            key_hash: r.key_hash,
            key: Some(r.key.clone()),
            destination: r.destination_index(),
            scheduled_s: r.scheduled_s,
            sent_s: r.sent_s,
            first_token_s: r.first_token_s,
            finish_s: r.finish_s,
            prompt_tokens: r.prompt_tokens,
            output_tokens: r.output_tokens,
            cached_tokens: r.cached_tokens.unwrap_or(0),
            preemptions: 0,
            retried: false,
            status: r.status.label(),
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
            sent += r.sent_s.is_some() as u64;
            if let (Some(l), Some(_)) = (r.late_s, r.sent_s) {
                n_late += 1;
                late.record_s(l);
            }
            if r.status == ReplayStatus::Abandoned {
                n_abandoned += 1;
                abandoned.insert(s.as_str());
            }
            if let (true, Some(c), true) = (r.status.is_ok(), r.cached_tokens, r.turn > Some(1)) {
                prompt += r.prompt_tokens as u64;
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
        let last = records.iter().map(|r| r.scheduled_s).fold(0.0, f64::max);
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
            let in_window = r.scheduled_s < dur;
            offered += in_window as u64;
            if let Some(s) = r.sent_s {
                sent += 1;
                achieved += (in_window && s < dur) as u64;
                let l = (s - r.scheduled_s).max(0.0);
                lag.record_s(l);
                lag_max = lag_max.max(l);
            }
            if r.status.is_ok() {
                ok += 1;
                prompt += r.prompt_tokens as u64;
                output += r.output_tokens as u64;
                if let Some(c) = r.cached_tokens {
                    reported += 1;
                    hit_prompt += r.prompt_tokens as u64;
                    hit_cached += c as u64;
                }
                if let (true, Some(t)) = (stream, r.first_token_s) {
                    ttft.record_s(t - r.scheduled_s);
                    if let (Some(f), true) = (r.finish_s, r.output_tokens > 1) {
                        tpot.record_s((f - t) / (r.output_tokens - 1) as f64);
                    }
                }
                if let Some(t) = r.finish_s {
                    e2e.record_s(t - r.scheduled_s);
                }
                if let Some(g) = r.max_itl_s {
                    max_itl.record_s(g);
                }
            } else {
                *errors.entry(r.status.label()).or_insert(0) += 1;
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

    fn rec(id: u64, sched: f64, sent: Option<f64>, status: ReplayStatus) -> ReplayRecord {
        ReplayRecord {
            id,
            key: "k".into(),
            key_hash: crate::key_hash("k"),
            scheduled_s: sched,
            sent_s: sent,
            first_token_s: sent.map(|s| s + 0.01),
            finish_s: Some(sched + 0.1),
            prompt_tokens: 10,
            output_tokens: 2,
            cached_tokens: Some(4),
            destination: Some("replica-3".into()),
            status,
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

    #[test]
    fn summary_counts_rates_lag_and_errors() {
        let rs = vec![
            rec(0, 0.0, Some(0.001), ReplayStatus::Ok),
            rec(1, 0.25, Some(0.252), ReplayStatus::Ok),
            rec(2, 0.5, None, ReplayStatus::Overflow),
            rec(3, 0.75, Some(0.75), ReplayStatus::Http(503)),
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
            r.cached_tokens = None;
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
        let mut r = rec(7, 1.0, Some(1.002), ReplayStatus::Ok);
        assert_eq!(r.destination_index(), Some(3));
        let row = RequestRow::from(&r);
        assert_eq!(row.destination, Some(3));
        assert_eq!(row.status, "ok");
        assert_eq!(row.cached_tokens, 4);
        let rates = HashMap::from([(r.key_hash, 2.5)]);
        let o = r.obs(&rates);
        assert_eq!(o.key_rate, 2.5);
        assert!((o.lag_s.unwrap() - 0.002).abs() < 1e-9);
        r.status = ReplayStatus::Overflow;
        r.sent_s = None;
        r.finish_s = Some(1.0001);
        r.destination = Some("none".into());
        let o = r.obs(&HashMap::new());
        assert!(!o.ok && o.key_rate.is_nan() && o.destination == -1);
        assert!(o.lag_s.unwrap() < 0.001);
        assert_eq!(RequestRow::from(&r).status, "overflow");
    }
}
