//! `distlock status` on PostgreSQL: the holder as the server sees it (`pg_locks` and
//! `pg_stat_activity` in advisory and row modes, the row in lease mode), waiters, and the last token.
//! In advisory mode the key held exclusive is a mutex or a writer (one lock: shown as a mutex); held
//! shared, it is readers, or the permits of a semaphore when the name has a stored limit (then each
//! holder is a slot key's, with its slot as the permit). Row mode shows the exclusive holder (the
//! transaction in the row's `xmax`, see `layout::Tables::row_holder`), or, on a row held shared, the
//! readers (`layout::Tables::row_readers`).
//!
//! A session's holder (advisory, row) is shown by its backend pid in `owner`
//! (`postgres backend <pid>`, [`layout::backend_owner`]), its client address and `application_name` in
//! `host` ([`layout::session_host`]: `distlock` for distlock's sessions, `psql` or an application's
//! name for others), and the hold's identity in `hold_id` ([`layout::HoldId`]: the transaction in row
//! mode; the session start, and for a holder that is not distlock's its idle time, in advisory mode).
//! `since` is when the hold began where the server tells it: in row mode the start of the transaction
//! that holds the row (for a holder that waited, the start of its last wait slice, at most 5 s
//! before the grant); in advisory mode nothing tells when a session lock was granted, so it is left
//! out (the session's start would say how old the connection is, not the hold). Both need the
//! privileges to read the session's activity (`pg_read_all_stats`, or its role). An exclusive
//! holder's `token` is the name's counter (its grant's, once the grant has bumped it). `distlock
//! break` takes that holder back ([`super::breaking`]).
//!
//! Row mode needs `UPDATE` on the lock table to tell a writer from readers (a `FOR SHARE SKIP
//! LOCKED` probe): without it, `inspect` fails with `PermissionDenied` rather than show a held name
//! as free.

use std::time::{Duration, SystemTime};

use distlock_core::raw::{HolderInfo, LockInfo};
use distlock_core::{FencingToken, LockKind};
use tokio_postgres::types::Type;

use super::backend::Inner;
use super::conn::Conn;
use super::{layout, session};
use crate::config::Mode;
use crate::error::SqlError;

pub(crate) async fn inspect(inner: &Inner, name: &str) -> Result<LockInfo, SqlError> {
    let conn = inner.control().await?;
    let bound = inner.request_timeout();
    let mut info = LockInfo::default();
    match inner.config.mode {
        Mode::Advisory => {
            let (classid, objid, objsubid) =
                layout::pg_locks_row(layout::key_for(name, inner.config.key));
            let sql = layout::advisory_holders();
            let rows = Conn::bounded(
                "reading pg_locks",
                bound,
                conn.client
                    .query(&sql, &[&i64::from(classid), &i64::from(objid), &objsubid]),
            )
            .await?;
            let mut waiters = 0;
            let mut shared = Vec::new();
            for row in &rows {
                if row.try_get::<_, bool>(1).unwrap_or(false) {
                    // `HolderInfo::pid` is a process id of the holder's machine; the server's backend
                    // pid is not one: it is the session's id, in `owner`.
                    let mut holder = HolderInfo::default();
                    holder.owner = row.try_get::<_, i32>(0).ok().map(layout::backend_owner);
                    holder.host = layout::session_host(
                        row.try_get(2).ok().flatten(),
                        row.try_get(5).ok().flatten(),
                    );
                    let session = row
                        .try_get::<_, Option<SystemTime>>(3)
                        .ok()
                        .flatten()
                        .and_then(layout::micros_since_epoch);
                    let is_shared =
                        row.try_get::<_, String>(4).ok().as_deref() == Some("ShareLock");
                    // A session that is not distlock's mints no token: its hold is told from a later
                    // one of the same session only by its staying idle (shown only when it is idle
                    // and its state can be read).
                    let ours = row.try_get::<_, Option<bool>>(8).ok().flatten() == Some(true);
                    let idle = (!ours && !is_shared)
                        .then(|| {
                            let state: Option<String> = row.try_get(6).ok().flatten();
                            let changed: Option<SystemTime> = row.try_get(7).ok().flatten();
                            (state.as_deref() == Some("idle"))
                                .then_some(changed)
                                .flatten()
                                .and_then(layout::micros_since_epoch)
                        })
                        .flatten();
                    holder.hold_id = Some(
                        layout::HoldId::Advisory {
                            shared: is_shared,
                            session,
                            idle,
                        }
                        .to_string(),
                    );
                    if is_shared {
                        shared.push(holder);
                    } else {
                        // A mutex and a write lock are one lock: the server cannot tell them apart.
                        info.kind = Some(LockKind::Mutex);
                        info.holder = Some(holder);
                    }
                } else {
                    waiters += 1;
                }
            }
            info.waiters = Some(waiters);
            if !shared.is_empty() {
                // Readers, or permit holders (which hold the key shared beside their slot).
                match session::stored_limit(inner, &conn, name, true).await? {
                    Some(limit) => {
                        let limit = u32::try_from(limit).unwrap_or(0);
                        info.kind = Some(LockKind::Permit { limit });
                        info.holders = permit_holders(&conn, bound, name, limit).await?;
                        // Permit waiters wait in the client (they poll), not in the server.
                        info.waiters = None;
                    }
                    None => {
                        info.kind = Some(LockKind::Read);
                        info.holders = shared;
                    }
                }
            }
        }
        Mode::Lease => {
            let sql = inner.tables.lease_holder();
            let rows = Conn::bounded(
                "reading the lease",
                bound,
                conn.client.query(&sql, &[&name]),
            )
            .await?;
            if let Some(row) = rows.first() {
                let version: i64 = row.try_get(1).unwrap_or(0);
                let left: i64 = row.try_get(2).unwrap_or(0);
                let mut holder = HolderInfo::default();
                holder.owner = row.try_get(0).ok();
                holder.token = u64::try_from(version).ok().map(FencingToken::new);
                holder.remaining_lease =
                    Some(Duration::from_millis(u64::try_from(left).unwrap_or(0)));
                info.holder = Some(holder);
                info.last_token = u64::try_from(version).ok().map(FencingToken::new);
            }
            return Ok(info);
        }
        _ => {
            let sql = inner.tables.row_holder();
            let read = Conn::bounded(
                "reading the row's locker",
                bound,
                conn.client.query_typed(&sql, &[(&name, Type::TEXT)]),
            )
            .await;
            let rows = match read {
                // Its `FOR SHARE` needs UPDATE on the table: without it a held row cannot be told
                // from a free one, so nothing is shown as free.
                Err(SqlError::Denied { message, source }) => {
                    return Err(SqlError::Denied {
                        message: format!(
                            "cannot tell who holds {name:?}: row mode tells a writer from readers with a \
                             FOR SHARE SKIP LOCKED probe of the name's row, which needs UPDATE on {} \
                             (GRANT UPDATE ON {} TO <role>); the server said: {message}",
                            inner.tables.locks, inner.tables.locks
                        ),
                        source,
                    });
                }
                rows => rows?,
            };
            if let Some(row) = rows.first() {
                info.kind = Some(LockKind::Mutex);
                info.holder = Some(row_holder_info(row, false));
            } else {
                let readers = row_readers(inner, &conn, name).await?;
                if !readers.is_empty() {
                    info.kind = Some(LockKind::Read);
                    info.holders = readers;
                }
            }
        }
    }
    let sql = inner.tables.last_token();
    let rows = Conn::bounded(
        "reading the fencing counter",
        bound,
        conn.client.query(&sql, &[&name]),
    )
    .await?;
    info.last_token = rows
        .first()
        .and_then(|r| r.try_get::<_, i64>(0).ok())
        .and_then(|t| u64::try_from(t).ok())
        .map(FencingToken::new);
    if let Some(holder) = info.holder.as_mut() {
        // Only an exclusive grant bumps the counter while the name is held exclusive.
        holder.token = info.last_token;
    }
    Ok(info)
}

