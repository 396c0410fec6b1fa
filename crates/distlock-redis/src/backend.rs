//! `impl raw::Backend` for Redis.
//!
//! # Acquire and wait
//! A try runs the acquire script ([`layout::ACQUIRE`]): a grant returns the token (`INCR` of the
//! token key) and the pttl; a busy lock returns the holder's pttl. While busy, the first
//! [`wait`](RedisBackend::wait) subscribes to the lock's channel on the backend's one pub/sub connection
//! and returns as soon as the server confirmed it, so the core tries again with the subscription in
//! place; later waits sleep until a message on the channel or the pttl, whichever is first (see
//! [`crate::pubsub`]). Dropping the acquisition unsubscribes (ref-counted per channel).
//!
//! # Renewals
//! `renew(batch)` sends one pipeline of renew-script calls per group: the whole batch on one
//! connection (standalone, Sentinel), or one pipeline per hash slot in Cluster (pipelines there must stay
//! in one slot), all groups at once. A reply of "no key" or "another owner" is `Gone` (Lost at once); an
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

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, Released, Renewal, RenewalId,
    Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Error, ErrorKind, Fencing, FencingToken, Result};
use redis::{Pipeline, Value};

use crate::config::RedisConfig;
use crate::conn::{Conn, Link, Sent, Target};
use crate::error::{RedisError, BACKEND};
use crate::layout::{self, Scripts};
use crate::pubsub::{Hub, Subscription};

/// How long a waiter sleeps when the holder's key has no expiry (not made by distlock or Redisson),
/// so no pttl bounds the wait: it still wakes on every release message.
const NO_EXPIRY_RECHECK: Duration = Duration::from_secs(5);

/// The Redis backend: standalone, Sentinel or Cluster. Cheap to clone (clones share connections).
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    target: Arc<Target>,
    link: Link,
    /// Releases (and undos sent afresh) in Cluster: a link without redis-rs's own resends, so that a
    /// release resent after a lost reply is known as such (see [`Link::without_resends`]). `None`
    /// outside Cluster, where `link` never resends by itself.
    release_link: Option<Link>,
    /// The dedicated connection for acquires with `WAIT` (only with `wait_replicas > 0`), one request
    /// at a time.
    durable: Option<(tokio::sync::Mutex<()>, Link)>,
    /// The same for renewals: `WAIT` blocks its connection for up to `wait_timeout`, so renewals on
    /// the acquires' connection would queue behind every acquire waiting for replicas.
    durable_renewals: Option<(tokio::sync::Mutex<()>, Link)>,
    hub: Hub,
    /// Undos still queued behind an abandoned acquire on its (slow) connection, by (name, owner): the
    /// entry's mutex is held until the undo's reply comes (or the connection fails, or the lease has
    /// passed). The same owner's next acquire waits for it: sent on a fresh connection before the
    /// late acquire and its undo land, it would be granted and then deleted by that undo.
    pending_undos: std::sync::Mutex<HashMap<(String, String), PendingUndo>>,
    scripts: Scripts,
    /// `publish`, or `spublish` in Cluster (sharded pub/sub, as Redisson uses on Redis ≥ 7).
    publish: &'static str,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("config", self.inner.target.config())
            .finish_non_exhaustive()
    }
}

/// Held by the task of an undo still queued behind its acquire (see `Inner::pending_undos`).
type PendingUndo = Arc<tokio::sync::Mutex<()>>;

/// The hold on a [`PendingUndo`], and the entry it replaced.
struct PendingGuard {
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
    previous: Option<PendingUndo>,
}

impl PendingGuard {
    /// Lets the same owner's acquires go, once the entry this one replaced is settled too (at most
    /// `within`).
    async fn release(self, within: Duration) {
        if let Some(previous) = self.previous {
            let _ = tokio::time::timeout(within, previous.lock()).await;
        }
        drop(self.held);
    }
}

/// What the Redis backend keeps for a held lock: nothing beyond the name and owner the core passes.
#[derive(Debug)]
pub struct RedisLease {
    /// The lease asked for: how long a release still on its way is waited for (see `release`).
    lease: Duration,
}

/// An acquire under way: the channel subscription, once the first wait made it.
pub struct RedisAcquisition {
    subscription: Option<Subscription>,
    /// Whether a grant may exist that the core has not seen (a try was sent and no busy reply came
    /// back), so `abandon` knows whether to undo.
    maybe_granted: bool,
    /// Where the last try went: the undo goes on the same connection, so that it runs after the try
    /// even when the try is still on its way (see `abandon`).
    sent: Sent,
}

