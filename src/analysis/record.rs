//! What every backend produces and every metric reads: the record of one request (timings,
//! tokens, destination, status) and of one installed plan. Below the simulator, the live
//! layers, the store and the analysis alike, so none of them imports another for its types.
//! Pure data.

use serde::{Deserialize, Serialize};

/// Outcome of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    /// No destination was up.
    NoDestination,
    /// Its destination failed after the first token (or on the retry).
    Failed,
    /// The engine refused it (larger than the KV cache).
    Rejected,
    /// Still running at the horizon.
    Unfinished,
}

/// One request as the simulator saw it. Times are virtual seconds from the trace start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: u64,
    /// `crate::key_hash` of the routing key.
    pub key: u64,
    /// Destination that served it (the last one tried); -1 when none.
    pub destination: i32,
    /// Scheduled (= sent, in simulation) time.
    pub scheduled_s: f64,
    pub first_token_s: f64,
    pub finish_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub cached_tokens: u32,
    pub preemptions: u32,
    pub retried: bool,
    pub status: Status,
}

impl RequestRecord {
    pub fn ttft_s(&self) -> f64 {
        self.first_token_s - self.scheduled_s
    }
    pub fn e2e_s(&self) -> f64 {
        self.finish_s - self.scheduled_s
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
    pub q_cap: f64,
    pub warm_slots: u64,
    /// Σ k_b over admitted keys: the replicas the plan gives its keys.
    #[serde(default)]
    pub replicas: u64,
    /// Set when the control loop tuned q_cap / W for this plan: what it compared and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tuning: Option<String>,
}
