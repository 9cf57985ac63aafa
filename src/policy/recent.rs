//! Bounded, approximately-LRU memories of recently seen block hashes: two generations of hash
//! maps; when the young one fills half the capacity it becomes the old one. Presence means
//! "seen within roughly the last `capacity` insertions". O(1) per operation, memory bounded.
//! [`RecentBlocks`]: a router's estimate of what a destination's prefix cache holds;
//! [`RecentMap`]: where a block was last sent (CacheRoute's conversation memory).

use crate::plan::KeyMap;

/// Two-generation recent map: a block hash → the value it was last recorded with.
#[derive(Debug, Clone)]
pub struct RecentMap<V> {
    young: KeyMap<V>,
    old: KeyMap<V>,
    half: usize,
}

impl<V: Copy> RecentMap<V> {
    pub fn new(capacity: usize) -> Self {
        Self {
            young: KeyMap::default(),
            old: KeyMap::default(),
            half: (capacity / 2).max(1),
        }
    }

    /// The value `h` was last recorded with, if recently.
    #[inline]
    pub fn get(&self, h: u64) -> Option<V> {
        self.young.get(&h).or_else(|| self.old.get(&h)).copied()
    }

    /// Record `h` with `v` now.
    #[inline]
    pub fn insert(&mut self, h: u64, v: V) {
        if self.young.insert(h, v).is_none() && self.young.len() >= self.half {
            self.old = std::mem::take(&mut self.young);
        }
    }

    /// Entries held (both generations; a hash in both counts twice).
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Two-generation recent set.
#[derive(Debug, Clone)]
pub struct RecentBlocks(RecentMap<()>);

impl RecentBlocks {
    pub fn new(capacity: usize) -> Self {
        Self(RecentMap::new(capacity))
    }

    /// Whether `h` was seen recently.
    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        self.0.get(h).is_some()
    }

    /// Record `h` as seen now.
    #[inline]
    pub fn touch(&mut self, h: u64) {
        self.0.insert(h, ());
    }

    /// Number of leading blocks of `blocks` present.
    pub fn matched_prefix(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|&&h| self.contains(h)).count()
    }

    /// Entries held (both generations).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn bounded_and_recent() {
        let mut r = RecentBlocks::new(100);
        for h in 0..1000u64 {
            r.touch(h);
        }
        assert!(r.len() <= 100);
        assert!(r.contains(999));
        assert!(!r.contains(0));
        assert_eq!(r.matched_prefix(&[999, 998, 5]), 2);
    }
}
