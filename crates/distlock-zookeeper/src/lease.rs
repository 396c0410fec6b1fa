//! Held locks: the lease record, renewals (per session: one `sync`, which the leader answers, and an
//! `exists` of each own node, pipelined in one round trip), the record of each hold on its session
//! (whose task watches the own node and the session's state, and runs the client-side expiry of a lock
//! whose renewals stopped, `max_hold`: `held.rs`), and release (delete of the own node only,
//! idempotent; a write hold's records its token in the same `multi`: `rw.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::clock::{self, Instant};
use distlock_core::raw::{LossReport, Released, Renewal, RenewalId, Renewed};
use distlock_core::LockKind;
use zookeeper_client as zk;

use crate::cleanup::{self, Leftover};
use crate::config::ZkConfig;
use crate::error::{retryable, session_gone, ZkError, BACKEND};
use crate::session::Session;

/// A held lock: its node, czxid (the token) and session, and its record among the session's held
/// nodes (`held.rs`: the watch that reports its loss, the `max_hold` timer that deletes the node once
/// its lease runs out unrenewed).
#[derive(Debug)]
pub struct ZkLease {
    pub(crate) session: Arc<Session>,
    /// The own node's full path (shared with its record).
    pub(crate) node: Arc<str>,
    pub(crate) czxid: i64,
    /// Its record's id in `session.held`.
    record: u64,
    /// What the hold is (a write release records its token: `rw.rs`).
    pub(crate) kind: LockKind,
}

impl ZkLease {
    /// A granted hold, recorded on its session: its node is watched from now on (losses go to `lost`)
    /// and deleted if its lease runs out unrenewed (`ttl` from now, pushed on by renewals): the
    /// watchdog stops renewing at `max_hold`, but the session keeps itself alive with pings, so
    /// without it the node would outlive the hold.
    pub(crate) fn new(
        session: Arc<Session>,
        node: Arc<str>,
        czxid: i64,
        ttl: Duration,
        lost: &LossReport,
    ) -> Self {
        let record = session
            .held
            .register(node.clone(), czxid, clock::now() + ttl, lost);
        Self {
            session,
            node,
            czxid,
            record,
            kind: LockKind::Mutex,
        }
    }

    /// The same hold, of `kind`.
    pub(crate) fn with_kind(mut self, kind: LockKind) -> Self {
        self.kind = kind;
        self
    }

    /// Forgets the record: nothing is reported for this hold any more, its timer is gone.
    pub(crate) fn forget(&self) {
        self.session.held.forget(self.record);
    }

    fn extend_to(&self, at: Instant) {
        self.session.held.extend(self.record, at);
    }
}

impl Drop for ZkLease {
    fn drop(&mut self) {
        self.forget();
    }
}

/// Deletes an own node (any version), retried on the same session while requests get no answer (the
/// client reconnects within the session), for at most the request timeout.
///
/// * Deleted: `Released`. Not there: `NotHeld` (deleted by someone else, or its session expired) —
///   unless an earlier attempt got no answer: that attempt may have deleted it, and the node's path is
///   unique to this acquire on this session, so the node being gone means this hold's delete landed
///   (or another delete of the same node did): `Released`, never `NotHeld` (issue 24).
/// * No answer by the bound: the delete is finished in the background once the session is connected
///   again (see `cleanup`) and the error says the outcome is unknown (`Unavailable`).
pub(crate) async fn delete_node(
    config: &ZkConfig,
    session: &Arc<Session>,
    path: &str,
) -> Result<Released, ZkError> {
    delete_node_recording(config, session, path, None).await
}

