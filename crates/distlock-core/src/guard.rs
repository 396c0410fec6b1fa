//! `LockGuard` and the hold it shares with reentrant guards: validity deadline, the three states, loss.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::{watch, Notify};

use crate::gate::{GateGuard, HandedGrant};
use crate::kinds::LockKind;

use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind, Result};
use crate::locks::{tag, LockShared, LocksInner, ReleaseInFlight};
use crate::options::LockOptions;
use crate::raw::{AcquireRequest, ErasedLease, HandOff, Released, Renewal, RenewalId, Renewed};

/// A backend's loss future ([`LossSignal::from_future`](crate::raw::LossSignal::from_future)).
pub(crate) type LossFuture = std::pin::Pin<Box<dyn std::future::Future<Output = String> + Send>>;
use crate::state::LockState;
use crate::sync::lock;
use crate::telemetry::{LossCause, Op, RenewalOutcome};
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

/// The renewal period after a grant of `granted`: a third of it, or of the lease if that is shorter
/// (an `extend` longer than the lease is followed by renewals with the lease).
fn renewal_period(lease: Duration, granted: Duration) -> Duration {
    (lease.min(granted) / 3).max(Duration::from_millis(1))
}

/// When to renew a grant of `granted` sent at `sent_at`: `sent_at + min(lease, granted)/3`, or never
/// when the grant already covers the rest of `max_hold` (renewing could only ask for less).
fn next_renewal(
    sent_at: Instant,
    granted: Duration,
    lease: Duration,
    max_hold_end: Option<Instant>,
) -> Option<Instant> {
    if max_hold_end.is_some_and(|end| sent_at.saturating_add(granted) >= end) {
        return None;
    }
    Some(sent_at.saturating_add(renewal_period(lease, granted)))
}

/// The renewal in flight that an `extend` owns; dropped unfinished (the `extend` future was dropped),
/// it ends the renewal, counting an unanswered request as unconfirmed.
struct RenewalTurn<'a> {
    holding: &'a Holding,
    /// The request, once sent: when, and for how long.
    sent: Option<(Instant, Duration)>,
    /// Its outcome was applied (which ended the renewal).
    applied: bool,
}

impl Drop for RenewalTurn<'_> {
    fn drop(&mut self) {
        if self.applied {
            return;
        }
        match self.sent.take() {
            Some((sent_at, ttl)) => self.holding.renewal_abandoned(sent_at, ttl),
            None => self.holding.renewal_not_sent(),
        }
    }
}

/// One hold of a lock, shared by the reentrant guards of one [`Lock`](crate::Lock).
pub(crate) struct Holding {
    pub(crate) shared: Arc<LockShared>,
    pub(crate) lease: ErasedLease,
    token: Option<FencingToken>,
    /// The lease renewals ask for.
    lease_ttl: Duration,
    max_hold_end: Option<Instant>,
    /// The runtime of the acquire: the watchdog moves there if its own runtime is dropped.
    pub(crate) runtime: Option<tokio::runtime::Handle>,
    status: Mutex<Status>,
    /// The state channel, made by the first observer (`state_changes`, `lost`, `jeopardy`, a backend's
    /// loss signal) under the `status` lock, where every publish happens, so none is missed. Most holds
    /// have none: the channel is ≈ 0.35 KiB (tokio's watch keeps eight `Notify`s), the largest part of
    /// a hold (issue 9's memory per held lock).
    state_tx: std::sync::OnceLock<watch::Sender<LockState>>,
    /// The local gate of this name, passed to the next waiter of this process after the release, or
    /// the release's mark once it passed the gate on early. One field for both (a hold has at most one
    /// of them): 16 bytes less per hold (issue 9's memory per held lock).
    gate: Mutex<OnGate>,
    /// The wake-ups of the hold's waiters, made by the first waiter (an `extend` waiting for its turn,
    /// `lost()`, `jeopardy()`): most holds have none, and two `Notify`s are 64 bytes (issue 9's memory
    /// per held lock). Only `notify_waiters` is used on them, which stores no permit, so one not yet made
    /// has no one to wake: a waiter arms its `notified()` before it reads the status, under the lock the
    /// waker changed it under.
    wakeups: std::sync::OnceLock<Box<Wakeups>>,
    /// Set once at install when the backend has one (the file backend's `flock`ed descriptor).
    pub(crate) descriptor: std::sync::OnceLock<Arc<std::os::fd::OwnedFd>>,
    /// Which permit a semaphore's hold is.
    permit: Option<Box<str>>,
    /// When the grant's request was sent, in milliseconds on the boot clock (8 bytes, not an
    /// `Instant`'s 16: a hold's size class): the start of `distlock_hold_seconds`.
    granted_at_ms: u64,
}

/// The hold's part in its name's local gate (see [`Holding::gate`]).
enum OnGate {
    /// The gate is the hold's.
    Held(GateGuard),
    /// The release passed the gate on before its reply: marked until that reply (see
    /// [`pass_gate_on_early`](Holding::pass_gate_on_early)); kept for its drop, which ends the mark.
    PassedEarly { _in_flight: ReleaseInFlight },
    /// Passed on (or never had).
    Passed,
}

/// See [`Holding::wakeups`].
#[derive(Default)]
struct Wakeups {
    /// Woken when a renewal ends, for an `extend` waiting for its turn.
    renewal_done: Notify,
    /// Woken when the deadline moves, so `lost()` re-arms its timer.
    deadline_moved: Notify,
}

