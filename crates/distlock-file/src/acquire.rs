//! Acquiring: one try of each kind (open, `flock` without blocking, mint or read the token, make it
//! durable) and the wait between tries (inotify, or the fallback poll).
//!
//! * **Mutex and writer** (`LOCK_EX` on the lock file): the try the backend has always made. Held by
//!   readers (a shared probe of the busy file succeeds, and is given back at once), a waiting writer
//!   also takes `LOCK_EX` on the turnstile `<stem>.writer`, which keeps new readers out until it is in
//!   or gives up (writers first). A mutex waiting behind a mutex never touches the turnstile.
//! * **Reader** (`LOCK_SH` on the lock file): passes the turnstile with `LOCK_SH` (refused while a
//!   writer waits there) and keeps it while it takes its lock, so no reader that comes after a waiting
//!   writer gets in; its token is the lock file's counter, read under its lock.
//! * **Permit**: see [`semaphore`](crate::semaphore).
//!
//! A mutex, writer or reader that holds the lock file gives it back if a permit of the name is held
//! (names are one kind; see [`semaphore`](crate::semaphore)): it looks at the slots only when the lock
//! file's record carries the `semaphore` mark, which the first permit's grant writes.
//!
//! Every file whose `Busy` a wait is to end is watched *before* the try that reports that `Busy`: a
//! try that had to add a watch looks again, so a release between a try and the wait is never missed.

use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LossReport};
use distlock_core::retry::Backoff;
use distlock_core::{FencingToken, Result};
use rustix::fs::{FlockOperation, OFlags};

use crate::config::FileConfig;
use crate::error::FileError;
use crate::held::{mint_unheld, read_last, FileLease, Held, HeldFile, SharedFile};
use crate::layout::{sibling_path, slot_path, Record, WRITER_SUFFIX};
use crate::notify::{any_changed, Notifier, Shared, Subscription};
use crate::open::{open_read_only, sync_dir, try_flock, OpenFile};
use crate::semaphore::{check_limit, free_slot, held_slot, take_slot, BRIEF_RETRIES};
use crate::sync_thread::off_the_workers_in;

/// How many times one try starts over because the lock file was deleted or replaced under it, or
/// because it had to watch another file first.
const MAX_ROUNDS: usize = 8;

/// One acquire under way: the open lock file (kept between tries), the watches, the turnstile, and
/// the poll's backoff.
#[derive(Debug)]
pub struct FileAcquisition {
    /// Shared with the hold and its loss signal, not copied into each (issue 9: allocations).
    path: Arc<Path>,
    file: Option<OpenFile>,
    watch: Option<Subscription>,
    watch_failed: bool,
    backoff: Backoff,
    /// The turnstile: a waiting writer's descriptor (holding `LOCK_EX` once it got it), or a reader's,
    /// kept between tries so its passes close nothing.
    turnstile: Option<Turnstile>,
    turnstile_watch: Option<Subscription>,
    /// Watches of slot files, by slot: a permit's waiter watches them all, a mutex's, writer's or
    /// reader's the held ones it found.
    slot_watches: Vec<Option<Subscription>>,
    /// A permit's: the limit was checked against the stored one (it is kept, so once is enough).
    limit_checked: bool,
}

/// A descriptor of the turnstile and whether it holds a lock there (unlocked as it drops, before the
/// close: the close wakes readers).
#[derive(Debug)]
struct Turnstile {
    fd: OwnedFd,
    locked: bool,
}

impl Turnstile {
    fn unlock(&mut self) {
        if self.locked {
            self.locked = false;
            let _ = rustix::fs::flock(&self.fd, FlockOperation::Unlock);
        }
    }
}

impl Drop for Turnstile {
    fn drop(&mut self) {
        self.unlock();
    }
}

/// What a try of a mutex, writer or reader came to.
enum Step {
    Acquired {
        held: Held,
        first_token: bool,
        watch: Option<Subscription>,
    },
    Busy,
    /// Look again at once: a watch was just added, or the lock file was replaced.
    Again,
}

impl FileAcquisition {
    /// An acquire of the lock file at `path`; nothing is opened yet.
    pub(crate) fn new(path: impl Into<Arc<Path>>, config: &FileConfig) -> Self {
        Self {
            path: path.into(),
            file: None,
            watch: None,
            watch_failed: false,
            backoff: Backoff::new(config.poll_initial, config.poll_max),
            turnstile: None,
            turnstile_watch: None,
            slot_watches: Vec::new(),
            limit_checked: false,
        }
    }

