//! CacheRoute dispatch: an admitted key goes to the least-loaded live member of its planned
//! set T(b); an unadmitted key (or one whose whole set is down) goes to the cold-tail policy:
//! consistent hashing with bounded loads over all live destinations (the default: the tail
//! keeps its locality while the bound keeps it balanced), power-of-two-choices (the paper's
//! choice: balance only) or Preble's prefix-tree scheduling. The bound, in queued prefill
//! tokens, has one prompt of slack for a conversation whose history is cached. Below the key,
//! the conversation memory (on by default, sized to the fleet's caches) keeps a conversation
//! where its history is cached while load allows: on its set's member, on its tail
//! destination, and across a plan that moved its key; the cache credit lets the holder of a
//! conversation's history stay past the bound by the history's tokens. The plan is built off
//! the request path by the control loop (simulator or router) from measured rates with
//! [`crate::plan`], and installed with [`Policy::install_plan`]. The ablation variants of the
//! paper's §5.3 are configurations of the same policy: `affinity` (k_b = 1, hash placement),
//! `replication` (k_b by q_cap, hash placement) and `full` (k_b by q_cap, LPT placement).

use super::chwbl::request_bound;
use super::preble::{Preble, PrebleConfig};
use super::recent::RecentMap;
use super::ring::Ring;
use super::setting::Setting;
use super::{least_loaded_of, p2c, FleetView, Planned, Policy, RouteError, RouteRequest};
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

pub use crate::analysis::record::{ColdTail, Dispatch, LoadSignal};

/// The engine model's constants behind `load: cost` (filled from the engine model by
/// `policy::calibrate::resolve_policy`; all 0: not known, and `cost` reads as `prefill`).
/// A replica running `n` decodes prefills a chunk of `chunk_tokens − n` prompt tokens in
/// `step_s + n · per_decode_s` seconds (each decode takes a token of the step's budget and adds
/// its KV read); a request arriving when every one of `max_seqs` slots is taken first waits for
/// one: about its own output length of decode steps of `decode_step_s` per `max_seqs` requests
/// ahead of it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    pub step_s: f64,
    pub per_decode_s: f64,
    pub chunk_tokens: u32,
    pub max_seqs: u32,
    pub decode_step_s: f64,
}

impl CostModel {
    /// Whether the constants are known.
    pub fn known(&self) -> bool {
        self.step_s > 0.0 && self.chunk_tokens > 1 && self.max_seqs > 0
    }

    /// Seconds per prompt token prefilled beside `running` decodes.
    #[inline]
    fn s_per_token(&self, running: u32) -> f64 {
        let n = running.min(self.max_seqs).min(self.chunk_tokens - 1);
        (self.step_s + n as f64 * self.per_decode_s) / (self.chunk_tokens - n) as f64
    }

    /// A request's predicted time to first token on a destination with `queued` prompt tokens
    /// not yet prefilled and `outstanding` requests, in tokens an idle replica prefills in that
    /// time, less the request's own prompt (an idle destination costs 0, and `queued` alone
    /// when nothing runs beside it: the `prefill` signal's units). `queued` alone when the
    /// constants are not known.
    #[inline]
    pub fn load_tokens(&self, queued: u64, outstanding: u32, prompt: u32, output: u32) -> u64 {
        if !self.known() {
            return queued;
        }
        let p = prompt.max(1) as f64;
        let prefill = (queued as f64 + p) * self.s_per_token(outstanding);
        let ahead = outstanding.saturating_sub(self.max_seqs - 1) as f64;
        let wait = ahead * output.max(1) as f64 * self.decode_step_s / self.max_seqs as f64;
        ((prefill + wait) / self.s_per_token(0) - p).max(0.0) as u64
    }
}

/// Which of a prompt's blocks the conversation memory records ([`CacheRouteConfig::memory_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryBlocks {
    /// Every full block of the prompt.
    Every,
    /// The last block and those at positions 1, 2, 4, 8, … (1-based).
    Sparse,
}

