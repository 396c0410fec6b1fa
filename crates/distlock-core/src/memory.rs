//! The in-memory backend, [`MemoryBackend`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::sync::watch;

use crate::capabilities::{Capabilities, Fencing};
use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind, Result};
use crate::raw::{
    AcquireRequest, Attempt, Backend, Grant, HandOff, HolderInfo, LockInfo, Released, Renewal,
    RenewalId, Renewed,
};
use crate::sync::lock;
use crate::token::FencingToken;
use crate::url::LockUrl;

/// The in-memory backend: the reference implementation of every semantic, TTLs included, inside one
/// process. `memory://name` is a process-global store per namespace ([`MemoryBackend::namespace`]);
/// [`MemoryBackend::new`] a private one. Clones share the store and the link to it.
///
/// With cargo feature `testing` (off by default; the testkit enables it), a handle can be cut off from
/// the store (`freeze`, or `memory://ns?freeze_after=2s`), as on a partition: every request of that
/// handle (and its clones) then fails with [`ErrorKind::Unavailable`] while leases keep expiring in the
/// store, so its guards go to Jeopardy and then Lost at their deadline, and other handles
/// (`another_client`) can take the lock over. That is how the loss path is tested without a server.
/// The timing of replies is a test facility too: `delay_renewals` holds back the replies of the next
/// renewals (the store has applied them; the reply is late, as over a slow network), `cap_ttl` makes
/// the store grant less than asked (as etcd caps a lock's lease by its session's remaining time and
/// ZooKeeper clamps a session timeout), `renewal_requests` counts the renewals that reached the store,
/// and `delay_releases` makes the next releases reach the store late.
#[derive(Clone)]
pub struct MemoryBackend {
    store: Arc<Store>,
    link: Arc<Link>,
    namespace: Option<String>,
}

struct Store {
    names: Mutex<HashMap<String, NameState>>,
    /// Bumped on every release, so waiters wake without polling and never miss one.
    releases: watch::Sender<u64>,
}

/// This handle's connection to the store, which a test can cut.
#[derive(Default)]
struct Link {
    frozen: AtomicBool,
    freeze_at: Mutex<Option<Instant>>,
    /// How long the replies of the next `renew` calls are held back, one entry per call.
    renewal_delays: Mutex<VecDeque<Duration>>,
    /// The most the store grants this handle, on acquire and renewal.
    ttl_cap: Mutex<Option<Duration>>,
    renewal_requests: AtomicU64,
    /// How long the next `release` calls take to reach the store, one entry per call.
    release_delays: Mutex<VecDeque<Duration>>,
    /// How long the replies of the next `release` calls are held back after the store applied them, one
    /// entry per call.
    release_reply_delays: Mutex<VecDeque<Duration>>,
    /// Releases hand the lock to the next local waiter in one step (`enable_hand_off`).
    hand_off: AtomicBool,
    hand_offs: AtomicU64,
}

impl Link {
    fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::SeqCst)
            || lock(&self.freeze_at).is_some_and(|at| clock::now() >= at)
    }

    /// What the store grants for `asked`.
    fn grant(&self, asked: Duration) -> Duration {
        lock(&self.ttl_cap).map_or(asked, |cap| asked.min(cap))
    }

    fn check_reachable(&self) -> Result<()> {
        if self.is_frozen() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the memory store is unreachable from this handle (frozen: a simulated partition)",
            ));
        }
        Ok(())
    }
}

#[derive(Default)]
struct NameState {
    holder: Option<Holder>,
    last_token: u64,
}

struct Holder {
    owner: String,
    token: u64,
    expires_at: Instant,
    since: SystemTime,
}

impl Holder {
    fn live(&self, now: Instant) -> bool {
        now < self.expires_at
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("namespace", &self.namespace)
            .field("frozen", &self.link.is_frozen())
            .finish()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    fn new() -> Self {
        Self {
            names: Mutex::new(HashMap::new()),
            releases: watch::channel(0).0,
        }
    }

    fn released(&self) {
        self.releases.send_modify(|n| *n = n.wrapping_add(1));
    }
}

impl MemoryBackend {
    /// A private store, shared only by clones of this backend.
    pub fn new() -> Self {
        Self {
            store: Arc::new(Store::new()),
            link: Arc::default(),
            namespace: None,
        }
    }

