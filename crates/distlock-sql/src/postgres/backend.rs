//! [`PostgresBackend`]: the `raw::Backend` impl, thin; the modes live in `session.rs` (advisory and
//! row: a dedicated connection per held lock) and `lease.rs` (the versioned lease row).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, Released, Renewal, RenewalId,
    Renewed,
};
use distlock_core::{Capabilities, Fencing, LockKind, LockKinds, ReadWriteOrder, Result};
use futures_util::future::join_all;
use tokio::sync::{broadcast, Mutex};
use tokio_postgres::types::Type;

use super::conn::{driver_config, Conn, Driver};
use super::layout::{self, Tables};
use super::{breaking, inspect, lease, semaphore, session};
use crate::config::{Mode, SqlConfig};
use crate::error::SqlError;

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "postgres";

/// The PostgreSQL backend: `postgres://` / `postgresql://` URLs (see the [module docs](super)).
/// Cheap to clone; clones share the control connection.
///
/// ```no_run
/// # async fn f() -> distlock_core::Result<()> {
/// use distlock_core::Locks;
/// use distlock_sql::postgres::PostgresBackend;
/// use distlock_sql::SqlConfig;
///
/// let config = SqlConfig::from_url("postgres://app@127.0.0.1:5432/app?mode=advisory")?;
/// let locks = Locks::new(PostgresBackend::from_config(config).await?);
/// let guard = locks.lock("orders/42")?.acquire().await?;
/// let token = guard.token(); // the name's counter row, committed before the grant
/// guard.release().await?;
/// # let _ = token;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) config: SqlConfig,
    pub(crate) driver: Driver,
    pub(crate) tables: Tables,
    /// The control connection: fence counters in row mode, every lease-mode statement, `LISTEN`.
    control: Mutex<Option<Arc<Conn>>>,
    /// Wake-ups of lease-mode and permit waiters: payloads (lock names) of the `NOTIFY`s on the control
    /// connection.
    pub(crate) notify: broadcast::Sender<String>,
    /// Idle dedicated connections (advisory and row modes): one opened ahead, and those a release
    /// handed back clean, so an acquire does not pay for the connection setup (TCP, SCRAM, a server
    /// process) between reading its clock and its grant. At most [`MAX_IDLE`].
    idle: std::sync::Mutex<Vec<Conn>>,
    /// The tables exist with distlock's shape (checked at connect).
    schema_checked: std::sync::atomic::AtomicBool,
    /// A task resets the idle bound of pooled connections before the server would end them
    /// ([`Inner::recycle`]); at most one runs.
    resetter_running: std::sync::atomic::AtomicBool,
    /// When the running resetter wakes next, and its wake-up for a connection due before that.
    resetter_wakes_at: std::sync::Mutex<Option<tokio::time::Instant>>,
    resetter_wake: std::sync::Mutex<Option<Arc<tokio::sync::Notify>>>,
    /// This backend, for the tasks it starts (which must not keep it alive).
    me: std::sync::Weak<Inner>,
    /// Waiters registered for release notifications ([`Inner::listen`]).
    waiters: std::sync::atomic::AtomicUsize,
    /// Registrations so far: the linger after the last one left ends only if none came since.
    listen_generation: std::sync::atomic::AtomicU64,
    /// A spare connection is being opened ([`Inner::refill_spare`]).
    opening_spare: std::sync::atomic::AtomicBool,
}

/// Clears [`Inner::resetter_running`] when the resetter task is dropped without having cleared it
/// (its runtime shut down, or it panicked), so the next recycle starts another.
struct ResetterRunning {
    inner: std::sync::Weak<Inner>,
    armed: bool,
}

