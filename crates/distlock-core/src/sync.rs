//! Small helpers shared by the core's modules.

use std::sync::{Mutex, MutexGuard};

/// Locks a std mutex, ignoring poisoning: the data behind the core's mutexes stays consistent even if a
/// holder panicked (every critical section is a few assignments).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
