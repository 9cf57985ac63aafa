//! The engine task: one [`Replica`] driven in real time. The virtual clock is
//! `v = (real time since start) × time_scale` ([`TimeScale::model_since`]); the task sleeps
//! until the replica's next event (converted to real time: [`TimeScale::wall_duration`]), the
//! next streamed token, or a command, then advances the replica to `v` and hands out what
//! happened.
//!
//! Token timing: the first token is the engine's `FirstToken` event; the last one is its
//! `Finished` event (exact, from the model). In between, the replica schedules a run of decode
//! steps as one event and does not expose the individual steps, so intermediate tokens are
//! released on a shared *decode tick*, like the engine's shared steps: the tick restarts at
//! every engine event (a step boundary) and then repeats every
//! `decode_step_time(batch, context)` of the model, with the batch and context of the requests
//! known to be decoding; each tick gives every decoding request one token, never its last one
//! (that waits for `Finished`). Steps that mix a long prefill chunk with decodes are slower than
//! the tick, so tokens may run ahead there; the last token and TTFT stay exact. A preempted
//! request's tokens pause until it finishes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::kv_publish::KvTap;
use super::metrics::MetricsState;
use crate::bounds::TimeScale;
use crate::engine::{EngineConfig, EngineEvent, EngineRequest, Replica, RequestStats};
use crate::telemetry::kv_events::EventBatch;

/// What a request's HTTP handler receives, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TokenEvent {
    /// `n` more output tokens are available (the first one is the first token).
    Tokens(u32),
    /// All tokens were delivered; the engine's outcome.
    Finished(RequestStats),
    /// The engine refused the request.
    Failed(String),
}

/// A request for the engine.
#[derive(Debug)]
pub(crate) struct Job {
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub block_hashes: Vec<u64>,
    /// The token ids of the full blocks (`block_tokens` per hash), when KV-cache events are
    /// published.
    pub block_token_ids: Option<Vec<u32>>,
    pub events: mpsc::UnboundedSender<TokenEvent>,
    /// When the HTTP request arrived (TTFT and latency in `/metrics` count from here).
    pub received: Instant,
}

enum Command {
    Submit(Job),
    ResetPrefixCache(oneshot::Sender<u32>),
    FlushIfIdle(oneshot::Sender<Result<u32, Busy>>),
}

/// The engine holds requests (running, waiting), so a flush that needs it idle is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy {
    pub running: usize,
    pub waiting: usize,
}

/// The engine task has stopped (the emulator is shutting down).
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineGone;

/// Cheap, cloneable access to the engine task.
#[derive(Debug, Clone)]
pub(crate) struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(j) => write!(f, "Submit({} tokens)", j.prompt_tokens),
            Command::ResetPrefixCache(_) => write!(f, "ResetPrefixCache"),
            Command::FlushIfIdle(_) => write!(f, "FlushIfIdle"),
        }
    }
}

impl EngineHandle {
    /// Hand a request to the engine; its events arrive on `job.events`.
    pub fn submit(&self, job: Job) -> Result<(), EngineGone> {
        self.tx.send(Command::Submit(job)).map_err(|_| EngineGone)
    }

    /// Drop every cached prefix no running request uses; returns how many cache units went.
    pub async fn reset_prefix_cache(&self) -> Result<u32, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::ResetPrefixCache(tx))
            .map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// SGLang's flush: the whole prefix cache goes, but only while no request runs or waits
    /// (requests whose client went away included: they are still in the engine).
    pub async fn flush_if_idle(&self) -> Result<Result<u32, Busy>, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::FlushIfIdle(tx))
            .map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }
}

/// Spawn the engine task on the current runtime. It stops when `shutdown` turns true or every
/// handle is dropped.
pub(crate) fn spawn(
    cfg: EngineConfig,
    time_scale: TimeScale,
    metrics: Arc<Mutex<MetricsState>>,
    kv_events: Option<(mpsc::UnboundedSender<EventBatch>, u32)>,
    shutdown: watch::Receiver<bool>,
) -> (EngineHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(run(cfg, time_scale, metrics, kv_events, rx, shutdown));
    (EngineHandle { tx }, task)
}

/// A request known to the engine task.
struct Active {
    events: mpsc::UnboundedSender<TokenEvent>,
    prompt: u32,
    output: u32,
    /// Tokens handed out so far.
    sent: u32,
    received: Instant,
    /// Between its first token and a preemption: intermediate tokens flow.
    decoding: bool,
    /// Its full blocks' hashes, held by the KV-event tap (empty when events are off).
    kv_hashes: Vec<u64>,
}

