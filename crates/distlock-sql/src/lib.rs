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
