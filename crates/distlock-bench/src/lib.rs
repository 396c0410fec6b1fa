//! `distlock bench`: the three workloads of DESIGN §8, in the shapes the peers were measured with
//! (shared/reference/baseline.md), each beside the engine's own round trip and a bare-client
//! baseline measured in the same run.
//!
//! The measuring is generic over [`distlock::Locks`]; only the baselines know their engine.
//!
//! This crate is the library behind the `distlock bench` subcommand of `distlock-cli`: the command
//! parses [`Options`] (a `clap::Args`), resolves the lock URL, calls [`bench()`] and prints the
//! [`Report`] ([`render`] for people, [`Report::to_json`] for scripts).

mod cpu;
mod engines;
mod error;
mod harness;
pub mod heap;
mod herd;
mod hold;
mod kinds;
mod measure;
mod mysql;
mod plot;
mod postgres;
mod progress;
mod redlock;
mod report;
mod same_scripts;
mod stats;
mod sweep;
mod zookeeper;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};

use engines::Engine;
pub use error::Error;
pub use herd::{HerdRun, HerdSection};
pub use hold::{HoldMemory, HoldRenewals, HoldSection};
use progress::Progress;
use report::Target;
pub use report::{render, Report};
pub use sweep::{Sweep, SweepPoint, SWEEP_TASKS};

/// `distlock bench --help`.
pub const ABOUT: &str = "\
Measure a lock service with the workloads of distlock's design (the same shapes as the peer \
baselines it is compared with):

  uncontended  1 task, one name: acquire + release cycles; p50/p99 latency and cycles/s
  many         N tasks (default 16), each on its own name: total cycles/s, once with one Locks \
shared by all tasks (one multiplexed connection) and once with one Locks per task
  contended    N tasks (default 8) of one process on one name, each holding it --hold (a thread \
sleep): acquisitions/s, handoff latency (release -> next grant, and to another task) p50/p99, \
fairness (min/max acquisitions per task) and the share of re-acquisitions by the releasing task
  kinds        1 task, one name each: read-lock cycles, then permit cycles (a semaphore of 4), each \
