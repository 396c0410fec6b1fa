//! The watchdog: one task per [`Locks`](crate::Locks), alive only while it has holds with a lease. Each
//! tick it takes every hold whose renewal is due (or nearly due, so renewals group) and hands them to the
//! backend in one batch, which sends one round trip per group. It also wakes at every validity deadline
//! so that `state_changes()` reports a loss on time.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind};
use crate::guard::Holding;
use crate::locks::LocksInner;
use crate::raw::{DynBackend, Renewal};
use crate::sync::lock;

#[derive(Default)]
pub(crate) struct Watchdog {
    state: Mutex<Registry>,
    wake: Notify,
}

#[derive(Default)]
struct Registry {
    holds: Vec<Weak<Holding>>,
    running: bool,
    /// When the running task will next look at the holds, so a new hold wakes it only if it needs an
    /// earlier look (a grant on every cycle would otherwise cost a cross-thread wake-up each).
    wake_at: Option<Instant>,
    /// Holds released since the task last looked are dropped from the list when it grows past this.
    prune_at: usize,
}

impl Watchdog {
    pub(crate) fn register(self: &Arc<Self>, holding: &Arc<Holding>, locks: &LocksInner) {
        let mut registry = lock(&self.state);
        if registry.holds.len() >= registry.prune_at {
            registry.holds.retain(|weak| weak.strong_count() > 0);
            registry.prune_at = (registry.holds.len() * 2).max(64);
        }
        registry.holds.push(Arc::downgrade(holding));
        if registry.running {
            let sooner = match (holding.next_event(), registry.wake_at) {
                (Some(event), Some(wake_at)) => event < wake_at,
                _ => true,
            };
            drop(registry);
            if sooner {
                self.wake.notify_one();
            }
            return;
        }
        let Some(runtime) = locks.runtime() else {
            return;
        };
        registry.running = true;
        runtime.spawn(self.clone().run(locks.backend.clone()));
    }

    async fn run(self: Arc<Self>, backend: Arc<dyn DynBackend>) {
        loop {
            let now = clock::now();
            let mut due = Vec::new();
            let mut next_wake: Option<Instant> = None;
            {
                let mut registry = lock(&self.state);
                registry
                    .holds
                    .retain(|weak| weak.upgrade().is_some_and(|h| h.watched(now)));
                if registry.holds.is_empty() {
                    // Decided under the lock `register` takes, so no hold is left unwatched.
                    registry.running = false;
                    return;
                }
                registry.prune_at = (registry.holds.len() * 2).max(64);
                for holding in registry.holds.iter().filter_map(Weak::upgrade) {
                    // Renewals due within an eighth of their period go together.
                    if let Some(ttl) = holding.take_due(now, holding.renew_every / 8) {
                        due.push((holding.clone(), ttl));
                    }
                    if let Some(at) = holding.next_event() {
                        next_wake = Some(next_wake.map_or(at, |w| w.min(at)));
                    }
                }
                // Set under the same lock as the scan: a hold registered after it compares against
                // this, one registered before it was scanned. A renewal under way wakes the task when
                // it completes, so there is no promise to make then.
                registry.wake_at = if due.is_empty() { next_wake } else { None };
            }
            if !due.is_empty() {
                tokio::spawn(renew_batch(backend.clone(), due, self.clone()));
            }
            let sleep = next_wake.map_or(Duration::from_secs(3600), Instant::remaining);
            tokio::select! {
                _ = tokio::time::sleep(sleep) => {}
                _ = self.wake.notified() => {}
            }
        }
    }
}

async fn renew_batch(
    backend: Arc<dyn DynBackend>,
    due: Vec<(Arc<Holding>, Duration)>,
    watchdog: Arc<Watchdog>,
) {
    let sent_at = clock::now();
    // A reply after the last deadline of the batch is useless: every entry would count it as failed.
    let limit = due
        .iter()
        .map(|(_, ttl)| *ttl)
        .max()
        .unwrap_or(Duration::from_secs(1));
    let batch: Vec<Renewal<'_, _>> = due
        .iter()
        .map(|(h, ttl)| Renewal {
            name: &h.shared.name,
            owner: &h.shared.owner,
            lease: &h.lease,
            ttl: *ttl,
        })
        .collect();
    // On timeout every entry gets "no reply in time" below.
    let outcomes = tokio::time::timeout(limit, backend.renew(&batch))
        .await
        .unwrap_or_default();
    let mut outcomes = outcomes.into_iter();
    for (holding, _) in &due {
        let outcome = outcomes.next().unwrap_or_else(|| {
            Err(Error::new(
                ErrorKind::Unavailable,
                "the renewal got no reply in time",
            ))
        });
        holding.apply_renewal(sent_at, outcome);
    }
    watchdog.wake.notify_one();
}
