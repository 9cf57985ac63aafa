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

pub mod export;
pub mod file;
mod lpt;
pub mod meter;
mod pair;

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
        if !(self.q_cap.is_finite() && self.q_cap > 0.0) {
            return Err(PlanError::Param(
                "q-cap must be a finite number > 0 (requests/s one destination sustains)".into(),
            ));
        }
        if self.warm_slots == 0 {
            return Err(PlanError::Param(
                "warm-slots must be ≥ 1 (warm keys per destination)".into(),
            ));
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

/// Slot cost of an admitted key: k_b, or k_b × blocks with byte-aware admission.
#[inline]
fn slot_cost(cfg: &PlannerConfig, k: usize, prefix_tokens: f64) -> u64 {
    if cfg.byte_aware {
        let blocks = (prefix_tokens.max(0.0) / cfg.block_tokens as f64)
            .ceil()
            .max(1.0) as u64;
        k as u64 * blocks
    } else {
        k as u64
    }
}

/// Result of admission: the admitted keys as plan entries with k_b set (not yet placed), in
/// placement order (decreasing rate, ties by key hash).
struct Admission {
    entries: Vec<PlanEntry>,
    slots_used: u64,
    admitted_rate: f64,
    total_rate: f64,
    /// Memory the sort used and no longer needs, for the dispatch index (may be empty).
    scratch: Vec<u32>,
}

/// What one pass over the input learns: every rate is a finite number ≥ 0 (else the first
/// that is not), their sum, and the range of the IEEE bits of the rates as admission orders
/// them (rates ≤ 0 as +0). The sum is taken in chunks of [`SCAN_CHUNK`] keys, each in input
/// order, and the chunk sums are added in chunk order: the same number whichever thread read
/// which chunk (the large plans' sort reads them on two, [`bucket_sorted`]).
#[derive(Clone, Copy)]
struct KeyScan {
    total_rate: f64,
    bits_lo: u64,
    bits_hi: u64,
}

/// Keys per chunk of [`KeyScan`]'s sum.
const SCAN_CHUNK: usize = 4096;

/// One chunk of [`KeyScan`]: `keys` starts at input index `first`.
fn scan_chunk(keys: &[KeyLoad], first: usize) -> Result<KeyScan, PlanError> {
    let mut total_rate = 0.0;
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for (i, k) in keys.iter().enumerate() {
        let r = k.rate;
        if !(r.is_finite() && r >= 0.0) {
            return Err(PlanError::BadRate {
                index: first + i,
                rate: r,
            });
        }
        total_rate += r;
        let b = if r > 0.0 { r.to_bits() } else { 0 };
        lo = lo.min(b);
        hi = hi.max(b);
    }
    Ok(KeyScan {
        total_rate,
        bits_lo: lo,
        bits_hi: hi,
    })
}

/// Chunk scans, in chunk order, folded into the whole input's (the first bad rate, if any).
fn fold_scans(
    mut chunks: impl Iterator<Item = Result<KeyScan, PlanError>>,
) -> Result<KeyScan, PlanError> {
    let empty = KeyScan {
        total_rate: 0.0,
        bits_lo: u64::MAX,
        bits_hi: 0,
    };
    chunks.try_fold(empty, |a, c| {
        let c = c?;
        Ok(KeyScan {
            total_rate: a.total_rate + c.total_rate,
            bits_lo: a.bits_lo.min(c.bits_lo),
            bits_hi: a.bits_hi.max(c.bits_hi),
        })
    })
}

fn scan_keys(keys: &[KeyLoad]) -> Result<KeyScan, PlanError> {
    fold_scans(
        keys.chunks(SCAN_CHUNK)
            .enumerate()
            .map(|(c, ks)| scan_chunk(ks, c * SCAN_CHUNK)),
    )
}

/// Previously admitted keys and the admission hysteresis they enjoy (churn-aware replanning):
/// such a key is ordered as if its rate were × (1 + hysteresis).
#[derive(Clone, Copy)]
struct Incumbents<'a> {
    keys: Option<&'a KeyMap<Vec<u16>>>,
    hysteresis: f64,
}

impl Incumbents<'_> {
    const NONE: Incumbents<'static> = Incumbents {
        keys: None,
        hysteresis: 0.0,
    };
    #[inline]
    fn boost(&self, key: u64) -> f64 {
        match self.keys {
            Some(m) if self.hysteresis > 0.0 && m.contains_key(&key) => 1.0 + self.hysteresis,
            _ => 1.0,
        }
    }
}

/// Admission order: decreasing rate, then increasing key hash. Entries being admitted hold
/// rates ≥ +0 (−0 and ≤ 0 are stored as +0), whose IEEE bits order like the numbers, so the
/// sort compares plain integers.
#[inline]
fn by_rate_then_key(a: &PlanEntry, b: &PlanEntry) -> Ordering {
    b.rate
        .to_bits()
        .cmp(&a.rate.to_bits())
        .then(a.key.cmp(&b.key))
}