    /// One try. `watcher` gives the inotify instance to watch files with (none if notification is
    /// off); it is not asked again once a watch failed.
    ///
    /// # Cancel safety
    /// The awaits are the `fdatasync` off the runtime's workers, which finishes even if this future is
    /// dropped (the held file is then dropped with its result, which unlocks it), and a permit's short
    /// sleeps while another permit's try holds the lock file (nothing is held then).
    pub(crate) async fn try_once(
        &mut self,
        config: &FileConfig,
        watcher: impl FnOnce() -> Option<Arc<Shared>>,
        notifier: &Arc<Notifier>,
        request: &AcquireRequest,
    ) -> Result<Attempt<FileLease>> {
        let watcher = if self.watch_failed { None } else { watcher() };
        let core = |e: FileError| e.into_core(Some(&request.name));
        let mut rounds = 0;
        let step = loop {
            let step = match request.kind {
                distlock_core::LockKind::Read => self.try_read(&config.dir, &watcher),
                distlock_core::LockKind::Permit { limit } => {
                    return self
                        .try_permit(config, &watcher, notifier, request, limit)
                        .await
                        .map_err(core);
                }
                _ => self.try_exclusive(&config.dir, &watcher, &request.owner),
            }
            .map_err(core)?;
            rounds += 1;
            match step {
                Step::Again if rounds < MAX_ROUNDS => continue,
                Step::Again => {
                    return Err(core(FileError::Replaced {
                        path: self.path.to_path_buf(),
                    }))
                }
                step => break step,
            }
        };
        let Step::Acquired {
            held,
            first_token,
            watch,
        } = step
        else {
            return Ok(Attempt::Busy { retry_after: None });
        };
        let held = match held {
            Held::Exclusive(held) if config.sync => {
                // The directory too for a file's first token only (the path is needed then alone).
                let dir = first_token.then(|| config.dir.clone());
                let pid = held.pid;
                Held::Exclusive(
                    off_the_workers_in(pid, move || held.sync(dir.as_deref()))
                        .await
                        .and_then(|r| r)
                        .map_err(core)?,
                )
            }
            held => held,
        };
        Ok(Attempt::Acquired(grant(held, watch, notifier, request)))
    }

    /// The lock file, open (kept between tries, reopened if it went).
    fn lock_file(&mut self, dir: &Path) -> Result<OpenFile, FileError> {
        match self.file.take() {
            Some(file) => Ok(file),
            None => {
                // A new file: a watch of the old one is useless.
                self.watch = None;
                OpenFile::open(&self.path, dir)
            }
        }
    }

    /// A mutex's or writer's try: `LOCK_EX` on the lock file.
    fn try_exclusive(
        &mut self,
        dir: &Path,
        watcher: &Option<Arc<Shared>>,
        owner: &str,
    ) -> Result<Step, FileError> {
        let mut file = self.lock_file(dir)?;
        let locked = file.try_lock(&self.path)?;
        let fresh_watch = self.watch.is_none() && self.subscribe(watcher);
        // The watch follows the path, the lock the descriptor: both must be on the same file.
        if !file.is_current(&self.path)? {
            tracing::debug!(path = %self.path.display(), "lock file replaced under a try; reopening");
            self.watch = None;
            return Ok(Step::Again);
        }
        if locked {
            // On an error the file drops, which unlocks it.
            let (last, len) = read_last(&file, &self.path)?;
            if let Some(slot) = permit_held(&last, &self.path)? {
                return Ok(self.permits_held(file, watcher, slot));
            }
            let first_token = last.token == 0;
            let held = HeldFile::take_after(file, &self.path, owner, &last, len)?;
            // Readers may pass the turnstile again; they wait for this hold on the lock file.
            self.turnstile = None;
            return Ok(Step::Acquired {
                held: Held::Exclusive(held),
                first_token,
                watch: self.watch.take(),
            });
        }
        if fresh_watch {
            // Busy before the watch existed: a release in between raised no event, so look again.
            self.file = Some(file);
            return Ok(Step::Again);
        }
        if self.turnstile.as_ref().is_none_or(|t| !t.locked) && file.held_shared(&self.path)? {
            // Held by readers: new ones stay out while this writer waits (writers first).
            self.enter_turnstile(dir);
        }
        self.file = Some(file);
        Ok(Step::Busy)
    }

