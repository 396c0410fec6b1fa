//! Holding a lock file: the token minted on it, the release, and the lease the core keeps. Its loss
//! (the file deleted or replaced while held) is watched by the notifier (`notify.rs`).

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use distlock_core::raw::Released;
use distlock_core::FencingToken;

use crate::error::FileError;
use crate::layout::{fnv1a64, names_owner_at, owner_offset, Record};
use crate::notify::HeldWatch;
use crate::open::{read_content, sync_dir, write_record, OpenFile};

/// A lock file this process holds, with the token it wrote. Dropped without [`release`](Self::release)
/// (a try whose future was dropped, a lease dropped unreleased), it clears the holder from the record
/// and unlocks.
#[derive(Debug)]
pub(crate) struct HeldFile {
    pub(crate) file: OpenFile,
    pub(crate) path: Arc<Path>,
    pub(crate) token: u64,
    /// This process's id, as the record names it (read once per acquire; the sync thread's fork check
    /// reuses it).
    pub(crate) pid: u32,
    /// Where this hold's owner id starts in the record it wrote: while the record is unchanged, the
    /// release compares the owner there, not with a copy of it (issue 9's memory per held lock: one
    /// block fewer per hold). `usize::MAX` if the record had no owner line (it always has).
    owner_at: usize,
    /// The length of the record this hold wrote.
    len: usize,
    /// FNV-1a 64 of the content this hold wrote: the release finds it unchanged (a hash of ~170
    /// bytes, no parse) unless something else wrote the file meanwhile. A hash, not the bytes, so a
    /// held lock costs no more memory (the `hold` workload keeps 10,000).
    written_hash: u64,
    /// Whether `Drop` must still clear the record.
    armed: bool,
    /// The lock file's `semaphore` mark, kept by every record this hold writes.
    semaphore: bool,
    /// The notifier's record of this hold, watching the file for loss; dropped first at the release,
    /// so a released hold is never reported.
    pub(crate) watching: Option<HeldWatch>,
}

impl HeldFile {
    /// Mints the next token on a locked file: reads the last one and writes it + 1 with the holder
    /// record. Returns the held file and whether this was the file's first token. Not yet durable: see
    /// [`sync`](Self::sync). (The acquire reads the record itself first: [`take_after`](Self::take_after).)
    #[cfg(test)]
    pub(crate) fn take(
        file: OpenFile,
        path: &Arc<Path>,
        owner: &str,
    ) -> Result<(Self, bool), FileError> {
        let (last, len) = read_last(&file, path)?;
        let held = Self::take_after(file, path, owner, &last, len)?;
        Ok((held, last.token == 0))
    }

    /// [`take`](Self::take) with the record already read ([`read_last`]): the caller looked at it
    /// first (its `semaphore` mark).
    pub(crate) fn take_after(
        file: OpenFile,
        path: &Arc<Path>,
        owner: &str,
        last: &Record,
        len: usize,
    ) -> Result<Self, FileError> {
        if last.token == u64::MAX {
            return Err(FileError::TokenOverflow {
                path: path.to_path_buf(),
            });
        }
        Self::write_holder(file, path, owner, last.token + 1, len, last.semaphore)
    }

    /// Holds slot file `file` (locked) for a permit whose token `token` was minted on the name's lock
    /// file: writes the holder record with it. What the slot held before is only overwritten (a
    /// slot's record feeds `status` alone).
    pub(crate) fn take_slot(
        file: OpenFile,
        path: &Arc<Path>,
        owner: &str,
        token: u64,
    ) -> Result<Self, FileError> {
        // Only the length matters: the file never shrinks (see `write_record`).
        let old_len = read_content(&*file.fd, path).map_or(0, |c| c.len());
        Self::write_holder(file, path, owner, token, old_len, false)
    }

