//! Routing policies: CacheRoute and the five baselines, one file each, behind one narrow trait.
//!
//! A policy sees the request (routing key hash; prefix block hashes for the policies that use
//! them), a read-only [`FleetView`] (which destinations are up, outstanding requests, queued
//! prefill work) and a seeded RNG, and returns a destination. Hooks exist only where a policy
//! needs them: [`Policy::on_complete`] (Preble's windowed load) and [`Policy::install_plan`]
//! (CacheRoute's table). The simulator and the live router call these same objects.
//!
//! Pure logic: no I/O, no clock (time comes in [`RouteRequest::now`]), no global RNG.

pub mod cacheroute;
pub mod calibrate;
pub mod chwbl;
pub mod dualmap;
pub mod dynamo;
pub mod flat_lb;
pub mod llmd;
pub mod preble;
pub mod recent;
pub mod ring;
pub mod round_robin;
pub mod setting;
pub mod sticky;

use crate::plan::Plan;
use crate::rng::Rng64;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What a policy knows about a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// `crate::key_hash` of the routing key.
    pub key: u64,
    /// Chain hashes of the prompt's full prefix blocks (empty when unknown).
    pub blocks: &'a [u64],
    /// Tokens per block in `blocks`.
    pub block_tokens: u32,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Expected output length in tokens (from `max_tokens` or the trace).
    pub output_tokens: u32,
    /// Current time in seconds (virtual in the simulator, real in the router).
    pub now: f64,
}

/// A read-only view of the fleet as a router observes it.
pub trait FleetView {
    /// Number of destinations (up or down).
    fn len(&self) -> usize;
    /// Whether the fleet has no destinations at all.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether destination `d` may receive requests.
    fn is_up(&self, d: usize) -> bool;
    /// Requests sent to `d` and not yet finished, as counted by the router.
    fn outstanding(&self, d: usize) -> u32;
    /// Prompt tokens sent to `d` whose first token has not come back yet (the router's view of
    /// queued prefill work).
    fn queued_prefill_tokens(&self, _d: usize) -> u64 {
        0
    }
}

/// A plain fleet view over vectors (simulator, tests, benchmarks).
#[derive(Debug, Clone, Default)]
pub struct FleetState {
    pub up: Vec<bool>,
    pub outstanding: Vec<u32>,
    pub queued_prefill: Vec<u64>,
}

impl FleetState {
    /// `n` destinations, all up and idle.
    pub fn new(n: usize) -> Self {
        Self {
            up: vec![true; n],
            outstanding: vec![0; n],
            queued_prefill: vec![0; n],
        }
    }
}

impl FleetView for FleetState {
    fn len(&self) -> usize {
        self.up.len()
    }
    fn is_up(&self, d: usize) -> bool {
        self.up[d]
    }
    fn outstanding(&self, d: usize) -> u32 {
        self.outstanding[d]
    }
    fn queued_prefill_tokens(&self, d: usize) -> u64 {
        self.queued_prefill[d]
    }
}

/// Routing failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no destination is up: all {0} destinations are down or draining")]
    NoneUp(usize),
}

/// The one trait every routing policy implements.
pub trait Policy: Send {
    /// Short name (as in reports).
    fn name(&self) -> &'static str;
    /// Choose a destination for `req`. Must return only a destination that is up.
    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError>;
    /// A request routed to `dest` finished (after `prefill_s` of prefill and `e2e_s` end to end).
    fn on_complete(&mut self, _req: &RouteRequest, _dest: usize, _done: &Completion) {}
    /// Destination `dest`'s prefix cache changed (its KV-cache events, in the order the
    /// engine published them; block hashes in [`RouteRequest::blocks`]'s chain-hash space).
    /// Only a policy whose spec [`PolicySpec::reads_kv_events`] is given them.
    fn on_kv_events(&mut self, _dest: usize, _events: &[KvEvent]) {}
    /// The plan hooks of a policy that routes by a plan (CacheRoute); `None` for every other
    /// policy, and the control loop then does not plan for it.
    fn planned(&mut self) -> Option<&mut dyn Planned> {
        None
    }
}

/// What the control loop does to a policy that routes by a plan ([`Policy::planned`]).
pub trait Planned {
    /// Install a new plan.
    fn install_plan(&mut self, plan: Arc<Plan>);
    /// The control loop's choice between pinned and bounded planned sets (with
    /// `bounded_sets` unset; a configured value wins).
    fn set_bounded_sets(&mut self, on: bool);
    /// The control loop's choice of dispatch (the parts the configuration leaves open; a
    /// configured part wins).
    fn set_dispatch(&mut self, d: cacheroute::Dispatch);
    /// The plan currently installed, if any.
    fn plan(&self) -> Option<Arc<Plan>>;
}

