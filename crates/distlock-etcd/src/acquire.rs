//! Acquiring: the first try claims a key and creates it in one transaction that also reads the holder
//! and the predecessor; a queued acquisition watches its predecessor until it is deleted, and each
//! later try checks, in one transaction, that the own key still exists before reading again. See
//! [`crate::backend`] for the whole picture.

use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt};
use distlock_core::retry::jitter;
use distlock_core::{FencingToken, LockKind};

use crate::backend::{EtcdBackend, Inner};
use crate::claims::{Doomed, FOREIGN};
use crate::error::EtcdError;
use crate::layout::{self, NameKey};
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
    /// The key (or the permits' key range) to watch for a delete, and the revision to watch from.
    watch: Option<WatchTarget>,
    /// A permit's limit was stored or found equal (once per acquisition).
    limit_checked: bool,
    /// A permit's: the own key's mod_revision as last known (its create's, or the last grant txn's
    /// put), which the next grant txn compares, so that only one send of it writes.
    written_at: i64,
    /// A reader's: the newest create_revision of a mutex or writer key it queued behind.
    seen_exclusive: i64,
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
    pub(crate) fn new(backend: &EtcdBackend, request: &AcquireRequest) -> EtcdAcquisition {
        let mut acquisition = EtcdAcquisition::default();
        acquisition.backend = Arc::downgrade(&backend.inner);
        acquisition.owner = request.owner.clone();
        acquisition
    }
}

/// What a waiting acquisition watches for a delete: one key (`range_end` empty), or a key range (a
/// permit waiting for any permit to go), from revision `from` (the read that found it + 1).
#[derive(Debug, Clone)]
pub(crate) struct WatchTarget {
    key: Vec<u8>,
    range_end: Vec<u8>,
    from: i64,
}

impl WatchTarget {
    fn key(key: Vec<u8>, from: i64) -> WatchTarget {
        WatchTarget {
            key,
            range_end: Vec::new(),
            from,
        }
    }
}

/// The outcome of [`EtcdBackend::standing`].
struct Standing {
    granted: bool,
    watch: Option<WatchTarget>,
    /// The newest mutex or writer key older than the own key (readers' tokens).
    seen_exclusive: Option<i64>,
}

