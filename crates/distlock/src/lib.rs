//! # distlock
//!
//! Distributed locks over the engines teams already run, with fencing tokens, a loss signal that is
//! never late (`Held` / `Jeopardy` / `Lost`), owner-only idempotent release, and waiters woken by
//! notification. Works with no server at all on the embedded file backend.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock::Result<()> {
//! let locks = distlock::connect("memory://").await?;     // or file:///var/lock/myapp, redis://…
//! let lock = locks.lock("orders/42")?;                     // one owner; no I/O yet
//! let guard = lock.acquire().await?;                       // waits; the watchdog renews while held
//! let token = guard.token();                               // pass it to the resource
//! assert_eq!(guard.state(), distlock::LockState::Held);
//! tokio::select! {
//!     _ = async { /* the work, fenced with `token` */ } => {}
//!     _ = guard.lost() => { /* ownership can no longer be assumed: stop */ }
//! }
//! guard.release().await?;
//! # let _ = token;
//! # Ok(())
//! # }
//! ```
//!
//! Backends compiled in, by cargo feature: `memory` (always), `file` (default), `redis`, `etcd`. The
//! others (Redlock, ZooKeeper, PostgreSQL, MySQL) are being built; their URL schemes are recognised and
//! fail with [`ErrorKind::Unsupported`] until they land.
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod connect;

pub use connect::{connect, default_file_dir};
pub use distlock_core::*;

/// The embedded file backend.
#[cfg(feature = "file")]
pub use distlock_file as file;

/// The Redis backend (standalone, Sentinel, Cluster).
#[cfg(feature = "redis")]
pub use distlock_redis as redis;

/// The etcd backend.
#[cfg(feature = "etcd")]
pub use distlock_etcd as etcd;