impl fmt::Debug for RedisAcquisition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAcquisition")
            .field("subscription", &self.subscription)
            .field("maybe_granted", &self.maybe_granted)
            .finish_non_exhaustive()
    }
}

/// The acquire script's reply.
enum Outcome {
    Granted { token: u64, pttl: Option<Duration> },
    Busy { pttl: Option<Duration> },
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn pttl(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn server_error(v: &Value) -> Option<redis::RedisError> {
    match v {
        Value::ServerError(e) => Some(e.clone().into()),
        _ => None,
    }
}

fn parse_acquire(v: &Value) -> std::result::Result<Outcome, RedisError> {
    let bad = || RedisError::Reply {
        what: "the acquire script",
        detail: format!("{v:?}"),
    };
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let [granted, token, ttl] = items.as_slice() else {
        return Err(bad());
    };
    let (granted, token, ttl) = (
        int(granted).ok_or_else(bad)?,
        int(token).ok_or_else(bad)?,
        int(ttl).ok_or_else(bad)?,
    );
    if granted == 1 {
        Ok(Outcome::Granted {
            token: u64::try_from(token).map_err(|_| bad())?,
            pttl: pttl(ttl),
        })
    } else {
        Ok(Outcome::Busy { pttl: pttl(ttl) })
    }
}

fn request_error(what: &'static str, target: &Target, source: redis::RedisError) -> RedisError {
    RedisError::Request {
        what,
        target: target.shown.clone(),
        source,
    }
}

fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.code() == "NOSCRIPT")
}

impl RedisBackend {
    /// Whether the pub/sub connection (opened when a lock is first waited for) is up now. For tests and
    /// diagnostics: it stays down while nobody waits.
    #[doc(hidden)]
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

