//! Holding: the grant (TTL capped by the session's confirmed lease, loss signal from the session and
//! the held-keys watch), renewals (one keep-alive per session), the client-side expiry of a lock whose
//! own lease is shorter than its session's, and the release. See [`crate::backend`] for the whole
//! picture.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::clock;
use distlock_core::raw::{
    AcquireRequest, Grant, HandOff, LossReport, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::{ErrorKind, FencingToken, LockKind, Result};

use crate::acquire::{header_rev, Position};
use crate::backend::{EtcdBackend, Inner};
use crate::claims::Doomed;
use crate::error::BACKEND;
use crate::expiry::{Expiries, ExpirySlot, Rearmed};
use crate::layout;
use crate::rpc::pb::etcdserverpb::response_op::Response as OpResponse;
use crate::rpc::pb::etcdserverpb::TxnResponse;
use crate::session::{KeepAlive, Session};

/// A held lock: its key, create_revision (the token) and session, and the client-side expiry of the
/// lock's own lease.
pub struct EtcdLease {
    pub(crate) key: Arc<str>,
    pub(crate) rev: i64,
    pub(crate) session: Arc<Session>,
    /// Its deadline in the backend's expiries (see `expiry.rs`); none once released.
    pub(crate) expiry: ExpirySlot,
    /// The lock's loss channel (the expiry task and the held-keys watch report on it).
    pub(crate) lost: LossReport,
    /// The local claim on `key`, passed on only once the key is known deleted.
    pub(crate) claim: u64,
    /// The held-keys watch id.
    pub(crate) watch_id: i64,
    /// For the delete of a lease dropped without a release (the core's release task ran on a runtime
    /// that was dropped).
    pub(crate) backend: Weak<Inner>,
    /// A failed release already handed the key to the retried deletes (with its owner): the drop must
    /// not hand it again.
    pub(crate) handed_off: std::sync::atomic::AtomicBool,
    /// What the hold is (a writer's release records its token for readers; only a mutex is handed
    /// off).
    pub(crate) kind: LockKind,
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let released = Expiries::released(&self.expiry);
        let Some(inner) = self.backend.upgrade() else {
            return;
        };
        // Not the expiry task's any more: the retried deletes below (or those of a failed release)
        // delete the key.
        inner.expiries.remove(&self.expiry);
        if released || self.handed_off.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let backend = EtcdBackend { inner };
        backend.inner.held.unwatch(self.watch_id);
        // By create_revision, so a newer key of the name is never touched; a key already deleted (a
        // failed release retried, an undo) just passes. The retrier starts on the current runtime, or
        // on the next one the backend is used on.
        backend.retry_delete(self.doomed(String::new()));
    }
}

impl std::fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLease")
            .field("key", &self.key)
            .field("create_revision", &self.rev)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl EtcdLease {
    /// The lock key, `NAME/<lease hex>`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key's create_revision: the fencing token of a mutex or writer hold, and of a permit
    /// granted by the txn that created its key. A permit granted at a later try carries the revision
    /// of that try's write instead (the key's mod_revision, `layout::permit_grant_txn`); a reader the
    /// last write's. Releases, expiries and deletes compare the create_revision.
    pub fn create_revision(&self) -> i64 {
        self.rev
    }

    /// The session lease id.
    pub fn lease_id(&self) -> i64 {
        self.session.id
    }

    /// This hold's key as a delete to retry: by create_revision, so a newer key of the name is never
    /// touched, passing on the claim once done.
    fn doomed(&self, owner: String) -> Doomed {
        Doomed {
            key: self.key.clone(),
            rev: Some(self.rev),
            owner,
            session: self.session.clone(),
            claim: self.claim,
            not_before: None,
        }
    }
}