/// The budget rule. The candidates are the plan entries themselves (key, rate and input index
/// side by side, one allocation): sorting them needs no indirection into `keys`, and the
/// admitted ones are compacted to the front and become the plan's entries.
///
/// The input's pass ([`scan_keys`]: validation, sum, range) is done here, and on a large
/// input where the whole order is sorted without incumbents it is the sort's counting pass.
fn admit(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    r_live: usize,
    inc: Incumbents,
) -> Result<Admission, PlanError> {
    let budget = cfg.warm_slots.saturating_mul(r_live as u64);
    let n = keys.len();
    let whole_order = !cfg.byte_aware && (budget as usize).saturating_mul(2) >= n;
    let fused = whole_order && inc.keys.is_none();
    let scan = if fused { None } else { Some(scan_keys(keys)?) };
    if cfg.byte_aware {
        let total = scan.expect("scanned").total_rate;
        return Ok(admit_byte_aware(cfg, keys, total, r_live, inc));
    }
    // While admitting, `rate` holds the effective rate (× (1 + hysteresis) for incumbents),
    // with rates ≤ 0 as +0.
    let boosted: Option<Vec<f64>> = inc
        .keys
        .map(|_| keys.iter().map(|k| k.rate * inc.boost(k.key)).collect());
    let eff = |i: usize| {
        let e = match &boosted {
            Some(b) => b[i],
            None => keys[i].rate,
        };
        if e > 0.0 {
            e
        } else {
            0.0
        }
    };
    // k = 1 until admission says otherwise (the common case needs no second write).
    let candidate = |i: usize| PlanEntry {
        key: keys[i].key,
        rate: eff(i),
        input_index: i as u32,
        k: 1,
    };
    let mut sorted = n;
    let mut cands: Vec<PlanEntry>;
    let total_rate;
    let mut scratch = Vec::new();
    if !whole_order {
        total_rate = scan.expect("scanned").total_rate;
        // Only the top of the order can be admitted: at most `budget` keys fit. Select a
        // prefix that is large enough in O(n) and sort just that; the rest is sorted only if
        // skipped keys leave budget unused at the prefix's end (the selection leaves it after
        // the prefix, so the scan simply continues).
        cands = (0..n).map(candidate).collect();
        sorted = (budget as usize * 2).max(1024).min(n);
        if sorted < n {
            cands.select_nth_unstable_by(sorted - 1, by_rate_then_key);
        }
        cands[..sorted].sort_unstable_by(by_rate_then_key);
    } else {
        let range = match (&boosted, scan) {
            (None, Some(sc)) => SortRange::Known(sc.bits_lo, sc.bits_hi),
            (None, None) => SortRange::Scan(keys),
            (Some(_), _) => {
                let (lo, hi) = (0..n).fold((u64::MAX, 0), |(lo, hi), i| {
                    let b = eff(i).to_bits();
                    (lo.min(b), hi.max(b))
                });
                SortRange::Known(lo, hi)
            }
        };
        let sorted = bucket_sorted(n, range, eff, candidate, None)?;
        cands = sorted.cands;
        scratch = sorted.scratch;
        total_rate = sorted
            .total_rate
            .or(scan.map(|s| s.total_rate))
            .expect("scanned");
    }
    // Once every later key costs one slot (its rate is at most q_cap, or no replication),
    // admission is a prefix of the order: no per-key decision is left. With incumbents the
    // order is by boosted rates while k follows true ones, so the scan stays per key.
    let unit_tail = |rate: f64| inc.keys.is_none() && (!cfg.replication || rate <= cfg.q_cap);
    let mut used = 0u64;
    let mut admitted = 0usize;
    let mut admitted_rate = 0.0;
    let mut next = 0usize;
    'scan: loop {
        let mut j = next;
        while j < sorted {
            let c = cands[j];
            if c.rate == 0.0 {
                // A key with no traffic gains nothing from a warm slot (and all after it are 0).
                break 'scan;
            }
            let rate = match inc.keys {
                Some(_) => keys[c.input_index as usize].rate,
                None => c.rate,
            };
            if unit_tail(rate) {
                let live = cands[j..sorted].partition_point(|e| e.rate > 0.0);
                let take = (live as u64).min(budget - used) as usize;
                if admitted != j {
                    cands.copy_within(j..j + take, admitted);
                }
                for e in &cands[admitted..admitted + take] {
                    admitted_rate += e.rate;
                }
                used += take as u64;
                admitted += take;
                j += take;
                if used == budget || take < sorted - (j - take) {
                    // The budget is full, or the keys left send nothing.
                    break 'scan;
                }
                continue;
            }
            let kb = if cfg.replication {
                replicas_for(rate, cfg.q_cap, r_live)
            } else {
                1
            };
            let cost = kb as u64;
            if used + cost <= budget {
                used += cost;
                cands[admitted] = PlanEntry {
                    rate,
                    k: kb as u16,
                    ..c
                };
                admitted += 1;
                admitted_rate += rate;
                if used == budget {
                    break 'scan;
                }
            }
            j += 1;
        }
        if sorted == n {
            break;
        }
        next = sorted;
        sorted = n;
        cands[next..].sort_unstable_by(by_rate_then_key);
    }
    cands.truncate(admitted);
    if inc.keys.is_some() {
        // Admitted in order of boosted rates; placed in order of true ones.
        placement_order(&mut cands);
    }
    Ok(Admission {
        entries: cands,
        slots_used: used,
        admitted_rate,
        total_rate,
        scratch,
    })
}

/// Plans with at least this many entries are built on two threads where that is exact: the
/// bucket sort's two halves, and the dispatch index beside the placement (on the helper
/// thread of [`pair`]; smaller plans take well under a millisecond on one).
const PARALLEL_MIN: usize = 1 << 15;

/// The bucket range of [`bucket_sorted`]: the least and greatest IEEE bits of the candidates'
/// rates, or the input itself, when the sort also does [`scan_keys`]'s pass.
enum SortRange<'a> {
    Known(u64, u64),
    Scan(&'a [KeyLoad]),
}

/// Buckets holding more candidates than this are sorted by merge sort, not by insertion (an
/// input of many equal rates, or a range estimated from a sample that missed its extremes).
const INSERTION_MAX: usize = 32;

