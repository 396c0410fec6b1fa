//! `impl raw::Backend` for lock files.
//!
//! # How an acquire runs
//!
//! Nothing ever blocks in `flock(2)`. A try is `flock(LOCK_EX | LOCK_NB)` on the lock file, opened once
//! per acquisition (`O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW`, mode 0666 less the umask) and kept open
//! between tries, so waiters do not raise close events for each other. The steps of a try, of a release
//! and of `inspect` (open, `flock` without blocking, stat, read and write of under 1 KiB) take
//! microseconds on a local file system and run inline; only the acquire's `fdatasync`, which can take
//! milliseconds, runs off the runtime's workers: on a thread kept for it, or on tokio's blocking pool
//! while that thread is busy (see `sync_thread.rs`).
//!
//! While busy, [`wait`](FileBackend::wait) sleeps until inotify reports that the file was closed (a
//! release: distlock unlocks and then closes; or a holder's death: the kernel closes its descriptors) or
//! until a fallback timer fires. The watch is added *before* the try whose `Busy` leads to a wait — a
//! first busy try adds it and tries again — so a release between the try and the wait is never missed.
//! The timer is jittered exponential backoff (from [`FileConfig::poll_initial`] up to
//! [`FileConfig::poll_max`], back to the start after every event). It covers what inotify cannot promise:
//! when a holding process dies, the kernel reports the close *before* it drops the lock
//! (`fsnotify_close` precedes `locks_remove_file` in `__fput`), so the try that follows the event can
//! still find the lock busy; the short delay after an event makes the next try come soon.
//!
//! So a bounded or cancelled wait leaves nothing behind: there is no thread blocked in `flock` that
//! could take the lock later, and dropping an acquisition closes its descriptor and its watch. A try
//! whose future is dropped while its `fdatasync` runs hands the locked file to nobody; the file's `Drop`
//! (on the thread that ran the sync) clears the holder record and unlocks.
//!
//! # Holding and releasing
//!
//! After the `flock` succeeds, the try checks that the path still names the file it locked (if the file
//! was deleted or replaced in between, it starts over on the new one), reads the last token, writes
//! token + 1 and the holder record, and `fdatasync`s before reporting the grant (see
//! [`FileConfig::sync`]). The grant has no TTL: the kernel holds a `flock` until it is released or the
//! process dies. It carries a loss signal that fires if the lock file is deleted or replaced while
//! held, since another process could then lock a new file of the same name.
//!
//! Release checks that the path still names the locked file and that the record still names this owner
//! and token, rewrites the record without the holder (keeping the token), unlocks, and closes the file.
//! The lock file itself is never unlinked: a waiter that had opened the old file would lock an inode
//! nobody else looks at.
//!
//! The other kinds follow the same rules (non-blocking tries, inotify wake-ups, nothing left behind by
//! a dropped acquire): a reader takes `LOCK_SH` on the same lock file, a writer is the mutex, and a
//! permit `LOCK_EX` on a slot file; see `acquire.rs` and `semaphore.rs`.
//!
//! The jobs live in files of their own: [`open`](crate::open) (the directory, the open file, the
//! record's I/O), [`acquire`](crate::acquire) (a try of each kind and the wait), [`semaphore`](crate::semaphore)
//! (the limit file, the slots, a permit's try), [`held`](crate::held) (the token, the release),
//! [`notify`](crate::notify) (inotify, and the watch of held files for loss),
//! [`inspect`](crate::inspect) (`status`).

use std::ffi::OsString;
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::Grant;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, HolderInfo, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{
    Capabilities, Error, ErrorKind, Fencing, LockKind, LockKinds, ReadWriteOrder, Result,
};

use crate::acquire::{downgraded_grant, FileAcquisition};
use crate::config::FileConfig;
use crate::error::{FileError, BACKEND};
use crate::held::{FileLease, Held};
use crate::inspect::inspect_name;
use crate::layout;
use crate::notify::{Notifier, Shared};
use crate::open::{open_read_only, prepare_dir};

/// The file backend: `flock(2)` locks on `<dir>/<escaped name>.lock`. Cheap to clone (clones share the
/// inotify instance).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use distlock_core::Locks;
/// use distlock_file::FileBackend;
///
/// let dir = tempfile::tempdir()?;
/// let backend = FileBackend::new(dir.path())?;
/// assert_eq!(backend.lock_file("orders/42"), dir.path().join("orders%2F42.lock"));
/// let locks = Locks::new(backend);
/// let guard = locks.lock("orders/42")?.acquire().await?;
/// assert!(guard.token().is_some());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FileBackend {
    config: Arc<FileConfig>,
    notifier: Arc<Notifier>,
}