beside its same-layout bare loop (redis: distlock's own read and permit scripts by EVALSHA, one call \
per acquire and per release; postgres advisory mode: a bare pg_advisory_lock_shared + token read / \
unlock_shared pair, and the permit's bare statements: key shared + slot key + counter bump, unlock \
both + NOTIFY; file: flock LOCK_SH, and a slot file's flock; other engines: distlock's figures alone)
  hold         (only when asked: not part of `all`) one Locks acquires --locks names (default \
10,000) with a short --lease (default 3s), holds them for --duration while the watchdog renews them, \
then releases them: renewal batches and round trips per tick (Redis: also the server's EVALSHA count), \
resident memory per held lock, and any lock not Held at the end
  herd         (only when asked; redis:// of one server) --tasks separate `distlock run` processes \
(default 30) queue on one name one after another, once as the URL says and once with fair=true: \
top-level commands per handoff (counted with MONITOR, scripts' own commands left out), and how many \
pairs of processes were granted out of their arrival order (from the tokens their commands print)

--sweep runs only the many workload, at 1, 2, 4, 8, 16 and 64 tasks, for distlock (shared and per-task \
Locks) and the engine's main baseline, and reports a sweep table; --plot out.svg also draws it (cycles/s \
against tasks, log2 axis).

Each run also measures the engine's own round trip and reports every figure as a ratio to it \
(redis: PING on a multiplexed redis-rs connection; redlock: a PING to every node in parallel; etcd: \
a put, and a range beside it; zk: a create, a getChildren and a create + delete; postgres, mysql: \
SELECT 1), and runs a baseline beside distlock (redis: a bare SET NX PX + EVALSHA \
compare-and-delete loop, the same-scripts loop (distlock's own acquire and release scripts by EVALSHA, \
nothing else: on one shared connection and on a connection per task in many) and rslock on the same \
server, and in contended the harness's floor, an in-process mutex whose release is one PING; redlock: \
the rslock crate on the same nodes; etcd: etcd's Lock/Unlock RPCs, and in contended the harness's \
floor, an in-process mutex whose release is one put and one range; postgres: a bare tokio-postgres pg_advisory_lock + pg_advisory_unlock pair; mysql: a bare \
mysql_async GET_LOCK + RELEASE_LOCK pair; both also with one counter commit after each lock, the peer \
of distlock's advisory mode, which commits its fencing counter before a grant; file: a bare flock + unlock, the floor). memory:// and \
file:// have no engine round trip: their figures are absolute.

Every measurement also reports CPU time per cycle, the bench process's and the server's over the \
same interval (redis: INFO cpu; etcd: process_cpu_seconds_total from its /metrics; other servers on \
this machine: the kernel's accounting of the process listening on the port; memory://, file://: \
in-process). It is the primary figure on a shared machine: wall-clock ratios swing by ~50 % between \
runs, CPU per cycle does not. Each target is shown as its wall-clock ratio and as the CPU ratio.

A progress bar shows on stderr when it is a terminal; the report goes to stdout (--json: one JSON \
object). Runs on a tokio multi-thread runtime with 2 workers, like the peers' measurements.";

/// The `--plot` image of a report's sweep (an SVG document), `None` without a sweep.
pub fn plot_svg(report: &Report) -> Option<String> {
    let sweep = report.sweep.as_ref()?;
    let title = format!(
        "distlock bench --sweep: {} ({})",
        report.url, report.backend
    );
    Some(plot::sweep_svg(sweep, &title))
}

/// Worker threads of the benchmark's runtime: the peers' Rust measurements used 2.
pub const WORKERS: usize = 2;

const DEFAULT_MANY_TASKS: usize = 16;
const DEFAULT_CONTENDED_TASKS: usize = 8;
/// Warm-up cycles before a measurement (baseline.md: 200 for one client, 20 per worker for many).
const WARMUP_ONE: usize = 200;
const WARMUP_MANY: usize = 20;
/// How long the end of the run waits for background releases.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// The runtime `distlock bench` runs on.
pub fn runtime_builder() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(WORKERS);
    builder
}

/// The flags of `distlock bench` (the lock URL aside: the command resolves it).
#[derive(Debug, Clone, Args)]
#[non_exhaustive]
pub struct Options {
    /// How long each measurement runs, after a short warm-up.
    #[arg(long, value_name = "DUR", value_parser = parse_duration, default_value = "5s")]
    pub duration: Duration,
    /// Concurrent tasks of the `many` (default 16) and `contended` (default 8) workloads.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub tasks: Option<u16>,
    /// How long the contended workload holds the lock each time (a thread sleep, as the peers'
    /// benchmarks do).
    #[arg(long, value_name = "DUR", value_parser = parse_duration, default_value = "1ms")]
    pub hold: Duration,
    /// The hold workload: how many locks one Locks acquires and holds.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub locks: u32,
    /// The hold workload: the lease of its locks (the watchdog renews every third of it, so a short
    /// lease shows several renewal ticks within --duration).
    #[arg(long, value_name = "DUR", value_parser = parse_duration, default_value = "3s")]
    pub lease: Duration,
    /// Which workload to run.
    #[arg(long, value_enum, value_name = "WORKLOAD", default_value_t = Workload::All)]
    pub workload: Workload,
    /// Print one JSON object on stdout instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Run only the `many` workload, at 1, 2, 4, 8, 16 and 64 tasks, for distlock (one shared Locks,
    /// one Locks per task) and the engine's main baseline; the report gets a `sweep` section.
    #[arg(long, conflicts_with_all = ["workload", "tasks"])]
    pub sweep: bool,
    /// With --sweep: also draw cycles/s against tasks as an SVG image at this path.
    #[arg(long, value_name = "PATH", requires = "sweep")]
    pub plot: Option<std::path::PathBuf>,
    /// Only measure the engine's round trip and the bare-client baselines, not distlock (for
    /// comparing engines, or a build whose backend for the URL is not ready).
    #[arg(long, hide = true)]
    pub baseline_only: bool,
    /// Each cycles measurement runs exactly its warm-up cycles, then exactly N measured cycles per
    /// task, with no time bound (the contended workload still runs for --duration): repeatable
    /// instruction counts for scripts/callgrind.sh.
    #[arg(long, hide = true, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub cycles: Option<u64>,
    /// Measure only distlock, or only the first baseline of each workload; no round-trip probes
    /// (scripts/callgrind.sh: one loop per process).
    #[arg(long, hide = true, value_enum, value_name = "WHAT")]
    pub only: Option<Only>,
}

/// What `--only` keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[non_exhaustive]
pub enum Only {
    /// distlock's measurements, no probes and no baselines.
    Distlock,
    /// The first baseline of each workload, no probes and no distlock.
    Baselines,
}

/// The workloads of `distlock bench` (DESIGN §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[non_exhaustive]
pub enum Workload {
    /// One task, one name: acquire + release cycles.
    Uncontended,
    /// Many tasks, each on its own name (one shared connection, then one per task).
    Many,
    /// Many tasks on one name, holding it briefly: handoff latency and fairness.
    Contended,
    /// One task, one name: read-lock cycles, then permit cycles, each beside its same-layout bare
    /// loop (Redis: distlock's own scripts by EVALSHA; PostgreSQL: the bare advisory statements).
    Kinds,
    /// All of uncontended, many, contended and kinds (not `hold`).
    All,
    /// One Locks holds --locks names (10,000) for --duration while the watchdog renews them:
    /// renewal round trips, CPU per tick, memory per held lock.
    Hold,
    /// Redis only: --tasks separate `distlock run` processes (default 30) queue on one name, as the
    /// URL says and in fair mode: top-level commands per handoff (MONITOR) and the grant order.
    Herd,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    distlock_core::duration::parse(text).map_err(|e| e.message().to_string())
}

/// What to run, checked.
#[derive(Debug, Clone)]
struct Config {
    url: String,
    engine: Engine,
    duration: Duration,
    hold: Duration,
    many_tasks: usize,
    contended_tasks: usize,
    uncontended: bool,
    many: bool,
    contended: bool,
    /// The kinds workload: read-lock and permit cycles.
    kinds: bool,
    /// `--workload hold`, its `--locks` and `--lease`.
    hold_workload: bool,
    hold_locks: usize,
    lease: Duration,
    /// `--workload herd`, and its number of processes.
    herd_workload: bool,
    herd_processes: usize,
    /// `--sweep`: (b) at every count of [`SWEEP_TASKS`], instead of the workloads.
    sweep: bool,
    /// `--cycles`: a fixed count of measured cycles per task instead of `duration`.
    cycles: Option<u64>,
    /// `--only`.
    only: Option<Only>,
    /// Prefix of every name and key the run uses, unique to the run.
    run: String,
}

/// Runs the benchmark against `url` as `options` ask, drawing a progress bar on stderr when it is a
/// terminal, and returns the report (`options.json` is for the caller's printing).
pub async fn bench(url: String, options: &Options) -> Result<Report, Error> {
    if options.duration.is_zero() {
        return Err(Error::usage("--duration must be more than 0"));
    }
    let engine = Engine::from_url(&url)?;
    let all = options.workload == Workload::All;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let config = Config {
        url,
        engine,
        duration: options.duration,
        hold: options.hold,
        many_tasks: options.tasks.map_or(DEFAULT_MANY_TASKS, usize::from),
        contended_tasks: options.tasks.map_or(DEFAULT_CONTENDED_TASKS, usize::from),
        uncontended: !options.sweep && (all || options.workload == Workload::Uncontended),
        many: !options.sweep && (all || options.workload == Workload::Many),
        contended: !options.sweep && (all || options.workload == Workload::Contended),
        kinds: !options.sweep && (all || options.workload == Workload::Kinds),
        sweep: options.sweep,
        hold_workload: !options.sweep && options.workload == Workload::Hold,
        herd_workload: !options.sweep && options.workload == Workload::Herd,
        herd_processes: options.tasks.map_or(herd::DEFAULT_PROCESSES, usize::from),
        hold_locks: options.locks as usize,
        lease: options.lease,
        cycles: options.cycles,
        only: options.only,
        run: format!("{}-{nanos:08x}", std::process::id()),
    };
    if config.hold_workload && (options.baseline_only || options.only == Some(Only::Baselines)) {
        return Err(Error::usage(
            "--workload hold measures distlock: not with --baseline-only",
        ));
    }
    if config.herd_workload && !matches!(config.engine, Engine::Redis(_)) {
        return Err(Error::usage(
            "--workload herd needs a redis:// URL of one server: it counts the processes' commands with MONITOR",
        ));
    }
    if config.herd_workload && (options.baseline_only || options.only.is_some()) {
        return Err(Error::usage(
            "--workload herd measures distlock run processes: not with --baseline-only or --only",
        ));
    }
    if config.hold_workload && config.lease.is_zero() {
        return Err(Error::usage("--lease must be more than 0"));
    }
    let locks = if options.baseline_only || options.only == Some(Only::Baselines) {
        None
    } else {
        Some(distlock::connect(&config.url).await?)
    };

    let total = count_steps(&config, locks.is_some());
    let mut runner = Runner {
        progress: Progress::new(total, config.duration),
        done: 0,
        total,
    };
    let measured = measure::measure(&config, locks.as_ref(), &mut runner).await;
    runner.progress.finish();
    if let Some(locks) = &locks {
        // Dropped guards of a failed run release in the background; let that reach the server.
        let _ = tokio::time::timeout(CLOSE_LIMIT, locks.close()).await;
    }
    measured
}

/// How many measurements [`measure::measure`] makes, for the progress bar.
fn count_steps(config: &Config, with_distlock: bool) -> usize {
    let d = usize::from(with_distlock);
    let (mut rtt, mut a, mut b, mut c) = match config.engine {
        Engine::Redis(_) => (1, 3, 5, 2),
        Engine::Redlock(_) => (1, 1, 1, 1),
        Engine::Etcd { .. } => (2, 1, 1, 1),
        Engine::ZooKeeper { .. } => (3, 0, 0, 0),
        Engine::Postgres { .. } => (2, 2, 1, 2),
        Engine::Mysql { .. } => (1, 2, 1, 2),
        Engine::File { sync, .. } => (0, 1 + usize::from(sync), 1, 0),
        Engine::Memory | Engine::Unmeasured { .. } => (0, 0, 0, 0),
    };
    let mut kinds_baselines = match config.engine {
        Engine::Redis(_) | Engine::File { .. } => 1,
        Engine::Postgres { advisory, .. } => usize::from(advisory),
        _ => 0,
    };
    if config.only == Some(Only::Distlock) {
        kinds_baselines = 0;
    }
    match config.only {
        Some(Only::Distlock) => (rtt, a, b, c) = (0, 0, 0, 0),
        Some(Only::Baselines) => (rtt, a, b, c) = (0, a.min(1), b.min(1), c.min(1)),
        None => {}
    }
    let sweep_baseline = !matches!(
        config.engine,
        Engine::Memory | Engine::Unmeasured { .. } | Engine::ZooKeeper { .. }
    );
    rtt + usize::from(config.uncontended) * (d + a)
        + usize::from(config.many) * (2 * d + b)
        + usize::from(config.contended) * (d + c)
        + usize::from(config.kinds) * 2 * (d + kinds_baselines)
        + usize::from(config.sweep) * SWEEP_TASKS.len() * (2 * d + usize::from(sweep_baseline))
        + usize::from(config.hold_workload) * 3
        + usize::from(config.herd_workload) * 2
}

/// Announces measurements on the progress bar.
#[derive(Debug)]
struct Runner {
    progress: Progress,
    done: usize,
    total: usize,
}

impl Runner {
    fn step(&mut self, label: &str) {
        self.progress
            .step(self.done, self.total.max(self.done + 1), label);
        self.done += 1;
    }
}

/// Total (client + server) CPU µs per cycle of a figure.
fn cpu(f: &report::CycleFigures) -> Option<f64> {
    f.cpu.total_us_per_cycle
}

fn sum(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? + b?)
}

