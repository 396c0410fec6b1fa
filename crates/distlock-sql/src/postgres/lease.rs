//! Lease mode: the optimistic lock. The name's row is a versioned lease: a grant is one conditional
//! upsert (free or expired → owner, `expires_at = now() + lease`, `version = version + 1`), the version is
//! the fencing token, renewals of every lease due in a watchdog tick are one `UPDATE … FROM unnest(…)`,
//! and a release clears the owner and `NOTIFY`s the waiters, who `LISTEN` on the control connection.
//! Expiry is on the database's clock. No connection is held, so it works through transaction-pooling
//! proxies (`LISTEN` then needs a session: without one, waiters fall back to the expiry hint).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use distlock_core::raw::{AcquireRequest, Attempt, Grant, Released, Renewal, RenewalId, Renewed};
use distlock_core::FencingToken;
use tokio_postgres::types::Type;

use super::backend::{Inner, LeaseKind, PgLease};
use super::conn::{self, Conn};
use super::wakeups::Wakeups;
use crate::error::SqlError;

/// The longest a waiter sleeps without a notification before trying again (a `NOTIFY` lost across a
/// reconnect of the control connection must not strand it until the holder's lease ends).
const MAX_NAP: Duration = Duration::from_secs(2);

/// An acquire under way in lease mode: subscribed to the wake-ups, and registered for the control
/// connection's `LISTEN`, at its first wait, which returns at once so the next try sees a release
/// that came before the `LISTEN` took effect.
#[derive(Debug, Default)]
pub(crate) struct Acquiring {
    wakeups: Wakeups,
}

/// A held lease: its version (the token), and a local upper bound of when the database expires it.
#[derive(Debug)]
pub(crate) struct Held {
    version: i64,
    /// No later than this the lease has expired on the database: the reply of the last statement that
    /// set `expires_at = now() + ttl` (the grant or a renewal) came after the database read `now()`, so
    /// reply time + ttl is at or after the database's expiry, up to the two clocks' rate difference
    /// ([`CLOCK_RATE_SLACK`]). A release sent after it cannot have cleared the lease (the update skips
    /// an expired one), which settles what a resend finds.
    expired_by: std::sync::Mutex<Instant>,
    /// A renewal of this lease went unanswered: the database may have applied it at any time since, so
    /// `expired_by` is no bound any more and a resend can never conclude `NotHeld`.
    renewal_unanswered: std::sync::atomic::AtomicBool,
}

/// The most the database's clock may run slower than ours over one lease (1,000 ppm, twice what NTP
/// lets a clock slew), plus a fixed 5 ms. The bound is on `std::time::Instant` (monotonic), not the
/// core's boot clock, on purpose: it says the lease *has* expired, so it needs the clock that never
/// runs ahead of the database's. The monotonic clock stops while this machine is suspended, so it can
/// only under-count; the boot clock counts the suspend, which a database in a VM on the same host
/// does not see until its clock is corrected, and would let a release conclude `NotHeld` early.
const CLOCK_RATE_SLACK: (u32, Duration) = (1_000, Duration::from_millis(5));

