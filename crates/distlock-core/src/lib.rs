//! The core of distlock: [`Locks`], [`Lock`], [`LockGuard`], [`LockState`], [`FencingToken`], the
//! watchdog, [`Error`]/[`ErrorKind`], [`Capabilities`], the [`raw::Backend`] trait backends implement, and
//! the in-memory reference backend.
//!
//! Users depend on the `distlock` facade, which re-exports this crate; backend crates depend on it
//! directly. Semantics live here, once: reentrancy per [`Lock`] with the same token, the local FIFO of
//! same-name waiters inside one [`Locks`], validity deadlines on the boot clock, the three states, the
//! watchdog that renews in batches, and undoing cancelled acquires.
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

pub mod capabilities;
pub mod clock;
pub mod duration;
pub mod error;
mod guard;
mod locks;
pub mod memory;
pub mod name;
pub mod options;
pub mod raw;
pub mod retry;
pub mod state;
mod sync;
pub mod token;
pub mod url;
mod watchdog;

pub use capabilities::{Capabilities, Fencing, LockKinds};
pub use error::{Error, ErrorKind, Result};
pub use guard::LockGuard;
pub use locks::{AcquireOptions, Lock, Locks};
pub use options::{LockOptions, Wait};
pub use state::LockState;
pub use token::FencingToken;
