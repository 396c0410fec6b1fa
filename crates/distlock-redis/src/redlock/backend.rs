//! `impl raw::Backend` for Redlock.
//!
//! # The five steps
//! 1. The core reads the clock (CLOCK_BOOTTIME) before it calls `try_acquire`: that is `t0`.
//! 2. The acquire script ([`layout::ACQUIRE`]) goes to every node at once, each on its own connection
//!    (polled together in the caller's task, see `fanout`), each bounded by the node timeout (far below the lease).
//! 3. The try succeeds as soon as a quorum (N/2 + 1) granted; the core then keeps the grant only if it
//!    arrived before its validity deadline `t0 + lease·0.99 − 2 ms` (lease − elapsed − drift > 0,
//!    computed once, in the core, for every backend). A grant that arrives later is abandoned, which
//!    releases it on every node, and the acquire fails with `Unavailable`.
//! 4. The lock is valid until that deadline; the watchdog renews on a quorum (see `renew`).
//! 5. A try without a quorum releases on every node at once and the core tries again after
//!    [`wait`](RedlockBackend::wait): a jittered backoff bounded by the Q-th smallest pttl.
//!
//! # Renewals and release
//! A renewal sends the extend script ([`layout::EXTEND`]) for the whole batch to every node at once:
//! an entry extended on a quorum is `Extended`; one that enough nodes definitely say is not ours (gone
//! or someone else's) that a quorum is impossible is `Gone`; anything else is unknown (an error:
//! Jeopardy, then Lost at the deadline). A release goes to every node, whether or not it answered the
//! acquire.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, HolderInfo, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Error, ErrorKind, Fencing, Result};
use redis::Value;

use crate::conn::{Conn, Sent};
pub use crate::redlock::acquire::RedlockAcquisition;
use crate::redlock::config::{RedlockConfig, BACKEND};
use crate::redlock::fanout::fan_out;
use crate::redlock::layout::Scripts;
use crate::redlock::node::{node_error, Node};
use crate::rpc::int;

/// The Redlock backend: N independent Redis masters, a quorum of N/2 + 1. Cheap to clone.
///
/// ```no_run
/// # async fn f() -> distlock_core::Result<()> {
/// use distlock_core::{url::LockUrl, Locks};
/// use distlock_redis::redlock::RedlockBackend;
///
/// let url = LockUrl::parse("redlock://127.0.0.1:6379,127.0.0.1:6380,127.0.0.1:6381")?;
/// let locks = Locks::new(RedlockBackend::connect(&url).await?);
/// let guard = locks.lock("orders/42")?.acquire().await?;
/// assert!(guard.token().is_none()); // Redlock mints no fencing token
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

