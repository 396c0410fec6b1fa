//! `--workload hold` (issue 9, deliverable 4): one `Locks` acquires `--locks` distinct names (10,000 by
//! default) with a short `--lease`, holds them for `--duration` while the watchdog renews them, then
//! releases them. It reports what the watchdog's batching costs: renewal round trips per tick, client
//! and server CPU per tick, resident memory per held lock, and whether every lock stayed held.
//!
//! How renewals are counted: the `Locks` of this workload runs on the engine's backend wrapped in
//! [`Counted`], which counts the batches the watchdog hands to `Backend::renew` and the renewals in
//! them. A tick is one renewal of every held lock, so ticks = renewals / locks. On a standalone Redis
//! server the backend sends each batch on its one connection in pipelines of at most
//! `RENEWALS_PER_PIPELINE` renewals, all queued before any reply is awaited: one round trip per batch,
//! and the pipelines are counted beside it. The server's own count (`INFO commandstats`, the `EVALSHA` + `EVAL` calls over the hold,
//! when only renewals run) is reported beside it: it counts commands, so it is the renewals, not the
//! round trips, and confirms them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock::raw::{
    AcquireRequest, Attempt, Backend, HandOff, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock::{Capabilities, LockGuard, LockState, LockUrl, Locks};
use serde::Serialize;
use tokio::task::JoinSet;

use crate::cpu::{CpuFigures, CpuMeter, CpuSpent};
use crate::engines::{redis_failure, Engine};
use crate::error::Error;
use crate::heap::{allocator_reading, AllocatorReading, HeapReading, HeapWindow};
use crate::measure::{Baseline, Run};
use crate::stats::round2;
use crate::Runner;

/// How many acquires (and releases) are in flight at once: enough to fill the connection's pipeline,
/// few enough not to queue thousands of requests behind one another.
pub const CONCURRENCY: usize = 256;
/// How long one acquire of the workload may wait (every name is the run's own: it never should).
const ACQUIRE_WAIT: Duration = Duration::from_secs(30);

/// The report's `hold` section.
#[derive(Debug, Serialize)]
pub struct HoldSection {
    pub locks: usize,
    pub lease_ms: f64,
    /// How long acquiring every lock took, with `CONCURRENCY` acquires in flight.
    pub acquire_s: f64,
    pub acquire_concurrency: usize,
    /// The measured hold, from the last grant to the state check.
    pub held_s: f64,
    pub release_s: f64,
    pub renewals: HoldRenewals,
    pub cpu: HoldCpu,
    pub memory: HoldMemory,
    /// Locks whose guard was not `Held` at the end of the hold (any lost lock is reported).
    pub not_held: usize,
    /// Of those, `Lost` (the rest were in `Jeopardy`).
    pub lost: usize,
    /// The first loss reason seen, if any.
    pub loss_reason: Option<String>,
}

/// The watchdog's renewals over the hold.
#[derive(Debug, Serialize)]
pub struct HoldRenewals {
    /// Batches handed to `Backend::renew`; `None` where the backend was not wrapped.
    pub batches: Option<u64>,
    /// Renewals in those batches.
    pub renewals: Option<u64>,
    /// Renewals / locks: how many times every lock was renewed.
    pub ticks: Option<f64>,
    /// The lease / 3 cadence: how many ticks the hold should see.
    pub expected_ticks: f64,
    /// Round trips to the engine for those batches, where the backend's grouping is known: requests
    /// sent one after another's reply. Pipelines sent back to back, none waiting for a reply of
    /// another, are one round trip.
    pub round_trips: Option<u64>,
    pub round_trips_per_tick: Option<f64>,
    /// Pipelines those round trips were sent as (Redis: a batch of more than
    /// `RENEWALS_PER_PIPELINE` renewals goes as several, back to back on the one connection).
    pub pipelines: Option<u64>,
    pub pipelines_per_tick: Option<f64>,
    /// Connections, slots or sessions the renewals go to (1 round trip per group per tick is the
    /// target).
    pub groups: Option<u64>,
    /// The server's count of the renew script's runs (Redis `INFO commandstats`).
    pub server_commands: Option<u64>,
    pub server_commands_per_tick: Option<f64>,
    /// How the figures were counted, or why one is missing.
    pub counted: String,
}

