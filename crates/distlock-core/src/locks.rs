//! `Locks` (a connection to a lock service), `Lock` (one owner of one name) and the acquire algorithm.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::runtime::Handle;
use tracing::Instrument;

use crate::capabilities::Capabilities;
use crate::clock;
use crate::error::{Error, ErrorKind, Result};
use crate::gate::{Gate, GateGuard, HandedGrant, Pass};
use crate::guard::{Holding, LockGuard};
use crate::kinds::{LockKind, RwLock, Semaphore};
use crate::options::{LockOptions, Wait};
use crate::raw::{AcquireRequest, Attempt, Backend, DynBackend, ErasedAcquisition, LockInfo};
use crate::sync::lock;
use crate::telemetry::{AcquireOutcome, LockMetrics, Op, Telemetry, WaitingMark};
use crate::watchdog::Watchdog;

/// The longest caller-supplied owner id accepted, in bytes.
pub(crate) const MAX_OWNER_BYTES: usize = 256;

/// A handle on one lock service: cheap to clone, shares connections, hands out [`Lock`]s.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// use distlock_core::{Locks, MemoryBackend};
///
/// let locks = Locks::new(MemoryBackend::new());
/// let lock = locks.lock("orders/42")?;
/// let guard = lock.acquire().await?;
/// assert!(guard.token().is_some());
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Locks {
    inner: Arc<LocksInner>,
}

pub(crate) struct LocksInner {
    pub(crate) backend: Arc<dyn DynBackend>,
    /// The runtime of the latest acquire: where background work goes when it is started outside any
    /// runtime (a guard dropped on a plain thread).
    runtime: Mutex<Option<Handle>>,
    defaults: LockOptions,
    /// Same-name waiters of this `Locks` queue here (FIFO, see [`Gate`]), so only the head contends
    /// with the engine.
    gates: Mutex<Gates>,
    /// The releases that passed the local gate on before their reply (see
    /// [`Backend::release_orders_next_acquire`](crate::raw::Backend::release_orders_next_acquire)), by
    /// name and owner id, until that reply: each held by its release ([`ReleaseInFlight`]). This
    /// owner's next acquire waits for it, since a release that reaches the engine after it (resent on a
    /// fresh connection, or delayed) would delete this owner's next grant. By name and owner, so every
    /// `Lock` of this `Locks` with that name and owner id waits (`lock_as` may give two the same): to
    /// the engine they are one owner. Other owners' acquires need not wait (the release is
    /// owner-guarded). An entry lives only while its release is in flight, so a held lock has none
    /// (issue 9's memory per held lock), and an acquire looks here only while its gate counts one of
    /// its name ([`Gate::has_releases_in_flight`]). Lock order: this map, then a gate's state.
    releasing: Mutex<HashMap<NameAndOwner, Arc<ReleasingMutex>>>,
    pub(crate) watchdog: Arc<Watchdog>,
    background: Arc<Background>,
    pub(crate) telemetry: Telemetry,
}

/// The mutex of a release in flight of one (name, owner) (see [`LocksInner::releasing`]), and its key.
type ReleasingMutex = tokio::sync::Mutex<()>;
type NameAndOwner = (Arc<str>, Arc<str>);

/// The local gates by name, each alive while a [`Lock`] holds it. Each `Lock` keeps its own from its
/// creation, so an acquire takes it without a look-up; the map only lets `Lock`s of one name find the
/// same gate.
#[derive(Default)]
struct Gates {
    by_name: HashMap<Arc<str>, Weak<Gate>>,
    /// Gates no `Lock` holds any more are dropped from the map when it grows past this (which then
    /// doubles the live count, so pruning stays amortised O(1) however many `Lock`s live).
    prune_at: usize,
}

impl Gates {
    fn get(&mut self, name: Arc<str>) -> Arc<Gate> {
        if let Some(gate) = self.by_name.get(&name).and_then(Weak::upgrade) {
            return gate;
        }
        if self.by_name.len() >= self.prune_at {
            self.by_name.retain(|_, gate| gate.strong_count() > 0);
            self.prune_at = (self.by_name.len() * 2).max(64);
        }
        let gate = Arc::new(Gate::default());
        // Removed first: `insert` keeps an existing (dead) entry's key, a dropped `Lock`'s copy.
        self.by_name.remove(&name);
        self.by_name.insert(name, Arc::downgrade(&gate));
        gate
    }
}

/// Counts background tasks (releases of dropped guards, undo of cancelled acquires) so that
/// [`Locks::close`] can wait for them.
#[derive(Default)]
struct Background {
    running: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

/// Held by a background task while it runs; counts down even if the task is dropped unfinished.
struct BackgroundTask(Arc<Background>);

impl Drop for BackgroundTask {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

fn process_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| uuid::Uuid::new_v4().to_string())
}

