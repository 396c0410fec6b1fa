//! The testkit's one error type.
//!
//! Every variant says what the test was waiting for and, where a server was involved, carries the tail of
//! its log, so a failing test explains itself without anyone re-running it by hand.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Result with [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a testkit operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server binary is not installed. Tests never skip silently: the message names the fix.
    #[error("`{program}` was not found on PATH: {hint}")]
    MissingBinary {
        /// The program that was looked up.
        program: String,
        /// How to install it (an `apt-get install` line, or `run scripts/setup.sh`).
        hint: String,
    },

    /// `fork`/`exec` of a server failed for a reason other than a missing binary.
    #[error("could not spawn {name} (`{program}`): {source}")]
    Spawn {
        /// The server's name (also its log file's stem).
        name: String,
        /// The program.
        program: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The server exited before it became ready (typically: its port was taken after all, or bad args).
    #[error(
        "{name} exited before it became ready ({status}); dir {dir}; last log lines:\n{log_tail}"
    )]
    Exited {
        /// The server's name.
        name: String,
        /// How it ended, e.g. `exit status: 1`.
        status: String,
        /// The kept temp dir with its data and log.
        dir: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },

    /// The readiness probe did not succeed before the deadline.
    #[error(
        "{name} (pid {pid}) not ready after {waited:?}: {last}; dir {dir}; last log lines:\n{log_tail}"
    )]
    NotReady {
        /// The server's name.
        name: String,
        /// Its pid.
        pid: u32,
        /// How long the probe was retried.
        waited: Duration,
        /// What the last probe saw.
        last: String,
        /// The kept temp dir with its data and log.
        dir: PathBuf,
        /// The last lines of its log.
        log_tail: String,
    },

    /// Every port in the testkit's range was locked by another test or bound by another process.
    #[error(
        "no free loopback port in {first}..={last} (all locked by other tests or already bound)"
    )]
    NoFreePort {
        /// First port of the range searched.
        first: u16,
        /// Last port of the range searched.
        last: u16,
    },

    /// An operation did not complete in time (e.g. a command to a paused server).
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was being done.
        what: String,
        /// The timeout that elapsed.
        after: Duration,
    },

    /// A peer spoke something that is not the protocol we expected.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// The operation does not fit the server's current state (e.g. `pause` on a killed server).
    #[error("invalid state: {0}")]
    State(String),

    /// Any other I/O failure, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// True for [`Error::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }
}
