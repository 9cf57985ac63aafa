//! NVIDIA Dynamo's KV router, through its own crate: `dynamo-kv-router` 1.6.1 (Apache-2.0),
//! with no default features.
//!
//! **Index: the crate's own.** Dynamo's concurrent radix tree
//! (`ConcurrentRadixTreeCompressed`, the crate's `src/indexer/concurrent_radix_tree_compressed/`)
//! behind its thread-pool indexer (`ThreadPoolIndexer`, `src/indexer/thread_pool.rs`), what
//! Dynamo's router runs with its default `router_event_threads` (here one lane, not four). The
//! engines' KV-cache events ([`Policy::on_kv_events`]) become the crate's `RouterEvent`s (stored
//! blocks after a parent, removed blocks, cleared), one worker per destination, and go to the
//! pool's lane; before a decision the policy waits on the crate's FIFO barrier
//! (`flush_and_wait`, an `async fn` polled to completion here, no runtime) so that every event
//! delivered so far is applied, then reads each worker's overlap (`find_matches`: the blocks of
//! the prompt's prefix it holds) on its own thread. The decisions therefore do not depend on the
//! lane's timing. (The crate's single-threaded `RadixTree` keeps its nodes in `Rc`s, so a policy
//! holding it could not be `Send` without `unsafe`, which `policy` forbids.) Blocks are named by
//! the router's chain hashes; a chain hash names its whole prefix, so it stands for both of
//! Dynamo's hashes of a block (the block's own tokens and its sequence), and the tree matches
//! exactly the prefixes it would match with the engine's.
//!
//! **Selection: the crate's cost, re-stated.** The crate's default cost function and picker
//! (`DefaultWorkerSelector` in its `src/scheduling/selector/reference.rs`) compile only for
//! its tests and benchmarks (`cfg(any(test, feature = "bench"))`), and its hosts call them
//! through a scheduler queue on a tokio runtime, so the few lines that decide are restated here
//! (`worker_logit`, `pick_default_worker`, `softmax_sample_index` of that file). For a
//! destination w with `overlap` cached blocks of the prompt (block = `block_tokens` tokens):
//!
//! ```text
//! credit  = overlap_score_credit × overlap            (× 1/(1 + decay × excess prefill), when
//!                                                       overlap_score_credit_decay > 0)
//! prefill = prefill_load_scale × max((active_prefill_tokens(w) + prompt) / block − credit, 0)
//! cost(w) = prefill + decode_blocks(w) + decode_active_request_weight × active_requests(w)
//! ```
//!
//! (Without prefill tracking an aggregated worker takes the decode pool's rule,
//! `max(decode_blocks − credit, 0) + the request term`.) A test checks this restatement against
//! the crate's own `DefaultWorkerSelector`, which the crate compiles for this crate's tests
//! through its `bench` feature (a dev-dependency).
//!
//! The lowest cost wins at `router_temperature` 0 (ties at random); above 0, a softmax over
//! the costs normalised to [0, 1] (Dynamo's sampling).
//!
//! **Load: Dynamo's accounting, kept here.** The crate's active-sequence tracker
//! (`ActiveSequences`, its `src/sequences/single.rs`) is crate-private and expires requests
//! by the wall clock, so this policy keeps the same two quantities itself:
//! - `active_prefill_tokens(w)`: the prompt tokens still to compute (prompt − cached overlap at
//!   routing, Dynamo's `effective_prefill_tokens`) of the requests sent to w whose first token
//!   has not come back. The router knows when it has: the fleet's
//!   [`FleetView::queued_prefill_tokens`] drops by the prompt at each first token, and requests
//!   leave this policy's list oldest first as it drops (an engine prefills first come, first
//!   served);
//! - `decode_blocks(w)`: the distinct prompt blocks of the requests sent to w and not finished
//!   plus the new request's blocks they do not share (Dynamo's `potential_decode_blocks`),
//!   added at routing and removed at completion ([`Policy::on_complete`], matched by key and
//!   prompt length, as the hook carries no request id); a destination the fleet shows with
//!   nothing outstanding holds none (a failure's lost requests end there).

