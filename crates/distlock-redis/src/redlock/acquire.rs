//! Acquire: Redlock's five steps, the first three here (the core reads the clock before the try and
//! checks the validity deadline after it, see [`RedlockBackend`]), retries and undo.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant};
use distlock_core::retry::Backoff;
use distlock_core::{Error, ErrorKind, Result};
use redis::Value;

use crate::conn::{Conn, Sent};
use crate::error::RedisError;
use crate::redlock::backend::{RedlockBackend, RedlockLease};
use crate::redlock::config::BACKEND;
use crate::redlock::fanout::{fan_out, Replies};
use crate::redlock::node::{is_wrongtype, wrongtype};
use crate::rpc::{int, millis};

/// The first retry after a failed quorum waits 1–2 ms, doubling up to 20–40 ms, never past the
/// Q-th smallest pttl (see [`RedlockBackend::wait`]): there is no notification across independent
/// nodes, so waiters poll, jittered so that clients that split a vote do not split it again.
const FIRST_RETRY: Duration = Duration::from_millis(2);
const MAX_RETRY: Duration = Duration::from_millis(40);

/// The node requests of the last try that may still be on their way: a try returns once a quorum
/// granted, and a release (or undo) must not overtake the others, so it waits for them to finish
/// (each is bounded by the node timeout) before it sends its own. While the try runs they are polled
/// in its task; once it returns with a quorum, one task finishes the rest (so a `NOSCRIPT` fallback
/// or a reconnect still goes out at once and every node gets its key), and the release awaits it.
#[derive(Default)]
pub(crate) struct Stragglers {
    replies: tokio::sync::Mutex<Straggling>,
    /// Acquire requests that got no reply in time and may still run on their node.
    pub(crate) unanswered: Arc<Unanswered>,
}

/// Per node, the connection of the last acquire request to it that got no reply (it timed out, or the
/// node refused it): that request may still run on the node later (a node paused, or slow), so the
/// release (or undo) goes on that connection too, where the node runs it after the acquire. A release
/// on a new connection alone may run first, or never reach a paused node, and the late acquire would
/// then leave a key for a whole lease.
#[derive(Default)]
pub(crate) struct Unanswered(std::sync::Mutex<Vec<(String, Conn)>>);

impl Unanswered {
    fn record(&self, node: &str, conn: Conn) {
        let mut all = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.retain(|(n, _)| n != node);
        all.push((node.to_string(), conn));
    }