fn next_owner_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("{}:{}", process_id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

impl Locks {
    /// Wraps a backend. Defaults: lease 30 s, wait forever.
    pub fn new<B: Backend>(backend: B) -> Self {
        Self::with_defaults(backend, LockOptions::default())
    }

    /// Wraps a backend with other default options for its locks (a URL's `?lease=`).
    pub fn with_defaults<B: Backend>(backend: B, defaults: LockOptions) -> Self {
        Self {
            inner: Arc::new(LocksInner {
                backend: Arc::new(backend),
                runtime: Mutex::new(None),
                defaults,
                gates: Mutex::default(),
                releasing: Mutex::default(),
                watchdog: Arc::new(Watchdog::default()),
                background: Arc::default(),
                telemetry: Telemetry::default(),
            }),
        }
    }

    /// Labels this `Locks`'s metrics with the lock name too (off by default: names can be unbounded,
    /// and every name then has series of its own). Applies to the `Lock`s made after it, through this
    /// `Locks` and every clone of it (they share one connection and one setting).
    ///
    /// distlock records through the [`metrics`](https://docs.rs/metrics) facade: nothing is recorded
    /// unless the application installs a recorder (an exporter), and that before it makes its `Locks`.
    /// The series and their labels are listed in the `distlock` crate's documentation.
    ///
    /// ```
    /// use distlock_core::{Locks, MemoryBackend};
    ///
    /// let locks = Locks::new(MemoryBackend::new()).with_name_labels(true);
    /// # let _ = locks;
    /// ```
    pub fn with_name_labels(self, on: bool) -> Self {
        self.inner.telemetry.set_name_labels(on);
        self
    }

    /// A new owner of `name`, with an owner id unique in this process (`<process uuid>:<n>`). No I/O.
    ///
    /// Fails with [`ErrorKind::InvalidName`] for an empty name, one over 1024 bytes, or one the backend
    /// cannot map.
    pub fn lock(&self, name: &str) -> Result<Lock> {
        self.lock_as(name, next_owner_id())
    }

    /// A new owner of `name` with a caller-supplied owner id (to resume ownership across restarts, or
    /// to interoperate with another client's id scheme).
    pub fn lock_as(&self, name: &str, owner: impl Into<String>) -> Result<Lock> {
        let owner = owner.into();
        self.check(name, Some(&owner), LockKind::Mutex)?;
        let name: Arc<str> = Arc::from(name);
        Ok(Lock {
            shared: Arc::new(self.shared(name, Arc::from(owner), LockKind::Mutex, OtherSide::None)),
        })
    }

    /// A new owner of `name`'s read-write lock (one owner id for both sides). No I/O.
    ///
    /// Fails with [`ErrorKind::Unsupported`] where the backend has no read-write lock
    /// ([`Capabilities::kinds`]), and as [`lock`](Self::lock) for a bad name.
    pub fn read_write(&self, name: &str) -> Result<RwLock> {
        self.read_write_as(name, next_owner_id())
    }

    /// [`read_write`](Self::read_write) with a caller-supplied owner id.
    pub fn read_write_as(&self, name: &str, owner: impl Into<String>) -> Result<RwLock> {
        let owner = owner.into();
        self.check(name, Some(&owner), LockKind::Read)?;
        let (name, owner): (Arc<str>, Arc<str>) = (Arc::from(name), Arc::from(owner));
        let writer = Arc::new_cyclic(|writer: &Weak<LockShared>| {
            let reader = Arc::new(self.shared(
                name.clone(),
                owner.clone(),
                LockKind::Read,
                OtherSide::Writer(writer.clone()),
            ));
            self.shared(name, owner, LockKind::Write, OtherSide::Reader(reader))
        });
        let OtherSide::Reader(reader) = &writer.other_side else {
            return Err(Error::new(
                ErrorKind::Protocol,
                "internal error: a read-write lock without its read side",
            ));
        };
        Ok(RwLock {
            reader: Lock {
                shared: reader.clone(),
            },
            writer: Lock { shared: writer },
        })
    }

    /// `name`'s semaphore of `limit` permits: at most `limit` holders at once. No I/O: the limit is
    /// checked against the one stored on the server at the first acquire.
    ///
    /// Fails with [`ErrorKind::Unsupported`] where the backend has no semaphore, with
    /// [`ErrorKind::InvalidConfig`] for a limit of 0 or over [`MAX_PERMITS`](crate::MAX_PERMITS), and
    /// as [`lock`](Self::lock) for a bad name.
    pub fn semaphore(&self, name: &str, limit: u32) -> Result<Semaphore> {
        crate::kinds::check_limit(limit)
            .map_err(|e| e.with_backend(self.inner.backend.kind()).with_lock(name))?;
        self.check(name, None, LockKind::Permit { limit })?;
        Ok(Semaphore {
            locks: self.clone(),
            name: Arc::from(name),
            limit,
        })
    }

    /// A new owner of one permit of `name`'s semaphore (checked by [`semaphore`](Self::semaphore)).
    pub(crate) fn permit_lock(&self, name: &Arc<str>, limit: u32) -> Lock {
        Lock {
            shared: Arc::new(self.shared(
                name.clone(),
                Arc::from(next_owner_id()),
                LockKind::Permit { limit },
                OtherSide::None,
            )),
        }
    }

    /// Checks a name, an owner id and that the backend supports `kind`.
    fn check(&self, name: &str, owner: Option<&str>, kind: LockKind) -> Result<()> {
        self.validate_name(name)?;
        let backend = self.inner.backend.kind();
        if owner.is_some_and(|owner| owner.is_empty() || owner.len() > MAX_OWNER_BYTES) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("an owner id must be 1 to {MAX_OWNER_BYTES} bytes"),
            )
            .with_backend(backend)
            .with_lock(name));
        }
        let kinds = self.inner.backend.capabilities().kinds;
        if !kinds.supports(kind) {
            let asked = match kind {
                LockKind::Mutex => "a mutex",
                LockKind::Read | LockKind::Write => "a read-write lock",
                LockKind::Permit { .. } => "a semaphore",
            };
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the {backend} backend has no {}; it supports: {}",
                    asked.trim_start_matches("a "),
                    kinds.describe()
                ),
            )
            .with_backend(backend)
            .with_lock(name));
        }
        Ok(())
    }

    /// The shared part of a new `Lock`. Exclusive kinds (mutex, write) queue in the name's gate, so
    /// only one of this `Locks` contends with the engine at a time; a reader or a permit holder has a
    /// gate of its own (it excludes nobody of its kind), which only orders its own acquire after its
    /// own release.
    fn shared(
        &self,
        name: Arc<str>,
        owner: Arc<str>,
        kind: LockKind,
        other_side: OtherSide,
    ) -> LockShared {
        let gate = if kind.is_exclusive() {
            lock(&self.inner.gates).get(name.clone())
        } else {
            Arc::new(Gate::default())
        };
        let metrics = self
            .inner
            .telemetry
            .for_lock(self.inner.backend.kind(), kind, &name);
        LockShared {
            locks: self.inner.clone(),
            metrics,
            name,
            owner,
            kind,
            other_side,
            acquiring: tokio::sync::Mutex::new(()),
            gate,
            held: Mutex::new(None),
        }
    }

    /// What the backend promises.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.backend.capabilities()
    }

    /// The backend's short name (`"file"`, `"memory"`, `"redis"`).
    pub fn backend_kind(&self) -> &'static str {
        self.inner.backend.kind()
    }

    /// The default options of this handle's locks.
    pub fn defaults(&self) -> LockOptions {
        self.inner.defaults
    }

    /// Waits until the background work of this handle has finished: releases handed off by dropped
    /// guards and the undo of cancelled acquires. Call it before the process exits, so that nothing is
    /// left on the server to expire by lease. Guards still alive are not released.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits; the work goes on.
    pub async fn close(&self) {
        let background = &self.inner.background;
        loop {
            let idle = background.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if background.running.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// What the server knows about `name`: holder, token, remaining lease, waiters where it can tell.
    pub async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.validate_name(name)?;
        let backend = self.inner.backend.kind();
        self.inner
            .backend
            .inspect(name)
            .await
            .map_err(|e| tag(e, backend, name))
    }

    /// The core's and the backend's name rules: every call that takes a name checks them first.
    fn validate_name(&self, name: &str) -> Result<()> {
        crate::name::validate(name)
            .and_then(|()| self.inner.backend.validate_name(name))
            .map_err(|e| e.with_backend(self.inner.backend.kind()))
    }

    /// Ends another holder's exclusive hold of `name` against its will: the operator's tool when a
    /// holder is known to be dead and its lease is long (`distlock break`). `holder` is what
    /// [`inspect`](Self::inspect) showed; the engine ends the hold only if that holder still holds the
    /// lock (checked on the server in the same step), so a holder that came since is never broken.
    ///
    /// `Ok(true)`: the hold is gone; `Ok(false)`: that holder no longer held it and nothing was
    /// touched. Backends without [`Capabilities::breaks_holders`] return [`ErrorKind::Unsupported`]
    /// (a `flock` cannot be taken from a live process). The broken holder's guard goes `Lost` when
    /// its engine tells it or at its next renewal; until then it may still believe it holds the lock,
    /// which is why fencing tokens exist.
    ///
    /// ```
    /// use distlock_core::{LockState, Locks, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> distlock_core::Result<()> {
    /// let backend = MemoryBackend::new();
    /// let (service, operator) = (Locks::new(backend.clone()), Locks::new(backend));
    /// let stuck = service.lock("nightly")?.acquire().await?;
    /// let holder = operator.inspect("nightly").await?.holder.expect("held");
    /// assert!(operator.break_holder("nightly", &holder).await?);
    /// assert!(operator.lock("nightly")?.try_acquire().await?.is_some());
    /// // Broken again with the same holder: that hold is gone, nothing is touched.
    /// assert!(!operator.break_holder("nightly", &holder).await?);
    /// # drop(stuck);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn break_holder(&self, name: &str, holder: &crate::raw::HolderInfo) -> Result<bool> {
        self.validate_name(name)?;
        let backend = self.inner.backend.kind();
        let broken = self
            .inner
            .backend
            .break_holder(name, holder)
            .await
            .map_err(|e| tag(e, backend, name))?;
        if broken {
            tracing::warn!(
                lock = name,
                engine = backend,
                owner = holder.owner.as_deref(),
                token = holder.token.map(|t| t.get()),
                pid = holder.pid,
                host = holder.host.as_deref(),
                "lock broken: another holder's hold was ended"
            );
        }
        Ok(broken)
    }
}

