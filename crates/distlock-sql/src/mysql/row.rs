//! `row` mode: the pessimistic lock. The name's lock row is locked with `SELECT … FOR UPDATE` in a
//! transaction held open on a dedicated session for the guard's life; releasing is `ROLLBACK`.
//!
//! * **Which row.** The lock row's key is the byte `0xFF` followed by the SHA-256 of the name (33 bytes;
//!   no UTF-8 name starts with `0xFF`, so it never meets a name's own row). The name's own row keeps the
//!   fencing counter, bumped by an autocommit statement on *another* session before the grant is
//!   reported: committing on the lock's session would end its transaction and free the row, and
//!   bumping the locked row from another session would wait for it.
//! * **Try**: a plain read of the lock row and, when missing, `INSERT IGNORE` of it (autocommit), `START TRANSACTION`, `SELECT … FOR UPDATE
//!   NOWAIT` (busy: error 1205, MySQL 3572, then `ROLLBACK`). **Wait**: the same without `NOWAIT` in a
//!   task that owns the session, bounded by the session's `innodb_lock_wait_timeout` (10 s slices);
//!   `abandon` ends it with `KILL QUERY` and rolls back. Probes and the loss deadline are the advisory
//!   mode's (`SELECT CONNECTION_ID(), @@in_transaction`).
//! * **Who holds it.** The `FOR UPDATE` that gets the row is followed, in the same query, by an
//!   `UPDATE` of the row's `owner` to the mark `<CONNECTION_ID()>/<UUID()>`, never committed (the hold
//!   ends with `ROLLBACK` or the session's end, which take it back). A read that sees uncommitted rows
//!   finds the hold there (a mark that differs from the committed value is an open transaction's):
//!   `inspect` shows its session, with the mark as the hold's identity, and `distlock break` kills
//!   that session only while that mark is there (see `breaking.rs`), so a later hold of the same
//!   session is never broken.

use distlock_core::raw::{AcquireRequest, Attempt, Grant};
use distlock_core::FencingToken;
use mysql_async::prelude::Queryable as _;
use sha2::{Digest as _, Sha256};

use super::advisory::{self, set_wait_timeout, Flavor, Held, Waiting};
use super::conn::last_row;
use super::conn::{bounded, Session};
use super::layout::{
    literal, mark_row_holder, mark_session, row_holder as row_holder_sql, session_host,
    session_owner,
};
use super::{Inner, MysqlLease};
use crate::error::SqlError;

/// The SQL literal of a name's lock row key: `X'FF' || SHA-256(name)`.
pub(crate) fn lock_row(name: &str) -> String {
    let mut key = vec![0xFF];
    key.extend_from_slice(&Sha256::digest(name.as_bytes()));
    literal(&key)
}

pub(crate) fn flavor(inner: &Inner, name: &str) -> Flavor {
    Flavor::Row {
        table: inner.table.clone(),
        row: lock_row(name),
    }
}

fn is_busy(e: &mysql_async::Error) -> bool {
    // ER_LOCK_WAIT_TIMEOUT (MariaDB's NOWAIT answer too), MySQL's ER_LOCK_NOWAIT.
    matches!(e, mysql_async::Error::Server(s) if s.code == 1205 || s.code == 3572)
}

/// `START TRANSACTION` and `SELECT … FOR UPDATE [NOWAIT]` of the lock row: `Some(1)` locked, `Some(0)`
/// busy (rolled back). Checks the session id when `nowait` (the try). `mark`: a lock's acquire (not
/// `inspect`'s look) also records its session in the row, uncommitted, in the same query
/// ([`mark_row_holder`]), for `inspect` and `distlock break`.
pub(crate) async fn wait_for_row(
    session: &mut Session,
    table: &str,
    row: &str,
    nowait: bool,
    mark: bool,
) -> Result<Option<i64>, SqlError> {
    session
        .conn
        .query_drop("START TRANSACTION")
        .await
        .map_err(|e| super::conn::map_error("starting the lock's transaction", e))?;
    let suffix = if nowait { " NOWAIT" } else { "" };
    let mut sql =
        format!("SELECT CONNECTION_ID() FROM {table} WHERE name = {row} FOR UPDATE{suffix}");
    if mark {
        // Runs only when the lock statement succeeded: a multi-statement query stops at an error.
        sql = format!("{sql}; {}", mark_row_holder(table, row));
    }
    let locked = async {
        let mut result = session.conn.query_iter(sql).await?;
        let ids: Vec<u64> = result.collect().await?;
        // The mark's answer, if it was sent.
        result.drop_result().await?;
        Ok::<_, mysql_async::Error>(ids.first().copied())
    }
    .await;
    match locked {
        Ok(Some(id)) if id == session.id => Ok(Some(1)),
        Ok(Some(id)) => {
            let _ = session.conn.query_drop("ROLLBACK").await;
            Err(advisory::session_changed(session.id, id))
        }
        Ok(None) => {
            let _ = session.conn.query_drop("ROLLBACK").await;
            Err(SqlError::Protocol(
                "the lock row vanished (was the lock table changed by hand?)".into(),
            ))
        }
        Err(e) if is_busy(&e) => {
            session
                .conn
                .query_drop("ROLLBACK")
                .await
                .map_err(|e| super::conn::map_error("rolling back a busy try", e))?;
            Ok(Some(0))
        }
        Err(e) => Err(super::conn::map_error("locking the row", e)),
    }
}

