//! One inotify instance per backend, shared by every waiter and every held lock of it.
//!
//! Why shared: Linux allows a user only 128 inotify instances by default
//! (`fs.inotify.max_user_instances`), while watches are plentiful; one instance per waiter would run out
//! with a few hundred concurrent acquires. A reader task on the runtime reads the events and bumps a
//! counter per watched file; subscribers wait for the counter to change.
//!
//! Every subscriber uses the same mask ([`MASK`]), because a second `inotify_add_watch` of one inode
//! replaces the first one's mask. Events are wake-ups, not facts: a woken waiter tries the lock, a woken
//! holder re-checks that its lock file is still in place.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::io::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, watch};

/// What wakes a subscriber:
/// * `CLOSE_WRITE`: a descriptor opened for writing was closed: a release (distlock unlocks, then
///   closes), or a holding process that died (the kernel closes its descriptors);
/// * `CLOSE_NOWRITE`: a read-only descriptor was closed: `status` probing the lock with a shared
///   `flock`, which could have made a try fail, or another tool (`flock(1)` opens read-only) releasing;
/// * `ATTRIB`, `MOVE_SELF`, `DELETE_SELF`: the file was unlinked (its link count changed), renamed or
///   deleted, so waiters must reopen the path and holders may have lost the lock.
pub(crate) const MASK: WatchFlags = WatchFlags::CLOSE_WRITE
    .union(WatchFlags::CLOSE_NOWRITE)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::DELETE_SELF);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps behind these mutexes stay consistent even if a holder panicked.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The backend's handle: starts the shared instance on first use and restarts it if its runtime went.
#[derive(Debug, Default)]
pub(crate) struct Notifier {
    current: Mutex<Option<Arc<Shared>>>,
    /// Set when the runtime cannot drive inotify at all; then waiters poll, and no retry is made.
    disabled: AtomicBool,
}

/// A live inotify instance and its watches. Dropping the last handle stops the reader task.
pub(crate) struct Shared {
    fd: Arc<OwnedFd>,
    watches: Mutex<HashMap<i32, Entry>>,
    alive: AtomicBool,
    /// Dropped with the last handle, which ends the reader task (and closes the instance).
    _stop: oneshot::Sender<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("fd", &self.fd.as_raw_fd())
            .field("watches", &lock(&self.watches).len())
            .field("alive", &self.alive.load(Ordering::Relaxed))
            .finish()
    }
}

struct Entry {
    refs: usize,
    events: watch::Sender<u64>,
}

impl Notifier {
    /// The live instance, started on the current runtime if there is none. `None` if inotify cannot be
    /// used (no runtime, or the per-user instance limit is reached): waiters then only poll.
    pub(crate) fn instance(&self) -> Option<Arc<Shared>> {
        if self.disabled.load(Ordering::Relaxed) {
            return None;
        }
        let mut current = lock(&self.current);
        if let Some(shared) = current.as_ref().filter(|s| s.alive.load(Ordering::Acquire)) {
            return Some(shared.clone());
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let fd = match inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK) {
            Ok(fd) => Arc::new(fd),
            Err(e) => {
                tracing::warn!(error = %e, "inotify is unavailable; waiters for file locks will poll");
                return None;
            }
        };
        let (stop_tx, stop_rx) = oneshot::channel();
        let shared = Arc::new(Shared {
            fd: fd.clone(),
            watches: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            _stop: stop_tx,
        });
        // The AsyncFd is registered with the reactor here, inside the runtime. tokio panics instead of
        // failing when the runtime was built without I/O; that must not take the acquire down with it.
        let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `SharedFd` owns an `Arc` of the descriptor, so it stays open, and the same, for
            // as long as the `AsyncFd` lives.
            unsafe { AsyncFd::register_with_interest(SharedFd(fd), Interest::READABLE) }
        }));
        let afd = match registered {
            Ok(Ok(afd)) => afd,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot register inotify with the runtime; waiters will poll");
                self.disabled.store(true, Ordering::Relaxed);
                return None;
            }
            Err(_) => {
                tracing::warn!(
                    "the tokio runtime has no I/O driver (enable_io); file lock waiters will poll"
                );
                self.disabled.store(true, Ordering::Relaxed);
                return None;
            }
        };
        // The reader's future owns the `OnExit`, so the instance is marked stopped even if the runtime
        // is dropped before the reader ever ran (a `block_on` that acquired without yielding).
        let on_exit = OnExit(Arc::downgrade(&shared));
        runtime.spawn(read_events(afd, on_exit, stop_rx));
        *current = Some(shared.clone());
        Some(shared)
    }
}

impl Notifier {
    /// How many files the live instance watches (for tests).
    #[cfg(test)]
    pub(crate) fn watch_count(&self) -> usize {
        lock(&self.current)
            .as_ref()
            .map_or(0, |shared| lock(&shared.watches).len())
    }
}

impl Shared {
    /// Watches the file at `path` (whatever inode the path names now). Callable from any thread.
    pub(crate) fn subscribe(self: &Arc<Self>, path: &Path) -> io::Result<Subscription> {
        let mut watches = lock(&self.watches);
        if !self.alive.load(Ordering::Acquire) {
            return Err(io::Error::other("the inotify reader stopped"));
        }
        // Under the map's lock, so a concurrent last unsubscribe cannot remove the watch we join.
        let wd = inotify::add_watch(self.fd.as_fd(), path, MASK)?;
        let entry = watches.entry(wd).or_insert_with(|| Entry {
            refs: 0,
            events: watch::channel(0).0,
        });
        entry.refs += 1;
        let events = entry.events.subscribe();
        Ok(Subscription {
            shared: self.clone(),
            wd,
            events,
        })
    }

