//! MySQL / MariaDB baselines: the engine's round trip (`SELECT 1`) and a bare mysql_async
//! `GET_LOCK`/`RELEASE_LOCK` pair (one text query each, on a connection of its own), the peer the
//! issue's advisory targets compare with.

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

/// A bare `GET_LOCK`/`RELEASE_LOCK` pair on its own connection (waiting in the server when contended).
pub struct BarePair {
    pub conn: Mutex<Conn>,
    pub key: String,
}

impl Cycler for BarePair {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.lock().await;
        let sql = format!("SELECT GET_LOCK('{}', 3600)", self.key);
        conn.query_drop(sql).await.map_err(failure)?;
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
