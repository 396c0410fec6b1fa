//! One inotify instance per backend, shared by every waiter and every held lock of it.
//!
//! Why shared: Linux allows a user only 128 inotify instances by default
//! (`fs.inotify.max_user_instances`), while watches are plentiful; one instance per waiter would run out
//! with a few hundred concurrent acquires. A reader task on distlock's background runtime (not the
//! caller's, which may lack I/O, sit idle between `block_on`s, or be dropped) reads the events and
//! bumps a counter per watched file; subscribers wait for the counter to change.
//!
//! Held lock files are watched here too, with no task per hold: the notifier keeps a record of each
//! grant (path, inode, the hold's [`LossReport`]), watched or not; the reader checks the records of a
//! file it has an event for and reports the hold lost if the path no longer names its inode. One
//! keeper task on the background runtime, running while anything is held, watches the holds no live
//! instance watches (a grant whose watch failed, an instance that stopped) and checks each once (a
//! deletion in between raised no event anyone read); every second it checks every held file, since
//! a rename of the lock directory raises no event on the file, and without inotify that sweep is the
//! only check.
//!
//! Every subscriber uses the same mask ([`MASK`]), because a second `inotify_add_watch` of one inode
//! replaces the first one's mask. Events are wake-ups, not facts: a woken waiter tries the lock, a woken
//! holder re-checks that its lock file is still in place.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use distlock_core::raw::LossReport;

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::io::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{oneshot, watch};

use crate::open::same_file;

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

/// The mask of the other kinds' files (turnstiles, slot files): [`MASK`] without `CLOSE_NOWRITE`.
/// Their holders open them read-write, so a release or a holder's death is a `CLOSE_WRITE`; probes
/// (a try looking for a free slot, a reader passing the turnstile, `status`) open them read-only and
/// close them every try, and must not wake the other waiters, whose tries would wake them back.
pub(crate) const AUX_MASK: WatchFlags = WatchFlags::CLOSE_WRITE
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::DELETE_SELF);

/// The mask every watch of the file at `path` uses: an inode has one mask per instance, and a
/// second `inotify_add_watch` replaces it, so it is decided by the file's kind alone (its suffix).
pub(crate) fn mask_for(path: &Path) -> WatchFlags {
    use std::os::unix::ffi::OsStrExt;
    if path
        .as_os_str()
        .as_bytes()
        .ends_with(crate::layout::SUFFIX.as_bytes())
    {
        MASK
    } else {
        AUX_MASK
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The maps behind these mutexes stay consistent even if a holder panicked.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The backend's handle: starts the shared instance on first use and restarts it if its runtime went.
/// Keeps the records of held lock files across instances.
#[derive(Default)]
pub(crate) struct Notifier {
    current: Mutex<Option<Arc<Shared>>>,
    /// Set when inotify is off (configured so, or the runtime cannot drive it at all); then waiters
    /// poll, held files are checked every second by the keeper, and no retry is made.
    pub(crate) disabled: AtomicBool,
    /// Numbers the instances, so a hold's record names the instance that watches it.
    generations: AtomicU64,
    held: Mutex<HeldFiles>,
    /// Wakes the running keeper when a hold needs watching.
    keeper_wake: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("current", &*lock(&self.current))
            .field("held", &lock(&self.held).files.len())
            .finish_non_exhaustive()
    }
}

/// The held lock files watched for loss.
#[derive(Default)]
struct HeldFiles {
    next_id: u64,
    files: HashMap<u64, HeldRecord>,
    /// `(instance generation, watch descriptor, hold id)` of each hold an instance watches: the reader
    /// finds the holds of an event's watch here.
    by_watch: BTreeSet<(u64, i32, u64)>,
    /// Whether the keeper task is running (see the module docs).
    keeper: bool,
}

impl HeldFiles {
    fn remove(&mut self, id: u64) -> Option<HeldRecord> {
        let record = self.files.remove(&id)?;
        if let Some((generation, wd)) = record.watch {
            self.by_watch.remove(&(generation, wd, id));
        }
        Some(record)
    }

    /// The ids, paths and inodes of the holds on `wd` of instance `generation`.
    fn on_watch(&self, generation: u64, wd: i32, into: &mut Vec<Candidate>) {
        for &(_, _, id) in self
            .by_watch
            .range((generation, wd, 0)..=(generation, wd, u64::MAX))
        {
            if let Some(record) = self.files.get(&id) {
                into.push(record.candidate(id));
            }
        }
    }
}

/// One held lock file: what must stay at its path, and where to report that it did not.
struct HeldRecord {
    path: Arc<Path>,
    dev: u64,
    ino: u64,
    report: LossReport,
    /// `(instance generation, watch descriptor)` of the watch on the file; `None` when no live
    /// instance watches it (the keeper then does).
    watch: Option<(u64, i32)>,
}

impl HeldRecord {
    fn candidate(&self, id: u64) -> Candidate {
        Candidate {
            id,
            path: self.path.clone(),
            dev: self.dev,
            ino: self.ino,
        }
    }
}

/// A held file to look at, taken out of the record so the `stat` runs without the lock.
struct Candidate {
    id: u64,
    path: Arc<Path>,
    dev: u64,
    ino: u64,
}

/// A hold's record in its notifier; dropped (at the release, or when the held file is dropped), the
/// record goes, and with it the hold's reference on the inotify watch.
pub(crate) struct HeldWatch {
    notifier: Arc<Notifier>,
    id: u64,
}

impl std::fmt::Debug for HeldWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldWatch").field("id", &self.id).finish()
    }
}

