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
//! ## What is where
//!
//! * **Connecting.** [`connect`] takes a URL (`file:///dir`, `redis://…`, `etcd://…`, `memory://`)
//!   and returns [`Locks`], a cheap-to-clone handle on one lock service. To build one from a backend
//!   configured in code, [`Locks::new`] takes a backend value: [`memory::MemoryBackend`],
//!   `file::FileBackend`, `redis::RedisBackend`, `etcd::EtcdBackend`.
//! * **Locking.** [`Locks::lock`] gives a [`Lock`] (one owner of one name); [`Lock::acquire`],
//!   [`Lock::try_acquire`] and [`Lock::options`] ([`AcquireOptions`]: wait limit, lease, max hold)
//!   return a [`LockGuard`]: its [`FencingToken`], its [`LockState`] and the [`LockGuard::lost`]
//!   signal, `extend` and `release`. Defaults for every lock of a [`Locks`] are [`LockOptions`] (with
//!   [`Wait`]).
//! * **Looking.** [`Locks::inspect`] returns a [`LockInfo`] (with [`HolderInfo`]) without taking the
//!   lock; [`Locks::capabilities`] says what the backend promises ([`Capabilities`], [`Fencing`],
//!   [`LockKinds`]).
//! * **Errors.** Every call returns [`Result`]; an [`Error`] has an [`ErrorKind`] to match on.
//! * **Backends**, one module each, compiled in by cargo feature: [`memory`] (always), `file`
//!   (default), `redis` (with Redlock as `redis::redlock`), `etcd`, `zookeeper`. Each module holds the
//!   backend type, its config and the description of its on-server layout. Network configs take
//!   [`Endpoint`]s and hold their credentials, TLS, timeouts and [`RetryPolicy`] in one
//!   [`ConnectionOptions`] (`config.connection`). PostgreSQL and MySQL/MariaDB (features `postgres`,
//!   `mysql`) are reached through [`connect`] with the driver's own URL; their types live in the
//!   `distlock-sql` crate.
//! * **For backend authors:** [`raw`], the trait a backend implements and the types it exchanges
//!   with the core. Users never call it.
//!
//! ## Metrics and traces
//!
//! distlock records through the [`metrics`](https://docs.rs/metrics) facade and emits
//! [`tracing`](https://docs.rs/tracing) spans; it ships no exporter. Nothing is recorded unless the
//! application installs a recorder, and that **before** it makes its [`Locks`] (handles made before a
//! recorder exists record nothing). With one, the hot path costs a few atomic adds.
//! `examples/metrics.rs` serves them for Prometheus with `metrics-exporter-prometheus`:
//!
//! ```text
//! cargo run -p distlock --example metrics 127.0.0.1:9898
//! curl -s http://127.0.0.1:9898/metrics | grep ^distlock_
//! ```
//!
//! | series | type | labels besides `engine`, `kind` |
//! |---|---|---|
//! | `distlock_acquisitions_total` | counter | `outcome`: `acquired`, `busy` (a try found it held, or the wait limit ran out), `error`, `cancelled` (the acquire future was dropped) |
//! | `distlock_acquire_wait_seconds` | histogram | `outcome` |
//! | `distlock_waiters` | gauge | acquires of this process waiting now, for a holder here or elsewhere |
//! | `distlock_holds` | gauge | `state`: `held`, `jeopardy` (holds of this process now) |
//! | `distlock_hold_seconds` | histogram | `end`: `released`, `lost` (from the grant's request to the release or the loss) |
//! | `distlock_renewals_total` | counter | `outcome`: `extended`, `gone`, `failed` |
//! | `distlock_renewal_seconds` | histogram | the round trip of answered renewals |
//! | `distlock_jeopardy_total` | counter | holds that went into Jeopardy |
//! | `distlock_lost_total` | counter | `reason`: `expired` (no confirmed renewal in time), `max_hold`, `gone` (a renewal found the key gone or another owner's), `reported` (the engine said so: a session or lease ended, a watch saw the key go) |
//! | `distlock_errors_total` | counter | `op`: `acquire`, `release`, `renew`; `error`: the [`ErrorKind`] in snake case (`unavailable`, `not_held`, …) |
//!
//! `engine` is the backend (`redis`, `redlock`, `etcd`, `zookeeper`, `postgres`, `mysql`, `file`,
//! `memory`) and `kind` what is held (`mutex`, `read`, `write`, `permit`). Lock names are labels only
//! after [`Locks::with_name_labels`]: they can be unbounded.
//!
//! Spans: `distlock.acquire` per acquire call (`engine`, `lock`, `kind`, then `outcome`, `wait_ms`,
//! `token`), a child of the caller's span; `distlock.hold` per hold, from the grant to the release or
//! the loss (`token`, then `end` and the loss `reason`), a root span that follows the caller's span
//! and its acquire (a hold outlives the request that took it; as a child it would keep that span
//! open). Events: `lock acquired`, `acquire failed` and `lock released` at `info`; `renewal failed;
//! lock in jeopardy` and `lock lost` at `warn`, `renewal confirmed; lock held again` at `info`, each in
//! the hold's span; a busy try and each wait after one at `debug`.
//!
//! Cargo feature `testing` (off by default; for tests only) adds fault-injection hooks: `freeze`,
//! `delay_renewals` and friends on [`memory::MemoryBackend`], `memory://…?freeze_after=`, and the test
//! hooks of the Redis and etcd backends.
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod connect;

