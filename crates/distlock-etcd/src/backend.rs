//! `impl raw::Backend` for etcd: the backend type, its construction, and the trait methods, which
//! delegate to the job files: `acquire.rs` (tries and waits), `lease.rs` (grants, renewals, expiry,
//! release), `claims.rs` (local key claims and the deletes that pass them on), `conn.rs` (the
//! connection, sessions, retried requests), `held.rs` (the watch on held keys), `tasks.rs` (background
//! tasks that outlive runtimes).
//!
//! # How an acquire runs
//!
//! The first [`try_acquire`](EtcdBackend::try_acquire) picks the session of the lock's lease (granting
//! it on first use) and sends one transaction: create `NAME/<lease hex>` if absent, read the holder
//! (oldest key) and the predecessor (the key created just before ours). When either answer is not a
//! key of `NAME` (a nested lock's `NAME/b/<hex>`: `layout::is_contender`), the keys up to ours are read
//! once more at the transaction's revision and only `NAME`'s count. Holder = ours → granted, with
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
//! session's TTL — and every other held lock too, since the session is kept alive while the core may
//! stop renewing (at `max_hold`, or after stalled renewals) — has a deadline in the backend's
//! client-side expiry (one task for all held locks, `expiry.rs`), which deletes its key (by
//! create_revision) when its own lease runs out without a renewal: `max_hold` and short leases
//! are honoured even though the session lives on. The expiry fires no earlier than the deadline
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
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, HandOff, HolderInfo, LockInfo, Released, Renewal, RenewalId,
    Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{
    Capabilities, Error, ErrorKind, Fencing, FencingToken, LockKind, LockKinds, LockOptions,
    ReadWriteOrder, Result,
};

use crate::acquire::EtcdAcquisition;
use crate::claims::Retry;
use crate::config::EtcdConfig;
use crate::conn::{connect_client, Conn, Keeper};
use crate::error::{EtcdError, BACKEND};
use crate::expiry::Expiries;
use crate::held::HeldKeys;
use crate::layout::{self, NameKey};
use crate::lease::EtcdLease;
use crate::rpc::pb::etcdserverpb::RangeRequest;
use crate::rpc::Client;
use crate::session::Session;

