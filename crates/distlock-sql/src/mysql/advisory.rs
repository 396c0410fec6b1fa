//! `advisory` mode: `GET_LOCK(advisory_name(name), …)` on a dedicated session held for the guard's life.
//!
//! * A try is `GET_LOCK(n, 0)`; a wait is `GET_LOCK(n, 30)` in a task of its own that owns the session,
//!   so a dropped wait future leaves the session whole. `abandon` ends a wait still in the server with
//!   `KILL QUERY <id>` on the control connection, then collects the session: a wait that won in the
//!   meantime is released with `RELEASE_LOCK`, so a cancelled wait never takes the lock later.
//! * The grant bumps the name's fence counter on the same session (autocommit), then reports.
//! * A probe (the watchdog's renewal) runs in a task too (`SET SESSION wait_timeout` if the lease
//!   changed, then `SELECT CONNECTION_ID(), IS_USED_LOCK(n)`), so a renewal dropped by the core's bound
//!   never leaves the held session half-read.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LockInfo, Released, RenewalId, Renewed};
use distlock_core::{FencingToken, HolderInfo};
use mysql_async::prelude::Queryable as _;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::conn::{self, bounded, Session};
use super::layout::{self, advisory_name};
use super::{whole_seconds, Inner, MysqlLease};
use crate::error::SqlError;

/// How long one in-server wait lasts before the core tries again (a wait has no deadline of its own:
/// the core drops it at the acquire's limit and `abandon` ends it).
pub(crate) const WAIT_SLICE_SECS: u64 = 30;

type WaitTask = JoinHandle<(Session, Result<Option<i64>, SqlError>)>;

/// An acquire under way: the session it tries on, and a wait in the server.
#[derive(Debug, Default)]
pub struct Waiting {
    pub(crate) session: Option<Session>,
    task: Option<(u64, WaitTask)>,
    /// A finished wait's session and answer, not yet looked at by a try.
    pub(crate) done: Option<(Session, Option<i64>)>,
}

/// What a held session holds: a `GET_LOCK` name, or a row locked in an open transaction. The statements
/// that wait for it, probe it, release it and undo an abandoned grant differ; the rest is shared.
#[derive(Debug, Clone)]
pub(crate) enum Flavor {
    /// `GET_LOCK(key)`.
    Advisory { key: String },
    /// `SELECT … FOR UPDATE` of the row `row` (a SQL literal) of `table`.
    Row { table: String, row: String },
}

impl Flavor {
    fn undo_sql(&self) -> String {
        match self {
            Flavor::Advisory { key } => format!("DO RELEASE_LOCK('{key}')"),
            Flavor::Row { .. } => "ROLLBACK".into(),
        }
    }

    fn probe_sql(&self) -> String {
        match self {
            Flavor::Advisory { key } => format!("SELECT CONNECTION_ID(), IS_USED_LOCK('{key}')"),
            Flavor::Row { .. } => "SELECT CONNECTION_ID(), @@in_transaction".into(),
        }
    }

    /// Whether the probe's second column says the session still holds the lock.
    fn probe_holds(&self, session_id: u64, second: Option<u64>) -> bool {
        match self {
            Flavor::Advisory { .. } => second == Some(session_id),
            Flavor::Row { .. } => second == Some(1),
        }
    }

    /// Runs the in-server wait on `session`: `Some(1)` when it got the lock, `Some(0)` when the slice
    /// ended without it.
    async fn wait_once(&self, session: &mut Session) -> Result<Option<i64>, SqlError> {
        match self {
            Flavor::Advisory { key } => session
                .conn
                .query_first::<Option<i64>, _>(format!(
                    "SELECT GET_LOCK('{key}', {WAIT_SLICE_SECS})"
                ))
                .await
                .map(Option::flatten)
                .map_err(|e| conn::map_error("waiting in GET_LOCK", e)),
            Flavor::Row { table, row } => {
                super::row::wait_for_row(session, table, row, false).await
            }
        }
    }
}

/// A held advisory or row lock: the session that holds it.
#[derive(Debug)]
pub struct Held {
    session: Arc<Mutex<Option<Session>>>,
    flavor: Flavor,
    id: u64,
}

