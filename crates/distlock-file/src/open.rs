//! Opening lock files: the lock directory, the open lock file and its `flock`, reading and writing the
//! record.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{
    flock, makedev, statx, AtFlags, FileType, FlockOperation, OFlags, Statx, StatxFlags, CWD,
};
use rustix::io::Errno;

use crate::error::FileError;
use crate::layout::{Record, MAX_RECORD_BYTES};

/// Makes `dir` (not empty: [`FileConfig::validate`](crate::FileConfig::validate) checked) absolute
/// and creates it if missing.
pub(crate) fn prepare_dir(dir: &Path) -> Result<PathBuf, FileError> {
    let dir = std::path::absolute(dir).map_err(|e| FileError::io("resolve", dir, e))?;
    create_dir(&dir)?;
    Ok(dir)
}

pub(crate) fn create_dir(dir: &Path) -> Result<(), FileError> {
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

/// A lock file opened for an acquisition, and whether this descriptor holds its `flock`.
#[derive(Debug)]
pub(crate) struct OpenFile {
    /// Shared with the grant as its inheritable descriptor, not duplicated: a `dup` shares the open
    /// file description anyway, so the file closes (and the close wakes other processes' waiters)
    /// when the last of the two goes either way, and sharing saves a `dup` and a `close` per
    /// acquisition (issue 9).
    pub(crate) fd: Arc<OwnedFd>,
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    locked: bool,
}

impl OpenFile {
    /// Opens (creating if needed) the lock file read-write. std opens with `O_CLOEXEC`, so no child
    /// process ever inherits the descriptor, and with it the lock; `O_NOFOLLOW` refuses a planted
    /// symbolic link.
    pub(crate) fn open(path: &Path, dir: &Path) -> Result<Self, FileError> {
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
        let id = Identity::of_file(&file).map_err(|e| FileError::io("stat", path, e))?;
        if !id.regular {
            return Err(FileError::Config(format!(
                "{} is not a regular file; remove it so distlock can use it as a lock file",
                path.display()
            )));
        }
        Ok(Self {
            fd: Arc::new(OwnedFd::from(file)),
            dev: id.dev,
            ino: id.ino,
            locked: false,
        })
    }

    /// `flock(LOCK_EX | LOCK_NB)`: whether this descriptor now holds the lock.
    pub(crate) fn try_lock(&mut self, path: &Path) -> Result<bool, FileError> {
        self.try_flock(path, FlockOperation::NonBlockingLockExclusive)
    }

    /// `flock(LOCK_SH | LOCK_NB)`: whether this descriptor now holds a shared lock (a reader's).
    pub(crate) fn try_lock_shared(&mut self, path: &Path) -> Result<bool, FileError> {
        self.try_flock(path, FlockOperation::NonBlockingLockShared)
    }

    fn try_flock(&mut self, path: &Path, operation: FlockOperation) -> Result<bool, FileError> {
        let locked = try_flock(&*self.fd, operation).map_err(|e| FileError::io("lock", path, e))?;
        self.locked |= locked;
        Ok(locked)
    }

    /// Whether the file, which this descriptor does not hold, is held shared (by readers) rather than
    /// exclusively: a `LOCK_SH | LOCK_NB` probe, given back at once (without a close, which would
    /// wake waiters for nothing). Also `true` if the lock was freed in between.
    pub(crate) fn held_shared(&self, path: &Path) -> Result<bool, FileError> {
        let shared = try_flock(&*self.fd, FlockOperation::NonBlockingLockShared)
            .map_err(|e| FileError::io("test the lock on", path, e))?;
        if shared {
            let _ = flock(&*self.fd, FlockOperation::Unlock);
        }
        Ok(shared)
    }

    /// Turns this descriptor's `LOCK_EX` into `LOCK_SH` with no other lock in between.
    ///
    /// On Linux a conversion is one step for every other locker: `flock_lock_inode` (fs/locks.c)
    /// removes this description's lock and inserts the new one under one hold of the inode's
    /// `flc_lock`, and the conflict check in between finds nothing, since no other lock exists while
    /// this one is exclusive (waiters blocked in `flock(2)` are woken, take the spinlock after it, and
    /// find the shared lock). The BSD warning in flock(2) ("not guaranteed to be atomic") is about an
    /// upgrade, which can meet another shared lock, and about other systems; file systems with their
    /// own `flock` (network ones) are not supported by this backend anyway.
    pub(crate) fn downgrade(&mut self, path: &Path) -> Result<(), FileError> {
        match try_flock(&*self.fd, FlockOperation::NonBlockingLockShared) {
            Ok(true) => Ok(()),
            // Cannot happen (nothing conflicts with a lock taken from an exclusive one); if it did,
            // the exclusive lock is gone.
            Ok(false) => {
                self.locked = false;
                Err(FileError::io(
                    "downgrade the lock on",
                    path,
                    io::Error::from_raw_os_error(Errno::WOULDBLOCK.raw_os_error()),
                ))
            }
            Err(e) => Err(FileError::io("downgrade the lock on", path, e)),
        }
    }

    /// Gives the lock up without closing the file (a try that must not hold it after all). Closing
    /// would wake other processes' waiters for nothing.
    pub(crate) fn unlock(&mut self) {
        if self.locked {
            self.locked = false;
            if let Err(e) = flock(&*self.fd, FlockOperation::Unlock) {
                tracing::warn!(error = %e, "cannot unlock a lock file; closing it releases the lock");
            }
        }
    }

    /// Forgets that this descriptor holds the lock, so dropping it does not unlock: another
    /// `OpenFile` of the same descriptor (a downgraded hold) owns the lock now.
    pub(crate) fn disown(&mut self) {
        self.locked = false;
    }

    /// Another handle on the same open file description (the descriptor is shared, not duplicated),
    /// holding its lock: the read hold a write hold becomes when it is downgraded.
    pub(crate) fn shared_handle(&self) -> OpenFile {
        OpenFile {
            fd: self.fd.clone(),
            dev: self.dev,
            ino: self.ino,
            locked: self.locked,
        }
    }

    /// Whether `path` still names this file (not deleted, not replaced by another).
    pub(crate) fn is_current(&self, path: &Path) -> Result<bool, FileError> {
        same_file(path, self.dev, self.ino)
    }
}

impl Drop for OpenFile {
    fn drop(&mut self) {
        // Unlock before the close: the close wakes waiters, and the kernel's own unlock at close comes
        // after that notification.
        self.unlock();
    }
}

/// `flock` without blocking: `Ok(true)` if `fd` now holds the lock, `Ok(false)` if another holds it.
pub(crate) fn try_flock(fd: impl AsFd, operation: FlockOperation) -> io::Result<bool> {
    loop {
        match flock(&fd, operation) {
            Ok(()) => return Ok(true),
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Opens a file of the name read-only to look at it or probe its lock, with no stat: `None` if it
/// does not exist (and `create` is off). Closing a read-only descriptor raises only `CLOSE_NOWRITE`,
/// which the watches of slot and turnstile files do not ask for, so probes wake nobody.
pub(crate) fn open_read_only(path: &Path, create: bool) -> Result<Option<OwnedFd>, FileError> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32);
    if create {
        // `O_CREAT` with read-only access: std insists on write access for `create`.
        options.custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::CREATE).bits() as i32);
        options.mode(0o666);
    }
    match options.open(path) {
        Ok(file) => Ok(Some(OwnedFd::from(file))),
        Err(e) if e.kind() == io::ErrorKind::NotFound && !create => Ok(None),
        Err(e) => Err(FileError::io("open", path, e)),
    }
}