/// Candidates `candidate(0..n)` in admission order ([`by_rate_then_key`]), where `eff(i)` is
/// candidate i's rate (≥ +0): a counting sort over the rates' IEEE patterns (which order like
/// the rates; [`BucketMap`] spreads the buckets as a sample of 4,096 rates lies) puts each
/// candidate in its bucket of about two, then each bucket is sorted by insertion. Linear in n
/// for the rate distributions the planner sees, with no comparison sort of the whole array.
///
/// With [`SortRange::Scan`] the bucket range comes from the sample too (rates outside it go to
/// the end buckets: the order stays exact) and the counting pass is also the input's
/// validation and sum ([`KeyScan`]; the total rate is returned): one pass over the input
/// instead of two.
///
/// On a large input two threads share the work, and the output does not depend on it. They
/// count chunks of the input from either end (the helper from the front, the caller from the
/// back, so a helper that starts late leaves no one waiting) until they meet; both then know
/// every bucket's place; each scatters the candidates it counted (the front part's go first in
/// each bucket, as one thread would put them) and each sorts half of the buckets.
fn bucket_sorted(
    n: usize,
    range: SortRange,
    eff: impl Fn(usize) -> f64 + Sync,
    candidate: impl Fn(usize) -> PlanEntry + Sync,
    scatter_by: Option<ScatterBy>,
) -> Result<Sorted, PlanError> {
    let scan_input = match range {
        SortRange::Scan(keys) => Some(keys),
        SortRange::Known(..) => None,
    };
    if n < 1024 {
        let scan = scan_input.map(scan_keys).transpose()?.map(|s| s.total_rate);
        let mut v: Vec<PlanEntry> = (0..n).map(candidate).collect();
        v.sort_by(by_rate_then_key);
        return Ok(Sorted {
            cands: v,
            total_rate: scan,
            scratch: Vec::new(),
        });
    }
    let step = n.div_ceil(SAMPLE);
    let (lo, hi) = match range {
        SortRange::Known(lo, hi) => (lo, hi),
        SortRange::Scan(_) => (0..n).step_by(step).fold((u64::MAX, 0), |(lo, hi), i| {
            let b = eff(i).to_bits();
            (lo.min(b), hi.max(b))
        }),
    };
    let map = BucketMap::new(
        lo,
        hi,
        (0..n).step_by(step).map(|i| eff(i).to_bits()),
        (n / 2).clamp(1, 1 << 21),
    );
    let buckets = map.buckets;
    let bucket = |i: usize| map.bucket(eff(i).to_bits());
    let parts = if n >= PARALLEL_MIN { 2 } else { 1 };
    let chunks = n.div_ceil(SCAN_CHUNK);
    // Chunks not yet counted: [front, back).
    let claims = std::sync::Mutex::new((0usize, chunks));
    let mut out: Vec<PlanEntry> = Vec::with_capacity(n);
    let mut scans: Vec<Result<KeyScan, PlanError>> = Vec::with_capacity(chunks);
    // One buffer holds each input's bucket (n) and then each part's count per bucket, turned
    // in place into its next slot in each bucket; the plan's dispatch index takes it over
    // afterwards ([`PlanTable::new_in`]), its pages already mapped.
    let mut scratch: Vec<u32> =
        Vec::with_capacity((n + parts * buckets).max(PlanTable::len_for(n)));
    let (slots, of_slots, scan_slots, count_slots) = (
        SharedSlots(out.as_mut_ptr()),
        SharedSlots(scratch.as_mut_ptr()),
        SharedSlots(scans.as_mut_ptr()),
        // SAFETY: n lies within the capacity.
        SharedSlots(unsafe { scratch.as_mut_ptr().add(n) }),
    );
    // The first bucket at or past half the candidates: the second part sorts from there.
    let mid = OnceLock::new();
    let totals: [OnceLock<u32>; 2] = Default::default();
    let barrier = pair::SpinBarrier::new(parts);
    let work = |h: usize| {
        // SAFETY: until the barrier each part touches only its own counts, which lie within
        // the scratch buffer's capacity; it sets them to zero first (zero bytes are zero).
        let hist = unsafe {
            std::ptr::write_bytes(count_slots.at(h * buckets), 0, buckets);
            std::slice::from_raw_parts_mut(count_slots.at(h * buckets), buckets)
        };
        loop {
            let c = {
                let mut cl = claims.lock().unwrap_or_else(|e| e.into_inner());
                if cl.0 == cl.1 {
                    break;
                }
                if h == 0 {
                    cl.0 += 1;
                    cl.0 - 1
                } else {
                    cl.1 -= 1;
                    cl.1
                }
            };
            let inputs = c * SCAN_CHUNK..((c + 1) * SCAN_CHUNK).min(n);
            let Some(keys) = scan_input else {
                for i in inputs {
                    let b = bucket(i);
                    hist[b as usize] += 1;
                    // SAFETY: input i lies in a chunk this thread claimed.
                    unsafe { of_slots.at(i).write(b) };
                }
                continue;
            };
            // The chunk's scan in the same loop: its sum in input order, as [`scan_chunk`]
            // takes it (which finds the first bad rate, if any).
            let (mut total_rate, mut valid) = (0.0, true);
            for (i, k) in inputs.clone().zip(&keys[inputs.clone()]) {
                let r = k.rate;
                valid &= r.is_finite() & (r >= 0.0);
                total_rate += r;
                let b = map.bucket(if r > 0.0 { r.to_bits() } else { 0 });
                hist[b as usize] += 1;
                // SAFETY: input i lies in a chunk this thread claimed.
                unsafe { of_slots.at(i).write(b) };
            }
            let scan = if valid {
                Ok(KeyScan {
                    total_rate,
                    bits_lo: 0,
                    bits_hi: 0,
                })
            } else {
                scan_chunk(&keys[inputs.clone()], inputs.start)
            };
            // SAFETY: chunk c is claimed by this thread alone; each chunk's slot is written
            // once, within `scans`' capacity.
            unsafe { scan_slots.at(c).write(scan) };
        }
        barrier.wait();
        // Both parts read the same chunk scans and stop together on a bad rate.
        if scan_input.is_some() {
            // SAFETY: every chunk was scanned before the barrier.
            let sc = unsafe { std::slice::from_raw_parts(scan_slots.at(0), chunks) };
            if sc.iter().any(|r| r.is_err()) {
                return;
            }
        }
        // Counts to cursors, in place: in each bucket the first part's candidates go first, as
        // one thread would put them. Each part turns half of the buckets, the second starting
        // from the candidates in the first half.
        let half_b = buckets / parts;
        let my_buckets = if h == 0 { 0..half_b } else { half_b..buckets };
        // SAFETY: for the reads and writes through `count_slots` below, up to the barrier, each
        // part touches only the counts of its own buckets, in both parts' arrays.
        let (pa, pb) = (
            |x: usize| count_slots.at(x),
            |x: usize| count_slots.at(buckets * (parts - 1) + x),
        );
        // SAFETY: `x` is one of this part's buckets (< `buckets`), before the barrier.
        let in_bucket = |x: usize| unsafe { *pa(x) + if parts == 2 { *pb(x) } else { 0 } };
        totals[h]
            .set(my_buckets.clone().map(in_bucket).sum())
            .expect("each part totals once");
        barrier.wait();
        let mut acc = if h == 0 {
            0
        } else {
            *totals[0].get().expect("first part totalled")
        };
        // The first bucket whose start is at or past half the candidates (the first part finds
        // it up to `half_b` included): the second part's buckets start there.
        let half_n = (n / 2) as u32;
        let mut found = h == 1 && acc >= half_n;
        for x in my_buckets {
            if !found && acc >= half_n {
                found = true;
                let _ = mid.set(x);
            }
            // SAFETY: `x` is one of this part's buckets; no other part touches its counts.
            unsafe {
                let a = *pa(x);
                *pa(x) = acc;
                acc += a;
                if parts == 2 {
                    let b = *pb(x);
                    *pb(x) = acc;
                    acc += b;
                }
            }
        }
        if h == 0 && !found && acc >= half_n {
            let _ = mid.set(half_b);
        }
        barrier.wait();
        // The first part counted the inputs before `split`, the second those after it.
        let front = claims.lock().unwrap_or_else(|e| e.into_inner()).0;
        let split = (front * SCAN_CHUNK).min(n);
        let m = mid.get().copied().unwrap_or(buckets);
        let mine = match (parts, h) {
            (1, _) => 0..buckets,
            (_, 0) => 0..m,
            _ => m..buckets,
        };
        // SAFETY: every input's bucket was written before the first barrier.
        let of = unsafe { std::slice::from_raw_parts(of_slots.at(0), n) };
        let by = scatter_by.unwrap_or(if parts == 2 && front.min(chunks - front) * 3 < chunks {
            ScatterBy::Buckets
        } else {
            ScatterBy::Inputs
        });
        match by {
            ScatterBy::Inputs => {
                // Each part writes the candidates it counted, with its own cursors.
                let inputs = if h == 0 { 0..split } else { split..n };
                let base = h * buckets;
                for i in inputs {
                    let c = count_slots.at(base + of[i] as usize);
                    // SAFETY: the cursors of this part are its alone until the barrier; slot
                    // `*c` lies in bucket b's range, reserved for this part's candidates of
                    // bucket b by the counts; each is written once, by one thread, within
                    // `out`'s capacity n.
                    unsafe {
                        slots.at(*c as usize).write(candidate(i));
                        *c += 1;
                    }
                }
            }
            ScatterBy::Buckets => {
                // One part counted much more than the other (a thread that came late): each
                // part writes the candidates of its own buckets instead, reading every input
                // in order (the first part's counted inputs with the first part's cursors,
                // the rest with the second's) and writing an input of the other part's
                // buckets to a spare entry, without a branch on the data.
                let (first, len) = (mine.start as u32, (mine.end - mine.start) as u32);
                let mut spare_cursor = 0u32;
                let mut spare = std::mem::MaybeUninit::<PlanEntry>::uninit();
                for (i, &b) in of.iter().enumerate() {
                    let own = b.wrapping_sub(first) < len;
                    let c = match (own, i < split) {
                        (true, true) => pa(b as usize),
                        (true, false) => pb(b as usize),
                        (false, _) => &mut spare_cursor,
                    };
                    // SAFETY: `c` is a cursor of one of this part's buckets (no other thread
                    // touches those until the barrier) or the spare one, which stays 0; an
                    // own slot is written once, as above.
                    unsafe {
                        let to = if own {
                            slots.at(*c as usize)
                        } else {
                            spare.as_mut_ptr()
                        };
                        to.write(candidate(i));
                        *c += own as u32;
                    }
                }
            }
        }
        barrier.wait();
        // The last part's cursors now end the buckets.
        // SAFETY: no cursor moves after the barrier above.
        let ends =
            unsafe { std::slice::from_raw_parts(count_slots.at((parts - 1) * buckets), buckets) };
        let mut s = if mine.start == 0 {
            0
        } else {
            ends[mine.start - 1] as usize
        };
        for b in mine {
            let e = ends[b] as usize;
            // SAFETY: every slot was written before the barrier above; the buckets sorted here
            // are this thread's alone.
            let v = unsafe { std::slice::from_raw_parts_mut(slots.at(s), e - s) };
            if v.len() <= INSERTION_MAX {
                small_sort(v);
            } else {
                v.sort_by(by_rate_then_key);
            }
            s = e;
        }
    };
    if parts == 2 {
        pair::join(|| work(0), || work(1));
    } else {
        work(0);
    }
    let scan = match scan_input {
        None => None,
        Some(_) => {
            // SAFETY: every chunk was scanned.
            unsafe { scans.set_len(chunks) };
            Some(fold_scans(scans.into_iter())?.total_rate)
        }
    };
    // SAFETY: all n slots were written (the bucket counts sum to n): a bad rate returned
    // above, before the scatter could have left any unwritten.
    unsafe { out.set_len(n) };
    Ok(Sorted {
        cands: out,
        total_rate: scan,
        scratch,
    })
}

