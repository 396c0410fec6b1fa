//! The measuring loops, generic over what one cycle is: distlock's `Lock`, a bare engine client, or a
//! round-trip probe.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::cpu::{CpuMeter, CpuSpent, ServerCpu};
use crate::error::Error;
use crate::stats::Recorder;

/// How every measurement of a run is made: for how long (or for how many cycles) and whose server
/// CPU it meters beside the bench's own.
#[derive(Debug, Clone, Copy)]
pub struct Plan<'a> {
    pub duration: Duration,
    /// `--cycles N`: each task of a cycles run does exactly its warm-up cycles, then exactly N
    /// measured ones, with no time bound (for repeatable instruction counts); the contended workload
    /// still runs for `duration`.
    pub cycles: Option<u64>,
    pub cpu: &'a ServerCpu,
}

/// One way to take and give back a lock.
pub trait Cycler: Send + Sync + 'static {
    /// Proof of holding, handed back to [`release`](Self::release).
    type Held: Send + 'static;

    /// Acquires, waiting at most `wait`; `Ok(None)` when the wait ran out.
    fn acquire(
        &self,
        wait: Duration,
    ) -> impl Future<Output = Result<Option<Self::Held>, Error>> + Send;

    fn release(&self, held: Self::Held) -> impl Future<Output = Result<(), Error>> + Send;
}

/// How long an uncontended acquire may wait before the run is declared broken (someone else holds
/// a name that should be this run's alone).
const UNCONTENDED_WAIT: Duration = Duration::from_secs(10);

/// How long past the end of a contended run a waiter keeps waiting: a fair queue drains in a few
/// holds, so a waiter still queued after this is stuck, and is counted as having given up.
const CONTENDED_GRACE: Duration = Duration::from_secs(10);

/// Lets each task say it has warmed up, then waits for the common start.
pub struct Starter {
    ready: mpsc::Sender<()>,
    go: watch::Receiver<Option<Instant>>,
}

impl Starter {
    /// Reports this task ready and returns the start instant, once every task is ready.
    pub async fn ready(mut self) -> Result<Instant, Error> {
        let stopped = || Error::unavailable("internal error: the benchmark stopped");
        self.ready.send(()).await.map_err(|_| stopped())?;
        let start = *self
            .go
            .wait_for(Option::is_some)
            .await
            .map_err(|_| stopped())?;
        start.ok_or_else(stopped)
    }
}

/// What [`run_tasks`] returns: the common start, each task's result, and the CPU time spent from the
/// start until the last task finished.
pub struct TasksRun<T> {
    pub start: Instant,
    pub results: Vec<T>,
    pub cpu: CpuSpent,
}

/// Spawns `n` tasks, starts them together once all have warmed up (a barrier, as in the peers'
/// measurements), and collects their results; the first failure ends the run (the other tasks are
/// aborted when the set is dropped). The client's and `cpu`'s CPU time is metered from the start
/// until the last task finished.
pub async fn run_tasks<T, F, Fut>(
    n: usize,
    cpu: &ServerCpu,
    mut body: F,
) -> Result<TasksRun<T>, Error>
where
    T: Send + 'static,
    F: FnMut(usize, Starter) -> Fut,
    Fut: Future<Output = Result<T, Error>> + Send + 'static,
{
    let (ready_tx, mut ready_rx) = mpsc::channel(n.max(1));
    let (go_tx, go_rx) = watch::channel(None);
    let mut set = JoinSet::new();
    for i in 0..n {
        let starter = Starter {
            ready: ready_tx.clone(),
            go: go_rx.clone(),
        };
        let task = body(i, starter);
        set.spawn(async move { (i, task.await) });
    }
    drop(ready_tx);
    let mut ready = 0;
    while ready < n {
        tokio::select! {
            Some(()) = ready_rx.recv() => ready += 1,
            // A task that ends before the start failed while warming up.
            joined = set.join_next() => return Err(joined_failure(joined)),
        }
    }
    let meter = CpuMeter::start(cpu).await;
    let start = Instant::now();
    let _ = go_tx.send(Some(start));
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        match joined {
            Ok((i, Ok(result))) => results[i] = Some(result),
            other => return Err(joined_failure(Some(other))),
        }
    }
    let cpu = meter.stop().await;
    Ok(TasksRun {
        start,
        results: results.into_iter().flatten().collect(),
        cpu,
    })
}

type Joined<T> = Result<(usize, Result<T, Error>), tokio::task::JoinError>;