/// CacheRoute parameters: the planner's and the control loop's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheRouteConfig {
    /// Per-destination capacity ceiling (requests/s). Automatic (written 0 or `auto`): chosen
    /// by the control loop (tuned, else estimated from the engine model).
    pub q_cap: Setting<f64>,
    /// Warm slots per destination. Automatic (0 or `auto`): chosen by the control loop (tuned,
    /// else derived from KV capacity and mean prefix size).
    pub warm_slots: Setting<u64>,
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
    /// Follow the plan (`false`: every request goes the cold tail's way, as a reactive router
    /// does). Absent or `null`: the self-calibration chooses (followed when it does not tune).
    #[serde(
        with = "crate::policy::setting::optional",
        skip_serializing_if = "Setting::is_auto"
    )]
    pub plan: Setting<bool>,
    /// Where unadmitted keys go. Absent or `auto`: the self-calibration chooses (CHWBL when it
    /// does not tune).
    #[serde(
        with = "crate::policy::setting::named",
        skip_serializing_if = "Setting::is_auto"
    )]
    pub cold_tail: Setting<ColdTail>,
    /// The bound of a CHWBL cold tail: a destination takes a tail key while its load (in the
    /// `load` signal) is below (1 + ε)·(total + this request) / R_live (rounded up for
    /// outstanding requests, as CHWBL does).
    pub cold_tail_epsilon: f64,
    /// Slack of the bound in `load: prefill`, in prompts: a destination takes a request while
    /// its queued prefill is below (1 + ε)·(total + this prompt)/R_live plus this many times
    /// this request's prompt tokens, as CHWBL's rounding up lets a destination take one
    /// request past the mean. Queued prefill is near zero on most destinations most of the
    /// time, so without slack one long prompt in a queue puts it past the bound (default 1).
    /// Only for a request whose history the conversation memory remembers for more than half
    /// its prompt: the slack keeps a conversation with its cache; a request with little or
    /// nothing cached is placed by the tight bound (so never with `conversations: false`).
    pub bound_slack: f64,
    /// The load a destination is judged by when choosing within a set or bounding the tail.
    /// Absent or `auto`: the self-calibration chooses (`prefill` when it does not tune).
    #[serde(
        with = "crate::policy::setting::named",
        skip_serializing_if = "Setting::is_auto"
    )]
    pub load: Setting<LoadSignal>,
    /// The engine model's constants behind `load: cost` (set from the engine model).
    #[serde(skip_serializing_if = "is_default_cost")]
    pub cost: CostModel,
    /// Bound planned keys too: when every member of a key's set is at or above the cold
    /// tail's bound ((1 + ε)·(total + this request) / R_live in the load signal), the request
    /// goes the cold tail's way. `false` pins admitted keys to their set whatever the load
    /// (the paper's Algorithm 1). Unset: the control loop's self-calibration chooses (pinned
    /// when it does not tune).
    #[serde(
        with = "crate::policy::setting::optional",
        skip_serializing_if = "Setting::is_auto"
    )]
    pub bounded_sets: Setting<bool>,
    /// Self-calibration: q_cap and W left at 0 are chosen by the control loop from replays of
    /// its recent traffic through the engine model (`sim::tune`); `false` keeps the
    /// engine-model estimates (`policy::calibrate`). Explicit values are never tuned.
    pub autotune: bool,
    /// Control intervals between two tunings (the first plan after traffic is seen is tuned).
    pub retune_intervals: u32,
    /// Keep conversations and shared prefixes together: remember where each prefix block was
    /// last sent ([`CONVERSATION_MEMORY`] blocks at most, an approximate prefix index), and
    /// send a request to the destination of the deepest remembered block of its prompt —
    /// within its planned set while that member is below the set's bound, or anywhere for the
    /// cold tail while it is below the tail's bound; and a planned key's conversation that the
    /// plan has moved stays where its history is while that is below the fleet's bound (the
    /// default). `false`: the key alone decides (`cacheroute-keys`).
    pub conversations: bool,
    /// Credit a conversation's cached history against the bound (`load: prefill` with the
    /// conversation memory): where the memory keeps a conversation on the destination its
    /// history went to (the cold tail's holder, and a moved key's), that destination stays
    /// while its queued prefill is below the bound plus the history's tokens (capped by
    /// `credit_cap`) — the history is prefill it would not have to redo, which no other
    /// destination can offer (the default). `false`: the bound alone.
    pub cache_credit: bool,
    /// Which of a prompt's blocks the conversation memory records: `every` block (the
    /// default), or `sparse`: its last block and those at positions 1, 2, 4, 8, …, about
    /// log2(n) + 1 of n, so that the memory holds that many times more requests (long-tailed
    /// traffic of long prompts, where it otherwise forgets a conversation within seconds),
    /// and finds a prefix shared across conversations at no less than half its depth.
    pub memory_blocks: MemoryBlocks,
    /// Blocks the conversation memory holds at most, per destination (the whole memory is
    /// this times the number of destinations). 0: twice what one replica's KV cache holds,
    /// in prefix blocks, where the engine model is known (the simulator, and the router with
    /// `--engine`), else [`CONVERSATION_MEMORY`]: the memory remembers at least as many
    /// recent blocks as the fleet's caches can hold, so a conversation the caches still hold
    /// is not forgotten.
    pub memory_size: u64,
    /// The cache credit's cap, in multiples of the bound: the holder stays while its load is
    /// below the bound plus min(history, this × the bound). 0 (the default): no cap — the
    /// history is prefill any other destination would redo, whatever the bound.
    pub credit_cap: f64,
    /// The prefix-aware cold tail's parameters (`cold_tail: prefix`); the prefill profile and
    /// TPOT left at 0 are set from the engine model, as Preble's are.
    #[serde(skip_serializing_if = "is_default_prefix")]
    pub prefix: PrebleConfig,
}

