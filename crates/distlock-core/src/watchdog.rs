//! The watchdog: one task per [`Locks`](crate::Locks), alive only while it has holds with a lease (and for
//! [`IDLE_LINGER`] after the last one ends, so a loop of acquire and release does not start one per grant). Each
//! tick it takes every hold whose renewal is due (or nearly due, so renewals group) and hands them to the
//! backend in one batch, which sends one round trip per group. It also wakes at every validity deadline
//! so that `state_changes()` reports a loss on time.
//!
//! The task runs on the runtime of the acquire that started it. A `Locks` may outlive that runtime (a
//! `Locks` in a `static` used by several `#[tokio::test]`s): when the runtime is dropped it drops the
//! task, and the task's [`RunGuard`] starts it again on the runtime of another live hold, or, with none,
//! on distlock's background runtime (so a live holder's lease is renewed whatever runtimes come and
//! go). The next acquire (reentrant included), `lost()`, `jeopardy()`, `state_changes()` or `extend()`
//! on a multi-thread runtime takes over a task left on a current-thread one.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::runtime::{Handle, Id, RuntimeFlavor};
use tokio::sync::Notify;

use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind};
use crate::guard::Holding;
use crate::locks::LocksInner;
use crate::raw::{DynBackend, Renewal, RenewalId, Renewed};
use crate::sync::lock;

/// How long the task stays after its last hold ended, on a multi-thread runtime. A loop of acquire and release (the grant
/// registers, the release ends the hold before the task next looks) would otherwise start a task per
/// grant, and each spawn wakes another worker thread to steal it: a cross-thread wake-up per cycle.
const IDLE_LINGER: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(crate) struct Watchdog {
    state: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    holds: Vec<Weak<Holding>>,
    /// The generation of the running task, `None` when none runs. A dropped task clears it only if it is
    /// still the current one.
    task: Option<u64>,
    generation: u64,
    /// When the running task will next look at the holds, so a new hold wakes it only if it needs an
    /// earlier look (a grant on every cycle would otherwise cost a cross-thread wake-up each).
    wake_at: Option<Instant>,
    /// Holds released since the task last looked are dropped from the list when it grows past this.
    prune_at: usize,
    /// The running task is on a current-thread runtime, which runs it only while someone is in its
    /// `block_on`: a multi-thread runtime that uses this `Locks` takes the task over.
    on_current_thread: bool,
    /// Wakes the running task. One per task: a retired task on an idle runtime must not swallow the
    /// wake-ups of the one that took over (`notify_one` goes to the oldest waiter).
    wake: Arc<Notify>,
}

impl Registry {
    /// Retires the running task if it is on a current-thread runtime and `current` is a multi-thread
    /// one (which runs it for sure); the retired task exits when it next looks. Returns whether a task
    /// must be started.
    fn needs_start(&mut self, current: Option<&Handle>) -> bool {
        if self.task.is_some()
            && self.on_current_thread
            && current.is_some_and(|h| h.runtime_flavor() != RuntimeFlavor::CurrentThread)
        {
            tracing::debug!(
                "the watchdog moves from a current-thread runtime to a multi-thread one"
            );
            self.task = None;
        }
        self.task.is_none()
    }
}

impl Watchdog {
    pub(crate) fn register(self: &Arc<Self>, holding: &Arc<Holding>, locks: &LocksInner) {
        let mut registry = lock(&self.state);
        if registry.holds.len() >= registry.prune_at {
            registry.holds.retain(|weak| weak.strong_count() > 0);
            registry.prune_at = (registry.holds.len() * 2).max(64);
        }
        registry.holds.push(Arc::downgrade(holding));
        let current = Handle::try_current().ok();
        if !registry.needs_start(current.as_ref()) {
            let sooner = match (holding.next_event(), registry.wake_at) {
                (Some(event), Some(wake_at)) => event < wake_at,
                _ => true,
            };
            let wake = registry.wake.clone();
            drop(registry);
            if sooner {
                wake.notify_one();
            }
            return;
        }
        let runtime = current.or_else(|| holding.runtime.clone());
        drop(registry);
        if let Some(runtime) = runtime {
            self.start(&runtime, locks.backend.clone(), Vec::new());
        }
    }