    /// The connections recorded so far.
    fn take(&self) -> Vec<(String, Conn)> {
        std::mem::take(
            &mut *self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// The requests of the last try: at most one of the two is set.
#[derive(Default)]
pub(crate) struct Straggling {
    /// Polled by the try (or left by a try whose future was dropped).
    here: Option<Replies<(String, Vote)>>,
    /// Finished by their own task after the try returned.
    spawned: Option<tokio::task::JoinHandle<()>>,
}

impl Stragglers {
    /// What a release (or undo) is ordered after: waits until every request of the last try has its
    /// reply (or its bound ran out), then takes the connections of the acquire requests that got none
    /// (see [`Unanswered`]), for the release to go on them too.
    pub(crate) async fn settle_for_release(&self, nodes: usize) -> Vec<(String, Conn)> {
        self.settle(nodes).await;
        self.unanswered.take()
    }

    /// Waits until every request of the last try has its reply (or its bound ran out).
    async fn settle(&self, nodes: usize) {
        let pending = std::mem::take(&mut *self.replies.lock().await);
        if let Some(replies) = pending.here {
            replies.all(nodes).await;
        }
        if let Some(task) = pending.spawned {
            let _ = task.await;
        }
    }
}

impl std::fmt::Debug for Stragglers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stragglers")
    }
}

/// What an acquire keeps between tries.
#[derive(Debug)]
pub struct RedlockAcquisition {
    /// The value its tries write on every node ([`layout::value`](crate::redlock::layout::value)):
    /// new for this acquire, kept by its hold for the renewals and the release.
    pub(crate) value: Arc<str>,
    /// Whether a try was sent: then an abandon must release on every node.
    pub(crate) sent: bool,
    pub(crate) backoff: Backoff,
    /// The last try's requests still on their way (shared with the lease it granted).
    pub(crate) stragglers: Arc<Stragglers>,
}

impl RedlockAcquisition {
    pub(crate) fn new(owner: &str) -> Self {
        Self {
            value: crate::redlock::layout::value(owner).into(),
            sent: false,
            backoff: Backoff::new(FIRST_RETRY, MAX_RETRY),
            stragglers: Arc::new(Stragglers::default()),
        }
    }
}

/// One node's answer to the acquire script.
pub(crate) enum Vote {
    Granted,
    /// Held by another owner, with the key's pttl (`None`: no expiry).
    Busy(Option<Duration>),
    Failed(RedisError),
}

fn vote(reply: std::result::Result<Value, RedisError>) -> Vote {
    match reply {
        Err(e) => Vote::Failed(e),
        Ok(v) => match int(&v) {
            Some(1) => Vote::Granted,
            Some(-1) => Vote::Busy(None),
            Some(n) if n < 0 => Vote::Busy(Some(Duration::from_millis(n.unsigned_abs()))),
            _ => Vote::Failed(RedisError::Reply {
                what: "Redlock acquire",
                detail: format!("{v:?}"),
            }),
        },
    }
}

/// The votes of one try, as they come.
#[derive(Default)]
struct Tally {
    granted: usize,
    busy: Vec<Option<Duration>>,
    failed: Vec<(String, RedisError)>,
}

impl Tally {
    fn count(&mut self, node: String, vote: Vote) {
        match vote {
            Vote::Granted => self.granted += 1,
            Vote::Busy(pttl) => self.busy.push(pttl),
            Vote::Failed(e) => self.failed.push((node, e)),
        }
    }
}

impl RedlockBackend {
    /// Steps 2 and 3: the acquire script to every node at once, success on a quorum of grants.
    /// Returns as soon as a quorum granted (the other nodes' requests are kept, see [`Stragglers`]) or can no
    /// longer grant; a failed quorum is released on every node before the next try.
    pub(crate) async fn try_acquire_once(
        &self,
        acquisition: &mut RedlockAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<RedlockLease>> {
        let (n, quorum) = (self.nodes().len(), self.config().quorum());
        let bound = self.config().node_timeout_for(request.lease);
        let lease_ms = millis(request.lease).to_string();
        acquisition.sent = true;
        let scripts = self.scripts();
        let (name, value) = (request.name.clone(), acquisition.value.clone());
        // Requests of an earlier try still on their way settle first (the failed try released on
        // every node after them already; this only waits for a try whose future was dropped).
        acquisition.stragglers.settle(n).await;
        let unanswered = acquisition.stragglers.unanswered.clone();
        let mut pending = acquisition.stragglers.replies.lock().await;
        let replies = pending.here.insert(fan_out(self.nodes(), |node| {
            let (scripts, name, value, lease_ms, unanswered) = (
                scripts.clone(),
                name.clone(),
                value.clone(),
                lease_ms.clone(),
                unanswered.clone(),
            );
            async move {
                let mut sent = Sent::default();
                let reply = node
                    .script_recorded(
                        "Redlock acquire",
                        bound,
                        &scripts.acquire,
                        &name,
                        &[&value, &lease_ms],
                        &mut sent,
                    )
                    .await;
                if let (Err(e), Some(conn)) = (&reply, sent.conn) {
                    if !e.is_broken_connection() {
                        unanswered.record(node.shown(), conn);
                    }
                }
                (node.shown().to_string(), vote(reply))
            }
        }));
        let mut tally = Tally::default();
        while let Some((_, (node, vote))) = replies.next().await {
            tally.count(node, vote);
            if tally.granted >= quorum {
                acquisition.backoff.reset();
                if let Some(mut rest) = pending.here.take() {
                    if rest.outstanding() > 0 {
                        let task =
                            tokio::spawn(async move { while rest.next().await.is_some() {} });
                        pending.spawned = Some(task);
                    }
                }
                drop(pending);
                let grant = Grant::new(RedlockLease {
                    lease: request.lease,
                    value: acquisition.value.clone(),
                    stragglers: acquisition.stragglers.clone(),
                })
                .with_ttl(request.lease);
                return Ok(Attempt::Acquired(grant));
            }
            if tally.granted + replies.outstanding() < quorum {
                break;
            }
        }
        // No quorum: wait for the stragglers (each bounded), so that the release goes after them on
        // their connections, then release everywhere at once.
        while let Some((_, (node, vote))) = replies.next().await {
            tally.count(node, vote);
        }
        *pending = Straggling::default();
        drop(pending);
        if tally.granted > 0 {
            // Not on the connections of unanswered requests: a release queued there behind a stuck
            // node could run after the next try's grant on that node and delete it. The next try
            // grants on this acquire's keys anyway; the final release (or undo) goes there too.
            if let Err(e) = self
                .release_everywhere(&request.name, &acquisition.value, Vec::new(), bound)
                .await
            {
                tracing::debug!(error = %e, lock = %request.name, "releasing a failed Redlock quorum");
            }
        }
        // A node answering WRONGTYPE is a failed vote, like a node down: only when the failed nodes
        // leave no quorum possible does the try fail (naming the `redis://` clash if there is one);
        // else a lock busy elsewhere is waited for.
        if tally.failed.len() > n - quorum {
            if let Some((node, _)) = tally.failed.iter().find(|(_, e)| is_wrongtype(e)) {
                return Err(wrongtype(&request.name, node));
            }
            return Err(unavailable(&request.name, n, quorum, &tally));
        }
        Ok(Attempt::Busy {
            retry_after: retry_after(&tally, quorum),
        })
    }

    /// Step 5's retry: a jittered backoff (2 ms doubling to 40 ms), never past the Q-th smallest pttl
    /// of the holders' keys (by then enough nodes have expired the holder's key for a quorum).
    pub(crate) async fn wait_to_retry(
        &self,
        acquisition: &mut RedlockAcquisition,
        retry_after: Option<Duration>,
    ) {
        let delay = acquisition.backoff.next_delay();
        let delay = retry_after.map_or(delay, |r| delay.min(r.max(Duration::from_millis(1))));
        tokio::time::sleep(delay).await;
    }

    /// An abandoned acquire: compare-and-delete on every node (a try whose reply was lost, or whose
    /// quorum arrived after its validity deadline, may have left keys). On each node the release goes
    /// on the connection the try went on, after it.
    pub(crate) async fn undo_abandoned(
        &self,
        acquisition: RedlockAcquisition,
        request: &AcquireRequest,
    ) {
        if !acquisition.sent {
            return;
        }
        let unanswered = acquisition
            .stragglers
            .settle_for_release(self.nodes().len())
            .await;
        if let Err(e) = self
            .release_everywhere(
                &request.name,
                &acquisition.value,
                unanswered,
                self.config().node_timeout_for(request.lease),
            )
            .await
        {
            tracing::warn!(error = %e, lock = %request.name, "undoing an abandoned Redlock acquire; keys left expire after the lease");
        }
    }
}

/// When to try again at the latest: the lock can be ours once `quorum − granted` more nodes are free,
/// i.e. when the (quorum − granted)-th smallest of the holders' pttls has passed.
fn retry_after(tally: &Tally, quorum: usize) -> Option<Duration> {
    let needed = quorum.saturating_sub(tally.granted).max(1);
    let mut pttls: Vec<Duration> = tally.busy.iter().flatten().copied().collect();
    pttls.sort();
    pttls.get(needed - 1).copied()
}

fn unavailable(name: &str, n: usize, quorum: usize, tally: &Tally) -> Error {
    let failures: Vec<String> = tally
        .failed
        .iter()
        .map(|(node, e)| format!("{node}: {e}"))
        .collect();
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "Redlock quorum unreachable: {} of {n} nodes failed to answer and a quorum needs {quorum} ({} granted, {} held elsewhere); {}",
            tally.failed.len(),
            tally.granted,
            tally.busy.len(),
            failures.join("; ")
        ),
    )
    .with_backend(BACKEND)
    .with_lock(name)
}
