//! `status`: what a name's files say about its holders, read without taking any lock.
//!
//! * The lock file held exclusively (a mutex or a writer: the same lock, shown as `mutex`): its
//!   record names the holder (owner, pid, host, token, since), unless another tool holds it.
//! * The lock file held shared (readers): readers write no record (they share the file), so they are
//!   listed from `/proc/locks`, which shows every `flock` with the pid of the process that took it and
//!   the file's device and inode: one holder per reader (a `flock -s` too), each with that pid and the
//!   token readers carry (the lock file's counter). Where `/proc/locks` cannot be read, one holder of
//!   unknown identity stands for them.
//! * A semaphore's permits: every held slot file's record (owner, pid, host, the permit's token,
//!   since), with the slot's number as the permit, and the stored limit as the kind's.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use distlock_core::raw::{HolderInfo, LockInfo};
use distlock_core::{FencingToken, LockKind};
use rustix::fs::{flock, fstat, major, minor, FlockOperation, OFlags};
use rustix::io::Errno;

use crate::error::FileError;
use crate::layout::{slot_path, Record, MAX_SLOTS};
use crate::open::{open_read_only, read_content};
use crate::semaphore::read_limit;

/// What `status` shows for the name whose lock file is `lock` (see the module docs).
pub(crate) fn inspect_name(lock: &Path) -> Result<LockInfo, FileError> {
    let (mut info, held) = inspect_file(lock)?;
    match held {
        LockFile::Exclusive => {
            info.kind = Some(LockKind::Mutex);
            return Ok(info);
        }
        LockFile::Shared(readers) => {
            info.kind = Some(LockKind::Read);
            info.holders = readers
                .into_iter()
                .map(|pid| {
                    let mut holder = HolderInfo::default();
                    holder.pid = pid;
                    holder.token = Some(FencingToken::new(
                        info.last_token.map_or(0, FencingToken::get),
                    ));
                    holder
                })
                .collect();
            return Ok(info);
        }
        LockFile::Free => {}
    }
    let permits = permit_holders(lock)?;
    if !permits.is_empty() {
        let limit = read_limit(lock).ok().flatten().unwrap_or_else(|| {
            // No readable limit file (removed by hand while permits are held): the slots in use.
            permits
                .iter()
                .filter_map(|h| h.permit.as_deref()?.parse::<u32>().ok())
                .max()
                .map_or(0, |slot| slot + 1)
        });
        info.kind = Some(LockKind::Permit { limit });
        info.holders = permits;
    }
    Ok(info)
}

/// How the lock file is held.
enum LockFile {
    Free,
    Exclusive,
    /// By readers: the pid of each (`None` where unknown).
    Shared(Vec<Option<u32>>),
}

/// Reads the lock file's record without locking (read-only, so it wakes no waiter) and tests the
/// lock with non-blocking `flock`s given back at once: shared (refused: held exclusively), then, if
/// `/proc/locks` cannot say, exclusive (refused: held by readers).
fn inspect_file(path: &Path) -> Result<(LockInfo, LockFile), FileError> {
    // Read-only: closing it raises no IN_CLOSE_WRITE, which would wake waiters for nothing.
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags((OFlags::NOFOLLOW | OFlags::CLOEXEC).bits() as i32)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok((LockInfo::default(), LockFile::Free))
        }
        Err(e) => return Err(FileError::io("open", path, e)),
    };
    // The record can change between the read and the probe; read it on both sides until they agree.
    let mut content = read_content(&file, path)?;
    let mut exclusive;
    let mut rounds = 0;
    loop {
        exclusive = !probe(&file, path, FlockOperation::NonBlockingLockShared)?;
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
    if exclusive {
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
        return Ok((info, LockFile::Exclusive));
    }
    let stat = fstat(&file).map_err(|e| FileError::io("stat", path, e.into()))?;
    let (dev_major, dev_minor) = (major(stat.st_dev), minor(stat.st_dev));
    let readers = match std::fs::read_to_string("/proc/locks") {
        Ok(table) => flock_readers(&table, dev_major, dev_minor, stat.st_ino),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read /proc/locks; readers are counted as one");
            if probe(&file, path, FlockOperation::NonBlockingLockExclusive)? {
                Vec::new()
            } else {
                vec![None]
            }
        }
    };
    Ok((
        info,
        if readers.is_empty() {
            LockFile::Free
        } else {
            LockFile::Shared(readers)
        },
    ))
}