/// CPU time over the hold (the bench's meter, `crate::cpu`), per renewal tick: the watchdog's
/// work and the server's for the renewals, and nothing else the run does (no acquire or release
/// falls in the interval).
#[derive(Debug, Serialize)]
pub struct HoldCpu {
    /// The bench process, ms per tick; `None` without a counted tick.
    pub client_ms_per_tick: Option<f64>,
    /// The server, ms per tick; `None` without a source or a counted tick.
    pub server_ms_per_tick: Option<f64>,
    /// The same per renewal (`*_us_per_cycle` = µs per renewal), with the totals and sources.
    pub per_renewal: CpuFigures,
}

/// Resident memory (`VmRSS` of `/proc/self/status`) and live heap (the counting allocator of
/// [`crate::heap`], where the binary installs it).
#[derive(Debug, Serialize)]
pub struct HoldMemory {
    pub rss_before_kib: Option<u64>,
    pub rss_holding_kib: Option<u64>,
    /// (holding − before) / locks: every lock's share, handles, guards and the watchdog's records
    /// included, and whatever the allocator kept from acquiring them (an upper bound).
    pub per_lock_bytes: Option<f64>,
    /// Live heap growth over the same window / locks, in requested bytes (the allocator's per-block
    /// overhead not included); `None` without the counting allocator.
    pub heap_per_lock_bytes: Option<f64>,
    /// Live blocks (allocations) over the same window / locks.
    pub heap_blocks_per_lock: Option<f64>,
    /// The highest live heap growth during the hold / locks: the held locks plus the renewal batches
    /// in flight (their requests and replies).
    pub heap_peak_per_lock_bytes: Option<f64>,
    /// How the heap figures were counted, or why they are missing.
    pub heap_counted: String,
    /// Growth over the same window / locks of what the allocator has in allocated chunks (live heap
    /// plus its per-block headers and rounding), glibc's `mallinfo2`; `None` on another allocator.
    pub allocator_in_use_per_lock_bytes: Option<f64>,
    /// Growth of the free memory the allocator keeps in its arenas / locks (freed, not returned).
    pub allocator_free_per_lock_bytes: Option<f64>,
    /// Growth of what the allocator took from the system / locks (in use + kept free): of the RSS
    /// growth, the rest is memory outside malloc (thread stacks, the binary's pages).
    pub allocator_system_per_lock_bytes: Option<f64>,
    /// Tokio tasks alive on the bench's runtime before the acquires and at the end of the hold
    /// (`RuntimeMetrics::num_alive_tasks`): the core's, the backend's and the bench's own.
    pub tasks_before: usize,
    pub tasks_holding: usize,
    /// (holding − before) / locks: tasks a held lock costs (a task per hold shows as ≥ 1).
    pub tasks_per_lock: Option<f64>,
}

/// Batches, renewals and pipelines, as [`Counts::read`] gives them.
type CountsRead = (u64, u64, u64);

/// Counts of a [`Counted`] backend.
#[derive(Debug, Default)]
pub struct Counts {
    batches: AtomicU64,
    renewals: AtomicU64,
    pipelines: AtomicU64,
}

impl Counts {
    fn read(&self) -> CountsRead {
        (
            self.batches.load(Ordering::Relaxed),
            self.renewals.load(Ordering::Relaxed),
            self.pipelines.load(Ordering::Relaxed),
        )
    }
}

/// A backend that counts the renewal batches the watchdog hands it, and otherwise is the backend.
pub struct Counted<B> {
    inner: B,
    counts: Arc<Counts>,
    /// The most renewals the backend sends in one pipeline, where it sends pipelines.
    renewals_per_pipeline: Option<usize>,
}

impl<B> Counted<B> {
    pub fn new(inner: B) -> (Self, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        (
            Self {
                inner,
                counts: counts.clone(),
                renewals_per_pipeline: None,
            },
            counts,
        )
    }

