//! llm-d's router (endpoint picker), the default profile of its "optimized baseline" guide, as a
//! peer: a port, since the original (Go ≥ 1.25, Kubernetes) cannot be built here.
//!
//! Sources: `github.com/llm-d/llm-d-router` at release **v0.10.0** (the same rules are in
//! v0.9.0), and the profile in `github.com/llm-d/llm-d`,
//! `guides/optimized-baseline/router/optimized-baseline.values.yaml`: the plugins
//! `approx-prefix-cache-producer`, `inflight-load-producer`, then the scheduling profile
//! `prefix-cache-affinity-filter` (affinityThreshold 0.80) → `token-load-scorer` → the default
//! `max-score-picker`. Paths below are under `pkg/epp/framework/plugins/`.
//!
//! **Approximate prefix index** (`requestcontrol/dataproducer/approximateprefix/plugin.go`,
//! `indexer.go`, `types.go`; hashing in `requestcontrol/dataproducer/prefixhash/hashing.go`).
//! The prompt is cut into blocks of `blockSizeTokens`, floored at 64 tokens (vLLM's 16 becomes
//! 64), the last partial block included, at most `maxPrefixTokensToMatch / blockSize` blocks;
//! each block's hash chains the previous one. The index is fed by the router's own decisions
//! only: after a pick, every block of the request is added to the chosen endpoint's LRU
//! (`lruCapacityPerServer` entries, or with `autoTune` the engine's GPU block count), and a
//! global hash → endpoints map follows the LRUs' evictions. A request's match on endpoint e is
//! found greedily: walk the request's blocks in order, stop at the first block no endpoint
//! holds, and count for each endpoint the walked blocks it holds. Here the request's chain
//! hashes of `block_tokens`-token blocks are grouped: the index block j is named by the chain
//! hash of the last request block it covers (a chain hash names its whole prefix, as the
//! original's chained hash does). The partial last block has no chain hash here; it is named
//! by a stand-in mixed from the previous block's hash, the routing key and the prompt length
//! (so it matches an identical prompt, as the original's content hash does).
//!
//! **In-flight load** (`requestcontrol/dataproducer/inflightload/producer.go`). On a pick the
//! chosen endpoint's token counter grows by the request's *uncached* prompt tokens
//! ((total − matched) blocks × block size, plus any prompt past the indexed cap), and with the
//! profile's default (`addEstimatedOutputTokens: false`) a streamed request releases its tokens
//! at the first response chunk. This port keeps those counts itself (a per-endpoint ledger of
//! its picks, in order) and learns the release time from [`FleetView::queued_prefill_tokens`]
//! (prompt tokens sent whose first token has not come back, kept by the simulator and the
//! router): the oldest ledger entries are dropped while the remaining entries' prompts still
//! cover that count. This assumes an engine starts requests' first tokens in the order it got
//! them (vLLM's first-come-first-served scheduler does); the ledger is the router-side count
//! the original keeps, not a metric scraped from the engine. The request counter (released at
//! the end) is not read by this profile and is not kept.
//!
//! **Affinity filter** (`scheduling/filter/prefixcacheaffinity/plugin.go`). With two or more
//! candidates and a positive threshold: with probability `explorationProbability` (default 0)
//! keep all; otherwise an endpoint is sticky when matched / total blocks ≥ `affinityThreshold`;
//! none sticky: keep all. **Saturation break**: with a positive penalty and at least one
//! non-sticky endpoint, each endpoint's TTFT is estimated as in-flight tokens /
//! `peakPrefillThroughput`; if the least-loaded sticky endpoint's estimate exceeds the
//! least-loaded non-sticky one's by more than `maxTTFTPenaltyMs`, keep all. Otherwise keep only
//! the sticky endpoints. The bound is a *difference*: sticky until the holder's in-flight
//! uncached tokens exceed the idlest other endpoint's by throughput × penalty. The guide's
//! overlay wrote it as `maxTokensInFlightPenalty: 286720` (the token form of an earlier
//! filter, = 20,480 tok/s × 14 s); v0.10.0's own defaults, 15,928 tok/s × 18,000 ms, give
//! 286,704 tokens.
//!
//! **Token-load scorer** (`scheduling/scorer/tokenload/token_load.go`): tokens = the endpoint's
//! in-flight tokens + this request's uncached tokens on it; score = 1 − min(tokens,
//! `queueThresholdTokens`) / `queueThresholdTokens` (4,194,304 by default; 1 when no tokens).
//!
//! **Picker** (`scheduling/picker/maxscore/picker.go`, `scheduling/picker/common.go`): shuffle,
//! then a stable sort by score: the highest score, uniformly at random among ties.
//!
//! Not ported: Kubernetes (pods, inference pools, endpoint discovery; here destinations are
//! indices and "up" comes from [`FleetView`]), cross-replica state sync, P/D profiles, the
//! latency-predictor TTFT source, multi-prompt requests, and the binary's configuration-less
//! default (queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3,
//! `pkg/epp/config/loader/defaults.go`): it scores waiting-queue depth and KV-cache
//! utilisation scraped from the engines' metrics, which [`FleetView`] does not carry, so it
//! would not be a faithful port.