pub use connect::{connect, default_file_dir};
pub use distlock_core::connection::ConnectionOptions;
pub use distlock_core::retry::RetryPolicy;
pub use distlock_core::url::{Endpoint, LockUrl};
pub use distlock_core::{
    AcquireOptions, Capabilities, Error, ErrorKind, Fencing, FencingToken, HolderInfo, Lock,
    LockGuard, LockInfo, LockKind, LockKinds, LockOptions, LockState, Locks, NodeInfo,
    ReadWriteOrder, Result, RwLock, Semaphore, Wait, MAX_PERMITS,
};

pub use distlock_core::raw;

/// The in-memory backend (`memory://`), always compiled: the reference implementation of every
/// semantic inside one process, for tests and examples.
pub mod memory {
    pub use distlock_core::MemoryBackend;
}

/// The embedded file backend (`file:///dir`, cargo feature `file`, on by default). The whole story is
/// in the [`distlock_file`] crate's docs.
#[cfg(feature = "file")]
pub mod file {
    pub use distlock_file::{
        layout, FileBackend, FileConfig, DEFAULT_POLL_INITIAL, DEFAULT_POLL_MAX,
    };
}

/// The Redis backend (`redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`; cargo feature
/// `redis`). The whole story is in the [`distlock_redis`] crate's docs.
#[cfg(feature = "redis")]
pub mod redis {
    /// Redlock (`redlock://`, `redlocks://`): a quorum over N independent masters, no fencing token.
    pub use distlock_redis::redlock;
    pub use distlock_redis::{
        layout, RedisBackend, RedisConfig, RedisLayout, Topology, DEFAULT_CONNECT_TIMEOUT,
        DEFAULT_POLL, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRY, DEFAULT_SENTINEL_PORT,
        DEFAULT_WAIT_TIMEOUT, RENEWALS_PER_PIPELINE,
    };
}

/// The etcd backend (`etcd://`, `etcds://`; cargo feature `etcd`). The whole story is in the
/// [`distlock_etcd`] crate's docs. Its gRPC client (`distlock_etcd::rpc`) is not re-exported here: it
/// serves the backend, its tests and the bench, and is not a general etcd client.
#[cfg(feature = "etcd")]
pub mod etcd {
    pub use distlock_etcd::{
        layout, EtcdBackend, EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT,
        DEFAULT_REQUEST_TIMEOUT, DEFAULT_SESSION_TTL,
    };
}

/// The ZooKeeper backend (cargo feature `zookeeper`): `zk://h:p,h:p[/chroot]`, Curator
/// `InterProcessMutex`-compatible layout, czxid fencing. See the [`distlock_zookeeper`] crate's docs.
#[cfg(feature = "zookeeper")]
pub mod zookeeper {
    pub use distlock_zookeeper::{
        layout, ZkBackend, ZkConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT,
        DEFAULT_REQUEST_TIMEOUT, DEFAULT_SESSION_TIMEOUT,
    };
}
