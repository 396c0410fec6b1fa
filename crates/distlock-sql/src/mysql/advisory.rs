//! `advisory` mode: `GET_LOCK(advisory_name(name), …)` on a dedicated session held for the guard's life.
//!
//! * A try is `GET_LOCK(n, 0)`; a wait is `GET_LOCK(n, 10)` (10 s slices) in a task of its own that owns the session,
//!   so a dropped wait future leaves the session whole. `abandon` ends a wait still in the server with
//!   `KILL QUERY <id>` on the control connection, then collects the session: a wait that won in the
//!   meantime is released with `RELEASE_LOCK`, so a cancelled wait never takes the lock later.
//! * The grant bumps the name's fence counter on the same session (autocommit), in the query that
//!   took the lock (a try's `GET_LOCK(n, 0)`, or a wait's `GET_LOCK(n, 10)`), then reports: the token
//!   is committed back to back with the grant, so a break finds a later hold of the same session by
//!   its token (see `breaking.rs`). The bump also records the session as the token's minter, which
//!   tells `inspect` and a break a distlock holder from another client holding the name.
//! * A probe (the watchdog's renewal) runs in a task too (`SET SESSION wait_timeout` if the lease
//!   changed, then `SELECT CONNECTION_ID(), IS_USED_LOCK(n)`), so a renewal dropped by the core's bound
//!   never leaves the held session half-read.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LockInfo, Released, RenewalId, Renewed};
use distlock_core::{FencingToken, HolderInfo, LockKind};
use mysql_async::prelude::Queryable as _;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use super::conn::{self, bounded, Session};
use super::layout::{self, advisory_name};
use super::{whole_seconds, Inner, MysqlLease};
use crate::error::SqlError;

use super::layout::{PERMIT_WAIT_SLICE_SECS, WAIT_SLICE_SECS};

type WaitTask = JoinHandle<(Session, Result<Answer, SqlError>)>;

/// A wait slice's answer: whether it got the lock (`Some(1)`) and, for a mutex's wait that mints with
/// its grant, the counter bump's answer.
#[derive(Debug, Clone, Copy, Default)]
struct Answer {
    got: Option<i64>,
    minted: Option<Minted>,
}

/// A counter bump's answer: the rows it changed (0: not bumped) and the new token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Minted {
    pub(crate) bumped: u64,
    pub(crate) token: Option<u64>,
}

/// An acquire under way: the session it tries on, and a wait in the server.
#[derive(Debug, Default)]
pub struct Waiting {
    pub(crate) session: Option<Session>,
    task: Option<(u64, WaitTask)>,
    /// A finished wait's session and answer, not yet looked at by a try.
    pub(crate) done: Option<(Session, Option<i64>)>,
    /// The counter bump a finished mutex wait sent with its grant (`Flavor::Advisory`'s `mint`).
    pub(crate) minted: Option<Minted>,
}

impl Waiting {
    /// Whether a wait in the server is under way (its answer not yet collected).
    pub(crate) fn waiting_in_server(&self) -> bool {
        self.task.is_some()
    }
}

/// What a held session holds: a `GET_LOCK` name, or a row locked in an open transaction. The statements
/// that wait for it, probe it, release it and undo an abandoned grant differ; the rest is shared.
#[derive(Debug, Clone)]
pub(crate) enum Flavor {
    /// `GET_LOCK(key)`; a wait sends `mint` (the counter bump of a mutex, which runs only when the
    /// session got `key`) in the same query as its `GET_LOCK`.
    Advisory { key: String, mint: Option<String> },
    /// `GET_LOCK(key)` of a semaphore slot: as `Advisory`, but a wait on it lasts
    /// [`PERMIT_WAIT_SLICE_SECS`] (the waiter then tries every slot and waits on the next one).
    Slot { key: String },
    /// `SELECT … FOR UPDATE` of the row `row` (a SQL literal) of `table`.
    Row { table: String, row: String },
}

impl Flavor {
    fn undo_sql(&self) -> String {
        match self {
            Flavor::Advisory { key, .. } | Flavor::Slot { key } => {
                format!("DO RELEASE_LOCK('{key}')")
            }
            Flavor::Row { .. } => "ROLLBACK".into(),
        }
    }

    fn probe_sql(&self) -> String {
        match self {
            Flavor::Advisory { key, .. } | Flavor::Slot { key } => {
                format!("SELECT CONNECTION_ID(), IS_USED_LOCK('{key}')")
            }
            Flavor::Row { .. } => "SELECT CONNECTION_ID(), @@in_transaction".into(),
        }
    }

    /// Whether the probe's second column says the session still holds the lock.
    fn probe_holds(&self, session_id: u64, second: Option<u64>) -> bool {
        match self {
            Flavor::Advisory { .. } | Flavor::Slot { .. } => second == Some(session_id),
            Flavor::Row { .. } => second == Some(1),
        }
    }

