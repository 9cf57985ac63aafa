//! The router's view of its destinations: per-destination atomics (up, outstanding requests,
//! queued prompt tokens until the first byte, counters) that implement
//! [`crate::policy::FleetView`] without a lock, plus the active health checks.
//!
//! Up/down: a destination goes down at once on a connection failure seen by a request (passive
//! detection: connection refused, reset or closed before an answer) or on a failed probe — a
//! slow answer (first-byte timeout) and a response that breaks once begun (a stream cut
//! mid-way) are counted but mark nothing; it comes back up on
//! the next successful probe (`GET {backend}/health` answering 2xx within the probe timeout).
//! Every policy only ever chooses among destinations that are up, so a down destination leaves
//! every policy's choice the moment it is marked.

use crate::policy::FleetView;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};

/// One destination's live state.
#[derive(Debug)]
pub struct Dest {
    /// Base URL without a trailing slash.
    pub url: String,
    up: AtomicBool,
    outstanding: AtomicU32,
    queued_tokens: AtomicU64,
    /// Requests sent (attempts, retries included).
    pub requests: AtomicU64,
    /// Attempts that failed (transport error, timeout, 5xx, broken stream).
    pub errors: AtomicU64,
    /// Times this destination was marked down.
    pub downs: AtomicU64,
    /// Attempts that got no response or first body byte within the first-byte timeout.
    pub timeouts: AtomicU64,
    /// Responses that broke once begun (a stream cut mid-way); they mark nothing.
    pub broken_streams: AtomicU64,
    /// TTFT, end-to-end and upstream latency histograms (`/metrics`).
    pub(crate) latency: super::latency::Latencies,
}

/// All destinations, indexed as the backends were given.
#[derive(Debug)]
pub struct Fleet {
    pub(crate) dests: Vec<Dest>,
}

impl Fleet {
    /// Destinations from base URLs; all start up (the first probe corrects that within one
    /// health interval, and a refused connection at once).
    pub fn new(urls: &[String]) -> Self {
        Self {
            dests: urls
                .iter()
                .map(|u| Dest {
                    url: u.trim_end_matches('/').to_string(),
                    up: AtomicBool::new(true),
                    outstanding: AtomicU32::new(0),
                    queued_tokens: AtomicU64::new(0),
                    requests: AtomicU64::new(0),
                    errors: AtomicU64::new(0),
                    downs: AtomicU64::new(0),
                    timeouts: AtomicU64::new(0),
                    broken_streams: AtomicU64::new(0),
                    latency: Default::default(),
                })
                .collect(),
        }
    }

    /// Destination `d`.
    pub fn dest(&self, d: usize) -> &Dest {
        &self.dests[d]
    }

    /// Mark `d` down; returns whether it was up before.
    pub fn mark_down(&self, d: usize) -> bool {
        let was = self.dests[d].up.swap(false, Relaxed);
        if was {
            self.dests[d].downs.fetch_add(1, Relaxed);
        }
        was
    }

    /// Mark `d` up; returns whether it was down before.
    pub fn mark_up(&self, d: usize) -> bool {
        !self.dests[d].up.swap(true, Relaxed)
    }

    /// Up flags, as the planner's `down` mask (true = down).
    pub fn down_mask(&self) -> Vec<bool> {
        self.dests.iter().map(|d| !d.up.load(Relaxed)).collect()
    }

    /// Number of destinations up.
    pub fn live(&self) -> usize {
        self.dests.iter().filter(|d| d.up.load(Relaxed)).count()
    }

    pub(crate) fn begin(&self, d: usize, prompt_tokens: u64) {
        let x = &self.dests[d];
        x.outstanding.fetch_add(1, Relaxed);
        x.queued_tokens.fetch_add(prompt_tokens, Relaxed);
        x.requests.fetch_add(1, Relaxed);
    }

    pub(crate) fn first_byte(&self, d: usize, prompt_tokens: u64) {
        self.dests[d]
            .queued_tokens
            .fetch_sub(prompt_tokens, Relaxed);
    }

    pub(crate) fn end(&self, d: usize) {
        self.dests[d].outstanding.fetch_sub(1, Relaxed);
    }
}

impl FleetView for Fleet {
    fn len(&self) -> usize {
        self.dests.len()
    }
    fn is_up(&self, d: usize) -> bool {
        self.dests[d].up.load(Relaxed)
    }
    fn outstanding(&self, d: usize) -> u32 {
        self.dests[d].outstanding.load(Relaxed)
    }
    fn queued_prefill_tokens(&self, d: usize) -> u64 {
        self.dests[d].queued_tokens.load(Relaxed)
    }
}

/// The fleet with one destination hidden (a retry must go elsewhere).
pub(crate) struct Excluding<'a> {
    pub fleet: &'a Fleet,
    pub skip: Option<usize>,
}

impl FleetView for Excluding<'_> {
    fn len(&self) -> usize {
        self.fleet.len()
    }
    fn is_up(&self, d: usize) -> bool {
        Some(d) != self.skip && self.fleet.is_up(d)
    }
    fn outstanding(&self, d: usize) -> u32 {
        self.fleet.outstanding(d)
    }
    fn queued_prefill_tokens(&self, d: usize) -> u64 {
        self.fleet.queued_prefill_tokens(d)
    }
}