/// The targets of issue 9 (Redis, etcd and file, which restate issues 3 and 4's), issues 10–12 (the
/// other engines), and the fairness ones every backend can meet with the local FIFO (DESIGN §3),
/// computed from the run: each as its wall-clock ratio and, where it has one, as the ratio of CPU
/// time per cycle (the primary figure on a shared machine).
fn targets(report: &Report, engine: &Engine) -> Vec<Target> {
    let mut out = Vec::new();
    let reference = report.round_trip.reference.as_ref();
    let rtt = reference.map(|p| &p.latency);
    let rtt_cpu = reference.and_then(|p| p.cpu.total_us_per_cycle);
    let others = &report.round_trip.others;
    let a = report.uncontended.as_ref();
    let a_distlock = a.and_then(|a| a.distlock.as_ref());
    let a_base = a.and_then(|a| a.baselines.first());
    let b = report.many.as_ref();
    let b_base = |label: &str| {
        b.and_then(|b| b.baselines.iter().find(|f| f.label == label))
            .filter(|f| f.cycles_per_s > 0.0)
    };
    let c = report.contended.as_ref().and_then(|c| c.distlock.as_ref());
    let c_cpu = c.and_then(|c| c.cpu.total_us_per_cycle);
    match engine {
        Engine::Redis(_) => {
            let bare = a.and_then(|a| a.baselines.iter().find(|f| f.label == measure::BARE_LOOP));
            if let (Some(d), Some(base)) = (a_distlock, bare) {
                if base.latency.mean_us > 0.0 {
                    out.push(
                        Target::at_most(
                            "Redis (a) distlock cycle / bare SET NX PX + EVALSHA loop cycle (mean)",
                            d.latency.mean_us / base.latency.mean_us,
                            1.10,
                        )
                        .with_cpu(
                            "CPU per cycle: distlock / bare loop",
                            cpu(d),
                            cpu(base),
                            1.10,
                        ),
                    );
                }
            }
            let per_task = b.and_then(|b| b.per_task.as_ref());
            if let (Some(f), Some(base)) = (per_task, b_base(measure::BARE_LOOP_PER_TASK)) {
                out.push(
                    Target::at_least(
                        "Redis (b) one Locks per task / bare loop, a connection per task, cycles/s",
                        f.cycles_per_s / base.cycles_per_s,
                        1.0,
                    )
                    .with_cpu(
                        "CPU per cycle: one Locks per task / bare loop per task",
                        cpu(f),
                        cpu(base),
                        1.0,
                    ),
                );
            }
            let shared = b.and_then(|b| b.shared.as_ref());
            if let (Some(f), Some(base)) = (shared, b_base(measure::SAME_SCRIPTS_SHARED)) {
                out.push(
                    Target::at_least(
                        "Redis (b) one shared Locks / same-scripts loop, one shared connection, cycles/s",
                        f.cycles_per_s / base.cycles_per_s,
                        0.9,
                    )
                    .with_cpu(
                        "CPU per cycle: one shared Locks / same-scripts loop",
                        cpu(f),
                        cpu(base),
                        1.0 / 0.9,
                    ),
                );
            }
            if let (Some(c), Some(rtt)) = (c, rtt) {
                if rtt.mean_us > 0.0 && c.handoff_to_other.n > 0 {
                    out.push(
                        Target::at_most(
                            "Redis (c) handoff to another task p50, in PING round trips",
                            c.handoff_to_other.p50_us / rtt.mean_us,
                            2.5,
                        )
                        .with_cpu(
                            "CPU per contended acquisition (acquire, release, wake-up), in PINGs' CPU",
                            c_cpu,
                            rtt_cpu,
                            2.5,
                        ),
                    );
                }
            }
            // The same target for the harness's own floor (an in-process lock whose release is one
            // PING): what any one-request handoff costs in this harness, beside distlock's row.
            let floor = report.contended.as_ref().and_then(|c| {
                c.baselines
                    .iter()
                    .find(|b| b.label == measure::PING_MUTEX_FLOOR)
            });
            if let (Some(floor), Some(rtt)) = (floor, rtt) {
                if rtt.mean_us > 0.0 && floor.handoff_to_other.n > 0 {
                    out.push(
                        Target::at_most(
                            "Redis (c) the harness floor's handoff p50 (in-process lock, release = one PING), in PING round trips",
                            floor.handoff_to_other.p50_us / rtt.mean_us,
                            2.5,
                        )
                        .with_cpu(
                            "the floor's CPU per contended acquisition, in PINGs' CPU",
                            floor.cpu.total_us_per_cycle,
                            rtt_cpu,
                            2.5,
                        ),
                    );
                }
            }
            redis_peer_targets(report, &mut out);
        }
        Engine::Redlock(_) => redlock_targets(report, &mut out),
        Engine::Postgres { lease: true, .. } => {
            let update = others
                .iter()
                .find(|p| p.label == measure::CONDITIONAL_UPDATE);
            if let (Some(d), Some(update)) = (a_distlock, update) {
                if update.latency.mean_us > 0.0 {
                    out.push(
                        Target::at_most(
                            "(a) distlock lease cycle, in conditional UPDATEs (mean)",
                            d.latency.mean_us / update.latency.mean_us,
                            2.3,
                        )
                        .with_cpu(
                            "CPU per cycle, in conditional UPDATEs' CPU",
                            cpu(d),
                            update.cpu.total_us_per_cycle,
                            2.3,
                        ),
                    );
                }
            }
        }
        Engine::Postgres { advisory, .. } | Engine::Mysql { advisory, .. } => {
            // distlock's advisory mode commits its fencing counter before it reports a grant: the
            // targets compare with the bare pair plus one counter commit (the issue's "+ one commit
            // when fenced"); the plain pair's ratio is in the report's baseline rows.
            let fenced = |label: &str| label == measure::FENCED_PAIR;
            let a_fenced = a.and_then(|a| a.baselines.iter().find(|b| fenced(&b.label)));
            if let (Some(d), Some(base), true) = (a_distlock, a_fenced, *advisory) {
                if base.latency.mean_us > 0.0 {
                    out.push(
                        Target::at_most(
                            "(a) distlock advisory cycle / (bare advisory pair + one commit) (mean)",
                            d.latency.mean_us / base.latency.mean_us,
                            1.15,
                        )
                        .with_cpu(
                            "CPU per cycle: distlock / (pair + one commit)",
                            cpu(d),
                            cpu(base),
                            1.15,
                        ),
                    );
                }
            }
            let c_base = report.contended.as_ref().and_then(|c| {
                c.baselines
                    .iter()
                    .find(|b| b.label == measure::FENCED_PAIR_CONTENDED)
            });
            if let (Some(c), Some(base), true) = (c, c_base, *advisory) {
                if base.handoff_to_other.p50_us > 0.0 && c.handoff_to_other.n > 0 {
                    out.push(
                        Target::at_most(
                            "(c) handoff p50 / (bare advisory pair + one commit)'s handoff p50",
                            c.handoff_to_other.p50_us / base.handoff_to_other.p50_us,
                            1.2,
                        )
                        .with_cpu(
                            "CPU per contended acquisition: distlock / (pair + one commit)",
                            c_cpu,
                            base.cpu.total_us_per_cycle,
                            1.2,
                        ),
                    );
                }
            }
        }
        Engine::Etcd { .. } => {
            if let (Some(d), Some(rtt)) = (a_distlock, rtt) {
                if rtt.mean_us > 0.0 {
                    out.push(
                        Target::at_most(
                            "etcd (a) distlock cycle, in put round trips (mean)",
                            d.latency.mean_us / rtt.mean_us,
                            2.2,
                        )
                        .with_cpu(
                            "CPU per cycle, in puts' CPU",
                            cpu(d),
                            rtt_cpu,
                            2.2,
                        ),
                    );
                }
            }
            if let (Some(c), Some(put), Some(range)) = (c, rtt, others.first()) {
                let floor_us = c.mean_hold_us + put.mean_us + range.latency.mean_us;
                if floor_us > 0.0 {
                    out.push(
                        Target::at_least(
                            "etcd (c) acquisitions/s / (1 / (hold + put + range))",
                            c.acquisitions_per_s * floor_us / 1e6,
                            0.9,
                        )
                        .with_cpu(
                            "CPU per acquisition / (put's + range's CPU)",
                            c_cpu,
                            sum(rtt_cpu, range.cpu.total_us_per_cycle),
                            1.0 / 0.9,
                        ),
                    );
                }
            }
            // The same target against the harness's own floor (an in-process lock whose release is
            // one put + one range): `hold + put + range` run in this harness, so the CPU ratio leaves
            // out what the harness itself costs per acquisition (its `block_in_place` holds and task
            // hand-overs), which the put and range probes above do not pay.
            let floor = report.contended.as_ref().and_then(|c| {
                c.baselines
                    .iter()
                    .find(|b| b.label == measure::PUT_RANGE_MUTEX_FLOOR)
            });
            if let (Some(c), Some(floor)) = (c, floor.filter(|f| f.acquisitions_per_s > 0.0)) {
                out.push(
                    Target::at_least(
                        "etcd (c) distlock / the harness floor (in-process lock, release = put + range), acquisitions/s",
                        c.acquisitions_per_s / floor.acquisitions_per_s,
                        0.9,
                    )
                    .with_cpu(
                        "CPU per acquisition: distlock / the harness floor",
                        c_cpu,
                        floor.cpu.total_us_per_cycle,
                        1.0 / 0.9,
                    ),
                );
            }
        }
        Engine::File { .. } => {
            if let (Some(d), Some(floor)) = (a_distlock, a_base) {
                if floor.latency.mean_us > 0.0 {
                    out.push(
                        Target::at_most(
                            format!("file (a) distlock cycle / {} cycle (mean)", floor.label),
                            d.latency.mean_us / floor.latency.mean_us,
                            1.15,
                        )
                        .with_cpu(
                            "CPU per cycle: distlock / the floor",
                            cpu(d),
                            cpu(floor),
                            1.15,
                        ),
                    );
                }
            }
            let shared = b.and_then(|b| b.shared.as_ref());
            let per_task = b.and_then(|b| b.per_task.as_ref());
            if let (Some(shared), Some(own)) = (shared, per_task.filter(|f| f.cycles_per_s > 0.0)) {
                out.push(
                    Target::at_least(
                        "file (b) one shared Locks / one Locks per task, cycles/s",
                        shared.cycles_per_s / own.cycles_per_s,
                        0.95,
                    )
                    .with_cpu(
                        "CPU per cycle: one shared Locks / one Locks per task",
                        cpu(shared),
                        cpu(own),
                        1.0 / 0.95,
                    ),
                );
            }
        }
        Engine::ZooKeeper { .. } => zookeeper_targets(&mut out, a_distlock, reference, others, c),
        _ => {}
    }
    kinds_targets(report, engine, &mut out);
    if let Some(hold) = &report.hold {
        hold_targets(hold, &mut out);
    }
    if let Some(c) = c {
        out.push(Target::at_most(
            "(c) share of re-acquisitions by the releasing task",
            c.same_holder_share,
            0.20,
        ));
        out.push(Target::at_least(
            "(c) fairness: min/max acquisitions per task",
            c.fairness_min_max,
            0.8,
        ));
    }
    out
}

