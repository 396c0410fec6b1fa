//! Acquiring: the first try claims a key and creates it in one transaction that also reads the holder
//! and the predecessor; a queued acquisition watches its predecessor until it is deleted, and each
//! later try checks, in one transaction, that the own key still exists before reading again. See
//! [`crate::backend`] for the whole picture.

use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt};
use distlock_core::retry::jitter;

use crate::backend::{EtcdBackend, Inner};
use crate::claims::{Doomed, FOREIGN};
use crate::error::EtcdError;
use crate::layout;
use crate::lease::{EtcdLease, QueuedWatch};
use crate::rpc::pb::etcdserverpb::response_op::Response as OpResponse;
use crate::rpc::pb::etcdserverpb::watch_create_request::FilterType;
use crate::rpc::pb::etcdserverpb::{RangeResponse, ResponseOp, TxnResponse, WatchCreateRequest};
use crate::rpc::pb::mvccpb::event::EventType;
use crate::rpc::pb::mvccpb::KeyValue;
use crate::session::Session;

/// An acquire under way: the session it queued on, its key and, once known, the key's create_revision.
#[derive(Debug, Default)]
pub struct EtcdAcquisition {
    session: Option<Arc<Session>>,
    key: Option<Arc<str>>,
    rev: Option<i64>,
    /// The predecessor to watch and the revision to watch from.
    watch: Option<(String, i64)>,
    /// The local claim on `key`.
    claim: Option<u64>,
    /// The key went to a grant (the lease owns it now).
    granted: bool,
    /// The held-key watch on the own key, made once the acquisition queued (handed to the grant).
    queued_watch: Option<QueuedWatch>,
    /// The backend and the owner id, for the undo of an acquisition dropped without
    /// [`abandon`](EtcdBackend::abandon): the core's undo task ran on a runtime that was dropped.
    backend: Weak<Inner>,
    owner: String,
}

impl EtcdAcquisition {
    pub(crate) fn new(backend: &EtcdBackend, owner: &str) -> EtcdAcquisition {
        let mut acquisition = EtcdAcquisition::default();
        acquisition.backend = Arc::downgrade(&backend.inner);
        acquisition.owner = owner.to_string();
        acquisition
    }
}

impl Drop for EtcdAcquisition {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        if let (Some(queued), Some(inner)) = (self.queued_watch.take(), self.backend.upgrade()) {
            inner.held.unwatch(queued.id);
        }
        let (Some(key), Some(session), Some(claim)) =
            (self.key.take(), self.session.take(), self.claim.take())
        else {
            return;
        };
        let Some(inner) = self.backend.upgrade() else {
            return;
        };
        let backend = EtcdBackend { inner };
        tracing::debug!(%key, "etcd: an acquisition was dropped without its undo; deleting its key in the background");
        // Without a create_revision the create may still land: delete (again) after twice the request
        // timeout, as `delete_and_unclaim` does.
        let not_before = self.rev.is_none().then(|| {
            tokio::time::Instant::now()
                + backend
                    .inner
                    .config
                    .connection
                    .request_timeout
                    .saturating_mul(2)
        });
        // The retrier starts on the current runtime, or on the next one the backend is used on.
        backend.retry_delete(Doomed {
            key,
            rev: self.rev,
            owner: std::mem::take(&mut self.owner),
            session,
            claim,
            not_before,
        });
    }
}

/// Where an acquisition stands after a try's reads.
pub(crate) struct Position {
    pub(crate) session: Arc<Session>,
    pub(crate) key: Arc<str>,
    /// The own key's create_revision.
    pub(crate) rev: i64,
    /// The oldest key under the prefix.
    pub(crate) holder: Option<KeyValue>,
    /// The key created just before ours.
    pub(crate) predecessor: Option<KeyValue>,
    /// The revision the predecessor was read at: its watch starts after it.
    pub(crate) read_rev: i64,
    /// A revision the own key is known to have existed at: the held-keys watch starts after it.
    pub(crate) alive_at: i64,
}