use super::{Completion, FleetView, KvEvent, Policy, RouteError, RouteRequest};
use crate::plan::KeyMap;
use crate::rng::Rng64;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, WorkerWithDpRank,
};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, KvRouterConfig, OverlapScores, RouterEvent, SyncIndexer,
    ThreadPoolIndexer,
};
use rand::RngExt;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Dynamo's router parameters that decide an aggregated fleet's routing (the crate's
/// `KvRouterConfig` fields of the same names; defaults are the crate's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamoConfig {
    /// Credit per cached block against the prefill load (Dynamo's `overlap_score_credit`, once
    /// `overlap_score_weight`); 0 ignores the cache.
    pub overlap_score_credit: f64,
    /// Decay of that credit as a destination's active prefill rises above the least loaded's;
    /// 0 = none.
    pub overlap_score_credit_decay: f64,
    /// Weight of the prefill term.
    pub prefill_load_scale: f64,
    /// Blocks' worth of cost per active request.
    pub decode_active_request_weight: f64,
    /// Softmax temperature of the choice; 0 = the cheapest (ties at random).
    pub router_temperature: f64,
    /// Count prompt tokens in prefill as load (Dynamo's `router_track_prefill_tokens`).
    pub router_track_prefill_tokens: bool,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        let d = KvRouterConfig::default();
        Self {
            overlap_score_credit: d.overlap_score_credit,
            overlap_score_credit_decay: d.overlap_score_credit_decay,
            prefill_load_scale: d.prefill_load_scale,
            decode_active_request_weight: d.decode_active_request_weight,
            router_temperature: d.router_temperature,
            router_track_prefill_tokens: d.router_track_prefill_tokens,
        }
    }
}

impl DynamoConfig {
    /// The crate's own configuration with these values (the rest at its defaults).
    pub fn kv_router_config(&self) -> KvRouterConfig {
        KvRouterConfig {
            overlap_score_credit: self.overlap_score_credit,
            overlap_score_credit_decay: self.overlap_score_credit_decay,
            prefill_load_scale: self.prefill_load_scale,
            decode_active_request_weight: self.decode_active_request_weight,
            router_temperature: self.router_temperature,
            router_track_prefill_tokens: self.router_track_prefill_tokens,
            ..KvRouterConfig::default()
        }
    }

    /// Range checks, `field: value is outside …` each.
    pub fn problems(&self) -> Vec<Option<String>> {
        use crate::bounds::non_negative;
        vec![
            non_negative("overlap_score_credit", self.overlap_score_credit, 1e6),
            non_negative(
                "overlap_score_credit_decay",
                self.overlap_score_credit_decay,
                1e6,
            ),
            non_negative("prefill_load_scale", self.prefill_load_scale, 1e6),
            non_negative(
                "decode_active_request_weight",
                self.decode_active_request_weight,
                1e9,
            ),
            non_negative("router_temperature", self.router_temperature, 1e6),
        ]
    }
}

/// The crate's index as Dynamo runs it by default: its concurrent radix tree behind its
/// thread-pool indexer (events applied on the pool's lane, matches read on the caller's
/// thread), with one lane.
struct Index {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    /// Events handed to the lane since the last barrier.
    pending: bool,
}

impl Index {
    fn new() -> Self {
        Self {
            // The block size is the pool's only for hashing token ids, which this policy does
            // not ask it to do (the blocks come hashed).
            pool: ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, 16),
            pending: false,
        }
    }

    fn apply(&mut self, event: RouterEvent) {
        // The lane is a channel that lives as long as the pool: sending cannot fail.
        let _ = self.pool.enqueue_event(event);
        self.pending = true;
    }

    /// Per worker, how many of `blocks`' leading blocks it holds, once every event handed over
    /// is applied (the crate's FIFO barrier; the routing is then independent of the lane's
    /// timing).
    fn find_matches(&mut self, blocks: &[u64]) -> OverlapScores {
        if self.pending {
            let _ = block_on(self.pool.flush_and_wait());
            self.pending = false;
        }
        if blocks.is_empty() {
            return OverlapScores::new();
        }
        let seq: Vec<LocalBlockHash> = blocks.iter().map(|&h| LocalBlockHash(h)).collect();
        self.pool.backend().find_matches(&seq, false)
    }
}

/// Run a future to completion on this thread (the crate's barrier is an `async fn` that only
/// waits on its lane's reply).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// A request sent to a destination and not finished.
#[derive(Debug, Clone)]
struct Active {
    key: u64,
    prompt_tokens: u32,
    blocks: Vec<u64>,
}

