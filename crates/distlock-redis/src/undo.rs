//! Undos of abandoned acquires, and releases or undos that may still be on their way.
//!
//! An abandoned acquire is undone (a compare-and-delete by owner) on the connection its last try went
//! on: Redis runs one connection's commands in order, so the undo runs after that try however late the
//! try arrives (a delayed request that timed out here may still reach the server). If that connection
//! fails (broken, or no reply in time), the undo is sent again on a fresh connection. A try the server
//! already received still runs after its connection was reset (Redis reads its socket buffer), e.g. on
//! a stalled server: a fresh connection reaches the server only after that, and if the undo cannot get
//! through, it is sent again in the background (at most the lease).
//!
//! A release or undo that failed without a reply may still be queued on its connection, and would
//! delete a grant the same owner gets meanwhile on a fresh one. So every such request is *pending*
//! ([`PendingUndos`]) until a later reply on its connection shows it ran, the connection fails
//! (nothing more gets onto the server through it), or the lease has passed; the same owner's next
//! acquire waits for that, at most the request timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use distlock_core::raw::AcquireRequest;
use distlock_core::retry::RetryPolicy;
use distlock_core::LockKind;
use redis::Value;
use tokio::time::Instant;

use crate::acquire::RedisAcquisition;
use crate::conn::{Conn, Sent};
use crate::error::RedisError;
use crate::layout;
use crate::RedisBackend;

/// How an undo that could not get through is sent again in the background: until the lease has
/// passed, after 50–100 ms, then doubling up to 1–2 s.
const BACKGROUND_UNDO: RetryPolicy =
    RetryPolicy::new(u32::MAX, Duration::from_millis(100), Duration::from_secs(2));

/// The (name, owner) pairs with an undo or release that may still be on its way, each with the
/// number of background jobs holding it.
#[derive(Default)]
pub(crate) struct PendingUndos {
    /// Entries in `by_name`: an acquire with nothing pending (the common case) reads only this.
    entries: AtomicUsize,
    by_name: Mutex<HashMap<String, Vec<Pending>>>,
}

struct Pending {
    owner: String,
    holds: usize,
    /// Never sent on: dropped with the entry, which wakes every waiter.
    settled: tokio::sync::watch::Sender<()>,
}

/// A job's hold on a pending (name, owner); the entry goes with the last hold.
#[derive(Clone)]
pub(crate) struct PendingHold {
    /// Kept for its `Drop`.
    _hold: Arc<Hold>,
}

struct Hold {
    registry: Arc<PendingUndos>,
    name: String,
    owner: String,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.registry.release(&self.name, &self.owner);
    }
}

