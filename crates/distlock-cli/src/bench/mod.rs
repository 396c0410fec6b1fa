//! `distlock bench`: the three workloads of DESIGN §8, in the shapes the peers were measured with
//! (shared/reference/baseline.md), each beside the engine's own round trip and a bare-client
//! baseline measured in the same run.
//!
//! The measuring is generic over [`distlock::Locks`]; only the baselines know their engine.

mod engines;
mod harness;
mod progress;
mod report;
mod stats;

use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use distlock::Locks;

use crate::cli::{self, BenchArgs, Workload};
use crate::exit::{Code, Failure};
use engines::{
    etcd_connect, etcd_revoke, redis_connect, Distlock, Engine, EtcdLockRpc, EtcdPut, EtcdRange,
    FlockFloor, RedisBare, RedisPing,
};
use harness::{run_contended, run_cycles};
use progress::Progress;
use report::{
    ContendedFigures, ContendedSection, CycleFigures, Many, Probe, Report, RoundTrip, Target,
    Uncontended,
};

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

Each run also measures the engine's own round trip and reports every figure as a ratio to it \
(redis: PING on a multiplexed redis-rs connection; etcd: a put, and a range beside it), and runs a \
baseline beside distlock (redis: a bare SET NX PX + EVALSHA compare-and-delete loop; etcd: \
etcd's Lock/Unlock RPCs; file: a bare flock + unlock, the floor). memory:// and file:// have \
no engine round trip: their figures are absolute.

A progress bar shows on stderr when it is a terminal; the report goes to stdout (--json: one JSON \
object). Runs on a tokio multi-thread runtime with 2 workers, like the peers' measurements.";

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

/// What to run, checked.
#[derive(Debug)]
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
    /// Prefix of every name and key the run uses, unique to the run.
    run: String,
}

