//! `distlock break` on PostgreSQL ([`Backend::break_holder`](distlock_core::raw::Backend::break_holder)):
//! ends the exclusive hold `inspect` showed, only if that holder still holds it, checked in the same
//! statement that ends it.
//!
//! * **advisory**, **row**: the hold is the holder's session, so the session is ended:
//!   `pg_terminate_backend(pid, timeout)` in one statement that first finds `pid` in `pg_locks` holding
//!   the name's key exclusive (advisory) or the transaction locking the name's row (row mode: the row's
//!   `xmax`, see `layout::Tables::row_holder`), with the session start and the name's counter `inspect`
//!   showed. The statement waits (up to half the request bound) for the backend to exit, which frees
//!   its locks: waiters in the server get the lock at once; the holder's connection is closed by the
//!   server, which its driver task reports as the guard's loss at once.
//! * **lease**: the lease row is expired (`expires_at = now()`) where owner and version are the ones
//!   shown, and the waiters are woken (`NOTIFY`); the holder learns at its next renewal (within a
//!   third of its lease).
//!
//! Only an exclusive holder (a mutex, a writer) is broken: a permit holder, or a name held only by
//! readers or permits, is `Unsupported`. Ending another role's session needs that role's privileges
//! or membership in `pg_signal_backend` (a superuser's, a superuser): otherwise `PermissionDenied`.

use std::time::{Duration, SystemTime};

use distlock_core::raw::HolderInfo;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::backend::Inner;
use super::conn::{map_error, Conn};
use super::layout;
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
    let token = match holder.token {
        Some(token) => Some(i64::try_from(token.get()).map_err(|_| {
            SqlError::Config(format!(
                "the holder's token {token} is not a PostgreSQL bigint"
            ))
        })?),
        None => None,
    };
    match inner.config.mode {
        Mode::Lease => break_lease(inner, name, holder, token).await,
        mode => {
            let pid = backend_pid(holder)?;
            break_session(inner, mode, name, pid, holder.since, token).await
        }
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

/// Advisory and row modes: terminates backend `pid` if it still holds the name exclusive.
async fn break_session(
    inner: &Inner,
    mode: Mode,
    name: &str,
    pid: i32,
    since: Option<SystemTime>,
    token: Option<i64>,
) -> Result<bool, SqlError> {
    let conn = inner.control().await?;
    let bound = inner.request_timeout();
    let wait_ms = i64::try_from((bound / 2).min(MAX_EXIT_WAIT).as_millis()).unwrap_or(0);
    // The key's `pg_locks` columns (advisory mode).
    let (classid, objid, objsubid) = layout::pg_locks_row(layout::key_for(name, inner.config.key));
    let key_row = (i64::from(classid), i64::from(objid), objsubid);
    let sql;
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = Vec::new();
    if mode == Mode::Advisory {
        sql = inner.tables.break_advisory();
        params.extend([
            (&key_row.0 as &(dyn ToSql + Sync), Type::INT8),
            (&key_row.1, Type::INT8),
            (&key_row.2, Type::INT2),
            (&pid, Type::INT4),
            (&since, Type::TIMESTAMPTZ),
            (&token, Type::INT8),
            (&name, Type::TEXT),
            (&wait_ms, Type::INT8),
        ]);
    } else {
        sql = inner.tables.break_row();
        params.extend([
            (&name as &(dyn ToSql + Sync), Type::TEXT),
            (&pid, Type::INT4),
            (&since, Type::TIMESTAMPTZ),
            (&token, Type::INT8),
            (&wait_ms, Type::INT8),
        ]);
    }
    let answered = tokio::time::timeout(bound, conn.client.query_typed_one(&sql, &params)).await;
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
                     end a superuser's session (row mode also needs UPDATE on distlock's lock table, \
                     for the FOR SHARE that tells an exclusive holder)",
                    e.as_db_error().map_or_else(|| e.to_string(), |db| db.message().to_string())
                ),
                source: Some(Box::new(e)),
            });
        }
        Ok(row) => row.map_err(|e| map_error("ending the holder's session", e)),
    };
    let row = inner.forget_stalled_control(&conn, row).await?;
    let protocol = |e| SqlError::Protocol(format!("the break returned {e}"));
    let matched: i64 = row.try_get(0).map_err(protocol)?;
    let exited: Option<bool> = row.try_get(1).map_err(protocol)?;
    if matched > 0 {
        if exited != Some(true) {
            // Signalled: it exits (and frees its locks) as soon as it handles the signal.
            tracing::warn!(
                lock = name,
                backend = pid,
                "the broken holder's backend was signalled but had not exited within {wait_ms} ms"
            );
        }
        return Ok(true);
    }
    let shared = if mode == Mode::Advisory {
        row.try_get::<_, bool>(2).map_err(protocol)?
    } else {
        // Held exclusive by another holder: that one is not touched.
        let exclusive: bool = row.try_get(2).map_err(protocol)?;
        !exclusive && held_by_readers(inner, &conn, name).await?
    };
    if shared {
        return Err(exclusive_only(format!(
            "{name:?} is held shared (by readers or permit holders), not by the holder given"
        )));
    }
    Ok(false)
}

/// Row mode, after a break found no exclusive holder: whether readers hold the row.
async fn held_by_readers(inner: &Inner, conn: &Conn, name: &str) -> Result<bool, SqlError> {
    let sql = inner.tables.row_locked();
    let row = Conn::bounded(
        "reading the row's lock",
        inner.request_timeout(),
        conn.client.query_typed_one(&sql, &[(&name, Type::TEXT)]),
    )
    .await?;
    let protocol = |e| SqlError::Protocol(format!("the row's lock check returned {e}"));
    let exists: bool = row.try_get(0).map_err(protocol)?;
    let locked: bool = row.try_get(1).map_err(protocol)?;
    Ok(exists && locked)
}