/// A hold whose renewal is due within this share of its period needs one now: the watchdog sends a
/// batch (an eighth, so holds due a moment apart still share one).
const DUE_SHARE: u32 = 8;
/// When a batch goes out anyway, every hold due within this share of its period rides along. Renewing
/// early only moves the deadline later, and it makes holds granted at different times fall into one
/// batch after one period, so a `Locks` holding many locks sends one round trip per connection per
/// tick, not one per group of grants. (With a narrower window, holds granted over more than that window
/// would keep their own batches for ever.) The cost: a hold with a longer period than others is renewed
/// up to twice as often, in the others' batches, with no extra round trip.
const RIDE_ALONG_SHARE: u32 = 2;

#[derive(Debug, Default)]
struct Status {
    /// `None` for locks with no server-side expiry.
    deadline: Option<Instant>,
    /// When the request behind `deadline` was sent: only a reply to a later request may replace it.
    confirmed_sent_at: Option<Instant>,
    /// A third of the last grant (at most of the lease): the renewal period.
    period: Duration,
    jeopardy: bool,
    /// The reason, boxed to its length (a `String`'s capacity word less per hold).
    lost: Option<Box<str>>,
    released: bool,
    next_renew_at: Option<Instant>,
    /// A renewal (the watchdog's or an `extend`) is in flight: at most one per hold.
    renewing: bool,
    /// The hold's `distlock.hold` span, from the grant until the release or the loss; only while a
    /// subscriber records it (boxed: most holds have none).
    span: Option<Box<tracing::Span>>,
}

