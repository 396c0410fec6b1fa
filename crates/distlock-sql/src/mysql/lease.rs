//! `lease` mode: the optimistic lock. The name's row is a versioned lease: `owner`, `expires_at` on the
//! database's clock (`UTC_TIMESTAMP(6)`: `NOW(6)` follows the session's time zone, whose DST changes
//! would move expiries by an hour) and `fence`, the version and fencing token. No connection is held:
//! every statement is autocommit on a pooled session, so it works through transaction-pooling proxies.
//!
//! * **Acquire**, one statement: `INSERT … ON DUPLICATE KEY UPDATE` that takes the row when it is free
//!   (no owner, expired, or this owner's). MariaDB has no `UPDATE … RETURNING`: the new version comes
//!   back as the OK packet's insert id through `LAST_INSERT_ID(fence + 1)`; whether the row was taken is
//!   told by the rows changed (1 inserted, 2 updated, 0 busy; `client_found_rows` is forced off). The
//!   assignments of `ON DUPLICATE KEY UPDATE` run left to right and each sees the columns assigned before
//!   it, so the "free" test is computed once, into `@dl_free`, by the first assignment, and the later ones
//!   read the variable, never the columns already changed.
//! * **Wait**: a jittered backoff (25 ms doubling to 1 s, each delay in `[d/2, d]`), never past the
//!   holder's expiry.
//! * **Renew**: one `UPDATE` per batch (`CASE name … END` for each entry's ttl), guarded by owner,
//!   version and expiry; a batch whose row count falls short is checked row by row.
//! * **Release / abandon**: `UPDATE … SET owner = NULL, expires_at = NULL` guarded by owner and version;
//!   an abandon undoes only what its own last try may have taken (nothing after a definite "busy";
//!   by owner alone only when that try's outcome is unknown).

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LockInfo, Released, RenewalId, Renewed};
use distlock_core::{FencingToken, HolderInfo, Result};
use mysql_async::prelude::Queryable as _;

use super::conn::{bounded, Session};
use super::layout::literal;
use super::{Inner, MysqlLease};
use crate::error::SqlError;

/// The clock every expiry is on.
const CLOCK: &str = "UTC_TIMESTAMP(6)";
/// The expiry a break leaves: `DATETIME`'s smallest value, below every clock reading.
const BROKEN: &str = "'1000-01-01 00:00:00'";
const FIRST_BACKOFF: Duration = Duration::from_millis(25);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A held lease row: its version (the token).
///
/// Reached only inside a [`MysqlLease`](super::MysqlLease):
///
/// ```
/// use distlock_sql::mysql::MysqlLease;
///
/// // No connection is held in lease mode: the row's expiry, renewed by the watchdog, is the lock.
/// fn holds_no_connection(lease: &MysqlLease) -> bool {
///     matches!(lease, MysqlLease::Lease(_))
/// }
/// # let _ = holds_no_connection;
/// ```
#[derive(Debug)]
pub struct Held {
    fence: u64,
}

fn micros(d: Duration) -> u128 {
    d.as_micros().max(1)
}

/// The acquire statement (see the module docs).
pub(crate) fn acquire_sql(table: &str, name: &str, owner: &str, lease: Duration) -> String {
    let (n, o, us) = (
        literal(name.as_bytes()),
        literal(owner.as_bytes()),
        micros(lease),
    );
    format!(
        "INSERT INTO {table} (name, fence, owner, expires_at) \
         VALUES ({n}, LAST_INSERT_ID(1), {o}, {CLOCK} + INTERVAL {us} MICROSECOND) \
         ON DUPLICATE KEY UPDATE \
         fence = IF(@dl_free := (owner IS NULL OR expires_at IS NULL OR expires_at <= {CLOCK} OR owner = {o}), \
                    LAST_INSERT_ID(fence + 1), fence), \
         expires_at = IF(@dl_free, {CLOCK} + INTERVAL {us} MICROSECOND, expires_at), \
         owner = IF(@dl_free, {o}, owner)"
    )
}