/// One change of an engine's prefix cache, as vLLM's KV-cache events carry it (`BlockStored`,
/// `BlockRemoved`, `AllBlocksCleared`), with the blocks named by the router's own chain hashes
/// (the simulator's engine model uses them; a live subscriber maps the engine's hashes to them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks now cached, in prefix order: `blocks[0]` follows `parent` (`None`: the prompt's
    /// first block).
    Stored {
        parent: Option<u64>,
        blocks: Vec<u64>,
    },
    /// Blocks evicted.
    Removed { blocks: Vec<u64> },
    /// The whole cache dropped (a reset, a restart).
    AllCleared,
}

/// What the router or simulator learned when a request finished.
#[derive(Debug, Clone, Copy, Default)]
pub struct Completion {
    pub now: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    pub output_tokens: u32,
    pub cached_tokens: u32,
}

/// Power-of-two-choices over live destinations: two distinct uniform samples, the one with
/// fewer outstanding requests (ties: the first sample). Shared by Flat-LB and CacheRoute's
/// fallback.
#[inline]
pub fn p2c(fleet: &dyn FleetView, rng: &mut Rng64) -> Result<usize, RouteError> {
    let n = fleet.len();
    if n == 0 {
        return Err(RouteError::NoneUp(0));
    }
    // Rejection sampling is O(1) when most destinations are up; fall back to an explicit
    // list of live destinations when many are down.
    let draw = |exclude: Option<usize>, rng: &mut Rng64| -> Option<usize> {
        for _ in 0..8 {
            let d = rng.random_range(0..n);
            if fleet.is_up(d) && Some(d) != exclude {
                return Some(d);
            }
        }
        let live: Vec<usize> = (0..n)
            .filter(|&d| fleet.is_up(d) && Some(d) != exclude)
            .collect();
        if live.is_empty() {
            None
        } else {
            Some(live[rng.random_range(0..live.len())])
        }
    };
    let a = draw(None, rng).ok_or(RouteError::NoneUp(n))?;
    let Some(b) = draw(Some(a), rng) else {
        return Ok(a);
    };
    Ok(if fleet.outstanding(b) < fleet.outstanding(a) {
        b
    } else {
        a
    })
}

/// Least outstanding among `cands` that are up (ties: earliest in `cands`).
#[inline]
pub fn least_loaded_of(
    cands: impl IntoIterator<Item = usize>,
    fleet: &dyn FleetView,
) -> Option<usize> {
    let mut best: Option<(u32, usize)> = None;
    for d in cands {
        if d < fleet.len() && fleet.is_up(d) {
            let o = fleet.outstanding(d);
            if best.is_none_or(|b| o < b.0) {
                best = Some((o, d));
            }
        }
    }
    best.map(|b| b.1)
}

