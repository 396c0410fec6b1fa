//! Semaphores on files: the limit file, the slot files, and a permit's try. The file names and the
//! limit file's content are in [`layout`](crate::layout).
//!
//! # How a permit is taken
//!
//! 1. The limit: `<stem>.sem` is read, or written if missing (whole, under a temporary name, then
//!    linked into place, so of two first users one link wins and nobody reads it half-written).
//!    Another limit than the one asked for fails with `LimitMismatch` naming both.
//! 2. A slot that looks free: slot files `0..limit` are opened read-only (created if missing) and
//!    probed with `LOCK_SH | LOCK_NB`. None free: `Busy`, and the waiter watches every slot file.
//!    This step touches no other file, so a waiter that finds every slot held never gets in the way of
//!    the name's other users.
//! 3. The lock file `<stem>.lock`, `LOCK_EX | LOCK_NB` for a moment (retried a few times over a few
//!    milliseconds, since another permit's try holds it only that long). Held by a mutex, a writer or
//!    readers: `Busy`, and the waiter watches the lock file too.
//! 4. Under it: the slot for good (read-write, `LOCK_EX`), and the token, minted on the lock file's
//!    counter (so it is above every earlier grant of the name, of any kind). Then the lock file is
//!    unlocked, the counter made durable (with [`FileConfig::sync`](crate::FileConfig::sync)), the
//!    holder record written into the slot file, and the permit granted: its id is the slot's number,
//!    its descriptor the slot file's.
//!
//! # Names are one kind
//!
//! A name's semaphore and its mutex or read-write lock exclude each other. A permit takes its slot
//! while it holds the lock file exclusively (step 4), and the token it mints there marks the lock
//! file's record `semaphore=1` (kept by every later record). A mutex, a writer or a reader, once it
//! holds the lock file, reads the record (as it does anyway, for its token) and, if it is marked,
//! looks for held slots (`held_slot`) and gives the lock file back if it finds one. So whichever
//! comes second sees the first: a holder of the lock file took it either before a permit's step 4
//! (which then fails until it is released) or after it, and then finds the mark and the held slot. A
//! name never used as a semaphore costs the mutex nothing.
//!
//! A crashed permit holder's slot file is closed by the kernel: its `flock` goes at once, and the
//! close (`CLOSE_WRITE`: holders open slots read-write) wakes the waiters.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{FlockOperation, OFlags};

use crate::error::FileError;
use crate::layout::{sibling_path, slot_path, SemaphoreLimit, MAX_SLOTS, SEMAPHORE_SUFFIX};
use crate::open::{create_dir, open_read_only, sync_dir, try_flock, OpenFile};

/// How many times the limit file is read and written before giving up (someone keeps deleting it).
const LIMIT_ROUNDS: usize = 8;

/// The longest limit file read: anything larger is not one.
const MAX_LIMIT_BYTES: usize = 4096;

/// The path of the limit file of the name whose lock file is `lock`.
pub(crate) fn limit_path(lock: &Path) -> std::path::PathBuf {
    sibling_path(lock, SEMAPHORE_SUFFIX)
}

/// The stored limit of the semaphore whose lock file is `lock`, `None` if none is stored.
pub(crate) fn read_limit(lock: &Path) -> Result<Option<u32>, FileError> {
    let path = limit_path(lock);
    let content = match std::fs::read(&path) {
        Ok(content) => content,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(FileError::io("read", &path, e)),
    };
    if content.len() > MAX_LIMIT_BYTES {
        return Err(FileError::CorruptLimit {
            path,
            detail: format!("it is larger than {MAX_LIMIT_BYTES} bytes"),
        });
    }
    SemaphoreLimit::parse(&content)
        .map(Some)
        .map_err(|detail| FileError::CorruptLimit { path, detail })
}

/// Checks `requested` against the limit stored for the semaphore whose lock file is `lock`, storing
/// it first if none is: `LimitMismatch` naming both if they differ. `sync`: make a new limit file
/// durable (its data and its directory entry) before it counts.
pub(crate) fn check_limit(
    lock: &Path,
    dir: &Path,
    requested: u32,
    sync: bool,
) -> Result<(), FileError> {
    for _ in 0..LIMIT_ROUNDS {
        if let Some(stored) = read_limit(lock)? {
            if stored == requested {
                return Ok(());
            }
            return Err(FileError::LimitMismatch {
                path: limit_path(lock),
                stored,
                requested,
            });
        }
        store_limit(lock, dir, requested, sync)?;
        // Read back: ours, or the one another first user linked before us.
    }
    Err(FileError::Replaced {
        path: limit_path(lock),
    })
}

