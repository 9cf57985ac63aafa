//! DualMap (Yuan et al. 2026): two independent seeded hash rings over the key give two
//! candidates. Prefer the first (cache-affinity) candidate; switch to the second when the
//! first's expected TTFT would break the SLO and the second's is lower.
//!
//! Expected TTFT at destination d ≈ (queued prefill tokens at d + this request's uncached
//! tokens at d) / prefill throughput. Queued prefill tokens are the router's own count (prompt
//! tokens sent to d whose first token has not come back). Uncached tokens are estimated from a
//! bounded recent-block set per destination (what the router sent there lately).
//!
//! Left out of the original: hotspot-aware batch migration of queued requests between the two
//! candidates and dual-ring scaling; they need engine-side request migration.

use super::recent::RecentBlocks;
use super::ring::Ring;
use super::{FleetView, Policy, RouteError, RouteRequest};
use crate::rng::Rng64;
use serde::{Deserialize, Serialize};

/// DualMap parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DualMapConfig {
    /// TTFT objective in seconds above which the second candidate is considered.
    pub slo_ttft_s: f64,
    /// Prefill throughput of one destination, tokens/s (the simulator sets it from the engine
    /// model when left at 0).
    pub prefill_tokens_per_s: f64,
    /// Virtual nodes per destination on each ring.
    pub vnodes: u32,
    /// Blocks remembered per destination for the cached-prefix estimate.
    pub recent_blocks: usize,
}

impl Default for DualMapConfig {
    fn default() -> Self {
        Self {
            slo_ttft_s: 2.0,
            prefill_tokens_per_s: 0.0,
            vnodes: 160,
            recent_blocks: 65_536,
        }
    }
}

/// Two-ring, SLO-aware affinity routing.
#[derive(Debug, Clone)]
pub struct DualMap {
    cfg: DualMapConfig,
    first: Ring,
    second: Ring,
    recent: Vec<RecentBlocks>,
}

impl DualMap {
    pub fn new(destinations: usize, cfg: DualMapConfig, seed: u64) -> Self {
        let cfg = DualMapConfig {
            prefill_tokens_per_s: if cfg.prefill_tokens_per_s > 0.0 {
                cfg.prefill_tokens_per_s
            } else {
                20_000.0
            },
            ..cfg
        };
        Self {
            first: Ring::new(destinations, cfg.vnodes, seed ^ 0x0d0a_1111),
            second: Ring::new(destinations, cfg.vnodes, seed ^ 0x0d0a_2222),
            recent: (0..destinations)
                .map(|_| RecentBlocks::new(cfg.recent_blocks))
                .collect(),
            cfg,
        }
    }

    /// Expected TTFT of `req` at `d`, in seconds.
    pub fn expected_ttft(&self, req: &RouteRequest, fleet: &dyn FleetView, d: usize) -> f64 {
        let matched = self.recent[d].matched_prefix(req.blocks) as u64 * req.block_tokens as u64;
        let uncached = (req.prompt_tokens as u64).saturating_sub(matched).max(1);
        (fleet.queued_prefill_tokens(d) + uncached) as f64 / self.cfg.prefill_tokens_per_s
    }
}

impl Policy for DualMap {
    fn name(&self) -> &'static str {
        "dualmap"
    }
    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        _rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        let up = |d: &usize| *d < fleet.len() && fleet.is_up(*d);
        let a = self
            .first
            .walk(req.key)
            .find(up)
            .ok_or(RouteError::NoneUp(fleet.len()))?;
        let b = self.second.walk(req.key).find(|d| up(d) && *d != a);
        let chosen = match b {
            Some(b) => {
                let ta = self.expected_ttft(req, fleet, a);
                if ta > self.cfg.slo_ttft_s && self.expected_ttft(req, fleet, b) < ta {
                    b
                } else {
                    a
                }
            }
            None => a,
        };
        for &h in req.blocks {
            self.recent[chosen].touch(h);
        }
        Ok(chosen)
    }
}