use super::{FleetView, Policy, RouteError, RouteRequest};
use crate::plan::KeyMap;
use crate::rng::{mix64, Rng64};
use rand::RngExt;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The profile's parameters, with the guide's and the plugins' documented defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlmdConfig {
    /// `affinityThreshold`: matched / total blocks at or above which an endpoint is sticky
    /// (0 or less: no filter).
    pub affinity_threshold: f64,
    /// `explorationProbability`: chance of skipping the filter.
    pub exploration_probability: f64,
    /// `peakPrefillThroughput`, tokens per second: in-flight tokens → estimated TTFT.
    pub peak_prefill_tokens_per_s: f64,
    /// `maxTTFTPenaltyMs` in seconds: the sticky endpoints' estimated TTFT may exceed the
    /// others' by this much before stickiness breaks (0: always stick).
    pub max_ttft_penalty_s: f64,
    /// `queueThresholdTokens`: in-flight tokens at which the token-load score reaches 0.
    pub queue_threshold_tokens: u64,
    /// The index's block size in tokens (`blockSizeTokens` after the producer's floor of 64).
    /// Rounded to a whole number of the request's blocks.
    pub index_block_tokens: u32,
    /// `maxPrefixTokensToMatch`: tokens of a prompt that are indexed.
    pub max_prefix_tokens: u64,
    /// `lruCapacityPerServer`: index entries per endpoint. 0: the engine's KV-cache block
    /// count where the engine model is known (the producer's `autoTune`), else 31,250.
    pub lru_capacity_per_endpoint: u64,
}

impl Default for LlmdConfig {
    fn default() -> Self {
        Self {
            affinity_threshold: 0.80,
            exploration_probability: 0.0,
            peak_prefill_tokens_per_s: 20_480.0,
            max_ttft_penalty_s: 14.0,
            queue_threshold_tokens: 4_194_304,
            index_block_tokens: 64,
            max_prefix_tokens: 131_072,
            lru_capacity_per_endpoint: 0,
        }
    }
}

/// The producer's fallback capacity when the engine's block count is not known.
pub const DEFAULT_LRU_CAPACITY: u64 = 31_250;

