//! The PostgreSQL backend (`postgres://`, `postgresql://`), driver tokio-postgres.
//!
//! The URL is tokio-postgres' own (libpq's key/value options as query parameters: `host=/socket/dir`,
//! `sslmode=`, `connect_timeout=`, `application_name=`, …), handed to the driver as written once
//! distlock's own parameters ([`crate::DISTLOCK_QUERY`]: `mode`, `table`, `schema`, `key`, `lease`,
//! `request_timeout`) are stripped.
//!
//! **TLS** is rustls (ring), with libpq's spellings: `sslmode=disable|prefer|require|verify-ca|verify-full`
//! (default `prefer`) and `sslrootcert=<file>` (a PEM CA trusted instead of the system roots). `require`
//! encrypts without checking the certificate, as libpq does, unless `sslrootcert` is given (then the
//! chain is checked, as libpq does); `verify-ca` checks the chain, `verify-full` the chain and the host
//! name (an IP address in the URL is checked against the certificate's IP names). The cancel request of
//! a given-up wait uses the same TLS. tokio-postgres knows neither `verify-*` nor `sslrootcert`, so
//! distlock takes them out of the URL and hands the driver `sslmode=require`. SCRAM runs without
//! channel binding (`channel_binding=require` is refused by the driver). A failed handshake is
//! `Unavailable` with a message that says so.
//!
//! ```text
//! postgres://app:pw@db.example:5432/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem
//! ```
//!
//! **Poolers.** Advisory and row locks live in a server session. A connection pooler (PgBouncer) hands
//! the client a cancel key of its own at login, whose process id is not `pg_backend_pid()`; distlock
//! compares the two on every connection it opens for a lock and refuses (`Unsupported`, the message names
//! the pooler and says to use `?mode=lease`) before anything is locked. Lease mode holds no session and
//! works through a transaction pooler. (A session-mode pooler, which would be safe, is refused too: the
//! two look the same at login.)
//!
//! * **advisory** (default): `pg_advisory_lock(key)` on a dedicated connection held for the life of the
//!   guard; the key is [`layout::advisory_key`] of the name (or `?key=`).
//! * **row**: `SELECT … FOR UPDATE` of the name's row in a transaction held open on a dedicated
//!   connection.
//! * **lease**: the name's row as a versioned lease (see [`layout`]); no connection held.
//!
//! **Lock kinds** ([`layout`] has every key and statement):
//!
//! | mode | read-write lock | semaphore |
//! |---|---|---|
//! | advisory | `pg_advisory_lock_shared` / `pg_advisory_lock` on the mutex's key (.NET DistributedLock's layout): the write side *is* the mutex; first come, first served in the server's lock queue (a reader arriving while a writer waits queues behind it); atomic downgrade | N slot keys in the two-int key space ([`layout::permit_key`]) plus the name's key shared; the limit stored in `<table>_limit` and kept; waits on `NOTIFY` plus a 1 s poll |
//! | row | the name's row `FOR SHARE` / `FOR UPDATE` in the held transaction; readers first (a `FOR SHARE` gets in past a waiting `FOR UPDATE`); no downgrade | `Unsupported` (use advisory mode) |
//! | lease | `Unsupported`: the lease row has one owner; a reader set would need another layout | `Unsupported` |
//!
//! A name is one kind at a time: in advisory mode its mutex, its write lock and its permits exclude
//! each other in the server (permits hold the key shared), and a read lock on a name with a stored
//! semaphore limit fails with `KindConflict`. A reader or permit holder whose process dies frees its
//! hold when its session ends (at once on a closed connection, else within its lease, as the mutex).
//!
//! Every mode mints a fencing token committed before the grant: a counter row (`<table>_fence`) in
//! advisory and row modes, the lease's version in lease mode. A write grant and each permit grant bump
//! it; a read grant carries its value (the last write grant's token). Advisory and row locks get a
//! server-enforced loss deadline from `idle_session_timeout` / `idle_in_transaction_session_timeout`
//! (needs PostgreSQL 14 or later); see `session.rs`. [`fence`] guards a resource's own `UPDATE` with
//! the token.
//!
//! **Breaking** (`Locks::break_holder`, `distlock break`): advisory and row modes end the holder's
//! session with `pg_terminate_backend`, in the statement that checks that the session `inspect`
//! showed (`owner = "postgres backend <pid>"`) still holds the name exclusive as the very hold shown
//! (`hold_id`: the row lock's transaction; in advisory mode the token, or for a session that is not
//! distlock's its idle state); lease mode expires the lease row (at `-infinity`) where owner and
//! version match. A holder given that is a reader or a permit holder is `Unsupported`; a holder that
//! is not distlock's is refused where its hold cannot be told from a later one.
//!
//! ```no_run
//! # async fn demo() -> distlock_core::Result<()> {
//! let backend = distlock_sql::postgres::connect("postgres://app:pw@db:5432/app?mode=advisory").await?;
//! let locks = distlock_core::Locks::new(backend);
//! let guard = locks.lock("orders/42")?.acquire().await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```

mod backend;
mod breaking;
mod conn;
pub mod fence;
mod inspect;
pub mod layout;
mod lease;
mod semaphore;
mod session;
mod tls;
mod wakeups;

pub use backend::{PgAcquisition, PgLease, PostgresBackend};
/// The driver, for [`fence`] and for tests that talk to the server directly.
pub use tokio_postgres;

/// `postgres://…` / `postgresql://…`: the entry point the facade's `connect` uses. See
/// [`SqlConfig::from_url`](crate::SqlConfig::from_url).
pub async fn connect(url: &str) -> distlock_core::Result<PostgresBackend> {
    PostgresBackend::connect(url).await
}