    /// The lock file was ours, but a permit of the name is held: the name is a semaphore now. The
    /// lock is given back (not closed: that would wake waiters for nothing) and the held slot watched.
    fn permits_held(
        &mut self,
        mut file: OpenFile,
        watcher: &Option<Arc<Shared>>,
        slot: u32,
    ) -> Step {
        file.unlock();
        self.file = Some(file);
        if self.subscribe_slot(watcher, slot) {
            Step::Again
        } else {
            Step::Busy
        }
    }

    /// A waiting writer's `LOCK_EX` on the turnstile, if it can have it (another waiting writer may
    /// hold it: readers stay out all the same). Best effort: a turnstile that cannot be used only
    /// costs the writer its precedence.
    fn enter_turnstile(&mut self, dir: &Path) {
        if self.turnstile.is_none() {
            let path = sibling_path(&self.path, WRITER_SUFFIX);
            let opened = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o666)
                .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32)
                .open(&path);
            match opened {
                Ok(file) => {
                    self.turnstile = Some(Turnstile {
                        fd: OwnedFd::from(file),
                        locked: false,
                    })
                }
                Err(e) => {
                    tracing::debug!(path = %path.display(), dir = %dir.display(), error = %e, "cannot open the turnstile; waiting without precedence over readers");
                    return;
                }
            }
        }
        if let Some(turnstile) = self.turnstile.as_mut() {
            turnstile.locked =
                try_flock(&turnstile.fd, FlockOperation::NonBlockingLockExclusive).unwrap_or(false);
        }
    }

    /// A reader's try: through the turnstile, then `LOCK_SH` on the lock file.
    fn try_read(&mut self, dir: &Path, watcher: &Option<Arc<Shared>>) -> Result<Step, FileError> {
        if !self.pass_turnstile()? {
            if self.turnstile_watch.is_none() && self.subscribe_turnstile(watcher) {
                return Ok(Step::Again);
            }
            return Ok(Step::Busy);
        }
        // The turnstile is held (shared) while the lock file is tried, and given back after.
        let step = self.read_lock_file(dir, watcher);
        if let Some(turnstile) = self.turnstile.as_mut() {
            turnstile.unlock();
        }
        step
    }

    /// `LOCK_SH` on the turnstile, if there is one: `false` if a waiting writer holds it.
    fn pass_turnstile(&mut self) -> Result<bool, FileError> {
        if self.turnstile.is_none() {
            let path = sibling_path(&self.path, WRITER_SUFFIX);
            // No turnstile: no writer ever waited behind readers here.
            let Some(fd) = open_read_only(&path, false)? else {
                return Ok(true);
            };
            self.turnstile = Some(Turnstile { fd, locked: false });
        }
        let Some(turnstile) = self.turnstile.as_mut() else {
            return Ok(true);
        };
        let passed = try_flock(&turnstile.fd, FlockOperation::NonBlockingLockShared)
            .map_err(|e| FileError::io("lock", &sibling_path(&self.path, WRITER_SUFFIX), e))?;
        turnstile.locked = passed;
        Ok(passed)
    }

    fn read_lock_file(
        &mut self,
        dir: &Path,
        watcher: &Option<Arc<Shared>>,
    ) -> Result<Step, FileError> {
        let mut file = self.lock_file(dir)?;
        let locked = file.try_lock_shared(&self.path)?;
        let fresh_watch = self.watch.is_none() && self.subscribe(watcher);
        if !file.is_current(&self.path)? {
            tracing::debug!(path = %self.path.display(), "lock file replaced under a try; reopening");
            self.watch = None;
            return Ok(Step::Again);
        }
        if locked {
            // The token readers carry: the counter, which no writer can change while they hold. On an
            // error the file drops, which unlocks it.
            let (last, _) = read_last(&file, &self.path)?;
            if let Some(slot) = permit_held(&last, &self.path)? {
                return Ok(self.permits_held(file, watcher, slot));
            }
            let token = last.token;
            let shared = SharedFile {
                file,
                path: self.path.clone(),
                token,
                watching: None,
            };
            return Ok(Step::Acquired {
                held: Held::Shared(shared),
                first_token: false,
                watch: self.watch.take(),
            });
        }
        self.file = Some(file);
        Ok(if fresh_watch { Step::Again } else { Step::Busy })
    }

    /// A permit's try (see [`semaphore`](crate::semaphore) for the steps and why they are safe).
    async fn try_permit(
        &mut self,
        config: &FileConfig,
        watcher: &Option<Arc<Shared>>,
        notifier: &Arc<Notifier>,
        request: &AcquireRequest,
        limit: u32,
    ) -> Result<Attempt<FileLease>, FileError> {
        if !self.limit_checked {
            check_limit(&self.path, &config.dir, limit, config.sync)?;
            self.limit_checked = true;
        }
        for _ in 0..MAX_ROUNDS {
            // A slot that looks free, without touching the lock file.
            let Some(candidate) = free_slot(&self.path, limit)? else {
                if self.subscribe_slots(watcher, limit) {
                    continue;
                }
                return Ok(Attempt::Busy { retry_after: None });
            };
            // The lock file, exclusive for a moment.
            let mut file = self.lock_file(&config.dir)?;
            let mut locked = file.try_lock(&self.path)?;
            for delay in BRIEF_RETRIES {
                if locked {
                    break;
                }
                tokio::time::sleep(delay).await;
                locked = file.try_lock(&self.path)?;
            }
            let fresh_watch = self.watch.is_none() && self.subscribe(watcher);
            if !file.is_current(&self.path)? {
                self.watch = None;
                continue;
            }
            if !locked {
                // A mutex, a writer or readers hold the name.
                self.file = Some(file);
                if fresh_watch {
                    continue;
                }
                return Ok(Attempt::Busy { retry_after: None });
            }
            let taken = take_slot(&self.path, &config.dir, limit, candidate);
            let minted = match &taken {
                Ok(Some(_)) => Some(mint_unheld(&file, &self.path)),
                _ => None,
            };
            file.unlock();
            let lock_fd = file.fd.clone();
            self.file = Some(file);
            let Some((slot, path, slot_file)) = taken? else {
                // Every slot that looked free was taken meanwhile: wait for the slots again.
                if self.subscribe_slots(watcher, limit) {
                    continue;
                }
                return Ok(Attempt::Busy { retry_after: None });
            };
            let Some(minted) = minted else {
                continue;
            };
            // On an error the slot file drops, which unlocks it.
            let (token, first_token) = minted?;
            let mut held = HeldFile::take_slot(slot_file, &path, &request.owner, token)?;
            if config.sync {
                // The token is durable before the grant is reported, as a mutex's is.
                let dir = first_token.then(|| config.dir.clone());
                let lock_path = self.path.clone();
                let pid = held.pid;
                held = off_the_workers_in(pid, move || -> Result<HeldFile, FileError> {
                    rustix::fs::fdatasync(&*lock_fd)
                        .map_err(|e| FileError::io("sync", &lock_path, e.into()))?;
                    if let Some(dir) = dir {
                        sync_dir(&dir)?;
                    }
                    #[cfg(test)]
                    crate::held::tests_support::count_sync(&lock_path);
                    Ok(held)
                })
                .await
                .and_then(|r| r)?;
            }
            let watch = self
                .slot_watches
                .get_mut(slot as usize)
                .and_then(Option::take);
            return Ok(Attempt::Acquired(grant(
                Held::Permit { held, slot },
                watch,
                notifier,
                request,
            )));
        }
        Err(FileError::Replaced {
            path: self.path.to_path_buf(),
        })
    }

    /// Watches the lock file; `true` if a watch was added now.
    fn subscribe(&mut self, watcher: &Option<Arc<Shared>>) -> bool {
        let path = self.path.clone();
        match self.watch_path(watcher, &path) {
            Some(watch) => {
                self.watch = Some(watch);
                true
            }
            None => false,
        }
    }

    fn subscribe_turnstile(&mut self, watcher: &Option<Arc<Shared>>) -> bool {
        let path = sibling_path(&self.path, WRITER_SUFFIX);
        match self.watch_path(watcher, &path) {
            Some(watch) => {
                self.turnstile_watch = Some(watch);
                true
            }
            None => false,
        }
    }

    /// Watches slot `slot` unless it is watched; `true` if a watch was added now.
    fn subscribe_slot(&mut self, watcher: &Option<Arc<Shared>>, slot: u32) -> bool {
        let at = slot as usize;
        if self.slot_watches.get(at).is_some_and(Option::is_some) {
            return false;
        }
        let Some(watch) = self.watch_path(watcher, &slot_path(&self.path, slot)) else {
            return false;
        };
        if self.slot_watches.len() <= at {
            self.slot_watches.resize_with(at + 1, || None);
        }
        self.slot_watches[at] = Some(watch);
        true
    }

    /// Watches every slot of `0..limit` not yet watched; `true` if any watch was added now.
    fn subscribe_slots(&mut self, watcher: &Option<Arc<Shared>>, limit: u32) -> bool {
        let mut added = false;
        for slot in 0..limit {
            added |= self.subscribe_slot(watcher, slot);
        }
        added
    }

    /// A new watch of `path`, unless watching is off or failed before.
    fn watch_path(&mut self, watcher: &Option<Arc<Shared>>, path: &Path) -> Option<Subscription> {
        if self.watch_failed {
            return None;
        }
        match watcher.as_ref()?.subscribe(path) {
            Ok(watch) => Some(watch),
            // The file was unlinked since the try opened it: the next try reopens it and watches again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot watch a lock file; waiting by polling only");
                self.watch_failed = true;
                None
            }
        }
    }

    /// Waits for an inotify event on a watched file or the fallback timer, whichever is first.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits. Events that arrive meanwhile are kept for the next wait.
    pub(crate) async fn wait(&mut self) {
        // The poll's delay doubles after every wait the timer ends (up to `poll_max`) and starts over
        // after an event. A lost watch ends the wait at once, before any poll: it leaves the delay as it
        // was (the backoff is restored), so it does not stretch the next poll with no time passed.
        let before = self.backoff.clone();
        let delay = self.backoff.next_delay();
        let event = {
            let mut watches: Vec<&mut Subscription> = self
                .watch
                .iter_mut()
                .chain(self.turnstile_watch.iter_mut())
                .chain(self.slot_watches.iter_mut().flatten())
                .collect();
            if watches.is_empty() {
                tokio::time::sleep(delay).await;
                None
            } else {
                tokio::select! {
                    event = any_changed(&mut watches) => Some(event),
                    () = tokio::time::sleep(delay) => None,
                }
            }
        };
        match event {
            Some((_, true)) => self.backoff.reset(),
            // A watch is gone (the file was deleted, or the reader stopped): the next try reopens
            // the path and watches it again.
            Some((gone, false)) => {
                self.forget_watch(gone);
                self.backoff = before;
            }
            None => {}
        }
    }

    /// Drops the watch at `index` in the order `wait` polls them.
    fn forget_watch(&mut self, mut index: usize) {
        if self.watch.is_some() {
            if index == 0 {
                self.watch = None;
                return;
            }
            index -= 1;
        }
        if self.turnstile_watch.is_some() {
            if index == 0 {
                self.turnstile_watch = None;
                return;
            }
            index -= 1;
        }
        if let Some(watch) = self
            .slot_watches
            .iter_mut()
            .filter(|w| w.is_some())
            .nth(index)
        {
            *watch = None;
        }
    }
}

