//! Advisory and row modes: a lock held by a dedicated connection's session (a session advisory lock,
//! or a row locked `FOR UPDATE` in a transaction held open), for the life of the guard.
//!
//! **Kinds.** A read lock is the same lock shared: `pg_advisory_lock_shared` on the name's key, or
//! the row `FOR SHARE`; a write lock is the mutex itself. A reader's token is the counter as the last
//! write grant left it, read once its lock is granted; an advisory reader also checks that the name
//! has no stored semaphore limit (`KindConflict`: permits hold the key shared too, see
//! `semaphore.rs`, which reuses this module's connection handling). A write hold becomes a read hold
//! on its own session ([`downgrade`]).
//!
//! **The loss deadline.** The connection sets `idle_session_timeout` and
//! `idle_in_transaction_session_timeout` to the lease: if no statement arrives for that long (the
//! client is cut off, paused or gone), the server ends the session and frees the lock. The watchdog's
//! renewal is a probe that sets the bound again and reads `pg_backend_pid()`, so the server frees the
//! lock no earlier than the probe's send time plus the bound, and the guard's validity deadline is that
//! send time plus the bound (minus the core's margin): Jeopardy after a failed probe, Lost at the
//! deadline. A probe that reads another backend pid means a transaction pooler sits in between (the
//! session, and with it the lock, is not ours): the guard is Lost with a message that says so.
//!
//! **Waiting** is in the server (`pg_advisory_lock` / `FOR UPDATE`). An acquire given up mid-wait sends
//! the driver's cancel request, then undoes on the same connection whatever the wait took before the
//! cancel landed (see [`discard`]) and closes the connection, so the wait never takes the lock later
//! and leaves nothing once the abandon returns (and `client_connection_check_interval` ends a wait
//! whose client vanished).

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, Released, Renewal, RenewalId, Renewed};
use distlock_core::{FencingToken, LockKind};
use futures_util::future::join_all;
use tokio::sync::Mutex;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::SimpleQueryMessage;

use super::backend::{Inner, LeaseKind, PgLease};
use super::conn::{is_fatal, is_lock_not_available, map_error, Conn, Params};
use super::layout;
use crate::config::{AdvisoryKey, Mode};
use crate::error::SqlError;

/// The bound of a cancel request sent when an acquire is given up.
const CANCEL_BOUND: Duration = Duration::from_secs(2);

/// Where a dedicated connection's acquire stands.
#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
enum Stage {
    /// Nothing sent that waits.
    #[default]
    Idle,
    /// A waiting statement was sent and has not answered.
    Waiting,
    /// The wait returned: the session holds the lock.
    Locked,
}

/// An acquire under way in advisory or row mode.
#[derive(Debug, Default)]
pub(crate) struct Acquiring {
    pub(super) conn: Option<Conn>,
    stage: Stage,
    /// The last try found the lock busy and nothing is in flight: the session holds nothing, so an
    /// abandon may hand the connection back instead of closing it.
    pub(super) clean: bool,
    /// The connection came from the idle pool and has not answered a statement of this acquire yet.
    pub(super) from_pool: bool,
    /// The next connection is a new one, not one from the pool.
    fresh: bool,
    /// The token an exclusive advisory wait minted with its grant ([`layout::advisory_wait_minting`]),
    /// for the try that reports it.
    minted: Option<FencingToken>,
}

/// What a held session holds.
#[derive(Debug, Clone, Copy)]
pub(super) enum Hold {
    /// Advisory mode: the name's key, exclusive (mutex, write) or shared (read).
    Advisory { key: AdvisoryKey, shared: bool },
    /// Advisory mode: a permit, the key of its slot and the name's key shared.
    Permit { key: AdvisoryKey, slot: AdvisoryKey },
    /// Row mode: the name's row locked in the held transaction (`FOR UPDATE` or `FOR SHARE`).
    Row,
}

/// A held lock: its connection (taken out on release) and what it locks.
pub(crate) struct Held {
    conn: Mutex<Option<Conn>>,
    hold: Hold,
    pid: i32,
}

impl Held {
    /// The hold of `conn`'s session.
    pub(super) fn new(conn: Conn, hold: Hold) -> Self {
        let pid = conn.pid;
        Self {
            conn: Mutex::new(Some(conn)),
            hold,
            pid,
        }
    }
}

