//! The discrete-event fleet simulator: a workload (any iterator of trace records), R engine
//! model replicas ([`crate::engine::Replica`]) and a routing policy from [`crate::policy`] —
//! the very trait objects the live router uses — on a virtual clock.
//!
//! The policy sees the fleet as a router would: which destinations are up, requests sent and
//! not finished, and prompt tokens sent whose first token has not come back. For policies that
//! use a plan (CacheRoute), the control loop measures per-key rates from the traffic seen so
//! far, rebuilds the plan every control interval (fresh or churn-aware, optionally from stale
//! rates) and installs it, so staleness and rewarming happen on their own. Destination
//! failure and recovery are injected at given times: a failed destination's requests that had
//! not produced a first token are retried once elsewhere (as the live router does), the rest
//! fail, the plan is repaired at once, and a recovered destination comes back cold.
//!
//! A policy that follows the engines' KV-cache events ([`PolicySpec::reads_kv_events`]) gets
//! each replica's prefix-cache stores and evictions ([`crate::engine::Replica::record_kv_events`])
//! batched per advance of that replica: everything the replica's cache did up to the simulated
//! time the simulator brings it to (a step's end, or an arrival routed to it) is delivered then,
//! in order, before any later routing decision; a failed destination's fresh replica is
//! announced as `AllCleared`. Other policies' replicas record nothing.
//!
//! Output: per-request records and per-destination counters in plain structs, plus one record
//! per installed plan. Deterministic: no wall clock, randomness only from the seed.

pub mod tune;

use crate::analysis::early::EarlyVerdict;
pub use crate::analysis::record::{PlanRecord, RequestRecord, Status};
use crate::control::{ControlOptions, Controller, Defaults};
pub use crate::engine::Failure;
use crate::engine::{chain_hashes, CacheChange, EngineConfig, EngineEvent, EngineRequest, Replica};
use crate::policy::calibrate::resolve_policy;
pub use crate::policy::calibrate::WarmStart;
use crate::policy::{Completion, FleetState, KvEvent, Policy, PolicySpec, RouteRequest};
use crate::workload::trace::TraceRecord;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

/// Simulator settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub destinations: usize,
    /// One engine configuration for every replica (its `hash_block_tokens` must be the trace's
    /// block size).
    pub engine: EngineConfig,
    pub policy: PolicySpec,
    pub seed: u64,
    pub failures: Vec<Failure>,
    /// Stop processing at this virtual time even if requests are still running (they are then
    /// recorded as unfinished). Infinite = run until every request finished.
    pub horizon_s: f64,
    /// For plan-driven policies: rates measured before the run starts (a deployment's previous
    /// period), planned and installed at t = 0 so the run does not start cold.
    pub warm_start: Option<WarmStart>,
    /// CacheRoute's controller seeds its rate meter with the first window's raw rates, as the
    /// live router does (`false`, the studies' setting: the EWMA starts from zero).
    pub seed_first_window: bool,
    /// Router replicas behind a round-robin front (request i to replica i mod N), each with
    /// its own policy state and its own view of the load (its own requests, as a live replica
    /// counts them); the engines' KV events reach every replica, and CacheRoute's replicas
    /// install one plan, planned from all of the traffic, as `route --etcd` shares it.
    pub router_replicas: usize,
}

/// Engine counters of one destination over the whole run (all its incarnations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DestCounters {
    pub routed: u64,
    pub prefill_tokens_computed: u64,
    pub cache_query_tokens: u64,
    pub cache_hit_tokens: u64,
    pub preemptions: u64,
    pub failures: u64,
}

/// Everything a simulation produced.
#[derive(Debug, Clone, Default)]
pub struct SimOutput {
    pub records: Vec<RequestRecord>,
    pub destinations: Vec<DestCounters>,
    pub plans: Vec<PlanRecord>,
    /// Events processed (arrivals, replica events, control ticks).
    pub events: u64,
    /// Virtual time of the last event.
    pub end_s: f64,
    /// The run was ended at `cut.at_s`, certain to fail ([`Simulator::watched`]); requests
    /// still running then are recorded as unfinished.
    pub cut: Option<crate::analysis::model::Cut>,
}

