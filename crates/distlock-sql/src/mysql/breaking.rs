//! `distlock break` on MySQL / MariaDB
//! ([`Backend::break_holder`](distlock_core::raw::Backend::break_holder)): ends the exclusive hold
//! `inspect` showed, only if that same hold still holds the name.
//!
//! * **row**: the hold is a transaction on the holder's session, which marked the lock row
//!   uncommitted with `<id>/<uuid>` (see `row.rs`; `inspect` shows the mark as the hold's
//!   `hold_id`). The session is killed (`KILL CONNECTION id`) only while that very mark is in the row
//!   and not committed (the transaction that wrote it is open, so it holds the row), read
//!   uncommitted: a later hold of the same session (a pooled session the same process took again)
//!   wrote another mark, whether or not its grant has bumped the counter yet.
//! * **advisory**: the session is killed where `IS_USED_LOCK(name) = id`, that session minted the
//!   name's last token (advisory grants record their session with the counter bump: a distlock
//!   holder) and the counter is the token shown. The name's row is read `FOR UPDATE SKIP LOCKED` in
//!   a transaction that ends after the kill: a grant's bump in flight (a later hold of the session,
//!   its lock taken and its token not yet committed) makes it skip, and no grant can commit a token
//!   between the check and the kill. A session holding the name that minted no token (a `mariadb`
//!   shell, another application's `GET_LOCK`) is refused (`Unsupported`): a later hold of it would
//!   look the same, and killing it would end its other locks and its transaction too.
//!
//!   `KILL` is a statement, so it cannot run inside the check's statement; it is prepared from a string
//!   the check picks, in the same query: the check and the kill run back to back in the server, with
//!   no round trip in between. The residual race is that gap of microseconds: a hold that came since
//!   on the same session in it would need the old hold released and a new one taken by the client
//!   (round trips); a holder that releases in it and whose session is idle then loses its idle
//!   session. The server frees the session's locks as it ends it: a waiter in the server gets the
//!   lock at once, and the holder's guard learns from its socket, closed by the server.
//! * **lease**: the lease row is expired (`expires_at = '1000-01-01'`, which no renewal in flight can
//!   pass) where owner and version are the ones shown; waiters find it free at their next try (they
//!   poll, at most 1 s apart), the holder at its next renewal (within a third of its lease).
//!
//! Only an exclusive holder is broken: a permit holder given is `Unsupported`; a break aimed at a
//! mutex holder that has gone while permits hold the name now is `Ok(false)`. Killing another user's
//! session needs `CONNECTION ADMIN` (MariaDB 10.5+; `SUPER` before; MySQL: `CONNECTION_ADMIN` or
//! `SUPER`): otherwise `PermissionDenied`.

use super::conn::{last_row, map_error, Session};
use super::layout::{self, advisory_name};
use super::{lease, row, Inner};
use crate::config::Mode;
use crate::error::SqlError;
use distlock_core::raw::HolderInfo;

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
    if holder.owner.is_none() {
        return Err(SqlError::Unsupported(format!(
            "the holder of {name:?} was shown without its session: it locks the row without \
             recording itself (an older distlock, or another client locking distlock's row), so a \
             break cannot tell whom to end; find its session by hand (information_schema.INNODB_TRX, \
             which needs the PROCESS privilege) and KILL it after checking"
        )));
    }
    let id = session_id(holder)?;
    let sql = match inner.config.mode {
        Mode::Row => {
            let mark = holder.hold_id.as_deref();
            if let Some(mark) = mark {
                if layout::mark_session(mark) != Some(id) {
                    return Err(SqlError::Config(format!(
                        "the holder to break has a hold id {mark:?} that is not session {id}'s row \
                         mark: pass the holder inspect showed"
                    )));
                }
            }
            layout::break_row(&inner.table, &row::lock_row(name), name, id, mark, token)
        }
        _ => layout::break_advisory(&inner.table, name, &advisory_name(name), id, token),
    };
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let answered =
        tokio::time::timeout(inner.limits.request, last_row(&mut session.conn, sql)).await;
    // On an error the session is dropped (closed): a transaction or a read's isolation may be
    // pending on it.
    let row = match answered {
        Err(_) => {
            return Err(SqlError::Timeout {
                action: "killing the holder's session",
                after: inner.limits.request,
            })
        }
        Ok(Err(mysql_async::Error::Server(e))) if e.code == NO_SUCH_THREAD => {
            // It ended between the check and the kill: that holder holds nothing any more.
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
        Ok(Err(e)) => return Err(map_error("killing the holder's session", e)),
        Ok(Ok(row)) => row.ok_or_else(|| SqlError::Protocol("the break answered no row".into()))?,
    };
    let flag = |i: usize| -> Option<i64> {
        row.get_opt::<Option<i64>, usize>(i)
            .and_then(Result::ok)
            .flatten()
    };
    if flag(0) == Some(1) {
        inner.pool.checkin(session);
        return Ok(true);
    }
    if inner.config.mode == Mode::Advisory {
        let (got, exists, holds, ours) = (flag(1), flag(2), flag(3), flag(4));
        if holds == Some(1) && ours != Some(1) && (got == Some(1) || exists == Some(0)) {
            inner.pool.checkin(session);
            return Err(SqlError::Unsupported(format!(
                "session {id} holds {name:?} (GET_LOCK('{}')), but it is no distlock holder: it \
                 minted no token, so a break cannot tell the hold shown from a later one of that \
                 session, and killing it would end its other locks and its transaction too; kill it \
                 by hand after checking: KILL CONNECTION {id}",
                advisory_name(name)
            )));
        }
        if holder.hold_id.is_none()
            && holder.token.is_none()
            && holds_a_permit(inner, &mut session, name, id).await?
        {
            // A holder given without a hold id or a token (not a mutex holder inspect showed) whose
            // session holds a permit of the name.
            inner.pool.checkin(session);
            return Err(exclusive_only(format!(
                "session {id} holds a permit of the semaphore {name:?}, not its mutex"
            )));
        }
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

/// Advisory mode, after a break killed nothing: whether session `id` holds a permit of `name`.
async fn holds_a_permit(
    inner: &Inner,
    session: &mut Session,
    name: &str,
    id: u64,
) -> Result<bool, SqlError> {
    let mut info = distlock_core::raw::LockInfo::default();
    super::semaphore::inspect_permits(inner, session, name, &mut info).await?;
    let owner = layout::session_owner(id);
    Ok(info
        .holders
        .iter()
        .any(|h| h.owner.as_deref() == Some(owner.as_str())))
}
