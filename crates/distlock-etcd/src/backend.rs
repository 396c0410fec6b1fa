//! `impl raw::Backend` for etcd.
//!
//! # How an acquire runs
//!
//! The first [`try_acquire`](EtcdBackend::try_acquire) picks the session of the lock's lease (granting
//! it on first use) and sends one transaction: create `NAME/<lease hex>` if absent, read the holder
//! (oldest key) and the predecessor (the key created just before ours). Holder = ours → granted, with
//! the own key's create_revision as the token. Otherwise the key stays queued and
//! [`wait`](EtcdBackend::wait) watches the predecessor's key, from the transaction's revision + 1, until
//! it is deleted (or the session dies: then the wait fails, etcd issue 19597). The next try is one
//! transaction again: *if the own key still has its create_revision* (issue 11456: the lease may have
//! expired while waiting) read holder and predecessor. A deleted predecessor is not always the holder
//! (a waiter before us may have given up), so the loop simply goes on watching the next one.
//!
//! Whatever the core gives up on goes to [`abandon`](EtcdBackend::abandon), which deletes the queued
//! key by key + create_revision, or, when the reply with the revision never came, by key only if it
//! still hangs on our lease.
//!
//! # Holding
//!
//! The grant's TTL is the lock's lease, capped by what is left of the session lease as last confirmed.
//! [`renew`](EtcdBackend::renew) sends one keep-alive round trip per distinct session in the batch and
//! reports the lock's requested TTL capped by the TTL the server confirmed. A lock's own lease can be
//! shorter than its session's (etcd leases are whole seconds and the server raises short ones to its
//! minimum; `max_hold` shrinks renewals), so a held lock whose lease is, or becomes, shorter than its
//! session's TTL gets a client-side timer that deletes its key (by create_revision) when its own lease
//! runs out without a renewal: `max_hold` and short leases are honoured even though the session lives
//! on. With equal TTLs (the default) the session's own expiry does that, and no timer task is spent. The timer fires no earlier than the deadline
//! the core computed, so a guard is never Held with its key deleted. The grant's loss signal resolves
//! when the held-keys watch (one stream per backend, see `held.rs`) sees the key deleted (`etcdctl del`,
//! a revoke, an expiry): within a round trip; or when a keep-alive finds the session lease gone.
//!
//! # One owner per key
//!
//! Every lock of the backend (and of its clones) hangs on the session of its TTL, so two owners of one
//! name would both compute `NAME/<lease hex>`. A contender therefore claims its key in a per-backend map
//! first (`NAME/<lease hex>`, or `NAME/<lease hex>_<n>` while that one is claimed), and gives the claim
//! up only once the key is known deleted; a delete that failed is retried in the background meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::clock::{self, Instant};
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, LossSignal, Released, Renewal,
    RenewalId, Renewed,
};
use distlock_core::retry::Backoff;
use distlock_core::retry::RetryPolicy;
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Fencing, FencingToken, LockOptions, Result};

use crate::rpc::pb::etcdserverpb::response_op::Response as OpResponse;
use crate::rpc::pb::etcdserverpb::watch_create_request::FilterType;
use crate::rpc::pb::etcdserverpb::{
    RangeRequest, RangeResponse, ResponseOp, TxnRequest, TxnResponse, WatchCreateRequest,
};
use crate::rpc::pb::mvccpb::event::EventType;
use crate::rpc::pb::mvccpb::KeyValue;
use crate::rpc::Client;
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;

use crate::config::EtcdConfig;
use crate::error::{EtcdError, BACKEND};
use crate::held::{report_loss, AliveFlag, HeldKeys, LossSender};
use crate::layout;
use crate::session::{KeepAlive, Session};

/// The etcd backend. Cheap to clone: clones share the connection, the sessions and the local key claims,
/// so `Locks` built on clones exclude each other (each owner queues with a key of its own).
///
/// ```no_run
/// # async fn demo() -> distlock_core::Result<()> {
/// use distlock_core::{url::LockUrl, Locks};
/// use distlock_etcd::EtcdBackend;
///
/// let backend = EtcdBackend::connect(&LockUrl::parse("etcd://127.0.0.1:2379")?).await?;
/// let locks = Locks::with_defaults(backend.clone(), backend.default_options());
/// let guard = locks.lock("orders/42")?.acquire().await?;   // key orders/42/<lease hex>
/// let token = guard.token();                               // its create_revision
/// guard.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// The connection. Its channel runs tasks on the runtime it was made on, so when that runtime is
    /// dropped the connection is dead: the next request reconnects on the current runtime.
    conn: Mutex<Conn>,
    reconnecting: tokio::sync::Mutex<()>,
    config: EtcdConfig,
    /// Sessions by TTL in whole seconds.
    sessions: tokio::sync::Mutex<HashMap<u64, Arc<Session>>>,
    keepers: Mutex<Vec<Keeper>>,
    /// Lock keys a local contender of this backend (or of a clone) uses, by key, with the claim id of
    /// that contender: queued, held, or left behind by a delete that failed and is being retried. All
    /// locks of a session share its lease, so without claims two owners of one name would compute the
    /// same key and the second would adopt the first one's key and token.
    claims: Mutex<HashMap<String, u64>>,
    next_claim: AtomicU64,
    /// Keys whose delete failed, retried by one background task.
    doomed: Mutex<Retry>,
    /// The watch on held keys (one stream for the whole backend).
    held: HeldKeys,
}

