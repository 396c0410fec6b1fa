//! `impl raw::Backend` for lock files.
//!
//! # How an acquire runs
//!
//! Nothing ever blocks in `flock(2)`. A try is `flock(LOCK_EX | LOCK_NB)` on the lock file, opened once
//! per acquisition (`O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW`, mode 0666 less the umask) and kept open
//! between tries, so waiters do not raise close events for each other. The steps of a try, of a release
//! and of `inspect` (open, `flock` without blocking, stat, read and write of under 1 KiB) take
//! microseconds on a local file system and run inline; only the acquire's `fdatasync`, which can take
//! milliseconds, runs on tokio's blocking pool (a hop there costs tens of microseconds, more than all
//! the inline steps together).
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
//! (on the blocking pool's thread) clears the holder record and unlocks.
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

use std::fmt;
use std::fs::{DirBuilder, File, OpenOptions};
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, LossSignal, Released, Renewal,
    RenewalId, Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Fencing, FencingToken, Result};
use rustix::fs::{flock, FlockOperation, OFlags};
use rustix::io::Errno;

use crate::config::FileConfig;
use crate::error::{FileError, BACKEND};
use crate::layout::{self, Record, MAX_RECORD_BYTES};
use crate::notify::{Notifier, Shared, Subscription};

/// How many times one try starts over because the lock file was deleted or replaced under it.
const MAX_ROUNDS: usize = 8;

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

    /// A backend with the given configuration; creates the directory if missing.
    pub fn from_config(config: FileConfig) -> Result<Self> {
        let mut config = config;
        config.dir = prepare_dir(&config.dir).map_err(|e| e.into_core(None))?;
        Ok(Self {
            config: Arc::new(config),
            notifier: Arc::new(Notifier::default()),
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
        self.config.dir.join(layout::file_name(name))
    }

    fn watcher(&self) -> Option<Arc<Shared>> {
        if self.config.notify {
            self.notifier.instance()
        } else {
            None
        }
    }
}

/// Makes `dir` absolute and creates it if missing.
fn prepare_dir(dir: &Path) -> Result<PathBuf, FileError> {
    if dir.as_os_str().is_empty() {
        return Err(FileError::Config(
            "the lock directory must not be empty; pass a directory such as /var/lock/myapp".into(),
        ));
    }
    let dir = std::path::absolute(dir).map_err(|e| FileError::io("resolve", dir, e))?;
    create_dir(&dir)?;
    Ok(dir)
}

fn create_dir(dir: &Path) -> Result<(), FileError> {
    match DirBuilder::new().recursive(true).mode(0o755).create(dir) {
        Ok(()) => Ok(()),
        Err(e) => {
            if dir.exists() && !dir.is_dir() {
                return Err(FileError::Config(format!(
                    "the lock directory {} exists but is not a directory",
                    dir.display()
                )));
            }
            Err(FileError::io("create the lock directory", dir, e))
        }
    }
}

fn host_name() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned()
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs slow file work (`fdatasync`) on tokio's blocking pool (inline when there is no runtime). If the
/// caller's future is dropped, the work still finishes and its result is dropped, which undoes it (see
/// [`HeldFile`]'s `Drop`).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, FileError> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => runtime
            .spawn_blocking(work)
            .await
            .map_err(|e| FileError::Task(e.to_string())),
        Err(_) => Ok(work()),
    }
}

// ---------------------------------------------------------------------------------------------
// An open lock file.

/// A lock file opened for an acquisition, and whether this descriptor holds its `flock`.
#[derive(Debug)]
struct OpenFile {
    file: File,
    dev: u64,
    ino: u64,
    locked: bool,
}

