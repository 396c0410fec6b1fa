//! The clock validity deadlines are computed on.
//!
//! For backend crates: a backend that computes a validity deadline itself (etcd's session expiry) uses
//! the same clock as the core.
//!
//! `CLOCK_BOOTTIME` keeps counting while the machine is suspended (`CLOCK_MONOTONIC`, behind
//! `std::time::Instant`, does not), so a deadline is never believed to be further away than it is after
//! a suspend. Both keep counting through SIGSTOP.

use std::time::Duration;

use rustix::time::{clock_gettime, clock_gettime_dynamic, ClockId, DynamicClockId};

/// The furthest a converted instant lies ahead (about 30 years): further ones cannot be represented.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// A point on the boot clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(Duration);

/// Now, on the boot clock.
pub fn now() -> Instant {
    let ts = clock_gettime_dynamic(DynamicClockId::Boottime)
        .unwrap_or_else(|_| clock_gettime(ClockId::Monotonic));
    Instant(Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    ))
}

impl std::ops::Add<Duration> for Instant {
    type Output = Instant;
    /// [`saturating_add`](Instant::saturating_add).
    fn add(self, d: Duration) -> Instant {
        self.saturating_add(d)
    }
}

impl std::ops::Sub<Duration> for Instant {
    type Output = Instant;
    /// [`saturating_sub`](Instant::saturating_sub).
    fn sub(self, d: Duration) -> Instant {
        self.saturating_sub(d)
    }
}

impl Instant {
    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(d))
    }

    /// `self - d`, saturating at zero.
    pub fn saturating_sub(self, d: Duration) -> Instant {
        Instant(self.0.saturating_sub(d))
    }

    /// The time left until `self`, zero if it has passed.
    pub fn remaining(self) -> Duration {
        self.saturating_duration_since(now())
    }

    /// The same moment as a tokio instant, for arming timers; saturates about 30 years from now (a
    /// lease of `Duration::MAX`).
    pub fn to_tokio(self) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        now.checked_add(self.remaining().min(FAR_FUTURE))
            .unwrap_or(now)
    }

    /// The same moment as a std instant (monotonic clock), for callers; saturates as
    /// [`to_tokio`](Self::to_tokio) does.
    pub fn to_std(self) -> std::time::Instant {
        let now = std::time::Instant::now();
        now.checked_add(self.remaining().min(FAR_FUTURE))
            .unwrap_or(now)
    }
}
