//! The conformance suite: every behaviour a backend must show, as a `pub async fn` over a
//! [`Provider`], expanded per backend by [`conformance_suite!`](crate::conformance_suite) so that a backend
//! cannot miss a case. Behaviours differ only by [`Capabilities`](distlock_core::Capabilities), never by
//! the backend's name; a case that does not apply asserts the capability that says so instead of
//! skipping silently.
//!
//! The cases panic on failure (they are test code); everything they need from the backend comes through
//! the provider.
//!
//! ```ignore
//! distlock_testkit::conformance_suite!(my_provider);   // `async fn my_provider() -> impl Provider`
//! ```

// The cases are test code run inside `#[test]`s: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock_core::{ErrorKind, Fencing, Lock, LockGuard, LockState, Locks};

use crate::holder::HolderProcess;
use crate::proxy::Proxy;

/// A future a [`Client`]'s cut hook returns.
pub type CutFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One client of the backend under test: a [`Locks`] with connections of its own, optionally the
/// testkit fault proxies those connections go through, and optionally a way to cut it off its server as
/// a partition would.
pub struct Client {
    /// The client's lock handle.
    pub locks: Locks,
    proxies: Vec<Arc<Proxy>>,
    /// Why this client's connections cannot go through proxies of its own, when they cannot.
    unproxied: Option<String>,
    cut: Option<Box<dyn Fn() -> CutFuture + Send + Sync>>,
    heal: Option<Box<dyn Fn() -> CutFuture + Send + Sync>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("locks", &self.locks)
            .field("proxies", &self.proxies)
            .field("unproxied", &self.unproxied)
            .field("can_cut", &self.cut.is_some())
            .finish()
    }
}

impl Client {
    /// A client that cannot be cut off and whose connections (if any) go through no proxy.
    pub fn new(locks: Locks) -> Self {
        Self {
            locks,
            proxies: Vec::new(),
            unproxied: None,
            cut: None,
            heal: None,
        }
    }

    /// Names the testkit fault proxies every connection of this client goes through, and only this
    /// client's: the connection cases delay and reset them (a cut, if any, is set separately).
    pub fn with_proxies(mut self, proxies: Vec<Arc<Proxy>>) -> Self {
        self.proxies = proxies;
        self
    }

    /// Says why this client's connections cannot go through proxies of its own (the topology hands
    /// out server addresses the client then connects to directly). The connection cases fail with this
    /// reason rather than pass untested.
    pub fn with_unproxied_connections(mut self, why: impl Into<String>) -> Self {
        self.unproxied = Some(why.into());
        self
    }

    /// The fault proxies this client's connections go through (empty: none).
    pub fn proxies(&self) -> &[Arc<Proxy>] {
        &self.proxies
    }

    /// Applies `action` to every proxy of this client, off the runtime's workers (the proxy's control
    /// calls block until applied).
    pub async fn on_proxies(
        &self,
        action: impl Fn(&Proxy) -> crate::error::Result<()> + Send + 'static,
    ) {
        let proxies = self.proxies.clone();
        tokio::task::spawn_blocking(move || {
            for p in proxies {
                action(&p).unwrap_or_else(|e| panic!("proxy {}: {e}", p.addr()));
            }
        })
        .await
        .expect("proxy task");
    }

    /// Bytes this client has sent into its proxies so far.
    pub fn bytes_sent(&self) -> u64 {
        self.proxies.iter().map(|p| p.client_bytes()).sum()
    }

    /// Adds the hook that reconnects a cut-off client.
    pub fn with_heal(mut self, heal: impl Fn() -> CutFuture + Send + Sync + 'static) -> Self {
        self.heal = Some(Box::new(heal));
        self
    }

    /// Reconnects a cut-off client; `false` if the provider has no way to.
    pub async fn heal(&self) -> bool {
        match &self.heal {
            Some(heal) => {
                heal().await;
                true
            }
            None => false,
        }
    }

    /// Adds the hook that cuts this client off its server (blackholes its connections, freezes it).
    pub fn with_cut(mut self, cut: impl Fn() -> CutFuture + Send + Sync + 'static) -> Self {
        self.cut = Some(Box::new(cut));
        self
    }

    /// Cut and heal through the testkit fault proxies this client's connections go through: the cut
    /// blackholes every one (bytes dropped, sockets kept open, as a partition); the heal passes bytes
    /// again and resets the connections (bytes dropped mid-frame leave a connection unusable, so the
    /// client reconnects afresh).
    pub fn with_proxy_cut(self, proxies: Vec<Arc<Proxy>>) -> Self {
        let (cut, heal) = (proxies.clone(), proxies.clone());
        self.with_proxies(proxies)
            .with_cut(move || {
                let proxies = cut.clone();
                Box::pin(async move {
                    tokio::task::spawn_blocking(move || {
                        for p in proxies {
                            p.blackhole().expect("blackhole");
                        }
                    })
                    .await
                    .expect("cut task");
                })
            })
            .with_heal(move || {
                let proxies = heal.clone();
                Box::pin(async move {
                    tokio::task::spawn_blocking(move || {
                        for p in proxies {
                            p.pass().expect("pass");
                            p.reset().expect("reset");
                        }
                    })
                    .await
                    .expect("heal task");
                })
            })
    }