impl Drop for ResetterRunning {
    fn drop(&mut self) {
        if let (true, Some(inner)) = (self.armed, self.inner.upgrade()) {
            inner.resetter_running.store(false, Ordering::Release);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The resetter sleeps until its next connection is due, up to half the longest lease: wake it
        // to find the backend gone.
        if let Some(wake) = lock(&self.resetter_wake).as_ref() {
            wake.notify_one();
        }
    }
}

/// How long the control connection keeps listening after the last waiter left: a name under steady
/// contention does not `LISTEN` and `UNLISTEN` for every waiter.
pub(crate) const LISTEN_LINGER: Duration = Duration::from_secs(1);

/// A waiter's registration for release notifications ([`Inner::listen`]); dropping it ends it.
#[derive(Debug)]
pub(crate) struct Listening {
    inner: std::sync::Weak<Inner>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        if inner.waiters.fetch_sub(1, Ordering::AcqRel) != 1
            || tokio::runtime::Handle::try_current().is_err()
        {
            return;
        }
        // The linger counts from the last registration's drop: a registration after this one
        // (a later generation) leaves the UNLISTEN to its own drop.
        let generation = inner.listen_generation.load(Ordering::Acquire);
        let weak = self.inner.clone();
        drop(inner);
        tokio::spawn(async move {
            tokio::time::sleep(LISTEN_LINGER).await;
            if let Some(inner) = weak.upgrade() {
                inner.unlisten_if_unwanted(generation).await;
            }
        });
    }
}

/// The most idle dedicated connections a backend keeps.
const MAX_IDLE: usize = 16;

