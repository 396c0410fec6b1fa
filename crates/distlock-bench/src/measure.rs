//! The measurements of one run, in order: the engine's round trip, then each workload's distlock
//! figures beside its engine baselines.

use distlock::etcd::EtcdConfig;
use distlock::Locks;
use distlock_etcd::rpc::pb::etcdserverpb::DeleteRangeRequest;
use distlock_etcd::rpc::Client as EtcdClient;

use crate::cpu::ServerCpu;
use crate::engines::{
    etcd_connect, etcd_revoke, Distlock, Engine, EtcdLockRpc, EtcdPut, EtcdPutRangeMutex,
    EtcdRange, FlockFloor, RedisBare, RedisPing, RedisPingMutex, RedisServer,
};
use crate::harness::{run_contended, run_cycles, Plan};
use crate::redlock::{rslock_uris, RedlockPing, Rslock};
use crate::report::{
    ContendedFigures, ContendedSection, CycleFigures, Many, Probe, Report, RoundTrip, Uncontended,
};
use crate::report::{PRIMARY_FIGURE, PRIMARY_NOTE};
use crate::{targets, Config, Error, Only, Runner, WARMUP_MANY, WARMUP_ONE, WORKERS};

/// Live connections of the engine baselines.
pub(crate) enum Baseline {
    None,
    Redis {
        server: Box<RedisServer>,
        conn: redis::aio::MultiplexedConnection,
    },
    Etcd {
        config: Box<EtcdConfig>,
        client: Box<EtcdClient>,
    },
    File {
        dir: std::path::PathBuf,
        sync: bool,
    },
    /// rslock's node URIs.
    Redlock {
        uris: Vec<String>,
    },
    Postgres {
        url: String,
    },
    Mysql {
        url: String,
    },
}

/// What every measurement of a run needs.
pub(crate) struct Run<'a> {
    pub(crate) config: &'a Config,
    pub(crate) plan: Plan<'a>,
    pub(crate) locks: Option<&'a Locks>,
    pub(crate) baseline: &'a Baseline,
    pub(crate) round_trip: &'a RoundTrip,
}

/// Measures the engine's round trip and the workloads the config asks for.
pub(crate) async fn measure(
    config: &Config,
    locks: Option<&Locks>,
    runner: &mut Runner,
) -> Result<Report, Error> {
    let cpu = ServerCpu::resolve(&config.engine).await;
    let plan = Plan {
        duration: config.duration,
        cycles: config.cycles,
        cpu: &cpu,
    };
    let (mut baseline, round_trip) = round_trip(config, plan, runner).await?;
    if config.only == Some(Only::Distlock) {
        baseline = Baseline::None;
    }
    let run = Run {
        config,
        plan,
        locks,
        baseline: &baseline,
        round_trip: &round_trip,
    };
    let uncontended = match config.uncontended {
        true => Some(run.uncontended(runner).await?),
        false => None,
    };
    let many = match config.many {
        true => Some(run.many(runner).await?),
        false => None,
    };
    let contended = match config.contended {
        true => run.contended(runner).await?,
        false => None,
    };
    let kinds = match config.kinds {
        true => Some(run.kinds(runner).await?),
        false => None,
    };
    let hold = match config.hold_workload {
        true => Some(run.hold(runner).await?),
        false => None,
    };
    let sweep = match config.sweep {
        true => Some(run.sweep(runner).await?),
        false => None,
    };
    let herd = match (&config.engine, config.herd_workload) {
        (Engine::Redis(server), true) => {
            runner.step("herd: distlock run processes on one name");
            Some(
                crate::herd::herd(
                    server,
                    &config.url,
                    &format!("distlock-bench/{}/herd", config.run),
                    config.herd_processes,
                )
                .await?,
            )
        }
        _ => None,
    };
    if let Baseline::Etcd { client, .. } = &baseline {
        let _ = client
            .delete_range(DeleteRangeRequest {
                key: format!("distlock-bench-rtt/{}", config.run).into_bytes(),
                ..DeleteRangeRequest::default()
            })
            .await;
    }

    let mut report = Report {
        url: distlock_core::url::redact(&config.url),
        backend: locks.map_or_else(
            || config.url.split("://").next().unwrap_or("").to_string(),
            |l| l.backend_kind().to_string(),
        ),
        duration_s: config.duration.as_secs_f64(),
        runtime_workers: WORKERS,
        primary_figure: PRIMARY_FIGURE,
        primary_note: PRIMARY_NOTE,
        server_cpu_source: cpu.source().to_string(),
        round_trip,
        uncontended,
        many,
        contended,
        kinds,
        sweep,
        hold,
        herd,
        targets: Vec::new(),
    };
    report.targets = targets(&report, &config.engine);
    Ok(report)
}