    /// Also counts the pipelines of a backend that sends a batch in pipelines of at most `per`.
    pub fn with_pipelines(inner: B, per: usize) -> (Self, Arc<Counts>) {
        let (mut counted, counts) = Self::new(inner);
        counted.renewals_per_pipeline = Some(per.max(1));
        (counted, counts)
    }
}

#[async_trait]
impl<B: Backend> Backend for Counted<B> {
    type Lease = B::Lease;
    type Acquisition = B::Acquisition;

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn validate_name(&self, name: &str) -> distlock::Result<()> {
        self.inner.validate_name(name)
    }

    fn begin(&self, request: &AcquireRequest) -> distlock::Result<Self::Acquisition> {
        self.inner.begin(request)
    }

    async fn try_acquire(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
    ) -> distlock::Result<Attempt<Self::Lease>> {
        self.inner.try_acquire(acquisition, request).await
    }

    async fn wait(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> distlock::Result<()> {
        self.inner.wait(acquisition, request, retry_after).await
    }

    async fn abandon(&self, acquisition: Self::Acquisition, request: &AcquireRequest) {
        self.inner.abandon(acquisition, request).await;
    }

    async fn renew(
        &self,
        batch: &[Renewal<'_, Self::Lease>],
    ) -> Vec<(RenewalId, distlock::Result<Renewed>)> {
        self.counts.batches.fetch_add(1, Ordering::Relaxed);
        self.counts
            .renewals
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if let Some(per) = self.renewals_per_pipeline {
            self.counts
                .pipelines
                .fetch_add(batch.len().div_ceil(per) as u64, Ordering::Relaxed);
        }
        self.inner.renew(batch).await
    }

    async fn release(
        &self,
        lease: &Self::Lease,
        name: &str,
        owner: &str,
    ) -> distlock::Result<Released> {
        self.inner.release(lease, name, owner).await
    }

    // The fast paths of the wrapped backend (the trait's defaults would turn them off): only renewals
    // are counted, so a handoff, like a release and a grant, is passed through uncounted.
    fn release_orders_next_acquire(&self) -> bool {
        self.inner.release_orders_next_acquire()
    }

    fn supports_hand_off(&self) -> bool {
        self.inner.supports_hand_off()
    }

    async fn hand_off(
        &self,
        lease: &Self::Lease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> distlock::Result<HandOff<Self::Lease>> {
        self.inner.hand_off(lease, name, owner, next).await
    }

    async fn inspect(&self, name: &str) -> distlock::Result<LockInfo> {
        self.inner.inspect(name).await
    }
}

/// A `Locks` for the workload: the engine's backend wrapped in [`Counted`] where the bench can build
/// it directly (memory, file, standalone Redis), else the facade's (renewals then not counted).
async fn connect(url: &str, engine: &Engine) -> Result<(Locks, Option<Arc<Counts>>), Error> {
    let wrap = |locks: Locks, counts| Ok((locks, Some(counts)));
    match engine {
        Engine::Memory => {
            let backend = distlock::memory::MemoryBackend::from_url(&LockUrl::parse(url)?)?;
            let (backend, counts) = Counted::new(backend);
            wrap(Locks::new(backend), counts)
        }
        Engine::File { .. } => {
            let backend = distlock::file::FileBackend::from_url(&LockUrl::parse(url)?)?;
            let (backend, counts) = Counted::new(backend);
            wrap(Locks::new(backend), counts)
        }
        Engine::Redis(_) => {
            let url = LockUrl::parse(url)?;
            let backend = Box::pin(distlock::redis::RedisBackend::connect(&url)).await?;
            // With `wait_replicas`, a batch goes as one pipeline with its `WAIT`.
            let per = match backend.config().wait_replicas {
                0 => distlock::redis::RENEWALS_PER_PIPELINE,
                _ => usize::MAX,
            };
            let (backend, counts) = Counted::with_pipelines(backend, per);
            wrap(Locks::new(backend), counts)
        }
        _ => Ok((distlock::connect(url).await?, None)),
    }
}

/// `VmRSS` of this process, in KiB.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The calls of the commands that run the renew script (`EVALSHA`, and `EVAL` after a `NOSCRIPT`), from
/// `INFO commandstats`.
async fn redis_script_calls(conn: &redis::aio::MultiplexedConnection) -> Result<u64, Error> {
    let mut conn = conn.clone();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .map_err(redis_failure)?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let rest = l
                .strip_prefix("cmdstat_evalsha:")
                .or_else(|| l.strip_prefix("cmdstat_eval:"))?;
            rest.split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse::<u64>()
                .ok()
        })
        .sum())
}