/// A held slot of the name's semaphore, looked for only when the lock file (held by the caller) is
/// marked as a semaphore's: a name never used as one costs nothing here.
fn permit_held(last: &Record, lock: &Path) -> Result<Option<u32>, FileError> {
    if last.semaphore {
        held_slot(lock)
    } else {
        Ok(None)
    }
}

/// The grant of a held (and, if configured, synced) file: its token, its descriptor for
/// `inheritable_descriptor`, a permit's id, and the loss signal (the notifier keeps the hold's record
/// and reports into it: no task per hold).
fn grant(
    mut held: Held,
    watch: Option<Subscription>,
    notifier: &Arc<Notifier>,
    request: &AcquireRequest,
) -> Grant<FileLease> {
    let token = held.token();
    // The locked descriptor itself, not a `dup` of it: whoever inherits it keeps the lock held (it
    // is close-on-exec, so only a deliberate hand-over passes it on). See `OpenFile::fd`.
    let descriptor = held.file().fd.clone();
    // Every grant gets a loss signal, watched or not: without a watch the notifier's keeper watches
    // the file later or checks it every second.
    let report = LossReport::new();
    let inode = (held.file().dev, held.file().ino);
    let path = held.path().clone();
    held.set_watching(notifier.watch_held(watch, path, inode, report.clone()));
    let permit = match &held {
        Held::Permit { slot, .. } => Some(*slot),
        _ => None,
    };
    tracing::debug!(lock = %request.name, token, kind = %request.kind, "file lock acquired");
    let mut grant = Grant::new(FileLease::new(held)).with_token(FencingToken::new(token));
    grant.descriptor = Some(descriptor);
    if let Some(slot) = permit {
        grant = grant.with_permit(slot.to_string());
    }
    grant.with_loss(report.signal())
}

