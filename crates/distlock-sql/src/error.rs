//! The SQL backends' errors, mapped once into [`distlock_core::Error`], tagged with the engine's
//! backend name (`"postgres"`, `"mysql"`). Each engine module maps its driver's errors into
//! [`SqlError`] (by SQLSTATE / error code), so the kinds mean the same on both engines.

use std::fmt;
use std::time::Duration;

use distlock_core::{Error, ErrorKind};

/// A driver error kept as the `source` of distlock's error.
pub(crate) type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in a SQL backend.
#[derive(Debug)]
#[allow(dead_code)] // each engine uses its share of the variants
pub(crate) enum SqlError {
    /// A bad URL or option.
    Config(String),
    /// A lock name the mode cannot take.
    Name(String),
    /// Something the engine or mode cannot do; nothing was changed.
    Unsupported(String),
    /// The server refused the credentials, the database, or a statement (no `CREATE` privilege).
    Denied {
        message: String,
        source: Option<Source>,
    },
    /// The table exists with another shape than distlock's.
    TableShape(String),
    /// The server could not be reached, or the connection broke; `action` says during what.
    Unavailable {
        action: &'static str,
        message: String,
        source: Option<Source>,
    },
    /// A statement got no answer in time.
    Timeout {
        action: &'static str,
        after: Duration,
    },
    /// The connection's server session changed between statements (a transaction pooler in between).
    SessionChanged(String),
    /// The server answered something distlock's layout does not allow.
    Protocol(String),
    /// A semaphore asked for with another limit than the one stored on the server.
    LimitMismatch {
        stored: u32,
        requested: u32,
        message: String,
    },
    /// The name is in use as another kind of lock; the message names it.
    KindConflict(String),
}

impl SqlError {
    /// The error as distlock reports it, tagged with the backend and, when known, the lock name.
    pub(crate) fn into_core(self, backend: &'static str, lock: Option<&str>) -> Error {
        let (kind, message, source) = match self {
            SqlError::Config(m) => (ErrorKind::InvalidConfig, m, None),
            SqlError::Name(m) => (ErrorKind::InvalidName, m, None),
            SqlError::Unsupported(m) => (ErrorKind::Unsupported, m, None),
            SqlError::Denied { message, source } => (ErrorKind::PermissionDenied, message, source),
            SqlError::TableShape(m) => (ErrorKind::InvalidConfig, m, None),
            SqlError::Unavailable {
                action,
                message,
                source,
            } => (
                ErrorKind::Unavailable,
                format!("{action}: {message}"),
                source,
            ),
            SqlError::Timeout { action, after } => (
                ErrorKind::Unavailable,
                format!("{action}: no answer within {after:?}"),
                None,
            ),
            SqlError::SessionChanged(m) => (ErrorKind::Unsupported, m, None),
            SqlError::Protocol(m) => (ErrorKind::Protocol, m, None),
            SqlError::LimitMismatch {
                stored,
                requested,
                message,
            } => (
                ErrorKind::LimitMismatch { stored, requested },
                message,
                None,
            ),
            SqlError::KindConflict(m) => (ErrorKind::KindConflict, m, None),
        };
        let mut error = Error::new(kind, message).with_backend(backend);
        if let Some(source) = source {
            error = error.with_source(source);
        }
        match lock {
            Some(name) => error.with_lock(name),
            None => error,
        }
    }
}

impl fmt::Display for SqlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