/// Runs `f` on every item with at most [`CONCURRENCY`] in flight; the first failure ends the run.
async fn bounded<T, R, F, Fut>(items: Vec<T>, f: F) -> Result<Vec<R>, Error>
where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Result<R, Error>> + Send + 'static,
{
    let mut out = Vec::with_capacity(items.len());
    let mut set = JoinSet::new();
    for item in items {
        if set.len() >= CONCURRENCY {
            out.push(joined(set.join_next().await)?);
        }
        set.spawn(f(item));
    }
    while let Some(next) = set.join_next().await {
        out.push(joined(Some(next))?);
    }
    Ok(out)
}

fn joined<R>(next: Option<Result<Result<R, Error>, tokio::task::JoinError>>) -> Result<R, Error> {
    match next {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(Error::unavailable(format!(
            "internal error: a hold task failed: {e}"
        ))),
        None => Err(Error::unavailable("internal error: no hold task")),
    }
}

impl Run<'_> {
    /// The hold workload.
    pub(crate) async fn hold(&self, runner: &mut Runner) -> Result<HoldSection, Error> {
        let (n, lease, d) = (
            self.config.hold_locks,
            self.config.lease,
            self.config.duration,
        );
        let (locks, counts) = connect(&self.config.url, &self.config.engine).await?;
        // Counting starts with the RSS window, so both cover the same allocations (the run's names
        // included: a caller of `lock(name)` has its names too).
        let heap = HeapWindow::open();
        let rss_before = rss_kib();
        let allocator_before = allocator_reading();
        let metrics = tokio::runtime::Handle::current().metrics();
        let tasks_before = metrics.num_alive_tasks();
        runner.step(&format!("hold: acquiring {n} locks"));
        let names: Vec<String> = (0..n)
            .map(|i| format!("distlock-bench/{}/hold/{i}", self.config.run))
            .collect();
        let handles = names
            .iter()
            .map(|name| locks.lock(name))
            .collect::<Result<Vec<_>, _>>()?;
        let began = Instant::now();
        let guards: Vec<LockGuard> = bounded(handles, |lock| async move {
            Ok(lock
                .options()
                .lease(lease)
                .wait(ACQUIRE_WAIT)
                .acquire()
                .await?)
        })
        .await?;
        let acquire_s = began.elapsed().as_secs_f64();

        runner.step(&format!("hold: holding {n} locks"));
        let redis = match self.baseline {
            Baseline::Redis { conn, .. } => Some(conn),
            _ => None,
        };
        let server_before = match redis {
            Some(conn) => Some(redis_script_calls(conn).await?),
            None => None,
        };
        let counted_before = counts.as_ref().map(|c| c.read());
        let meter = CpuMeter::start(self.plan.cpu).await;
        if let Some(heap) = &heap {
            heap.reset_peak();
        }
        let held_from = Instant::now();
        tokio::time::sleep(d).await;
        let spent = meter.stop().await;
        let counted_after = counts.as_ref().map(|c| c.read());
        let server_after = match redis {
            Some(conn) => Some(redis_script_calls(conn).await?),
            None => None,
        };
        let rss_holding = rss_kib();
        let allocator_holding = allocator_reading();
        let tasks_holding = metrics.num_alive_tasks();
        let heap_holding = heap.as_ref().map(HeapWindow::read);
        drop(heap);
        let mut not_held = 0;
        let mut lost = 0;
        let mut loss_reason = None;
        for guard in &guards {
            match guard.state() {
                LockState::Held => {}
                state => {
                    not_held += 1;
                    if state == LockState::Lost {
                        lost += 1;
                    }
                    if loss_reason.is_none() {
                        loss_reason = guard.loss_reason();
                    }
                }
            }
        }
        let held_s = held_from.elapsed().as_secs_f64();

        runner.step(&format!("hold: releasing {n} locks"));
        let began = Instant::now();
        // A lock lost during the hold fails its release; that is already counted above.
        bounded(guards, |guard| async move {
            let _ = guard.release().await;
            Ok(())
        })
        .await?;
        let release_s = began.elapsed().as_secs_f64();
        let _ = tokio::time::timeout(crate::CLOSE_LIMIT, locks.close()).await;

        let renewals = self.renewal_figures(
            counted_before.zip(counted_after),
            server_before.zip(server_after),
            held_s,
        );
        let cpu = hold_cpu(&spent, renewals.renewals, renewals.ticks);
        Ok(HoldSection {
            locks: n,
            lease_ms: round2(lease.as_secs_f64() * 1e3),
            acquire_s: round2(acquire_s),
            acquire_concurrency: CONCURRENCY,
            held_s: round2(held_s),
            release_s: round2(release_s),
            renewals,
            cpu,
            memory: hold_memory(
                n,
                (rss_before, rss_holding),
                heap_holding,
                allocator_before.zip(allocator_holding),
                (tasks_before, tasks_holding),
            ),
            not_held,
            lost,
            loss_reason,
        })
    }

    fn renewal_figures(
        &self,
        counted: Option<(CountsRead, CountsRead)>,
        server: Option<(u64, u64)>,
        held_s: f64,
    ) -> HoldRenewals {
        let n = self.config.hold_locks.max(1) as f64;
        let period = self.config.lease.as_secs_f64() / 3.0;
        let expected_ticks = if period > 0.0 {
            round2(held_s / period)
        } else {
            0.0
        };
        let (batches, renewals, pipelines) = match counted {
            Some(((b0, r0, p0), (b1, r1, p1))) => (Some(b1 - b0), Some(r1 - r0), Some(p1 - p0)),
            None => (None, None, None),
        };
        let ticks = renewals.map(|r| r as f64 / n);
        let per_tick = |count: u64| ticks.filter(|t| *t > 0.0).map(|t| round2(count as f64 / t));
        let server_commands = server.map(|(before, after)| after.saturating_sub(before));
        let redis = matches!(self.baseline, Baseline::Redis { .. });
        // Standalone Redis: one round trip per batch on the backend's one connection (its pipelines
        // all sent before any reply is awaited).
        let round_trips = if redis { batches } else { None };
        let pipelines = if redis { pipelines } else { None };
        let counted = match (&self.config.engine, batches) {
            (Engine::Redis(_), Some(_)) => {
                "batches and renewals counted at Backend::renew (a counting wrapper around the \
                 Redis backend); one batch goes on the backend's one connection as pipelines of at \
                 most RENEWALS_PER_PIPELINE renewals (pipelines = those counted from each batch's \
                 size), all queued on the connection before any reply is awaited, so round trips = \
                 batches; ticks = renewals / locks; server_commands = EVALSHA + EVAL calls \
                 from INFO commandstats over the hold (commands, not round trips: a pipeline of N \
                 renewals is N commands; its window differs from the client's by the batches in \
                 flight at either edge)"
            }
            (Engine::Memory | Engine::File { .. }, Some(_)) => {
                "batches and renewals counted at Backend::renew (a counting wrapper); no engine \
                 round trip: the backend renews in process"
            }
            _ => {
                "not counted: the bench wraps the backend to count renewals only for memory, file \
                 and standalone redis"
            }
        };
        HoldRenewals {
            batches,
            renewals,
            ticks: ticks.map(round2),
            expected_ticks,
            round_trips,
            round_trips_per_tick: round_trips.and_then(per_tick),
            pipelines,
            pipelines_per_tick: pipelines.and_then(per_tick),
            groups: redis.then_some(1),
            server_commands,
            server_commands_per_tick: server_commands.and_then(per_tick),
            counted: counted.to_string(),
        }
    }
}