/// This policy's view of one destination's load.
#[derive(Debug, Default)]
struct Worker {
    active: Vec<Active>,
    /// Active requests holding each prompt block.
    refs: KeyMap<u32>,
    /// Requests whose first token has not come back, oldest first: (prompt, tokens to compute).
    prefill: VecDeque<(u32, u32)>,
    prefill_prompt: u64,
    prefill_tokens: u64,
    /// Events applied (the crate's event ids).
    events: u64,
}

impl Worker {
    /// Requests leave prefill, oldest first, until what is left matches the fleet's count.
    fn sync(&mut self, queued_prefill: u64, outstanding: u32) {
        while self.prefill_prompt > queued_prefill {
            let Some((prompt, tokens)) = self.prefill.pop_front() else {
                break;
            };
            self.prefill_prompt -= prompt as u64;
            self.prefill_tokens -= tokens as u64;
        }
        if outstanding == 0 && !self.active.is_empty() {
            self.active.clear();
            self.refs.clear();
        }
    }

    /// The prompt's leading blocks some active request here shares.
    fn shared_depth(&self, blocks: &[u64]) -> usize {
        if self.refs.is_empty() {
            return 0;
        }
        blocks
            .iter()
            .take_while(|b| self.refs.contains_key(b))
            .count()
    }
}

/// Dynamo's KV router.
pub struct Dynamo {
    cfg: DynamoConfig,
    index: Index,
    workers: Vec<Worker>,
    costs: Vec<(usize, f64)>,
    probabilities: Vec<f64>,
}

impl Dynamo {
    pub fn new(destinations: usize, cfg: DynamoConfig) -> Self {
        Self {
            cfg,
            index: Index::new(),
            workers: (0..destinations).map(|_| Worker::default()).collect(),
            costs: Vec::new(),
            probabilities: Vec::new(),
        }
    }

    /// Blocks of `blocks`' prefix that destination `d` holds, per the index.
    pub fn overlap(&mut self, d: usize, blocks: &[u64]) -> u32 {
        self.index
            .find_matches(blocks)
            .scores
            .get(&worker(d))
            .copied()
            .unwrap_or(0)
    }

    /// The destination for `req` and its overlap, without counting the request as its load.
    fn decide(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<(usize, u32), RouteError> {
        let n = fleet.len().min(self.workers.len());
        for d in 0..n {
            self.workers[d].sync(fleet.queued_prefill_tokens(d), fleet.outstanding(d));
        }
        let overlap = self.score(req, fleet);
        let d = self.pick(rng).ok_or(RouteError::NoneUp(fleet.len()))?;
        Ok((d, overlap[d]))
    }

    /// Every live destination's cost for `req`, in `self.costs`; the overlaps, per destination.
    fn score(&mut self, req: &RouteRequest, fleet: &dyn FleetView) -> Vec<u32> {
        let n = fleet.len().min(self.workers.len());
        let scores = self.index.find_matches(req.blocks);
        let overlap: Vec<u32> = (0..n)
            .map(|d| scores.scores.get(&worker(d)).copied().unwrap_or(0))
            .collect();
        let min_prefill = (0..n)
            .filter(|&d| fleet.is_up(d))
            .map(|d| self.workers[d].prefill_tokens)
            .min()
            .unwrap_or(0);
        self.costs.clear();
        for d in (0..n).filter(|&d| fleet.is_up(d)) {
            let w = &self.workers[d];
            let input = WorkerInput {
                prefill_tokens: w.prefill_tokens,
                decode_blocks: w.refs.len() + req.blocks.len() - w.shared_depth(req.blocks),
                requests: fleet.outstanding(d),
                overlap: overlap[d],
            };
            let c = cost(
                &self.cfg,
                req.prompt_tokens,
                req.block_tokens,
                min_prefill,
                input,
            );
            self.costs.push((d, c));
        }
        overlap
    }

    /// The crate's `pick_default_worker`: the cheapest (ties uniformly at random), or a softmax
    /// draw at a positive temperature.
    fn pick(&mut self, rng: &mut Rng64) -> Option<usize> {
        if self.costs.is_empty() {
            return None;
        }
        let t = self.cfg.router_temperature;
        if t == 0.0 {
            let mut best = None;
            let mut best_cost = f64::INFINITY;
            let mut ties = 0u32;
            for &(d, c) in &self.costs {
                if c < best_cost {
                    (best, best_cost, ties) = (Some(d), c, 1);
                } else if c == best_cost {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        best = Some(d);
                    }
                }
            }
            return best;
        }
        let row =
            softmax_sample_index(&self.costs, t, rng.random::<f64>(), &mut self.probabilities);
        Some(self.costs[row].0)
    }
}