/// Issue 9's "distlock / peer" rows on Redis: against the same-scripts loop (distlock's own scripts
/// by `EVALSHA`, nothing else: the client's overhead alone) and against rslock (the crate a Rust user
/// would pick instead), each in the direction the figure needs, with the CPU-per-cycle ratio beside
/// it (the one shared `Locks` / same-scripts row is in [`targets`]).
fn redis_peer_targets(report: &Report, out: &mut Vec<Target>) {
    fn find<'a>(list: &'a [report::CycleFigures], label: &str) -> Option<&'a report::CycleFigures> {
        list.iter()
            .find(|f| f.label == label)
            .filter(|f| f.cycles_per_s > 0.0 && f.latency.mean_us > 0.0)
    }
    if let Some(a) = &report.uncontended {
        if let Some(d) = &a.distlock {
            for (peer, what, cpu_what, limit) in [
                (
                    measure::SAME_SCRIPTS,
                    "Redis (a) distlock cycle / same-scripts loop cycle (mean)",
                    "CPU per cycle: distlock / same-scripts loop",
                    1.10,
                ),
                (
                    measure::RSLOCK_SINGLE,
                    "Redis (a) distlock cycle / rslock cycle (mean)",
                    "CPU per cycle: distlock / rslock",
                    1.0,
                ),
            ] {
                if let Some(p) = find(&a.baselines, peer) {
                    out.push(
                        Target::at_most(what, d.latency.mean_us / p.latency.mean_us, limit)
                            .with_cpu(cpu_what, cpu(d), cpu(p), limit),
                    );
                }
            }
        }
    }
    if let Some(b) = &report.many {
        for (ours, peer, what, cpu_what) in [
            (
                &b.per_task,
                measure::SAME_SCRIPTS_PER_TASK,
                "Redis (b) one Locks per task / same-scripts loop, a connection per task, cycles/s",
                "CPU per cycle: one Locks per task / same-scripts loop per task",
            ),
            (
                &b.shared,
                measure::RSLOCK_SHARED_MANAGER,
                "Redis (b) one shared Locks / rslock, one shared LockManager, cycles/s",
                "CPU per cycle: one shared Locks / rslock",
            ),
        ] {
            if let (Some(d), Some(p)) = (ours, find(&b.baselines, peer)) {
                out.push(
                    Target::at_least(what, d.cycles_per_s / p.cycles_per_s, 1.0).with_cpu(
                        cpu_what,
                        cpu(d),
                        cpu(p),
                        1.0,
                    ),
                );
            }
        }
    }
    if let Some(c) = &report.contended {
        let peer = c
            .baselines
            .iter()
            .find(|f| f.label == measure::RSLOCK_CONTENDED);
        if let (Some(d), Some(peer)) = (&c.distlock, peer) {
            if peer.acquisitions_per_s > 0.0 {
                out.push(
                    Target::at_least(
                        "Redis (c) distlock acquisitions/s / rslock's",
                        d.acquisitions_per_s / peer.acquisitions_per_s,
                        1.0,
                    )
                    .with_cpu(
                        "CPU per acquisition: distlock / rslock",
                        d.cpu.total_us_per_cycle,
                        peer.cpu.total_us_per_cycle,
                        1.0,
                    ),
                );
            }
        }
    }
}