/// [`delete_node`], with `record` (a write release's token, `rw.rs`) set in the same `multi` as the
/// delete, so it is set exactly when the node is deleted by this call.
pub(crate) async fn delete_node_recording(
    config: &ZkConfig,
    session: &Arc<Session>,
    path: &str,
    record: Option<&crate::rw::WriteRecord>,
) -> Result<Released, ZkError> {
    if session.runtime_gone() {
        // Not a definite "not held": the node lives until the server expires the session.
        return Err(ZkError::SessionLost(format!(
            "the tokio runtime the ZooKeeper {} ran on is gone, so it cannot delete {path}; the node goes when the server expires the session (within its timeout)",
            session.describe()
        )));
    }
    if session.is_gone() {
        return Ok(Released::NotHeld);
    }
    let bound = config.connection.request_timeout;
    let deadline = tokio::time::Instant::now() + bound;
    let mut retries = config.connection.retry.start(Some(deadline));
    // Why the last attempt got no answer, once one did: it may have been applied.
    let mut unanswered: Option<String> = None;
    let why = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let delete = crate::rw::delete_recording(&session.client, path, None, record);
        let source = match tokio::time::timeout(left, delete).await {
            Ok(Ok(())) => return Ok(Released::Released),
            Ok(Err(zk::Error::NoNode)) if unanswered.is_some() => {
                tracing::debug!(%path, "a resent delete found the node gone: the unanswered one landed");
                return Ok(Released::Released);
            }
            Ok(Err(zk::Error::NoNode)) => return Ok(Released::NotHeld),
            Ok(Err(source)) if session_gone(&source) => match unanswered {
                // The node went with the session, maybe after the unanswered delete had landed.
                Some(why) => break format!("{why}; then the session ended ({source})"),
                None => return Ok(Released::NotHeld),
            },
            Ok(Err(source)) if retryable(&source) => source,
            Ok(Err(source)) => {
                return Err(ZkError::Request {
                    action: "delete",
                    source,
                })
            }
            Err(_) => break format!("no answer within {bound:?}"),
        };
        unanswered = Some(source.to_string());
        match retries.next_delay() {
            Some(delay) => tokio::time::sleep(delay).await,
            None => break source.to_string(),
        }
    };
    cleanup::remove_later(config, session, Leftover::Node(path.to_string()));
    Err(ZkError::DeleteUnanswered {
        path: path.to_string(),
        why,
    })
}

/// Releases a held lock: deletes the own node (its path is unique to this acquire).
/// The hold is forgotten first (its watch would see the release's own delete).
pub(crate) async fn release(config: &ZkConfig, held: &ZkLease) -> Result<Released, ZkError> {
    held.forget();
    let record = crate::rw::release_record(held);
    delete_node_recording(config, &held.session, &held.node, record.as_ref()).await
}

