//! Advisory mode's semaphore: a permit is one `GET_LOCK` slot name of the semaphore's,
//! [`permit_name`]`(name, slot)` for `slot` in `0..N`, held by a dedicated session for the guard's life,
//! as the mutex's `GET_LOCK` is (same session handling, `wait_timeout`, probe, renewal, release and
//! abandon as `advisory.rs`). MariaDB keeps any number of `GET_LOCK` names per session since 10.0.2.
//!
//! **Try** (one round trip for up to [`SLOTS_PER_STATEMENT`] permits, see [`layout::try_permit`]): if
//! the limit stored in `<table>_limit` is `N`, `GET_LOCK(slot, 0)` slot by slot from an offset of the
//! owner's (so that waiters spread over the slots), keeping the first got, then the fencing counter's
//! bump when the name's mutex is free. No limit stored yet: [`layout::store_limit`] (one autocommit
//! statement, refused while the name's mutex is held), then the try again. Another limit:
//! `LimitMismatch`, nothing taken.
//!
//! **Wait**: nothing in the server waits for "the first of N names", so a waiter waits in the server on
//! one slot, `GET_LOCK(slot, 1)` ([`PERMIT_WAIT_SLICE_SECS`]), the next slot at each slice, and tries
//! every slot between slices: a permit given back (or freed by its holder's death) on the slot waited
//! on is taken at once, one on another slot within a slice. A cancelled wait is ended by
//! `KILL QUERY`, and a slot won meanwhile given back, as the mutex's.
//!
//! [`permit_name`]: super::layout::permit_name
//! [`SLOTS_PER_STATEMENT`]: super::layout::SLOTS_PER_STATEMENT
//! [`PERMIT_WAIT_SLICE_SECS`]: super::layout::PERMIT_WAIT_SLICE_SECS

use distlock_core::raw::{AcquireRequest, Attempt, Grant, HolderInfo, LockInfo};
use distlock_core::{FencingToken, LockKind};
use mysql_async::prelude::Queryable as _;
use sha2::{Digest as _, Sha256};

use super::advisory::{self, session_changed, set_wait_timeout, Flavor, Held, Waiting};
use super::conn::{bounded, Session};
use super::layout::{self, permit_name, Slots, SLOTS_PER_STATEMENT};
use super::{Inner, MysqlLease};
use crate::error::SqlError;

/// A permit acquire's own state beside the session's ([`Waiting`]).
#[derive(Debug, Default)]
pub(crate) struct Acquiring {
    /// The owner's first slot: tries start there, waits start there.
    offset: Option<u32>,
    /// How many waits this acquire has started (the slot waited on moves on by one each time).
    rounds: u32,
    /// The slot the wait in the server is (or was last) on.
    waited: Option<u32>,
}

/// The owner's first slot of `limit`.
fn owner_offset(owner: &str, limit: u32) -> u32 {
    let digest = Sha256::digest(owner.as_bytes());
    u32::from_le_bytes([digest[0], digest[1], digest[2], digest[3]]) % limit.max(1)
}

/// What one permit statement answered.
struct Answer {
    stored: Option<u32>,
    slot: Option<i64>,
    id: u64,
    bumped: u64,
    token: Option<u64>,
}

async fn run_try(inner: &Inner, session: &mut Session, sql: String) -> Result<Answer, SqlError> {
    bounded("taking a permit", inner.limits.request, async {
        let mut result = session.conn.query_iter(sql).await?;
        let row: Vec<(Option<i64>, Option<u32>, u64)> = result.collect().await?;
        // `collect` has moved to the second statement's answer: the bump's OK packet.
        let bumped = result.affected_rows();
        let token = result.last_insert_id();
        result.drop_result().await?;
        Ok((row, bumped, token))
    })
    .await
    .and_then(|(row, bumped, token)| {
        let (slot, stored, id) = row
            .first()
            .copied()
            .ok_or_else(|| SqlError::Protocol("the permit statement returned no row".into()))?;
        Ok(Answer {
            stored,
            slot,
            id,
            bumped,
            token,
        })
    })
}