impl OpenFile {
    /// Opens (creating if needed) the lock file read-write. std opens with `O_CLOEXEC`, so no child
    /// process ever inherits the descriptor, and with it the lock; `O_NOFOLLOW` refuses a planted
    /// symbolic link.
    fn open(path: &Path, dir: &Path) -> Result<Self, FileError> {
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o666)
                .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32)
                .open(path)
        };
        let file = match open() {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // The directory went away (a tmp cleaner); make it again.
                create_dir(dir)?;
                open().map_err(|e| FileError::io("open", path, e))?
            }
            Err(e) => return Err(FileError::io("open", path, e)),
        };
        let meta = file
            .metadata()
            .map_err(|e| FileError::io("stat", path, e))?;
        if !meta.is_file() {
            return Err(FileError::Config(format!(
                "{} is not a regular file; remove it so distlock can use it as a lock file",
                path.display()
            )));
        }
        Ok(Self {
            file,
            dev: meta.dev(),
            ino: meta.ino(),
            locked: false,
        })
    }

    /// `flock(LOCK_EX | LOCK_NB)`: whether this descriptor now holds the lock.
    fn try_lock(&mut self, path: &Path) -> Result<bool, FileError> {
        loop {
            match flock(&self.file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {
                    self.locked = true;
                    return Ok(true);
                }
                Err(Errno::WOULDBLOCK) => return Ok(false),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(FileError::io("lock", path, e.into())),
            }
        }
    }

    /// Whether `path` still names this file (not deleted, not replaced by another).
    fn is_current(&self, path: &Path) -> Result<bool, FileError> {
        same_file(path, self.dev, self.ino)
    }

    fn unlock(&mut self) {
        if self.locked {
            self.locked = false;
            if let Err(e) = flock(&self.file, FlockOperation::Unlock) {
                tracing::warn!(error = %e, "cannot unlock a lock file; closing it releases the lock");
            }
        }
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        // Unlock before the close: the close wakes waiters, and the kernel's own unlock at close comes
        // after that notification.
        self.unlock();
    }
}

fn same_file(path: &Path, dev: u64, ino: u64) -> Result<bool, FileError> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(meta.dev() == dev && meta.ino() == ino),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(FileError::io("stat", path, e)),
    }
}

fn read_content(file: &File, path: &Path) -> Result<Vec<u8>, FileError> {
    let mut buf = vec![0u8; MAX_RECORD_BYTES + 1];
    let mut len = 0;
    while len < buf.len() {
        match file.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len < buf.len() {
                    // A short read of a regular file is its end: no second call to learn that.
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FileError::io("read", path, e)),
        }
    }
    if len > MAX_RECORD_BYTES {
        return Err(FileError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("it is larger than {MAX_RECORD_BYTES} bytes"),
        });
    }
    buf.truncate(len);
    Ok(buf)
}

/// Writes `record` over the file's content of `old_len` bytes.
fn write_record(
    file: &File,
    path: &Path,
    record: &Record,
    old_len: usize,
) -> Result<usize, FileError> {
    let text = record.render();
    // Written over the old record, then cut to length: the file never goes through an empty state
    // in which a crash would lose the counter.
    file.write_all_at(text.as_bytes(), 0)
        .map_err(|e| FileError::io("write", path, e))?;
    if text.len() < old_len {
        file.set_len(text.len() as u64)
            .map_err(|e| FileError::io("truncate", path, e))?;
    }
    Ok(text.len())
}

fn sync_dir(dir: &Path) -> Result<(), FileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| FileError::io("sync the lock directory", dir, e))
}

// ---------------------------------------------------------------------------------------------
// A held lock.

/// A lock file this process holds, with the token it wrote. Dropped without [`release`](Self::release)
/// (a try whose future was dropped, a lease dropped unreleased), it clears the holder from the record
/// and unlocks.
#[derive(Debug)]
struct HeldFile {
    file: OpenFile,
    path: PathBuf,
    token: u64,
    owner: String,
    /// The length of the record this hold wrote.
    len: usize,
    /// Whether `Drop` must still clear the record.
    armed: bool,
}

impl HeldFile {
    /// Mints the next token on a locked file: reads the last one and writes it + 1 with the holder
    /// record. Returns the held file and whether this was the file's first token. Not yet durable: see
    /// [`sync`](Self::sync).
    fn take(file: OpenFile, path: &Path, owner: &str) -> Result<(Self, bool), FileError> {
        let content = read_content(&file.file, path)?;
        let last = Record::parse(&content).map_err(|detail| FileError::Corrupt {
            path: path.to_path_buf(),
            detail,
        })?;
        let token = last
            .token
            .checked_add(1)
            .ok_or_else(|| FileError::TokenOverflow {
                path: path.to_path_buf(),
            })?;
        let mut record = Record::released(token);
        record.owner = Some(owner.to_string());
        record.pid = Some(std::process::id());
        record.host = Some(host_name().to_string());
        record.since_ms = Some(now_ms());
        let len = write_record(&file.file, path, &record, content.len())?;
        let held = HeldFile {
            file,
            path: path.to_path_buf(),
            token,
            owner: owner.to_string(),
            len,
            armed: true,
        };
        Ok((held, last.token == 0))
    }

