//! A second thread for the planner's two-way splits, started once per process and kept.
//!
//! Starting a thread costs about a quarter of a millisecond on a small VM (the kernel maps its
//! stack, the thread is scheduled, it touches its first pages) — a twentieth of a
//! full-admission plan of 128,824 keys, and two of them (the sort's halves, then the dispatch
//! index beside the placement) a tenth. So the planner asks for its helper with [`start`] before
//! validating the input, which lets the thread come up while the first pass runs, and every
//! later split of this and later plans (the router replans every interval) reuses it.
//!
//! [`join`] runs two closures at the same time, one on the helper and one on the caller, and
//! returns when both have finished. They may wait on each other (a barrier): when the helper
//! is busy with another plan (two plans built at once on different threads) the first closure
//! gets a thread of its own, as `std::thread::scope` would give it. What the closures compute
//! never depends on which thread ran them.
//!
//! Waits between the two threads are short (a plan's threads meet every few hundred
//! microseconds), so they spin before they sleep: [`SpinBarrier`] for the meetings inside a
//! job, and the helper and the caller check for the next job or its end [`SPINS`] times
//! first. Waking a sleeping thread took 20–80 µs at each meeting here.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvError, Sender, TryRecvError};
use std::sync::{Mutex, OnceLock};

/// How many times a thread checks, a pause between checks, before it gives up its CPU (a
/// [`SpinBarrier`]) or sleeps (the helper between jobs, the caller awaiting the helper): some
/// tens of microseconds. The threads of one plan meet a few times within a millisecond, and
/// waking a sleeping thread costs about as much again on a small VM.
const SPINS: u32 = 1 << 12;

/// The next message on `rx`: checked [`SPINS`] times before sleeping on it.
fn recv_soon<T>(rx: &Receiver<T>) -> Result<T, RecvError> {
    for _ in 0..SPINS {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
        }
    }
    rx.recv()
}

/// A barrier for the threads of one [`join`] (or one thread) that waits by checking, then by
/// giving up the CPU to other threads between checks, never by sleeping: a plan's threads
/// meet again within microseconds, and the one that waits is back at once (when both share
/// one CPU, yielding lets the other run).
pub(super) struct SpinBarrier {
    parties: usize,
    arrived: AtomicUsize,
    round: AtomicUsize,
}

impl SpinBarrier {
    pub(super) fn new(parties: usize) -> Self {
        SpinBarrier {
            parties,
            arrived: AtomicUsize::new(0),
            round: AtomicUsize::new(0),
        }
    }