/// Which policy, with its parameters (the `policies:` entries of an experiment spec).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PolicySpec {
    FlatLb,
    Sticky {
        #[serde(default = "default_vnodes")]
        vnodes: u32,
    },
    Chwbl {
        #[serde(default = "default_vnodes")]
        vnodes: u32,
        #[serde(default = "default_epsilon")]
        epsilon: f64,
    },
    Dualmap(#[serde(default)] dualmap::DualMapConfig),
    Preble(#[serde(default)] preble::PrebleConfig),
    Cacheroute(#[serde(default)] cacheroute::CacheRouteConfig),
    Dynamo(#[serde(default)] dynamo::DynamoConfig),
    /// llm-d's router, its optimized-baseline profile (`llm-d`).
    LlmD(#[serde(default)] llmd::LlmdConfig),
    /// Each request to the next destination in turn: the front a study puts before several
    /// router replicas (`round-robin`).
    RoundRobin,
}

fn default_vnodes() -> u32 {
    160
}
fn default_epsilon() -> f64 {
    0.25
}

impl PolicySpec {
    /// Parse a policy name as given on a command line: `flat-lb`, `sticky`, `chwbl`, `dualmap`,
    /// `preble`, `llm-d`, `cacheroute`, and the ablations `cacheroute-affinity`,
    /// `cacheroute-replication`.
    pub fn from_name(name: &str) -> Result<Self, String> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "flat-lb" | "flatlb" | "p2c" => PolicySpec::FlatLb,
            "sticky" => PolicySpec::Sticky { vnodes: default_vnodes() },
            "chwbl" => PolicySpec::Chwbl { vnodes: default_vnodes(), epsilon: default_epsilon() },
            "dualmap" => PolicySpec::Dualmap(Default::default()),
            "preble" => PolicySpec::Preble(Default::default()),
            "llm-d" | "llmd" => PolicySpec::LlmD(Default::default()),
            "cacheroute" => PolicySpec::Cacheroute(Default::default()),
            "cacheroute-affinity" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig::affinity_only()),
            "cacheroute-replication" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig::with_replication()),
            "cacheroute-p2c-tail" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig { cold_tail: setting::Setting::Fixed(cacheroute::ColdTail::P2c), ..Default::default() }),
            "cacheroute-prefix-tail" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig { cold_tail: setting::Setting::Fixed(cacheroute::ColdTail::Prefix), ..Default::default() }),
            "cacheroute-paper" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig::paper()),
            "cacheroute-conversations" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig { conversations: true, ..Default::default() }),
            "cacheroute-keys" => PolicySpec::Cacheroute(cacheroute::CacheRouteConfig { conversations: false, ..Default::default() }),
            "dynamo" => PolicySpec::Dynamo(Default::default()),
            "round-robin" => PolicySpec::RoundRobin,
            other => {
                return Err(format!(
                    "unknown policy `{other}`; choose one of flat-lb, sticky, chwbl, dualmap, preble, llm-d, cacheroute, cacheroute-keys, cacheroute-affinity, cacheroute-replication, cacheroute-p2c-tail, cacheroute-prefix-tail, cacheroute-paper, dynamo, round-robin"
                ))
            }
        })
    }

    /// Whether the policy reads the prompt's prefix block hashes ([`RouteRequest::blocks`]; the
    /// router hashes a prompt only for a policy that does).
    pub fn reads_blocks(&self) -> bool {
        match self {
            PolicySpec::Dualmap(_)
            | PolicySpec::Preble(_)
            | PolicySpec::Dynamo(_)
            | PolicySpec::LlmD(_) => true,
            PolicySpec::Cacheroute(c) => c.conversations || c.may_use_prefix_tail(),
            _ => false,
        }
    }

    /// Whether the policy follows the engines' KV-cache events ([`Policy::on_kv_events`]; the
    /// simulator's engine model emits them and the router subscribes only then).
    pub fn reads_kv_events(&self) -> bool {
        match self {
            PolicySpec::Dynamo(_) => true,
            PolicySpec::Preble(c) => c.follows_events(),
            PolicySpec::Cacheroute(c) => c.prefix.follows_events() && c.may_use_prefix_tail(),
            _ => false,
        }
    }

    /// The spec with an unset `prefix.from_events` of CacheRoute resolved: on where the
    /// engines' KV-cache events are `available` (a router subscribed to them; the simulator),
    /// off elsewhere. A value the spec gives is kept. Measured (docs/kv-events.md): with one
    /// router the events' tree ties the router's own, with several only the events keep the
    /// fleet's cache whole; so wherever they are available, CacheRoute follows them. Preble
    /// stays the baseline as published — its own tree of the requests it routed — unless its
    /// spec says `from_events: true`.
    /// Where they are not, the unset value stays unset (and means off), so the spec still
    /// equals the one written.
    pub fn with_events(mut self, available: bool) -> Self {
        let unset = match &mut self {
            PolicySpec::Cacheroute(c) if c.may_use_prefix_tail() => Some(&mut c.prefix.from_events),
            _ => None,
        };
        if let Some(f) = unset.filter(|_| available) {
            f.get_or_insert(true);
        }
        self
    }

    /// Whether the policy learns from finished requests ([`Policy::on_complete`]; the router
    /// reads a response's timing and usage for it only then).
    pub fn reads_completions(&self) -> bool {
        match self {
            PolicySpec::Preble(_) | PolicySpec::Dynamo(_) => true,
            PolicySpec::Cacheroute(c) => c.may_use_prefix_tail(),
            _ => false,
        }
    }

    /// The name used in reports.
    pub fn label(&self) -> String {
        match self {
            PolicySpec::FlatLb => "flat-lb".into(),
            PolicySpec::Sticky { .. } => "sticky".into(),
            PolicySpec::Chwbl { .. } => "chwbl".into(),
            PolicySpec::Dualmap(_) => "dualmap".into(),
            PolicySpec::Preble(_) => "preble".into(),
            PolicySpec::LlmD(_) => "llm-d".into(),
            PolicySpec::Cacheroute(c) => c.label(),
            PolicySpec::Dynamo(_) => "dynamo".into(),
            PolicySpec::RoundRobin => "round-robin".into(),
        }
    }

    /// Build the policy for `destinations` destinations. `seed` seeds hash rings.
    pub fn build(&self, destinations: usize, seed: u64) -> Box<dyn Policy> {
        match self {
            PolicySpec::FlatLb => Box::new(flat_lb::FlatLb),
            PolicySpec::Sticky { vnodes } => {
                Box::new(sticky::Sticky::new(destinations, *vnodes, seed))
            }
            PolicySpec::Chwbl { vnodes, epsilon } => {
                Box::new(chwbl::Chwbl::new(destinations, *vnodes, *epsilon, seed))
            }
            PolicySpec::Dualmap(c) => {
                Box::new(dualmap::DualMap::new(destinations, c.clone(), seed))
            }
            PolicySpec::Preble(c) => Box::new(preble::Preble::new(destinations, c.clone())),
            PolicySpec::LlmD(c) => Box::new(llmd::Llmd::new(destinations, c.clone())),
            PolicySpec::Cacheroute(c) => {
                Box::new(cacheroute::CacheRoute::new(c.clone(), destinations, seed))
            }
            PolicySpec::Dynamo(c) => Box::new(dynamo::Dynamo::new(destinations, c.clone())),
            PolicySpec::RoundRobin => Box::new(round_robin::RoundRobin::default()),
        }
    }
}

