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
//! **Kinds.** Advisory mode has the semaphore: a permit is one `GET_LOCK` slot name
//! ([`permit_name`]) held by its own session, the limit a row of `<table>_limit` written with the first
//! permit and kept (see `semaphore.rs`); a name with a limit row is a semaphore, and its mutex is
//! refused with `KindConflict` (and a permit while the mutex is held). No mode has the read-write lock:
//! `GET_LOCK` is exclusive only, and no shared lock of the server's excludes the `GET_LOCK` that is the
//! name's mutex. Row and lease modes are mutex-only.
//!
//! **Breaking** (`Locks::break_holder`, `distlock break`): advisory and row modes kill the holder's
//! session (`KILL CONNECTION`, prepared from a string that the check picks in the same query) where
//! the session `inspect` showed (`owner = "mysql session <id>"`) still holds the name as the very hold
//! shown: in row mode the hold's uncommitted mark in the lock row (`hold_id`), in advisory mode
//! `IS_USED_LOCK` with the token shown, minted by that session; lease mode expires the lease row (at
//! `1000-01-01`) where owner and version match. Permit holders, and holders that are not distlock's
//! (no token, no mark), are refused (`Unsupported`).
//!
//! The table (`?table=`, default `distlock_locks`, in `?schema=` or the URL's database) is created on
//! first use under `GET_LOCK('dl-schema')`: `name VARBINARY(1024)` (case kept, 1,024 bytes), `fence`,
//! `owner`, `expires_at DATETIME(6)`.

mod advisory;
mod breaking;
mod conn;
pub mod fence;
mod layout;
mod lease;
mod row;
mod semaphore;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, HolderInfo, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::{Capabilities, Fencing, LockKind, LockKinds, Result};
use mysql_async::prelude::Queryable as _;
use mysql_async::{Conn, Opts};

use crate::config::{Mode, SqlConfig};
use crate::error::SqlError;

pub use layout::{advisory_name, permit_name, LIMIT_SUFFIX, LOCK_NAME_PREFIX, PERMIT_NAME_PREFIX};
/// The driver, for callers that need a plain connection of their own (the fence helper's callers, the bench).
pub use mysql_async;

use conn::{bounded, Limits, Pool};

/// The backend's name in errors and logs.
pub(crate) const KIND: &str = "mysql";

/// A MySQL / MariaDB lock service. Cheap to clone; clones share the idle sessions.
///
/// Made from a URL (or a [`SqlConfig`] built in code) and handed to `distlock_core::Locks`, which
/// acquires, renews and releases through it (against a running server):
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// use distlock_core::Locks;
/// use distlock_sql::{mysql::MysqlBackend, Mode, SqlConfig};
///
/// let config = SqlConfig::from_url("mariadb://app:pw@127.0.0.1/app?mode=lease&table=locks")?;
/// let backend = MysqlBackend::from_config(config).await?; // creates the table if missing
/// assert_eq!(backend.mode(), Mode::Lease);
/// let locks = Locks::new(backend);
/// let guard = locks.lock("nightly-report")?.acquire().await?;
/// let _token = guard.token().expect("SQL locks mint tokens"); // for `fence::FencedUpdate`
/// guard.release().await?;
/// # Ok(()) }
/// ```
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
    /// The semaphore limit table (`<table>_limit`), qualified and quoted.
    pub(crate) limit_table_name: String,
    /// Whether the limit table was there (or created) when the backend connected; without it,
    /// semaphores are refused and the mutex checks no limit row.
    pub(crate) limit_ready: std::sync::atomic::AtomicBool,
    pub(crate) pool: Pool,
    /// The connection that sends `KILL QUERY` and the lease mode's statements.
    pub(crate) control: tokio::sync::Mutex<Option<Conn>>,
}

impl Inner {
    pub(crate) fn error(&self, e: SqlError, lock: Option<&str>) -> distlock_core::Error {
        e.into_core(KIND, lock)
    }

