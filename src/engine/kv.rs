//! The paged KV block pool and prefix cache of one replica. Pure data structure, O(1) per
//! operation.
//!
//! Blocks are counted, not named: a running request holds a number of *private* blocks plus
//! references to *cached units*. A unit is `blocks_per_unit` blocks holding one whole cache unit
//! of a prompt (lcm of the KV block size and the trace's hash block), keyed by the chain hash of
//! the prompt up to its end. Units with no reference sit in an LRU list (an intrusive doubly
//! linked list over a slab) and are evicted, least recently released first, only when an
//! allocation needs their blocks. A referenced unit is never evicted.
//!
//! On request ([`PrefixCache::record_changes`]) the cache also logs what it stores and evicts,
//! as an engine's KV-cache events do ([`CacheChange`], named by the trace's chain hashes); off,
//! the hot path pays one branch per unit stored or evicted.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const NIL: u32 = u32::MAX;

/// A cheap hasher for u64 keys that are already hashes (chain hashes); still mixes, so small
/// integer keys spread too.
#[derive(Default, Clone, Copy)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        let h = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

type U64Map<V> = HashMap<u64, V, BuildHasherDefault<U64Hasher>>;

#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// One change of the cached units, named by the chain hashes of the trace's hash blocks they
/// hold (a unit holds `stride` of them, in prefix order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheChange {
    /// Units now cached: `hashes[0]` follows `parent` (`None`: the prompt's first block).
    /// Consecutive units of one prompt stored together are one change.
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    /// Units evicted (consecutive evictions are one change).
    Removed { hashes: Vec<u64> },
}

/// The change log of a recording cache.
#[derive(Debug, Clone, Default)]
struct ChangeLog {
    /// Hash blocks per unit.
    stride: usize,
    /// The hash blocks of the unit in each slot (`stride` per slot), when `stride` > 1 (with
    /// one, the unit's own hash is its only hash block).
    slot_hashes: Vec<u64>,
    changes: Vec<CacheChange>,
}

/// Block pool + prefix cache.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    blocks_per_unit: u32,
    total: u32,
    free: u32,
    entries: Vec<Entry>,
    vacant: Vec<u32>,
    map: U64Map<u32>,
    /// Least recently released unreferenced unit (evicted first).
    head: u32,
    /// Most recently released unreferenced unit.
    tail: u32,
    lru_len: u32,
    evicted_units: u64,
    /// Stores and evictions, when recording.
    log: Option<Box<ChangeLog>>,
}

impl PrefixCache {
    /// A pool of `total_blocks` blocks whose cached units are `blocks_per_unit` blocks each.
    pub fn new(total_blocks: u32, blocks_per_unit: u32) -> PrefixCache {
        assert!(blocks_per_unit >= 1);
        // Sized for a full cache up front: no rehashing on the hot path.
        let units = (total_blocks / blocks_per_unit) as usize;
        PrefixCache {
            blocks_per_unit,
            total: total_blocks,
            free: total_blocks,
            entries: Vec::with_capacity(units),
            vacant: Vec::new(),
            map: U64Map::with_capacity_and_hasher(units, Default::default()),
            head: NIL,
            tail: NIL,
            lru_len: 0,
            evicted_units: 0,
            log: None,
        }
    }

    /// Log every unit stored ([`PrefixCache::note_stored`]) and evicted from now on, each unit
    /// named by its `stride` hash blocks (≥ 1).
    pub fn record_changes(&mut self, stride: u32) {
        self.log = Some(Box::new(ChangeLog {
            stride: stride.max(1) as usize,
            ..Default::default()
        }));
    }

    /// Whether changes are logged.
    #[inline]
    pub fn recording(&self) -> bool {
        self.log.is_some()
    }

