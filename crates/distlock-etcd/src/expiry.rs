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
use std::time::Duration;

use distlock_core::clock::{self, Instant};
use distlock_core::raw::LossReport;
use distlock_core::retry::Backoff;
use tokio::sync::Notify;

use crate::backend::{EtcdBackend, Inner};
use crate::claims::{Doomed, FOREIGN};
use crate::session::Session;
use crate::tasks::Task;

/// A held lock's expiry: what the task needs to report its loss and delete its key.
#[derive(Debug)]
struct Expiring {
    key: Arc<str>,
    rev: i64,
    lost: LossReport,
    session: Arc<Session>,
}

#[derive(Default)]
struct State {
    /// By deadline, then by the hold's expiry id (unique per hold). A renewal moves its entry (a
    /// remove and an insert, which reuse the tree's nodes).
    deadlines: BTreeMap<(Instant, u64), Expiring>,
    next_id: u64,
    /// The expiry tasks: one on each runtime a hold was granted on (see
    /// [`EtcdBackend::ensure_expiry`]), each serving every deadline. A task whose runtime was dropped
    /// is not alive any more; the entries stay for the others, and for the next grant's.
    tasks: Vec<(tokio::runtime::Id, Task)>,
    /// Expired holds whose key is not known deleted yet, by expiry id. Kept here rather than in a task
    /// of one runtime, so that every expiry task retries them (review: a delete run as a task on a
    /// short-lived runtime whose task took the deadline died with that runtime); removed once a
    /// delete answered, or the key's session is gone.
    undeleted: BTreeMap<u64, Doomed>,
}

