//! What every backend produces and every metric reads: the record of one request (timings,
//! tokens, destination, status) and of one installed plan. Below the simulator, the live
//! layers, the store and the analysis alike, so none of them imports another for its types.
//! These are the one shape of each idea: the simulator fills [`RequestRecord`] and
//! [`PlanRecord`], the live replayer wraps the record with what only it knows, the store
//! writes and reads them back, and the step metrics and the report read them. `None` says
//! "did not happen / not known"; no NaN or -1 stands for it. Pure data.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Outcome of one request, from any backend. Stored (and serialized) as its [`label`](Self::label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Completed: the simulator finished it, or a 2xx response was read to its end.
    Ok,
    /// No destination was up (simulator).
    NoDestination,
    /// Simulator: its destination failed after the first token (or on the retry). Live: a
    /// transport error mid-response or a body that is not the expected JSON.
    Failed,
    /// The engine refused it (larger than the KV cache; simulator).
    Rejected,
    /// Still running at the horizon (simulator).
    Unfinished,
    /// Live: the server answered with this non-2xx HTTP status.
    Http(u16),
    /// Live: no complete answer within the request timeout (counted from the actual send).
    Timeout,
    /// Live, not sent: the in-flight cap was reached at its scheduled time. Counted as an
    /// error, never delayed.
    Overflow,
    /// Live: the connection could not be made (refused, unreachable, connect timeout).
    Connect,
    /// Live, not sent: an earlier turn of its session failed, so there was no answer to
    /// continue from. Counted as an error.
    Abandoned,
}

/// A stored status label that names no [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown request status `{0}` (expected ok, no_destination, failed, rejected, unfinished, \
     http_<code>, timeout, overflow, connect or abandoned)"
)]
pub struct UnknownStatus(pub String);

impl Status {
    /// The stored label: `ok`, `no_destination`, `failed`, `rejected`, `unfinished`,
    /// `http_<code>`, `timeout`, `overflow`, `connect`, `abandoned`.
    pub fn label(&self) -> String {
        match self {
            Status::Http(c) => format!("http_{c}"),
            s => s.unit_label().expect("a unit status").to_owned(),
        }
    }

    fn unit_label(&self) -> Option<&'static str> {
        Some(match self {
            Status::Ok => "ok",
            Status::NoDestination => "no_destination",
            Status::Failed => "failed",
            Status::Rejected => "rejected",
            Status::Unfinished => "unfinished",
            Status::Timeout => "timeout",
            Status::Overflow => "overflow",
            Status::Connect => "connect",
            Status::Abandoned => "abandoned",
            Status::Http(_) => return None,
        })
    }

    /// The status a stored label names (the inverse of [`label`](Self::label)).
    pub fn parse(label: &str) -> Result<Status, UnknownStatus> {
        const UNIT: [Status; 9] = [
            Status::Ok,
            Status::NoDestination,
            Status::Failed,
            Status::Rejected,
            Status::Unfinished,
            Status::Timeout,
            Status::Overflow,
            Status::Connect,
            Status::Abandoned,
        ];
        if let Some(s) = UNIT.into_iter().find(|s| s.unit_label() == Some(label)) {
            return Ok(s);
        }
        label
            .strip_prefix("http_")
            .filter(|c| c.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|c| c.parse().ok())
            .map(Status::Http)
            .ok_or_else(|| UnknownStatus(label.to_owned()))
    }

    pub fn is_ok(&self) -> bool {
        *self == Status::Ok
    }
}

impl Serialize for Status {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

impl<'de> Deserialize<'de> for Status {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let label = String::deserialize(d)?;
        Status::parse(&label).map_err(serde::de::Error::custom)
    }
}

/// One request, from any backend. Times are seconds from the run's start on one clock
/// (virtual seconds from the trace start in simulation); latencies are measured from
/// `scheduled_s` (open loop), never from `sent_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the schedule (0-based).
    pub id: u64,
    /// `crate::key_hash` of the routing key.
    pub key: u64,
    /// Destination that served it (the last one tried); `None` when none (or, live, when the
    /// answer did not name one).
    pub destination: Option<i32>,
    /// When the request was due.
    pub scheduled_s: f64,
    /// When it actually left (`None`: never sent, e.g. overflow). The simulator sends at the
    /// scheduled time.
    pub sent_s: Option<f64>,
    /// First token: the first content chunk (stream), or the full response (non-stream).
    pub first_token_s: Option<f64>,
    /// End of the response, or when the failure was seen (for overflow: when it was refused).
    pub finish_s: Option<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// Prompt tokens served from the KV cache; `None` when the server did not report it.
    pub cached_tokens: Option<u32>,
    pub preemptions: u32,
    /// Retried on another destination (simulator).
    pub retried: bool,
    pub status: Status,
}

