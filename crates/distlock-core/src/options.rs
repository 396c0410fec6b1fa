//! Lock options and their defaults.

use std::time::Duration;

use crate::duration;
use crate::error::{Error, ErrorKind, Result};

/// The default lease: Redisson's watchdog timeout.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The shortest lease accepted. Renewals run every third of the lease, so shorter leases would spend
/// more time renewing than holding.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(100);

/// How long an acquire may wait for a lock held elsewhere.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{LockOptions, Wait};
///
/// // Every lock of a `Locks` waits at most 5 s unless an acquire says otherwise.
/// let defaults = LockOptions::default().with_wait(Wait::Limit(Duration::from_secs(5)));
/// assert_eq!(defaults.wait, Wait::Limit(Duration::from_secs(5)));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Until the lock is acquired (or the future is dropped).
    Forever,
    /// At most this long, then [`ErrorKind::Timeout`]. Zero means one attempt.
    Limit(Duration),
}

/// Options of one acquire: how long to wait, the lease on the server, and a cap on the whole hold.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{LockOptions, Locks, MemoryBackend, Wait};
///
/// // Defaults for every lock of one `Locks`: a 10 s lease, a 2 s wait, never held over an hour.
/// let defaults = LockOptions::default()
///     .with_lease(Duration::from_secs(10))
///     .with_wait(Wait::Limit(Duration::from_secs(2)))
///     .with_max_hold(Some(Duration::from_secs(3600)));
/// defaults.validate()?; // a zero or too-short lease is refused before any I/O
/// let locks = Locks::with_defaults(MemoryBackend::new(), defaults);
/// assert_eq!(locks.defaults().lease, Duration::from_secs(10));
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockOptions {
    /// How long an acquire may wait.
    pub wait: Wait,
    /// The time-to-live on the server; the watchdog renews it every third while a guard lives.
    pub lease: Duration,
    /// Cap on the total hold: renewals stop asking beyond it and the guard becomes Lost when reached.
    pub max_hold: Option<Duration>,
}

impl Default for LockOptions {
    fn default() -> Self {
        Self {
            wait: Wait::Forever,
            lease: DEFAULT_LEASE,
            max_hold: None,
        }
    }
}

impl LockOptions {
    /// Sets the wait limit.
    pub fn with_wait(mut self, wait: Wait) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the lease.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the cap on the total hold.
    pub fn with_max_hold(mut self, max_hold: Option<Duration>) -> Self {
        self.max_hold = max_hold;
        self
    }

    /// Rejects values no lock can work with, naming the allowed range.
    pub fn validate(&self) -> Result<()> {
        if self.lease < MIN_LEASE {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "lease {} is too short: it must be at least {}",
                    duration::format(self.lease),
                    duration::format(MIN_LEASE)
                ),
            ));
        }
        if let Some(max_hold) = self.max_hold {
            if max_hold.is_zero() {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    "max_hold must be longer than zero",
                ));
            }
        }
        Ok(())
    }

    /// The lease the first request asks for: the lease, capped by `max_hold`.
    pub(crate) fn first_ttl(&self) -> Duration {
        match self.max_hold {
            Some(cap) => self.lease.min(cap),
            None => self.lease,
        }
    }
}
