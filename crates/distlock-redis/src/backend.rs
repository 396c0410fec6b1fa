//! `impl raw::Backend` for Redis.
//!
//! # Acquire and wait
//! A try runs the acquire script of the request's kind ([`layout::ACQUIRE`], [`layout::READ_ACQUIRE`],
//! [`layout::WRITE_ACQUIRE`], [`layout::PERMIT_ACQUIRE`]; see the `kinds` module): a grant returns the
//! token (`INCR` of the token key; a reader's is its current value) and the lease it set; a busy lock
//! returns the holder's pttl (a semaphore: the time to its earliest permit's expiry). While busy, the
//! first [`wait`](RedisBackend::wait) subscribes to the kind's channel on the backend's one pub/sub
//! connection and returns as soon as the server confirmed it, so the core tries again with the
//! subscription in place; later waits sleep until a message on the channel or the pttl, whichever is
//! first (a read-write lock's waiter at most 0.5–1 s; see [`crate::pubsub`]). Dropping the acquisition
//! unsubscribes (ref-counted per channel).
//!
//! # Renewals
//! `renew(batch)` sends one round trip of renew-script calls per group: the whole batch on one
//! connection (standalone, Sentinel), or one per hash slot in Cluster (pipelines there must stay in one
//! slot), all groups at once. A group goes in pipelines of at most
//! [`RENEWALS_PER_PIPELINE`](crate::RENEWALS_PER_PIPELINE), each queued on the connection as soon as it
//! is built, before any reply is awaited (with `wait_replicas`: one pipeline, `WAIT` last). A reply of "no key" or "another owner" is `Gone` (Lost at once); an
//! I/O error or a timeout is an error (Jeopardy until the deadline).
//!
//! # Durability
//! With `wait_replicas = n`, the acquire script and `WAIT n timeout` go in one pipeline on a dedicated
//! connection used by one request at a time (`WAIT` blocks its connection, and counts the replication
//! of that connection's own writes). Fewer than `n` confirmations undo the grant (compare-and-delete by
//! owner, on the same connection) and fail with `InsufficientReplicas`. Renewals go the same way on a
//! second dedicated connection, so they never queue behind acquires waiting in `WAIT`; a shortfall there
//! is an error for the batch (Jeopardy).
//!
//! # Undo and release under lost replies
//! An abandoned acquire is undone on the connection its last try went on (see
//! [`abandon`](RedisBackend#method.abandon)): Redis runs one connection's commands in order, so the undo
//! cannot overtake a delayed try. A release whose connection broke before the reply came is sent once
//! more on a fresh connection; if that finds nothing of this owner's, the first attempt may have been
//! the one that deleted the lock, and the release fails with `Unavailable` ("the outcome is unknown")
//! instead of answering `NotHeld`.

//!
//! The jobs live in their own files: [`acquire`](crate::acquire) (try and wait),
//! [`release`](crate::release), [`undo`](crate::undo) (abandoned acquires, and releases or undos
//! still on their way), [`renew`](crate::renew), [`inspect`](crate::inspect),
//! [`breaking`](crate::breaking) (`distlock break`), and
//! [`rpc`](crate::rpc) (scripts and pipelines on a [`Link`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HandOff, HolderInfo, LockInfo, Released, Renewal,
    RenewalId, Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{
    Capabilities, Error, ErrorKind, Fencing, LockKind, LockKinds, ReadWriteOrder, Result,
};

pub use crate::acquire::RedisAcquisition;
use crate::config::RedisConfig;
use crate::conn::{Ask, Link, Sent, Target};
use crate::error::BACKEND;
use crate::layout::{self, Scripts};
use crate::pubsub::Hub;
use crate::undo::PendingUndos;

/// The Redis backend: standalone, Sentinel or Cluster. Cheap to clone (clones share connections).
///
/// ```no_run
/// # async fn f() -> distlock_core::Result<()> {
/// use std::time::Duration;
/// use distlock_core::{url::Endpoint, Locks};
/// use distlock_redis::{RedisBackend, RedisConfig};
///
/// // Built in code rather than from a URL: a Sentinel-managed master, writes acknowledged by a replica.
/// let sentinels = vec![Endpoint::new("127.0.0.1", 26379), Endpoint::new("127.0.0.2", 26379)];
/// let config = RedisConfig::sentinel(sentinels, "mymaster")
///     .with_wait_replicas(1, Duration::from_millis(200));
/// let locks = Locks::new(RedisBackend::from_config(config).await?);
/// let guard = locks.lock("orders/42")?.acquire().await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) target: Arc<Target>,
    pub(crate) link: Link,
    /// Releases (and undos sent afresh) in Cluster: a link of their own. A Cluster connection routes
    /// each request on its own, so a release on `link` would not be ordered before the next acquire
    /// anyway (see `release_orders_next_acquire`). `None` outside Cluster, where releases go on `link`.
    pub(crate) release_link: Option<Link>,
    /// The dedicated connection for acquires with `WAIT` (only with `wait_replicas > 0`), one request
    /// at a time.
    pub(crate) durable: Option<(tokio::sync::Mutex<()>, Link)>,
    /// The same for renewals: `WAIT` blocks its connection for up to `wait_timeout`, so renewals on
    /// the acquires' connection would queue behind every acquire waiting for replicas.
    pub(crate) durable_renewals: Option<(tokio::sync::Mutex<()>, Link)>,
    pub(crate) hub: Hub,
    /// Undos and releases that may still be on their way (see [`PendingUndos`]).
    pub(crate) pending: Arc<PendingUndos>,
    pub(crate) scripts: Scripts,
    /// `publish`, or `spublish` in Cluster (sharded pub/sub, as Redisson uses on Redis ≥ 7).
    pub(crate) publish: &'static str,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("config", self.inner.target.config())
            .finish_non_exhaustive()
    }
}