/// The held-key watch an acquisition makes for its own key once it queues behind another (in
/// [`HeldKeys`](crate::held::HeldKeys), from the server's current revision, so synced): by the time its
/// predecessor goes, it is confirmed, and the grant that follows needs no round trip for it.
#[derive(Debug)]
pub(crate) struct QueuedWatch {
    pub(crate) id: i64,
    pub(crate) lost: LossReport,
    /// Held unread so that the first confirmation is taken (a dropped receiver would make the
    /// watch task re-read the key, a round trip for nothing while the key is queued).
    pub(crate) first_confirmation: tokio::sync::oneshot::Receiver<i64>,
}

impl EtcdBackend {
    /// The grant of `found`'s key. `queued` is the held-key watch its acquisition made while it
    /// waited (see [`QueuedWatch`]); without one (granted at the first try) the watch is made now.
    pub(crate) async fn grant(
        &self,
        found: Position,
        claim: u64,
        lease: Duration,
        queued: Option<QueuedWatch>,
        kind: LockKind,
    ) -> Grant<EtcdLease> {
        let Position {
            session,
            key,
            rev,
            alive_at: read_rev,
            ..
        } = found;
        let ttl = lease.min(session.remaining());
        let (lost, watch_id, confirmed) = match queued {
            Some(queued) => {
                // Kept alive until now, so its first confirmation was taken (no re-read) and
                // recorded on the entry.
                drop(queued.first_confirmation);
                let confirmed = self.inner.held.confirmation(queued.id);
                (queued.lost, queued.id, confirmed)
            }
            None => {
                let lost = LossReport::new();
                // The key existed at the grant's read: a watch (re)made after that re-reads it
                // unless the store has not moved since (`from` is that read + 1). A watch kept from
                // an earlier release of this key (a loop of acquire and release) is taken as one
                // made while queued: confirmed before the read, it needs no round trip.
                match self
                    .inner
                    .held
                    .take_lingering(&key, rev, read_rev + 1, &lost)
                {
                    Some(id) => {
                        let confirmed = self.inner.held.confirmation(id);
                        (lost, id, confirmed)
                    }
                    None => {
                        let (id, confirmed) =
                            self.inner
                                .held
                                .watch(key.clone(), rev, read_rev + 1, lost.clone());
                        (lost, id, Err(confirmed))
                    }
                }
            }
        };
        let expires = clock::now().saturating_add(lease);
        let token = FencingToken::new(rev.unsigned_abs());
        match confirmed {
            // The watch made while queued was confirmed (on the stream still open) at or before
            // the grant's read, which found the key: every later delete reaches it. No round trip.
            Ok(created_at) if created_at <= read_rev => {}
            // Confirmed after the read (or made again since): a delete in between is found by
            // reading the key.
            Ok(created_at) => {
                self.recheck_granted(&key, rev, &lost, watch_id, created_at)
                    .await
            }
            Err(confirmed) => {
                self.await_watch(&key, rev, read_rev, confirmed, &lost, watch_id)
                    .await
            }
        }
        // Every hold has a deadline (see `expiry.rs`): the session outlives a hold the core stopped
        // renewing.
        let expiry =
            self.inner
                .expiries
                .insert(expires, key.clone(), rev, lost.clone(), session.clone());
        self.ensure_expiry();
        // After the insert: a session marked gone before it is seen here, one marked gone after it
        // finds the hold among the deadlines ([`Expiries::session_gone`]).
        if let Some(reason) = session.gone_reason() {
            lost.report(reason);
        }
        let loss = lost.signal();
        let held = EtcdLease {
            key,
            rev,
            session,
            expiry,
            lost,
            claim,
            watch_id,
            backend: Arc::downgrade(&self.inner),
            handed_off: std::sync::atomic::AtomicBool::new(false),
            kind,
        };
        Grant::new(held)
            .with_token(token)
            .with_ttl(ttl)
            .with_loss(loss)
    }