fn ttl_ms(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The statements that set the session's idle bound to `ttl` and read `pg_backend_pid()`.
fn bound_sql(ttl: Duration) -> Result<String, SqlError> {
    Ok(layout::session_bound(bound_ms(ttl)?))
}

/// Refuses a lease longer than the server's idle bound can be ([`bound_ms`]), before any I/O.
pub(super) fn check_lease(ttl: Duration) -> Result<(), SqlError> {
    bound_ms(ttl).map(drop)
}

/// The idle bound of a lease of `ttl`, in milliseconds; refused above what the server accepts.
fn bound_ms(ttl: Duration) -> Result<u64, SqlError> {
    let ms = ttl_ms(ttl);
    if ms > i32::MAX as u64 {
        // The server refuses a longer idle bound, so it could not end a cut-off holder's session.
        return Err(SqlError::Config(format!(
            "a lease of {ms} ms is longer than idle_session_timeout can be ({} ms, about 24.8 days), which \
             bounds how long a held session lives without a probe; use a shorter lease (the watchdog renews \
             it) or ?mode=lease",
            i32::MAX
        )));
    }
    Ok(ms)
}

/// Reads the answer of [`bound_sql`] (plus what followed it): refuses another pid than `expected`,
/// returns the first column of the next row.
fn check_pid(messages: &[SimpleQueryMessage], expected: i32) -> Result<Option<String>, SqlError> {
    let mut rows = messages.iter().filter_map(|m| match m {
        SimpleQueryMessage::Row(row) => Some(row.get(0).map(str::to_string)),
        _ => None,
    });
    let pid = rows.next().flatten().and_then(|p| p.parse::<i32>().ok());
    same_session(pid, expected)?;
    Ok(rows.next().flatten())
}

/// Refuses a probe's `pg_backend_pid()` other than `expected` (or none).
pub(super) fn same_session(pid: Option<i32>, expected: i32) -> Result<(), SqlError> {
    match pid {
        Some(pid) if pid == expected => Ok(()),
        Some(pid) => Err(SqlError::SessionChanged(format!(
            "pg_backend_pid() changed from {expected} to {pid} on one connection: a transaction pooler \
             (PgBouncer in transaction mode) sits between distlock and PostgreSQL, so session locks are not \
             held; connect directly or use ?mode=lease"
        ))),
        None => Err(SqlError::Protocol("the probe returned no pg_backend_pid()".into())),
    }
}

/// Sets the session's idle bound to `ttl` and reads `pg_backend_pid()`, refusing another pid than
/// `expected`; then runs `then` (a statement without parameters) in the same round trip and returns
/// the first column of its first row.
pub(super) async fn probe(
    conn: &Conn,
    ttl: Duration,
    bound: Duration,
    expected: i32,
    then: Option<&str>,
) -> Result<Option<String>, SqlError> {
    let ms = bound_ms(ttl)?;
    // Unknown until the answer says it was set (a failure may leave either value).
    conn.set_idle_bound(None);
    if then.is_none() {
        // Alone, it is the prepared statement (the try pipelined behind it is one of its own).
        let params = Params::default().text(ms.to_string());
        let row = Conn::bounded(
            "probing the session",
            bound,
            conn.query_one_cached(layout::PROBE, &params.refs()),
        )
        .await?;
        let pid = row
            .try_get(0)
            .map_err(|e| SqlError::Protocol(format!("the probe returned {e}")))?;
        same_session(pid, expected)?;
        conn.set_idle_bound(Some(ms));
        return Ok(None);
    }
    // With statements after it the bound may be rolled back with them (a transaction they open and
    // end): it stays unknown.
    let mut sql = bound_sql(ttl)?;
    if let Some(then) = then {
        sql = format!("{sql}; {then}");
    }
    let messages =
        Conn::bounded("probing the session", bound, conn.client.simple_query(&sql)).await?;
    check_pid(&messages, expected)
}

/// A try's probe, or nothing when the session already runs with the idle bound of `ttl`
/// ([`IdleBound`](super::conn::IdleBound)): the try itself is then the statement that restarts the
/// server's idle clock, sent after the core read its clock as the probe would be, so the server still
/// frees the lock no earlier than the validity deadline the grant reports.
pub(super) async fn probe_for_try(
    conn: &Conn,
    ttl: Duration,
    bound: Duration,
) -> Result<(), SqlError> {
    if conn.idle_bound().ms == Some(bound_ms(ttl)?) {
        return Ok(());
    }
    probe(conn, ttl, bound, conn.pid, None).await.map(drop)
}

/// The dedicated connection of this acquire, opened (with the holder settings and the idle bound) on
/// first use.
pub(super) async fn connection(
    inner: &Arc<Inner>,
    acquiring: &mut Acquiring,
) -> Result<(), SqlError> {
    if acquiring
        .conn
        .as_ref()
        .is_some_and(|c| c.closed_reason().is_some())
    {
        acquiring.conn = None;
        acquiring.stage = Stage::Idle;
    }
    if acquiring.conn.is_none() {
        if std::mem::take(&mut acquiring.fresh) {
            acquiring.conn = Some(inner.open_dedicated().await?);
            acquiring.from_pool = false;
        } else {
            let (conn, reused) = inner.dedicated().await?;
            acquiring.conn = Some(conn);
            acquiring.from_pool = reused;
        }
    }
    Ok(())
}

/// After a try failed with `error`: whether it failed because its connection, taken from the idle
/// pool for it, had ended while it waited there (the server ended it, or a reset the driver had not
/// read yet), in which case it is dropped and the try may run again on a new one. Such a connection
/// has no live session, or one that ends when the server reads the close or, at the latest, when its
/// idle bound (a lease) runs out; whatever its try took stays with that session until then. A mutex or
/// write lock is then busy for the retry (never held twice); a read lock or a permit may be held a
/// second time by the retry meanwhile, so one acquire can occupy two of a semaphore's permits for up
/// to a lease (the limit is the server's and still holds; the orphan's token is never used).
pub(super) async fn pooled_connection_ended(acquiring: &mut Acquiring, error: &SqlError) -> bool {
    if !std::mem::take(&mut acquiring.from_pool)
        || acquiring.stage != Stage::Idle
        || !matches!(error, SqlError::Unavailable { .. })
    {
        return false;
    }
    let Some(conn) = acquiring.conn.as_ref() else {
        return false;
    };
    // The driver task may read the close just after the statement failed.
    let ended = tokio::time::timeout(Duration::from_millis(200), conn.closed())
        .await
        .is_ok();
    if ended {
        tracing::debug!(%error, "a pooled connection had ended; trying again on a new one");
        acquiring.conn = None;
        acquiring.clean = false;
        // Not another pooled one: whatever ended this one may have ended them too.
        acquiring.fresh = true;
    }
    ended
}

pub(super) fn conn_of(acquiring: &Acquiring) -> Result<&Conn, SqlError> {
    acquiring
        .conn
        .as_ref()
        .ok_or_else(|| SqlError::Protocol("internal error: no connection".into()))
}

pub(crate) async fn try_acquire(
    inner: &Arc<Inner>,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
) -> Result<Attempt<PgLease>, SqlError> {
    let shared = match request.kind {
        LockKind::Read => true,
        LockKind::Permit { .. } => {
            // Advisory permits are `semaphore.rs`'s; row mode has none (not announced).
            return Err(SqlError::Unsupported(format!(
                "PostgreSQL's {} mode has no semaphore; use ?mode=advisory",
                inner.config.mode
            )));
        }
        _ => false,
    };
    // A lease the idle bound cannot express is refused before anything is sent: the probe would
    // refuse it, but only after the try pipelined behind it went out and maybe took the lock.
    check_lease(request.lease)?;
    let key = (inner.config.mode == Mode::Advisory)
        .then(|| layout::key_for(&request.name, inner.config.key));
    let bound = inner.request_timeout();
    if acquiring.stage == Stage::Waiting {
        // A wait whose answer never came back here: do not reuse its connection.
        discard(inner, acquiring).await;
    }
    acquiring.clean = false;
    connection(inner, acquiring).await?;
    let stage = acquiring.stage;
    let minted = acquiring.minted.take();
    let conn = conn_of(acquiring)?;
    let lease = request.lease;
    let name = request.name.as_str();
    // Every branch sends its statements pipelined (tokio-postgres writes the requests of futures
    // polled together back to back), so each is one round trip. The probe comes after the core read
    // its clock, so the server's idle clock restarts after the guard's validity window began.
    let token = match (stage, key) {
        (Stage::Locked, _) if shared => {
            // The wait got the lock shared: the probe, the last write's token and (advisory) the
            // kind check, read now that the lock is granted.
            let (probed, read) = futures_util::future::join(
                probe_for_try(conn, lease, bound),
                read_token_and_limit(inner, conn, name, key.is_some()),
            )
            .await;
            probed?;
            let (token, limit) = read?;
            refuse_semaphore(inner, name, limit)?;
            token
        }
        (Stage::Locked, Some(_)) if minted.is_some() => {
            // The advisory wait got the lock and minted its token in the same statement: the probe.
            probe_for_try(conn, lease, bound).await?;
            minted.ok_or_else(|| SqlError::Protocol("internal error: no minted token".into()))?
        }
        (Stage::Locked, _) => {
            // The wait got the lock: the probe and the counter bump.
            let (probed, token) = futures_util::future::join(
                probe_for_try(conn, lease, bound),
                next_token(inner, conn, key.is_some(), name),
            )
            .await;
            probed?;
            token?
        }
        (_, Some(key)) if shared => {
            // The probe, the try, then (pipelined, so read after the lock is granted) the last
            // write's token and the kind check, wasted when the lock is busy: one round trip.
            let sql = layout::try_lock_shared(key);
            let params = Params::default().key(key);
            let (probed, locked, read) = futures_util::future::join3(
                probe_for_try(conn, lease, bound),
                Conn::bounded(
                    "pg_try_advisory_lock_shared",
                    bound,
                    conn.query_one_cached(&sql, &params.refs()),
                ),
                read_token_and_limit(inner, conn, name, true),
            )
            .await;
            probed?;
            let got: bool = locked?.try_get(0).map_err(|e| {
                SqlError::Protocol(format!("pg_try_advisory_lock_shared returned {e}"))
            })?;
            if !got {
                // A read that failed (a timeout may have left a prepared statement the client never
                // learned of) keeps the connection out of the idle pool.
                acquiring.clean = read.is_ok();
                return Ok(Attempt::Busy { retry_after: None });
            }
            // Held shared from here: a refusal leaves it to the abandon, which unlocks it.
            let (token, limit) = read?;
            refuse_semaphore(inner, name, limit)?;
            token
        }
        (_, Some(key)) => {
            let sql = inner.tables.try_lock_and_next_token(key);
            let params = Params::default().text(name).key(key);
            let (probed, locked) = futures_util::future::join(
                probe_for_try(conn, lease, bound),
                Conn::bounded(
                    "pg_try_advisory_lock",
                    bound,
                    conn.query_one_cached(&sql, &params.refs()),
                ),
            )
            .await;
            // On an error the connection may hold the lock: the core abandons the acquire, which
            // closes it (`clean` stays false).
            probed?;
            let row = locked?;
            let got: bool = row
                .try_get(0)
                .map_err(|e| SqlError::Protocol(format!("pg_try_advisory_lock returned {e}")))?;
            if !got {
                acquiring.clean = true;
                return Ok(Attempt::Busy { retry_after: None });
            }
            let token: Option<i64> = row
                .try_get(1)
                .map_err(|e| SqlError::Protocol(format!("the fencing counter returned {e}")))?;
            token_of(token, name)?
        }
        (_, None) => {
            if !try_row(inner, conn, name, lease, bound, shared).await? {
                acquiring.clean = true;
                return Ok(Attempt::Busy { retry_after: None });
            }
            if shared {
                read_token(inner, conn, name).await?
            } else {
                next_token(inner, conn, false, name).await?
            }
        }
    };
    let loss = conn.loss_signal();
    let Some(conn) = acquiring.conn.take() else {
        return Err(SqlError::Protocol("internal error: no connection".into()));
    };
    acquiring.stage = Stage::Idle;
    let hold = match key {
        Some(key) => Hold::Advisory { key, shared },
        None => Hold::Row,
    };
    let held = Held::new(conn, hold);
    Ok(Attempt::Acquired(
        Grant::new(PgLease(LeaseKind::Session(Box::new(held))))
            .with_token(token)
            .with_ttl(request.lease)
            .with_loss(loss),
    ))
}

/// Row mode: the row exists (autocommit), then `BEGIN` and `FOR UPDATE NOWAIT` (`FOR SHARE NOWAIT`
/// when `shared`); busy rolls back. The three statements are pipelined: one round trip.
async fn try_row(
    inner: &Inner,
    conn: &Conn,
    name: &str,
    lease: Duration,
    bound: Duration,
    shared: bool,
) -> Result<bool, SqlError> {
    let ensure = inner.tables.ensure_row();
    let lock = inner.tables.lock_row(true, shared);
    let client = &conn.client;
    let (ensured, probed, locked) = tokio::time::timeout(
        bound,
        futures_util::future::join3(
            client.execute_typed(&ensure, &[(&name, Type::TEXT)]),
            probe(conn, lease, bound, conn.pid, Some("BEGIN")),
            client.query_typed(&lock, &[(&name, Type::TEXT)]),
        ),
    )
    .await
    .map_err(|_| SqlError::Timeout {
        action: "SELECT … FOR UPDATE NOWAIT",
        after: bound,
    })?;
    ensured.map_err(|e| map_error("creating the lock row", e))?;
    probed?;
    match locked {
        Ok(rows) if rows.len() == 1 => Ok(true),
        Ok(_) => Err(SqlError::Protocol(format!(
            "the lock row of {name:?} vanished"
        ))),
        Err(e) if is_lock_not_available(&e) => {
            Conn::bounded("ROLLBACK", bound, conn.client.batch_execute("ROLLBACK")).await?;
            Ok(false)
        }
        Err(e) => Err(map_error("SELECT … FOR UPDATE NOWAIT", e)),
    }
}

/// Bumps the fencing counter, committed before the grant is reported: on the lock's own connection in
/// advisory mode (autocommit), on the control connection in row mode (committing the lock's
/// transaction would release it).
async fn next_token(
    inner: &Inner,
    conn: &Conn,
    advisory: bool,
    name: &str,
) -> Result<FencingToken, SqlError> {
    let sql = inner.tables.next_token();
    let bound = inner.request_timeout();
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&name, Type::TEXT)];
    let row = if advisory {
        Conn::bounded(
            "minting the fencing token",
            bound,
            conn.client.query_typed_one(&sql, &params),
        )
        .await?
    } else {
        let control = inner.control().await?;
        let row = Conn::bounded(
            "minting the fencing token",
            bound,
            control.client.query_typed_one(&sql, &params),
        )
        .await;
        inner.forget_stalled_control(&control, row).await?
    };
    let token: i64 = row
        .try_get(0)
        .map_err(|e| SqlError::Protocol(format!("the fencing counter returned {e}")))?;
    token_of(Some(token), name)
}