impl Inner {
    /// The bound of one statement distlock sends.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.config.connection.request_timeout
    }

    /// A fresh connection (a dedicated one for a lock, or the control connection).
    pub(crate) async fn open(&self, listen: bool) -> std::result::Result<Conn, SqlError> {
        let notify = listen.then(|| self.notify.clone());
        Conn::open(&self.driver, self.config.connection.connect_timeout, notify).await
    }

    /// A connection for a lock: an idle one if one is still open, else a new one; when none is left
    /// idle, another is opened in the background. Says whether it came from the idle pool (where the
    /// server may have ended it without the driver having noticed yet).
    pub(crate) async fn dedicated(self: &Arc<Self>) -> std::result::Result<(Conn, bool), SqlError> {
        let reused = {
            let mut idle = self.lock_idle();
            let mut found = None;
            while let Some(conn) = idle.pop() {
                if conn.closed_reason().is_none() {
                    found = Some(conn);
                    break;
                }
            }
            found
        };
        self.refill_spare();
        match reused {
            Some(conn) => {
                conn.unpark();
                Ok((conn, true))
            }
            None => Ok((self.open_dedicated().await?, false)),
        }
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands back a dedicated connection whose session holds nothing any more. Its idle bound goes
    /// with it (a release keeps it, so the next try with that lease sends no probe); a task resets it
    /// once the connection has waited half the bound, before the server would end the idle session
    /// (a FATAL in the server's log for each). A connection whose bound is unknown is closed instead.
    pub(crate) fn recycle(&self, conn: Conn) {
        if conn.closed_reason().is_some() || conn.idle_bound().ms.is_none() {
            return;
        }
        conn.park();
        let stale_at = conn.idle_bound().stale_at();
        {
            let mut idle = self.lock_idle();
            if idle.len() >= MAX_IDLE {
                return;
            }
            idle.push(conn);
            // A lease shorter than the ones the resetter sleeps for: wake it sooner.
            if stale_at
                .is_some_and(|stale| lock(&self.resetter_wakes_at).is_some_and(|at| stale < at))
            {
                if let Some(wake) = lock(&self.resetter_wake).as_ref() {
                    // Stored as a permit if the task is not asleep yet.
                    wake.notify_one();
                }
            }
        }
        // Without a bound running, nothing ends the idle session: nothing to reset.
        if stale_at.is_none() {
            return;
        }
        if !self.resetter_running.swap(true, Ordering::AcqRel) {
            self.start_resetter();
        }
    }

    /// The task that resets the idle bound of pooled connections at their [`IdleBound::stale_at`]:
    /// it sleeps until the earliest, takes those out, resets them (all at once; one that fails is
    /// closed) and puts them back; it ends when no pooled connection has a bound left, or the backend
    /// is dropped (which wakes it). If its runtime shuts down, the next recycle starts another.
    ///
    /// [`IdleBound::stale_at`]: super::conn::IdleBound::stale_at
    fn start_resetter(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            self.resetter_running.store(false, Ordering::Release);
            return;
        }
        let weak = self.me.clone();
        let running = ResetterRunning {
            inner: weak.clone(),
            armed: true,
        };
        tokio::spawn(async move {
            // The whole guard moves into the task (a closure would capture only the field it sets).
            let mut running = running;
            loop {
                // The backend is held only between sleeps: a dropped backend ends the task.
                let (next, woken) = {
                    let Some(inner) = weak.upgrade() else { return };
                    let idle = inner.lock_idle();
                    let next = idle.iter().filter_map(|c| c.idle_bound().stale_at()).min();
                    *lock(&inner.resetter_wakes_at) = next;
                    let Some(next) = next else {
                        // Under the pool's lock: a recycle after this starts a new task.
                        running.armed = false;
                        inner.resetter_running.store(false, Ordering::Release);
                        return;
                    };
                    // Registered under the pool's lock: a recycle's wake-up after it is not missed.
                    let wake = Arc::new(tokio::sync::Notify::new());
                    *lock(&inner.resetter_wake) = Some(wake.clone());
                    (next, wake)
                };
                tokio::select! {
                    () = tokio::time::sleep_until(next) => {}
                    () = woken.notified() => {}
                }
                let Some(inner) = weak.upgrade() else { return };
                let now = tokio::time::Instant::now();
                let stale: Vec<Conn> = {
                    let mut idle = inner.lock_idle();
                    let (stale, fresh) = std::mem::take(&mut *idle)
                        .into_iter()
                        .partition(|c| c.idle_bound().stale_at().is_some_and(|at| at <= now));
                    *idle = fresh;
                    stale
                };
                let inner = &inner;
                join_all(stale.into_iter().map(|conn| async move {
                    conn.unpark();
                    if session::reset_bound(inner, &conn).await.is_ok() {
                        inner.recycle(conn);
                    }
                }))
                .await;
            }
        });
    }

    pub(crate) async fn open_dedicated(&self) -> std::result::Result<Conn, SqlError> {
        let conn = self.open(false).await?;
        conn.refuse_pooler()?;
        let setup = format!("{}; {}", layout::HOLDER_SETTINGS, self.tables.warm_up());
        Conn::bounded(
            "setting up the session",
            self.request_timeout(),
            conn.client.batch_execute(&setup),
        )
        .await?;
        Ok(conn)
    }

    fn refill_spare(self: &Arc<Self>) {
        if self.config.mode == Mode::Lease || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        if self.lock_idle().iter().any(|c| c.closed_reason().is_none())
            || self.opening_spare.swap(true, Ordering::AcqRel)
        {
            // One spare at a time: acquires that find the pool empty meanwhile open their own.
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(inner) = weak.upgrade() else { return };
            let opened = inner.open_dedicated().await;
            inner.opening_spare.store(false, Ordering::Release);
            match opened {
                Ok(conn) => inner.recycle_spare(conn),
                Err(e) => tracing::debug!(error = %e, "could not open a spare connection"),
            }
        });
    }

    /// Puts a new connection at the bottom of the idle pool, so the ones that have run distlock's
    /// statements (prepared, with the idle bound of a lease) are taken first.
    fn recycle_spare(&self, conn: Conn) {
        let mut idle = self.lock_idle();
        if idle.len() < MAX_IDLE {
            conn.park();
            idle.insert(0, conn);
        }
    }

    /// The control connection, reconnected if it has closed.
    pub(crate) async fn control(&self) -> std::result::Result<Arc<Conn>, SqlError> {
        let mut slot = self.control.lock().await;
        self.control_in(&mut slot).await
    }

    /// [`Inner::control`] with its slot locked by the caller.
    async fn control_in(
        &self,
        slot: &mut Option<Arc<Conn>>,
    ) -> std::result::Result<Arc<Conn>, SqlError> {
        if let Some(conn) = slot.as_ref() {
            if conn.closed_reason().is_none() {
                return Ok(conn.clone());
            }
        }
        // It forwards the NOTIFYs it gets; it LISTENs only while a waiter wants them ([`Inner::listen`]).
        let conn = Arc::new(self.open(true).await?);
        if self
            .schema_checked
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            let warm = self.tables.warm_up();
            Conn::bounded(
                "warming up",
                self.request_timeout(),
                conn.client.batch_execute(&warm),
            )
            .await?;
        }
        if self.waiters.load(Ordering::Acquire) > 0 {
            if let Err(e) = self.set_listening(&conn, true).await {
                // The statement in hand needs no notification; the next wait LISTENs again
                // (`ensure_listening`).
                tracing::debug!(error = %e, "LISTEN failed on a new control connection");
            }
        }
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Registers a waiter that wants the release notifications (a permit or lease-mode wait): the
    /// control connection `LISTEN`s from before this returns until [`LISTEN_LINGER`] after the last
    /// registration is dropped. Nobody listens while nobody waits, so an uncontended release's `NOTIFY`
    /// wakes no server process (each listening backend of the database is signalled and reads the
    /// queue, whatever channel it listens on) and no driver task. A release committed before this
    /// returns may have notified nobody: the caller tries again before it sleeps.
    pub(crate) async fn listen(&self) -> std::result::Result<Listening, SqlError> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        self.listen_generation.fetch_add(1, Ordering::AcqRel);
        let registration = Listening {
            inner: self.me.clone(),
        };
        self.ensure_listening().await?;
        Ok(registration)
    }

    /// Makes sure the control connection is open and `LISTEN`s (a registered waiter calls it before
    /// each sleep: the connection may have closed, or a `LISTEN` failed, since). `Ok(true)`: it was
    /// listening all along; `Ok(false)`: it listens now but was not, so notifications may have been
    /// lost and the waiter tries again at once.
    pub(crate) async fn ensure_listening(&self) -> std::result::Result<bool, SqlError> {
        let mut slot = self.control.lock().await;
        let conn = self.control_in(&mut slot).await?;
        if conn.listening() {
            return Ok(true);
        }
        if let Err(e) = self.set_listening(&conn, true).await {
            // Its state is unknown now: a new connection next time.
            *slot = None;
            return Err(e);
        }
        Ok(false)
    }

    /// `LISTEN` or `UNLISTEN` on `conn`: recorded once a `LISTEN` is confirmed, and before an
    /// `UNLISTEN` is sent (a timed-out one may still run later; a `LISTEN` more is harmless, a
    /// waiter that thinks the connection listens when it does not is deaf).
    async fn set_listening(&self, conn: &Conn, on: bool) -> std::result::Result<(), SqlError> {
        let sql = if on {
            self.tables.listen()
        } else {
            conn.set_listening(false);
            self.tables.unlisten()
        };
        Conn::bounded(
            if on { "LISTEN" } else { "UNLISTEN" },
            self.request_timeout(),
            conn.client.batch_execute(&sql),
        )
        .await?;
        conn.set_listening(on);
        Ok(())
    }

    /// `UNLISTEN` once no waiter has registered since the registration whose drop scheduled this
    /// (`generation`) and none is registered (under the control slot's lock, so a registration that
    /// comes meanwhile either sees the connection still listening or `LISTEN`s after this).
    async fn unlisten_if_unwanted(&self, generation: u64) {
        let mut slot = self.control.lock().await;
        let Some(conn) = slot.as_ref().cloned() else {
            return;
        };
        if self.waiters.load(Ordering::Acquire) > 0
            || self.listen_generation.load(Ordering::Acquire) != generation
            || !conn.listening()
            || conn.closed_reason().is_some()
        {
            return;
        }
        if let Err(e) = self.set_listening(&conn, false).await {
            tracing::debug!(error = %e, "UNLISTEN failed; closing the control connection");
            *slot = None;
        }
    }

    /// Passes `result` (of a statement on the control connection `conn`) through; a statement that got
    /// no answer within its bound drops `conn` as the control connection, so the next statement opens
    /// a new one instead of waiting on a link that died silently.
    pub(crate) async fn forget_stalled_control<T>(
        &self,
        conn: &Arc<Conn>,
        result: std::result::Result<T, SqlError>,
    ) -> std::result::Result<T, SqlError> {
        if matches!(result, Err(SqlError::Timeout { .. })) {
            let mut slot = self.control.lock().await;
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                *slot = None;
            }
        }
        result
    }

    /// Creates the tables unless they exist, and checks their shape.
    async fn ensure_schema(&self) -> std::result::Result<(), SqlError> {
        let conn = self.control().await?;
        let bound = self.request_timeout();
        match self.check_shape(&conn).await {
            Err(SqlError::TableShape(_)) => {
                let create = self.tables.create();
                let created = Conn::bounded(
                    "creating distlock's tables",
                    bound,
                    conn.client.batch_execute(&create),
                )
                .await;
                if created.is_err() {
                    // A failed batch leaves its transaction open on the connection: start afresh.
                    *self.control.lock().await = None;
                }
                created?;
                self.check_shape(&conn).await
            }
            other => other,
        }?;
        self.ensure_limit_table(&conn).await?;
        self.schema_checked
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The semaphore limit table, which came after the other two: created if missing (under the same
    /// schema lock). A role that may not create it, or not read it, still connects: the mutex and the
    /// write lock do not need it; a semaphore then says what to create or grant, and a read lock fails
    /// with `PermissionDenied` if it may not read it (with no table at all a read lock works: no name
    /// can be a semaphore then). A table of another shape is refused as the others are.
    async fn ensure_limit_table(&self, conn: &Arc<Conn>) -> std::result::Result<(), SqlError> {
        let bound = self.request_timeout();
        let shape = self.tables.shape_of_limit();
        let check = || async {
            let statement = Conn::bounded(
                "checking distlock's tables",
                bound,
                conn.client.prepare(&shape),
            )
            .await?;
            match statement.columns().get(1).map(|c| c.type_()) {
                Some(t) if *t == Type::INT4 => Ok(()),
                other => Err(SqlError::TableShape(format!(
                    "table {}: column permits is {other:?}, distlock needs integer; pick another ?table=",
                    self.tables.limit
                ))),
            }
        };
        let denied = |e: &SqlError| {
            tracing::warn!(
                table = %self.tables.limit,
                error = %e,
                "this role may not create or read the semaphore limit table; everything but semaphores \
                 and read locks works (those say what to grant)"
            );
        };
        match check().await {
            Err(SqlError::TableShape(_)) => {}
            Err(e @ SqlError::Denied { .. }) => {
                denied(&e);
                return Ok(());
            }
            other => return other,
        }
        let create = self.tables.create_limit();
        match Conn::bounded(
            "creating distlock's limit table",
            bound,
            conn.client.batch_execute(&create),
        )
        .await
        {
            Ok(()) => match check().await {
                Err(e @ SqlError::Denied { .. }) => {
                    denied(&e);
                    Ok(())
                }
                checked => checked,
            },
            Err(e) => {
                // A failed batch leaves its transaction open on the connection: start afresh.
                *self.control.lock().await = None;
                match e {
                    SqlError::Denied { .. } => {
                        denied(&e);
                        Ok(())
                    }
                    other => Err(other),
                }
            }
        }
    }

    async fn check_shape(&self, conn: &Conn) -> std::result::Result<(), SqlError> {
        let bound = self.request_timeout();
        let text = [Type::TEXT, Type::VARCHAR];
        let expected: [(String, &str, Vec<Vec<Type>>); 2] = [
            (
                self.tables.shape_of_locks(),
                self.tables.locks.as_str(),
                vec![
                    text.to_vec(),
                    text.to_vec(),
                    vec![Type::TIMESTAMPTZ],
                    vec![Type::INT8],
                ],
            ),
            (
                self.tables.shape_of_fence(),
                self.tables.fence.as_str(),
                vec![text.to_vec(), vec![Type::INT8]],
            ),
        ];
        for (sql, table, types) in expected {
            let statement = Conn::bounded(
                "checking distlock's tables",
                bound,
                conn.client.prepare(&sql),
            )
            .await?;
            for (column, allowed) in statement.columns().iter().zip(&types) {
                if !allowed.contains(column.type_()) {
                    return Err(SqlError::TableShape(format!(
                        "table {table}: column {} is {}, distlock needs {}; pick another ?table=",
                        column.name(),
                        column.type_(),
                        allowed[0]
                    )));
                }
            }
        }
        Ok(())
    }
}

impl PostgresBackend {
    /// Connects the control connection and makes sure the tables exist (creating them on first use).
    /// Bad input fails here: a URL the driver refuses, a wrong password or unknown database, a role
    /// that may not create the tables, a table of another shape.
    pub async fn from_config(config: SqlConfig) -> Result<PostgresBackend> {
        config.validate()?;
        let driver = driver_config(&config).map_err(|e| e.into_core(BACKEND, None))?;
        let tables = Tables::new(config.schema.as_deref(), &config.table);
        let (notify, _) = broadcast::channel(1024);
        let backend = PostgresBackend {
            inner: Arc::new_cyclic(|me| Inner {
                config,
                driver,
                tables,
                control: Mutex::new(None),
                notify,
                idle: std::sync::Mutex::new(Vec::new()),
                schema_checked: std::sync::atomic::AtomicBool::new(false),
                resetter_running: std::sync::atomic::AtomicBool::new(false),
                resetter_wakes_at: std::sync::Mutex::new(None),
                resetter_wake: std::sync::Mutex::new(None),
                waiters: std::sync::atomic::AtomicUsize::new(0),
                listen_generation: std::sync::atomic::AtomicU64::new(0),
                opening_spare: std::sync::atomic::AtomicBool::new(false),
                me: me.clone(),
            }),
        };
        let inner = &backend.inner;
        inner
            .ensure_schema()
            .await
            .map_err(|e| e.into_core(BACKEND, None))?;
        if inner.config.mode != Mode::Lease {
            // The first lock's connection, made now: an acquire's validity deadline counts from
            // before its first request, and a connection setup (TCP, SCRAM, a server process) inside
            // it could eat a short lease.
            let conn = inner
                .open_dedicated()
                .await
                .map_err(|e| e.into_core(BACKEND, None))?;
            inner.recycle_spare(conn);
        }
        Ok(backend)
    }

    /// Parses the URL (see [`SqlConfig::from_url`]) and connects.
    pub async fn connect(url: &str) -> Result<PostgresBackend> {
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(SqlError::Config(format!(
                "the PostgreSQL backend takes postgres:// or postgresql:// URLs, not {scheme}://"
            ))
            .into_core(BACKEND, None));
        }
        Self::from_config(SqlConfig::from_url(url)?).await
    }

    /// The configuration it was made from.
    pub fn config(&self) -> &SqlConfig {
        &self.inner.config
    }
}