/// How the two parts of [`bucket_sorted`] share the scatter (the result is the same).
#[derive(Clone, Copy, Debug, PartialEq)]
enum ScatterBy {
    /// Each part writes the inputs it counted.
    Inputs,
    /// Each part writes the inputs of the buckets it sorts afterwards.
    Buckets,
}

/// What [`bucket_sorted`] returns: the candidates in admission order, the input's total rate
/// when the sort also scanned it, and the memory it used and no longer needs.
struct Sorted {
    cands: Vec<PlanEntry>,
    total_rate: Option<f64>,
    scratch: Vec<u32>,
}

/// Rates sampled by [`bucket_sorted`] for its bucket range and [`BucketMap`].
const SAMPLE: usize = 4096;

/// Where [`bucket_sorted`] puts a rate: buckets spread over the rates' IEEE bits as densely as
/// a sample of them lies. The range `lo..=hi` is cut into at most [`BucketMap::CELLS`] equal
/// cells of bit patterns; each cell gets a power of two of equal buckets, about as many as half
/// the keys the sample puts in it (at least one). A rate distribution that is dense in a few
/// octaves (many keys at low rates) thus still gets about two keys a bucket, where equal
/// buckets over the whole range would crowd the dense octaves and leave most buckets empty.
/// Rates outside `lo..=hi` go to the end buckets. Higher rates map to lower buckets.
struct BucketMap {
    lo: u64,
    hi: u64,
    /// A cell covers 2^cell_shift bit patterns.
    cell_shift: u32,
    /// Per cell: (index of its highest-rate bucket) << 6 | (shift of an offset in the cell to
    /// its bucket within the cell).
    cells: Vec<u32>,
    /// Number of buckets.
    buckets: usize,
}