/// A reader's token: the counter as the last write grant left it (0 if the name was never written),
/// read on the lock's own connection after its lock was granted (in row mode inside the held
/// transaction, whose statements each see what was committed before them).
async fn read_token(inner: &Inner, conn: &Conn, name: &str) -> Result<FencingToken, SqlError> {
    let sql = inner.tables.last_token();
    let rows = Conn::bounded(
        "reading the fencing counter",
        inner.request_timeout(),
        conn.client.query_typed(&sql, &[(&name, Type::TEXT)]),
    )
    .await?;
    let token = match rows.first() {
        Some(row) => row
            .try_get::<_, i64>(0)
            .map_err(|e| SqlError::Protocol(format!("the fencing counter returned {e}")))?,
        None => 0,
    };
    reader_token(token, name)
}

/// The counter as a reader's token (0: the name was never written).
fn reader_token(token: i64, name: &str) -> Result<FencingToken, SqlError> {
    u64::try_from(token)
        .map(FencingToken::new)
        .map_err(|_| SqlError::Protocol(format!("the fencing counter of {name:?} is {token}")))
}

/// A reader's token ([`read_token`]) and, where `check` (advisory mode), the semaphore limit stored
/// for `name` ([`stored_limit`]), in one statement. Without a limit table (a role that could not
/// create it: no name is a semaphore then) the token alone, in a statement of its own.
async fn read_token_and_limit(
    inner: &Inner,
    conn: &Conn,
    name: &str,
    check: bool,
) -> Result<(FencingToken, Option<i32>), SqlError> {
    if !check {
        return Ok((read_token(inner, conn, name).await?, None));
    }
    let sql = inner.tables.last_token_and_limit();
    let read = Conn::bounded(
        "reading the fencing counter and the semaphore limit",
        inner.request_timeout(),
        conn.query_one_cached(&sql, &[(&name, Type::TEXT)]),
    )
    .await;
    let row = match read {
        Err(SqlError::TableShape(_)) => return Ok((read_token(inner, conn, name).await?, None)),
        row => row?,
    };
    let protocol = |e| SqlError::Protocol(format!("the fencing counter returned {e}"));
    let token: Option<i64> = row.try_get(0).map_err(protocol)?;
    let limit: Option<i32> = row.try_get(1).map_err(protocol)?;
    Ok((reader_token(token.unwrap_or(0), name)?, limit))
}

