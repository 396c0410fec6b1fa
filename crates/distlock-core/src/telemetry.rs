//! What distlock tells an operator: metrics through the [`metrics`] facade and the `tracing` spans and
//! events of acquires and holds. Every metric name and label is here, in one place.
//!
//! Nothing is recorded unless the application installs a `metrics` recorder; the handles are made once
//! per `Locks` and lock kind (per `Lock` with name labels), so the hot path costs a few atomic adds with
//! a recorder and nothing but a branch without one. A recorder installed after a `Locks` was made does
//! not see that `Locks`'s locks: handles registered before it exists are no-ops, as `metrics` documents.
//!
//! The series, their labels and the spans are listed for users in the `distlock` crate's docs
//! ("Metrics and traces"); keep that table in step with this file.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Label};

use crate::error::ErrorKind;
use crate::kinds::LockKind;

const ACQUISITIONS: &str = "distlock_acquisitions_total";
const ACQUIRE_WAIT: &str = "distlock_acquire_wait_seconds";
const WAITERS: &str = "distlock_waiters";
const HOLDS: &str = "distlock_holds";
const HOLD_TIME: &str = "distlock_hold_seconds";
const RENEWALS: &str = "distlock_renewals_total";
const RENEWAL_TIME: &str = "distlock_renewal_seconds";
const JEOPARDY: &str = "distlock_jeopardy_total";
const LOST: &str = "distlock_lost_total";
const ERRORS: &str = "distlock_errors_total";

/// How one acquire call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcquireOutcome {
    Acquired,
    /// `Ok(None)`: held elsewhere for the whole wait (a try, or a wait limit that ran out).
    Busy,
    Error,
    /// The acquire future was dropped before it finished.
    Cancelled,
}

impl AcquireOutcome {
    const ALL: [AcquireOutcome; 4] = [
        AcquireOutcome::Acquired,
        AcquireOutcome::Busy,
        AcquireOutcome::Error,
        AcquireOutcome::Cancelled,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AcquireOutcome::Acquired => "acquired",
            AcquireOutcome::Busy => "busy",
            AcquireOutcome::Error => "error",
            AcquireOutcome::Cancelled => "cancelled",
        }
    }
}

/// Why a hold was lost: a bounded label (the reason's text goes to the trace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LossCause {
    /// The validity deadline passed without a confirmed renewal.
    Expired,
    /// `max_hold` was reached.
    MaxHold,
    /// A renewal found the key gone or another owner's.
    Gone,
    /// The engine said so (a session or lease ended, a watch saw the key go, a downgrade failed).
    Reported,
}

impl LossCause {
    const ALL: [LossCause; 4] = [
        LossCause::Expired,
        LossCause::MaxHold,
        LossCause::Gone,
        LossCause::Reported,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LossCause::Expired => "expired",
            LossCause::MaxHold => "max_hold",
            LossCause::Gone => "gone",
            LossCause::Reported => "reported",
        }
    }
}

/// How a renewal ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenewalOutcome {
    Extended,
    Gone,
    Failed,
}

/// The operation an error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Acquire,
    Release,
    Renew,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Release => "release",
            Op::Renew => "renew",
        }
    }
}

/// A label value for an error kind: [`ErrorKind::as_str`] in snake case.
fn error_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Timeout => "timeout",
        ErrorKind::LockLost => "lock_lost",
        ErrorKind::NotHeld => "not_held",
        ErrorKind::Unavailable => "unavailable",
        ErrorKind::InsufficientReplicas { .. } => "insufficient_replicas",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::InvalidConfig => "invalid_config",
        ErrorKind::InvalidName => "invalid_name",
        ErrorKind::PermissionDenied => "permission_denied",
        ErrorKind::Protocol => "protocol",
        ErrorKind::WouldDeadlock => "would_deadlock",
        ErrorKind::LimitMismatch { .. } => "limit_mismatch",
        ErrorKind::KindConflict => "kind_conflict",
    }
}

