//! Lock kinds beyond the mutex: [`RwLock`] (many readers or one writer) and [`Semaphore`] (at most N
//! holders), and [`LockKind`], what one acquire asks the engine for.
//!
//! A kind is a mode of the one acquire path: every guard is a [`LockGuard`](crate::LockGuard) with the
//! mutex's loss signal, watchdog, owner-only release and cancel-safe wait. The backend learns the kind
//! from [`AcquireRequest::kind`](crate::raw::AcquireRequest::kind); the core keeps what is the same for
//! every engine: reentrancy per [`Lock`], the refusal of an upgrade, the local queue of exclusive
//! waiters, and the check that the backend supports the kind at all.

use std::fmt;

use crate::error::{Error, ErrorKind, Result};
use crate::guard::LockGuard;
use crate::locks::Lock;

/// The most permits a semaphore may have. Backends may accept fewer (their docs say so).
pub const MAX_PERMITS: u32 = 65_536;

/// What an acquire asks for.
///
/// ```
/// use distlock_core::LockKind;
/// assert!(LockKind::Mutex.is_exclusive() && LockKind::Write.is_exclusive());
/// assert!(!LockKind::Read.is_exclusive());
/// assert_eq!(LockKind::Permit { limit: 4 }.to_string(), "permit of a 4-permit semaphore");
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockKind {
    /// An exclusive lock ([`Locks::lock`](crate::Locks::lock)).
    Mutex,
    /// The shared side of a read-write lock: any number of readers, no writer.
    Read,
    /// The exclusive side of a read-write lock. Where an engine keeps a name's mutex and read-write
    /// lock in one server object (file, PostgreSQL, memory), this is the mutex itself.
    Write,
    /// One permit of a semaphore of `limit` permits.
    Permit {
        /// How many holders the semaphore admits at once.
        limit: u32,
    },
}

impl LockKind {
    /// Whether a holder of this kind excludes every other holder of the name (mutex and write).
    pub fn is_exclusive(self) -> bool {
        matches!(self, LockKind::Mutex | LockKind::Write)
    }

    /// A short, stable name: `mutex`, `read`, `write`, `permit`.
    pub fn as_str(self) -> &'static str {
        match self {
            LockKind::Mutex => "mutex",
            LockKind::Read => "read",
            LockKind::Write => "write",
            LockKind::Permit { .. } => "permit",
        }
    }
}

impl fmt::Display for LockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockKind::Mutex => f.write_str("mutex"),
            LockKind::Read => f.write_str("read lock"),
            LockKind::Write => f.write_str("write lock"),
            LockKind::Permit { limit } => write!(f, "permit of a {limit}-permit semaphore"),
        }
    }
}

/// One owner of a name's read-write lock: many readers at once, or one writer. No I/O until an
/// acquire.
///
/// The two sides are [`Lock`]s of their own ([`reader`](Self::reader), [`writer`](Self::writer)) with
/// one owner id, each reentrant as a mutex `Lock` is: a second `read` while this `RwLock` holds one
/// returns another guard of the same hold. Mixing the sides on one `RwLock` fails at once with
/// [`ErrorKind::WouldDeadlock`]: a `write` while it holds a read would wait for itself (no upgrade,
/// as in Redisson and Curator), and a `read` while it holds the write is a
/// [`downgrade`](crate::LockGuard::downgrade), where the engine can do one atomically. The two
/// sides' acquires take turns, as one `Lock`'s do: an acquire of one side made while the other side's
/// is under way (waiting in the engine, say) waits for it, and then fails so if that one got the lock,
/// so neither side ever waits for the other's hold.
///
/// A write grant mints a fencing token (where the backend mints any) strictly above every earlier
/// write grant of the name; a read guard carries the token of the last write grant, so a resource can
/// refuse a writer older than what a reader saw.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// use distlock_core::{Locks, MemoryBackend};
///
/// let locks = Locks::new(MemoryBackend::new());
/// let (a, b) = (locks.read_write("config")?, locks.read_write("config")?);
/// let (r1, r2) = (a.read().await?, b.read().await?); // two readers at once
/// assert!(a.writer().try_acquire().await.is_err()); // no upgrade: WouldDeadlock
/// drop((r1, r2));
/// let w = b.write().await?;
/// assert!(a.reader().try_acquire().await?.is_none()); // a writer excludes readers
/// w.release().await?;
/// # Ok(())
/// # }
/// ```
pub struct RwLock {
    pub(crate) reader: Lock,
    pub(crate) writer: Lock,
}

