//! The Redis backend of distlock: standalone (`redis://`, `rediss://`), Sentinel (`redis+sentinel://`)
//! and Cluster (`redis+cluster://`), on Redisson's `RLock` layout so Java services using Redisson and
//! Rust services using distlock exclude each other (see [`layout`]). Also Redlock (`redlock://`,
//! `redlocks://`) over N independent masters, on node-redlock's layout: see [`redlock`].
//!
//! * **Lock.** A hash at key `NAME`, field = owner, `PEXPIRE` = lease; the watchdog of the core renews it
//!   every third of the lease (one pipelined round trip per connection, or per Cluster slot: a large
//!   batch in pipelines of [`RENEWALS_PER_PIPELINE`] sent back to back).
//! * **Fencing.** `INCR` of `redisson_lock_token:{NAME}` inside the acquire script:
//!   [`Fencing::BestEffort`](distlock_core::Fencing::BestEffort), since a failover to a replica that
//!   missed the increment, or a restart without persistence, can hand out a token again.
//! * **Waiting.** Pub/sub on `redisson_lock__channel:{NAME}` (sharded in Cluster), one connection per
//!   backend, no polling: see [`pubsub`](crate::RedisBackend#acquire-and-wait).
//! * **Durability.** Optional `WAIT n timeout` after every grant and renewal
//!   (`?wait_replicas=1&wait_timeout=200ms`), on a dedicated connection; fewer confirmations fail the
//!   acquire with `InsufficientReplicas` (and undo it) or put a held lock in Jeopardy.
//! * **Loss.** Found by the renewal reply (the key gone or someone else's → Lost at once) and by the
//!   core's validity deadline (no confirmed renewal → Lost).
//! * **Plain layout** (`?layout=plain`): the string key `NAME` = owner, `SET NX PX`, as redis-py's
//!   `Lock`, rslock and node-redlock (one node) write it, so their holders and distlock's exclude each
//!   other; the same token counter; releases publish on `distlock_lock__channel:{NAME}`, and waiters
//!   also try again every `poll` (100 ms) for holders that publish nothing. See [`layout`].
//! * **Kinds.** The read-write lock (`Locks::read_write`) on Redisson's `RReadWriteLock` layout, readers
//!   first, with an atomic downgrade, and the semaphore (`Locks::semaphore`) on Redisson's
//!   `RPermitExpirableSemaphore` layout with scores from the server's clock and the limit kept as
//!   Redisson's counter keeps it; a name is one kind at a time (`KindConflict`). Redlock has neither.
//!   See [`layout`] for the keys and scripts.
//!
//! ```no_run
//! # async fn f() -> distlock_core::Result<()> {
//! use distlock_core::{url::LockUrl, Locks};
//! use distlock_redis::RedisBackend;
//!
//! let backend = RedisBackend::connect(&LockUrl::parse("redis://127.0.0.1:6379")?).await?;
//! let locks = Locks::new(backend);
//! let guard = locks.lock("orders/42")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod acquire;
mod backend;
mod breaking;
mod config;
mod conn;
mod error;
mod handoff;
mod inspect;
mod kinds;
pub mod layout;
mod pubsub;
pub mod redlock;
mod release;
mod renew;
mod rpc;
mod undo;

pub use backend::RedisBackend;
pub use config::{
    RedisConfig, RedisLayout, Topology, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POLL, DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRY, DEFAULT_SENTINEL_PORT, DEFAULT_WAIT_TIMEOUT,
};
pub use renew::RENEWALS_PER_PIPELINE;

pub use redlock::{RedlockBackend, RedlockConfig};

/// Connects as the URL says: `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`
/// (`redlock://` and `redlocks://` with [`RedlockBackend::connect`]).
pub async fn connect(url: &distlock_core::url::LockUrl) -> distlock_core::Result<RedisBackend> {
    RedisBackend::connect(url).await
}