impl BucketMap {
    const CELLS: usize = 1024;

    /// The map for rates in `lo..=hi` with `sample` (IEEE bits), aiming at `target` buckets.
    fn new(lo: u64, hi: u64, sample: impl Iterator<Item = u64>, target: usize) -> Self {
        let (lo, hi) = if lo > hi { (0, 0) } else { (lo, hi) };
        let span_bits = 64 - (hi - lo).leading_zeros();
        let cell_shift = span_bits.saturating_sub(Self::CELLS.trailing_zeros());
        let used = ((hi - lo) >> cell_shift) as usize + 1;
        let mut hits = vec![0u32; used];
        let mut taken = 0usize;
        for b in sample {
            hits[((b.clamp(lo, hi) - lo) >> cell_shift) as usize] += 1;
            taken += 1;
        }
        // Buckets per sampled key; each cell's count rounded to a power of two (the nearest,
        // in log terms), no finer than single bit patterns.
        let per_hit = target as f64 / taken.max(1) as f64;
        let mut first = 0usize;
        let mut cells = Vec::with_capacity(used);
        for &h in &hits {
            let want = h as f64 * per_hit;
            let p = if want > 1.0 {
                (want.log2().round() as u32).min(cell_shift)
            } else {
                0
            };
            cells.push((first, cell_shift - p));
            first += 1 << p;
        }
        let buckets = first;
        let cells = cells
            .into_iter()
            .map(|(f, sh)| ((buckets - 1 - f) as u32) << 6 | sh)
            .collect();
        BucketMap {
            lo,
            hi,
            cell_shift,
            cells,
            buckets,
        }
    }

    /// The bucket of a rate with IEEE bits `b`.
    #[inline]
    fn bucket(&self, b: u64) -> u32 {
        let d = b.clamp(self.lo, self.hi) - self.lo;
        let e = self.cells[(d >> self.cell_shift) as usize];
        let within = (d & ((1u64 << self.cell_shift) - 1)) >> (e & 63);
        (e >> 6) - within as u32
    }
}

/// A buffer's start while both threads of [`bucket_sorted`] write disjoint slots of it.
struct SharedSlots<T>(*mut T);
impl<T> Clone for SharedSlots<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedSlots<T> {}
impl<T> SharedSlots<T> {
    /// Slot `i` (a method, so closures capture the whole wrapper, not the bare pointer). Safe:
    /// it only computes the address; whoever dereferences it owes `i` < the buffer's capacity.
    fn at(self, i: usize) -> *mut T {
        self.0.wrapping_add(i)
    }
}
// SAFETY: the threads write disjoint slots, and read them only after a barrier.
unsafe impl<T> Send for SharedSlots<T> {}
// SAFETY: as for Send: disjoint writes, reads after a barrier.
unsafe impl<T> Sync for SharedSlots<T> {}

/// Whether `a` goes after `b` in admission order ([`by_rate_then_key`] is `Greater`), without
/// a branch.
#[inline]
fn goes_after(a: &PlanEntry, b: &PlanEntry) -> bool {
    let (ra, rb) = (a.rate.to_bits(), b.rate.to_bits());
    (ra < rb) | ((ra == rb) & (a.key > b.key))
}

/// Order `v[i]` and `v[i + 1]`, swapping them only if they are out of order (so equal ones
/// keep their order), with selects instead of a branch.
#[inline]
fn order_pair(v: &mut [PlanEntry], i: usize) {
    let (a, b) = (v[i], v[i + 1]);
    let swap = goes_after(&a, &b);
    let (lo, hi) = if swap { (b, a) } else { (a, b) };
    v[i] = lo;
    v[i + 1] = hi;
}

/// Sort the few entries of one bucket by [`by_rate_then_key`], stably: two or three by
/// exchanges of neighbours without branches on the data, more by insertion.
#[inline]
fn small_sort(v: &mut [PlanEntry]) {
    match v.len() {
        0 | 1 => {}
        2 => order_pair(v, 0),
        3 => {
            order_pair(v, 0);
            order_pair(v, 1);
            order_pair(v, 0);
        }
        _ => insertion_sort(v),
    }
}

