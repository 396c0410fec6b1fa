//! `LockGuard` and the hold it shares with reentrant guards: validity deadline, the three states, loss.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, OwnedMutexGuard};

use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind, Result};
use crate::locks::{tag, LockShared};
use crate::options::LockOptions;
use crate::raw::{ErasedLease, LossSignal, Released, Renewal, Renewed};
use crate::state::LockState;
use crate::sync::lock;
use crate::token::FencingToken;

/// The share of a granted TTL the guard trusts: clocks may drift by up to 1 %.
const DRIFT: f64 = 0.99;
/// Subtracted from every validity deadline for timer and scheduling slack.
const SLACK: Duration = Duration::from_millis(2);

/// `sent_at + ttl·(1−0.01) − 2 ms`: until when a grant or renewal sent at `sent_at` can be trusted.
pub(crate) fn validity_deadline(sent_at: Instant, ttl: Duration) -> Instant {
    sent_at
        .saturating_add(ttl.mul_f64(DRIFT))
        .saturating_sub(SLACK)
}

/// One hold of a lock, shared by the reentrant guards of one [`Lock`](crate::Lock).
pub(crate) struct Holding {
    pub(crate) shared: Arc<LockShared>,
    pub(crate) lease: ErasedLease,
    token: Option<FencingToken>,
    /// The lease renewals ask for.
    lease_ttl: Duration,
    pub(crate) renew_every: Duration,
    max_hold_end: Option<Instant>,
    status: Mutex<Status>,
    state_tx: watch::Sender<LockState>,
    /// The local gate of this name, passed to the next waiter of this process after the release.
    gate: Mutex<Option<OwnedMutexGuard<()>>>,
    /// Set once at install when the backend has one (the file backend's `flock`ed descriptor).
    pub(crate) descriptor: std::sync::OnceLock<Arc<std::os::fd::OwnedFd>>,
}

#[derive(Debug, Default)]
struct Status {
    /// `None` for locks with no server-side expiry.
    deadline: Option<Instant>,
    jeopardy: bool,
    lost: Option<String>,
    released: bool,
    next_renew_at: Option<Instant>,
    renewing: bool,
}

impl Status {
    fn state(&self) -> LockState {
        if self.lost.is_some() {
            LockState::Lost
        } else if self.jeopardy {
            LockState::Jeopardy
        } else {
            LockState::Held
        }
    }
}

impl Holding {
    pub(crate) fn new(
        shared: Arc<LockShared>,
        lease: ErasedLease,
        token: Option<FencingToken>,
        ttl: Option<Duration>,
        sent_at: Instant,
        options: LockOptions,
        gate: Option<OwnedMutexGuard<()>>,
    ) -> Arc<Self> {
        let renew_every = options.lease / 3;
        let status = Status {
            deadline: ttl.map(|ttl| validity_deadline(sent_at, ttl)),
            next_renew_at: ttl.map(|_| sent_at.saturating_add(renew_every)),
            ..Status::default()
        };
        let (state_tx, _) = watch::channel(LockState::Held);
        Arc::new(Self {
            shared,
            lease,
            token,
            lease_ttl: options.lease,
            renew_every,
            max_hold_end: options.max_hold.map(|cap| sent_at.saturating_add(cap)),
            status: Mutex::new(status),
            state_tx,
            gate: Mutex::new(gate),
            descriptor: std::sync::OnceLock::new(),
        })
    }

    /// The state now: reads the clock, so it is never late.
    pub(crate) fn state(&self) -> LockState {
        let mut status = lock(&self.status);
        self.refresh(&mut status, clock::now());
        status.state()
    }

    pub(crate) fn loss_reason(&self) -> Option<String> {
        let mut status = lock(&self.status);
        self.refresh(&mut status, clock::now());
        status.lost.clone()
    }

    /// Marks the hold Lost if a deadline has passed, and publishes any change.
    fn refresh(&self, status: &mut Status, now: Instant) {
        if status.lost.is_none() {
            if status.deadline.is_some_and(|d| now >= d) {
                status.lost =
                    Some("the validity deadline passed without a confirmed renewal".into());
            } else if self.max_hold_end.is_some_and(|end| now >= end) {
                status.lost = Some("max_hold was reached".into());
            }
        }
        self.publish(status);
    }

    fn publish(&self, status: &Status) {
        let state = status.state();
        self.state_tx.send_if_modified(|current| {
            let changed = *current != state;
            *current = state;
            changed
        });
    }

