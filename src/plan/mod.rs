//! The CacheRoute planner (the paper's Algorithm 1) and what the product adds to it.
//!
//! Per control interval, from measured per-key rates λ_b:
//! 1. k_b = min(R, max(1, ⌈λ_b / q_cap⌉));
//! 2. keys by decreasing rate; admit while Σ k_b ≤ C = R·W (a key that does not fit is skipped
//!    and later, smaller keys may still be admitted);
//! 3. every destination starts at the expected cold-tail load (Σ unadmitted rates) / R;
//! 4. LPT: admitted keys in decreasing rate order, each charges λ_b / k_b to each of its k_b
//!    currently least-loaded distinct destinations ([`lpt`]: a binary heap over R, or the
//!    same rule in vector registers where R ≤ 32).
//!
//! Options of the same planner (docs/planner.md): churn-aware replanning against a previous plan
//! ([`replan`]), plan repair when destinations go down ([`repair`]), byte-aware admission
//! ([`PlannerConfig::byte_aware`]), and the ablation placements (hash placement, no
//! replication) used by the paper's §5.3.
//!
//! Pure logic: no I/O, no clock (the caller passes a timer for `build_ms` via [`build_timed`]),
//! no randomness. Keys are identified by [`crate::key_hash`] values.

//!
//! Files: this one holds the types ([`Plan`], [`PlanEntry`], [`PlannerConfig`], the dispatch
//! index [`PlanTable`]); `admit.rs` steps 1–2; `sort.rs` the admission order's bucket sort;
//! `build.rs` steps 3–4 ([`build`]); `lpt.rs` the LPT placement and its SIMD kernels; `pair.rs`
//! the helper thread; `replan.rs` churn-aware replanning; `repair.rs` repair; `file.rs` plan
//! files; `export.rs` JSON export; `meter.rs` the rate meter.

mod admit;
mod build;
pub mod export;
pub mod file;
mod lpt;
pub mod meter;
mod pair;
mod repair;
mod replan;
mod sort;

use admit::*;
use build::*;
pub use build::{build, build_timed};
pub use repair::repair;
pub use replan::{churn, replan};
use sort::*;

use std::cmp::Ordering;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::OnceLock;

/// A key's input to the planner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyLoad {
    /// `crate::key_hash` of the routing key.
    pub key: u64,
    /// Measured requests per second.
    pub rate: f64,
    /// Reusable prefix size in tokens (only used by byte-aware admission; 0 when unknown).
    pub prefix_tokens: f64,
}

/// How admitted keys are placed on destinations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Longest-processing-time list scheduling against expected load (the paper's planner).
    Lpt,
    /// Placement by hashing the key (the ablation's "affinity" and "+ replication" rows).
    Hash,
}

/// Planner parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannerConfig {
    /// Number of destinations R.
    pub destinations: usize,
    /// Per-destination capacity ceiling q_cap (requests per second).
    pub q_cap: f64,
    /// Warm slots per destination W (in keys; in KV blocks with byte-aware admission).
    pub warm_slots: u64,
    /// When false, every admitted key gets k_b = 1 (ablation: affinity only).
    pub replication: bool,
    /// LPT (full planner) or hash placement (ablation).
    pub placement: Placement,
    /// Byte-aware admission: value per slot = rate × prefix tokens, slots in KV blocks.
    pub byte_aware: bool,
    /// Tokens per KV block for byte-aware slot accounting.
    pub block_tokens: u32,
    /// Churn-aware replanning with LPT placement: allowed max/mean expected load, relative to
    /// what a fresh LPT plan achieves on the same rates (1.05 = within 5%).
    pub max_imbalance: f64,
    /// Churn-aware replanning: a previously admitted key keeps its slot unless an unadmitted
    /// key's rate exceeds its rate × (1 + hysteresis). 0 = admission exactly as a fresh plan.
    pub admission_hysteresis: f64,
}

impl PlannerConfig {
    /// The paper's planner with the given R, q_cap and W.
    pub fn new(destinations: usize, q_cap: f64, warm_slots: u64) -> Self {
        Self {
            destinations,
            q_cap,
            warm_slots,
            replication: true,
            placement: Placement::Lpt,
            byte_aware: false,
            block_tokens: 16,
            max_imbalance: 1.05,
            admission_hysteresis: 0.5,
        }
    }