/// The metric handles of the locks of one engine, kind and (with name labels) name.
pub(crate) struct LockMetrics {
    labels: Vec<Label>,
    acquisitions: [Counter; 4],
    acquire_wait: [Histogram; 4],
    waiters: Gauge,
    held: Gauge,
    in_jeopardy: Gauge,
    hold_released: Histogram,
    hold_lost: Histogram,
    renewals_extended: Counter,
    renewals_gone: Counter,
    renewals_failed: Counter,
    renewal_time: Histogram,
    jeopardy: Counter,
    lost: [Counter; 4],
    /// `distlock_errors_total` by operation and error, registered at each pair's first error (most
    /// never happen; 3 × 13 handles made up front would be the largest part of this).
    errors: std::sync::Mutex<Vec<(Op, &'static str, Counter)>>,
}

impl LockMetrics {
    fn new(engine: &'static str, kind: LockKind, name: Option<&str>) -> Self {
        let mut labels = vec![
            Label::from_static_parts("engine", engine),
            Label::from_static_parts("kind", kind.as_str()),
        ];
        if let Some(name) = name {
            labels.push(Label::new("name", name.to_string()));
        }
        let with = |key: &'static str, value: &'static str| {
            let mut all = labels.clone();
            all.push(Label::from_static_parts(key, value));
            all
        };
        Self {
            acquisitions: AcquireOutcome::ALL
                .map(|o| metrics::counter!(ACQUISITIONS, with("outcome", o.as_str()))),
            acquire_wait: AcquireOutcome::ALL
                .map(|o| metrics::histogram!(ACQUIRE_WAIT, with("outcome", o.as_str()))),
            waiters: metrics::gauge!(WAITERS, labels.clone()),
            held: metrics::gauge!(HOLDS, with("state", "held")),
            in_jeopardy: metrics::gauge!(HOLDS, with("state", "jeopardy")),
            hold_released: metrics::histogram!(HOLD_TIME, with("end", "released")),
            hold_lost: metrics::histogram!(HOLD_TIME, with("end", "lost")),
            renewals_extended: metrics::counter!(RENEWALS, with("outcome", "extended")),
            renewals_gone: metrics::counter!(RENEWALS, with("outcome", "gone")),
            renewals_failed: metrics::counter!(RENEWALS, with("outcome", "failed")),
            renewal_time: metrics::histogram!(RENEWAL_TIME, labels.clone()),
            jeopardy: metrics::counter!(JEOPARDY, labels.clone()),
            lost: LossCause::ALL.map(|c| metrics::counter!(LOST, with("reason", c.as_str()))),
            errors: std::sync::Mutex::default(),
            labels,
        }
    }

    pub(crate) fn acquired(&self, outcome: AcquireOutcome, waited: Duration) {
        let at = outcome as usize;
        self.acquisitions[at].increment(1);
        self.acquire_wait[at].record(waited.as_secs_f64());
    }

    /// An error, counted by operation and kind (each pair's handle made at its first error).
    pub(crate) fn error(&self, op: Op, kind: ErrorKind) {
        let error = error_label(kind);
        let mut errors = crate::sync::lock(&self.errors);
        if let Some((_, _, counter)) = errors.iter().find(|(o, e, _)| *o == op && *e == error) {
            counter.increment(1);
            return;
        }
        let mut labels = self.labels.clone();
        labels.push(Label::from_static_parts("op", op.as_str()));
        labels.push(Label::from_static_parts("error", error));
        let counter = metrics::counter!(ERRORS, labels);
        counter.increment(1);
        errors.push((op, error, counter));
    }

    pub(crate) fn hold_started(&self) {
        self.held.increment(1.0);
    }

    /// A hold ended (released, or lost: `cause`), in Jeopardy or not, after `held_for`.
    pub(crate) fn hold_ended(
        &self,
        in_jeopardy: bool,
        cause: Option<LossCause>,
        held_for: Duration,
    ) {
        if in_jeopardy {
            self.in_jeopardy.decrement(1.0);
        } else {
            self.held.decrement(1.0);
        }
        match cause {
            Some(cause) => {
                self.lost[cause as usize].increment(1);
                self.hold_lost.record(held_for.as_secs_f64());
            }
            None => self.hold_released.record(held_for.as_secs_f64()),
        }
    }

    /// A hold went into Jeopardy (`true`) or recovered from it.
    pub(crate) fn jeopardy(&self, entered: bool) {
        if entered {
            self.jeopardy.increment(1);
            self.held.decrement(1.0);
            self.in_jeopardy.increment(1.0);
        } else {
            self.in_jeopardy.decrement(1.0);
            self.held.increment(1.0);
        }
    }