impl fmt::Debug for Locks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locks")
            .field("backend", &self.inner.backend.kind())
            .field("defaults", &self.inner.defaults)
            .finish_non_exhaustive()
    }
}

impl LocksInner {
    /// The mutex of a release of (name, owner) that passed the local gate `gate` (of `name`) on before
    /// its reply and has not had it (see [`LocksInner::releasing`]); `None` if there is none. Read by a
    /// holder of the name's gate, which no other hold of the name can release meanwhile, so the answer
    /// stays `Some` or turns `None`, never turns `Some`, until that holder passes the gate on.
    pub(crate) fn release_in_flight(
        &self,
        gate: &Gate,
        name: &Arc<str>,
        owner: &Arc<str>,
    ) -> Option<Arc<ReleasingMutex>> {
        if !gate.has_releases_in_flight() {
            return None;
        }
        lock(&self.releasing)
            .get(&(name.clone(), owner.clone()))
            .cloned()
    }

    /// Marks a release of the `Lock`'s name and owner as passed on early, until the mark is dropped
    /// (its reply came); `None` if one is marked already (a restarted release, or another `Lock` of
    /// the same owner id), and then the gate must stay until the reply.
    pub(crate) fn start_release_in_flight(shared: &Arc<LockShared>) -> Option<ReleaseInFlight> {
        let mut releasing = lock(&shared.locks.releasing);
        let key = (shared.name.clone(), shared.owner.clone());
        if releasing.contains_key(&key) {
            return None;
        }
        // A new mutex, so free.
        let held = Arc::new(ReleasingMutex::new(())).try_lock_owned().ok()?;
        releasing.insert(key, tokio::sync::OwnedMutexGuard::mutex(&held).clone());
        shared.gate.release_in_flight_started();
        Some(ReleaseInFlight {
            shared: shared.clone(),
            _held: held,
        })
    }

    /// The runtime of the latest acquire. It may have been dropped since: [`spawn`] copes with that.
    pub(crate) fn runtime(&self) -> Option<Handle> {
        lock(&self.runtime).clone()
    }

    /// Runs `work` as counted background work (see [`Locks::close`]) on the current runtime, or, outside
    /// any runtime, on the latest acquire's if it is a multi-thread one (so a guard dropped on a plain
    /// thread still releases). Otherwise, or if that runtime is gone, the work runs on distlock's
    /// background runtime (see [`spawn`]). `None` when no `JoinHandle` can be given.
    pub(crate) fn spawn_background<F>(&self, work: F) -> Option<tokio::task::JoinHandle<()>>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.background.running.fetch_add(1, Ordering::AcqRel);
        let task = BackgroundTask(self.background.clone());
        let work = async move {
            let _task = task;
            work.await;
        };
        // Outside any runtime, the latest acquire's serves only if it is a multi-thread one: a
        // current-thread runtime runs its tasks only inside its `block_on`, which may not come again.
        let runtime = Handle::try_current().ok().or_else(|| {
            self.runtime()
                .filter(|h| h.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread)
        });
        spawn(runtime.as_ref(), work)
    }

    /// As [`spawn_background`](Self::spawn_background), for work that is safe to run again from the start
    /// (an owner-guarded release): if its task is dropped after it started and before it finished (its
    /// runtime was dropped mid-way), a fresh `make()` runs on the background runtime, and
    /// [`Locks::close`] waits for that too.
    pub(crate) fn spawn_background_restartable<M, F>(&self, make: M)
    where
        M: Fn() -> F + Send + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.background.running.fetch_add(1, Ordering::AcqRel);
        let mut unfinished = Unfinished {
            make: Some(Box::new(move || -> BoxedWork { Box::pin(make()) })),
            task: Some(BackgroundTask(self.background.clone())),
        };
        let _ = self.spawn_background(async move {
            let Some(work) = unfinished.make.as_ref().map(|make| make()) else {
                return;
            };
            work.await;
            unfinished.finished();
        });
    }

    /// Records the current runtime as the latest acquire's; fails outside any runtime.
    fn bind_runtime(&self) -> Result<()> {
        let handle = Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::InvalidConfig,
                "distlock needs a tokio runtime: call it from inside one",
            )
        })?;
        let mut runtime = lock(&self.runtime);
        if runtime
            .as_ref()
            .is_none_or(|bound| bound.id() != handle.id())
        {
            *runtime = Some(handle);
        }
        Ok(())
    }
}