    /// Waits for the held-key watch made at a grant (read at `read_rev`), so that a delete after the
    /// grant reaches this holder from the same event as the next waiter, whose watch sees the same
    /// delete (etcd sends an event to every synced watch in one pass; that waiter then needs one more
    /// round trip, though the two processes are not ordered in real time). The
    /// watch starts at the revision it was created at: if the store moved since the grant's read, the
    /// key is read again, so a delete in between is `Lost` before the grant is even returned. A watch
    /// not confirmed in time (the stream broke and is not back yet, or it is on a member that stopped
    /// answering without closing the connection) leaves the grant as it is: the watch task re-reads
    /// the key once the watch is made again. In time is the request's hedge bound (a quarter of the
    /// request timeout) when there are several members: a paused member holding the watch stream
    /// must not cost every grant the whole request timeout (the stream moves to another member once
    /// its HTTP/2 keep-alive fails).
    async fn await_watch(
        &self,
        key: &str,
        rev: i64,
        read_rev: i64,
        confirmed: tokio::sync::oneshot::Receiver<i64>,
        lost: &LossReport,
        watch_id: i64,
    ) {
        let request_timeout = self.inner.config.connection.request_timeout;
        let timeout = crate::conn::hedge_after(&self.inner.config, request_timeout)
            .unwrap_or(request_timeout);
        let mut confirmed = confirmed;
        let created_at = match tokio::time::timeout(timeout, &mut confirmed).await {
            Ok(Ok(revision)) => revision,
            Ok(Err(_)) => return,
            Err(_) => {
                // Closed before giving up: a confirmation sent just as the time ran out is either
                // here now, or its send fails and the watch task re-reads the key itself. Dropping
                // the receiver instead could lose one sent after the last poll (its sender would
                // count it delivered, and nobody would read the key).
                confirmed.close();
                match confirmed.try_recv() {
                    Ok(revision) => revision,
                    Err(_) => {
                        tracing::debug!(%key, "etcd: the held-key watch was not confirmed in time; a delete is reported once it is made again");
                        return;
                    }
                }
            }
        };
        if created_at <= read_rev {
            return;
        }
        self.recheck_granted(key, rev, lost, watch_id, created_at)
            .await;
    }

    /// Reads a just-granted key whose watch was created after the grant's read: deleted in between,
    /// the grant is returned already lost.
    /// A read that fails is handed to the watch task (`watch_id`, confirmed at `created_at`), which
    /// reads until it is answered: the delete may have come before the watch, which never sees it.
    async fn recheck_granted(
        &self,
        key: &str,
        rev: i64,
        lost: &LossReport,
        watch_id: i64,
        created_at: i64,
    ) {
        let own = crate::rpc::pb::etcdserverpb::RangeRequest {
            key: key.as_bytes().to_vec(),
            ..Default::default()
        };
        match self.get("held-key check", own).await {
            Ok(read) if read.kvs.first().is_some_and(|kv| kv.create_revision == rev) => {}
            Ok(_) => lost.report(
                format!("its key {key} was deleted on the server right after the grant (by hand, or its session lease was revoked or expired)"),
            ),
            Err(e) => {
                tracing::debug!(%key, error = %e, "etcd: re-reading a just-granted key failed; the watch task reads it again");
                self.inner.held.recheck_later(watch_id, created_at);
            }
        }
    }

    /// What one renewal's session keep-alive (`None`: none was sent for it) means for its lock.
    fn renewal_outcome(
        &self,
        entry: &Renewal<'_, EtcdLease>,
        keep_alive: Option<&std::result::Result<Duration, KeepAlive>>,
    ) -> Result<Renewed> {
        match keep_alive {
            Some(Ok(ttl)) => {
                // A loss the backend found (its key deleted) is also this renewal's answer: a
                // live session alone does not keep the lock.
                let found = entry.lease.lost.reason();
                if let Some(reason) = found {
                    return Ok(Renewed::Gone { reason });
                }
                // What the core is told (the lease the server confirmed may be shorter): the key
                // must not outlive the guard's own deadline by more than a round trip.
                let expires = clock::now().saturating_add(entry.ttl.min(*ttl));
                match self.inner.expiries.renew(&entry.lease.expiry, expires) {
                    Rearmed::Moved | Rearmed::Released => {}
                    Rearmed::Expired => return Ok(Renewed::Gone {
                        reason:
                            "the lock's own lease ran out before this renewal; its key was deleted"
                                .into(),
                    }),
                }
                Ok(Renewed::Extended {
                    ttl: entry.ttl.min(*ttl),
                })
            }
            Some(Err(KeepAlive::Gone(reason))) => Ok(Renewed::Gone {
                reason: reason.clone(),
            }),
            Some(Err(KeepAlive::Failed(e))) => Err(distlock_core::Error::new(
                distlock_core::ErrorKind::Unavailable,
                e.to_string(),
            )
            .with_backend(BACKEND)
            .with_lock(entry.name)),
            None => Err(distlock_core::Error::new(
                distlock_core::ErrorKind::Protocol,
                "internal error: a renewal without its session",
            )),
        }
    }

