//! Opening lock files: the lock directory, the open lock file and its `flock`, reading and writing the
//! record.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation, OFlags};
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
    pub(crate) file: File,
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
    pub(crate) fn try_lock(&mut self, path: &Path) -> Result<bool, FileError> {
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
    pub(crate) fn is_current(&self, path: &Path) -> Result<bool, FileError> {
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

/// Whether `path` still names the inode `dev`/`ino` and that inode is still linked.
///
/// The link count matters: `unlink(2)` sends inotify's `ATTRIB` (link count changed) before it drops
/// the name from the dentry cache, so a holder woken by that event can still find the old inode at the
/// path for a moment — with its link count already 0. Without this check that holder would take the
/// deleted file for its own and wait for an event that never comes (`DELETE_SELF` only follows the
/// last close, which is the holder's own).
pub(crate) fn same_file(path: &Path, dev: u64, ino: u64) -> Result<bool, FileError> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(meta.dev() == dev && meta.ino() == ino && meta.nlink() > 0),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(FileError::io("stat", path, e)),
    }
}

pub(crate) fn read_content(file: &File, path: &Path) -> Result<Vec<u8>, FileError> {
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
pub(crate) fn write_record(
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

pub(crate) fn sync_dir(dir: &Path) -> Result<(), FileError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| FileError::io("sync the lock directory", dir, e))
}
