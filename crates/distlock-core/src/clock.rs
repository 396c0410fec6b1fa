//! The clock validity deadlines are computed on.
//!
//! For backend crates: a backend that computes a validity deadline itself (etcd's session expiry) uses
//! the same clock as the core.
//!
//! `CLOCK_BOOTTIME` keeps counting while the machine is suspended (`CLOCK_MONOTONIC`, behind
//! `std::time::Instant` and tokio's timers, does not), so a deadline is never believed to be further
//! away than it is after a suspend. Both keep counting through SIGSTOP.
//!
//! Timers whose firing decides a loss or an expiry sleep on this clock too ([`sleep_until`], [`Sleep`]):
//! a tokio timer armed for a deadline fires as much later as the machine was suspended in between.

use std::collections::{btree_map, BTreeMap};
use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rustix::time::{
    clock_gettime, clock_gettime_dynamic, timerfd_create, timerfd_settime, ClockId, DynamicClockId,
    Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec,
};

use crate::sync::lock;

/// The furthest a converted instant lies ahead (about 30 years): further ones cannot be represented.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// A point on the boot clock.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::clock;
///
/// // A validity deadline: counted from before the request went out, on a clock that a suspend
/// // does not stop.
/// let sent = clock::now();
/// let validity_deadline = sent + Duration::from_secs(30);
/// assert!(validity_deadline.remaining() <= Duration::from_secs(30));
/// assert!(validity_deadline > sent);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(Duration);

/// Now, on the boot clock.
pub fn now() -> Instant {
    let ts = clock_gettime_dynamic(DynamicClockId::Boottime)
        .unwrap_or_else(|_| clock_gettime(ClockId::Monotonic));
    Instant(
        Duration::new(
            ts.tv_sec.max(0) as u64,
            ts.tv_nsec.clamp(0, 999_999_999) as u32,
        )
        .saturating_add(offset()),
    )
}

/// How far a simulated suspend moved the clock on ([`testing::suspend`]).
#[cfg(feature = "testing")]
fn offset() -> Duration {
    Duration::from_nanos(testing::OFFSET_NANOS.load(std::sync::atomic::Ordering::SeqCst))
}

#[cfg(not(feature = "testing"))]
fn offset() -> Duration {
    Duration::ZERO
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

    /// Whole milliseconds since the boot clock's zero: a moment in 8 bytes where millisecond precision
    /// does (a hold's start, for its duration in the metrics).
    pub(crate) fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
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

/// Sleeps until `deadline` on the boot clock: wakes at that moment even if the machine was suspended
/// in between (a tokio timer, on `CLOCK_MONOTONIC`, would fire as much later as the suspend lasted).
///
/// Every timer whose firing decides a loss or an expiry sleeps on this. It works from any tokio runtime
/// (and outside one, see [`Sleep`]) and survives the runtime it was first polled on being dropped.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        entry: None,
        fallback: None,
    }
}

/// Sleeps `duration` on the boot clock ([`sleep_until`] `now() + duration`).
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(now().saturating_add(duration))
}