impl Drop for HeldWatch {
    fn drop(&mut self) {
        self.notifier.forget(self.id);
    }
}

/// A live inotify instance and its watches. Dropping the last handle stops the reader task.
pub(crate) struct Shared {
    fd: Arc<OwnedFd>,
    generation: u64,
    notifier: Weak<Notifier>,
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

/// One watched file: the waiters' channel and the references that keep the watch.
#[derive(Default)]
struct Entry {
    /// Waiters' subscriptions; the channel exists while there is one (a held file needs none: its
    /// events are read against the holds' records).
    waiters: usize,
    holds: usize,
    events: Option<watch::Sender<u64>>,
}

impl Notifier {
    /// The live instance, started on the current runtime if there is none. `None` if inotify cannot be
    /// used (no runtime, or the per-user instance limit is reached): waiters then only poll.
    pub(crate) fn instance(self: &Arc<Self>) -> Option<Arc<Shared>> {
        if self.disabled.load(Ordering::Relaxed) {
            return None;
        }
        let mut current = lock(&self.current);
        if let Some(shared) = current.as_ref().filter(|s| s.alive.load(Ordering::Acquire)) {
            return Some(shared.clone());
        }
        // The reader runs on distlock's background runtime, not the caller's: a caller's runtime may
        // lack the I/O driver, be kept idle between `block_on`s, or be dropped, and every hold and
        // waiter of the backend shares this reader. The caller's runtime only if there is no other.
        let runtime = distlock_core::raw::background_runtime()
            .or_else(|| tokio::runtime::Handle::try_current().ok())?;
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
            generation: self.generations.fetch_add(1, Ordering::Relaxed),
            notifier: Arc::downgrade(self),
            watches: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            _stop: stop_tx,
        });
        // The AsyncFd is registered with the reactor here, inside the runtime. tokio panics instead of
        // failing when the runtime was built without I/O; that must not take the acquire down with it.
        let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _runtime = runtime.enter();
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

    /// How many held files have a record (for tests).
    #[cfg(test)]
    pub(crate) fn held_count(&self) -> usize {
        lock(&self.held).files.len()
    }