    /// A new `Lock` of `name` on this client.
    pub fn lock(&self, name: &str) -> Lock {
        self.locks.lock(name).expect("a valid lock name")
    }

    /// Acquires `name` with `lease`, waiting as long as it takes.
    pub async fn hold(&self, name: &str, lease: Duration) -> LockGuard {
        self.lock(name)
            .options()
            .lease(lease)
            .acquire()
            .await
            .expect("acquire")
    }

    /// Cuts the client off; `false` if this backend's provider has no way to.
    pub async fn cut(&self) -> bool {
        match &self.cut {
            Some(cut) => {
                cut().await;
                true
            }
            None => false,
        }
    }
}

/// What a backend's test gives the suite.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    /// A new client of the backend under test, on the same server(s) as every other client.
    async fn client(&self) -> Client;

    /// A URL another process can use (`distlock run --url`), if locks are shared across processes.
    fn url(&self) -> Option<String>;

    /// A lease the server honours reliably, for expiry and watchdog cases (1 s by default).
    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// A lock name unique to this case and run, so cases never see each other's locks.
pub fn unique_name(case: &str) -> String {
    format!(
        "conformance/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A generous bound for "this happens promptly" on a loaded 2-core machine. Mechanism bounds in the cases
/// are multiples of the lease; this is only the floor.
pub(crate) const PROMPT: Duration = Duration::from_secs(5);

/// Four tasks, each its own client, take turns; never two inside at once.
pub async fn mutual_exclusion(provider: &impl Provider) {
    let name = unique_name("mutual_exclusion");
    let inside = Arc::new(AtomicUsize::new(0));
    let entries = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let client = provider.client().await;
        let (name, inside, entries, tokens) = (
            name.clone(),
            inside.clone(),
            entries.clone(),
            tokens.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let lock = client.lock(&name);
            for _ in 0..5 {
                let guard = lock.acquire().await.expect("acquire");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders inside at once"
                );
                entries.fetch_add(1, Ordering::SeqCst);
                tokens.lock().expect("tokens").push(guard.token());
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    assert_eq!(entries.load(Ordering::SeqCst), 20);
    let tokens = tokens.lock().expect("tokens").clone();
    if provider.client().await.locks.capabilities().fencing != Fencing::None {
        let distinct: HashSet<_> = tokens.iter().collect();
        assert_eq!(
            distinct.len(),
            tokens.len(),
            "a token was granted twice: {tokens:?}"
        );
    }
}

/// `try_acquire` on a lock held elsewhere is `Ok(None)`, both from another client and from another
/// `Lock` of the same client; it succeeds once the holder releases.
pub async fn try_acquire_when_held_is_none(provider: &impl Provider) {
    let name = unique_name("try_acquire_when_held");
    let a = provider.client().await;
    let b = provider.client().await;
    let holder = a.lock(&name);
    let guard = holder.acquire().await.expect("acquire");
    let other_client = b.lock(&name);
    assert!(
        other_client.try_acquire().await.expect("try").is_none(),
        "another client got a held lock"
    );
    let same_client = a.lock(&name);
    assert!(
        same_client.try_acquire().await.expect("try").is_none(),
        "another Lock of the holder's client got it"
    );
    guard.release().await.expect("release");
    let again = other_client.try_acquire().await.expect("try");
    assert!(again.is_some(), "the lock stayed held after release");
}

/// A bounded wait on a held lock fails with `Timeout` after the limit, not before.
pub async fn wait_timeout(provider: &impl Provider) {
    let name = unique_name("wait_timeout");
    let a = provider.client().await;
    let b = provider.client().await;
    let guard = a.lock(&name).acquire().await.expect("acquire");
    let waiter = b.lock(&name);
    let limit = Duration::from_millis(400);
    let started = Instant::now();
    let err = waiter
        .options()
        .wait(limit)
        .acquire()
        .await
        .expect_err("must time out");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        started.elapsed() >= limit,
        "timed out after {:?}, before the {limit:?} limit",
        started.elapsed()
    );
    assert_eq!(guard.state(), LockState::Held);
    guard.release().await.expect("release");
    // The timed-out waiter left nothing behind: it can acquire now without waiting.
    assert!(waiter.try_acquire().await.expect("try").is_some());
}

/// Dropping an acquire future leaves no lock and no queue entry behind.
pub async fn cancelled_acquire_leaves_nothing(provider: &impl Provider) {
    let name = unique_name("cancelled_acquire");
    let a = provider.client().await;
    let b = provider.client().await;
    let c = provider.client().await;
    let guard = a.lock(&name).acquire().await.expect("acquire");
    let cancelled = b.lock(&name);
    let dropped = tokio::time::timeout(Duration::from_millis(300), cancelled.acquire()).await;
    assert!(dropped.is_err(), "the waiter got a held lock");
    guard.release().await.expect("release");
    // Neither the cancelled waiter nor its undo holds it: a third client gets it, without waiting for a
    // lease to run out.
    let third = c.lock(&name);
    let got = third
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("third client must get it");
    got.release().await.expect("release");
    // And the cancelled Lock itself can still acquire.
    let again = cancelled
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("cancelled Lock acquires later");
    again.release().await.expect("release");
}

/// Dropping a guard releases the lock in the background, long before its 30 s lease would end.
pub async fn drop_releases(provider: &impl Provider) {
    let name = unique_name("drop_releases");
    let a = provider.client().await;
    let b = provider.client().await;
    let guard = a
        .lock(&name)
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .expect("acquire");
    drop(guard);
    let other = b.lock(&name);
    let got = other
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("a dropped guard must release");
    got.release().await.expect("release");
}

/// Only the owner releases, and a late release never deletes a newer holder's lock: a holder cut off
/// past its lease loses the lock to another client, and its release then reports `NotHeld` and leaves the
/// new holder's lock in place.
pub async fn release_is_owner_only(provider: &impl Provider) {
    let name = unique_name("release_owner_only");
    let a = provider.client().await;
    let b = provider.client().await;
    let c = provider.client().await;
    let caps = a.locks.capabilities();
    let lease = provider.short_lease();
    let first = a.hold(&name, lease).await;
    if !a.cut().await {
        assert!(
            !caps.server_ttl,
            "a backend with leases must let the suite cut a client off"
        );
        // No lease to run out: the only way to free the lock is the owner's release, which works once.
        let other = b.lock(&name);
        assert!(other.try_acquire().await.expect("try").is_none());
        first.release().await.expect("release");
        let second = other
            .try_acquire()
            .await
            .expect("try")
            .expect("free after release");
        assert_eq!(second.state(), LockState::Held);
        second.release().await.expect("release");
        return;
    }
    let second = b
        .lock(&name)
        .options()
        .lease(Duration::from_secs(30))
        .wait(lease * 4 + PROMPT)
        .acquire()
        .await
        .expect("the cut-off holder's lease must expire");
    let healed = a.heal().await;
    let err = first
        .release()
        .await
        .expect_err("a superseded holder's release must fail");
    if healed && !caps.frees_on_process_death {
        // Reconnected, the release reaches the server, which must refuse it.
        assert_eq!(err.kind(), ErrorKind::NotHeld, "{err}");
    } else {
        // Not reconnected; or the lock is its connection's (a session lock: PostgreSQL's and
        // MariaDB's), and the release may meet that connection broken by the cut before its driver
        // read the close: the unlock's outcome is unknown to the client then (`Unavailable`), and the
        // lock went with the session, which the new holder's grant shows.
        assert!(
            matches!(err.kind(), ErrorKind::NotHeld | ErrorKind::Unavailable),
            "{err}"
        );
    }
    assert_eq!(second.state(), LockState::Held);
    let third = c.lock(&name);
    assert!(
        third.try_acquire().await.expect("try").is_none(),
        "the late release deleted the new holder's lock"
    );
    second.release().await.expect("release");
}

/// Acquiring again through the same `Lock` while a guard lives is reentrant: the same token, and the lock
/// is released only when the last guard goes.
pub async fn reentrancy_same_token(provider: &impl Provider) {
    let name = unique_name("reentrancy");
    let a = provider.client().await;
    let b = provider.client().await;
    let lock = a.lock(&name);
    let outer = lock.acquire().await.expect("acquire");
    let inner = lock
        .try_acquire()
        .await
        .expect("try")
        .expect("reentrant acquire");
    assert_eq!(
        inner.token(),
        outer.token(),
        "a reentrant acquire must return the same token"
    );
    let other = b.lock(&name);
    outer.release().await.expect("inner release");
    assert!(
        other.try_acquire().await.expect("try").is_none(),
        "released while a reentrant guard lived"
    );
    assert_eq!(inner.state(), LockState::Held);
    inner.release().await.expect("release");
    assert!(
        other.options().wait(PROMPT).acquire().await.is_ok(),
        "not released after the last guard"
    );
}

/// A lease expires when its holder is cut off, and another client gets the lock after it, not before.
pub async fn abandoned_lease_expires(provider: &impl Provider) {
    let name = unique_name("abandoned_lease");
    let a = provider.client().await;
    let b = provider.client().await;
    let lease = provider.short_lease();
    let guard = a.hold(&name, lease).await;
    let cut_at = Instant::now();
    if !a.cut().await {
        assert!(
            !a.locks.capabilities().server_ttl,
            "a backend with leases must let the suite cut a client off"
        );
        assert!(guard.validity_deadline().is_none());
        return;
    }
    let other = b.lock(&name);
    let got = other
        .options()
        .wait(lease * 4 + PROMPT)
        .acquire()
        .await
        .expect("the lease must expire");
    // The renewal a third of a lease before the cut may have been the last: the lock cannot be free
    // before two thirds of a lease after the cut.
    assert!(
        cut_at.elapsed() >= lease * 2 / 3 - Duration::from_millis(50),
        "taken over {:?} after the cut, inside the lease",
        cut_at.elapsed()
    );
    assert_eq!(
        guard.state(),
        LockState::Lost,
        "the cut-off holder still believes it holds the lock"
    );
    if got.token().is_some() {
        assert!(
            got.token() > guard.token(),
            "the new holder's token must be higher"
        );
    }
    got.release().await.expect("release");
}

/// The watchdog keeps a lock held far beyond its lease while the guard lives.
pub async fn watchdog_outlives_lease(provider: &impl Provider) {
    let name = unique_name("watchdog");
    let a = provider.client().await;
    let b = provider.client().await;
    let lease = provider.short_lease();
    let guard = a.hold(&name, lease).await;
    let token = guard.token();
    tokio::time::sleep(lease * 3).await;
    assert_eq!(
        guard.state(),
        LockState::Held,
        "lost while the watchdog should renew: {:?}",
        guard.loss_reason()
    );
    assert_eq!(guard.token(), token);
    let other = b.lock(&name);
    assert!(
        other.try_acquire().await.expect("try").is_none(),
        "the lease ran out under a live guard"
    );
    if a.locks.capabilities().server_ttl {
        let deadline = guard
            .validity_deadline()
            .expect("a lease has a validity deadline");
        assert!(
            deadline > std::time::Instant::now(),
            "the validity deadline was not pushed forward"
        );
    }
    guard.release().await.expect("release");
}

/// When the client is cut off, `jeopardy()` and then `lost()` fire, and `state()` is never `Held` after
/// the validity deadline.
pub async fn lost_fires_when_cut_off(provider: &impl Provider) {
    let name = unique_name("lost_fires");
    let a = provider.client().await;
    let lease = provider.short_lease();
    let guard = a.hold(&name, lease).await;
    let mut changes = guard.state_changes();
    if !a.cut().await {
        assert!(!a.locks.capabilities().server_ttl);
        assert!(guard.validity_deadline().is_none());
        assert_eq!(guard.state(), LockState::Held);
        return;
    }
    let bound = lease * 2 + PROMPT;
    tokio::time::timeout(bound, guard.jeopardy())
        .await
        .expect("jeopardy() must fire");
    // Sample the state until it is Lost: past the deadline it must never read Held.
    let sampled = tokio::time::timeout(bound, async {
        loop {
            let deadline = guard.validity_deadline();
            let state = guard.state();
            if let Some(deadline) = deadline {
                if std::time::Instant::now() >= deadline {
                    assert_ne!(state, LockState::Held, "Held after the validity deadline");
                }
            }
            if state == LockState::Lost {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(sampled.is_ok(), "never Lost after the cut");
    tokio::time::timeout(Duration::from_millis(100), guard.lost())
        .await
        .expect("lost() resolves at once when Lost");
    assert!(guard.loss_reason().is_some());
    // The watch saw the transition too.
    tokio::time::timeout(PROMPT, changes.wait_for(|s| *s == LockState::Lost))
        .await
        .expect("state_changes")
        .expect("watch open");
    drop(guard);
}

/// Tokens strictly increase across holders.
pub async fn tokens_strictly_increase(provider: &impl Provider) {
    let name = unique_name("tokens");
    let mut last = None;
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(provider.client().await);
    }
    let fencing = clients[0].locks.capabilities().fencing;
    for round in 0..6 {
        let client = &clients[round % clients.len()];
        let guard = client.lock(&name).acquire().await.expect("acquire");
        match fencing {
            Fencing::None => assert!(
                guard.token().is_none(),
                "a backend without fencing returned a token"
            ),
            _ => {
                let token = guard.token().expect("a fencing backend returns a token");
                if let Some(previous) = last {
                    assert!(token > previous, "token {token} after {previous}");
                }
                last = Some(token);
            }
        }
        guard.release().await.expect("release");
    }
}

/// Names are case-sensitive and never collide after mapping; invalid names are refused before any I/O.
pub async fn names_map_as_documented(provider: &impl Provider) {
    let client = provider.client().await;
    let other = provider.client().await;
    let base = unique_name("names");
    let names = [
        format!("{base}/Name"),
        format!("{base}/name"),
        format!("{base}/a b"),
        format!("{base}/a%20b"),
        format!("{base}/x_y"),
        format!("{base}/x:y"),
        format!("{base}/ü"),
        format!("{base}/u"),
        format!("{base}/{}", "l".repeat(1024 - base.len() - 1)),
    ];
    let mut guards = Vec::new();
    for name in &names {
        let lock = client.locks.lock(name).expect("a valid name");
        guards.push(
            lock.try_acquire()
                .await
                .expect("try")
                .unwrap_or_else(|| panic!("{name:?} collided with another name")),
        );
    }
    for name in &names {
        let lock = other.locks.lock(name).expect("a valid name");
        assert!(
            lock.try_acquire().await.expect("try").is_none(),
            "{name:?} not held after mapping"
        );
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
    for bad in [String::new(), "x".repeat(1025)] {
        let err = client.locks.lock(&bad).expect_err("an invalid name");
        assert_eq!(err.kind(), ErrorKind::InvalidName, "{err}");
    }
}

/// Waiters of one client queue first come, first served, and only the head contends with the engine:
/// waiters are served in arrival order, and a task that releases and at once re-acquires goes behind the
/// waiter already queued instead of winning the race back (what pollers do 96–99 % of the time).
pub async fn local_waiters_fifo(provider: &impl Provider) {
    let name = unique_name("local_fifo");
    let client = provider.client().await;
    let holder = client.lock(&name);
    let first = holder.acquire().await.expect("acquire");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let lock = client.lock(&name);
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = lock.acquire().await.expect("acquire");
            order.lock().expect("order").push(i);
            guard.release().await.expect("release");
        }));
        // Let each waiter reach the queue before the next one starts.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Release and re-acquire at once: the holder must queue behind the four waiters.
    first.release().await.expect("release");
    let again = holder
        .options()
        .wait(PROMPT * 2)
        .acquire()
        .await
        .expect("re-acquire");
    order.lock().expect("order").push(99);
    again.release().await.expect("release");
    for task in tasks {
        tokio::time::timeout(PROMPT * 2, task)
            .await
            .expect("waiters finish")
            .expect("task");
    }
    assert_eq!(
        *order.lock().expect("order"),
        vec![0, 1, 2, 3, 99],
        "local waiters were not served in arrival order (99 is the releasing task re-acquiring)"
    );
}

/// `max_hold` ends a hold: the guard becomes Lost at the cap and another client gets the lock, even
/// though the watchdog renews in between. Backends with no lease refuse it as Unsupported.
pub async fn max_hold_caps_the_hold(provider: &impl Provider) {
    let name = unique_name("max_hold");
    let a = provider.client().await;
    let b = provider.client().await;
    let lease = provider.short_lease();
    let cap = lease * 2;
    let lock = a.lock(&name);
    // The cap counts from the acquire's send, so the clock starts before the call: a slow acquire
    // (a first one that creates paths or opens a session) must not make a correct cap look early.
    let started = Instant::now();
    let acquired = lock.options().lease(lease).max_hold(cap).acquire().await;
    if !a.locks.capabilities().server_ttl {
        let err = acquired.expect_err("max_hold without a lease must be refused");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert!(
            b.lock(&name).try_acquire().await.expect("try").is_some(),
            "the refused acquire locked something"
        );
        return;
    }
    let guard = acquired.expect("acquire");
    tokio::time::timeout(cap + PROMPT, guard.lost())
        .await
        .expect("Lost at max_hold");
    assert!(
        started.elapsed() >= cap - Duration::from_millis(50),
        "lost before the cap: {:?}",
        started.elapsed()
    );
    let other = b.lock(&name);
    let got = other
        .options()
        .wait(lease + PROMPT)
        .acquire()
        .await
        .expect("the capped lease must run out");
    got.release().await.expect("release");
}

/// `extend` renews now where there is a lease, and is Unsupported where there is none; bad options are
/// refused before anything is locked.
pub async fn extend_and_bad_options(provider: &impl Provider) {
    let name = unique_name("extend");
    let a = provider.client().await;
    let b = provider.client().await;
    let lock = a.lock(&name);
    for lease in [Duration::ZERO, Duration::from_millis(1)] {
        let err = lock
            .options()
            .lease(lease)
            .acquire()
            .await
            .expect_err("a tiny lease is refused");
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    }
    let probe = b.lock(&name).try_acquire().await.expect("try");
    probe
        .expect("a refused acquire locked something")
        .release()
        .await
        .expect("release");
    let guard = lock
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("acquire");
    let extended = guard.extend(Duration::from_secs(20)).await;
    if a.locks.capabilities().server_ttl {
        extended.expect("extend");
        let left = guard.validity_deadline().expect("deadline") - std::time::Instant::now();
        assert!(
            left > Duration::from_secs(15),
            "extend did not push the deadline: {left:?} left"
        );
    } else {
        assert_eq!(
            extended.expect_err("no lease to extend").kind(),
            ErrorKind::Unsupported
        );
    }
    guard.release().await.expect("release");
}

/// A holder in another process (the `distlock` binary) excludes this one; when that process is
/// SIGKILLed, the lock frees (at once where the engine frees on process death, else after the lease).
pub async fn killed_holder_process_frees_lock(provider: &impl Provider) {
    let client = provider.client().await;
    let caps = client.locks.capabilities();
    let Some(url) = provider.url() else {
        assert!(
            !caps.shared_across_processes,
            "a backend shared across processes must give the suite a URL"
        );
        return;
    };
    let name = unique_name("killed_holder");
    let lease = provider.short_lease();
    let mut holder = HolderProcess::spawn(&url, &name, lease).expect("holder process");
    let lock = client.lock(&name);
    assert!(
        lock.try_acquire().await.expect("try").is_none(),
        "the other process's lock was not seen"
    );
    if let (Some(theirs), Fencing::Strict | Fencing::BestEffort) = (holder.token(), caps.fencing) {
        assert!(theirs > 0);
    }
    holder.kill9().expect("kill the holder");
    let started = Instant::now();
    let bound = if caps.frees_on_process_death {
        PROMPT
    } else {
        lease * 4 + PROMPT
    };
    let guard = lock
        .options()
        .wait(bound)
        .acquire()
        .await
        .expect("the lock must free after the holder dies");
    if !caps.frees_on_process_death {
        assert!(
            started.elapsed() >= lease / 3,
            "freed {:?} after the kill, inside the lease",
            started.elapsed()
        );
    }
    if let (Some(ours), Some(theirs)) = (guard.token(), holder.token()) {
        assert!(
            ours.get() > theirs,
            "token {ours} after the killed holder's {theirs}"
        );
    }
    assert!(
        holder.child_gone(PROMPT),
        "the killed holder's command outlived it"
    );
    guard.release().await.expect("release");
}

/// Whether the connection cases can reach this client's connections: `true` if it has proxies of its
/// own. A client without any passes only where the backend has no connection to lose: in-process
/// (not `shared_across_processes`), or with no server that could expire or end a hold (no `server_ttl`:
/// every backend that talks to a server has a lease or a session the server ends). A networked client
/// without proxies fails here, loudly, with the provider's reason if it gave one.
pub(crate) fn connections_in_reach(client: &Client, case: &str) -> bool {
    if !client.proxies().is_empty() {
        return true;
    }
    let caps = client.locks.capabilities();
    if let Some(why) = &client.unproxied {
        panic!("{case}: this client's connections bypass the suite's fault proxies ({why}); the case cannot run here");
    }
    assert!(
        !caps.shared_across_processes || !caps.server_ttl,
        "{case}: the backend talks to a server (a lease it expires: {caps:?}) but the provider gave \
         this client no fault proxies (Client::with_proxies)"
    );
    false
}

/// One acquire and release cycle with `lease` on a name of its own, so the client's connections,
/// sessions and server-side scripts for that lease exist before a fault is timed against one request
/// (a first request that must also connect or load a script takes several round trips).
pub(crate) async fn warm_up(client: &Client, case: &str, lease: Duration) {
    let guard = client
        .hold(&unique_name(&format!("{case}-warm-up")), lease)
        .await;
    guard.release().await.expect("warm-up release");
}

/// Waits (bounded) until the client has sent nothing through its proxies for `QUIET`, and returns
/// its byte count then. A client's own background traffic (a pool opening a spare connection or
/// resetting a returned one, a keep-alive) goes through the same proxies as the request a case is
/// about to time a fault against: counted from a busy moment, a background byte would pass for the
/// request's, and the fault land before the request was sent.
async fn quiet_bytes_sent(client: &Client, what: &str) -> u64 {
    const QUIET: Duration = Duration::from_millis(150);
    let started = Instant::now();
    let mut last = client.bytes_sent();
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = client.bytes_sent();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= QUIET {
            return now;
        }
        assert!(
            started.elapsed() < PROMPT * 2,
            "{what}: the client kept sending for {:?}",
            started.elapsed()
        );
    }
}

/// Waits (bounded) until the client has put at least one byte more than `before` into its proxies.
async fn wait_for_bytes_sent(client: &Client, before: u64, what: &str) {
    let started = Instant::now();
    while client.bytes_sent() <= before {
        assert!(
            started.elapsed() < PROMPT * 2,
            "{what}: nothing was sent in {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The outcome a release may have when a fault hit its connection: done, or unknown (`Unavailable`).
/// `NotHeld` would say the lock was not ours, which is false, and would make `distlock run` exit 76
/// ("lock lost") for a command that ran under the lock to the end.
fn assert_ok_or_unavailable(outcome: &distlock_core::Result<()>, case: &str) {
    if let Err(e) = outcome {
        assert_eq!(
            e.kind(),
            ErrorKind::Unavailable,
            "{case}: a release whose connection failed must be done (Ok) or unknown (Unavailable), \
             never {:?}: {e}",
            e.kind()
        );
    }
}

/// A holder (30 s lease) releases while its connections are reset: its proxies hold the release on
/// its way (`delay`), and once it is sent, every connection is reset. Whatever the release returns (`Ok`,
/// or `Unavailable` if the outcome is still unknown, never `NotHeld` or another error), the lock must
/// not stay behind: another client gets it promptly, far inside the lease, and the same `Lock` acquires
/// again afterwards.
pub async fn release_under_a_reset(provider: &impl Provider) {
    let case = "release_under_a_reset";
    let name = unique_name(case);
    let a = provider.client().await;
    let b = provider.client().await;
    let lease = Duration::from_secs(30);
    warm_up(&a, case, lease).await;
    let lock = a.lock(&name);
    let guard = lock
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    if !connections_in_reach(&a, case) {
        // Nothing to reset: the release is plain, and frees the lock at once.
        guard.release().await.expect("release");
        let got = b.lock(&name).try_acquire().await.expect("try");
        got.expect("free after release")
            .release()
            .await
            .expect("release");
        return;
    }
    let before = quiet_bytes_sent(&a, "before the release").await;
    a.on_proxies(|p| p.delay(Duration::from_secs(1))).await;
    let release = tokio::spawn(guard.release());
    wait_for_bytes_sent(&a, before, "the release").await;
    a.on_proxies(|p| p.pass().and_then(|()| p.reset())).await;
    let reset_at = Instant::now();
    let outcome = tokio::time::timeout(lease / 2, release)
        .await
        .expect("the release must return well inside the lease")
        .expect("release task");
    // The lock first (a lock left behind blocks everyone), then what the release said.
    let other = b.lock(&name);
    let got = other
        .options()
        .lease(lease)
        .wait(PROMPT * 2)
        .acquire()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the lock stayed behind after a release under a reset (release said {outcome:?}); \
                 another client could not get it: {e}"
            )
        });
    assert!(
        reset_at.elapsed() < lease * 2 / 3,
        "the lock freed {:?} after the reset: the lease ran out, the release did not free it",
        reset_at.elapsed()
    );
    assert_ok_or_unavailable(&outcome, case);
    got.release().await.expect("release");
    let again = lock
        .options()
        .wait(PROMPT * 2)
        .acquire()
        .await
        .expect("the released Lock acquires again");
    again.release().await.expect("release");
}

/// The release reaches the server and is applied, but its reply is lost: the holder's proxies hold
/// every byte 1 s both ways, the release is sent, and once another client can take the lock (the
/// server applied the release: no backend-specific look), the proxies pass and reset, dropping the
/// held reply. The release must return `Ok` or `Unavailable`, never `NotHeld`; and whatever the
/// holder resends must leave the other client's hold alone: it stays Held, nobody else gets the lock
/// meanwhile, and its release is `Ok`.
pub async fn lost_release_reply(provider: &impl Provider) {
    let case = "lost_release_reply";
    let a = provider.client().await;
    let b = provider.client().await;
    let c = provider.client().await;
    let lease = Duration::from_secs(30);
    if !connections_in_reach(&a, case) {
        let name = unique_name(case);
        let guard = a.hold(&name, lease).await;
        guard.release().await.expect("release");
        let got = b.lock(&name).try_acquire().await.expect("try");
        got.expect("free after release")
            .release()
            .await
            .expect("release");
        return;
    }
    warm_up(&a, case, lease).await;
    // Under load the reply may get through before the reset; then try again with a fresh lock.
    for attempt in 1..=3 {
        let name = unique_name(case);
        let (mine, next, third) = (a.lock(&name), b.lock(&name), c.lock(&name));
        if lose_a_release_reply(&a, &mine, &next, &third, case).await {
            return;
        }
        eprintln!("{case}: attempt {attempt}: the reply got through before the reset; again");
    }
    panic!("{case}: the release's reply got through before the reset in 3 attempts");
}

/// One try of [`lost_release_reply`] (and of the shared kinds' `lost_release_reply_of`): `mine` (of `holder`) holds and releases under held replies,
/// `next` gets in once the release is applied, `third` must stay out while `next` holds. Whether the
/// reply was really lost (the release had not returned when `next` got in).
pub(crate) async fn lose_a_release_reply(
    holder: &Client,
    mine: &Lock,
    next: &Lock,
    third: &Lock,
    case: &str,
) -> bool {
    let lease = Duration::from_secs(30);
    let guard = mine
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    holder.on_proxies(|p| p.delay(Duration::from_secs(1))).await;
    let release = tokio::spawn(guard.release());
    let started = Instant::now();
    let theirs = loop {
        if let Some(got) = next
            .options()
            .lease(lease)
            .try_acquire()
            .await
            .expect("try")
        {
            break got;
        }
        assert!(
            started.elapsed() < PROMPT * 2,
            "{case}: the delayed release never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let reply_lost = !release.is_finished();
    holder
        .on_proxies(|p| p.pass().and_then(|()| p.reset()))
        .await;
    let outcome = tokio::time::timeout(lease / 2, release)
        .await
        .expect("the release must return well inside the lease")
        .expect("release task");
    if let Err(e) = &outcome {
        assert_ne!(
            e.kind(),
            ErrorKind::NotHeld,
            "{case}: the release was applied (another client got in) but reported NotHeld: {e}"
        );
    }
    assert_ok_or_unavailable(&outcome, case);
    // Whatever the holder's client resent, the next hold stays: watch it a while.
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(2) {
        assert_eq!(
            theirs.state(),
            LockState::Held,
            "{case}: the next holder lost its hold after a resent release: {:?}",
            theirs.loss_reason()
        );
        assert!(
            third.try_acquire().await.expect("try").is_none(),
            "{case}: a resent release let a third client in beside the next holder"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    theirs
        .release()
        .await
        .expect("the next holder's release, after the old holder's resend");
    let again = mine
        .options()
        .wait(PROMPT * 2)
        .acquire()
        .await
        .expect("the released Lock acquires again");
    again.release().await.expect("release");
    reply_lost
}

/// An operator's break ([`Locks::break_holder`], `distlock break`) ends the hold `inspect` showed and
/// no other: a holder that came since survives a break aimed at the one before it; the broken holder's
/// guard goes `Lost` (when its engine tells it, or at its next renewal: within its lease) while a
/// waiter gets the lock (a holder that keeps renewing would otherwise keep it for ever). A backend
/// without [`breaks_holders`](distlock_core::Capabilities::breaks_holders) refuses with `Unsupported`
/// and leaves the hold alone.
pub async fn break_ends_only_the_holder_shown(provider: &impl Provider) {
    let name = unique_name("break");
    let a = provider.client().await;
    let b = provider.client().await;
    let operator = provider.client().await;
    let lease = Duration::from_secs(3);
    let first_lock = a.lock(&name);
    let first = first_lock
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let shown = |info: distlock_core::LockInfo| info.holder.expect("inspect shows the holder");
    let first_shown = shown(operator.locks.inspect(&name).await.expect("inspect"));
    if !operator.locks.capabilities().breaks_holders {
        let refused = operator
            .locks
            .break_holder(&name, &first_shown)
            .await
            .expect_err("a backend without breaks_holders refuses");
        assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
        assert_eq!(first.state(), LockState::Held);
        assert!(b.lock(&name).try_acquire().await.expect("try").is_none());
        first.release().await.expect("release");
        return;
    }

    // Aimed at a holder that has gone while the same `Lock` holds again (same owner id): where
    // inspect shows the hold's identity (a token or an engine's hold id), the new hold is not touched.
    first.release().await.expect("release");
    let first = first_lock
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("acquire again");
    let again = shown(operator.locks.inspect(&name).await.expect("inspect"));
    if first_shown.token.is_some() || first_shown.hold_id.is_some() {
        let stale = operator
            .locks
            .break_holder(&name, &first_shown)
            .await
            .expect("break");
        assert!(
            !stale,
            "a break aimed at the first hold broke the same owner's next hold ({first_shown:?}, now {again:?})"
        );
        assert_eq!(first.state(), LockState::Held);
    }

    // Aimed at a holder that has gone: the one there now is not touched.
    first.release().await.expect("release");
    let first_shown = again;
    let second = b.hold(&name, lease).await;
    let stale = operator
        .locks
        .break_holder(&name, &first_shown)
        .await
        .expect("break");
    assert!(
        !stale,
        "a break aimed at the first holder reported a broken hold"
    );
    assert!(
        a.lock(&name).try_acquire().await.expect("try").is_none(),
        "the second holder lost the lock to a break aimed at the first"
    );
    assert_eq!(second.state(), LockState::Held);

    // Aimed at the holder there now: it is broken, a waiter gets the lock, the guard learns it.
    let second_shown = shown(operator.locks.inspect(&name).await.expect("inspect"));
    let waiter = a.lock(&name);
    let waiting = tokio::spawn(async move {
        let guard = waiter.acquire().await;
        (waiter, guard)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        operator
            .locks
            .break_holder(&name, &second_shown)
            .await
            .expect("break"),
        "the holder shown was not broken"
    );
    let (_waiter, third) = tokio::time::timeout(lease + PROMPT, waiting)
        .await
        .expect("a waiter gets a broken lock (its holder is alive and renewing)")
        .expect("waiter task");
    let third = third.expect("acquire");
    tokio::time::timeout(lease + PROMPT, second.lost())
        .await
        .expect("the broken holder's guard goes Lost within its lease");
    if let (Some(broken), Some(next)) = (second_shown.token, third.token()) {
        assert!(next > broken, "{next} after the broken {broken}");
    }
    third.release().await.expect("release");

    // Aimed at a writer that has gone while readers hold the name now: nothing to break there, and
    // no refusal either (the holder shown is simply gone).
    if operator.locks.capabilities().kinds.read_write {
        let name = unique_name("break_rw");
        let writer = a.locks.read_write(&name).expect("a read-write lock");
        let written = writer.write().await.expect("write");
        let writer_shown = shown(operator.locks.inspect(&name).await.expect("inspect"));
        written.release().await.expect("release");
        let reader = b.locks.read_write(&name).expect("a read-write lock");
        let read = reader.read().await.expect("read");
        let broken = operator
            .locks
            .break_holder(&name, &writer_shown)
            .await
            .expect("a stale break of a writer while readers hold is no error");
        assert!(!broken, "a reader was broken by a break aimed at a writer");
        assert_eq!(read.state(), LockState::Held);
        read.release().await.expect("release");
    }
}

/// Expands the whole suite for one backend: one `#[tokio::test]` per case, named after it.
///
/// `$make` is an async fn (or closure returning a future) producing the [`Provider`]; each test calls it
/// once, so providers may start a fresh server per test. `conformance_suite!(@mutex $make)` expands
/// the mutex's cases alone (for a variant of a backend whose kinds are the same objects, such as
/// Redis's plain layout).
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@mutex $make);
        $crate::conformance_suite!(@kinds $make;
            read_write,
            semaphore,
        );
    };
    (@mutex $make:expr) => {
        $crate::conformance_suite!(@cases $make;
            mutual_exclusion,
            try_acquire_when_held_is_none,
            wait_timeout,
            cancelled_acquire_leaves_nothing,
            drop_releases,
            release_is_owner_only,
            reentrancy_same_token,
            abandoned_lease_expires,
            watchdog_outlives_lease,
            lost_fires_when_cut_off,
            tokens_strictly_increase,
            names_map_as_documented,
            local_waiters_fifo,
            max_hold_caps_the_hold,
            extend_and_bad_options,
            killed_holder_process_frees_lock,
            release_under_a_reset,
            lost_release_reply,
            break_ends_only_the_holder_shown,
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let provider = ($make)().await;
                $crate::conformance::$case(&provider).await;
            }
        )*
    };
    (@kinds $make:expr; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let provider = ($make)().await;
                $crate::conformance_kinds::$case(&provider).await;
            }
        )*
    };
}