    pub(crate) fn mark_lost(&self, reason: String) {
        let mut status = lock(&self.status);
        if status.lost.is_none() && !status.released {
            tracing::warn!(lock = %self.shared.name, %reason, "lock lost");
            status.lost = Some(reason);
        }
        self.publish(&status);
    }

    /// The earliest moment the state may change by itself (a deadline or `max_hold`).
    fn next_deadline(&self) -> Option<Instant> {
        let status = lock(&self.status);
        match (status.deadline, self.max_hold_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // --- the watchdog's view -----------------------------------------------------------------

    /// Whether the watchdog should keep this hold; marks it Lost if a deadline passed.
    pub(crate) fn watched(&self, now: Instant) -> bool {
        let mut status = lock(&self.status);
        self.refresh(&mut status, now);
        !status.released && status.lost.is_none()
    }

    /// If a renewal is due by `now + slack`, marks it under way and returns the TTL to ask for.
    pub(crate) fn take_due(&self, now: Instant, slack: Duration) -> Option<Duration> {
        let mut status = lock(&self.status);
        let due = status.next_renew_at?;
        if status.renewing
            || status.released
            || status.lost.is_some()
            || due > now.saturating_add(slack)
        {
            return None;
        }
        status.renewing = true;
        Some(self.renewal_ttl(now))
    }

    /// The lease, capped by what is left of `max_hold`.
    fn renewal_ttl(&self, now: Instant) -> Duration {
        match self.max_hold_end {
            Some(end) => self
                .lease_ttl
                .min(end.saturating_duration_since(now))
                .max(Duration::from_millis(1)),
            None => self.lease_ttl,
        }
    }

    /// When the watchdog must next look at this hold.
    pub(crate) fn next_event(&self) -> Option<Instant> {
        let status = lock(&self.status);
        let renew = if status.renewing {
            None
        } else {
            status.next_renew_at
        };
        [renew, status.deadline, self.max_hold_end]
            .into_iter()
            .flatten()
            .min()
    }

    /// Applies the outcome of a renewal sent at `sent_at`.
    pub(crate) fn apply_renewal(&self, sent_at: Instant, outcome: Result<Renewed>) {
        let now = clock::now();
        let mut status = lock(&self.status);
        status.renewing = false;
        self.refresh(&mut status, now);
        if status.lost.is_some() || status.released {
            return;
        }
        match outcome {
            Ok(Renewed::Extended { ttl }) => {
                status.deadline = Some(validity_deadline(sent_at, ttl));
                status.jeopardy = false;
                status.next_renew_at = Some(sent_at.saturating_add(self.renew_every));
            }
            Ok(Renewed::Gone { reason }) => {
                tracing::warn!(lock = %self.shared.name, %reason, "lock lost");
                status.lost = Some(reason);
            }
            Err(error) => {
                if !status.jeopardy {
                    tracing::warn!(lock = %self.shared.name, %error, "renewal failed; lock in jeopardy");
                }
                status.jeopardy = true;
                // Retry well before the deadline.
                let retry = (self.renew_every / 4).max(Duration::from_millis(20));
                status.next_renew_at = Some(now.saturating_add(retry));
            }
        }
        self.publish(&status);
    }

    /// Renews now with `ttl`, outside the watchdog's schedule.
    async fn renew_now(&self, ttl: Duration) -> Result<()> {
        let backend = self.shared.locks.backend.clone();
        let batch = [Renewal {
            name: &self.shared.name,
            owner: &self.shared.owner,
            lease: &self.lease,
            ttl,
        }];
        let sent_at = clock::now();
        let mut outcomes = backend.renew(&batch).await;
        let outcome = outcomes.pop().unwrap_or_else(|| {
            Err(Error::new(
                ErrorKind::Protocol,
                "internal error: the backend returned no renewal outcome",
            ))
        });
        let failure = match &outcome {
            Ok(Renewed::Extended { .. }) => None,
            Ok(Renewed::Gone { reason }) => Some(Error::new(ErrorKind::LockLost, reason.clone())),
            Err(e) => Some(Error::new(e.kind(), e.message().to_string())),
        };
        self.apply_renewal(sent_at, outcome);
        if let Some(reason) = self.loss_reason() {
            return Err(Error::new(ErrorKind::LockLost, reason));
        }
        failure.map_or(Ok(()), Err)
    }

    /// Watches a backend's loss signal until the hold ends.
    pub(crate) fn watch_loss(self: &Arc<Self>, loss: LossSignal) {
        let Some(runtime) = self.shared.locks.runtime() else {
            return;
        };
        let weak = Arc::downgrade(self);
        let mut changes = self.state_tx.subscribe();
        runtime.spawn(async move {
            tokio::select! {
                reason = loss => {
                    if let Some(holding) = weak.upgrade() {
                        holding.mark_lost(reason);
                    }
                }
                _ = async {
                    // Ends when the hold is lost or dropped (the sender goes with it).
                    while changes.changed().await.is_ok() {
                        if *changes.borrow() == LockState::Lost {
                            break;
                        }
                    }
                } => {}
            }
        });
    }

    /// Releases on the server, then passes the local gate on. Runs as its own task so that dropping the
    /// caller's future does not interrupt it.
    async fn finish(self: Arc<Self>) -> Result<()> {
        {
            let mut status = lock(&self.status);
            self.refresh(&mut status, clock::now());
            status.released = true;
        }
        let backend = self.shared.locks.backend.clone();
        let outcome = backend
            .release(&self.lease, &self.shared.name, &self.shared.owner)
            .await;
        let lost = lock(&self.status).lost.clone();
        drop(lock(&self.gate).take());
        let kind = backend.kind();
        let name = &self.shared.name;
        match outcome {
            Ok(Released::Released) => Ok(()),
            Ok(Released::NotHeld) => Err(tag(
                Error::new(
                    ErrorKind::NotHeld,
                    match lost {
                        Some(reason) => format!("the lock was no longer held at release: {reason}"),
                        None => {
                            "the lock was no longer held at release (expired or taken over)".into()
                        }
                    },
                ),
                kind,
                name,
            )),
            Err(e) => Err(tag(e, kind, name)),
        }
    }
}

/// Proof of holding a lock. Dropping it releases the lock in the background; [`release`](Self::release)
/// does it now and reports the outcome.
///
/// A guard of a lock with a lease is renewed by the watchdog while it lives. Its [`state`](Self::state)
/// says whether ownership can still be assumed; [`lost`](Self::lost) resolves when it cannot.
///
/// Release-on-drop is not immediate: it is handed to a background task on the runtime of the first
/// acquire (so it works when dropped outside a runtime). Call `release().await` to know it happened.
#[must_use = "if unused the lock is released at once"]
#[clippy::has_significant_drop]
pub struct LockGuard {
    holding: Arc<Holding>,
    done: bool,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.holding.shared.name)
            .field("owner", &self.holding.shared.owner)
            .field("token", &self.holding.token)
            .field("state", &self.holding.state())
            .finish()
    }
}