/// A release of one `Lock`'s name and owner in flight after it passed the gate on early (see
/// [`LocksInner::releasing`]): dropped when its reply came, it leaves the map and wakes the acquires
/// of that owner waiting for it.
pub(crate) struct ReleaseInFlight {
    shared: Arc<LockShared>,
    /// Dropped after the entry left the map (fields drop after `drop`), so an acquire that finds the
    /// entry waits on a mutex still held.
    _held: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for ReleaseInFlight {
    fn drop(&mut self) {
        let shared = &self.shared;
        {
            let mut releasing = lock(&shared.locks.releasing);
            releasing.remove(&(shared.name.clone(), shared.owner.clone()));
            // After a burst of releases, the table is not kept at its largest.
            if releasing.capacity() > 4 * releasing.len() + 64 {
                let len = releasing.len();
                releasing.shrink_to(2 * len);
            }
        }
        shared.gate.release_in_flight_ended();
    }
}

/// Adds the backend and lock name to an error if the backend did not.
pub(crate) fn tag(mut error: Error, backend: &'static str, name: &str) -> Error {
    if error.backend().is_empty() {
        error = error.with_backend(backend);
    }
    if error.lock_name().is_none() {
        error = error.with_lock(name);
    }
    error
}

/// Spawns `work` on `runtime`; if that runtime drops the task before its first poll (it is shut down,
/// or shuts down before it gets to the task: a guard dropped at the end of a `#[tokio::test]`) or there
/// is none, runs it on distlock's background runtime ([`run_on_background_runtime`]), so that a release or an undo
/// is never lost with a dropped runtime.
pub(crate) fn spawn<F>(runtime: Option<&Handle>, work: F) -> Option<tokio::task::JoinHandle<()>>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let work = Box::pin(work);
    let Some(runtime) = runtime else {
        run_on_background_runtime(work);
        return None;
    };
    Some(runtime.spawn(FirstPoll {
        work: Some(work),
        polled: false,
    }))
}

/// Restartable background work under way; dropped before it finished, runs it again on the background
/// runtime, still counted for [`Locks::close`].
struct Unfinished {
    make: Option<Box<dyn Fn() -> BoxedWork + Send>>,
    task: Option<BackgroundTask>,
}

impl Unfinished {
    fn finished(&mut self) {
        self.make = None;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(make) = self.make.take() {
            let task = self.task.take();
            tracing::debug!(
                "background work interrupted by its runtime's shutdown; running it again"
            );
            run_on_background_runtime(Box::pin(async move {
                let _task = task;
                make().await;
            }));
        }
    }
}

type BoxedWork = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>;

/// Runs `work` on the library's own background runtime: one worker thread, started on first need and
/// never shut down. Work lands here when the runtime it belonged to is gone. It must be a runtime that
/// lives on: what the work creates there (a backend's reconnected channel, a re-armed watch) keeps
/// serving the process after the work is done, which a short-lived runtime per task would cut off.
fn run_on_background_runtime(work: BoxedWork) {
    match background_runtime() {
        Some(runtime) => {
            runtime.spawn(work);
        }
        None => tracing::error!("no runtime for background work; it is dropped"),
    }
}

/// distlock's background runtime (see [`run_on_background_runtime`]), started on first use; `None` only
/// if it cannot be built.
pub(crate) fn background_runtime() -> Option<Handle> {
    static BACKGROUND: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    let runtime = BACKGROUND.get_or_init(|| {
        match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("distlock-background")
            .enable_all()
            .build()
        {
            Ok(runtime) => Some(runtime),
            Err(error) => {
                tracing::error!(%error, "cannot start distlock's background runtime");
                None
            }
        }
    });
    runtime.as_ref().map(|runtime| runtime.handle().clone())
}

/// A future that moves its work to the background runtime if it is dropped before its first poll (its
/// runtime was shut down, at once or with the task still queued).
struct FirstPoll {
    work: Option<BoxedWork>,
    polled: bool,
}

impl std::future::Future for FirstPoll {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.polled = true;
        match self.work.as_mut() {
            Some(work) => work.as_mut().poll(cx),
            None => std::task::Poll::Ready(()),
        }
    }
}

impl Drop for FirstPoll {
    fn drop(&mut self) {
        if !self.polled {
            if let Some(work) = self.work.take() {
                run_on_background_runtime(work);
            }
        }
    }
}

/// One owner of one lock name. Not `Clone`: tasks that must exclude each other each call
/// [`Locks::lock`]. Acquiring again while one of its guards lives is reentrant: it returns another guard
/// with the same token, and the lock is released when the last guard goes.
///
/// ```
/// use distlock_core::{Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let lock = locks.lock("orders/42")?;
/// let outer = lock.acquire().await?;
/// let inner = lock.acquire().await?; // reentrant: same owner, same token
/// assert_eq!(inner.token(), outer.token());
/// // Another owner of the same name is excluded.
/// assert!(locks.lock("orders/42")?.try_acquire().await?.is_none());
/// inner.release().await?;
/// assert!(lock.is_held()); // until the last guard goes
/// outer.release().await?;
/// # Ok(())
/// # }
/// ```
pub struct Lock {
    shared: Arc<LockShared>,
}

pub(crate) struct LockShared {
    pub(crate) locks: Arc<LocksInner>,
    /// The name and owner id, shared with the `gates` map's key and the `releasing` map's while a
    /// release is in flight.
    pub(crate) name: Arc<str>,
    pub(crate) owner: Arc<str>,
    /// What this `Lock` acquires.
    pub(crate) kind: LockKind,
    /// The other side of a read-write lock, to refuse an upgrade (and find the read side of a
    /// downgrade).
    pub(crate) other_side: OtherSide,
    /// Serialises acquires of this `Lock`, so a second task's acquire sees the first one's hold and
    /// joins it instead of racing it to the engine. The write side of a read-write lock uses its read
    /// side's (see [`serial`](Self::serial)).
    acquiring: tokio::sync::Mutex<()>,
    /// The local gate of this name in this `Locks` (see [`LocksInner::gates`]).
    pub(crate) gate: Arc<Gate>,
    /// The current hold and how many guards share it.
    pub(crate) held: Mutex<Option<(Arc<Holding>, usize)>>,
    /// The metric handles of its engine and kind (and name, if asked for).
    pub(crate) metrics: Arc<LockMetrics>,
}

/// The other side of a read-write lock's `Lock` (see [`LockShared::other_side`]): the write side
/// keeps the read side alive (a write guard may outlive its `RwLock` and still downgrade); the read
/// side only looks at the write side.
pub(crate) enum OtherSide {
    /// Not a read-write lock.
    None,
    /// Of the write side.
    Reader(Arc<LockShared>),
    /// Of the read side.
    Writer(Weak<LockShared>),
}

