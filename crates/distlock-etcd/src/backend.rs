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
//! when the session lease is confirmed gone (a keep-alive answering TTL 0 / lease not found: revoked or
//! expired), so a revoked lease is noticed within one keep-alive interval (a third of the TTL).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::clock::{self, Instant};
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, LossSignal, Released, Renewal,
    Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Fencing, FencingToken, LockOptions, Result};
use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetResponse, KeyValue, TlsOptions, Txn,
    TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;

use crate::config::EtcdConfig;
use crate::error::{EtcdError, BACKEND};
use crate::layout;
use crate::session::{KeepAlive, Session};

/// The etcd backend. Cheap to clone: clones share the connection and the sessions.
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
    client: Client,
    config: EtcdConfig,
    /// Sessions by TTL in whole seconds.
    sessions: tokio::sync::Mutex<HashMap<u64, Arc<Session>>>,
    keepers: Mutex<Vec<(Arc<Session>, AbortHandle)>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let keepers = match self.keepers.get_mut() {
            Ok(k) => std::mem::take(k),
            Err(_) => return,
        };
        let handle = tokio::runtime::Handle::try_current().ok();
        for (session, task) in keepers {
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
}

/// A held lock: its key, create_revision (the token) and session, and the client-side expiry of the
/// lock's own lease.
pub struct EtcdLease {
    key: String,
    rev: i64,
    session: Arc<Session>,
    clock: Arc<Mutex<LeaseClock>>,
    wake: Arc<Notify>,
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
    /// The loss channel's sender until the expiry timer starts (see `arm_expiry`); `None` once it runs.
    unarmed: Option<watch::Sender<Option<String>>>,
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
        config.validate()?;
        let shown = config.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.timeout)
            // HTTP/2 pings find a dead connection (a blackholed peer) within a few seconds.
            .with_keep_alive(Duration::from_secs(2), config.timeout)
            .with_keep_alive_while_idle(true);
        if let (Some(user), Some(password)) = (&config.user, &config.password) {
            options = options.with_user(user.clone(), password.clone());
        }
        if config.tls {
            let mut tls = TlsOptions::new().with_native_roots();
            if let Some(path) = &config.ca_file {
                let pem = std::fs::read(path).map_err(|e| {
                    EtcdError::Config(format!("cannot read the CA file {}: {e}", path.display()))
                })?;
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            options = options.with_tls(tls);
        }
        let connect = Client::connect(config.client_endpoints(), Some(options));
        let client = match tokio::time::timeout(config.timeout, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(source)) => {
                return Err(EtcdError::Connect {
                    endpoints: shown,
                    source,
                })
            }
            Err(_) => {
                return Err(EtcdError::Timeout {
                    action: "connect",
                    after: config.timeout,
                })
            }
        };
        // The channel connects lazily: one cheap call proves a member answers (and auth works).
        // Requests are balanced over the endpoints at random, so with one member down a single call
        // may land on it: retry (bounded by the timeout) before calling the whole list unreachable.
        let mut maintenance = client.maintenance_client();
        let started = tokio::time::Instant::now();
        let mut retries = retries_for(config.endpoints.len()).saturating_sub(1);
        let status = loop {
            let left = config.timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, maintenance.status()).await {
                Ok(Err(e)) if retries > 0 => {
                    tracing::debug!(error = %e, retries, "etcd status check failed; retrying");
                    retries -= 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => break other,
            }
        };
        match status {
            Ok(Ok(_)) => {}
            Ok(Err(source)) => {
                return Err(EtcdError::Connect {
                    endpoints: shown,
                    source,
                })
            }
            Err(_) => {
                return Err(EtcdError::Connect {
                    endpoints: shown,
                    source: etcd_client::Error::InvalidArgs(format!(
                        "no answer within {:?}",
                        config.timeout
                    )),
                })
            }
        }
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                client,
                config,
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                keepers: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The underlying etcd-client handle (for fenced writes with [`layout::fenced_put`]).
    pub fn client(&self) -> &Client {
        &self.inner.client
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
        let mut sessions = self.inner.sessions.lock().await;
        if let Some(s) = sessions.get(&secs) {
            if s.gone_reason().is_none() {
                return Ok(s.clone());
            }
        }
        let session = Session::grant(
            &self.inner.client,
            Duration::from_secs(secs),
            self.inner.config.timeout,
        )
        .await?;
        let task = tokio::spawn(session.clone().keep_alive_loop()).abort_handle();
        if let Ok(mut keepers) = self.inner.keepers.lock() {
            keepers.retain(|(s, t)| {
                let live = s.gone_reason().is_none();
                if !live {
                    t.abort();
                }
                live
            });
            keepers.push((session.clone(), task));
        }
        sessions.insert(secs, session.clone());
        Ok(session)
    }

    async fn txn(
        &self,
        action: &'static str,
        txn: Txn,
    ) -> std::result::Result<TxnResponse, EtcdError> {
        let kv = self.inner.client.kv_client();
        // Every txn here is compare-guarded, so repeating one is harmless.
        self.idempotent(action, || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
    }

    async fn get(
        &self,
        action: &'static str,
        (key, options): (String, etcd_client::GetOptions),
    ) -> std::result::Result<GetResponse, EtcdError> {
        let kv = self.inner.client.kv_client();
        self.idempotent(action, || {
            let (mut kv, key, options) = (kv.clone(), key.clone(), options.clone());
            async move { kv.get(key, Some(options)).await }
        })
        .await
    }

    /// Runs an idempotent request within the request timeout, retrying failures other than a refusal
    /// of the credentials. Retrying rides over a connection that broke since the last request, or fails
    /// over to another endpoint: etcd-client balances requests over all endpoints at random and a dead
    /// member's connection fails each request sent to it, so with several endpoints a few retries are
    /// needed to find a live one.
    async fn idempotent<T, F, Fut>(
        &self,
        action: &'static str,
        mut request: F,
    ) -> std::result::Result<T, EtcdError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let timeout = self.inner.config.timeout;
        let started = tokio::time::Instant::now();
        let mut retries = self.retries();
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, request()).await {
                Err(_) => {
                    return Err(EtcdError::Timeout {
                        action,
                        after: timeout,
                    })
                }
                Ok(Ok(resp)) => return Ok(resp),
                Ok(Err(e))
                    if retries > 0
                        && !matches!(
                            crate::error::kind_of(&e),
                            distlock_core::ErrorKind::PermissionDenied
                        ) =>
                {
                    tracing::debug!(action, error = %e, retries, "etcd request failed; retrying");
                    retries -= 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Err(e)) => return Err(EtcdError::rpc(action)(e)),
            }
        }
    }

    /// How many times an idempotent request is retried: once with one endpoint, and with several
    /// enough that a random pick among them meets a live one with near certainty while a member is down.
    fn retries(&self) -> usize {
        retries_for(self.inner.config.endpoints.len())
    }

    /// Deletes a key by key + create_revision, with a few retries: a queued key left behind on a live
    /// session would block the name until the backend goes away.
    async fn delete_own(&self, key: &str, rev: Option<i64>, lease: i64) {
        let mut delay = Duration::from_millis(50);
        for attempt in 0..4 {
            let txn = match rev {
                Some(rev) => layout::release_txn(key, rev),
                None => layout::undo_txn(key, lease),
            };
            match self.txn("undo", txn).await {
                Ok(_) => return,
                Err(e) if attempt == 3 => {
                    tracing::warn!(%key, error = %e, "etcd: could not delete an abandoned key; it goes with its session lease");
                }
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay *= 4;
                }
            }
        }
    }

    fn grant(
        &self,
        session: Arc<Session>,
        key: String,
        rev: i64,
        lease: Duration,
    ) -> Grant<EtcdLease> {
        let ttl = lease.min(session.remaining());
        let (lost_tx, lost_rx) = watch::channel::<Option<String>>(None);
        let clock = Arc::new(Mutex::new(LeaseClock {
            expires: clock::now().saturating_add(lease),
            expired: false,
            released: false,
            unarmed: Some(lost_tx),
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
        let held = EtcdLease {
            key,
            rev,
            session,
            clock,
            wake,
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
    /// session's own expiry frees the key, and no task is spent per lock.
    fn arm_expiry(&self, held: &EtcdLease, ttl: Duration) {
        if ttl >= held.session.granted {
            return;
        }
        let lost = match held.clock.lock() {
            Ok(mut clock) => clock.unarmed.take(),
            Err(_) => None,
        };
        if let Some(lost) = lost {
            tokio::spawn(expiry_timer(
                self.clone(),
                held.key.clone(),
                held.rev,
                held.clock.clone(),
                held.wake.clone(),
                lost,
            ));
        }
    }
}

/// Deletes a held lock's key when its own lease runs out without a renewal (see the module docs).
async fn expiry_timer(
    backend: EtcdBackend,
    key: String,
    rev: i64,
    clock: Arc<Mutex<LeaseClock>>,
    wake: Arc<Notify>,
    lost: watch::Sender<Option<String>>,
) {
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
    let _ = lost.send(Some(
        "the lock's lease ran out without a renewal (max_hold reached or renewals failed); its key was deleted"
            .into(),
    ));
    backend.delete_own(&key, Some(rev), 0).await;
}

/// Retries of an idempotent request over `endpoints` endpoints: 1 for one, 4 per endpoint beyond it
/// (with one of three members dead, ten picks all landing on it is a ~1-in-60 000 event).
fn retries_for(endpoints: usize) -> usize {
    1 + 4 * endpoints.saturating_sub(1)
}

fn get_of(op: Option<&TxnOpResponse>) -> std::result::Result<&GetResponse, EtcdError> {
    match op {
        Some(TxnOpResponse::Get(get)) => Ok(get),
        other => Err(EtcdError::Protocol(format!(
            "expected a range response in the lock txn, got {other:?}"
        ))),
    }
}

fn header_rev(resp: &TxnResponse) -> std::result::Result<i64, EtcdError> {
    resp.header()
        .map(|h| h.revision())
        .ok_or_else(|| EtcdError::Protocol("a txn response without a header".into()))
}

fn key_string(kv: &KeyValue) -> String {
    String::from_utf8_lossy(kv.key()).into_owned()
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

    fn begin(&self, _request: &AcquireRequest) -> Result<EtcdAcquisition> {
        Ok(EtcdAcquisition::default())
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

    async fn abandon(&self, acquisition: EtcdAcquisition, _request: &AcquireRequest) {
        let (Some(key), Some(session)) = (acquisition.key, acquisition.session) else {
            return;
        };
        self.delete_own(&key, acquisition.rev, session.id).await;
    }

    async fn renew(&self, batch: &[Renewal<'_, EtcdLease>]) -> Vec<Result<Renewed>> {
        // One keep-alive round trip per distinct session, concurrently.
        let mut sessions: Vec<Arc<Session>> = Vec::new();
        for entry in batch {
            if !sessions.iter().any(|s| s.id == entry.lease.session.id) {
                sessions.push(entry.lease.session.clone());
            }
        }
        let outcomes =
            futures_util::future::join_all(sessions.iter().map(|s| s.keep_alive())).await;
        let by_id: HashMap<i64, &std::result::Result<Duration, KeepAlive>> =
            sessions.iter().map(|s| s.id).zip(outcomes.iter()).collect();
        batch
            .iter()
            .map(|entry| match by_id.get(&entry.lease.session.id) {
                Some(Ok(ttl)) => {
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
                            reason: "the lock's own lease ran out before this renewal; its key was deleted".into(),
                        });
                    }
                    clock.expires = clock::now().saturating_add(entry.ttl);
                    let armed = clock.unarmed.is_none();
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
            })
            .collect()
    }

    async fn release(&self, lease: &EtcdLease, name: &str, _owner: &str) -> Result<Released> {
        let resp = self
            .txn("release", layout::release_txn(&lease.key, lease.rev))
            .await
            .map_err(|e| e.into_core(Some(name)))?;
        // Only now stop the expiry timer: if the release failed, the timer still deletes the key
        // when the lease runs out.
        if let Ok(mut c) = lease.clock.lock() {
            c.released = true;
        }
        lease.wake.notify_one();
        Ok(if resp.succeeded() {
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
        let kvs = resp.kvs();
        let mut info = LockInfo::default();
        info.waiters = Some(kvs.len().saturating_sub(1));
        if let Some(holder) = kvs.first() {
            let mut remaining = None;
            if holder.lease() != 0 {
                let mut lease = self.inner.client.lease_client();
                if let Ok(Ok(ttl)) = tokio::time::timeout(
                    self.inner.config.timeout,
                    lease.time_to_live(holder.lease(), None),
                )
                .await
                {
                    remaining = Some(Duration::from_secs(ttl.ttl().max(0).unsigned_abs()));
                }
            }
            let value = String::from_utf8_lossy(holder.value()).into_owned();
            let token = FencingToken::new(holder.create_revision().unsigned_abs());
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
        let (session, key, rev, holder, predecessor, read_rev) = match (
            &acq.session,
            &acq.key,
            acq.rev,
        ) {
            (Some(session), Some(key), Some(rev)) => {
                let resp = self
                    .txn("acquire check", layout::check_txn(key, &prefix, rev))
                    .await?;
                if !resp.succeeded() {
                    let why = session.gone_reason().unwrap_or_else(|| {
                        "the queued key was deleted (its session lease expired or someone removed it)".into()
                    });
                    return Err(EtcdError::SessionLost(format!(
                        "lost the place in the queue while waiting: {why}; not reporting the lock held (etcd issue 11456)"
                    )));
                }
                let ops = resp.op_responses();
                let holder = get_of(ops.first())?.kvs().first().cloned();
                let pred = get_of(ops.get(1))?.kvs().first().cloned();
                (
                    session.clone(),
                    key.clone(),
                    rev,
                    holder,
                    pred,
                    header_rev(&resp)?,
                )
            }
            _ => {
                let session = self.session_for(request.lease).await?;
                let key = layout::key(&request.name, session.id);
                acq.session = Some(session.clone());
                acq.key = Some(key.clone());
                acq.rev = None;
                let resp = self
                    .txn(
                        "acquire",
                        layout::create_txn(&key, &prefix, session.id, &request.owner),
                    )
                    .await?;
                let read_rev = header_rev(&resp)?;
                let ops = resp.op_responses();
                let holder = get_of(ops.get(1))?.kvs().first().cloned();
                if resp.succeeded() {
                    // Our key is the newest; the one before it is the predecessor.
                    let rev = read_rev;
                    let pred = get_of(ops.get(2))?
                        .kvs()
                        .iter()
                        .find(|kv| kv.create_revision() < rev)
                        .cloned();
                    (session, key, rev, holder, pred, read_rev)
                } else {
                    // The key was there: a retry after a lost reply. Ours (the key carries our lease).
                    let own = get_of(ops.first())?.kvs().first().cloned().ok_or_else(|| {
                        EtcdError::Protocol("the lock key vanished inside a txn".into())
                    })?;
                    if own.lease() != session.id {
                        return Err(EtcdError::Protocol(format!(
                            "{key} exists on lease {:x}, not on this session's lease",
                            own.lease()
                        )));
                    }
                    let rev = own.create_revision();
                    let pred_resp = self
                        .get("predecessor read", layout::predecessor(&prefix, rev))
                        .await?;
                    let pred = pred_resp.kvs().first().cloned();
                    let read_rev = pred_resp.header().map_or(read_rev, |h| h.revision());
                    (session, key, rev, holder, pred, read_rev)
                }
            }
        };
        acq.rev = Some(rev);
        let first = holder.as_ref().is_none_or(|h| h.create_revision() == rev);
        if first {
            acq.watch = None;
            return Ok(Attempt::Acquired(self.grant(
                session,
                key,
                rev,
                request.lease,
            )));
        }
        acq.watch = predecessor.map(|kv| (key_string(&kv), read_rev + 1));
        Ok(Attempt::Busy { retry_after: None })
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
        let options = WatchOptions::new()
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut]);
        let mut client = self.inner.client.watch_client();
        let timeout = self.inner.config.timeout;
        let mut stream = tokio::select! {
            reason = &mut gone => return Err(session_died(reason)),
            opened = tokio::time::timeout(timeout, client.watch(pred.clone(), Some(options))) => match opened {
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
                        if resp.canceled() || resp.compact_revision() > 0 {
                            return Ok(());
                        }
                        if resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
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

fn session_died(reason: String) -> EtcdError {
    EtcdError::SessionLost(format!(
        "the session lease died while waiting for the lock ({reason}); the queued key went with it, so this acquire stops (etcd issue 19597)"
    ))
}
