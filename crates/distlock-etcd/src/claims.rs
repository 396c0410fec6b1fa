//! Local claims on lock keys, and the deletes of keys of ours that pass a claim on. Every lock of a
//! backend (and of its clones) hangs on the session of its TTL, so two owners of one name would both
//! compute `NAME/<lease hex>`: a contender claims its key first (`NAME/<lease hex>`, or
//! `NAME/<lease hex>_<n>` while that one is claimed), and gives the claim up only once the key is known
//! deleted; a delete that failed is retried in the background meanwhile.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use distlock_core::retry::Backoff;
use distlock_core::LockKind;

use crate::backend::{EtcdBackend, Inner};
use crate::layout;
use crate::session::Session;
use crate::tasks::Task;

/// Claim id of a key on our lease that another owner wrote.
pub(crate) const FOREIGN: u64 = 0;

/// Keys whose delete failed, and the task retrying them.
#[derive(Default)]
pub(crate) struct Retry {
    keys: HashMap<Arc<str>, Doomed>,
    task: Option<Task>,
}

/// A key of ours to delete, with what the delete compares and the claim to pass on after it.
#[derive(Clone)]
pub(crate) struct Doomed {
    pub(crate) key: Arc<str>,
    pub(crate) rev: Option<i64>,
    pub(crate) owner: String,
    pub(crate) session: Arc<Session>,
    pub(crate) claim: u64,
    /// Not to be tried before this (a create that may still land).
    pub(crate) not_before: Option<tokio::time::Instant>,
}

impl EtcdBackend {
    /// Claims the first key of `name` on session `lease` that no local contender uses: slot 0 is Go's
    /// `NAME/<lease hex>`, later slots exist only while several owners of one name share the session.
    pub(crate) fn claim_key(&self, name: &str, lease: i64) -> (Arc<str>, u64) {
        self.claim_key_of(LockKind::Mutex, name, lease)
    }

    /// Claims the first key of `kind`'s shape no local contender uses: a mutex's as
    /// [`claim_key`](Self::claim_key); a reader's or writer's `NAME/read|write/<unix nanos>` (Go's
    /// `recipe.RWMutex`), the nanoseconds moved on by the slot while a local contender uses one;
    /// a permit's `NAME/permit.<lease hex>.<n>`, the first free slot.
    pub(crate) fn claim_key_of(&self, kind: LockKind, name: &str, lease: i64) -> (Arc<str>, u64) {
        let nanos = match kind {
            LockKind::Read | LockKind::Write => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            _ => 0,
        };
        let shape = |slot: usize| match kind {
            LockKind::Read => layout::read_key(name, nanos + slot as u128),
            LockKind::Write => layout::write_key(name, nanos + slot as u128),
            LockKind::Permit { .. } => layout::permit_key(name, lease, slot),
            _ => layout::slot_key(name, lease, slot),
        };
        let claim = self.inner.next_claim.fetch_add(1, Ordering::Relaxed);
        let mut claims = match self.inner.claims.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut slot = 0;
        loop {
            // One allocation of the key for the hold's life: the claim, the acquisition, the lease,
            // the held-key watch and the deadline share it (issue 9's memory per held lock).
            let key: Arc<str> = shape(slot).into();
            if let std::collections::hash_map::Entry::Vacant(v) = claims.entry(key.clone()) {
                v.insert(claim);
                return (key, claim);
            }
            slot += 1;
        }
    }

    /// Passes a key on locally (it is deleted, or went with its session).
    pub(crate) fn unclaim(&self, key: &str, claim: u64) {
        if let Ok(mut claims) = self.inner.claims.lock() {
            if claims.get(key) == Some(&claim) {
                claims.remove(key);
            }
        }
    }

    /// Marks `key` as someone else's (a key on our lease with another owner's value): no local
    /// contender uses it again while its session lives.
    pub(crate) fn disown(&self, key: &str, claim: u64) {
        if let Ok(mut claims) = self.inner.claims.lock() {
            if let Some(owner) = claims.get_mut(key).filter(|owner| **owner == claim) {
                *owner = FOREIGN;
            }
        }
    }