impl LockShared {
    /// The mutex that serialises this `Lock`'s acquires: its own, or for either side of a read-write
    /// lock the read side's, one for both. Each side's acquire then checks the other side and installs
    /// its grant with no acquire of the other side in between: a side never waits in the engine for
    /// the other's hold (a read granted while the same `RwLock`'s write waits, say), and the two sides
    /// never hold at once. A downgrade holds it too, while the hold changes sides.
    pub(crate) fn serial(&self) -> &tokio::sync::Mutex<()> {
        match &self.other_side {
            OtherSide::Reader(reader) => &reader.acquiring,
            OtherSide::None | OtherSide::Writer(_) => &self.acquiring,
        }
    }
}

impl OtherSide {
    /// Whether the other side holds the lock now.
    fn is_held(&self) -> bool {
        match self {
            OtherSide::None => false,
            OtherSide::Reader(reader) => lock(&reader.held).is_some(),
            OtherSide::Writer(writer) => writer
                .upgrade()
                .is_some_and(|writer| lock(&writer.held).is_some()),
        }
    }
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("name", &self.shared.name)
            .field("owner", &self.shared.owner)
            .field("kind", &self.shared.kind)
            .field("backend", &self.shared.locks.backend.kind())
            .finish()
    }
}

impl Lock {
    /// The lock name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// This owner's id.
    pub fn owner(&self) -> &str {
        &self.shared.owner
    }

    /// What this `Lock` acquires: a mutex, a side of a read-write lock, or a permit.
    pub fn kind(&self) -> LockKind {
        self.shared.kind
    }

    /// Acquires the lock with the defaults of its [`Locks`] (by default waiting as long as it takes).
    ///
    /// # Cancel safety
    /// Dropping the future leaves no lock and no queue entry behind: whatever was already sent is undone
    /// by a background task (compare-and-delete by owner, delete of the own queued key). The same holds
    /// for a request whose reply was lost.
    pub async fn acquire(&self) -> Result<LockGuard> {
        self.options().acquire().await
    }

    /// One attempt: `Ok(None)` when the lock is held elsewhere (including by another [`Lock`] of this
    /// process).
    ///
    /// # Cancel safety
    /// As for [`acquire`](Self::acquire).
    pub async fn try_acquire(&self) -> Result<Option<LockGuard>> {
        self.options().try_acquire().await
    }

    /// Options for one acquire: `lock.options().wait(d).lease(d).max_hold(d).acquire().await`.
    pub fn options(&self) -> AcquireOptions<'_> {
        AcquireOptions {
            lock: self,
            options: self.shared.locks.defaults,
        }
    }

    /// Whether a guard of this `Lock` is alive.
    pub fn is_held(&self) -> bool {
        lock(&self.shared.held).is_some()
    }

    /// An acquire, with its span, its metrics and its outcome's event.
    async fn run(&self, options: LockOptions) -> Result<Option<LockGuard>> {
        let shared = &self.shared;
        let backend_kind = shared.locks.backend.kind();
        let span = tracing::info_span!(
            "distlock.acquire",
            engine = backend_kind,
            lock = %shared.name,
            kind = shared.kind.as_str(),
            outcome = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            token = tracing::field::Empty,
        );
        let mut record = AcquireRecord {
            metrics: &shared.metrics,
            span: &span,
            started: clock::now(),
            finished: false,
        };
        let result = self
            .run_inner(options)
            .instrument(span.clone())
            .await
            .map_err(|e| tag(e, backend_kind, &shared.name));
        record.finished = true;
        let waited = clock::now().saturating_duration_since(record.started);
        let wait_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX);
        let outcome = match &result {
            Ok(Some(_)) => AcquireOutcome::Acquired,
            Ok(None) => AcquireOutcome::Busy,
            Err(_) => AcquireOutcome::Error,
        };
        shared.metrics.acquired(outcome, waited);
        span.record("outcome", outcome.as_str());
        span.record("wait_ms", wait_ms);
        match &result {
            Ok(Some(guard)) => {
                let token = guard.token().map(|t| t.get());
                if let Some(token) = token {
                    span.record("token", token);
                }
                tracing::info!(parent: &span, wait_ms, token, "lock acquired");
                guard.start_hold_span(Some(&span));
            }
            Ok(None) => {
                tracing::debug!(parent: &span, wait_ms, "lock not acquired: held elsewhere")
            }
            Err(error) => {
                shared.metrics.error(Op::Acquire, error.kind());
                tracing::info!(parent: &span, wait_ms, %error, "acquire failed");
            }
        }
        result
    }

    async fn run_inner(&self, options: LockOptions) -> Result<Option<LockGuard>> {
        options.validate()?;
        let shared = &self.shared;
        let locks = &shared.locks;
        locks.bind_runtime()?;
        if options.max_hold.is_some() && !locks.backend.capabilities().server_ttl {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "max_hold needs a lease on the server; this backend holds a lock until it is released or its process ends",
            ));
        }
        let deadline = match options.wait {
            Wait::Forever => None,
            // A limit too far to represent (`Duration::MAX`) is no limit.
            Wait::Limit(limit) => tokio::time::Instant::now().checked_add(limit),
        };

        // Free locks are taken without a timer (`try_lock` fails while others queue, so the queue
        // stays FIFO): an uncontended acquire arms none (issue 9).
        // Counted in `distlock_waiters` from its first wait until it returns.
        let mut waiting: Option<WaitingMark> = None;
        let _serial = match shared.serial().try_lock() {
            Ok(serial) => serial,
            Err(_) => {
                waiting = Some(shared.metrics.waiting());
                match within(deadline, shared.serial().lock()).await {
                    Some(serial) => serial,
                    None => return Ok(None),
                }
            }
        };
        if let Some(guard) = self.reenter()? {
            // As a first acquire would: the hold's watchdog may have gone with a dropped runtime.
            locks.watchdog.ensure_running(locks);
            return Ok(Some(guard));
        }
        if shared.other_side.is_held() {
            return Err(Error::new(
                ErrorKind::WouldDeadlock,
                match shared.kind {
                    LockKind::Write => "this read-write lock holds a read lock: a write would wait for it for ever (no upgrade); release the read guard first",
                    _ => "this read-write lock holds the write lock: a read would wait for it; downgrade the write guard instead (LockGuard::downgrade)",
                },
            ));
        }
        let gate = match shared
            .gate
            .take_or_queue(&shared.owner, options.first_ttl(), shared.kind)
        {
            Ok(gate) => gate,
            Err(wait) => {
                waiting.get_or_insert_with(|| shared.metrics.waiting());
                match within(deadline, wait).await {
                    Some(Ok(Pass::Plain(gate))) => gate,
                    // The releaser handed the lock on with the gate: installed like a grant of ours.
                    Some(Ok(Pass::Granted(handed))) => return self.install_handed(handed, options),
                    Some(Err(e)) => return Err(e),
                    None => return Ok(None),
                }
            }
        };
        // This owner's own release may still be on its way (see `LocksInner::releasing`).
        if let Some(releasing) = locks.release_in_flight(&shared.gate, &shared.name, &shared.owner)
        {
            if within(deadline, releasing.lock()).await.is_none() {
                return Ok(None);
            }
        }

        let request = AcquireRequest {
            name: shared.name.to_string(),
            owner: shared.owner.to_string(),
            lease: options.first_ttl(),
            kind: shared.kind,
        };
        let acquisition = locks.backend.begin(&request)?;
        let mut pending = Pending {
            acquisition: Some(acquisition),
            gate: Some(gate),
            request,
            locks: locks.clone(),
        };
        loop {
            // Read before the request is sent: the validity deadline counts from here.
            let sent_at = clock::now();
            // A try is never cut short by the wait limit (a grant that arrives is not thrown away, and a
            // zero wait still makes one whole attempt); backends bound their own requests.
            let (acquisition, request) = pending.parts()?;
            let attempt = match locks.backend.try_acquire(acquisition, request).await {
                Ok(attempt) => attempt,
                Err(e) => {
                    pending.abandon().await;
                    return Err(e);
                }
            };
            let retry_after = match attempt {
                Attempt::Acquired(grant) => {
                    if let Some(ttl) = grant.ttl {
                        if clock::now() >= crate::guard::validity_deadline(sent_at, ttl) {
                            pending.abandon().await;
                            return Err(Error::new(
                                ErrorKind::Unavailable,
                                format!(
                                    "the grant arrived after its validity deadline (the round trip took longer than the {} lease); use a longer lease",
                                    crate::duration::format(ttl)
                                ),
                            ));
                        }
                    }
                    let gate = pending.disarm();
                    return Ok(Some(self.install(grant, sent_at, options, gate)));
                }
                Attempt::Busy { retry_after } => retry_after,
            };
            if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                pending.abandon().await;
                return Ok(None);
            }
            waiting.get_or_insert_with(|| shared.metrics.waiting());
            tracing::debug!(
                retry_after_ms = retry_after.map(|d| d.as_millis()),
                "lock busy; waiting for its release"
            );
            let (acquisition, request) = pending.parts()?;
            let waited = within(
                deadline,
                locks.backend.wait(acquisition, request, retry_after),
            )
            .await;
            match waited {
                None => {
                    pending.abandon().await;
                    return Ok(None);
                }
                Some(Err(e)) => {
                    pending.abandon().await;
                    return Err(e);
                }
                Some(Ok(())) => {}
            }
        }
    }

    /// Joins the current hold if there is one: the same token, one more guard.
    fn reenter(&self) -> Result<Option<LockGuard>> {
        let mut held = lock(&self.shared.held);
        let Some((holding, count)) = held.as_mut() else {
            return Ok(None);
        };
        if let Some(reason) = holding.loss_reason() {
            return Err(Error::new(
                ErrorKind::LockLost,
                format!("cannot re-enter a lock that was lost: {reason}"),
            ));
        }
        *count += 1;
        Ok(Some(LockGuard::new(holding.clone())))
    }

    /// Installs a grant the releaser got for us with the local gate (see
    /// [`Backend::hand_off`](crate::raw::Backend::hand_off)); one that arrived after its validity
    /// deadline is released, as a late grant of ours would be abandoned.
    fn install_handed(
        &self,
        mut handed: HandedGrant,
        options: LockOptions,
    ) -> Result<Option<LockGuard>> {
        let sent_at = handed.sent_at;
        if let Some(ttl) = handed.grant.as_ref().and_then(|g| g.ttl) {
            if clock::now() >= crate::guard::validity_deadline(sent_at, ttl) {
                // Dropped with its grant: released in the background, then the gate moves on.
                drop(handed);
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the lock handed on by the previous holder arrived after its validity deadline (the round trip took longer than the {} lease); use a longer lease",
                        crate::duration::format(ttl)
                    ),
                ));
            }
        }
        let (Some(grant), gate) = (handed.grant.take(), handed.gate.take()) else {
            return Err(Error::new(
                ErrorKind::Protocol,
                "internal error: a handed-on lock without its grant",
            ));
        };
        Ok(Some(self.install(grant, sent_at, options, gate)))
    }

    fn install(
        &self,
        grant: crate::raw::Grant<crate::raw::ErasedLease>,
        sent_at: clock::Instant,
        options: LockOptions,
        gate: Option<GateGuard>,
    ) -> LockGuard {
        install(&self.shared, grant, sent_at, options, gate)
    }
}