/// The semaphore limit stored for `name`, read on `conn` (advisory mode only: `check`); `None` when
/// there is none, or no limit table (a role that could not create it: then no semaphore exists, since
/// storing a limit needs the table).
pub(super) async fn stored_limit(
    inner: &Inner,
    conn: &Conn,
    name: &str,
    check: bool,
) -> Result<Option<i32>, SqlError> {
    if !check {
        return Ok(None);
    }
    let sql = inner.tables.stored_limit();
    let rows = tokio::time::timeout(
        inner.request_timeout(),
        conn.client.query_typed(&sql, &[(&name, Type::TEXT)]),
    )
    .await
    .map_err(|_| SqlError::Timeout {
        action: "reading the semaphore limit",
        after: inner.request_timeout(),
    })?;
    let rows = match rows {
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => return Ok(None),
        rows => rows.map_err(|e| map_error("reading the semaphore limit", e))?,
    };
    rows.first()
        .map(|row| row.try_get::<_, i32>(0))
        .transpose()
        .map_err(|e| SqlError::Protocol(format!("the semaphore limit is {e}")))
}

/// A read lock on a name that is a semaphore (it has a stored limit) is refused: its permits hold the
/// name's key shared too, so a reader would share the name with them.
fn refuse_semaphore(inner: &Inner, name: &str, limit: Option<i32>) -> Result<(), SqlError> {
    match limit {
        None => Ok(()),
        Some(limit) => Err(SqlError::KindConflict(format!(
            "{name:?} is a semaphore of {limit} permits (its limit is stored in {}); it cannot be taken as a \
             read lock, and a mutex or write lock on it waits for its permits",
            inner.tables.limit
        ))),
    }
}