impl RequestRecord {
    /// First token − scheduled (NaN without a first token).
    pub fn ttft_s(&self) -> f64 {
        self.first_token_s
            .map_or(f64::NAN, |t| t - self.scheduled_s)
    }

    /// Finish − scheduled (NaN without a finish).
    pub fn e2e_s(&self) -> f64 {
        self.finish_s.map_or(f64::NAN, |t| t - self.scheduled_s)
    }

    /// Actual send − scheduled send: the schedule lag the step metrics count. An overflowed
    /// request carries the lag of the moment it was refused (it was dispatched on time and is
    /// counted as an error, not as a missing send); `None` for one never sent otherwise.
    pub fn schedule_lag_s(&self) -> Option<f64> {
        self.sent_s
            .or(if self.status == Status::Overflow {
                self.finish_s
            } else {
                None
            })
            .map(|t| t - self.scheduled_s)
    }

    /// The same record with every time passed through `f` (a live step's wall seconds back in
    /// the model's seconds, by the step's time scale).
    pub fn map_times(mut self, f: impl Fn(f64) -> f64) -> Self {
        self.scheduled_s = f(self.scheduled_s);
        for t in [
            &mut self.sent_s,
            &mut self.first_token_s,
            &mut self.finish_s,
        ] {
            *t = t.map(&f);
        }
        self
    }
}

/// CacheRoute's settings one plan was built with, as the control loop resolved them
/// (configured, else tuned, else its defaults): the one record of them that the plan record,
/// the router's admin API and state file, and the plan shared through etcd carry.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Resolved {
    pub q_cap: f64,
    pub warm_slots: u64,
    pub bounded_sets: bool,
    /// How requests are dispatched (older records without it read as [`Dispatch::PLANNED`]).
    #[serde(default)]
    pub dispatch: Dispatch,
}

/// Where CacheRoute sends the keys without a plan entry (`policy::cacheroute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ColdTail {
    /// Power-of-two-choices on outstanding requests (the paper's Algorithm 1).
    P2c,
    /// Consistent hashing with bounded loads (ε = `cold_tail_epsilon`, 160 virtual nodes).
    Chwbl,
    /// Prefix-aware: Preble's E2 scheduling (`policy::preble`, parameters in `prefix`) over a
    /// prefix tree of every request's blocks, the planned keys' included: a request whose
    /// matched prefix is more than half its prompt goes to the lightest holder of its deepest
    /// matched block, any other to the destination with the least windowed prefill-and-decode
    /// cost.
    Prefix,
}

/// What "least loaded" means when CacheRoute picks among destinations (a key's planned set,
/// and the bound of a CHWBL cold tail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadSignal {
    /// Outstanding requests (the paper's choice).
    Outstanding,
    /// Prompt tokens sent whose first token has not come back (queued prefill work; ties by
    /// outstanding requests): a long prompt counts for what it costs.
    Prefill,
    /// The request's predicted time to first token on the destination, from the engine
    /// model's constants: its queued prefill and this prompt over the replica's prefill rate
    /// as slowed by the decodes it runs, plus the wait for a batch slot when every slot is
    /// taken (`policy::cacheroute::CostModel`); in tokens an idle replica prefills in that
    /// time, so that the bound and the cache credit read as with `prefill`.
    Cost,
}

/// The dispatch CacheRoute follows: whether planned keys go to their planned sets, where the
/// rest go, and what "least loaded" means. The self-calibration chooses it where the
/// configuration leaves it open (`sim::tune`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Dispatch {
    /// Follow the plan (`false`: every request goes the cold tail's way).
    pub plan: bool,
    pub cold_tail: ColdTail,
    pub load: LoadSignal,
}

impl Dispatch {
    /// The product's dispatch before self-calibration chose it: the plan, a CHWBL tail, the
    /// queued-prefill signal.
    pub const PLANNED: Dispatch = Dispatch {
        plan: true,
        cold_tail: ColdTail::Chwbl,
        load: LoadSignal::Prefill,
    };
}

impl Dispatch {
    /// No plan: every request to the prefix-aware tail (Preble's rule).
    pub const REACTIVE: Dispatch = Dispatch {
        plan: false,
        cold_tail: ColdTail::Prefix,
        load: LoadSignal::Prefill,
    };
}

impl Dispatch {
    /// The same dispatch under another load signal.
    pub fn with_load(self, load: LoadSignal) -> Dispatch {
        Dispatch { load, ..self }
    }
}

impl Default for Dispatch {
    fn default() -> Self {
        Dispatch::PLANNED
    }
}