impl LockGuard {
    pub(crate) fn new(holding: Arc<Holding>) -> Self {
        Self {
            holding,
            done: false,
        }
    }

    /// The lock name.
    pub fn name(&self) -> &str {
        &self.holding.shared.name
    }

    /// The owner id.
    pub fn owner(&self) -> &str {
        &self.holding.shared.owner
    }

    /// The fencing token of this hold (the same for reentrant guards); `None` where the backend mints
    /// none. Pass it to the resource, which must reject tokens lower than the highest it has seen.
    pub fn token(&self) -> Option<FencingToken> {
        self.holding.token
    }

    /// A descriptor whose inheritance keeps the lock held: while any process has it open, the kernel
    /// holds the lock even if this process dies (the file backend's `flock`ed file; `None` on every other
    /// backend). `distlock run` hands it to the process that supervises the command, so the lock frees
    /// only after the command's last descendant is gone. Unlocking or releasing through the guard still
    /// unlocks for every holder of the descriptor.
    pub fn inheritable_descriptor(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.holding.descriptor.get().map(|fd| fd.as_fd())
    }

    /// `Held`, `Jeopardy` or `Lost`, computed from the clock on every call.
    pub fn state(&self) -> LockState {
        self.holding.state()
    }

    /// Why the lock was lost, once it is.
    pub fn loss_reason(&self) -> Option<String> {
        self.holding.loss_reason()
    }

    /// Until when ownership can be assumed without another confirmed renewal; `None` for locks with no
    /// server-side expiry (file locks, SQL advisory locks: held until the process or connection ends).
    pub fn validity_deadline(&self) -> Option<std::time::Instant> {
        lock(&self.holding.status).deadline.map(Instant::to_std)
    }

    /// Every state transition, as a watch channel.
    pub fn state_changes(&self) -> watch::Receiver<LockState> {
        let _ = self.holding.state();
        self.holding.state_tx.subscribe()
    }