/// What the cost reads of one destination.
#[derive(Debug, Clone, Copy, Default)]
struct WorkerInput {
    /// Prompt tokens still to compute of its requests in prefill.
    prefill_tokens: u64,
    /// Its active blocks with the request's (Dynamo's `potential_decode_blocks`).
    decode_blocks: usize,
    /// Its requests not finished.
    requests: u32,
    /// The prompt's leading blocks it holds.
    overlap: u32,
}

/// The crate's `worker_logit` (`src/scheduling/selector/reference.rs`) for an aggregated
/// worker with device overlap only; `min_prefill` is the least `prefill_tokens` of the live
/// destinations (the decay's floor).
fn cost(
    cfg: &DynamoConfig,
    prompt_tokens: u32,
    block_tokens: u32,
    min_prefill: u64,
    w: WorkerInput,
) -> f64 {
    let block = block_tokens.max(1) as f64;
    let isl = prompt_tokens as u64;
    let track = cfg.router_track_prefill_tokens;
    let decay = if track && cfg.overlap_score_credit_decay > 0.0 {
        let excess = w.prefill_tokens.saturating_sub(min_prefill) as f64 / block;
        let request_blocks = isl.div_ceil(block_tokens.max(1) as u64).max(1) as f64;
        1.0 / (1.0 + cfg.overlap_score_credit_decay * excess / request_blocks)
    } else {
        1.0
    };
    let credit = cfg.overlap_score_credit * decay * w.overlap as f64;
    let requests = cfg.decode_active_request_weight * w.requests as f64;
    if !track && cfg.overlap_score_credit > 0.0 {
        // Without prefill tracking, an aggregated worker is scored by the decode pool's rule
        // (its selector label is "decode": the crate's `WorkerType::default_selector_label`).
        return (w.decode_blocks as f64 - credit).max(0.0) + requests;
    }
    let raw_prefill_blocks = if track {
        (w.prefill_tokens + isl) as f64 / block
    } else {
        0.0
    };
    let prefill = cfg.prefill_load_scale * (raw_prefill_blocks - credit).max(0.0);
    prefill + w.decode_blocks as f64 + requests
}

/// The crate's `softmax_sample_index` (its `src/scheduling/selector/reference.rs`): costs
/// normalised by their range, probabilities ∝ exp(−normalised cost / temperature), `sample`
/// uniform in [0, 1).
fn softmax_sample_index(
    entries: &[(usize, f64)],
    temperature: f64,
    sample: f64,
    probabilities: &mut Vec<f64>,
) -> usize {
    let (lo, hi) = entries
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), e| {
            (lo.min(e.1), hi.max(e.1))
        });
    probabilities.clear();
    if lo == hi {
        probabilities.resize(entries.len(), 1.0 / entries.len() as f64);
    } else {
        let magnitude = if (hi - lo).is_finite() {
            1.0
        } else {
            lo.abs().max(hi.abs())
        };
        let min_normalized = lo / magnitude;
        let scale = -1.0 / ((hi / magnitude - min_normalized) * temperature);
        let max_scaled = min_normalized * scale;
        probabilities.extend(
            entries
                .iter()
                .map(|e| (e.1 / magnitude * scale - max_scaled).exp()),
        );
    }
    let sum: f64 = probabilities.iter().sum();
    let mut cumulative = 0.0;
    for (row, p) in probabilities.iter().enumerate() {
        cumulative += p / sum;
        if sample <= cumulative {
            return row;
        }
    }
    entries.len() - 1
}

/// Destination `d` as the crate's worker (one data-parallel rank).
fn worker(d: usize) -> WorkerWithDpRank {
    WorkerWithDpRank::new(d as u64, 0)
}