/// A counter value as a token: positive, or the counter is not distlock's.
fn token_of(token: Option<i64>, name: &str) -> Result<FencingToken, SqlError> {
    token
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .map(FencingToken::new)
        .ok_or_else(|| SqlError::Protocol(format!("the fencing counter of {name:?} is {token:?}")))
}

/// How long one wait in the server lasts before the server ends it (`lock_timeout`) and the acquire
/// tries again: a wait that gets no answer within this plus the request bound is on a connection that
/// died silently (no FIN or RST reached the client), and is given up for a new one.
pub(crate) const WAIT_SLICE: Duration = Duration::from_secs(5);

/// Waits in the server, for one [`WAIT_SLICE`] at most, until the lock is this session's
/// (`pg_advisory_lock`, or `FOR UPDATE` in a transaction). `Ok` when the wait got the lock (the next
/// try mints the token), when the slice ended on the server (the next try goes on), or when no answer
/// came within the slice plus the request bound (the connection is presumed dead: the next try
/// discards it, undoing whatever the wait may have taken, and opens a new one). If this future is
/// dropped, `abandon` cancels the statement and closes the connection.
pub(crate) async fn wait(
    inner: &Arc<Inner>,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
) -> Result<(), SqlError> {
    // Refused before anything is sent, as a try does.
    check_lease(request.lease)?;
    let bound = inner.request_timeout();
    let advisory = inner.config.mode == Mode::Advisory;
    let shared = request.kind == LockKind::Read;
    let key = layout::key_for(&request.name, inner.config.key);
    let slice_ms = ttl_ms(WAIT_SLICE);
    let silent_after = WAIT_SLICE + bound;
    connection(inner, acquiring).await?;
    // Only a try runs again on a new connection (`pooled_connection_ended`).
    acquiring.from_pool = false;
    // From here on the session may be in a transaction or hold the lock: never handed back as clean.
    acquiring.clean = false;
    let name = request.name.as_str();
    if advisory {
        // The probe first (unless the session already runs with the lease's bound), answered before
        // the wait is sent: a statement and a transaction of its own, so the bound is in force before
        // the wait can take the lock and stays whatever the wait's message does (a cancel landing after
        // the grant rolls that message back, not the bound, so a client cut off then still has its
        // session ended by the server); a probe that fails sends no wait. The message is one implicit
        // transaction: a wait ended by lock_timeout rolls the slice's setting back; a granted one sets
        // it back to 0. Its lock statement also reads `pg_backend_pid()`, checked before any grant.
        // An exclusive wait mints its token in the statement that gets the lock, as a try does: no
        // later statement of the acquire is needed to tell this hold from the session's last one.
        let lock = if shared {
            layout::advisory_wait(key, "pg_advisory_lock_shared")
        } else {
            layout::advisory_wait_minting(key, &inner.tables.fence, name)
        };
        let sql = format!(
            "{}; {lock}; {}",
            layout::wait_slice(slice_ms, false),
            layout::wait_slice(0, false)
        );
        acquiring.minted = None;
        probe_for_try(conn_of(acquiring)?, request.lease, bound).await?;
        acquiring.stage = Stage::Waiting;
        let conn = conn_of(acquiring)?;
        let pid = conn.pid;
        let waited = tokio::time::timeout(silent_after, conn.client.simple_query(&sql)).await;
        match waited {
            Err(_) => {
                silent_wait(silent_after);
                return Ok(());
            }
            Ok(Err(e)) if is_lock_not_available(&e) => {
                // The slice ended on the server: nothing was taken (the message's implicit
                // transaction rolled back, its settings too).
                acquiring.stage = Stage::Idle;
                acquiring.clean = true;
                return Ok(());
            }
            Ok(waited) => {
                let messages = waited.map_err(|e| map_error("waiting for the lock", e))?;
                acquiring.stage = Stage::Locked;
                // A changed pid is refused before any grant: the lock it got goes with the
                // connection, which the abandon closes.
                let granted = messages.iter().find_map(|m| match m {
                    SimpleQueryMessage::Row(row) => Some((row.get(0), row.get(1))),
                    _ => None,
                });
                let granted_on = granted.and_then(|(_, p)| p.and_then(|p| p.parse::<i32>().ok()));
                same_session(granted_on, pid)?;
                if !shared {
                    let token = granted
                        .and_then(|(t, _)| t)
                        .and_then(|t| t.parse::<i64>().ok());
                    acquiring.minted = Some(token_of(token, name)?);
                }
            }
        }
        return Ok(());
    }
    {
        let conn = conn_of(acquiring)?;
        let then = format!("BEGIN; {}", layout::wait_slice(slice_ms, true));
        probe(conn, request.lease, bound, conn.pid, Some(&then)).await?;
    }
    let sql = inner.tables.lock_row(false, shared);
    acquiring.stage = Stage::Waiting;
    let client = &conn_of(acquiring)?.client;
    match tokio::time::timeout(
        silent_after,
        client.query_typed(&sql, &[(&name, Type::TEXT)]),
    )
    .await
    {
        Err(_) => {
            silent_wait(silent_after);
            Ok(())
        }
        Ok(Ok(_)) => {
            acquiring.stage = Stage::Locked;
            Ok(())
        }
        Ok(Err(e)) if is_lock_not_available(&e) => {
            // The slice ended on the server: end its (aborted) transaction, which took nothing.
            Conn::bounded("ROLLBACK", bound, client.batch_execute("ROLLBACK")).await?;
            acquiring.stage = Stage::Idle;
            acquiring.clean = true;
            Ok(())
        }
        Ok(Err(e)) => Err(map_error("waiting for the lock", e)),
    }
}

