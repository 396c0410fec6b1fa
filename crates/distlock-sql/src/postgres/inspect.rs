//! `distlock status` on PostgreSQL: the holder as the server sees it (`pg_locks` and
//! `pg_stat_activity` in advisory and row modes, the row in lease mode), waiters, and the last token.
//! In advisory mode the key held exclusive is a mutex or a writer (one lock: shown as a mutex); held
//! shared, it is readers, or the permits of a semaphore when the name has a stored limit (then each
//! holder is a slot key's, with its slot as the permit). Row mode shows the exclusive holder (the
//! transaction in the row's `xmax`, see `layout::Tables::row_holder`); readers are not listed.
//!
//! A session's holder (advisory, row) is shown by its backend pid in `owner`
//! (`postgres backend <pid>`, [`layout::backend_owner`]), its client address in `host` and its
//! session's start in `since`; an exclusive holder's `token` is the name's counter (its grant's, once
//! the grant has bumped it). `distlock break` takes that holder back ([`super::breaking`]).

use std::time::Duration;

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
            let sql = "SELECT l.pid, l.granted, a.client_addr::text, a.backend_start, l.mode \
                       FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
                       WHERE l.locktype = 'advisory' AND l.classid = $1::bigint::oid \
                       AND l.objid = $2::bigint::oid AND l.objsubid = $3 \
                       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";
            let rows = Conn::bounded(
                "reading pg_locks",
                bound,
                conn.client
                    .query(sql, &[&i64::from(classid), &i64::from(objid), &objsubid]),
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
                    holder.host = row.try_get(2).ok();
                    holder.since = row.try_get(3).ok();
                    if row.try_get::<_, String>(4).ok().as_deref() == Some("ShareLock") {
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
                // Its `FOR SHARE` needs UPDATE on the table: a role that may only read is shown
                // the token alone, as before the holder was shown.
                Err(e @ SqlError::Denied { .. }) => {
                    tracing::debug!(error = %e, "cannot tell the row's holder without UPDATE on the table");
                    Vec::new()
                }
                rows => rows?,
            };
            if let Some(row) = rows.first() {
                let mut holder = HolderInfo::default();
                holder.owner = row.try_get::<_, i32>(0).ok().map(layout::backend_owner);
                holder.host = row.try_get(1).ok();
                holder.since = row.try_get(2).ok();
                info.kind = Some(LockKind::Mutex);
                info.holder = Some(holder);
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
    let sql = "SELECT l.objid::bigint, a.client_addr::text, a.backend_start, l.pid \
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
            holder.host = row.try_get(1).ok();
            holder.since = row.try_get(2).ok();
            holder.owner = row.try_get::<_, i32>(3).ok().map(layout::backend_owner);
            holder
        })
        .collect())
}