impl Standing {
    fn granted() -> Standing {
        Standing {
            granted: true,
            watch: None,
            seen_exclusive: None,
        }
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
    /// The oldest key under the prefix; once past a full read in `standing`, the oldest key of the
    /// name.
    pub(crate) holder: Option<KeyValue>,
    /// The key created just before ours; once past a full read in `standing`, the name's key just
    /// before ours.
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
        if let LockKind::Permit { limit } = request.kind {
            // Before any key of the permit's: a mismatch leaves nothing behind.
            if !acq.limit_checked {
                self.check_limit(&request.name, limit).await?;
                acq.limit_checked = true;
            }
        }
        let permit = matches!(request.kind, LockKind::Permit { .. });
        // A permit's token is minted by a write in the txn that decides its grant: the create's, when
        // that txn already shows the own key the oldest under the prefix; else the put of
        // `permit_grant_txn`.
        let (found, standing, minted) = match (acq.session.clone(), acq.key.clone(), acq.rev) {
            (Some(session), Some(key), Some(rev)) if permit => {
                self.permit_standing(
                    &session,
                    &key,
                    rev,
                    &mut acq.written_at,
                    &prefix,
                    request.kind,
                )
                .await?
            }
            (Some(session), Some(key), Some(rev)) => {
                let found = self.check(&session, &key, rev, &prefix).await?;
                let (found, standing) = self.standing(&prefix, request.kind, found).await?;
                (found, standing, None)
            }
            _ => {
                let (found, created) = self.create(acq, request, &prefix).await?;
                acq.rev = Some(found.rev);
                let oldest = found.holder.as_ref().is_some_and(|kv| {
                    kv.create_revision == found.rev && kv.key == found.key.as_bytes()
                });
                // Nothing wrote the key since its create (this acquisition alone claims it).
                acq.written_at = found.rev;
                if permit && !(created && oldest) {
                    let (session, key, rev) = (found.session.clone(), found.key.clone(), found.rev);
                    self.permit_standing(
                        &session,
                        &key,
                        rev,
                        &mut acq.written_at,
                        &prefix,
                        request.kind,
                    )
                    .await?
                } else {
                    let (found, standing) = self.standing(&prefix, request.kind, found).await?;
                    (found, standing, None)
                }
            }
        };
        acq.rev = Some(found.rev);
        if let Some(seen) = standing.seen_exclusive {
            acq.seen_exclusive = acq.seen_exclusive.max(seen);
        }
        if standing.granted {
            acq.watch = None;
            // A reader carries the last write grant's token (read before the grant: a failure
            // leaves the key to the abandon).
            let reader_token = match request.kind {
                LockKind::Read => Some(self.reader_token(&request.name, acq.seen_exclusive).await?),
                _ => None,
            };
            let permit = matches!(request.kind, LockKind::Permit { .. })
                .then(|| layout::permit_name(&request.name, &found.key).to_string());
            // Kept in the acquisition too: a grant the core refuses (it came after its deadline) is abandoned.
            let claim = acq.claim.unwrap_or(FOREIGN);
            acq.granted = true;
            let queued = acq.queued_watch.take();
            let mut grant = self
                .grant(found, claim, request.lease, queued, request.kind)
                .await;
            if let Some(token) = reader_token.or(minted) {
                grant = grant.with_token(FencingToken::new(token));
            }
            if let Some(permit) = permit {
                grant = grant.with_permit(permit);
            }
            return Ok(Attempt::Acquired(grant));
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
        acq.watch = standing.watch;
        Ok(Attempt::Busy { retry_after: None })
    }

    /// Where the own key stands among the name's keys ([`layout::classify`]: mutex contenders, readers,
    /// writers, permits; one queue by create_revision; a nested lock's keys such as `NAME/b/<hex>`,
    /// issue 24, are passed over), and what to watch when it must wait:
    ///
    /// * a mutex or a writer holds when no key of the name is older; it watches the newest older one;
    /// * a reader holds when no mutex, writer or permit key is older (readers share); it watches the
    ///   newest such key;
    /// * a permit holds when no mutex, reader or writer key is older and fewer than `limit` permit
    ///   keys are; it watches the newest older key of another kind, else every permit key for a
    ///   delete.
    ///
    /// The tries read the oldest key under the prefix and the newest one below the own key with
    /// `limit: 1`. When the oldest is the own key, nothing is older and the key holds, whatever its
    /// kind. For a mutex or a writer, when both answers are keys of the name, they stand as they are and
    /// nothing more is read. Otherwise the keys up to the own one are read once more at the revision the
    /// own key was last seen at (`alive_at`: one view with the first read), and classified. A revision
    /// compacted meanwhile is read at the current one instead, which must still hold the own key.
    ///
    /// A permit comes here only from a first try whose create txn found its key the oldest (granted,
    /// its token the create's revision); every other permit try is [`permit_standing`](Self::permit_standing),
    /// whose txn writes the token it grants with.
    async fn standing(
        &self,
        prefix: &str,
        kind: LockKind,
        found: Position,
    ) -> std::result::Result<(Position, Standing), EtcdError> {
        let name_key = |kv: &KeyValue| layout::classify(prefix, &kv.key).is_some();
        let ours =
            |kv: &KeyValue| kv.create_revision == found.rev && kv.key == found.key.as_bytes();
        if found.holder.as_ref().is_some_and(ours) {
            return Ok((found, Standing::granted()));
        }
        let exclusive = matches!(kind, LockKind::Mutex | LockKind::Write);
        if exclusive
            && found.holder.as_ref().is_some_and(name_key)
            && found.predecessor.as_ref().is_none_or(name_key)
        {
            let watch = found
                .predecessor
                .as_ref()
                .map(|kv| WatchTarget::key(kv.key.clone(), found.read_rev + 1));
            return Ok((
                found,
                Standing {
                    granted: false,
                    watch,
                    seen_exclusive: None,
                },
            ));
        }
        let client = self.connection().await?;
        let read = |at: i64| {
            let range = layout::keys_up_to(prefix, found.rev, at);
            let client = client.clone();
            // A compacted revision is an answer (`OutOfRange`), not a failure to retry.
            async move {
                match client.range(range).await {
                    Err(status) if at > 0 && status.code() == tonic::Code::OutOfRange => {
                        Ok(Err(status))
                    }
                    other => other.map(Ok),
                }
            }
        };
        let at = found.alive_at;
        let (kvs, view) = match self.idempotent("contenders read", || read(at)).await? {
            Ok(resp) => (resp.kvs, at),
            Err(status) => {
                tracing::debug!(error = %status, "etcd: the contenders read at the try's revision was refused; reading at the current one");
                let resp = self
                    .idempotent("contenders read", || read(0))
                    .await?
                    .map_err(EtcdError::rpc("contenders read"))?;
                let view = resp.header.as_ref().map_or(at, |h| h.revision);
                (resp.kvs, view)
            }
        };
        Self::rank(prefix, kind, found, kvs, view)
    }

    /// A permit's try once its key exists ([`layout::permit_grant_txn`]): if the own key still has
    /// `rev` and was last written at `written_at`, put it again unchanged and read the keys up to it,
    /// in one txn; ranked as [`standing`](Self::standing) ranks them. Also returns the txn's revision,
    /// the put's: the token when the permit is granted, and the key's mod_revision from then on (a
    /// resend of the txn, after a lost reply or as a hedged copy, fails the compare once one send
    /// wrote, so the grant's token is always the key's last write: `status`, `fenced_put`). A send that
    /// finds the key written since (an earlier send of it applied, its reply lost) takes the key's
    /// mod_revision and tries again at once.
    async fn permit_standing(
        &self,
        session: &Arc<Session>,
        key: &Arc<str>,
        rev: i64,
        written_at: &mut i64,
        prefix: &str,
        kind: LockKind,
    ) -> std::result::Result<(Position, Standing, Option<u64>), EtcdError> {
        let resp = self
            .txn(
                "permit grant",
                layout::permit_grant_txn(key, prefix, rev, *written_at),
            )
            .await?;
        let alive = |kv: &&KeyValue| kv.create_revision == rev;
        let written = match resp.responses.first().and_then(|op| op.response.as_ref()) {
            Some(OpResponse::ResponseRange(own)) if !resp.succeeded => {
                own.kvs.iter().find(alive).map(|kv| kv.mod_revision)
            }
            _ => None,
        };
        if let Some(written) = written {
            tracing::debug!(%key, written, "etcd: a permit's key was written since its last grant txn (an earlier send applied); trying again");
            *written_at = written;
            let at = header_rev(&resp)?;
            let found = Position {
                session: session.clone(),
                key: key.clone(),
                rev,
                holder: None,
                predecessor: None,
                read_rev: at,
                alive_at: at,
            };
            let again = Standing {
                granted: false,
                watch: None,
                seen_exclusive: None,
            };
            return Ok((found, again, None));
        }
        if !resp.succeeded {
            let why = session.gone_reason().unwrap_or_else(|| {
                "the queued key was deleted (its session lease expired or someone removed it)"
                    .into()
            });
            return Err(EtcdError::SessionLost(format!(
                "lost the place in the queue while waiting: {why}; not reporting the lock held (etcd issue 11456)"
            )));
        }
        let at = header_rev(&resp)?;
        *written_at = at;
        let kvs = get_of(resp.responses.get(1))?.kvs.clone();
        let found = Position {
            session: session.clone(),
            key: key.clone(),
            rev,
            holder: None,
            predecessor: None,
            read_rev: at,
            alive_at: at,
        };
        let (found, standing) = Self::rank(prefix, kind, found, kvs, at)?;
        Ok((found, standing, Some(at.unsigned_abs())))
    }

    /// Ranks the own key among `kvs` (every key under the prefix created at or before it, oldest
    /// first, read at revision `view`): see [`standing`](Self::standing).
    fn rank(
        prefix: &str,
        kind: LockKind,
        mut found: Position,
        kvs: Vec<KeyValue>,
        view: i64,
    ) -> std::result::Result<(Position, Standing), EtcdError> {
        let ours =
            |kv: &KeyValue| kv.create_revision == found.rev && kv.key == found.key.as_bytes();
        let keys: Vec<(NameKey, KeyValue)> = kvs
            .into_iter()
            .filter_map(|kv| layout::classify(prefix, &kv.key).map(|k| (k, kv)))
            .collect();
        if !keys.iter().any(|(_, kv)| ours(kv)) {
            return Err(EtcdError::SessionLost(
                "the queued key is gone (its session lease expired or someone removed it); not reporting the lock held (etcd issue 11456)".into(),
            ));
        }
        let older: Vec<&(NameKey, KeyValue)> = keys
            .iter()
            .filter(|(_, kv)| kv.create_revision < found.rev)
            .collect();
        let newest_older = |blocks: &dyn Fn(NameKey) -> bool| {
            older
                .iter()
                .rev()
                .find(|(k, _)| blocks(*k))
                .map(|(_, kv)| WatchTarget::key(kv.key.clone(), view + 1))
        };
        let mut standing = Standing {
            granted: false,
            watch: None,
            seen_exclusive: None,
        };
        match kind {
            LockKind::Read => {
                standing.watch = newest_older(&|k| k.is_exclusive() || k == NameKey::Permit);
                standing.seen_exclusive = older
                    .iter()
                    .filter(|(k, _)| k.is_exclusive())
                    .map(|(_, kv)| kv.create_revision)
                    .max();
                standing.granted = standing.watch.is_none();
            }
            LockKind::Permit { limit } => {
                standing.watch = newest_older(&|k| k != NameKey::Permit);
                if standing.watch.is_none() {
                    let before = older.len();
                    if before < usize::try_from(limit).unwrap_or(usize::MAX) {
                        standing.granted = true;
                    } else {
                        let name = prefix.strip_suffix('/').unwrap_or(prefix);
                        let (start, end) = layout::permit_range(name);
                        standing.watch = Some(WatchTarget {
                            key: start,
                            range_end: end,
                            from: view + 1,
                        });
                    }
                }
            }
            _ => {
                standing.watch = newest_older(&|_| true);
                standing.granted = standing.watch.is_none();
            }
        }
        found.holder = keys.first().map(|(_, kv)| kv.clone());
        found.predecessor = older.last().map(|(_, kv)| kv.clone());
        found.read_rev = view;
        Ok((found, standing))
    }

    /// The token a reader carries: the last write grant's, as recorded by the writers' releases
    /// ([`layout::write_record_key`]), or the newest writer or mutex key it queued behind (`seen`),
    /// whichever is newer; 0 when neither is known (no distlock writer released on the name).
    async fn reader_token(&self, name: &str, seen: i64) -> std::result::Result<u64, EtcdError> {
        let record = crate::rpc::pb::etcdserverpb::RangeRequest {
            key: layout::write_record_key(name).into_bytes(),
            ..Default::default()
        };
        let resp = self.get("write token record read", record).await?;
        let recorded = resp
            .kvs
            .first()
            .and_then(|kv| {
                std::str::from_utf8(&kv.value)
                    .ok()?
                    .trim()
                    .parse::<i64>()
                    .ok()
            })
            .unwrap_or(0);
        Ok(recorded.max(seen).max(0).unsigned_abs())
    }

    /// The semaphore's stored limit: stores `limit` if there is none ([`layout::limit_txn`]), else
    /// compares: another limit is `LimitMismatch`, a value that is no limit `InvalidConfig`.
    async fn check_limit(&self, name: &str, limit: u32) -> std::result::Result<(), EtcdError> {
        let resp = self.txn("limit", layout::limit_txn(name, limit)).await?;
        if resp.succeeded {
            return Ok(());
        }
        let key = layout::limit_key(name);
        let stored = get_of(resp.responses.first())?
            .kvs
            .first()
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
            .unwrap_or_default();
        match stored.trim().parse::<u32>() {
            Ok(n) if n == limit => Ok(()),
            Ok(n) if (1..=distlock_core::MAX_PERMITS).contains(&n) => {
                Err(EtcdError::LimitMismatch {
                    key,
                    stored: n,
                    requested: limit,
                })
            }
            _ => Err(EtcdError::Config(format!(
                "the semaphore limit stored at etcd key {key} is not a limit (1 to {}): {stored:?}; delete it (`etcdctl del {key}`) while no permit is held, and the next permit stores its own",
                distlock_core::MAX_PERMITS
            ))),
        }
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
    ) -> std::result::Result<(Position, bool), EtcdError> {
        // A few passes: a session found dead (revoked behind the keep-alive's back) is replaced once,
        // and a key of ours some other writer made on our lease is skipped for the next slot.
        for _ in 0..8 {
            let session = self.session_for(request.lease).await?;
            let (key, claim) = self.claim_key_of(request.kind, &request.name, session.id);
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
                return Ok((
                    Position {
                        session,
                        key,
                        rev,
                        holder,
                        predecessor: pred,
                        read_rev,
                        alive_at: read_rev,
                    },
                    true,
                ));
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
            return Ok((
                Position {
                    session,
                    key,
                    rev,
                    holder,
                    predecessor: pred,
                    read_rev: pred_rev,
                    alive_at: read_rev,
                },
                false,
            ));
        }
        Err(EtcdError::Protocol(format!(
            "no usable lock key for {} after several tries (keys on this session's lease hold other owners' ids, or its lease keeps vanishing)",
            request.name
        )))
    }

    pub(crate) async fn wait_predecessor(
        &self,
        acq: &mut EtcdAcquisition,
        own_key_too: bool,
    ) -> std::result::Result<(), EtcdError> {
        let Some(session) = acq.session.clone() else {
            return Ok(());
        };
        let gone = session.gone();
        tokio::pin!(gone);
        let Some(target) = acq.watch.take() else {
            // Nothing to watch (the predecessor went between the reads): try again at once.
            return Ok(());
        };
        let (from, target_is_key) = (target.from, target.range_end.is_empty());
        let watch = WatchCreateRequest {
            key: target.key,
            range_end: target.range_end,
            start_revision: target.from,
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
        // A reader, a writer or a permit (Go's recipe waits on only the key before it) also watches
        // its own key on the same stream, so an operator's delete of it ends the wait at once (the
        // next try's own-key check then fails it). A permit waiting on the permits' range watches its
        // own key with it already; the mutex keeps its one watch per waiter (its cost was measured in
        // issue 9).
        if own_key_too && target_is_key {
            if let Some(own) = acq.key.as_ref() {
                let own = WatchCreateRequest {
                    key: own.as_bytes().to_vec(),
                    start_revision: from,
                    filters: vec![FilterType::Noput as i32],
                    ..WatchCreateRequest::default()
                };
                if let Err(e) = stream.watch(own).await {
                    tracing::debug!(error = %e, "etcd: watching the own key while queued failed");
                }
            }
        }
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