    /// The process-global store of `namespace`: every `memory://namespace` in this process shares it.
    pub fn namespace(namespace: &str) -> Self {
        static STORES: OnceLock<Mutex<HashMap<String, Arc<Store>>>> = OnceLock::new();
        let stores = STORES.get_or_init(|| Mutex::new(HashMap::new()));
        let store = lock(stores)
            .entry(namespace.to_string())
            .or_insert_with(|| Arc::new(Store::new()))
            .clone();
        Self {
            store,
            link: Arc::default(),
            namespace: Some(namespace.to_string()),
        }
    }

    /// `memory://[namespace]`. With cargo feature `testing`, also `?freeze_after=DURATION`: freezes the
    /// server side that long after the backend is made, a fault-injection knob for testing the loss path
    /// (of `distlock run`, say) in another process. (`lease` is read by the facade's `connect`.)
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        #[cfg(feature = "testing")]
        const KNOWN: &[&str] = &["freeze_after", "lease"];
        #[cfg(not(feature = "testing"))]
        const KNOWN: &[&str] = &["lease"];
        url.reject_unknown_query(KNOWN)?;
        if url.hosts().len() > 1 || !url.path().trim_matches('/').is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "memory URLs take only a namespace: memory://[namespace]",
            ));
        }
        let backend = Self::namespace(url.hosts().first().map_or("", String::as_str));
        // Each URL connection is a client of its own, as with a server.
        #[cfg(feature = "testing")]
        if let Some(after) = url.query_duration("freeze_after")? {
            backend.freeze_after(after);
        }
        Ok(backend)
    }

    /// Another handle on the same store with a link of its own: what a second client would have.
    #[cfg(feature = "testing")]
    pub fn another_client(&self) -> Self {
        Self {
            store: self.store.clone(),
            link: Arc::default(),
            namespace: self.namespace.clone(),
        }
    }

    /// Cuts this handle (and its clones) off the store: every request fails as on a partition, while
    /// leases keep expiring in the store.
    #[cfg(feature = "testing")]
    pub fn freeze(&self) {
        self.link.frozen.store(true, Ordering::SeqCst);
    }

    /// Cuts this handle off `after` from now.
    #[cfg(feature = "testing")]
    pub fn freeze_after(&self, after: Duration) {
        *lock(&self.link.freeze_at) = Some(clock::now().saturating_add(after));
    }

    /// Ends a freeze.
    #[cfg(feature = "testing")]
    pub fn unfreeze(&self) {
        self.link.frozen.store(false, Ordering::SeqCst);
        *lock(&self.link.freeze_at) = None;
    }

    /// Whether this handle is cut off.
    #[cfg(feature = "testing")]
    pub fn is_frozen(&self) -> bool {
        self.link.is_frozen()
    }

    /// Holds back the replies of this handle's next `renew` calls (a watchdog batch or an `extend`), one
    /// delay per call in order: the store applies each renewal at once, and its reply comes that much
    /// later, as over a slow network. Calls after the queue is used up are answered at once.
    #[cfg(feature = "testing")]
    pub fn delay_renewals(&self, delays: impl IntoIterator<Item = Duration>) {
        lock(&self.link.renewal_delays).extend(delays);
    }

    /// Holds back this handle's next `release` calls, one delay per call in order: each reaches the store
    /// that much later, as over a slow network (so a release can be under way when its runtime is
    /// dropped). Calls after the queue is used up reach the store at once.
    #[cfg(feature = "testing")]
    pub fn delay_releases(&self, delays: impl IntoIterator<Item = Duration>) {
        lock(&self.link.release_delays).extend(delays);
    }

    /// Holds back the replies of this handle's next `release` calls, one delay per call in order: the
    /// store applies each at once and its reply comes that much later, as over a slow network (so the
    /// next acquire of this process can run while a release's reply is on its way). Calls after the
    /// queue is used up reply at once.
    #[cfg(feature = "testing")]
    pub fn delay_release_replies(&self, delays: impl IntoIterator<Item = Duration>) {
        lock(&self.link.release_reply_delays).extend(delays);
    }

    /// Makes the store grant this handle at most `cap` on acquires and renewals, whatever it asks (as
    /// etcd caps a lock's lease by its session's remaining time, and ZooKeeper clamps a session timeout).
    /// `None` lifts the cap.
    #[cfg(feature = "testing")]
    pub fn cap_ttl(&self, cap: Option<Duration>) {
        *lock(&self.link.ttl_cap) = cap;
    }

    /// Makes this handle (and its clones) pass a lock to the next waiter of its `Locks` in one step
    /// at release ([`Backend::hand_off`]) instead of passing its local queue on early; `delay_releases`
    /// delays handoffs too.
    #[cfg(feature = "testing")]
    pub fn enable_hand_off(&self) {
        self.link.hand_off.store(true, Ordering::SeqCst);
    }

    /// How many handoffs of this handle granted the lock to the next owner.
    #[cfg(feature = "testing")]
    pub fn hand_offs(&self) -> u64 {
        self.link.hand_offs.load(Ordering::SeqCst)
    }

    /// How many `renew` calls of this handle have reached the store (renewals under way included).
    #[cfg(feature = "testing")]
    pub fn renewal_requests(&self) -> u64 {
        self.link.renewal_requests.load(Ordering::SeqCst)
    }
}