    /// Log that the unit [`PrefixCache::insert`] just put in slot `unit` holds `hashes` (its
    /// `stride` hash blocks, `hashes[0]` following `parent`). No-op when not recording.
    pub fn note_stored(&mut self, unit: u32, parent: Option<u64>, hashes: &[u64]) {
        let Some(log) = self.log.as_deref_mut() else {
            return;
        };
        debug_assert_eq!(hashes.len(), log.stride);
        if log.stride > 1 {
            let at = unit as usize * log.stride;
            if log.slot_hashes.len() < at + log.stride {
                log.slot_hashes.resize(at + log.stride, 0);
            }
            log.slot_hashes[at..at + log.stride].copy_from_slice(hashes);
        }
        if let Some(CacheChange::Stored { hashes: last, .. }) = log.changes.last_mut() {
            if parent.is_some() && last.last().copied() == parent {
                last.extend_from_slice(hashes);
                return;
            }
        }
        log.changes.push(CacheChange::Stored {
            parent,
            hashes: hashes.to_vec(),
        });
    }

    /// Move the logged changes, oldest first, to the end of `out`.
    pub fn drain_changes(&mut self, out: &mut Vec<CacheChange>) {
        if let Some(log) = self.log.as_deref_mut() {
            out.append(&mut log.changes);
        }
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> u32 {
        self.total
    }
    /// Blocks per cached unit.
    pub fn blocks_per_unit(&self) -> u32 {
        self.blocks_per_unit
    }
    /// Blocks holding nothing.
    pub fn free_blocks(&self) -> u32 {
        self.free
    }
    /// Blocks in unreferenced cached units (reclaimable by eviction).
    pub fn evictable_blocks(&self) -> u32 {
        self.lru_len * self.blocks_per_unit
    }
    /// Blocks an allocation can get: free + evictable.
    pub fn available_blocks(&self) -> u32 {
        self.free + self.evictable_blocks()
    }
    /// Blocks held by running requests (what vLLM's `kv_cache_usage_perc` counts).
    pub fn used_blocks(&self) -> u32 {
        self.total - self.available_blocks()
    }
    /// Cached units (referenced or not).
    pub fn cached_units(&self) -> usize {
        self.map.len()
    }
    /// Units evicted so far.
    pub fn evicted_units(&self) -> u64 {
        self.evicted_units
    }

    /// The unit cached under `hash`, without touching its recency.
    #[inline]
    pub fn lookup(&self, hash: u64) -> Option<u32> {
        self.map.get(&hash).copied()
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// References to a unit.
    #[inline]
    pub fn refs(&self, unit: u32) -> u32 {
        self.entries[unit as usize].refs
    }

    /// Take a reference (a request now uses the unit); leaves the LRU list if it was there.
    #[inline]
    pub fn acquire(&mut self, unit: u32) {
        if self.entries[unit as usize].refs == 0 {
            self.unlink(unit);
        }
        self.entries[unit as usize].refs += 1;
    }

    /// Drop a reference; at zero the unit becomes the most recently used evictable unit.
    #[inline]
    pub fn release(&mut self, unit: u32) {
        let e = &mut self.entries[unit as usize];
        debug_assert!(e.refs > 0);
        e.refs -= 1;
        if e.refs == 0 {
            self.push_tail(unit);
        }
    }

    /// Allocate `n` private blocks, evicting least recently used unreferenced units as needed.
    /// Returns false (and changes nothing) when even eviction cannot free enough.
    #[inline]
    pub fn try_alloc(&mut self, n: u32) -> bool {
        if n > self.available_blocks() {
            return false;
        }
        while self.free < n {
            self.evict_lru();
        }
        self.free -= n;
        true
    }

    /// Return `n` private blocks to the free pool.
    #[inline]
    pub fn free(&mut self, n: u32) {
        self.free += n;
        debug_assert!(self.free + self.evictable_blocks() <= self.total);
    }

    /// Turn `blocks_per_unit` private blocks of the caller into a cached unit under `hash`, with
    /// one reference (the caller's). Returns `None` if `hash` is already cached (the caller keeps
    /// its blocks private or uses the existing unit).
    pub fn insert(&mut self, hash: u64) -> Option<u32> {
        if self.map.contains_key(&hash) {
            return None;
        }
        let e = Entry {
            hash,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        let idx = match self.vacant.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        };
        self.map.insert(hash, idx);
        Some(idx)
    }

    /// Evict every unreferenced unit (vLLM's prefix-cache reset; units in use stay). Returns the
    /// number of units dropped.
    pub fn clear_unreferenced(&mut self) -> u32 {
        let n = self.lru_len;
        while self.head != NIL {
            self.evict_lru();
        }
        n
    }

    fn evict_lru(&mut self) {
        let idx = self.head;
        debug_assert!(idx != NIL);
        self.unlink(idx);
        let hash = self.entries[idx as usize].hash;
        if let Some(log) = self.log.as_deref_mut() {
            let hashes = if log.stride > 1 {
                let at = idx as usize * log.stride;
                &log.slot_hashes[at..at + log.stride]
            } else {
                std::slice::from_ref(&hash)
            };
            match log.changes.last_mut() {
                Some(CacheChange::Removed { hashes: last }) => last.extend_from_slice(hashes),
                _ => log.changes.push(CacheChange::Removed {
                    hashes: hashes.to_vec(),
                }),
            }
        }
        self.map.remove(&hash);
        self.vacant.push(idx);
        self.free += self.blocks_per_unit;
        self.evicted_units += 1;
    }

    fn unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let e = &self.entries[idx as usize];
            (e.prev, e.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        let e = &mut self.entries[idx as usize];
        e.prev = NIL;
        e.next = NIL;
        self.lru_len -= 1;
    }

    fn push_tail(&mut self, idx: u32) {
        let tail = self.tail;
        {
            let e = &mut self.entries[idx as usize];
            e.prev = tail;
            e.next = NIL;
        }
        if tail == NIL {
            self.head = idx;
        } else {
            self.entries[tail as usize].next = idx;
        }
        self.tail = idx;
        self.lru_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cache `hashes` as units the way a finished request leaves them: allocate, insert, release.
    fn cache_units(c: &mut PrefixCache, hashes: &[u64]) -> Vec<u32> {
        let ids: Vec<u32> = hashes
            .iter()
            .map(|&h| {
                assert!(c.try_alloc(c.blocks_per_unit()));
                c.insert(h).unwrap()
            })
            .collect();
        for &i in &ids {
            c.release(i);
        }
        ids
    }

    #[test]
    fn lru_evicts_least_recently_used_unreferenced_and_never_a_referenced_unit() {
        let mut c = PrefixCache::new(4, 1);
        let ids = cache_units(&mut c, &[10, 20, 30, 40]);
        assert_eq!((c.free_blocks(), c.evictable_blocks()), (0, 4));
        // Touch 10 (a hit): acquire then release makes it most recent.
        c.acquire(ids[0]);
        c.release(ids[0]);
        // Hold 20 (a running request references it).
        c.acquire(ids[1]);
        // Two blocks needed: evicts 30 then 40 (oldest unreferenced); 20 is skipped although it
        // is older, 10 was touched.
        assert!(c.try_alloc(2));
        assert!(!c.contains(30) && !c.contains(40));
        assert!(c.contains(10) && c.contains(20));
        // One more: 10 is the only evictable unit.
        assert!(c.try_alloc(1));
        assert!(!c.contains(10) && c.contains(20));
        // Nothing left but the referenced unit: allocation fails and changes nothing.
        assert!(!c.try_alloc(1));
        assert!(c.contains(20));
        assert_eq!(c.used_blocks(), 4);
        c.release(ids[1]);
        assert_eq!(c.clear_unreferenced(), 1);
        c.free(3);
        assert_eq!(c.free_blocks(), 4);
        assert_eq!(c.cached_units(), 0);
    }

    #[test]
    fn multi_block_units_free_all_their_blocks() {
        let mut c = PrefixCache::new(10, 4);
        cache_units(&mut c, &[1, 2]);
        assert_eq!((c.free_blocks(), c.available_blocks()), (2, 10));
        assert!(c.try_alloc(5)); // evicts unit 1 only
        assert!(!c.contains(1) && c.contains(2));
        assert_eq!(c.free_blocks(), 1);
        assert_eq!(c.insert(2), None);
    }
}
