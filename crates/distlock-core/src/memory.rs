//! The in-memory backend, [`MemoryBackend`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::sync::watch;

use crate::capabilities::{Capabilities, Fencing, LockKinds, ReadWriteOrder};
use crate::clock::{self, Instant};
use crate::error::{Error, ErrorKind, Result};
use crate::kinds::LockKind;
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
///
/// ```
/// use distlock_core::{Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// // Two handles on one named store contend as two processes would on a server.
/// let first = Locks::new(MemoryBackend::namespace("example"));
/// let second = Locks::new(MemoryBackend::namespace("example"));
/// let guard = first.lock("report")?.acquire().await?;
/// assert!(second.lock("report")?.try_acquire().await?.is_none());
/// guard.release().await?;
/// assert!(second.lock("report")?.try_acquire().await?.is_some());
/// # Ok(())
/// # }
/// ```
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

/// One name in the store. Its mutex and the write side of its read-write lock are one lock
/// (`holder`); readers share it while nobody holds that; a semaphore's permits are another kind of
/// lock on the name, which excludes the other two ([`ErrorKind::KindConflict`]).
#[derive(Default)]
struct NameState {
    /// The exclusive holder: a mutex or a writer.
    holder: Option<Holder>,
    readers: Vec<Holder>,
    /// A writer (or the name's mutex: the same lock) waiting for the readers to leave: new readers
    /// wait behind it (writers first). It refreshes this on every try, and it ends when the writer
    /// takes the lock or gives up, or after the writer's lease without a try.
    writer_waiting: Option<(String, Instant)>,
    /// The semaphore's permit holders, each in a slot below the limit.
    permits: Vec<Holder>,
    /// The semaphore's limit, stored with its first permit and kept.
    limit: Option<u32>,
    /// The last token minted for the name (write and mutex grants, and permits).
    last_token: u64,
    /// The last write (or mutex) grant's token, which a reader carries: a permit minted since is no
    /// write a reader has seen.
    last_write_token: u64,
}

struct Holder {
    owner: String,
    token: u64,
    expires_at: Instant,
    since: SystemTime,
    /// The slot of a permit.
    slot: u32,
}

impl Holder {
    fn new(owner: &str, token: u64, expires_at: Instant) -> Self {
        Self {
            owner: owner.to_string(),
            token,
            expires_at,
            since: SystemTime::now(),
            slot: 0,
        }
    }

    fn live(&self, now: Instant) -> bool {
        now < self.expires_at
    }

    fn info(&self, now: Instant) -> HolderInfo {
        HolderInfo {
            owner: Some(self.owner.clone()),
            token: Some(FencingToken::new(self.token)),
            remaining_lease: Some(self.expires_at.saturating_duration_since(now)),
            pid: Some(std::process::id()),
            since: Some(self.since),
            ..HolderInfo::default()
        }
    }
}

impl NameState {
    /// Forgets holders whose lease ran out, and a waiting writer's mark past its time.
    fn expire(&mut self, now: Instant) {
        if self.holder.as_ref().is_some_and(|h| !h.live(now)) {
            self.holder = None;
        }
        self.readers.retain(|h| h.live(now));
        self.permits.retain(|h| h.live(now));
        if self
            .writer_waiting
            .as_ref()
            .is_some_and(|(_, until)| now >= *until)
        {
            self.writer_waiting = None;
        }
    }

    /// The hold of `owner` of `kind`, if it is live.
    fn hold_mut(&mut self, owner: &str, kind: LockKind) -> Option<&mut Holder> {
        match kind {
            LockKind::Read => self.readers.iter_mut().find(|h| h.owner == owner),
            LockKind::Permit { .. } => self.permits.iter_mut().find(|h| h.owner == owner),
            _ => self.holder.as_mut().filter(|h| h.owner == owner),
        }
    }

    /// Removes `owner`'s hold of `kind`; whether there was one.
    fn remove(&mut self, owner: &str, kind: LockKind) -> bool {
        let list = match kind {
            LockKind::Read => &mut self.readers,
            LockKind::Permit { .. } => &mut self.permits,
            _ => {
                let mine = self.holder.as_ref().is_some_and(|h| h.owner == owner);
                if mine {
                    self.holder = None;
                }
                return mine;
            }
        };
        let before = list.len();
        list.retain(|h| h.owner != owner);
        list.len() < before
    }