/// What the Redis backend keeps for a held lock beyond the name and owner the core passes: the kind
/// of hold (the two sides of one `RwLock` share an owner; a permit's id is derived from its owner).
#[derive(Debug)]
pub struct RedisLease {
    /// The lease asked for: how long a release still on its way is waited for (see `release`).
    pub(crate) lease: Duration,
    /// What is held: it picks the release, renew and undo scripts.
    pub(crate) kind: LockKind,
}

impl RedisBackend {
    /// Whether the pub/sub connection (opened when a lock is first waited for) is up now. A test
    /// hook (feature `testing`): it stays down while nobody waits.
    #[cfg(feature = "testing")]
    pub fn pubsub_connected(&self) -> bool {
        self.inner.hub.is_connected()
    }

    /// Connects as the URL says (see [`RedisConfig::from_url`]). The entry point of
    /// `distlock::connect("redis://…")`.
    ///
    /// Connects once before returning, so an unreachable server or a wrong password fails here
    /// (`Unavailable`, `PermissionDenied`); later connection losses are repaired on the next request.
    pub async fn connect(url: &LockUrl) -> Result<Self> {
        Self::from_config(RedisConfig::from_url(url)?).await
    }

    /// A backend with the given configuration (checked with [`RedisConfig::validate`]); connects once
    /// (see [`connect`](Self::connect)).
    pub async fn from_config(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        let cluster = matches!(config.topology, crate::Topology::Cluster { .. });
        let durable = config.wait_replicas > 0;
        let target = Arc::new(Target::new(config));
        let backend = Self {
            inner: Arc::new(Inner {
                hub: Hub::start(target.clone()),
                pending: Arc::new(PendingUndos::default()),
                link: Link::new(),
                release_link: cluster.then(Link::new),
                durable: durable.then(|| (tokio::sync::Mutex::new(()), Link::new())),
                durable_renewals: durable.then(|| (tokio::sync::Mutex::new(()), Link::new())),
                scripts: Scripts::new(),
                publish: if cluster { "spublish" } else { "publish" },
                target,
            }),
        };
        backend
            .inner
            .link
            .run(
                &backend.inner.target,
                "PING",
                backend.request_timeout(),
                Ask::Follow,
                |mut c| async move {
                    redis::cmd("PING")
                        .query_async::<String>(&mut c)
                        .await
                        .map(|_| ())
                },
                &mut Sent::default(),
            )
            .await
            .map_err(|e| e.into_core(None))?;
        Ok(backend)
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        self.inner.target.config()
    }

    /// Where releases go: see [`Inner::release_link`].
    pub(crate) fn release_link(&self) -> &Link {
        self.inner.release_link.as_ref().unwrap_or(&self.inner.link)
    }

    pub(crate) fn request_timeout(&self) -> Duration {
        self.config().connection.request_timeout
    }
}

#[async_trait]
impl Backend for RedisBackend {
    type Lease = RedisLease;
    type Acquisition = RedisAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    /// The mutex, Redisson's read-write lock (readers first, as Redisson's: a reader gets in whenever
    /// no writer holds; atomic downgrade) and its permit-expirable semaphore (see the `kinds` module).
    fn capabilities(&self) -> Capabilities {
        let fencing = if self.mints_token() {
            Fencing::BestEffort
        } else {
            Fencing::None
        };
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(fencing)
            .with_notify_wait(true)
            // Fair mode: the server's queue, in the order the waiters' first busy tries ran (a
            // process's own waiters of one name line up locally first, as on etcd and ZooKeeper).
            .with_fifo(self.config().fair)
            .with_frees_on_process_death(false)
            // `distlock break`: the mutex's or writer's hold, by one script (see `breaking`).
            .with_breaks_holders(true)
            .with_kinds(
                LockKinds::mutex_only()
                    .with_read_write(ReadWriteOrder::ReadersFirst)
                    .with_atomic_downgrade()
                    .with_semaphore(),
            )
    }

