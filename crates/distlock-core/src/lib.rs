//! The core of distlock: [`Locks`], [`Lock`], [`LockGuard`], [`LockState`], [`FencingToken`], the
//! watchdog, [`Error`]/[`ErrorKind`], [`Capabilities`], the [`raw::Backend`] trait backends implement, and
//! the in-memory reference backend ([`MemoryBackend`]).
//!
//! Users depend on the `distlock` facade, which re-exports the user-facing part of this crate by name;
//! backend crates depend on this crate directly. Semantics live here, once: reentrancy per [`Lock`] with
//! the same token, the local FIFO of same-name waiters inside one [`Locks`], validity deadlines on the
//! boot clock, the three states, the watchdog that renews in batches, and undoing cancelled acquires.
//!
//! What is where:
//!
//! * at the root: the user API (what the facade re-exports);
//! * [`raw`]: the interface for backend authors (the [`raw::Backend`] trait and its request and reply
//!   types); [`url`] (the URL grammar a backend's `from_url` parses), [`retry`] (the one retry and
//!   backoff policy), [`connection`] (the credentials, TLS, timeouts and retry policy of every
//!   network backend's config) and [`clock`] (the boot clock deadlines are on) are for backend
//!   crates too;
//! * [`duration`] and [`name`]: the duration syntax (`500ms`, `2m`) and the lock-name rules, for the
//!   `distlock` CLI and backends' messages.
//!
//! Cargo feature `testing` (off by default; the testkit turns it on): fault-injection hooks on
//! [`MemoryBackend`] (`freeze`, `delay_renewals`, …), `memory://…?freeze_after=`, and a simulated
//! suspend of the machine (`clock::testing::suspend`).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock_core::Result<()> {
//! use distlock_core::{LockState, Locks, MemoryBackend};
//!
//! let locks = Locks::new(MemoryBackend::new());
//! let guard = locks.lock("orders/42")?.acquire().await?;
//! assert_eq!(guard.state(), LockState::Held);
//! let token = guard.token().expect("the memory backend mints tokens");
//! // Each `Lock` is one owner: another finds the name held, then gets a higher token.
//! let other = locks.lock("orders/42")?;
//! assert!(other.try_acquire().await?.is_none());
//! guard.release().await?;
//! let next = other.try_acquire().await?.expect("free after the release");
//! assert!(next.token().expect("a token") > token);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod capabilities;
pub mod clock;
pub mod connection;
pub mod duration;
mod error;
mod gate;
mod guard;
mod kinds;
mod locks;
mod memory;
pub mod name;
mod options;
pub mod raw;
pub mod retry;
mod state;
mod sync;
mod telemetry;
mod token;
pub mod url;
mod watchdog;

pub use capabilities::{Capabilities, Fencing, LockKinds, ReadWriteOrder};
pub use error::{Error, ErrorKind, Result};
pub use guard::LockGuard;
pub use kinds::{LockKind, RwLock, Semaphore, MAX_PERMITS};
pub use locks::{AcquireOptions, Lock, Locks};
pub use memory::MemoryBackend;
pub use options::{LockOptions, Wait};
pub use raw::{HolderInfo, LockInfo, NodeInfo};
pub use state::LockState;
pub use token::FencingToken;