/// Issue 25's targets: a read-lock cycle and a permit cycle each within 1.1× their same-layout bare
/// loop's, on Redis (distlock's own scripts by `EVALSHA`) and PostgreSQL's advisory mode (the bare
/// statements); other engines have no target.
fn kinds_targets(report: &Report, engine: &Engine, out: &mut Vec<Target>) {
    let engine_name = match engine {
        Engine::Redis(_) => "Redis",
        Engine::Postgres { advisory: true, .. } => "PostgreSQL",
        _ => return,
    };
    let Some(k) = &report.kinds else {
        return;
    };
    for (kind, section) in [("read-lock", &k.read), ("permit", &k.permit)] {
        let (Some(d), Some(base)) = (&section.distlock, section.baselines.first()) else {
            continue;
        };
        if base.latency.mean_us > 0.0 {
            out.push(
                Target::at_most(
                    format!(
                        "{engine_name} (kinds) distlock {kind} cycle / {} cycle (mean)",
                        base.label
                    ),
                    d.latency.mean_us / base.latency.mean_us,
                    1.10,
                )
                .with_cpu(
                    format!("CPU per {kind} cycle: distlock / the same-layout bare loop"),
                    cpu(d),
                    cpu(base),
                    1.10,
                ),
            );
        }
    }
}