    /// A backend with the given configuration; connects once (see [`connect`](Self::connect)).
    pub async fn from_config(config: RedisConfig) -> Result<Self> {
        config.check().map_err(|e| e.into_core(None))?;
        let cluster = matches!(config.topology, crate::Topology::Cluster { .. });
        let durable = config.wait_replicas > 0;
        let target = Arc::new(Target::new(config));
        let backend = Self {
            inner: Arc::new(Inner {
                hub: Hub::start(target.clone()),
                pending_undos: std::sync::Mutex::new(HashMap::new()),
                link: Link::new(),
                release_link: cluster.then(Link::without_resends),
                durable: durable.then(|| (tokio::sync::Mutex::new(()), Link::new())),
                durable_renewals: durable.then(|| (tokio::sync::Mutex::new(()), Link::new())),
                scripts: Scripts::new(),
                publish: if cluster { "spublish" } else { "publish" },
                target,
            }),
        };
        let io = backend.config().io_timeout;
        backend
            .inner
            .link
            .run(&backend.inner.target, "PING", io, |mut c| async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .map(|_| ())
            })
            .await
            .map_err(|e| e.into_core(None))?;
        Ok(backend)
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        self.inner.target.config()
    }

    /// Where releases go: see [`Inner::release_link`].
    fn release_link(&self) -> &Link {
        self.inner.release_link.as_ref().unwrap_or(&self.inner.link)
    }

    /// How long an undo on an acquire's connection may take: on the `WAIT` connection it queues behind
    /// the acquire's `WAIT`, which blocks the connection for up to `wait_timeout`. Giving up earlier
    /// drops the last handle on the connection: it closes, and the server frees the blocked client
    /// with the undo unread.
    fn undo_bound(&self) -> Duration {
        match &self.inner.durable {
            Some(_) => self.io() + self.config().wait_timeout,
            None => self.io(),
        }
    }

    /// Waits until the requests on `name` sent so far on `conn` have run (an `EXISTS` of the lock sent
    /// after them is answered: keyed, so that a Cluster connection sends it to the same node), the
    /// connection fails (nothing more gets onto the server through it), or `within` has passed.
    async fn settle(&self, mut conn: Conn, name: &str, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut ping = redis::cmd("EXISTS");
            ping.arg(layout::lock_key(name));
            let answered =
                tokio::time::timeout_at(deadline, ping.query_async::<Value>(&mut conn)).await;
            match answered {
                Ok(Err(e)) if e.is_timeout() => continue,
                Ok(Ok(_)) => return,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "the connection of an undo failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!("no reply on the connection of an undo within the lease; the same owner may acquire again");
                    return;
                }
            }
        }
    }

    /// A release (or undo) of this owner that failed without a reply may still be on its way on `conn`
    /// (a connection that broke carries nothing more; one that timed out may): until a later reply
    /// on `conn` shows it ran, the same owner's next acquire waits (see [`Inner::pending_undos`]).
    /// A release that lands after that acquire's grant would delete it.
    fn settle_in_background(
        &self,
        error: &RedisError,
        sent: Sent,
        name: &str,
        owner: &str,
        within: Duration,
    ) {
        let Some(conn) = sent.conn else {
            return;
        };
        if error.is_broken_connection() {
            return;
        }
        let key = (name.to_string(), owner.to_string());
        let (pending, held) = self.register_pending(&key);
        let this = self.clone();
        tokio::spawn(async move {
            this.settle(conn, &key.0, within).await;
            held.release(within).await;
            this.forget_pending(&key, &pending);
        });
    }

    /// The undo could not be sent (or confirmed) on a fresh connection either: the server may be
    /// stalled or unreachable, and an acquire it already received still runs when it is back (even
    /// if the connection was reset meanwhile: Redis reads what its socket buffer holds). So the undo is
    /// sent again until one gets an answer, for at most the lease; until then the same owner's next
    /// acquire waits (see [`Inner::pending_undos`]), as the undo would delete its grant.
    fn undo_in_background(&self, error: &RedisError, sent: Sent, request: &AcquireRequest) {
        let key = (request.name.clone(), request.owner.clone());
        let (pending, held) = self.register_pending(&key);
        let this = self.clone();
        let lease = request.lease.max(self.undo_bound());
        let deadline = tokio::time::Instant::now() + lease;
        let unsettled = sent.conn.filter(|_| !error.is_broken_connection());
        tokio::spawn(async move {
            if let Some(conn) = unsettled {
                this.settle(conn, &key.0, lease).await;
            }
            let mut pause = Duration::from_millis(100);
            loop {
                if tokio::time::Instant::now() + pause >= deadline {
                    tracing::warn!(lock = %key.0, "could not undo an abandoned acquire; it expires with its lease");
                    break;
                }
                tokio::time::sleep(pause).await;
                match this.release_on(this.release_link(), &key.0, &key.1).await {
                    Ok(_) | Err(RedisError::ReleaseOutcomeUnknown { .. }) => {
                        tracing::debug!(lock = %key.0, "undid an abandoned acquire in the background");
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(lock = %key.0, error = %e, "the undo failed again");
                        pause = (pause * 2).min(Duration::from_secs(2));
                    }
                }
            }
            held.release(lease).await;
            this.forget_pending(&key, &pending);
        });
    }

    /// Registers a pending undo or release for `key` (see [`Inner::pending_undos`]), held until the
    /// returned guard is dropped. One registered before for the same key and still held is waited for
    /// too: the new entry's guard is only released once that one is (see [`PendingGuard`]).
    fn register_pending(&self, key: &(String, String)) -> (PendingUndo, PendingGuard) {
        let pending = Arc::new(tokio::sync::Mutex::new(()));
        let held = pending.clone().try_lock_owned().ok();
        let previous = self
            .inner
            .pending_undos
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(key.clone(), pending.clone());
        (pending, PendingGuard { held, previous })
    }

    /// Removes `pending` from [`Inner::pending_undos`] unless a later one took its place.
    fn forget_pending(&self, key: &(String, String), pending: &PendingUndo) {
        let mut pending_undos = self
            .inner
            .pending_undos
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pending_undos
            .get(key)
            .is_some_and(|p| Arc::ptr_eq(p, pending))
        {
            pending_undos.remove(key);
        }
    }

    /// Waits until no undo of this owner's earlier acquire is still queued (see
    /// [`Inner::pending_undos`]), at most the request bound.
    async fn after_pending_undo(
        &self,
        request: &AcquireRequest,
    ) -> std::result::Result<(), RedisError> {
        let key = (request.name.clone(), request.owner.clone());
        let pending = self
            .inner
            .pending_undos
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            .cloned();
        let Some(pending) = pending else {
            return Ok(());
        };
        let waited = tokio::time::timeout(self.io(), pending.lock()).await;
        match waited {
            Ok(_) => Ok(()),
            Err(_) => Err(RedisError::UndoPending {
                target: self.inner.target.shown.clone(),
                after: self.io(),
            }),
        }
    }

    fn io(&self) -> Duration {
        self.config().io_timeout
    }

    fn wait_cmd(&self) -> redis::Cmd {
        let config = self.config();
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(config.wait_replicas)
            .arg(millis(config.wait_timeout));
        cmd
    }

    /// Runs a pipeline (with replies as values, errors included), loading the scripts and trying once
    /// more if the server had not seen one (`NOSCRIPT`: a restarted server, a failover).
    async fn pipeline(
        &self,
        link: &Link,
        what: &'static str,
        timeout: Duration,
        pipe: Pipeline,
    ) -> std::result::Result<Vec<Value>, RedisError> {
        self.pipeline_tracked(link, what, timeout, pipe, &mut Sent::default())
            .await
    }

    /// [`pipeline`](Self::pipeline), recording where it went in `sent`.
    async fn pipeline_tracked(
        &self,
        link: &Link,
        what: &'static str,
        timeout: Duration,
        pipe: Pipeline,
        sent: &mut Sent,
    ) -> std::result::Result<Vec<Value>, RedisError> {
        let target = &self.inner.target;
        let mut pipe = pipe;
        pipe.ignore_errors();
        for attempt in 0..2 {
            let result = link
                .run_tracked(
                    target,
                    what,
                    timeout,
                    |mut c: Conn| {
                        let p = pipe.clone();
                        async move { p.query_async::<Vec<Value>>(&mut c).await }
                    },
                    sent,
                )
                .await;
            // A standalone server answers NOSCRIPT in the pipeline's values; a Cluster pipeline fails
            // as a whole with it.
            let noscript = match &result {
                Ok(values) => values.iter().any(is_noscript),
                Err(RedisError::Request { source, .. }) => {
                    source.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
                }
                Err(_) => false,
            };
            if attempt == 0 && noscript {
                // One `SCRIPT LOAD` command per script, not a pipeline: a keyless pipeline goes to one
                // arbitrary Cluster node, while the command is routed to every node.
                let scripts = &self.inner.scripts;
                link.run(target, "SCRIPT LOAD", self.io(), |mut c: Conn| async move {
                    for script in [&scripts.acquire, &scripts.release, &scripts.renew] {
                        script.load_async(&mut c).await?;
                    }
                    Ok(())
                })
                .await?;
                continue;
            }
            return result;
        }
        Err(RedisError::Reply {
            what,
            detail: "NOSCRIPT after SCRIPT LOAD".into(),
        })
    }

    /// One script call, `EVALSHA` with the `EVAL` fallback, recording where it went in `sent`.
    async fn script(
        &self,
        link: &Link,
        what: &'static str,
        invocation: redis::ScriptInvocation<'_>,
        sent: &mut Sent,
    ) -> std::result::Result<Value, RedisError> {
        let target = &self.inner.target;
        let invocation = &invocation;
        link.run_tracked(
            target,
            what,
            self.io(),
            |mut c: Conn| async move { invocation.invoke_async::<Value>(&mut c).await },
            sent,
        )
        .await
    }

    /// `sent` records the connection the try went on (for `abandon`), also if this future is dropped.
    async fn acquire_once(
        &self,
        request: &AcquireRequest,
        sent: &mut Sent,
    ) -> std::result::Result<Outcome, RedisError> {
        let scripts = &self.inner.scripts;
        let name = &request.name;
        let mut invocation = scripts.acquire.prepare_invoke();
        invocation
            .key(layout::lock_key(name))
            .key(layout::token_key(name))
            .arg(millis(request.lease))
            .arg(&request.owner);
        let Some((gate, link)) = &self.inner.durable else {
            let value = self
                .script(&self.inner.link, "acquire", invocation, sent)
                .await?;
            return parse_acquire(&value);
        };
        let _one_at_a_time = gate.lock().await;
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation).add_command(self.wait_cmd());
        let timeout = self.io() + self.config().wait_timeout;
        let values = self
            .pipeline_tracked(link, "acquire + WAIT", timeout, pipe, sent)
            .await?;
        let [reply, waited] = values.as_slice() else {
            return Err(RedisError::Reply {
                what: "acquire + WAIT",
                detail: format!("{values:?}"),
            });
        };
        if let Some(e) = server_error(reply) {
            return Err(request_error("acquire", &self.inner.target, e));
        }
        let outcome = parse_acquire(reply)?;
        if let Outcome::Granted { .. } = outcome {
            let required = self.config().wait_replicas;
            let confirmed = match waited {
                Value::Int(n) => u32::try_from(*n).unwrap_or(0),
                other => {
                    if let Some(e) = server_error(other) {
                        tracing::warn!(error = %e, "WAIT failed");
                    }
                    0
                }
            };
            if confirmed < required {
                // Undo on the same connection, so the delete is ordered after the grant.
                let undone = match &sent.conn {
                    Some(conn) => {
                        self.undo_on(conn.clone(), name, &request.owner, self.undo_bound())
                            .await
                    }
                    None => self
                        .release_on(link, name, &request.owner)
                        .await
                        .map(|_| ()),
                };
                undone?;
                return Err(RedisError::Replicas {
                    confirmed,
                    required,
                });
            }
        }
        Ok(outcome)
    }

    fn release_invocation<'a>(&'a self, name: &str, owner: &str) -> redis::ScriptInvocation<'a> {
        let mut invocation = self.inner.scripts.release.prepare_invoke();
        invocation
            .key(layout::lock_key(name))
            .key(layout::channel(name))
            .arg(owner)
            .arg(self.inner.publish)
            .arg(layout::UNLOCK_MESSAGE);
        invocation
    }

    /// Compare-and-delete by owner on the link's connection: whether this owner's lock was deleted.
    /// When the connection broke under a first attempt (its reply lost) and the retry finds nothing of
    /// this owner's, the first attempt may have been the one that deleted it: that is
    /// [`RedisError::ReleaseOutcomeUnknown`], never a plain "not held".
    async fn release_on(
        &self,
        link: &Link,
        name: &str,
        owner: &str,
    ) -> std::result::Result<bool, RedisError> {
        self.release_on_tracked(link, name, owner, &mut Sent::default())
            .await
    }

    /// [`release_on`](Self::release_on), recording where it went in `sent`.
    async fn release_on_tracked(
        &self,
        link: &Link,
        name: &str,
        owner: &str,
        sent: &mut Sent,
    ) -> std::result::Result<bool, RedisError> {
        let invocation = self.release_invocation(name, owner);
        let value = self.script(link, "release", invocation, sent).await?;
        match parse_release(&value)? {
            false if sent.resent => Err(RedisError::ReleaseOutcomeUnknown {
                target: self.inner.target.shown.clone(),
            }),
            released => Ok(released),
        }
    }

    /// The undo of an acquire, on the connection the acquire went on: Redis runs one connection's
    /// commands in order, so it runs after the acquire even if that is still on its way. The link may
    /// have dropped that connection after the acquire timed out; whatever reply comes back here, the
    /// undo itself is queued behind the acquire on the server's side of the connection.
    async fn undo_on(
        &self,
        mut conn: Conn,
        name: &str,
        owner: &str,
        bound: Duration,
    ) -> std::result::Result<(), RedisError> {
        let invocation = self.release_invocation(name, owner);
        let target = &self.inner.target;
        match tokio::time::timeout(bound, invocation.invoke_async::<Value>(&mut conn)).await {
            Ok(Ok(value)) => parse_release(&value).map(|undone| {
                if undone {
                    tracing::debug!(lock = %name, "undid an abandoned grant");
                }
            }),
            Ok(Err(source)) => Err(RedisError::Request {
                what: "undo of an acquire",
                target: target.shown.clone(),
                source,
            }),
            Err(_) => Err(RedisError::Timeout {
                what: "undo of an acquire",
                target: target.shown.clone(),
                after: bound,
            }),
        }
    }

    /// Renews one group (one connection, or one Cluster slot) in one round trip.
    async fn renew_group(
        &self,
        group: &[&Renewal<'_, RedisLease>],
    ) -> Vec<(RenewalId, Result<Renewed>)> {
        let scripts = &self.inner.scripts;
        let mut pipe = redis::pipe();
        for entry in group {
            let mut invocation = scripts.renew.prepare_invoke();
            invocation
                .key(layout::lock_key(entry.name))
                .arg(millis(entry.ttl))
                .arg(entry.owner);
            pipe.invoke_script(&invocation);
        }
        let longest = group.iter().map(|e| e.ttl).max().unwrap_or_default();
        // A renewal answered after half the lease is of little use; fail it and let the core retry.
        let timeout = self.io().min((longest / 2).max(Duration::from_millis(50)));
        let (link, durable_gate) = match &self.inner.durable_renewals {
            Some((gate, link)) => {
                pipe.add_command(self.wait_cmd());
                (link, Some(gate))
            }
            None => (&self.inner.link, None),
        };
        let _one_at_a_time = match durable_gate {
            Some(gate) => Some(gate.lock().await),
            None => None,
        };
        let timeout = if durable_gate.is_some() {
            timeout + self.config().wait_timeout
        } else {
            timeout
        };
        let values = match self.pipeline(link, "renew", timeout, pipe).await {
            Ok(values) if values.len() == group.len() + usize::from(durable_gate.is_some()) => {
                values
            }
            Ok(values) => {
                let e = RedisError::Reply {
                    what: "renew",
                    detail: format!("{} replies for {} renewals", values.len(), group.len()),
                };
                return group
                    .iter()
                    .map(|g| (g.id, Err(copy(&e, g.name))))
                    .collect();
            }
            Err(e) => {
                let e = e.into_core(None);
                return group
                    .iter()
                    .map(|g| {
                        let e = Error::new(e.kind(), e.message())
                            .with_backend(BACKEND)
                            .with_lock(g.name);
                        (g.id, Err(e))
                    })
                    .collect();
            }
        };
        let shortfall = if durable_gate.is_some() {
            let required = self.config().wait_replicas;
            let confirmed = values
                .last()
                .and_then(int)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0);
            (confirmed < required).then_some(RedisError::Replicas {
                confirmed,
                required,
            })
        } else {
            None
        };
        group
            .iter()
            .zip(&values)
            .map(|(entry, value)| {
                (
                    entry.id,
                    self.renew_outcome(entry, value, shortfall.as_ref()),
                )
            })
            .collect()
    }

    /// What one renew script's reply says about its entry.
    fn renew_outcome(
        &self,
        entry: &Renewal<'_, RedisLease>,
        value: &Value,
        shortfall: Option<&RedisError>,
    ) -> Result<Renewed> {
        if let Some(e) = server_error(value) {
            return Err(request_error("renew", &self.inner.target, e).into_core(Some(entry.name)));
        }
        match int(value) {
                    Some(1) => match shortfall {
                        Some(e) => Err(copy(e, entry.name)),
                        None => Ok(Renewed::Extended { ttl: entry.ttl }),
                    },
                    Some(0) => Ok(Renewed::Gone {
                        reason: "another owner holds the lock on the server".into(),
                    }),
                    Some(-1) => Ok(Renewed::Gone {
                        reason: "the lock's key is gone from the server (expired, deleted, or the server restarted without it)".into(),
                    }),
                    Some(-2) => Ok(Renewed::Gone {
                        reason: "the lock's key was overwritten with another type".into(),
                    }),
                    _ => Err(RedisError::Reply {
                        what: "the renew script",
                        detail: format!("{value:?}"),
                    }
                    .into_core(Some(entry.name))),
                }
    }
}

