//! The client-side expiry of held locks: one task per runtime (that a hold was granted on) over the
//! deadlines of all the backend's held locks (issue 9: a task per held lock cost most of a held
//! lock's memory). Every hold has a deadline
//! here: the session is kept alive for the process's other locks and waiters (and for its next
//! acquire), so it outlives a hold the core stopped renewing — at `max_hold`, whose last renewal may
//! ask for the whole lease when it is sent right at the cap minus one lease, or after renewals that
//! stalled — and its key would block the name until the guard is dropped. At a deadline the lock's
//! loss is reported on its loss channel and its key deleted by create_revision.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use distlock_core::clock::{self, Instant};
use tokio::sync::Notify;

use crate::backend::{EtcdBackend, Inner};
use crate::claims::{Doomed, FOREIGN};
use crate::held::{report_loss, LossSender};
use crate::session::Session;
use crate::tasks::Task;

/// A held lock's expiry: what the task needs to report its loss and delete its key.
#[derive(Debug)]
struct Expiring {
    key: String,
    rev: i64,
    lost: LossSender,
    session: Arc<Session>,
}

#[derive(Debug, Default)]
struct State {
    /// By deadline, then by the hold's expiry id (unique per hold). A renewal moves its entry (a
    /// remove and an insert, which reuse the tree's nodes).
    deadlines: BTreeMap<(Instant, u64), Expiring>,
    next_id: u64,
    /// The expiry tasks: one on each runtime a hold was granted on (see
    /// [`EtcdBackend::ensure_expiry`]), each serving every deadline. A task whose runtime was dropped
    /// is not alive any more; the entries stay for the others, and for the next grant's.
    tasks: Vec<(tokio::runtime::Id, Task)>,
}

/// The deadlines of a backend's held locks.
#[derive(Debug, Default)]
pub(crate) struct Expiries {
    state: Mutex<State>,
    /// Wakes the tasks when an entry becomes the earliest.
    earlier: Notify,
}

/// What a renewal found for its hold.
pub(crate) enum Rearmed {
    /// The deadline was moved.
    Moved,
    /// The hold's entry is gone: its deadline passed and the task deleted its key.
    Expired,
    /// The hold was released (or dropped) meanwhile: nothing to move.
    Released,
}

/// A hold's place among the deadlines (in [`EtcdLease`](crate::lease::EtcdLease)): its id, and its
/// current deadline, the key of its entry. Changed only under the expiries' lock.
#[derive(Debug)]
pub(crate) struct ExpirySlot {
    id: u64,
    deadline: Mutex<Option<Instant>>,
}

impl Expiries {
    /// Records a hold's deadline; the returned slot moves it ([`renew`](Self::renew)) and removes it
    /// ([`remove`](Self::remove)).
    pub(crate) fn insert(
        &self,
        deadline: Instant,
        key: String,
        rev: i64,
        lost: LossSender,
        session: Arc<Session>,
    ) -> ExpirySlot {
        let Ok(mut state) = self.state.lock() else {
            // A poisoned lock (a panic under it): no timer, as when no runtime ran one before.
            return ExpirySlot {
                id: 0,
                deadline: Mutex::new(None),
            };
        };
        state.next_id += 1;
        let id = state.next_id;
        state.deadlines.insert(
            (deadline, id),
            Expiring {
                key,
                rev,
                lost,
                session,
            },
        );
        self.wake_if_first(&state, (deadline, id));
        ExpirySlot {
            id,
            deadline: Mutex::new(Some(deadline)),
        }
    }

    /// Moves a hold's deadline to `deadline` (a renewal).
    pub(crate) fn renew(&self, slot: &ExpirySlot, deadline: Instant) -> Rearmed {
        let Ok(mut state) = self.state.lock() else {
            return Rearmed::Moved;
        };
        let Ok(mut current) = slot.deadline.lock() else {
            return Rearmed::Moved;
        };
        let Some(old) = *current else {
            return Rearmed::Released;
        };
        let Some(entry) = state.deadlines.remove(&(old, slot.id)) else {
            return Rearmed::Expired;
        };
        state.deadlines.insert((deadline, slot.id), entry);
        *current = Some(deadline);
        self.wake_if_first(&state, (deadline, slot.id));
        Rearmed::Moved
    }

