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
//! is capped at `max_nodes` (oldest evicted first), so it never grows without bound. A node is
//! 8 bytes beside its 8-byte hash: its first holder inline and its last use as an `f32` offset
//! from the first request seen; the rare prefix held by more destinations (2–3% of the paper
//! workload's blocks) keeps its list in a side map.
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
    /// Learn where prefixes are from the engines' KV-cache events (exact: a block is held
    /// while the engine keeps it) instead of from the routing decisions and the window
    /// (Preble's own, approximate). Unset (the default): from the events wherever they are
    /// available — a router subscribed to them (`--kv-events-port-offset`), the simulator
    /// (its engine model emits them) — resolved by [`super::PolicySpec::with_events`];
    /// `true` demands them (the router then needs `--kv-events-port-offset`), `false` keeps
    /// the approximate tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_events: Option<bool>,
}

impl PrebleConfig {
    /// Whether the tree follows the events (an unresolved default does not).
    pub fn follows_events(&self) -> bool {
        self.from_events == Some(true)
    }
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
            from_events: None,
        }
    }
}

/// Holders kept in the node itself; more go to [`Preble::spilled`].
pub const INLINE: usize = 1;

/// One prefix block in the tree.
#[derive(Debug, Clone, Copy)]
struct Node {
    /// The first holders (the first `len` of them), when `len` ≤ [`INLINE`]; with more, the
    /// whole list is in [`Preble::spilled`] under the node's hash.
    inline: [u16; INLINE],
    len: u16,
    /// Last use, seconds after [`Preble::origin`].
    last_seen: f32,
}

impl Node {
    fn new(last_seen: f32) -> Self {
        Self {
            inline: [0; INLINE],
            len: 0,
            last_seen,
        }
    }
}

