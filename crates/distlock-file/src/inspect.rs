//! `status`: what a lock file says about its holder, read without taking the lock.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use distlock_core::raw::{HolderInfo, LockInfo};
use distlock_core::FencingToken;
use rustix::fs::{flock, FlockOperation, OFlags};
use rustix::io::Errno;

use crate::error::FileError;
use crate::layout::Record;
use crate::open::read_content;

/// Reads the record without locking (read-only, so it wakes no waiter) and tests the lock with a
/// non-blocking shared `flock` that is given back at once. A missing file is a free lock with no token
/// yet.
pub(crate) fn inspect_file(path: &Path) -> Result<LockInfo, FileError> {
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