/// A wait got no answer within `after`: logged; the stage stays `Waiting`, so the next try discards
/// the connection.
fn silent_wait(after: Duration) {
    tracing::warn!(
        ?after,
        "a wait in the server got no answer within its slice plus the request bound; the connection is \
         presumed dead, the wait goes on over a new one"
    );
}

/// Ends what the acquire's connection is doing and holds, then closes it. A wait in flight gets a
/// cancel request; but PostgreSQL acts on it asynchronously (the request is only written when the
/// driver returns), so the wait may still win in the meantime, and a session advisory lock outlives the
/// statement or transaction that took it (even a statement cancelled after the lock was granted). So
/// an undo is queued behind it on the same connection (`pg_advisory_unlock_all()` for this session's
/// pid, or `ROLLBACK`), and its answer is awaited: once it comes, the session holds nothing, whatever
/// the wait did. A cancel that lands late may cut the undo instead: it is sent again. Only if the undo
/// gets no answer within the bound does freeing the lock fall to the server noticing the close.
async fn discard(inner: &Inner, acquiring: &mut Acquiring) {
    let stage = std::mem::take(&mut acquiring.stage);
    let clean = std::mem::take(&mut acquiring.clean);
    acquiring.minted = None;
    let Some(conn) = acquiring.conn.take() else {
        return;
    };
    if stage == Stage::Waiting {
        conn.cancel(CANCEL_BOUND).await;
    }
    if (stage == Stage::Idle && clean) || conn.closed_reason().is_some() {
        return;
    }
    let undo = match inner.config.mode {
        Mode::Advisory => layout::unlock_all_of(conn.pid),
        _ => "ROLLBACK".to_string(),
    };
    let deadline = tokio::time::Instant::now() + inner.request_timeout().max(CANCEL_BOUND);
    loop {
        match tokio::time::timeout_at(deadline, conn.client.simple_query(&undo)).await {
            Ok(Ok(_)) => break,
            Ok(Err(e)) if e.code() == Some(&SqlState::QUERY_CANCELED) => continue,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "undoing an abandoned acquire failed; closing its connection");
                break;
            }
            Err(_) => {
                tracing::warn!(
                    "undoing an abandoned acquire got no answer; closing its connection (the server frees \
                     what it holds once it notices)"
                );
                break;
            }
        }
    }
    drop(conn);
}