pub(crate) async fn try_acquire(
    inner: &Inner,
    waiting: &mut Waiting,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
    limit: u32,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let Some(limit_table) = inner.limit_table() else {
        return Err(no_limit_table(inner));
    };
    let name = request.name.as_str();
    let offset = *acquiring
        .offset
        .get_or_insert_with(|| owner_offset(&request.owner, limit));
    let (mut session, mut won) = match waiting.done.take() {
        Some((session, got)) => (session, acquiring.waited.filter(|_| got == Some(1))),
        None => match waiting.session.take() {
            Some(session) => (session, None),
            None => (inner.pool.checkout(&inner.opts, &inner.limits).await?, None),
        },
    };
    // On an error the session is dropped: closing it frees whatever slot it got.
    set_wait_timeout(inner, &mut session, request.lease).await?;
    let mut stored_now = false;
    let mut first = offset;
    let mut tried = 0;
    loop {
        let slots = match won.take() {
            Some(slot) => Slots::Won(slot),
            None => Slots::Walk {
                first,
                count: SLOTS_PER_STATEMENT.min(limit - tried),
            },
        };
        let sql = layout::try_permit(&inner.table, limit_table, name, limit, slots);
        let answer = match run_try(inner, &mut session, sql).await {
            Ok(answer) => answer,
            Err(e) => {
                undo_and_drop(inner, session).await;
                return Err(e);
            }
        };
        if answer.id != session.id {
            return Err(session_changed(session.id, answer.id));
        }
        let held_won = match slots {
            Slots::Won(slot) => Some(slot),
            Slots::Walk { .. } => None,
        };
        match (answer.stored, answer.slot) {
            (None, _) => {
                give_back(inner, &mut session, name, held_won).await?;
                if stored_now {
                    // The limit row could not be written: the name's mutex is held.
                    waiting.session = Some(session);
                    return Err(held_as_mutex(name));
                }
                store_limit(inner, &mut session, limit_table, name, limit).await?;
                stored_now = true;
                (first, tried) = (offset, 0);
            }
            (Some(stored), _) if stored != limit => {
                give_back(inner, &mut session, name, held_won).await?;
                waiting.session = Some(session);
                return Err(mismatch(inner, name, stored, limit));
            }
            (Some(_), Some(slot)) if slot >= 0 => {
                let slot = u32::try_from(slot).map_err(|_| {
                    SqlError::Protocol(format!("the permit statement answered slot {slot}"))
                })?;
                match answer.token {
                    Some(token) if token > 0 && answer.bumped > 0 => {
                        return grant(session, name, slot, token, request);
                    }
                    _ if answer.bumped == 0 => {
                        // Got a slot, but the name's mutex is held: give it back.
                        give_back(inner, &mut session, name, Some(slot)).await?;
                        waiting.session = Some(session);
                        return Err(held_as_mutex(name));
                    }
                    other => {
                        undo_and_drop(inner, session).await;
                        return Err(SqlError::Protocol(format!(
                            "the fencing counter statement changed {} rows, insert id {other:?}",
                            answer.bumped
                        )));
                    }
                }
            }
            (Some(_), _) => {
                // Every slot tried is busy (or the slot a wait won is no longer this session's).
                give_back(inner, &mut session, name, held_won).await?;
                if let Slots::Walk { count, .. } = slots {
                    tried += count;
                    first = (first + count) % limit;
                }
                if tried >= limit {
                    waiting.session = Some(session);
                    return Ok(Attempt::Busy { retry_after: None });
                }
            }
        }
    }
}

/// Gives back the slot a wait won (when the try does not turn it into a grant); on an error the
/// session is gone (dropped: closing it frees the slot).
async fn give_back(
    inner: &Inner,
    session: &mut Session,
    name: &str,
    slot: Option<u32>,
) -> Result<(), SqlError> {
    let Some(slot) = slot else {
        return Ok(());
    };
    bounded(
        "giving back a permit's slot",
        inner.limits.request,
        session.conn.query_drop(layout::release_slot(name, slot)),
    )
    .await
}

/// Writes the limit row of a name that has none (see [`layout::store_limit`]).
async fn store_limit(
    inner: &Inner,
    session: &mut Session,
    limit_table: &str,
    name: &str,
    limit: u32,
) -> Result<(), SqlError> {
    bounded(
        "storing the semaphore limit",
        inner.limits.request,
        session
            .conn
            .query_drop(layout::store_limit(limit_table, name, limit)),
    )
    .await
}

/// Gives back every `GET_LOCK` name of a session a permit statement failed on (which slot it got, if
/// any, is unknown), then drops it (closing it frees whatever the release could not).
async fn undo_and_drop(inner: &Inner, mut session: Session) {
    let undone = bounded(
        "undoing a failed permit",
        inner.limits.request,
        session.conn.query_drop("DO RELEASE_ALL_LOCKS()"),
    )
    .await;
    if let Err(e) = undone {
        tracing::debug!(error = %e, "releasing the slots of a failed permit failed; closing its session");
    }
    drop(session);
}

fn grant(
    session: Session,
    name: &str,
    slot: u32,
    token: u64,
    request: &AcquireRequest,
) -> Result<Attempt<MysqlLease>, SqlError> {
    let loss = session.loss_signal();
    let held = Held::new(
        session,
        Flavor::Advisory {
            key: permit_name(name, slot),
            mint: None,
        },
    );
    let mut grant = Grant::new(MysqlLease::Advisory(held))
        .with_token(FencingToken::new(token))
        .with_ttl(request.lease)
        .with_permit(slot.to_string());
    if let Some(loss) = loss {
        grant = grant.with_loss(loss);
    }
    Ok(Attempt::Acquired(grant))
}

