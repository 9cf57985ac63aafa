//! Sticky: consistent hashing of the routing key on a ring with virtual nodes (Karger 1997).
//! Key → first virtual node clockwise → destination; down destinations are skipped by walking
//! on. Load-blind by design: the pure-affinity baseline.

use super::ring::Ring;
use super::{FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;

/// Consistent hashing.
#[derive(Debug, Clone)]
pub struct Sticky {
    ring: Ring,
}

impl Sticky {
    pub fn new(destinations: usize, vnodes: u32, seed: u64) -> Self {
        Self {
            ring: Ring::new(destinations, vnodes, seed),
        }
    }
}

impl Policy for Sticky {
    fn name(&self) -> &'static str {
        "sticky"
    }
    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        _rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        self.ring
            .walk(req.key)
            .find(|&d| d < fleet.len() && fleet.is_up(d))
            .ok_or(RouteError::NoneUp(fleet.len()))
    }
}