/// Runs `distlock bench`; `Ok` is the exit code.
pub async fn bench(args: BenchArgs) -> Result<i32, Failure> {
    if args.duration.is_zero() {
        return Err(Failure::new(Code::Usage, "--duration must be more than 0"));
    }
    let url = cli::lock_url(args.url.as_deref())?;
    let engine = Engine::from_url(&url)?;
    let all = args.workload == Workload::All;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let config = Config {
        url,
        engine,
        duration: args.duration,
        hold: args.hold,
        many_tasks: args.tasks.map_or(DEFAULT_MANY_TASKS, usize::from),
        contended_tasks: args.tasks.map_or(DEFAULT_CONTENDED_TASKS, usize::from),
        uncontended: all || args.workload == Workload::Uncontended,
        many: all || args.workload == Workload::Many,
        contended: all || args.workload == Workload::Contended,
        run: format!("{}-{nanos:08x}", std::process::id()),
    };
    let locks = if args.baseline_only {
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
    let measured = measure(&config, locks.as_ref(), &mut runner).await;
    runner.progress.finish();
    if let Some(locks) = &locks {
        // Dropped guards of a failed run release in the background; let that reach the server.
        let _ = tokio::time::timeout(CLOSE_LIMIT, locks.close()).await;
    }
    let report = measured?;

    let text = if args.json {
        let mut json = serde_json::to_string_pretty(&report).map_err(|e| {
            Failure::new(Code::Unavailable, format!("cannot encode the report: {e}"))
        })?;
        json.push('\n');
        json
    } else {
        report::render(&report)
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(Failure::new(
            Code::Unavailable,
            format!("cannot write the report: {e}"),
        )),
    }
}

/// How many measurements [`measure`] makes, for the progress bar.
fn count_steps(config: &Config, with_distlock: bool) -> usize {
    let d = usize::from(with_distlock);
    let (rtt, a, b, c) = match config.engine {
        Engine::Redis(_) => (1, 1, 2, 0),
        Engine::Etcd { .. } => (2, 1, 1, 1),
        Engine::File { sync, .. } => (0, 1 + usize::from(sync), 1, 0),
        Engine::Memory | Engine::Unmeasured { .. } => (0, 0, 0, 0),
    };
    rtt + usize::from(config.uncontended) * (d + a)
        + usize::from(config.many) * (2 * d + b)
        + usize::from(config.contended) * (d + c)
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

/// Live connections of the engine baselines.
enum Baseline {
    None,
    Redis {
        info: Box<redis::ConnectionInfo>,
        conn: redis::aio::MultiplexedConnection,
    },
    Etcd {
        config: Box<distlock::etcd::EtcdConfig>,
        client: Box<distlock::etcd::rpc::Client>,
    },
    File {
        dir: std::path::PathBuf,
        sync: bool,
    },
}

async fn measure(
    config: &Config,
    locks: Option<&Locks>,
    runner: &mut Runner,
) -> Result<Report, Failure> {
    let d = config.duration;
    let run = &config.run;
    let (baseline, round_trip) = round_trip(config, runner).await?;

    let uncontended = if config.uncontended {
        let mut baselines = Vec::new();
        match &baseline {
            Baseline::Redis { conn, .. } => {
                runner.step("(a) bare SET NX PX + EVALSHA loop");
                let bare = RedisBare::new(conn.clone(), format!("distlock-bench-bare/{run}/a"));
                let cycles = run_cycles(vec![bare], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(
                    "bare SET NX PX + EVALSHA (redis-rs)",
                    &cycles,
                    &round_trip,
                ));
            }
            Baseline::Etcd { client, .. } => {
                runner.step("(a) etcd Lock/Unlock RPC");
                let peer =
                    EtcdLockRpc::new((**client).clone(), format!("distlock-bench-peer/{run}/a"))
                        .await?;
                let lease = peer.lease();
                let cycles = run_cycles(vec![peer], WARMUP_ONE, d).await;
                etcd_revoke(vec![lease]).await;
                baselines.push(CycleFigures::new(
                    "etcd Lock/Unlock RPC",
                    &cycles?,
                    &round_trip,
                ));
            }
            Baseline::File { dir, sync } => {
                // The synced floor first: it is what the backend's default (sync on) compares to.
                for sync in [*sync, false].into_iter().take(1 + usize::from(*sync)) {
                    let label = floor_label(sync);
                    runner.step(&format!("(a) {label}"));
                    let path = dir.join(format!(".distlock-bench-floor-{run}-a"));
                    let cycles =
                        run_cycles(vec![FlockFloor::new(path, sync)?], WARMUP_ONE, d).await?;
                    baselines.push(CycleFigures::new(label, &cycles, &round_trip));
                }
            }
            Baseline::None => {}
        }
        let distlock = match locks {
            Some(locks) => {
                runner.step("(a) distlock, uncontended");
                let lock = locks.lock(&format!("distlock-bench/{run}/a"))?;
                let cycles = run_cycles(vec![Distlock { lock }], WARMUP_ONE, d).await?;
                Some(CycleFigures::new("distlock", &cycles, &round_trip))
            }
            None => None,
        };
        Some(Uncontended {
            distlock,
            baselines,
        })
    } else {
        None
    };

    let many = if config.many {
        let n = config.many_tasks;
        let (mut shared, mut per_task) = (None, None);
        if let Some(locks) = locks {
            runner.step("(b) distlock, one shared Locks");
            let clients = (0..n)
                .map(|i| {
                    Ok(Distlock {
                        lock: locks.lock(&format!("distlock-bench/{run}/b-shared/{i}"))?,
                    })
                })
                .collect::<Result<Vec<_>, Failure>>()?;
            let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
            shared = Some(CycleFigures::new(
                "distlock, one shared Locks",
                &cycles,
                &round_trip,
            ));

            runner.step("(b) distlock, one Locks per task");
            let mut own = Vec::with_capacity(n);
            let mut clients = Vec::with_capacity(n);
            for i in 0..n {
                let locks = distlock::connect(&config.url).await?;
                clients.push(Distlock {
                    lock: locks.lock(&format!("distlock-bench/{run}/b-own/{i}"))?,
                });
                own.push(locks);
            }
            let cycles = run_cycles(clients, WARMUP_MANY, d).await;
            for locks in &own {
                let _ = tokio::time::timeout(CLOSE_LIMIT, locks.close()).await;
            }
            per_task = Some(CycleFigures::new(
                "distlock, one Locks per task",
                &cycles?,
                &round_trip,
            ));
        }
        let mut baselines = Vec::new();
        match &baseline {
            Baseline::Redis { info, conn } => {
                runner.step("(b) bare loop, one connection per task");
                let mut clients = Vec::with_capacity(n);
                for i in 0..n {
                    let key = format!("distlock-bench-bare/{run}/b-own/{i}");
                    clients.push(RedisBare::new(redis_connect(info).await?, key));
                }
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(
                    "bare loop, one connection per task",
                    &cycles,
                    &round_trip,
                ));

                runner.step("(b) bare loop, one shared connection");
                let clients = (0..n)
                    .map(|i| {
                        RedisBare::new(
                            conn.clone(),
                            format!("distlock-bench-bare/{run}/b-shared/{i}"),
                        )
                    })
                    .collect();
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(
                    "bare loop, one shared connection",
                    &cycles,
                    &round_trip,
                ));
            }
            Baseline::Etcd {
                config: etcd_config,
                ..
            } => {
                runner.step("(b) etcd Lock RPC, one client per task");
                let mut clients = Vec::with_capacity(n);
                for i in 0..n {
                    let client = etcd_connect(etcd_config).await?;
                    let name = format!("distlock-bench-peer/{run}/b/{i}");
                    clients.push(EtcdLockRpc::new(client, name).await?);
                }
                let leases = clients.iter().map(EtcdLockRpc::lease).collect();
                let cycles = run_cycles(clients, WARMUP_MANY, d).await;
                etcd_revoke(leases).await;
                baselines.push(CycleFigures::new(
                    "etcd Lock RPC, one client per task",
                    &cycles?,
                    &round_trip,
                ));
            }
            Baseline::File { dir, sync } => {
                let label = format!("{}, one file per task", floor_label(*sync));
                runner.step(&format!("(b) {label}"));
                let clients = (0..n)
                    .map(|i| {
                        let path = dir.join(format!(".distlock-bench-floor-{run}-b{i}"));
                        FlockFloor::new(path, *sync)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(label, &cycles, &round_trip));
            }
            Baseline::None => {}
        }
        Some(Many {
            tasks: n,
            shared,
            per_task,
            baselines,
        })
    } else {
        None
    };

    let contended = if config.contended {
        let n = config.contended_tasks;
        let distlock = match locks {
            Some(locks) => {
                runner.step("(c) distlock, contended");
                let name = format!("distlock-bench/{run}/c");
                let clients = (0..n)
                    .map(|_| {
                        Ok(Distlock {
                            lock: locks.lock(&name)?,
                        })
                    })
                    .collect::<Result<Vec<_>, Failure>>()?;
                let result = run_contended(clients, config.hold, d).await?;
                Some(ContendedFigures::new("distlock", &result, &round_trip))
            }
            None => None,
        };
        let mut baselines = Vec::new();
        if let Baseline::Etcd {
            config: etcd_config,
            ..
        } = &baseline
        {
            runner.step("(c) etcd Lock RPC, contended");
            let name = format!("distlock-bench-peer/{run}/c");
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                let client = etcd_connect(etcd_config).await?;
                clients.push(EtcdLockRpc::new(client, name.clone()).await?);
            }
            let leases = clients.iter().map(EtcdLockRpc::lease).collect();
            let result = run_contended(clients, config.hold, d).await;
            etcd_revoke(leases).await;
            baselines.push(ContendedFigures::new(
                "etcd Lock RPC, one client per task",
                &result?,
                &round_trip,
            ));
        }
        // Nothing to show (--baseline-only where the engine has no contended peer).
        (distlock.is_some() || !baselines.is_empty()).then_some(ContendedSection {
            tasks: n,
            hold_us: config.hold.as_secs_f64() * 1e6,
            distlock,
            baselines,
        })
    } else {
        None
    };

    if let Baseline::Etcd { client, .. } = &baseline {
        let _ = client
            .delete_range(distlock::etcd::rpc::pb::etcdserverpb::DeleteRangeRequest {
                key: format!("distlock-bench-rtt/{run}").into_bytes(),
                ..Default::default()
            })
            .await;
    }

    let mut report = Report {
        url: distlock::url::redact(&config.url),
        backend: locks.map_or_else(
            || config.url.split("://").next().unwrap_or("").to_string(),
            |l| l.backend_kind().to_string(),
        ),
        duration_s: config.duration.as_secs_f64(),
        runtime_workers: WORKERS,
        round_trip,
        uncontended,
        many,
        contended,
        targets: Vec::new(),
    };
    report.targets = targets(&report, &config.engine);
    Ok(report)
}

