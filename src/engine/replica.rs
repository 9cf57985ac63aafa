//! `Replica`: one vLLM-like engine instance on a virtual clock, for event-driven simulation and
//! emulation. Pure and deterministic: time is passed in, nothing is random, no allocation per
//! engine step (only per request), O(batch) work per event.
//!
//! Engine behaviour (vLLM V1 scheduler, see docs/engine-model.md):
//! - Each step has a token budget (`max_num_batched_tokens`). Running requests are served first,
//!   in admission order: a decode takes 1 token, an unfinished prefill takes what is left of the
//!   budget (chunked prefill). Then waiting requests are admitted FCFS while budget, a free
//!   `max_num_seqs` slot and KV blocks remain; a request that does not fit blocks the queue.
//! - A running request that cannot get the blocks for its next tokens preempts the most recently
//!   admitted running request (recompute: its blocks are released to the cache, it goes back to
//!   the head of the queue); no request is admitted in a step that preempted.
//! - On admission the prompt's whole cache units are looked up by chain hash; the longest cached
//!   prefix is reused, capped so that at least the last prompt token is recomputed.
//! - A step is atomic: its tokens appear at its end. A run of pure-decode steps is one *segment*
//!   whose step times are summed analytically (the KV read grows by `batch` tokens per step); it
//!   ends at the first completion or when blocks would run out, and a `submit` during it cuts it
//!   at the first step boundary at or after the arrival, exactly where stepping one step at a
//!   time would have admitted the arrival.

use std::collections::VecDeque;

use super::config::EngineConfig;
use super::kv::PrefixCache;
use super::EngineError;

/// A request as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Caller's id, echoed in events.
    pub id: u64,
    /// Prompt length in tokens (≥ 1).
    pub prompt_tokens: u32,
    /// Tokens to generate (0 is served as 1: an engine always samples one token).
    pub output_tokens: u32,
    /// Chain hashes of the prompt's full blocks of `hash_block_tokens` tokens
    /// ([`crate::engine::chain_hashes`]). Entries past the prompt's last full block are ignored.
    pub block_hashes: Vec<u64>,
}

/// Per-request outcome, reported at completion. Times are seconds from submission.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestStats {
    /// Caller's id.
    pub id: u64,
    /// Submission time (virtual clock).
    pub arrival_s: f64,
    /// Submission → first scheduled.
    pub queue_s: f64,
    /// Submission → first token.
    pub ttft_s: f64,
    /// Submission → last token.
    pub e2e_s: f64,
    /// Mean time per output token after the first.
    pub tpot_s: f64,
    /// Largest gap between consecutive tokens.
    pub max_itl_s: f64,
    /// Prompt tokens served from the prefix cache at first admission (vLLM's
    /// `usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u32,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Output tokens generated.
    pub output_tokens: u32,
    /// Times this request was preempted.
    pub preemptions: u32,
}

/// What happened to a request, in time order, written into the caller's buffer by
/// [`Replica::advance`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// The first output token was produced at `time`.
    FirstToken {
        /// Request id.
        id: u64,
        /// Virtual time.
        time: f64,
    },
    /// The request was preempted (its KV dropped; it will be recomputed).
    Preempted {
        /// Request id.
        id: u64,
        /// Virtual time.
        time: f64,
    },
    /// The last output token was produced at `time`.
    Finished {
        /// Virtual time.
        time: f64,
        /// Outcome.
        stats: RequestStats,
    },
}

/// Cumulative counters, readable at any time (as of the last event processed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Requests submitted.
    pub submitted: u64,
    /// Requests finished.
    pub finished: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Events processed (segments: one step, or a run of decode steps).
    pub segments: u64,
    /// Prompt (and recomputed) tokens run through prefill.
    pub prefill_tokens_computed: u64,
    /// Decode tokens run.
    pub decode_tokens: u64,
    /// Tokens looked up in the prefix cache on admission (`vllm:prefix_cache_queries_total`).
    pub cache_query_tokens: u64,
    /// Tokens found in the prefix cache on admission (`vllm:prefix_cache_hits_total`).
    pub cache_hit_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
}

#[derive(Debug)]
struct Seq {
    id: u64,
    arrival: f64,
    prompt: u32,
    output: u32,
    hashes: Vec<u64>,
    /// Whole cache units the hashes cover.
    max_units: u32,
    generated: u32,
    computed: u32,
    prefilling: bool,
    units: Vec<u32>,
    private: u32,
    sched: u32,
    first_sched: f64,
    first_token: f64,
    last_token: f64,
    max_itl: f64,
    cached: u32,
    preemptions: u32,
}

impl Seq {
    #[inline]
    fn num_tokens(&self) -> u32 {
        self.prompt + self.generated
    }
    #[inline]
    fn held(&self, bpu: u32) -> u32 {
        self.units.len() as u32 * bpu + self.private
    }
}

/// A run of `steps` pure-decode steps: step j (0-based) takes `fixed + a·(ctx0 + j·batch)`.
#[derive(Debug, Clone, Copy)]
struct DecodeRun {
    fixed: f64,
    a: f64,
    ctx0: f64,
    batch: f64,
}

