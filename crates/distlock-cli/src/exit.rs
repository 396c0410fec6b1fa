//! The one exit-code table of the `distlock` command, and the one-line error a failure prints.
//!
//! `--help` renders [`help_table`]; the tests read the codes from [`Code`]; errors from the library are
//! mapped by [`Code::from_kind`]. A command that ran exits with its own code (or 128 + the signal that
//! killed it), which may collide with these: as with `timeout(1)`, callers that care must pick commands
//! whose codes do not.

use std::fmt;

use distlock::ErrorKind;

/// The codes `distlock` itself exits with (the command's own code aside).
///
/// A library error's kind picks the code scripts test for:
///
/// ```
/// use distlock::ErrorKind;
/// use distlock_cli::exit::Code;
///
/// let code = Code::from_kind(ErrorKind::Timeout);
/// assert_eq!((code, code.as_i32()), (Code::Timeout, 124)); // as timeout(1)
/// assert_eq!(Code::from_kind(ErrorKind::InvalidName).as_i32(), 64);
/// assert_eq!(Code::Busy.as_i32(), 75); // --no-wait, and the lock is held elsewhere
/// // None is above 127, so none reads as "the command was killed by a signal".
/// assert!(Code::ALL.iter().all(|code| code.as_i32() < 128));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    /// Bad flag, URL, name, duration, lease, or a missing command (sysexits `EX_USAGE`).
    Usage,
    /// The lock service could not be used (sysexits `EX_UNAVAILABLE`).
    Unavailable,
    /// Held elsewhere and `--no-wait` (sysexits `EX_TEMPFAIL`).
    Busy,
    /// The lock was lost while the command ran (also with `--on-lost ignore`).
    Lost,
    /// The `--wait` limit elapsed (as `timeout(1)`).
    Timeout,
    /// The command was found but could not be executed (as the shell).
    CannotExecute,
    /// The command was not found (as the shell).
    NotFound,
}

impl Code {
    /// Every code, in the order `--help` lists them.
    pub const ALL: [Code; 7] = [
        Code::Usage,
        Code::Unavailable,
        Code::Busy,
        Code::Lost,
        Code::Timeout,
        Code::CannotExecute,
        Code::NotFound,
    ];

    /// The process exit code.
    pub const fn as_i32(self) -> i32 {
        match self {
            Code::Usage => 64,
            Code::Unavailable => 69,
            Code::Busy => 75,
            Code::Lost => 76,
            Code::Timeout => 124,
            Code::CannotExecute => 126,
            Code::NotFound => 127,
        }
    }

    /// What the code means, for `--help`.
    pub const fn meaning(self) -> &'static str {
        match self {
            Code::Usage => {
                "usage error: bad flag, URL, lock name, duration or lease, or no command"
            }
            Code::Unavailable => "the lock service is unavailable or cannot be used",
            Code::Busy => "busy: the lock is held elsewhere and --no-wait (or --wait 0) was given",
            Code::Timeout => "the --wait limit elapsed before the lock was acquired",
            Code::Lost => "the lock was lost while the command ran (also with --on-lost ignore)",
            Code::CannotExecute => "the command could not be executed",
            Code::NotFound => "the command was not found",
        }
    }

    /// The code for a library error.
    ///
    /// Configuration and name errors are the user's to fix (64). `Unsupported` (a scheme this build
    /// lacks, an option the engine cannot honour), refused credentials and protocol surprises are
    /// "this service cannot be used as asked" (69), as is being unreachable.
    pub fn from_kind(kind: ErrorKind) -> Code {
        match kind {
            ErrorKind::InvalidConfig
            | ErrorKind::InvalidName
            | ErrorKind::LimitMismatch { .. }
            | ErrorKind::KindConflict
            | ErrorKind::WouldDeadlock => Code::Usage,
            ErrorKind::Timeout => Code::Timeout,
            ErrorKind::LockLost | ErrorKind::NotHeld => Code::Lost,
            ErrorKind::Unavailable
            | ErrorKind::InsufficientReplicas { .. }
            | ErrorKind::Unsupported
            | ErrorKind::PermissionDenied
            | ErrorKind::Protocol => Code::Unavailable,
            // ErrorKind is non-exhaustive: a kind added later is most likely a service-side problem.
            _ => Code::Unavailable,
        }
    }
}

