//! The SQL backends of distlock: PostgreSQL (cargo feature `postgres`, driver tokio-postgres) and
//! MySQL / MariaDB (cargo feature `mysql`, driver mysql_async).
//!
//! **Shape.** One backend type per engine, each implementing `distlock_core::raw::Backend`:
//! `postgres::PostgresBackend` and `mysql::MysqlBackend`, each with `from_config(SqlConfig)` and a
//! `connect(url)` entry point the facade's `connect` routes `postgres://`/`postgresql://` and
//! `mysql://`/`mariadb://` to. They share [`SqlConfig`] (the driver's URL as written plus distlock's
//! `?mode=&table=&schema=&key=` parameters) and [`Mode`].
//!
//! **Modes** ([`Mode`], `?mode=`):
//! * `advisory` (default): a session advisory lock (`pg_advisory_lock` / `GET_LOCK`) on a dedicated
//!   connection held for the life of the guard, waiting in the server; a cancelled wait is cancelled on
//!   the server (tokio-postgres' cancel request, `KILL QUERY`), so it never takes the lock later.
//! * `row`: the pessimistic lock, the name's row `SELECT … FOR UPDATE` in a transaction held open on a
//!   dedicated connection.
//! * `lease`: the optimistic lock, the name's row as a versioned lease on the database's clock; the
//!   version is the fencing token; works through transaction-pooling proxies.
//!
//! Every mode mints a fencing token: a per-name counter committed before the grant is reported.
//!
//! Users reach this crate through `distlock::connect("postgres://…")` (or `mysql://…`); directly it
//! is (against a running server):
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> distlock_core::Result<()> {
//! use distlock_core::Locks;
//!
//! let backend = distlock_sql::postgres::connect("postgres://app:pw@127.0.0.1/app").await?;
//! let locks = Locks::new(backend);
//! let guard = locks.lock("nightly-report")?.acquire().await?;
//! let _token = guard.token(); // the name's counter, committed before the grant
//! guard.release().await?;
//! # Ok(()) }
//! # #[cfg(not(feature = "postgres"))]
//! # fn main() {}
//! ```
#![deny(missing_docs)]
#![cfg_attr(not(test), forbid(clippy::print_stdout, clippy::print_stderr))]

mod config;
mod error;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;

pub use config::{
    AdvisoryKey, Mode, SqlConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_REQUEST_TIMEOUT, DEFAULT_TABLE,
    DISTLOCK_QUERY, MAX_IDENTIFIER_LEN,
};