    /// How many tasks have been started so far.
    #[cfg(test)]
    pub(crate) fn starts(&self) -> u64 {
        lock(&self.state).generation
    }

    /// Makes the task look at its holds again (a deadline or a renewal time moved).
    pub(crate) fn poke(&self) {
        let wake = lock(&self.state).wake.clone();
        wake.notify_one();
    }

    /// Starts the task on the current runtime if holds are waiting for one (its runtime was dropped and
    /// no other hold's runtime could take it).
    pub(crate) fn ensure_running(self: &Arc<Self>, locks: &LocksInner) {
        let Ok(current) = Handle::try_current() else {
            return;
        };
        let idle = {
            let mut registry = lock(&self.state);
            registry.holds.iter().any(|h| h.strong_count() > 0)
                && registry.needs_start(Some(&current))
        };
        if idle {
            self.start(&current, locks.backend.clone(), Vec::new());
        }
    }

    /// Spawns the task on `runtime` unless one runs. `tried` are runtimes found dropped on the way.
    fn start(self: &Arc<Self>, runtime: &Handle, backend: Arc<dyn DynBackend>, tried: Vec<Id>) {
        let (generation, wake) = {
            let mut registry = lock(&self.state);
            if registry.task.is_some() {
                return;
            }
            registry.generation += 1;
            registry.task = Some(registry.generation);
            registry.on_current_thread = runtime.runtime_flavor() == RuntimeFlavor::CurrentThread;
            registry.wake = Arc::new(Notify::new());
            (registry.generation, registry.wake.clone())
        };
        let guard = RunGuard {
            watchdog: self.clone(),
            backend: backend.clone(),
            generation,
            runtime: runtime.id(),
            tried,
            exited: false,
        };
        // Spawned outside the registry lock: on a dropped runtime tokio drops the task at once, and its
        // guard takes the lock to move on.
        runtime.spawn(self.clone().run(backend, wake, guard));
    }

    /// The task of `generation` was dropped unfinished (its runtime was dropped): starts it on the
    /// runtime of a live hold, other than those already found dropped.
    fn restart_elsewhere(self: &Arc<Self>, guard: &mut RunGuard) {
        let mut tried = std::mem::take(&mut guard.tried);
        tried.push(guard.runtime);
        let candidate = {
            let mut registry = lock(&self.state);
            if registry.task != Some(guard.generation) {
                return;
            }
            registry.task = None;
            let live: Vec<Arc<Holding>> = registry.holds.iter().filter_map(Weak::upgrade).collect();
            if live.is_empty() {
                return;
            }
            let candidates: Vec<Handle> = live
                .iter()
                .filter_map(|h| h.runtime.clone())
                .filter(|runtime| !tried.contains(&runtime.id()))
                .collect();
            // A multi-thread runtime runs the task for sure; a current-thread one only inside `block_on`.
            // With neither, distlock's own background runtime renews the holds: their holders live on.
            candidates
                .iter()
                .find(|runtime| runtime.runtime_flavor() != RuntimeFlavor::CurrentThread)
                .or(candidates.first())
                .cloned()
                .or_else(crate::locks::background_runtime)
        };
        match candidate {
            Some(runtime) => {
                tracing::debug!("the watchdog's runtime was dropped; restarting it on another");
                self.start(&runtime, guard.backend.clone(), tried);
            }
            None => {
                tracing::error!("the watchdog's runtime was dropped and no runtime can take it")
            }
        }
    }