pub(crate) async fn abandon(inner: &Inner, mut acquiring: Acquiring) {
    park(inner, &mut acquiring).await;
    discard(inner, &mut acquiring).await;
}

/// Hands the acquire's connection back to the idle pool if a busy try left nothing on its session
/// (its idle bound reset first); otherwise leaves it where it is.
pub(super) async fn park(inner: &Inner, acquiring: &mut Acquiring) {
    if !(acquiring.clean && acquiring.stage == Stage::Idle) {
        return;
    }
    if let Some(conn) = acquiring.conn.take() {
        acquiring.clean = false;
        recycle(inner, conn).await;
    }
}

/// Hands a connection whose session holds nothing to the idle pool: with its idle bound when known
/// (the pool resets it before it runs out), else after a reset (closed if that fails).
async fn recycle(inner: &Inner, conn: Conn) {
    if conn.idle_bound().ms.is_none() && reset_bound(inner, &conn).await.is_err() {
        return;
    }
    inner.recycle(conn);
}

/// Sets the session's idle bound back to off and records it.
pub(crate) async fn reset_bound(inner: &Inner, conn: &Conn) -> Result<(), SqlError> {
    conn.set_idle_bound(None);
    let reset_sql = layout::reset_bound();
    let reset = conn.client.batch_execute(&reset_sql);
    Conn::bounded("resetting the session", inner.request_timeout(), reset).await?;
    conn.set_idle_bound(Some(0));
    Ok(())
}