/// Makes a grant `shared`'s hold: its guard, its watchdog entry and its loss signal.
pub(crate) fn install(
    shared: &Arc<LockShared>,
    grant: crate::raw::Grant<crate::raw::ErasedLease>,
    sent_at: clock::Instant,
    options: LockOptions,
    gate: Option<GateGuard>,
) -> LockGuard {
    let holding = Holding::new(
        shared.clone(),
        grant.lease,
        grant.token,
        grant.ttl,
        sent_at,
        options,
        gate,
        grant.permit.map(String::into_boxed_str),
    );
    *lock(&shared.held) = Some((holding.clone(), 1));
    if grant.ttl.is_some() || options.max_hold.is_some() {
        shared.locks.watchdog.register(&holding, &shared.locks);
    }
    if let Some(loss) = grant.loss {
        loss.attach(&holding);
    }
    if let Some(descriptor) = grant.descriptor {
        let _ = holding.descriptor.set(descriptor);
    }
    LockGuard::new(holding)
}

/// An acquire being counted: one that ends without [`finished`](Self::finished) set was cancelled.
struct AcquireRecord<'a> {
    metrics: &'a LockMetrics,
    span: &'a tracing::Span,
    started: clock::Instant,
    finished: bool,
}

impl Drop for AcquireRecord<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let waited = clock::now().saturating_duration_since(self.started);
            self.metrics.acquired(AcquireOutcome::Cancelled, waited);
            self.span
                .record("outcome", AcquireOutcome::Cancelled.as_str());
        }
    }
}

/// Runs `fut` until `deadline`; `None` if it elapsed first. The future is polled once even when the
/// deadline has already passed, so a zero wait still takes what is free.
async fn within<F: std::future::Future>(
    deadline: Option<tokio::time::Instant>,
    fut: F,
) -> Option<F::Output> {
    match deadline {
        None => Some(fut.await),
        Some(deadline) => tokio::time::timeout_at(deadline, fut).await.ok(),
    }
}

/// An acquisition the core has not finished: if it is dropped (the acquire future was cancelled) or
/// abandoned, whatever it may have left on the server is undone in the background, and the local gate
/// is passed on only after that, so the next waiter of this process never races the undo.
struct Pending {
    acquisition: Option<ErasedAcquisition>,
    gate: Option<GateGuard>,
    request: AcquireRequest,
    locks: Arc<LocksInner>,
}

