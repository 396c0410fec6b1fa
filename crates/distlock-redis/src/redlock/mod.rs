//! Redlock (`redlock://h1:p1,h2:p2,h3:p3`, `redlocks://` for TLS): a lock held when a quorum (N/2 + 1)
//! of N independent Redis masters grant it, as Redis's published algorithm, node-redlock, redis-py and
//! rslock do, on their layout (see [`layout`]), so their clients and distlock exclude each other.
//!
//! * **Acquire** sends the acquire script to every node in parallel, each node on its own connection
//!   (`conn.rs`'s `Link` per node) bounded by `node_timeout`, succeeds on a quorum
//!   arriving before the core's validity deadline, else releases on every node and retries after a
//!   jittered backoff bounded by the Q-th smallest pttl (no notification across independent nodes).
//! * **Renewal** needs a quorum; **release** goes to every node.
//! * **Break** (`distlock break`) deletes, on every node, the key that still holds the value `inspect`
//!   showed (owner id and nonce: a later hold of the same `Lock` is left alone); it is over once too
//!   few nodes hold it for a quorum (see `breaking`).
//! * **No fencing token**: [`Fencing::None`](distlock_core::Fencing::None). Redlock's safety rests on
//!   bounded clock drift, pauses and network delays, and on nodes not losing keys (a restart without
//!   persistence): see the Redlock section of GUARANTEES.md. Use it for efficiency, not correctness.
//! * **Mutex only**: Redlock has no read-write lock and no semaphore (`locks.read_write(…)` and
//!   `locks.semaphore(…)` fail with `ErrorKind::Unsupported`, and `distlock run --read`/`--write`/
//!   `--permits` exit 64), because no published Redlock client defines them over independent masters
//!   and a quorum of per-node reader sets or counters would not bound readers or permits across nodes.
//!
//! ```no_run
//! # async fn f() -> distlock_core::Result<()> {
//! use distlock_core::{url::LockUrl, Locks};
//! use distlock_redis::redlock::RedlockBackend;
//!
//! let url = LockUrl::parse("redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003")?;
//! let locks = Locks::new(RedlockBackend::connect(&url).await?);
//! let guard = locks.lock("orders/42")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod acquire;
mod backend;
mod breaking;
mod config;
mod fanout;
mod inspect;
pub mod layout;
mod node;

pub use backend::RedlockBackend;
pub use config::{RedlockConfig, MIN_NODES};