/// A boot-clock sleep ([`sleep_until`]): resolves once [`now`] reaches its deadline; resettable.
///
/// All sleeps of a process share one timer: a `timerfd` on `CLOCK_BOOTTIME` armed (absolute) for the
/// earliest deadline, read by one thread that wakes the sleepers whose deadline has come, in deadline
/// order. A pending sleep costs an entry in an ordered map (no task, thread or descriptor of its own, and
/// no wake-up before its deadline). Where no timerfd can be made (a kernel before 3.15, a sandbox that
/// forbids it), sleeps fall back to tokio timers (which then need a runtime with time enabled) and
/// re-check the boot clock when they fire: late after a suspend, as every timer was before.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::clock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut expiry = clock::sleep(Duration::from_secs(3600));
/// // A renewal moved the expiry closer (or further): the same sleep, reset.
/// let deadline = clock::now() + Duration::from_millis(5);
/// expiry.reset(deadline);
/// expiry.await;
/// assert!(clock::now() >= deadline);
/// # }
/// ```
#[derive(Debug)]
pub struct Sleep {
    deadline: Instant,
    /// The key of this sleep in the shared timer, while registered.
    entry: Option<u64>,
    fallback: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Sleep {
    /// The deadline it sleeps until.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Sleeps until `deadline` instead (earlier or later); it takes effect at the next poll.
    pub fn reset(&mut self, deadline: Instant) {
        if deadline != self.deadline {
            self.unregister();
            self.fallback = None;
            self.deadline = deadline;
        }
    }

    /// Whether the deadline has come (without waiting).
    pub fn is_elapsed(&self) -> bool {
        now() >= self.deadline
    }

    fn unregister(&mut self) {
        if let Some(id) = self.entry.take() {
            if let Some(timer) = timer() {
                timer.remove(self.deadline, id);
            }
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.unregister();
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        loop {
            if now() >= this.deadline {
                this.unregister();
                this.fallback = None;
                return Poll::Ready(());
            }
            if let Some(timer) = timer() {
                // Registered after the check above: if the deadline passes in between, the timer is
                // armed for a moment already past and fires at once.
                timer.register(this.deadline, &mut this.entry, cx.waker());
                return Poll::Pending;
            }
            let deadline = this.deadline;
            let fallback = this
                .fallback
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.to_tokio())));
            match fallback.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                // The monotonic clock never runs ahead of the boot clock; a rounding left over is
                // slept again.
                Poll::Ready(()) => this.fallback = None,
            }
        }
    }
}

/// The process's one boot-clock timer.
struct Timer {
    fd: OwnedFd,
    state: Mutex<TimerState>,
}

/// The ids of sleeps, unique in the process and its forked children: a sleep registered with the
/// parent's timer and polled again in a child keeps its id, and must not take a child's sleep's entry.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
struct TimerState {
    /// Pending sleeps by (deadline, id): the earliest first.
    sleepers: BTreeMap<(Instant, u64), Waker>,
    /// The deadline the timerfd is armed for (on [`now`]'s scale), `None` if disarmed or already fired.
    armed: Option<Instant>,
}

/// How many forks without exec lie between this process and the one that first registered
/// [`forked_child`]: bumped in each child as it is forked (the parent's count stays).
static FORK_DEPTH: AtomicUsize = AtomicUsize::new(0);

/// Runs in a child right after `fork`, before `fork` returns there (`pthread_atfork`): only an atomic
/// add, which is async-signal-safe.
extern "C" fn forked_child() {
    FORK_DEPTH.fetch_add(1, Ordering::SeqCst);
}

/// The deepest fork a timer is made for; a process forked deeper sleeps on tokio timers.
const MAX_FORK_DEPTH: usize = 16;

/// This process's timer, started at its first sleep; `None` where no timerfd or thread can be made.
///
/// One per fork depth: a child forked without exec inherits its parent's record of the timer and the
/// descriptor, but not the thread that reads it, and the descriptor still names the parent's timer (a
/// fork shares open file descriptions): a child that armed it would move the parent's wake-up (its
/// earlier sleepers then woke at the child's moment), and the child's own sleeps would never wake (a
/// watchdog that never renews, a `lost()` that never resolves). So a child (its depth bumped by
/// [`forked_child`]) starts a timer of its own, in a slot its parent never used, and never touches the
/// parent's (whose state lock may have been held by a thread that is not in the child). Siblings share
/// a depth but not memory. One atomic load per call: a `getpid` took about 1 µs here.
fn timer() -> Option<&'static Timer> {
    static TIMERS: [OnceLock<Option<&'static Timer>>; MAX_FORK_DEPTH] =
        [const { OnceLock::new() }; MAX_FORK_DEPTH];
    static AT_FORK: Once = Once::new();
    // Registered before the first timer is started (inherited by every child forked after it). A
    // process whose ancestors never registered it started no timer before forking, so its depth-0
    // slot is unused in the child too.
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only adds to an atomic (async-signal-safe) in the child;
        // no prepare or parent handler.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if registered != 0 {
            tracing::warn!(
                error = registered,
                "could not register the boot-clock timer's fork handler: a child forked without exec \
                 would sleep on its parent's timer"
            );
        }
    });
    // Deeper than the slots: tokio timers (see `Sleep`).
    let slot = TIMERS.get(FORK_DEPTH.load(Ordering::SeqCst))?;
    *slot.get_or_init(|| match Timer::start() {
        Ok(timer) => Some(timer),
        Err(e) => {
            tracing::warn!(
                error = %e,
                "no boot-clock timer (timerfd on CLOCK_BOOTTIME): timers fall back to tokio's clock, \
                 which stops while the machine is suspended"
            );
            None
        }
    })
}

