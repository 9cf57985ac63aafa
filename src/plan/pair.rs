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

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, OnceLock};

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
                    for job in job_rx {
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
    let ra = guard.done.recv();
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

    #[test]
    fn a_panic_on_the_helper_reaches_the_caller_and_the_helper_lives_on() {
        let r = catch_unwind(|| join(|| panic!("helper side"), || 1));
        assert!(r.is_err());
        assert_eq!(join(|| {}, || 3), 3);
    }
}
