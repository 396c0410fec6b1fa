//! PostgreSQL baselines: the engine's round trip (`SELECT 1`) and a bare tokio-postgres advisory
//! lock/unlock pair (`pg_advisory_lock` + `pg_advisory_unlock`, one simple query each, on a connection
//! of its own), the shape the peer figures were measured with; and the same pair plus one
//! fencing-counter commit after each lock ([`BarePair::fenced`]), what distlock's advisory mode does
//! at the least (its counter is committed before the grant is reported).

use std::time::Duration;

use distlock_sql::postgres::tokio_postgres::{self, Client, NoTls};

use crate::harness::Cycler;
use crate::Error;

fn failure(e: tokio_postgres::Error) -> Error {
    Error::unavailable(format!("postgres baseline: {e}"))
}

/// A plain tokio-postgres connection to the driver URL (distlock's parameters stripped).
pub async fn connect(url: &str) -> Result<Client, Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.map_err(failure)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// `SELECT 1`: the engine's round trip.
pub struct SelectOne {
    pub client: Client,
}

impl Cycler for SelectOne {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        self.client
            .simple_query("SELECT 1")
            .await
            .map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// One conditional `UPDATE` of a row (autocommit: one commit), what a lease-mode grant or release
/// costs at the least: the peer of the lease mode's target.
pub struct ConditionalUpdate {
    pub client: Client,
    sql: String,
}

impl ConditionalUpdate {
    /// On the row `name` of the bench's counter table (created if missing).
    pub async fn new(url: &str, name: &str) -> Result<ConditionalUpdate, Error> {
        let client = connect(url).await?;
        let name = name.replace('\'', "''");
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {FENCE_TABLE} (name text PRIMARY KEY, token bigint NOT NULL); \
                 INSERT INTO {FENCE_TABLE} (name, token) VALUES ('{name}', 0) ON CONFLICT (name) DO NOTHING"
            ))
            .await
            .map_err(failure)?;
        let sql = format!(
            "UPDATE {FENCE_TABLE} SET token = token + 1 WHERE name = '{name}' AND token >= 0"
        );
        Ok(ConditionalUpdate { client, sql })
    }
}

impl Cycler for ConditionalUpdate {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        self.client.simple_query(&self.sql).await.map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// A bare advisory lock/unlock pair on its own connection (waiting in the server when contended);
/// with `fence`, each lock is followed by that counter bump (autocommit: one commit).
pub struct BarePair {
    pub client: Client,
    pub key: i64,
    pub fence: Option<String>,
}

/// The counter table of the fenced pair (created if missing; one row per bench name).
const FENCE_TABLE: &str = "distlock_bench_fence";

impl BarePair {
    /// The plain pair.
    pub async fn new(url: &str, key: i64) -> Result<BarePair, Error> {
        Ok(BarePair {
            client: connect(url).await?,
            key,
            fence: None,
        })
    }

    /// The pair plus one counter commit per lock, on the row `name` of the bench's counter table.
    pub async fn fenced(url: &str, key: i64, name: &str) -> Result<BarePair, Error> {
        let client = connect(url).await?;
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {FENCE_TABLE} (name text PRIMARY KEY, token bigint NOT NULL)"
            ))
            .await
            .map_err(failure)?;
        let name = name.replace('\'', "''");
        let fence = format!(
            "INSERT INTO {FENCE_TABLE} AS f (name, token) VALUES ('{name}', 1) \
             ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token"
        );
        Ok(BarePair {
            client,
            key,
            fence: Some(fence),
        })
    }
}

impl Cycler for BarePair {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let sql = format!("SELECT pg_advisory_lock({})", self.key);
        self.client.simple_query(&sql).await.map_err(failure)?;
        if let Some(fence) = &self.fence {
            self.client.simple_query(fence).await.map_err(failure)?;
        }
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let sql = format!("SELECT pg_advisory_unlock({})", self.key);
        self.client.simple_query(&sql).await.map_err(failure)?;
        Ok(())
    }
}

/// The one TCP host and port of the driver URL (for reading the server's CPU time when it is local).
pub fn host_port(url: &str) -> Option<(String, u16)> {
    let config: tokio_postgres::Config = url.parse().ok()?;
    let [tokio_postgres::config::Host::Tcp(host)] = config.get_hosts() else {
        return None;
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    Some((host.clone(), port))
}