impl Policy for Dynamo {
    fn name(&self) -> &'static str {
        "dynamo"
    }

    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        let (d, overlap) = self.decide(req, fleet, rng)?;
        let cached = overlap
            .saturating_mul(req.block_tokens.max(1))
            .min(req.prompt_tokens);
        let w = &mut self.workers[d];
        if self.cfg.router_track_prefill_tokens {
            let tokens = req.prompt_tokens - cached;
            w.prefill.push_back((req.prompt_tokens, tokens));
            w.prefill_prompt += req.prompt_tokens as u64;
            w.prefill_tokens += tokens as u64;
        }
        for &b in req.blocks {
            *w.refs.entry(b).or_insert(0) += 1;
        }
        w.active.push(Active {
            key: req.key,
            prompt_tokens: req.prompt_tokens,
            blocks: req.blocks.to_vec(),
        });
        Ok(d)
    }

    fn on_complete(&mut self, req: &RouteRequest, dest: usize, _done: &Completion) {
        let Some(w) = self.workers.get_mut(dest) else {
            return;
        };
        let Some(i) = w
            .active
            .iter()
            .position(|a| a.key == req.key && a.prompt_tokens == req.prompt_tokens)
        else {
            return;
        };
        let a = w.active.swap_remove(i);
        for b in a.blocks {
            if let Some(r) = w.refs.get_mut(&b) {
                *r -= 1;
                if *r == 0 {
                    w.refs.remove(&b);
                }
            }
        }
    }

    fn on_kv_events(&mut self, dest: usize, events: &[KvEvent]) {
        let Some(w) = self.workers.get_mut(dest) else {
            return;
        };
        for e in events {
            let data = match e {
                KvEvent::Stored { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|&h| KvCacheStoredBlockData {
                            block_hash: ExternalSequenceBlockHash(h),
                            tokens_hash: LocalBlockHash(h),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
                KvEvent::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: blocks
                        .iter()
                        .map(|&h| ExternalSequenceBlockHash(h))
                        .collect(),
                }),
                KvEvent::AllCleared => KvCacheEventData::Cleared,
            };
            w.events += 1;
            let event = RouterEvent::new(
                dest as u64,
                KvCacheEvent {
                    event_id: w.events,
                    data,
                    dp_rank: 0,
                },
            );
            self.index.apply(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FleetState, PolicySpec};
    use crate::rng::{seeded, Rng64};

    const B: [u64; 4] = [101, 102, 103, 104];

    fn req<'a>(key: u64, blocks: &'a [u64], prompt_tokens: u32) -> RouteRequest<'a> {
        RouteRequest {
            key,
            blocks,
            block_tokens: 16,
            prompt_tokens,
            output_tokens: 10,
            now: 0.0,
        }
    }

    fn stored(parent: Option<u64>, blocks: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent,
            blocks: blocks.to_vec(),
        }
    }

    /// Where `r` would go under 64 different seeds, each once (a choice left to a tie shows
    /// as several).
    fn choices(p: &mut Dynamo, r: &RouteRequest, fleet: &FleetState) -> Vec<usize> {
        let mut got: Vec<usize> = (0..64)
            .map(|s| p.decide(r, fleet, &mut seeded(s)).unwrap().0)
            .collect();
        got.sort_unstable();
        got.dedup();
        got
    }

    /// Route `r` for real: the policy's choice, and the fleet counts it as the router would.
    fn send(p: &mut Dynamo, r: &RouteRequest, fleet: &mut FleetState) -> usize {
        let d = p.choose(r, fleet, &mut seeded(0)).unwrap();
        fleet.outstanding[d] += 1;
        fleet.queued_prefill[d] += r.prompt_tokens as u64;
        d
    }

    /// The documented rules on two idle destinations, a 64-token prompt of four 16-token blocks
    /// (cost = prefill_load_scale × max((active prefill + prompt)/block − overlap, 0) + decode
    /// blocks): each assertion fails if its rule is dropped.
    #[test]
    fn cached_overlap_wins_until_prefill_or_decode_load_outweighs_it() {
        let mut p = Dynamo::new(2, DynamoConfig::default());
        let mut fleet = FleetState::new(2);
        let b = req(1, &B, 64);
        // Nothing cached: 4 + 4 blocks each, a tie, settled at random.
        assert_eq!(choices(&mut p, &b, &fleet), vec![0, 1]);
        // Destination 1 holds the whole prefix: 0 + 4 against 4 + 4. (Ignoring the overlap
        // leaves the tie.)
        p.on_kv_events(1, &[stored(None, &B[..2]), stored(Some(B[1]), &B[2..])]);
        assert_eq!(p.overlap(1, &B), 4);
        assert_eq!(p.overlap(0, &B), 0);
        assert_eq!(choices(&mut p, &b, &fleet), vec![1]);

        // Prefill load: a 160-token prompt without full blocks goes to 1 (0 is down for it) and
        // waits for its first token: 1 costs (160 + 64)/16 − 4 + 4 = 14 against 8. (Ignoring
        // the active prefill: 4 against 8.)
        fleet.up[0] = false;
        let a = req(2, &[], 160);
        assert_eq!(send(&mut p, &a, &mut fleet), 1);
        fleet.up[0] = true;
        assert_eq!(choices(&mut p, &b, &fleet), vec![0]);
        // Its first token: the fleet's queued prefill drops by its prompt, 1 costs 4 again.
        fleet.queued_prefill[1] -= 160;
        assert_eq!(choices(&mut p, &b, &fleet), vec![1]);
        p.on_complete(&a, 1, &Completion::default());
        fleet.outstanding[1] -= 1;

        // Decode load: eight 16-token blocks of another prompt running on 1 after its prefill:
        // 1 costs 0 + (8 + 4) = 12 against 8. (Ignoring decode blocks: 0 against 4.)
        let other: Vec<u64> = (201..209).collect();
        fleet.up[0] = false;
        let c = req(3, &other, 128);
        assert_eq!(send(&mut p, &c, &mut fleet), 1);
        fleet.up[0] = true;
        fleet.queued_prefill[1] -= 128;
        assert_eq!(choices(&mut p, &b, &fleet), vec![0]);
        // It finishes: 1 wins again.
        p.on_complete(&c, 1, &Completion::default());
        fleet.outstanding[1] -= 1;
        assert_eq!(choices(&mut p, &b, &fleet), vec![1]);

        // A half-overlap on 0 (4 − 2 + 4 = 6) loses to 1's whole one (4) …
        p.on_kv_events(0, &[stored(None, &B[..2])]);
        assert_eq!(choices(&mut p, &b, &fleet), vec![1]);
        // … until 1's cache is cleared (AllCleared): 6 against 8.
        p.on_kv_events(1, &[KvEvent::AllCleared]);
        assert_eq!(p.overlap(1, &B), 0);
        assert_eq!(choices(&mut p, &b, &fleet), vec![0]);
        // Removed blocks leave the overlap at the prefix still held.
        p.on_kv_events(1, &[stored(None, &B)]);
        p.on_kv_events(
            1,
            &[KvEvent::Removed {
                blocks: vec![B[2], B[3]],
            }],
        );
        assert_eq!(p.overlap(1, &B), 2);
    }

    /// Shared blocks count once in the decode load (Dynamo's `potential_decode_blocks`): a
    /// request on the same prefix already running adds only its new blocks.
    #[test]
    fn decode_load_counts_blocks_shared_with_running_requests_once() {
        let mut p = Dynamo::new(2, DynamoConfig::default());
        let mut fleet = FleetState::new(2);
        let long: Vec<u64> = (1..=8).collect();
        fleet.up[0] = false;
        let a = req(1, &long, 128);
        assert_eq!(send(&mut p, &a, &mut fleet), 1);
        fleet.up[0] = true;
        fleet.queued_prefill[1] = 0;
        // Its first four blocks again (nothing cached anywhere): on 1, 4 + (8 + 0) = 12; on 0,
        // 4 + 4 = 8. A prompt of four other blocks: 4 + (8 + 4) = 16 on 1.
        assert_eq!(p.workers[1].refs.len(), 8);
        assert_eq!(p.workers[1].shared_depth(&long[..4]), 4);
        assert_eq!(p.workers[1].shared_depth(&B), 0);
        assert_eq!(choices(&mut p, &req(2, &long[..4], 64), &fleet), vec![0]);
        // With those four cached on 1 as well: 0 + 8 on 1 against 4 + 4 on 0, a tie.
        p.on_kv_events(1, &[stored(None, &long[..4])]);
        assert_eq!(choices(&mut p, &req(2, &long[..4], 64), &fleet), vec![0, 1]);
        // A failure's lost requests: the fleet shows nothing outstanding on 1, its blocks go.
        fleet.outstanding[1] = 0;
        let _ = choices(&mut p, &req(2, &B, 64), &fleet);
        assert!(p.workers[1].refs.is_empty() && p.workers[1].active.is_empty());
    }

    /// At a positive temperature the choice is a softmax draw over normalised costs: the
    /// cheaper destination most often, the dearer one sometimes.
    #[test]
    fn temperature_samples_and_zero_temperature_does_not() {
        let cfg = DynamoConfig {
            router_temperature: 1.0,
            ..Default::default()
        };
        let mut p = Dynamo::new(2, cfg);
        p.on_kv_events(1, &[stored(None, &B)]);
        let fleet = FleetState::new(2);
        let b = req(1, &B, 64);
        let picks: Vec<usize> = (0..400)
            .map(|s| p.decide(&b, &fleet, &mut seeded(s)).unwrap().0)
            .collect();
        let ones = picks.iter().filter(|&&d| d == 1).count();
        // Costs 8 and 4 normalise to 1 and 0: p(1) = 1/(1 + e^-1) ≈ 0.73.
        assert!((250..340).contains(&ones), "{ones}");
        // The sampler on the same numbers: row 0 takes [0, 0.269], row 1 the rest.
        let mut probs = Vec::new();
        let costs = [(0, 8.0), (1, 4.0)];
        assert_eq!(softmax_sample_index(&costs, 1.0, 0.26, &mut probs), 0);
        assert_eq!(softmax_sample_index(&costs, 1.0, 0.28, &mut probs), 1);
        // At temperature 0 the cheaper always.
        let mut p = Dynamo::new(2, DynamoConfig::default());
        p.on_kv_events(1, &[stored(None, &B)]);
        assert_eq!(choices(&mut p, &b, &fleet), vec![1]);
    }

    /// The restated cost against the crate's own default selector (`DefaultWorkerSelector`,
    /// compiled for this crate's tests through its `bench` feature), on random fleets and
    /// parameters: the same destination wherever the cheapest is unique.
    #[test]
    fn the_restated_cost_picks_what_the_crate_s_selector_picks() {
        use dynamo_kv_router::protocols::{RoutingConstraints, WorkerConfigLike, WorkerId};
        use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode};
        use dynamo_kv_router::{
            DefaultWorkerSelector, SchedulingRequest, WorkerLoadProjection, WorkerSelectionInput,
            WorkerSelector,
        };
        use std::collections::{HashMap, HashSet};

        struct Aggregated(HashSet<String>);
        impl WorkerConfigLike for Aggregated {
            fn data_parallel_start_rank(&self) -> u32 {
                0
            }
            fn data_parallel_size(&self) -> u32 {
                1
            }
            fn max_num_batched_tokens(&self) -> Option<u64> {
                None
            }
            fn total_kv_blocks(&self) -> Option<u64> {
                None
            }
            fn taints(&self) -> &HashSet<String> {
                &self.0
            }
        }

        let mut compared = 0;
        for case in 0..400u64 {
            let mut r = seeded(case);
            let pick = |r: &mut Rng64, v: &[f64]| v[r.random_range(0..v.len())];
            let cfg = DynamoConfig {
                overlap_score_credit: pick(&mut r, &[0.0, 0.5, 1.0, 2.0]),
                overlap_score_credit_decay: pick(&mut r, &[0.0, 0.0, 1.0, 4.0]),
                prefill_load_scale: pick(&mut r, &[0.5, 1.0, 1.0, 3.0]),
                decode_active_request_weight: pick(&mut r, &[0.0, 0.0, 1.0, 8.0]),
                router_temperature: 0.0,
                router_track_prefill_tokens: r.random_range(0..4) > 0,
            };
            let n = r.random_range(2..9usize);
            let isl: u32 = r.random_range(1..4096);
            let blocks = isl / 16;
            let inputs: Vec<WorkerInput> = (0..n)
                .map(|_| WorkerInput {
                    prefill_tokens: r.random_range(0..6000),
                    decode_blocks: r.random_range(0..400),
                    requests: r.random_range(0..30),
                    overlap: r.random_range(0..=blocks),
                })
                .collect();
            let min_prefill = inputs.iter().map(|w| w.prefill_tokens).min().unwrap();
            let costs: Vec<f64> = inputs
                .iter()
                .map(|&w| cost(&cfg, isl, 16, min_prefill, w))
                .collect();
            let best = (0..n)
                .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
                .unwrap();
            if (0..n).any(|d| d != best && costs[d] - costs[best] < 1e-9) {
                continue;
            }

            let workers: HashMap<WorkerId, Aggregated> = (0..n as u64)
                .map(|d| (d, Aggregated(HashSet::new())))
                .collect();
            let mut request = SchedulingRequest {
                mode: ScheduleMode::QueryOnly { request_id: None },
                token_seq: None,
                isl_tokens: isl as usize,
                lora_name: None,
                expected_output_tokens: None,
                affinity_target: None,
                pinned_worker: None,
                allowed_worker_ids: None,
                routing_constraints: RoutingConstraints {
                    required_taints: HashSet::new(),
                    preferred_taints: HashMap::new(),
                },
                router_config_override: None,
                track_prefill_tokens: cfg.router_track_prefill_tokens,
                priority_jump: 0.0,
                strict_priority: 0,
                policy_class: None,
                session_context: None,
                overlap: OverlapSignals {
                    tier_overlap_blocks: Default::default(),
                    effective_overlap_blocks: Default::default(),
                    effective_cached_tokens: Default::default(),
                },
                kv_transfer_candidates: None,
                retain_kv_transfer_chain: false,
                shared_cache_hits: None,
                worker_loads: Default::default(),
                resp_tx: None,
            };
            for (d, w) in inputs.iter().enumerate() {
                let o = &mut request.overlap;
                o.effective_overlap_blocks
                    .insert(worker(d), w.overlap as f64);
                o.effective_cached_tokens
                    .insert(worker(d), w.overlap as usize * 16);
                request.worker_loads.insert(
                    worker(d),
                    WorkerLoadProjection {
                        active_prefill_tokens: w.prefill_tokens as usize,
                        active_decode_blocks: w.decode_blocks / 2,
                        active_requests: w.requests as usize,
                        additional_active_blocks: w.decode_blocks - w.decode_blocks / 2,
                    },
                );
            }
            // Aggregated workers carry the decode pool's selector label.
            let selector = DefaultWorkerSelector::new(Some(cfg.kv_router_config()), "decode");
            let got = selector
                .select_worker(WorkerSelectionInput::configured(
                    &workers,
                    &request,
                    request.eligibility(),
                    16,
                ))
                .unwrap();
            assert_eq!(
                got.worker,
                worker(best),
                "case {case}: {cfg:?} {inputs:?} {costs:?}"
            );
            compared += 1;
        }
        assert!(compared > 300, "{compared}");
    }

    #[test]
    fn spec_defaults_are_the_crate_s_and_bad_fields_are_named() {
        let spec = PolicySpec::from_name("dynamo").unwrap();
        assert_eq!(spec.label(), "dynamo");
        assert!(spec.reads_blocks() && spec.reads_kv_events() && spec.reads_completions());
        assert!(!PolicySpec::from_name("preble").unwrap().reads_kv_events());
        let PolicySpec::Dynamo(c) = &spec else {
            panic!("{spec:?}")
        };
        let k = KvRouterConfig::default();
        assert_eq!(c.overlap_score_credit, k.overlap_score_credit);
        assert_eq!(c.prefill_load_scale, k.prefill_load_scale);
        assert_eq!(c.router_temperature, k.router_temperature);
        assert!(spec.problems().is_empty());
        assert!(c.kv_router_config().validate().is_ok());
        let parsed: PolicySpec =
            yaml_serde::from_str("{policy: dynamo, prefill_load_scale: -1}").unwrap();
        let problems = parsed.problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("prefill_load_scale:"),
            "{problems:?}"
        );
        assert!(yaml_serde::from_str::<PolicySpec>("{policy: dynamo, overlap_weight: 1}").is_err());
        // Down destinations are never chosen; none up is an error.
        let mut p = spec.build(4, 1);
        let mut fleet = FleetState::new(4);
        fleet.up[2] = false;
        for s in 0..50 {
            assert_ne!(
                p.choose(&req(s, &B, 64), &fleet, &mut seeded(s)).unwrap(),
                2
            );
        }
        fleet.up = vec![false; 4];
        assert_eq!(
            p.choose(&req(1, &B, 64), &fleet, &mut seeded(1)),
            Err(RouteError::NoneUp(4))
        );
    }
}