impl PolicySpec {
    /// Every parameter outside its allowed range, each as `name: value is outside …` (the
    /// caller prefixes its own field path, e.g. `policies[2].`). Empty when all are in range.
    pub fn problems(&self) -> Vec<String> {
        use crate::bounds::{count, non_negative, positive, real, MAX_INTERVAL_S};
        let vnodes = |v: &u32| count("vnodes", *v as u64, 1, 10_000);
        let p: Vec<Option<String>> = match self {
            PolicySpec::FlatLb | PolicySpec::RoundRobin => vec![],
            PolicySpec::Sticky { vnodes: v } => vec![vnodes(v)],
            PolicySpec::Chwbl { vnodes: v, epsilon } => {
                vec![vnodes(v), positive("epsilon", *epsilon, 100.0)]
            }
            PolicySpec::Dualmap(c) => vec![
                count("vnodes", c.vnodes as u64, 1, 10_000),
                positive("slo_ttft_s", c.slo_ttft_s, MAX_INTERVAL_S),
                non_negative("prefill_tokens_per_s", c.prefill_tokens_per_s, 1e9),
                count("recent_blocks", c.recent_blocks as u64, 1, 100_000_000),
            ],
            PolicySpec::Preble(c) => preble_problems(c),
            PolicySpec::LlmD(c) => c.problems(),
            PolicySpec::Cacheroute(c) => preble_problems(&c.prefix)
                .into_iter()
                .map(|p| p.map(|p| format!("prefix.{p}")))
                .chain([
                    non_negative("q_cap", c.q_cap.number(), 1e6),
                    count("warm_slots", c.warm_slots.number(), 0, 10_000_000),
                    positive("interval_s", c.interval_s, MAX_INTERVAL_S),
                    positive("rate_alpha", c.rate_alpha, 1.0),
                    real("max_imbalance", c.max_imbalance, 1.0, false, 100.0),
                    count("stale_intervals", c.stale_intervals as u64, 0, 1_000),
                    positive("cold_tail_epsilon", c.cold_tail_epsilon, 100.0),
                    non_negative("bound_slack", c.bound_slack, 100.0),
                    count("memory_size", c.memory_size, 0, 1 << 28),
                    non_negative("credit_cap", c.credit_cap, 100.0),
                    count("retune_intervals", c.retune_intervals as u64, 1, 1_000),
                ])
                .collect(),
            PolicySpec::Dynamo(c) => c.problems(),
        };
        p.into_iter().flatten().collect()
    }
}

/// The range checks of Preble's parameters (the baseline's, and CacheRoute's prefix tail's).
fn preble_problems(c: &preble::PrebleConfig) -> Vec<Option<String>> {
    use crate::bounds::{count, non_negative, positive, real, MAX_INTERVAL_S};
    vec![
        positive("window_s", c.window_s, MAX_INTERVAL_S),
        non_negative("prefill_a_s", c.prefill_a_s, 3600.0),
        non_negative("prefill_b_s_per_token", c.prefill_b_s_per_token, 1.0),
        positive("tpot_s", c.tpot_s, 3600.0),
        non_negative(
            "rebalance_outstanding_per_dest",
            c.rebalance_outstanding_per_dest,
            1e9,
        ),
        real("rebalance_ratio", c.rebalance_ratio, 1.0, false, 1e6),
        count("max_nodes", c.max_nodes as u64, 1, 100_000_000),
    ]
}

#[cfg(test)]
mod tests;