/// Waits in the server on the next slot for one slice (see the module docs).
pub(crate) async fn wait(
    inner: &Inner,
    waiting: &mut Waiting,
    acquiring: &mut Acquiring,
    request: &AcquireRequest,
    limit: u32,
) -> Result<(), SqlError> {
    if !waiting.waiting_in_server() {
        let offset = *acquiring
            .offset
            .get_or_insert_with(|| owner_offset(&request.owner, limit));
        let slot = (offset + acquiring.rounds % limit.max(1)) % limit.max(1);
        acquiring.rounds = acquiring.rounds.wrapping_add(1);
        acquiring.waited = Some(slot);
    }
    let key = permit_name(&request.name, acquiring.waited.unwrap_or(0));
    advisory::wait(waiting, Flavor::Slot { key }, inner.limits.request).await
}

/// Ends a permit wait: `KILL QUERY` of a wait still in the server, and the slot it may have won
/// given back.
pub(crate) async fn abandon(
    inner: &Inner,
    waiting: Waiting,
    acquiring: &Acquiring,
    request: &AcquireRequest,
) {
    let key = permit_name(&request.name, acquiring.waited.unwrap_or(0));
    advisory::abandon(inner, waiting, request, Flavor::Slot { key }).await
}

/// The semaphore part of `inspect`: the stored limit and, if any slot is held, the holders (each
/// slot's `IS_USED_LOCK`, [`SLOTS_PER_STATEMENT`] slots per statement).
pub(crate) async fn inspect_permits(
    inner: &Inner,
    session: &mut Session,
    name: &str,
    info: &mut LockInfo,
) -> Result<(), SqlError> {
    let Some(limit_table) = inner.limit_table() else {
        return Ok(());
    };
    let limit: Option<u32> = bounded(
        "reading the semaphore limit",
        inner.limits.request,
        session
            .conn
            .query_first(layout::read_limit(limit_table, name)),
    )
    .await?;
    let Some(limit) = limit else {
        return Ok(());
    };
    // A row written by hand may hold any number; no permit is ever taken above `MAX_PERMITS`.
    let slots = limit.min(distlock_core::MAX_PERMITS);
    let mut first = 0;
    while first < slots {
        let count = SLOTS_PER_STATEMENT.min(slots - first);
        let row: Option<mysql_async::Row> = bounded(
            "reading the slots' holders",
            inner.limits.request,
            session
                .conn
                .query_first(layout::slot_holders(name, first, count)),
        )
        .await?;
        let Some(row) = row else {
            return Err(SqlError::Protocol("IS_USED_LOCK returned no row".into()));
        };
        for i in 0..count {
            let holder: Option<u64> = row.get::<Option<u64>, usize>(i as usize).flatten();
            if let Some(conn_id) = holder {
                let mut h = HolderInfo::default();
                h.owner = Some(layout::session_owner(conn_id));
                h.permit = Some((first + i).to_string());
                info.holders.push(h);
            }
        }
        first += count;
    }
    if !info.holders.is_empty() {
        info.kind = Some(LockKind::Permit { limit });
    }
    Ok(())
}

fn held_as_mutex(name: &str) -> SqlError {
    SqlError::KindConflict(format!(
        "{name:?} is held as a mutex (GET_LOCK('{}')), so a permit of a semaphore of that name is refused; \
         a name is one kind of lock",
        layout::advisory_name(name)
    ))
}

fn no_limit_table(inner: &Inner) -> SqlError {
    let limit_table = format!("{}{}", inner.config.table, layout::LIMIT_SUFFIX);
    if limit_table.len() > layout::MAX_SERVER_IDENTIFIER_LEN {
        // Not a permission the owner could grant: the server refuses the name itself.
        return SqlError::Config(format!(
            "semaphores need the table {limit_table}, whose name is longer than the server's {} \
             characters: use a ?table= name of at most {} characters",
            layout::MAX_SERVER_IDENTIFIER_LEN,
            layout::MAX_SERVER_IDENTIFIER_LEN - layout::LIMIT_SUFFIX.len()
        ));
    }
    SqlError::Denied {
        message: format!(
            "semaphores need the table {table}, which this role could not create or read when it connected: \
             have its owner run {create} and grant this role SELECT, INSERT and UPDATE on it, then reconnect",
            table = inner.limit_table_name,
            create = layout::create_limit_table(&inner.limit_table_name)
        ),
        source: None,
    }
}

fn mismatch(inner: &Inner, name: &str, stored: u32, requested: u32) -> SqlError {
    SqlError::LimitMismatch {
        stored,
        requested,
        message: format!(
            "the semaphore {name:?} has {stored} permits on the server; this one asked for {requested} (every \
             user must ask for the same). The limit is kept in {table}; to change it, once no permit is held: \
             DELETE FROM {table} WHERE name = {}",
            layout::literal(name.as_bytes()),
            table = inner.limit_table_name,
        ),
    }
}
