//! `distlock break` on PostgreSQL ([`Backend::break_holder`](distlock_core::raw::Backend::break_holder)):
//! ends the exclusive hold `inspect` showed, only if that same hold still holds the name, checked in
//! the statement that ends it. `inspect` shows each hold's identity in `hold_id` ([`layout::HoldId`]):
//!
//! * **row**: the hold is a transaction (the one in the row's `xmax`) on the holder's session, so the
//!   session is ended: `pg_terminate_backend(pid, timeout)` in one statement that first finds `pid`'s
//!   transaction locking the name's row exclusive, and that transaction is the one shown
//!   (`layout::Tables::break_row`). Every hold is a transaction of its own: a later hold of the same
//!   session (a pooled connection the same process took again) has another transaction id, and is
//!   never touched, whether or not its grant has bumped the counter yet.
//! * **advisory**: the session holding the name's key exclusive is ended the same way
//!   (`layout::Tables::break_advisory`) if it is still the session shown (pid, and its start where the
//!   role can read it) and the hold is the one shown: for one of distlock's sessions, the name's
//!   counter is the token shown, read `FOR SHARE SKIP LOCKED` (a grant takes the lock and bumps the
//!   counter in one statement, so a later hold of the same session either has committed a new token,
//!   or is bumping it and the read skips the row, or will bump it only after the terminate: it never
//!   is granted and then broken); for a session that is not distlock's (it mints no token), the
//!   session is still idle since `inspect` saw it so (a later hold would have run statements).
//!   A holder that is not distlock's shown without that (busy, or its activity unreadable) is refused
//!   (`Unsupported`).
//! * **lease**: the lease row is expired (`expires_at = '-infinity'`, which no renewal in flight can
//!   pass) where owner and version are the ones shown, and the waiters are woken (`NOTIFY`); the
//!   holder learns at its next renewal (within a third of its lease).
//!
//! In both session modes the statement reads `pg_locks` (or the row's locker) and then signals the
//! backend, microseconds later: not one atomic step. A hold that came since on that same session in
//! those microseconds would need the old one released and a new one taken by the client (two round
//! trips), and a new advisory grant could not commit its token before the signal.
//!
//! The server frees the session's locks as it ends: waiters in the server get the lock at once, and
//! the holder's driver reports the closed connection as the guard's loss at once. Ending a session
//! ends everything on it: a holder that is not distlock's loses its other locks and its open
//! transaction too.
//!
//! Only an exclusive holder (a mutex, a writer) is broken: a holder given that is itself shared (a
//! permit holder, a reader) is `Unsupported`; a break aimed at a writer that has gone while readers
//! or permits hold the name now is `Ok(false)`. Ending another role's session needs that role's
//! privileges or membership in `pg_signal_backend` (a superuser's, a superuser): otherwise
//! `PermissionDenied`.

use std::time::{Duration, SystemTime};

use distlock_core::raw::HolderInfo;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::backend::Inner;
use super::conn::{map_error, Conn};
use super::inspect;
use super::layout::{self, HoldId};
use crate::config::Mode;
use crate::error::SqlError;

/// The longest a break waits for the broken backend to exit (it waits at most half the request
/// bound, so its answer comes within the bound).
const MAX_EXIT_WAIT: Duration = Duration::from_secs(5);

pub(crate) async fn break_holder(
    inner: &Inner,
    name: &str,
    holder: &HolderInfo,
) -> Result<bool, SqlError> {
    if let Some(permit) = &holder.permit {
        return Err(exclusive_only(format!(
            "the holder given holds permit {permit} of a semaphore"
        )));
    }
    let hold = match holder.hold_id.as_deref() {
        None => None,
        Some(text) => Some(HoldId::parse(text).ok_or_else(|| {
            SqlError::Config(format!(
                "the holder to break has a hold id {text:?} that is not PostgreSQL's: pass the \
                 holder inspect showed"
            ))
        })?),
    };
    if hold.is_some_and(|h| h.shared()) {
        return Err(exclusive_only(format!(
            "the holder given holds {name:?} shared (a reader or a permit holder)"
        )));
    }
    let token = match holder.token {
        Some(token) => Some(i64::try_from(token.get()).map_err(|_| {
            SqlError::Config(format!(
                "the holder's token {token} is not a PostgreSQL bigint"
            ))
        })?),
        None => None,
    };
    match (inner.config.mode, hold) {
        (Mode::Lease, _) => break_lease(inner, name, holder, token).await,
        (Mode::Row, None | Some(HoldId::Row { .. })) => {
            let pid = backend_pid(holder)?;
            let xid = hold.and_then(|h| match h {
                HoldId::Row { xid, .. } => Some(xid),
                HoldId::Advisory { .. } => None,
            });
            break_row(inner, name, pid, xid, token).await
        }
        (Mode::Advisory, None) => {
            let pid = backend_pid(holder)?;
            break_advisory(inner, name, pid, None, token).await
        }
        (Mode::Advisory, Some(HoldId::Advisory { session, idle, .. })) => {
            let pid = backend_pid(holder)?;
            let shown = Shown {
                session: session.and_then(layout::time_of_micros),
                idle: idle.and_then(layout::time_of_micros),
            };
            break_advisory(inner, name, pid, Some(shown), token).await
        }
        (mode, Some(_)) => Err(SqlError::Config(format!(
            "the holder to break was shown by another mode than this backend's ({mode}): pass the \
             holder inspect showed"
        ))),
    }
}

