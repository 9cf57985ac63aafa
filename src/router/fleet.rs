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
//!
//! Slots: the fleet has a fixed number of destination slots, so every policy keeps its index
//! space. With a static backend list there is one slot per backend. With a watched backends
//! file (`discovery`) there are more: a slot that holds no backend is vacant (down for good,
//! never chosen); a backend removed from the file leaves its slot vacant, one added fills a
//! vacant slot and comes up by probe. Each fill or vacancy moves the slot's generation on, so
//! a probe begun for the slot's previous backend cannot mark its new one up.

use super::lock::Locked;
use crate::policy::FleetView;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// One destination's live state.
#[derive(Debug)]
pub struct Dest {
    /// Base URL without a trailing slash (of the slot's last backend when vacant).
    url: Mutex<Arc<str>>,
    /// No backend in this slot (removed from the backends file, or never filled).
    vacant: AtomicBool,
    /// Moves on at every fill and vacancy of the slot.
    generation: AtomicU64,
    up: AtomicBool,
    outstanding: AtomicU32,
    queued_tokens: AtomicU64,
    /// Requests sent (attempts, retries included).
    pub requests: AtomicU64,
    /// Prompt tokens of the requests the policy chose this destination for.
    pub prompt_tokens: AtomicU64,
    /// Of those, the tokens the router's exact index (the engines' KV-cache events) held at
    /// this destination when it was chosen (0 unsubscribed).
    pub predicted_cached_tokens: AtomicU64,
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

impl Dest {
    /// A slot holding `url` (up until a probe says otherwise), or a vacant one (down).
    fn new(url: &str, vacant: bool) -> Dest {
        Dest {
            url: Mutex::new(url.into()),
            vacant: AtomicBool::new(vacant),
            generation: AtomicU64::new(0),
            up: AtomicBool::new(!vacant),
            outstanding: AtomicU32::new(0),
            queued_tokens: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            predicted_cached_tokens: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            downs: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            broken_streams: AtomicU64::new(0),
            latency: Default::default(),
        }
    }

    /// The slot's base URL (its last backend's when vacant).
    pub fn url(&self) -> Arc<str> {
        self.url.locked().clone()
    }

    fn reset_counters(&self) {
        for c in [
            &self.requests,
            &self.errors,
            &self.downs,
            &self.timeouts,
            &self.broken_streams,
        ] {
            c.store(0, Relaxed);
        }
        self.latency.reset();
    }
}

/// All destination slots, indexed as the backends were given (then as discovery fills them).
#[derive(Debug)]
pub struct Fleet {
    pub(crate) dests: Vec<Dest>,
}

impl Fleet {
    /// Destinations from base URLs, in `slots` slots (at least one per URL; the rest vacant).
    /// Backends start up (the first probe corrects that within one health interval, and a
    /// refused connection at once).
    pub fn new(urls: &[String], slots: usize) -> Self {
        Self {
            dests: (0..slots.max(urls.len()))
                .map(|d| {
                    Dest::new(
                        urls.get(d).map_or("", |u| u.trim_end_matches('/')),
                        d >= urls.len(),
                    )
                })
                .collect(),
        }
    }

    /// Destination `d` (a slot past the last is read as a vacant one: down, never chosen).
    pub fn dest(&self, d: usize) -> &Dest {
        static NOWHERE: std::sync::LazyLock<Dest> =
            std::sync::LazyLock::new(|| Dest::new("", true));
        self.dests.get(d).unwrap_or(&NOWHERE)
    }

    /// Mark `d` down; returns whether it was up before.
    pub fn mark_down(&self, d: usize) -> bool {
        let Some(x) = self.dests.get(d) else {
            return false;
        };
        let was = x.up.swap(false, Relaxed);
        if was {
            x.downs.fetch_add(1, Relaxed);
        }
        was
    }