/// Keys whose delete failed, and the liveness of the task retrying them.
#[derive(Default)]
struct Retry {
    keys: HashMap<String, Doomed>,
    task: Option<Arc<AtomicBool>>,
}

/// The connection and whether the runtime it was made on still runs.
struct Conn {
    client: Client,
    alive: Arc<AtomicBool>,
    sentinel: Option<AbortHandle>,
}

/// A session's keep-alive task; `alive` is false once it is gone with its runtime.
struct Keeper {
    session: Arc<Session>,
    task: AbortHandle,
    alive: Arc<AtomicBool>,
}

impl Keeper {
    fn spawn(runtime: &tokio::runtime::Handle, session: Arc<Session>) -> Keeper {
        let alive = Arc::new(AtomicBool::new(true));
        let flag = AliveFlag(alive.clone());
        let task = runtime
            .spawn({
                let session = session.clone();
                async move {
                    let _flag = flag;
                    session.keep_alive_loop().await;
                }
            })
            .abort_handle();
        Keeper {
            session,
            task,
            alive,
        }
    }
}

/// A task on the current runtime that does nothing but flip its flag when it is dropped: it tells
/// whether the runtime a connection was made on (and so the connection's own tasks) still runs.
fn runtime_sentinel() -> (Arc<AtomicBool>, Option<AbortHandle>) {
    let alive = Arc::new(AtomicBool::new(true));
    let sentinel = tokio::runtime::Handle::try_current().ok().map(|runtime| {
        let flag = AliveFlag(alive.clone());
        runtime
            .spawn(async move {
                let _flag = flag;
                std::future::pending::<()>().await;
            })
            .abort_handle()
    });
    (alive, sentinel)
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(conn) = self.conn.get_mut() {
            if let Some(sentinel) = conn.sentinel.take() {
                sentinel.abort();
            }
        }
        let keepers = match self.keepers.get_mut() {
            Ok(k) => std::mem::take(k),
            Err(_) => return,
        };
        let handle = tokio::runtime::Handle::try_current().ok();
        for Keeper { session, task, .. } in keepers {
            task.abort();
            // Revoke, so queued keys and the lease do not outlive the backend by a TTL.
            if let Some(handle) = &handle {
                handle.spawn(async move { session.revoke().await });
            }
        }
    }
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// An acquire under way: the session it queued on, its key and, once known, the key's create_revision.
#[derive(Debug, Default)]
pub struct EtcdAcquisition {
    session: Option<Arc<Session>>,
    key: Option<String>,
    rev: Option<i64>,
    /// The predecessor to watch and the revision to watch from.
    watch: Option<(String, i64)>,
    /// The local claim on `key`.
    claim: Option<u64>,
    /// The key went to a grant (the lease owns it now).
    granted: bool,
    /// The backend and the owner id, for the undo of an acquisition dropped without
    /// [`abandon`](EtcdBackend::abandon): the core's undo task ran on a runtime that was dropped.
    backend: Weak<Inner>,
    owner: String,
}