    /// Watches a held lock file for loss with `report`: `watch` is the acquisition's subscription,
    /// made before the file was locked, so nothing that happened to the file since is missed. The
    /// record lasts as long as the returned [`HeldWatch`], or until the loss is reported.
    pub(crate) fn watch_held(
        self: &Arc<Self>,
        mut watch: Option<Subscription>,
        path: Arc<Path>,
        (dev, ino): (u64, u64),
        report: LossReport,
    ) -> HeldWatch {
        // No subscription (inotify off or unavailable, or the watch failed): the record is made all
        // the same, and the keeper watches the file, or checks it every second.
        let wd = watch.as_ref().map_or(-1, |w| w.wd);
        let shared = watch.as_mut().and_then(|w| w.shared.take());
        // The hold's reference on the watch first, so a loss reported as soon as the record exists
        // drops a reference that is there.
        let kept = shared.as_ref().filter(|shared| {
            lock(&shared.watches)
                .get_mut(&wd)
                .map(|entry| entry.holds += 1)
                .is_some()
        });
        // Then the record: the reader checks it on any event it reads from now on.
        let id = {
            let mut held = lock(&self.held);
            let id = held.next_id;
            held.next_id += 1;
            let watch = kept.map(|shared| (shared.generation, wd));
            if let Some((generation, wd)) = watch {
                held.by_watch.insert((generation, wd, id));
            }
            held.files.insert(
                id,
                HeldRecord {
                    path,
                    dev,
                    ino,
                    report,
                    watch,
                },
            );
            id
        };
        let hold = HeldWatch {
            notifier: self.clone(),
            id,
        };
        // Then the acquisition's reference goes. An event the reader sent to the waiters' channel
        // before the record existed is only there: look at the file now if there was one.
        let missed = match kept {
            Some(shared) => {
                let mut watches = lock(&shared.watches);
                let missed = watch
                    .as_ref()
                    .is_none_or(|w| w.events.has_changed().unwrap_or(true));
                if let Some(entry) = watches.get_mut(&wd) {
                    entry.waiters = entry.waiters.saturating_sub(1);
                    if entry.waiters == 0 {
                        entry.events = None;
                    }
                }
                missed
            }
            // No live watch: the keeper watches the file again (and checks it).
            None => true,
        };
        if missed {
            let candidate = lock(&self.held).files.get(&id).map(|r| r.candidate(id));
            self.check(candidate);
        }
        // Always: the keeper's sweep checks watched holds too (see `keep_watching`). Woken now only
        // for a hold with no live watch (a reader that stopped after the record was made may have
        // found no record to hand the keeper): a watched one waits for the sweep.
        self.ensure_keeper(kept.is_none_or(|s| !s.alive.load(Ordering::Acquire)));
        hold
    }

    /// Drops a hold's record (released or dropped) and its reference on the watch.
    fn forget(&self, id: u64) {
        let record = lock(&self.held).remove(id);
        if let Some(HeldRecord {
            watch: Some((generation, wd)),
            ..
        }) = record
        {
            self.unwatch_held(generation, wd);
        }
    }

    fn unwatch_held(&self, generation: u64, wd: i32) {
        let shared = lock(&self.current).clone();
        // A stopped instance's watches are gone with it.
        if let Some(shared) = shared.filter(|s| s.generation == generation) {
            shared.unref(wd, false);
        }
    }

    /// Looks at each held file; reports (and forgets) those whose path no longer names their inode.
    fn check(&self, candidates: impl IntoIterator<Item = Candidate>) {
        for candidate in candidates {
            match same_file(&candidate.path, candidate.dev, candidate.ino) {
                Ok(true) => {}
                Ok(false) => self.lost(candidate.id),
                Err(e) => tracing::debug!(error = %e, "cannot check the lock file"),
            }
        }
    }

    fn lost(&self, id: u64) {
        // Taken out under the lock: a hold released meanwhile is not reported.
        let Some(record) = lock(&self.held).remove(id) else {
            return;
        };
        if let Some((generation, wd)) = record.watch {
            self.unwatch_held(generation, wd);
        }
        record.report.report(format!(
            "the lock file {} was deleted or replaced while held; another process can now lock a new file of that name",
            record.path.display()
        ));
    }

    /// The reader of instance `generation` read `events`: checks the held files they concern.
    fn held_events(self: &Arc<Self>, generation: u64, events: &[(i32, ReadFlags)]) {
        let mut candidates = Vec::new();
        let ignored: Vec<i32> = events
            .iter()
            .filter(|(_, flags)| flags.contains(ReadFlags::IGNORED))
            .map(|&(wd, _)| wd)
            .collect();
        {
            let held = lock(&self.held);
            if held.files.is_empty() {
                return;
            }
            if events
                .iter()
                .any(|(_, flags)| flags.contains(ReadFlags::QUEUE_OVERFLOW))
            {
                // Events were lost: look at every file this instance watches.
                let all = (generation, i32::MIN, 0)..=(generation, i32::MAX, u64::MAX);
                for &(_, _, id) in held.by_watch.range(all) {
                    if let Some(record) = held.files.get(&id) {
                        candidates.push(record.candidate(id));
                    }
                }
            } else {
                for &(wd, _) in events {
                    held.on_watch(generation, wd, &mut candidates);
                }
            }
        }
        candidates.sort_unstable_by_key(|c| c.id);
        candidates.dedup_by_key(|c| c.id);
        self.check(candidates);
        if ignored.is_empty() {
            return;
        }
        // The kernel dropped these watches (an unmount; a held file's inode cannot go while we
        // keep it open): holds still on them are the keeper's to watch again.
        let mut unwatched = false;
        {
            let mut held = lock(&self.held);
            for wd in ignored {
                let ids: Vec<u64> = held
                    .by_watch
                    .range((generation, wd, 0)..=(generation, wd, u64::MAX))
                    .map(|&(_, _, id)| id)
                    .collect();
                for id in ids {
                    held.by_watch.remove(&(generation, wd, id));
                    if let Some(record) = held.files.get_mut(&id) {
                        record.watch = None;
                        unwatched = true;
                    }
                }
            }
        }
        if unwatched {
            self.ensure_keeper(true);
        }
    }