impl Status {
    /// Runs `event` (a `tracing` event) in the hold's span, if it has one.
    fn in_span(&self, event: impl FnOnce()) {
        match self.span.as_deref() {
            Some(span) => span.in_scope(event),
            None => event(),
        }
    }

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
    // The grant's parts and the acquire's, each stored once: a struct of them would only be unpacked.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<LockShared>,
        lease: ErasedLease,
        token: Option<FencingToken>,
        ttl: Option<Duration>,
        sent_at: Instant,
        options: LockOptions,
        gate: Option<GateGuard>,
        permit: Option<Box<str>>,
    ) -> Arc<Self> {
        let max_hold_end = options.max_hold.map(|cap| sent_at.saturating_add(cap));
        let mut status = Status::default();
        if let Some(ttl) = ttl {
            status.deadline = Some(validity_deadline(sent_at, ttl));
            status.confirmed_sent_at = Some(sent_at);
            status.period = renewal_period(options.lease, ttl);
            status.next_renew_at = next_renewal(sent_at, ttl, options.lease, max_hold_end);
        }
        shared.metrics.hold_started();
        Arc::new(Self {
            shared,
            lease,
            token,
            lease_ttl: options.lease,
            max_hold_end,
            runtime: tokio::runtime::Handle::try_current().ok(),
            status: Mutex::new(status),
            state_tx: std::sync::OnceLock::new(),
            gate: Mutex::new(gate.map_or(OnGate::Passed, OnGate::Held)),
            wakeups: std::sync::OnceLock::new(),
            descriptor: std::sync::OnceLock::new(),
            permit,
            granted_at_ms: sent_at.as_millis(),
        })
    }

    /// Opens the hold's span (following the caller's span and the acquire's), unless it has one or no
    /// subscriber wants it.
    pub(crate) fn start_span(&self, acquire: Option<&tracing::Span>) {
        {
            // A reentrant acquire joins the hold and its span.
            let status = lock(&self.status);
            if status.span.is_some() || status.released || status.lost.is_some() {
                return;
            }
        }
        // No parent: a hold outlives the caller's span (a request that took a leader's lock), and a
        // child would keep that span open until the release. Linked to it and to the acquire instead.
        let span = tracing::info_span!(
            parent: None,
            "distlock.hold",
            engine = self.shared.locks.backend.kind(),
            lock = %self.shared.name,
            kind = self.shared.kind.as_str(),
            token = self.token.map(FencingToken::get),
            end = tracing::field::Empty,
            reason = tracing::field::Empty,
        );
        if span.is_disabled() {
            return;
        }
        span.follows_from(tracing::Span::current());
        if let Some(acquire) = acquire {
            span.follows_from(acquire);
        }
        let mut status = lock(&self.status);
        if status.span.is_none() && !status.released && status.lost.is_none() {
            status.span = Some(Box::new(span));
        }
    }

    /// How long since the grant's request was sent.
    fn held_for(&self) -> Duration {
        Duration::from_millis(clock::now().as_millis().saturating_sub(self.granted_at_ms))
    }

    /// Marks the hold Lost for `reason` (under the `status` lock, once): counted, logged in its span,
    /// and the span closed. A hold already released only shows the reason to a guard still holding it.
    fn lose(&self, status: &mut Status, reason: Box<str>, cause: LossCause) {
        if status.lost.is_some() {
            return;
        }
        if !status.released {
            self.shared
                .metrics
                .hold_ended(status.jeopardy, Some(cause), self.held_for());
            if let Some(span) = &status.span {
                span.record("end", "lost");
                span.record("reason", &*reason);
            }
            status.in_span(
                || tracing::warn!(lock = %self.shared.name, reason = &*reason, "lock lost"),
            );
            status.span = None;
        }
        status.lost = Some(reason);
    }

    /// Marks the hold released (under the `status` lock, once): counted unless it was lost, and its
    /// span closed.
    fn end_released(&self, status: &mut Status) {
        if std::mem::replace(&mut status.released, true) || status.lost.is_some() {
            return;
        }
        let held_for = self.held_for();
        self.shared
            .metrics
            .hold_ended(status.jeopardy, None, held_for);
        if let Some(span) = status.span.take() {
            span.record("end", "released");
            let held_ms = u64::try_from(held_for.as_millis()).unwrap_or(u64::MAX);
            tracing::info!(parent: &*span, held_ms, "lock released");
        }
    }

    /// The wake-ups, made now if no waiter has made them (for a waiter).
    fn wakeups(&self) -> &Wakeups {
        self.wakeups.get_or_init(Box::default)
    }

    /// Wakes an `extend` waiting for its turn, if a waiter made the wake-ups.
    fn wake_renewal_done(&self) {
        if let Some(wakeups) = self.wakeups.get() {
            wakeups.renewal_done.notify_waiters();
        }
    }

    /// Wakes the `lost()`s re-arming their timers, if a waiter made the wake-ups.
    fn wake_deadline_moved(&self) {
        if let Some(wakeups) = self.wakeups.get() {
            wakeups.deadline_moved.notify_waiters();
        }
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
        status.lost.as_deref().map(String::from)
    }

    /// Marks the hold Lost if a deadline has passed, and publishes any change.
    fn refresh(&self, status: &mut Status, now: Instant) {
        if status.lost.is_none() {
            if status.deadline.is_some_and(|d| now >= d) {
                // No renewal was due: the last grant covered the rest of `max_hold`, and its
                // deadline (1 % early for clock drift) came just before the cap itself.
                let capped = self.max_hold_end.is_some() && status.next_renew_at.is_none();
                if capped {
                    let reason = "max_hold was reached (the last grant covered the rest of it)";
                    self.lose(status, reason.into(), LossCause::MaxHold);
                } else {
                    let reason = "the validity deadline passed without a confirmed renewal";
                    self.lose(status, reason.into(), LossCause::Expired);
                }
            } else if self.max_hold_end.is_some_and(|end| now >= end) {
                self.lose(status, "max_hold was reached".into(), LossCause::MaxHold);
            }
        }
        self.publish(status);
    }

    /// Publishes the state to the channel, if anyone made it (called under the `status` lock).
    fn publish(&self, status: &Status) {
        let Some(state_tx) = self.state_tx.get() else {
            return;
        };
        let state = status.state();
        state_tx.send_if_modified(|current| {
            let changed = *current != state;
            *current = state;
            changed
        });
    }

    /// Ends a write hold that became a read hold ([`LockGuard::downgrade`]): no longer this `Lock`'s
    /// hold, not renewed, and its gate passed on, with nothing to release on the server.
    fn end_downgraded(&self) {
        {
            let mut held = lock(&self.shared.held);
            if held
                .as_ref()
                .is_some_and(|(holding, _)| std::ptr::eq(Arc::as_ptr(holding), self))
            {
                held.take();
            }
        }
        self.end_released(&mut lock(&self.status));
        let on_gate = std::mem::replace(&mut *lock(&self.gate), OnGate::Passed);
        drop(on_gate);
    }

    /// Marks a hold that has ended (released or downgraded) `Lost`, for a guard still showing it.
    fn mark_lost_after_release(&self, reason: &str) {
        let mut status = lock(&self.status);
        if status.lost.is_none() {
            status.lost = Some(reason.into());
        }
        self.publish(&status);
    }

    pub(crate) fn mark_lost(&self, reason: String) {
        let mut status = lock(&self.status);
        if !status.released {
            self.lose(&mut status, reason.into(), LossCause::Reported);
        }
        self.publish(&status);
    }

    /// A receiver of the state channel, made now if no one has made it, with the state now as seen.
    pub(crate) fn subscribe(&self) -> watch::Receiver<LockState> {
        let mut status = lock(&self.status);
        self.refresh(&mut status, clock::now());
        self.state_tx
            .get_or_init(|| watch::channel(status.state()).0)
            .subscribe()
    }

    /// Whether an observer has made the state channel.
    #[cfg(test)]
    pub(crate) fn has_state_channel(&self) -> bool {
        self.state_tx.get().is_some()
    }

    /// The validity deadline; `None` for locks with no server-side expiry.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        lock(&self.status).deadline
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

    /// Whether this hold needs a renewal now: one is due within [`DUE_SHARE`] of its period and none
    /// is in flight. Only such a hold makes the watchdog send a batch.
    pub(crate) fn renewal_due(&self, now: Instant) -> bool {
        let status = lock(&self.status);
        Self::due_within(&status, now, status.period / DUE_SHARE)
    }

    /// For a batch that goes out: if a renewal is due within [`RIDE_ALONG_SHARE`] of its period and
    /// none is in flight (an `extend`, say: the hold is skipped this tick), marks one under way and
    /// returns the TTL to ask for.
    pub(crate) fn take_due(&self, now: Instant) -> Option<Duration> {
        let mut status = lock(&self.status);
        if !Self::due_within(&status, now, status.period / RIDE_ALONG_SHARE) {
            return None;
        }
        status.renewing = true;
        Some(self.renewal_ttl(now))
    }

    fn due_within(status: &Status, now: Instant, window: Duration) -> bool {
        status.next_renew_at.is_some_and(|due| {
            !status.renewing
                && !status.released
                && status.lost.is_none()
                && due <= now.saturating_add(window)
        })
    }

    /// The lease, capped by what is left of `max_hold`.
    fn renewal_ttl(&self, now: Instant) -> Duration {
        self.cap_by_max_hold(self.lease_ttl, now)
    }

    /// `ttl`, capped by what is left of `max_hold`: the key never outlives the hold.
    fn cap_by_max_hold(&self, ttl: Duration, now: Instant) -> Duration {
        match self.max_hold_end {
            Some(end) => ttl
                .min(end.saturating_duration_since(now))
                .max(Duration::from_millis(1)),
            None => ttl,
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

    /// A renewal asking for `ttl` goes out at `sent_at`. Until its outcome is known it may have been
    /// applied, so the deadline is at most the one it would set: an `extend` shorter than what is left (or
    /// a renewal after a longer `extend`) cannot leave the guard trusting the longer lease while its reply
    /// is on the way.
    pub(crate) fn renewal_sent(&self, sent_at: Instant, ttl: Duration) {
        let unconfirmed = validity_deadline(sent_at, ttl);
        let moved = {
            let mut status = lock(&self.status);
            match status.deadline {
                Some(deadline) if unconfirmed < deadline => {
                    status.deadline = Some(unconfirmed);
                    true
                }
                _ => false,
            }
        };
        if moved {
            self.wake_deadline_moved();
            self.shared.locks.watchdog.poke();
        }
    }

    /// The renewal marked under way was never sent (its task was dropped before it ran): the hold is free
    /// for the next one, and the watchdog and a waiting `extend` are told.
    pub(crate) fn renewal_not_sent(&self) {
        lock(&self.status).renewing = false;
        self.wake_renewal_done();
        self.shared.locks.watchdog.poke();
    }

    /// A renewal sent at `sent_at` for `ttl` will never be answered (its future was dropped: an
    /// `extend` cancelled by its caller, or a batch whose runtime was dropped). It may have been applied,
    /// so it counts as an unconfirmed reply. The watchdog is woken: the hold is due for a retry, and a
    /// watchdog restarted elsewhere may have skipped it while the renewal was in flight.
    pub(crate) fn renewal_abandoned(&self, sent_at: Instant, ttl: Duration) {
        self.apply_renewal(
            sent_at,
            ttl,
            Err(Error::new(
                ErrorKind::Unavailable,
                "the renewal was abandoned before its reply",
            )),
        );
        self.shared.locks.watchdog.poke();
    }

    /// Applies the outcome of a renewal sent at `sent_at` asking for `asked`, and ends the renewal in
    /// flight.
    ///
    /// - `Extended`: replaces the deadline only if its request was sent after the one behind the current
    ///   deadline (with one renewal per hold whose reply counts, that is always so; the check keeps it
    ///   so). The
    ///   deadline is that request's `sent_at + granted·0.99 − 2 ms`, earlier or later than before, and
    ///   the next renewal is due at `sent_at + min(lease, granted)/3`.
    /// - `Gone`: Lost, whichever request it answers: within one hold the key is this owner's, and no
    ///   renewal recreates a key the server dropped, so any `Gone` is a real loss.
    /// - an error (or no reply): the request may still have been applied, so the deadline becomes the
    ///   earlier of the current one and the one it would have set (an unconfirmed `extend(short)` cannot
    ///   leave the guard trusting a longer lease); Jeopardy, and a retry soon.
    pub(crate) fn apply_renewal(
        &self,
        sent_at: Instant,
        asked: Duration,
        outcome: Result<Renewed>,
    ) {
        let now = clock::now();
        let mut status = lock(&self.status);
        status.renewing = false;
        let before = status.deadline;
        let metrics = &self.shared.metrics;
        if !status.released {
            // Counted even when the reply came too late to count for the hold: those renewals explain
            // the expiries.
            let round_trip = now.saturating_duration_since(sent_at);
            match &outcome {
                Ok(Renewed::Extended { .. }) => {
                    metrics.renewal(RenewalOutcome::Extended, Some(round_trip))
                }
                Ok(Renewed::Gone { .. }) => metrics.renewal(RenewalOutcome::Gone, Some(round_trip)),
                Err(error) => {
                    metrics.renewal(RenewalOutcome::Failed, None);
                    metrics.error(Op::Renew, error.kind());
                }
            }
        }
        self.refresh(&mut status, now);
        if status.lost.is_none() && !status.released {
            match outcome {
                Ok(Renewed::Extended { ttl }) => {
                    if status.confirmed_sent_at.is_some_and(|c| sent_at <= c) {
                        tracing::debug!(lock = %self.shared.name, "a reply older than the current deadline's is ignored");
                    } else {
                        status.deadline = Some(validity_deadline(sent_at, ttl));
                        status.confirmed_sent_at = Some(sent_at);
                        if std::mem::replace(&mut status.jeopardy, false) {
                            metrics.jeopardy(false);
                            status.in_span(|| tracing::info!(lock = %self.shared.name, "renewal confirmed; lock held again"));
                        }
                        status.period = renewal_period(self.lease_ttl, ttl);
                        status.next_renew_at =
                            next_renewal(sent_at, ttl, self.lease_ttl, self.max_hold_end);
                    }
                }
                Ok(Renewed::Gone { reason }) => {
                    self.lose(&mut status, reason.into(), LossCause::Gone);
                }
                Err(error) => {
                    let unconfirmed = validity_deadline(sent_at, asked);
                    status.deadline = status.deadline.map(|d| d.min(unconfirmed));
                    if !status.jeopardy {
                        metrics.jeopardy(true);
                        status.in_span(|| tracing::warn!(lock = %self.shared.name, %error, "renewal failed; lock in jeopardy"));
                    }
                    status.jeopardy = true;
                    // Retry well before the deadline, which may just have moved closer.
                    let remaining = status
                        .deadline
                        .map_or(Duration::MAX, |d| d.saturating_duration_since(now));
                    let retry = (status.period / 4)
                        .min(remaining / 4)
                        .max(Duration::from_millis(20));
                    status.next_renew_at = Some(now.saturating_add(retry));
                }
            }
            // A reply confirmed after its own deadline counts as failed: this marks it Lost.
            self.refresh(&mut status, clock::now());
        }
        self.publish(&status);
        let moved = status.deadline != before;
        drop(status);
        self.wake_renewal_done();
        if moved {
            self.wake_deadline_moved();
        }
    }

    /// Waits until no renewal of this hold is in flight, then marks one under way for the caller.
    async fn take_turn(&self) -> Result<RenewalTurn<'_>> {
        loop {
            let done = self.wakeups().renewal_done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            {
                let mut status = lock(&self.status);
                self.refresh(&mut status, clock::now());
                if let Some(reason) = &status.lost {
                    return Err(Error::new(ErrorKind::LockLost, reason.clone()));
                }
                if status.released {
                    return Err(Error::new(ErrorKind::NotHeld, "the lock was released"));
                }
                if !status.renewing {
                    status.renewing = true;
                    return Ok(RenewalTurn {
                        holding: self,
                        sent: None,
                        applied: false,
                    });
                }
            }
            done.await;
        }
    }

    /// Renews now with `ttl` (capped by `max_hold`), after any renewal in flight: the later request
    /// defines the deadline.
    async fn renew_now(&self, ttl: Duration) -> Result<()> {
        let mut turn = self.take_turn().await?;
        let backend = self.shared.locks.backend.clone();
        let sent_at = clock::now();
        let ttl = self.cap_by_max_hold(ttl, sent_at);
        let batch = [Renewal {
            id: RenewalId(0),
            name: &self.shared.name,
            owner: &self.shared.owner,
            lease: &self.lease,
            ttl,
        }];
        turn.sent = Some((sent_at, ttl));
        self.renewal_sent(sent_at, ttl);
        // The watchdog skips this hold while the extend is in flight: a reply that stalls must not use up
        // the time left, so after half of it the request counts as unconfirmed and the watchdog retries.
        let wait = lock(&self.status).deadline.map_or(ttl, |deadline| {
            deadline.saturating_duration_since(sent_at) / 2
        });
        // On the boot clock: after a suspend the half is over at the resume, not that much later.
        let replied = tokio::select! {
            biased;
            outcomes = backend.renew(&batch) => Ok(outcomes),
            () = clock::sleep_until(sent_at.saturating_add(wait)) => Err(()),
        };
        let outcome = match replied {
            Ok(outcomes) => outcomes
                .into_iter()
                .find_map(|(id, outcome)| (id == RenewalId(0)).then_some(outcome))
                .unwrap_or_else(|| {
                    Err(Error::new(
                        ErrorKind::Protocol,
                        "internal error: the backend returned no renewal outcome",
                    ))
                }),
            Err(_) => Err(Error::new(
                ErrorKind::Unavailable,
                "the extend got no reply within half the time left before the validity deadline; the watchdog retries",
            )),
        };
        let failure = match &outcome {
            Ok(Renewed::Extended { .. }) => None,
            Ok(Renewed::Gone { reason }) => Some(Error::new(ErrorKind::LockLost, reason.clone())),
            Err(e) => Some(Error::new(e.kind(), e.message().to_string())),
        };
        self.apply_renewal(sent_at, ttl, outcome);
        turn.applied = true;
        // The deadline and the next renewal moved: the watchdog re-arms its timer.
        self.shared.locks.watchdog.poke();
        if let Some(reason) = self.loss_reason() {
            return Err(Error::new(ErrorKind::LockLost, reason));
        }
        failure.map_or(Ok(()), Err)
    }

    /// Watches a backend's loss future until the hold ends, in a task.
    pub(crate) fn watch_loss(self: &Arc<Self>, loss: LossFuture) {
        // On the acquire's runtime, which the hold's user is on.
        let runtime = self.runtime.clone().or_else(|| self.shared.locks.runtime());
        LossWatch::start(runtime.as_ref(), Arc::downgrade(self), loss);
    }

    /// [`finish`](Self::finish) as background work, restartable: a release cut off by its runtime's
    /// shutdown runs again from the start (it is owner-guarded). `failed` is logged with its error.
    fn finish_in_background(self: Arc<Self>, failed: &'static str) {
        let locks = self.shared.locks.clone();
        locks.spawn_background_restartable(move || {
            let holding = self.clone();
            async move {
                let name = holding.shared.name.clone();
                if let Err(error) = holding.finish().await {
                    tracing::warn!(lock = %name, %error, "{failed}");
                }
            }
        });
    }

    /// The release is on its way, ahead of every acquire sent after it: the next waiter of this process
    /// may go. This owner's own next acquire still waits for the reply, on `releasing`; if that cannot be
    /// marked (a restarted release marked it already, or another is marked), the gate stays until the
    /// reply.
    fn pass_gate_on_early(&self) {
        let mut on_gate = lock(&self.gate);
        if matches!(*on_gate, OnGate::PassedEarly { .. }) {
            return;
        }
        if let Some(in_flight) = LocksInner::start_release_in_flight(&self.shared) {
            let gate = std::mem::replace(
                &mut *on_gate,
                OnGate::PassedEarly {
                    _in_flight: in_flight,
                },
            );
            drop(on_gate);
            drop(gate);
        }
    }

    /// The gate, if the hold still has it.
    fn take_gate(&self) -> Option<GateGuard> {
        let mut on_gate = lock(&self.gate);
        match std::mem::replace(&mut *on_gate, OnGate::Passed) {
            OnGate::Held(gate) => Some(gate),
            other => {
                *on_gate = other;
                None
            }
        }
    }

    /// Where the backend can, releases and grants the lock to the front waiter of the local gate in one
    /// request ([`Backend::hand_off`](crate::raw::Backend::hand_off)), and passes the gate on with the
    /// grant. `None` when it is not tried: the backend cannot, nobody waits, or the next waiter is this
    /// same owner (to the engine one owner; its acquire must not overtake this release, see
    /// [`LocksInner::releasing`]), or the next owner's own earlier release, passed on early, has not
    /// answered yet (a handed grant skips the `releasing` wait an acquire of its would make, and that
    /// release, resent late, would delete the grant). Where a backend also passes the gate on early
    /// (`release_orders_next_acquire`), the handoff is tried first: one request instead of a release
    /// and an acquire behind it (issue 9).
    async fn hand_off(&self) -> Option<Result<Released>> {
        let backend = self.shared.locks.backend.clone();
        if !backend.supports_hand_off() {
            return None;
        }
        let next = match &*lock(&self.gate) {
            OnGate::Held(gate) => gate.next_waiter()?,
            OnGate::PassedEarly { .. } | OnGate::Passed => return None,
        };
        // Only to a waiter of the same kind: a mutex and a write lock share the gate, and where they
        // are different server objects one cannot be handed on as the other.
        if next.owner == self.shared.owner
            || next.kind != self.shared.kind
            || self
                .shared
                .locks
                .release_in_flight(&self.shared.gate, &self.shared.name, &next.owner)
                .is_some()
        {
            return None;
        }
        let request = AcquireRequest::new(
            self.shared.name.to_string(),
            next.owner.to_string(),
            next.lease,
        )
        .with_kind(next.kind);
        let sent_at = clock::now();
        let outcome = backend
            .hand_off(&self.lease, &self.shared.name, &self.shared.owner, &request)
            .await;
        Some(match outcome {
            Ok(HandOff::Handed(grant)) => {
                let handed = HandedGrant {
                    gate: None,
                    grant: Some(grant),
                    sent_at,
                    locks: self.shared.locks.clone(),
                    name: self.shared.name.clone(),
                    owner: next.owner,
                };
                match self.take_gate() {
                    Some(gate) => gate.pass_with_grant(next.id, handed),
                    // Not expected (the gate was ours a moment ago): the grant is released.
                    None => drop(handed),
                }
                Ok(Released::Released)
            }
            Ok(HandOff::Released(released)) => Ok(released),
            Err(e) => Err(e),
        })
    }

    /// Releases on the server, then passes the local gate on. Runs as its own task so that dropping the
    /// caller's future does not interrupt it.
    async fn finish(self: Arc<Self>) -> Result<()> {
        let lost_before = {
            let mut status = lock(&self.status);
            self.refresh(&mut status, clock::now());
            self.end_released(&mut status);
            status.lost.is_some()
        };
        let backend = self.shared.locks.backend.clone();
        let handed = if lost_before {
            None
        } else {
            self.hand_off().await
        };
        let outcome = if let Some(outcome) = handed {
            outcome
        } else if backend.release_orders_next_acquire() {
            let mut release = backend.release(&self.lease, &self.shared.name, &self.shared.owner);
            // One poll puts the request on the connection; from then on the next waiter's acquire
            // travels behind it, so it need not wait for the reply.
            match std::future::poll_fn(|cx| Poll::Ready(release.as_mut().poll(cx))).await {
                Poll::Ready(outcome) => outcome,
                Poll::Pending => {
                    self.pass_gate_on_early();
                    release.await
                }
            }
        } else {
            backend
                .release(&self.lease, &self.shared.name, &self.shared.owner)
                .await
        };
        let lost = lock(&self.status).lost.clone();
        let on_gate = std::mem::replace(&mut *lock(&self.gate), OnGate::Passed);
        drop(on_gate);
        let kind = backend.kind();
        let name = &self.shared.name;
        let result = match outcome {
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
        };
        if let Err(error) = &result {
            self.shared.metrics.error(Op::Release, error.kind());
        }
        result
    }
}