struct Inner {
    config: RedlockConfig,
    nodes: Vec<Arc<Node>>,
    scripts: Arc<Scripts>,
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// What Redlock keeps for a held lock: the lease asked for.
#[derive(Debug)]
pub struct RedlockLease {
    pub(crate) lease: Duration,
    /// The value the granting acquire wrote on every node (see [`layout::value`](crate::redlock::layout::value)).
    pub(crate) value: Arc<str>,
    /// The granting try's requests still on their way; the release waits for them.
    pub(crate) stragglers: Arc<crate::redlock::acquire::Stragglers>,
}

impl RedlockLease {
    /// The lease asked for.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The value this hold's key has on every node: the owner id and a nonce new for each acquire
    /// (see [`layout::value`](crate::redlock::layout::value)).
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl RedlockBackend {
    /// Connects as the URL says (see [`RedlockConfig::from_url`]): the entry point of
    /// `distlock::connect("redlock://…")`.
    pub async fn connect(url: &LockUrl) -> Result<Self> {
        Self::from_config(RedlockConfig::from_url(url)?).await
    }

    /// A backend over the configured nodes (checked with [`RedlockConfig::validate`]). Pings every
    /// node at once and fails with `Unavailable` unless a quorum answers (a wrong password anywhere
    /// fails with `PermissionDenied`); nodes down now are retried on every request. Then refuses
    /// (`InvalidConfig`) two listed nodes that are one server (see
    /// `check_distinct_servers`).
    pub async fn from_config(config: RedlockConfig) -> Result<Self> {
        config.validate()?;
        let nodes = config.nodes.iter().map(|n| Node::new(n, &config)).collect();
        let backend = Self {
            inner: Arc::new(Inner {
                config,
                nodes,
                scripts: Arc::new(Scripts::new()),
            }),
        };
        backend.ping_quorum().await?;
        backend.check_distinct_servers().await?;
        Ok(backend)
    }

    /// Refuses two listed nodes that are one Redis server under two addresses (`127.0.0.1:7001` and
    /// `localhost:7001`, a proxy or NAT in front of it): its votes would count twice toward the quorum.
    /// Decided by the server's identity, the `run_id` of `INFO server` (random, new at each start), not
    /// by the address text ([`RedlockConfig::validate`] catches only the same text twice).
    ///
    /// Only the nodes that answer now are compared: a node down at connect (or whose user may not run
    /// `INFO`) is not checked, with a warning. An alias of a server that answered is normally down only
    /// with it, and one that is down leaves no quorum of aliases; the check runs once, at connect.
    async fn check_distinct_servers(&self) -> Result<()> {
        let bound = self.config().connection.connect_timeout + self.request_timeout();
        let replies = fan_out(self.nodes(), |node| async move {
            node.run("INFO server", bound, |mut c| async move {
                redis::cmd("INFO")
                    .arg("server")
                    .query_async::<String>(&mut c)
                    .await
            })
            .await
        })
        .all(self.nodes().len())
        .await;
        let mut seen: Vec<(String, usize, &str)> = Vec::new();
        let mut unchecked = Vec::new();
        for (i, (node, reply)) in self.nodes().iter().zip(replies).enumerate() {
            let run_id = match reply {
                Some(Ok(info)) => run_id(&info),
                Some(Err(e)) => {
                    unchecked.push(format!("{}: {e}", node.shown()));
                    continue;
                }
                None => None,
            };
            let Some(run_id) = run_id else {
                unchecked.push(format!("{}: no run_id in INFO server", node.shown()));
                continue;
            };
            if let Some(&(_, first, shown)) = seen.iter().find(|(id, _, _)| *id == run_id) {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "the Redlock nodes {} (node {}) and {} (node {}) are one Redis server (run_id {run_id}): each listed node must be a different Redis master, or one server's votes count twice toward the quorum",
                        shown,
                        first + 1,
                        node.shown(),
                        i + 1
                    ),
                )
                .with_backend(BACKEND));
            }
            seen.push((run_id, i, node.shown()));
        }
        if !unchecked.is_empty() {
            tracing::warn!(nodes = ?unchecked, "Redlock could not check that these nodes are distinct servers (INFO server failed); a server listed twice would count twice toward the quorum");
        }
        Ok(())
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedlockConfig {
        &self.inner.config
    }

    pub(crate) fn nodes(&self) -> &[Arc<Node>] {
        &self.inner.nodes
    }

    pub(crate) fn scripts(&self) -> Arc<Scripts> {
        self.inner.scripts.clone()
    }

    fn request_timeout(&self) -> Duration {
        self.config().connection.request_timeout
    }

