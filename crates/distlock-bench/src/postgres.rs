//! PostgreSQL baselines: the engine's round trip (`SELECT 1`) and a bare tokio-postgres advisory
//! lock/unlock pair (`pg_advisory_lock` + `pg_advisory_unlock`, one simple query each, on a connection
//! of its own), the shape the peer figures were measured with.

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

/// A bare advisory lock/unlock pair on its own connection (waiting in the server when contended).
pub struct BarePair {
    pub client: Client,
    pub key: i64,
}

impl Cycler for BarePair {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let sql = format!("SELECT pg_advisory_lock({})", self.key);
        self.client.simple_query(&sql).await.map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let sql = format!("SELECT pg_advisory_unlock({})", self.key);
        self.client.simple_query(&sql).await.map_err(failure)?;
        Ok(())
    }
}