    /// Resolves once the state is `Lost`: at once if it already is, otherwise at the validity deadline
    /// (a timer armed for it) or when the watchdog or backend learns of the loss.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn lost(&self) {
        self.until(|state| state == LockState::Lost).await
    }

    /// Resolves once the state is no longer `Held` (`Jeopardy` or `Lost`).
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn jeopardy(&self) {
        self.until(|state| state != LockState::Held).await
    }

    async fn until(&self, reached: impl Fn(LockState) -> bool) {
        let mut changes = self.holding.state_tx.subscribe();
        loop {
            if reached(self.holding.state()) {
                return;
            }
            match self.holding.next_deadline() {
                Some(deadline) => {
                    tokio::select! {
                        _ = changes.changed() => {}
                        _ = tokio::time::sleep_until(deadline.to_tokio()) => {}
                    }
                }
                None => {
                    if changes.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            }
        }
    }

    /// Renews the lease now for `ttl` (the watchdog keeps renewing with the lock's lease afterwards).
    ///
    /// Fails with [`ErrorKind::LockLost`] if the server says the lock is gone, with the backend's error
    /// (the guard then in Jeopardy) if the renewal could not be confirmed, and with
    /// [`ErrorKind::Unsupported`] for locks with no server-side expiry.
    ///
    /// # Cancel safety
    /// Cancel safe: a renewal whose reply is dropped leaves the lease as the server has it.
    pub async fn extend(&self, ttl: Duration) -> Result<()> {
        let kind = self.holding.shared.locks.backend.kind();
        let name = self.name().to_string();
        if lock(&self.holding.status).deadline.is_none() {
            return Err(tag(
                Error::new(
                    ErrorKind::Unsupported,
                    "this lock has no lease on the server to extend",
                ),
                kind,
                &name,
            ));
        }
        if ttl < crate::options::MIN_LEASE {
            return Err(tag(
                Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "extend needs at least {}",
                        crate::duration::format(crate::options::MIN_LEASE)
                    ),
                ),
                kind,
                &name,
            ));
        }
        if let Some(reason) = self.holding.loss_reason() {
            return Err(tag(Error::new(ErrorKind::NotHeld, reason), kind, &name));
        }
        self.holding
            .renew_now(ttl)
            .await
            .map_err(|e| tag(e, kind, &name))
    }

    /// Releases now. With reentrant guards alive, only this one ends and `Ok(())` is returned; the last
    /// guard releases the lock on the server, owner-guarded: [`ErrorKind::NotHeld`] if it was no longer
    /// this owner's.
    ///
    /// # Cancel safety
    /// Cancel safe: if this future is dropped before the release is confirmed, the release is started
    /// again in the background (it is owner-guarded, so repeating it never touches another holder).
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        let Some(holding) = self.leave() else {
            return Ok(());
        };
        // Inline: a task of its own would cost a cross-thread hand-off on every release. If this future
        // is dropped before the outcome is known, the release starts again in the background; it is
        // owner-guarded and safe to repeat.
        let mut unfinished = RestartOnDrop(Some(holding.clone()));
        let outcome = holding.finish().await;
        unfinished.0 = None;
        outcome
    }

    /// Drops this guard's share of the hold; returns the hold if this was the last guard.
    fn leave(&self) -> Option<Arc<Holding>> {
        let shared = &self.holding.shared;
        let mut held = lock(&shared.held);
        match held.as_mut() {
            Some((holding, count)) if Arc::ptr_eq(holding, &self.holding) => {
                *count -= 1;
                if *count == 0 {
                    return held.take().map(|(holding, _)| holding);
                }
                None
            }
            _ => None,
        }
    }
}

/// Restarts an interrupted release in the background.
struct RestartOnDrop(Option<Arc<Holding>>);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if let Some(holding) = self.0.take() {
            let name = holding.shared.name.clone();
            let locks = holding.shared.locks.clone();
            locks.spawn_background(async move {
                if let Err(error) = holding.finish().await {
                    tracing::warn!(lock = %name, %error, "release restarted after cancellation failed");
                }
            });
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(holding) = self.leave() {
            let name = holding.shared.name.clone();
            let locks = holding.shared.locks.clone();
            locks.spawn_background(async move {
                if let Err(error) = holding.finish().await {
                    tracing::warn!(lock = %name, %error, "release after drop failed");
                }
            });
        }
    }
}
