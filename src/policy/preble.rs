//! Preble (Srivatsa et al. 2024, E2 scheduling), behaviour-matched.
//!
//! A global prefix tree over requests' blocks: because blocks are chain hashes, a block hash
//! names its whole prefix, so the tree is a map from block hash to node (allocated
//! destinations, last use). For a request, c = matched prefix tokens in the tree and
//! m = prompt − c. **Exploit** when m < c: candidates are the destinations holding the deepest
//! matched node; the one with the lowest load cost wins. **Explore** otherwise: argmin load
//! cost over all live destinations. The request's nodes are then marked as allocated to the
//! chosen destination.
//!
//! **Load cost** of destination g over a sliding window H: the prefill time of the tokens each
//! request routed to g had to compute there (the quantity Preble's per-node
//! missrate·count·T_prefill sum estimates), plus the decode work of g's outstanding requests
//! (outstanding × mean output length × TPOT_g, TPOT_g an EWMA of g's completed requests).
//! T_prefill is a linear profile a + b·tokens.
//!
//! **Rebalancing**: when total outstanding exceeds `rebalance_outstanding_per_dest` × R and the
//! exploit target's cost is ≥ 1.5 × the lightest destination's, the request (and its prefix)
//! moves to the lightest destination. The original moves whole tree nodes in a batch; this
//! per-request form has the same effect on where later requests for that prefix go.
//!
//! **Memory**: nodes not used within the window are evicted by periodic sweeps, and the tree
//! is capped at `max_nodes` (oldest evicted first), so it never grows without bound.
//! Left out: prefix autoscaling (replicating one hot node when its TTFT doubles).

use super::{FleetView, Policy, RouteError, RouteRequest};
use crate::plan::KeyMap;
use crate::rng::Rng64;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Preble parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrebleConfig {
    /// Sliding window H in seconds (Preble's code: 3 minutes).
    pub window_s: f64,
    /// Prefill profile: seconds = a + b · tokens. b = 0 means "set from the engine model".
    pub prefill_a_s: f64,
    pub prefill_b_s_per_token: f64,
    /// Initial TPOT guess in seconds before any completion is seen.
    pub tpot_s: f64,
    /// Rebalance when total outstanding > this × R.
    pub rebalance_outstanding_per_dest: f64,
    /// Heaviest/lightest cost ratio that triggers rebalancing.
    pub rebalance_ratio: f64,
    /// Upper bound on tree nodes.
    pub max_nodes: usize,
}

impl Default for PrebleConfig {
    fn default() -> Self {
        Self {
            window_s: 180.0,
            prefill_a_s: 0.01,
            prefill_b_s_per_token: 0.0,
            tpot_s: 0.03,
            rebalance_outstanding_per_dest: 50.0,
            rebalance_ratio: 1.5,
            max_nodes: 2_000_000,
        }
    }
}

#[derive(Debug, Clone)]
struct Node {
    /// Destinations holding this prefix (small: usually one or two).
    alloc: Vec<u16>,
    last_seen: f64,
}

/// Preble E2 scheduler.
#[derive(Debug, Clone)]
pub struct Preble {
    cfg: PrebleConfig,
    nodes: KeyMap<Node>,
    /// Windowed prefill cost per destination, and its log for expiry.
    prefill_cost: Vec<f64>,
    log: VecDeque<(f64, u16, f64)>,
    tpot: Vec<f64>,
    mean_output: f64,
    seen: u64,
    last_sweep: f64,
    /// Decisions by path, for tests and reports.
    pub exploits: u64,
    pub explores: u64,
    pub rebalances: u64,
}

impl Preble {
    pub fn new(destinations: usize, cfg: PrebleConfig) -> Self {
        let cfg = PrebleConfig {
            prefill_b_s_per_token: if cfg.prefill_b_s_per_token > 0.0 {
                cfg.prefill_b_s_per_token
            } else {
                1.0 / 20_000.0
            },
            ..cfg
        };
        Self {
            tpot: vec![cfg.tpot_s; destinations],
            cfg,
            nodes: KeyMap::default(),
            prefill_cost: vec![0.0; destinations],
            log: VecDeque::new(),
            mean_output: 200.0,
            seen: 0,
            last_sweep: 0.0,
            exploits: 0,
            explores: 0,
            rebalances: 0,
        }
    }

    fn t_prefill(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            0.0
        } else {
            self.cfg.prefill_a_s + self.cfg.prefill_b_s_per_token * tokens as f64
        }
    }

    /// Load cost of destination `d` now.
    pub fn load_cost(&self, fleet: &dyn FleetView, d: usize) -> f64 {
        self.prefill_cost[d] + fleet.outstanding(d) as f64 * self.mean_output * self.tpot[d]
    }

    fn expire(&mut self, now: f64) {
        let h = self.cfg.window_s;
        while let Some(&(t, d, c)) = self.log.front() {
            if t >= now - h {
                break;
            }
            self.prefill_cost[d as usize] = (self.prefill_cost[d as usize] - c).max(0.0);
            self.log.pop_front();
        }
        // Sweep stale nodes every quarter window, or when over the cap.
        if now - self.last_sweep > h / 4.0 || self.nodes.len() > self.cfg.max_nodes {
            let mut cutoff = now - h;
            self.nodes.retain(|_, n| n.last_seen >= cutoff);
            while self.nodes.len() > self.cfg.max_nodes {
                // Tighten the window until the tree fits.
                cutoff += (now - cutoff) / 2.0;
                self.nodes.retain(|_, n| n.last_seen >= cutoff);
            }
            self.last_sweep = now;
        }
    }

    /// Matched prefix blocks in the tree, and the deepest matched node's allocation.
    fn match_prefix(&self, blocks: &[u64]) -> (usize, Option<&[u16]>) {
        let mut depth = 0;
        let mut alloc: Option<&[u16]> = None;
        for h in blocks {
            match self.nodes.get(h) {
                Some(n) => {
                    depth += 1;
                    if !n.alloc.is_empty() {
                        alloc = Some(&n.alloc);
                    }
                }
                None => break,
            }
        }
        (depth, alloc)
    }
}

