//! Advisory mode's semaphore: a permit is a slot key of the name's (see [`layout::permit_key`]) plus the
//! name's key shared, both held by a dedicated connection's session for the life of the guard, as a
//! session lock is (same connection handling, idle bound, probe, renewal and abandon as `session.rs`).
//!
//! **Try** (one round trip: the probe and one statement, [`Tables::try_permit`]): if the stored limit
//! is the one asked for, the name's key shared, then the first free slot, then the fencing counter's
//! bump, committed before the answer. No limit stored yet: the name's key exclusive and the limit row
//! (once per name, [`Tables::store_limit`]), then the try again. Another limit: `LimitMismatch`, nothing
//! taken.
//!
//! **Wait**: no server-side wait fits "the first of N keys", so a waiter hands its connection back to
//! the idle pool (a waiting permit holds no server session) and sleeps until a permit release of the
//! name is notified (`NOTIFY` on the table's channel, `LISTEN`ed on the control connection only while
//! a waiter is registered, `Inner::listen`; the first wait registers and returns at once, so the try
//! after it sees a release that came before the `LISTEN`) or [`POLL`] (jittered down to half) has
//! passed: a holder whose session ended
//! (a killed process, `pg_terminate_backend`, its idle bound) frees its slot at once on the server but
//! notifies nobody, and a mutex or writer that lets the key go notifies nobody either.
//!
//! [`Tables::try_permit`]: super::layout::Tables::try_permit
//! [`Tables::store_limit`]: super::layout::Tables::store_limit

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant};
use distlock_core::FencingToken;
use tokio_postgres::types::Type;

use super::backend::{Inner, LeaseKind, PgLease};
use super::conn::{Conn, Params};
use super::layout;
use super::session::{self, Held, Hold};
use super::wakeups::Wakeups;
use crate::config::AdvisoryKey;
use crate::error::SqlError;

/// The longest a permit waiter sleeps without a notification before it tries again (jittered to
/// between half of it and all of it, so waiters that woke together do not poll together): the bound
/// on noticing a permit freed without a release (its holder's session ended).
pub(crate) const POLL: Duration = Duration::from_secs(1);

/// A permit acquire's wake-ups: subscribed, and registered for the control connection's `LISTEN`, at
/// its first wait, which then returns at once so the next try sees a release that came before the
/// `LISTEN` took effect (an uncontended acquire never listens).
#[derive(Debug, Default)]
pub(crate) struct Acquiring {
    wakeups: Wakeups,
}

/// What one permit statement answered.
enum Outcome {
    /// No limit stored for the name yet.
    NoLimit,
    /// Another limit is stored.
    Mismatch(u32),
    /// Every slot is taken, or the name's key is held exclusive (or a writer waits for it).
    Busy,
    /// This slot, with this token.
    Granted(u32, FencingToken),
}

pub(crate) async fn try_acquire(
    inner: &Arc<Inner>,
    session: &mut session::Acquiring,
    request: &AcquireRequest,
    limit: u32,
) -> Result<Attempt<PgLease>, SqlError> {
    let requested = i32::try_from(limit)
        .map_err(|_| SqlError::Config(format!("a semaphore of {limit} permits")))?;
    // Refused before anything is sent (see `session::try_acquire`).
    session::check_lease(request.lease)?;
    let key = layout::key_for(&request.name, inner.config.key);
    let first_slot = layout::permit_key(&request.name, 0);
    let name = request.name.as_str();
    let bound = inner.request_timeout();
    session.clean = false;
    session::connection(inner, session).await?;
    let mut stored_now = false;
    loop {
        let conn = session::conn_of(session)?;
        let sql = inner.tables.try_permit(key);
        let (slot_a, slot_b) = layout::pair(first_slot);
        let params = Params::default()
            .text(name)
            .int4(requested)
            .key(key)
            .key(AdvisoryKey::Pair(slot_a, slot_b));
        let (probed, answered) = futures_util::future::join(
            session::probe_for_try(conn, request.lease, bound),
            Conn::bounded(
                "taking a permit",
                bound,
                conn.query_one_cached(&sql, &params.refs()),
            ),
        )
        .await;
        // On an error the session may hold a slot and the key: `clean` stays false, so the abandon
        // unlocks everything of the session before it closes the connection.
        probed?;
        let row = answered.map_err(|e| limit_table_error(inner, e))?;
        match outcome(&row, name, limit)? {
            Outcome::Granted(slot, token) => {
                let Some(conn) = session.conn.take() else {
                    return Err(SqlError::Protocol("internal error: no connection".into()));
                };
                let loss = conn.loss_signal();
                let hold = Hold::Permit {
                    key,
                    slot: layout::permit_key(name, slot),
                };
                let held = Held::new(conn, hold);
                return Ok(Attempt::Acquired(
                    Grant::new(PgLease(LeaseKind::Session(Box::new(held))))
                        .with_token(token)
                        .with_ttl(request.lease)
                        .with_permit(slot.to_string())
                        .with_loss(loss),
                ));
            }
            Outcome::Busy => {
                session.clean = true;
                return Ok(Attempt::Busy { retry_after: None });
            }
            Outcome::Mismatch(stored) => {
                session.clean = true;
                return Err(mismatch(inner, name, stored, limit));
            }
            Outcome::NoLimit if stored_now => {
                return Err(SqlError::Protocol(format!(
                    "the semaphore limit of {name:?} was stored but is not there"
                )));
            }
            Outcome::NoLimit => {
                if !store_limit(inner, conn, key, name, requested).await? {
                    // The name is held as another kind (or another first permit is storing its
                    // limit): busy, as the key's holders exclude permits.
                    session.clean = true;
                    return Ok(Attempt::Busy { retry_after: None });
                }
                stored_now = true;
            }
        }
    }
}