impl DecodeRun {
    /// Time of the first `k` steps.
    #[inline]
    fn elapsed(&self, k: u32) -> f64 {
        let k = k as f64;
        k * self.fixed + self.a * (k * self.ctx0 + self.batch * k * (k - 1.0) / 2.0)
    }
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    start: f64,
    end: f64,
    steps: u32,
    decode: Option<DecodeRun>,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Idle,
    Pending(f64),
    Busy(Segment),
}

/// One engine replica. See the module docs for the rules and [`crate::engine`] for how a
/// simulator drives it.
#[derive(Debug)]
pub struct Replica {
    cfg: EngineConfig,
    cache: PrefixCache,
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    state: State,
    counters: EngineCounters,
    queued_prefill: u64,
    unit: u32,
    hash_blocks_per_unit: u32,
    bpu: u32,
}

impl Replica {
    /// An idle replica with an empty cache.
    pub fn new(cfg: EngineConfig) -> Replica {
        let bpu = cfg.blocks_per_unit();
        let unit = cfg.cache_unit_tokens();
        Replica {
            cache: PrefixCache::new(cfg.kv_capacity_blocks(), bpu),
            running: Vec::with_capacity(cfg.knobs().max_num_seqs.min(4096) as usize),
            waiting: VecDeque::new(),
            state: State::Idle,
            counters: EngineCounters::default(),
            queued_prefill: 0,
            unit,
            hash_blocks_per_unit: unit / cfg.knobs().hash_block_tokens,
            bpu,
            cfg,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Hand a request to the engine at `now` (≥ every earlier time given to this replica). It is
    /// considered at the first step boundary at or after `now`.
    pub fn submit(&mut self, req: EngineRequest, now: f64) -> Result<(), EngineError> {
        if req.prompt_tokens == 0 {
            return Err(EngineError::EmptyPrompt { id: req.id });
        }
        let output = req.output_tokens.max(1);
        let tokens = req.prompt_tokens as u64 + output as u64 - 1;
        let capacity = self.cfg.kv_capacity_tokens();
        if tokens > capacity {
            return Err(EngineError::RequestTooLarge {
                id: req.id,
                tokens,
                capacity,
            });
        }
        let hb = self.cfg.knobs().hash_block_tokens;
        let full_hash_blocks = (req.block_hashes.len() as u32).min(req.prompt_tokens / hb);
        let max_units = full_hash_blocks / self.hash_blocks_per_unit;
        self.counters.submitted += 1;
        self.queued_prefill += req.prompt_tokens as u64;
        self.waiting.push_back(Seq {
            id: req.id,
            arrival: now,
            prompt: req.prompt_tokens,
            output,
            hashes: req.block_hashes,
            max_units,
            generated: 0,
            computed: 0,
            prefilling: true,
            units: Vec::new(),
            private: 0,
            sched: 0,
            first_sched: f64::NAN,
            first_token: f64::NAN,
            last_token: f64::NAN,
            max_itl: 0.0,
            cached: 0,
            preemptions: 0,
        });
        match &mut self.state {
            State::Idle => self.state = State::Pending(now),
            State::Busy(seg) if seg.steps > 1 && now < seg.end => {
                let run = seg.decode.expect("multi-step segments are decode runs");
                let k = first_boundary_at_or_after(&run, seg.steps, now - seg.start);
                seg.steps = k;
                seg.end = seg.start + run.elapsed(k);
            }
            _ => {}
        }
        Ok(())
    }

    /// When this replica next needs [`Replica::advance`]: the end of the running step (or run
    /// of decode steps), or the time work was submitted to an idle replica. `None` when idle.
    pub fn next_event_time(&self) -> Option<f64> {
        match self.state {
            State::Idle => None,
            State::Pending(t) => Some(t),
            State::Busy(seg) => Some(seg.end),
        }
    }

    /// Run the engine forward through every event at or before `until`, appending what happened
    /// to `out` (not cleared). Steps that end after `until` keep running.
    pub fn advance(&mut self, until: f64, out: &mut Vec<EngineEvent>) {
        loop {
            match self.state {
                State::Idle => return,
                State::Pending(t) => {
                    if t > until {
                        return;
                    }
                    self.start_step(t, out);
                }
                State::Busy(seg) => {
                    if seg.end > until {
                        return;
                    }
                    self.finish(seg, out);
                    self.start_step(seg.end, out);
                }
            }
        }
    }

    /// Counters so far.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }
    /// Requests running (admitted, holding KV).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Requests waiting for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Requests in the replica (running + waiting).
    pub fn num_outstanding(&self) -> usize {
        self.running.len() + self.waiting.len()
    }
    /// Prompt tokens still to prefill (waiting requests before their cache lookup, plus the
    /// unfinished part of running prefills), for TTFT estimates by router policies.
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.queued_prefill
    }
    /// Fraction of KV blocks held by running requests (vLLM `kv_cache_usage_perc`: cached but
    /// unreferenced blocks do not count).
    pub fn kv_usage(&self) -> f64 {
        self.cache.used_blocks() as f64 / self.cache.total_blocks() as f64
    }
    /// The block pool and prefix cache (read-only).
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }
    /// Tokens of a prompt that would be served from this replica's cache if it were admitted
    /// now (no recency change): whole cached units, at most `prompt_tokens − 1`.
    pub fn cached_prefix_tokens(&self, block_hashes: &[u64], prompt_tokens: u32) -> u32 {
        if prompt_tokens == 0 {
            return 0;
        }
        let hb = self.cfg.knobs().hash_block_tokens;
        let full = (block_hashes.len() as u32).min(prompt_tokens / hb) / self.hash_blocks_per_unit;
        let limit = full.min((prompt_tokens - 1) / self.unit);
        let mut u = 0;
        while u < limit
            && self
                .cache
                .contains(block_hashes[((u + 1) * self.hash_blocks_per_unit - 1) as usize])
        {
            u += 1;
        }
        u * self.unit
    }
    /// Log the prefix cache's stores and evictions from now on, as an engine's KV-cache events
    /// (vLLM's `BlockStored`/`BlockRemoved`), in the trace's chain-hash space: a unit is named by
    /// the hash blocks it holds. Read them with [`Replica::drain_kv_changes`].
    pub fn record_kv_events(&mut self) {
        self.cache.record_changes(self.hash_blocks_per_unit);
    }