    /// Starts the keeper on distlock's background runtime unless it runs or nothing is held; `wake`:
    /// a hold needs watching, so a running keeper looks now, not at its next sweep.
    fn ensure_keeper(self: &Arc<Self>, wake: bool) {
        {
            let mut held = lock(&self.held);
            if held.files.is_empty() {
                return;
            }
            if held.keeper {
                if wake {
                    self.keeper_wake.notify_one();
                }
                return;
            }
            held.keeper = true;
        }
        match distlock_core::raw::background_runtime() {
            Some(runtime) => {
                runtime.spawn(keep_watching(Arc::downgrade(self)));
            }
            None => {
                lock(&self.held).keeper = false;
                tracing::error!(
                    "no runtime to watch held lock files on; their deletion goes unnoticed"
                );
            }
        }
    }
}

/// The keeper: watches every held file no live instance watches on one, then checks each, since a
/// deletion before the watch raised no event for it (files that cannot be watched are left to the
/// next sweep). Every second it also checks every held file, watched or not: a rename of the lock
/// directory (or of a directory above it) raises no event on the held file, and while no instance
/// can be had this is the only check. Ends when nothing is held.
async fn keep_watching(notifier: Weak<Notifier>) {
    // Clears the flag if the task is dropped unfinished (a runtime does not end: defensive).
    struct Running(Weak<Notifier>, bool);
    impl Drop for Running {
        fn drop(&mut self) {
            if self.1 {
                if let Some(notifier) = self.0.upgrade() {
                    lock(&notifier.held).keeper = false;
                }
            }
        }
    }
    let mut running = Running(notifier.clone(), true);
    let mut next_sweep = tokio::time::Instant::now();
    loop {
        let Some(strong) = notifier.upgrade() else {
            running.1 = false;
            return;
        };
        let shared = strong.instance();
        let sweep = tokio::time::Instant::now() >= next_sweep;
        let (pending, all) = {
            let mut held = lock(&strong.held);
            if held.files.is_empty() {
                held.keeper = false;
                running.1 = false;
                return;
            }
            // Read under the lock: a reader that stops after this finds the flag still set only if
            // this round sees it stopped.
            let live = shared
                .as_ref()
                .filter(|s| s.alive.load(Ordering::Acquire))
                .map(|s| s.generation);
            let pending: Vec<Candidate> = held
                .files
                .iter()
                .filter(|(_, r)| live.is_none() || r.watch.map(|(g, _)| g) != live)
                .map(|(&id, r)| r.candidate(id))
                .collect();
            let all: Vec<Candidate> = if sweep {
                held.files.iter().map(|(&id, r)| r.candidate(id)).collect()
            } else {
                Vec::new()
            };
            (pending, all)
        };
        let mut unwatched = shared.is_none();
        if let Some(shared) = &shared {
            for candidate in &pending {
                match shared.watch_file(&candidate.path) {
                    Ok(wd) => strong.rewatched(candidate.id, shared, wd),
                    Err(e) => {
                        tracing::debug!(path = %candidate.path.display(), error = %e, "cannot watch a held lock file again");
                        unwatched = true;
                    }
                }
            }
        }
        let rewatched = !pending.is_empty() && !unwatched;
        if sweep {
            next_sweep = tokio::time::Instant::now() + SWEEP;
            strong.check(all);
        } else {
            strong.check(pending);
        }
        let wake = strong.keeper_wake.clone();
        drop((strong, shared));
        // Rewatched: look again at once (a reader may have stopped meanwhile); else wait for the
        // sweep, or for a hold that needs watching.
        if !rewatched {
            tokio::select! {
                () = tokio::time::sleep_until(next_sweep) => {}
                () = wake.notified() => {}
            }
        }
    }
}

/// How often the keeper checks every held file.
const SWEEP: Duration = Duration::from_secs(1);