impl fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileBackend")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl FileBackend {
    /// Locks in `dir`, created (mode 0755 less the umask) if missing, with the default options. A
    /// relative `dir` is made absolute now, so a later `chdir` does not move the locks.
    ///
    /// Fails with [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig) if `dir` is empty
    /// or cannot be a directory (a component is a regular file), and with
    /// [`ErrorKind::PermissionDenied`](distlock_core::ErrorKind::PermissionDenied) if it cannot be
    /// created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        Self::from_config(FileConfig::new(dir))
    }

    /// `file:///abs/dir`: see [`FileConfig::from_url`].
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::from_config(FileConfig::from_url(url)?)
    }

    /// A backend with the given configuration (checked with [`FileConfig::validate`]); creates the
    /// directory if missing.
    pub fn from_config(config: FileConfig) -> Result<Self> {
        config.validate()?;
        let mut config = config;
        config.dir = prepare_dir(&config.dir).map_err(|e| e.into_core(None))?;
        let notifier = Notifier::default();
        // Inotify off: held files are checked by the keeper's poll, not watched.
        notifier
            .disabled
            .store(!config.notify, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            config: Arc::new(config),
            notifier: Arc::new(notifier),
        })
    }

    /// The lock directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.config.dir
    }

    /// The configuration in use.
    pub fn config(&self) -> &FileConfig {
        &self.config
    }

    /// The lock file of `name` (see [`layout::file_name`]). It may not exist yet.
    pub fn lock_file(&self, name: &str) -> PathBuf {
        // `dir.join(file_name(name))` in one buffer (issue 9: allocations per acquire).
        let dir = self.config.dir.as_os_str().as_bytes();
        let mut path = Vec::with_capacity(dir.len() + 1 + name.len() + 16);
        path.extend_from_slice(dir);
        if !dir.ends_with(b"/") {
            path.push(b'/');
        }
        layout::push_file_name(&mut path, name);
        PathBuf::from(OsString::from_vec(path))
    }

    fn watcher(&self) -> Option<Arc<Shared>> {
        if self.config.notify {
            self.notifier.instance()
        } else {
            None
        }
    }
}