impl Timer {
    fn start() -> std::io::Result<&'static Timer> {
        let fd = timerfd_create(TimerfdClockId::Boottime, TimerfdFlags::CLOEXEC)?;
        // Leaked: it lives as long as the process (its thread reads it for ever).
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            fd,
            state: Mutex::new(TimerState::default()),
        }));
        std::thread::Builder::new()
            .name("distlock-clock".into())
            .spawn(move || timer.run())?;
        Ok(timer)
    }

    fn register(&self, deadline: Instant, entry: &mut Option<u64>, waker: &Waker) {
        let mut state = lock(&self.state);
        let id = match *entry {
            Some(id) => id,
            None => NEXT_ID.fetch_add(1, Ordering::Relaxed) + 1,
        };
        match state.sleepers.entry((deadline, id)) {
            btree_map::Entry::Occupied(mut slot) => {
                if !slot.get().will_wake(waker) {
                    slot.insert(waker.clone());
                }
            }
            btree_map::Entry::Vacant(slot) => {
                slot.insert(waker.clone());
            }
        }
        *entry = Some(id);
        if state.armed.is_none_or(|armed| deadline < armed) {
            self.arm(&mut state, deadline);
        }
    }

    fn remove(&self, deadline: Instant, id: u64) {
        lock(&self.state).sleepers.remove(&(deadline, id));
    }

    /// Arms the timerfd for `deadline` (absolute, so time spent suspended counts); a moment already past
    /// fires at once. Called under the state lock, so `armed` is what the timerfd holds.
    fn arm(&self, state: &mut TimerState, deadline: Instant) {
        // The timerfd counts on the real boot clock, without a simulated suspend's offset.
        let real = deadline
            .0
            .saturating_sub(offset())
            .max(Duration::from_nanos(1));
        let value = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: i64::try_from(real.as_secs()).unwrap_or(i64::MAX),
                tv_nsec: i64::from(real.subsec_nanos()),
            },
        };
        match timerfd_settime(&self.fd, TimerfdTimerFlags::ABSTIME, &value) {
            Ok(_) => state.armed = Some(deadline),
            // Not expected (the values are valid): the sleepers wait for the next arm or firing.
            Err(e) => tracing::error!(error = %e, "could not arm the boot-clock timer"),
        }
    }

    /// Fires the timer at once, so every sleeper is checked against the clock again.
    #[cfg(feature = "testing")]
    fn fire_now(&self) {
        let mut state = lock(&self.state);
        self.arm(&mut state, Instant(Duration::ZERO));
    }

    fn run(&self) {
        let mut expirations = [0u8; 8];
        loop {
            // Blocks until the armed moment; re-arming meanwhile (an earlier sleeper) moves it.
            match rustix::io::read(&self.fd, &mut expirations) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    // Not expected; the sleepers are still checked, a second apart at worst.
                    tracing::error!(error = %e, "could not read the boot-clock timer");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let due: Vec<Waker> = {
                let mut state = lock(&self.state);
                let now = now();
                let mut due = Vec::new();
                while let Some(entry) = state.sleepers.first_entry() {
                    if entry.key().0 > now {
                        break;
                    }
                    due.push(entry.remove());
                }
                state.armed = None;
                // With nothing pending the timer stays disarmed: the next sleeper arms it.
                if let Some(next) = state.sleepers.keys().next().map(|(at, _)| *at) {
                    self.arm(&mut state, next);
                }
                due
            };
            for waker in due {
                waker.wake();
            }
        }
    }
}