async fn with_session<T>(
    inner: &Inner,
    f: impl AsyncFnOnce(&mut Session) -> Result<T, SqlError>,
) -> Result<T, SqlError> {
    let mut session = inner.pool.checkout(&inner.opts, &inner.limits).await?;
    let out = f(&mut session).await;
    if out.is_ok() {
        inner.pool.checkin(session);
    }
    out
}

/// What an abandoned acquire must undo: only what its own last try may have taken, so that an
/// abandon after a definite "busy" never frees a hold it did not create (one of the same owner id in
/// another process, taken after the busy answer).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Undo {
    /// No try was sent, or the last one answered "busy": nothing.
    #[default]
    Nothing,
    /// The last try's outcome is unknown (an error, a timeout, dropped in flight): the row, if it is
    /// this owner's.
    OwnersRow,
    /// The last try took the row at this version (a grant the core then refused): that version only.
    Version(u64),
}

pub(crate) async fn try_acquire(
    inner: &Inner,
    undo: &mut Undo,
    request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let request_timeout = inner.limits.request;
    let sql = acquire_sql(&inner.table, &request.name, &request.owner, request.lease);
    let name = literal(request.name.as_bytes());
    // Until the answer is read, the try may have taken the row.
    *undo = Undo::OwnersRow;
    with_session(inner, async |s| {
        bounded("taking the lease row", request_timeout, s.conn.query_drop(sql)).await?;
        // 1 row: inserted, 2: updated (taken); 0: unchanged (busy). The insert id is only meaningful
        // when taken: a statement that does not call LAST_INSERT_ID(expr) may report the session's last.
        let taken = matches!(s.conn.affected_rows(), 1 | 2);
        let fence = s.conn.last_insert_id().unwrap_or(0);
        *undo = if taken && fence > 0 {
            Undo::Version(fence)
        } else if taken {
            Undo::OwnersRow
        } else {
            Undo::Nothing
        };
        if taken && fence > 0 {
            let grant = Grant::new(MysqlLease::Lease(Held { fence }))
                .with_token(FencingToken::new(fence))
                .with_ttl(request.lease);
            return Ok(Attempt::Acquired(grant));
        }
        let left: Option<Option<i64>> = bounded(
            "reading the holder's expiry",
            request_timeout,
            s.conn.query_first(format!(
                "SELECT TIMESTAMPDIFF(MICROSECOND, {CLOCK}, expires_at) FROM {} WHERE name = {name}",
                inner.table
            )),
        )
        .await?;
        let retry_after = left
            .flatten()
            .map(|us| Duration::from_micros(u64::try_from(us.max(0)).unwrap_or(0)));
        Ok(Attempt::Busy { retry_after })
    })
    .await
}

/// Waits a jittered backoff step, never past the holder's expiry.
pub(crate) async fn wait(
    backoff: &mut Option<distlock_core::retry::Backoff>,
    retry_after: Option<Duration>,
) {
    let backoff = backoff
        .get_or_insert_with(|| distlock_core::retry::Backoff::new(FIRST_BACKOFF, MAX_BACKOFF));
    let mut delay = backoff.next_delay();
    if let Some(expiry) = retry_after {
        delay = delay.min(expiry + Duration::from_millis(1));
    }
    tokio::time::sleep(delay).await;
}