    /// Move the cache changes logged since the last call, in the order they happened, to the
    /// end of `out` (nothing unless [`Replica::record_kv_events`] was called). A store happens
    /// at the end of the step that computed the unit, an eviction when a step's allocation
    /// needs the blocks.
    pub fn drain_kv_changes(&mut self, out: &mut Vec<super::kv::CacheChange>) {
        self.cache.drain_changes(out);
    }

    /// Drop every cached unit no running request uses ("reset between runs"); returns how many.
    pub fn clear_prefix_cache(&mut self) -> u32 {
        self.cache.clear_unreferenced()
    }

    fn start_step(&mut self, t: f64, out: &mut Vec<EngineEvent>) {
        let seg = self.schedule(t, out);
        self.state = match seg {
            Some(seg) => State::Busy(seg),
            None => State::Idle,
        };
    }

    /// Decide the composition of the step starting at `t`, allocate its blocks, and return the
    /// segment (None when there is nothing to run).
    fn schedule(&mut self, t: f64, out: &mut Vec<EngineEvent>) -> Option<Segment> {
        let bpu = self.bpu;
        let mut budget = self.cfg.knobs().max_num_batched_tokens;
        let mut preempted = false;

        // 1. Running requests, in admission order.
        let mut i = 0;
        'running: while i < self.running.len() {
            if budget == 0 {
                self.running[i].sched = 0;
                i += 1;
                continue;
            }
            let (n, need) = {
                let s = &self.running[i];
                let n = if s.prefilling {
                    (s.num_tokens() - s.computed).min(budget)
                } else {
                    1
                };
                let need = self
                    .cfg
                    .blocks_for(s.computed + n)
                    .saturating_sub(s.held(bpu));
                (n, need)
            };
            while !self.cache.try_alloc(need) {
                let victim = self.running.len() - 1;
                self.preempt_last(t, out);
                preempted = true;
                if victim == i {
                    break 'running;
                }
            }
            let s = &mut self.running[i];
            s.private += need;
            s.sched = n;
            budget -= n;
            i += 1;
        }

        // 2. Waiting requests, FCFS, unless this step preempted.
        let mut admitted = false;
        let max_seqs = self.cfg.knobs().max_num_seqs as usize;
        while !preempted && budget > 0 && self.running.len() < max_seqs {
            let Some(s) = self.waiting.front_mut() else {
                break;
            };
            s.units.clear();
            let limit = s.max_units.min((s.num_tokens() - 1) / self.unit);
            let mut evictable_hits = 0;
            for u in 0..limit {
                let h = s.hashes[((u + 1) * self.hash_blocks_per_unit - 1) as usize];
                match self.cache.lookup(h) {
                    Some(idx) => {
                        if self.cache.refs(idx) == 0 {
                            evictable_hits += 1;
                        }
                        s.units.push(idx);
                    }
                    None => break,
                }
            }
            let hit_units = s.units.len() as u32;
            let hit = hit_units * self.unit;
            let n = (s.num_tokens() - hit).min(budget);
            let need = self.cfg.blocks_for(hit + n) - hit_units * bpu;
            if need > self.cache.available_blocks() - evictable_hits * bpu {
                s.units.clear();
                break;
            }
            for &idx in &s.units {
                self.cache.acquire(idx);
            }
            let ok = self.cache.try_alloc(need);
            debug_assert!(ok);
            let mut s = self.waiting.pop_front().expect("front exists");
            s.private = need;
            s.computed = hit;
            s.sched = n;
            self.counters.cache_query_tokens += s.num_tokens() as u64;
            self.counters.cache_hit_tokens += hit as u64;
            if s.first_sched.is_nan() {
                s.first_sched = t;
                s.cached = hit;
            }
            self.queued_prefill -= hit as u64;
            budget -= n;
            self.running.push(s);
            admitted = true;
        }