impl Run<'_> {
    /// Whether a workload runs its baselines beyond the first: not with `--only baselines`, which
    /// measures the first one alone (the bare loop on Redis, the synced floor on file) for
    /// `scripts/callgrind.sh`. A baseline added after the first of its workload checks this.
    fn more_baselines(&self) -> bool {
        self.config.only != Some(Only::Baselines)
    }

    /// (a): the baselines first, then distlock.
    async fn uncontended(&self, runner: &mut Runner) -> Result<Uncontended, Error> {
        let baselines = self.uncontended_baselines(runner).await?;
        let distlock = match self.locks {
            Some(locks) => {
                runner.step("(a) distlock, uncontended");
                let lock = locks.lock(&format!("distlock-bench/{}/a", self.config.run))?;
                let cycles = run_cycles(vec![Distlock { lock }], WARMUP_ONE, self.plan).await?;
                Some(CycleFigures::new("distlock", &cycles, self.round_trip))
            }
            None => None,
        };
        Ok(Uncontended {
            distlock,
            baselines,
        })
    }

    async fn uncontended_baselines(&self, runner: &mut Runner) -> Result<Vec<CycleFigures>, Error> {
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        let mut baselines = Vec::new();
        match self.baseline {
            Baseline::Redis { conn, .. } => {
                runner.step("(a) bare SET NX PX + EVALSHA loop");
                let bare = RedisBare::new(conn.clone(), format!("distlock-bench-bare/{run}/a"));
                let cycles = run_cycles(vec![bare], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(BARE_LOOP, &cycles, rtt));
                if self.more_baselines() {
                    baselines.extend(self.redis_peers_uncontended(runner).await?);
                }
            }
            Baseline::Etcd { client, .. } => {
                runner.step("(a) etcd Lock/Unlock RPC");
                let peer =
                    EtcdLockRpc::new((**client).clone(), format!("distlock-bench-peer/{run}/a"))
                        .await?;
                let lease = peer.lease();
                let cycles = run_cycles(vec![peer], WARMUP_ONE, d).await;
                etcd_revoke(vec![lease]).await;
                baselines.push(CycleFigures::new("etcd Lock/Unlock RPC", &cycles?, rtt));
            }
            Baseline::Redlock { uris } => {
                runner.step("(a) rslock");
                let peer = Rslock::new(uris, format!("distlock-bench-peer/{run}/a"));
                let cycles = run_cycles(vec![peer], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new("rslock (same nodes)", &cycles, rtt));
            }
            Baseline::Postgres { url } => {
                runner.step("(a) bare pg_advisory_lock + pg_advisory_unlock");
                let bare = crate::postgres::BarePair::new(url, bench_key(run, "a")).await?;
                let cycles = run_cycles(vec![bare], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(
                    "bare pg_advisory_lock + unlock (tokio-postgres)",
                    &cycles,
                    rtt,
                ));
                // Second: the like-for-like peer of the advisory mode, which commits a counter.
                runner.step("(a) bare advisory pair + one counter commit");
                let name = format!("distlock-bench-bare/{run}/a");
                let fenced =
                    crate::postgres::BarePair::fenced(url, bench_key(run, "a"), &name).await?;
                let cycles = run_cycles(vec![fenced], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(FENCED_PAIR, &cycles, rtt));
            }
            Baseline::Mysql { url } => {
                runner.step("(a) bare GET_LOCK + RELEASE_LOCK");
                let key = crate::mysql::bench_key(run, "a");
                let bare = crate::mysql::BarePair::new(url, key.clone()).await?;
                let cycles = run_cycles(vec![bare], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(
                    "bare GET_LOCK + RELEASE_LOCK (mysql_async)",
                    &cycles,
                    rtt,
                ));
                runner.step("(a) bare GET_LOCK pair + one counter commit");
                let fenced = crate::mysql::BarePair::fenced(url, key).await?;
                let cycles = run_cycles(vec![fenced], WARMUP_ONE, d).await?;
                baselines.push(CycleFigures::new(FENCED_PAIR, &cycles, rtt));
            }
            Baseline::File { dir, sync } => {
                // The synced floor first: it is what the backend's default (sync on) compares to.
                let floors = 1 + usize::from(*sync && self.more_baselines());
                for sync in [*sync, false].into_iter().take(floors) {
                    let label = floor_label(sync);
                    runner.step(&format!("(a) {label}"));
                    let path = dir.join(format!(".distlock-bench-floor-{run}-a"));
                    let cycles =
                        run_cycles(vec![FlockFloor::new(path, sync)?], WARMUP_ONE, d).await?;
                    baselines.push(CycleFigures::new(label, &cycles, rtt));
                }
            }
            Baseline::None => {}
        }
        Ok(baselines)
    }

    /// (b): distlock with one shared `Locks`, then one per task, then the baselines.
    async fn many(&self, runner: &mut Runner) -> Result<Many, Error> {
        let (shared, per_task) = match self.locks {
            Some(locks) => (
                Some(self.many_shared(locks, runner).await?),
                Some(self.many_per_task(runner).await?),
            ),
            None => (None, None),
        };
        Ok(Many {
            tasks: self.config.many_tasks,
            shared,
            per_task,
            baselines: self.many_baselines(runner).await?,
        })
    }

    pub(crate) async fn many_shared(
        &self,
        locks: &Locks,
        runner: &mut Runner,
    ) -> Result<CycleFigures, Error> {
        runner.step("(b) distlock, one shared Locks");
        let run = &self.config.run;
        let clients = (0..self.config.many_tasks)
            .map(|i| {
                Ok(Distlock {
                    lock: locks.lock(&format!("distlock-bench/{run}/b-shared/{i}"))?,
                })
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let cycles = run_cycles(clients, WARMUP_MANY, self.plan).await?;
        Ok(CycleFigures::new(
            "distlock, one shared Locks",
            &cycles,
            self.round_trip,
        ))
    }

    pub(crate) async fn many_per_task(&self, runner: &mut Runner) -> Result<CycleFigures, Error> {
        runner.step("(b) distlock, one Locks per task");
        let (n, run) = (self.config.many_tasks, &self.config.run);
        let mut own = Vec::with_capacity(n);
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let locks = distlock::connect(&self.config.url).await?;
            clients.push(Distlock {
                lock: locks.lock(&format!("distlock-bench/{run}/b-own/{i}"))?,
            });
            own.push(locks);
        }
        let cycles = run_cycles(clients, WARMUP_MANY, self.plan).await;
        for locks in &own {
            let _ = tokio::time::timeout(crate::CLOSE_LIMIT, locks.close()).await;
        }
        Ok(CycleFigures::new(
            "distlock, one Locks per task",
            &cycles?,
            self.round_trip,
        ))
    }

    pub(crate) async fn many_baselines(
        &self,
        runner: &mut Runner,
    ) -> Result<Vec<CycleFigures>, Error> {
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        let n = self.config.many_tasks;
        let mut baselines = Vec::new();
        match self.baseline {
            Baseline::Redis { server, conn } => {
                runner.step("(b) bare loop, one connection per task");
                let mut clients = Vec::with_capacity(n);
                for i in 0..n {
                    let key = format!("distlock-bench-bare/{run}/b-own/{i}");
                    clients.push(RedisBare::new(server.connect().await?, key));
                }
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(BARE_LOOP_PER_TASK, &cycles, rtt));

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
                    rtt,
                ));
                if self.more_baselines() {
                    baselines.extend(self.redis_peers_many(runner).await?);
                }
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
                    rtt,
                ));
            }
            Baseline::Redlock { uris } => {
                runner.step("(b) rslock, one LockManager per task");
                let clients = (0..n)
                    .map(|i| Rslock::new(uris, format!("distlock-bench-peer/{run}/b/{i}")))
                    .collect();
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(
                    "rslock, one LockManager per task",
                    &cycles,
                    rtt,
                ));
            }
            Baseline::Postgres { url } => {
                runner.step("(b) bare advisory pair, one connection per task");
                let mut clients = Vec::with_capacity(n);
                for i in 0..n {
                    clients.push(
                        crate::postgres::BarePair::new(url, bench_key(run, &format!("b{i}")))
                            .await?,
                    );
                }
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                baselines.push(CycleFigures::new(
                    "bare advisory pair, one connection per task",
                    &cycles,
                    rtt,
                ));
            }
            Baseline::Mysql { url } => {
                runner.step("(b) bare GET_LOCK pair, one connection per task");
                let mut clients = Vec::with_capacity(n);
                for i in 0..n {
                    let key = crate::mysql::bench_key(run, &format!("b{i}"));
                    clients.push(crate::mysql::BarePair::new(url, key).await?);
                }
                let cycles = run_cycles(clients, WARMUP_MANY, d).await?;
                let label = "bare GET_LOCK pair, one connection per task";
                baselines.push(CycleFigures::new(label, &cycles, rtt));
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
                baselines.push(CycleFigures::new(label, &cycles, rtt));
            }
            Baseline::None => {}
        }
        Ok(baselines)
    }

    /// (c): distlock, then the engine's peer where it has one; `None` when there is nothing to show
    /// (`--baseline-only` where the engine has no contended peer).
    async fn contended(&self, runner: &mut Runner) -> Result<Option<ContendedSection>, Error> {
        let (n, d, hold) = (self.config.contended_tasks, self.plan, self.config.hold);
        let distlock = match self.locks {
            Some(locks) => {
                runner.step("(c) distlock, contended");
                let name = format!("distlock-bench/{}/c", self.config.run);
                let clients = (0..n)
                    .map(|_| {
                        Ok(Distlock {
                            lock: locks.lock(&name)?,
                        })
                    })
                    .collect::<Result<Vec<_>, Error>>()?;
                let result = run_contended(clients, hold, d).await?;
                Some(ContendedFigures::new("distlock", &result, self.round_trip))
            }
            None => None,
        };
        let mut baselines = Vec::new();
        if let Baseline::Etcd {
            config: etcd_config,
            ..
        } = self.baseline
        {
            runner.step("(c) etcd Lock RPC, contended");
            let name = format!("distlock-bench-peer/{}/c", self.config.run);
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                let client = etcd_connect(etcd_config).await?;
                clients.push(EtcdLockRpc::new(client, name.clone()).await?);
            }
            let leases = clients.iter().map(EtcdLockRpc::lease).collect();
            let result = run_contended(clients, hold, d).await;
            etcd_revoke(leases).await;
            baselines.push(ContendedFigures::new(
                "etcd Lock RPC, one client per task",
                &result?,
                self.round_trip,
            ));
        }
        if let Baseline::Etcd { client, .. } = self.baseline {
            runner.step("(c) floor: in-process mutex, release = one put + one range, contended");
            let lock = std::sync::Arc::new(tokio::sync::Mutex::new(()));
            // The round-trip probes' key: the bench leaves no other key behind.
            let key = format!("distlock-bench-rtt/{}", self.config.run);
            let clients = (0..n)
                .map(|_| EtcdPutRangeMutex {
                    client: (**client).clone(),
                    key: key.clone(),
                    lock: lock.clone(),
                })
                .collect();
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                PUT_RANGE_MUTEX_FLOOR,
                &result,
                self.round_trip,
            ));
        }
        if let Baseline::Redlock { uris } = self.baseline {
            runner.step("(c) rslock, contended");
            let name = format!("distlock-bench-peer/{}/c", self.config.run);
            let clients = (0..n).map(|_| Rslock::new(uris, name.clone())).collect();
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                "rslock, one LockManager per task",
                &result,
                self.round_trip,
            ));
        }
        if let Baseline::Redis { conn, .. } = self.baseline {
            runner.step("(c) floor: in-process mutex, release = one PING, contended");
            let lock = std::sync::Arc::new(tokio::sync::Mutex::new(()));
            let clients = (0..n)
                .map(|_| RedisPingMutex {
                    conn: conn.clone(),
                    lock: lock.clone(),
                })
                .collect();
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                PING_MUTEX_FLOOR,
                &result,
                self.round_trip,
            ));
        }
        if let (Baseline::Redis { .. }, true) = (self.baseline, self.more_baselines()) {
            baselines.push(self.redis_rslock_contended(runner).await?);
        }
        if let Baseline::Postgres { url } = self.baseline {
            runner.step("(c) bare advisory pair, contended");
            let key = bench_key(&self.config.run, "c");
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                clients.push(crate::postgres::BarePair::new(url, key).await?);
            }
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                "bare advisory pair, one connection per task",
                &result,
                self.round_trip,
            ));
            runner.step("(c) bare advisory pair + one counter commit, contended");
            let name = format!("distlock-bench-bare/{}/c", self.config.run);
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                clients.push(crate::postgres::BarePair::fenced(url, key, &name).await?);
            }
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                FENCED_PAIR_CONTENDED,
                &result,
                self.round_trip,
            ));
        }
        if let Baseline::Mysql { url } = self.baseline {
            runner.step("(c) bare GET_LOCK pair, contended");
            let key = crate::mysql::bench_key(&self.config.run, "c");
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                clients.push(crate::mysql::BarePair::new(url, key.clone()).await?);
            }
            let result = run_contended(clients, hold, d).await?;
            let label = "bare GET_LOCK pair, one connection per task";
            baselines.push(ContendedFigures::new(label, &result, self.round_trip));
            runner.step("(c) bare GET_LOCK pair + one counter commit, contended");
            let mut clients = Vec::with_capacity(n);
            for _ in 0..n {
                clients.push(crate::mysql::BarePair::fenced(url, key.clone()).await?);
            }
            let result = run_contended(clients, hold, d).await?;
            baselines.push(ContendedFigures::new(
                FENCED_PAIR_CONTENDED,
                &result,
                self.round_trip,
            ));
        }
        Ok(
            (distlock.is_some() || !baselines.is_empty()).then_some(ContendedSection {
                tasks: n,
                hold_us: hold.as_secs_f64() * 1e6,
                distlock,
                baselines,
            }),
        )
    }
}