/// The grant of a write hold turned into a read hold ([`HeldFile::downgrade`]): watched for loss
/// anew (the write hold's record went with it).
pub(crate) fn downgraded_grant(
    shared: SharedFile,
    notifier: &Arc<Notifier>,
    request: &AcquireRequest,
) -> Grant<FileLease> {
    grant(Held::Shared(shared), None, notifier, request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A watch made on a runtime that is then dropped.
    fn watch_from_a_dropped_runtime(notifier: &Arc<Notifier>, path: &Path) -> Subscription {
        let first = runtime();
        let watch = first.block_on(async { notifier.instance().unwrap().subscribe(path).unwrap() });
        drop(first);
        watch
    }

    /// The grant's inheritable descriptor is the descriptor the lease locked and releases (one open
    /// descriptor per hold, no `dup` per acquisition), and the file stays open while the core keeps
    /// it: releasing through the lease unlocks it for the holder of the descriptor too.
    #[test]
    fn the_grant_shares_the_locked_descriptor() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let config = FileConfig::new(dir.path());
        let path = dir.path().join("x.lock");
        let notifier = Arc::new(Notifier::default());
        let request = AcquireRequest::new("x", "owner-1", Duration::from_secs(30));
        let mut acquisition = FileAcquisition::new(path.clone(), &config);
        let attempt = runtime()
            .block_on(acquisition.try_once(&config, || None, &notifier, &request))
            .unwrap();
        let Attempt::Acquired(grant) = attempt else {
            panic!("a free lock file was busy");
        };
        let descriptor = grant
            .descriptor
            .clone()
            .expect("a file grant has a descriptor");
        let Some(Held::Exclusive(held)) = grant.lease.take() else {
            panic!("the lease holds the file exclusively");
        };
        assert!(
            Arc::ptr_eq(&descriptor, &held.file.fd),
            "the grant's descriptor {} is not the locked one {}",
            descriptor.as_raw_fd(),
            held.file.fd.as_raw_fd()
        );
        drop(grant);
        assert_eq!(
            held.release("owner-1"),
            distlock_core::raw::Released::Released
        );
        // Released through the lease: another open file description can lock it, while the
        // descriptor the core keeps stays open.
        let other = std::fs::File::open(&path).unwrap();
        rustix::fs::flock(&other, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .expect("the released file is still locked");
        assert!(rustix::io::fcntl_getfd(&*descriptor).is_ok());
    }

    /// A watch that ends (its reader stopped, or the file went) makes the wait return at once, without
    /// sleeping; the fallback poll must not grow then, or every lost watch would stretch the next
    /// poll without any time having passed.
    #[test]
    fn a_lost_watch_does_not_grow_the_poll() {
        let dir = tempfile::tempdir().unwrap();
        let config = FileConfig::new(dir.path());
        let path = dir.path().join("x.lock");
        std::fs::write(&path, b"").unwrap();
        let notifier = Arc::new(Notifier::default());
        let mut acquisition = FileAcquisition::new(path.clone(), &config);
        // The file deleted: the kernel drops the watch, and the watch ends.
        let mut watch = notifier.instance().unwrap().subscribe(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        runtime().block_on(async {
            let ended = async { while watch.changed().await {} };
            tokio::time::timeout(Duration::from_secs(2), ended)
                .await
                .expect("the deleted file's watch did not end");
        });
        acquisition.watch = Some(watch);
        runtime()
            .block_on(async {
                tokio::time::timeout(Duration::from_millis(10), acquisition.wait()).await
            })
            .expect("a lost watch ends the wait at once");
        assert!(acquisition.watch.is_none());
        assert_eq!(acquisition.backoff.nominal(), config.poll_initial);
    }

    /// The runtime that first asked for the inotify instance is dropped (here before its reader
    /// could ever have run on it): the instance's reader runs on distlock's background runtime, so
    /// a watch made then still gets events, and the next runtime shares the instance.
    #[test]
    fn the_instance_outlives_the_runtime_that_started_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lock");
        std::fs::write(&path, b"").unwrap();
        let notifier = Arc::new(Notifier::default());
        let mut early = watch_from_a_dropped_runtime(&notifier, &path);
        runtime().block_on(async {
            let mut fresh = notifier.instance().unwrap().subscribe(&path).unwrap();
            drop(std::fs::OpenOptions::new().write(true).open(&path).unwrap());
            for (name, watch) in [("early", &mut early), ("fresh", &mut fresh)] {
                let woken = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
                assert_eq!(
                    woken,
                    Ok(true),
                    "a close raised no event on the {name} watch"
                );
            }
        });
    }
}