impl Pending {
    /// The acquisition and its request, for the next call to the backend.
    fn parts(&mut self) -> Result<(&mut ErasedAcquisition, &AcquireRequest)> {
        match self.acquisition.as_mut() {
            Some(acquisition) => Ok((acquisition, &self.request)),
            None => Err(Error::new(
                ErrorKind::Protocol,
                "internal error: acquisition already finished",
            )),
        }
    }

    /// The acquire succeeded: nothing to undo. Returns the gate for the hold to keep.
    fn disarm(&mut self) -> Option<GateGuard> {
        self.acquisition = None;
        self.gate.take()
    }

    /// Undoes the acquisition and waits for that to finish; the undo goes on if this future is dropped.
    async fn abandon(&mut self) {
        if let Some(task) = self.spawn_abandon() {
            let _ = task.await;
        }
    }

    fn spawn_abandon(&mut self) -> Option<tokio::task::JoinHandle<()>> {
        let acquisition = self.acquisition.take()?;
        let gate = self.gate.take();
        let backend = self.locks.backend.clone();
        let request = self.request.clone();
        self.locks.spawn_background(async move {
            backend.abandon(acquisition, &request).await;
            drop(gate);
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.spawn_abandon().is_some() {
            tracing::debug!(lock = %self.request.name, "acquire cancelled; undoing it in the background");
        }
    }
}

/// Options for one acquire, from [`Lock::options`].
///
/// ```
/// use std::time::Duration;
/// use distlock_core::{Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let lock = locks.lock("migrations")?;
/// let guard = lock
///     .options()
///     .wait(Duration::from_secs(5))       // then ErrorKind::Timeout
///     .lease(Duration::from_secs(10))     // the server's TTL, renewed every third of it
///     .max_hold(Duration::from_secs(600)) // Lost after ten minutes, whatever happens
///     .acquire()
///     .await?;
/// # guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[must_use = "options do nothing until .acquire() or .try_acquire() is awaited"]
pub struct AcquireOptions<'a> {
    lock: &'a Lock,
    options: LockOptions,
}

impl fmt::Debug for AcquireOptions<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcquireOptions")
            .field("lock", &self.lock.name())
            .field("options", &self.options)
            .finish()
    }
}