/// The label of Redis's bare loop (`SET NX PX` + `EVALSHA` compare-and-delete) in (a).
pub(crate) const BARE_LOOP: &str = "bare SET NX PX + EVALSHA (redis-rs)";
/// The label of Redis's bare loop with a connection per task in (b), the peer of one `Locks` per task.
pub(crate) const BARE_LOOP_PER_TASK: &str = "bare loop, one connection per task";
/// The label of Redis's loop of distlock's own scripts (acquire and release, `EVALSHA`) on one shared
/// multiplexed connection in (b), the peer of one shared `Locks` (issue 9's target ≥ 0.9). The
/// target row appears when a baseline with this label is in the report.
pub(crate) const SAME_SCRIPTS_SHARED: &str =
    "same scripts as distlock (EVALSHA), one shared connection";

/// The label of the SQL baselines' second peer: the bare advisory pair plus one fencing-counter commit
/// after each lock. distlock's advisory mode always commits its counter before it reports a grant, so
/// its targets compare with this peer (the "+ one commit when fenced").
pub(crate) const FENCED_PAIR: &str = "bare advisory pair + one counter commit (autocommit upsert)";
/// The label of PostgreSQL's second round trip: one conditional `UPDATE` (autocommit), the peer of
/// the lease mode's cycle target.
pub(crate) const CONDITIONAL_UPDATE: &str = "one conditional UPDATE (autocommit, simple query)";
/// [`FENCED_PAIR`] in the contended workload.
pub(crate) const FENCED_PAIR_CONTENDED: &str =
    "bare advisory pair + one counter commit, one connection per task";

