//! The three states of a held lock.

use std::fmt;

/// Whether a guard's holder may still assume it owns the lock.
///
/// `Held → Jeopardy → Held` (a renewal confirmed before the deadline) or `→ Lost`; `Lost` is final.
///
/// ```
/// use distlock_core::{LockState, Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let guard = locks.lock("nightly")?.acquire().await?;
/// // Before each step that must run under the lock (the fencing token protects the rest).
/// match guard.state() {
///     LockState::Held => { /* go on */ }
///     LockState::Jeopardy => { /* finish or pause what cannot be undone; a renewal may still come */ }
///     _ => { /* Lost: stop */ }
/// }
/// assert_eq!(guard.state().as_str(), "held");
/// # guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockState {
    /// Owned, and the validity deadline (if any) has not passed.
    Held,
    /// A renewal failed or is late, or the connection is down, and the deadline has not passed yet.
    Jeopardy,
    /// Ownership can no longer be assumed: the deadline passed without a confirmed renewal, the server
    /// said someone else owns it, the session or connection is gone, or `max_hold` was reached.
    Lost,
}

impl LockState {
    /// A lower-case name for logs and the CLI.
    pub fn as_str(&self) -> &'static str {
        match self {
            LockState::Held => "held",
            LockState::Jeopardy => "jeopardy",
            LockState::Lost => "lost",
        }
    }
}

impl fmt::Display for LockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