    fn validate_name(&self, name: &str) -> Result<()> {
        if self.inner.target.is_cluster() && !layout::keys_share_slot(name) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "in Redis Cluster a lock name with '{{' must carry a non-empty hash tag such as {{tenant}}, so that the lock, its token key, its channels and (for a read-write lock or semaphore) its timeout keys share a slot; {name:?} does not"
                ),
            )
            .with_backend(BACKEND)
            .with_lock(name));
        }
        Ok(())
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<RedisAcquisition> {
        Ok(RedisAcquisition::new())
    }

    async fn try_acquire(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<RedisLease>> {
        self.try_acquire_once(acquisition, request).await
    }

    async fn wait(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        self.wait_for_release(acquisition, request, retry_after)
            .await;
        Ok(())
    }

    /// See the `undo` module: the undo goes on the connection the last try went on, then on a
    /// fresh one, then in the background until the lease has passed; until it is settled, the same
    /// owner's next acquire waits.
    async fn abandon(&self, acquisition: RedisAcquisition, request: &AcquireRequest) {
        self.undo_abandoned(acquisition, request).await;
    }

    async fn renew(&self, batch: &[Renewal<'_, RedisLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        self.renew_batch(batch).await
    }

    async fn release(&self, lease: &RedisLease, name: &str, owner: &str) -> Result<Released> {
        self.release_held(lease, name, owner).await
    }

    /// Standalone and Sentinel without `wait_replicas`: a release and every acquire go out on the one
    /// multiplexed connection of `link`, and the first poll of a release puts its request into that
    /// connection's queue (the connection is cached; redis-rs queues in the order of the calls), so an
    /// acquire sent after it runs after it on the server. Not in Cluster (releases have a link of their
    /// own) nor with `wait_replicas` (acquires go on the durable connection).
    fn release_orders_next_acquire(&self) -> bool {
        self.inner.release_link.is_none() && self.inner.durable.is_none()
    }

    /// Where `release_orders_next_acquire` holds (standalone and Sentinel without `wait_replicas`): the
    /// handoff script goes on the connection acquires and releases go on. Not in Cluster (releases
    /// there go on a link without redis-rs's resends, which a handoff would need too) nor with
    /// `wait_replicas` (a grant must be confirmed by `WAIT` on the durable connection, and the release
    /// part would not be ordered with it): there a release and the next owner's acquire run as before.
    ///
    /// Not in fair mode: the next owner of this `Locks` would overtake the server's queue.
    fn supports_hand_off(&self) -> bool {
        self.release_orders_next_acquire() && !self.config().fair
    }

    /// See the `handoff` module: one script releases this owner's hold and grants `next`, with nothing
    /// published; nothing is granted if this owner's hold is gone.
    async fn hand_off(
        &self,
        lease: &RedisLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<RedisLease>> {
        self.hand_off_held(lease, name, owner, next).await
    }

    /// What holds the name (one read-only script, [`layout::INSPECT`]): the mutex's or writer's field
    /// with the hash's `PTTL`, each reader with its longest timeout key, or each permit (its hex id) with
    /// its expiry and the semaphore's limit; the last token (the token key) and, outside Cluster,
    /// `PUBSUB NUMSUB` of the kind's channel as the waiters: the number of *connections* subscribed (one
    /// per waiting distlock backend or Redisson client, however many tasks wait in it), so an
    /// estimate. A holder's own token is not recorded in Redisson's layout (`None`); a mutex's or
    /// writer's holder gets the token counter, read in the same script, as its hold id (where this
    /// client's grants mint tokens): what a break compares (see `breaking`).
    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.inspect_lock(name).await
    }

    /// One script ([`layout::BREAK`]): the name's key is deleted if the owner `holder` names holds it
    /// exclusively (a mutex's field in either layout, or the write side), whatever its hold count,
    /// and what a release would publish is published (a fair queue's head woken too), and, when
    /// `holder` has a hold id, only if the token counter has not moved since `inspect` read it (no
    /// grant came since: a later hold of the same owner is not broken). Holders that mint no token
    /// are matched by owner id only (see `breaking`). A reader or a permit's holder given is
    /// `Unsupported`, and left alone; an exclusive holder that has gone is `false`, whatever holds the
    /// name now.
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        self.break_exclusive(name, holder).await
    }

    /// One script ([`layout::DOWNGRADE`]): the writer takes its read field and timeout key, its write
    /// field goes, `mode=read`, and readers waiting are told (`1` on the read-write lock's channel).
    async fn downgrade(
        &self,
        _lease: &RedisLease,
        read: &AcquireRequest,
    ) -> Result<Grant<RedisLease>> {
        self.downgrade_held(read).await
    }
}
