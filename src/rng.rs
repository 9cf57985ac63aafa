//! The one random number generator type used by pure logic. Callers pass it in, seeded, so
//! every run is reproducible; nothing in the crate draws from a global or OS RNG.

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
