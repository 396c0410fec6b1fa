//! The file backend's errors, mapped once into [`distlock_core::Error`] (tagged backend `"file"`).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use distlock_core::{Error, ErrorKind};
use rustix::io::Errno;

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "file";

/// Everything that can go wrong in the file backend.
#[derive(Debug)]
pub(crate) enum FileError {
    /// A bad URL or option.
    Config(String),
    /// A system call on `path` failed; `action` says what was being done ("open", "lock", …).
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The lock file's content cannot be read as a record, so its counter cannot be trusted.
    Corrupt { path: PathBuf, detail: String },
    /// The fencing counter reached `u64::MAX`.
    TokenOverflow { path: PathBuf },
    /// The lock file kept being deleted or replaced while it was being locked.
    Replaced { path: PathBuf },
    /// A blocking task did not finish (it panicked or its runtime shut down).
    Task(String),
    /// A semaphore's limit file cannot be read as one.
    CorruptLimit { path: PathBuf, detail: String },
    /// A semaphore was asked for with another limit than the one stored in its limit file.
    LimitMismatch {
        path: PathBuf,
        stored: u32,
        requested: u32,
    },
    /// A semaphore of more permits than slot files can serve.
    TooManyPermits { requested: u32 },
}

impl FileError {
    pub(crate) fn io(action: &'static str, path: &Path, source: io::Error) -> Self {
        FileError::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// The error as distlock reports it, tagged with the backend and, when known, the lock name.
    pub(crate) fn into_core(self, lock: Option<&str>) -> Error {
        let error = Error::from(self);
        match lock {
            Some(name) => error.with_lock(name),
            None => error,
        }
    }
}

/// The kind and advice for a failed system call.
fn classify(source: &io::Error) -> (ErrorKind, &'static str) {
    let Some(errno) = Errno::from_io_error(source) else {
        return (ErrorKind::Unavailable, "");
    };
    if errno == Errno::ACCESS || errno == Errno::PERM {
        (
            ErrorKind::PermissionDenied,
            "make the directory (and any lock files in it) writable by this user, or use another directory (file:///dir)",
        )
    } else if errno == Errno::ROFS {
        (
            ErrorKind::PermissionDenied,
            "the file system is read-only; use a writable directory (file:///dir)",
        )
    } else if errno == Errno::NOENT {
        (
            ErrorKind::InvalidConfig,
            "the directory does not exist and could not be created",
        )
    } else if errno == Errno::NOTDIR {
        (
            ErrorKind::InvalidConfig,
            "a component of the path is not a directory; use another directory (file:///dir)",
        )
    } else if errno == Errno::LOOP {
        (
            ErrorKind::InvalidConfig,
            "lock files must not be symbolic links; remove the link",
        )
    } else if errno == Errno::ISDIR {
        (
            ErrorKind::InvalidConfig,
            "the lock file's path is a directory; remove it",
        )
    } else if errno == Errno::NOSPC || errno == Errno::DQUOT {
        (ErrorKind::Unavailable, "the disk or quota is full")
    } else if errno == Errno::MFILE || errno == Errno::NFILE {
        (
            ErrorKind::Unavailable,
            "too many open files; raise the limit (ulimit -n)",
        )
    } else if errno == Errno::NOLCK || errno == Errno::OPNOTSUPP || errno == Errno::NOSYS {
        (
            ErrorKind::Unsupported,
            "this file system does not support flock(2); use a local directory",
        )
    } else {
        (ErrorKind::Unavailable, "")
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileError::Config(message) => f.write_str(message),
            FileError::Io { action, path, source } => {
                let (_, advice) = classify(source);
                write!(f, "cannot {action} {}: {source}", path.display())?;
                if !advice.is_empty() {
                    write!(f, " ({advice})")?;
                }
                Ok(())
            }
            FileError::Corrupt { path, detail } => write!(
                f,
                "the lock file {} is corrupt ({detail}), so its fencing counter cannot be trusted. Write a line `token=N` into it, with N at least the highest token any resource has seen, or delete it if no resource checks tokens (the counter then restarts at 1)",
                path.display()
            ),
            FileError::TokenOverflow { path } => {
                write!(f, "the fencing counter in {} is exhausted", path.display())
            }
            FileError::Replaced { path } => write!(
                f,
                "the lock file {} kept being deleted or replaced while it was being locked; something other than distlock is removing lock files (a tmp cleaner?)",
                path.display()
            ),
            FileError::Task(message) => write!(f, "a file operation did not finish: {message}"),
            FileError::CorruptLimit { path, detail } => write!(
                f,
                "the semaphore limit file {} is corrupt ({detail}). Delete it while no permit is held; the next user stores its limit again",
                path.display()
            ),
            FileError::LimitMismatch { path, stored, requested } => write!(
                f,
                "the semaphore has {stored} permits (stored in {}), not {requested}; every user must ask for the same number. To change it, delete that file while no permit is held",
                path.display()
            ),
            FileError::TooManyPermits { requested } => write!(
                f,
                "a file semaphore has at most {} permits (one slot file each, all tried and watched by every waiter), not {requested}",
                crate::layout::MAX_SLOTS
            ),
        }
    }
}

impl From<FileError> for Error {
    fn from(error: FileError) -> Self {
        let kind = match &error {
            FileError::Config(_) => ErrorKind::InvalidConfig,
            FileError::Io { source, .. } => classify(source).0,
            FileError::Corrupt { .. }
            | FileError::TokenOverflow { .. }
            | FileError::CorruptLimit { .. } => ErrorKind::Protocol,
            FileError::Replaced { .. } | FileError::Task(_) => ErrorKind::Unavailable,
            FileError::LimitMismatch {
                stored, requested, ..
            } => ErrorKind::LimitMismatch {
                stored: *stored,
                requested: *requested,
            },
            FileError::TooManyPermits { .. } => ErrorKind::Unsupported,
        };
        let message = error.to_string();
        let error = match error {
            FileError::Io { source, .. } => Error::new(kind, message).with_source(source),
            _ => Error::new(kind, message),
        };
        error.with_backend(BACKEND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_say_what_to_do() {
        let e: Error = FileError::io(
            "open",
            Path::new("/x/y.lock"),
            io::Error::from_raw_os_error(Errno::ACCESS.raw_os_error()),
        )
        .into();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert_eq!(e.backend(), "file");
        assert!(e.message().contains("/x/y.lock"), "{e}");
        assert!(e.message().contains("writable"), "{e}");

        let e: Error = FileError::io(
            "create",
            Path::new("/ro"),
            io::Error::from_raw_os_error(Errno::ROFS.raw_os_error()),
        )
        .into();
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    }
}