impl SimOutput {
    /// Records as analysis samples (requests still running at the end count as errors).
    pub fn samples(&self) -> impl Iterator<Item = crate::analysis::Sample> + '_ {
        self.records.iter().map(|r| crate::analysis::Sample {
            destination: r.destination.unwrap_or(-1),
            scheduled_s: r.scheduled_s,
            ttft_s: r.ttft_s(),
            e2e_s: r.e2e_s(),
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens.unwrap_or(0),
            ok: r.status == Status::Ok,
        })
    }

    /// Summary of requests scheduled in `[from_s, to_s)`.
    pub fn summary(&self, from_s: f64, to_s: f64) -> crate::analysis::Summary {
        crate::analysis::summarize(self.samples(), self.destinations.len(), from_s, to_s)
    }

    /// Preemptions over the run, all destinations.
    pub fn preemptions(&self) -> u64 {
        self.destinations.iter().map(|d| d.preemptions).sum()
    }
}

/// Errors of a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("destinations must be ≥ 1")]
    NoDestinations,
    #[error(
        "failure #{index}: destination {destination} does not exist (destinations are 0..{n})"
    )]
    BadFailure {
        index: usize,
        destination: usize,
        n: usize,
    },
    #[error("trace record {index}: timestamp {t_ms} ms goes back in time (previous {prev_ms} ms)")]
    NonMonotone {
        index: usize,
        t_ms: f64,
        prev_ms: f64,
    },
    #[error("trace: {0}")]
    Trace(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Per-request state the simulator keeps while a request is in flight.
struct InFlight {
    blocks: Vec<u64>,
}

/// The simulator's side of CacheRoute's controller ([`crate::control`]): when the next window
/// closes, and the arrivals a tuning replays.
struct Control {
    ctl: Controller,
    interval_s: f64,
    next_tick: f64,
    /// Recent arrivals (the last two intervals) for the replays; kept only when tuning.
    window: std::collections::VecDeque<TraceRecord>,
}

/// One router replica: its policy, its view of the fleet (the requests it sent), its RNG.
struct Front {
    policy: Box<dyn Policy>,
    view: FleetState,
    rng: crate::rng::Rng64,
}

/// The simulator.
pub struct Simulator {
    cfg: SimConfig,
    /// The router replicas ([`SimConfig::router_replicas`], at least one).
    fronts: Vec<Front>,
    replicas: Vec<Replica>,
    heap: BinaryHeap<Reverse<(Time, u32, u64)>>,
    version: Vec<u64>,
    out: SimOutput,
    inflight: Vec<Option<InFlight>>,
    retired: Vec<DestCounters>,
    control: Option<Control>,
    events_buf: Vec<EngineEvent>,
    block_tokens: u32,
    /// The replicas record their cache changes for the policy.
    kv_events: bool,
    kv_buf: Vec<CacheChange>,
    /// Ends the run once the step is certain to fail (checked once per model second).
    watch: Option<EarlyVerdict>,
}

impl Simulator {
    pub fn new(cfg: SimConfig) -> Result<Self, SimError> {
        let r = cfg.destinations;
        if r == 0 {
            return Err(SimError::NoDestinations);
        }
        for (i, f) in cfg.failures.iter().enumerate() {
            if f.destination >= r {
                return Err(SimError::BadFailure {
                    index: i,
                    destination: f.destination,
                    n: r,
                });
            }
        }
        // The engine model emits KV-cache events: an unset `from_events` follows them, as a
        // router subscribed to its engines' events does (docs/kv-events.md, measured).
        let spec = resolve_policy(&cfg.policy.clone().with_events(true), &cfg.engine);
        let fronts = (0..cfg.router_replicas.max(1))
            .map(|i| Front {
                policy: spec.build(r, cfg.seed),
                view: FleetState::new(r),
                rng: if i == 0 {
                    crate::rng::derive(cfg.seed, "sim/policy")
                } else {
                    crate::rng::derive(cfg.seed, &format!("sim/policy/{i}"))
                },
            })
            .collect();
        let kv_events = spec.reads_kv_events();
        let block_tokens = cfg.engine.knobs().hash_block_tokens;
        let control = match &spec {
            PolicySpec::Cacheroute(c) => Some(Control {
                ctl: Controller::new(
                    c.clone(),
                    ControlOptions {
                        destinations: r,
                        block_tokens,
                        defaults: Defaults::EngineModel(Box::new(cfg.engine.clone())),
                        seed_first_window: cfg.seed_first_window,
                    },
                    Some(Box::new(tune::ReplayTuner {
                        engine: cfg.engine.clone(),
                        seed: cfg.seed,
                    })),
                ),
                interval_s: c.interval_s.max(1e-3),
                next_tick: c.interval_s.max(1e-3),
                window: Default::default(),
            }),
            _ => None,
        };
        let mut sim = Self {
            replicas: (0..r)
                .map(|_| new_replica(&cfg.engine, kv_events))
                .collect(),
            fronts,
            heap: BinaryHeap::new(),
            version: vec![0; r],
            out: SimOutput {
                destinations: vec![DestCounters::default(); r],
                ..Default::default()
            },
            inflight: Vec::new(),
            retired: vec![DestCounters::default(); r],
            control,
            events_buf: Vec::new(),
            block_tokens,
            kv_events,
            kv_buf: Vec::new(),
            watch: None,
            cfg,
        };
        if let Some(ws) = sim.cfg.warm_start.clone() {
            // Planned from the previous period's rates, as if one interval had just closed.
            let down = sim.down();
            if let Some(c) = sim.control.as_mut() {
                if let Some(d) = c.ctl.warm_start(&ws, 0.0, &down, None) {
                    sim.install(d);
                }
            }
        }
        Ok(sim)
    }

    fn schedule(&mut self, d: usize) {
        self.version[d] += 1;
        if let Some(t) = self.replicas[d].next_event_time() {
            self.heap
                .push(Reverse((Time(t), d as u32, self.version[d])));
        }
    }

    fn next_replica_time(&mut self) -> f64 {
        while let Some(Reverse((t, d, v))) = self.heap.peek().copied() {
            if self.version[d as usize] == v {
                return t.0;
            }
            self.heap.pop();
        }
        f64::INFINITY
    }

    /// Route request `id` at `now` and submit it.
    fn dispatch(&mut self, id: usize, now: f64) {
        let rec = self.out.records[id];
        let blocks = std::mem::take(&mut self.inflight[id].as_mut().expect("in flight").blocks);
        let req = RouteRequest {
            key: rec.key,
            blocks: &blocks,
            block_tokens: self.block_tokens,
            prompt_tokens: rec.prompt_tokens,
            output_tokens: rec.output_tokens,
            now,
        };
        let front = &mut self.fronts[id % self.cfg.router_replicas.max(1)];
        let d = match front.policy.choose(&req, &front.view, &mut front.rng) {
            Ok(d) => d,
            Err(_) => {
                let r = &mut self.out.records[id];
                r.status = Status::NoDestination;
                r.destination = None;
                self.inflight[id] = None;
                return;
            }
        };
        debug_assert!(front.view.up[d], "policy chose a down destination");
        // Bring the replica up to `now` first, then hand it the request.
        self.advance_replica(d, now);
        let engine_req = EngineRequest {
            id: id as u64,
            prompt_tokens: rec.prompt_tokens,
            output_tokens: rec.output_tokens,
            block_hashes: blocks.clone(),
        };
        // Kept for a possible retry on another destination.
        if let Some(f) = self.inflight[id].as_mut() {
            f.blocks = blocks;
        }
        self.out.records[id].destination = Some(d as i32);
        self.out.destinations[d].routed += 1;
        match self.replicas[d].submit(engine_req, now) {
            Ok(()) => {
                let view = &mut self.front(id).view;
                view.outstanding[d] += 1;
                view.queued_prefill[d] += rec.prompt_tokens as u64;
            }
            Err(_) => {
                self.out.records[id].status = Status::Rejected;
                self.inflight[id] = None;
            }
        }
        self.schedule(d);
    }

    fn advance_replica(&mut self, d: usize, until: f64) {
        let mut buf = std::mem::take(&mut self.events_buf);
        buf.clear();
        self.replicas[d].advance(until, &mut buf);
        if self.kv_events {
            self.deliver_kv_events(d);
        }
        for ev in buf.drain(..) {
            match ev {
                EngineEvent::FirstToken { id, time } => {
                    let r = &mut self.out.records[id as usize];
                    r.first_token_s = Some(time);
                    let prompt = r.prompt_tokens as u64;
                    let q = &mut self.front(id as usize).view.queued_prefill[d];
                    *q = q.saturating_sub(prompt);
                }
                EngineEvent::Preempted { .. } => {}
                EngineEvent::Finished { time, stats } => {
                    let id = stats.id as usize;
                    let r = &mut self.out.records[id];
                    r.finish_s = Some(time);
                    r.cached_tokens = Some(stats.cached_tokens);
                    r.preemptions = stats.preemptions;
                    r.output_tokens = stats.output_tokens;
                    r.status = Status::Ok;
                    r.first_token_s.get_or_insert(time);
                    let r = *r;
                    let o = &mut self.front(id).view.outstanding[d];
                    *o = o.saturating_sub(1);
                    self.inflight[id] = None;
                    let done = Completion {
                        now: time,
                        ttft_s: r.ttft_s(),
                        e2e_s: r.e2e_s(),
                        output_tokens: r.output_tokens,
                        cached_tokens: stats.cached_tokens,
                    };
                    let req = RouteRequest {
                        key: r.key,
                        blocks: &[],
                        block_tokens: self.block_tokens,
                        prompt_tokens: r.prompt_tokens,
                        output_tokens: r.output_tokens,
                        now: time,
                    };
                    self.front(id).policy.on_complete(&req, d, &done);
                }
            }
        }
        self.events_buf = buf;
    }

    /// Hand the policy what replica `d`'s cache did since the last delivery.
    fn deliver_kv_events(&mut self, d: usize) {
        self.replicas[d].drain_kv_changes(&mut self.kv_buf);
        if self.kv_buf.is_empty() {
            return;
        }
        let events: Vec<KvEvent> = self
            .kv_buf
            .drain(..)
            .map(|c| match c {
                CacheChange::Stored { parent, hashes } => KvEvent::Stored {
                    parent,
                    blocks: hashes,
                },
                CacheChange::Removed { hashes } => KvEvent::Removed { blocks: hashes },
            })
            .collect();
        for f in &mut self.fronts {
            f.policy.on_kv_events(d, &events);
        }
    }

    /// The router replica that routes request `id`.
    fn front(&mut self, id: usize) -> &mut Front {
        let n = self.fronts.len();
        &mut self.fronts[id % n]
    }

    fn fail(&mut self, d: usize, now: f64) {
        self.advance_replica(d, now);
        for f in &mut self.fronts {
            f.view.up[d] = false;
        }
        self.out.destinations[d].failures += 1;
        self.retire(d);
        for f in &mut self.fronts {
            f.view.outstanding[d] = 0;
            f.view.queued_prefill[d] = 0;
        }
        let victims: Vec<usize> = (0..self.out.records.len())
            .filter(|&i| {
                self.inflight[i].is_some() && self.out.records[i].destination == Some(d as i32)
            })
            .collect();
        // Plan repair first, so retries already see the repaired table.
        self.repair_plan(now);
        for id in victims {
            let r = &mut self.out.records[id];
            if r.first_token_s.is_none() && !r.retried {
                r.retried = true;
                self.dispatch(id, now);
            } else {
                r.status = Status::Failed;
                r.finish_s = Some(now);
                self.inflight[id] = None;
            }
        }
    }

    fn recover(&mut self, d: usize) {
        for f in &mut self.fronts {
            f.view.up[d] = true;
        }
    }

    /// Fold a replica's counters into the destination's totals and replace it with a fresh,
    /// cold one.
    fn retire(&mut self, d: usize) {
        let c = self.replicas[d].counters();
        let t = &mut self.retired[d];
        t.prefill_tokens_computed += c.prefill_tokens_computed;
        t.cache_query_tokens += c.cache_query_tokens;
        t.cache_hit_tokens += c.cache_hit_tokens;
        t.preemptions += c.preemptions;
        self.replicas[d] = new_replica(&self.cfg.engine, self.kv_events);
        if self.kv_events {
            for f in &mut self.fronts {
                f.policy.on_kv_events(d, &[KvEvent::AllCleared]);
            }
        }
        self.schedule(d);
    }

    fn down(&self) -> Vec<bool> {
        self.fronts[0].view.up.iter().map(|u| !u).collect()
    }

    /// The plan the policy routes by, if it routes by one (every replica holds the same).
    fn plan(&mut self) -> Option<Arc<crate::plan::Plan>> {
        self.fronts[0].policy.planned().and_then(|p| p.plan())
    }

    /// Install a controller's decision: the plan into every replica's policy, its record into
    /// the output.
    fn install(&mut self, d: crate::control::Decision) {
        self.out.plans.push(d.record);
        let plan = Arc::new(d.plan);
        for f in &mut self.fronts {
            if let Some(p) = f.policy.planned() {
                p.install_plan(plan.clone());
            }
        }
    }

    fn repair_plan(&mut self, now: f64) {
        let (Some(p), Some(c)) = (self.plan(), self.control.as_ref()) else {
            return;
        };
        if let Some(d) = c.ctl.repair(&p, &self.down(), now) {
            self.install(d);
        }
    }

    /// A control interval closed: the controller plans (or not) and the plan is installed.
    fn control_tick(&mut self, now: f64) {
        let down = self.down();
        let prev = self.plan();
        let Some(c) = self.control.as_mut() else {
            return;
        };
        c.next_tick = now + c.interval_s;
        let Some(Ok(step)) = c
            .ctl
            .close_window(c.interval_s, &down, c.window.make_contiguous())
        else {
            return;
        };
        if step.tuned.is_some() {
            for f in &mut self.fronts {
                if let Some(p) = f.policy.planned() {
                    p.set_bounded_sets(step.settings.bounded_sets);
                    p.set_dispatch(step.settings.dispatch);
                }
            }
        }
        if let Ok(d) = c.ctl.build(step, now, prev.as_deref(), &down) {
            self.install(d);
        }
    }

    /// Run the whole trace.
    pub fn run<I>(mut self, trace: I) -> Result<SimOutput, SimError>
    where
        I: IntoIterator<Item = TraceRecord>,
    {
        let mut trace = trace.into_iter().peekable();
        let mut failures: Vec<(f64, usize, bool)> = Vec::new();
        for f in &self.cfg.failures {
            failures.push((f.at_s, f.destination, false));
            if let Some(r) = f.recover_at_s {
                failures.push((r, f.destination, true));
            }
        }
        failures.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut fi = 0;
        let mut prev_ms = f64::NEG_INFINITY;
        let horizon = self.cfg.horizon_s;
        let mut next_check = f64::NEG_INFINITY;
        loop {
            let t_arr = trace
                .peek()
                .map(|r| r.timestamp_ms / 1000.0)
                .unwrap_or(f64::INFINITY);
            let t_rep = self.next_replica_time();
            let t_fail = failures.get(fi).map(|f| f.0).unwrap_or(f64::INFINITY);
            let t_ctl = match &self.control {
                Some(c) if t_arr.is_finite() => c.next_tick,
                _ => f64::INFINITY,
            };
            let t = t_arr.min(t_rep).min(t_fail).min(t_ctl);
            if !t.is_finite() || t > horizon {
                break;
            }
            if t >= next_check {
                if let Some(w) = self.watch.as_mut() {
                    next_check = t.floor() + 1.0;
                    if let Some(cut) = w.check(t, &self.out.records) {
                        self.out.cut = Some(cut);
                        break;
                    }
                }
            }
            self.out.events += 1;
            self.out.end_s = t;
            if t_fail == t {
                let (_, d, recover) = failures[fi];
                fi += 1;
                if recover {
                    self.recover(d);
                } else {
                    self.fail(d, t);
                }
            } else if t_rep == t {
                let Reverse((_, d, _)) = self.heap.pop().expect("peeked");
                let d = d as usize;
                self.advance_replica(d, t);
                self.schedule(d);
            } else if t_ctl == t {
                self.control_tick(t);
            } else {
                let rec = trace.next().expect("peeked");
                if rec.timestamp_ms < prev_ms {
                    return Err(SimError::NonMonotone {
                        index: self.out.records.len(),
                        t_ms: rec.timestamp_ms,
                        prev_ms,
                    });
                }
                prev_ms = rec.timestamp_ms;
                let id = self.out.records.len();
                let key = crate::key_hash(&rec.key);
                let blocks = chain_hashes(&rec.hash_ids);
                if let Some(c) = self.control.as_mut() {
                    c.ctl.observe(key, rec.input_length, rec.output_length);
                }
                self.out.records.push(RequestRecord {
                    id: id as u64,
                    key,
                    destination: None,
                    scheduled_s: t,
                    // The simulator sends at the scheduled time.
                    sent_s: Some(t),
                    first_token_s: None,
                    finish_s: None,
                    prompt_tokens: rec.input_length.max(1),
                    output_tokens: rec.output_length.max(1),
                    cached_tokens: Some(0),
                    preemptions: 0,
                    retried: false,
                    status: Status::Unfinished,
                });
                if let Some(c) = self.control.as_mut().filter(|c| c.ctl.tunes()) {
                    // The replays' window: the last two intervals (the record moves in).
                    let keep_ms = 2000.0 * c.interval_s;
                    while c
                        .window
                        .front()
                        .is_some_and(|f| f.timestamp_ms < rec.timestamp_ms - keep_ms)
                    {
                        c.window.pop_front();
                    }
                    c.window.push_back(rec);
                }
                self.inflight.push(Some(InFlight { blocks }));
                self.dispatch(id, t);
            }
        }
        for d in 0..self.cfg.destinations {
            let c = self.replicas[d].counters();
            let t = &self.retired[d];
            let o = &mut self.out.destinations[d];
            o.prefill_tokens_computed = t.prefill_tokens_computed + c.prefill_tokens_computed;
            o.cache_query_tokens = t.cache_query_tokens + c.cache_query_tokens;
            o.cache_hit_tokens = t.cache_hit_tokens + c.cache_hit_tokens;
            o.preemptions = t.preemptions + c.preemptions;
        }
        Ok(self.out)
    }
}

impl Simulator {
    /// End the run as soon as `watch` says the step is certain to fail (checked before the
    /// first event of each model second; the output's `cut` says when).
    pub fn watched(mut self, watch: EarlyVerdict) -> Self {
        self.watch = Some(watch);
        self
    }
}

/// A cold replica, recording its KV-cache changes when the policy reads them.
fn new_replica(engine: &EngineConfig, kv_events: bool) -> Replica {
    let mut r = Replica::new(engine.clone());
    if kv_events {
        r.record_kv_events();
    }
    r
}

/// Convenience: simulate `trace` with `cfg`.
pub fn simulate<I: IntoIterator<Item = TraceRecord>>(
    cfg: SimConfig,
    trace: I,
) -> Result<SimOutput, SimError> {
    Simulator::new(cfg)?.run(trace)
}

#[cfg(test)]
mod tests;