    /// Removes a hold's deadline (its release, its drop): its key is no longer the task's to delete.
    pub(crate) fn remove(&self, slot: &ExpirySlot) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let Ok(mut current) = slot.deadline.lock() else {
            return;
        };
        if let Some(old) = current.take() {
            // A later deadline wake of the task finds nothing due and sleeps again.
            state.deadlines.remove(&(old, slot.id));
        }
    }

    /// Whether the hold was released (or dropped): its slot has no deadline.
    pub(crate) fn released(slot: &ExpirySlot) -> bool {
        slot.deadline.lock().map(|d| d.is_none()).unwrap_or(false)
    }

    fn wake_if_first(&self, state: &State, entry: (Instant, u64)) {
        if state.deadlines.first_key_value().map(|(k, _)| *k) == Some(entry) {
            // Every task (one per runtime): each registered its wait before it read the deadlines.
            self.earlier.notify_waiters();
        }
    }

    /// The number of deadlines recorded (a test hook).
    #[cfg(feature = "testing")]
    pub(crate) fn len(&self) -> usize {
        self.state.lock().map(|s| s.deadlines.len()).unwrap_or(0)
    }

    /// Stops the tasks (the backend is dropped).
    pub(crate) fn stop(&self) {
        if let Ok(state) = self.state.lock() {
            for (_, task) in &state.tasks {
                task.abort();
            }
        }
    }
}

impl EtcdBackend {
    /// Starts an expiry task on the current runtime unless one runs there: at every grant (and at
    /// renewals and requests). One per runtime, not one per backend: a single task lives on the
    /// runtime it was spawned on, and a hold granted on a second runtime, once the first is dropped
    /// with no renewal due any more (a hold whose grant covers its `max_hold`), had nothing to delete
    /// its key at the deadline (review). Any task serves every deadline, so the holds of a dropped
    /// runtime are expired by another runtime's task, or by the next grant's.
    pub(crate) fn ensure_expiry(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let expiries = &self.inner.expiries;
        let Ok(mut state) = expiries.state.lock() else {
            return;
        };
        let here = runtime.id();
        state.tasks.retain(|(_, task)| task.is_alive());
        if state.tasks.iter().any(|(id, _)| *id == here) {
            return;
        }
        let task = Task::spawn(&runtime, run(expiries.clone(), Arc::downgrade(&self.inner)));
        state.tasks.push((here, task));
    }
}

/// The expiry task: sleeps until the earliest deadline (or until an earlier one is recorded), and at
/// each deadline passed reports the hold lost and deletes its key. Holds only a weak reference to the
/// backend, which aborts it when dropped.
async fn run(expiries: Arc<Expiries>, backend: Weak<Inner>) {
    loop {
        // Registered before the deadlines are read, so an earlier one recorded after the read wakes
        // this task (`notify_waiters` stores no permit).
        let earlier = expiries.earlier.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let now = clock::now();
        let mut due = Vec::new();
        let next = {
            let Ok(mut state) = expiries.state.lock() else {
                return;
            };
            while let Some(entry) = state.deadlines.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            state.deadlines.first_key_value().map(|((at, _), _)| *at)
        };
        if !due.is_empty() {
            let Some(inner) = backend.upgrade() else {
                return;
            };
            let backend = EtcdBackend { inner };
            for Expiring {
                key,
                rev,
                lost,
                session,
            } in due
            {
                report_loss(
                    &lost,
                    "the lock's lease ran out without a renewal (max_hold reached or renewals failed); its key was deleted"
                        .into(),
                );
                // Handed to the backend's retried deletes, which try until the key is gone or its
                // session is, and are started again on another runtime if this one is dropped: a
                // delete run as a task here died with a short-lived runtime whose task took the
                // deadline, and a delete given up after three tries left the key past the cap
                // (review). The claim stays with the lease until its release, as before (`FOREIGN`
                // passes none on).
                let doomed = Doomed {
                    key,
                    rev: Some(rev),
                    owner: String::new(),
                    session,
                    claim: FOREIGN,
                    not_before: None,
                };
                // At once as well (the retrier's first pass is a backoff away).
                let now = backend.clone();
                let first = doomed.clone();
                tokio::spawn(async move { now.delete_once(&first).await });
                backend.retry_delete(doomed);
            }
        }
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep(at.saturating_duration_since(now)) => {}
                    _ = &mut earlier => {}
                }
            }
            None => earlier.await,
        }
    }
}