    /// Check parameters; each problem names the parameter and what to do.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.destinations == 0 {
            return Err(PlanError::Param("destinations must be ≥ 1".into()));
        }
        if self.destinations > u16::MAX as usize {
            return Err(PlanError::Param(format!(
                "destinations must be ≤ {}",
                u16::MAX
            )));
        }
        // q_cap and W are resolved here (an automatic setting was chosen before planning).
        let resolved = [
            crate::bounds::finite_positive("q-cap", self.q_cap)
                .map(|e| format!("{e} (requests/s one destination sustains)")),
            crate::bounds::count("warm-slots", self.warm_slots, 1, u64::MAX)
                .map(|e| format!("{e} (warm keys per destination)")),
        ];
        if let Some(e) = resolved.into_iter().flatten().next() {
            return Err(PlanError::Param(e));
        }
        if self.byte_aware && self.block_tokens == 0 {
            return Err(PlanError::Param(
                "block-tokens must be ≥ 1 with byte-aware admission".into(),
            ));
        }
        if !(self.admission_hysteresis.is_finite() && self.admission_hysteresis >= 0.0) {
            return Err(PlanError::Param("admission-hysteresis must be ≥ 0".into()));
        }
        if !(self.max_imbalance.is_finite() && self.max_imbalance >= 1.0) {
            return Err(PlanError::Param(
                "max-imbalance must be ≥ 1.0 (a factor on the fresh plan's max/mean)".into(),
            ));
        }
        Ok(())
    }
}

/// Planner errors.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{0}")]
    Param(String),
    #[error("key {index}: rate {rate} is not a finite number ≥ 0")]
    BadRate { index: usize, rate: f64 },
    #[error("no destination is available to plan for")]
    NoDestination,
}

/// Identity hasher for maps keyed by `key_hash` values (already well mixed).
#[derive(Default, Clone, Copy)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by key hashes.
pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;

/// One admitted key in a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanEntry {
    pub key: u64,
    pub rate: f64,
    /// Index of this key in the planner's input.
    pub input_index: u32,
    /// Number of destinations k_b.
    pub k: u16,
}

/// A routing plan: admitted keys → destination sets, with expected loads.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Number of destinations R the plan was built for.
    pub destinations: usize,
    /// Admitted keys, in the order they were placed (decreasing rate).
    pub entries: Vec<PlanEntry>,
    /// Destination indices of all entries, flat, in entry order.
    dests: Vec<u16>,
    /// Offset of each entry's destinations in `dests`; empty when every entry has k_b = 1
    /// (entry i's one destination is then `dests[i]`: 4 bytes an entry less to build).
    starts: Vec<u32>,
    /// Expected load per destination (requests/s), cold tail included.
    pub loads: Vec<f64>,
    /// Expected cold-tail load per live destination.
    pub cold_tail_per_dest: f64,
    /// Total rate of unadmitted keys.
    pub cold_tail_rate: f64,
    /// Total rate of all keys.
    pub total_rate: f64,
    /// Σ k_b (or Σ k_b·blocks with byte-aware admission).
    pub slots_used: u64,
    /// The budget C = R_live·W.
    pub slot_budget: u64,
    /// Fraction of admitted keys whose destination set changed against the previous plan.
    pub churn: Option<f64>,
    /// Destinations that were down when the plan was built (nothing placed there).
    pub down: Vec<bool>,
    /// Set by [`replan`] when no churn-aware plan met the bound and the fresh plan was used.
    pub fell_back_to_fresh: bool,
    /// Construction time in milliseconds (set by [`build_timed`]; 0 otherwise).
    pub build_ms: f64,
    /// Dispatch index: key hash → entry.
    table: PlanTable,
}

impl Plan {
    /// Number of admitted keys.
    pub fn admitted(&self) -> usize {
        self.entries.len()
    }

    /// Destinations of entry `i`.
    pub fn dests_of(&self, i: usize) -> &[u16] {
        let s = self.start_of(i);
        &self.dests[s..s + self.entries[i].k as usize]
    }

    /// Offset of entry `i`'s destinations in `dests`.
    #[inline]
    fn start_of(&self, i: usize) -> usize {
        if self.starts.is_empty() {
            i
        } else {
            self.starts[i] as usize
        }
    }

    /// Σ k_b over admitted keys (the replicas the plan hands out).
    pub fn replicas(&self) -> u64 {
        self.entries.iter().map(|e| e.k as u64).sum()
    }

    /// Share of the total rate carried by admitted keys.
    pub fn admitted_share(&self) -> f64 {
        if self.total_rate > 0.0 {
            1.0 - self.cold_tail_rate / self.total_rate
        } else {
            0.0
        }
    }

    /// max / mean of expected load over live destinations (1.0 = perfectly even).
    pub fn imbalance(&self) -> f64 {
        max_over_mean(&self.loads, &self.down)
    }

    /// Destinations of `key` if it is admitted (the dispatch-time lookup).
    #[inline]
    pub fn lookup(&self, key: u64) -> Option<&[u16]> {
        self.table.get(key, &self.entries).map(|i| self.dests_of(i))
    }