    /// `PING` on every node at once: the round trip of one Redlock step (what `distlock bench`
    /// measures as the engine's own). Fails unless a quorum answers.
    pub async fn ping_quorum(&self) -> Result<()> {
        let bound = self.config().connection.connect_timeout + self.request_timeout();
        let replies = fan_out(self.nodes(), |node| async move {
            node.run("PING", bound, |mut c| async move {
                redis::cmd("PING").query_async::<String>(&mut c).await
            })
            .await
        })
        .all(self.nodes().len())
        .await;
        let mut answered = 0;
        let mut failures = Vec::new();
        for (node, reply) in self.nodes().iter().zip(replies) {
            match reply {
                Some(Ok(_)) => answered += 1,
                Some(Err(e)) => {
                    let e = node_error(e, None);
                    if e.kind() == ErrorKind::PermissionDenied {
                        return Err(e);
                    }
                    failures.push(format!("{}: {e}", node.shown()));
                }
                None => failures.push(format!("{}: no reply", node.shown())),
            }
        }
        let quorum = self.config().quorum();
        if answered < quorum {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "Redlock quorum unreachable: {answered} of {} nodes answered PING and a quorum needs {quorum}; {}",
                    self.nodes().len(),
                    failures.join("; ")
                ),
            )
            .with_backend(BACKEND));
        }
        Ok(())
    }

    /// The release script on every node at once, each bounded by `bound`: whether it deleted the key
    /// holding `value` (one acquire's) anywhere.
    ///
    /// `unanswered`: connections of acquire requests that got no reply (see `acquire::Unanswered`); the
    /// release goes on each of them too, so that its node runs it after that acquire.
    ///
    /// `bound`: `request_timeout` for a release; the node timeout for the undo of a try or of an
    /// acquire (a node that slow is a failed node, which Redlock tolerates: the acquire must not wait
    /// out `request_timeout` on it; its key, if the late request sets one, is ours and expires).
    ///
    /// A node's "deleted nothing" is definite only when its request was sent once: one resent on a
    /// fresh connection after the first broke under it (its reply lost) may find nothing because the
    /// first deleted the key. So the answer is `Released` when a node deleted the key; `NotHeld` only
    /// when more than N − Q nodes definitely hold none of this hold's (then no quorum held it, as a
    /// renewal's `Gone`); else `Unavailable`, the outcome unknown (released, or expired).
    pub(crate) async fn release_everywhere(
        &self,
        name: &str,
        value: &Arc<str>,
        unanswered: Vec<(String, Conn)>,
        bound: Duration,
    ) -> Result<Released> {
        let scripts = self.scripts();
        let name_owned = name.to_string();
        let replies = fan_out(self.nodes(), |node| {
            let (scripts, name, value) = (scripts.clone(), name_owned.clone(), value.clone());
            let late: Vec<Conn> = unanswered
                .iter()
                .filter(|(n, _)| n == node.shown())
                .map(|(_, c)| c.clone())
                .collect();
            async move {
                let (release, args) = (&scripts.release, [&*value]);
                let (node, name, args) = (&node, name.as_str(), &args[..]);
                let mut sent = Sent::default();
                let fresh =
                    node.script_recorded("Redlock release", bound, release, name, args, &mut sent);
                let after_late = futures_util::future::join_all(late.into_iter().map(|conn| {
                    node.script_on(conn, "Redlock release", bound, release, name, args)
                }));
                let (fresh, after_late) = futures_util::future::join(fresh, after_late).await;
                // Deleted on either connection: this owner's key is gone from the node.
                let reply = match after_late
                    .into_iter()
                    .find(|r| matches!(r, Ok(v) if int(v) == Some(1)))
                {
                    Some(deleted) => deleted,
                    None => fresh,
                };
                (reply, sent.resent)
            }
        })
        .all(self.nodes().len())
        .await;
        let (mut deleted, mut not_ours, mut unknown, mut failures) = (0, 0, 0, Vec::new());
        for (node, reply) in self.nodes().iter().zip(replies) {
            match reply.map(|(r, resent)| (r.map(|v| int(&v)), resent)) {
                Some((Ok(Some(1)), _)) => deleted += 1,
                Some((Ok(Some(0)), false)) => not_ours += 1,
                Some((Ok(Some(0)), true)) => unknown += 1,
                Some((Ok(other), _)) => {
                    failures.push(format!("{}: unexpected reply {other:?}", node.shown()))
                }
                Some((Err(e), _)) => failures.push(format!("{}: {e}", node.shown())),
                None => failures.push(format!("{}: no reply", node.shown())),
            }
        }
        if !failures.is_empty() {
            tracing::debug!(lock = name, failures = ?failures, "Redlock release did not reach every node; its keys there expire after the lease");
        }
        let (n, quorum) = (self.nodes().len(), self.config().quorum());
        if deleted > 0 {
            return Ok(Released::Released);
        }
        if not_ours > n - quorum {
            return Ok(Released::NotHeld);
        }
        let mut why = Vec::new();
        if unknown > 0 {
            why.push(format!(
                "{unknown} were sent again after the connection broke before the reply came back and found nothing (the first attempt may have deleted the key, or it had expired)"
            ));
        }
        if !failures.is_empty() {
            why.push(format!(
                "{} failed (their keys expire after the lease): {}",
                failures.len(),
                failures.join("; ")
            ));
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "the Redlock release's outcome is unknown: it deleted nothing, {not_ours} of {n} nodes said the key is not this hold's (no quorum of {quorum} can be ruled out), {}",
                why.join("; ")
            ),
        )
        .with_backend(BACKEND)
        .with_lock(name))
    }

    /// One renewal batch: the extend script for every entry, on every node at once.
    async fn renew_batch(
        &self,
        batch: &[Renewal<'_, RedlockLease>],
    ) -> Vec<(RenewalId, Result<Renewed>)> {
        let Some(shortest) = batch.iter().map(|r| r.ttl).min() else {
            return Vec::new();
        };
        let bound = self.config().node_timeout_for(shortest);
        let entries: Arc<Vec<(String, String, String)>> = Arc::new(
            batch
                .iter()
                .map(|r| {
                    (
                        r.name.to_string(),
                        r.lease.value.to_string(),
                        crate::rpc::millis(r.ttl).to_string(),
                    )
                })
                .collect(),
        );
        let scripts = self.scripts();
        let replies = fan_out(self.nodes(), |node| {
            let (scripts, entries) = (scripts.clone(), entries.clone());
            async move {
                let node = &node;
                let extend = &scripts.extend;
                let calls = entries.iter().map(|(name, value, ttl)| async move {
                    node.script("Redlock extend", bound, extend, name, &[value, ttl])
                        .await
                });
                futures_util::future::join_all(calls).await
            }
        })
        .all(self.nodes().len())
        .await;
        let (n, quorum) = (self.nodes().len(), self.config().quorum());
        batch
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let (mut extended, mut not_ours, mut failures) = (0, 0, Vec::new());
                for (node, reply) in self.nodes().iter().zip(&replies) {
                    match reply.as_ref().and_then(|all| all.get(i)) {
                        Some(Ok(v)) if int(v) == Some(1) => extended += 1,
                        Some(Ok(v)) if int(v) == Some(0) => not_ours += 1,
                        Some(Ok(v)) => failures.push(format!("{}: unexpected reply {v:?}", node.shown())),
                        Some(Err(e)) => failures.push(format!("{}: {e}", node.shown())),
                        None => failures.push(format!("{}: no reply", node.shown())),
                    }
                }
                let outcome = if extended >= quorum {
                    Ok(Renewed::Extended { ttl: r.ttl })
                } else if not_ours > n - quorum {
                    Ok(Renewed::Gone {
                        reason: format!(
                            "{not_ours} of {n} Redlock nodes no longer hold this hold's key (expired or taken), so no quorum of {quorum} can"
                        ),
                    })
                } else {
                    Err(Error::new(
                        ErrorKind::Unavailable,
                        format!(
                            "Redlock renewal confirmed by {extended} of {n} nodes, a quorum needs {quorum}; {not_ours} said not ours; {}",
                            failures.join("; ")
                        ),
                    )
                    .with_backend(BACKEND)
                    .with_lock(r.name))
                };
                (r.id, outcome)
            })
            .collect()
    }
}

