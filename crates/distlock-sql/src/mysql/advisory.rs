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
const WAIT_SLICE_SECS: u64 = 30;

type WaitTask = JoinHandle<(Session, Result<Option<i64>, SqlError>)>;

/// An acquire under way: the session it tries on, and a wait in the server.
#[derive(Debug, Default)]
pub struct Waiting {
    session: Option<Session>,
    task: Option<(u64, WaitTask)>,
    /// A finished wait's session and answer, not yet looked at by a try.
    done: Option<(Session, Option<i64>)>,
}

/// A held advisory lock.
#[derive(Debug)]
pub struct Held {
    session: Arc<Mutex<Option<Session>>>,
    key: String,
    id: u64,
}

impl Held {
    /// The server-side id of the session holding the lock.
    pub fn connection_id(&self) -> u64 {
        self.id
    }
}

/// Sets the session's `wait_timeout` to `lease` (whole seconds) if it is set to something else.
pub(crate) async fn set_wait_timeout(
    inner: &Inner,
    session: &mut Session,
    lease: Duration,
) -> Result<(), SqlError> {
    let secs = whole_seconds(lease).max(1);
    if session.wait_timeout != Some(secs) {
        bounded(
            "setting wait_timeout",
            inner.limits.request,
            session
                .conn
                .query_drop(format!("SET SESSION wait_timeout = {secs}")),
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
        let row: Option<(Option<i64>, u64)> = bounded(
            "GET_LOCK",
            inner.limits.request,
            session
                .conn
                .query_first(format!("SELECT GET_LOCK('{key}', 0), CONNECTION_ID()")),
        )
        .await?;
        let (got, id) = row.ok_or_else(|| SqlError::Protocol("GET_LOCK returned no row".into()))?;
        if id != session.id {
            // Dropping the session closes it, which frees whatever it got.
            return Err(session_changed(session.id, id));
        }
        if got != Some(1) {
            waiting.session = Some(session);
            return Ok(Attempt::Busy { retry_after: None });
        }
        session
    };
    // Won. On any error from here the session is dropped, which closes it and frees the lock.
    let token = inner.bump_fence(&mut session.conn, &request.name).await?;
    let loss = session.loss_signal();
    let id = session.id;
    let held = Held {
        session: Arc::new(Mutex::new(Some(session))),
        key,
        id,
    };
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

pub(crate) async fn wait(waiting: &mut Waiting, request: &AcquireRequest) -> Result<(), SqlError> {
    if waiting.task.is_none() {
        let Some(mut session) = waiting.session.take() else {
            return Ok(()); // nothing to wait on: the core tries again
        };
        let key = advisory_name(&request.name);
        let id = session.id;
        let task = tokio::spawn(async move {
            let got = session
                .conn
                .query_first::<Option<i64>, _>(format!(
                    "SELECT GET_LOCK('{key}', {WAIT_SLICE_SECS})"
                ))
                .await
                .map(Option::flatten)
                .map_err(|e| conn::map_error("waiting in GET_LOCK", e));
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

pub(crate) async fn abandon(inner: &Inner, mut waiting: Waiting, request: &AcquireRequest) {
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
    if let Some((mut session, got)) = waiting.done.take() {
        if got == Some(1) {
            let key = advisory_name(&request.name);
            let undone = bounded(
                "undoing an abandoned grant",
                inner.limits.request,
                session.conn.query_drop(format!("DO RELEASE_LOCK('{key}')")),
            )
            .await;
            if undone.is_err() {
                return; // dropped: closing the session frees it
            }
        }
        inner.pool.checkin(session);
    }
    if let Some(session) = waiting.session.take() {
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
    let key = held.key.clone();
    let request = inner.limits.request;
    let wait_secs = whole_seconds(ttl).max(1);
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
            session
                .conn
                .query_first(format!("SELECT CONNECTION_ID(), IS_USED_LOCK('{key}')")),
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
        if holder == Some(session.id) {
            Ok(Renewed::Extended {
                ttl: Duration::from_secs(wait_secs).min(ttl.max(Duration::from_millis(1))),
            })
        } else {
            Ok(Renewed::Gone {
                reason: format!(
                    "IS_USED_LOCK shows {holder:?}, not the lock's session {}",
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
    let got: Option<Option<i64>> = bounded(
        "RELEASE_LOCK",
        inner.limits.request,
        session
            .conn
            .query_first(format!("SELECT RELEASE_LOCK('{}')", held.key)),
    )
    .await?;
    inner.pool.checkin(session);
    Ok(match got.flatten() {
        Some(1) => Released::Released,
        _ => Released::NotHeld,
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