    /// How long one wait slice lasts in the server, seconds.
    fn slice_secs(&self) -> u64 {
        match self {
            Flavor::Slot { .. } => PERMIT_WAIT_SLICE_SECS,
            Flavor::Advisory { .. } | Flavor::Row { .. } => WAIT_SLICE_SECS,
        }
    }

    /// Runs the in-server wait on `session`: `Some(1)` when it got the lock, `Some(0)` when the slice
    /// ended without it.
    async fn wait_once(&self, session: &mut Session) -> Result<Answer, SqlError> {
        match self {
            Flavor::Advisory {
                key,
                mint: Some(mint),
            } => {
                let secs = self.slice_secs();
                let sql = format!("SELECT GET_LOCK('{key}', {secs}); {mint}");
                async {
                    let mut result = session.conn.query_iter(sql).await?;
                    let got: Vec<Option<i64>> = result.collect().await?;
                    // `collect` has moved to the second statement's answer: the bump's OK packet.
                    let minted = Minted {
                        bumped: result.affected_rows(),
                        token: result.last_insert_id(),
                    };
                    result.drop_result().await?;
                    let got = got.first().copied().flatten();
                    Ok::<_, mysql_async::Error>(Answer {
                        got,
                        minted: Some(minted),
                    })
                }
                .await
                .map_err(|e| conn::map_error("waiting in GET_LOCK", e))
            }
            Flavor::Advisory { key, .. } | Flavor::Slot { key } => {
                let secs = self.slice_secs();
                session
                    .conn
                    .query_first::<Option<i64>, _>(format!("SELECT GET_LOCK('{key}', {secs})"))
                    .await
                    .map(|got| Answer {
                        got: got.flatten(),
                        minted: None,
                    })
                    .map_err(|e| conn::map_error("waiting in GET_LOCK", e))
            }
            Flavor::Row { table, row } => {
                super::row::wait_for_row(session, table, row, false, true)
                    .await
                    .map(|got| Answer { got, minted: None })
            }
        }
    }
}

/// A held advisory or row lock: the session that holds it.
///
/// Reached only inside a [`MysqlLease`](super::MysqlLease), which code over the raw trait matches to
/// tell what a hold keeps on the server:
///
/// ```
/// use distlock_sql::mysql::MysqlLease;
///
/// // A session (and its connection) stays open for the whole hold in these two modes.
/// fn holds_a_session(lease: &MysqlLease) -> bool {
///     matches!(lease, MysqlLease::Advisory(_) | MysqlLease::Row(_))
/// }
/// # let _ = holds_a_session;
/// ```
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
            waiting.minted = None;
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
            "{}; {}",
            layout::try_mutex(inner.limit_table(), &request.name, &key),
            layout::bump_fence_if_locked(&inner.table, inner.limit_table(), &request.name, &key)
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
        if got == Some(layout::SEMAPHORE_NAME) {
            // The name has a semaphore limit: refused without taking the lock.
            waiting.session = Some(session);
            return Err(semaphore_name(inner, &request.name));
        }
        if got != Some(1) {
            waiting.session = Some(session);
            return Ok(Attempt::Busy { retry_after: None });
        }
        if bumped == 0 && inner.limit_table().is_some() {
            // Got the lock, but the name has a semaphore limit: give it back.
            return refuse_semaphore_name(inner, waiting, session, &key, &request.name).await;
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
    // Won in a wait, which minted the token with its grant (a wait that sent no bump has its lock
    // bumped now): on an error the lock is released before the error is reported.
    let minted = match waiting.minted.take() {
        Some(minted) => Ok(minted),
        None => inner
            .bump_mutex_fence(&mut session.conn, &request.name)
            .await
            .map(|token| Minted {
                bumped: u64::from(token.is_some()),
                token,
            }),
    };
    let token = match minted {
        Ok(Minted { bumped: 0, .. }) if inner.limit_table().is_some() => {
            return refuse_semaphore_name(inner, waiting, session, &key, &request.name).await;
        }
        Ok(Minted {
            bumped,
            token: Some(token),
        }) if bumped > 0 && token > 0 => token,
        Ok(other) => {
            undo_and_drop(inner, session, &key).await;
            return Err(SqlError::Protocol(format!(
                "the fencing counter statement after the wait answered {other:?}"
            )));
        }
        Err(e) => {
            undo_and_drop(inner, session, &key).await;
            return Err(e);
        }
    };
    grant(session, key, token, request)
}

/// A mutex that got `key` on a name that is a semaphore (its limit row exists): gives the lock back
/// and fails with `KindConflict`.
async fn refuse_semaphore_name(
    inner: &Inner,
    waiting: &mut Waiting,
    mut session: Session,
    key: &str,
    name: &str,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let undone = bounded(
        "giving back a refused mutex",
        inner.limits.request,
        session.conn.query_drop(format!("DO RELEASE_LOCK('{key}')")),
    )
    .await;
    if undone.is_ok() {
        waiting.session = Some(session);
    } // else dropped: closing the session frees the lock
    Err(semaphore_name(inner, name))
}