impl Held {
    pub(crate) fn new(session: Session, flavor: Flavor) -> Held {
        let id = session.id;
        Held {
            session: Arc::new(Mutex::new(Some(session))),
            flavor,
            id,
        }
    }
}

impl Held {
    /// The server-side id of the session holding the lock.
    pub fn connection_id(&self) -> u64 {
        self.id
    }
}

/// The largest `wait_timeout` MariaDB and MySQL accept; a larger one is clamped with only a warning.
const MAX_WAIT_TIMEOUT_SECS: u64 = 31_536_000;

/// `lease` in whole seconds for `wait_timeout`, refused when the server would clamp it: the server
/// would then end a cut-off holder's session (and free its lock) before the guard's validity deadline.
pub(crate) fn wait_timeout_secs(lease: Duration) -> Result<u64, SqlError> {
    let secs = whole_seconds(lease).max(1);
    if secs > MAX_WAIT_TIMEOUT_SECS {
        return Err(SqlError::Config(format!(
            "a lease of {secs} s is longer than the server's largest wait_timeout ({MAX_WAIT_TIMEOUT_SECS} s), \
             which bounds how long a held session lives without a probe; use a shorter lease (the watchdog \
             renews it) or ?mode=lease"
        )));
    }
    Ok(secs)
}

/// Sets the session's `wait_timeout` to `lease` (whole seconds) if it is set to something else.
pub(crate) async fn set_wait_timeout(
    inner: &Inner,
    session: &mut Session,
    lease: Duration,
) -> Result<(), SqlError> {
    let secs = wait_timeout_secs(lease)?;
    if session.wait_timeout != Some(secs) {
        bounded(
            "setting wait_timeout",
            inner.limits.request,
            session.conn.query_drop(format!(
                "SET SESSION wait_timeout = {secs}, innodb_lock_wait_timeout = {WAIT_SLICE_SECS}"
            )),
        )
        .await?;
        session.wait_timeout = Some(secs);
    }
    Ok(())
}

pub(crate) async fn try_acquire(
    inner: &Inner,
    waiting: &mut Waiting,
    request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let key = advisory_name(&request.name);
    let mut session = if let Some((session, got)) = waiting.done.take() {
        if got != Some(1) {
            waiting.session = Some(session);
            return Ok(Attempt::Busy { retry_after: None });
        }
        session
    } else {
        let mut session = match waiting.session.take() {
            Some(s) => s,
            None => inner.pool.checkout(&inner.opts, &inner.limits).await?,
        };
        set_wait_timeout(inner, &mut session, request.lease).await?;
        // The try and, when it got the lock, the counter bump: one multi-statement query, one round
        // trip. The bump's OK packet carries the token as its insert id.
        let sql = format!(
            "SELECT GET_LOCK('{key}', 0), CONNECTION_ID(); {}",
            layout::bump_fence_if_locked(&inner.table, &request.name, &key)
        );
        let answered = bounded("GET_LOCK", inner.limits.request, async {
            let mut result = session.conn.query_iter(sql).await?;
            let row: Vec<(Option<i64>, u64)> = result.collect().await?;
            // `collect` has moved to the second statement's answer: the bump's OK packet.
            let bumped = result.affected_rows();
            let token = result.last_insert_id();
            result.drop_result().await?;
            Ok((row, bumped, token))
        })
        .await;
        let (row, bumped, token) = match answered {
            Ok(answer) => answer,
            Err(e) => {
                // GET_LOCK may have got the lock before the bump failed.
                undo_and_drop(inner, session, &key).await;
                return Err(e);
            }
        };
        let (got, id) = row
            .first()
            .copied()
            .ok_or_else(|| SqlError::Protocol("GET_LOCK returned no row".into()))?;
        if id != session.id {
            // Dropping the session closes it, which frees whatever it got.
            return Err(session_changed(session.id, id));
        }
        if got != Some(1) {
            waiting.session = Some(session);
            return Ok(Attempt::Busy { retry_after: None });
        }
        let token = match token {
            Some(token) if token > 0 && bumped > 0 => token,
            other => {
                undo_and_drop(inner, session, &key).await;
                return Err(SqlError::Protocol(format!(
                    "the fencing counter statement changed {bumped} rows, insert id {other:?}"
                )));
            }
        };
        return grant(session, key, token, request);
    };
    // Won in a wait: on an error the lock is released before the error is reported.
    let token = match inner.bump_fence(&mut session.conn, &request.name).await {
        Ok(token) => token,
        Err(e) => {
            undo_and_drop(inner, session, &key).await;
            return Err(e);
        }
    };
    grant(session, key, token, request)
}