/// Issue 9's fair Redis baseline in (a): a bare loop of distlock's own acquire and release scripts by
/// `EVALSHA` (the same-scripts loop, [`SAME_SCRIPTS_SHARED`] in (b)), one task.
pub(crate) const SAME_SCRIPTS: &str = "same scripts as distlock (EVALSHA)";
/// The same-scripts loop in (b), a connection per task (the peer of one `Locks` per task).
pub(crate) const SAME_SCRIPTS_PER_TASK: &str =
    "same scripts as distlock (EVALSHA), one connection per task";
/// rslock, the Rust peer, on the one Redis server, in (a).
pub(crate) const RSLOCK_SINGLE: &str = "rslock (same server)";
/// rslock in (b): every task on one `LockManager` (one multiplexed connection), the peer of one
/// shared `Locks`.
pub(crate) const RSLOCK_SHARED_MANAGER: &str = "rslock, one shared LockManager";
/// The harness's floor in (c) on Redis ([`RedisPingMutex`]): the same tasks, hold and handoff
/// measurement with an in-process FIFO lock whose release is one `PING` on the shared connection,
/// then the unlock. distlock's handoff is one request too, so its (c) figures beside this row say how
/// much of the handoff is the harness and the scheduler, and how much distlock's.
pub(crate) const PING_MUTEX_FLOOR: &str =
    "floor: in-process tokio Mutex, release = one PING then unlock, one shared connection";