impl LlmdConfig {
    /// Every field outside its range, as `name: …` (see `PolicySpec::problems`).
    pub fn problems(&self) -> Vec<Option<String>> {
        use crate::bounds::{count, non_negative, positive, real, MAX_INTERVAL_S};
        let mut p = vec![
            real(
                "affinity_threshold",
                self.affinity_threshold,
                -1.0,
                false,
                1.0,
            ),
            real(
                "exploration_probability",
                self.exploration_probability,
                0.0,
                false,
                1.0,
            ),
            non_negative(
                "max_ttft_penalty_s",
                self.max_ttft_penalty_s,
                MAX_INTERVAL_S,
            ),
            count(
                "queue_threshold_tokens",
                self.queue_threshold_tokens,
                1,
                1 << 40,
            ),
            count(
                "index_block_tokens",
                self.index_block_tokens as u64,
                1,
                1 << 20,
            ),
            count("max_prefix_tokens", self.max_prefix_tokens, 1, 1 << 30),
            count(
                "lru_capacity_per_endpoint",
                self.lru_capacity_per_endpoint,
                0,
                1 << 28,
            ),
        ];
        // As the filter's own check: a throughput is needed only while the gate is on.
        if self.max_ttft_penalty_s > 0.0 {
            p.push(positive(
                "peak_prefill_tokens_per_s",
                self.peak_prefill_tokens_per_s,
                1e9,
            ));
        } else {
            p.push(non_negative(
                "peak_prefill_tokens_per_s",
                self.peak_prefill_tokens_per_s,
                1e9,
            ));
        }
        p
    }
}

/// The endpoints holding one indexed block: one inline, more in a list.
#[derive(Debug, Clone)]
enum Holders {
    One(u16),
    Many(Vec<u16>),
}

/// One endpoint's LRU of indexed blocks: last-use stamps, and the order of uses (stale entries
/// skipped when evicting, compacted when they pile up).
#[derive(Debug, Clone, Default)]
struct Lru {
    stamp: KeyMap<u64>,
    order: VecDeque<(u64, u64)>,
    next: u64,
}

/// A block's stand-in name where the request carries no chain hash for it.
fn stand_in(prev: u64, key: u64, prompt_tokens: u32, j: usize) -> u64 {
    mix64(prev ^ mix64(key ^ mix64(((prompt_tokens as u64) << 32) ^ j as u64)))
}

/// llm-d's optimized-baseline profile.
#[derive(Debug, Clone)]
pub struct Llmd {
    cfg: LlmdConfig,
    capacity: usize,
    holders: KeyMap<Holders>,
    lru: Vec<Lru>,
    /// Per endpoint: (prompt tokens, uncached tokens) of picks, oldest first, and their sums.
    ledger: Vec<VecDeque<(u32, u64)>>,
    ledger_prompt: Vec<u64>,
    ledger_tokens: Vec<u64>,
    /// Scratch: this request's index blocks and per-endpoint matched blocks.
    hashes: Vec<u64>,
    matched: Vec<u32>,
    /// Decisions by path, for tests and reports.
    pub sticky_picks: u64,
    pub saturation_breaks: u64,
}

impl Llmd {
    pub fn new(destinations: usize, cfg: LlmdConfig) -> Self {
        let capacity = if cfg.lru_capacity_per_endpoint > 0 {
            cfg.lru_capacity_per_endpoint
        } else {
            DEFAULT_LRU_CAPACITY
        } as usize;
        Self {
            cfg,
            capacity,
            holders: KeyMap::default(),
            lru: vec![Lru::default(); destinations],
            ledger: vec![VecDeque::new(); destinations],
            ledger_prompt: vec![0; destinations],
            ledger_tokens: vec![0; destinations],
            hashes: Vec::new(),
            matched: vec![0; destinations],
            sticky_picks: 0,
            saturation_breaks: 0,
        }
    }

    /// Indexed blocks destination `d` holds (for tests).
    pub fn indexed_blocks(&self, d: usize) -> usize {
        self.lru.get(d).map_or(0, |l| l.stamp.len())
    }