/// Whether `path` still names the inode `dev`/`ino` and that inode is still linked.
///
/// The link count matters: `unlink(2)` sends inotify's `ATTRIB` (link count changed) before it drops
/// the name from the dentry cache, so a holder woken by that event can still find the old inode at the
/// path for a moment — with its link count already 0. Without this check that holder would take the
/// deleted file for its own and wait for an event that never comes (`DELETE_SELF` only follows the
/// last close, which is the holder's own).
pub(crate) fn same_file(path: &Path, dev: u64, ino: u64) -> Result<bool, FileError> {
    match Identity::of_path(path) {
        Ok(id) => Ok(id.dev == dev && id.ino == ino && id.linked),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(FileError::io("stat", path, e)),
    }
}

/// What the backend needs to know of a file: which inode it is, whether it is a regular file, and
/// whether it is still linked.
///
/// Read with `statx` asking for exactly that, never for timestamps. Since Linux 6.13 (multigrain
/// timestamps), a `stat` that asks for mtime/ctime marks them queried, and the next write stamps a
/// fine-grained time instead of the clock tick's: the inode then changes at every write, and on ext4
/// without a journal `fdatasync` writes the inode block whenever it changed (one more device write,
/// waited for, per acquire; issue 9). `std::fs::metadata` asks for every field, timestamps included.
struct Identity {
    dev: u64,
    ino: u64,
    regular: bool,
    linked: bool,
}

impl Identity {
    const FIELDS: StatxFlags = StatxFlags::TYPE
        .union(StatxFlags::INO)
        .union(StatxFlags::NLINK);

    fn of_file(file: &File) -> io::Result<Identity> {
        match statx(file, "", AtFlags::EMPTY_PATH, Self::FIELDS) {
            Ok(stx) => Ok(Self::from_statx(&stx)),
            Err(Errno::NOSYS | Errno::PERM) => file.metadata().map(|m| Self::from_std(&m)),
            Err(e) => Err(e.into()),
        }
    }