/// Proof of holding a lock. Dropping it releases the lock in the background; [`release`](Self::release)
/// does it now and reports the outcome.
///
/// A guard of a lock with a lease is renewed by the watchdog while it lives. Its [`state`](Self::state)
/// says whether ownership can still be assumed; [`lost`](Self::lost) resolves when it cannot.
///
/// Release-on-drop is not immediate: it is handed to a background task on the current runtime, or,
/// dropped outside any runtime, on the latest acquire's if that is a multi-thread runtime (otherwise, or
/// if that runtime is gone, on distlock's background runtime). Call `release().await` to know it happened.
///
/// ```
/// use distlock_core::{LockState, Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let guard = locks.lock("nightly")?.acquire().await?;
/// let token = guard.token(); // pass it with every write to the resource
/// tokio::select! {
///     () = async { /* the work, fenced with `token` */ } => {}
///     () = guard.lost() => { /* ownership can no longer be assumed: stop the work */ }
/// }
/// assert_eq!(guard.state(), LockState::Held);
/// guard.release().await?; // or drop it: released in the background
/// # let _ = token;
/// # Ok(())
/// # }
/// ```
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
    /// Opens the hold's span (see [`Holding::start_span`]).
    pub(crate) fn start_hold_span(&self, acquire: Option<&tracing::Span>) {
        self.holding.start_span(acquire);
    }

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
    ///
    /// A read guard's token is the last write grant's (a reader mints none), so a resource can refuse
    /// writes from a writer older than what a reader saw. Each permit of a semaphore gets one of its
    /// own, above every earlier grant of the name: a resource the permit holders share fences per
    /// [`permit`](Self::permit).
    pub fn token(&self) -> Option<FencingToken> {
        self.holding.token
    }

    /// What this guard holds: a mutex, a side of a read-write lock, or a permit.
    pub fn kind(&self) -> LockKind {
        self.holding.shared.kind
    }

    /// Which permit this guard holds, as the engine names it (a slot number, a permit id, a lease
    /// node); `None` for other kinds.
    pub fn permit(&self) -> Option<&str> {
        self.holding.permit.as_deref()
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
    /// server-side expiry (file locks: held until the process ends). SQL session locks (advisory, row)
    /// have one: the server ends an idle session after the lease (PostgreSQL's
    /// `idle_session_timeout`, MariaDB's `wait_timeout`), so each confirmed probe moves it on.
    pub fn validity_deadline(&self) -> Option<std::time::Instant> {
        lock(&self.holding.status).deadline.map(Instant::to_std)
    }

    /// Every state transition, as a watch channel.
    pub fn state_changes(&self) -> watch::Receiver<LockState> {
        // The watchdog publishes a loss by time: it must run (it may have gone with a dropped runtime).
        let locks = &self.holding.shared.locks;
        locks.watchdog.ensure_running(locks);
        self.holding.subscribe()
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
        let locks = &self.holding.shared.locks;
        locks.watchdog.ensure_running(locks);
        let mut changes = self.holding.subscribe();
        loop {
            // Armed before the deadline is read, so a move in between is not missed.
            let moved = self.holding.wakeups().deadline_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if reached(self.holding.state()) {
                return;
            }
            let deadline = self.holding.next_deadline();
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        // The sender lives as long as the hold; never reached while this guard lives.
                        moved.await;
                    }
                }
                _ = async {
                    match deadline {
                        // On the boot clock: a tokio timer would fire late after a suspend.
                        Some(deadline) => clock::sleep_until(deadline).await,
                        None => std::future::pending().await,
                    }
                } => {}
                _ = &mut moved => {}
            }
        }
    }

    /// Renews the lease now for `ttl`, capped by what is left of `max_hold` (the watchdog keeps
    /// renewing with the lock's lease afterwards, the first time a third of `min(lease, granted)` after
    /// this request).
    ///
    /// A hold has at most one renewal in flight whose reply counts (one with no reply by its limit may
    /// still be on its way, but only a `Gone` from it counts): if the watchdog's is under way, `extend`
    /// waits for its reply and then sends its own, so the later request defines the validity deadline, earlier or
    /// later than before. While it is in flight the watchdog leaves the hold alone, so `extend` waits for
    /// its reply at most half the time left before the validity deadline; then the request counts as
    /// unconfirmed (Jeopardy, [`ErrorKind::Unavailable`]) and the watchdog retries in time.
    ///
    /// Fails with [`ErrorKind::LockLost`] if the server says the lock is gone, with the backend's error
    /// (the guard then in Jeopardy) if the renewal could not be confirmed, and with
    /// [`ErrorKind::Unsupported`] for locks with no server-side expiry.
    ///
    /// # Cancel safety
    /// Cancel safe: if the future is dropped after the request went out, the request counts as
    /// unconfirmed (it may have been applied): the guard goes to Jeopardy, its deadline no later than
    /// the one the request would have set, and the watchdog renews at once.
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
        let locks = &self.holding.shared.locks;
        locks.watchdog.ensure_running(locks);
        self.holding
            .renew_now(ttl)
            .await
            .map_err(|e| tag(e, kind, &name))
    }

    /// Turns this write guard into a read guard of the same [`RwLock`](crate::RwLock) in one step: no
    /// writer can take the lock in between, and the read guard keeps this guard's fencing token, lease
    /// and `max_hold`. Changes nothing and fails with [`ErrorKind::Unsupported`] where the backend
    /// cannot do it atomically ([`LockKinds::atomic_downgrade`](crate::LockKinds::atomic_downgrade)),
    /// for a guard that is not a write guard, or while reentrant guards share its hold.
    ///
    /// If the engine does not confirm it, the error is returned and this guard is `Lost` (the write
    /// hold may be gone on the server); dropping it releases whatever is left.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> distlock_core::Result<()> {
    /// use distlock_core::{LockKind, Locks, MemoryBackend};
    ///
    /// let locks = Locks::new(MemoryBackend::new());
    /// let rw = locks.read_write("config")?;
    /// let mut guard = rw.write().await?;
    /// let token = guard.token();
    /// guard.downgrade().await?;
    /// assert_eq!((guard.kind(), guard.token()), (LockKind::Read, token));
    /// let other = locks.read_write("config")?;
    /// assert!(other.reader().try_acquire().await?.is_some()); // readers share it now
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Cancel safety
    /// Cancel safe: the request runs in a task of its own. If this future is dropped, that task
    /// finishes it: a read hold it got is released in the background, and this guard is `Lost`.
    pub async fn downgrade(&mut self) -> Result<()> {
        let writer = self.holding.shared.clone();
        let locks = writer.locks.clone();
        let backend_kind = locks.backend.kind();
        let refuse =
            |kind, message: String| Err(tag(Error::new(kind, message), backend_kind, &writer.name));
        if writer.kind != LockKind::Write {
            return refuse(
                ErrorKind::Unsupported,
                format!(
                    "only a write guard can be downgraded, not a {}",
                    writer.kind
                ),
            );
        }
        if !locks.backend.capabilities().kinds.atomic_downgrade {
            return refuse(
                ErrorKind::Unsupported,
                format!("the {backend_kind} backend cannot turn a write lock into a read lock in one step"),
            );
        }
        let crate::locks::OtherSide::Reader(reader) = &writer.other_side else {
            return refuse(
                ErrorKind::Protocol,
                "internal error: a write lock without its read side".into(),
            );
        };
        let reader = reader.clone();
        let holding = self.holding.clone();
        let (reply, replied) = tokio::sync::oneshot::channel();
        // Everything from here on in the task, the read-write lock's acquires kept out until the end:
        // if this future is dropped, no acquire of either side can join the write hold the task is
        // ending or come between its end and the read hold's install.
        locks.spawn_background(async move {
            let result = downgrade_hold(&holding, &reader).await;
            if let Err(Ok(unwanted)) = reply.send(result) {
                // The caller gave up: its guard, still the write guard, no longer holds anything.
                holding.mark_lost_after_release("the downgrade finished after its caller gave up");
                drop(unwanted);
            }
        });
        match replied.await {
            Ok(Ok(read)) => {
                read.start_hold_span(None);
                let mut write = std::mem::replace(self, read);
                // Its hold ended in the downgrade: nothing to release.
                write.done = true;
                Ok(())
            }
            Ok(Err(e)) => Err(tag(e, backend_kind, &writer.name)),
            Err(_) => refuse(
                ErrorKind::Protocol,
                "internal error: the downgrade's task ended without an outcome".into(),
            ),
        }
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

/// The work of [`LockGuard::downgrade`], in its task: turns `holding` (the only guard's write hold)
/// into a read hold of `reader` (its read side) and returns the read guard.
async fn downgrade_hold(holding: &Arc<Holding>, reader: &Arc<LockShared>) -> Result<LockGuard> {
    let writer = &holding.shared;
    let locks = &writer.locks;
    // No acquire of either side while the hold changes sides (one mutex for both sides).
    let _serial = writer.serial().lock().await;
    match lock(&writer.held).as_ref() {
        Some((held, 1)) if Arc::ptr_eq(held, holding) => {}
        Some((held, _)) if Arc::ptr_eq(held, holding) => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "other guards share this write hold (reentrant acquires): release them first",
            ));
        }
        _ => {
            return Err(Error::new(
                ErrorKind::NotHeld,
                "this guard no longer holds the write lock",
            ))
        }
    }
    if let Some(reason) = holding.loss_reason() {
        return Err(Error::new(ErrorKind::LockLost, reason));
    }
    // The read side's own gate: held only by a read release of this `RwLock` still on its way.
    let read_gate =
        match reader
            .gate
            .take_or_queue(&reader.owner, holding.lease_ttl, LockKind::Read)
        {
            Ok(gate) => gate,
            Err(wait) => match wait.await {
                Ok(crate::gate::Pass::Plain(gate)) => gate,
                Ok(crate::gate::Pass::Granted(_)) | Err(_) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        "internal error: the read side's gate was handed on with a grant",
                    ))
                }
            },
        };
    // A read release of this owner that passed the gate on early may reach the engine after the
    // downgrade, where it would delete the read hold made now: its reply is waited for, as an
    // acquire of the read side waits for it (see `LocksInner::releasing`).
    if let Some(releasing) = locks.release_in_flight(&reader.gate, &reader.name, &reader.owner) {
        drop(releasing.lock().await);
    }
    // The waits may have used up the rest of `max_hold` (or the lease).
    if let Some(reason) = holding.loss_reason() {
        return Err(Error::new(ErrorKind::LockLost, reason));
    }
    let sent_at = clock::now();
    // The read hold ends where the write hold had to: `max_hold` counts from the write's grant.
    let options = LockOptions::default()
        .with_lease(holding.lease_ttl)
        .with_max_hold(holding.max_hold_end.map(|end| {
            end.saturating_duration_since(sent_at)
                .max(Duration::from_millis(1))
        }));
    let request = AcquireRequest::new(
        reader.name.to_string(),
        reader.owner.to_string(),
        options.first_ttl(),
    )
    .with_kind(LockKind::Read);
    match locks.backend.downgrade(&holding.lease, &request).await {
        Ok(mut grant) => {
            grant.token = grant.token.or(holding.token);
            holding.end_downgraded();
            Ok(crate::locks::install(
                reader,
                grant,
                sent_at,
                options,
                Some(read_gate),
            ))
        }
        Err(error) => {
            holding.mark_lost(format!(
                "the downgrade to a read lock was not confirmed, so the write lock may be gone: {error}"
            ));
            drop(read_gate);
            Err(error)
        }
    }
}