fn parse_release(value: &Value) -> std::result::Result<bool, RedisError> {
    match int(value) {
        Some(1) => Ok(true),
        Some(0) => Ok(false),
        _ => Err(RedisError::Reply {
            what: "the release script",
            detail: format!("{value:?}"),
        }),
    }
}

/// The same error for another entry of a batch.
fn copy(e: &RedisError, name: &str) -> Error {
    let kind = match e {
        RedisError::Replicas {
            confirmed,
            required,
        } => ErrorKind::InsufficientReplicas {
            confirmed: *confirmed,
            required: *required,
        },
        _ => ErrorKind::Protocol,
    };
    Error::new(kind, e.to_string())
        .with_backend(BACKEND)
        .with_lock(name)
}

#[async_trait]
impl Backend for RedisBackend {
    type Lease = RedisLease;
    type Acquisition = RedisAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::BestEffort)
            .with_notify_wait(true)
            .with_fifo(false)
            .with_frees_on_process_death(false)
    }

    fn validate_name(&self, name: &str) -> Result<()> {
        if self.inner.target.is_cluster() && !layout::keys_share_slot(name) {
            return Err(Error::new(
                ErrorKind::InvalidName,
                format!(
                    "in Redis Cluster a lock name with '{{' must carry a non-empty hash tag such as {{tenant}}, so that the lock, its token key and its channel share a slot; {name:?} does not"
                ),
            )
            .with_backend(BACKEND)
            .with_lock(name));
        }
        Ok(())
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<RedisAcquisition> {
        Ok(RedisAcquisition {
            subscription: None,
            maybe_granted: false,
            sent: Sent::default(),
        })
    }

    async fn try_acquire(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<RedisLease>> {
        if let Some(sub) = acquisition.subscription.as_mut() {
            // Messages from now on count: one arriving during this try makes the next wait return.
            sub.mark_seen();
        }
        self.after_pending_undo(request)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))?;
        acquisition.maybe_granted = true;
        acquisition.sent = Sent::default();
        let outcome = self
            .acquire_once(request, &mut acquisition.sent)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))?;
        match outcome {
            Outcome::Granted { token, pttl } => Ok(Attempt::Acquired(
                Grant::new(RedisLease {
                    lease: request.lease,
                })
                .with_token(FencingToken::new(token))
                .with_ttl(pttl.unwrap_or(request.lease).min(request.lease)),
            )),
            Outcome::Busy { pttl } => {
                acquisition.maybe_granted = false;
                acquisition.sent = Sent::default();
                Ok(Attempt::Busy { retry_after: pttl })
            }
        }
    }

    async fn wait(
        &self,
        acquisition: &mut RedisAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        if acquisition.subscription.is_none() {
            let sub = self.inner.hub.register(layout::channel(&request.name));
            let confirmed = sub.confirm().await;
            acquisition.subscription = Some(sub);
            match confirmed {
                // Subscribed: the core tries again, and no release after this point is missed.
                Ok(()) => return Ok(()),
                Err(e) => {
                    // The hub wakes this waiter once it is connected again; until then the pttl bounds
                    // the wait.
                    tracing::debug!(error = %e, lock = %request.name, "cannot subscribe yet");
                }
            }
        }
        let Some(sub) = acquisition.subscription.as_mut() else {
            return Ok(());
        };
        let limit = retry_after.unwrap_or(NO_EXPIRY_RECHECK);
        tokio::select! {
            _ = sub.changed() => {}
            _ = tokio::time::sleep(limit) => {}
        }
        Ok(())
    }

    /// The undo is a compare-and-delete by owner, sent on the connection the last try went on, so it
    /// runs after that try however late the try arrives (a delayed request that timed out here may still
    /// reach the server). If that connection fails (broken, or no reply in time), the undo is sent again
    /// on the current connection. A try the server already received still runs after its connection
    /// was reset (Redis reads its socket buffer), e.g. on a stalled server: a fresh connection reaches
    /// the server only after that, and if the undo cannot get through, it is retried in the background
    /// (at most the lease); a timed-out one still has the first undo queued behind the try. Until an
    /// undo (or release) still on its way is settled, the same owner's next acquire waits.
    async fn abandon(&self, acquisition: RedisAcquisition, request: &AcquireRequest) {
        let RedisAcquisition {
            subscription,
            maybe_granted,
            sent,
        } = acquisition;
        drop(subscription);
        if !maybe_granted {
            return;
        }
        if let Some(conn) = sent.conn {
            // The undo goes on in a task of its own until its reply comes (or the lease has passed),
            // keeping the connection open, and the same owner's next acquire waits for it.
            let key = (request.name.clone(), request.owner.clone());
            let (pending, held) = self.register_pending(&key);
            let this = self.clone();
            let lingering = request.lease.max(self.undo_bound());
            let mut undo = tokio::spawn(async move {
                let undone = this
                    .undo_on(conn.clone(), &key.0, &key.1, this.undo_bound())
                    .await;
                if undone.as_ref().is_err_and(|e| !e.is_broken_connection()) {
                    // No reply in time (redis-rs gives up on it after its response timeout too): the
                    // undo may still be on its way. Wait for a later reply on the connection.
                    this.settle(conn, &key.0, lingering).await;
                }
                held.release(lingering).await;
                this.forget_pending(&key, &pending);
                undone
            });
            match tokio::time::timeout(self.undo_bound(), &mut undo).await {
                Ok(Ok(Ok(()))) => return,
                Ok(Ok(Err(e))) => {
                    tracing::debug!(lock = %request.name, error = %e, "undo on the acquire's connection failed; undoing on a fresh one too")
                }
                Ok(Err(e)) => {
                    tracing::debug!(lock = %request.name, error = %e, "the undo task failed; undoing on a fresh connection")
                }
                Err(_) => {
                    tracing::debug!(lock = %request.name, "the undo is still queued behind the acquire; undoing on a fresh connection too")
                }
            }
        }
        let mut sent = Sent::default();
        let undone = self
            .release_on_tracked(
                self.release_link(),
                &request.name,
                &request.owner,
                &mut sent,
            )
            .await;
        match undone {
            Ok(true) => tracing::debug!(lock = %request.name, "undid an abandoned grant"),
            Ok(false) => {}
            Err(RedisError::ReleaseOutcomeUnknown { .. }) => {
                tracing::debug!(lock = %request.name, "the undo was sent twice; either attempt removed the grant, or there was none")
            }
            Err(e) => {
                tracing::warn!(lock = %request.name, error = %e, "could not undo an abandoned acquire yet; trying again in the background until its lease has passed");
                self.undo_in_background(&e, sent, request);
            }
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, RedisLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        if !self.inner.target.is_cluster() {
            let group: Vec<&Renewal<'_, RedisLease>> = batch.iter().collect();
            return self.renew_group(&group).await;
        }
        // Cluster: one pipeline per slot, all at once.
        let mut slots: BTreeMap<u16, Vec<&Renewal<'_, RedisLease>>> = BTreeMap::new();
        for entry in batch {
            slots
                .entry(layout::hash_slot(entry.name.as_bytes()))
                .or_default()
                .push(entry);
        }
        futures_util::future::join_all(slots.values().map(|group| self.renew_group(group)))
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    async fn release(&self, lease: &RedisLease, name: &str, owner: &str) -> Result<Released> {
        let mut sent = Sent::default();
        let released = self
            .release_on_tracked(self.release_link(), name, owner, &mut sent)
            .await;
        if let Err(e) = &released {
            self.settle_in_background(e, sent, name, owner, lease.lease.max(self.io()));
        }
        let released = released.map_err(|e| e.into_core(Some(name)))?;
        Ok(if released {
            Released::Released
        } else {
            Released::NotHeld
        })
    }

    /// Holder (the hash's field), remaining lease (`PTTL`), last token (`GET` of the token key) and,
    /// outside Cluster, `PUBSUB NUMSUB` of the channel as the waiters: the number of *connections*
    /// subscribed (one per waiting distlock backend or Redisson client, however many tasks wait in
    /// it), so an estimate. The holder's own token is not recorded in Redisson's layout (`None`).
    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        let cluster = self.inner.target.is_cluster();
        let mut pipe = redis::pipe();
        pipe.cmd("HGETALL")
            .arg(layout::lock_key(name))
            .cmd("PTTL")
            .arg(layout::lock_key(name))
            .cmd("GET")
            .arg(layout::token_key(name));
        if !cluster {
            pipe.cmd("PUBSUB").arg("NUMSUB").arg(layout::channel(name));
        }
        let values = self
            .pipeline(&self.inner.link, "inspect", self.io(), pipe)
            .await
            .map_err(|e| e.into_core(Some(name)))?;
        for v in &values {
            if let Some(e) = server_error(v) {
                return Err(request_error("inspect", &self.inner.target, e).into_core(Some(name)));
            }
        }
        let mut info = LockInfo::default();
        let owner = match values.first() {
            Some(Value::Array(items)) => items.first().and_then(|v| match v {
                Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            }),
            Some(Value::Map(pairs)) => pairs.first().and_then(|(k, _)| match k {
                Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            }),
            _ => None,
        };
        if let Some(owner) = owner {
            info.holder = Some({
                let mut h = HolderInfo::default();
                h.owner = Some(owner);
                h.remaining_lease = values.get(1).and_then(int).and_then(pttl);
                h
            });
        }
        info.last_token = values
            .get(2)
            .and_then(int)
            .and_then(|t| u64::try_from(t).ok())
            .map(FencingToken::new);
        if !cluster {
            info.waiters = match values.get(3) {
                Some(Value::Array(items)) => items
                    .get(1)
                    .and_then(int)
                    .and_then(|n| usize::try_from(n).ok()),
                Some(Value::Map(pairs)) => pairs
                    .first()
                    .and_then(|(_, n)| int(n))
                    .and_then(|n| usize::try_from(n).ok()),
                _ => None,
            };
        }
        Ok(info)
    }
}
