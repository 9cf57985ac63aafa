//! CacheRoute dispatch: an admitted key goes to the least-outstanding live member of its
//! planned set T(b); an unadmitted key (or one whose whole set is down) goes to
//! power-of-two-choices over all live destinations. The plan is built off the request path by
//! the control loop (simulator or router) from measured rates with [`crate::plan`], and
//! installed with [`Policy::install_plan`]. The ablation variants of the paper's §5.3 are
//! configurations of the same policy: `affinity` (k_b = 1, hash placement), `replication`
//! (k_b by q_cap, hash placement) and `full` (k_b by q_cap, LPT placement).

use super::{least_loaded_of, p2c, FleetView, Policy, RouteError, RouteRequest};
use crate::plan::{Placement, Plan, PlannerConfig};
use crate::rng::Rng64;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Which ablation row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// Affinity only: admitted keys pinned to one destination by hash.
    Affinity,
    /// + replication: k_b by q_cap, destinations by hash.
    Replication,
    /// The full planner: k_b by q_cap, LPT placement.
    Full,
}

/// CacheRoute parameters: the planner's and the control loop's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheRouteConfig {
    /// Per-destination capacity ceiling (requests/s). 0 = calibrate from the engine model.
    pub q_cap: f64,
    /// Warm slots per destination. 0 = derive from KV capacity and mean prefix size.
    pub warm_slots: u64,
    /// Control interval in seconds.
    pub interval_s: f64,
    /// EWMA weight of the newest interval in measured rates (1 = last interval only).
    pub rate_alpha: f64,
    /// Keep previous placements where the load bound allows (the product's default; `false`
    /// rebuilds a fresh LPT plan every interval, as the paper's Algorithm 1 does).
    pub churn_aware: bool,
    /// Churn-aware bound, relative to a fresh LPT plan's max/mean.
    pub max_imbalance: f64,
    /// Byte-aware admission (value = rate × prefix tokens, slots in KV blocks).
    pub byte_aware: bool,
    /// Ablation row.
    pub variant: Variant,
    /// Plan from rates measured this many intervals before the latest one (0 = fresh; 1 = the
    /// plan in force is one control interval staler than it could be).
    pub stale_intervals: u32,
}

impl Default for CacheRouteConfig {
    fn default() -> Self {
        Self {
            q_cap: 0.0,
            warm_slots: 0,
            interval_s: 30.0,
            rate_alpha: 0.5,
            churn_aware: true,
            max_imbalance: 1.05,
            byte_aware: false,
            variant: Variant::Full,
            stale_intervals: 0,
        }
    }
}

impl CacheRouteConfig {
    pub fn affinity_only() -> Self {
        Self {
            variant: Variant::Affinity,
            ..Self::default()
        }
    }
    pub fn with_replication() -> Self {
        Self {
            variant: Variant::Replication,
            ..Self::default()
        }
    }

    /// Report label.
    pub fn label(&self) -> String {
        let mut s = match self.variant {
            Variant::Full => "cacheroute".to_string(),
            Variant::Affinity => "cacheroute-affinity".to_string(),
            Variant::Replication => "cacheroute-replication".to_string(),
        };
        if !self.churn_aware {
            s.push_str("-fresh");
        }
        if self.byte_aware {
            s.push_str("-bytes");
        }
        if self.stale_intervals > 0 {
            s.push_str(&format!("-stale{}", self.stale_intervals));
        }
        s
    }

    /// Planner configuration for `destinations` destinations, with q_cap and W resolved.
    pub fn planner(
        &self,
        destinations: usize,
        q_cap: f64,
        warm_slots: u64,
        block_tokens: u32,
    ) -> PlannerConfig {
        let mut p = PlannerConfig::new(destinations, q_cap, warm_slots);
        p.max_imbalance = self.max_imbalance;
        p.byte_aware = self.byte_aware;
        p.block_tokens = block_tokens.max(1);
        match self.variant {
            Variant::Affinity => {
                p.replication = false;
                p.placement = Placement::Hash;
            }
            Variant::Replication => p.placement = Placement::Hash,
            Variant::Full => {}
        }
        p
    }
}

/// CacheRoute dispatch over an installed plan.
#[derive(Debug, Clone)]
pub struct CacheRoute {
    cfg: CacheRouteConfig,
    plan: Option<Arc<Plan>>,
    /// Decisions by path.
    pub table_hits: u64,
    pub fallbacks: u64,
}

impl CacheRoute {
    pub fn new(cfg: CacheRouteConfig) -> Self {
        Self {
            cfg,
            plan: None,
            table_hits: 0,
            fallbacks: 0,
        }
    }
    pub fn config(&self) -> &CacheRouteConfig {
        &self.cfg
    }
}

impl Policy for CacheRoute {
    fn name(&self) -> &'static str {
        "cacheroute"
    }

    #[inline]
    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        if let Some(plan) = &self.plan {
            if let Some(set) = plan.lookup(req.key) {
                if let Some(d) = least_loaded_of(set.iter().map(|&d| d as usize), fleet) {
                    self.table_hits += 1;
                    return Ok(d);
                }
            }
        }
        self.fallbacks += 1;
        p2c(fleet, rng)
    }

    fn install_plan(&mut self, plan: Arc<Plan>) {
        self.plan = Some(plan);
    }

    fn uses_plan(&self) -> bool {
        true
    }

    fn plan(&self) -> Option<Arc<Plan>> {
        self.plan.clone()
    }
}