    async fn run(
        self: Arc<Self>,
        backend: Arc<dyn DynBackend>,
        wake: Arc<Notify>,
        mut guard: RunGuard,
    ) {
        // Since when the task has had no hold, if it has none.
        let mut idle_since: Option<Instant> = None;
        loop {
            let now = clock::now();
            let mut due = Vec::new();
            let mut next_wake: Option<Instant> = None;
            {
                let mut registry = lock(&self.state);
                if registry.task != Some(guard.generation) {
                    // Retired: another task took over (see `Registry::needs_start`).
                    guard.exited = true;
                    return;
                }
                registry
                    .holds
                    .retain(|weak| weak.upgrade().is_some_and(|h| h.watched(now)));
                if registry.holds.is_empty() {
                    let since = *idle_since.get_or_insert(now);
                    // Not on a current-thread runtime: there a spawn wakes no other thread, and a task
                    // lingering on one that idles (its `block_on` returned) never runs, so a hold
                    // registered meanwhile from another current-thread runtime would not be renewed.
                    let linger = if registry.on_current_thread {
                        Duration::ZERO
                    } else {
                        IDLE_LINGER
                    };
                    let until = since.saturating_add(linger);
                    if now >= until {
                        // Decided under the lock `register` takes, so no hold is left unwatched.
                        registry.task = None;
                        guard.exited = true;
                        return;
                    }
                    // Linger: a hold registered meanwhile wakes the task only if it needs a look
                    // before then (`wake_at` below), so a grant per cycle costs no wake-up.
                    next_wake = Some(until);
                } else {
                    idle_since = None;
                }
                registry.prune_at = (registry.holds.len() * 2).max(64);
                let live: Vec<Arc<Holding>> =
                    registry.holds.iter().filter_map(Weak::upgrade).collect();
                // A batch goes out only when some hold needs it; then the others nearly due ride along.
                let sending = live.iter().any(|holding| holding.renewal_due(now));
                for holding in live {
                    let taken = sending.then(|| holding.take_due(now)).flatten();
                    if let Some(ttl) = taken {
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
                // Built before the spawn: a task dropped before its first poll (its runtime shut down
                // in between) still frees its holds for the next renewal.
                let unanswered = Unanswered {
                    answered: vec![false; due.len()],
                    due,
                    sent_at: None,
                };
                tokio::spawn(renew_batch(backend.clone(), unanswered, self.clone()));
            }
            // On the boot clock, so a deadline that passed during a suspend is seen at the resume.
            let wake_at =
                next_wake.unwrap_or_else(|| now.saturating_add(Duration::from_secs(3600)));
            tokio::select! {
                () = clock::sleep_until(wake_at) => {}
                _ = wake.notified() => {}
            }
        }
    }
}

/// Lives inside the watchdog task; dropped unfinished, the task's runtime is gone (or it panicked).
struct RunGuard {
    watchdog: Arc<Watchdog>,
    backend: Arc<dyn DynBackend>,
    generation: u64,
    runtime: Id,
    /// Runtimes found dropped while restarting, so a restart never loops over them.
    tried: Vec<Id>,
    exited: bool,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if !self.exited {
            let watchdog = self.watchdog.clone();
            watchdog.restart_elsewhere(self);
        }
    }
}

async fn renew_batch(
    backend: Arc<dyn DynBackend>,
    mut unanswered: Unanswered,
    watchdog: Arc<Watchdog>,
) {
    let sent_at = clock::now();
    // If this task is dropped before the replies are in (its runtime was dropped), the holds still
    // waiting are free for the next renewal.
    unanswered.sent_at = Some(sent_at);
    let Unanswered { due, answered, .. } = &mut unanswered;
    let due: &[(Arc<Holding>, Duration)] = due;
    for (holding, ttl) in due {
        holding.renewal_sent(sent_at, *ttl);
    }
    // A hold is renewed by nothing else while its renewal is in flight: a reply that stalls must not use
    // up the time left, so after half of its time left before its deadline a hold's renewal counts as
    // unconfirmed (Jeopardy) and the hold is free for a retry before the deadline. Per hold, not per
    // batch: with the batch's shortest time left as everyone's limit, one hold granted with little time
    // left (a ZooKeeper grant cut to the proven leader touch) put every hold riding along in Jeopardy
    // whenever the reply took longer than that, and their retries rode along with it again.
    let limits: Vec<Duration> = due
        .iter()
        .map(|(holding, ttl)| {
            holding.deadline().map_or(*ttl, |deadline| {
                deadline.saturating_duration_since(sent_at) / 2
            })
        })
        .collect();
    let mut by_limit: Vec<usize> = (0..due.len()).collect();
    by_limit.sort_by_key(|&i| limits[i]);
    let batch: Vec<Renewal<'_, _>> = due
        .iter()
        .enumerate()
        .map(|(i, (h, ttl))| Renewal {
            id: RenewalId(i),
            name: &h.shared.name,
            owner: &h.shared.owner,
            lease: &h.lease,
            ttl: *ttl,
        })
        .collect();
    let mut renew = backend.renew(&batch);
    let mut timed_out = 0;
    let outcomes = loop {
        let Some(&next) = by_limit.get(timed_out) else {
            // Every hold's limit passed: the requests are dropped.
            break Vec::new();
        };
        tokio::select! {
            biased;
            outcomes = &mut renew => break outcomes,
            () = clock::sleep_until(sent_at.saturating_add(limits[next])) => {
                // Limits up to an eighth past this one time out with it: a little early is safe (Jeopardy
                // and a retry sooner), and holds whose limits are spread (granted apart, riding along)
                // cost a few wake-ups, not one per distinct limit, each with a poke that makes the
                // watchdog scan every hold.
                let elapsed = clock::now().saturating_duration_since(sent_at);
                let until = elapsed.saturating_add(elapsed / COALESCED_LIMITS);
                while let Some(&i) = by_limit.get(timed_out).filter(|&&i| limits[i] <= until) {
                    answered[i] = true;
                    let (holding, ttl) = &due[i];
                    holding.apply_renewal(sent_at, *ttl, Err(no_reply_in_time()));
                    timed_out += 1;
                }
                // Those holds are due for a retry, which the task schedules when it looks again.
                watchdog.poke();
            }
        }
    };
    drop(renew);
    drop(batch);
    let mut by_entry: Vec<Option<crate::Result<Renewed>>> = due.iter().map(|_| None).collect();
    for (RenewalId(i), outcome) in outcomes {
        // The first outcome for an entry counts; an unknown id is ignored.
        if let Some(slot) = by_entry.get_mut(i).filter(|slot| slot.is_none()) {
            *slot = Some(outcome);
        }
    }
    for (((holding, ttl), outcome), answered) in due.iter().zip(by_entry).zip(answered.iter_mut()) {
        if *answered {
            // Counted as unconfirmed at its limit, and maybe retried since: only a loss still counts
            // (it is final, whichever request it answers), so that it is not reported later than needed.
            if let Some(Ok(gone @ Renewed::Gone { .. })) = outcome {
                holding.apply_renewal(sent_at, *ttl, Ok(gone));
            }
            continue;
        }
        *answered = true;
        holding.apply_renewal(
            sent_at,
            *ttl,
            outcome.unwrap_or_else(|| Err(no_reply_in_time())),
        );
    }
    watchdog.poke();
}

/// A hold's renewal times out with an earlier one's if its limit is at most this share past it.
const COALESCED_LIMITS: u32 = 8;

fn no_reply_in_time() -> Error {
    Error::new(ErrorKind::Unavailable, "the renewal got no reply in time")
}

/// The holds of a batch whose replies are not in yet.
struct Unanswered {
    due: Vec<(Arc<Holding>, Duration)>,
    /// `None` until the batch goes out.
    sent_at: Option<Instant>,
    /// Per hold of `due`: its outcome was applied (a reply, or no reply by its limit).
    answered: Vec<bool>,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        for ((holding, ttl), answered) in self.due.iter().zip(&self.answered) {
            if *answered {
                continue;
            }
            match self.sent_at {
                Some(sent_at) => holding.renewal_abandoned(sent_at, *ttl),
                None => holding.renewal_not_sent(),
            }
        }
    }
}