    /// Mark `d` up, if it still holds the backend of generation `generation` (see
    /// [`Fleet::generation`]); returns whether it was down before. A vacant slot stays down.
    pub fn mark_up(&self, d: usize, generation: u64) -> bool {
        let Some(x) = self.dests.get(d) else {
            return false;
        };
        let current =
            |x: &Dest| !x.vacant.load(Relaxed) && x.generation.load(Relaxed) == generation;
        if !current(x) {
            return false;
        }
        let was_down = !x.up.swap(true, Relaxed);
        // The slot was emptied or refilled meanwhile: undo (its vacancy marks it down after
        // moving the generation on, so one of the two sees the other).
        if !current(x) {
            x.up.store(false, Relaxed);
            return false;
        }
        was_down
    }

    /// The slot's generation now (read before a probe, passed to [`Fleet::mark_up`]).
    pub fn generation(&self, d: usize) -> u64 {
        self.dest(d).generation.load(Relaxed)
    }

    /// Whether slot `d` holds no backend.
    pub fn is_vacant(&self, d: usize) -> bool {
        self.dest(d).vacant.load(Relaxed)
    }

    /// The backends in force: (slot, base URL), by slot.
    pub fn backends(&self) -> Vec<(usize, Arc<str>)> {
        (0..self.dests.len())
            .filter(|&d| !self.is_vacant(d))
            .map(|d| (d, self.dest(d).url()))
            .collect()
    }

    /// Number of slots that hold a backend.
    pub fn occupied(&self) -> usize {
        self.dests
            .iter()
            .filter(|d| !d.vacant.load(Relaxed))
            .count()
    }

    /// Empty slot `d`: down for good until filled again. Requests in flight to it finish on
    /// the connections they hold.
    pub(crate) fn vacate(&self, d: usize) {
        let Some(x) = self.dests.get(d) else {
            return;
        };
        x.vacant.store(true, Relaxed);
        x.generation.fetch_add(1, Relaxed);
        x.up.store(false, Relaxed);
    }

    /// Put the backend at `url` into vacant slot `d`, down until its first probe passes. Its
    /// counters start from zero unless the slot held this same URL before.
    pub(crate) fn fill(&self, d: usize, url: &str) {
        let Some(x) = self.dests.get(d) else {
            return;
        };
        let url = url.trim_end_matches('/');
        {
            let mut u = x.url.locked();
            if &**u != url {
                *u = url.into();
                x.reset_counters();
            }
        }
        x.up.store(false, Relaxed);
        x.generation.fetch_add(1, Relaxed);
        x.vacant.store(false, Relaxed);
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
        let x = self.dest(d);
        x.outstanding.fetch_add(1, Relaxed);
        x.queued_tokens.fetch_add(prompt_tokens, Relaxed);
        x.requests.fetch_add(1, Relaxed);
    }

    pub(crate) fn first_byte(&self, d: usize, prompt_tokens: u64) {
        self.dest(d).queued_tokens.fetch_sub(prompt_tokens, Relaxed);
    }

    pub(crate) fn end(&self, d: usize) {
        self.dest(d).outstanding.fetch_sub(1, Relaxed);
    }
}

impl FleetView for Fleet {
    fn len(&self) -> usize {
        self.dests.len()
    }
    fn is_up(&self, d: usize) -> bool {
        self.dest(d).up.load(Relaxed)
    }
    fn outstanding(&self, d: usize) -> u32 {
        self.dest(d).outstanding.load(Relaxed)
    }
    fn queued_prefill_tokens(&self, d: usize) -> u64 {
        self.dest(d).queued_tokens.load(Relaxed)
    }
}

/// The fleet with one destination hidden (a retry must go elsewhere).
pub(crate) struct Excluding<'a> {
    pub fleet: &'a Fleet,
    pub skip: Option<usize>,
    /// Only these destinations (by slot) may be chosen (an EPP's subset hint); `None`: all.
    pub only: Option<&'a [bool]>,
}

impl FleetView for Excluding<'_> {
    fn len(&self) -> usize {
        self.fleet.len()
    }
    fn is_up(&self, d: usize) -> bool {
        Some(d) != self.skip
            && self.only.is_none_or(|o| o.get(d).copied().unwrap_or(false))
            && self.fleet.is_up(d)
    }
    fn outstanding(&self, d: usize) -> u32 {
        self.fleet.outstanding(d)
    }
    fn queued_prefill_tokens(&self, d: usize) -> u64 {
        self.fleet.queued_prefill_tokens(d)
    }
}