impl ColdTail {
    pub fn name(self) -> &'static str {
        match self {
            ColdTail::P2c => "p2c",
            ColdTail::Chwbl => "chwbl",
            ColdTail::Prefix => "prefix",
        }
    }
}

impl LoadSignal {
    pub fn name(self) -> &'static str {
        match self {
            LoadSignal::Outstanding => "outstanding",
            LoadSignal::Prefill => "prefill",
            LoadSignal::Cost => "cost",
        }
    }
}

impl std::fmt::Display for Dispatch {
    /// `plan+chwbl+prefill`, `reactive+prefix+prefill`: the form the store and reports use.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}+{}+{}",
            if self.plan { "plan" } else { "reactive" },
            self.cold_tail.name(),
            self.load.name()
        )
    }
}

impl std::str::FromStr for Dispatch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("`{s}` is not a dispatch: write PLAN+TAIL+LOAD, e.g. plan+chwbl+prefill (PLAN: plan or reactive; TAIL: p2c, chwbl or prefix; LOAD: outstanding, prefill or cost)")
        };
        let mut parts = s.trim().split('+');
        let (Some(p), Some(t), Some(l), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let plan = match p {
            "plan" => true,
            "reactive" => false,
            _ => return Err(bad()),
        };
        let cold_tail = [ColdTail::P2c, ColdTail::Chwbl, ColdTail::Prefix]
            .into_iter()
            .find(|c| c.name() == t)
            .ok_or_else(bad)?;
        let load = [
            LoadSignal::Outstanding,
            LoadSignal::Prefill,
            LoadSignal::Cost,
        ]
        .into_iter()
        .find(|c| c.name() == l)
        .ok_or_else(bad)?;
        Ok(Dispatch {
            plan,
            cold_tail,
            load,
        })
    }
}

/// One installed plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRecord {
    pub at_s: f64,
    pub admitted: usize,
    pub admitted_share: f64,
    pub imbalance: f64,
    /// Against the plan it replaced.
    pub churn: f64,
    pub repair: bool,
    /// Plan build time; `None` when not measured (the simulator does not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_ms: Option<f64>,
    /// The q_cap and warm slots W the plan was built with; `None` when not known (a plan read
    /// from a file, or a stored row without them).
    #[serde(default)]
    pub q_cap: Option<f64>,
    #[serde(default)]
    pub warm_slots: Option<u64>,
    /// Whether its sets were bounded (`None`: not known, as for q_cap and W).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bounded_sets: Option<bool>,
    /// The dispatch in force with it (`None`: not known, as for q_cap and W).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<Dispatch>,
    /// Σ k_b over admitted keys: the replicas the plan gives its keys (`None`: not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u64>,
    /// Set when the control loop tuned q_cap / W for this plan: what it compared and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tuning: Option<String>,
}

impl PlanRecord {
    /// The settings the plan was built with, where the record knows them all.
    pub fn settings(&self) -> Option<Resolved> {
        Some(Resolved {
            q_cap: self.q_cap?,
            warm_slots: self.warm_slots?,
            bounded_sets: self.bounded_sets?,
            dispatch: self.dispatch.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_label_reads_back_and_unknown_ones_are_refused() {
        for s in [
            Status::Ok,
            Status::NoDestination,
            Status::Failed,
            Status::Rejected,
            Status::Unfinished,
            Status::Http(503),
            Status::Timeout,
            Status::Overflow,
            Status::Connect,
            Status::Abandoned,
        ] {
            assert_eq!(Status::parse(&s.label()), Ok(s));
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.label()));
            assert_eq!(serde_json::from_str::<Status>(&json).unwrap(), s);
        }
        for bad in [
            "",
            "OK",
            "http_",
            "http_x1",
            "http_+5",
            "http_99999",
            "lost",
        ] {
            let e = Status::parse(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("`{bad}`")), "{e}");
        }
    }

    #[test]
    fn lag_counts_an_overflow_at_its_refusal() {
        let mut r = RequestRecord {
            id: 0,
            key: 1,
            destination: None,
            scheduled_s: 1.0,
            sent_s: None,
            first_token_s: None,
            finish_s: Some(1.25),
            prompt_tokens: 1,
            output_tokens: 1,
            cached_tokens: None,
            preemptions: 0,
            retried: false,
            status: Status::Failed,
        };
        assert_eq!(r.schedule_lag_s(), None);
        assert!(r.ttft_s().is_nan());
        r.status = Status::Overflow;
        assert_eq!(r.schedule_lag_s(), Some(0.25));
        r.sent_s = Some(1.5);
        assert_eq!(r.map_times(|t| t * 2.0).schedule_lag_s(), Some(1.0));
    }
}