/// A memory acquisition: the release counter last seen, so no release between a busy try and the wait
/// is missed.
#[derive(Debug)]
pub struct MemoryAcquisition {
    releases: watch::Receiver<u64>,
}

#[async_trait]
impl Backend for MemoryBackend {
    type Lease = ();
    type Acquisition = MemoryAcquisition;

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict)
            .with_notify_wait(true)
            .with_shared_across_processes(false)
    }

    fn begin(&self, _request: &AcquireRequest) -> Result<MemoryAcquisition> {
        let mut releases = self.store.releases.subscribe();
        releases.borrow_and_update();
        Ok(MemoryAcquisition { releases })
    }

    async fn try_acquire(
        &self,
        acquisition: &mut MemoryAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<()>> {
        self.link.check_reachable()?;
        acquisition.releases.borrow_and_update();
        let now = clock::now();
        let mut names = lock(&self.store.names);
        let state = names.entry(request.name.clone()).or_default();
        if let Some(holder) = state.holder.as_mut().filter(|h| h.live(now)) {
            if holder.owner != request.owner {
                return Ok(Attempt::Busy {
                    retry_after: Some(holder.expires_at.saturating_duration_since(now)),
                });
            }
            // Ours already (an earlier reply was lost): the same hold, refreshed.
            let ttl = self.link.grant(request.lease);
            holder.expires_at = now.saturating_add(ttl);
            return Ok(Attempt::Acquired(
                Grant::new(())
                    .with_token(FencingToken::new(holder.token))
                    .with_ttl(ttl),
            ));
        }
        let ttl = self.link.grant(request.lease);
        state.last_token += 1;
        state.holder = Some(Holder {
            owner: request.owner.clone(),
            token: state.last_token,
            expires_at: now.saturating_add(ttl),
            since: SystemTime::now(),
        });
        Ok(Attempt::Acquired(
            Grant::new(())
                .with_token(FencingToken::new(state.last_token))
                .with_ttl(ttl),
        ))
    }

    async fn wait(
        &self,
        acquisition: &mut MemoryAcquisition,
        _request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        let expiry = retry_after.unwrap_or(Duration::from_secs(3600));
        tokio::select! {
            _ = acquisition.releases.changed() => {}
            _ = tokio::time::sleep(expiry) => {}
        }
        Ok(())
    }

    async fn abandon(&self, _acquisition: MemoryAcquisition, request: &AcquireRequest) {
        if self.link.check_reachable().is_err() {
            return;
        }
        let mut names = lock(&self.store.names);
        if let Some(state) = names.get_mut(&request.name) {
            if state
                .holder
                .as_ref()
                .is_some_and(|h| h.owner == request.owner)
            {
                state.holder = None;
                drop(names);
                self.store.released();
            }
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, ()>]) -> Vec<(RenewalId, Result<Renewed>)> {
        if let Err(e) = self.link.check_reachable() {
            return batch
                .iter()
                .map(|entry| (entry.id, Err(Error::new(e.kind(), e.message()))))
                .collect();
        }
        self.link.renewal_requests.fetch_add(1, Ordering::SeqCst);
        let outcomes: Vec<(RenewalId, Result<Renewed>)> = {
            let now = clock::now();
            let mut names = lock(&self.store.names);
            batch
                .iter()
                .map(|entry| {
                    let holder = names.get_mut(entry.name).and_then(|s| s.holder.as_mut());
                    let outcome = match holder {
                        Some(h) if h.owner == entry.owner && h.live(now) => {
                            let ttl = self.link.grant(entry.ttl);
                            h.expires_at = now.saturating_add(ttl);
                            Renewed::Extended { ttl }
                        }
                        Some(h) if h.live(now) => Renewed::Gone {
                            reason: "another owner holds the lock".into(),
                        },
                        _ => Renewed::Gone {
                            reason: "the lease expired on the server".into(),
                        },
                    };
                    (entry.id, Ok(outcome))
                })
                .collect()
        };
        let delay = lock(&self.link.renewal_delays).pop_front();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        outcomes
    }

    async fn release(&self, _lease: &(), name: &str, owner: &str) -> Result<Released> {
        let delay = lock(&self.link.release_delays).pop_front();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        self.link.check_reachable()?;
        let now = clock::now();
        let released = {
            let mut names = lock(&self.store.names);
            match names.get_mut(name) {
                Some(state)
                    if state
                        .holder
                        .as_ref()
                        .is_some_and(|h| h.owner == owner && h.live(now)) =>
                {
                    state.holder = None;
                    true
                }
                _ => false,
            }
        };
        let released = if released {
            self.store.released();
            Released::Released
        } else {
            Released::NotHeld
        };
        let delay = lock(&self.link.release_reply_delays).pop_front();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        Ok(released)
    }

    /// The store applies a release at its first poll (unless `delay_releases` holds it back: then an
    /// acquire that overtakes it finds the lock held and waits for the release, as it would anyway).
    fn release_orders_next_acquire(&self) -> bool {
        !self.link.hand_off.load(Ordering::SeqCst)
    }

    fn supports_hand_off(&self) -> bool {
        self.link.hand_off.load(Ordering::SeqCst)
    }

    /// The holder becomes `next` with a new token, in one step (the store has no queue of its own to
    /// pass over).
    async fn hand_off(
        &self,
        _lease: &(),
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<()>> {
        let delay = lock(&self.link.release_delays).pop_front();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        self.link.check_reachable()?;
        let now = clock::now();
        let mut names = lock(&self.store.names);
        let Some(state) = names.get_mut(name).filter(|s| {
            s.holder
                .as_ref()
                .is_some_and(|h| h.owner == owner && h.live(now))
        }) else {
            return Ok(HandOff::Released(Released::NotHeld));
        };
        let ttl = self.link.grant(next.lease);
        state.last_token += 1;
        state.holder = Some(Holder {
            owner: next.owner.clone(),
            token: state.last_token,
            expires_at: now.saturating_add(ttl),
            since: SystemTime::now(),
        });
        self.link.hand_offs.fetch_add(1, Ordering::SeqCst);
        Ok(HandOff::Handed(
            Grant::new(())
                .with_token(FencingToken::new(state.last_token))
                .with_ttl(ttl),
        ))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.link.check_reachable()?;
        let now = clock::now();
        let names = lock(&self.store.names);
        let mut info = LockInfo::default();
        if let Some(state) = names.get(name) {
            info.last_token = (state.last_token > 0).then(|| FencingToken::new(state.last_token));
            if let Some(h) = state.holder.as_ref().filter(|h| h.live(now)) {
                let holder = HolderInfo {
                    owner: Some(h.owner.clone()),
                    token: Some(FencingToken::new(h.token)),
                    remaining_lease: Some(h.expires_at.saturating_duration_since(now)),
                    pid: Some(std::process::id()),
                    since: Some(h.since),
                    ..HolderInfo::default()
                };
                info.holder = Some(holder);
            }
        }
        Ok(info)
    }
}