/// Insertion sort by [`by_rate_then_key`] for the few entries of one bucket.
#[inline]
fn insertion_sort(v: &mut [PlanEntry]) {
    for i in 1..v.len() {
        let x = v[i];
        let mut j = i;
        while j > 0 && by_rate_then_key(&v[j - 1], &x) == Ordering::Greater {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
    }
}

/// Byte-aware admission: keys by decreasing value per slot (rate × prefix tokens per KV block
/// of its k_b copies).
fn admit_byte_aware(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    total_rate: f64,
    r_live: usize,
    inc: Incumbents,
) -> Admission {
    let budget = cfg.warm_slots.saturating_mul(r_live as u64);
    let kb_of = |k: &KeyLoad| {
        if cfg.replication {
            replicas_for(k.rate, cfg.q_cap, r_live)
        } else {
            1
        }
    };
    let dens = |i: u32| {
        let k = &keys[i as usize];
        inc.boost(k.key) * k.rate * k.prefix_tokens.max(0.0)
            / slot_cost(cfg, kb_of(k), k.prefix_tokens) as f64
    };
    // Ties by key hash, so the order never depends on input order.
    let mut idx: Vec<u32> = (0..keys.len() as u32).collect();
    idx.sort_unstable_by(|&a, &b| {
        dens(b)
            .total_cmp(&dens(a))
            .then_with(|| keys[a as usize].key.cmp(&keys[b as usize].key))
    });
    let mut used = 0u64;
    let mut entries = Vec::new();
    let mut admitted_rate = 0.0;
    for &i in &idx {
        let k = &keys[i as usize];
        if k.rate <= 0.0 {
            continue;
        }
        let kb = kb_of(k);
        let cost = slot_cost(cfg, kb, k.prefix_tokens);
        if used + cost <= budget {
            used += cost;
            entries.push(PlanEntry {
                key: k.key,
                rate: k.rate,
                input_index: i,
                k: kb as u16,
            });
            admitted_rate += k.rate;
            if used == budget {
                break;
            }
        }
    }
    placement_order(&mut entries);
    Admission {
        entries,
        slots_used: used,
        admitted_rate,
        total_rate,
        scratch: Vec::new(),
    }
}

/// Admitted keys are placed in decreasing (true) rate order, ties by key hash (LPT).
fn placement_order(entries: &mut [PlanEntry]) {
    entries.sort_unstable_by(|a, b| b.rate.total_cmp(&a.rate).then(a.key.cmp(&b.key)));
}

fn live_mask(r: usize, down: Option<&[bool]>) -> Vec<bool> {
    (0..r)
        .map(|d| down.and_then(|m| m.get(d).copied()).unwrap_or(false))
        .collect()
}

/// Hash placement for the ablation: k distinct destinations starting at the key's hash
/// position among the live destinations `live` (in index order).
fn hash_dests(key: u64, k: usize, live: &[u16], out: &mut Vec<u16>) {
    let start = (crate::rng::mix64(key) % live.len() as u64) as usize;
    for j in 0..k {
        out.push(live[(start + j) % live.len()]);
    }
}

/// [`Plan::starts`] for entries with these destination counts (empty when all are 1), and
/// their sum.
fn starts_of(ks: impl Iterator<Item = usize> + Clone) -> (Vec<u32>, usize) {
    if ks.clone().all(|k| k == 1) {
        return (Vec::new(), ks.count());
    }
    let mut total = 0usize;
    let starts = ks
        .map(|k| {
            let s = total as u32;
            total += k;
            s
        })
        .collect();
    (starts, total)
}

/// Build a fresh plan (Algorithm 1). `down` marks destinations to leave out.
pub fn build(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
) -> Result<Plan, PlanError> {
    build_with(cfg, keys, down, Incumbents::NONE)
}

fn build_with(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
    inc: Incumbents,
) -> Result<Plan, PlanError> {
    cfg.validate()?;
    if keys.len() >= PARALLEL_MIN {
        // The helper thread comes up while the input is validated.
        pair::start();
    }
    let r = cfg.destinations;
    let down = live_mask(r, down);
    let r_live = down.iter().filter(|d| !**d).count();
    if r_live == 0 {
        // A bad rate is reported first, as when there are live destinations.
        scan_keys(keys)?;
        return Err(PlanError::NoDestination);
    }
    let adm = admit(cfg, keys, r_live, inc)?;
    let cold = adm.total_rate - adm.admitted_rate;
    // +0 when nothing is left (never −0: placement compares loads as IEEE numbers).
    let cold = if cold > 0.0 { cold } else { 0.0 };
    let cold_per = cold / r_live as f64;
    let mut loads: Vec<f64> = down
        .iter()
        .map(|&d| if d { 0.0 } else { cold_per })
        .collect();
    let entries = adm.entries;
    // Slots are Σ k_b without byte-aware admission: as many as entries means every k_b = 1.
    let (starts, total_k) = if !cfg.byte_aware && adm.slots_used == entries.len() as u64 {
        (Vec::new(), entries.len())
    } else {
        starts_of(entries.iter().map(|e| e.k as usize))
    };
    let mut dests: Vec<u16> = Vec::with_capacity(total_k);
    let mut place = |entries: &[PlanEntry]| match cfg.placement {
        Placement::Lpt => {
            // Every load stays below this bound (the total rate, cold tail included).
            let bound = adm.total_rate + cold_per;
            lpt::place(entries, &mut dests, &mut loads, &down, bound);
        }
        Placement::Hash => {
            let live: Vec<u16> = (0..r as u16).filter(|&d| !down[d as usize]).collect();
            for e in entries {
                let share = e.rate / e.k as f64;
                let first = dests.len();
                hash_dests(e.key, e.k as usize, &live, &mut dests);
                for &d in &dests[first..] {
                    loads[d as usize] += share;
                }
            }
        }
    };
    // The dispatch index needs only the keys: on a large plan it is built on a second thread
    // while this one places (the plan is the same either way).
    let table = if entries.len() >= PARALLEL_MIN {
        let mut table = None;
        pair::join(
            || table = Some(PlanTable::new_in(&entries, adm.scratch)),
            || place(&entries),
        );
        table.expect("the index was built")
    } else {
        place(&entries);
        PlanTable::new_in(&entries, adm.scratch)
    };
    Ok(Plan {
        destinations: r,
        entries,
        dests,
        starts,
        loads,
        cold_tail_per_dest: cold_per,
        cold_tail_rate: cold,
        total_rate: adm.total_rate,
        slots_used: adm.slots_used,
        slot_budget: cfg.warm_slots.saturating_mul(r_live as u64),
        churn: None,
        down,
        fell_back_to_fresh: false,
        build_ms: 0.0,
        table,
    })
}

/// [`build`], recording construction time with the caller's clock (milliseconds).
pub fn build_timed(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    down: Option<&[bool]>,
    clock_ms: &mut dyn FnMut() -> f64,
) -> Result<Plan, PlanError> {
    let t0 = clock_ms();
    let mut p = build(cfg, keys, down)?;
    p.build_ms = clock_ms() - t0;
    Ok(p)
}

/// Fraction of `new`'s admitted keys whose destination set differs from `old`'s (a key not
/// admitted before counts as changed).
pub fn churn(old: &KeyMap<Vec<u16>>, new: &Plan) -> f64 {
    if new.entries.is_empty() {
        return 0.0;
    }
    let mut changed = 0usize;
    let mut buf: Vec<u16> = Vec::new();
    for i in 0..new.entries.len() {
        buf.clear();
        buf.extend_from_slice(new.dests_of(i));
        buf.sort_unstable();
        match old.get(&new.entries[i].key) {
            Some(prev) if *prev == buf => {}
            _ => changed += 1,
        }
    }
    changed as f64 / new.entries.len() as f64
}

/// Churn-aware replanning. Admission is the budget rule with previously admitted keys ordered
/// as if their rate were × (1 + `admission_hysteresis`) (0 = exactly a fresh plan's); placement keeps each key's
/// previous destinations where it can (adding or dropping replicas when k_b changed, the
/// least-loaded first), places new keys by LPT, and then moves as few keys as possible until
/// max/mean expected load is within `cfg.max_imbalance` × the fresh LPT plan's. If no such
/// plan is found, the fresh plan is returned with `fell_back_to_fresh` set. `churn` is set on
/// the result either way.
///
/// The placement and replication of `cfg` are kept: with [`Placement::Hash`] (the ablation
/// rows) a key's destinations are a function of its hash, k_b and the live destinations, so
/// the fresh hash plan (with the same admission hysteresis) already moves only keys whose k_b,
/// admission or live destinations changed, and it is returned as is: repairing it toward LPT
/// balance would turn the ablation row into the full planner. `max_imbalance` applies to LPT
/// placement only. With `replication` off every key keeps k_b = 1.
pub fn replan(
    cfg: &PlannerConfig,
    keys: &[KeyLoad],
    previous: &KeyMap<Vec<u16>>,
    down: Option<&[bool]>,
) -> Result<Plan, PlanError> {
    let prev_sets = previous;
    let inc = Incumbents {
        keys: Some(previous),
        hysteresis: cfg.admission_hysteresis,
    };
    if cfg.placement == Placement::Hash {
        let mut p = build_with(cfg, keys, down, inc)?;
        p.churn = Some(churn(prev_sets, &p));
        return Ok(p);
    }
    // The reference: a fresh LPT placement of the same admitted set.
    let mut fresh = build_with(cfg, keys, down, inc)?;
    let bound = fresh.imbalance() * cfg.max_imbalance;
    let r = cfg.destinations;
    let down_mask = fresh.down.clone();
    let r_live = down_mask.iter().filter(|d| !**d).count();

    // Per-entry destination sets, starting from the previous plan.
    let n = fresh.entries.len();
    let mut sets: Vec<Vec<u16>> = Vec::with_capacity(n);
    let mut loads: Vec<f64> = down_mask
        .iter()
        .map(|&d| if d { 0.0 } else { fresh.cold_tail_per_dest })
        .collect();
    let mut pending: Vec<usize> = Vec::new();
    for (i, e) in fresh.entries.iter().enumerate() {
        let share = e.rate / e.k as f64;
        let mut set: Vec<u16> = prev_sets
            .get(&e.key)
            .map(|s| {
                s.iter()
                    .copied()
                    .filter(|&d| (d as usize) < r && !down_mask[d as usize])
                    .collect()
            })
            .unwrap_or_default();
        if set.len() > e.k as usize {
            // Keep the k least-loaded of the previous destinations.
            set.sort_by(|&a, &b| {
                loads[a as usize]
                    .total_cmp(&loads[b as usize])
                    .then(a.cmp(&b))
            });
            set.truncate(e.k as usize);
        }
        if set.len() == e.k as usize {
            for &d in &set {
                loads[d as usize] += share;
            }
        } else {
            pending.push(i);
        }
        sets.push(set);
    }
    // New or grown keys: fill their missing destinations by LPT, in decreasing rate order.
    for &i in &pending {
        let e = fresh.entries[i];
        let share = e.rate / e.k as f64;
        let set = &mut sets[i];
        for &d in set.iter() {
            loads[d as usize] += share;
        }
        while set.len() < e.k as usize {
            let d = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)))
                .expect("k ≤ live destinations");
            set.push(d as u16);
            loads[d] += share;
        }
    }
    // Repair: move single replicas from the heaviest destination until within the bound.
    let mean = loads.iter().sum::<f64>() / r_live as f64;
    let mut on_dest: Vec<Vec<u32>> = vec![Vec::new(); r];
    for (i, s) in sets.iter().enumerate() {
        for &d in s {
            on_dest[d as usize].push(i as u32);
        }
    }
    let max_moves = n.saturating_mul(2).max(16);
    let mut moves = 0usize;
    let mut ok = true;
    while mean > 0.0 && max_over_mean(&loads, &down_mask) > bound * (1.0 + 1e-12) {
        if moves >= max_moves {
            ok = false;
            break;
        }
        let heavy = (0..r)
            .filter(|&d| !down_mask[d])
            .max_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(b.cmp(&a)))
            .unwrap();
        // The best move: the replica on `heavy` whose share is closest to half the gap to
        // the lightest destination it may move to.
        let mut best: Option<(f64, usize, usize)> = None; // (score, entry, to)
        for &ei in &on_dest[heavy] {
            let e = fresh.entries[ei as usize];
            let share = e.rate / e.k as f64;
            let set = &sets[ei as usize];
            let to = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)));
            let Some(to) = to else { continue };
            let gap = loads[heavy] - loads[to];
            if share >= gap {
                continue; // would not lower the pair's maximum
            }
            let score = (share - gap / 2.0).abs();
            if best.is_none_or(|b| score < b.0) {
                best = Some((score, ei as usize, to));
            }
        }
        if let Some((_, ei, to)) = best {
            let e = fresh.entries[ei];
            let share = e.rate / e.k as f64;
            let set = &mut sets[ei];
            let pos = set.iter().position(|&d| d as usize == heavy).unwrap();
            set[pos] = to as u16;
            loads[heavy] -= share;
            loads[to] += share;
            on_dest[heavy].retain(|&x| x as usize != ei);
            on_dest[to].push(ei as u32);
            moves += 1;
            continue;
        }
        // No single move lowers the maximum: try exchanging a replica on the heaviest
        // destination with a smaller one on one of the lightest (two keys move).
        let mut lights: Vec<usize> = (0..r).filter(|&d| !down_mask[d] && d != heavy).collect();
        lights.sort_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)));
        lights.truncate(3);
        let mut swap: Option<(f64, usize, usize, usize)> = None; // (score, a on heavy, b on light, light)
        for &l in &lights {
            let gap = loads[heavy] - loads[l];
            for &ea in &on_dest[heavy] {
                let a = fresh.entries[ea as usize];
                if sets[ea as usize].contains(&(l as u16)) {
                    continue;
                }
                let sa = a.rate / a.k as f64;
                for &eb in &on_dest[l] {
                    let b = fresh.entries[eb as usize];
                    if sets[eb as usize].contains(&(heavy as u16)) {
                        continue;
                    }
                    let delta = sa - b.rate / b.k as f64;
                    if delta <= 0.0 || delta >= gap {
                        continue;
                    }
                    let score = (delta - gap / 2.0).abs();
                    if swap.is_none_or(|s| score < s.0) {
                        swap = Some((score, ea as usize, eb as usize, l));
                    }
                }
            }
        }
        let Some((_, ea, eb, l)) = swap else {
            ok = false;
            break;
        };
        let (a, b) = (fresh.entries[ea], fresh.entries[eb]);
        let (sa, sb) = (a.rate / a.k as f64, b.rate / b.k as f64);
        let pa = sets[ea].iter().position(|&d| d as usize == heavy).unwrap();
        sets[ea][pa] = l as u16;
        let pb = sets[eb].iter().position(|&d| d as usize == l).unwrap();
        sets[eb][pb] = heavy as u16;
        loads[heavy] += sb - sa;
        loads[l] += sa - sb;
        on_dest[heavy].retain(|&x| x as usize != ea);
        on_dest[heavy].push(eb as u32);
        on_dest[l].retain(|&x| x as usize != eb);
        on_dest[l].push(ea as u32);
        moves += 2;
    }
    if !ok {
        fresh.churn = Some(churn(prev_sets, &fresh));
        fresh.fell_back_to_fresh = true;
        return Ok(fresh);
    }
    let mut dests = Vec::with_capacity(fresh.dests.len());
    for set in &sets {
        dests.extend_from_slice(set);
    }
    fresh.starts = starts_of(sets.iter().map(|s| s.len())).0;
    fresh.dests = dests;
    fresh.loads = loads;
    fresh.churn = Some(churn(prev_sets, &fresh));
    Ok(fresh.index())
}