    fn dispatch(&self, events: &[(i32, ReadFlags)]) {
        let mut watches = lock(&self.watches);
        for &(wd, flags) in events {
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                // Events were lost: wake everyone.
                for entry in watches.values() {
                    entry.events.send_modify(|n| *n = n.wrapping_add(1));
                }
                continue;
            }
            if let Some(entry) = watches.get(&wd) {
                entry.events.send_modify(|n| *n = n.wrapping_add(1));
            }
            if flags.contains(ReadFlags::IGNORED) {
                // The kernel removed the watch (the inode is gone or its file system unmounted):
                // dropping the sender tells the subscribers.
                watches.remove(&wd);
            }
        }
    }

    fn stop(&self) {
        self.alive.store(false, Ordering::Release);
        // Dropping the senders wakes every subscriber with "gone".
        lock(&self.watches).clear();
    }
}

/// One subscriber's view of one watched file. Dropping it removes the watch when it was the last.
pub(crate) struct Subscription {
    shared: Arc<Shared>,
    wd: i32,
    events: watch::Receiver<u64>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("wd", &self.wd)
            .finish()
    }
}

impl Subscription {
    /// Waits for the next event on the file: `true`, or `false` if the watch is gone for good (the file
    /// was deleted, or the reader stopped). Only events after the subscription was made count.
    ///
    /// # Cancel safety
    /// Cancel safe: an event that arrives while nobody waits is seen by the next call.
    pub(crate) async fn changed(&mut self) -> bool {
        self.events.changed().await.is_ok()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut watches = lock(&self.shared.watches);
        let last = match watches.get_mut(&self.wd) {
            Some(entry) => {
                entry.refs = entry.refs.saturating_sub(1);
                entry.refs == 0
            }
            None => false,
        };
        if last {
            watches.remove(&self.wd);
            // EINVAL: the kernel removed it already. Either way it is gone.
            let _ = inotify::remove_watch(self.shared.fd.as_fd(), self.wd);
        }
    }
}

/// The inotify descriptor as the reactor sees it.
struct SharedFd(Arc<OwnedFd>);

impl AsRawFd for SharedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl SharedFd {
    fn borrow(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Marks the instance stopped however the reader task ends (its runtime shutting down drops it too).
struct OnExit(Weak<Shared>);

impl Drop for OnExit {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.stop();
        }
    }
}

/// The size of `struct inotify_event` before its name.
const EVENT_HEADER: usize = 16;
/// The longest event: the header and a name of `NAME_MAX` bytes with its terminating NUL.
const MAX_EVENT: usize = EVENT_HEADER + 256;

async fn read_events(afd: AsyncFd<SharedFd>, on_exit: OnExit, mut stop: oneshot::Receiver<()>) {
    let shared = on_exit.0.clone();
    let mut buf = vec![0u8; 8192];
    let mut events = Vec::new();
    loop {
        let mut ready = tokio::select! {
            _ = &mut stop => return,
            ready = afd.readable() => match ready {
                Ok(ready) => ready,
                Err(e) => {
                    tracing::warn!(error = %e, "inotify reader failed; file lock waiters will poll");
                    return;
                }
            },
        };
        events.clear();
        // Read until the queue is empty. A read with room left for another event emptied it, so the
        // readiness is cleared then without a second read to see EAGAIN (one read per wake, not two:
        // our own release's close wakes this reader every cycle; issue 9). An event queued after that
        // read is not lost: epoll is edge-triggered, and tokio clears only the readiness this guard
        // saw, not a newer one.
        loop {
            match rustix::io::read(afd.get_ref().borrow(), &mut buf[..]) {
                Ok(n) => {
                    parse_events(&buf[..n], &mut events);
                    if n + MAX_EVENT <= buf.len() {
                        break;
                    }
                }
                Err(Errno::AGAIN) => break,
                Err(Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read inotify events; file lock waiters will poll");
                    return;
                }
            }
        }
        ready.clear_ready();
        if events.is_empty() {
            continue;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.dispatch(&events);
    }
}

/// The watch and the flags of each `struct inotify_event` in `bytes` (whole events, as `read` returns
/// them).
fn parse_events(bytes: &[u8], events: &mut Vec<(i32, ReadFlags)>) {
    let field = |at: usize| -> Option<[u8; 4]> { bytes.get(at..at + 4)?.try_into().ok() };
    let mut at = 0;
    while let (Some(wd), Some(mask), Some(len)) = (field(at), field(at + 4), field(at + 12)) {
        events.push((
            i32::from_ne_bytes(wd),
            ReadFlags::from_bits_retain(u32::from_ne_bytes(mask)),
        ));
        at += EVENT_HEADER + u32::from_ne_bytes(len) as usize;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events as the kernel lays them out: each header, then its name padded to its `len`.
    #[test]
    fn events_are_parsed_whole_names_skipped() {
        let mut bytes = Vec::new();
        let mut event = |wd: i32, mask: u32, name: &[u8]| {
            bytes.extend_from_slice(&wd.to_ne_bytes());
            bytes.extend_from_slice(&mask.to_ne_bytes());
            bytes.extend_from_slice(&0u32.to_ne_bytes());
            bytes.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            bytes.extend_from_slice(name);
        };
        let close = ReadFlags::CLOSE_WRITE.bits();
        event(3, close, b"");
        event(5, ReadFlags::ATTRIB.bits(), b"x.lock\0\0\0\0\0\0\0\0\0\0");
        event(-1, ReadFlags::QUEUE_OVERFLOW.bits(), b"");
        let mut events = Vec::new();
        parse_events(&bytes, &mut events);
        assert_eq!(
            events,
            [
                (3, ReadFlags::CLOSE_WRITE),
                (5, ReadFlags::ATTRIB),
                (-1, ReadFlags::QUEUE_OVERFLOW)
            ]
        );
    }
}
