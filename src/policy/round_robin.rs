//! Round robin: each request to the next destination that is up, in index order (cache-blind,
//! load-blind). A study puts it in front of several router replicas (`router_replicas`), as
//! the simulator's front sends request i to replica i mod N.

use super::{FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;

/// The next destination in turn; down destinations are skipped.
#[derive(Debug, Default, Clone)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }
    fn choose(
        &mut self,
        _req: &RouteRequest,
        fleet: &dyn FleetView,
        _rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        let n = fleet.len();
        for i in 0..n {
            let d = (self.next + i) % n;
            if fleet.is_up(d) {
                self.next = (d + 1) % n;
                return Ok(d);
            }
        }
        Err(RouteError::NoneUp(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FleetState;

    fn req() -> RouteRequest<'static> {
        RouteRequest {
            key: 1,
            blocks: &[],
            block_tokens: 64,
            prompt_tokens: 10,
            output_tokens: 1,
            now: 0.0,
        }
    }

    #[test]
    fn each_up_destination_in_turn_and_none_up_is_an_error() {
        let mut p = RoundRobin::default();
        let mut rng = crate::rng::seeded(1);
        let mut pick = |f: &FleetState| p.choose(&req(), f, &mut rng);
        let fleet = |up: Vec<bool>| FleetState {
            outstanding: vec![0; up.len()],
            queued_prefill: vec![0; up.len()],
            up,
        };
        let all = fleet(vec![true; 3]);
        let got: Vec<usize> = (0..7).map(|_| pick(&all).unwrap()).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2, 0]);
        // Destination 2 down: skipped, the turn goes on from where it was.
        let one_down = fleet(vec![true, true, false]);
        let got: Vec<usize> = (0..4).map(|_| pick(&one_down).unwrap()).collect();
        assert_eq!(got, [1, 0, 1, 0]);
        assert_eq!(pick(&fleet(vec![false, false])), Err(RouteError::NoneUp(2)));
        assert_eq!(pick(&fleet(vec![])), Err(RouteError::NoneUp(0)));
    }
}