/// The hold's memory figures per held lock.
fn hold_memory(
    n: usize,
    (rss_before, rss_holding): (Option<u64>, Option<u64>),
    heap: Option<HeapReading>,
    allocator: Option<(AllocatorReading, AllocatorReading)>,
    (tasks_before, tasks_holding): (usize, usize),
) -> HoldMemory {
    let per_lock = |total: f64| (n > 0).then(|| round2(total / n as f64));
    let per_lock_bytes = match (rss_before, rss_holding) {
        (Some(before), Some(holding)) => per_lock(holding.saturating_sub(before) as f64 * 1024.0),
        _ => None,
    };
    let heap_counted = if heap.is_some() {
        "live heap counted by the binary's counting allocator from before the names were made to the \
         end of the hold (requested bytes; the allocator's per-block overhead not included); peak: the \
         highest during the hold, renewal batches in flight included"
    } else {
        "not counted: the counting allocator is not this binary's global allocator"
    };
    HoldMemory {
        rss_before_kib: rss_before,
        rss_holding_kib: rss_holding,
        per_lock_bytes,
        heap_per_lock_bytes: heap.and_then(|h| per_lock(h.live_bytes as f64)),
        heap_blocks_per_lock: heap.and_then(|h| per_lock(h.live_blocks as f64)),
        heap_peak_per_lock_bytes: heap.and_then(|h| per_lock(h.peak_bytes as f64)),
        heap_counted: heap_counted.to_string(),
        allocator_in_use_per_lock_bytes: allocator.and_then(|(before, holding)| {
            per_lock(holding.in_use_bytes as f64 - before.in_use_bytes as f64)
        }),
        allocator_free_per_lock_bytes: allocator.and_then(|(before, holding)| {
            per_lock(holding.free_bytes as f64 - before.free_bytes as f64)
        }),
        allocator_system_per_lock_bytes: allocator.and_then(|(before, holding)| {
            per_lock(holding.system_bytes as f64 - before.system_bytes as f64)
        }),
        tasks_before,
        tasks_holding,
        tasks_per_lock: per_lock(tasks_holding as f64 - tasks_before as f64),
    }
}