/// What the backend keeps for a held lock.
///
/// Opaque: the core keeps it inside the guard and hands it back to renew and release. Code over the
/// raw trait (a wrapper backend, a test) names it through `Backend::Lease`:
///
/// ```
/// use distlock_core::raw::Backend;
/// use distlock_sql::postgres::{PgLease, PostgresBackend};
///
/// fn forwards<B: Backend<Lease = PgLease>>() {}
/// forwards::<PostgresBackend>();
/// ```
pub struct PgLease(pub(crate) LeaseKind);

pub(crate) enum LeaseKind {
    Session(Box<session::Held>),
    Lease(lease::Held),
}

impl std::fmt::Debug for PgLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgLease")
    }
}

/// What the backend keeps while an acquire is under way.
///
/// Opaque: `Backend::begin` makes it (no I/O), every try and wait of that acquire gets it, and
/// `abandon` undoes what a try left (a connection that may hold the lock is closed). Code over the
/// raw trait names it through `Backend::Acquisition`:
///
/// ```
/// use distlock_core::raw::Backend;
/// use distlock_sql::postgres::{PgAcquisition, PostgresBackend};
///
/// fn forwards<B: Backend<Acquisition = PgAcquisition>>() {}
/// forwards::<PostgresBackend>();
/// let _fresh = PgAcquisition::default(); // as `begin` makes it: nothing to undo yet
/// ```
#[derive(Debug, Default)]
pub struct PgAcquisition {
    pub(crate) session: session::Acquiring,
    pub(crate) lease: lease::Acquiring,
    pub(crate) permit: semaphore::Acquiring,
}

