//! Flat-LB: power-of-two-choices on outstanding requests at the router (cache-blind).
//! Two distinct live destinations sampled uniformly with the seeded RNG; the one with fewer
//! outstanding requests wins; ties go to the first sample.

use super::{p2c, FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;

/// Power-of-two-choices.
#[derive(Debug, Default, Clone)]
pub struct FlatLb;

impl Policy for FlatLb {
    fn name(&self) -> &'static str {
        "flat-lb"
    }
    fn choose(
        &mut self,
        _req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        p2c(fleet, rng)
    }
}