fn joined_failure<T>(joined: Option<Joined<T>>) -> Error {
    match joined {
        Some(Ok((_, Err(failure)))) => failure,
        Some(Err(e)) => Error::unavailable(format!("internal error: a benchmark task failed: {e}")),
        Some(Ok((_, Ok(_)))) | None => {
            Error::unavailable("internal error: a benchmark task ended early")
        }
    }
}

/// The result of a cycles run: every task acquires and releases its own name as fast as it can.
#[derive(Debug)]
pub struct Cycles {
    pub tasks: usize,
    pub cycles: u64,
    pub elapsed: Duration,
    /// Acquire + release, per cycle.
    pub latency: Recorder,
    /// Client and server CPU time over the measured interval.
    pub cpu: CpuSpent,
}

impl Cycles {
    pub fn per_second(&self) -> f64 {
        per_second(self.cycles, self.elapsed)
    }
}

pub fn per_second(count: u64, elapsed: Duration) -> f64 {
    if elapsed.is_zero() {
        0.0
    } else {
        count as f64 / elapsed.as_secs_f64()
    }
}

/// Runs acquire + release cycles on each client concurrently: `warmup` cycles each (bounded by a
/// tenth of the plan's duration), then cycles for the duration from a common start (with
/// `plan.cycles`: exactly `warmup` cycles, then exactly that many). The elapsed time runs from the
/// start until the last task finished its last cycle.
pub async fn run_cycles<C: Cycler>(
    clients: Vec<C>,
    warmup: usize,
    plan: Plan<'_>,
) -> Result<Cycles, Error> {
    let tasks = clients.len();
    let (duration, fixed) = (plan.duration, plan.cycles);
    let mut clients: Vec<Option<C>> = clients.into_iter().map(Some).collect();
    let run = run_tasks(tasks, plan.cpu, |i, starter| {
        let client = clients[i].take();
        async move {
            let client =
                client.ok_or_else(|| Error::unavailable("internal error: no client for a task"))?;
            let warm_until = Instant::now() + duration / 10;
            for _ in 0..warmup {
                if fixed.is_none() && Instant::now() >= warm_until {
                    break;
                }
                cycle(&client).await?;
            }
            let start = starter.ready().await?;
            let deadline = start + duration;
            let mut latency = Recorder::new();
            let mut cycles = 0u64;
            loop {
                let began = Instant::now();
                let done = match fixed {
                    Some(n) => cycles >= n,
                    None => began >= deadline,
                };
                if done {
                    break;
                }
                cycle(&client).await?;
                latency.record(began.elapsed());
                cycles += 1;
            }
            Ok((cycles, latency, Instant::now()))
        }
    })
    .await?;
    let start = run.start;
    let mut latency = Recorder::new();
    let mut cycles = 0;
    let mut end = start;
    for (n, recorder, finished) in &run.results {
        cycles += n;
        latency.merge(recorder);
        end = end.max(*finished);
    }
    Ok(Cycles {
        tasks,
        cycles,
        elapsed: end.duration_since(start),
        latency,
        cpu: run.cpu,
    })
}

async fn cycle<C: Cycler>(client: &C) -> Result<(), Error> {
    match client.acquire(UNCONTENDED_WAIT).await? {
        Some(held) => client.release(held).await,
        None => Err(Error::unavailable(format!(
            "an uncontended acquire waited {}s: is another process using the benchmark's names?",
            UNCONTENDED_WAIT.as_secs()
        ))),
    }
}

/// One acquisition of the contended run.
#[derive(Debug, Clone, Copy)]
struct Event {
    task: usize,
    requested: Instant,
    acquired: Instant,
    released: Instant,
}

/// The result of a contended run: every task on the same name.
#[derive(Debug)]
pub struct Contended {
    pub acquisitions: u64,
    pub elapsed: Duration,
    /// Release called → the next acquire returned, over all consecutive acquisitions.
    pub handoff: Recorder,
    /// The same, only where the next holder is another task (the real wake-up latency).
    pub to_other: Recorder,
    /// Acquire called → returned.
    pub wait: Recorder,
    pub mean_hold: Duration,
    pub per_task: Vec<u64>,
    /// Consecutive acquisitions by the same task.
    pub same_holder: u64,
    /// Consecutive acquisitions in all (acquisitions − 1).
    pub pairs: u64,
    /// Acquisitions that began before the previous holder released: mutual exclusion broken.
    pub overlaps: u64,
    /// Waits that ran out ([`CONTENDED_GRACE`] past the end).
    pub gave_up: u64,
    /// Client and server CPU time over the measured interval.
    pub cpu: CpuSpent,
}