fn is_default_prefix(c: &PrebleConfig) -> bool {
    *c == PrebleConfig::default()
}

fn is_default_cost(c: &CostModel) -> bool {
    *c == CostModel::default()
}

/// Blocks CacheRoute's conversation memory holds at most per destination where the engine is
/// not known (two generations; ~24 bytes each): 1M tokens of 16-token blocks.
pub const CONVERSATION_MEMORY: usize = 1 << 16;

/// The conversation memory's whole size for `destinations` destinations.
pub fn memory_capacity(cfg: &CacheRouteConfig, destinations: usize) -> usize {
    let per = match cfg.memory_size {
        0 => CONVERSATION_MEMORY,
        n => n as usize,
    };
    per.saturating_mul(destinations.max(1)).min(1 << 30)
}

impl Default for CacheRouteConfig {
    fn default() -> Self {
        Self {
            q_cap: Setting::Auto,
            warm_slots: Setting::Auto,
            interval_s: 30.0,
            rate_alpha: 0.5,
            churn_aware: true,
            max_imbalance: 1.05,
            byte_aware: false,
            variant: Variant::Full,
            stale_intervals: 0,
            plan: Setting::Auto,
            cold_tail: Setting::Auto,
            cold_tail_epsilon: 0.25,
            bound_slack: 1.0,
            load: Setting::Auto,
            cost: CostModel::default(),
            bounded_sets: Setting::Auto,
            autotune: true,
            retune_intervals: 4,
            conversations: true,
            cache_credit: true,
            memory_blocks: MemoryBlocks::Every,
            memory_size: 0,
            credit_cap: 0.0,
            prefix: PrebleConfig::default(),
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

    /// The paper's Algorithm 1 as published: P2C cold tail, outstanding requests, pinned sets,
    /// q_cap and W from the engine-model estimates when not given (no self-calibration).
    pub fn paper() -> Self {
        Self {
            cold_tail: Setting::Fixed(ColdTail::P2c),
            load: Setting::Fixed(LoadSignal::Outstanding),
            bounded_sets: Setting::Fixed(false),
            autotune: false,
            conversations: false,
            ..Self::default()
        }
    }

    /// Whether any setting is left to the control loop (q_cap, W, bounded sets or a part of
    /// the dispatch).
    pub fn automatic(&self) -> bool {
        self.q_cap.is_auto()
            || self.warm_slots.is_auto()
            || self.bounded_sets.is_auto()
            || self.dispatch_automatic()
    }

    /// Whether a part of the dispatch (plan, cold tail, load signal) is left to the control loop.
    pub fn dispatch_automatic(&self) -> bool {
        self.plan.is_auto() || self.cold_tail.is_auto() || self.load.is_auto()
    }

    /// The dispatch before (or without) self-calibration: each part as configured, else
    /// [`Dispatch::PLANNED`]'s.
    pub fn default_dispatch(&self) -> Dispatch {
        self.configured_dispatch(Dispatch::PLANNED)
    }

    /// `d` with the configured parts of the dispatch put back (configured wins).
    pub fn configured_dispatch(&self, d: Dispatch) -> Dispatch {
        Dispatch {
            plan: self.plan.or_else(|| d.plan),
            cold_tail: self.cold_tail.or_else(|| d.cold_tail),
            load: self.load.or_else(|| d.load),
        }
    }

    /// Whether the cold tail may be prefix-aware (configured so, or left to the control loop).
    pub fn may_use_prefix_tail(&self) -> bool {
        self.cold_tail.fixed().is_none_or(|t| t == ColdTail::Prefix)
    }

    /// Report label.
    pub fn label(&self) -> String {
        if *self == Self::paper() {
            return "cacheroute-paper".into();
        }
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
        if !self.autotune {
            s.push_str("-estimated");
        }
        if let Setting::Fixed(l) = self.load {
            s.push('-');
            s.push_str(l.name());
        }
        match self.plan {
            Setting::Fixed(true) => s.push_str("-planned"),
            Setting::Fixed(false) => s.push_str("-reactive"),
            Setting::Auto => {}
        }
        match self.bounded_sets {
            Setting::Fixed(true) => s.push_str("-bounded"),
            Setting::Fixed(false) => s.push_str("-pinned"),
            Setting::Auto => {}
        }
        if self.cold_tail.fixed().is_none_or(|t| t == ColdTail::Chwbl)
            && self.cold_tail_epsilon != Self::default().cold_tail_epsilon
        {
            s.push_str(&format!("-eps{}", self.cold_tail_epsilon));
        }
        if self.bound_slack != Self::default().bound_slack {
            s.push_str(&format!("-slack{}", self.bound_slack));
        }
        if self.conversations != Self::default().conversations {
            s.push_str(if self.conversations {
                "-conversations"
            } else {
                "-keys"
            });
        }
        if self.cache_credit != Self::default().cache_credit {
            s.push_str(if self.cache_credit {
                "-credit"
            } else {
                "-no-credit"
            });
        }
        if self.memory_size != Self::default().memory_size {
            s.push_str(&format!("-memory{}", self.memory_size));
        }
        if self.credit_cap != Self::default().credit_cap {
            s.push_str(&format!("-credit-cap{}", self.credit_cap));
        }
        match self.memory_blocks {
            MemoryBlocks::Every => {}
            MemoryBlocks::Sparse => s.push_str("-sparse-memory"),
        }
        if let Setting::Fixed(t) = self.cold_tail {
            s.push_str(&format!("-{}-tail", t.name()));
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
    /// The dispatch in force (configured, or set by the control loop).
    dispatch: Dispatch,
    /// The CHWBL cold tail's ring.
    tail: Ring,
    /// The prefix-aware cold tail (`ColdTail::Prefix` in force); it sees every request.
    prefix: Option<Preble>,
    /// Whether planned keys are bounded (configured, or set by the control loop).
    bounded: bool,
    /// Where each request's last full prefix block was sent (`conversations`).
    memory: Option<RecentMap<u16>>,
    destinations: usize,
    /// Decisions by path.
    pub table_hits: u64,
    pub fallbacks: u64,
    /// Decisions that followed the conversation memory.
    pub remembered: u64,
}

impl CacheRoute {
    /// `destinations` and `seed` shape the cold tail's hash ring.
    pub fn new(cfg: CacheRouteConfig, destinations: usize, seed: u64) -> Self {
        let dispatch = cfg.default_dispatch();
        let mut c = Self {
            bounded: cfg.bounded_sets.or_else(|| false),
            memory: cfg
                .conversations
                .then(|| RecentMap::new(memory_capacity(&cfg, destinations))),
            tail: Ring::new(destinations, 160, seed),
            cfg,
            plan: None,
            dispatch,
            prefix: None,
            destinations,
            table_hits: 0,
            fallbacks: 0,
            remembered: 0,
        };
        c.apply_dispatch(dispatch);
        c
    }
    pub fn config(&self) -> &CacheRouteConfig {
        &self.cfg
    }

    /// The dispatch in force.
    pub fn dispatch(&self) -> Dispatch {
        self.dispatch
    }

    /// Put `d` in force. The prefix tree is kept while a prefix-aware tail is in force or may
    /// come in force (the cold tail left to the control loop), so that the tail it comes back
    /// to knows where every recent prefix went; it is dropped for good only when the tail is
    /// configured to another.
    fn apply_dispatch(&mut self, d: Dispatch) {
        self.dispatch = d;
        let keep = d.cold_tail == ColdTail::Prefix || self.cfg.may_use_prefix_tail();
        match (keep, self.prefix.is_some()) {
            (true, false) => {
                self.prefix = Some(Preble::new(self.destinations, self.cfg.prefix.clone()))
            }
            (false, true) => self.prefix = None,
            _ => {}
        }
    }

    /// The prefix-aware tail, when it is the one in force.
    fn prefix_tail(&self) -> Option<&Preble> {
        self.prefix
            .as_ref()
            .filter(|_| self.dispatch.cold_tail == ColdTail::Prefix)
    }

    /// Load of `d` in the signal in force, for `req`.
    #[inline]
    fn load_of(&self, d: usize, req: &RouteRequest, fleet: &dyn FleetView) -> u64 {
        match self.dispatch.load {
            LoadSignal::Outstanding => fleet.outstanding(d) as u64,
            LoadSignal::Prefill => fleet.queued_prefill_tokens(d),
            LoadSignal::Cost => self.cfg.cost.load_tokens(
                fleet.queued_prefill_tokens(d),
                fleet.outstanding(d),
                req.prompt_tokens,
                req.output_tokens,
            ),
        }
    }

    /// The least-loaded live one of `cands` (ties: outstanding requests, then order).
    #[inline]
    fn least_loaded(
        &self,
        cands: impl Iterator<Item = usize>,
        req: &RouteRequest,
        fleet: &dyn FleetView,
    ) -> Option<usize> {
        match self.dispatch.load {
            LoadSignal::Outstanding => least_loaded_of(cands, fleet),
            LoadSignal::Prefill | LoadSignal::Cost => cands
                .filter(|&d| d < fleet.len() && fleet.is_up(d))
                .min_by_key(|&d| (self.load_of(d, req, fleet), fleet.outstanding(d))),
        }
    }

    /// The bound: (1 + ε)·(total load + this request) / R_live, plus `slack` of this request's
    /// prompts in `load: prefill`; `None` when nothing is up.
    fn bound(&self, req: &RouteRequest, fleet: &dyn FleetView, slack: f64) -> Option<f64> {
        self.bound_over(req, fleet, slack, 0..fleet.len())
    }

    /// The same bound over the live ones of `dests` (a planned set, or the whole fleet).
    fn bound_over(
        &self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        slack: f64,
        dests: impl Iterator<Item = usize>,
    ) -> Option<f64> {
        let (mut total, mut live) = (0u64, 0u64);
        for d in dests.filter(|&d| d < fleet.len() && fleet.is_up(d)) {
            total += self.load_of(d, req, fleet);
            live += 1;
        }
        if live == 0 {
            return None;
        }
        let eps = self.cfg.cold_tail_epsilon;
        let cap = match self.dispatch.load {
            LoadSignal::Outstanding => request_bound(total, live, eps),
            LoadSignal::Prefill | LoadSignal::Cost => {
                let p = req.prompt_tokens.max(1) as f64;
                (1.0 + eps) * (total as f64 + p) / live as f64 + slack * p
            }
        };
        Some(cap)
    }

    /// The choice (see the module doc); [`Policy::choose`] then remembers it.
    fn pick(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        // The memory's deepest remembered block of the prompt (one scan serves both uses):
        // where the conversation was last sent, if up, and whether it covers over half.
        let deepest = self
            .memory
            .as_ref()
            .and_then(|m| deepest_remembered(m, req));
        let at = deepest
            .map(|(_, d)| d as usize)
            .filter(|&d| d < fleet.len() && fleet.is_up(d));
        // What the remembered history spares its holder, in the load signal's units (the
        // memory's holder only: with a prefix tail the tree names the holders, and no credit).
        let history = deepest.map_or(0, |(i, _)| {
            ((i as u64 + 1) * req.block_tokens as u64).min(req.prompt_tokens as u64)
        });
        // The slack is for a conversation's holder: where the remembered history is more than
        // half the prompt (Preble's exploit rule), one long prompt in its queue does not send
        // the conversation away; a request with little or nothing cached anywhere is placed by
        // the tight bound, for balance.
        let slack = if 2 * history > req.prompt_tokens as u64 {
            self.cfg.bound_slack
        } else {
            0.0
        };
        let credit_on = self.cfg.cache_credit
            && self.dispatch.load != LoadSignal::Outstanding
            && self.dispatch.cold_tail != ColdTail::Prefix;
        let cap_x = self.cfg.credit_cap;
        let credit = |c: f64| -> f64 {
            if credit_on {
                let h = history as f64;
                if cap_x > 0.0 {
                    h.min(cap_x * c)
                } else {
                    h
                }
            } else {
                0.0
            }
        };
        // The bound costs a pass over the fleet: computed at most once per request.
        let mut cap: Option<Option<f64>> = None;
        if let Some(plan) = self.plan.as_ref().filter(|_| self.dispatch.plan) {
            if let Some(set) = plan.lookup(req.key) {
                let members = || set.iter().map(|&d| d as usize);
                // A conversation the plan has moved away from where its history is cached
                // stays there while that destination is below the fleet's bound.
                let mut one = [0u16; 1];
                let held = match (self.prefix_tail(), &self.memory) {
                    (Some(p), _) => p.deep_holders(req),
                    (None, _) => deepest
                        .filter(|&(i, _)| {
                            2 * (i as u64 + 1) * req.block_tokens as u64 > req.prompt_tokens as u64
                        })
                        .map(|(_, d)| {
                            one[0] = d;
                            &one[..]
                        }),
                };
                if let Some(held) = held {
                    if !held.iter().any(|h| set.contains(h)) {
                        let c = *cap.get_or_insert_with(|| self.bound(req, fleet, slack));
                        let stay = self.least_loaded(held.iter().map(|&d| d as usize), req, fleet);
                        if let (Some(d), Some(c)) = (stay, c) {
                            if (self.load_of(d, req, fleet) as f64) < c + credit(c) {
                                self.table_hits += 1;
                                self.remembered += 1;
                                return Ok(d);
                            }
                        }
                    }
                }
                // The conversation stays on the member that holds it while that member is
                // below the set's own bound.
                if let Some(a) = at.filter(|a| members().any(|d| d == *a)) {
                    let set_cap = self
                        .bound_over(req, fleet, slack, members())
                        .unwrap_or(f64::INFINITY);
                    let load = self.load_of(a, req, fleet) as f64;
                    if load < set_cap
                        && (!self.bounded
                            || cap
                                .insert(self.bound(req, fleet, slack))
                                .is_none_or(|c| load < c))
                    {
                        self.table_hits += 1;
                        self.remembered += 1;
                        return Ok(a);
                    }
                }
                if let Some(d) = self.least_loaded(members(), req, fleet) {
                    let within = !self.bounded
                        || cap
                            .insert(self.bound(req, fleet, slack))
                            .is_none_or(|c| (self.load_of(d, req, fleet) as f64) < c);
                    if within {
                        self.table_hits += 1;
                        return Ok(d);
                    }
                }
            }
        }
        self.fallbacks += 1;
        if self.dispatch.cold_tail == ColdTail::Prefix {
            if let Some(p) = self.prefix.as_mut() {
                return p.decide(req, fleet);
            }
        }
        if self.dispatch.cold_tail == ColdTail::P2c {
            return p2c(fleet, rng);
        }
        let ring = &self.tail;
        // Consistent hashing with bounded loads in the configured signal: the destination
        // that holds the conversation, else the first live destination clockwise from the key,
        // below the bound; else the least loaded.
        let c = cap.unwrap_or_else(|| self.bound(req, fleet, slack));
        if let (Some(a), Some(c)) = (at, c) {
            if (self.load_of(a, req, fleet) as f64) < c + credit(c) {
                self.remembered += 1;
                return Ok(a);
            }
        }
        c.and_then(|c| {
            ring.walk(req.key).find(|&d| {
                d < fleet.len() && fleet.is_up(d) && (self.load_of(d, req, fleet) as f64) < c
            })
        })
        .or_else(|| self.least_loaded(0..fleet.len(), req, fleet))
        .ok_or(RouteError::NoneUp(fleet.len()))
    }
}

/// The blocks `MemoryBlocks::Sparse` records: the last, and those at 1-based positions 1, 2, 4,
/// 8, … (the next turn of a conversation extends this prompt and finds its last block; another
/// conversation that shares a system prompt or a document finds it at no less than half the
/// shared depth).
#[inline]
fn sparse_blocks(blocks: &[u64]) -> impl Iterator<Item = u64> + '_ {
    let last = blocks.len().wrapping_sub(1);
    blocks
        .iter()
        .enumerate()
        .filter(move |&(i, _)| i == last || (i + 1).is_power_of_two())
        .map(|(_, &h)| h)
}

/// The deepest block of `req`'s prompt the conversation memory holds: its index in the prompt
/// and the destination it was last sent to.
fn deepest_remembered(m: &RecentMap<u16>, req: &RouteRequest) -> Option<(usize, u16)> {
    req.blocks
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, &h)| m.get(h).map(|d| (i, d)))
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
        if let Some(p) = self.prefix.as_mut() {
            p.observe(req);
        }
        let d = self.pick(req, fleet, rng)?;
        if let Some(p) = self.prefix.as_mut() {
            p.record(req, d);
        }
        if let Some(m) = self.memory.as_mut() {
            match self.cfg.memory_blocks {
                MemoryBlocks::Every => req.blocks.iter().for_each(|&h| m.insert(h, d as u16)),
                MemoryBlocks::Sparse => {
                    sparse_blocks(req.blocks).for_each(|h| m.insert(h, d as u16))
                }
            }
        }
        Ok(d)
    }

    fn on_complete(&mut self, _req: &RouteRequest, dest: usize, done: &super::Completion) {
        if let Some(p) = self.prefix.as_mut() {
            p.complete(dest, done);
        }
    }

    fn on_kv_events(&mut self, dest: usize, events: &[super::KvEvent]) {
        if let Some(p) = self.prefix.as_mut() {
            p.on_kv_events(dest, events);
        }
    }

    fn planned(&mut self) -> Option<&mut dyn Planned> {
        Some(self)
    }
}

impl Planned for CacheRoute {
    fn install_plan(&mut self, plan: Arc<Plan>) {
        self.plan = Some(plan);
    }

    fn set_bounded_sets(&mut self, on: bool) {
        if self.cfg.bounded_sets.is_auto() {
            self.bounded = on;
        }
    }

    fn set_dispatch(&mut self, d: Dispatch) {
        let d = self.cfg.configured_dispatch(d);
        if d != self.dispatch {
            self.apply_dispatch(d);
        }
    }

    fn plan(&self) -> Option<Arc<Plan>> {
        self.plan.clone()
    }
}