        if self.running.is_empty() {
            debug_assert!(
                self.waiting.is_empty(),
                "an empty replica admits its queue head"
            );
            return None;
        }

        // 3. Cost. A pure-decode step may extend into a run of decode steps.
        let all_decode =
            !admitted && !preempted && self.running.iter().all(|s| !s.prefilling && s.sched == 1);
        if all_decode {
            let batch = self.running.len() as u32;
            let ctx0: u64 = self.running.iter().map(|s| s.computed as u64 + 1).sum();
            let run = DecodeRun {
                fixed: self.cfg.decode_fixed_s(batch as u64),
                a: self.cfg.kv_read_s_per_token(),
                ctx0: ctx0 as f64,
                batch: batch as f64,
            };
            let mut steps = 1;
            if self.cfg.knobs().macro_steps {
                let to_completion = self
                    .running
                    .iter()
                    .map(|s| s.output - s.generated)
                    .min()
                    .unwrap_or(1);
                steps = self.decode_steps_that_fit(to_completion);
            }
            return Some(Segment {
                start: t,
                end: t + run.elapsed(steps),
                steps,
                decode: Some(run),
            });
        }
        let mut tokens = 0u64;
        let mut sampled = 0u64;
        let mut attn_pairs = 0.0;
        let mut kv_read = 0u64;
        for s in &self.running {
            if s.sched == 0 {
                continue;
            }
            tokens += s.sched as u64;
            if s.computed + s.sched == s.num_tokens() {
                sampled += 1;
            }
            if s.prefilling {
                let n = s.sched as f64;
                attn_pairs += n * (s.computed as f64 + n / 2.0);
            } else {
                kv_read += s.computed as u64 + 1;
            }
        }
        let dt = self.cfg.step_time(tokens, sampled, attn_pairs, kv_read);
        Some(Segment {
            start: t,
            end: t + dt,
            steps: 1,
            decode: None,
        })
    }

    /// Extra blocks (beyond what is held, which covers the first step) that `k` decode steps of
    /// the running batch need.
    fn extra_blocks(&self, k: u32) -> u64 {
        self.running
            .iter()
            .map(|s| {
                self.cfg
                    .blocks_for(s.computed + k)
                    .saturating_sub(s.held(self.bpu)) as u64
            })
            .sum()
    }

    /// The most decode steps, up to `max`, whose blocks are available now.
    fn decode_steps_that_fit(&self, max: u32) -> u32 {
        let avail = self.cache.available_blocks() as u64;
        if max <= 1 || self.extra_blocks(max) <= avail {
            return max.max(1);
        }
        let (mut lo, mut hi) = (1u32, max); // extra(lo) fits, extra(hi) does not
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.extra_blocks(mid) <= avail {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn finish(&mut self, seg: Segment, out: &mut Vec<EngineEvent>) {
        let end = seg.end;
        let bpu = self.bpu;
        self.counters.segments += 1;
        self.counters.steps += seg.steps as u64;
        if let Some(run) = seg.decode {
            let k = seg.steps;
            let t1 = seg.start + run.elapsed(1);
            let last_dt = if k >= 2 {
                run.fixed + run.a * (run.ctx0 + run.batch * (k - 1) as f64)
            } else {
                0.0
            };
            for s in &mut self.running {
                let extra = self
                    .cfg
                    .blocks_for(s.computed + k)
                    .saturating_sub(s.held(bpu));
                let ok = self.cache.try_alloc(extra);
                debug_assert!(ok, "decode run allocated more blocks than were available");
                s.private += extra;
                s.computed += k;
                s.generated += k;
                s.max_itl = s.max_itl.max(t1 - s.last_token).max(last_dt);
                s.last_token = end;
                s.sched = 0;
            }
            self.counters.decode_tokens += k as u64 * self.running.len() as u64;
        } else {
            for s in &mut self.running {
                let n = s.sched;
                if n == 0 {
                    continue;
                }
                s.sched = 0;
                s.computed += n;
                if s.prefilling {
                    self.counters.prefill_tokens_computed += n as u64;
                    self.queued_prefill -= n as u64;
                    register_units(
                        s,
                        &mut self.cache,
                        self.unit,
                        self.hash_blocks_per_unit,
                        bpu,
                    );
                } else {
                    self.counters.decode_tokens += n as u64;
                }
                if s.computed == s.num_tokens() {
                    s.prefilling = false;
                    s.generated += 1;
                    if s.generated == 1 {
                        s.first_token = end;
                        out.push(EngineEvent::FirstToken {
                            id: s.id,
                            time: end,
                        });
                    } else {
                        s.max_itl = s.max_itl.max(end - s.last_token);
                    }
                    s.last_token = end;
                }
            }
        }
        // Completions, keeping admission order for the rest.
        let cache = &mut self.cache;
        let counters = &mut self.counters;
        self.running.retain_mut(|s| {
            if s.generated < s.output {
                return true;
            }
            for &u in s.units.iter().rev() {
                cache.release(u);
            }
            cache.free(s.private);
            counters.finished += 1;
            let first = s.first_token;
            out.push(EngineEvent::Finished {
                time: end,
                stats: RequestStats {
                    id: s.id,
                    arrival_s: s.arrival,
                    queue_s: s.first_sched - s.arrival,
                    ttft_s: first - s.arrival,
                    e2e_s: end - s.arrival,
                    tpot_s: if s.output > 1 {
                        (end - first) / (s.output - 1) as f64
                    } else {
                        0.0
                    },
                    max_itl_s: s.max_itl,
                    cached_tokens: s.cached,
                    prompt_tokens: s.prompt,
                    output_tokens: s.output,
                    preemptions: s.preemptions,
                },
            });
            false
        });
    }

    /// Preempt the most recently admitted running request (recompute policy).
    fn preempt_last(&mut self, t: f64, out: &mut Vec<EngineEvent>) {
        let mut s = self.running.pop().expect("a running request to preempt");
        for &u in s.units.iter().rev() {
            self.cache.release(u);
        }
        s.units.clear();
        self.cache.free(s.private);
        s.private = 0;
        if s.prefilling {
            self.queued_prefill -= (s.num_tokens() - s.computed) as u64;
        }
        s.computed = 0;
        s.prefilling = true;
        s.sched = 0;
        self.queued_prefill += s.num_tokens() as u64;
        s.preemptions += 1;
        self.counters.preemptions += 1;
        out.push(EngineEvent::Preempted { id: s.id, time: t });
        self.waiting.push_front(s);
    }
}

/// Register the cache units a prefill has just completed: private blocks become a cached unit
/// (or, if another request cached the same unit meanwhile, are freed in favour of it).
fn register_units(s: &mut Seq, cache: &mut PrefixCache, unit: u32, hbpu: u32, bpu: u32) {
    let full = (s.computed / unit).min(s.max_units);
    while (s.units.len() as u32) < full {
        let u = s.units.len() as u32;
        let h = s.hashes[((u + 1) * hbpu - 1) as usize];
        match cache.insert(h) {
            Some(idx) => {
                if cache.recording() {
                    let first = (u * hbpu) as usize;
                    let parent = first.checked_sub(1).map(|p| s.hashes[p]);
                    cache.note_stored(idx, parent, &s.hashes[first..first + hbpu as usize]);
                }
                s.units.push(idx)
            }
            None => {
                let idx = cache.lookup(h).expect("present");
                cache.acquire(idx);
                s.units.push(idx);
                cache.free(bpu);
            }
        }
        s.private -= bpu;
    }
}

/// Smallest k in [1, steps] whose boundary `elapsed(k)` is at or after `target`.
fn first_boundary_at_or_after(run: &DecodeRun, steps: u32, target: f64) -> u32 {
    if target <= run.elapsed(1) {
        return 1;
    }
    let alpha = run.a * run.batch / 2.0;
    let beta = run.fixed + run.a * run.ctx0 - alpha;
    let guess = if alpha > 0.0 {
        (-beta + (beta * beta + 4.0 * alpha * target).sqrt()) / (2.0 * alpha)
    } else {
        target / beta
    };
    let mut k = (guess.ceil().max(1.0) as u64).min(steps as u64) as u32;
    while k > 1 && run.elapsed(k - 1) >= target {
        k -= 1;
    }
    while k < steps && run.elapsed(k) < target {
        k += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{chain_hashes, EngineKnobs, EngineSpec};

    fn cfg_with(spec: &str, f: impl FnOnce(&mut EngineKnobs)) -> EngineConfig {
        let spec: EngineSpec = spec.parse().unwrap();
        let mut k = EngineKnobs::for_spec(&spec);
        f(&mut k);
        EngineConfig::with_knobs(spec, k).unwrap()
    }

    fn flagship() -> EngineConfig {
        EngineConfig::parse("llama-3.3-70b:h100:fp8:tp2").unwrap()
    }

    /// 8B fp8 on one H100 with a KV cache of `blocks` 16-token blocks.
    fn small(blocks: u32, budget: u32, macro_steps: bool) -> EngineConfig {
        cfg_with("llama-3.1-8b:h100:fp8:tp1", |k| {
            k.kv_cache_bytes = Some(blocks as f64 * 16.0 * 65536.0);
            k.max_num_batched_tokens = budget;
            k.macro_steps = macro_steps;
        })
    }

    fn req(id: u64, prompt: u32, output: u32, ids: &[u64]) -> EngineRequest {
        EngineRequest {
            id,
            prompt_tokens: prompt,
            output_tokens: output,
            block_hashes: chain_hashes(ids),
        }
    }

    /// Run arrivals (time-sorted) to completion; arrivals win ties with step ends.
    fn run(cfg: EngineConfig, arrivals: Vec<(f64, EngineRequest)>) -> (Vec<EngineEvent>, Replica) {
        let mut r = Replica::new(cfg);
        let mut out = Vec::new();
        let mut it = arrivals.into_iter().peekable();
        loop {
            match (it.peek().map(|a| a.0), r.next_event_time()) {
                (Some(a), e) if e.is_none_or(|e| a <= e) => {
                    let (t, q) = it.next().unwrap();
                    r.submit(q, t).unwrap();
                }
                (_, Some(e)) => r.advance(e, &mut out),
                (None, None) => break,
                (Some(_), None) => unreachable!(),
            }
        }
        (out, r)
    }

    fn finished(events: &[EngineEvent]) -> Vec<RequestStats> {
        let mut v: Vec<RequestStats> = events
            .iter()
            .filter_map(|e| match e {
                EngineEvent::Finished { stats, .. } => Some(*stats),
                _ => None,
            })
            .collect();
        v.sort_by_key(|s| s.id);
        v
    }

    #[test]
    fn fully_cached_prompt_costs_only_its_last_blocks_prefill() {
        let cfg = flagship();
        let ids: Vec<u64> = (0..256).collect(); // 4096 tokens = 256 blocks of 16
        let (ev, r) = run(
            cfg.clone(),
            vec![(0.0, req(1, 4096, 1, &ids)), (10.0, req(2, 4096, 1, &ids))],
        );
        let s = finished(&ev);
        assert_eq!(s[0].cached_tokens, 0);
        assert_eq!(s[0].ttft_s, cfg.prefill_time(4096, 0));
        assert_eq!(s[1].cached_tokens, 4080);
        assert!((s[1].ttft_s - cfg.prefill_time(16, 4080)).abs() < 1e-12);
        assert!(s[1].ttft_s < s[0].ttft_s / 5.0);
        let c = r.counters();
        assert_eq!(c.prefill_tokens_computed, 4096 + 16);
        assert_eq!((c.cache_query_tokens, c.cache_hit_tokens), (8192, 4080));
        // A partial last block is never cached: 4100 tokens hit the 256 full blocks.
        let mut r = r;
        r.submit(req(3, 4100, 1, &ids), 20.0).unwrap();
        let mut out = Vec::new();
        r.advance(30.0, &mut out);
        assert_eq!(finished(&out)[0].cached_tokens, 4096);
        assert_eq!(r.kv_usage(), 0.0);
        assert_eq!(r.queued_prefill_tokens(), 0);
    }

    #[test]
    fn hot_prefix_stays_cached_under_cold_traffic_that_fits() {
        // 200 blocks; hot prefix 64 blocks; each cold request 32 blocks of unique prompt; three
        // cold requests between hot visits: 64 + 3·33 < 200 fits, so the hot prefix survives.
        let cfg = small(200, 8192, true);
        let hot: Vec<u64> = (0..64).collect();
        let mut arrivals = Vec::new();
        let mut t = 0.0;
        for i in 0..40u64 {
            let (prompt, ids) = if i % 4 == 0 {
                (64 * 16 + 8, hot.clone())
            } else {
                (32 * 16, (0..32).map(|j| 1_000_000 + i * 100 + j).collect())
            };
            arrivals.push((t, req(i, prompt, 4, &ids)));
            t += 1.0;
        }
        let (ev, r) = run(cfg, arrivals);
        for s in finished(&ev) {
            if s.id % 4 == 0 && s.id > 0 {
                assert_eq!(s.cached_tokens, 64 * 16, "hot request {} missed", s.id);
            } else {
                assert_eq!(s.cached_tokens, 0);
            }
        }
        assert!(
            r.cache().evicted_units() > 0,
            "cold traffic did cause evictions"
        );
        // Contrast: with 6 cold requests between visits (64 + 6·33 > 200) the prefix is lost.
        let cfg = small(200, 8192, true);
        let mut arrivals = Vec::new();
        for i in 0..21u64 {
            let (prompt, ids) = if i % 7 == 0 {
                (64 * 16 + 8, hot.clone())
            } else {
                (32 * 16, (0..32).map(|j| 1_000_000 + i * 100 + j).collect())
            };
            arrivals.push((i as f64, req(i, prompt, 4, &ids)));
        }
        let (ev, _) = run(cfg, arrivals);
        assert!(finished(&ev)
            .iter()
            .filter(|s| s.id % 7 == 0)
            .all(|s| s.cached_tokens < 64 * 16));
    }

    #[test]
    fn continuous_batching_admits_into_a_running_batch() {
        let cfg = flagship();
        let (ev, r) = run(
            cfg.clone(),
            vec![
                (0.0, req(1, 1000, 100, &[])),
                (0.0, req(2, 1000, 100, &[])),
                (0.5, req(3, 1000, 10, &[])),
            ],
        );
        let s = finished(&ev);
        // 1 and 2 were prefilled together in one step.
        assert_eq!(s[0].ttft_s, s[1].ttft_s);
        let both = cfg.step_time(2000, 2, 2.0 * 1000.0 * 500.0, 0);
        assert!((s[0].ttft_s - both).abs() < 1e-12);
        // 3 arrived mid-decode and joined at the next step boundary, not after 1 and 2 finished.
        assert!(s[2].queue_s < 0.1, "{:?}", s[2]);
        assert!(s[2].e2e_s + 0.5 < s[0].e2e_s);
        assert!(s.iter().all(|s| s.preemptions == 0));
        assert_eq!(r.counters().decode_tokens, 99 + 99 + 9);
        // Three sequences decoding at once are slower per token than one alone.
        assert!(s[0].tpot_s > cfg.decode_step_time(1, 1050));
    }

    #[test]
    fn chunked_prefill_splits_a_long_prompt_over_the_token_budget() {
        let cfg = flagship(); // budget 8192
        let (ev, r) = run(cfg.clone(), vec![(0.0, req(1, 20000, 1, &[]))]);
        let s = finished(&ev)[0];
        let expect = cfg.step_time(8192, 0, 8192.0 * 4096.0, 0)
            + cfg.step_time(8192, 0, 8192.0 * (8192.0 + 4096.0), 0)
            + cfg.step_time(3616, 1, 3616.0 * (16384.0 + 1808.0), 0);
        assert!(
            (s.ttft_s - expect).abs() < 1e-12,
            "{} vs {expect}",
            s.ttft_s
        );
        assert_eq!(r.counters().steps, 3);
        // Chunking costs only the extra per-step overhead over one unchunked prefill.
        let one = cfg.prefill_time(20000, 0);
        assert!(s.ttft_s > one && s.ttft_s < one + 3.0 * cfg.knobs().step_overhead_s);
    }

    #[test]
    fn preemptions_are_counted_and_everything_finishes() {
        // 64 blocks = 1024 tokens; three requests that each grow to 500 tokens.
        let arrivals = (0..3)
            .map(|i| (0.0, req(i, 200, 300, &[])))
            .collect::<Vec<_>>();
        let (ev, r) = run(small(64, 8192, true), arrivals);
        let s = finished(&ev);
        assert_eq!(s.len(), 3);
        let per_request: u32 = s.iter().map(|s| s.preemptions).sum();
        let events = ev
            .iter()
            .filter(|e| matches!(e, EngineEvent::Preempted { .. }))
            .count();
        let c = r.counters();
        assert!(c.preemptions > 0);
        assert_eq!(c.preemptions, per_request as u64);
        assert_eq!(c.preemptions, events as u64);
        assert!(s.iter().all(|s| s.output_tokens == 300));
        // The most recently admitted request is the victim.
        assert!(s[2].preemptions > 0 && s[0].preemptions == 0);
        // Recompute: prefill work exceeds the prompts.
        assert!(c.prefill_tokens_computed > 600);
        assert_eq!(r.kv_usage(), 0.0);
    }

    /// A mixed workload with shared prefixes, chunking and KV pressure.
    fn workload(n: u64) -> Vec<(f64, EngineRequest)> {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut t = 0.0;
        (0..n)
            .map(|i| {
                t += (next() % 1000) as f64 / 1000.0 * 0.4;
                let key = next() % 4;
                let prefix = 20 + key * 10;
                let unique = next() % 60;
                let mut ids: Vec<u64> = (0..prefix).map(|j| key * 10_000 + j).collect();
                ids.extend((0..unique).map(|j| 1_000_000 + i * 1000 + j));
                let prompt = (ids.len() as u32) * 16 + (next() % 16) as u32;
                let output = 1 + (next() % 400) as u32;
                (t, req(i, prompt, output, &ids))
            })
            .collect()
    }

    #[test]
    fn decode_runs_give_the_same_timings_as_single_steps() {
        let w = workload(120);
        let (a, ra) = run(small(600, 1024, true), w.clone());
        let (b, rb) = run(small(600, 1024, false), w);
        let (sa, sb) = (finished(&a), finished(&b));
        assert_eq!(sa.len(), 120);
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * (1.0 + x.abs());
        for (x, y) in sa.iter().zip(&sb) {
            assert_eq!(
                (x.id, x.cached_tokens, x.preemptions, x.output_tokens),
                (y.id, y.cached_tokens, y.preemptions, y.output_tokens)
            );
            for (p, q) in [
                (x.queue_s, y.queue_s),
                (x.ttft_s, y.ttft_s),
                (x.e2e_s, y.e2e_s),
                (x.tpot_s, y.tpot_s),
                (x.max_itl_s, y.max_itl_s),
            ] {
                assert!(close(p, q), "request {}: {x:?} vs {y:?}", x.id);
            }
        }
        let (ca, cb) = (ra.counters(), rb.counters());
        assert_eq!(
            EngineCounters { segments: 0, ..ca },
            EngineCounters { segments: 0, ..cb }
        );
        assert!(
            ca.preemptions > 0,
            "the workload should exercise preemption"
        );
        assert!(ca.cache_hit_tokens > 0);
        assert!(
            ca.segments * 3 < cb.segments,
            "{} vs {}",
            ca.segments,
            cb.segments
        );
    }

    #[test]
    fn runs_are_deterministic() {
        let (a, _) = run(small(600, 1024, true), workload(60));
        let (b, _) = run(small(600, 1024, true), workload(60));
        assert_eq!(a, b);
    }

    #[test]
    fn bad_requests_are_rejected_with_a_reason() {
        let mut r = Replica::new(small(64, 8192, true));
        let e = r.submit(req(1, 1000, 100, &[]), 0.0).unwrap_err();
        assert!(
            e.to_string()
                .contains("exceed the replica's KV capacity of 1024"),
            "{e}"
        );
        let e = r.submit(req(2, 0, 1, &[]), 0.0).unwrap_err();
        assert!(e.to_string().contains("0 tokens"), "{e}");
        assert_eq!(r.next_event_time(), None);
    }

    #[test]
    fn cache_peek_and_reset() {
        let ids: Vec<u64> = (0..10).collect();
        let (_, mut r) = run(small(64, 8192, true), vec![(0.0, req(1, 160, 1, &ids))]);
        let h = chain_hashes(&ids);
        assert_eq!(r.cached_prefix_tokens(&h, 160), 144);
        assert_eq!(r.cached_prefix_tokens(&h, 170), 160);
        assert_eq!(r.clear_prefix_cache(), 10);
        assert_eq!(r.cached_prefix_tokens(&h, 170), 0);
    }

    /// The KV-event log: a prompt's new units as one store chained to the cached prefix it
    /// extends, evictions as removals, in the trace's hash blocks (two per unit when the KV
    /// block is twice the hash block); nothing for units another request already cached.
    #[test]
    fn kv_changes_name_the_trace_s_hash_blocks_in_order() {
        use crate::engine::CacheChange::{Removed, Stored};
        let drain = |r: &mut Replica| {
            let mut v = Vec::new();
            r.drain_kv_changes(&mut v);
            v
        };
        // 16-token hash blocks and KV blocks: one hash block per unit.
        let mut r = Replica::new(small(64, 8192, true));
        r.record_kv_events();
        let mut out = Vec::new();
        let h = chain_hashes(&[1, 2, 3, 4, 5]);
        r.submit(req(1, 80, 1, &[1, 2, 3, 4, 5]), 0.0).unwrap();
        while let Some(t) = r.next_event_time() {
            r.advance(t, &mut out);
        }
        // 80 tokens: five whole units, stored together.
        let first = drain(&mut r);
        assert_eq!(
            first,
            vec![Stored {
                parent: None,
                hashes: h.clone()
            }]
        );
        // The same prompt extended: only the new units, chained to the cached ones.
        let h2 = chain_hashes(&[1, 2, 3, 4, 5, 6, 7]);
        r.submit(req(2, 112, 1, &[1, 2, 3, 4, 5, 6, 7]), 1.0)
            .unwrap();
        while let Some(t) = r.next_event_time() {
            r.advance(t, &mut out);
        }
        assert_eq!(
            drain(&mut r),
            vec![Stored {
                parent: Some(h2[4]),
                hashes: h2[5..].to_vec()
            }]
        );
        assert_eq!(r.clear_prefix_cache(), 7);
        match &drain(&mut r)[..] {
            [Removed { hashes }] => {
                let mut got = hashes.clone();
                got.sort_unstable();
                let mut want = h2.clone();
                want.sort_unstable();
                assert_eq!(got, want);
            }
            other => panic!("{other:?}"),
        }
        // 32-token KV blocks over 16-token hash blocks: a unit is two hash blocks.
        let cfg = cfg_with("llama-3.1-8b:h100:fp8:tp1", |k| {
            k.kv_cache_bytes = Some(64.0 * 32.0 * 65536.0);
            k.block_size = 32;
        });
        let mut r = Replica::new(cfg);
        r.record_kv_events();
        let h = chain_hashes(&[1, 2, 3, 4, 5]);
        r.submit(req(1, 80, 1, &[1, 2, 3, 4, 5]), 0.0).unwrap();
        while let Some(t) = r.next_event_time() {
            r.advance(t, &mut out);
        }
        assert_eq!(
            drain(&mut r),
            vec![Stored {
                parent: None,
                hashes: h[..4].to_vec()
            }]
        );
        assert_eq!(r.clear_prefix_cache(), 2);
        let removed = drain(&mut r);
        let [Removed { hashes }] = &removed[..] else {
            panic!("{removed:?}")
        };
        assert_eq!(hashes.len(), 4);
        // Not recording: nothing logged.
        let mut r = Replica::new(small(64, 8192, true));
        r.submit(req(1, 80, 1, &[1, 2, 3, 4, 5]), 0.0).unwrap();
        while let Some(t) = r.next_event_time() {
            r.advance(t, &mut out);
        }
        assert!(drain(&mut r).is_empty());
    }
}
