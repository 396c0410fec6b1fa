//! The etcd v3 backend of distlock: `etcd://h:p,h:p` (`etcds://` for TLS) in a URL, [`EtcdBackend`] in
//! code. Talks to etcd with its own gRPC client ([`rpc`]: tonic, and code generated once from etcd's
//! protos and checked in, so building needs no `protoc`).
//!
//! * **Layout compatible with etcd's Go `concurrency.Mutex` and `etcdctl lock NAME`** (see [`layout`]):
//!   key `NAME/<session lease id in hex>`, the holder is the oldest key under `NAME/`, waiters queue in
//!   creation order and each watches only its predecessor. distlock, Go services and `etcdctl lock`
//!   exclude each other. Unlike Go, distlock counts only `NAME`'s own keys under the prefix
//!   ([`layout::is_contender`]), so a lock `a` and a lock `a/b` nested under it never block each other
//!   (a Go client on `a` still waits behind `a/b`'s keys: see [`layout`]).
//! * **Sessions.** One lease per distinct TTL per backend (a lock's lease, rounded up to whole seconds,
//!   picks its session), kept alive on one stream every third of its TTL; every lock key of the backend
//!   hangs on its session's lease, so an acquire is one transaction and renewals cost one keep-alive per
//!   session per watchdog tick. [`EtcdBackend::default_lease`] is `?session_ttl=` (60 s, Go's default).
//! * **Fencing.** The token is the holder key's create_revision, strictly increasing per name; a
//!   permit granted after its first try carries the revision of the write its grant made to its key
//!   (the key's mod_revision; [`layout::permit_grant_txn`]). [`layout::fenced_put`] writes into etcd
//!   only while the lock key's mod_revision is still the token (a mutex's or writer's key is never
//!   written after its create). A reader's token is not its key's (it carries the last write's), so
//!   `fenced_put` is for mutex holders, writers and permits.
//! * **Loss.** Keep-alive failures make guards Jeopardy, then Lost at the deadline computed from the
//!   granted TTL; a held key deleted on the server (`etcdctl del`, a revoked or expired lease) makes its
//!   guard Lost within a round trip: the backend watches the keys it holds on one watch stream.
//! * **Break** (`distlock break`): the holder's key deleted by its create_revision, its session lease
//!   left alone ([`layout::break_txn`]); the broken guard learns it from the held-keys watch.
//! * **One owner per key.** Owners of one name sharing a session (two `Locks` on clones of one backend)
//!   each claim a key of their own (`NAME/<lease hex>_<n>` for all but the first) and queue; a key is
//!   adopted only by the owner that wrote it.
//! * **Lock kinds** (issue 25): a read-write lock with the key shapes of Go's `recipe.RWMutex`
//!   (`NAME/read/<unix nanos>`, `NAME/write/<unix nanos>`) and a semaphore of distlock's own
//!   (`NAME/permit.<lease hex>.<n>`, its limit kept at [`layout::limit_key`]). Every kind of a name is
//!   in one queue by create_revision ([`layout::classify`]): FIFO, and kinds wait for each other.
//!   A reader carries the last write's token ([`layout::write_record_key`]); no atomic downgrade.
//! * **What the Go client gets wrong, done right:** after waiting, the own key is checked (same
//!   transaction as the holder read) before the lock is reported held (etcd issue 11456); release deletes
//!   the own key only while its create_revision matches (22082); a waiter whose session dies stops with
//!   an error (19597); a cancelled acquire deletes its queued key.
//!
//! Users reach this crate through `distlock::connect("etcd://…")`; directly it is (against a running
//! etcd):
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock_core::Result<()> {
//! use distlock_core::{url::LockUrl, Locks};
//!
//! let backend = distlock_etcd::connect(&LockUrl::parse("etcd://127.0.0.1:2379")?).await?;
//! // The backend's defaults: the lease is the session TTL (`?session_ttl=`, 60 s).
//! let locks = Locks::with_defaults(backend.clone(), backend.default_options());
//! let guard = locks.lock("nightly-report")?.acquire().await?;
//! let _revision = guard.token(); // the key's create_revision, as `etcdctl get -w fields` shows it
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod acquire;
mod backend;
mod claims;
mod config;
mod conn;
mod error;
mod expiry;
mod held;
pub mod layout;
mod lease;
pub mod rpc;
mod session;
mod tasks;

pub use backend::EtcdBackend;
pub use config::{
    EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT, DEFAULT_SESSION_TTL,
};

/// `etcd://…` / `etcds://…`: the entry point the facade's `connect` uses. See [`EtcdConfig::from_url`].
pub async fn connect(url: &distlock_core::url::LockUrl) -> distlock_core::Result<EtcdBackend> {
    EtcdBackend::connect(url).await
}