    /// (Re)build the key → entry index after entries changed.
    fn index(mut self) -> Self {
        self.table = PlanTable::new(&self.entries);
        self
    }

    /// Destination sets keyed by key hash (for comparisons and churn).
    pub fn key_sets(&self) -> KeyMap<Vec<u16>> {
        let mut m = KeyMap::with_capacity_and_hasher(self.entries.len(), Default::default());
        for i in 0..self.entries.len() {
            let mut d = self.dests_of(i).to_vec();
            d.sort_unstable();
            m.insert(self.entries[i].key, d);
        }
        m
    }
}

/// The dispatch-time index of a plan: key hash → entry. Open addressing with linear probing
/// over entry indices only (4 bytes a slot, at most half full): a probe reads the slot and
/// then the entry, whose key it compares and whose destinations the caller reads next.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlanTable {
    /// Entry index per slot, [`Self::EMPTY`] when free; the length is a power of two.
    slots: Vec<u32>,
    /// 64 − log2(slots): the top bits of the multiplied key pick the home slot.
    shift: u32,
}

impl PlanTable {
    const EMPTY: u32 = u32::MAX;

    fn new(entries: &[PlanEntry]) -> Self {
        Self::new_in(entries, Vec::new())
    }

    /// Slots for `n` entries: a power of two, at least twice as many.
    fn len_for(n: usize) -> usize {
        (n * 2).next_power_of_two().max(2)
    }

    /// The index of `entries`, in `memory` where it is large enough and not more than twice
    /// too large (a plan keeps its index's memory), else in a new allocation.
    fn new_in(entries: &[PlanEntry], mut memory: Vec<u32>) -> Self {
        if entries.is_empty() {
            return Self::default();
        }
        let len = Self::len_for(entries.len());
        if !(len..=2 * len).contains(&memory.capacity()) {
            memory = Vec::new();
        }
        memory.clear();
        memory.resize(len, Self::EMPTY);
        let mut t = PlanTable {
            slots: memory,
            shift: 64 - len.trailing_zeros(),
        };
        let mask = len - 1;
        // Each entry's home slot is asked for this many entries ahead, so that the memory
        // reads of several inserts overlap (the inserts themselves wait on each other's
        // branches).
        const AHEAD: usize = 16;
        for (i, e) in entries.iter().enumerate() {
            #[cfg(target_arch = "x86_64")]
            if let Some(f) = entries.get(i + AHEAD) {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                // SAFETY: a prefetch only hints; the home slot lies within the table.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(t.slots.as_ptr().add(t.home(f.key)).cast()) };
            }
            let mut s = t.home(e.key);
            loop {
                let cur = t.slots[s];
                if cur == Self::EMPTY {
                    t.slots[s] = i as u32;
                    break;
                }
                if entries[cur as usize].key == e.key {
                    // A repeated key: the later entry wins.
                    t.slots[s] = i as u32;
                    break;
                }
                s = (s + 1) & mask;
            }
        }
        t
    }

    /// Home slot of `key` (Fibonacci hashing: keys need not be well mixed).
    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    /// Entry index of `key` among `entries` (the plan's), if admitted.
    #[inline]
    pub fn get(&self, key: u64, entries: &[PlanEntry]) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut s = self.home(key);
        loop {
            let i = self.slots[s];
            if i == Self::EMPTY {
                return None;
            }
            if entries[i as usize].key == key {
                return Some(i as usize);
            }
            s = (s + 1) & mask;
        }
    }
}

/// max/mean over live destinations.
pub fn max_over_mean(loads: &[f64], down: &[bool]) -> f64 {
    let mut max = 0.0f64;
    let mut sum = 0.0;
    let mut n = 0usize;
    for (i, &l) in loads.iter().enumerate() {
        if down.get(i).copied().unwrap_or(false) {
            continue;
        }
        max = max.max(l);
        sum += l;
        n += 1;
    }
    if n == 0 || sum <= 0.0 {
        1.0
    } else {
        max / (sum / n as f64)
    }
}

/// k_b = min(R, max(1, ⌈λ_b / q_cap⌉)).
#[inline]
pub fn replicas_for(rate: f64, q_cap: f64, r_live: usize) -> usize {
    let x = rate / q_cap;
    if x <= 1.0 {
        // The common case, without a call to `ceil` (not an instruction on baseline x86-64).
        return 1;
    }
    let k = x.ceil();
    let k = if k.is_finite() && k >= 1.0 {
        k.min(r_live as f64) as usize
    } else {
        1
    };
    k.clamp(1, r_live.max(1))
}

#[cfg(test)]
mod tests;