/// The holders of a semaphore's slots (`pg_locks`: the slot keys of `name` below `limit`), each with
/// its permit (the slot number).
async fn permit_holders(
    conn: &Conn,
    bound: Duration,
    name: &str,
    limit: u32,
) -> Result<Vec<HolderInfo>, SqlError> {
    let (classid, first, _) = layout::pg_locks_row(layout::permit_key(name, 0));
    let last = i64::from(first) + i64::from(limit.max(1)) - 1;
    let sql = "SELECT l.objid::bigint, host(a.client_addr), a.application_name, l.pid \
               FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
               WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
               AND l.classid = $1::bigint::oid AND l.objid::bigint BETWEEN $2 AND $3 \
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
               ORDER BY l.objid";
    let rows = Conn::bounded(
        "reading pg_locks",
        bound,
        conn.client
            .query(sql, &[&i64::from(classid), &i64::from(first), &last]),
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let mut holder = HolderInfo::default();
            holder.permit = row
                .try_get::<_, i64>(0)
                .ok()
                .map(|objid| (objid - i64::from(first)).to_string());
            holder.host =
                layout::session_host(row.try_get(1).ok().flatten(), row.try_get(2).ok().flatten());
            holder.owner = row.try_get::<_, i32>(3).ok().map(layout::backend_owner);
            holder
        })
        .collect())
}

/// A row-mode holder from a row of [`layout::Tables::row_holder`] or [`layout::Tables::row_readers`]
/// (pid, client address, transaction start, `application_name`, transaction id).
fn row_holder_info(row: &tokio_postgres::Row, shared: bool) -> HolderInfo {
    let mut holder = HolderInfo::default();
    holder.owner = row.try_get::<_, i32>(0).ok().map(layout::backend_owner);
    holder.host =
        layout::session_host(row.try_get(1).ok().flatten(), row.try_get(3).ok().flatten());
    // The transaction that holds the row began with the hold (a try) or with its last wait slice.
    holder.since = row.try_get(2).ok().flatten();
    holder.hold_id = row
        .try_get::<_, Option<String>>(4)
        .ok()
        .flatten()
        .and_then(|xid| xid.parse::<u32>().ok())
        .map(|xid| layout::HoldId::Row { shared, xid }.to_string());
    holder
}

/// Row mode: the readers of `name`'s row, if it is held shared (none when it is free or missing).
pub(crate) async fn row_readers(
    inner: &Inner,
    conn: &Conn,
    name: &str,
) -> Result<Vec<HolderInfo>, SqlError> {
    let bound = inner.request_timeout();
    let sql = inner.tables.row_locked();
    let row = Conn::bounded(
        "reading the row's lock",
        bound,
        conn.client.query_typed_one(&sql, &[(&name, Type::TEXT)]),
    )
    .await?;
    let protocol = |e| SqlError::Protocol(format!("the row's lock check returned {e}"));
    let exists: bool = row.try_get(0).map_err(protocol)?;
    let locked: bool = row.try_get(1).map_err(protocol)?;
    if !(exists && locked) {
        return Ok(Vec::new());
    }
    let sql = inner.tables.row_readers();
    let rows = Conn::bounded(
        "reading the row's readers",
        bound,
        conn.client.query_typed(&sql, &[(&name, Type::TEXT)]),
    )
    .await?;
    Ok(rows.iter().map(|row| row_holder_info(row, true)).collect())
}