/// Issue 9's watchdog-scale targets: one renewal round trip per connection (slot, session) per tick,
/// at most 2 KiB of resident memory per held lock, and no lock lost while held.
fn hold_targets(hold: &HoldSection, out: &mut Vec<Target>) {
    if let (Some(per_tick), Some(groups)) = (
        hold.renewals.round_trips_per_tick,
        hold.renewals.groups.filter(|g| *g > 0),
    ) {
        out.push(Target::at_most(
            "hold: renewal round trips per tick, per connection",
            per_tick / groups as f64,
            1.0,
        ));
    }
    if let Some(bytes) = hold.memory.per_lock_bytes {
        out.push(Target::at_most(
            "hold: resident memory per held lock, KiB (upper bound: RSS growth)",
            bytes / 1024.0,
            2.0,
        ));
    }
    out.push(Target::at_most(
        "hold: locks not Held at the end of the hold",
        hold.not_held as f64,
        0.0,
    ));
}

/// Issue 12's targets: a cycle within 2.5 parallel PING fan-outs and no slower than rslock; contended
/// handoff p99 under 50 ms, no wait over 2 s, fairness at least 0.5.
fn redlock_targets(report: &Report, out: &mut Vec<Target>) {
    let reference = report.round_trip.reference.as_ref();
    let rtt = reference.map(|p| &p.latency);
    let rtt_cpu = reference.and_then(|p| p.cpu.total_us_per_cycle);
    let a = report.uncontended.as_ref();
    if let (Some(d), Some(rtt)) = (a.and_then(|a| a.distlock.as_ref()), rtt) {
        if rtt.mean_us > 0.0 {
            out.push(
                Target::at_most(
                    "(a) distlock cycle, in parallel PING fan-outs (mean)",
                    d.latency.mean_us / rtt.mean_us,
                    2.5,
                )
                .with_cpu("CPU per cycle, in fan-outs' CPU", cpu(d), rtt_cpu, 2.5),
            );
        }
    }
    let peer = a.and_then(|a| a.baselines.first());
    if let (Some(d), Some(peer)) = (a.and_then(|a| a.distlock.as_ref()), peer) {
        if peer.latency.mean_us > 0.0 {
            out.push(
                Target::at_most(
                    "(a) distlock cycle / rslock cycle (mean)",
                    d.latency.mean_us / peer.latency.mean_us,
                    1.0,
                )
                .with_cpu(
                    "CPU per cycle: distlock / rslock",
                    cpu(d),
                    cpu(peer),
                    1.0,
                ),
            );
        }
    }
    if let Some(c) = report.contended.as_ref().and_then(|c| c.distlock.as_ref()) {
        out.push(Target::at_most(
            "(c) handoff p99, ms",
            c.handoff.p99_us / 1000.0,
            50.0,
        ));
        out.push(Target::at_most(
            "(c) longest wait, ms",
            c.wait.max_us / 1000.0,
            2000.0,
        ));
        out.push(Target::at_least(
            "(c) fairness: min/max acquisitions per task (Redlock)",
            c.fairness_min_max,
            0.5,
        ));
    }
}