/// The harness's floor in (c) on etcd ([`EtcdPutRangeMutex`]): an in-process FIFO lock whose release
/// is one put and one range, then the unlock: the (c) target's `hold + put + range` in this harness.
pub(crate) const PUT_RANGE_MUTEX_FLOOR: &str =
    "floor: in-process tokio Mutex, release = one put + one range then unlock, one shared client";
/// rslock in (c): one `LockManager` (so one connection) per task.
pub(crate) const RSLOCK_CONTENDED: &str = "rslock, one LockManager per task";

/// A key for the bare advisory baselines, apart from distlock's own names.
fn bench_key(run: &str, case: &str) -> i64 {
    distlock_sql::postgres::layout::advisory_key(&format!("distlock-bench-bare/{run}/{case}"))
}

pub(crate) fn floor_label(sync: bool) -> &'static str {
    if sync {
        "bare flock + write + fdatasync + unlock"
    } else {
        "bare flock + unlock"
    }
}

/// Connects the baselines and measures the engine's round trip.
async fn round_trip(
    config: &Config,
    plan: Plan<'_>,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Error> {
    if config.only.is_some() {
        return connect_baseline(config).await;
    }
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
        Engine::Redis(server) => redis_round_trip(plan, server, runner).await?,
        Engine::Redlock(redlock) => redlock_round_trip(plan, redlock, runner).await?,
        Engine::Etcd {
            config: etcd_config,
        } => etcd_round_trip(config, plan, etcd_config, runner).await?,
        Engine::ZooKeeper { config: zk_config } => (
            Baseline::None,
            zookeeper_round_trip(config, plan, zk_config, runner).await?,
        ),
        Engine::Postgres { url, .. } => postgres_round_trip(config, plan, url, runner).await?,
        Engine::Mysql { url, .. } => {
            runner.step("SELECT 1 round trip");
            let probe = crate::mysql::SelectOne {
                conn: crate::mysql::connect(url).await?,
            };
            let cycles = run_cycles(vec![probe], WARMUP_ONE, plan).await?;
            let reference = Probe::new("SELECT 1 (mysql_async, text query)", &cycles);
            (
                Baseline::Mysql { url: url.clone() },
                RoundTrip {
                    reference: Some(reference),
                    others: Vec::new(),
                    note: None,
                },
            )
        }
    })
}