/// The refusal of a break aimed at shared holders.
fn exclusive_only(what: String) -> SqlError {
    SqlError::Unsupported(format!(
        "{what}: break ends an exclusive holder (a mutex or a write lock) only, never readers or \
         permit holders"
    ))
}

/// The backend pid in a session holder's `owner`, as `inspect` shows it.
fn backend_pid(holder: &HolderInfo) -> Result<i32, SqlError> {
    holder
        .owner
        .as_deref()
        .and_then(|owner| owner.strip_prefix(layout::BACKEND_OWNER_PREFIX))
        .and_then(|pid| pid.trim().parse::<i32>().ok())
        .ok_or_else(|| {
            SqlError::Config(format!(
                "the holder to break names no PostgreSQL session (its owner is {:?}, not \
                 \"{}<pid>\"): pass the holder inspect showed",
                holder.owner,
                layout::BACKEND_OWNER_PREFIX
            ))
        })
}

/// Lease mode: expires the lease if that owner (at that version) still holds it.
async fn break_lease(
    inner: &Inner,
    name: &str,
    holder: &HolderInfo,
    token: Option<i64>,
) -> Result<bool, SqlError> {
    let Some(owner) = holder.owner.as_deref() else {
        return Err(SqlError::Config(
            "the holder to break has no owner id: pass the holder inspect showed".into(),
        ));
    };
    let conn = inner.control().await?;
    let sql = inner.tables.break_lease();
    let row = Conn::bounded(
        "breaking the lease",
        inner.request_timeout(),
        conn.client.query_typed_one(
            &sql,
            &[
                (&name, Type::TEXT),
                (&owner, Type::TEXT),
                (&token, Type::INT8),
            ],
        ),
    )
    .await;
    let row = inner.forget_stalled_control(&conn, row).await?;
    row.try_get::<_, bool>(0)
        .map_err(|e| SqlError::Protocol(format!("the lease break returned {e}")))
}

/// How long the break's statement waits for the terminated backend to exit, in ms.
fn exit_wait_ms(inner: &Inner) -> i64 {
    i64::try_from((inner.request_timeout() / 2).min(MAX_EXIT_WAIT).as_millis()).unwrap_or(0)
}

/// Runs a break statement on the control connection, bounded by the request bound; a refusal to
/// signal (or to read the row locks) is `Denied`, saying what is needed.
async fn run_break(
    inner: &Inner,
    conn: &std::sync::Arc<Conn>,
    sql: &str,
    params: &[(&(dyn ToSql + Sync), Type)],
    pid: i32,
) -> Result<tokio_postgres::Row, SqlError> {
    let bound = inner.request_timeout();
    let answered = tokio::time::timeout(bound, conn.client.query_typed_one(sql, params)).await;
    let row = match answered {
        Err(_) => Err(SqlError::Timeout {
            action: "ending the holder's session",
            after: bound,
        }),
        Ok(Err(e)) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            return Err(SqlError::Denied {
                message: format!(
                    "ending the holder's session (backend {pid}) was refused: {}; \
                     pg_terminate_backend needs the privileges of the holder's role or membership in \
                     pg_signal_backend (GRANT pg_signal_backend TO <role>), and only a superuser may \
                     end a superuser's session; the check also needs UPDATE on distlock's tables (for \
                     its FOR SHARE reads: the fence table in advisory mode, the lock table in row mode)",
                    e.as_db_error().map_or_else(|| e.to_string(), |db| db.message().to_string())
                ),
                source: Some(Box::new(e)),
            });
        }
        Ok(row) => row.map_err(|e| map_error("ending the holder's session", e)),
    };
    inner.forget_stalled_control(conn, row).await
}

