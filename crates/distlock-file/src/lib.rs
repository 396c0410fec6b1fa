//! The file backend of distlock, the embedded default: `flock(2)` locks on lock files in a directory,
//! needing no server. `file:///dir` in a URL; [`FileBackend`] in code.
//!
//! * **Exclusion.** `flock(LOCK_EX)` on `<dir>/<escaped name>.lock` (the mapping is in [`layout`]). The
//!   kernel ties the lock to the open file description, so two [`Lock`](distlock_core::Lock)s of one
//!   process exclude each other just as two processes do, and a program the holder execs never inherits
//!   a lock (the file is opened `O_CLOEXEC`). **A child forked without exec does** share the locked open
//!   file description, so the lock stays held until both the holder and that child have closed it (a
//!   holder that forks a worker and dies keeps the lock held for the worker's life). distlock does not
//!   close it in the child for you: an at-fork handler would also take it from `distlock run`'s
//!   supervisor, which inherits the descriptor on purpose. Processes on one machine, or containers
//!   sharing the directory, contend; network file systems are not supported.
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
//! * **Read-write lock** ([`Locks::read_write`](distlock_core::Locks::read_write)): a reader holds
//!   `flock(LOCK_SH)`, a writer `flock(LOCK_EX)`, on the same lock file: the write side is the mutex,
//!   and `flock -s` / `flock -x` users of the file share and exclude as expected. Writers first: a
//!   writer waiting behind readers holds the turnstile `<stem>.writer`, which distlock readers pass (a
//!   plain `flock -s` does not). A reader carries the counter (the last write's token). A write guard
//!   downgrades atomically (`flock(LOCK_SH)` on its own descriptor). Readers are listed by `status`
//!   from `/proc/locks`.
//! * **Semaphore** ([`Locks::semaphore`](distlock_core::Locks::semaphore)): permit *i* holds
//!   `flock(LOCK_EX)` on slot file `<stem>.sem.<i>`; the limit is stored in `<stem>.sem` by the first
//!   user and kept (another limit is `LimitMismatch`; delete the file, with no permit held, to change
//!   it); at most [`layout::MAX_SLOTS`] permits. Each permit's token comes from the lock file's counter,
//!   so it is above every earlier grant of the name. A crashed holder's permit is free at once.
//!   A name's mutex and read-write lock and its semaphore wait for each other (never two holders of
//!   different kinds). How it works: `semaphore.rs`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use distlock_core::{ErrorKind, Locks};
//! use distlock_file::FileBackend;
//!
//! let dir = tempfile::tempdir()?;
//! let locks = Locks::new(FileBackend::new(dir.path())?);
//! let (a, b) = (locks.read_write("config")?, locks.read_write("config")?);
//! let (r1, r2) = (a.read().await?, b.read().await?); // readers share the lock file
//! assert!(locks.lock("config")?.try_acquire().await?.is_none()); // the mutex is the write side
//! drop((r1, r2));
//!
//! let workers = locks.semaphore("workers", 2)?;
//! let (p1, p2) = (workers.acquire().await?, workers.acquire().await?);
//! assert_eq!((p1.permit(), p2.permit()), (Some("0"), Some("1")));
//! assert!(workers.try_acquire().await?.is_none());
//! let other = locks.semaphore("workers", 3)?.try_acquire().await.unwrap_err();
//! assert_eq!(other.kind(), ErrorKind::LimitMismatch { stored: 2, requested: 3 });
//! # Ok(())
//! # }
//! ```
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
#![deny(missing_docs)]
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
mod semaphore;
mod sync_thread;

pub use backend::FileBackend;
pub use config::{FileConfig, DEFAULT_POLL_INITIAL, DEFAULT_POLL_MAX};