/// Clears a grant the acquire's last try may have got without hearing of it, or got and the core
/// refused (see [`Undo`]); nothing after a definite "busy".
pub(crate) async fn abandon(inner: &Inner, undo: Undo, request: &AcquireRequest) {
    let version = match undo {
        Undo::Nothing => return,
        Undo::OwnersRow => String::new(),
        Undo::Version(fence) => format!(" AND fence = {fence}"),
    };
    let sql = format!(
        "UPDATE {} SET owner = NULL, expires_at = NULL WHERE name = {} AND owner = {}{version}",
        inner.table,
        literal(request.name.as_bytes()),
        literal(request.owner.as_bytes())
    );
    let request_timeout = inner.limits.request;
    let undone = with_session(inner, async |s| {
        bounded(
            "undoing an abandoned lease",
            request_timeout,
            s.conn.query_drop(sql),
        )
        .await
    })
    .await;
    if let Err(e) = undone {
        tracing::warn!(lock = %request.name, error = %e, "could not undo an abandoned lease; it expires with its lease");
    }
}

/// One entry of a renewal batch: id, name, owner, lease, ttl.
pub(crate) type Entry<'a> = (RenewalId, &'a str, &'a str, &'a Held, Duration);

fn guard(name: &str, owner: &str, fence: u64) -> String {
    format!(
        "(name = {} AND owner = {} AND fence = {fence})",
        literal(name.as_bytes()),
        literal(owner.as_bytes())
    )
}

