//! MySQL / MariaDB baselines: the engine's round trip (`SELECT 1`) and a bare mysql_async
//! `GET_LOCK`/`RELEASE_LOCK` pair (one text query each, on a connection of its own), the peer the
//! issue's advisory targets compare with; and the same pair plus one fencing-counter commit after
//! each lock ([`BarePair::fenced`]), what distlock's advisory mode does at the least.

use std::time::Duration;

use distlock_sql::mysql::mysql_async::prelude::Queryable as _;
use distlock_sql::mysql::mysql_async::{self, Conn};
use tokio::sync::Mutex;

use crate::harness::Cycler;
use crate::Error;

fn failure(e: mysql_async::Error) -> Error {
    Error::unavailable(format!("mysql baseline: {e}"))
}

/// A plain mysql_async connection to the driver URL (distlock's parameters stripped, `mariadb://`
/// spelled `mysql://`, TCP even on loopback).
pub async fn connect(url: &str) -> Result<Mutex<Conn>, Error> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_string(),
    };
    let opts = mysql_async::Opts::from_url(&url)
        .map_err(|e| Error::unavailable(format!("mysql baseline: {e}")))?;
    let opts = mysql_async::OptsBuilder::from_opts(opts).prefer_socket(false);
    Ok(Mutex::new(Conn::new(opts).await.map_err(failure)?))
}

/// `SELECT 1`: the engine's round trip.
pub struct SelectOne {
    pub conn: Mutex<Conn>,
}

impl Cycler for SelectOne {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.lock().await;
        conn.query_drop("SELECT 1").await.map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// A bare `GET_LOCK`/`RELEASE_LOCK` pair on its own connection (waiting in the server when contended);
/// with `fence`, each lock is followed by that counter bump (autocommit: one commit).
pub struct BarePair {
    pub conn: Mutex<Conn>,
    pub key: String,
    pub fence: Option<String>,
}

/// The counter table of the fenced pair (created if missing; one row per bench name).
const FENCE_TABLE: &str = "distlock_bench_fence";

impl BarePair {
    /// The plain pair.
    pub async fn new(url: &str, key: String) -> Result<BarePair, Error> {
        Ok(BarePair {
            conn: connect(url).await?,
            key,
            fence: None,
        })
    }

    /// The pair plus one counter commit per lock, on the row `key` of the bench's counter table.
    pub async fn fenced(url: &str, key: String) -> Result<BarePair, Error> {
        let conn = connect(url).await?;
        conn.lock()
            .await
            .query_drop(format!(
                "CREATE TABLE IF NOT EXISTS {FENCE_TABLE} (name VARBINARY(255) PRIMARY KEY, \
                 fence BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB"
            ))
            .await
            .map_err(failure)?;
        let fence = format!(
            "INSERT INTO {FENCE_TABLE} (name, fence) VALUES ('{key}', LAST_INSERT_ID(1)) \
             ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)"
        );
        Ok(BarePair {
            conn,
            key,
            fence: Some(fence),
        })
    }
}

impl Cycler for BarePair {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.lock().await;
        let sql = format!("SELECT GET_LOCK('{}', 3600)", self.key);
        conn.query_drop(sql).await.map_err(failure)?;
        if let Some(fence) = &self.fence {
            conn.query_drop(fence).await.map_err(failure)?;
        }
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let mut conn = self.conn.lock().await;
        let sql = format!("DO RELEASE_LOCK('{}')", self.key);
        conn.query_drop(sql).await.map_err(failure)?;
        Ok(())
    }
}

/// A `GET_LOCK` name for the bare baselines, apart from distlock's own names.
pub fn bench_key(run: &str, case: &str) -> String {
    distlock_sql::mysql::advisory_name(&format!("distlock-bench-bare/{run}/{case}"))
}

/// The host and port of the driver URL (for reading the server's CPU time when it is local).
pub fn host_port(url: &str) -> Option<(String, u16)> {
    let url = match url.strip_prefix("mariadb://") {
        Some(rest) => format!("mysql://{rest}"),
        None => url.to_string(),
    };
    let opts = mysql_async::Opts::from_url(&url).ok()?;
    Some((opts.ip_or_hostname().to_string(), opts.tcp_port()))
}
