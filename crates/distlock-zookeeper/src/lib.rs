//! The ZooKeeper backend of distlock: `zk://h:p,h:p[/chroot]` in a URL, [`ZkBackend`] in code. Talks to
//! ZooKeeper with the `zookeeper-client` crate (not its `lock()` recipe, which orders waiters
//! differently from Curator and hides the czxid).
//!
//! * **Layout compatible with Apache Curator's `InterProcessMutex`** (see [`layout`]): ephemeral
//!   sequential children `_c_<uuid>-lock-<seq>` under the lock path, the holder first in Curator's own
//!   sort, each waiter watching only its predecessor. distlock and Java services using Curator exclude
//!   each other on the same path.
//! * **Sessions.** One session per distinct lease per backend: a lock's lease is its session's timeout,
//!   so a lock frees at most a lease after its holder stops (process frozen, network cut). The default
//!   lease ([`ZkBackend::default_lease`]) is the timeout the server negotiated for
//!   `?session_timeout=` (60 s asked, as Curator; the server's `maxSessionTimeout` bounds it). A lease
//!   the server will not grant exactly fails with `InvalidConfig`, never silently changed.
//! * **Fencing.** The token is the lock node's `czxid`, strictly increasing across holders.
//! * **States.** Disconnected → renewals (`sync` through the leader + `exists` of the own node) fail →
//!   `Jeopardy`; reconnected within the session → `Held`; session expired, closed, or the own node
//!   deleted → `Lost` at once (a watch on the own node); never `Held` past the deadline computed from
//!   the negotiated timeout.
//! * **Break** (`distlock break`): the holder's node deleted once its czxid is the token shown, at the
//!   version read with it; the broken guard learns it from the watch on its own node.
//! * **No orphans.** A cancelled, timed-out or interrupted acquire deletes its node, found by its
//!   `_c_<uuid>` prefix when the create's reply was lost; release deletes only the own node.
//! * **Read-write lock** = Curator's `InterProcessReadWriteLock` (`_c_<uuid>-__READ__<seq>` /
//!   `_c_<uuid>-__WRIT__<seq>`, in one first-come-first-served queue with the mutex's nodes): a reader
//!   holds before the first writer and watches it, a writer holds when first. A writer's token is its
//!   node's czxid, recorded in the name node by its release; a reader carries the last write's. The
//!   downgrade is one `multi` making Curator 5.5's `__READ__<writer's seq>` node in the writer's place.
//! * **Semaphore** = Curator's `InterProcessSemaphoreV2` (`<name>/locks` inner mutex,
//!   `<name>/leases/_c_<uuid>-lease-<seq>`), the limit stored once in `<name>/limit` as Curator's
//!   `SharedCount` writes it; token: the lease node's czxid, permit id: its name. A session's end frees
//!   a reader or a permit; a semaphore and a mutex or read-write lock of one name refuse each other
//!   (`KindConflict`). See [`layout`] and docs/DESIGN.md.
//!
//! Users reach this crate through `distlock::connect("zk://…")`; directly it is (against a running
//! ZooKeeper):
//!
//! ```no_run
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock_core::Result<()> {
//! use distlock_core::{url::LockUrl, Locks};
//!
//! let backend = distlock_zookeeper::connect(&LockUrl::parse("zk://127.0.0.1:2181/app")?).await?;
//! // The backend's defaults: the lease is the negotiated session timeout.
//! let locks = Locks::with_defaults(backend.clone(), backend.default_options());
//! let guard = locks.lock("nightly-report")?.acquire().await?;
//! let _czxid = guard.token(); // the lock node's czxid (`zkCli.sh stat`)
//! guard.release().await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod acquire;
mod backend;
mod cleanup;
mod config;
mod error;
mod held;
pub mod layout;
mod lease;
mod request;
mod rw;
mod semaphore;
mod session;

pub use backend::ZkBackend;
pub use config::{
    ZkConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SESSION_TIMEOUT,
};

/// `zk://…`: the entry point the facade's `connect` uses. See [`ZkConfig::from_url`].
pub async fn connect(url: &distlock_core::url::LockUrl) -> distlock_core::Result<ZkBackend> {
    ZkBackend::connect(url).await
}