fn floor_label(sync: bool) -> &'static str {
    if sync {
        "bare flock + write + fdatasync + unlock"
    } else {
        "bare flock + unlock"
    }
}

/// Connects the baselines and measures the engine's round trip.
async fn round_trip(
    config: &Config,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Failure> {
    let d = config.duration;
    let none = |note: &str| RoundTrip {
        reference: None,
        others: Vec::new(),
        note: Some(note.to_string()),
    };
    Ok(match &config.engine {
        Engine::Memory => (Baseline::None, none("no engine round trip")),
        Engine::File { dir, sync } => (
            Baseline::File {
                dir: dir.clone(),
                sync: *sync,
            },
            none("no engine round trip"),
        ),
        Engine::Unmeasured { reason } => (
            Baseline::None,
            none(&format!("not measured ({reason}); absolute figures only")),
        ),
        Engine::Redis(info) => {
            let conn = redis_connect(info).await?;
            runner.step("PING round trip");
            let ping = run_cycles(vec![RedisPing { conn: conn.clone() }], WARMUP_ONE, d).await?;
            (
                Baseline::Redis {
                    info: info.clone(),
                    conn,
                },
                RoundTrip {
                    reference: Some(Probe::new("PING (redis-rs, multiplexed connection)", &ping)),
                    others: Vec::new(),
                    note: None,
                },
            )
        }
        Engine::Etcd {
            config: etcd_config,
        } => {
            let client = etcd_connect(etcd_config).await?;
            let key = format!("distlock-bench-rtt/{}", config.run);
            runner.step("put round trip");
            let put = EtcdPut {
                client: client.clone(),
                key: key.clone(),
            };
            let put = run_cycles(vec![put], WARMUP_MANY, d).await?;
            runner.step("range round trip");
            let range = EtcdRange {
                client: client.clone(),
                key,
            };
            let range = run_cycles(vec![range], WARMUP_MANY, d).await?;
            (
                Baseline::Etcd {
                    config: etcd_config.clone(),
                    client: Box::new(client),
                },
                RoundTrip {
                    reference: Some(Probe::new("put (raw gRPC client)", &put)),
                    others: vec![Probe::new("range, linearizable (raw gRPC client)", &range)],
                    note: None,
                },
            )
        }
    })
}

/// The targets of issues 3 (Redis) and 4 (etcd), and the fairness ones every backend can meet with
/// the local FIFO (DESIGN §3), computed from the run.
fn targets(report: &Report, engine: &Engine) -> Vec<Target> {
    let mut out = Vec::new();
    let rtt = report.round_trip.reference.as_ref().map(|p| &p.latency);
    let others = &report.round_trip.others;
    let a = report.uncontended.as_ref();
    let a_distlock = a.and_then(|a| a.distlock.as_ref());
    let a_base = a.and_then(|a| a.baselines.first());
    let b = report.many.as_ref();
    let c = report.contended.as_ref().and_then(|c| c.distlock.as_ref());
    match engine {
        Engine::Redis(_) => {
            if let (Some(d), Some(base)) = (a_distlock, a_base) {
                if base.latency.mean_us > 0.0 {
                    out.push(Target::at_most(
                        "(a) distlock cycle / bare loop cycle (mean)",
                        d.latency.mean_us / base.latency.mean_us,
                        1.10,
                    ));
                }
            }
            if let Some(b) = b {
                let base = b.baselines.first().filter(|f| f.cycles_per_s > 0.0);
                for (what, figures) in [
                    (
                        "(b) distlock one shared Locks / bare loop, cycles/s",
                        &b.shared,
                    ),
                    (
                        "(b) distlock one Locks per task / bare loop, cycles/s",
                        &b.per_task,
                    ),
                ] {
                    if let (Some(f), Some(base)) = (figures, base) {
                        out.push(Target::at_least(
                            what,
                            f.cycles_per_s / base.cycles_per_s,
                            1.0,
                        ));
                    }
                }
            }
            if let (Some(c), Some(rtt)) = (c, rtt) {
                if rtt.mean_us > 0.0 && c.handoff_to_other.n > 0 {
                    out.push(Target::at_most(
                        "(c) handoff to another task p50, in PING round trips",
                        c.handoff_to_other.p50_us / rtt.mean_us,
                        4.0,
                    ));
                }
            }
        }
        Engine::Etcd { .. } => {
            if let (Some(d), Some(rtt)) = (a_distlock, rtt) {
                if rtt.mean_us > 0.0 {
                    out.push(Target::at_most(
                        "(a) distlock cycle, in put round trips (mean)",
                        d.latency.mean_us / rtt.mean_us,
                        2.2,
                    ));
                }
            }
            if let (Some(c), Some(put), Some(range)) = (c, rtt, others.first()) {
                let floor_us = c.mean_hold_us + put.mean_us + range.latency.mean_us;
                if floor_us > 0.0 {
                    out.push(Target::at_least(
                        "(c) acquisitions/s / (1 / (hold + put + range))",
                        c.acquisitions_per_s * floor_us / 1e6,
                        0.9,
                    ));
                }
            }
        }
        _ => {}
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
