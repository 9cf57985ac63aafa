//! The one random number generator type used by pure logic, and the hashing helpers built on
//! the same mixer (splitmix64: [`mix64`], [`IdHasher`]). Callers pass it in, seeded, so
//! every run is reproducible; nothing in the crate draws from a global or OS RNG.

use rand::RngExt;
use rand_core::SeedableRng;

/// Portable, fast, stable-across-platforms generator (PCG 64-bit MCG).
pub type Rng64 = rand_pcg::Pcg64Mcg;

/// A generator from a 64-bit seed.
pub fn seeded(seed: u64) -> Rng64 {
    Rng64::seed_from_u64(seed)
}

/// Derive an independent stream from a seed and a label (e.g. per policy, per destination),
/// so adding one consumer never shifts another's random numbers.
pub fn derive(seed: u64, label: &str) -> Rng64 {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(label.as_bytes(), seed);
    Rng64::seed_from_u64(h)
}

/// splitmix64 finalizer: a cheap, well-mixed 64-bit bijection.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Vose's alias table: O(n) build, O(1) sampling of an index with probability ∝ weight.
#[derive(Debug, Clone)]
pub struct Alias {
    prob: Vec<f64>,
    alias: Vec<u32>,
}

impl Alias {
    pub fn new(weights: &[f64]) -> Self {
        let n = weights.len().max(1);
        let sum: f64 = weights.iter().sum();
        let mut prob: Vec<f64> = if sum > 0.0 {
            weights.iter().map(|w| w * n as f64 / sum).collect()
        } else {
            vec![1.0; n]
        };
        prob.resize(n, 1.0);
        let mut alias = vec![0u32; n];
        let (mut small, mut large): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for (i, p) in prob.iter().enumerate() {
            if *p < 1.0 {
                small.push(i as u32)
            } else {
                large.push(i as u32)
            }
        }
        while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
            small.pop();
            alias[s as usize] = l;
            prob[l as usize] -= 1.0 - prob[s as usize];
            if prob[l as usize] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        for i in small.into_iter().chain(large) {
            prob[i as usize] = 1.0;
        }
        Alias { prob, alias }
    }

    #[inline]
    pub fn sample(&self, rng: &mut Rng64) -> usize {
        let i = rng.random_range(0..self.prob.len());
        if rng.random::<f64>() < self.prob[i] {
            i
        } else {
            self.alias[i] as usize
        }
    }
}

/// A fast hasher for block ids (splitmix64 finalizer; ids may be small sequential ints).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        crate::rng::mix64(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        // FxHash-style over 8-byte words (keys, e.g. per-key counts); `finish` mixes.
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517C_C1B7_2722_0A95);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517C_C1B7_2722_0A95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = crate::rng::mix64(self.0 ^ v);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64 ^ 0x1_0000_0000_0000);
    }
}