pub(crate) async fn renew(inner: &Inner, batch: &[Entry<'_>]) -> Vec<(RenewalId, Result<Renewed>)> {
    let mut cases = String::new();
    let mut guards = Vec::new();
    for (_, name, owner, held, ttl) in batch {
        cases.push_str(&format!(
            " WHEN {} THEN {}",
            literal(name.as_bytes()),
            micros(*ttl)
        ));
        guards.push(guard(name, owner, held.fence));
    }
    let sql = format!(
        "UPDATE {} SET expires_at = {CLOCK} + INTERVAL (CASE name{cases} END) MICROSECOND \
         WHERE expires_at > {CLOCK} AND ({})",
        inner.table,
        guards.join(" OR ")
    );
    let request_timeout = inner.limits.request;
    let outcome = with_session(inner, async |s| {
        bounded("renewing leases", request_timeout, s.conn.query_drop(sql)).await?;
        let updated = s.conn.affected_rows();
        if updated == batch.len() as u64 {
            return Ok(None);
        }
        // Some were not extended: find which rows are still this owner's and unexpired.
        let mut alive = Vec::new();
        for (_, name, owner, held, _) in batch {
            let still: Option<i64> = bounded(
                "checking a lease",
                request_timeout,
                s.conn.query_first(format!(
                    "SELECT 1 FROM {} WHERE {} AND expires_at > {CLOCK}",
                    inner.table,
                    guard(name, owner, held.fence)
                )),
            )
            .await?;
            alive.push(still.is_some());
        }
        Ok(Some(alive))
    })
    .await;
    match outcome {
        Ok(None) => batch
            .iter()
            .map(|(id, .., ttl)| (*id, Ok(Renewed::Extended { ttl: *ttl })))
            .collect(),
        Ok(Some(alive)) => batch
            .iter()
            .zip(alive)
            .map(|((id, .., ttl), alive)| {
                let outcome = if alive {
                    Renewed::Extended { ttl: *ttl }
                } else {
                    Renewed::Gone {
                        reason:
                            "the lease row expired or was taken over (another owner or version)"
                                .into(),
                    }
                };
                (*id, Ok(outcome))
            })
            .collect(),
        Err(e) => {
            let message = e.to_string();
            batch
                .iter()
                .map(|(id, name, ..)| {
                    let e = SqlError::Unavailable {
                        action: "renewing leases",
                        message: message.clone(),
                        source: None,
                    };
                    (*id, Err(inner.error(e, Some(name))))
                })
                .collect()
        }
    }
}

pub(crate) async fn release(
    inner: &Inner,
    held: &Held,
    name: &str,
    owner: &str,
) -> Result<Released, SqlError> {
    let sql = format!(
        "UPDATE {} SET owner = NULL, expires_at = NULL WHERE {} AND expires_at > {CLOCK}",
        inner.table,
        guard(name, owner, held.fence)
    );
    let request_timeout = inner.limits.request;
    let send = async || {
        with_session(inner, async |s| {
            bounded(
                "releasing the lease row",
                request_timeout,
                s.conn.query_drop(sql.as_str()),
            )
            .await?;
            Ok(if s.conn.affected_rows() > 0 {
                Released::Released
            } else {
                Released::NotHeld
            })
        })
        .await
    };
    let first_error = match send().await {
        Ok(released) => return Ok(released),
        Err(e) => e,
    };
    // The first send's outcome is unknown (a reset or a timeout: it may have been applied, its reply
    // lost). Resend once on a fresh session (a failed session is never pooled): the guard names this
    // hold's owner and version, so a resend never frees another hold. Finding nothing then cannot tell
    // "our first send freed it" from "it had expired": that is unknown, never `NotHeld`.
    tracing::debug!(error = %first_error, lock = name, "lease release failed; resending once");
    match send().await {
        Ok(Released::NotHeld) => Err(SqlError::Unavailable {
            action: "releasing the lease row",
            message: format!(
                "the outcome is unknown: the first release got no answer ({first_error}) and the \
                 resend found nothing of this hold's (freed by the first release, or expired)"
            ),
            source: None,
        }),
        Ok(released) => Ok(released),
        Err(_) => Err(first_error),
    }
}

/// `distlock break`: expires the lease of `name` if `owner` holds it unexpired (at version `fence`,
/// if given). The owner stays, so the broken holder's renewal and release find their lease expired
/// (lost), never released by them; waiters find it free at their next try. The expiry is
/// [`BROKEN`], not the clock: a renewal whose statement began before this one (its clock earlier)
/// and waited for the row re-checks `expires_at > clock` on the row this statement left, which an
/// expiry at the break's clock would pass (the renewal would undo the break); no clock is below
/// [`BROKEN`], and the acquire finds it free (`expires_at <= clock`). Whether it was expired.
pub(crate) async fn break_lease(
    inner: &Inner,
    name: &str,
    owner: &str,
    fence: Option<u64>,
) -> Result<bool, SqlError> {
    let version = fence.map_or_else(String::new, |f| format!(" AND fence = {f}"));
    let sql = format!(
        "UPDATE {} SET expires_at = {BROKEN} WHERE name = {} AND owner = {}{version} \
         AND expires_at > {CLOCK}",
        inner.table,
        literal(name.as_bytes()),
        literal(owner.as_bytes())
    );
    let request_timeout = inner.limits.request;
    with_session(inner, async |s| {
        bounded(
            "breaking the lease",
            request_timeout,
            s.conn.query_drop(sql),
        )
        .await?;
        Ok(s.conn.affected_rows() > 0)
    })
    .await
}

pub(crate) async fn inspect(inner: &Inner, name: &str) -> Result<LockInfo, SqlError> {
    let sql = format!(
        "SELECT owner, fence, TIMESTAMPDIFF(MICROSECOND, {CLOCK}, expires_at) FROM {} WHERE name = {}",
        inner.table,
        literal(name.as_bytes())
    );
    let request_timeout = inner.limits.request;
    let row: Option<(Option<Vec<u8>>, u64, Option<i64>)> = with_session(inner, async |s| {
        bounded(
            "reading the lease row",
            request_timeout,
            s.conn.query_first(sql),
        )
        .await
    })
    .await?;
    let mut info = LockInfo::default();
    if let Some((owner, fence, left)) = row {
        info.last_token = (fence > 0).then(|| FencingToken::new(fence));
        if let (Some(owner), Some(left)) = (owner, left.filter(|l| *l > 0)) {
            let mut h = HolderInfo::default();
            h.owner = Some(String::from_utf8_lossy(&owner).into_owned());
            h.token = info.last_token;
            h.remaining_lease = Some(Duration::from_micros(u64::try_from(left).unwrap_or(0)));
            info.holder = Some(h);
        }
    }
    Ok(info)
}