#[async_trait]
impl Backend for PostgresBackend {
    type Lease = PgLease;
    type Acquisition = PgAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    /// Per mode: advisory has the read-write lock (PostgreSQL's lock queue: first come, first
    /// served; atomic downgrade) and the semaphore; row mode the read-write lock (`FOR SHARE` readers
    /// get in past a waiting `FOR UPDATE` writer: readers first; no downgrade); lease mode the mutex
    /// only (its lease row has one owner: a read-write lock or a semaphore would need another layout).
    ///
    /// Advisory's order holds within a wait slice (`session::WAIT_SLICE`, 5 s): a waiting writer
    /// leaves the server's queue when its slice ends and queues again at once, and the readers that
    /// had queued behind it are granted at that moment. So a writer waits for the readers that hold
    /// when it comes as long as read holds are shorter than the slice; overlapping read holds each
    /// longer than it can keep a writer out (DESIGN and GUARANTEES say so).
    fn capabilities(&self) -> Capabilities {
        let kinds = match self.inner.config.mode {
            Mode::Advisory => LockKinds::mutex_only()
                .with_read_write(ReadWriteOrder::Fifo)
                .with_atomic_downgrade()
                .with_semaphore(),
            Mode::Row => LockKinds::mutex_only().with_read_write(ReadWriteOrder::ReadersFirst),
            _ => LockKinds::mutex_only(),
        };
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict)
            .with_fifo(false)
            .with_notify_wait(true)
            .with_frees_on_process_death(self.inner.config.mode != Mode::Lease)
            .with_shared_across_processes(true)
            .with_breaks_holders(true)
            .with_kinds(kinds)
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<PgAcquisition> {
        Ok(PgAcquisition::default())
    }