/// Issue 10's targets: (a) the cycle against create + getChildren + delete (the last two probes are
/// getChildren and create + delete), (c) the handoff in creates.
fn zookeeper_targets(
    out: &mut Vec<Target>,
    a: Option<&report::CycleFigures>,
    create: Option<&report::Probe>,
    others: &[report::Probe],
    c: Option<&report::ContendedFigures>,
) {
    if let (Some(a), Some(children), Some(create_delete)) = (a, others.first(), others.get(1)) {
        let floor = children.latency.mean_us + create_delete.latency.mean_us;
        if floor > 0.0 {
            out.push(
                Target::at_most(
                    "(a) distlock cycle / (create + getChildren + delete) (mean)",
                    a.latency.mean_us / floor,
                    1.2,
                )
                .with_cpu(
                    "CPU per cycle / (getChildren's + create + delete's CPU)",
                    cpu(a),
                    sum(
                        children.cpu.total_us_per_cycle,
                        create_delete.cpu.total_us_per_cycle,
                    ),
                    1.2,
                ),
            );
        }
    }
    let create_cpu = create.and_then(|p| p.cpu.total_us_per_cycle);
    if let (Some(c), Some(create)) = (c, create.map(|p| &p.latency)) {
        if create.mean_us > 0.0 && c.handoff_to_other.n > 0 {
            out.push(
                Target::at_most(
                    "(c) handoff to another task p50, in creates",
                    c.handoff_to_other.p50_us / create.mean_us,
                    2.5,
                )
                .with_cpu(
                    "CPU per contended acquisition, in creates' CPU",
                    c.cpu.total_us_per_cycle,
                    create_cpu,
                    2.5,
                ),
            );
            out.push(Target::at_most(
                "(c) handoff to another task p99, in creates",
                c.handoff_to_other.p99_us / create.mean_us,
                10.0,
            ));
        }
    }
}
