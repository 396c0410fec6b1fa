//! PostgreSQL baselines: the engine's round trip (`SELECT 1`) and a bare tokio-postgres advisory
//! lock/unlock pair (`pg_advisory_lock` + `pg_advisory_unlock`, one simple query each, on a connection
//! of its own), the shape the peer figures were measured with; and the same pair plus one
//! fencing-counter commit after each lock ([`BarePair::fenced`]), what distlock's advisory mode does
//! at the least (its counter is committed before the grant is reported).

use std::time::Duration;

use distlock_sql::postgres::tokio_postgres::types::Type;
use distlock_sql::postgres::tokio_postgres::{self, Client, NoTls, Statement};

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

/// The same-layout loop of an advisory read lock (issue 25): `pg_advisory_lock_shared` on the name's
/// key and, pipelined with it (one round trip, as distlock sends them), the reader's token read (the
/// fencing counter's row of the name); then `pg_advisory_unlock_shared`. On a connection of its own,
/// each statement prepared once (the best a hand-written loop does, as the Redis loops' `EVALSHA`).
pub struct BareShared {
    pub client: Client,
    lock: Statement,
    token: Statement,
    unlock: Statement,
    name: String,
}

impl BareShared {
    /// On the advisory key of `name` (`layout::advisory_key`), with the bench's counter table.
    pub async fn new(url: &str, name: &str) -> Result<BareShared, Error> {
        let client = connect(url).await?;
        create_fence_table(&client).await?;
        let key = distlock_sql::postgres::layout::advisory_key(name);
        let lock = prepare(
            &client,
            &format!("SELECT pg_advisory_lock_shared(({key})::bigint)"),
            &[],
        )
        .await?;
        let token = prepare(
            &client,
            &format!("SELECT token FROM {FENCE_TABLE} WHERE name = $1"),
            &[Type::TEXT],
        )
        .await?;
        let unlock = prepare(
            &client,
            &format!("SELECT pg_advisory_unlock_shared(({key})::bigint)"),
            &[],
        )
        .await?;
        Ok(BareShared {
            client,
            lock,
            token,
            unlock,
            name: name.to_string(),
        })
    }
}

impl Cycler for BareShared {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let name: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&self.name];
        let (locked, token) = tokio::join!(
            self.client.query(&self.lock, &[]),
            self.client.query(&self.token, &name),
        );
        locked.map_err(failure)?;
        token.map_err(failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        self.client
            .query(&self.unlock, &[])
            .await
            .map_err(failure)?;
        Ok(())
    }
}

/// The same-layout loop of an advisory permit (issue 25), what distlock's permit path does at the
/// least, as bare statements: one autocommit statement that takes the name's key shared
/// (`pg_try_advisory_lock_shared`), the first slot's key (`layout::permit_key(name, 0)`, two-int key
/// space, `pg_try_advisory_lock`) and, when both were got, bumps the name's fencing counter; then one
/// that unlocks both keys and `NOTIFY`s (the layout's wake-up for permit waiters). On a connection of
/// its own, both statements prepared once. distlock's statement also reads the stored limit and walks
/// the slots.
pub struct BarePermit {
    pub client: Client,
    take: Statement,
    give_back: Statement,
    name: String,
}

impl BarePermit {
    pub async fn new(url: &str, name: &str) -> Result<BarePermit, Error> {
        use distlock_sql::postgres::layout::{advisory_key, permit_key};
        let client = connect(url).await?;
        create_fence_table(&client).await?;
        let key = advisory_key(name);
        let (a, b) = match permit_key(name, 0) {
            distlock_sql::AdvisoryKey::Pair(a, b) => (a, b),
            other => {
                return Err(Error::unavailable(format!(
                    "postgres baseline: a permit key that is not two ints: {other:?}"
                )))
            }
        };
        let take = format!(
            "WITH l AS (SELECT pg_try_advisory_lock_shared(({key})::bigint) \
               AND pg_try_advisory_lock(({a})::integer, ({b})::integer) AS got), \
             t AS (INSERT INTO {FENCE_TABLE} AS f (name, token) SELECT $1, 1 FROM l WHERE l.got \
               ON CONFLICT (name) DO UPDATE SET token = f.token + 1 RETURNING token) \
             SELECT l.got, (SELECT token FROM t) FROM l"
        );
        let give_back = format!(
            "SELECT pg_advisory_unlock(({a})::integer, ({b})::integer), \
             pg_advisory_unlock_shared(({key})::bigint), pg_notify('{FENCE_TABLE}', $1)"
        );
        let take = prepare(&client, &take, &[Type::TEXT]).await?;
        let give_back = prepare(&client, &give_back, &[Type::TEXT]).await?;
        Ok(BarePermit {
            client,
            take,
            give_back,
            name: name.to_string(),
        })
    }
}

impl Cycler for BarePermit {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let row = self
            .client
            .query_one(&self.take, &[&self.name])
            .await
            .map_err(failure)?;
        let got: bool = row.try_get(0).map_err(failure)?;
        if got {
            Ok(Some(()))
        } else {
            Err(Error::unavailable(format!(
                "postgres permit baseline: {:?} not granted (its keys are this run's alone)",
                self.name
            )))
        }
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        self.client
            .query(&self.give_back, &[&self.name])
            .await
            .map_err(failure)?;
        Ok(())
    }
}

/// `sql` prepared on `client` with these parameter types.
async fn prepare(client: &Client, sql: &str, types: &[Type]) -> Result<Statement, Error> {
    client.prepare_typed(sql, types).await.map_err(failure)
}

async fn create_fence_table(client: &Client) -> Result<(), Error> {
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {FENCE_TABLE} (name text PRIMARY KEY, token bigint NOT NULL)"
        ))
        .await
        .map_err(failure)
}