    pub(crate) async fn renew_batch(
        &self,
        batch: &[Renewal<'_, EtcdLease>],
    ) -> Vec<(RenewalId, Result<Renewed>)> {
        // A connection whose runtime was dropped is made again first (a failure shows in the
        // keep-alives below).
        if let Err(e) = self.connection().await {
            tracing::debug!(error = %e, "etcd: reconnecting for a renewal failed");
        }
        // One keep-alive round trip per distinct session, concurrently.
        let mut sessions: Vec<Arc<Session>> = Vec::new();
        for entry in batch {
            if !sessions.iter().any(|s| s.id == entry.lease.session.id) {
                sessions.push(entry.lease.session.clone());
            }
        }
        let outcomes =
            futures_util::future::join_all(sessions.iter().map(|s| s.keep_alive())).await;
        // Renewals run on the runtime the core's watchdog is on now: the keep-alive tasks and the
        // held-keys watch (and the expiry task) move there if their runtime is gone.
        self.ensure_background();
        let by_id: HashMap<i64, &std::result::Result<Duration, KeepAlive>> =
            sessions.iter().map(|s| s.id).zip(outcomes.iter()).collect();
        batch
            .iter()
            .map(|entry| {
                let keep_alive = by_id.get(&entry.lease.session.id).copied();
                (entry.id, self.renewal_outcome(entry, keep_alive))
            })
            .collect()
    }

    /// A release (or handoff) txn of `lease` failed: its key goes to the retried deletes, and its drop
    /// must not hand it there again.
    fn delete_after_failed_release(&self, lease: &EtcdLease, owner: &str) {
        lease
            .handed_off
            .store(true, std::sync::atomic::Ordering::Release);
        self.delete_later(lease.doomed(owner.to_string()));
    }

    pub(crate) async fn release_lease(
        &self,
        lease: &EtcdLease,
        name: &str,
        owner: &str,
    ) -> Result<Released> {
        // Kept for the next grant of this key (this owner's next cycle, or another local owner's).
        self.inner.held.linger(lease.watch_id);
        // A loss known before the release is sent makes a key found gone a definite `NotHeld`.
        let lost_before = lease.lost.reason().is_some();
        // A writer's release records its token for the readers after it, in the same txn.
        let txn = match lease.kind {
            LockKind::Write => layout::write_release_txn(name, &lease.key, lease.rev),
            _ => layout::release_txn(&lease.key, lease.rev),
        };
        let resp = match self
            .txn_settled("release", txn, |resp| resp.succeeded)
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                // The key may still be there, on a session this process keeps alive: delete it in the
                // background until that works, and keep its claim meanwhile, so the next local owner
                // of the name neither adopts it nor gets the lock before it is gone.
                self.delete_after_failed_release(lease, owner);
                return Err(e.into_core(Some(name)));
            }
        };
        self.unclaim(&lease.key, lease.claim);
        // Only now remove its deadline: if the release failed, the expiry task still deletes the
        // key when the lease runs out.
        self.inner.expiries.remove(&lease.expiry);
        if resp.reply.succeeded {
            Ok(Released::Released)
        } else {
            not_held_or_unknown(name, resp.unsure, lost_before)
        }
    }
}