/// The hold's CPU per tick and per renewal.
fn hold_cpu(spent: &CpuSpent, renewals: Option<u64>, ticks: Option<f64>) -> HoldCpu {
    let per_tick = |d: Duration| {
        ticks
            .filter(|t| *t > 0.0)
            .map(|t| round2(d.as_secs_f64() * 1e3 / t))
    };
    HoldCpu {
        client_ms_per_tick: per_tick(spent.client),
        server_ms_per_tick: spent.server.and_then(per_tick),
        per_renewal: spent.per(renewals.unwrap_or(0)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use distlock::memory::MemoryBackend;
    use distlock::raw::Backend;
    use distlock::Locks;

    use super::Counted;

    /// The wrapped backend's release ordering shows through (the memory store applies a release at
    /// its first poll; the trait's default says no).
    #[test]
    fn counted_keeps_the_release_ordering_of_its_backend() {
        let inner = MemoryBackend::new();
        assert!(inner.release_orders_next_acquire());
        let (counted, _) = Counted::new(inner);
        assert!(counted.release_orders_next_acquire());
    }

    /// A release with a local waiter queued is one handoff of the wrapped backend, not a release and
    /// the waiter's own acquire.
    #[tokio::test]
    async fn counted_hands_off_through_its_backend() {
        let inner = MemoryBackend::new();
        inner.enable_hand_off();
        let (counted, _) = Counted::new(inner.clone());
        assert!(counted.supports_hand_off());
        let locks = Locks::new(counted);
        let first = locks.lock("counted-hand-off").unwrap();
        let second = locks.lock("counted-hand-off").unwrap();
        let held = first.acquire().await.unwrap();
        let waiter = tokio::spawn(async move { second.acquire().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        held.release().await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(inner.hand_offs(), 1, "the release was not a handoff");
        next.release().await.unwrap();
    }
}