/// Reads a break's first two columns (backends matched, whether they exited) and says whether the
/// holder was ended.
fn ended(row: &tokio_postgres::Row, name: &str, pid: i32, wait_ms: i64) -> Result<bool, SqlError> {
    let protocol = |e| SqlError::Protocol(format!("the break returned {e}"));
    let matched: i64 = row.try_get(0).map_err(protocol)?;
    let exited: Option<bool> = row.try_get(1).map_err(protocol)?;
    if matched > 0 && exited != Some(true) {
        // Signalled: it exits (and frees its locks) as soon as it handles the signal.
        tracing::warn!(
            lock = name,
            backend = pid,
            "the broken holder's backend was signalled but had not exited within {wait_ms} ms"
        );
    }
    Ok(matched > 0)
}

/// What an advisory hold id shows of the holder's session ([`HoldId::Advisory`]).
struct Shown {
    /// Its `backend_start`.
    session: Option<SystemTime>,
    /// For a holder that is not distlock's: its `state_change`, idle when shown.
    idle: Option<SystemTime>,
}

/// Advisory mode: terminates backend `pid` if it still holds the name exclusive, as the hold shown
/// (`shown`: `None` for a holder given without a hold id; see the module docs).
async fn break_advisory(
    inner: &Inner,
    name: &str,
    pid: i32,
    shown: Option<Shown>,
    token: Option<i64>,
) -> Result<bool, SqlError> {
    let session = shown.as_ref().and_then(|s| s.session);
    let idle = shown.as_ref().and_then(|s| s.idle);
    let conn = inner.control().await?;
    let wait_ms = exit_wait_ms(inner);
    let (classid, objid, objsubid) = layout::pg_locks_row(layout::key_for(name, inner.config.key));
    let key_row = (i64::from(classid), i64::from(objid), objsubid);
    let sql = inner.tables.break_advisory();
    let params: [(&(dyn ToSql + Sync), Type); 9] = [
        (&key_row.0, Type::INT8),
        (&key_row.1, Type::INT8),
        (&key_row.2, Type::INT2),
        (&pid, Type::INT4),
        (&session, Type::TIMESTAMPTZ),
        (&token, Type::INT8),
        (&name, Type::TEXT),
        (&wait_ms, Type::INT8),
        (&idle, Type::TIMESTAMPTZ),
    ];
    let row = run_break(inner, &conn, &sql, &params, pid).await?;
    if ended(&row, name, pid, wait_ms)? {
        return Ok(true);
    }
    let protocol = |e| SqlError::Protocol(format!("the break returned {e}"));
    let given_shared: bool = row.try_get(2).map_err(protocol)?;
    let foreign: Option<bool> = row.try_get(3).map_err(protocol)?;
    if foreign == Some(true) && idle.is_none() {
        return Err(SqlError::Unsupported(format!(
            "backend {pid} holds {name:?}, but its session is not one of distlock's (its \
             application_name is neither 'distlock' nor this URL's): it mints no token, so a break \
             cannot tell the hold shown from a later one of that session, and ending the session \
             would end its other locks and its open transaction too. It can be broken only when \
             inspect sees it idle (which needs pg_read_all_stats or its role); else end it by hand \
             after checking: SELECT pg_terminate_backend({pid})"
        )));
    }
    if shown.is_none() && given_shared {
        // A holder given without a hold id (not one inspect showed) whose session holds the name
        // shared: a reader or a permit holder.
        return Err(exclusive_only(format!(
            "backend {pid} holds {name:?} shared (a reader or a permit holder), not exclusive"
        )));
    }
    Ok(false)
}

/// Row mode: terminates backend `pid` if its transaction (`xid`, the hold shown) still holds the
/// name's row exclusive.
async fn break_row(
    inner: &Inner,
    name: &str,
    pid: i32,
    xid: Option<u32>,
    token: Option<i64>,
) -> Result<bool, SqlError> {
    let conn = inner.control().await?;
    let wait_ms = exit_wait_ms(inner);
    let xid = xid.map(|x| x.to_string());
    let sql = inner.tables.break_row();
    let params: [(&(dyn ToSql + Sync), Type); 5] = [
        (&name, Type::TEXT),
        (&pid, Type::INT4),
        (&xid, Type::TEXT),
        (&token, Type::INT8),
        (&wait_ms, Type::INT8),
    ];
    let row = run_break(inner, &conn, &sql, &params, pid).await?;
    if ended(&row, name, pid, wait_ms)? {
        return Ok(true);
    }
    if xid.is_none() {
        // A holder not shown by inspect (no hold id): refused if its session reads the row now.
        let readers = inspect::row_readers(inner, &conn, name).await?;
        let owner = layout::backend_owner(pid);
        if readers.iter().any(|r| r.owner.as_deref() == Some(&owner)) {
            return Err(exclusive_only(format!(
                "backend {pid} holds {name:?} shared (a reader), not exclusive"
            )));
        }
    }
    Ok(false)
}