impl Notifier {
    /// The keeper watches hold `id` again with `wd` of `shared`.
    fn rewatched(&self, id: u64, shared: &Arc<Shared>, wd: i32) {
        let kept = {
            let mut held = lock(&self.held);
            let stale = held
                .files
                .get(&id)
                .map(|r| r.watch.map(|(g, _)| g) != Some(shared.generation));
            match stale {
                Some(true) => {
                    let record = held.files.get_mut(&id);
                    let old = record.and_then(|r| r.watch.replace((shared.generation, wd)));
                    if let Some((generation, old_wd)) = old {
                        held.by_watch.remove(&(generation, old_wd, id));
                    }
                    held.by_watch.insert((shared.generation, wd, id));
                    true
                }
                // Released meanwhile, or watched by this instance already.
                _ => false,
            }
        };
        if !kept {
            shared.unref(wd, false);
        }
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
        let wd = inotify::add_watch(self.fd.as_fd(), path, mask_for(path))?;
        let entry = watches.entry(wd).or_default();
        entry.waiters += 1;
        let events = entry
            .events
            .get_or_insert_with(|| watch::channel(0).0)
            .subscribe();
        Ok(Subscription {
            shared: Some(self.clone()),
            wd,
            events,
        })
    }

    /// Watches the held file at `path` for a hold's record (see [`Notifier::watch_held`]).
    fn watch_file(&self, path: &Path) -> io::Result<i32> {
        let mut watches = lock(&self.watches);
        if !self.alive.load(Ordering::Acquire) {
            return Err(io::Error::other("the inotify reader stopped"));
        }
        let wd = inotify::add_watch(self.fd.as_fd(), path, mask_for(path))?;
        watches.entry(wd).or_default().holds += 1;
        Ok(wd)
    }

    /// Drops a waiter's (or a hold's) reference on watch `wd`; the last one removes the watch.
    fn unref(&self, wd: i32, waiter: bool) {
        let mut watches = lock(&self.watches);
        let last = match watches.get_mut(&wd) {
            Some(entry) => {
                if waiter {
                    entry.waiters = entry.waiters.saturating_sub(1);
                    if entry.waiters == 0 {
                        entry.events = None;
                    }
                } else {
                    entry.holds = entry.holds.saturating_sub(1);
                }
                entry.waiters == 0 && entry.holds == 0
            }
            None => false,
        };
        if last {
            watches.remove(&wd);
            // EINVAL: the kernel removed it already. Either way it is gone.
            let _ = inotify::remove_watch(self.fd.as_fd(), wd);
        }
    }

    fn dispatch(&self, events: &[(i32, ReadFlags)]) {
        {
            let mut watches = lock(&self.watches);
            for &(wd, flags) in events {
                if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                    // Events were lost: wake everyone.
                    for entry in watches.values() {
                        wake(entry);
                    }
                    continue;
                }
                if let Some(entry) = watches.get(&wd) {
                    wake(entry);
                }
                if flags.contains(ReadFlags::IGNORED) {
                    // The kernel removed the watch (the inode is gone or its file system unmounted):
                    // dropping the sender tells the subscribers.
                    watches.remove(&wd);
                }
            }
        }
        if let Some(notifier) = self.notifier.upgrade() {
            notifier.held_events(self.generation, events);
        }
    }

    fn stop(&self) {
        self.alive.store(false, Ordering::Release);
        // Dropping the senders wakes every subscriber with "gone".
        lock(&self.watches).clear();
        // Held files are watched by nobody now: the keeper watches them again.
        if let Some(notifier) = self.notifier.upgrade() {
            notifier.ensure_keeper(true);
        }
    }
}

fn wake(entry: &Entry) {
    if let Some(events) = &entry.events {
        events.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// One subscriber's view of one watched file. Dropping it removes the watch when it was the last.
pub(crate) struct Subscription {
    /// `None` once the subscription became a hold's ([`Notifier::watch_held`]).
    shared: Option<Arc<Shared>>,
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

/// Waits for the next event on any of `watches`: the index of the first with one, and `false` if its
/// watch is gone for good (see [`Subscription::changed`]). Pending for ever when `watches` is empty.
///
/// # Cancel safety
/// Cancel safe, as [`Subscription::changed`].
pub(crate) async fn any_changed(watches: &mut [&mut Subscription]) -> (usize, bool) {
    if watches.is_empty() {
        return std::future::pending().await;
    }
    let mut waits: Vec<_> = watches
        .iter_mut()
        .map(|watch| Box::pin(watch.changed()))
        .collect();
    std::future::poll_fn(|cx| {
        use std::future::Future as _;
        for (i, wait) in waits.iter_mut().enumerate() {
            if let std::task::Poll::Ready(alive) = wait.as_mut().poll(cx) {
                return std::task::Poll::Ready((i, alive));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(shared) = self.shared.take() {
            shared.unref(self.wd, true);
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