impl Drop for EtcdAcquisition {
    fn drop(&mut self) {
        if self.granted {
            return;
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
            tokio::time::Instant::now() + backend.inner.config.request_timeout.saturating_mul(2)
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

/// A held lock: its key, create_revision (the token) and session, and the client-side expiry of the
/// lock's own lease.
pub struct EtcdLease {
    key: String,
    rev: i64,
    session: Arc<Session>,
    clock: Arc<Mutex<LeaseClock>>,
    wake: Arc<Notify>,
    /// The lock's loss channel (the expiry timer and the held-keys watch report on it).
    lost: LossSender,
    /// The local claim on `key`, passed on only once the key is known deleted.
    claim: u64,
    /// The held-keys watch id.
    watch_id: i64,
    /// For the delete of a lease dropped without a release (the core's release task ran on a runtime
    /// that was dropped).
    backend: Weak<Inner>,
    /// A failed release already handed the key to the retried deletes (with its owner): the drop must
    /// not hand it again.
    handed_off: std::sync::atomic::AtomicBool,
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let released = self.clock.lock().map(|c| c.released).unwrap_or(false);
        if released || self.handed_off.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let Some(inner) = self.backend.upgrade() else {
            return;
        };
        let backend = EtcdBackend { inner };
        backend.inner.held.unwatch(self.watch_id);
        // By create_revision, so a newer key of the name is never touched; a key already deleted (a
        // failed release retried, an undo) just passes. The retrier starts on the current runtime, or
        // on the next one the backend is used on.
        backend.retry_delete(Doomed {
            key: self.key.clone(),
            rev: Some(self.rev),
            owner: String::new(),
            session: self.session.clone(),
            claim: self.claim,
            not_before: None,
        });
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

    /// The key's create_revision: the fencing token.
    pub fn create_revision(&self) -> i64 {
        self.rev
    }

    /// The session lease id.
    pub fn lease_id(&self) -> i64 {
        self.session.id
    }
}

#[derive(Debug)]
struct LeaseClock {
    expires: Instant,
    /// The timer deleted the key: no renewal may report it held again.
    expired: bool,
    released: bool,
    /// The expiry timer task runs (see `arm_expiry`); false again if its runtime went away with it.
    timer: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl EtcdBackend {
    /// Connects to the endpoints of an `etcd://` / `etcds://` URL (see [`EtcdConfig::from_url`]).
    /// Fails with `InvalidConfig` for a bad URL and `Unavailable` (naming the endpoints) when no
    /// endpoint answers.
    pub async fn connect(url: &LockUrl) -> Result<EtcdBackend> {
        Self::from_config(EtcdConfig::from_url(url)?).await
    }

    /// Connects with a typed configuration, and checks that a member answers (a `status` call).
    pub async fn from_config(config: EtcdConfig) -> Result<EtcdBackend> {
        Self::open(config).await.map_err(|e| e.into_core(None))
    }

    async fn open(config: EtcdConfig) -> std::result::Result<EtcdBackend, EtcdError> {
        config.check()?;
        let client = connect_client(&config, "connect").await?;
        let (alive, sentinel) = runtime_sentinel();
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                held: HeldKeys::new(client.clone(), config.request_timeout),
                conn: Mutex::new(Conn {
                    client,
                    alive,
                    sentinel,
                }),
                reconnecting: tokio::sync::Mutex::new(()),
                config,
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                keepers: Mutex::new(Vec::new()),
                claims: Mutex::new(HashMap::new()),
                next_claim: AtomicU64::new(1),
                doomed: Mutex::new(Retry::default()),
            }),
        })
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The backend's gRPC client (for fenced writes with [`layout::fenced_put`]; see [`crate::rpc`]).
    /// It does not retry. The backend's requests reconnect on the current runtime once the runtime
    /// the connection was made on is dropped; this handle is the connection as of now.
    pub fn client(&self) -> Client {
        match self.inner.conn.lock() {
            Ok(conn) => conn.client.clone(),
            Err(poisoned) => poisoned.into_inner().client.clone(),
        }
    }

    /// The connection, made again on the current runtime if the runtime it was made on is gone (its
    /// channel's tasks went with it); sessions, keep-alive tasks and the held-keys watch move to it.
    async fn connection(&self) -> std::result::Result<Client, EtcdError> {
        let live = |inner: &Inner| match inner.conn.lock() {
            Ok(conn) if conn.alive.load(Ordering::Acquire) => Some(conn.client.clone()),
            _ => None,
        };
        if let Some(client) = live(&self.inner) {
            return Ok(client);
        }
        let _serial = self.inner.reconnecting.lock().await;
        if let Some(client) = live(&self.inner) {
            return Ok(client);
        }
        let client = connect_client(&self.inner.config, "reconnect").await?;
        let (alive, sentinel) = runtime_sentinel();
        if let Ok(mut conn) = self.inner.conn.lock() {
            if let Some(old) = conn.sentinel.take() {
                old.abort();
            }
            *conn = Conn {
                client: client.clone(),
                alive,
                sentinel,
            };
        }
        tracing::debug!(
            "etcd: the connection's runtime was dropped; reconnected on the current one"
        );
        for session in self.inner.sessions.lock().await.values() {
            session.use_client(&client).await;
        }
        self.inner.held.use_client(&client);
        self.ensure_background();
        Ok(client)
    }

    /// Starts again, on the current runtime, the background tasks whose runtime was dropped: session
    /// keep-alives, the held-keys watch, the retry of failed deletes.
    fn ensure_background(&self) {
        self.ensure_keepers();
        self.inner.held.keep_running();
        self.ensure_retrier();
    }

    /// Starts again, on the current runtime, the keep-alive tasks whose runtime was dropped.
    fn ensure_keepers(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Ok(mut keepers) = self.inner.keepers.lock() {
            for keeper in keepers.iter_mut() {
                if !keeper.alive.load(Ordering::Acquire) && keeper.session.gone_reason().is_none() {
                    *keeper = Keeper::spawn(&runtime, keeper.session.clone());
                }
            }
        }
    }

    /// The session TTL of the configuration: the lease locks get when they ask for none.
    pub fn default_lease(&self) -> Duration {
        self.inner.config.session_ttl
    }

    /// Lock options with [`default_lease`](Self::default_lease) as the lease, for
    /// [`Locks::with_defaults`](distlock_core::Locks::with_defaults).
    pub fn default_options(&self) -> LockOptions {
        LockOptions::default().with_lease(self.default_lease())
    }

    /// The session lease ids of this backend (for tests and status): `(ttl, lease id)`.
    pub async fn session_leases(&self) -> Vec<(Duration, i64)> {
        self.inner
            .sessions
            .lock()
            .await
            .values()
            .filter(|s| s.gone_reason().is_none())
            .map(|s| (s.granted, s.id))
            .collect()
    }

    /// The session for a lock of `lease`: TTL = the lease rounded up to whole seconds.
    async fn session_for(&self, lease: Duration) -> std::result::Result<Arc<Session>, EtcdError> {
        let secs = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
        let secs = secs.max(1);
        let client = self.connection().await?;
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(s) = sessions.get(&secs) {
            if s.gone_reason().is_none() && !s.remaining().is_zero() {
                self.ensure_background();
                return Ok(s.clone());
            }
            // Known gone, or not confirmed within its TTL (keep-alives failed that long): the server
            // has expired it or will before long, so a key put on it now would be born dead. Retire it
            // (revoking it in case it lives on, so its keys go) and grant a new one.
            if s.gone_reason().is_none() {
                let _ = s.mark_gone("the session lease was not confirmed within its TTL");
                let retired = s.clone();
                tokio::spawn(async move { retired.revoke().await });
            }
        }
        let session = Session::grant(
            &client,
            Duration::from_secs(secs),
            self.inner.config.request_timeout,
        )
        .await?;
        let runtime = tokio::runtime::Handle::current();
        if let Ok(mut keepers) = self.inner.keepers.lock() {
            keepers.retain(|k| {
                let live = k.session.gone_reason().is_none();
                if !live {
                    k.task.abort();
                }
                live
            });
            keepers.push(Keeper::spawn(&runtime, session.clone()));
        }
        sessions.insert(secs, session.clone());
        Ok(session)
    }

    async fn txn(
        &self,
        action: &'static str,
        txn: TxnRequest,
    ) -> std::result::Result<TxnResponse, EtcdError> {
        let client = self.connection().await?;
        // Every txn here is compare-guarded, so repeating one is harmless.
        self.idempotent(action, || client.txn(txn.clone())).await
    }

    async fn get(
        &self,
        action: &'static str,
        range: RangeRequest,
    ) -> std::result::Result<RangeResponse, EtcdError> {
        let client = self.connection().await?;
        self.idempotent(action, || client.range(range.clone()))
            .await
    }

    /// Runs an idempotent request within the request timeout, retried per the configured
    /// [`retry`](EtcdConfig::retry) policy on failures other than a refusal of the credentials.
    /// Retrying rides over a connection that broke since the last request, or fails over to another
    /// endpoint: requests are balanced over all endpoints and a dead member's connection fails each
    /// request sent to it, so with several endpoints a few retries are needed to find a live one.
    async fn idempotent<T, F, Fut>(
        &self,
        action: &'static str,
        request: F,
    ) -> std::result::Result<T, EtcdError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
    {
        bounded_retry(
            &self.inner.config,
            action,
            self.inner.config.request_timeout,
            request,
        )
        .await
    }

    /// Deletes a held key by key + create_revision, with a few retries (the expiry timer's delete; the
    /// key's claim stays with its lease until the release).
    async fn delete_own(&self, key: &str, rev: i64) {
        let policy = RetryPolicy::new(3, Duration::from_millis(50), Duration::from_millis(800));
        let deleted = distlock_core::retry::retry(
            &policy,
            None,
            |_| self.txn("expiry delete", layout::release_txn(key, rev)),
            |_| true,
        )
        .await;
        if let Err(e) = deleted {
            tracing::warn!(%key, error = %e, "etcd: could not delete an expired lock key; the release retries it");
        }
    }

    /// Claims the first key of `name` on session `lease` that no local contender uses: slot 0 is Go's
    /// `NAME/<lease hex>`, later slots exist only while several owners of one name share the session.
    fn claim_key(&self, name: &str, lease: i64) -> (String, u64) {
        let claim = self.inner.next_claim.fetch_add(1, Ordering::Relaxed);
        let mut claims = match self.inner.claims.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut slot = 0;
        loop {
            let key = layout::slot_key(name, lease, slot);
            if let std::collections::hash_map::Entry::Vacant(v) = claims.entry(key.clone()) {
                v.insert(claim);
                return (key, claim);
            }
            slot += 1;
        }
    }

    /// Passes a key on locally (it is deleted, or went with its session).
    fn unclaim(&self, key: &str, claim: u64) {
        if let Ok(mut claims) = self.inner.claims.lock() {
            if claims.get(key) == Some(&claim) {
                claims.remove(key);
            }
        }
    }

    /// Marks `key` as someone else's (a key on our lease with another owner's value): no local
    /// contender uses it again while its session lives.
    fn disown(&self, key: &str, claim: u64) {
        if let Ok(mut claims) = self.inner.claims.lock() {
            if claims.get(key) == Some(&claim) {
                claims.insert(key.to_string(), FOREIGN);
            }
        }
    }

    /// One delete of a key of ours: by key + create_revision, or, when the revision never came back,
    /// by key + lease + owner. True once the key is known gone (deleted now, or not there).
    async fn delete_once(&self, doomed: &Doomed) -> bool {
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
    async fn delete_and_unclaim(&self, mut doomed: Doomed) {
        let deleted = self.delete_once(&doomed).await;
        if doomed.rev.is_none() {
            doomed.not_before = Some(
                tokio::time::Instant::now() + self.inner.config.request_timeout.saturating_mul(2),
            );
            self.retry_delete(doomed);
        } else if deleted {
            self.unclaim(&doomed.key, doomed.claim);
        } else {
            self.delete_later(doomed);
        }
    }

    fn delete_later(&self, doomed: Doomed) {
        tracing::warn!(key = %doomed.key, "etcd: could not delete a lock key; retrying in the background (the name stays blocked until it is gone)");
        self.retry_delete(doomed);
    }

    fn retry_delete(&self, doomed: Doomed) {
        if let Ok(mut retry) = self.inner.doomed.lock() {
            retry.keys.insert(doomed.key.clone(), doomed);
        }
        self.ensure_retrier();
    }

    /// Starts the task that retries failed deletes, unless it runs (or nothing is left to delete). It
    /// is started again by later requests if its runtime was dropped.
    fn ensure_retrier(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Ok(mut retry) = self.inner.doomed.lock() else {
            return;
        };
        if retry.keys.is_empty()
            || retry
                .task
                .as_ref()
                .is_some_and(|alive| alive.load(Ordering::Acquire))
        {
            return;
        }
        let alive = Arc::new(AtomicBool::new(true));
        retry.task = Some(alive.clone());
        let flag = AliveFlag(alive);
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            let _flag = flag;
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
                    if doomed.session.gone_reason().is_some() || backend.delete_once(&doomed).await {
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
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn grant(
        &self,
        session: Arc<Session>,
        key: String,
        rev: i64,
        read_rev: i64,
        claim: u64,
        lease: Duration,
    ) -> Grant<EtcdLease> {
        let ttl = lease.min(session.remaining());
        let lost: LossSender = Arc::new(watch::channel::<Option<String>>(None).0);
        let lost_rx = lost.subscribe();
        let clock = Arc::new(Mutex::new(LeaseClock {
            expires: clock::now().saturating_add(lease),
            expired: false,
            released: false,
            timer: None,
        }));
        let wake = Arc::new(Notify::new());
        let gone = session.gone();
        let loss: LossSignal = Box::pin(async move {
            let mut lost_rx = lost_rx;
            let own = async move {
                let reason = match lost_rx.wait_for(Option::is_some).await {
                    Ok(r) => r.clone(),
                    Err(_) => None,
                };
                match reason {
                    Some(reason) => reason,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                reason = gone => reason,
                reason = own => reason,
            }
        });
        let token = FencingToken::new(rev.unsigned_abs());
        // From the revision the grant was read at + 1: the key existed then, so any delete the watch
        // sees is of this very key.
        let watch_id = self
            .inner
            .held
            .watch(key.clone(), rev, read_rev + 1, lost.clone());
        let held = EtcdLease {
            key,
            rev,
            session,
            clock,
            wake,
            lost,
            claim,
            watch_id,
            backend: Arc::downgrade(&self.inner),
            handed_off: std::sync::atomic::AtomicBool::new(false),
        };
        self.arm_expiry(&held, lease);
        Grant::new(held)
            .with_token(token)
            .with_ttl(ttl)
            .with_loss(loss)
    }

    /// Starts the lock's expiry timer once its lease (`ttl`) is shorter than its session's TTL: only
    /// then can the session, kept alive for the process's other locks and waiters, outlive the lock and
    /// keep its key (a short lease at the grant, or a renewal capped by `max_hold`). With equal TTLs the
    /// session's own expiry frees the key, and no task is spent per lock. A timer whose runtime went
    /// away with it is started again on the current one.
    fn arm_expiry(&self, held: &EtcdLease, ttl: Duration) {
        if ttl >= held.session.granted {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let flag = match held.clock.lock() {
            Ok(mut clock) => {
                if clock
                    .timer
                    .as_ref()
                    .is_some_and(|alive| alive.load(Ordering::Acquire))
                {
                    return;
                }
                let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
                clock.timer = Some(alive.clone());
                AliveFlag(alive)
            }
            Err(_) => return,
        };
        runtime.spawn(expiry_timer(
            self.clone(),
            held.key.clone(),
            held.rev,
            held.clock.clone(),
            held.wake.clone(),
            held.lost.clone(),
            flag,
        ));
    }
}

/// Hands a key whose undo did not finish to the retried deletes when dropped.
struct UndoOnDrop {
    backend: EtcdBackend,
    doomed: Option<Doomed>,
}

impl Drop for UndoOnDrop {
    fn drop(&mut self) {
        if let Some(doomed) = self.doomed.take() {
            self.backend.retry_delete(doomed);
        }
    }
}

/// Claim id of a key on our lease that another owner wrote.
const FOREIGN: u64 = 0;

/// A key of ours to delete, with what the delete compares and the claim to pass on after it.
#[derive(Clone)]
struct Doomed {
    key: String,
    rev: Option<i64>,
    owner: String,
    session: Arc<Session>,
    claim: u64,
    /// Not to be tried before this (a create that may still land).
    not_before: Option<tokio::time::Instant>,
}

/// Deletes a held lock's key when its own lease runs out without a renewal (see the module docs).
async fn expiry_timer(
    backend: EtcdBackend,
    key: String,
    rev: i64,
    clock: Arc<Mutex<LeaseClock>>,
    wake: Arc<Notify>,
    lost: LossSender,
    alive: AliveFlag,
) {
    let _alive = alive;
    loop {
        let left = match clock.lock() {
            Ok(c) if c.released => return,
            Ok(c) => c.expires.saturating_duration_since(clock::now()),
            Err(_) => return,
        };
        tokio::select! {
            _ = tokio::time::sleep(left) => {}
            _ = wake.notified() => {}
        }
        match clock.lock() {
            Ok(c) if c.released => return,
            Ok(mut c) if clock::now() >= c.expires => {
                c.expired = true;
                break;
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
    report_loss(
        &lost,
        "the lock's lease ran out without a renewal (max_hold reached or renewals failed); its key was deleted"
            .into(),
    );
    backend.delete_own(&key, rev).await;
}

fn get_of(op: Option<&ResponseOp>) -> std::result::Result<&RangeResponse, EtcdError> {
    match op.and_then(|op| op.response.as_ref()) {
        Some(OpResponse::ResponseRange(get)) => Ok(get),
        other => Err(EtcdError::Protocol(format!(
            "expected a range response in the lock txn, got {other:?}"
        ))),
    }
}

fn header_rev(resp: &TxnResponse) -> std::result::Result<i64, EtcdError> {
    resp.header
        .as_ref()
        .map(|h| h.revision)
        .ok_or_else(|| EtcdError::Protocol("a txn response without a header".into()))
}

fn key_string(kv: &KeyValue) -> String {
    String::from_utf8_lossy(&kv.key).into_owned()
}

impl EtcdBackend {
    /// What one renewal's session keep-alive (`None`: none was sent for it) means for its lock.
    fn renewal_outcome(
        &self,
        entry: &Renewal<'_, EtcdLease>,
        keep_alive: Option<&std::result::Result<Duration, KeepAlive>>,
    ) -> Result<Renewed> {
        match keep_alive {
            Some(Ok(ttl)) => {
                // A loss the backend found (its key deleted) is also this renewal's answer: the
                // grant's loss signal may have no listener any more (the core's watcher ran on a
                // runtime since dropped), and a live session alone does not keep the lock.
                let found = entry.lease.lost.borrow().clone();
                if let Some(reason) = found {
                    return Ok(Renewed::Gone { reason });
                }
                let mut clock = match entry.lease.clock.lock() {
                    Ok(c) => c,
                    Err(_) => {
                        return Ok(Renewed::Gone {
                            reason: "internal error: a poisoned lease clock".into(),
                        })
                    }
                };
                if clock.expired {
                    return Ok(Renewed::Gone {
                        reason:
                            "the lock's own lease ran out before this renewal; its key was deleted"
                                .into(),
                    });
                }
                clock.expires = clock::now().saturating_add(entry.ttl);
                let armed = clock
                    .timer
                    .as_ref()
                    .is_some_and(|alive| alive.load(Ordering::Acquire));
                drop(clock);
                if armed {
                    entry.lease.wake.notify_one();
                } else {
                    self.arm_expiry(entry.lease, entry.ttl);
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
}

#[async_trait]
impl Backend for EtcdBackend {
    type Lease = EtcdLease;
    type Acquisition = EtcdAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict)
            .with_fifo(true)
            .with_notify_wait(true)
            .with_frees_on_process_death(false)
            .with_shared_across_processes(true)
    }

    fn begin(&self, request: &AcquireRequest) -> Result<EtcdAcquisition> {
        let mut acquisition = EtcdAcquisition::default();
        acquisition.backend = Arc::downgrade(&self.inner);
        acquisition.owner = request.owner.clone();
        Ok(acquisition)
    }

    async fn try_acquire(
        &self,
        acquisition: &mut EtcdAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<EtcdLease>> {
        let name = request.name.as_str();
        self.try_once(acquisition, request)
            .await
            .map_err(|e| e.into_core(Some(name)))
    }

    async fn wait(
        &self,
        acquisition: &mut EtcdAcquisition,
        request: &AcquireRequest,
        _retry_after: Option<Duration>,
    ) -> Result<()> {
        self.wait_predecessor(acquisition)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))
    }

    async fn abandon(&self, mut acquisition: EtcdAcquisition, request: &AcquireRequest) {
        // Taken, so that its drop has nothing left to undo.
        let (Some(key), Some(session), Some(claim)) = (
            acquisition.key.take(),
            acquisition.session.take(),
            acquisition.claim.take(),
        ) else {
            return;
        };
        let doomed = Doomed {
            key,
            rev: acquisition.rev,
            owner: request.owner.clone(),
            session,
            claim,
            not_before: None,
        };
        // If this future is dropped before the delete is done (its runtime went away), the retried
        // deletes take the key over.
        let mut unfinished = UndoOnDrop {
            backend: self.clone(),
            doomed: Some(Doomed {
                not_before: doomed.rev.is_none().then(|| {
                    tokio::time::Instant::now()
                        + self.inner.config.request_timeout.saturating_mul(2)
                }),
                ..doomed.clone()
            }),
        };
        self.delete_and_unclaim(doomed).await;
        unfinished.doomed = None;
    }

    async fn renew(&self, batch: &[Renewal<'_, EtcdLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
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
        // held-keys watch move there if their runtime is gone.
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

    async fn release(&self, lease: &EtcdLease, name: &str, owner: &str) -> Result<Released> {
        self.inner.held.unwatch(lease.watch_id);
        let resp = match self
            .txn("release", layout::release_txn(&lease.key, lease.rev))
            .await
        {
            Ok(resp) => resp,
            Err(e) => {
                // The key may still be there, on a session this process keeps alive: delete it in the
                // background until that works, and keep its claim meanwhile, so the next local owner
                // of the name neither adopts it nor gets the lock before it is gone.
                lease
                    .handed_off
                    .store(true, std::sync::atomic::Ordering::Release);
                self.delete_later(Doomed {
                    key: lease.key.clone(),
                    rev: Some(lease.rev),
                    owner: owner.to_string(),
                    session: lease.session.clone(),
                    claim: lease.claim,
                    not_before: None,
                });
                return Err(e.into_core(Some(name)));
            }
        };
        self.unclaim(&lease.key, lease.claim);
        // Only now stop the expiry timer: if the release failed, the timer still deletes the key
        // when the lease runs out.
        if let Ok(mut c) = lease.clock.lock() {
            c.released = true;
        }
        lease.wake.notify_one();
        Ok(if resp.succeeded {
            Released::Released
        } else {
            Released::NotHeld
        })
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        let resp = self
            .get("status read", layout::all_keys(name))
            .await
            .map_err(|e| e.into_core(Some(name)))?;
        let kvs = &resp.kvs;
        let mut info = LockInfo::default();
        info.waiters = Some(kvs.len().saturating_sub(1));
        if let Some(holder) = kvs.first() {
            let mut remaining = None;
            if holder.lease != 0 {
                let client = self.client();
                if let Ok(Ok(ttl)) = tokio::time::timeout(
                    self.inner.config.request_timeout,
                    client.lease_time_to_live(holder.lease),
                )
                .await
                {
                    remaining = Some(Duration::from_secs(ttl.ttl.max(0).unsigned_abs()));
                }
            }
            let value = String::from_utf8_lossy(&holder.value).into_owned();
            let token = FencingToken::new(holder.create_revision.unsigned_abs());
            let mut holder_info = HolderInfo::default();
            holder_info.owner = (!value.is_empty()).then_some(value);
            holder_info.token = Some(token);
            holder_info.remaining_lease = remaining;
            info.holder = Some(holder_info);
            info.last_token = Some(token);
        }
        Ok(info)
    }
}

impl EtcdBackend {
    async fn try_once(
        &self,
        acq: &mut EtcdAcquisition,
        request: &AcquireRequest,
    ) -> std::result::Result<Attempt<EtcdLease>, EtcdError> {
        let prefix = layout::prefix(&request.name);
        let (session, key, rev, holder, predecessor, read_rev, alive_at) = match (
            &acq.session,
            &acq.key,
            acq.rev,
        ) {
            (Some(session), Some(key), Some(rev)) => {
                let resp = self
                    .txn("acquire check", layout::check_txn(key, &prefix, rev))
                    .await?;
                if !resp.succeeded {
                    let why = session.gone_reason().unwrap_or_else(|| {
                        "the queued key was deleted (its session lease expired or someone removed it)".into()
                    });
                    return Err(EtcdError::SessionLost(format!(
                        "lost the place in the queue while waiting: {why}; not reporting the lock held (etcd issue 11456)"
                    )));
                }
                let ops = &resp.responses;
                let holder = get_of(ops.first())?.kvs.first().cloned();
                let pred = get_of(ops.get(1))?.kvs.first().cloned();
                let read_rev = header_rev(&resp)?;
                (
                    session.clone(),
                    key.clone(),
                    rev,
                    holder,
                    pred,
                    read_rev,
                    read_rev,
                )
            }
            _ => self.create(acq, request, &prefix).await?,
        };
        acq.rev = Some(rev);
        let first = holder.as_ref().is_none_or(|h| h.create_revision == rev);
        if first {
            acq.watch = None;
            // Kept in the acquisition too: a grant the core refuses (it came after its deadline) is abandoned.
            let claim = acq.claim.unwrap_or(FOREIGN);
            acq.granted = true;
            return Ok(Attempt::Acquired(self.grant(
                session,
                key,
                rev,
                alive_at,
                claim,
                request.lease,
            )));
        }
        acq.watch = predecessor.map(|kv| (key_string(&kv), read_rev + 1));
        Ok(Attempt::Busy { retry_after: None })
    }

    /// The first try: claims a key, creates it if absent, reads the holder and the predecessor.
    /// Returns `(session, key, rev, holder, predecessor, read revision, a revision the key existed at)`.
    async fn create(
        &self,
        acq: &mut EtcdAcquisition,
        request: &AcquireRequest,
        prefix: &str,
    ) -> std::result::Result<Created, EtcdError> {
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
                return Ok((session, key, rev, holder, pred, read_rev, read_rev));
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
            return Ok((session, key, rev, holder, pred, pred_rev, read_rev));
        }
        Err(EtcdError::Protocol(format!(
            "no usable lock key for {} after several tries (keys on this session's lease hold other owners' ids, or its lease keeps vanishing)",
            request.name
        )))
    }

    async fn wait_predecessor(
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
        let timeout = self.inner.config.request_timeout;
        let mut stream = tokio::select! {
            reason = &mut gone => return Err(session_died(reason)),
            opened = tokio::time::timeout(timeout, client.watch(watch)) => match opened {
                Ok(Ok(stream)) => stream,
                // The next try reports a server that is really down; a broken connection is retried there.
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "etcd: opening a watch failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
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
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return Ok(());
                    }
                },
            }
        }
    }
}

/// What [`EtcdBackend::create`] found.
type Created = (
    Arc<Session>,
    String,
    i64,
    Option<KeyValue>,
    Option<KeyValue>,
    i64,
    i64,
);

fn session_died(reason: String) -> EtcdError {
    EtcdError::SessionLost(format!(
        "the session lease died while waiting for the lock ({reason}); the queued key went with it, so this acquire stops (etcd issue 19597)"
    ))
}

/// Runs `request` until it succeeds, within `timeout` in all, retried per `config.retry` on
/// failures other than a refusal of the credentials.
async fn bounded_retry<T, F, Fut>(
    config: &EtcdConfig,
    action: &'static str,
    timeout: Duration,
    request: F,
) -> std::result::Result<T, EtcdError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    distlock_core::retry::retry(
        &config.retry,
        Some(deadline),
        |_| async {
            match tokio::time::timeout_at(deadline, request()).await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(status)) => {
                    tracing::debug!(action, error = %status, "etcd request failed");
                    Err(EtcdError::rpc(action)(status))
                }
                Err(_) => Err(EtcdError::Timeout {
                    action,
                    after: timeout,
                }),
            }
        },
        |e| matches!(e, EtcdError::Rpc { source, .. } if crate::error::retryable(source)),
    )
    .await
}

/// Makes the client of `config` and proves within the connect timeout that a member answers (and
/// the credentials work): authenticates if needed, then one status call, retried per
/// `config.retry` (requests are balanced over the endpoints, and one may land on a dead member).
/// `action` names the attempt in a timeout error (`connect`, `reconnect`).
async fn connect_client(
    config: &EtcdConfig,
    action: &'static str,
) -> std::result::Result<Client, EtcdError> {
    let client = Client::new(config)?;
    let proved = bounded_retry(config, action, config.connect_timeout, || async {
        if client.needs_token() {
            client.authenticate().await?;
        }
        client.status().await
    })
    .await;
    match proved {
        Ok(_) => Ok(client),
        Err(EtcdError::Rpc { source, .. }) => Err(EtcdError::Connect {
            endpoints: config.endpoints.join(","),
            source,
        }),
        Err(e) => Err(e),
    }
}