    /// Makes the new token durable; the grant is reported only after this, so a token never repeats
    /// after a crash. For a file's first token the directory entry is synced too. On failure the held
    /// file is dropped, which unlocks it.
    fn sync(self, dir: &Path, first_token: bool) -> Result<Self, FileError> {
        self.file
            .file
            .sync_data()
            .map_err(|e| FileError::io("sync", &self.path, e))?;
        if first_token {
            sync_dir(dir)?;
        }
        Ok(self)
    }

    /// Releases the lock: `Released` if the file and its record were still this hold's, `NotHeld` if the
    /// lock file was deleted or replaced, or its record names another holder. Unlocks either way.
    fn release(mut self, owner: &str) -> Released {
        self.armed = false;
        match self.check(owner) {
            Ok(()) => {
                if let Err(e) = write_record(
                    &self.file.file,
                    &self.path,
                    &Record::released(self.token),
                    self.len,
                ) {
                    // The record only feeds `status`, which tests the lock itself.
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot clear the holder record");
                }
                Released::Released
            }
            Err(reason) => {
                tracing::warn!(path = %self.path.display(), %reason, "released a lock file that was no longer this owner's");
                Released::NotHeld
            }
        }
        // `self.file` unlocks and closes as it drops.
    }

    /// Whether this hold still owns the lock file: same file at the path, record naming this owner and
    /// token. An unreadable record does not disprove it (we hold the `flock`); rewriting it repairs it.
    fn check(&self, owner: &str) -> Result<(), String> {
        match self.file.is_current(&self.path) {
            Ok(true) => {}
            Ok(false) => return Err("the lock file was deleted or replaced while held".into()),
            Err(e) => tracing::debug!(error = %e, "cannot stat the lock file at release"),
        }
        let record = read_content(&self.file.file, &self.path)
            .ok()
            .and_then(|c| Record::parse(&c).ok());
        match record {
            Some(r) if r.owner.as_deref() != Some(owner) || r.token != self.token => Err(format!(
                "the record names owner {:?} with token {}, not this hold ({owner:?}, token {})",
                r.owner.unwrap_or_default(),
                r.token,
                self.token
            )),
            _ => Ok(()),
        }
    }
}

impl Drop for HeldFile {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = write_record(
                &self.file.file,
                &self.path,
                &Record::released(self.token),
                self.len,
            ) {
                tracing::debug!(error = %e, "cannot clear the holder record of a dropped lock");
            }
            tracing::debug!(path = %self.path.display(), owner = %self.owner, "unreleased lock file dropped; unlocking");
        }
    }
}

/// The backend's record of a held lock: the locked file, until it is released.
pub struct FileLease {
    held: Mutex<Option<HeldFile>>,
    path: PathBuf,
    token: u64,
}

impl fmt::Debug for FileLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileLease")
            .field("path", &self.path)
            .field("token", &self.token)
            .field("held", &self.is_held())
            .finish()
    }
}

impl FileLease {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fencing token of this hold.
    pub fn token(&self) -> FencingToken {
        FencingToken::new(self.token)
    }