    /// The earliest moment a hold that blocks a new one may end by itself.
    fn soonest_expiry<'a>(
        holds: impl IntoIterator<Item = &'a Holder>,
        now: Instant,
    ) -> Option<Duration> {
        holds
            .into_iter()
            .map(|h| h.expires_at.saturating_duration_since(now))
            .min()
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

/// A memory hold: what it is, so a release of a read hold leaves the same owner's write hold alone
/// (the two sides of one `RwLock` share an owner id).
#[derive(Debug, Clone, Copy)]
pub struct MemoryLease {
    kind: LockKind,
}

impl MemoryBackend {
    /// One try of `request` on its name's state.
    fn try_on(
        &self,
        state: &mut NameState,
        request: &AcquireRequest,
        now: Instant,
    ) -> Result<Attempt<MemoryLease>> {
        let (owner, kind) = (request.owner.as_str(), request.kind);
        let lease = MemoryLease { kind };
        let ttl = self.link.grant(request.lease);
        let expires_at = now.saturating_add(ttl);
        let granted = |token: u64| {
            Attempt::Acquired(
                Grant::new(lease)
                    .with_token(FencingToken::new(token))
                    .with_ttl(ttl),
            )
        };
        // Ours already (an earlier reply was lost): the same hold, refreshed.
        if let Some(hold) = state.hold_mut(owner, kind) {
            hold.expires_at = expires_at;
            let (token, slot) = (hold.token, hold.slot);
            let attempt = granted(token);
            return Ok(match (attempt, kind) {
                (Attempt::Acquired(grant), LockKind::Permit { .. }) => {
                    Attempt::Acquired(grant.with_permit(slot.to_string()))
                }
                (attempt, _) => attempt,
            });
        }
        if let LockKind::Permit { limit } = kind {
            if state.holder.is_some() || !state.readers.is_empty() {
                return Err(conflict(&request.name, "a mutex or read-write lock", kind));
            }
            if let Some(stored) = state.limit.filter(|stored| *stored != limit) {
                return Err(Error::new(
                    ErrorKind::LimitMismatch { stored, requested: limit },
                    format!("the semaphore has {stored} permits on the server; this one asked for {limit} (every user must ask for the same)"),
                ));
            }
            state.limit = Some(limit);
            let free = (0..limit).find(|slot| !state.permits.iter().any(|h| h.slot == *slot));
            let Some(slot) = free else {
                return Ok(Attempt::Busy {
                    retry_after: NameState::soonest_expiry(&state.permits, now),
                });
            };
            state.last_token += 1;
            let mut holder = Holder::new(owner, state.last_token, expires_at);
            holder.slot = slot;
            state.permits.push(holder);
            return Ok(match granted(state.last_token) {
                Attempt::Acquired(grant) => Attempt::Acquired(grant.with_permit(slot.to_string())),
                busy => busy,
            });
        }
        if !state.permits.is_empty() {
            let limit = state.limit.unwrap_or_default();
            return Err(conflict(
                &request.name,
                &format!("a semaphore of {limit} permits"),
                kind,
            ));
        }
        if let Some(holder) = &state.holder {
            return Ok(Attempt::Busy {
                retry_after: NameState::soonest_expiry([holder], now),
            });
        }
        if kind == LockKind::Read {
            if let Some((_, until)) = state
                .writer_waiting
                .as_ref()
                .filter(|(writer, _)| writer != owner)
            {
                return Ok(Attempt::Busy {
                    retry_after: Some(until.saturating_duration_since(now)),
                });
            }
            state
                .readers
                .push(Holder::new(owner, state.last_write_token, expires_at));
            return Ok(granted(state.last_write_token));
        }
        if !state.readers.is_empty() {
            if kind.is_exclusive() {
                // Writers first (the mutex is the write side itself): readers that come after this
                // keep out until it is in, or gives up.
                state.writer_waiting = Some((owner.to_string(), expires_at));
            }
            // Back before the mark runs out, so it is renewed while the readers stay.
            let soonest = NameState::soonest_expiry(&state.readers, now).map(|d| d.min(ttl / 3));
            return Ok(Attempt::Busy {
                retry_after: soonest,
            });
        }
        if state
            .writer_waiting
            .as_ref()
            .is_some_and(|(writer, _)| writer == owner)
        {
            state.writer_waiting = None;
        }
        state.last_token += 1;
        state.last_write_token = state.last_token;
        state.holder = Some(Holder::new(owner, state.last_token, expires_at));
        Ok(granted(state.last_token))
    }
}

/// The error for a name in use as another kind of lock.
fn conflict(name: &str, in_use: &str, asked: LockKind) -> Error {
    Error::new(
        ErrorKind::KindConflict,
        format!("{name:?} is in use as {in_use}; it cannot be taken as a {asked} until that is released"),
    )
}

#[async_trait]
impl Backend for MemoryBackend {
    type Lease = MemoryLease;
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
            .with_breaks_holders(true)
            .with_kinds(
                LockKinds::mutex_only()
                    .with_read_write(ReadWriteOrder::WritersFirst)
                    .with_atomic_downgrade()
                    .with_semaphore(),
            )
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
    ) -> Result<Attempt<MemoryLease>> {
        self.link.check_reachable()?;
        acquisition.releases.borrow_and_update();
        let now = clock::now();
        let mut names = lock(&self.store.names);
        let state = names.entry(request.name.clone()).or_default();
        state.expire(now);
        self.try_on(state, request, now)
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
            // Only an exclusive request's: a read request of the same owner (the read side of the
            // waiting writer's `RwLock`) leaves the writer's mark alone.
            let waiting = request.kind.is_exclusive()
                && state
                    .writer_waiting
                    .as_ref()
                    .is_some_and(|(writer, _)| *writer == request.owner);
            if waiting {
                state.writer_waiting = None;
            }
            if state.remove(&request.owner, request.kind) || waiting {
                drop(names);
                self.store.released();
            }
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, MemoryLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
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
                    let state = names.get_mut(entry.name);
                    let hold = state.and_then(|state| {
                        state.expire(now);
                        state.hold_mut(entry.owner, entry.lease.kind)
                    });
                    let outcome = match hold {
                        Some(h) => {
                            let ttl = self.link.grant(entry.ttl);
                            h.expires_at = now.saturating_add(ttl);
                            Renewed::Extended { ttl }
                        }
                        None => Renewed::Gone {
                            reason:
                                "the lease expired on the server (or another owner holds the lock)"
                                    .into(),
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

    async fn release(&self, lease: &MemoryLease, name: &str, owner: &str) -> Result<Released> {
        let delay = lock(&self.link.release_delays).pop_front();
        if let Some(delay) = delay.filter(|d| !d.is_zero()) {
            tokio::time::sleep(delay).await;
        }
        self.link.check_reachable()?;
        let now = clock::now();
        let released = {
            let mut names = lock(&self.store.names);
            match names.get_mut(name) {
                Some(state) => {
                    state.expire(now);
                    state.remove(owner, lease.kind)
                }
                None => false,
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
    /// pass over). The core hands on only between holds of one exclusive kind.
    async fn hand_off(
        &self,
        lease: &MemoryLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<MemoryLease>> {
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
        state.last_write_token = state.last_token;
        state.holder = Some(Holder::new(
            &next.owner,
            state.last_token,
            now.saturating_add(ttl),
        ));
        self.link.hand_offs.fetch_add(1, Ordering::SeqCst);
        Ok(HandOff::Handed(
            Grant::new(MemoryLease { kind: lease.kind })
                .with_token(FencingToken::new(state.last_token))
                .with_ttl(ttl),
        ))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.link.check_reachable()?;
        let now = clock::now();
        let mut names = lock(&self.store.names);
        let mut info = LockInfo::default();
        if let Some(state) = names.get_mut(name) {
            state.expire(now);
            info.last_token = (state.last_token > 0).then(|| FencingToken::new(state.last_token));
            if let Some(h) = &state.holder {
                info.kind = Some(LockKind::Mutex);
                info.holder = Some(h.info(now));
            } else if !state.readers.is_empty() {
                info.kind = Some(LockKind::Read);
                info.holders = state.readers.iter().map(|h| h.info(now)).collect();
            } else if let Some(limit) = state.limit.filter(|_| !state.permits.is_empty()) {
                info.kind = Some(LockKind::Permit { limit });
                info.holders = state
                    .permits
                    .iter()
                    .map(|h| HolderInfo {
                        permit: Some(h.slot.to_string()),
                        ..h.info(now)
                    })
                    .collect();
            }
        }
        Ok(info)
    }

    /// Removes the exclusive holder if it is `holder` (same owner and, when shown, same token).
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        self.link.check_reachable()?;
        let Some(owner) = holder.owner.as_deref() else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the holder to break has no owner id: pass the holder inspect showed",
            ));
        };
        let now = clock::now();
        let broken = {
            let mut names = lock(&self.store.names);
            names.get_mut(name).is_some_and(|state| {
                state.expire(now);
                let same_token = |h: &Holder| holder.token.is_none_or(|t| t.get() == h.token);
                state
                    .holder
                    .take_if(|h| h.owner == owner && same_token(h))
                    .is_some()
            })
        };
        if broken {
            self.store.released();
        }
        Ok(broken)
    }

    /// The writer becomes a reader with its token, in one step.
    async fn downgrade(
        &self,
        _lease: &MemoryLease,
        read: &AcquireRequest,
    ) -> Result<Grant<MemoryLease>> {
        self.link.check_reachable()?;
        let now = clock::now();
        let mut names = lock(&self.store.names);
        let state = names.entry(read.name.clone()).or_default();
        state.expire(now);
        let Some(writer) = state.holder.take_if(|h| h.owner == read.owner) else {
            return Err(Error::new(
                ErrorKind::NotHeld,
                "the write lock was no longer held",
            ));
        };
        let ttl = self.link.grant(read.lease);
        state.readers.push(Holder::new(
            &read.owner,
            writer.token,
            now.saturating_add(ttl),
        ));
        drop(names);
        // Other readers may come in now.
        self.store.released();
        Ok(Grant::new(MemoryLease {
            kind: LockKind::Read,
        })
        .with_token(FencingToken::new(writer.token))
        .with_ttl(ttl))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use std::time::Duration;

    use super::MemoryBackend;
    use crate::kinds::LockKind;
    use crate::raw::{AcquireRequest, Attempt, Backend};

    fn request(owner: &str, kind: LockKind) -> AcquireRequest {
        AcquireRequest::new("marked", owner, Duration::from_secs(30)).with_kind(kind)
    }

    async fn try_once(backend: &MemoryBackend, request: &AcquireRequest) -> bool {
        let mut acquisition = backend.begin(request).expect("begin");
        matches!(
            backend
                .try_acquire(&mut acquisition, request)
                .await
                .expect("try"),
            Attempt::Acquired(_)
        )
    }

    /// REVIEW (failed on e2f01b7): the undo of a read request cleared the writers-first mark of a
    /// write of the same owner (the two sides of one `RwLock` share it) still waiting, and let new
    /// readers in ahead of it.
    #[tokio::test]
    async fn a_read_requests_undo_leaves_the_same_owners_write_mark() {
        let backend = MemoryBackend::new();
        assert!(try_once(&backend, &request("r", LockKind::Read)).await);
        // x's write waits behind r: the mark.
        assert!(!try_once(&backend, &request("x", LockKind::Write)).await);
        // x's read acquire (of the same RwLock) is given up.
        let read = request("x", LockKind::Read);
        let acquisition = backend.begin(&read).expect("begin");
        backend.abandon(acquisition, &read).await;
        assert!(
            !try_once(&backend, &request("y", LockKind::Read)).await,
            "a new reader got in ahead of the waiting writer"
        );
        // x's own write giving up does end it.
        let write = request("x", LockKind::Write);
        let acquisition = backend.begin(&write).expect("begin");
        backend.abandon(acquisition, &write).await;
        assert!(try_once(&backend, &request("y", LockKind::Read)).await);
    }
}