    fn write_holder(
        file: OpenFile,
        path: &Arc<Path>,
        owner: &str,
        token: u64,
        old_len: usize,
        semaphore: bool,
    ) -> Result<Self, FileError> {
        let mut record = Record::released(token);
        record.semaphore = semaphore;
        record.owner = Some(owner.to_string());
        let pid = std::process::id();
        record.pid = Some(pid);
        record.host = Some(host_name().to_string());
        record.since_ms = Some(now_ms());
        let written = write_record(&*file.fd, path, &record, old_len)?;
        let (len, written_hash) = (written.len(), fnv1a64(&written));
        let owner_at = owner_offset(&written).unwrap_or(usize::MAX);
        Ok(HeldFile {
            file,
            path: path.clone(),
            token,
            pid,
            owner_at,
            len,
            written_hash,
            armed: true,
            semaphore,
            watching: None,
        })
    }

    /// What this hold leaves behind at its release: the counter (and the `semaphore` mark).
    fn released(&self) -> Record {
        let mut record = Record::released(self.token);
        record.semaphore = self.semaphore;
        record
    }

    /// Turns this write hold into a read hold of the same open file description in one step (see
    /// [`OpenFile::downgrade`]): the holder record is cleared first (readers keep none), then the lock
    /// becomes shared. On failure the hold is dropped, which unlocks whatever is left.
    pub(crate) fn downgrade(mut self) -> Result<SharedFile, FileError> {
        if let Err(e) = write_record(&*self.file.fd, &self.path, &self.released(), self.len) {
            // The record only feeds `status`, which tests the lock itself.
            tracing::warn!(path = %self.path.display(), error = %e, "cannot clear the holder record");
        }
        self.armed = false;
        self.file.downgrade(&self.path)?;
        let file = self.file.shared_handle();
        // The read hold owns the lock now: this one must not unlock it as it drops.
        self.file.disown();
        Ok(SharedFile {
            file,
            path: self.path.clone(),
            token: self.token,
            watching: None,
        })
    }

    /// Makes the new token durable; the grant is reported only after this, so a token never repeats
    /// after a crash. For a file's first token the directory entry is synced too (`dir`). On failure
    /// the held file is dropped, which unlocks it.
    pub(crate) fn sync(self, dir: Option<&Path>) -> Result<Self, FileError> {
        rustix::fs::fdatasync(&*self.file.fd)
            .map_err(|e| FileError::io("sync", &self.path, e.into()))?;
        if let Some(dir) = dir {
            sync_dir(dir)?;
        }
        #[cfg(test)]
        tests_support::count_sync(&self.path);
        Ok(self)
    }