impl Preble {
    /// Expire the window and learn the request's output length (before [`Preble::decide`]).
    pub fn observe(&mut self, req: &RouteRequest) {
        self.expire(req.now);
        self.seen += 1;
        self.mean_output +=
            (req.output_tokens as f64 - self.mean_output) / (self.seen.min(1000) as f64);
    }

    /// The destinations holding the deepest matched block of `req`'s prompt, when the matched
    /// prefix is more than half of it (Preble's exploit case); `None` otherwise.
    pub fn deep_holders(&self, req: &RouteRequest) -> Option<&[u16]> {
        let (depth, alloc) = self.match_prefix(req.blocks);
        let c = (depth as u64 * req.block_tokens as u64).min(req.prompt_tokens as u64);
        (req.prompt_tokens as u64 - c < c)
            .then_some(alloc)
            .flatten()
    }

    /// The E2 decision for `req` (see the module doc); changes only the path counters.
    pub fn decide(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
    ) -> Result<usize, RouteError> {
        let n = fleet.len();
        let lightest = (0..n)
            .filter(|&d| fleet.is_up(d))
            .min_by(|&a, &b| {
                self.load_cost(fleet, a)
                    .total_cmp(&self.load_cost(fleet, b))
                    .then(a.cmp(&b))
            })
            .ok_or(RouteError::NoneUp(n))?;
        let (depth, alloc) = self.match_prefix(req.blocks);
        let c = (depth as u64 * req.block_tokens as u64).min(req.prompt_tokens as u64);
        let m = req.prompt_tokens as u64 - c;
        if m >= c {
            self.explores += 1;
            return Ok(lightest);
        }
        let best = alloc.and_then(|a| {
            a.iter()
                .map(|&d| d as usize)
                .filter(|&d| d < n && fleet.is_up(d))
                .min_by(|&x, &y| {
                    self.load_cost(fleet, x)
                        .total_cmp(&self.load_cost(fleet, y))
                        .then(x.cmp(&y))
                })
        });
        let Some(d) = best else {
            self.explores += 1;
            return Ok(lightest);
        };
        self.exploits += 1;
        let total: u64 = (0..n)
            .filter(|&d| fleet.is_up(d))
            .map(|d| fleet.outstanding(d) as u64)
            .sum();
        if total as f64 > self.cfg.rebalance_outstanding_per_dest * n as f64
            && self.load_cost(fleet, d)
                >= self.cfg.rebalance_ratio * self.load_cost(fleet, lightest).max(1e-9)
        {
            self.rebalances += 1;
            return Ok(lightest);
        }
        Ok(d)
    }

    /// `req` went to `chosen` (by this scheduler or by another path): its blocks are marked as
    /// held there, and the prefill work of the blocks `chosen` did not hold yet is added to
    /// `chosen`'s windowed load.
    pub fn record(&mut self, req: &RouteRequest, chosen: usize) {
        let mut held = 0u64;
        let mut still_matching = true;
        let now = req.now;
        for &h in req.blocks {
            let node = self.nodes.entry(h).or_insert(Node {
                alloc: Vec::new(),
                last_seen: now,
            });
            node.last_seen = now;
            let has = node.alloc.contains(&(chosen as u16));
            if still_matching && has {
                held += 1;
            } else {
                still_matching = false;
            }
            if !has {
                node.alloc.push(chosen as u16);
            }
        }
        let computed = (req.prompt_tokens as u64).saturating_sub(held * req.block_tokens as u64);
        let cost = self.t_prefill(computed);
        self.prefill_cost[chosen] += cost;
        self.log.push_back((now, chosen as u16, cost));
    }

    /// Learn `dest`'s time per output token from a finished request.
    pub fn complete(&mut self, dest: usize, done: &super::Completion) {
        if done.output_tokens > 1 && dest < self.tpot.len() {
            let tpot = (done.e2e_s - done.ttft_s).max(0.0) / (done.output_tokens - 1) as f64;
            self.tpot[dest] += 0.1 * (tpot - self.tpot[dest]);
        }
    }
}

impl Policy for Preble {
    fn name(&self) -> &'static str {
        "preble"
    }

    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        _rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        self.observe(req);
        let chosen = self.decide(req, fleet)?;
        self.record(req, chosen);
        Ok(chosen)
    }

    fn on_complete(&mut self, _req: &RouteRequest, dest: usize, done: &super::Completion) {
        self.complete(dest, done);
    }
}

impl Preble {
    /// Nodes currently in the tree.
    pub fn tree_size(&self) -> usize {
        self.nodes.len()
    }
}
