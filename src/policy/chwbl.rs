//! CHWBL: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).
//! Capacity per destination = ⌈(1 + ε)·(total in-flight + 1) / R_live⌉; walk the ring clockwise
//! from the key's point and take the first live destination whose in-flight count is below
//! capacity. With exact counts and ε > 0 one always qualifies; if none does (stale counts),
//! fall back to the least loaded. ε = 0.25 by default (HAProxy hash-balance-factor 125).

use super::ring::Ring;
use super::{least_loaded_of, FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;

/// Consistent hashing with bounded loads.
#[derive(Debug, Clone)]
pub struct Chwbl {
    ring: Ring,
    epsilon: f64,
}

impl Chwbl {
    pub fn new(destinations: usize, vnodes: u32, epsilon: f64, seed: u64) -> Self {
        Self {
            ring: Ring::new(destinations, vnodes, seed),
            epsilon: epsilon.max(0.0),
        }
    }

    /// The bound for the current fleet state.
    pub fn capacity(&self, fleet: &dyn FleetView) -> u32 {
        let mut total = 0u64;
        let mut live = 0u64;
        for d in 0..fleet.len() {
            if fleet.is_up(d) {
                total += fleet.outstanding(d) as u64;
                live += 1;
            }
        }
        if live == 0 {
            return 0;
        }
        request_bound(total, live, self.epsilon) as u32
    }
}

/// CHWBL's bound on in-flight requests: ⌈(1 + ε)·(total + 1) / live⌉ (`live` ≥ 1). Shared
/// with CacheRoute's bounded cold tail.
pub fn request_bound(total: u64, live: u64, epsilon: f64) -> f64 {
    ((1.0 + epsilon) * (total + 1) as f64 / live as f64).ceil()
}

impl Policy for Chwbl {
    fn name(&self) -> &'static str {
        "chwbl"
    }
    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        _rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        let cap = self.capacity(fleet);
        if let Some(d) = self
            .ring
            .walk(req.key)
            .find(|&d| d < fleet.len() && fleet.is_up(d) && fleet.outstanding(d) < cap)
        {
            return Ok(d);
        }
        least_loaded_of(0..fleet.len(), fleet).ok_or(RouteError::NoneUp(fleet.len()))
    }
}