/// The baselines' connections without the round-trip probes (`--only`).
async fn connect_baseline(config: &Config) -> Result<(Baseline, RoundTrip), Error> {
    let baseline = match &config.engine {
        Engine::File { dir, sync } => Baseline::File {
            dir: dir.clone(),
            sync: *sync,
        },
        Engine::Redis(server) => Baseline::Redis {
            conn: server.connect().await?,
            server: server.clone(),
        },
        Engine::Redlock(redlock) => Baseline::Redlock {
            uris: rslock_uris(redlock),
        },
        Engine::Etcd {
            config: etcd_config,
        } => Baseline::Etcd {
            client: Box::new(etcd_connect(etcd_config).await?),
            config: etcd_config.clone(),
        },
        Engine::Postgres { url, .. } => Baseline::Postgres { url: url.clone() },
        Engine::Mysql { url, .. } => Baseline::Mysql { url: url.clone() },
        Engine::Memory | Engine::ZooKeeper { .. } | Engine::Unmeasured { .. } => Baseline::None,
    };
    let round_trip = RoundTrip {
        reference: None,
        others: Vec::new(),
        note: Some("not measured (--only)".to_string()),
    };
    Ok((baseline, round_trip))
}

/// ZooKeeper's round trips on a plain session: create, getChildren, create + delete. The other
/// workloads have no bare-client baseline on ZooKeeper.
async fn zookeeper_round_trip(
    config: &Config,
    plan: Plan<'_>,
    zk_config: &distlock::zookeeper::ZkConfig,
    runner: &mut Runner,
) -> Result<RoundTrip, Error> {
    use crate::zookeeper::{connect, parent, Create, CreateDelete, GetChildren};
    let d = plan;
    let client = connect(zk_config).await?;
    let created = parent(&client, zk_config, &config.run, "create").await?;
    let listed = parent(&client, zk_config, &config.run, "children").await?;
    let deleted = parent(&client, zk_config, &config.run, "delete").await?;
    runner.step("create round trip");
    let create = Create {
        client: client.clone(),
        prefix: format!("{created}/lock-"),
    };
    let create = run_cycles(vec![create], WARMUP_MANY, d).await?;
    runner.step("getChildren round trip");
    // One child, as an uncontended lock has.
    Create {
        client: client.clone(),
        prefix: format!("{listed}/lock-"),
    }
    .acquire_once()
    .await?;
    let children = GetChildren {
        client: client.clone(),
        parent: listed,
    };
    let children = run_cycles(vec![children], WARMUP_MANY, d).await?;
    runner.step("create + delete round trips");
    let create_delete = CreateDelete {
        client,
        prefix: format!("{deleted}/lock-"),
    };
    let create_delete = run_cycles(vec![create_delete], WARMUP_MANY, d).await?;
    Ok(RoundTrip {
        reference: Some(Probe::new(
            "create, ephemeral sequential (zookeeper-client)",
            &create,
        )),
        others: vec![
            Probe::new("getChildren of a node with one child", &children),
            Probe::new("create + delete", &create_delete),
        ],
        note: None,
    })
}