/// Preble E2 scheduler.
#[derive(Debug, Clone)]
pub struct Preble {
    cfg: PrebleConfig,
    nodes: KeyMap<Node>,
    /// Holder lists of the nodes with more than [`INLINE`] holders.
    spilled: KeyMap<Vec<u16>>,
    /// The first request's time: nodes keep their last use as an offset from it.
    origin: Option<f64>,
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
            spilled: KeyMap::default(),
            origin: None,
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
        let by_window = !self.cfg.follows_events() && now - self.last_sweep > h / 4.0;
        if by_window || self.nodes.len() > self.cfg.max_nodes {
            let mut cutoff = now - h;
            let mut keep = self.stamp(cutoff);
            self.nodes.retain(|_, n| n.last_seen >= keep);
            while self.nodes.len() > self.cfg.max_nodes {
                // Tighten the window until the tree fits.
                cutoff += (now - cutoff) / 2.0;
                keep = self.stamp(cutoff);
                self.nodes.retain(|_, n| n.last_seen >= keep);
            }
            if !self.spilled.is_empty() {
                let nodes = &self.nodes;
                self.spilled.retain(|h, _| nodes.contains_key(h));
            }
            self.last_sweep = now;
        }
    }

    /// `t` as a node's time stamp (an offset from the first request's time).
    fn stamp(&self, t: f64) -> f32 {
        (t - self.origin.unwrap_or(t)) as f32
    }

    /// The destinations holding the node of hash `h`.
    fn holders<'a>(&'a self, h: &u64, n: &'a Node) -> &'a [u16] {
        if n.len as usize <= INLINE {
            &n.inline[..n.len as usize]
        } else {
            self.spilled.get(h).map_or(&[], Vec::as_slice)
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
                    if n.len > 0 {
                        alloc = Some(self.holders(h, n));
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
        self.origin.get_or_insert(req.now);
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
        self.origin.get_or_insert(now);
        let stamp = self.stamp(now);
        let c = chosen as u16;
        for &h in req.blocks {
            // With the events as the source, routing marks nothing (and makes no node, which
            // no window would sweep): only a store does.
            let has = if self.cfg.follows_events() {
                self.nodes
                    .get(&h)
                    .is_some_and(|n| self.holders(&h, n).contains(&c))
            } else {
                self.add_holder(h, c, stamp)
            };
            if still_matching && has {
                held += 1;
            } else {
                still_matching = false;
            }
        }
        let computed = (req.prompt_tokens as u64).saturating_sub(held * req.block_tokens as u64);
        let cost = self.t_prefill(computed);
        self.prefill_cost[chosen] += cost;
        self.log.push_back((now, chosen as u16, cost));
    }

    /// Follow destination `dest`'s KV-cache events (with [`PrebleConfig::from_events`]): a
    /// stored block is held by `dest`, a removed one no longer, a cleared cache holds nothing.
    pub fn apply_events(&mut self, dest: usize, events: &[super::KvEvent]) {
        use super::KvEvent;
        let c = dest as u16;
        for e in events {
            match e {
                KvEvent::Stored { blocks, .. } => {
                    for &h in blocks {
                        // The stamp is unused: events, not a window, evict.
                        self.add_holder(h, c, 0.0);
                    }
                }
                KvEvent::Removed { blocks } => {
                    for h in blocks {
                        self.drop_holder(*h, c);
                    }
                }
                KvEvent::AllCleared => {
                    let held: Vec<u64> = self
                        .nodes
                        .iter()
                        .filter(|(h, n)| self.holders(h, n).contains(&c))
                        .map(|(h, _)| *h)
                        .collect();
                    for h in held {
                        self.drop_holder(h, c);
                    }
                }
            }
        }
    }

    /// Block `h`'s node (made if new), its last use now `stamp`, `c` one of its holders.
    /// Whether `c` held it before.
    fn add_holder(&mut self, h: u64, c: u16, stamp: f32) -> bool {
        let node = self.nodes.entry(h).or_insert(Node::new(stamp));
        node.last_seen = stamp;
        let len = node.len as usize;
        let has = if len <= INLINE {
            node.inline[..len].contains(&c)
        } else {
            self.spilled.get(&h).is_some_and(|v| v.contains(&c))
        };
        if !has {
            if len < INLINE {
                node.inline[len] = c;
            } else if len == INLINE {
                let mut all = node.inline.to_vec();
                all.push(c);
                self.spilled.insert(h, all);
            } else {
                self.spilled.entry(h).or_default().push(c);
            }
            node.len = node.len.saturating_add(1);
        }
        has
    }

    /// `c` no longer holds block `h`; a block nobody holds leaves the tree.
    fn drop_holder(&mut self, h: u64, c: u16) {
        let Some(node) = self.nodes.get_mut(&h) else {
            return;
        };
        let len = node.len as usize;
        let left = if len <= INLINE {
            let Some(i) = node.inline[..len].iter().position(|&x| x == c) else {
                return;
            };
            node.inline.copy_within(i + 1..len, i);
            len - 1
        } else {
            let Some(v) = self.spilled.get_mut(&h) else {
                return;
            };
            let Some(i) = v.iter().position(|&x| x == c) else {
                return;
            };
            v.remove(i);
            if v.len() <= INLINE {
                node.inline[..v.len()].copy_from_slice(v);
                self.spilled.remove(&h);
            }
            len - 1
        };
        if left == 0 {
            self.nodes.remove(&h);
        } else {
            node.len = left as u16;
        }
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

    fn on_kv_events(&mut self, dest: usize, events: &[super::KvEvent]) {
        if self.cfg.follows_events() {
            self.apply_events(dest, events);
        }
    }
}

impl Preble {
    /// Nodes currently in the tree.
    pub fn tree_size(&self) -> usize {
        self.nodes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(blocks: &[u64], now: f64) -> RouteRequest<'_> {
        RouteRequest {
            key: 1,
            blocks,
            block_tokens: 16,
            prompt_tokens: 16 * blocks.len() as u32,
            output_tokens: 10,
            now,
        }
    }

    #[test]
    fn a_prefix_held_by_more_than_the_inline_holders_keeps_them_all_and_in_order() {
        let mut p = Preble::new(8, PrebleConfig::default());
        let blocks = [7u64, 8, 9, 10];
        for d in [5usize, 2, 7, 0, 3, 2, 5] {
            let r = req(&blocks, 100.0);
            p.observe(&r);
            p.record(&r, d);
        }
        let r = req(&blocks, 101.0);
        assert_eq!(p.deep_holders(&r), Some(&[5u16, 2, 7, 0, 3][..]));
        assert_eq!(p.spilled.len(), 4, "every block of the prefix spilled");
        // A destination already listed is not listed twice, inline or spilled.
        let (_, alloc) = p.match_prefix(&blocks[..1]);
        assert_eq!(alloc, Some(&[5u16, 2, 7, 0, 3][..]));
    }

    #[test]
    fn the_window_sweep_drops_spilled_lists_with_their_nodes_at_any_clock_origin() {
        // A router's clock may be far from zero; stamps are offsets, so the window still holds.
        for origin in [0.0, 1.7e9] {
            let cfg = PrebleConfig {
                window_s: 10.0,
                ..Default::default()
            };
            let mut p = Preble::new(8, cfg);
            let old = [1u64, 2];
            for d in 0..5 {
                let r = req(&old, origin + 1.0);
                p.observe(&r);
                p.record(&r, d);
            }
            assert_eq!(p.spilled.len(), 2);
            // Within the window: kept.
            let r = req(&[50], origin + 9.0);
            p.observe(&r);
            p.record(&r, 0);
            assert_eq!(p.tree_size(), 3, "origin {origin}");
            // Past the window and the quarter-window sweep period: the old prefix goes, lists too.
            let r = req(&[60], origin + 12.0);
            p.observe(&r);
            assert_eq!(p.tree_size(), 1, "origin {origin}");
            assert!(p.spilled.is_empty(), "origin {origin}");
            assert_eq!(p.deep_holders(&req(&old, origin + 12.0)), None);
        }
    }

    #[test]
    fn from_events_the_tree_holds_what_the_engines_hold() {
        use crate::policy::KvEvent;
        let cfg = PrebleConfig {
            from_events: Some(true),
            ..Default::default()
        };
        let mut p = Preble::new(4, cfg);
        let blocks = [21u64, 22, 23];
        let r = req(&blocks, 1.0);
        // Routing alone teaches it nothing.
        p.observe(&r);
        p.record(&r, 1);
        assert_eq!(p.deep_holders(&r), None);
        assert_eq!(
            p.tree_size(),
            0,
            "routing makes no node the engines did not store"
        );
        let stored = |d: usize, p: &mut Preble| {
            p.apply_events(
                d,
                &[KvEvent::Stored {
                    parent: None,
                    blocks: blocks.to_vec(),
                }],
            )
        };
        stored(2, &mut p);
        stored(0, &mut p);
        stored(3, &mut p);
        stored(0, &mut p); // a repeat changes nothing
        assert_eq!(p.deep_holders(&r), Some(&[2u16, 0, 3][..]));
        // Destination 0 evicts the last block: the deepest node is held by 2 and 3.
        p.apply_events(0, &[KvEvent::Removed { blocks: vec![23] }]);
        assert_eq!(p.deep_holders(&r), Some(&[2u16, 3][..]));
        p.apply_events(2, &[KvEvent::AllCleared]);
        assert_eq!(p.deep_holders(&r), Some(&[3u16][..]));
        p.apply_events(3, &[KvEvent::AllCleared]);
        // Blocks 21 and 22 are still held by 0: 2 of 3 blocks matched, more than half.
        assert_eq!(p.deep_holders(&r), Some(&[0u16][..]));
        p.apply_events(
            0,
            &[KvEvent::Removed {
                blocks: vec![21, 22],
            }],
        );
        assert_eq!(p.tree_size(), 0);
        assert!(p.spilled.is_empty(), "no list outlives its node");
        // The window does not evict what the engines still hold.
        stored(1, &mut p);
        let late = req(&[99], 10_000.0);
        p.observe(&late);
        assert_eq!(p.deep_holders(&r), Some(&[1u16][..]));
    }
}
