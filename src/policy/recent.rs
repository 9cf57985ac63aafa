//! A bounded, approximately-LRU set of recently seen block hashes: two generations of hash
//! sets; when the young one fills half the capacity it becomes the old one. Membership means
//! "seen within roughly the last `capacity` insertions". O(1) per operation, memory bounded —
//! a router's estimate of what a destination's prefix cache holds.

use crate::plan::KeyMap;

/// Two-generation recent set.
#[derive(Debug, Clone)]
pub struct RecentBlocks {
    young: KeyMap<()>,
    old: KeyMap<()>,
    half: usize,
}

impl RecentBlocks {
    pub fn new(capacity: usize) -> Self {
        Self {
            young: KeyMap::default(),
            old: KeyMap::default(),
            half: (capacity / 2).max(1),
        }
    }

    /// Whether `h` was seen recently.
    #[inline]
    pub fn contains(&self, h: u64) -> bool {
        self.young.contains_key(&h) || self.old.contains_key(&h)
    }

    /// Record `h` as seen now.
    #[inline]
    pub fn touch(&mut self, h: u64) {
        if self.young.insert(h, ()).is_none() && self.young.len() >= self.half {
            self.old = std::mem::take(&mut self.young);
        }
    }

    /// Number of leading blocks of `blocks` present.
    pub fn matched_prefix(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|&&h| self.contains(h)).count()
    }

    /// Entries held (both generations).
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
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