    /// The limit table, if it was there when the backend connected.
    pub(crate) fn limit_table(&self) -> Option<&str> {
        self.limit_ready
            .load(std::sync::atomic::Ordering::Relaxed)
            .then_some(self.limit_table_name.as_str())
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
        let limit_table_name = layout::qualified_limit(config.schema.as_deref(), &config.table);
        let inner = Inner {
            config,
            opts,
            limits,
            table,
            limit_table_name,
            limit_ready: std::sync::atomic::AtomicBool::new(false),
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
        let limit_created = match &created {
            Ok(()) => {
                bounded(
                    "creating the semaphore limit table",
                    request,
                    conn.query_drop(layout::create_limit_table(&self.limit_table_name)),
                )
                .await
            }
            Err(_) => Ok(()),
        };
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
        // The limit table came with the semaphore: a role that may not create it (a schema that
        // predates it) still gets the mutex; semaphores are then refused, naming the table.
        let limit_checked = bounded(
            "checking the semaphore limit table",
            request,
            conn.query_drop(layout::check_limit_table(&self.limit_table_name)),
        )
        .await;
        match (&limit_created, &limit_checked) {
            (_, Ok(())) => self
                .limit_ready
                .store(true, std::sync::atomic::Ordering::Relaxed),
            (created, Err(e)) => tracing::warn!(
                table = %self.limit_table_name,
                create_error = ?created.as_ref().err().map(ToString::to_string),
                error = %e,
                "the semaphore limit table is missing or unreadable; semaphores are refused"
            ),
        }
        self.pool.checkin(session);
        if self.config.mode == Mode::Row {
            let second = conn::Session::open(&self.opts, &self.limits).await?;
            self.pool.checkin(second);
        }
        Ok(())
    }

    /// A mutex's bump after a won wait: the new token, or `None` when the name is a semaphore (its
    /// limit row exists) and nothing was bumped.
    pub(crate) async fn bump_mutex_fence(
        &self,
        conn: &mut Conn,
        name: &str,
    ) -> Result<Option<u64>, SqlError> {
        bounded(
            "bumping the fencing counter",
            self.limits.request,
            conn.query_drop(layout::bump_fence_unless_semaphore(
                &self.table,
                self.limit_table(),
                name,
            )),
        )
        .await?;
        if conn.affected_rows() == 0 && self.limit_table().is_some() {
            return Ok(None);
        }
        match conn.last_insert_id() {
            Some(token) if token > 0 => Ok(Some(token)),
            other => Err(SqlError::Protocol(format!(
                "the fencing counter statement returned insert id {other:?}"
            ))),
        }
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
///
/// Opaque: [`MysqlBackend`]'s `Backend::begin` makes it (no I/O) and the core hands it back to every
/// try and wait of that acquire, then to `abandon` if the acquire gives up, which undoes what a try
/// left on the server. Code over the raw trait (a wrapper backend, a test) names it through
/// `Backend::Acquisition`:
///
/// ```
/// use distlock_core::raw::Backend;
/// use distlock_sql::mysql::{MysqlAcquisition, MysqlBackend};
///
/// fn forwards<B: Backend<Acquisition = MysqlAcquisition>>() {}
/// forwards::<MysqlBackend>();
/// let _fresh = MysqlAcquisition::default(); // as `begin` makes it: nothing to undo yet
/// ```
#[derive(Debug, Default)]
pub struct MysqlAcquisition {
    advisory: advisory::Waiting,
    /// A permit's own state (its slot offset, the slot waited on).
    permit: semaphore::Acquiring,
    backoff: Option<distlock_core::retry::Backoff>,
    /// Lease mode: what `abandon` must undo (see [`lease::Undo`]).
    lease_undo: lease::Undo,
}

/// What is kept for a held lock.
///
/// The variant is the URL's `?mode=`. `Locks` keeps it inside the guard; code that drives the raw
/// trait itself gets it in the grant and passes it back to `renew` and `release` (against a running
/// server):
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// use distlock_core::raw::{AcquireRequest, Attempt, Backend};
/// use distlock_sql::mysql::MysqlLease;
/// use std::time::Duration;
///
/// let backend = distlock_sql::mysql::connect("mysql://app:pw@127.0.0.1/app?mode=lease").await?;
/// let request = AcquireRequest::new("nightly-report", "owner-1", Duration::from_secs(30));
/// let mut acquisition = backend.begin(&request)?;
/// match backend.try_acquire(&mut acquisition, &request).await? {
///     Attempt::Acquired(grant) => {
///         assert!(matches!(grant.lease, MysqlLease::Lease(_)));
///         backend.release(&grant.lease, &request.name, &request.owner).await?;
///     }
///     _ => backend.abandon(acquisition, &request).await, // held elsewhere: undo the try
/// }
/// # Ok(()) }
/// ```
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

    /// Kinds: advisory mode has the semaphore (slot `GET_LOCK` names, see `semaphore.rs`); no mode has
    /// the read-write lock, since `GET_LOCK` is exclusive only and no shared lock of MariaDB's excludes
    /// the `GET_LOCK` that is the name's mutex; row and lease modes are mutex-only.
    fn capabilities(&self) -> Capabilities {
        let base = Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict)
            // Every mode: a killed session (advisory, row) or an expired lease row (lease).
            .with_breaks_holders(true);
        match self.inner.config.mode {
            Mode::Lease => base,
            // Held sessions: freed when the holder's process dies (its socket closes), waits in the server.
            Mode::Row => base
                .with_notify_wait(true)
                .with_frees_on_process_death(true),
            _ => base
                .with_notify_wait(true)
                .with_frees_on_process_death(true)
                .with_kinds(LockKinds::mutex_only().with_semaphore()),
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
        if !self.capabilities().kinds.supports(request.kind) {
            // The core refuses these before any I/O; a direct caller of the trait gets the same.
            return Err(SqlError::Unsupported(format!(
                "MariaDB's {} mode has no {}",
                inner.config.mode, request.kind
            ))
            .into_core(KIND, Some(&request.name)));
        }
        let attempt = match (inner.config.mode, request.kind) {
            (Mode::Lease, _) => {
                lease::try_acquire(inner, &mut acquisition.lease_undo, request).await
            }
            (Mode::Row, _) => row::try_acquire(inner, &mut acquisition.advisory, request).await,
            (_, LockKind::Permit { limit }) => {
                semaphore::try_acquire(
                    inner,
                    &mut acquisition.advisory,
                    &mut acquisition.permit,
                    request,
                    limit,
                )
                .await
            }
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
        let waited = match (inner.config.mode, request.kind) {
            (Mode::Lease, _) => {
                lease::wait(&mut acquisition.backoff, retry_after).await;
                Ok(())
            }
            (Mode::Row, _) => {
                let flavor = row::flavor(inner, &request.name);
                advisory::wait(&mut acquisition.advisory, flavor, inner.limits.request).await
            }
            (_, LockKind::Permit { limit }) => {
                semaphore::wait(
                    inner,
                    &mut acquisition.advisory,
                    &mut acquisition.permit,
                    request,
                    limit,
                )
                .await
            }
            _ => {
                // The mutex's wait mints its token with its grant, as its try does.
                let key = advisory_name(&request.name);
                let mint = layout::bump_fence_if_locked(
                    &inner.table,
                    inner.limit_table(),
                    &request.name,
                    &key,
                );
                let flavor = advisory::Flavor::Advisory {
                    key,
                    mint: Some(mint),
                };
                advisory::wait(&mut acquisition.advisory, flavor, inner.limits.request).await
            }
        };
        waited.map_err(|e| inner.error(e, Some(&request.name)))
    }

    async fn abandon(&self, acquisition: Self::Acquisition, request: &AcquireRequest) {
        let inner = &self.inner;
        match (inner.config.mode, request.kind) {
            (Mode::Lease, _) => lease::abandon(inner, acquisition.lease_undo, request).await,
            (Mode::Row, _) => {
                let flavor = row::flavor(inner, &request.name);
                advisory::abandon(inner, acquisition.advisory, request, flavor).await
            }
            (_, LockKind::Permit { .. }) => {
                semaphore::abandon(inner, acquisition.advisory, &acquisition.permit, request).await
            }
            _ => {
                let key = advisory_name(&request.name);
                let flavor = advisory::Flavor::Advisory { key, mint: None };
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

    /// Advisory and row modes kill the holder's session where it still holds the name as the hold
    /// shown (checked in the server just before the kill, in the same query); lease mode expires the
    /// lease row where owner and version still match. See `breaking.rs`.
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let inner = &self.inner;
        breaking::break_holder(inner, name, holder)
            .await
            .map_err(|e| inner.error(e, Some(name)))
    }
}