impl AcquireOptions<'_> {
    /// Waits at most `limit` for a lock held elsewhere, then fails with [`ErrorKind::Timeout`].
    pub fn wait(mut self, limit: Duration) -> Self {
        self.options.wait = Wait::Limit(limit);
        self
    }

    /// Waits as long as it takes.
    pub fn wait_forever(mut self) -> Self {
        self.options.wait = Wait::Forever;
        self
    }

    /// Makes one attempt: the same as `wait(Duration::ZERO)`.
    pub fn no_wait(self) -> Self {
        self.wait(Duration::ZERO)
    }

    /// The lease on the server (default 30 s); the watchdog renews it every third while a guard lives.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// Caps the whole hold: renewals ask for at most what is left, and the guard becomes Lost when the cap
    /// is reached. Redisson's `lock(leaseTime)` is `lease(t).max_hold(t)`.
    pub fn max_hold(mut self, cap: Duration) -> Self {
        self.options.max_hold = Some(cap);
        self
    }

    /// The options as set so far.
    pub fn as_options(&self) -> LockOptions {
        self.options
    }

    /// Acquires with these options; [`ErrorKind::Timeout`] if a wait limit elapses.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`].
    pub async fn acquire(self) -> Result<LockGuard> {
        match self.lock.run(self.options).await? {
            Some(guard) => Ok(guard),
            // Only a wait limit ends a wait without the lock.
            None => Err(tag(
                Error::timeout(self.lock.name(), self.options.wait),
                self.lock.shared.locks.backend.kind(),
                self.lock.name(),
            )),
        }
    }

    /// One attempt with these options (the wait limit is ignored): `Ok(None)` when held elsewhere.
    ///
    /// # Cancel safety
    /// As for [`Lock::acquire`].
    pub async fn try_acquire(self) -> Result<Option<LockGuard>> {
        self.lock
            .run(self.options.with_wait(Wait::Limit(Duration::ZERO)))
            .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::Locks;
    use crate::MemoryBackend;

    /// A loop of acquire and release starts the watchdog task once, not once per grant (each start is
    /// a spawn, which wakes another worker thread): the task stays a while after its last hold ends.
    #[test]
    fn a_loop_of_cycles_starts_the_watchdog_once() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        // On a worker (not in `block_on`), so the watchdog task runs between the cycles.
        let cycles = runtime.spawn(async {
            let locks = Locks::new(MemoryBackend::new());
            let lock = locks.lock("cycles").expect("lock");
            for _ in 0..20 {
                let guard = lock.acquire().await.expect("acquire");
                guard.release().await.expect("release");
                // The task gets to look between cycles, and finds no hold.
                tokio::task::yield_now().await;
            }
            locks.inner.watchdog.starts()
        });
        assert_eq!(runtime.block_on(cycles).expect("cycles"), 1);
    }

    /// A hold makes its state channel (≈ 0.35 KiB) only for its first observer, and that observer
    /// still sees every change from then on (issue 9: memory per held lock).
    #[tokio::test]
    async fn a_holds_state_channel_is_made_by_its_first_observer() {
        let locks = Locks::new(MemoryBackend::new());
        let lock = locks.lock("observed").expect("lock");
        let guard = lock.acquire().await.expect("acquire");
        let holding = || {
            crate::sync::lock(&lock.shared.held)
                .as_ref()
                .map(|(holding, _)| holding.clone())
                .expect("held")
        };
        assert!(!holding().has_state_channel());
        assert_eq!(guard.state(), crate::LockState::Held);
        assert!(!holding().has_state_channel());
        let mut changes = guard.state_changes();
        assert!(holding().has_state_channel());
        assert_eq!(*changes.borrow_and_update(), crate::LockState::Held);
        holding().mark_lost("test".into());
        changes.changed().await.expect("a change");
        assert_eq!(*changes.borrow(), crate::LockState::Lost);
        let _ = guard.release().await;
    }

    /// The `gates` map is keyed by the `Lock`'s own name, not a copy of it, and a `Lock` has no
    /// `releasing` entry until a release of its passes the gate on early (issue 9: memory per held
    /// lock); that entry is keyed by the `Lock`'s own name and owner id.
    #[test]
    fn the_shared_maps_keys_are_the_locks_own_name_and_owner() {
        let locks = Locks::new(MemoryBackend::new());
        let lock = locks.lock("keyed").expect("lock");
        {
            let gates = crate::sync::lock(&locks.inner.gates);
            let (name, _) = gates
                .by_name
                .get_key_value("keyed")
                .expect("a gate for the name");
            assert!(std::sync::Arc::ptr_eq(name, &lock.shared.name));
        }
        assert!(crate::sync::lock(&locks.inner.releasing).is_empty());
        let in_flight = super::LocksInner::start_release_in_flight(&lock.shared).expect("marked");
        {
            let releasing = crate::sync::lock(&locks.inner.releasing);
            let ((name, owner), _) = releasing.iter().next().expect("a releasing entry");
            assert!(std::sync::Arc::ptr_eq(name, &lock.shared.name));
            assert!(std::sync::Arc::ptr_eq(owner, &lock.shared.owner));
        }
        drop(in_flight);
        assert!(crate::sync::lock(&locks.inner.releasing).is_empty());
        assert!(!lock.shared.gate.has_releases_in_flight());
    }

    /// A handoff is not made to an owner whose own release passed the gate on early and has not
    /// answered (the handed grant would skip that owner's wait for it): `release_in_flight` is `Some`
    /// exactly while that owner's release is marked, whichever `Lock` of the owner id marked it; a
    /// second mark of the same name and owner is refused meanwhile, and the mutex it gives is held
    /// until the mark is dropped.
    #[tokio::test]
    async fn an_owners_release_in_flight_is_seen_by_name_and_owner() {
        let locks = Locks::new(MemoryBackend::new());
        let lock = locks.lock_as("in-flight", "owner-1").expect("lock");
        let same = locks.lock_as("in-flight", "owner-1").expect("lock");
        let other = locks.lock_as("in-flight", "owner-2").expect("lock");
        let gate = &lock.shared.gate;
        let (name, owner) = (lock.shared.name.clone(), lock.shared.owner.clone());
        let in_flight = |owner| locks.inner.release_in_flight(gate, &name, owner);
        assert!(in_flight(&owner).is_none());
        let marked = super::LocksInner::start_release_in_flight(&lock.shared).expect("marked");
        assert!(super::LocksInner::start_release_in_flight(&same.shared).is_none());
        let mutex = in_flight(&same.shared.owner).expect("in flight, for the same owner id");
        assert!(mutex.try_lock().is_err(), "held while in flight");
        assert!(in_flight(&other.shared.owner).is_none());
        let other_marked =
            super::LocksInner::start_release_in_flight(&other.shared).expect("another owner");
        drop(marked);
        assert!(in_flight(&owner).is_none());
        assert!(mutex.try_lock().is_ok(), "free once the reply came");
        assert!(gate.has_releases_in_flight(), "the other owner's still is");
        drop(other_marked);
        assert!(!gate.has_releases_in_flight());
        let unknown: std::sync::Arc<str> = "owner-3".into();
        assert!(in_flight(&unknown).is_none());
    }

    // --- adversarial review (issue 9 memory work) ---------------------------------------------------

    /// REVIEW (fails on hmem 7139fae): a `Lock` made after an earlier `Lock` of the same name was
    /// dropped finds the dead entry in `gates` and inserts over it; `HashMap::insert` keeps the existing
    /// key, so the map stayed keyed by the dropped `Lock`'s name `Arc` (kept alive by the map until the
    /// next prune), not by the new `Lock`'s own one as
    /// `the_shared_maps_keys_are_the_locks_own_name_and_owner` and DESIGN claim.
    #[test]
    fn a_recreated_locks_map_keys_are_its_own_not_a_dropped_locks() {
        let locks = Locks::new(MemoryBackend::new());
        drop(locks.lock_as("rekeyed", "owner-1").expect("lock"));
        let lock = locks.lock_as("rekeyed", "owner-1").expect("lock");
        let gates = crate::sync::lock(&locks.inner.gates);
        let (name, _) = gates
            .by_name
            .get_key_value("rekeyed")
            .expect("a gate for the name");
        assert!(
            std::sync::Arc::ptr_eq(name, &lock.shared.name),
            "the gates map is keyed by the dropped Lock's name"
        );
    }

    /// REVIEW probe (passes): a Jeopardy and then a Lost published before any observer made the state
    /// channel are what the first observer starts from; `jeopardy()` and `lost()` resolve at once.
    #[tokio::test]
    async fn changes_before_the_first_observer_are_not_missed() {
        let locks = Locks::new(MemoryBackend::new());
        let lock = locks.lock("early").expect("lock");
        let guard = lock.acquire().await.expect("acquire");
        let holding = crate::sync::lock(&lock.shared.held)
            .as_ref()
            .map(|(holding, _)| holding.clone())
            .expect("held");
        holding.apply_renewal(
            crate::clock::now(),
            std::time::Duration::from_secs(30),
            Err(crate::Error::new(crate::ErrorKind::Unavailable, "review")),
        );
        assert!(!holding.has_state_channel());
        assert_eq!(*guard.state_changes().borrow(), crate::LockState::Jeopardy);
        tokio::time::timeout(std::time::Duration::from_millis(100), guard.jeopardy())
            .await
            .expect("jeopardy() resolves");
        holding.mark_lost("review".into());
        tokio::time::timeout(std::time::Duration::from_millis(100), guard.lost())
            .await
            .expect("lost() resolves");
        assert_eq!(*guard.state_changes().borrow(), crate::LockState::Lost);
        drop(holding);
        let _ = guard.release().await;
    }

    /// REVIEW probe (passes): many first observers racing one another and a loss all see the loss.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_first_observers_all_see_the_loss() {
        for round in 0..200 {
            let locks = Locks::new(MemoryBackend::new());
            let lock = locks.lock(&format!("race{round}")).expect("lock");
            let guard = std::sync::Arc::new(lock.acquire().await.expect("acquire"));
            let holding = crate::sync::lock(&lock.shared.held)
                .as_ref()
                .map(|(holding, _)| holding.clone())
                .expect("held");
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(9));
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let (guard, barrier) = (guard.clone(), barrier.clone());
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let mut changes = guard.state_changes();
                    let seen = changes
                        .wait_for(|s| *s == crate::LockState::Lost)
                        .await
                        .is_ok();
                    let lost =
                        tokio::time::timeout(std::time::Duration::from_secs(1), guard.lost())
                            .await
                            .is_ok();
                    seen && lost
                }));
            }
            barrier.wait().await;
            holding.mark_lost("review".into());
            for task in tasks {
                let ok = tokio::time::timeout(std::time::Duration::from_secs(2), task)
                    .await
                    .expect("an observer missed the loss")
                    .expect("task");
                assert!(ok, "round {round}: an observer missed the loss");
            }
        }
    }
}