/// What a release whose compare failed (the key with the hold's create_revision is gone) reports.
/// `NotHeld` is a definite answer ("nothing of this owner's was there"), so it is given only when no
/// other send of the release may have been the one that deleted the key (`unsure`: a send failed
/// after it may have reached the server, or was unanswered), or when the hold was already known lost
/// before the release was sent. Otherwise the outcome is unknown: our first send deleted the key, or
/// it was gone before (deleted, or its lease expired), and the answer is `Unavailable`, as on Redis
/// (issue 24). Either way no other owner's key was touched: the delete compares the create_revision.
fn not_held_or_unknown(name: &str, unsure: bool, lost_before: bool) -> Result<Released> {
    if !unsure || lost_before {
        return Ok(Released::NotHeld);
    }
    Err(distlock_core::Error::new(
        ErrorKind::Unavailable,
        format!(
            "release of {name:?} on etcd: the outcome is unknown: a send of the release got no reply (the connection broke, or the request was also sent to another member), and the send that answered found the key gone, so either the first send deleted it or it was already gone (deleted, or its session lease expired); no other owner's key was touched"
        ),
    ))
}

/// A key made for the next owner by a handoff whose outcome is not known yet: if the handoff future is
/// dropped (or its reply lost), the key is deleted in the background at once (by create_revision once
/// known, else by lease + owner, and then again after twice the request timeout in case the txn still
/// lands; the retried deletes keep it until done), so a handoff cut short does not leave the next acquire queued behind a key nobody holds.
struct HandOffUndo {
    backend: EtcdBackend,
    doomed: Option<Doomed>,
}

impl Drop for HandOffUndo {
    fn drop(&mut self) {
        let Some(mut doomed) = self.doomed.take() else {
            return;
        };
        tracing::debug!(key = %doomed.key, "etcd: a handoff was cut short; deleting the next owner's key in the background");
        // At once where a runtime runs it; but a runtime shutting down drops new tasks unrun (a
        // release cut short by its runtime's shutdown is exactly this case: review), so the key is
        // also recorded for the retried deletes, which later requests start again on their runtime.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let backend = self.backend.clone();
            let now = doomed.clone();
            runtime.spawn(async move { backend.delete_once(&now).await });
        }
        if doomed.rev.is_none() {
            doomed.not_before = Some(
                tokio::time::Instant::now()
                    + self
                        .backend
                        .inner
                        .config
                        .connection
                        .request_timeout
                        .saturating_mul(2),
            );
        }
        self.backend.retry_delete(doomed);
    }
}

