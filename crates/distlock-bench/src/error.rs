//! The one error of a benchmark run: what went wrong, and whose fault it is (the caller's arguments,
//! or a service that could not be used), so a command can pick its exit code.

use std::fmt;

/// Why a benchmark run failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A bad argument (a zero duration, a malformed URL or host).
    Usage(String),
    /// A baseline client or the benchmark itself could not run.
    Unavailable(String),
    /// distlock itself failed; its kind says how.
    Lock(distlock::Error),
}

impl Error {
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Error::Usage(message.into())
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        Error::Unavailable(message.into())
    }
}

impl From<distlock::Error> for Error {
    fn from(error: distlock::Error) -> Self {
        Error::Lock(error)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(message) | Error::Unavailable(message) => f.write_str(message),
            Error::Lock(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Lock(error) => Some(error),
            _ => None,
        }
    }
}