/// The exit code of a command killed by signal `signo`, as shells report it.
pub const fn signal_code(signo: i32) -> i32 {
    128 + signo
}

/// The table `--help` shows.
pub fn help_table() -> String {
    let mut out = String::from("Exit codes of `distlock run`:\n");
    out.push_str("  <the command's>  the command ran to completion while the lock was held\n");
    out.push_str("  128+n            the command was killed by signal n\n");
    for code in Code::ALL {
        out.push_str(&format!("  {:<16} {}\n", code.as_i32(), code.meaning()));
    }
    out.push_str("`distlock status` exits 0 when it could tell, else with a code above.\n");
    out.push_str(
        "`distlock break` exits 0 when it ended the hold shown (or the lock was free), 75 when the lock \
         is still held (not confirmed, or another holder took it since), else with a code above.",
    );
    out
}

/// A failure of `distlock` itself: an exit code and one line for stderr.
///
/// Library errors convert with `?` (the code from their kind); `main` prints it with [`report`] and
/// exits with [`code`](Failure::code):
///
/// ```
/// use distlock::{Error, ErrorKind};
/// use distlock_cli::exit::{Code, Failure};
///
/// let failure = Failure::from(Error::new(ErrorKind::Timeout, "not acquired within 10s"));
/// assert_eq!((failure.code(), failure.code().as_i32()), (Code::Timeout, 124));
/// assert_eq!(failure.message(), "not acquired within 10s");
/// // Shown as one `distlock: …` line, however many lines the message has.
/// let failure = Failure::new(Code::Unavailable, "connection refused\n  is the server up?");
/// assert_eq!(failure.to_string(), "connection refused is the server up?");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    code: Code,
    message: String,
}

impl Failure {
    /// A failure with a message a user can act on.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The exit code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message, without the `distlock: ` prefix.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<distlock::Error> for Failure {
    fn from(error: distlock::Error) -> Self {
        Failure::new(Code::from_kind(error.kind()), error.to_string())
    }
}

impl From<distlock_bench::Error> for Failure {
    fn from(error: distlock_bench::Error) -> Self {
        match error {
            distlock_bench::Error::Lock(error) => error.into(),
            distlock_bench::Error::Usage(message) => Failure::new(Code::Usage, message),
            // Unavailable, and any kind added later: the benchmark could not run.
            other => Failure::new(Code::Unavailable, other.to_string()),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&one_line(&self.message))
    }
}

/// Writes `distlock: <message>` to stderr as one line: every diagnostic of the command goes through
/// here, so scripts can rely on one line per event.
pub fn report(message: impl fmt::Display) {
    eprintln!("distlock: {}", one_line(&message.to_string()));
}

/// Folds a message (a driver's error may span lines) into one line.
fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_outside_the_signal_range() {
        for (i, a) in Code::ALL.iter().enumerate() {
            assert!(a.as_i32() < 128, "{a:?}");
            for b in &Code::ALL[i + 1..] {
                assert_ne!(a.as_i32(), b.as_i32());
            }
        }
    }

    #[test]
    fn kinds_map_to_the_table() {
        assert_eq!(Code::from_kind(ErrorKind::InvalidName).as_i32(), 64);
        assert_eq!(Code::from_kind(ErrorKind::InvalidConfig).as_i32(), 64);
        assert_eq!(Code::from_kind(ErrorKind::Unavailable).as_i32(), 69);
        assert_eq!(Code::from_kind(ErrorKind::Timeout).as_i32(), 124);
        assert_eq!(Code::from_kind(ErrorKind::LockLost).as_i32(), 76);
    }

    #[test]
    fn messages_are_one_line() {
        assert_eq!(one_line("a\n  b\r\n\nc"), "a b c");
        assert!(help_table().contains("  75 "));
    }
}