impl EtcdBackend {
    /// Releases `lease` and grants the name to `next` in one txn ([`layout::hand_off_txn`]): the
    /// releaser's key is deleted and the next owner's key (a local claim of its own) created in the
    /// same revision, unless someone queued on the server meanwhile; then it is only released (the
    /// txn's failure branch), and the next owner acquires as usual, behind whoever queued.
    pub(crate) async fn hand_off_lease(
        &self,
        lease: &EtcdLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<EtcdLease>> {
        // Only a mutex is handed on: a writer's release records its token, and the next writer's
        // key would need its own shape.
        if lease.kind != LockKind::Mutex || next.kind != LockKind::Mutex {
            return Ok(HandOff::Released(
                self.release_lease(lease, name, owner).await?,
            ));
        }
        let session = match self.session_for(next.lease).await {
            Ok(session) => session,
            Err(e) => {
                tracing::debug!(lock = %name, error = %e, "etcd: no session for a handoff; releasing instead");
                return Ok(HandOff::Released(
                    self.release_lease(lease, name, owner).await?,
                ));
            }
        };
        let prefix = layout::prefix(name);
        let (key, claim) = self.claim_key(name, session.id);
        let mut undo = HandOffUndo {
            backend: self.clone(),
            doomed: Some(Doomed {
                key: key.clone(),
                rev: None,
                owner: next.owner.clone(),
                session: session.clone(),
                claim,
                not_before: None,
            }),
        };
        self.inner.held.linger(lease.watch_id);
        let lost_before = lease.lost.reason().is_some();
        let txn = layout::hand_off_txn(
            &lease.key,
            lease.rev,
            &prefix,
            &key,
            session.id,
            &next.owner,
        );
        let made_by_us = |resp: &TxnResponse| {
            resp.responses.get(1).and_then(|op| match &op.response {
                Some(OpResponse::ResponseRange(read)) => read
                    .kvs
                    .first()
                    .filter(|kv| kv.lease == session.id && kv.value == next.owner.as_bytes())
                    .map(|kv| kv.create_revision),
                _ => None,
            })
        };
        // A reply shows the handoff's write if it applied, or its failure branch released the key,
        // or found the next owner's key an earlier send made.
        let shows_a_write = |resp: &TxnResponse| {
            resp.succeeded
                || made_by_us(resp).is_some()
                || matches!(
                    resp.responses.first().and_then(|op| op.response.as_ref()),
                    Some(OpResponse::ResponseTxn(release)) if release.succeeded
                )
        };
        let settled = match self.txn_settled("handoff", txn, shows_a_write).await {
            Ok(settled) => settled,
            Err(e) => {
                // Either outcome may have happened: the old key goes to the retried deletes as a
                // failed release's does, the new one with `undo`.
                self.delete_after_failed_release(lease, owner);
                return Err(e.into_core(Some(name)));
            }
        };
        let (resp, unsure) = (settled.reply, settled.unsure);
        // The old key is gone either way (deleted now, or no longer this hold's).
        self.unclaim(&lease.key, lease.claim);
        self.inner.expiries.remove(&lease.expiry);
        let rev = if resp.succeeded {
            header_rev(&resp).map_err(|e| e.into_core(Some(name)))?
        } else {
            // A copy of this txn sent before (its reply lost, or a hedged copy to another member)
            // may have applied first: then the new key is there, on the session's lease with the next
            // owner's value, and the handoff happened (the releaser's key went with it). Unclaiming
            // it as if nothing was written left it blocking the name (review).
            match made_by_us(&resp) {
                Some(rev) => rev,
                None => {
                    // Nothing was written for the next owner.
                    undo.doomed = None;
                    self.unclaim(&key, claim);
                    let released = match resp.responses.first().and_then(|op| op.response.as_ref())
                    {
                        Some(OpResponse::ResponseTxn(release)) if release.succeeded => {
                            Released::Released
                        }
                        _ => not_held_or_unknown(name, unsure, lost_before)?,
                    };
                    return Ok(HandOff::Released(released));
                }
            }
        };
        if let Some(doomed) = undo.doomed.as_mut() {
            doomed.rev = Some(rev);
        }
        let found = Position {
            session,
            key,
            rev,
            holder: None,
            predecessor: None,
            read_rev: rev,
            alive_at: rev,
        };
        let grant = self
            .grant(found, claim, next.lease, None, LockKind::Mutex)
            .await;
        undo.doomed = None;
        Ok(HandOff::Handed(grant))
    }
}

#[cfg(test)]
mod loss_tests {
    //! The loss reports (`LossReport`, from a review): a session marked gone while grants on
    //! it are under way (the grant's post-insert check against `Expiries::session_gone`), and while a
    //! local handoff's grant is under way, must reach every hold on that session, and no other.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use distlock_core::url::LockUrl;
    use distlock_core::{LockGuard, LockState, Locks};
    use distlock_testkit::etcd::EtcdServer;

