//! The MySQL / MariaDB backend (`mysql://`, `mariadb://`), driver mysql_async.
//!
//! ```text
//! mysql://user:pw@host:3306/db                      advisory mode (GET_LOCK)
//! mariadb://user:pw@host/db?mode=lease&table=locks   the optimistic lock
//! mysql://user:pw@host/db?mode=row&schema=app        the pessimistic lock
//! ```
//!
//! The URL reaches mysql_async as written (its parameters, e.g. `require_ssl=true`, are its own), with
//! two changes: `mariadb://` is spelled `mysql://`, and `prefer_socket` is off unless the URL sets it.
//! distlock's parameters (`mode`, `table`, `schema`, `request_timeout`, `lease`) are stripped first.
//!
//! **TLS** is mysql_async's, through rustls (ring): `require_ssl=true` turns it on, and verifies the
//! chain and the host name unless `verify_ca=false` / `verify_identity=false`; `built_in_roots=false`
//! drops mysql_async's built-in roots. mysql_async 0.36 has no URL spelling for a CA file, so distlock
//! adds one, stripped before the driver sees the URL: `ssl_ca=<file>` (PEM), trusted **instead of** the
//! built-in roots (the rule for a CA file everywhere in distlock); it needs `require_ssl=true`. A failed
//! handshake is `Unavailable` with a message that says so.
//!
//! ```text
//! mariadb://app:pw@db.example/app?require_ssl=true&ssl_ca=/etc/ssl/db-ca.pem
//! ```
//!
//! **Modes** (see the crate docs): `advisory` — `GET_LOCK(`[`advisory_name`]`(name), …)` on a dedicated
//! session held for the guard's life, waiting in the server, a cancelled wait ended by `KILL QUERY`;
//! `row` — the name's row `SELECT … FOR UPDATE` in a transaction held open on a dedicated session;
//! `lease` — the name's row as a versioned lease on the database's clock.
//!
//! **Fencing.** Every mode's token is the name's `fence` counter in the lock table, bumped by one
//! autocommit statement before the grant is reported (`LAST_INSERT_ID(fence + 1)` returns it: MariaDB has
//! no `UPDATE … RETURNING`). [`fence`] guards the application's own writes with it.
//!
//! **Loss deadline** (`advisory`, `row`): the held session's `wait_timeout` is set to the lease (whole
//! seconds, rounded up), and the watchdog probes it every third of the lease (`SELECT CONNECTION_ID(),
//! IS_USED_LOCK(…)`), so the server frees the lock no earlier than a lease after the last probe was
//! sent: the guard's validity deadline. A probe that sees another `CONNECTION_ID()` than the session's
//! (a pooling proxy in between) ends the hold; a session the server closes (`KILL`, restart) is noticed
//! at once from its socket.
//!
//! The table (`?table=`, default `distlock_locks`, in `?schema=` or the URL's database) is created on
//! first use under `GET_LOCK('dl-schema')`: `name VARBINARY(1024)` (case kept, 1,024 bytes), `fence`,
//! `owner`, `expires_at DATETIME(6)`.

mod advisory;
mod conn;
pub mod fence;
mod layout;
mod lease;
mod row;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::{Capabilities, Fencing, Result};
use mysql_async::prelude::Queryable as _;
use mysql_async::{Conn, Opts};

use crate::config::{Mode, SqlConfig};
use crate::error::SqlError;

pub use layout::{advisory_name, LOCK_NAME_PREFIX};
/// The driver, for callers that need a plain connection of their own (the fence helper's callers, the bench).
pub use mysql_async;

use conn::{bounded, Limits, Pool};

/// The backend's name in errors and logs.
pub(crate) const KIND: &str = "mysql";

/// A MySQL / MariaDB lock service. Cheap to clone; clones share the idle sessions.
#[derive(Debug, Clone)]
pub struct MysqlBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) config: SqlConfig,
    pub(crate) opts: Opts,
    pub(crate) limits: Limits,
    /// The lock table, qualified and quoted.
    pub(crate) table: String,
    pub(crate) pool: Pool,
    /// The connection that sends `KILL QUERY` and the lease mode's statements.
    pub(crate) control: tokio::sync::Mutex<Option<Conn>>,
}