/// The deadlines of a backend's held locks.
#[derive(Default)]
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
        key: Arc<str>,
        rev: i64,
        lost: LossReport,
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

    /// Reports every hold on `session` lost: the session is gone, and its keys with it.
    pub(crate) fn session_gone(&self, session: &Session, reason: &str) {
        let holds: Vec<LossReport> = match self.state.lock() {
            Ok(state) => state
                .deadlines
                .values()
                .filter(|e| std::ptr::eq(Arc::as_ptr(&e.session), session))
                .map(|e| e.lost.clone())
                .collect(),
            Err(_) => return,
        };
        for lost in holds {
            lost.report(reason);
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

/// The expiry task (one per runtime a hold was granted on): sleeps until the earliest deadline (or
/// until an earlier one is recorded), and at each deadline passed reports the hold lost and deletes
/// its key by create_revision, retrying with backoff until a delete answers or the session is gone.
/// Holds only a weak reference to the backend, which aborts it when dropped.
async fn run(expiries: Arc<Expiries>, backend: Weak<Inner>) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        // Registered before the deadlines are read, so an earlier one recorded after the read wakes
        // this task (`notify_waiters` stores no permit).
        let earlier = expiries.earlier.notified();
        tokio::pin!(earlier);
        earlier.as_mut().enable();
        let now = clock::now();
        let mut due = Vec::new();
        let (next, undeleted) = {
            let Ok(mut state) = expiries.state.lock() else {
                return;
            };
            while let Some(entry) = state.deadlines.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let ((_, id), expiring) = entry.remove_entry();
                due.push((id, expiring));
            }
            for (
                id,
                Expiring {
                    key, rev, session, ..
                },
            ) in &due
            {
                // The claim stays with the lease until its release, as before.
                let doomed = Doomed {
                    key: key.clone(),
                    rev: Some(*rev),
                    owner: String::new(),
                    session: session.clone(),
                    claim: FOREIGN,
                    not_before: None,
                };
                state.undeleted.insert(*id, doomed);
            }
            let next = state.deadlines.first_key_value().map(|((at, _), _)| *at);
            let undeleted: Vec<(u64, Doomed)> = state
                .undeleted
                .iter()
                .map(|(id, d)| (*id, d.clone()))
                .collect();
            (next, undeleted)
        };
        for (_, Expiring { lost, .. }) in &due {
            lost.report(
                "the lock's lease ran out without a renewal (max_hold reached or renewals failed); its key was deleted",
            );
        }
        let mut retry_after = None;
        if !undeleted.is_empty() {
            let Some(inner) = backend.upgrade() else {
                return;
            };
            let backend = EtcdBackend { inner };
            // All at once: one after the other, many keys expiring together on a slow etcd held up
            // the next deadline by a round trip each (review).
            let deleted = futures_util::future::join_all(undeleted.iter().map(|(_, doomed)| {
                let backend = &backend;
                async move {
                    // A key whose session is gone went with its lease.
                    doomed.session.gone_reason().is_some() || backend.delete_once(doomed).await
                }
            }))
            .await;
            let mut failed = false;
            if let Ok(mut state) = expiries.state.lock() {
                for ((id, _), deleted) in undeleted.iter().zip(deleted) {
                    if deleted {
                        state.undeleted.remove(id);
                    } else {
                        failed = true;
                    }
                }
            }
            if failed {
                retry_after = Some(backoff.next_delay());
            } else {
                backoff.reset();
            }
        }
        let wake_at = match (next, retry_after) {
            (Some(at), Some(retry)) => Some(at.min(clock::now().saturating_add(retry))),
            (Some(at), None) => Some(at),
            (None, Some(retry)) => Some(clock::now().saturating_add(retry)),
            (None, None) => None,
        };
        match wake_at {
            Some(at) => {
                tokio::select! {
                    // On the boot clock: a tokio timer would report the loss and delete the key as
                    // much later as the machine was suspended.
                    () = clock::sleep_until(at) => {}
                    _ = &mut earlier => {}
                }
            }
            None => earlier.await,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::rpc::pb::etcdserverpb::LeaseGrantResponse;
    use crate::rpc::Client;
    use crate::EtcdConfig;
    use distlock_testkit::etcd::EtcdServer;

    fn session(client: &Client, id: i64, expiries: &Arc<Expiries>) -> Arc<Session> {
        let granted = LeaseGrantResponse {
            id,
            ttl: 60,
            ..LeaseGrantResponse::default()
        };
        Session::granted(
            client,
            60,
            granted,
            clock::now(),
            Duration::from_secs(5),
            Arc::downgrade(expiries),
        )
        .unwrap()
    }

    /// A session marked gone reports every hold on it lost, and no other: with a loss report per hold
    /// instead of a task per hold, the session's own signal reaches the holds through the deadlines
    /// (which list every hold), not through a future each hold polls.
    #[tokio::test]
    async fn a_session_gone_reports_its_holds_and_only_those() {
        let server = EtcdServer::start_or_panic();
        let client = Client::connect(&EtcdConfig::new([server.endpoints()]))
            .await
            .unwrap();
        let expiries = Arc::new(Expiries::default());
        let gone = session(&client, 1, &expiries);
        let live = session(&client, 2, &expiries);
        let far = clock::now().saturating_add(Duration::from_secs(60));
        let on_gone: Vec<LossReport> = (0..3).map(|_| LossReport::new()).collect();
        let on_live = LossReport::new();
        let _slots: Vec<ExpirySlot> = on_gone
            .iter()
            .enumerate()
            .map(|(i, lost)| {
                expiries.insert(far, format!("k/{i}").into(), 1, lost.clone(), gone.clone())
            })
            .chain([expiries.insert(far, "k/live".into(), 1, on_live.clone(), live.clone())])
            .collect();
        let _ = gone.mark_gone("the session lease expired or was revoked on the server");
        for lost in &on_gone {
            let reason = lost
                .reason()
                .expect("a hold on the gone session is reported lost");
            assert!(reason.contains("lease 1"), "{reason}");
        }
        assert_eq!(
            on_live.reason(),
            None,
            "a hold on another session is untouched"
        );
    }
}