/// Creates the lock row if it is missing. A plain (non-locking) read first: `INSERT IGNORE` of a row
/// that exists and is locked would wait for the holder's transaction.
async fn ensure_row(inner: &Inner, session: &mut Session, row: &str) -> Result<(), SqlError> {
    let found: Option<i64> = bounded(
        "looking for the lock row",
        inner.limits.request,
        session
            .conn
            .query_first(format!("SELECT 1 FROM {} WHERE name = {row}", inner.table)),
    )
    .await?;
    if found.is_none() {
        bounded(
            "creating the lock row",
            inner.limits.request,
            session.conn.query_drop(format!(
                "INSERT IGNORE INTO {} (name) VALUES ({row})",
                inner.table
            )),
        )
        .await?;
    }
    Ok(())
}

pub(crate) async fn try_acquire(
    inner: &Inner,
    waiting: &mut Waiting,
    request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let row = lock_row(&request.name);
    let session = if let Some((session, got)) = waiting.done.take() {
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
        ensure_row(inner, &mut session, &row).await?;
        let got = tokio::time::timeout(
            inner.limits.request,
            wait_for_row(&mut session, &inner.table, &row, true, true),
        )
        .await
        .map_err(|_| SqlError::Timeout {
            action: "locking the row",
            after: inner.limits.request,
        })??;
        if got != Some(1) {
            waiting.session = Some(session);
            return Ok(Attempt::Busy { retry_after: None });
        }
        session
    };
    // Locked. The counter is bumped on another session; on any error the lock's session is dropped,
    // which closes it and rolls the transaction back.
    let mut other = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let token = inner.bump_fence(&mut other.conn, &request.name).await?;
    inner.pool.checkin(other);
    if session.server_closed() {
        return Err(SqlError::Unavailable {
            action: "locking the row",
            message: "the server closed the lock's session before the grant".into(),
            source: None,
        });
    }
    let loss = session.loss_signal();
    let held = Held::new(session, flavor(inner, &request.name));
    let mut grant = Grant::new(MysqlLease::Row(held))
        .with_token(FencingToken::new(token))
        .with_ttl(request.lease);
    if let Some(loss) = loss {
        grant = grant.with_loss(loss);
    }
    Ok(Attempt::Acquired(grant))
}

/// What `distlock status` shows in row mode: the hold recorded uncommitted in the lock row
/// ([`mark_row_holder`], read uncommitted: InnoDB's own lock tables need the `PROCESS` privilege) by a
/// transaction still open (the mark differs from the committed value), shown by its session in
/// `owner`, its mark in `hold_id`, the session's `HOST` in `host` (where the user may read it) and
/// the name's counter as its token. A row locked by a session that recorded nothing (an older
/// distlock, or another client locking the row) is found by trying it with `FOR UPDATE NOWAIT`, rolled
/// back at once (a locking read that finds it free holds it for one round trip), and shown without an
/// owner: a break cannot tell whom to end (`Unsupported`).
pub(crate) async fn inspect(
    inner: &Inner,
    name: &str,
) -> Result<distlock_core::raw::LockInfo, SqlError> {
    let row = lock_row(name);
    let request = inner.limits.request;
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let exists: Option<i64> = bounded(
        "looking for the lock row",
        request,
        session
            .conn
            .query_first(format!("SELECT 1 FROM {} WHERE name = {row}", inner.table)),
    )
    .await?;
    let mut held = false;
    let mut mark = None;
    if exists.is_some() {
        mark = row_holder(inner, &mut session, &row).await?;
        held = mark.is_some();
    }
    if exists.is_some() && !held {
        let got = tokio::time::timeout(
            request,
            wait_for_row(&mut session, &inner.table, &row, true, false),
        )
        .await
        .map_err(|_| SqlError::Timeout {
            action: "trying the lock row",
            after: request,
        })??;
        if got == Some(1) {
            bounded("rolling back", request, session.conn.query_drop("ROLLBACK")).await?;
        }
        held = got == Some(0);
    }
    let id = mark.as_deref().and_then(mark_session);
    let (fence, host): (Option<u64>, Option<String>) = bounded(
        "reading the fencing counter",
        request,
        session.conn.query_first(format!(
            "SELECT (SELECT fence FROM {} WHERE name = {}), {}",
            inner.table,
            literal(name.as_bytes()),
            session_host(&id.map_or_else(|| "NULL".to_string(), |id| id.to_string()))
        )),
    )
    .await?
    .unwrap_or((None, None));
    inner.pool.checkin(session);
    let mut info = distlock_core::raw::LockInfo::default();
    info.last_token = fence.filter(|f| *f > 0).map(FencingToken::new);
    if held {
        let mut holder = distlock_core::HolderInfo::default();
        holder.owner = id.map(session_owner);
        holder.hold_id = id.and(mark);
        holder.host = host;
        holder.token = info.last_token;
        info.kind = Some(distlock_core::LockKind::Mutex);
        info.holder = Some(holder);
    }
    Ok(info)
}

/// The mark of the hold of the lock row `row` ([`mark_row_holder`]), read uncommitted, if a
/// transaction still open wrote it (it differs from the committed value); `None` when no open
/// transaction recorded itself there. On an error the caller drops `session` (the read's isolation
/// may still be pending on it).
pub(crate) async fn row_holder(
    inner: &Inner,
    session: &mut Session,
    row: &str,
) -> Result<Option<String>, SqlError> {
    let found = bounded(
        "reading the lock row's holder",
        inner.limits.request,
        last_row(&mut session.conn, row_holder_sql(&inner.table, row)),
    )
    .await?;
    let column = |i: usize| -> Option<Vec<u8>> {
        found
            .as_ref()
            .and_then(|r| r.get_opt::<Option<Vec<u8>>, usize>(i))
            .and_then(Result::ok)
            .flatten()
    };
    let (dirty, committed) = (column(0), column(1));
    if dirty.is_none() || dirty == committed {
        return Ok(None);
    }
    Ok(dirty.and_then(|d| String::from_utf8(d).ok()))
}