    /// Releases the lock: `Released` if the file and its record were still this hold's, `NotHeld` if the
    /// lock file was deleted or replaced, or its record names another holder. Unlocks either way.
    pub(crate) fn release(mut self, owner: &str) -> Released {
        self.armed = false;
        drop(self.watching.take());
        match self.check(owner) {
            Ok(()) => {
                if let Err(e) = write_record(&*self.file.fd, &self.path, &self.released(), self.len)
                {
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
        let content = read_content(&*self.file.fd, &self.path).ok();
        // What this hold wrote, naming `owner` where it wrote its own owner id.
        let unchanged = content.as_deref().is_some_and(|c| {
            c.len() == self.len
                && fnv1a64(c) == self.written_hash
                && names_owner_at(c, self.owner_at, owner)
        });
        if unchanged {
            // What this hold wrote: its owner and token.
            return Ok(());
        }
        let record = content.and_then(|c| Record::parse(&c).ok());
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
        drop(self.watching.take());
        if self.armed {
            if let Err(e) = write_record(&*self.file.fd, &self.path, &self.released(), self.len) {
                tracing::debug!(error = %e, "cannot clear the holder record of a dropped lock");
            }
            tracing::debug!(path = %self.path.display(), token = self.token, "unreleased lock file dropped; unlocking");
        }
    }
}

/// The lock file's record and its length, read under the caller's lock: the last token (0 for a
/// fresh file) and the `semaphore` mark. Unreadable content fails with an error naming the file:
/// its counter cannot be trusted.
pub(crate) fn read_last(file: &OpenFile, path: &Path) -> Result<(Record, usize), FileError> {
    let content = read_content(&*file.fd, path)?;
    let record = Record::parse(&content).map_err(|detail| FileError::Corrupt {
        path: path.to_path_buf(),
        detail,
    })?;
    Ok((record, content.len()))
}

/// Mints a permit's token on the name's lock file, which the caller holds with `LOCK_EX` for this
/// moment only: the counter + 1, written with no holder (no one holds the lock file for the permit)
/// and with the `semaphore` mark, which makes every later mutex, writer and reader look for held
/// slots. Returns the token and whether it is the file's first. Not yet durable: the caller syncs
/// the file.
pub(crate) fn mint_unheld(file: &OpenFile, path: &Path) -> Result<(u64, bool), FileError> {
    let (last, len) = read_last(file, path)?;
    let token = last
        .token
        .checked_add(1)
        .ok_or_else(|| FileError::TokenOverflow {
            path: path.to_path_buf(),
        })?;
    let mut record = Record::released(token);
    record.semaphore = true;
    write_record(&*file.fd, path, &record, len)?;
    Ok((token, last.token == 0))
}

/// A reader's hold of a lock file: `LOCK_SH` on its own open file description, no record (readers
/// share the file, so none can write a holder record; `status` lists them from `/proc/locks`).
#[derive(Debug)]
pub(crate) struct SharedFile {
    pub(crate) file: OpenFile,
    pub(crate) path: Arc<Path>,
    pub(crate) token: u64,
    pub(crate) watching: Option<HeldWatch>,
}

impl SharedFile {
    /// Releases the read lock: `Released` if the path still names the locked file, `NotHeld` if it
    /// was deleted or replaced. Unlocks either way (as the file drops).
    pub(crate) fn release(mut self) -> Released {
        drop(self.watching.take());
        match self.file.is_current(&self.path) {
            Ok(false) => {
                tracing::warn!(path = %self.path.display(), "released a read lock whose file was deleted or replaced");
                Released::NotHeld
            }
            Ok(true) => Released::Released,
            Err(e) => {
                // We hold the `flock`: an unreadable path does not disprove it.
                tracing::debug!(error = %e, "cannot stat the lock file at release");
                Released::Released
            }
        }
    }
}

/// What a lease holds: a lock file exclusively (mutex, writer), shared (reader), or a slot file
/// (permit).
#[derive(Debug)]
pub(crate) enum Held {
    Exclusive(HeldFile),
    Shared(SharedFile),
    Permit { held: HeldFile, slot: u32 },
}

impl Held {
    pub(crate) fn file(&self) -> &OpenFile {
        match self {
            Held::Exclusive(held) | Held::Permit { held, .. } => &held.file,
            Held::Shared(shared) => &shared.file,
        }
    }

    pub(crate) fn path(&self) -> &Arc<Path> {
        match self {
            Held::Exclusive(held) | Held::Permit { held, .. } => &held.path,
            Held::Shared(shared) => &shared.path,
        }
    }

    pub(crate) fn token(&self) -> u64 {
        match self {
            Held::Exclusive(held) | Held::Permit { held, .. } => held.token,
            Held::Shared(shared) => shared.token,
        }
    }

    pub(crate) fn set_watching(&mut self, watching: HeldWatch) {
        let slot = match self {
            Held::Exclusive(held) | Held::Permit { held, .. } => &mut held.watching,
            Held::Shared(shared) => &mut shared.watching,
        };
        *slot = Some(watching);
    }

    /// Releases the hold (see each kind's `release`).
    pub(crate) fn release(self, owner: &str) -> Released {
        match self {
            Held::Exclusive(held) | Held::Permit { held, .. } => held.release(owner),
            Held::Shared(shared) => shared.release(),
        }
    }
}

/// The backend's record of a held lock: the locked file, until it is released.
pub struct FileLease {
    held: Mutex<Option<Held>>,
    path: Arc<Path>,
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
    /// The lease of a file this process now holds.
    pub(crate) fn new(held: Held) -> Self {
        Self {
            path: held.path().clone(),
            token: held.token(),
            held: Mutex::new(Some(held)),
        }
    }

    /// The locked file: the lock file, or a permit's slot file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fencing token of this hold.
    pub fn token(&self) -> FencingToken {
        FencingToken::new(self.token)
    }

    pub(crate) fn take(&self) -> Option<Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Puts back a hold taken out by mistake (a downgrade of a hold that is not a write hold).
    pub(crate) fn restore(&self, held: Held) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(held);
    }

    pub(crate) fn is_held(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
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

/// The release's check of the record: unchanged (the fast path), rewritten by someone else, or
/// rewritten to the same owner and token.
#[cfg(test)]
mod tests {
    use super::*;

    fn held(dir: &Path) -> HeldFile {
        let path: Arc<Path> = dir.join("x.lock").into();
        let mut file = OpenFile::open(&path, dir).unwrap();
        assert!(file.try_lock(&path).unwrap());
        HeldFile::take(file, &path, "me").unwrap().0
    }

    fn overwrite(held: &HeldFile, record: &Record) {
        write_record(&*held.file.fd, &held.path, record, held.len).unwrap();
    }

    #[test]
    fn the_release_tells_its_own_record_from_another() {
        let dir = tempfile::tempdir().unwrap();
        let mine = held(dir.path());
        assert_eq!(mine.release("me"), Released::Released);

        // Another owner wrote the record meanwhile (a tool that ignores the lock): not ours.
        let theirs = held(dir.path());
        let mut record = Record::released(theirs.token);
        record.owner = Some("us".into()); // as long as "me": only the content tells them apart
        overwrite(&theirs, &record);
        assert_eq!(theirs.release("me"), Released::NotHeld);

        // The same owner and token with other details: still this hold's.
        let rewritten = held(dir.path());
        let mut record = Record::released(rewritten.token);
        record.owner = Some("me".into());
        record.pid = Some(1);
        overwrite(&rewritten, &record);
        assert_eq!(rewritten.release("me"), Released::Released);

        // Another token under our owner: not ours.
        let stale = held(dir.path());
        let mut record = Record::released(stale.token + 7);
        record.owner = Some("me".into());
        overwrite(&stale, &record);
        assert_eq!(stale.release("me"), Released::NotHeld);

        // Unchanged, released by another owner id (a prefix of ours, ours with more, one escaped in
        // the record): not theirs. The fast path compares the owner where this hold wrote it.
        for other in ["m", "me2", "me\n", "%me"] {
            let unchanged = held(dir.path());
            assert_eq!(unchanged.release(other), Released::NotHeld, "{other:?}");
        }
        // An owner id that is escaped in the record is compared escaped.
        let path: Arc<Path> = dir.path().join("x.lock").into();
        let mut file = OpenFile::open(&path, dir.path()).unwrap();
        assert!(file.try_lock(&path).unwrap());
        let escaped = HeldFile::take(file, &path, "a%b\tc:1").unwrap().0;
        assert_eq!(escaped.release("a%b\tc:1"), Released::Released);

        // Unreadable: it does not disprove the hold (we hold the `flock`), and the release repairs it.
        let garbled = held(dir.path());
        rustix::io::pwrite(&*garbled.file.fd, b"\xff\xfe", 0).unwrap();
        let token = garbled.token;
        assert_eq!(garbled.release("me"), Released::Released);
        let content = std::fs::read(dir.path().join("x.lock")).unwrap();
        assert_eq!(Record::parse(&content).unwrap(), Record::released(token));
    }
}

/// What tests observe of the mechanism: how many times each lock file's token was synced.
#[cfg(test)]
pub(crate) mod tests_support {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    static SYNCS: Mutex<Option<HashMap<PathBuf, usize>>> = Mutex::new(None);

    pub(crate) fn count_sync(path: &Path) {
        let mut syncs = SYNCS.lock().unwrap_or_else(|p| p.into_inner());
        *syncs
            .get_or_insert_with(HashMap::new)
            .entry(path.to_path_buf())
            .or_default() += 1;
    }

    /// How many times the token in the lock file at `path` was made durable.
    pub(crate) fn syncs(path: &Path) -> usize {
        let syncs = SYNCS.lock().unwrap_or_else(|p| p.into_inner());
        syncs
            .as_ref()
            .and_then(|m| m.get(path).copied())
            .unwrap_or(0)
    }
}
