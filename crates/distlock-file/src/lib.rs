//! The file backend of distlock, the embedded default: `flock(2)` locks on lock files in a directory,
//! needing no server. `file:///dir` in a URL; [`FileBackend`] in code.
//!
//! * **Exclusion.** `flock(LOCK_EX)` on `<dir>/<escaped name>.lock` (the mapping is in [`layout`]). The
//!   kernel ties the lock to the open file description, so two [`Lock`](distlock_core::Lock)s of one
//!   process exclude each other just as two processes do, and a child process never inherits a lock (the
//!   file is opened `O_CLOEXEC`). Processes on one machine, or containers sharing the directory, contend;
//!   network file systems are not supported.
//! * **No lease.** The lock is held until it is released or the holding process dies (whatever the way:
//!   the kernel releases it), so a guard's `validity_deadline()` is `None` and `max_hold`/`extend` are
//!   unsupported. The guard becomes Lost only if the lock file is deleted or replaced while held.
//! * **Fencing.** Each lock file keeps a counter: every acquire writes counter + 1 with a holder record
//!   and `fdatasync`s it before the grant, so tokens strictly increase across holders, processes,
//!   restarts and crashes. Lock files are never unlinked (that would race with waiters and reset the
//!   counter); do not let a tmp cleaner remove them.
//! * **Waiting.** Never blocked in `flock`: a try is non-blocking, and a waiter sleeps until inotify
//!   reports the lock file closed (a release, or a holder's death) with a jittered exponential fallback
//!   poll (25 ms up to 1 s) in case an event is missed. A bounded or cancelled wait leaves nothing
//!   behind. Not FIFO across processes.
//! * **Status.** [`Locks::inspect`](distlock_core::Locks::inspect) reads the record (owner, pid, host,
//!   token, since) and tests the lock without taking it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use distlock_core::Locks;
//! use distlock_file::FileBackend;
//!
//! let dir = tempfile::tempdir()?;
//! let locks = Locks::new(FileBackend::new(dir.path())?);
//!
//! let first = locks.lock("orders/42")?;
//! let second = locks.lock("orders/42")?;
//! let guard = first.acquire().await?;
//! assert!(second.try_acquire().await?.is_none()); // held by `first`
//!
//! let info = locks.inspect("orders/42").await?;
//! let holder = info.holder.expect("held");
//! assert_eq!(holder.owner.as_deref(), Some(first.owner()));
//! assert_eq!(holder.pid, Some(std::process::id()));
//! assert_eq!(holder.token, guard.token());
//!
//! let token = guard.token();
//! guard.release().await?;
//! let next = second.acquire().await?;
//! assert!(next.token() > token); // strictly increasing across holders
//! next.release().await?;
//! # Ok(())
//! # }
//! ```
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod acquire;
mod backend;
mod config;
mod error;
mod held;
mod inspect;
pub mod layout;
mod notify;
mod open;
mod sync_thread;

pub use backend::FileBackend;
pub use config::{FileConfig, DEFAULT_POLL_INITIAL, DEFAULT_POLL_MAX};
