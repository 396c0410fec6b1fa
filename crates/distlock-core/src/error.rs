//! The one error type every backend maps into.

use std::error::Error as StdError;
use std::fmt;

/// What went wrong, in terms a caller can act on.
///
/// Contention is not an error: `try_acquire` returns `Ok(None)` when the lock is held elsewhere.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{ErrorKind, Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let _held = locks.lock("nightly")?.acquire().await?;
/// match locks.lock("nightly")?.options().wait(Duration::from_millis(20)).acquire().await {
///     Ok(_guard) => unreachable!("held above"),
///     Err(e) if e.kind() == ErrorKind::Timeout => { /* someone else is on it: skip this run */ }
///     Err(e) if e.is_temporary() => { /* the server is away: try again later */ }
///     Err(e) => return Err(e),
/// }
/// # Ok(())
/// # }
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The wait limit elapsed before the lock could be acquired.
    Timeout,
    /// The lock was lost while it was being used (lease expired, session gone, another owner).
    LockLost,
    /// A release or extend of a lock this owner no longer holds.
    NotHeld,
    /// The server (or a quorum of servers) could not be reached. Temporary.
    Unavailable,
    /// Fewer replicas confirmed a write than were required.
    InsufficientReplicas {
        /// Replicas that confirmed.
        confirmed: u32,
        /// Replicas that were required.
        required: u32,
    },
    /// The backend cannot do what was asked; nothing was changed.
    Unsupported,
    /// A configuration value (URL, option, duration) is invalid.
    InvalidConfig,
    /// A lock name is empty, too long or not acceptable to the backend.
    InvalidName,
    /// The server refused the credentials or the operation.
    PermissionDenied,
    /// The server answered something unexpected (for example `WRONGTYPE`).
    Protocol,
    /// The request would wait for the caller's own hold: a `write` on a
    /// [`RwLock`](crate::RwLock) that holds a read (no upgrade), or a `read` while it holds the write
    /// (use [`LockGuard::downgrade`](crate::LockGuard::downgrade)). Nothing was sent.
    WouldDeadlock,
    /// A semaphore was asked for with another number of permits than the one stored on the server.
    LimitMismatch {
        /// The limit on the server.
        stored: u32,
        /// The limit asked for.
        requested: u32,
    },
    /// The name is in use as another kind of lock (a mutex asked for while it is a semaphore, say)
    /// on an engine where the kinds are different server objects. The message names the kind in use.
    KindConflict,
}

impl ErrorKind {
    /// A short, stable name for logs and messages.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorKind::Timeout => "timeout",
            ErrorKind::LockLost => "lock lost",
            ErrorKind::NotHeld => "not held",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::InsufficientReplicas { .. } => "insufficient replicas",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::InvalidConfig => "invalid configuration",
            ErrorKind::InvalidName => "invalid lock name",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::Protocol => "protocol error",
            ErrorKind::WouldDeadlock => "would deadlock",
            ErrorKind::LimitMismatch { .. } => "limit mismatch",
            ErrorKind::KindConflict => "kind conflict",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error from distlock: a kind, the backend and lock it concerns, a message a user can act on, and
/// the driver's error as `source` for downcasting.
///
/// ```
/// use distlock_core::{ErrorKind, Locks, MemoryBackend};
///
/// let locks = Locks::new(MemoryBackend::new());
/// let err = locks.lock("").expect_err("an empty name is refused before any I/O");
/// assert_eq!(err.kind(), ErrorKind::InvalidName);
/// assert!(!err.message().is_empty()); // says what to do about it
/// ```
pub struct Error {
    kind: ErrorKind,
    backend: &'static str,
    lock: Option<String>,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

/// `Result` with distlock's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a message that says what to do about it.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            backend: "",
            lock: None,
            message: message.into(),
            source: None,
        }
    }

    /// Tags the error with the backend it came from (`"redis"`, `"file"`, …).
    pub fn with_backend(mut self, backend: &'static str) -> Self {
        self.backend = backend;
        self
    }

    /// Tags the error with the lock name it concerns.
    pub fn with_lock(mut self, name: impl Into<String>) -> Self {
        self.lock = Some(name.into());
        self
    }

    /// Keeps the underlying error reachable through [`std::error::Error::source`].
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The backend that reported it (empty when none did).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The lock name it concerns, if any.
    pub fn lock_name(&self) -> Option<&str> {
        self.lock.as_deref()
    }

    /// The message, without the backend and lock prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether trying again later may succeed.
    pub fn is_temporary(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::InsufficientReplicas { .. }
        )
    }

    pub(crate) fn timeout(name: &str, wait: crate::options::Wait) -> Self {
        let message = match wait {
            crate::options::Wait::Limit(limit) => format!(
                "still held elsewhere after waiting {}",
                crate::duration::format(limit)
            ),
            crate::options::Wait::Forever => "still held elsewhere".to_string(),
        };
        Error::new(ErrorKind::Timeout, message).with_lock(name)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.backend.is_empty() {
            write!(f, "{}: ", self.backend)?;
        }
        if let Some(lock) = &self.lock {
            write!(f, "lock {lock:?}: ")?;
        }
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            let text = source.to_string();
            if !text.is_empty() && !self.message.contains(&text) {
                write!(f, ": {text}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("backend", &self.backend)
            .field("lock", &self.lock)
            .field("message", &self.message)
            .field("source", &self.source)
            .finish()
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn StdError + 'static))
    }
}