impl PendingUndos {
    fn by_name(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Pending>>> {
        self.by_name.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks (name, owner) pending until the returned hold (and its clones) are dropped.
    pub(crate) fn hold(self: &Arc<Self>, name: &str, owner: &str) -> PendingHold {
        let mut by_name = self.by_name();
        let list = by_name.entry(name.to_string()).or_default();
        match list.iter_mut().find(|p| p.owner == owner) {
            Some(pending) => pending.holds += 1,
            None => {
                list.push(Pending {
                    owner: owner.to_string(),
                    holds: 1,
                    settled: tokio::sync::watch::channel(()).0,
                });
                self.entries.fetch_add(1, Ordering::SeqCst);
            }
        }
        PendingHold {
            _hold: Arc::new(Hold {
                registry: self.clone(),
                name: name.to_string(),
                owner: owner.to_string(),
            }),
        }
    }

    fn release(&self, name: &str, owner: &str) {
        let mut by_name = self.by_name();
        let Some(list) = by_name.get_mut(name) else {
            return;
        };
        if let Some(i) = list.iter().position(|p| p.owner == owner) {
            list[i].holds -= 1;
            if list[i].holds == 0 {
                list.swap_remove(i);
                self.entries.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if list.is_empty() {
            by_name.remove(name);
        }
    }

    /// Whether something is pending for (name, owner) now. Without any pending entry, neither locks
    /// nor allocates.
    pub(crate) fn is_pending(&self, name: &str, owner: &str) -> bool {
        if self.entries.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.by_name()
            .get(name)
            .is_some_and(|list| list.iter().any(|p| p.owner == owner))
    }

    /// Waits until nothing is pending for (name, owner), at most `within`: `false` if something still
    /// is. Without any pending entry, neither locks nor allocates.
    pub(crate) async fn settled(&self, name: &str, owner: &str, within: Duration) -> bool {
        if self.entries.load(Ordering::SeqCst) == 0 {
            return true;
        }
        let mut settled = {
            let by_name = self.by_name();
            let pending = by_name
                .get(name)
                .and_then(|list| list.iter().find(|p| p.owner == owner));
            match pending {
                Some(pending) => pending.settled.subscribe(),
                None => return true,
            }
        };
        // `changed` fails once the entry (and its sender) is gone: that is the signal.
        tokio::time::timeout(within, settled.changed())
            .await
            .is_ok()
    }
}

/// A step of a background job (see [`RedisBackend::spawn_pending`]).
enum Step {
    /// Send the undo (of a hold of this kind) on this connection (the acquire's); if no reply comes,
    /// wait until the connection is settled.
    UndoOn(Conn, LockKind),
    /// Wait until the requests sent so far on this connection have run (see [`RedisBackend::settle`]).
    Settle(Conn),
    /// Send the undo (of a hold of this kind) on a fresh connection until one is answered.
    Resend(LockKind),
}

impl RedisBackend {
    /// Waits until no undo or release of this owner's is still on its way (see [`PendingUndos`]), at
    /// most the request timeout.
    pub(crate) async fn after_pending_undo(
        &self,
        request: &AcquireRequest,
    ) -> Result<(), RedisError> {
        let within = self.request_timeout();
        if self
            .inner
            .pending
            .settled(&request.name, &request.owner, within)
            .await
        {
            return Ok(());
        }
        Err(RedisError::UndoPending {
            target: self.inner.target.shown.clone(),
            after: within,
        })
    }

    /// How long an undo on an acquire's connection may take: on the `WAIT` connection it queues behind
    /// the acquire's `WAIT`, which blocks the connection for up to `wait_timeout`. Giving up earlier
    /// drops the last handle on the connection: it closes, and the server frees the blocked client
    /// with the undo unread.
    pub(crate) fn undo_bound(&self) -> Duration {
        match &self.inner.durable {
            Some(_) => self.request_timeout() + self.config().wait_timeout,
            None => self.request_timeout(),
        }
    }

    /// `Backend::abandon`: see the [module](self).
    pub(crate) async fn undo_abandoned(
        &self,
        acquisition: RedisAcquisition,
        request: &AcquireRequest,
    ) {
        let RedisAcquisition {
            subscription,
            maybe_granted,
            sent,
            seen_busy,
            ..
        } = acquisition;
        drop(subscription);
        // A fair waiter's place in the queue (it has one since its first busy answer) goes with the
        // undo: the fair release script takes it off the queue, and wakes the head when the lock is
        // free, so the queue never waits on it.
        let queued = seen_busy && self.is_fair(request.kind);
        if !maybe_granted && !queued {
            return;
        }
        let (name, owner) = (&request.name, &request.owner);
        let lingering = request.lease.max(self.undo_bound());
        // Pending from now on, so the same owner's next acquire waits for the undo.
        let hold = self.inner.pending.hold(name, owner);
        if let Some(conn) = sent.conn {
            let mut undo = self.spawn_pending(
                hold.clone(),
                name,
                owner,
                vec![Step::UndoOn(conn, request.kind)],
                lingering,
            );
            match tokio::time::timeout(self.undo_bound(), &mut undo).await {
                Ok(Ok(Ok(()))) => return,
                Ok(Ok(Err(e))) => {
                    tracing::debug!(lock = %name, error = %e, "undo on the acquire's connection failed; undoing on a fresh one too")
                }
                Ok(Err(e)) => {
                    tracing::debug!(lock = %name, error = %e, "the undo task failed; undoing on a fresh connection")
                }
                Err(_) => {
                    tracing::debug!(lock = %name, "the undo is still queued behind the acquire; undoing on a fresh connection too")
                }
            }
        }
        let mut sent = Sent::default();
        match self
            .release_on(self.release_link(), name, owner, request.kind, &mut sent)
            .await
        {
            Ok(true) => tracing::debug!(lock = %name, "undid an abandoned grant"),
            Ok(false) => {}
            Err(RedisError::ReleaseOutcomeUnknown { .. }) => {
                tracing::debug!(lock = %name, "the undo was sent twice; either attempt removed the grant, or there was none")
            }
            Err(e) => {
                tracing::warn!(lock = %name, error = %e, "could not undo an abandoned acquire yet; trying again in the background until its lease has passed");
                // An undo that timed out may still be on its way on its connection: settle it first,
                // so the resend cannot be overtaken by it (nothing to settle after a broken one).
                let mut steps: Vec<Step> = sent
                    .conn
                    .filter(|_| !e.is_broken_connection())
                    .map(Step::Settle)
                    .into_iter()
                    .collect();
                steps.push(Step::Resend(request.kind));
                drop(self.spawn_pending(hold, name, owner, steps, lingering));
            }
        }
    }

    /// A release that failed without a reply may still be on its way on its connection (one that
    /// broke carries nothing more; one that timed out may): until a later reply on that connection
    /// shows it ran, the same owner's next acquire waits.
    pub(crate) fn settle_in_background(
        &self,
        error: &RedisError,
        sent: Sent,
        name: &str,
        owner: &str,
        within: Duration,
    ) {
        let Some(conn) = sent.conn.filter(|_| !error.is_broken_connection()) else {
            return;
        };
        let hold = self.inner.pending.hold(name, owner);
        drop(self.spawn_pending(hold, name, owner, vec![Step::Settle(conn)], within));
    }

    /// The one background job of an undo or release that may still be on its way: runs `steps` within
    /// `within`, holding `hold` (the same owner's next acquire waits) until it ends. The task's result
    /// is the first [`Step::UndoOn`]'s.
    fn spawn_pending(
        &self,
        hold: PendingHold,
        name: &str,
        owner: &str,
        steps: Vec<Step>,
        within: Duration,
    ) -> tokio::task::JoinHandle<Result<(), RedisError>> {
        let this = self.clone();
        let (name, owner) = (name.to_string(), owner.to_string());
        tokio::spawn(async move {
            let _hold = hold;
            let deadline = Instant::now() + within;
            let mut outcome = Ok(());
            for step in steps {
                let left = deadline.saturating_duration_since(Instant::now());
                match step {
                    Step::UndoOn(conn, kind) => {
                        outcome = this
                            .undo_on(conn.clone(), &name, &owner, kind, this.undo_bound())
                            .await;
                        if outcome.as_ref().is_err_and(|e| !e.is_broken_connection()) {
                            // No reply in time (redis-rs gives up on it after its response timeout
                            // too): the undo may still be on its way.
                            this.settle(conn, &name, left).await;
                        }
                    }
                    Step::Settle(conn) => this.settle(conn, &name, left).await,
                    Step::Resend(kind) => this.resend_undo(&name, &owner, kind, deadline).await,
                }
            }
            outcome
        })
    }

    /// Sends the undo on a fresh connection until one gets an answer, or `deadline`: the server may
    /// be stalled or unreachable, and an acquire it already received still runs when it is back.
    /// A resend that got no reply in time may still be on its way on its connection, and would
    /// delete the same owner's next grant if it landed after the job ended: its connection is settled
    /// before the next resend (nothing to settle after a broken one).
    async fn resend_undo(&self, name: &str, owner: &str, kind: LockKind, deadline: Instant) {
        let mut retries = BACKGROUND_UNDO.start(Some(deadline));
        while retries.wait().await {
            let mut sent = Sent::default();
            match self
                .release_on(self.release_link(), name, owner, kind, &mut sent)
                .await
            {
                Ok(_) | Err(RedisError::ReleaseOutcomeUnknown { .. }) => {
                    tracing::debug!(lock = %name, "undid an abandoned acquire in the background");
                    return;
                }
                Err(e) => {
                    tracing::debug!(lock = %name, error = %e, "the undo failed again");
                    if let Some(conn) = sent.conn.filter(|_| !e.is_broken_connection()) {
                        let left = deadline.saturating_duration_since(Instant::now());
                        self.settle(conn, name, left).await;
                    }
                }
            }
        }
        tracing::warn!(lock = %name, "could not undo an abandoned acquire; it expires with its lease");
    }

    /// Waits until the requests on `name` sent so far on `conn` have run (an `EXISTS` of the lock sent
    /// after them is answered: keyed, so that a Cluster connection sends it to the same node), the
    /// connection fails (nothing more gets onto the server through it), or `within` has passed.
    async fn settle(&self, mut conn: Conn, name: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(layout::lock_key(name));
            let answered =
                tokio::time::timeout_at(deadline, exists.query_async::<Value>(&mut conn)).await;
            match answered {
                // redis-rs's own response timeout: the reply may still come; ask again.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(20);

    #[tokio::test]
    async fn nothing_pending_returns_at_once() {
        let pending = Arc::new(PendingUndos::default());
        assert!(pending.settled("a", "o1", SHORT).await);
        let hold = pending.hold("a", "o1");
        // Another owner, another name: not held up.
        assert!(pending.settled("a", "o2", SHORT).await);
        assert!(pending.settled("b", "o1", SHORT).await);
        assert!(!pending.settled("a", "o1", SHORT).await);
        drop(hold);
        assert!(pending.settled("a", "o1", SHORT).await);
        assert_eq!(pending.entries.load(Ordering::SeqCst), 0);
        assert!(pending.by_name().is_empty());
    }

    #[tokio::test]
    async fn the_entry_goes_with_the_last_hold() {
        let pending = Arc::new(PendingUndos::default());
        let first = pending.hold("a", "o1");
        let copy = first.clone();
        let second = pending.hold("a", "o1");
        assert_eq!(pending.entries.load(Ordering::SeqCst), 1);
        drop(first);
        drop(second);
        assert!(
            !pending.settled("a", "o1", SHORT).await,
            "a clone still holds"
        );
        let waiter = {
            let pending = pending.clone();
            tokio::spawn(async move { pending.settled("a", "o1", Duration::from_secs(60)).await })
        };
        tokio::task::yield_now().await;
        drop(copy);
        assert!(
            waiter.await.unwrap(),
            "the waiter is woken when the last hold goes"
        );
        assert_eq!(pending.entries.load(Ordering::SeqCst), 0);
    }

    /// A background resend of an undo is delayed on its way (3 s) and times out at the 1 s request
    /// bound; the next resend, on a fresh connection, is answered at once. The job must not end (and
    /// the same owner's next acquire must not go ahead) until the first resend has run: otherwise it
    /// lands after that acquire's grant and deletes it (the core would call it Held while another
    /// client takes the lock). A real server behind the testkit's proxy; the private job is driven
    /// directly, as reaching a timed-out resend through `abandon` needs a mode switch between a
    /// connect and its first request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timed_out_resend_cannot_delete_the_same_owners_next_grant_fault() {
        use distlock_core::raw::{Attempt, Backend};
        use distlock_core::url::Endpoint;
        use distlock_testkit::proxy::Proxy;
        use distlock_testkit::redis::RedisServer;

        let server = RedisServer::start_or_panic();
        let proxy = Proxy::start_or_panic(server.addr());
        let config = crate::RedisConfig::new(Endpoint::new("127.0.0.1", proxy.port()))
            .with_request_timeout(Duration::from_secs(1));
        let backend = RedisBackend::from_config(config).await.expect("connect");
        let (name, owner) = ("undo/timed-out-resend", "owner-a:1");
        let request = AcquireRequest::new(name, owner, Duration::from_secs(30));
        let exists = || server.command(&["EXISTS", name]).unwrap().as_int() == Some(1);
        // Loads the release script (a delayed `EVALSHA` must not come back `NOSCRIPT`) and opens the
        // connection the first resend goes on, so that only the request itself is delayed.
        backend
            .release_on(
                backend.release_link(),
                name,
                owner,
                LockKind::Mutex,
                &mut Sent::default(),
            )
            .await
            .unwrap();

        let delay = Duration::from_secs(3);
        proxy.delay(delay).unwrap();
        let started = Instant::now();
        let hold = backend.inner.pending.hold(name, owner);
        let job = backend.spawn_pending(
            hold,
            name,
            owner,
            vec![Step::Resend(LockKind::Mutex)],
            Duration::from_secs(30),
        );
        // The first resend goes out after 50–100 ms and is held in the proxy; from now on new traffic
        // passes at once.
        tokio::time::sleep(Duration::from_millis(500)).await;
        proxy.pass().unwrap();

        // The same owner acquires again as soon as nothing is pending.
        let mut acquisition = backend.begin(&request).unwrap();
        loop {
            match backend.try_acquire(&mut acquisition, &request).await {
                Ok(Attempt::Acquired(_)) => break,
                Ok(Attempt::Busy { .. }) => panic!("the lock is held by someone else"),
                Ok(other) => panic!("unexpected {other:?}"),
                Err(e) => {
                    assert_eq!(e.kind(), distlock_core::ErrorKind::Unavailable, "{e}");
                    assert!(
                        started.elapsed() < Duration::from_secs(20),
                        "never granted: {e}"
                    );
                }
            }
        }
        let granted_at = started.elapsed();
        assert!(
            granted_at >= delay,
            "granted after {granted_at:?}, before the delayed resend could land (it can delete the grant)"
        );
        // The delayed resend has landed by `delay` and a bit.
        tokio::time::sleep_until(started + delay + Duration::from_millis(1500)).await;
        assert!(job.is_finished(), "the job has settled every resend by now");
        assert!(
            exists(),
            "the late resend of the undo deleted the same owner's next grant"
        );
    }
}