impl Inner {
    pub(crate) fn error(&self, e: SqlError, lock: Option<&str>) -> distlock_core::Error {
        e.into_core(KIND, lock)
    }
}

/// Connects to the server a `mysql://` or `mariadb://` URL names (with distlock's `?mode=&table=&schema=`).
pub async fn connect(url: &str) -> Result<MysqlBackend> {
    let config = SqlConfig::from_url(url)?;
    MysqlBackend::from_config(config).await
}

impl MysqlBackend {
    /// Connects with `config` and creates the lock table if it is missing.
    pub async fn from_config(config: SqlConfig) -> Result<MysqlBackend> {
        config.validate()?;
        let scheme_ok = config.url.starts_with("mysql://") || config.url.starts_with("mariadb://");
        if !scheme_ok {
            return Err(SqlError::Config(format!(
                "the MySQL backend takes mysql:// or mariadb:// URLs, not {:?}",
                distlock_core::url::redact(&config.url)
            ))
            .into_core(KIND, None));
        }
        let opts = conn::driver_opts(&config.url).map_err(|e| e.into_core(KIND, None))?;
        let limits = Limits {
            connect: config.connection.connect_timeout,
            request: config.connection.request_timeout,
        };
        let table = layout::qualified(config.schema.as_deref(), &config.table);
        let inner = Inner {
            config,
            opts,
            limits,
            table,
            pool: Pool::default(),
            control: tokio::sync::Mutex::new(None),
        };
        inner
            .ensure_table()
            .await
            .map_err(|e| e.into_core(KIND, None))?;
        Ok(MysqlBackend {
            inner: Arc::new(inner),
        })
    }

    /// The mode this backend locks in.
    pub fn mode(&self) -> Mode {
        self.inner.config.mode
    }

    /// The configuration it was made from.
    pub fn config(&self) -> &SqlConfig {
        &self.inner.config
    }
}

impl Inner {
    /// Creates the table under a lock if it is missing, then checks its shape. The session it used is
    /// kept for the first acquire (row mode keeps a second one: it bumps the counter on another session),
    /// so a first acquire costs no connect.
    async fn ensure_table(&self) -> Result<(), SqlError> {
        let mut session = conn::Session::open(&self.opts, &self.limits).await?;
        let conn = &mut session.conn;
        let request = self.limits.request;
        let got: Option<Option<i64>> = bounded(
            "locking the schema",
            request,
            conn.query_first(format!("SELECT GET_LOCK('{}', 10)", layout::SCHEMA_LOCK)),
        )
        .await?;
        let created = bounded(
            "creating the lock table",
            request,
            conn.query_drop(layout::create_table(&self.table)),
        )
        .await;
        if got.flatten() == Some(1) {
            let _ = bounded(
                "unlocking the schema",
                request,
                conn.query_drop(format!("DO RELEASE_LOCK('{}')", layout::SCHEMA_LOCK)),
            )
            .await;
        }
        created?;
        bounded(
            "checking the lock table",
            request,
            conn.query_drop(layout::check_table(&self.table)),
        )
        .await?;
        self.pool.checkin(session);
        if self.config.mode == Mode::Row {
            let second = conn::Session::open(&self.opts, &self.limits).await?;
            self.pool.checkin(second);
        }
        Ok(())
    }

    /// Bumps the name's counter on `conn` (autocommit) and returns the new value.
    pub(crate) async fn bump_fence(&self, conn: &mut Conn, name: &str) -> Result<u64, SqlError> {
        bounded(
            "bumping the fencing counter",
            self.limits.request,
            conn.query_drop(layout::bump_fence(&self.table, name)),
        )
        .await?;
        match conn.last_insert_id() {
            Some(token) if token > 0 => Ok(token),
            other => Err(SqlError::Protocol(format!(
                "the fencing counter statement returned insert id {other:?}"
            ))),
        }
    }
}

/// What is kept while an acquire is under way.
#[derive(Debug, Default)]
pub struct MysqlAcquisition {
    advisory: advisory::Waiting,
    backoff: Option<distlock_core::retry::Backoff>,
}

