//! Locks that never panic: a mutex poisoned by a panic elsewhere is taken as it is. What the
//! router guards with a mutex (a slot's URL, the installed plan, a connection list, a pending
//! batch) is whole after every statement, so one panicked task does not make every later
//! request panic too.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`], poison taken as it is.
pub(crate) trait Locked<T> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