async fn redis_round_trip(
    plan: Plan<'_>,
    server: &RedisServer,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Error> {
    let conn = server.connect().await?;
    runner.step("PING round trip");
    let ping = RedisPing { conn: conn.clone() };
    let ping = run_cycles(vec![ping], WARMUP_ONE, plan).await?;
    Ok((
        Baseline::Redis {
            server: Box::new(server.clone()),
            conn,
        },
        RoundTrip {
            reference: Some(Probe::new("PING (redis-rs, multiplexed connection)", &ping)),
            others: Vec::new(),
            note: None,
        },
    ))
}

async fn redlock_round_trip(
    plan: Plan<'_>,
    redlock: &distlock::redis::redlock::RedlockConfig,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Error> {
    let backend = distlock::redis::redlock::RedlockBackend::from_config(redlock.clone()).await?;
    runner.step("parallel PING fan-out round trip");
    let ping = RedlockPing { backend };
    let ping = run_cycles(vec![ping], WARMUP_ONE, plan).await?;
    Ok((
        Baseline::Redlock {
            uris: rslock_uris(redlock),
        },
        RoundTrip {
            reference: Some(Probe::new(
                format!("PING to all {} nodes in parallel", redlock.nodes.len()),
                &ping,
            )),
            others: Vec::new(),
            note: None,
        },
    ))
}

async fn etcd_round_trip(
    config: &Config,
    plan: Plan<'_>,
    etcd_config: &EtcdConfig,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Error> {
    let d = plan;
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
    Ok((
        Baseline::Etcd {
            config: Box::new(etcd_config.clone()),
            client: Box::new(client),
        },
        RoundTrip {
            reference: Some(Probe::new("put (raw gRPC client)", &put)),
            others: vec![Probe::new("range, linearizable (raw gRPC client)", &range)],
            note: None,
        },
    ))
}

async fn postgres_round_trip(
    config: &Config,
    plan: Plan<'_>,
    url: &str,
    runner: &mut Runner,
) -> Result<(Baseline, RoundTrip), Error> {
    runner.step("SELECT 1 round trip");
    let probe = crate::postgres::SelectOne {
        client: crate::postgres::connect(url).await?,
    };
    let cycles = run_cycles(vec![probe], WARMUP_ONE, plan).await?;
    runner.step("one conditional UPDATE");
    let name = format!("distlock-bench-bare/{}/update", config.run);
    let update = crate::postgres::ConditionalUpdate::new(url, &name).await?;
    let updates = run_cycles(vec![update], WARMUP_ONE, plan).await?;
    Ok((
        Baseline::Postgres {
            url: url.to_string(),
        },
        RoundTrip {
            reference: Some(Probe::new(
                "SELECT 1 (tokio-postgres, simple query)",
                &cycles,
            )),
            others: vec![Probe::new(CONDITIONAL_UPDATE, &updates)],
            note: None,
        },
    ))
}
