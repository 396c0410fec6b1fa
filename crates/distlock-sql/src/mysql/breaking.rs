//! `distlock break` on MySQL / MariaDB
//! ([`Backend::break_holder`](distlock_core::raw::Backend::break_holder)): ends the exclusive hold
//! `inspect` showed, only if that holder still holds it.
//!
//! * **advisory**, **row**: the hold is the holder's session, so the session is killed:
//!   `KILL CONNECTION id` where `IS_USED_LOCK(name) = id` (advisory) or the lock row's uncommitted
//!   `owner` is `id` (row mode, see `row.rs`), and the name's counter is the token shown. `KILL` is a
//!   statement, so it cannot run inside the check's statement; it is prepared from a string the check
//!   picks (`SELECT IF(check, 'KILL CONNECTION id', 'DO 0') INTO @v; PREPARE …; EXECUTE …`), all in one
//!   query: the check and the kill run back to back in the server, with no round trip in between. The
//!   residual race is that gap of microseconds: a holder that releases in it and whose session is idle
//!   or holds another lock then is killed for nothing (the counter check keeps a later hold of the
//!   same name by that session safe once its grant has bumped the counter). The server frees the
//!   session's locks as it ends it: a waiter in the server gets the lock at once, and the holder's
//!   guard learns from its socket, closed by the server (its loss signal).
//! * **lease**: the lease row is expired (`expires_at = UTC_TIMESTAMP(6)`) where owner and version
//!   are the ones shown; waiters find it free at their next try (they poll, at most 1 s apart), the
//!   holder at its next renewal (within a third of its lease).
//!
//! Only an exclusive holder is broken: a permit holder, or a name held only by permits, is
//! `Unsupported`. Killing another user's session needs `CONNECTION ADMIN` (MariaDB 10.5+; `SUPER`
//! before; MySQL: `CONNECTION_ADMIN` or `SUPER`): otherwise `PermissionDenied`.

use distlock_core::raw::HolderInfo;
use mysql_async::prelude::Queryable as _;

use super::conn::{bounded, last_row, map_error};
use super::layout::{self, advisory_name};
use super::{lease, row, Inner};
use crate::config::Mode;
use crate::error::SqlError;

/// ER_NO_SUCH_THREAD: the session had ended by the time `KILL` ran.
const NO_SUCH_THREAD: u16 = 1094;
/// ER_KILL_DENIED_ERROR: "You are not owner of thread …".
const KILL_DENIED: u16 = 1095;

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
    let token = holder.token.map(|t| t.get());
    if inner.config.mode == Mode::Lease {
        let Some(owner) = holder.owner.as_deref() else {
            return Err(SqlError::Config(
                "the holder to break has no owner id: pass the holder inspect showed".into(),
            ));
        };
        return lease::break_lease(inner, name, owner, token).await;
    }
    let id = session_id(holder)?;
    let (check, dirty) = match inner.config.mode {
        Mode::Row => (
            layout::holds_row(&inner.table, &row::lock_row(name), id),
            true,
        ),
        _ => (layout::holds_advisory(&advisory_name(name), id), false),
    };
    let fence = token.map_or_else(String::new, |t| layout::fence_is(&inner.table, name, t));
    let sql = layout::kill_if(&format!("{check}{fence}"), id, dirty);
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let answered =
        tokio::time::timeout(inner.limits.request, last_row(&mut session.conn, sql)).await;
    let killed = match answered {
        Err(_) => {
            return Err(SqlError::Timeout {
                action: "killing the holder's session",
                after: inner.limits.request,
            })
        }
        Ok(Err(mysql_async::Error::Server(e))) if e.code == NO_SUCH_THREAD => {
            // It ended between the check and the kill: that holder holds nothing any more.
            inner.pool.checkin(session);
            return Ok(false);
        }
        Ok(Err(mysql_async::Error::Server(e))) if e.code == KILL_DENIED => {
            return Err(SqlError::Denied {
                message: format!(
                    "killing the holder's session {id} was refused ({}): killing another user's \
                     session needs the CONNECTION ADMIN privilege (MariaDB 10.5 and later; SUPER \
                     before) or, on MySQL, CONNECTION_ADMIN or SUPER",
                    e.message
                ),
                source: Some(Box::new(mysql_async::Error::Server(e))),
            });
        }
        // On an error the session is dropped (closed): the read's isolation may still be pending.
        Ok(Err(e)) => return Err(map_error("killing the holder's session", e)),
        Ok(Ok(row)) => row
            .and_then(|r| r.get_opt::<Option<i64>, usize>(0))
            .and_then(Result::ok)
            .flatten()
            .ok_or_else(|| SqlError::Protocol("the break answered no row".into()))?,
    };
    if killed == 1 {
        inner.pool.checkin(session);
        return Ok(true);
    }
    if inner.config.mode == Mode::Advisory && held_by_permits(inner, &mut session, name).await? {
        return Err(exclusive_only(format!(
            "{name:?} is held by permit holders of a semaphore, not by the holder given"
        )));
    }
    inner.pool.checkin(session);
    Ok(false)
}

/// The refusal of a break aimed at shared holders.
fn exclusive_only(what: String) -> SqlError {
    SqlError::Unsupported(format!(
        "{what}: break ends an exclusive holder (a mutex or a write lock) only, never readers or \
         permit holders"
    ))
}

/// The session id in a session holder's `owner`, as `inspect` shows it.
fn session_id(holder: &HolderInfo) -> Result<u64, SqlError> {
    holder
        .owner
        .as_deref()
        .and_then(|owner| owner.strip_prefix(layout::SESSION_OWNER_PREFIX))
        .and_then(|id| id.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            SqlError::Config(format!(
                "the holder to break names no MySQL session (its owner is {:?}, not \"{}<id>\"): \
                 pass the holder inspect showed",
                holder.owner,
                layout::SESSION_OWNER_PREFIX
            ))
        })
}

/// Advisory mode, after a break killed nothing: whether the name's mutex is free and permits of it
/// are held.
async fn held_by_permits(
    inner: &Inner,
    session: &mut super::conn::Session,
    name: &str,
) -> Result<bool, SqlError> {
    let key = advisory_name(name);
    let mutex: Option<Option<u64>> = bounded(
        "IS_USED_LOCK",
        inner.limits.request,
        session
            .conn
            .query_first(format!("SELECT IS_USED_LOCK('{key}')")),
    )
    .await?;
    if mutex.flatten().is_some() {
        return Ok(false);
    }
    let mut info = distlock_core::raw::LockInfo::default();
    super::semaphore::inspect_permits(inner, session, name, &mut info).await?;
    Ok(!info.holders.is_empty())
}