/// One probe per held connection, all at once.
pub(crate) async fn renew(
    inner: &Inner,
    batch: &[(&Renewal<'_, PgLease>, &Held)],
) -> Vec<(RenewalId, Result<Renewed, SqlError>)> {
    let bound = inner.request_timeout();
    join_all(batch.iter().map(|(entry, held)| async move {
        let slot = held.conn.lock().await;
        let outcome = match slot.as_ref() {
            None => Ok(Renewed::Gone {
                reason: "released".into(),
            }),
            Some(conn) => match conn.closed_reason() {
                Some(reason) => Ok(Renewed::Gone { reason }),
                None => match probe(conn, entry.ttl, bound.min(entry.ttl), held.pid, None).await {
                    Ok(_) => Ok(Renewed::Extended { ttl: entry.ttl }),
                    Err(SqlError::SessionChanged(reason)) => Ok(Renewed::Gone { reason }),
                    Err(e) => match conn.closed_reason() {
                        Some(reason) => Ok(Renewed::Gone { reason }),
                        None => Err(e),
                    },
                },
            },
        };
        (entry.id, outcome)
    }))
    .await
}

/// Unlocks (advisory) or rolls back (row); hands the connection back when that is confirmed, closes it
/// otherwise. A second call finds no connection and answers `NotHeld`.
///
/// A release whose answer is lost (the link reset, or no answer within the bound) has an unknown
/// outcome: the unlock may have been applied before the connection broke, and closing the connection
/// frees whatever the session still holds once the server notices (at the latest when its
/// `idle_session_timeout`, the lease, runs out). So it is `Unavailable`, never `NotHeld`. `NotHeld` only
/// when the session was over before the release: the close was seen before it was sent, or the server
/// said it ended the session (a FATAL error: its idle limit ran out, `pg_terminate_backend`).
pub(crate) async fn release(inner: &Inner, held: &Held, name: &str) -> Result<Released, SqlError> {
    let Some(conn) = held.conn.lock().await.take() else {
        return Ok(Released::NotHeld);
    };
    // The hold ends with this release, whatever it answers: the connection's end is no loss of it.
    conn.clear_loss();
    if conn.closed_reason().is_some() {
        return Ok(Released::NotHeld);
    }
    let bound = inner.request_timeout();
    let outcome = match held.hold {
        Hold::Permit { key, slot } => release_permit(inner, &conn, key, slot, name).await,
        hold => {
            match hold {
                Hold::Advisory { key, shared } => {
                    let sql = layout::advisory_release(
                        key,
                        if shared {
                            "pg_advisory_unlock_shared"
                        } else {
                            "pg_advisory_unlock"
                        },
                    );
                    let params = Params::default().key(key);
                    Conn::bounded(
                        "releasing",
                        bound,
                        conn.query_one_cached(&sql, &params.refs()),
                    )
                    .await
                    .and_then(|row| {
                        row.try_get::<_, bool>(0)
                            .map_err(|e| SqlError::Protocol(format!("the unlock returned {e}")))
                    })
                }
                _ => {
                    let sql = format!("ROLLBACK; {}", layout::reset_bound());
                    // The ROLLBACK ended the transaction and its row lock.
                    let rolled_back =
                        Conn::bounded("releasing", bound, conn.client.batch_execute(&sql)).await;
                    if rolled_back.is_ok() {
                        conn.set_idle_bound(Some(0));
                    }
                    rolled_back.map(|()| true)
                }
            }
        }
    };
    match outcome {
        Ok(true) => {
            // The session holds nothing now: the next lock may use it.
            recycle(inner, conn).await;
            Ok(Released::Released)
        }
        Ok(false) => {
            drop(conn);
            Ok(Released::NotHeld)
        }
        Err(e) => {
            // The driver's connection task may learn of a server's FATAL just after the query fails.
            let closed = tokio::time::timeout(std::time::Duration::from_millis(200), conn.closed())
                .await
                .is_ok();
            let ended_by_server = is_fatal(&e) || (closed && conn.ended_by_server());
            // Closing the connection frees whatever the session still holds.
            drop(conn);
            if ended_by_server {
                return Ok(Released::NotHeld);
            }
            let said = match &e {
                SqlError::Unavailable {
                    action, message, ..
                } => format!("{action}: {message}"),
                SqlError::Timeout { action, after } => {
                    format!("{action}: no answer within {after:?}")
                }
                other => format!("{other:?}"),
            };
            let source = match e {
                SqlError::Unavailable { source, .. } => source,
                _ => None,
            };
            Err(SqlError::Unavailable {
                action: "releasing",
                message: format!(
                    "the release got no answer ({said}); outcome unknown: the unlock may have been applied \
                     before the connection broke, and the connection is closed, which frees the lock once \
                     the server notices (at the latest when the lease runs out)"
                ),
                source,
            })
        }
    }
}

/// A permit's release: both keys and the wake-up in one statement (the idle bound stays, as a lock's
/// release leaves it). Whether the slot was this session's.
async fn release_permit(
    inner: &Inner,
    conn: &Conn,
    key: AdvisoryKey,
    slot: AdvisoryKey,
    name: &str,
) -> Result<bool, SqlError> {
    let sql = inner.tables.release_permit(key);
    let (a, b) = layout::pair(slot);
    let params = Params::default()
        .text(name)
        .key(AdvisoryKey::Pair(a, b))
        .key(key);
    let row = Conn::bounded(
        "releasing",
        inner.request_timeout(),
        conn.query_one_cached(&sql, &params.refs()),
    )
    .await?;
    let protocol = |e| SqlError::Protocol(format!("the permit's release returned {e}"));
    let slot_unlocked: bool = row.try_get(0).map_err(protocol)?;
    let key_unlocked: bool = row.try_get(1).map_err(protocol)?;
    Ok(slot_unlocked && key_unlocked)
}

/// Turns a write hold into a read hold on the same session: `pg_advisory_lock_shared` then
/// `pg_advisory_unlock` of the key, in one simple query (with the probe that restarts the session's
/// idle clock, as a grant's try does). The connection leaves the write hold whatever happens; on an
/// error it is closed, which frees everything the session held (the core reports the write guard
/// `Lost`).
pub(crate) async fn downgrade(
    inner: &Inner,
    held: &Held,
    read: &AcquireRequest,
) -> Result<Grant<PgLease>, SqlError> {
    let Hold::Advisory { key, shared: false } = held.hold else {
        return Err(SqlError::Unsupported(
            "only an advisory write lock can be downgraded in one step".into(),
        ));
    };
    let Some(conn) = held.conn.lock().await.take() else {
        return Err(SqlError::Unavailable {
            action: "downgrading",
            message: "the write lock was released".into(),
            source: None,
        });
    };
    if let Some(reason) = conn.closed_reason() {
        return Err(SqlError::Unavailable {
            action: "downgrading",
            message: format!("the write lock's session has ended: {reason}"),
            source: None,
        });
    }
    let sql = format!(
        "{}; {}",
        bound_sql(read.lease)?,
        layout::downgrade(key, ttl_ms(WAIT_SLICE))
    );
    conn.set_idle_bound(None);
    let bound = inner.request_timeout();
    let messages = Conn::bounded(
        "downgrading",
        WAIT_SLICE + bound,
        conn.client.simple_query(&sql),
    )
    .await?;
    check_pid(&messages, held.pid)?;
    let unlocked = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0),
            _ => None,
        })
        .last();
    if unlocked != Some("t") {
        return Err(SqlError::Protocol(format!(
            "the downgrade's pg_advisory_unlock returned {unlocked:?}: the session did not hold the key \
             exclusive"
        )));
    }
    let loss = conn.loss_signal();
    let held = Held::new(conn, Hold::Advisory { key, shared: true });
    Ok(Grant::new(PgLease(LeaseKind::Session(Box::new(held))))
        .with_ttl(read.lease)
        .with_loss(loss))
}