impl RwLock {
    /// The lock name.
    pub fn name(&self) -> &str {
        self.reader.name()
    }

    /// The owner id both sides share.
    pub fn owner(&self) -> &str {
        self.reader.owner()
    }

    /// The read side, for options: `rw.reader().options().wait(d).acquire()`.
    pub fn reader(&self) -> &Lock {
        &self.reader
    }

    /// The write side, for options: `rw.writer().options().wait(d).acquire()`.
    pub fn writer(&self) -> &Lock {
        &self.writer
    }

    /// Acquires the read side with the [`Locks`](crate::Locks)' defaults.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`].
    pub async fn read(&self) -> Result<LockGuard> {
        self.reader.acquire().await
    }

    /// Acquires the write side with the [`Locks`](crate::Locks)' defaults.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`].
    pub async fn write(&self) -> Result<LockGuard> {
        self.writer.acquire().await
    }
}

impl fmt::Debug for RwLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &self.name())
            .field("owner", &self.owner())
            .finish()
    }
}

/// A name's semaphore of `limit` permits: at most `limit` holders at once. Cheap to clone; no I/O
/// until an acquire.
///
/// Every [`acquire`](Self::acquire) takes one more permit, as a new owner, with a guard of its own (its
/// own lease, renewal and loss signal); [`permit`](Self::permit) gives the would-be holder of one
/// permit as a [`Lock`], for options. The limit is stored on the server with the first permit, and
/// every later user must ask for the same: another limit fails with [`ErrorKind::LimitMismatch`]
/// naming both (where the limit lives and how to change it is each backend's, in its docs). Where the
/// backend mints tokens, each grant gets one strictly above every earlier grant of the name; a resource
/// the permit holders share must fence per permit ([`LockGuard::permit`](crate::LockGuard::permit)),
/// since N holders' tokens interleave.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// use distlock_core::{ErrorKind, Locks, MemoryBackend};
///
/// let locks = Locks::new(MemoryBackend::new());
/// let workers = locks.semaphore("workers", 2)?;
/// let (p1, p2) = (workers.acquire().await?, workers.acquire().await?);
/// assert!(workers.try_acquire().await?.is_none()); // both permits are taken
/// let other = locks.semaphore("workers", 3)?;
/// let err = other.try_acquire().await.unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::LimitMismatch { stored: 2, requested: 3 });
/// drop((p1, p2));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Semaphore {
    pub(crate) locks: crate::Locks,
    pub(crate) name: std::sync::Arc<str>,
    pub(crate) limit: u32,
}

impl Semaphore {
    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many permits it has.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// A new would-be holder of one permit (a new owner id); no I/O. Acquiring through it again while
    /// its guard lives is reentrant (the same permit), as for any [`Lock`].
    pub fn permit(&self) -> Lock {
        self.locks.permit_lock(&self.name, self.limit)
    }

    /// Takes one more permit, waiting as the [`Locks`](crate::Locks)' defaults say.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`]: a dropped acquire leaves no permit and no queue entry behind.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.permit().acquire().await
    }

    /// One attempt at one more permit: `Ok(None)` when all are taken.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`].
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        self.permit().try_acquire().await
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name)
            .field("limit", &self.limit)
            .finish()
    }
}

/// A semaphore limit out of range.
pub(crate) fn check_limit(limit: u32) -> Result<()> {
    if limit == 0 || limit > MAX_PERMITS {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("a semaphore needs 1 to {MAX_PERMITS} permits, not {limit}"),
        ));
    }
    Ok(())
}