    fn take(&self) -> Option<HeldFile> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn is_held(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

/// Fires if the held lock file is deleted or replaced (then another process can lock a new file of the
/// same name, with a counter that starts over).
///
/// The inotify reader runs on a runtime; if that runtime is dropped while the lock is held (a `Locks`
/// used from several runtimes), the watch ends and a new one is taken on the runtime this signal is
/// polled on now, checking the file in between so a deletion in the gap is not missed. Without inotify
/// the file is checked every second.
fn loss_signal(
    mut watch: Subscription,
    notifier: Arc<Notifier>,
    path: PathBuf,
    dev: u64,
    ino: u64,
) -> LossSignal {
    let deleted = move |path: &Path| {
        format!(
            "the lock file {} was deleted or replaced while held; another process can now lock a new file of that name",
            path.display()
        )
    };
    Box::pin(async move {
        loop {
            let alive = watch.changed().await;
            if alive {
                match same_file(&path, dev, ino) {
                    Ok(true) => continue,
                    Ok(false) => return deleted(&path),
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot check the lock file");
                        continue;
                    }
                }
            }
            // The reader stopped: watch again, then look, so nothing between the two is missed.
            loop {
                let renewed = notifier
                    .instance()
                    .and_then(|shared| shared.subscribe(&path).ok());
                match same_file(&path, dev, ino) {
                    Ok(false) => return deleted(&path),
                    Ok(true) => {}
                    Err(e) => tracing::debug!(error = %e, "cannot check the lock file"),
                }
                if let Some(renewed) = renewed {
                    watch = renewed;
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Acquisitions.

/// The fallback poll's state: jittered exponential backoff, reset by every event.
#[derive(Debug, Clone)]
struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            current: initial,
        }
    }

    /// The next delay: uniformly in [current/2, current], so waiters of several processes spread out.
    fn delay(&self) -> Duration {
        let half = self.current / 2;
        let spread = u64::try_from(half.as_micros()).unwrap_or(u64::MAX).max(1);
        let random = RandomState::new().hash_one(std::time::Instant::now());
        half + Duration::from_micros(random % (spread + 1))
    }

    fn grow(&mut self) {
        self.current = (self.current * 2).min(self.max);
    }

    fn reset(&mut self) {
        self.current = self.initial;
    }
}

/// One acquire under way: the open lock file (kept between tries), its watch, and the poll's backoff.
#[derive(Debug)]
pub struct FileAcquisition {
    path: PathBuf,
    file: Option<OpenFile>,
    watch: Option<Subscription>,
    watch_failed: bool,
    backoff: Backoff,
}

/// One try (inline: microseconds). Owns what it needs; its outcome goes back into the acquisition.
struct TryJob {
    path: PathBuf,
    dir: PathBuf,
    owner: String,
    file: Option<OpenFile>,
    watch: Option<Subscription>,
    watcher: Option<Arc<Shared>>,
    watch_failed: bool,
}

enum TryOutcome {
    Acquired {
        held: HeldFile,
        first_token: bool,
        watch: Option<Subscription>,
    },
    Busy {
        file: OpenFile,
        watch: Option<Subscription>,
        watch_failed: bool,
    },
}

impl TryJob {
    fn run(mut self) -> Result<TryOutcome, FileError> {
        for _ in 0..MAX_ROUNDS {
            let mut file = match self.file.take() {
                Some(file) => file,
                None => {
                    // A new file: a watch of the old one is useless.
                    self.watch = None;
                    OpenFile::open(&self.path, &self.dir)?
                }
            };
            let locked = file.try_lock(&self.path)?;
            let fresh_watch = self.watch.is_none() && self.subscribe();
            // The watch follows the path, the lock the descriptor: both must be on the same file.
            if !file.is_current(&self.path)? {
                tracing::debug!(path = %self.path.display(), "lock file replaced under a try; reopening");
                self.watch = None;
                continue;
            }
            if locked {
                let (held, first_token) = HeldFile::take(file, &self.path, &self.owner)?;
                return Ok(TryOutcome::Acquired {
                    held,
                    first_token,
                    watch: self.watch,
                });
            }
            if fresh_watch {
                // Busy before the watch existed: a release in between raised no event, so look again.
                self.file = Some(file);
                continue;
            }
            return Ok(TryOutcome::Busy {
                file,
                watch: self.watch,
                watch_failed: self.watch_failed,
            });
        }
        Err(FileError::Replaced { path: self.path })
    }

    /// Adds the watch; `true` if one was added now.
    fn subscribe(&mut self) -> bool {
        if self.watch_failed {
            return false;
        }
        let Some(watcher) = &self.watcher else {
            return false;
        };
        match watcher.subscribe(&self.path) {
            Ok(watch) => {
                self.watch = Some(watch);
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot watch the lock file; waiting by polling only");
                self.watch_failed = true;
                false
            }
        }
    }
}

fn inspect_file(path: &Path) -> Result<LockInfo, FileError> {
    // Read-only: closing it raises no IN_CLOSE_WRITE, which would wake waiters for nothing.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LockInfo::default()),
        Err(e) => return Err(FileError::io("open", path, e)),
    };
    // The record can change between the read and the probe; read it on both sides until they agree.
    let mut content = read_content(&file, path)?;
    let mut held;
    let mut rounds = 0;
    loop {
        held = loop {
            match flock(&file, FlockOperation::NonBlockingLockShared) {
                Ok(()) => {
                    // Free: give the probe back at once (before the close, which wakes waiters).
                    let _ = flock(&file, FlockOperation::Unlock);
                    break false;
                }
                Err(Errno::WOULDBLOCK) => break true,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(FileError::io("test the lock on", path, e.into())),
            }
        };
        let again = read_content(&file, path)?;
        rounds += 1;
        if again == content || rounds >= 3 {
            content = again;
            break;
        }
        content = again;
    }
    let record = match Record::parse(&content) {
        Ok(record) => record,
        Err(detail) => {
            tracing::warn!(path = %path.display(), %detail, "unreadable lock file record");
            Record::default()
        }
    };
    let mut info = LockInfo::default();
    info.last_token = (record.token > 0).then(|| FencingToken::new(record.token));
    if held {
        // Held: the record describes the holder, unless the lock was taken by another tool (or the
        // holder has not written it yet), in which case the holder is unknown.
        let mut holder = HolderInfo::default();
        if record.has_holder() {
            holder.owner = record.owner.clone();
            holder.token = info.last_token;
            holder.pid = record.pid;
            holder.host = record.host.clone();
            holder.since = record.since();
        }
        info.holder = Some(holder);
    }
    Ok(info)
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
    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
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

    fn begin(&self, request: &AcquireRequest) -> Result<FileAcquisition> {
        Ok(FileAcquisition {
            path: self.lock_file(&request.name),
            file: None,
            watch: None,
            watch_failed: false,
            backoff: Backoff::new(self.config.poll_initial, self.config.poll_max),
        })
    }

    /// # Cancel safety
    /// The only await is the `fdatasync` on the blocking pool, which finishes even if this future is
    /// dropped; the locked file is then dropped with its result, which clears the record and unlocks.
    async fn try_acquire(
        &self,
        acquisition: &mut FileAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<FileLease>> {
        let job = TryJob {
            path: acquisition.path.clone(),
            dir: self.config.dir.clone(),
            owner: request.owner.clone(),
            file: acquisition.file.take(),
            watch: acquisition.watch.take(),
            watcher: if acquisition.watch_failed {
                None
            } else {
                self.watcher()
            },
            watch_failed: acquisition.watch_failed,
        };
        let outcome = job.run().map_err(|e| e.into_core(Some(&request.name)))?;
        match outcome {
            TryOutcome::Acquired {
                mut held,
                first_token,
                watch,
            } => {
                if self.config.sync {
                    let dir = self.config.dir.clone();
                    held = blocking(move || held.sync(&dir, first_token))
                        .await
                        .and_then(|r| r)
                        .map_err(|e| e.into_core(Some(&request.name)))?;
                }
                let (path, token) = (held.path.clone(), held.token);
                let (dev, ino) = (held.file.dev, held.file.ino);
                // A duplicate shares the open file description and so the `flock`: whoever inherits
                // it keeps the lock held (`dup` with close-on-exec, like the original).
                let descriptor =
                    held.file.file.as_fd().try_clone_to_owned().map_err(|e| {
                        FileError::io("dup", &path, e).into_core(Some(&request.name))
                    })?;
                tracing::debug!(lock = %request.name, token, "file lock acquired");
                let lease = FileLease {
                    held: Mutex::new(Some(held)),
                    path: path.clone(),
                    token,
                };
                let mut grant = Grant::new(lease)
                    .with_token(FencingToken::new(token))
                    .with_descriptor(descriptor);
                if let Some(watch) = watch {
                    grant =
                        grant.with_loss(loss_signal(watch, self.notifier.clone(), path, dev, ino));
                }
                Ok(Attempt::Acquired(grant))
            }
            TryOutcome::Busy {
                file,
                watch,
                watch_failed,
            } => {
                acquisition.file = Some(file);
                acquisition.watch = watch;
                acquisition.watch_failed = watch_failed;
                Ok(Attempt::Busy { retry_after: None })
            }
        }
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
        let delay = acquisition.backoff.delay();
        let event = match acquisition.watch.as_mut() {
            Some(watch) => tokio::select! {
                alive = watch.changed() => Some(alive),
                () = tokio::time::sleep(delay) => None,
            },
            None => {
                tokio::time::sleep(delay).await;
                None
            }
        };
        match event {
            Some(true) => acquisition.backoff.reset(),
            // The watch is gone (the file was deleted, or the reader stopped): the next try reopens
            // the path and watches it again.
            Some(false) => acquisition.watch = None,
            None => acquisition.backoff.grow(),
        }
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

    /// Reads the record without locking (read-only, so it wakes no waiter) and tests the lock with a
    /// non-blocking shared `flock` that is given back at once. A missing file is a free lock with no
    /// token yet.
    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        inspect_file(&self.lock_file(name)).map_err(|e| e.into_core(Some(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // The loss watchers end with their holds, in tasks of their own.
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

    #[test]
    fn backoff_grows_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(35));
        for _ in 0..20 {
            let d = b.delay();
            assert!(
                d >= Duration::from_millis(5) && d <= Duration::from_millis(10),
                "{d:?}"
            );
        }
        b.grow();
        b.grow();
        b.grow();
        assert_eq!(b.current, Duration::from_millis(35));
        b.reset();
        assert_eq!(b.current, Duration::from_millis(10));
    }
}