/// What is kept for a held lock.
#[derive(Debug)]
pub enum MysqlLease {
    /// `GET_LOCK` on a held session.
    Advisory(advisory::Held),
    /// A row lock in a held transaction.
    Row(advisory::Held),
    /// A versioned lease row.
    Lease(lease::Held),
}

/// Seconds for `wait_timeout` (whole, rounded up, at least 1).
pub(crate) fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[async_trait]
impl Backend for MysqlBackend {
    type Lease = MysqlLease;
    type Acquisition = MysqlAcquisition;

    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        let base = Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict);
        match self.inner.config.mode {
            Mode::Lease => base,
            // Held sessions: freed when the holder's process dies (its socket closes), waits in the server.
            _ => base
                .with_notify_wait(true)
                .with_frees_on_process_death(true),
        }
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<Self::Acquisition> {
        Ok(MysqlAcquisition::default())
    }

    async fn try_acquire(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<Self::Lease>> {
        let inner = &self.inner;
        let attempt = match inner.config.mode {
            Mode::Lease => lease::try_acquire(inner, request).await,
            Mode::Row => row::try_acquire(inner, &mut acquisition.advisory, request).await,
            _ => advisory::try_acquire(inner, &mut acquisition.advisory, request).await,
        };
        attempt.map_err(|e| inner.error(e, Some(&request.name)))
    }

    async fn wait(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        let inner = &self.inner;
        let waited = match inner.config.mode {
            Mode::Lease => {
                lease::wait(&mut acquisition.backoff, retry_after).await;
                Ok(())
            }
            Mode::Row => {
                advisory::wait(&mut acquisition.advisory, row::flavor(inner, &request.name)).await
            }
            _ => {
                let key = advisory_name(&request.name);
                advisory::wait(
                    &mut acquisition.advisory,
                    advisory::Flavor::Advisory { key },
                )
                .await
            }
        };
        waited.map_err(|e| inner.error(e, Some(&request.name)))
    }

    async fn abandon(&self, acquisition: Self::Acquisition, request: &AcquireRequest) {
        let inner = &self.inner;
        match inner.config.mode {
            Mode::Lease => lease::abandon(inner, request).await,
            Mode::Row => {
                let flavor = row::flavor(inner, &request.name);
                advisory::abandon(inner, acquisition.advisory, request, flavor).await
            }
            _ => {
                let key = advisory_name(&request.name);
                let flavor = advisory::Flavor::Advisory { key };
                advisory::abandon(inner, acquisition.advisory, request, flavor).await
            }
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, Self::Lease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        let inner = &self.inner;
        let mut leases = Vec::new();
        let mut probes = Vec::new();
        for entry in batch {
            match entry.lease {
                MysqlLease::Lease(held) => {
                    leases.push((entry.id, entry.name, entry.owner, held, entry.ttl))
                }
                MysqlLease::Advisory(held) | MysqlLease::Row(held) => {
                    probes.push(advisory::probe(
                        inner, entry.id, held, entry.name, entry.ttl,
                    ));
                }
            }
        }
        let mut out: Vec<(RenewalId, Result<Renewed>)> = futures_util::future::join_all(probes)
            .await
            .into_iter()
            .map(|(id, name, r)| (id, r.map_err(|e| inner.error(e, Some(name)))))
            .collect();
        if !leases.is_empty() {
            out.extend(lease::renew(inner, &leases).await);
        }
        out
    }

    async fn release(&self, lease: &Self::Lease, name: &str, owner: &str) -> Result<Released> {
        let inner = &self.inner;
        let released = match lease {
            MysqlLease::Advisory(held) | MysqlLease::Row(held) => {
                advisory::release(inner, held).await
            }
            MysqlLease::Lease(held) => lease::release(inner, held, name, owner).await,
        };
        released.map_err(|e| inner.error(e, Some(name)))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        let inner = &self.inner;
        let info = match inner.config.mode {
            Mode::Lease => lease::inspect(inner, name).await,
            Mode::Row => row::inspect(inner, name).await,
            _ => advisory::inspect(inner, name).await,
        };
        info.map_err(|e| inner.error(e, Some(name)))
    }
}