    /// The request's blocks in the index's block size, into `self.hashes`; returns the
    /// effective block size in tokens.
    fn index_blocks(&mut self, req: &RouteRequest) -> u64 {
        let bt = req.block_tokens.max(1) as u64;
        let k = ((self.cfg.index_block_tokens as u64 + bt / 2) / bt).max(1);
        let eff = k * bt;
        let max_blocks = (self.cfg.max_prefix_tokens / eff) as usize;
        let total = (req.prompt_tokens as u64).div_ceil(eff) as usize;
        let total = total.min(max_blocks);
        self.hashes.clear();
        let k = k as usize;
        let full = (req.blocks.len() / k).min(total);
        self.hashes
            .extend(req.blocks.chunks_exact(k).take(full).map(|c| c[k - 1]));
        let mut prev = self.hashes.last().copied().unwrap_or(0);
        for j in full..total {
            prev = stand_in(prev, req.key, req.prompt_tokens, j);
            self.hashes.push(prev);
        }
        eff
    }

    /// Drop the picks of `d` whose first token has come back; returns `d`'s in-flight tokens.
    fn in_flight_tokens(&mut self, d: usize, fleet: &dyn FleetView) -> u64 {
        let queued = fleet.queued_prefill_tokens(d);
        let q = &mut self.ledger[d];
        while let Some(&(p, t)) = q.front() {
            if self.ledger_prompt[d] - p as u64 >= queued {
                q.pop_front();
                self.ledger_prompt[d] -= p as u64;
                self.ledger_tokens[d] -= t;
            } else {
                break;
            }
        }
        self.ledger_tokens[d]
    }

    fn add_block(&mut self, hash: u64, d: usize) {
        let cap = self.capacity;
        let lru = &mut self.lru[d];
        lru.next += 1;
        let stamp = lru.next;
        let fresh = lru.stamp.insert(hash, stamp).is_none();
        lru.order.push_back((hash, stamp));
        if fresh {
            match self.holders.get_mut(&hash) {
                None => {
                    self.holders.insert(hash, Holders::One(d as u16));
                }
                Some(Holders::One(o)) => {
                    let o = *o;
                    self.holders.insert(hash, Holders::Many(vec![o, d as u16]));
                }
                Some(Holders::Many(v)) => v.push(d as u16),
            }
        }
        while lru.stamp.len() > cap {
            let Some((h, s)) = lru.order.pop_front() else {
                break;
            };
            if lru.stamp.get(&h) == Some(&s) {
                lru.stamp.remove(&h);
                Self::drop_holder(&mut self.holders, h, d as u16);
            }
        }
        if lru.order.len() > 2 * cap + 64 {
            let stamps = &lru.stamp;
            lru.order.retain(|(h, s)| stamps.get(h) == Some(s));
        }
    }

    fn drop_holder(holders: &mut KeyMap<Holders>, h: u64, d: u16) {
        match holders.get_mut(&h) {
            Some(Holders::One(o)) if *o == d => {
                holders.remove(&h);
            }
            Some(Holders::Many(v)) => {
                v.retain(|&x| x != d);
                if v.len() == 1 {
                    let o = v[0];
                    holders.insert(h, Holders::One(o));
                }
            }
            _ => {}
        }
    }
}