/// The error of a break aimed at a shared holder of `name` (a reader, a permit holder), which a break
/// never ends.
fn shared_holder(name: &str, kind: NameKey) -> Error {
    let holder = if kind == NameKey::Read {
        "a reader"
    } else {
        "a semaphore permit holder"
    };
    Error::new(
        ErrorKind::Unsupported,
        format!("break ends an exclusive holder only (a mutex or a write lock); the holder given is {holder} of {name:?}, which is left holding"),
    )
    .with_backend(BACKEND)
    .with_lock(name)
}

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
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// The connection. Its channel runs tasks on the runtime it was made on, so when that runtime is
    /// dropped the connection is dead: the next request reconnects on the current runtime.
    pub(crate) conn: Mutex<Conn>,
    pub(crate) reconnecting: tokio::sync::Mutex<()>,
    pub(crate) config: EtcdConfig,
    /// Sessions by TTL in whole seconds.
    pub(crate) sessions: tokio::sync::Mutex<HashMap<u64, Arc<Session>>>,
    pub(crate) keepers: Mutex<Vec<Keeper>>,
    /// Lock keys a local contender of this backend (or of a clone) uses, by key, with the claim id of
    /// that contender: queued, held, or left behind by a delete that failed and is being retried. All
    /// locks of a session share its lease, so without claims two owners of one name would compute the
    /// same key and the second would adopt the first one's key and token.
    pub(crate) claims: Mutex<HashMap<Arc<str>, u64>>,
    pub(crate) next_claim: AtomicU64,
    /// Keys whose delete failed, retried by one background task.
    pub(crate) doomed: Mutex<Retry>,
    /// The watch on held keys (one stream for the whole backend).
    pub(crate) held: HeldKeys,
    /// The deadlines of held locks, and the one task that expires them.
    pub(crate) expiries: Arc<Expiries>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.expiries.stop();
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
        for Keeper { session, task } in keepers {
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
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                held: HeldKeys::new(client.clone(), config.connection.request_timeout),
                conn: Mutex::new(Conn::new(client)),
                reconnecting: tokio::sync::Mutex::new(()),
                config,
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                keepers: Mutex::new(Vec::new()),
                claims: Mutex::new(HashMap::new()),
                next_claim: AtomicU64::new(1),
                doomed: Mutex::new(Retry::default()),
                expiries: Arc::default(),
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

    /// The session TTL of the configuration: the lease locks get when they ask for none.
    pub fn default_lease(&self) -> Duration {
        self.inner.config.session_ttl
    }

    /// Lock options with [`default_lease`](Self::default_lease) as the lease, for
    /// [`Locks::with_defaults`](distlock_core::Locks::with_defaults).
    pub fn default_options(&self) -> LockOptions {
        LockOptions::default().with_lease(self.default_lease())
    }

    /// The session lease ids of this backend (a test hook, with the `testing` feature): `(ttl, lease
    /// id)`.
    #[cfg(feature = "testing")]
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

    /// How many held locks have a deadline in the expiry task's structure (a test hook, with the
    /// `testing` feature).
    #[cfg(feature = "testing")]
    pub fn held_deadlines(&self) -> usize {
        self.inner.expiries.len()
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
            // `distlock break`: the holder's key deleted by its create_revision (`break_name`).
            .with_breaks_holders(true)
            .with_kinds(
                LockKinds::mutex_only()
                    .with_read_write(ReadWriteOrder::Fifo)
                    .with_semaphore(),
            )
    }

    fn begin(&self, request: &AcquireRequest) -> Result<EtcdAcquisition> {
        Ok(EtcdAcquisition::new(self, request))
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
        self.wait_predecessor(
            acquisition,
            // Every kind but the mutex (whose single watch issue 9 measured); a permit waiting on
            // the permits' range watches its own key with it already.
            !matches!(request.kind, LockKind::Mutex),
        )
        .await
        .map_err(|e| e.into_core(Some(&request.name)))
    }

    async fn abandon(&self, acquisition: EtcdAcquisition, request: &AcquireRequest) {
        self.abandon_acquisition(acquisition, request).await;
    }

    async fn renew(&self, batch: &[Renewal<'_, EtcdLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        self.renew_batch(batch).await
    }

    async fn release(&self, lease: &EtcdLease, name: &str, owner: &str) -> Result<Released> {
        self.release_lease(lease, name, owner).await
    }

    fn supports_hand_off(&self) -> bool {
        true
    }

    async fn hand_off(
        &self,
        lease: &EtcdLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<EtcdLease>> {
        self.hand_off_lease(lease, name, owner, next).await
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.inspect_name(name)
            .await
            .map_err(|e| e.into_core(Some(name)))
    }

    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        self.break_name(name, holder).await
    }
}

impl EtcdBackend {
    /// The number a key of the name keeps (the stored limit, the last write token); `None` when the
    /// key is missing or holds no number.
    async fn read_number<T: std::str::FromStr>(
        &self,
        action: &'static str,
        key: String,
    ) -> std::result::Result<Option<T>, EtcdError> {
        let read = self
            .get(
                action,
                RangeRequest {
                    key: key.into_bytes(),
                    ..RangeRequest::default()
                },
            )
            .await?;
        Ok(read
            .kvs
            .first()
            .and_then(|kv| std::str::from_utf8(&kv.value).ok()?.trim().parse().ok()))
    }

    /// `distlock break`: ends the exclusive hold `holder` (as [`inspect_name`](Self::inspect_name)
    /// showed it) by deleting its key ([`layout::break_txn`]), only while that key still has the
    /// token shown as its create_revision (and the owner shown as its value, and the hold id shown,
    /// [`layout::hold_id`]). A holder given that is a reader or a permit holder (its hold id or its
    /// permit says so; with neither, it matches one of the name's shared holders now by owner and
    /// token) is `Unsupported`. Otherwise the holder is the oldest contender of the name, read first:
    /// any other hold there (readers, permits, another exclusive holder) or none is `Ok(false)`, the
    /// holder shown having gone. A key passing the txn's compare is still the holder (no key older
    /// than it can appear), so the compare alone keeps a holder that came since safe. The holder's
    /// session lease is left alone (its other locks live on); waiters watching the key and the
    /// holder's own held-key watch (`held.rs`) see the delete as they see a release.
    async fn break_name(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let core = |e: EtcdError| e.into_core(Some(name));
        let aimed = holder.hold_id.as_deref().and_then(layout::parse_hold_id);
        if holder.token.is_none() && holder.owner.is_none() && aimed.is_none() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the holder to break has neither a token, an owner id nor a hold id: pass the holder status showed",
            )
            .with_backend(BACKEND)
            .with_lock(name));
        }
        if let Some((kind, _)) = aimed.filter(|(kind, _)| !kind.is_exclusive()) {
            return Err(shared_holder(name, kind));
        }
        if holder.permit.is_some() {
            return Err(shared_holder(name, NameKey::Permit));
        }
        let resp = self
            .get("break read", layout::all_keys(name))
            .await
            .map_err(core)?;
        let prefix = layout::prefix(name);
        let Some((kind, kv)) = resp
            .kvs
            .iter()
            .find_map(|kv| layout::classify(&prefix, &kv.key).map(|k| (k, kv)))
        else {
            return Ok(false);
        };
        if !kind.is_exclusive() {
            // Readers or permits hold now: the exclusive holder shown has gone, unless the holder
            // given (with no hold id: built by hand) is one of them, as status shows them.
            if aimed.is_none() && self.is_shared_holder(name, holder).await.map_err(core)? {
                return Err(shared_holder(name, kind));
            }
            return Ok(false);
        }
        let value = String::from_utf8_lossy(&kv.value);
        let same_hold = aimed.is_none_or(|aimed| aimed == (kind, kv.create_revision));
        let same_token = holder
            .token
            .is_none_or(|t| t.get() == kv.create_revision.unsigned_abs());
        let same_owner = holder.owner.as_deref().is_none_or(|o| o == value);
        if !(same_hold && same_token && same_owner) {
            return Ok(false);
        }
        let key = String::from_utf8_lossy(&kv.key).into_owned();
        let txn = layout::break_txn(
            name,
            &key,
            kv.create_revision,
            holder.owner.as_deref(),
            kind == NameKey::Write,
        );
        let resp = self
            .txn_settled("break", txn, |resp| resp.succeeded)
            .await
            .map_err(core)?;
        if resp.reply.succeeded {
            tracing::debug!(%key, rev = kv.create_revision, "etcd: broke a hold (deleted its key)");
            return Ok(true);
        }
        if resp.unsure {
            // A send that got no reply may be the one that deleted the key.
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("break of {name:?} on etcd: the outcome is unknown: a send got no reply, and the one that answered found the key {key} gone (that send deleted it, or the hold ended otherwise); no other hold was touched"),
            )
            .with_backend(BACKEND)
            .with_lock(name));
        }
        Ok(false)
    }

    /// Whether `holder` (given with no hold id) is one of the readers or permit holders `status`
    /// shows for `name` now: the same owner id and token, where given.
    async fn is_shared_holder(
        &self,
        name: &str,
        holder: &HolderInfo,
    ) -> std::result::Result<bool, EtcdError> {
        let info = self.inspect_name(name).await?;
        Ok(info.holders.iter().any(|shared| {
            holder
                .owner
                .as_ref()
                .is_none_or(|o| shared.owner.as_ref() == Some(o))
                && holder.token.is_none_or(|t| shared.token == Some(t))
        }))
    }

    /// `status`: the name's keys ([`layout::classify`]; a nested lock's keys, issue 24, are neither
    /// holders nor waiters) in create_revision order. The oldest decides the kind: a mutex or a
    /// writer holds alone; readers hold up to the first key of another kind; permits hold up to the
    /// first key of another kind and the stored limit. The rest wait.
    async fn inspect_name(&self, name: &str) -> std::result::Result<LockInfo, EtcdError> {
        let resp = self.get("status read", layout::all_keys(name)).await?;
        let prefix = layout::prefix(name);
        let keys: Vec<_> = resp
            .kvs
            .iter()
            .filter_map(|kv| layout::classify(&prefix, &kv.key).map(|k| (k, kv)))
            .collect();
        let mut info = LockInfo::default();
        let Some(&(first, _)) = keys.first() else {
            info.waiters = Some(0);
            return Ok(info);
        };
        let limit = match first {
            NameKey::Permit => {
                self.read_number::<u32>("status limit read", layout::limit_key(name))
                    .await?
            }
            _ => None,
        };
        let holding = match first {
            NameKey::Read | NameKey::Permit => {
                let same = keys.iter().take_while(|(k, _)| *k == first).count();
                match (first, limit) {
                    (NameKey::Permit, Some(limit)) => {
                        same.min(usize::try_from(limit).unwrap_or(usize::MAX))
                    }
                    _ => same,
                }
            }
            _ => 1,
        };
        info.waiters = Some(keys.len().saturating_sub(holding));
        let record = match first {
            NameKey::Read => {
                self.read_number::<u64>("status record read", layout::write_record_key(name))
                    .await?
            }
            _ => None,
        };
        let mut holders = Vec::new();
        for (kind, kv) in keys.iter().take(holding) {
            let mut remaining = None;
            if kv.lease != 0 {
                let client = self.client();
                if let Ok(Ok(ttl)) = tokio::time::timeout(
                    self.inner.config.connection.request_timeout,
                    client.lease_time_to_live(kv.lease),
                )
                .await
                {
                    remaining = Some(Duration::from_secs(ttl.ttl.max(0).unsigned_abs()));
                }
            }
            let value = String::from_utf8_lossy(&kv.value).into_owned();
            let own_token = FencingToken::new(kv.create_revision.unsigned_abs());
            // A granted permit's token is the revision of its grant's write, the key's last
            // (`layout::permit_grant_txn`); a permit in the first `limit` whose try has not come yet
            // shows its last try's (or its create's).
            let permit_token = FencingToken::new(kv.mod_revision.unsigned_abs());
            let mut holder = HolderInfo::default();
            holder.owner = (!value.is_empty()).then_some(value);
            holder.remaining_lease = remaining;
            holder.hold_id = Some(layout::hold_id(*kind, kv.create_revision));
            match first {
                // A reader carries the last recorded write token (or 0).
                NameKey::Read => holder.token = Some(FencingToken::new(record.unwrap_or(0))),
                NameKey::Permit => {
                    holder.token = Some(permit_token);
                    let key = String::from_utf8_lossy(&kv.key);
                    holder.permit = Some(layout::permit_name(name, &key).to_string());
                }
                _ => holder.token = Some(own_token),
            }
            holders.push(holder);
        }
        match first {
            NameKey::Mutex | NameKey::Write => {
                info.kind = Some(if first == NameKey::Write {
                    LockKind::Write
                } else {
                    LockKind::Mutex
                });
                info.last_token = holders.first().and_then(|h| h.token);
                info.holder = holders.pop();
            }
            NameKey::Read => {
                info.kind = Some(LockKind::Read);
                info.last_token = record.map(FencingToken::new);
                info.holders = holders;
            }
            _ => {
                info.kind = limit.map(|limit| LockKind::Permit { limit });
                info.last_token = holders.iter().filter_map(|h| h.token).max();
                info.holders = holders;
            }
        }
        Ok(info)
    }
}