/// Releases `key` on a session that may hold it when an acquire fails after `GET_LOCK` (a failed
/// counter bump), so the lock is free when the error is reported, then drops the session (closing it
/// frees whatever the release could not). `RELEASE_LOCK` frees only a lock of this session.
async fn undo_and_drop(inner: &Inner, mut session: Session, key: &str) {
    let undone = bounded(
        "undoing a failed grant",
        inner.limits.request,
        session.conn.query_drop(format!("DO RELEASE_LOCK('{key}')")),
    )
    .await;
    if let Err(e) = undone {
        tracing::debug!(error = %e, "releasing the lock of a failed acquire failed; closing its session");
    }
    drop(session);
}

/// The grant of a session that holds `key`, with its committed token.
fn grant(
    session: Session,
    key: String,
    token: u64,
    request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let loss = session.loss_signal();
    let held = Held::new(session, Flavor::Advisory { key });
    let mut grant = Grant::new(MysqlLease::Advisory(held))
        .with_token(FencingToken::new(token))
        .with_ttl(request.lease);
    if let Some(loss) = loss {
        grant = grant.with_loss(loss);
    }
    Ok(Attempt::Acquired(grant))
}

pub(crate) fn session_changed(expected: u64, got: u64) -> SqlError {
    SqlError::SessionChanged(format!(
        "the server session changed between statements (CONNECTION_ID() {expected}, then {got}): a \
         connection-pooling proxy sits between distlock and the server, and session locks cannot work \
         through it; connect to the server directly, or use ?mode=lease"
    ))
}

pub(crate) async fn wait(waiting: &mut Waiting, flavor: Flavor) -> Result<(), SqlError> {
    if waiting.task.is_none() {
        let Some(mut session) = waiting.session.take() else {
            return Ok(()); // nothing to wait on: the core tries again
        };
        let id = session.id;
        let task = tokio::spawn(async move {
            let got = flavor.wait_once(&mut session).await;
            (session, got)
        });
        waiting.task = Some((id, task));
    }
    let Some((_, task)) = waiting.task.as_mut() else {
        return Ok(());
    };
    let joined = task.await;
    waiting.task = None;
    let (session, got) =
        joined.map_err(|e| SqlError::Protocol(format!("the wait task failed: {e}")))?;
    waiting.done = Some((session, got?));
    Ok(())
}

pub(crate) async fn abandon(
    inner: &Inner,
    mut waiting: Waiting,
    request: &AcquireRequest,
    flavor: Flavor,
) {
    if let Some((id, task)) = waiting.task.take() {
        if let Err(e) = conn::kill_query(&inner.control, &inner.opts, &inner.limits, id).await {
            tracing::warn!(lock = %request.name, error = %e, "KILL QUERY of an abandoned wait failed; closing its session");
            task.abort();
            return;
        }
        match tokio::time::timeout(inner.limits.request, task).await {
            Ok(Ok((session, Ok(got)))) => waiting.done = Some((session, got)),
            Ok(Ok((_, Err(_)))) | Ok(Err(_)) => {}
            Err(_) => {
                tracing::warn!(lock = %request.name, "an abandoned wait did not end after KILL QUERY; its session is dropped")
            }
        }
    }
    // A row session may be left in a transaction by the killed statement: always roll back.
    let always = matches!(flavor, Flavor::Row { .. });
    let sessions = [
        waiting.done.take(),
        waiting.session.take().map(|s| (s, None)),
    ];
    for (mut session, got) in sessions.into_iter().flatten() {
        if got == Some(1) || always {
            let undone = bounded(
                "undoing an abandoned grant",
                inner.limits.request,
                session.conn.query_drop(flavor.undo_sql()),
            )
            .await;
            if undone.is_err() {
                continue; // dropped: closing the session frees it
            }
        }
        inner.pool.checkin(session);
    }
}