impl Held {
    fn new(version: i64, ttl: Duration) -> Self {
        Held {
            version,
            expired_by: std::sync::Mutex::new(expiry_bound(ttl)),
            renewal_unanswered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A renewal got no answer (it may have been applied).
    fn renewal_unanswered(&self) {
        self.renewal_unanswered
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the lease has certainly expired on the database by now.
    fn certainly_expired(&self) -> bool {
        !self
            .renewal_unanswered
            .load(std::sync::atomic::Ordering::Relaxed)
            && Instant::now() > self.expired_by()
    }

    /// A renewal of `ttl` was confirmed just now.
    fn extended(&self, ttl: Duration) {
        let bound = expiry_bound(ttl);
        let mut expired_by = self
            .expired_by
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *expired_by = (*expired_by).max(bound);
    }

    fn expired_by(&self) -> Instant {
        *self
            .expired_by
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Now (a reply just came) + `ttl` + the clocks' slack.
fn expiry_bound(ttl: Duration) -> Instant {
    let (ppm, fixed) = CLOCK_RATE_SLACK;
    Instant::now() + ttl + ttl / (1_000_000 / ppm) + fixed
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

pub(crate) async fn try_acquire(
    inner: &Inner,
    request: &AcquireRequest,
) -> Result<Attempt<PgLease>, SqlError> {
    let conn = inner.control().await?;
    let bound = inner.request_timeout();
    let take = inner.tables.take_lease();
    let name = request.name.as_str();
    let owner = request.owner.as_str();
    let taken = tokio::time::timeout(
        bound,
        conn.client.query_typed(
            &take,
            &[
                (&name, Type::TEXT),
                (&owner, Type::TEXT),
                (&ms(request.lease), Type::INT8),
            ],
        ),
    )
    .await;
    let rows = match taken {
        // Racing upserts under REPEATABLE READ / SERIALIZABLE (a transaction pooler can hand the
        // statement a session whose isolation distlock did not set), or a lock wait cut by a pooled
        // session's lock_timeout: another acquire won this round. Contention, tried again at once.
        Ok(Err(e)) if is_contention(&e) => {
            tracing::debug!(lock = %name, error = %e, "the lease upsert lost a race; trying again");
            return Ok(Attempt::Busy {
                retry_after: Some(Duration::ZERO),
            });
        }
        Ok(rows) => rows.map_err(|e| conn::map_error("taking the lease", e)),
        Err(_) => Err(SqlError::Timeout {
            action: "taking the lease",
            after: bound,
        }),
    };
    let rows = inner.forget_stalled_control(&conn, rows).await?;
    if let Some(row) = rows.first() {
        let version: i64 = row
            .try_get(0)
            .map_err(|e| SqlError::Protocol(format!("the lease version is {e}")))?;
        let token = u64::try_from(version)
            .ok()
            .filter(|v| *v > 0)
            .map(FencingToken::new)
            .ok_or_else(|| {
                SqlError::Protocol(format!("the lease version of {name:?} is {version}"))
            })?;
        return Ok(Attempt::Acquired(
            Grant::new(PgLease(LeaseKind::Lease(Held::new(version, request.lease))))
                .with_token(token)
                .with_ttl(request.lease),
        ));
    }
    let holder = inner.tables.lease_holder();
    let rows = Conn::bounded(
        "reading the holder",
        bound,
        conn.client.query_typed(&holder, &[(&name, Type::TEXT)]),
    )
    .await;
    let rows = inner.forget_stalled_control(&conn, rows).await?;
    let retry_after = rows
        .first()
        .and_then(|row| row.try_get::<_, i64>(2).ok())
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    Ok(Attempt::Busy {
        retry_after: Some(retry_after.unwrap_or(Duration::ZERO)),
    })
}

/// A statement that lost a race to a concurrent one: a serialization failure (40001), a deadlock
/// (40P01), or a lock wait cut by `lock_timeout` (55P03).
fn is_contention(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::T_R_SERIALIZATION_FAILURE
            || *c == SqlState::T_R_DEADLOCK_DETECTED
            || *c == SqlState::LOCK_NOT_AVAILABLE
    })
}

/// Sleeps until a release of this name is notified, or the holder's lease ends (`retry_after`), or
/// [`MAX_NAP`].
pub(crate) async fn wait(
    inner: &Inner,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
    retry_after: Option<Duration>,
) {
    let nap = retry_after.unwrap_or(MAX_NAP).min(MAX_NAP) + Duration::from_millis(5);
    acquiring
        .wakeups
        .wait(inner, request.name.as_str(), nap, "lease waits")
        .await;
}

/// Frees whatever lease this owner may hold on the name (a grant whose reply was lost).
pub(crate) async fn abandon(inner: &Inner, request: &AcquireRequest) {
    let undo = async {
        let conn = inner.control().await?;
        let sql = inner.tables.release_lease_of_owner();
        let name = request.name.as_str();
        let owner = request.owner.as_str();
        let undone = Conn::bounded(
            "undoing the acquire",
            inner.request_timeout(),
            conn.client
                .query_typed(&sql, &[(&name, Type::TEXT), (&owner, Type::TEXT)]),
        )
        .await;
        inner.forget_stalled_control(&conn, undone).await
    };
    if let Err(e) = undo.await {
        tracing::warn!(lock = %request.name, error = %e, "could not undo an abandoned lease acquire; it expires with its lease");
    }
}

/// Renews every lease of the batch in one statement.
pub(crate) async fn renew(
    inner: &Inner,
    batch: &[(&Renewal<'_, PgLease>, &Held)],
) -> Vec<(RenewalId, Result<Renewed, SqlError>)> {
    if batch.is_empty() {
        return Vec::new();
    }
    let names: Vec<&str> = batch.iter().map(|(e, _)| e.name).collect();
    let owners: Vec<&str> = batch.iter().map(|(e, _)| e.owner).collect();
    let versions: Vec<i64> = batch.iter().map(|(_, h)| h.version).collect();
    let ttls: Vec<i64> = batch.iter().map(|(e, _)| ms(e.ttl)).collect();
    let shortest = batch
        .iter()
        .map(|(e, _)| e.ttl)
        .min()
        .unwrap_or(Duration::MAX);
    let bound = inner.request_timeout().min(shortest);
    let renewed = async {
        let conn = inner.control().await?;
        let sql = inner.tables.renew_leases();
        let renewed = Conn::bounded(
            "renewing leases",
            bound,
            conn.client.query_typed(
                &sql,
                &[
                    (&names, Type::TEXT_ARRAY),
                    (&owners, Type::TEXT_ARRAY),
                    (&versions, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                ],
            ),
        )
        .await;
        inner.forget_stalled_control(&conn, renewed).await
    };
    match renewed.await {
        Ok(rows) => {
            let alive: HashSet<String> = rows.iter().filter_map(|r| r.try_get(0).ok()).collect();
            batch
                .iter()
                .map(|(entry, held)| {
                    let outcome = if alive.contains(entry.name) {
                        held.extended(entry.ttl);
                        Renewed::Extended { ttl: entry.ttl }
                    } else {
                        Renewed::Gone {
                            reason: "the lease row is no longer this owner's (expired, taken over or deleted)"
                                .into(),
                        }
                    };
                    (entry.id, Ok(outcome))
                })
                .collect()
        }
        Err(e) => {
            let message = e.to_string();
            batch
                .iter()
                .map(|(entry, held)| {
                    held.renewal_unanswered();
                    (
                        entry.id,
                        Err(SqlError::Unavailable {
                            action: "renewing leases",
                            message: message.clone(),
                            source: None,
                        }),
                    )
                })
                .collect()
        }
    }
}

/// Clears the owner if this owner still holds this version and the lease has not expired, and wakes
/// the waiters. An expired lease is `NotHeld` (the hold was lost, as the renewal would say). A release
/// sent on a control connection that broke (a reset link, or no answer within the bound) is sent once
/// more on a new one: the update is conditional on owner and version, so sending it twice is harmless,
/// and the resend reads what the first one did: the owner cleared at our version is our release
/// (`Released`); our lease expired is `NotHeld`; another version is `NotHeld` when the first release
/// was sent after [`Held::expired_by`] (it found the lease expired, so it cleared nothing and the
/// takeover came after the expiry), else `Unavailable`, outcome unknown (taken over after our release
/// or after the expiry, which cannot be told apart), never `NotHeld`.
pub(crate) async fn release(
    inner: &Inner,
    held: &Held,
    name: &str,
    owner: &str,
) -> Result<Released, SqlError> {
    let sent_after_expiry = held.certainly_expired();
    match release_once(inner, held, name, owner, None).await {
        Err(e) if conn::connection_closed(&e) || matches!(e, SqlError::Timeout { .. }) => {
            tracing::debug!(lock = %name, error = %e, "the release got no answer; sending it again");
            release_once(inner, held, name, owner, Some(sent_after_expiry)).await
        }
        released => released,
    }
}

async fn release_once(
    inner: &Inner,
    held: &Held,
    name: &str,
    owner: &str,
    // A resend: whether the first release was sent after the lease had expired on the database.
    resent: Option<bool>,
) -> Result<Released, SqlError> {
    let conn = inner.control().await?;
    let sql = inner.tables.release_lease();
    let row = Conn::bounded(
        "releasing the lease",
        inner.request_timeout(),
        conn.client.query_typed_one(
            &sql,
            &[
                (&name, Type::TEXT),
                (&owner, Type::TEXT),
                (&held.version, Type::INT8),
            ],
        ),
    )
    .await;
    let row = inner.forget_stalled_control(&conn, row).await?;
    let protocol = |e| SqlError::Protocol(format!("the lease release returned {e}"));
    let freed: bool = row.try_get(0).map_err(protocol)?;
    let was_owner: Option<String> = row.try_get(1).map_err(protocol)?;
    let was_version: Option<i64> = row.try_get(2).map_err(protocol)?;
    let was_expired: Option<bool> = row.try_get(3).map_err(protocol)?;
    if freed {
        return Ok(Released::Released);
    }
    if was_version != Some(held.version) {
        if resent == Some(false) {
            return Err(SqlError::Unavailable {
                action: "releasing the lease",
                message: "the first release got no answer and the resend found the lease taken over at \
                          another version: outcome unknown (the first release was applied, or the lease \
                          expired first)"
                    .into(),
                source: None,
            });
        }
        // Nothing of ours was released before (no earlier attempt, or it was sent after the lease
        // expired, so it cleared nothing): the lease expired and was taken over.
        return Ok(Released::NotHeld);
    }
    match (was_owner.as_deref(), was_expired) {
        // Cleared at our version: only our release does that (an earlier attempt, applied).
        (None, _) => Ok(Released::Released),
        // Still ours but expired: the hold was lost before the release.
        (Some(o), Some(true)) if o == owner => Ok(Released::NotHeld),
        // The row changed between the update and the read (a concurrent statement): nothing definite.
        _ => Err(SqlError::Unavailable {
            action: "releasing the lease",
            message: "the lease row changed while the release ran: outcome unknown".into(),
            source: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_is_certain_only_past_the_bound_and_never_after_an_unanswered_renewal() {
        let held = Held::new(1, Duration::from_millis(1));
        assert!(!held.certainly_expired(), "inside lease + slack");
        std::thread::sleep(Duration::from_millis(20));
        assert!(held.certainly_expired(), "past lease + slack");
        // A renewal that may have been applied moves the database's expiry out of our sight.
        held.renewal_unanswered();
        assert!(!held.certainly_expired());
        // A confirmed renewal moves the bound later, never earlier.
        let held = Held::new(1, Duration::from_secs(60));
        held.extended(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !held.certainly_expired(),
            "the grant's 60 s bound still stands"
        );
    }
}