/// Whether `operation` (a non-blocking lock) can be had on `file` now; given back at once, before the
/// close (which wakes waiters).
fn probe(file: &std::fs::File, path: &Path, operation: FlockOperation) -> Result<bool, FileError> {
    loop {
        match flock(file, operation) {
            Ok(()) => {
                let _ = flock(file, FlockOperation::Unlock);
                return Ok(true);
            }
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(FileError::io("test the lock on", path, e.into())),
        }
    }
}

/// The granted shared `flock`s of one file in `/proc/locks` (fs/locks.c `lock_get_status`): lines
/// `N: FLOCK ADVISORY READ <pid> <major>:<minor>:<inode> 0 EOF`, device numbers in hex; blocked
/// requests (`N: -> FLOCK …`) are waiters, not holders. A pid of 0 (not visible from this pid
/// namespace) is unknown.
pub(crate) fn flock_readers(
    table: &str,
    dev_major: u32,
    dev_minor: u32,
    ino: u64,
) -> Vec<Option<u32>> {
    let wanted = |field: &str| -> bool {
        let mut parts = field.split(':');
        let (Some(major), Some(minor), Some(inode), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return false;
        };
        u32::from_str_radix(major, 16).ok() == Some(dev_major)
            && u32::from_str_radix(minor, 16).ok() == Some(dev_minor)
            && inode.parse::<u64>().ok() == Some(ino)
    };
    table
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                [_, "FLOCK", _, "READ", pid, file, ..] if wanted(file) => {
                    Some(pid.parse::<u32>().ok().filter(|pid| *pid > 0))
                }
                _ => None,
            }
        })
        .collect()
}

/// The holders of a semaphore's slots: every slot file (up to the stored limit, and past it while
/// slot files exist) that a probe finds held, with its record.
fn permit_holders(lock: &Path) -> Result<Vec<HolderInfo>, FileError> {
    let limit = read_limit(lock).ok().flatten().unwrap_or(0);
    let mut holders = Vec::new();
    for slot in 0..MAX_SLOTS {
        let path = slot_path(lock, slot);
        let Some(fd) = open_read_only(&path, false)? else {
            if slot >= limit {
                break;
            }
            continue;
        };
        let file = std::fs::File::from(fd);
        if probe(&file, &path, FlockOperation::NonBlockingLockShared)? {
            continue;
        }
        let record = read_content(&file, &path)
            .ok()
            .and_then(|content| Record::parse(&content).ok())
            .unwrap_or_default();
        let mut holder = HolderInfo::default();
        holder.permit = Some(slot.to_string());
        if record.has_holder() {
            holder.since = record.since();
            holder.owner = record.owner;
            holder.token = Some(FencingToken::new(record.token));
            holder.pid = record.pid;
            holder.host = record.host;
        }
        holders.push(holder);
    }
    Ok(holders)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Readers of one file only, granted only; the pid of each, 0 as unknown.
    #[test]
    fn proc_locks_lines_are_read_for_one_file() {
        let table = "\
1: FLOCK  ADVISORY  READ 1556 fe:00:10014746 0 EOF
2: FLOCK  ADVISORY  WRITE 32201 fe:00:10014746 0 EOF
3: -> FLOCK  ADVISORY  READ 77 fe:00:10014746 0 EOF
4: FLOCK  ADVISORY  READ 0 fe:00:10014746 0 EOF
5: FLOCK  ADVISORY  READ 12 fe:01:10014746 0 EOF
6: FLOCK  ADVISORY  READ 13 fe:00:100147460 0 EOF
7: POSIX  ADVISORY  READ 14 fe:00:10014746 0 EOF
8: OFDLCK ADVISORY  READ -1 fe:00:10014746 0 EOF
9: FLOCK  ADVISORY  READ 1553 103:1a:10014746 0 EOF
";
        assert_eq!(
            flock_readers(table, 0xfe, 0, 10_014_746),
            [Some(1556), None]
        );
        assert_eq!(flock_readers(table, 0x103, 0x1a, 10_014_746), [Some(1553)]);
        assert!(flock_readers("", 0xfe, 0, 1).is_empty());
    }
}