#[async_trait]
impl Backend for RedlockBackend {
    type Lease = RedlockLease;
    type Acquisition = RedlockAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    /// A lease on the server, no fencing token (Redlock mints none that is safe: see GUARANTEES.md),
    /// waiters poll with jitter. The mutex only: read-write locks and semaphores are `Unsupported` on
    /// Redlock (see the module).
    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::None)
            .with_notify_wait(false)
            .with_fifo(false)
            .with_frees_on_process_death(false)
            .with_breaks_holders(true)
    }

    fn begin(&self, request: &AcquireRequest) -> Result<RedlockAcquisition> {
        Ok(RedlockAcquisition::new(&request.owner))
    }

    async fn try_acquire(
        &self,
        acquisition: &mut RedlockAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<RedlockLease>> {
        self.try_acquire_once(acquisition, request).await
    }

    async fn wait(
        &self,
        acquisition: &mut RedlockAcquisition,
        _request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        self.wait_to_retry(acquisition, retry_after).await;
        Ok(())
    }

    async fn abandon(&self, acquisition: RedlockAcquisition, request: &AcquireRequest) {
        self.undo_abandoned(acquisition, request).await;
    }

    async fn renew(
        &self,
        batch: &[Renewal<'_, RedlockLease>],
    ) -> Vec<(RenewalId, Result<Renewed>)> {
        self.renew_batch(batch).await
    }

    /// Waits for the granting try's requests still on their way (a release must not reach a node
    /// before its acquire), then compare-and-delete on every node.
    async fn release(&self, lease: &RedlockLease, name: &str, _owner: &str) -> Result<Released> {
        let unanswered = lease
            .stragglers
            .settle_for_release(self.nodes().len())
            .await;
        self.release_everywhere(name, &lease.value, unanswered, self.request_timeout())
            .await
    }

    /// Every node's holder and pttl (in [`LockInfo::nodes`]); the holder shown is the owner on a
    /// quorum of nodes, with the Q-th longest pttl among them (how long the quorum lasts).
    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.inspect_nodes(name).await
    }

    /// The break script ([`layout::BREAK`](crate::redlock::layout::BREAK)) on every node at once:
    /// the key deleted where it still holds the value `inspect` showed (`holder.hold_id`: owner id and
    /// nonce, so a later acquire of the same owner is never broken; without one, any value of
    /// `holder`'s owner id). `true` once the holder's key was deleted somewhere and too few nodes hold it for a
    /// quorum; `false` when no node deleted anything and no quorum holds it; else `Unavailable` (see
    /// the `breaking` module).
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        self.break_everywhere(name, holder).await
    }
}

/// The `run_id:` line of an `INFO server` reply.
fn run_id(info: &str) -> Option<String> {
    info.lines()
        .find_map(|line| line.strip_prefix("run_id:"))
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty())
}

/// A `GET` reply as text.
pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}