    /// One delete of a key of ours: by key + create_revision, or, when the revision never came back,
    /// by key + lease + owner. True once the key is known gone (deleted now, or not there).
    pub(crate) async fn delete_once(&self, doomed: &Doomed) -> bool {
        let txn = match doomed.rev {
            Some(rev) => layout::release_txn(&doomed.key, rev),
            None => layout::undo_txn(&doomed.key, doomed.session.id, &doomed.owner),
        };
        match self.txn("delete", txn).await {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(key = %doomed.key, error = %e, "etcd: deleting a key failed");
                false
            }
        }
    }

    /// Deletes a key of ours and then passes its claim on. A delete that fails is retried in the
    /// background until it succeeds or the session is gone: a key left on a live session would block
    /// the name for everyone as long as this process keeps the session alive, and its claim keeps the
    /// key from being reused (adopted) locally meanwhile.
    ///
    /// Without a create_revision (the create's reply was lost, or its future dropped) the create may
    /// still be on its way and land after this delete, leaving a key of ours on a live session: the
    /// delete is then repeated once more after twice the request timeout, and the key stays claimed
    /// until then.
    pub(crate) async fn delete_and_unclaim(&self, mut doomed: Doomed) {
        let deleted = self.delete_once(&doomed).await;
        if doomed.rev.is_none() {
            doomed.not_before = Some(
                tokio::time::Instant::now()
                    + self
                        .inner
                        .config
                        .connection
                        .request_timeout
                        .saturating_mul(2),
            );
            self.retry_delete(doomed);
        } else if deleted {
            self.unclaim(&doomed.key, doomed.claim);
        } else {
            self.delete_later(doomed);
        }
    }

    pub(crate) fn delete_later(&self, doomed: Doomed) {
        tracing::warn!(key = %doomed.key, "etcd: could not delete a lock key; retrying in the background (the name stays blocked until it is gone)");
        self.retry_delete(doomed);
    }

    pub(crate) fn retry_delete(&self, doomed: Doomed) {
        if let Ok(mut retry) = self.inner.doomed.lock() {
            retry.keys.insert(doomed.key.clone(), doomed);
        }
        self.ensure_retrier();
    }

    /// Starts the task that retries failed deletes, unless it runs (or nothing is left to delete). It
    /// is started again by later requests if its runtime was dropped.
    pub(crate) fn ensure_retrier(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(mut retry) = self.inner.doomed.lock() else {
            return;
        };
        if retry.keys.is_empty() || retry.task.as_ref().is_some_and(Task::is_alive) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        // Spawned under the lock: the task takes it first thing, so it sees the task recorded.
        retry.task = Some(Task::spawn(&runtime, async move {
            let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
            loop {
                tokio::time::sleep(backoff.next_delay()).await;
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let backend = EtcdBackend { inner };
                let keys: Vec<Doomed> = match backend.inner.doomed.lock() {
                    Ok(retry) => retry.keys.values().cloned().collect(),
                    Err(_) => return,
                };
                let now = tokio::time::Instant::now();
                for doomed in keys {
                    if doomed.not_before.is_some_and(|t| t > now) {
                        continue;
                    }
                    // A key whose session is gone went with its lease.
                    if doomed.session.gone_reason().is_some() || backend.delete_once(&doomed).await
                    {
                        if let Ok(mut retry) = backend.inner.doomed.lock() {
                            // Only this entry: the key may have been passed on and doomed again since.
                            if retry
                                .keys
                                .get(&doomed.key)
                                .is_some_and(|d| d.claim == doomed.claim)
                            {
                                retry.keys.remove(&doomed.key);
                            }
                        }
                        backend.unclaim(&doomed.key, doomed.claim);
                        tracing::debug!(key = %doomed.key, "etcd: a lock key left by a failed delete is gone");
                    }
                }
                // Stop when done, under the lock `delete_later` adds under, so no key is left behind.
                let done = match backend.inner.doomed.lock() {
                    Ok(mut retry) if retry.keys.is_empty() => {
                        retry.task = None;
                        true
                    }
                    _ => false,
                };
                if done {
                    return;
                }
            }
        }));
    }
}