/// Restarts an interrupted release in the background.
struct RestartOnDrop(Option<Arc<Holding>>);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        if let Some(holding) = self.0.take() {
            holding.finish_in_background("release restarted after cancellation failed");
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(holding) = self.leave() {
            holding.finish_in_background("release after drop failed");
        }
    }
}

/// Waits for a backend's loss signal until the hold ends. If its runtime is dropped while the hold
/// lives (a `Locks` used from several runtimes), the signal would be dropped with the task and a later
/// loss never reported: the signal is handed to distlock's background runtime instead (see
/// [`crate::locks::spawn`]). Backends' signals stay pending, never resolve, when what feeds them is gone,
/// so moving one never reports a false loss.
struct LossWatch {
    loss: Option<LossFuture>,
    holding: Weak<Holding>,
}

impl LossWatch {
    /// The signal resolved or the hold ended: nothing to hand on when dropped.
    fn finished(&mut self) {
        self.loss = None;
    }

    fn start(runtime: Option<&tokio::runtime::Handle>, holding: Weak<Holding>, loss: LossFuture) {
        let Some(changes) = holding.upgrade().map(|h| h.subscribe()) else {
            return;
        };
        let mut watch = LossWatch {
            loss: Some(loss),
            holding,
        };
        crate::locks::spawn(runtime, async move {
            let mut changes = changes;
            let Some(loss) = watch.loss.as_mut() else {
                return;
            };
            tokio::select! {
                reason = loss => {
                    watch.finished();
                    if let Some(holding) = watch.holding.upgrade() {
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
                } => watch.finished(),
            }
        });
    }
}

impl Drop for LossWatch {
    fn drop(&mut self) {
        let Some(loss) = self.loss.take() else {
            return;
        };
        // Dropped unfinished: the runtime went away. Keep watching while the hold is still on.
        if self
            .holding
            .upgrade()
            .is_some_and(|h| h.watched(clock::now()))
        {
            tracing::debug!(
                "a loss signal's runtime was dropped; watching it on the background runtime"
            );
            LossWatch::start(None, self.holding.clone(), loss);
        }
    }
}