#[async_trait]
impl Backend for FileBackend {
    type Lease = FileLease;
    type Acquisition = FileAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    /// A mutex with no server-side TTL (held until released or the process dies), strict fencing (with
    /// [`FileConfig::sync`]; best-effort without), notification by inotify (with
    /// [`FileConfig::notify`]). Not FIFO: when a lock is released, every waiting process tries at once
    /// and the kernel lets one win, in no particular order (inside one `Locks`, the core still queues
    /// waiters in order).
    ///
    /// Lock kinds: the read-write lock (writers first: a writer waiting behind readers keeps new
    /// readers out, through the turnstile; see `acquire.rs`), with an atomic downgrade, and the
    /// semaphore (see `semaphore.rs`). A name's mutex is its write lock.
    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_kinds(
                LockKinds::mutex_only()
                    .with_read_write(ReadWriteOrder::WritersFirst)
                    .with_atomic_downgrade()
                    .with_semaphore(),
            )
            .with_server_ttl(false)
            .with_fencing(if self.config.sync {
                Fencing::Strict
            } else {
                Fencing::BestEffort
            })
            .with_notify_wait(self.config.notify)
            .with_frees_on_process_death(true)
            .with_fifo(false)
    }

    /// Refuses a semaphore of more than [`layout::MAX_SLOTS`] permits (`Unsupported`), before any
    /// I/O.
    fn begin(&self, request: &AcquireRequest) -> Result<FileAcquisition> {
        if let LockKind::Permit { limit } = request.kind {
            if limit > layout::MAX_SLOTS {
                return Err(
                    FileError::TooManyPermits { requested: limit }.into_core(Some(&request.name))
                );
            }
        }
        Ok(FileAcquisition::new(
            self.lock_file(&request.name),
            &self.config,
        ))
    }

    /// One try: open the lock file (kept open between tries), `flock` without blocking, and on success
    /// mint the next token and make it durable (see the module docs of `acquire.rs`).
    ///
    /// # Cancel safety
    /// The only await is the `fdatasync` off the runtime's workers, which finishes even if this future is
    /// dropped; the locked file is then dropped with its result, which clears the record and unlocks.
    async fn try_acquire(
        &self,
        acquisition: &mut FileAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<FileLease>> {
        acquisition
            .try_once(&self.config, || self.watcher(), &self.notifier, request)
            .await
    }

    /// Waits for an inotify event on the lock file or the fallback timer, whichever is first.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits. Events that arrive meanwhile are kept for the next wait.
    async fn wait(
        &self,
        acquisition: &mut FileAcquisition,
        _request: &AcquireRequest,
        _retry_after: Option<Duration>,
    ) -> Result<()> {
        acquisition.wait().await;
        Ok(())
    }

    /// An acquisition holds no lock: a try that locks the file moves it straight into the grant (or,
    /// if nobody receives the grant, unlocks it as it drops). Dropping the acquisition closes its
    /// descriptor and its watch.
    async fn abandon(&self, acquisition: FileAcquisition, _request: &AcquireRequest) {
        drop(acquisition);
    }

    /// A file lock cannot expire, and the core never renews grants without a TTL. If asked anyway, a
    /// lease still held is confirmed as `Extended` with the TTL asked for, and a released one is `Gone`.
    async fn renew(&self, batch: &[Renewal<'_, FileLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        batch
            .iter()
            .map(|entry| {
                let outcome = if entry.lease.is_held() {
                    Renewed::Extended { ttl: entry.ttl }
                } else {
                    Renewed::Gone {
                        reason: "the file lock was released".into(),
                    }
                };
                (entry.id, Ok(outcome))
            })
            .collect()
    }

    /// # Cancel safety
    /// Cancel safe: it completes without awaiting.
    async fn release(&self, lease: &FileLease, _name: &str, owner: &str) -> Result<Released> {
        Ok(match lease.take() {
            Some(held) => held.release(owner),
            None => Released::NotHeld,
        })
    }

    /// The lock file's holder (from its record, testing the lock without taking it), its readers
    /// (from `/proc/locks`), or the semaphore's permit holders (from the slot files' records); see
    /// `inspect.rs`. A missing file is a free lock with no token yet.
    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        inspect_name(&self.lock_file(name)).map_err(|e| e.into_core(Some(name)))
    }

    /// A `flock` belongs to the open file of the process holding it: no other process can take it
    /// away. Refused, naming the holder's process, which is what can be ended.
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let who = match (holder.pid, holder.host.as_deref()) {
            (Some(pid), Some(host)) => format!("pid {pid} on {host}"),
            (Some(pid), None) => format!("pid {pid}"),
            _ => "its holding process".to_string(),
        };
        Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "a file lock (flock) cannot be broken: it is held by {who} and is freed the moment that process ends (end it, e.g. kill it, to free the lock)"
            ),
        )
        .with_backend(BACKEND)
        .with_lock(name))
    }

    /// `flock(LOCK_SH)` on the write hold's own descriptor: on Linux the kernel swaps the lock in one
    /// step (see `OpenFile::downgrade`), so no writer, distlock's or `flock -x`, gets in between.
    /// The holder record is cleared first. Waiting readers are woken with a read-only open and close of
    /// the lock file (the downgrade itself closes nothing).
    ///
    /// # Cancel safety
    /// Completes without awaiting.
    async fn downgrade(
        &self,
        lease: &FileLease,
        read: &AcquireRequest,
    ) -> Result<Grant<FileLease>> {
        let core = |e: FileError| e.into_core(Some(&read.name));
        let held = match lease.take() {
            Some(Held::Exclusive(held)) => held,
            Some(other) => {
                lease.restore(other);
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "only a write hold can be downgraded",
                )
                .with_backend(BACKEND)
                .with_lock(&read.name));
            }
            None => {
                return Err(
                    Error::new(ErrorKind::NotHeld, "the write lock was no longer held")
                        .with_backend(BACKEND)
                        .with_lock(&read.name),
                )
            }
        };
        let path = held.path.clone();
        let shared = held.downgrade().map_err(core)?;
        // Readers waiting for this writer wake on the close (`CLOSE_NOWRITE`).
        drop(open_read_only(&path, false));
        Ok(downgraded_grant(shared, &self.notifier, read))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::held::tests_support::syncs;

    /// With `sync` (the default) every grant's token is made durable once, before the grant is
    /// reported, however many acquires sync at once (the sync thread takes one, the blocking pool the
    /// rest); without `sync`, never.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_grant_is_synced_once_before_it_is_reported() {
        for sync in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let backend =
                FileBackend::from_config(FileConfig::new(dir.path()).with_sync(sync)).unwrap();
            let locks = Arc::new(distlock_core::Locks::new(backend.clone()));
            let expected = move |cycles: usize| if sync { cycles } else { 0 };
            let lock = locks.lock("one").unwrap();
            for cycle in 1..=5 {
                let guard = lock.acquire().await.unwrap();
                assert_eq!(syncs(&backend.lock_file("one")), expected(cycle));
                guard.release().await.unwrap();
            }
            let tasks: Vec<_> = (0..8)
                .map(|task| {
                    let (locks, backend) = (locks.clone(), backend.clone());
                    tokio::spawn(async move {
                        let name = format!("many-{task}");
                        let lock = locks.lock(&name).unwrap();
                        for cycle in 1..=5 {
                            let guard = lock.acquire().await.unwrap();
                            assert_eq!(syncs(&backend.lock_file(&name)), expected(cycle));
                            guard.release().await.unwrap();
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        }
    }

    /// The path built in one buffer is `dir.join(file_name(name))`, long and escaped names included,
    /// with or without a trailing `/` on the directory.
    #[test]
    fn lock_file_is_the_directory_joined_with_the_file_name() {
        let dir = tempfile::tempdir().unwrap();
        let slashed = format!("{}/", dir.path().display());
        let names = [
            "a".to_string(),
            "orders/42".into(),
            ".hidden".into(),
            "größe 100%".into(),
            "x".repeat(1024),
            format!("{}{}", "a".repeat(181), "/".repeat(40)),
            format!("{}{}", "a".repeat(182), "/".repeat(40)),
        ];
        for backend in [
            FileBackend::new(dir.path()).unwrap(),
            FileBackend::new(&slashed).unwrap(),
        ] {
            for name in &names {
                assert_eq!(
                    backend.lock_file(name),
                    backend.dir().join(layout::file_name(name)),
                    "{name:?} in {}",
                    backend.dir().display()
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watches_end_with_the_holds_and_waits_that_made_them() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let notifier = backend.notifier.clone();
        let locks = distlock_core::Locks::new(backend);
        let other = distlock_core::Locks::new(FileBackend::new(dir.path()).unwrap());
        for i in 0..20 {
            let name = format!("w{}", i % 3);
            locks
                .lock(&name)
                .unwrap()
                .acquire()
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
            // A wait that times out, and one that is woken.
            let held = other.lock(&name).unwrap().acquire().await.unwrap();
            let lock = locks.lock(&name).unwrap();
            assert!(lock
                .options()
                .wait(Duration::from_millis(20))
                .acquire()
                .await
                .is_err());
            let waiting = tokio::spawn(async move { lock.acquire().await });
            tokio::time::sleep(Duration::from_millis(5)).await;
            held.release().await.unwrap();
            waiting.await.unwrap().unwrap().release().await.unwrap();
        }
        // The holds' references end with their releases; the waits' with the waits.
        assert_eq!(notifier.held_count(), 0, "records of released holds kept");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while notifier.watch_count() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} watches left",
                notifier.watch_count()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    const BOUND: Duration = Duration::from_secs(5);

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn names(count: usize) -> Vec<String> {
        (0..count).map(|i| format!("h{i}")).collect()
    }

    /// Held lock files cost no task each: the runtime runs as many tasks with 40 holds as with one
    /// (the inotify reader, whatever the core keeps), and a deleted one is still reported Lost
    /// promptly, the others staying Held. With a loss future per hold, the core ran a task per hold.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_files_are_watched_with_no_task_per_hold() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let locks = distlock_core::Locks::new(backend.clone());
        let metrics = tokio::runtime::Handle::current().metrics();
        let first = locks.lock("h-first").unwrap().acquire().await.unwrap();
        let with_one = metrics.num_alive_tasks();
        let mut guards = Vec::new();
        for name in names(40) {
            guards.push(locks.lock(&name).unwrap().acquire().await.unwrap());
        }
        let with_many = metrics.num_alive_tasks();
        assert!(
            with_many < with_one + 5,
            "{with_one} tasks with one hold, {with_many} with 41"
        );
        assert_eq!(backend.notifier.held_count(), 41);

        std::fs::remove_file(backend.lock_file("h7")).unwrap();
        tokio::time::timeout(BOUND, guards[7].lost())
            .await
            .expect("the deletion went unnoticed");
        assert!(guards[7].loss_reason().unwrap().contains("deleted"));
        for (i, guard) in guards.iter().enumerate().filter(|(i, _)| *i != 7) {
            assert_eq!(guard.state(), distlock_core::LockState::Held, "h{i}");
        }
        assert_eq!(first.state(), distlock_core::LockState::Held);
        // The lost hold's record went with its report.
        assert_eq!(backend.notifier.held_count(), 40);
    }

    /// Holds acquired on a runtime that is then dropped (its inotify reader with it) stay watched:
    /// one file was replaced while that runtime was not driven (the event died with the reader, so
    /// only a check after watching again sees it), another is deleted later, on another runtime
    /// that never touches the backend. Both are reported; the rest stay Held.
    #[test]
    fn holds_outliving_their_runtime_stay_watched() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let locks = distlock_core::Locks::new(backend.clone());
        let first = current_thread();
        let guards: Vec<_> = first.block_on(async {
            let mut guards = Vec::new();
            for name in names(10) {
                guards.push(locks.lock(&name).unwrap().acquire().await.unwrap());
            }
            guards
        });
        // Replaced by a rename over it, while nobody reads the first runtime's inotify events.
        let other = dir.path().join("other");
        std::fs::write(&other, b"").unwrap();
        std::fs::rename(&other, backend.lock_file("h3")).unwrap();
        drop(first);

        current_thread().block_on(async {
            tokio::time::timeout(BOUND, guards[3].lost())
                .await
                .expect("a replacement while the reader was down went unnoticed");
            // Watched again by now (the replacement was seen after the new watch): a later
            // deletion is an event for the new reader.
            std::fs::remove_file(backend.lock_file("h6")).unwrap();
            tokio::time::timeout(BOUND, guards[6].lost())
                .await
                .expect("a deletion after the runtime was dropped went unnoticed");
            for (i, guard) in guards.iter().enumerate() {
                if i != 3 && i != 6 {
                    assert_eq!(guard.state(), distlock_core::LockState::Held, "h{i}");
                }
            }
        });
        assert_eq!(backend.notifier.held_count(), 8);
    }

    /// Without inotify (here: disabled before the grants), held files are checked every second by
    /// one task for all of them, not one per hold.
    #[test]
    fn without_inotify_one_task_checks_every_held_file() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let locks = distlock_core::Locks::new(backend.clone());
        let background = distlock_core::raw::background_runtime().unwrap();
        let before = background.metrics().num_alive_tasks();
        backend
            .notifier
            .disabled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let first = current_thread();
        let guards: Vec<_> = first.block_on(async {
            let mut guards = Vec::new();
            for name in names(20) {
                guards.push(locks.lock(&name).unwrap().acquire().await.unwrap());
            }
            guards
        });
        drop(first);

        current_thread().block_on(async {
            std::fs::remove_file(backend.lock_file("h11")).unwrap();
            tokio::time::timeout(BOUND, guards[11].lost())
                .await
                .expect("the deletion went unnoticed without inotify");
            // Far from one per hold, with room for other tests' background work (`cargo test` runs
            // them in one process).
            let checkers = background
                .metrics()
                .num_alive_tasks()
                .saturating_sub(before);
            assert!(checkers < 10, "{checkers} tasks check 19 held files");
            assert_eq!(guards[0].state(), distlock_core::LockState::Held);
        });
    }

    /// A released hold's record goes at the release (and a dropped guard's with its release in the
    /// background), with its reference on the inotify watch: nothing grows with the holds made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn released_holds_are_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let backend = FileBackend::new(dir.path()).unwrap();
        let locks = distlock_core::Locks::new(backend.clone());
        for round in 0..50 {
            let guard = locks
                .lock(&format!("r{}", round % 7))
                .unwrap()
                .acquire()
                .await
                .unwrap();
            assert_eq!(backend.notifier.held_count(), 1);
            guard.release().await.unwrap();
            assert_eq!(backend.notifier.held_count(), 0, "round {round}");
            assert_eq!(backend.notifier.watch_count(), 0, "round {round}");
        }
        let dropped = locks.lock("dropped").unwrap().acquire().await.unwrap();
        drop(dropped);
        let deadline = tokio::time::Instant::now() + BOUND;
        while backend.notifier.held_count() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a dropped guard's record kept"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(backend.notifier.watch_count(), 0);
    }
}