    /// The lease of the key `token` of `name` has (none if it is not there).
    async fn lease_of(backend: &EtcdBackend, name: &str, token: u64) -> Option<i64> {
        let prefix = layout::prefix(name);
        let mut end = prefix.clone().into_bytes();
        *end.last_mut().unwrap() += 1;
        let read = backend
            .get(
                "test",
                crate::rpc::pb::etcdserverpb::RangeRequest {
                    key: prefix.into_bytes(),
                    range_end: end,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        read.kvs
            .iter()
            .find(|kv| kv.create_revision.unsigned_abs() == token)
            .map(|kv| kv.lease)
    }

    async fn live_session(backend: &EtcdBackend) -> Arc<Session> {
        backend
            .inner
            .sessions
            .lock()
            .await
            .values()
            .find(|s| s.gone_reason().is_none())
            .cloned()
            .expect("a live session")
    }

    /// Every guard on the gone session is Lost at once, every other one Held. Returns how many were
    /// on the gone session.
    async fn check(backend: &EtcdBackend, gone: &Session, held: &[(String, LockGuard)]) -> usize {
        let mut on_gone = 0;
        for (name, guard) in held {
            let token = guard.token().unwrap().get();
            let lease = lease_of(backend, name, token).await;
            if lease == Some(gone.id) {
                on_gone += 1;
                assert_eq!(
                    guard.state(),
                    LockState::Lost,
                    "{name}: a hold on the session marked gone is not Lost (token {token})"
                );
            } else if lease.is_some() {
                assert_eq!(
                    guard.state(),
                    LockState::Held,
                    "{name}: a hold on another session"
                );
            }
        }
        on_gone
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_marked_gone_during_grants_reaches_every_hold_on_it() {
        let server = EtcdServer::start_or_panic();
        let mut total = 0;
        for round in 0u64..24 {
            let backend = EtcdBackend::connect(&LockUrl::parse(&server.url()).unwrap())
                .await
                .unwrap();
            let locks = Locks::with_defaults(backend.clone(), backend.default_options());
            let warm = locks.lock(&format!("review-loss/warm{round}")).unwrap();
            warm.acquire().await.unwrap().release().await.unwrap();
            let session = live_session(&backend).await;
            let names: Vec<String> = (0..16)
                .map(|i| format!("review-loss/r{round}/n{i}"))
                .collect();
            let mut tasks = Vec::new();
            for name in &names {
                let lock = locks.lock(name).unwrap();
                let name = name.clone();
                tasks.push(tokio::spawn(async move {
                    lock.acquire().await.ok().map(|g| (name, g))
                }));
            }
            let marker = {
                let session = session.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(round * 400)).await;
                    let _ = session.mark_gone("review: marked gone during grants");
                })
            };
            let mut held = Vec::new();
            for t in tasks {
                if let Some(g) = t.await.unwrap() {
                    held.push(g);
                }
            }
            marker.await.unwrap();
            total += check(&backend, &session, &held).await;
        }
        assert!(total > 0, "no hold was granted on a session marked gone");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_marked_gone_during_local_handoffs_reaches_the_handed_holds() {
        let server = EtcdServer::start_or_panic();
        let mut total = 0;
        for round in 0u64..16 {
            let backend = EtcdBackend::connect(&LockUrl::parse(&server.url()).unwrap())
                .await
                .unwrap();
            let locks = Locks::with_defaults(backend.clone(), backend.default_options());
            let names: Vec<String> = (0..8)
                .map(|i| format!("review-loss-h/r{round}/n{i}"))
                .collect();
            let mut first = Vec::new();
            let mut waiters = Vec::new();
            for name in &names {
                let a = locks.lock(name).unwrap();
                first.push(a.acquire().await.unwrap());
                let b = locks.lock(name).unwrap();
                let name = name.clone();
                waiters.push(tokio::spawn(async move {
                    b.acquire().await.ok().map(|g| (name, g))
                }));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            let session = live_session(&backend).await;
            let marker = {
                let session = session.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(round * 500)).await;
                    let _ = session.mark_gone("review: marked gone during handoffs");
                })
            };
            let releases: Vec<_> = first
                .into_iter()
                .map(|g| {
                    tokio::spawn(async move {
                        let _ = g.release().await;
                    })
                })
                .collect();
            let mut held = Vec::new();
            for w in waiters {
                if let Ok(Ok(Some(g))) = tokio::time::timeout(Duration::from_secs(10), w).await {
                    held.push(g);
                }
            }
            for r in releases {
                r.await.unwrap();
            }
            marker.await.unwrap();
            total += check(&backend, &session, &held).await;
        }
        assert!(total > 0, "no handed hold was on the session marked gone");
    }
}