/// Plan repair when destinations go down: only keys that held a removed destination move
/// (their lost replicas go to the least-loaded live destinations not already in the set), and
/// the cold tail is spread over the remaining live destinations. Admission is unchanged.
pub fn repair(plan: &Plan, down: &[bool]) -> Result<Plan, PlanError> {
    let r = plan.destinations;
    let down_mask: Vec<bool> = (0..r)
        .map(|d| down.get(d).copied().unwrap_or(false) || plan.down[d])
        .collect();
    let r_live = down_mask.iter().filter(|d| !**d).count();
    if r_live == 0 {
        return Err(PlanError::NoDestination);
    }
    let cold_per = plan.cold_tail_rate / r_live as f64;
    let mut loads: Vec<f64> = down_mask
        .iter()
        .map(|&d| if d { 0.0 } else { cold_per })
        .collect();
    let mut out = plan.clone();
    let mut lost: Vec<usize> = Vec::new();
    for i in 0..out.entries.len() {
        let e = out.entries[i];
        let share = e.rate / e.k as f64;
        let ds = out.dests_of(i);
        if ds.iter().any(|&d| down_mask[d as usize]) {
            lost.push(i);
        }
        for &d in ds {
            if !down_mask[d as usize] {
                loads[d as usize] += share;
            }
        }
    }
    for &i in &lost {
        let e = out.entries[i];
        let share = e.rate / e.k as f64;
        let range = out.start_of(i)..out.start_of(i) + e.k as usize;
        let mut set: Vec<u16> = out.dests[range.clone()]
            .iter()
            .copied()
            .filter(|&d| !down_mask[d as usize])
            .collect();
        let kept = set.len();
        // If fewer live destinations remain than k, the key keeps what it can.
        let want = (e.k as usize).min(r_live);
        while set.len() < want {
            let d = (0..r)
                .filter(|&d| !down_mask[d] && !set.contains(&(d as u16)))
                .min_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)))
                .expect("want ≤ live");
            set.push(d as u16);
        }
        // Charge the new share: rate split over the final set size.
        let new_share = e.rate / set.len() as f64;
        for (j, &d) in set.iter().enumerate() {
            if j < kept {
                loads[d as usize] += new_share - share;
            } else {
                loads[d as usize] += new_share;
            }
        }
        // Keep the flat layout: pad with the first destination when the set shrank.
        for (slot, j) in range.clone().zip(0..) {
            out.dests[slot] = set[j.min(set.len() - 1)];
        }
        out.entries[i].k = set.len() as u16;
    }
    out.loads = loads;
    out.cold_tail_per_dest = cold_per;
    out.down = down_mask;
    out.slot_budget = (plan.slot_budget
        / (plan.down.iter().filter(|d| !**d).count() as u64).max(1))
        * r_live as u64;
    Ok(out)
}

#[cfg(test)]
mod tests;