impl Contended {
    pub fn per_second(&self) -> f64 {
        per_second(self.acquisitions, self.elapsed)
    }
}

/// Each client takes the (same) lock, holds it for `hold` (a thread sleep inside `block_in_place`, as
/// the peers' measurements hold), releases it and asks again at once, for the plan's duration.
pub async fn run_contended<C: Cycler>(
    clients: Vec<C>,
    hold: Duration,
    plan: Plan<'_>,
) -> Result<Contended, Error> {
    let tasks = clients.len();
    let duration = plan.duration;
    let mut clients: Vec<Option<C>> = clients.into_iter().map(Some).collect();
    let run = run_tasks(tasks, plan.cpu, |task, starter| {
        let client = clients[task].take();
        async move {
            let client =
                client.ok_or_else(|| Error::unavailable("internal error: no client for a task"))?;
            let start = starter.ready().await?;
            let deadline = start + duration;
            let mut events = Vec::new();
            let mut gave_up = 0u64;
            loop {
                let requested = Instant::now();
                if requested >= deadline {
                    break;
                }
                let wait = deadline.duration_since(requested) + CONTENDED_GRACE;
                let Some(held) = client.acquire(wait).await? else {
                    gave_up += 1;
                    break;
                };
                let acquired = Instant::now();
                if !hold.is_zero() {
                    tokio::task::block_in_place(|| std::thread::sleep(hold));
                }
                let released = Instant::now();
                client.release(held).await?;
                events.push(Event {
                    task,
                    requested,
                    acquired,
                    released,
                });
            }
            Ok((events, gave_up, Instant::now()))
        }
    })
    .await?;

    let start = run.start;
    let mut events = Vec::new();
    let mut gave_up = 0;
    let mut end = start;
    for (task_events, task_gave_up, finished) in run.results {
        events.extend(task_events);
        gave_up += task_gave_up;
        end = end.max(finished);
    }
    Ok(analyse(
        events,
        tasks,
        gave_up,
        end.duration_since(start),
        run.cpu,
    ))
}

fn analyse(
    mut events: Vec<Event>,
    tasks: usize,
    gave_up: u64,
    elapsed: Duration,
    cpu: CpuSpent,
) -> Contended {
    events.sort_by_key(|e| e.acquired);
    let mut per_task = vec![0u64; tasks];
    let mut wait = Recorder::new();
    let mut held = Duration::ZERO;
    for e in &events {
        if let Some(count) = per_task.get_mut(e.task) {
            *count += 1;
        }
        wait.record(e.acquired.duration_since(e.requested));
        held += e.released.duration_since(e.acquired);
    }
    let mut handoff = Recorder::new();
    let mut to_other = Recorder::new();
    let (mut same_holder, mut overlaps) = (0, 0);
    for pair in events.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        let Some(gap) = next.acquired.checked_duration_since(prev.released) else {
            overlaps += 1;
            continue;
        };
        handoff.record(gap);
        if next.task == prev.task {
            same_holder += 1;
        } else {
            to_other.record(gap);
        }
    }
    let acquisitions = events.len() as u64;
    Contended {
        acquisitions,
        elapsed,
        handoff,
        to_other,
        wait,
        mean_hold: if events.is_empty() {
            Duration::ZERO
        } else {
            held / u32::try_from(events.len()).unwrap_or(u32::MAX)
        },
        per_task,
        same_holder,
        pairs: acquisitions.saturating_sub(1),
        overlaps,
        gave_up,
        cpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoffs_are_counted_by_holder() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        let ev = |task, acquired, released| Event {
            task,
            requested: at(0),
            acquired: at(acquired),
            released: at(released),
        };
        // Task 0, then 0 again, then 1, then 0 overlapping 1's hold.
        let events = vec![ev(0, 10, 20), ev(0, 25, 30), ev(1, 40, 50), ev(0, 45, 60)];
        let c = analyse(events, 2, 0, Duration::from_millis(1), CpuSpent::none());
        assert_eq!(c.acquisitions, 4);
        assert_eq!(c.pairs, 3);
        assert_eq!(c.same_holder, 1);
        assert_eq!(c.overlaps, 1);
        assert_eq!(c.per_task, [3, 1]);
        assert_eq!(c.handoff.len(), 2);
        assert_eq!(c.to_other.len(), 1);
    }
}