/// Reads the permit statement's row.
fn outcome(row: &tokio_postgres::Row, name: &str, requested: u32) -> Result<Outcome, SqlError> {
    let protocol = |e| SqlError::Protocol(format!("the permit statement returned {e}"));
    let stored: Option<i32> = row.try_get(0).map_err(protocol)?;
    let slot: Option<i32> = row.try_get(1).map_err(protocol)?;
    let token: Option<i64> = row.try_get(2).map_err(protocol)?;
    let Some(stored) = stored else {
        return Ok(Outcome::NoLimit);
    };
    let stored = u32::try_from(stored)
        .map_err(|_| SqlError::Protocol(format!("the semaphore limit of {name:?} is {stored}")))?;
    match (slot, token) {
        (None, _) if stored != requested => Ok(Outcome::Mismatch(stored)),
        (Some(-1 | -2), _) => Ok(Outcome::Busy),
        (Some(slot), Some(token)) if slot >= 0 => {
            let token = u64::try_from(token)
                .ok()
                .filter(|t| *t > 0)
                .map(FencingToken::new)
                .ok_or_else(|| {
                    SqlError::Protocol(format!("the fencing counter of {name:?} is {token}"))
                })?;
            Ok(Outcome::Granted(slot.unsigned_abs(), token))
        }
        (slot, token) => Err(SqlError::Protocol(format!(
            "the permit statement answered slot {slot:?}, token {token:?}"
        ))),
    }
}

/// Stores the limit of a name that has none, under the name's key held exclusive (so no reader holds
/// the key meanwhile, and whoever gets it afterwards sees the row); the key is let go after the row's
/// commit. Whether the key was got (`false`: someone holds the name).
async fn store_limit(
    inner: &Inner,
    conn: &Conn,
    key: AdvisoryKey,
    name: &str,
    limit: i32,
) -> Result<bool, SqlError> {
    let bound = inner.request_timeout();
    let sql = inner.tables.store_limit(key);
    let row = Conn::bounded(
        "storing the semaphore limit",
        bound,
        conn.client
            .query_typed_one(&sql, &[(&name, Type::TEXT), (&limit, Type::INT4)]),
    )
    .await
    .map_err(|e| limit_table_error(inner, e))?;
    let got: bool = row
        .try_get(0)
        .map_err(|e| SqlError::Protocol(format!("storing the semaphore limit returned {e}")))?;
    if got {
        let unlock = layout::advisory(key, "pg_advisory_unlock");
        Conn::bounded(
            "storing the semaphore limit",
            bound,
            conn.client.batch_execute(&unlock),
        )
        .await?;
    }
    Ok(got)
}

/// The limit table is missing (a role that could not create it at connect), or this role may not use
/// it: say what to run.
fn limit_table_error(inner: &Inner, e: SqlError) -> SqlError {
    let table = &inner.tables.limit;
    match e {
        SqlError::TableShape(message) => SqlError::Denied {
            message: format!(
                "{message}; semaphores need the table {table}: have its owner run CREATE TABLE {table} (name \
                 text COLLATE \"C\" PRIMARY KEY, permits integer NOT NULL) and grant this role SELECT and \
                 INSERT on it"
            ),
            source: None,
        },
        SqlError::Denied { message, source } => SqlError::Denied {
            message: format!("{message}; semaphores need SELECT and INSERT on {table}"),
            source,
        },
        other => other,
    }
}

fn mismatch(inner: &Inner, name: &str, stored: u32, requested: u32) -> SqlError {
    let literal = name.replace('\'', "''");
    SqlError::LimitMismatch {
        stored,
        requested,
        message: format!(
            "the semaphore {name:?} has {stored} permits on the server; this one asked for {requested} (every \
             user must ask for the same). The limit is kept in {}; to change it, once no permit is held: \
             DELETE FROM {} WHERE name = '{literal}'",
            inner.tables.limit, inner.tables.limit
        ),
    }
}

/// Hands the connection back (a busy try left nothing on its session) and sleeps until a permit of
/// the name is released or the jittered [`POLL`] bound passes.
pub(crate) async fn wait(
    inner: &Arc<Inner>,
    session: &mut session::Acquiring,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
) {
    session::park(inner, session).await;
    let nap = distlock_core::retry::jitter(POLL);
    acquiring
        .wakeups
        .wait(inner, request.name.as_str(), nap, "permit waits")
        .await;
}