    /// A renewal's outcome, and its round trip when it was answered.
    pub(crate) fn renewal(&self, outcome: RenewalOutcome, round_trip: Option<Duration>) {
        match outcome {
            RenewalOutcome::Extended => self.renewals_extended.increment(1),
            RenewalOutcome::Gone => self.renewals_gone.increment(1),
            RenewalOutcome::Failed => self.renewals_failed.increment(1),
        }
        if let Some(round_trip) = round_trip {
            self.renewal_time.record(round_trip.as_secs_f64());
        }
    }

    /// Counts an acquire as waiting until the mark is dropped.
    pub(crate) fn waiting(self: &Arc<Self>) -> WaitingMark {
        self.waiters.increment(1.0);
        WaitingMark(self.clone())
    }
}

/// An acquire counted in `distlock_waiters` (see [`LockMetrics::waiting`]).
pub(crate) struct WaitingMark(Arc<LockMetrics>);

impl Drop for WaitingMark {
    fn drop(&mut self) {
        self.0.waiters.decrement(1.0);
    }
}

/// The telemetry settings and handles of one `Locks`.
#[derive(Default)]
pub(crate) struct Telemetry {
    name_labels: std::sync::atomic::AtomicBool,
    /// Without name labels, one set per kind (mutex, read, write, permit), made at first use.
    by_kind: [OnceLock<Arc<LockMetrics>>; 4],
    /// With name labels, one set per kind and name while a `Lock` of it lives: `lock(name)?.acquire()`
    /// in a loop, or a semaphore's acquires (a `Lock` each), reuse it.
    by_name: std::sync::Mutex<Named>,
}

/// See [`Telemetry::by_name`]; pruned as the local gates' map is (amortised O(1)).
#[derive(Default)]
struct Named {
    sets: std::collections::HashMap<(usize, Arc<str>), std::sync::Weak<LockMetrics>>,
    prune_at: usize,
}

impl Telemetry {
    pub(crate) fn set_name_labels(&self, on: bool) {
        self.name_labels
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The handles for a new `Lock` of `name` and `kind`.
    pub(crate) fn for_lock(
        &self,
        engine: &'static str,
        kind: LockKind,
        name: &Arc<str>,
    ) -> Arc<LockMetrics> {
        describe();
        let at = match kind {
            LockKind::Mutex => 0,
            LockKind::Read => 1,
            LockKind::Write => 2,
            LockKind::Permit { .. } => 3,
        };
        if !self.name_labels.load(std::sync::atomic::Ordering::Relaxed) {
            return self.by_kind[at]
                .get_or_init(|| Arc::new(LockMetrics::new(engine, kind, None)))
                .clone();
        }
        let mut named = crate::sync::lock(&self.by_name);
        let key = (at, name.clone());
        if let Some(set) = named.sets.get(&key).and_then(std::sync::Weak::upgrade) {
            return set;
        }
        if named.sets.len() >= named.prune_at {
            named.sets.retain(|_, set| set.strong_count() > 0);
            named.prune_at = (named.sets.len() * 2).max(64);
        }
        let set = Arc::new(LockMetrics::new(engine, kind, Some(name)));
        named.sets.insert(key, Arc::downgrade(&set));
        set
    }
}

/// The metrics' units and help texts, given to the recorder once per process.
fn describe() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
        describe_counter!(ACQUISITIONS, "Acquire calls by outcome");
        describe_histogram!(
            ACQUIRE_WAIT,
            Unit::Seconds,
            "How long acquire calls took, by outcome"
        );
        describe_gauge!(
            WAITERS,
            "Acquires of this process waiting now for a lock held here or elsewhere"
        );
        describe_gauge!(HOLDS, "Locks this process holds now, by state");
        describe_histogram!(
            HOLD_TIME,
            Unit::Seconds,
            "How long holds lasted, from grant to release or loss"
        );
        describe_counter!(RENEWALS, "Lease renewals by outcome");
        describe_histogram!(
            RENEWAL_TIME,
            Unit::Seconds,
            "Round trip of answered lease renewals"
        );
        describe_counter!(JEOPARDY, "Holds that went into Jeopardy");
        describe_counter!(LOST, "Holds lost, by reason");
        describe_counter!(ERRORS, "Errors by operation and kind");
    });
}
