//! A consistent-hash ring with virtual nodes (Karger et al. 1997), shared by Sticky, CHWBL
//! and DualMap. Points are xxh3 hashes of (destination, vnode) under a seed, so two rings
//! with different seeds are independent. Destinations are identified by their index.

use xxhash_rust::xxh3::xxh3_64_with_seed;

pub use crate::rng::mix64;

/// A ring of `(point, destination)` sorted by point.
#[derive(Debug, Clone)]
pub struct Ring {
    points: Vec<u64>,
    owners: Vec<u16>,
    seed: u64,
    destinations: usize,
}

impl Ring {
    /// A ring over destinations `0..n` with `vnodes` virtual nodes each.
    pub fn new(n: usize, vnodes: u32, seed: u64) -> Self {
        let vnodes = vnodes.max(1);
        let mut pts: Vec<(u64, u16)> = Vec::with_capacity(n * vnodes as usize);
        for d in 0..n {
            for v in 0..vnodes {
                let mut buf = [0u8; 12];
                buf[..8].copy_from_slice(&(d as u64).to_le_bytes());
                buf[8..].copy_from_slice(&v.to_le_bytes());
                pts.push((xxh3_64_with_seed(&buf, seed), d as u16));
            }
        }
        pts.sort_unstable();
        Self {
            points: pts.iter().map(|p| p.0).collect(),
            owners: pts.iter().map(|p| p.1).collect(),
            seed,
            destinations: n,
        }
    }

    /// Number of destinations on the ring.
    pub fn destinations(&self) -> usize {
        self.destinations
    }

    /// Position of a key on the ring.
    #[inline]
    pub fn point_of(&self, key: u64) -> u64 {
        mix64(key ^ self.seed)
    }

    /// Index of the first virtual node clockwise from `key`'s point.
    #[inline]
    pub fn start(&self, key: u64) -> usize {
        let p = self.point_of(key);
        let i = self.points.partition_point(|&x| x < p);
        if i == self.points.len() {
            0
        } else {
            i
        }
    }

    /// Destinations clockwise from `key`, each at most once, starting with the key's owner.
    pub fn walk(&self, key: u64) -> RingWalk<'_> {
        RingWalk {
            ring: self,
            pos: self.start(key),
            steps: 0,
            seen: [0u64; 4],
            seen_vec: Vec::new(),
            yielded: 0,
        }
    }
}

/// Iterator over distinct destinations clockwise on the ring.
pub struct RingWalk<'a> {
    ring: &'a Ring,
    pos: usize,
    steps: usize,
    seen: [u64; 4],
    seen_vec: Vec<bool>,
    yielded: usize,
}

impl RingWalk<'_> {
    #[inline]
    fn mark(&mut self, d: usize) -> bool {
        if d < 256 {
            let (w, b) = (d / 64, d % 64);
            let fresh = self.seen[w] & (1 << b) == 0;
            self.seen[w] |= 1 << b;
            fresh
        } else {
            if self.seen_vec.is_empty() {
                self.seen_vec = vec![false; self.ring.destinations];
            }
            let fresh = !self.seen_vec[d];
            self.seen_vec[d] = true;
            fresh
        }
    }
}

impl Iterator for RingWalk<'_> {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        let n = self.ring.points.len();
        while self.yielded < self.ring.destinations && self.steps < n {
            let d = self.ring.owners[self.pos] as usize;
            self.pos += 1;
            if self.pos == n {
                self.pos = 0;
            }
            self.steps += 1;
            if self.mark(d) {
                self.yielded += 1;
                return Some(d);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_visits_every_destination_once() {
        let r = Ring::new(7, 50, 1);
        let mut v: Vec<usize> = r.walk(12345).collect();
        assert_eq!(v.len(), 7);
        v.sort();
        assert_eq!(v, (0..7).collect::<Vec<_>>());
        let r = Ring::new(300, 4, 1);
        let mut v: Vec<usize> = r.walk(99).collect();
        v.sort();
        assert_eq!(v, (0..300).collect::<Vec<_>>());
    }

    #[test]
    fn seeds_give_independent_rings() {
        let a = Ring::new(30, 160, 1);
        let b = Ring::new(30, 160, 2);
        let same = (0..2000u64)
            .filter(|&k| a.walk(mix64(k)).next() == b.walk(mix64(k)).next())
            .count();
        // Independent owners agree about 1/30 of the time.
        assert!(same < 200, "{same}");
    }
}