/// A simulated suspend, for tests (cargo feature `testing`).
#[cfg(feature = "testing")]
pub mod testing {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    pub(super) static OFFSET_NANOS: AtomicU64 = AtomicU64::new(0);

    /// Moves this process's boot clock ([`now`](super::now)) on by `duration` and fires the shared
    /// timer, as a resume after a suspend of `duration` would: boot-clock deadlines in between have
    /// passed, while tokio's clock (and `std::time::Instant`) did not move. Process-wide and never undone:
    /// a test that calls it runs in a process of its own (nextest runs every test so).
    pub fn suspend(duration: Duration) {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        OFFSET_NANOS
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |o| {
                Some(o.saturating_add(nanos))
            })
            .ok();
        if let Some(timer) = super::timer() {
            timer.fire_now();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn pending_sleepers() -> usize {
        lock(&timer().expect("a boot-clock timer").state)
            .sleepers
            .len()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sleeps_wake_at_their_deadlines_earliest_first() {
        let start = now();
        let tasks: Vec<_> = (0..40u64)
            .map(|i| {
                // Registered out of order.
                let deadline = start + Duration::from_millis(20 + (i * 37) % 200);
                tokio::spawn(async move {
                    sleep_until(deadline).await;
                    let woke = now();
                    assert!(woke >= deadline, "woke before its deadline");
                    (deadline, woke)
                })
            })
            .collect();
        for task in tasks {
            let (deadline, woke) = tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .expect("every sleep wakes")
                .unwrap();
            assert!(woke.saturating_duration_since(deadline) < Duration::from_secs(2));
        }
        assert_eq!(pending_sleepers(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_or_reset_sleep_leaves_no_entry() {
        let mut far = sleep(Duration::from_secs(3600));
        assert!(futures_util::poll!(&mut far).is_pending());
        assert_eq!(pending_sleepers(), 1);
        far.reset(now() + Duration::from_millis(20));
        assert_eq!(pending_sleepers(), 0, "the reset took the old entry out");
        tokio::time::timeout(Duration::from_secs(5), &mut far)
            .await
            .expect("a reset to an earlier deadline wakes then");
        let mut dropped = sleep(Duration::from_secs(3600));
        assert!(futures_util::poll!(&mut dropped).is_pending());
        drop(dropped);
        assert_eq!(pending_sleepers(), 0);
    }

    #[test]
    fn a_sleep_outlives_the_runtime_it_was_first_polled_on() {
        let mut nap = sleep(Duration::from_millis(200));
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        first.block_on(async {
            assert!(futures_util::poll!(&mut nap).is_pending());
        });
        drop(first);
        let second = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), &mut nap)
                .await
                .expect("woken on the second runtime");
        });
        // No runtime at all: a plain executor.
        futures_util::future::FutureExt::now_or_never(sleep(Duration::ZERO)).expect("ready");
    }

    #[cfg(feature = "testing")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_simulated_suspend_wakes_the_sleeps_it_passed_at_once() {
        let passed = tokio::spawn(sleep(Duration::from_secs(3600)));
        let mut not_passed = sleep(Duration::from_secs(7200));
        assert!(futures_util::poll!(&mut not_passed).is_pending());
        tokio::time::sleep(Duration::from_millis(50)).await;
        testing::suspend(Duration::from_secs(3601));
        tokio::time::timeout(Duration::from_secs(5), passed)
            .await
            .expect("an hour-long sleep wakes at the resume")
            .unwrap();
        assert!(futures_util::poll!(&mut not_passed).is_pending());
        assert!(!not_passed.is_elapsed());
    }
}