impl EtcdBackend {
    pub(crate) async fn try_once(
        &self,
        acq: &mut EtcdAcquisition,
        request: &AcquireRequest,
    ) -> std::result::Result<Attempt<EtcdLease>, EtcdError> {
        let prefix = layout::prefix(&request.name);
        let found = match (&acq.session, &acq.key, acq.rev) {
            (Some(session), Some(key), Some(rev)) => self.check(session, key, rev, &prefix).await?,
            _ => self.create(acq, request, &prefix).await?,
        };
        acq.rev = Some(found.rev);
        let first = found
            .holder
            .as_ref()
            .is_none_or(|h| h.create_revision == found.rev);
        if first {
            acq.watch = None;
            // Kept in the acquisition too: a grant the core refuses (it came after its deadline) is abandoned.
            let claim = acq.claim.unwrap_or(FOREIGN);
            acq.granted = true;
            let queued = acq.queued_watch.take();
            return Ok(Attempt::Acquired(
                self.grant(found, claim, request.lease, queued).await,
            ));
        }
        if acq.queued_watch.is_none() {
            // Queued: watch the own key now, so the grant after the wait finds its watch confirmed.
            // The key existed at this read (`from` is the revision after it).
            let lost = distlock_core::raw::LossReport::new();
            let (id, first_confirmation) = self.inner.held.watch(
                found.key.clone(),
                found.rev,
                found.alive_at + 1,
                lost.clone(),
            );
            acq.queued_watch = Some(QueuedWatch {
                id,
                lost,
                first_confirmation,
            });
        }
        acq.watch = found
            .predecessor
            .as_ref()
            .map(|kv| (key_string(kv), found.read_rev + 1));
        Ok(Attempt::Busy { retry_after: None })
    }

    /// A later try, once queued: if the own key still has its create_revision, read the holder and
    /// the predecessor (etcd issue 11456: the lease may have expired while waiting).
    async fn check(
        &self,
        session: &Arc<Session>,
        key: &Arc<str>,
        rev: i64,
        prefix: &str,
    ) -> std::result::Result<Position, EtcdError> {
        let resp = self
            .txn("acquire check", layout::check_txn(key, prefix, rev))
            .await?;
        if !resp.succeeded {
            let why = session.gone_reason().unwrap_or_else(|| {
                "the queued key was deleted (its session lease expired or someone removed it)"
                    .into()
            });
            return Err(EtcdError::SessionLost(format!(
                "lost the place in the queue while waiting: {why}; not reporting the lock held (etcd issue 11456)"
            )));
        }
        let ops = &resp.responses;
        let read_rev = header_rev(&resp)?;
        Ok(Position {
            session: session.clone(),
            key: key.clone(),
            rev,
            holder: get_of(ops.first())?.kvs.first().cloned(),
            predecessor: get_of(ops.get(1))?.kvs.first().cloned(),
            read_rev,
            alive_at: read_rev,
        })
    }

    /// The first try: claims a key, creates it if absent, reads the holder and the predecessor.
    async fn create(
        &self,
        acq: &mut EtcdAcquisition,
        request: &AcquireRequest,
        prefix: &str,
    ) -> std::result::Result<Position, EtcdError> {
        // A few passes: a session found dead (revoked behind the keep-alive's back) is replaced once,
        // and a key of ours some other writer made on our lease is skipped for the next slot.
        for _ in 0..8 {
            let session = self.session_for(request.lease).await?;
            let (key, claim) = self.claim_key(&request.name, session.id);
            acq.session = Some(session.clone());
            acq.key = Some(key.clone());
            acq.claim = Some(claim);
            acq.rev = None;
            let resp = match self
                .txn(
                    "acquire",
                    layout::create_txn(&key, prefix, session.id, &request.owner),
                )
                .await
            {
                Ok(resp) => resp,
                Err(e) if e.is_lease_not_found() => {
                    // Nothing was written (the put refers to a lease that is gone).
                    let _ = session.mark_gone(
                        "the session lease was not found on the server (revoked or expired)",
                    );
                    self.unclaim(&key, claim);
                    acq.session = None;
                    acq.key = None;
                    acq.claim = None;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let read_rev = header_rev(&resp)?;
            let ops = &resp.responses;
            let holder = get_of(ops.get(1))?.kvs.first().cloned();
            if resp.succeeded {
                // Our key is the newest; the one before it is the predecessor.
                let rev = read_rev;
                let pred = get_of(ops.get(2))?
                    .kvs
                    .iter()
                    .find(|kv| kv.create_revision < rev)
                    .cloned();
                return Ok(Position {
                    session,
                    key,
                    rev,
                    holder,
                    predecessor: pred,
                    read_rev,
                    alive_at: read_rev,
                });
            }
            let own =
                get_of(ops.first())?.kvs.first().cloned().ok_or_else(|| {
                    EtcdError::Protocol("the lock key vanished inside a txn".into())
                })?;
            // The key was there. This acquisition holds the only local claim on it, so it is ours
            // only as a retry after a lost reply: on our lease with our owner id, read in the same
            // transaction. Anything else was written by someone else: not adopted (its token is not
            // ours to hand out), never deleted, and skipped for the next slot.
            if own.lease != session.id || own.value != request.owner.as_bytes() {
                tracing::warn!(%key, "etcd: a lock key on this session's lease holds another owner's id; leaving it alone");
                self.disown(&key, claim);
                acq.key = None;
                acq.claim = None;
                continue;
            }
            let rev = own.create_revision;
            let pred_resp = self
                .get("predecessor read", layout::predecessor(prefix, rev))
                .await?;
            let pred = pred_resp.kvs.first().cloned();
            let pred_rev = pred_resp.header.as_ref().map_or(read_rev, |h| h.revision);
            return Ok(Position {
                session,
                key,
                rev,
                holder,
                predecessor: pred,
                read_rev: pred_rev,
                alive_at: read_rev,
            });
        }
        Err(EtcdError::Protocol(format!(
            "no usable lock key for {} after several tries (keys on this session's lease hold other owners' ids, or its lease keeps vanishing)",
            request.name
        )))
    }

    pub(crate) async fn wait_predecessor(
        &self,
        acq: &mut EtcdAcquisition,
    ) -> std::result::Result<(), EtcdError> {
        let Some(session) = acq.session.clone() else {
            return Ok(());
        };
        let gone = session.gone();
        tokio::pin!(gone);
        let Some((pred, from)) = acq.watch.take() else {
            // Nothing to watch (the predecessor went between the reads): try again at once.
            return Ok(());
        };
        let watch = WatchCreateRequest {
            key: pred.into_bytes(),
            start_revision: from,
            filters: vec![FilterType::Noput as i32],
            ..WatchCreateRequest::default()
        };
        let client = self.connection().await?;
        let timeout = self.inner.config.connection.request_timeout;
        let mut stream = tokio::select! {
            reason = &mut gone => return Err(session_died(reason)),
            opened = tokio::time::timeout(timeout, client.watch(watch)) => match opened {
                Ok(Ok(stream)) => stream,
                // The next try reports a server that is really down; a broken connection is retried there.
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "etcd: opening a watch failed");
                    tokio::time::sleep(jitter(WATCH_RETRY_DELAY)).await;
                    return Ok(());
                }
                Err(_) => return Ok(()),
            },
        };
        loop {
            tokio::select! {
                reason = &mut gone => return Err(session_died(reason)),
                message = stream.message() => match message {
                    Ok(Some(resp)) => {
                        if resp.canceled || resp.compact_revision > 0 {
                            return Ok(());
                        }
                        if resp.events.iter().any(|e| e.r#type == EventType::Delete as i32) {
                            return Ok(());
                        }
                    }
                    Ok(None) | Err(_) => {
                        tokio::time::sleep(jitter(WATCH_RETRY_DELAY)).await;
                        return Ok(());
                    }
                },
            }
        }
    }