    /// Follows symbolic links, as `std::fs::metadata` does.
    fn of_path(path: &Path) -> io::Result<Identity> {
        match statx(CWD, path, AtFlags::empty(), Self::FIELDS) {
            Ok(stx) => Ok(Self::from_statx(&stx)),
            Err(Errno::NOSYS | Errno::PERM) => std::fs::metadata(path).map(|m| Self::from_std(&m)),
            Err(e) => Err(e.into()),
        }
    }

    fn from_statx(stx: &Statx) -> Identity {
        Identity {
            dev: makedev(stx.stx_dev_major, stx.stx_dev_minor),
            ino: stx.stx_ino,
            regular: FileType::from_raw_mode(u32::from(stx.stx_mode)) == FileType::RegularFile,
            linked: stx.stx_nlink > 0,
        }
    }

    fn from_std(meta: &std::fs::Metadata) -> Identity {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            regular: meta.is_file(),
            linked: meta.nlink() > 0,
        }
    }
}

/// The first read's buffer: a whole record, usually.
const FIRST_READ_BYTES: usize = 512;

pub(crate) fn read_content(file: impl AsFd, path: &Path) -> Result<Vec<u8>, FileError> {
    // Read into spare capacity, not a zeroed buffer: zeroing 4 KiB twice a cycle (the acquire's read
    // and the release's) was a fifth of the cycle's user-space instructions (issue 9). A small buffer
    // first, grown to the limit only for a record that fills it: a 4 KiB block per acquire, hundreds in
    // flight at once, left holes the allocator kept between held locks' blocks (issue 9's resident
    // memory per held lock). A record is ~0.2 KiB, so it is still one `pread`.
    let mut buf = Vec::with_capacity(FIRST_READ_BYTES.min(MAX_RECORD_BYTES + 1));
    loop {
        if buf.len() == buf.capacity() {
            if buf.len() > MAX_RECORD_BYTES {
                break;
            }
            buf.reserve_exact(MAX_RECORD_BYTES + 1 - buf.len());
        }
        let offset = buf.len() as u64;
        match rustix::io::pread(&file, rustix::buffer::spare_capacity(&mut buf), offset) {
            Ok(0) => break,
            Ok(_) => {
                if buf.len() < buf.capacity() {
                    // A short read of a regular file is its end: no second call to learn that.
                    break;
                }
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(FileError::io("read", path, e.into())),
        }
    }
    if buf.len() > MAX_RECORD_BYTES {
        return Err(FileError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("it is larger than {MAX_RECORD_BYTES} bytes"),
        });
    }
    Ok(buf)
}

/// Writes `record` over the file's content of `old_len` bytes; returns what it wrote (the file's
/// content after it).
///
/// The file never shrinks: a record shorter than the old content is followed by blank lines up to the
/// old length (blank lines are comments, and reading stops at `end` anyway). A size change is what
/// makes `fdatasync` write the inode too (ext4 without a journal writes the inode block and waits for
/// it; with one, it commits the journal): the release's shorter record and the next acquire's longer
/// one changed the size twice per cycle, so every acquire's sync cost two device writes instead of
/// one (issue 9). With the size kept, only the data block is written, as a bare `pwrite` +
/// `fdatasync` does. Written in place, never truncated first: the file never goes through an empty
/// state in which a crash would lose the counter.
pub(crate) fn write_record(
    file: impl AsFd,
    path: &Path,
    record: &Record,
    old_len: usize,
) -> Result<Vec<u8>, FileError> {
    let mut text = record.render().into_bytes();
    if text.len() < old_len {
        text.resize(old_len, b'\n');
    }
    let mut written = 0;
    while written < text.len() {
        match rustix::io::pwrite(&file, &text[written..], written as u64) {
            Ok(0) => {
                return Err(FileError::io(
                    "write",
                    path,
                    io::ErrorKind::WriteZero.into(),
                ))
            }
            Ok(n) => written += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(FileError::io("write", path, e.into())),
        }
    }
    Ok(text)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), FileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| FileError::io("sync the lock directory", dir, e))
}

#[cfg(test)]
mod read_tests {
    use super::*;

    /// A record longer than the first read's buffer is read whole (the buffer grows), one at the limit
    /// too, and one past the limit is refused as before.
    #[test]
    fn read_content_reads_past_the_first_buffer_up_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        for len in [
            0,
            1,
            FIRST_READ_BYTES - 1,
            FIRST_READ_BYTES,
            FIRST_READ_BYTES + 1,
            3 * FIRST_READ_BYTES,
            MAX_RECORD_BYTES,
        ] {
            let path = dir.path().join(format!("r{len}"));
            let content: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
            std::fs::write(&path, &content).unwrap();
            let file = File::open(&path).unwrap();
            assert_eq!(read_content(&file, &path).unwrap(), content, "{len} bytes");
        }
        let path = dir.path().join("too-long");
        std::fs::write(&path, vec![b'x'; MAX_RECORD_BYTES + 1]).unwrap();
        let file = File::open(&path).unwrap();
        assert!(matches!(
            read_content(&file, &path),
            Err(FileError::Corrupt { .. })
        ));
    }
}