/// Renews a batch: per session, a `sync` (served through the leader, so a follower cut off from the
/// leader cannot confirm a session the leader may have expired) followed by an `exists` of each own
/// node, sent together. Extended by `min(asked, session timeout)` from the moment the requests were sent,
/// cut to what the proven leader touch leaves (issue 10: the `sync` does not touch the session on the
/// leader, so the leader's last touch can predate the send; see `session::LeaderTouch`). Nothing left:
/// unconfirmed (Jeopardy).
///
/// Cadence: the core renews after a third of the TTL reported. The floor is the newest earlier
/// confirmation at least the touch report lag `L` old (0.375·timeout + 50 ms with the default tickTime
/// guess), so with renewals every `R = TTL/3` the TTL is `timeout − k·R` for the smallest `k` with
/// `k·R ≥ L`. At the default 60 s timeout, `L` = 22.55 s: `k = 1` (`R` = 15 s) is too recent; `k = 2`
/// (`R = timeout/5` = 12 s, TTL 0.6·timeout) and `k = 3` (`R = timeout/6`, TTL 0.5·timeout, where it
/// lands from a fresh grant) both hold. At 600 ms, `L` = 275 ms: `k = 3`, TTL ≈ 255 ms, renewed every
/// ≈ 85 ms. Either way each renewal is answered more than a third of a TTL before the deadline the last
/// one set, so the guard stays Held while the follower reaches the leader (unit test
/// `steady_state_renewals_stay_confirmed_at_the_default_and_the_test_timeouts`).
pub(crate) async fn renew(
    config: &ZkConfig,
    batch: &[Renewal<'_, ZkLease>],
) -> Vec<(RenewalId, distlock_core::Result<Renewed>)> {
    let mut groups: HashMap<usize, Vec<&Renewal<'_, ZkLease>>> = HashMap::new();
    for entry in batch {
        groups
            .entry(Arc::as_ptr(&entry.lease.session) as usize)
            .or_default()
            .push(entry);
    }
    let rounds = groups
        .into_values()
        .map(|entries| renew_session(config, entries));
    futures_util::future::join_all(rounds)
        .await
        .into_iter()
        .flatten()
        .collect()
}

async fn renew_session(
    config: &ZkConfig,
    entries: Vec<&Renewal<'_, ZkLease>>,
) -> Vec<(RenewalId, distlock_core::Result<Renewed>)> {
    let Some(first) = entries.first() else {
        return Vec::new();
    };
    let session = first.lease.session.clone();
    if session.is_gone() {
        let reason = format!("the ZooKeeper {} expired or closed", session.describe());
        return entries
            .iter()
            .map(|e| {
                (
                    e.id,
                    Ok(Renewed::Gone {
                        reason: reason.clone(),
                    }),
                )
            })
            .collect();
    }
    if session.client.state() == zk::SessionState::Disconnected {
        // The client queues requests until it reconnects: no reply can come now, so the renewal fails
        // at once (Jeopardy now, retried soon) rather than after the request bound.
        let message = format!(
            "renewal: the ZooKeeper {} is disconnected (reconnecting within its timeout)",
            session.describe()
        );
        return unconfirmed(&entries, &message);
    }
    // On the core's boot clock, which counts a suspend: the leader's clock does.
    let sent_at = clock::now();
    let client = &session.client;
    // Sent in this order on one session, answered in this order: the reads see the leader's view.
    let sync = client.sync("/");
    let checks: Vec<_> = entries
        .iter()
        .map(|e| client.check_stat(&e.lease.node))
        .collect();
    let round = async { (sync.await, futures_util::future::join_all(checks).await) };
    let bound = config.connection.request_timeout.min(session.timeout);
    let (synced, stats) = match tokio::time::timeout(bound, round).await {
        Ok(answers) => answers,
        Err(_) => {
            let error = ZkError::Timeout {
                action: "renewal (sync + exists)",
                after: bound,
            };
            return unconfirmed(&entries, &error.to_string());
        }
    };
    if synced.is_ok() {
        session.leader_confirmed(sent_at);
    }
    entries
        .iter()
        .zip(stats)
        .map(|(entry, stat)| {
            let outcome = match (&synced, &stat) {
                (Err(source), _) | (Ok(()), Err(source)) if session_gone(source) => {
                    Ok(Renewed::Gone {
                        reason: format!("the ZooKeeper {} expired", session.describe()),
                    })
                }
                (Err(source), _) => Err(ZkError::Request {
                    action: "renewal (sync)",
                    source: source.clone(),
                }
                .into_core(Some(entry.name))),
                (Ok(()), Err(source)) => Err(ZkError::Request {
                    action: "renewal (exists)",
                    source: source.clone(),
                }
                .into_core(Some(entry.name))),
                (Ok(()), Ok(Some(stat))) if stat.czxid == entry.lease.czxid => {
                    match session.leader_ttl(entry.ttl.min(session.timeout), sent_at) {
                        Some(ttl) => {
                            entry.lease.extend_to(sent_at + ttl);
                            Ok(Renewed::Extended { ttl })
                        }
                        None => Err(unproven_touch(&session).into_core(Some(entry.name))),
                    }
                }
                (Ok(()), Ok(_)) => Ok(Renewed::Gone {
                    reason: format!(
                        "the lock node {} is gone (deleted, or its session expired)",
                        entry.lease.node
                    ),
                }),
            };
            (entry.id, outcome)
        })
        .collect()
}

/// The session's last touch on the leader is not proven recent enough to trust it any longer.
pub(crate) fn unproven_touch(session: &Session) -> ZkError {
    ZkError::Unconfirmed(format!(
        "the ZooKeeper {} has no touch by the leader proven within its timeout (is the server cut off from the leader?)",
        session.describe()
    ))
}

/// Every entry's renewal unconfirmed (`Unavailable`: Jeopardy, retried soon).
fn unconfirmed(
    entries: &[&Renewal<'_, ZkLease>],
    message: &str,
) -> Vec<(RenewalId, distlock_core::Result<Renewed>)> {
    entries
        .iter()
        .map(|e| {
            let err = distlock_core::Error::new(distlock_core::ErrorKind::Unavailable, message)
                .with_backend(BACKEND)
                .with_lock(e.name);
            (e.id, Err(err))
        })
        .collect()
}