    async fn try_acquire(
        &self,
        acquisition: &mut PgAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<PgLease>> {
        let inner = &self.inner;
        if !self.capabilities().kinds.supports(request.kind) {
            // The core refuses these before any I/O; a direct caller of the trait gets the same.
            return Err(SqlError::Unsupported(format!(
                "PostgreSQL's {} mode has no {}",
                inner.config.mode, request.kind
            ))
            .into_core(BACKEND, Some(&request.name)));
        }
        if inner.config.mode == Mode::Lease {
            return lease::try_acquire(inner, request)
                .await
                .map_err(|e| e.into_core(BACKEND, Some(&request.name)));
        }
        let mut retried = false;
        loop {
            let attempt = match request.kind {
                LockKind::Permit { limit } => {
                    semaphore::try_acquire(inner, &mut acquisition.session, request, limit).await
                }
                _ => session::try_acquire(inner, &mut acquisition.session, request).await,
            };
            match attempt {
                // Once, on a new connection: the pooled one had ended while it waited.
                Err(ref e)
                    if !retried
                        && session::pooled_connection_ended(&mut acquisition.session, e).await =>
                {
                    retried = true;
                }
                attempt => {
                    acquisition.session.from_pool = false;
                    return attempt.map_err(|e| e.into_core(BACKEND, Some(&request.name)));
                }
            }
        }
    }

    async fn wait(
        &self,
        acquisition: &mut PgAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        let inner = &self.inner;
        let waited = match (inner.config.mode, request.kind) {
            (Mode::Lease, _) => {
                lease::wait(inner, &mut acquisition.lease, request, retry_after).await;
                Ok(())
            }
            (_, LockKind::Permit { .. }) => {
                semaphore::wait(
                    inner,
                    &mut acquisition.session,
                    &mut acquisition.permit,
                    request,
                )
                .await;
                Ok(())
            }
            _ => session::wait(&self.inner, &mut acquisition.session, request).await,
        };
        waited.map_err(|e| e.into_core(BACKEND, Some(&request.name)))
    }

    async fn abandon(&self, acquisition: PgAcquisition, request: &AcquireRequest) {
        match self.inner.config.mode {
            Mode::Lease => lease::abandon(&self.inner, request).await,
            _ => session::abandon(&self.inner, acquisition.session).await,
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, PgLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        let mut sessions = Vec::new();
        let mut leases = Vec::new();
        for entry in batch {
            match &entry.lease.0 {
                LeaseKind::Session(held) => sessions.push((entry, &**held)),
                LeaseKind::Lease(held) => leases.push((entry, held)),
            }
        }
        let mut outcomes = session::renew(&self.inner, &sessions).await;
        outcomes.extend(lease::renew(&self.inner, &leases).await);
        outcomes
            .into_iter()
            .map(|(id, r)| (id, r.map_err(|e| e.into_core(BACKEND, None))))
            .collect()
    }

    async fn release(&self, lease: &PgLease, name: &str, owner: &str) -> Result<Released> {
        let released = match &lease.0 {
            LeaseKind::Session(held) => session::release(&self.inner, held, name).await,
            LeaseKind::Lease(held) => lease::release(&self.inner, held, name, owner).await,
        };
        released.map_err(|e| e.into_core(BACKEND, Some(name)))
    }

    /// Advisory mode: the writer's session takes the key shared, then lets the exclusive hold go.
    async fn downgrade(&self, lease: &PgLease, read: &AcquireRequest) -> Result<Grant<PgLease>> {
        let downgraded = match &lease.0 {
            LeaseKind::Session(held) if self.inner.config.mode == Mode::Advisory => {
                session::downgrade(&self.inner, held, read).await
            }
            _ => Err(SqlError::Unsupported(format!(
                "PostgreSQL's {} mode cannot turn a write lock into a read lock in one step",
                self.inner.config.mode
            ))),
        };
        downgraded.map_err(|e| e.into_core(BACKEND, Some(&read.name)))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        inspect::inspect(&self.inner, name)
            .await
            .map_err(|e| e.into_core(BACKEND, Some(name)))
    }

    /// Advisory and row modes terminate the holder's backend (`pg_terminate_backend`) where it still
    /// holds the name exclusive as the hold shown, checked in the same statement; lease mode expires
    /// the lease row where owner and version still match. See `breaking.rs`.
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        breaking::break_holder(&self.inner, name, holder)
            .await
            .map_err(|e| e.into_core(BACKEND, Some(name)))
    }
}

/// `mutex` locked, whether or not a holder panicked (the data stays consistent: plain values).
fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