/// Probes a held session (see the module docs), in a task that owns it while the statement runs.
pub(crate) async fn probe<'a>(
    inner: &Inner,
    id: RenewalId,
    held: &Held,
    name: &'a str,
    ttl: Duration,
) -> (RenewalId, &'a str, Result<Renewed, SqlError>) {
    let slot = held.session.clone().lock_owned().await;
    let flavor = held.flavor.clone();
    let request = inner.limits.request;
    let wait_secs = match wait_timeout_secs(ttl) {
        Ok(secs) => secs,
        Err(e) => return (id, name, Err(e)),
    };
    let task = tokio::spawn(async move {
        let mut slot = slot;
        let Some(session) = slot.as_mut() else {
            return Ok(Renewed::Gone {
                reason: "the lock was released".into(),
            });
        };
        if session.wait_timeout != Some(wait_secs) {
            bounded(
                "setting wait_timeout",
                request,
                session
                    .conn
                    .query_drop(format!("SET SESSION wait_timeout = {wait_secs}")),
            )
            .await?;
            session.wait_timeout = Some(wait_secs);
        }
        let row: Option<(u64, Option<u64>)> = bounded(
            "probing the lock's session",
            request,
            session.conn.query_first(flavor.probe_sql()),
        )
        .await?;
        let Some((now_id, holder)) = row else {
            return Err(SqlError::Protocol("the probe returned no row".into()));
        };
        if now_id != session.id {
            return Ok(Renewed::Gone {
                reason: session_changed(session.id, now_id).to_string(),
            });
        }
        if flavor.probe_holds(session.id, holder) {
            Ok(Renewed::Extended {
                ttl: Duration::from_secs(wait_secs).min(ttl.max(Duration::from_millis(1))),
            })
        } else {
            Ok(Renewed::Gone {
                reason: format!(
                    "the probe found the lock no longer held by session {} ({holder:?})",
                    session.id
                ),
            })
        }
    });
    let result = match task.await {
        Ok(r) => r,
        Err(e) => Err(SqlError::Protocol(format!("the probe task failed: {e}"))),
    };
    (id, name, result)
}

pub(crate) async fn release(inner: &Inner, held: &Held) -> Result<Released, SqlError> {
    let mut slot = held.session.lock().await;
    let Some(mut session) = slot.take() else {
        return Ok(Released::NotHeld);
    };
    if session.server_closed() {
        return Ok(Released::NotHeld);
    }
    let released = match &held.flavor {
        Flavor::Advisory { key } => {
            let got: Option<Option<i64>> = bounded(
                "RELEASE_LOCK",
                inner.limits.request,
                session
                    .conn
                    .query_first(format!("SELECT RELEASE_LOCK('{key}')")),
            )
            .await?;
            got.flatten() == Some(1)
        }
        Flavor::Row { .. } => {
            let in_txn: Option<Option<u64>> = bounded(
                "ending the lock's transaction",
                inner.limits.request,
                session.conn.query_first("SELECT @@in_transaction"),
            )
            .await?;
            bounded(
                "ending the lock's transaction",
                inner.limits.request,
                session.conn.query_drop("ROLLBACK"),
            )
            .await?;
            in_txn.flatten() == Some(1)
        }
    };
    inner.pool.checkin(session);
    Ok(if released {
        Released::Released
    } else {
        Released::NotHeld
    })
}

pub(crate) async fn inspect(inner: &Inner, name: &str) -> Result<LockInfo, SqlError> {
    let key = advisory_name(name);
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let holder: Option<Option<u64>> = bounded(
        "IS_USED_LOCK",
        inner.limits.request,
        session
            .conn
            .query_first(format!("SELECT IS_USED_LOCK('{key}')")),
    )
    .await?;
    let fence: Option<u64> = bounded(
        "reading the fencing counter",
        inner.limits.request,
        session
            .conn
            .query_first(layout::read_fence(&inner.table, name)),
    )
    .await?;
    inner.pool.checkin(session);
    let mut info = LockInfo::default();
    info.last_token = fence.filter(|f| *f > 0).map(FencingToken::new);
    if let Some(conn_id) = holder.flatten() {
        let mut h = HolderInfo::default();
        h.owner = Some(format!("mysql session {conn_id}"));
        h.token = info.last_token;
        info.holder = Some(h);
    }
    Ok(info)
}