    /// Returns once all parties have called it (this round). What a party wrote before it
    /// called is visible to every party after.
    pub(super) fn wait(&self) {
        let round = self.round.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.parties {
            // The count is reset before the round moves on, so a party that goes straight to
            // the next round counts from zero.
            self.arrived.store(0, Ordering::Relaxed);
            self.round.fetch_add(1, Ordering::Release);
            return;
        }
        let mut checks = 0u32;
        while self.round.load(Ordering::Acquire) == round {
            if checks < SPINS {
                checks += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A closure with its borrows' lifetime erased; see the safety argument in [`join`].
type Job = Box<dyn FnOnce() + Send + 'static>;

struct Helper {
    jobs: Sender<Job>,
    done: Receiver<Result<(), Box<dyn Any + Send>>>,
}

static HELPER: OnceLock<Option<Mutex<Helper>>> = OnceLock::new();

fn helper() -> Option<&'static Mutex<Helper>> {
    HELPER
        .get_or_init(|| {
            let (jobs, job_rx) = channel::<Job>();
            let (done_tx, done) = channel();
            std::thread::Builder::new()
                .name("cacheroute-plan".into())
                .spawn(move || {
                    // A plan's next job often follows within microseconds: wait a little
                    // awake before sleeping.
                    while let Ok(job) = recv_soon(&job_rx) {
                        if done_tx.send(catch_unwind(AssertUnwindSafe(job))).is_err() {
                            break;
                        }
                    }
                })
                .ok()?;
            Some(Mutex::new(Helper { jobs, done }))
        })
        .as_ref()
}

/// Start the helper thread if it is not running yet. Returns at once: the thread comes up
/// while the caller goes on.
pub(super) fn start() {
    helper();
}

/// Run `a` and `b` concurrently (`a` on the helper thread, `b` on the caller's) and return
/// `b`'s result once both are done. A panic in either is resumed here, after both finished.
pub(super) fn join<A, B, R>(a: A, b: B) -> R
where
    A: FnOnce() + Send,
    B: FnOnce() -> R,
{
    let Some(guard) = helper().and_then(|m| m.try_lock().ok()) else {
        return scoped(a, b);
    };
    let job: Box<dyn FnOnce() + Send + '_> = Box::new(a);
    // SAFETY: only the lifetime of `a`'s borrows is erased. This function does not return, nor
    // unwind, before the helper has reported `a` finished (or the helper is gone, which drops
    // the job first): `b` runs under `catch_unwind`, and `done.recv()` is awaited on every
    // path after a successful send. While `guard` is held no other job is queued, so the report
    // received is this job's.
    let job: Job = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + '_>, Job>(job) };
    if let Err(unsent) = guard.jobs.send(job) {
        drop(guard);
        // The helper is gone; the job comes back unrun and still borrows this frame.
        return scoped(unsent.0, b);
    }
    let rb = catch_unwind(AssertUnwindSafe(b));
    let ra = recv_soon(&guard.done);
    drop(guard);
    if let Ok(Err(p)) = ra {
        resume_unwind(p);
    }
    match rb {
        Ok(r) => r,
        Err(p) => resume_unwind(p),
    }
}

/// [`join`] on a thread started for the occasion.
fn scoped<A, B, R>(a: A, b: B) -> R
where
    A: FnOnce() + Send,
    B: FnOnce() -> R,
{
    std::thread::scope(|s| {
        s.spawn(a);
        b()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    #[test]
    fn both_run_at_once_and_see_their_borrows() {
        let barrier = Barrier::new(2);
        let mut left = Vec::new();
        let right = join(
            || {
                barrier.wait();
                left.push(1);
            },
            || {
                barrier.wait();
                2
            },
        );
        assert_eq!((left, right), (vec![1], 2));
    }

    #[test]
    fn a_busy_helper_gives_the_second_caller_its_own_thread() {
        // Four callers at once, each pair waiting on its own barrier: with one helper, three
        // of them must get a scoped thread or they would never pass their barrier.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        let barrier = Barrier::new(2);
                        join(
                            || {
                                barrier.wait();
                            },
                            || {
                                barrier.wait();
                            },
                        );
                    }
                });
            }
        });
    }

    /// Many rounds of the spin barrier between the two threads of a join: in each round every
    /// party sees what the other wrote before the barrier (a counter each, read after it).
    #[test]
    fn the_spin_barrier_holds_every_party_until_all_arrived() {
        use std::sync::atomic::AtomicU64;
        let barrier = SpinBarrier::new(2);
        let counts = [AtomicU64::new(0), AtomicU64::new(0)];
        let party = |me: usize| {
            for round in 1..=2000u64 {
                counts[me].store(round, Ordering::Relaxed);
                barrier.wait();
                assert_eq!(counts[1 - me].load(Ordering::Relaxed), round);
                barrier.wait();
            }
        };
        join(|| party(0), || party(1));
        let one = SpinBarrier::new(1);
        one.wait();
        one.wait();
    }

    #[test]
    fn a_panic_on_the_helper_reaches_the_caller_and_the_helper_lives_on() {
        let r = catch_unwind(|| join(|| panic!("helper side"), || 1));
        assert!(r.is_err());
        assert_eq!(join(|| {}, || 3), 3);
    }
}