/// Writes the limit file whole under a temporary name and links it into place; a limit file that
/// appeared meanwhile (another first user) is kept. The temporary name,
/// `<stem>.sem.new-<pid>-<nanoseconds>-<n>`, is no slot's, and unique across processes of other pid
/// namespaces sharing the directory too (a collision only fails this round: the caller tries again);
/// one is left behind only by a crash between its creation and its removal.
fn store_limit(lock: &Path, dir: &Path, limit: u32, sync: bool) -> Result<(), FileError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = limit_path(lock);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let temp = sibling_path(
        lock,
        &format!(
            "{SEMAPHORE_SUFFIX}.new-{}-{nanos}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ),
    );
    let write = || -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o666)
            .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32)
            .open(&temp)?;
        file.write_all(SemaphoreLimit::render(limit).as_bytes())?;
        if sync {
            file.sync_data()?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        match e.kind() {
            // Another process's temporary file of the same name: the caller tries again.
            std::io::ErrorKind::AlreadyExists => return Ok(()),
            // The directory went away (a tmp cleaner): make it again; the caller tries again.
            std::io::ErrorKind::NotFound => return create_dir(dir),
            _ => {
                let _ = std::fs::remove_file(&temp);
                return Err(FileError::io("write", &temp, e));
            }
        }
    }
    let linked = std::fs::hard_link(&temp, &path);
    let _ = std::fs::remove_file(&temp);
    match linked {
        Ok(()) => {
            if sync {
                sync_dir(dir)?;
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(FileError::io("create", &path, e)),
    }
}

/// The first slot held by a permit of the name whose lock file is `lock`, for a mutex, writer or
/// reader that holds the lock file marked as a semaphore's (see the module docs). Slot files are probed read-only with
/// `LOCK_SH | LOCK_NB` (probes never conflict with each other, only with a holder's `LOCK_EX`), up to
/// the stored limit and past it while slot files exist (a holder of an older, larger limit).
pub(crate) fn held_slot(lock: &Path) -> Result<Option<u32>, FileError> {
    let first = slot_path(lock, 0);
    let Some(fd) = open_read_only(&first, false)? else {
        return Ok(None);
    };
    if !probe(&fd, &first)? {
        return Ok(Some(0));
    }
    drop(fd);
    // A corrupt limit file is the permit takers' error; here every slot file that exists counts.
    let limit = read_limit(lock).ok().flatten().unwrap_or(0);
    for slot in 1..MAX_SLOTS {
        let path = slot_path(lock, slot);
        match open_read_only(&path, false)? {
            Some(fd) if !probe(&fd, &path)? => return Ok(Some(slot)),
            Some(_) => {}
            None if slot >= limit => break,
            None => {}
        }
    }
    Ok(None)
}

/// Whether the slot file open as `fd` is free (no permit holds it): a shared probe, given back as
/// the descriptor closes.
fn probe(fd: &impl std::os::fd::AsFd, path: &Path) -> Result<bool, FileError> {
    try_flock(fd, FlockOperation::NonBlockingLockShared)
        .map_err(|e| FileError::io("test the lock on", path, e))
}

/// A slot of `0..limit` that looks free, probed read-only (slot files are created as needed, in
/// order): `None` if every one is held.
pub(crate) fn free_slot(lock: &Path, limit: u32) -> Result<Option<u32>, FileError> {
    for slot in 0..limit {
        let path = slot_path(lock, slot);
        if let Some(fd) = open_read_only(&path, true)? {
            if probe(&fd, &path)? {
                return Ok(Some(slot));
            }
        }
    }
    Ok(None)
}

/// A slot for good, taken while the caller holds the lock file exclusively: read-write, `LOCK_EX`,
/// starting at `first` (the slot that looked free) and looking again, read-only, if another got it
/// (a probe of someone else's holds a slot for a moment). `None` if none could be had.
pub(crate) fn take_slot(
    lock: &Path,
    dir: &Path,
    limit: u32,
    first: u32,
) -> Result<Option<(u32, Arc<Path>, OpenFile)>, FileError> {
    let mut candidate = Some(first);
    for _ in 0..3 {
        let Some(slot) = candidate else {
            return Ok(None);
        };
        let path: Arc<Path> = slot_path(lock, slot).into();
        let mut file = OpenFile::open(&path, dir)?;
        if file.try_lock(&path)? && file.is_current(&path)? {
            return Ok(Some((slot, path, file)));
        }
        // Dropped: a read-write close, which wakes this slot's waiters once; only a slot that
        // looked free comes here.
        drop(file);
        candidate = free_slot(lock, limit)?;
    }
    Ok(None)
}

/// How a permit's try waits for another permit's moment on the lock file: a few short sleeps.
pub(crate) const BRIEF_RETRIES: [Duration; 4] = [
    Duration::from_millis(1),
    Duration::from_millis(2),
    Duration::from_millis(4),
    Duration::from_millis(8),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit file: stored by the first user, kept, refused when another limit is asked for or
    /// when it cannot be read.
    #[test]
    fn the_limit_is_stored_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join("w.lock");
        assert_eq!(read_limit(&lock).unwrap(), None);
        check_limit(&lock, dir.path(), 3, true).unwrap();
        assert_eq!(read_limit(&lock).unwrap(), Some(3));
        check_limit(&lock, dir.path(), 3, false).unwrap();
        match check_limit(&lock, dir.path(), 4, false) {
            Err(FileError::LimitMismatch {
                stored: 3,
                requested: 4,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["w.sem"]);
        std::fs::write(dir.path().join("w.sem"), b"limit=x\n").unwrap();
        assert!(matches!(
            check_limit(&lock, dir.path(), 3, false),
            Err(FileError::CorruptLimit { .. })
        ));
    }
}