/// The mutex's refusal of a name that is a semaphore.
fn semaphore_name(inner: &Inner, name: &str) -> SqlError {
    SqlError::KindConflict(format!(
        "{name:?} is a semaphore (its limit is stored in {}), so a mutex of that name is refused; a name \
         is one kind of lock. To use it as a mutex again, once no permit of it is held, delete the row: \
         DELETE FROM {} WHERE name = {}",
        inner.limit_table_name,
        inner.limit_table_name,
        layout::literal(name.as_bytes())
    ))
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
    let held = Held::new(session, Flavor::Advisory { key, mint: None });
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

/// Whether an error says the connection itself is gone or silent (no reply in time, a socket error),
/// as opposed to an answer of the server's.
pub(crate) fn connection_broke(e: &SqlError) -> bool {
    match e {
        SqlError::Timeout { .. } => true,
        SqlError::Unavailable {
            source: Some(source),
            ..
        } => source
            .downcast_ref::<mysql_async::Error>()
            .is_some_and(|e| matches!(e, mysql_async::Error::Io(_))),
        _ => false,
    }
}

/// One wait slice in the server. The slice ends in the server after [`WAIT_SLICE_SECS`] ([`PERMIT_WAIT_SLICE_SECS`] on a
/// permit's slot); the client
/// gives it `request` more, then counts the connection as dead (it died without a FIN or RST reaching
/// this side: nothing else would end the read), drops it (closing it frees whatever the server's
/// session got) and returns, so the core's next try goes on over another connection.
pub(crate) async fn wait(
    waiting: &mut Waiting,
    flavor: Flavor,
    request: Duration,
) -> Result<(), SqlError> {
    if waiting.task.is_none() {
        let Some(mut session) = waiting.session.take() else {
            return Ok(()); // nothing to wait on: the core tries again
        };
        let id = session.id;
        // A mutex's wait bumps the counter in the same query as its GET_LOCK: if the bump fails, the
        // session may hold the lock, which is released before the error is reported.
        let undo_key = match &flavor {
            Flavor::Advisory { key, mint: Some(_) } => Some(key.clone()),
            _ => None,
        };
        // A permit's slice is 1 s: its silent connection is given up after 1 s + `request`, not 10 s.
        let bound = Duration::from_secs(flavor.slice_secs()) + request;
        let task = tokio::spawn(async move {
            let got = match tokio::time::timeout(bound, flavor.wait_once(&mut session)).await {
                Ok(got) => got,
                Err(_) => Err(SqlError::Timeout {
                    action: "waiting for the lock (one wait slice)",
                    after: bound,
                }),
            };
            let got = match (got, undo_key) {
                (Err(e), Some(key)) if !connection_broke(&e) => {
                    let undo = session.conn.query_drop(format!("DO RELEASE_LOCK('{key}')"));
                    if !matches!(tokio::time::timeout(request, undo).await, Ok(Ok(()))) {
                        tracing::debug!(
                            "releasing the lock of a failed wait failed; its session is closed"
                        );
                    }
                    Err(e)
                }
                (got, _) => got,
            };
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
    match got {
        Ok(answer) => {
            waiting.done = Some((session, answer.got));
            waiting.minted = answer.minted;
        }
        Err(e) if connection_broke(&e) => {
            tracing::warn!(session = session.id, error = %e, "a waiting connection broke or went silent; waiting on over another one");
            drop(session);
        }
        Err(e) => return Err(e),
    }
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
            Ok(Ok((session, Ok(answer)))) => waiting.done = Some((session, answer.got)),
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
        Flavor::Advisory { key, .. } | Flavor::Slot { key } => {
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

/// What `distlock status` shows in advisory mode: the session holding the name's `GET_LOCK`, with the
/// name's counter as its token when that session minted it (a distlock holder, see the module docs;
/// another client holding the name, which minted nothing, is shown without a token), and its `HOST`
/// where the user may read it; then the permits of a semaphore of that name.
pub(crate) async fn inspect(inner: &Inner, name: &str) -> Result<LockInfo, SqlError> {
    let key = advisory_name(name);
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    type Read = (Option<u64>, Option<u64>, Option<Vec<u8>>, Option<String>);
    let read: Option<Read> = bounded(
        "IS_USED_LOCK",
        inner.limits.request,
        session
            .conn
            .query_first(layout::advisory_holder(&inner.table, name, &key)),
    )
    .await?;
    let (holder, fence, minter, host) = read.unwrap_or_default();
    let mut info = LockInfo::default();
    info.last_token = fence.filter(|f| *f > 0).map(FencingToken::new);
    if let Some(conn_id) = holder {
        let owner = layout::session_owner(conn_id);
        let mut h = HolderInfo::default();
        if minter.as_deref() == Some(owner.as_bytes()) {
            h.token = info.last_token;
        }
        h.owner = Some(owner);
        h.host = host;
        info.kind = Some(LockKind::Mutex);
        info.holder = Some(h);
    }
    super::semaphore::inspect_permits(inner, &mut session, name, &mut info).await?;
    inner.pool.checkin(session);
    Ok(info)
}