impl Policy for Llmd {
    fn name(&self) -> &'static str {
        "llm-d"
    }

    fn choose(
        &mut self,
        req: &RouteRequest,
        fleet: &dyn FleetView,
        rng: &mut Rng64,
    ) -> Result<usize, RouteError> {
        let n = fleet.len().min(self.lru.len());
        let eff = self.index_blocks(req);
        let total = self.hashes.len();
        // Greedy longest-prefix walk over the whole index.
        self.matched[..n].fill(0);
        for &h in &self.hashes {
            match self.holders.get(&h) {
                None => break,
                Some(Holders::One(o)) => {
                    if let Some(m) = self.matched.get_mut(*o as usize) {
                        *m += 1;
                    }
                }
                Some(Holders::Many(v)) => {
                    for &o in v {
                        if let Some(m) = self.matched.get_mut(o as usize) {
                            *m += 1;
                        }
                    }
                }
            }
        }
        let prompt = req.prompt_tokens as u64;
        let indexed = total as u64 * eff;
        let uncached = |m: u32| (total as u64 - m as u64) * eff + prompt.saturating_sub(indexed);

        let live: Vec<usize> = (0..n).filter(|&d| fleet.is_up(d)).collect();
        if live.is_empty() {
            return Err(RouteError::NoneUp(fleet.len()));
        }
        let load: Vec<u64> = live
            .iter()
            .map(|&d| self.in_flight_tokens(d, fleet))
            .collect();

        // prefix-cache-affinity-filter.
        let mut keep = vec![true; live.len()];
        let thr = self.cfg.affinity_threshold;
        let explore = self.cfg.exploration_probability > 0.0
            && rng.random::<f64>() < self.cfg.exploration_probability;
        if live.len() > 1 && thr > 0.0 && !explore {
            let score = |d: usize| {
                if total > 0 {
                    self.matched[d] as f64 / total as f64
                } else {
                    0.0
                }
            };
            let sticky: Vec<bool> = live.iter().map(|&d| score(d) >= thr).collect();
            if sticky.iter().any(|&s| s) {
                let mut broken = false;
                if self.cfg.max_ttft_penalty_s > 0.0 && sticky.iter().any(|&s| !s) {
                    let ttft_ms = |t: u64| t as f64 / self.cfg.peak_prefill_tokens_per_s * 1000.0;
                    let best = |want: bool| {
                        (0..live.len())
                            .filter(|&i| sticky[i] == want)
                            .map(|i| ttft_ms(load[i]))
                            .fold(f64::MAX, f64::min)
                    };
                    broken = best(true) - best(false) > self.cfg.max_ttft_penalty_s * 1000.0;
                }
                if broken {
                    self.saturation_breaks += 1;
                } else {
                    keep = sticky;
                    self.sticky_picks += 1;
                }
            }
        }

        // token-load-scorer, then max-score-picker (uniform among ties).
        let qt = self.cfg.queue_threshold_tokens.max(1) as f64;
        let mut best: Option<(f64, usize)> = None;
        let mut ties = 0u32;
        for (i, &d) in live.iter().enumerate() {
            if !keep[i] {
                continue;
            }
            let tokens = (load[i] + uncached(self.matched[d])) as f64;
            let s = if tokens <= 0.0 {
                1.0
            } else {
                1.0 - tokens.min(qt) / qt
            };
            match best {
                Some((b, _)) if s < b => {}
                Some((b, _)) if s == b => {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        best = Some((s, i));
                    }
                }
                _ => {
                    best = Some((s, i));
                    ties = 1;
                }
            }
        }
        let i = best.expect("a live candidate is kept").1;
        let d = live[i];

        // inflight-load-producer's PreRequest, then the prefix producer's.
        let t = uncached(self.matched[d]);
        self.ledger[d].push_back((req.prompt_tokens, t));
        self.ledger_prompt[d] += prompt;
        self.ledger_tokens[d] += t;
        let hashes = std::mem::take(&mut self.hashes);
        for &h in &hashes {
            self.add_block(h, d);
        }
        self.hashes = hashes;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FleetState;
    use crate::rng::seeded;

    /// A request of `blocks` 64-token blocks named `base + i` (so two requests share the
    /// blocks they share names for), `tail` tokens after them.
    fn request(names: &[u64], tail: u32) -> RouteRequest<'_> {
        RouteRequest {
            key: 7,
            blocks: names,
            block_tokens: 64,
            prompt_tokens: names.len() as u32 * 64 + tail,
            output_tokens: 10,
            now: 0.0,
        }
    }

    /// Route `names` once to warm destination `d`: every other destination is made busy so the
    /// token-load scorer picks `d`, then the ledgers are cleared (first tokens back).
    fn warm(p: &mut Llmd, fleet: &mut FleetState, names: &[u64], d: usize) {
        let n = fleet.len();
        let mut busy = FleetState::new(n);
        for o in 0..n {
            busy.queued_prefill[o] = if o == d { 0 } else { 1 << 40 };
            p.ledger[o].push_back((u32::MAX, 1 << 30));
            p.ledger_prompt[o] += u32::MAX as u64;
            p.ledger_tokens[o] += 1 << 30;
        }
        p.ledger[d].clear();
        p.ledger_prompt[d] = 0;
        p.ledger_tokens[d] = 0;
        let got = p.choose(&request(names, 0), &busy, &mut seeded(1)).unwrap();
        assert_eq!(got, d);
        for o in 0..n {
            p.ledger[o].clear();
            p.ledger_prompt[o] = 0;
            p.ledger_tokens[o] = 0;
        }
        *fleet = FleetState::new(n);
        assert_eq!(p.indexed_blocks(d), names.len());
    }

    /// Give destination `d` `tokens` in-flight uncached tokens (a pick whose first token has
    /// not come back).
    fn load(p: &mut Llmd, fleet: &mut FleetState, d: usize, tokens: u64) {
        p.ledger[d].push_back((1, tokens));
        p.ledger_prompt[d] += 1;
        p.ledger_tokens[d] += tokens;
        fleet.queued_prefill[d] += 1;
    }

    fn names(n: u64) -> Vec<u64> {
        (1..=n).map(mix64).collect()
    }

    #[test]
    fn the_prefix_holder_is_kept_while_under_the_penalty_even_when_busier() {
        // 20,480 tok/s × 14 s = 286,720 tokens of headroom over the idlest other endpoint.
        let mut p = Llmd::new(4, LlmdConfig::default());
        let mut fleet = FleetState::new(4);
        let b = names(10);
        warm(&mut p, &mut fleet, &b, 2);
        load(&mut p, &mut fleet, 2, 200_000);
        load(&mut p, &mut fleet, 0, 1_000);
        for seed in 0..20 {
            let got = p
                .choose(&request(&b, 0), &fleet, &mut seeded(seed))
                .unwrap();
            assert_eq!(
                got, 2,
                "the holder, 200,000 tokens busier than idle ones, is kept"
            );
            // Undo the pick's own ledger entry (a full hit adds 0 tokens, 640 prompt tokens).
            let e = p.ledger[2].pop_back().unwrap();
            p.ledger_prompt[2] -= e.0 as u64;
            assert_eq!(e.1, 0, "a full hit adds no uncached tokens");
        }
        assert_eq!(p.saturation_breaks, 0);
    }

    #[test]
    fn past_the_penalty_the_least_token_loaded_endpoint_wins() {
        let mut p = Llmd::new(4, LlmdConfig::default());
        let mut fleet = FleetState::new(4);
        let b = names(10);
        warm(&mut p, &mut fleet, &b, 2);
        // Holder 286,720 + 1,000 + 1 over endpoint 0's 1,000: the gate opens.
        load(&mut p, &mut fleet, 2, 287_721);
        load(&mut p, &mut fleet, 0, 1_000);
        load(&mut p, &mut fleet, 1, 5_000);
        load(&mut p, &mut fleet, 3, 3_000);
        let got = p.choose(&request(&b, 0), &fleet, &mut seeded(3)).unwrap();
        assert_eq!(got, 0, "the least token-loaded endpoint");
        assert_eq!(p.saturation_breaks, 1);
        // One token less and the holder is kept: the bound is exactly throughput × penalty,
        // measured against the idlest non-sticky endpoint (not against zero).
        let mut p = Llmd::new(4, LlmdConfig::default());
        let mut fleet = FleetState::new(4);
        warm(&mut p, &mut fleet, &b, 2);
        load(&mut p, &mut fleet, 2, 287_720);
        load(&mut p, &mut fleet, 0, 1_000);
        load(&mut p, &mut fleet, 1, 5_000);
        load(&mut p, &mut fleet, 3, 3_000);
        let got = p.choose(&request(&b, 0), &fleet, &mut seeded(3)).unwrap();
        assert_eq!(got, 2);
        assert_eq!(p.saturation_breaks, 0);
    }

    #[test]
    fn below_the_match_threshold_there_is_no_stickiness() {
        // 10 blocks cached; the new request shares 7 of 9 (0.78 < 0.8) or 8 of 10 (0.8).
        let b = names(10);
        for (shared, len, sticky) in [(7usize, 9usize, false), (8, 10, true)] {
            let mut p = Llmd::new(4, LlmdConfig::default());
            let mut fleet = FleetState::new(4);
            warm(&mut p, &mut fleet, &b, 2);
            load(&mut p, &mut fleet, 2, 50_000);
            let mut r: Vec<u64> = b[..shared].to_vec();
            r.extend((0..(len - shared) as u64).map(|i| mix64(1000 + i)));
            let got = p.choose(&request(&r, 0), &fleet, &mut seeded(5)).unwrap();
            if sticky {
                assert_eq!(got, 2, "{shared}/{len} ≥ 0.8 sticks to the holder");
            } else {
                assert_ne!(
                    got, 2,
                    "{shared}/{len} < 0.8: the busy holder is not forced"
                );
            }
        }
    }

    #[test]
    fn the_partial_last_block_counts_in_the_match_ratio() {
        // 4 full blocks cached; the request adds a 10-token tail: 4 of 5 blocks = 0.8 sticks,
        // while 3 full blocks + a tail (3 of 4 = 0.75) does not.
        let b = names(4);
        for (full, sticky) in [(4usize, true), (3, false)] {
            let mut p = Llmd::new(3, LlmdConfig::default());
            let mut fleet = FleetState::new(3);
            warm(&mut p, &mut fleet, &b, 1);
            load(&mut p, &mut fleet, 1, 10_000);
            let got = p
                .choose(&request(&b[..full], 10), &fleet, &mut seeded(9))
                .unwrap();
            assert_eq!(got == 1, sticky, "{full} full blocks + tail");
        }
    }

    #[test]
    fn in_flight_tokens_are_uncached_and_leave_at_the_first_token() {
        let mut p = Llmd::new(2, LlmdConfig::default());
        let mut fleet = FleetState::new(2);
        let b = names(10);
        warm(&mut p, &mut fleet, &b, 0);
        // 10 cached blocks + 2 new + a 20-token tail: uncached = 3 blocks × 64 = 192 on 0.
        let mut r = b.clone();
        r.extend([mix64(77), mix64(78)]);
        let req = request(&r, 20);
        let got = p.choose(&req, &fleet, &mut seeded(1)).unwrap();
        assert_eq!(got, 0);
        fleet.queued_prefill[0] += req.prompt_tokens as u64;
        assert_eq!(p.in_flight_tokens(0, &fleet), 192);
        fleet.queued_prefill[0] = 0;
        assert_eq!(p.in_flight_tokens(0, &fleet), 0);
    }

    #[test]
    fn ties_are_broken_at_random_and_the_index_is_bounded() {
        let cfg = LlmdConfig {
            lru_capacity_per_endpoint: 50,
            ..Default::default()
        };
        let mut p = Llmd::new(4, cfg);
        let fleet = FleetState::new(4);
        let mut seen = [0u32; 4];
        let mut rng = seeded(11);
        for i in 0..400u64 {
            let r: Vec<u64> = (0..8).map(|j| mix64(i * 100 + j + 1)).collect();
            seen[p.choose(&request(&r, 0), &fleet, &mut rng).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&s| s > 50), "{seen:?}");
        assert!((0..4).all(|d| p.indexed_blocks(d) <= 50));
        assert!(p.holders.len() <= 200);
    }
}