    /// Deletes the key of an acquisition the core gave up on, and passes its claim on.
    pub(crate) async fn abandon_acquisition(
        &self,
        mut acquisition: EtcdAcquisition,
        request: &AcquireRequest,
    ) {
        let (Some(key), Some(session), Some(claim)) = (
            acquisition.key.clone(),
            acquisition.session.clone(),
            acquisition.claim,
        ) else {
            return;
        };
        if let Some(queued) = acquisition.queued_watch.take() {
            self.inner.held.unwatch(queued.id);
        }
        // Until the delete is done, the acquisition keeps its key: if this future is dropped first
        // (its runtime went away), the acquisition's drop hands the key to the retried deletes. A
        // grant the core refused is undone here too.
        acquisition.granted = false;
        let doomed = Doomed {
            key,
            rev: acquisition.rev,
            owner: request.owner.clone(),
            session,
            claim,
            not_before: None,
        };
        self.delete_and_unclaim(doomed).await;
        // Done: nothing left for the drop to undo.
        acquisition.key = None;
    }
}

/// The pause before the next try after a predecessor watch failed to open or broke (the next try
/// reports a server that is really down).
const WATCH_RETRY_DELAY: Duration = Duration::from_millis(100);

fn session_died(reason: String) -> EtcdError {
    EtcdError::SessionLost(format!(
        "the session lease died while waiting for the lock ({reason}); the queued key went with it, so this acquire stops (etcd issue 19597)"
    ))
}

fn get_of(op: Option<&ResponseOp>) -> std::result::Result<&RangeResponse, EtcdError> {
    match op.and_then(|op| op.response.as_ref()) {
        Some(OpResponse::ResponseRange(get)) => Ok(get),
        other => Err(EtcdError::Protocol(format!(
            "expected a range response in the lock txn, got {other:?}"
        ))),
    }
}

pub(crate) fn header_rev(resp: &TxnResponse) -> std::result::Result<i64, EtcdError> {
    resp.header
        .as_ref()
        .map(|h| h.revision)
        .ok_or_else(|| EtcdError::Protocol("a txn response without a header".into()))
}

fn key_string(kv: &KeyValue) -> String {
    String::from_utf8_lossy(&kv.key).into_owned()
}