impl Active {
    fn wants_token(&self) -> bool {
        self.decoding && self.sent + 1 < self.output
    }
    fn send(&self, ev: TokenEvent) {
        // A closed receiver means the client went away; the engine model has no abort, so the
        // request keeps its place in the engine and its tokens go nowhere.
        let _ = self.events.send(ev);
    }
}

struct Engine {
    replica: Replica,
    start: Instant,
    clock: TimeScale,
    active: HashMap<u64, Active>,
    next_id: u64,
    events: Vec<EngineEvent>,
    metrics: Arc<Mutex<MetricsState>>,
    /// Virtual time of the next decode tick (infinite when no request wants a token).
    next_tick_v: f64,
    /// The KV-cache event publisher's feed, when events are on.
    kv: Option<KvTap>,
}

impl Engine {
    fn now_v(&self) -> f64 {
        self.clock.model_since(self.start.elapsed())
    }

    fn real_instant(&self, v: f64) -> Instant {
        // Capped at 1e9 s, so that the instant cannot overflow.
        let wall = self
            .clock
            .wall_duration(v)
            .min(Duration::from_secs(1_000_000_000));
        self.start + wall
    }

    /// The virtual time this task must next wake at, if any.
    fn wake_v(&self) -> Option<f64> {
        let tok = self.next_tick_v.is_finite().then_some(self.next_tick_v);
        match (self.replica.next_event_time(), tok) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn command(&mut self, cmd: Command, now: f64) {
        match cmd {
            Command::Submit(job) => {
                let id = self.next_id;
                self.next_id += 1;
                let kv_hashes = match (&self.kv, &job.block_token_ids) {
                    (Some(_), Some(_)) => job.block_hashes.clone(),
                    _ => Vec::new(),
                };
                let req = EngineRequest {
                    id,
                    prompt_tokens: job.prompt_tokens,
                    output_tokens: job.output_tokens,
                    block_hashes: job.block_hashes,
                };
                match self.replica.submit(req, now) {
                    Ok(()) => {
                        if let (Some(kv), Some(ids)) = (&mut self.kv, &job.block_token_ids) {
                            kv.hold(&kv_hashes, ids);
                        }
                        self.active.insert(
                            id,
                            Active {
                                events: job.events,
                                prompt: job.prompt_tokens,
                                output: job.output_tokens.max(1),
                                sent: 0,
                                received: job.received,
                                decoding: false,
                                kv_hashes,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = job.events.send(TokenEvent::Failed(e.to_string()));
                    }
                }
            }
            Command::ResetPrefixCache(reply) => {
                let n = match &mut self.kv {
                    Some(kv) => kv.reset(&mut self.replica),
                    None => self.replica.clear_prefix_cache(),
                };
                let _ = reply.send(n);
            }
            Command::FlushIfIdle(reply) => {
                let busy = Busy {
                    running: self.replica.num_running(),
                    waiting: self.replica.num_waiting(),
                };
                let _ = reply.send(
                    if self.active.is_empty() && busy.running + busy.waiting == 0 {
                        Ok(match &mut self.kv {
                            Some(kv) => kv.reset(&mut self.replica),
                            None => self.replica.clear_prefix_cache(),
                        })
                    } else {
                        Err(busy)
                    },
                );
            }
        }
    }

    /// The model's current decode cadence for the requests known to be decoding.
    fn decode_step_v(&self) -> f64 {
        let (mut batch, mut ctx) = (0u32, 0u64);
        for a in self.active.values().filter(|a| a.decoding) {
            batch += 1;
            ctx += (a.prompt + a.sent) as u64;
        }
        self.replica
            .config()
            .decode_step_time(batch.max(1), ctx)
            .max(1e-6)
    }

    /// Advance the replica to `now`, publish counters, hand out events and due tokens.
    fn step(&mut self, now: f64) {
        self.replica.advance(now, &mut self.events);
        // What the cache did in this advance, before a finished request lets its blocks go.
        if let Some(kv) = &mut self.kv {
            kv.publish(&mut self.replica);
        }
        let metrics = self.metrics.clone();
        let mut m = metrics.lock().unwrap_or_else(|p| p.into_inner());
        // Counters first, so a client that has its last token sees them in /metrics.
        m.set_engine(
            self.replica.counters(),
            self.replica.num_running(),
            self.replica.num_waiting(),
            self.replica.kv_usage(),
        );
        let events = std::mem::take(&mut self.events);
        // Ticks that fell before this batch of events, on the old rhythm.
        let first_event = events.first().map_or(now, event_time);
        self.ticks_until(first_event);
        for ev in &events {
            match *ev {
                EngineEvent::FirstToken { id, .. } => {
                    if let Some(a) = self.active.get_mut(&id) {
                        a.sent = 1;
                        a.decoding = true;
                        m.observe_first_token(a.prompt, a.received.elapsed().as_secs_f64());
                        a.send(TokenEvent::Tokens(1));
                    }
                }
                EngineEvent::Preempted { id, .. } => {
                    if let Some(a) = self.active.get_mut(&id) {
                        a.decoding = false;
                    }
                }
                EngineEvent::Finished { stats, .. } => {
                    if let Some(a) = self.active.remove(&stats.id) {
                        if let Some(kv) = &mut self.kv {
                            kv.release(&a.kv_hashes);
                        }
                        let rest = a.output.saturating_sub(a.sent);
                        if rest > 0 {
                            a.send(TokenEvent::Tokens(rest));
                        }
                        m.observe_finished(&stats, a.received.elapsed().as_secs_f64());
                        a.send(TokenEvent::Finished(stats));
                    }
                }
            }
        }
        drop(m);
        // An engine event is a step boundary: the next decode step starts there.
        if let Some(last) = events.last() {
            self.next_tick_v = event_time(last) + self.decode_step_v();
        }
        self.events = events;
        self.events.clear();
        self.ticks_until(now);
    }

    /// Hand out the decode ticks at or before `t`; re-arm the next one.
    fn ticks_until(&mut self, t: f64) {
        if !self.active.values().any(Active::wants_token) {
            self.next_tick_v = f64::INFINITY;
            return;
        }
        if !self.next_tick_v.is_finite() {
            // Nobody was decoding: start ticking from here.
            self.next_tick_v = t + self.decode_step_v();
        }
        let mut due: HashMap<u64, u32> = HashMap::new();
        while self.next_tick_v <= t {
            let mut any = false;
            for (&id, a) in self.active.iter_mut().filter(|(_, a)| a.wants_token()) {
                a.sent += 1;
                *due.entry(id).or_default() += 1;
                any = true;
            }
            if !any {
                break;
            }
            self.next_tick_v += self.decode_step_v();
        }
        for (id, n) in due {
            self.active[&id].send(TokenEvent::Tokens(n));
        }
        if !self.active.values().any(Active::wants_token) {
            self.next_tick_v = f64::INFINITY;
        }
    }
}

fn event_time(e: &EngineEvent) -> f64 {
    match *e {
        EngineEvent::FirstToken { time, .. }
        | EngineEvent::Preempted { time, .. }
        | EngineEvent::Finished { time, .. } => time,
    }
}

async fn run(
    cfg: EngineConfig,
    clock: TimeScale,
    metrics: Arc<Mutex<MetricsState>>,
    kv_events: Option<(mpsc::UnboundedSender<EventBatch>, u32)>,
    mut rx: mpsc::UnboundedReceiver<Command>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut replica = Replica::new(cfg);
    let kv = kv_events.map(|(out, block_tokens)| KvTap::new(&mut replica, block_tokens, out));
    let mut e = Engine {
        replica,
        start: Instant::now(),
        clock,
        active: HashMap::new(),
        next_id: 0,
        events: Vec::new(),
        metrics,
        next_tick_v: f64::INFINITY,
        kv,
    };
    loop {
        if *shutdown.borrow() {
            break;
        }
        let wake = e.wake_v().map(|v| e.real_instant(v));
        let sleep = async {
            match wake {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        let mut cmds = Vec::new();
        tokio::select! {
            biased;
            r = shutdown.changed() => match r {
                Ok(()) => continue,
                Err(_) => break,
            },
            cmd = rx.recv() => match cmd {
                Some(c) => cmds.push(c),
                None => break,
            },
            _ = sleep => {}
        }
        while let Ok(c) = rx.try_recv() {
            cmds.push(c);
        }
        let now = e.now_v();
        // Every event up to `now` happens before the new arrivals (times never go back).
        e.step(now);
        if !cmds.is_empty() {
            for c in cmds {
                e.command(c, now);
            }
            // A submit to an idle replica asks for a step at `now`.
            e.step(now);
        }
    }
    // Shutting down: dropping `e` closes every request's channel; handlers report the
    // interruption to their clients.
}
