//! The fair Redis baselines of issue 9: a bare redis-rs loop of distlock's own scripts (the
//! acquire and release of [`distlock::redis::layout`], of the layout the URL asks for: Redisson's, or
//! the plain one with `?layout=plain`, whose acquire without tokens is `SET NX PX`) by `EVALSHA`,
//! with the keys and arguments distlock sends, so distlock's client overhead is measured apart from
//! the cost of its richer server-side layout; and rslock, the crate a Rust user would pick instead, on the same
//! single server.

use std::sync::Arc;
use std::time::Duration;

use distlock::redis::{layout, RedisLayout};
use redis::Value;

use crate::engines::{redis_failure, RedisServer};
use crate::error::Error;
use crate::harness::{run_contended, run_cycles, Cycler};
use crate::measure::{
    Baseline, Run, RSLOCK_CONTENDED, RSLOCK_SHARED_MANAGER, RSLOCK_SINGLE, SAME_SCRIPTS,
    SAME_SCRIPTS_PER_TASK, SAME_SCRIPTS_SHARED,
};
use crate::redlock::Rslock;
use crate::report::{ContendedFigures, CycleFigures};
use crate::{Runner, WARMUP_MANY, WARMUP_ONE};

/// The lease distlock asks for by default (30 s), in ms: the acquire script's `ARGV[1]`.
const LEASE_MS: u64 = 30_000;

/// The two scripts, compiled once and shared by every client of a run (redis-rs sends `EVALSHA` and
/// falls back to `EVAL` on `NOSCRIPT`, as the backend does).
#[derive(Debug)]
pub struct Scripts {
    acquire: redis::Script,
    release: redis::Script,
    /// The plain acquire script's last argument (`1`: mint a token); `None` for Redisson's.
    mint: Option<&'static str>,
}

impl Scripts {
    /// The Redisson layout's scripts, or the plain layout's (minting a token as the layout says).
    pub fn new(layout: RedisLayout) -> Arc<Self> {
        let (acquire, release, mint) = match layout {
            RedisLayout::Plain { tokens, .. } => (
                layout::PLAIN_ACQUIRE,
                layout::PLAIN_RELEASE,
                Some(if tokens { "1" } else { "0" }),
            ),
            _ => (layout::ACQUIRE, layout::RELEASE, None),
        };
        Arc::new(Self {
            acquire: redis::Script::new(acquire),
            release: redis::Script::new(release),
            mint,
        })
    }
}

/// One client of the same-scripts loop: distlock's acquire script (`KEYS` the lock and its fencing
/// counter; `ARGV` the lease in ms and the owner), then its release script (`KEYS` the lock; `ARGV` the
/// owner, `publish`, the unlock message and the channel), nothing else: no local gate, no
/// watchdog, no timers.
#[derive(Debug)]
pub struct SameScripts {
    conn: redis::aio::MultiplexedConnection,
    scripts: Arc<Scripts>,
    lock_key: String,
    token_key: String,
    channel: String,
    /// `<run>:<client>`, the shape of distlock's `<process uuid>:<n>`.
    owner: String,
}

impl SameScripts {
    pub fn new(
        conn: redis::aio::MultiplexedConnection,
        scripts: Arc<Scripts>,
        name: &str,
        owner: String,
    ) -> Self {
        Self {
            conn,
            lock_key: layout::lock_key(name).to_string(),
            token_key: layout::token_key(name),
            channel: if scripts.mint.is_some() {
                layout::plain_channel(name)
            } else {
                layout::channel(name)
            },
            scripts,
            owner,
        }
    }
}

impl Cycler for SameScripts {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.clone();
        let reply: Value = if self.scripts.mint == Some("0") {
            // The plain layout without tokens acquires with `SET NX PX`, as distlock does.
            let set: Value = redis::cmd("SET")
                .arg(&self.lock_key)
                .arg(&self.owner)
                .arg("NX")
                .arg("PX")
                .arg(LEASE_MS)
                .query_async(&mut conn)
                .await
                .map_err(redis_failure)?;
            match set {
                Value::Nil => set,
                _ => Value::Array(vec![Value::Int(1)]),
            }
        } else {
            let mut call = self.scripts.acquire.key(&self.lock_key);
            call.key(&self.token_key).arg(LEASE_MS).arg(&self.owner);
            if let Some(mint) = self.scripts.mint {
                call.arg(mint);
            }
            call.invoke_async(&mut conn).await.map_err(redis_failure)?
        };
        // `{1, token, lease}` on a grant; the key is this client's alone, so anything else is a fault.
        match &reply {
            Value::Array(items) if matches!(items.first(), Some(Value::Int(1))) => Ok(Some(())),
            other => Err(Error::unavailable(format!(
                "same-scripts baseline: key {:?} not granted: {other:?}",
                self.lock_key
            ))),
        }
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let released: i64 = self
            .scripts
            .release
            .key(&self.lock_key)
            .arg(&self.owner)
            .arg("publish")
            .arg(layout::UNLOCK_MESSAGE)
            .arg(&self.channel)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        if released == 1 {
            Ok(())
        } else {
            Err(Error::unavailable(format!(
                "same-scripts baseline: key {:?} was not ours at release",
                self.lock_key
            )))
        }
    }
}

impl Run<'_> {
    /// The Redis baseline's server and shared connection; `None` for other engines.
    fn redis(&self) -> Option<(&RedisServer, &redis::aio::MultiplexedConnection)> {
        match self.baseline {
            Baseline::Redis { server, conn } => Some((server, conn)),
            _ => None,
        }
    }

    /// The owner of client `i`, in the shape of distlock's `<process uuid>:<n>`.
    pub(crate) fn owner(&self, i: usize) -> String {
        format!("{}:{i}", self.config.run)
    }

    /// (a): the same-scripts loop, then rslock, one task each.
    pub(crate) async fn redis_peers_uncontended(
        &self,
        runner: &mut Runner,
    ) -> Result<Vec<CycleFigures>, Error> {
        let Some((server, conn)) = self.redis() else {
            return Ok(Vec::new());
        };
        let (d, run, rtt) = (self.plan, &self.config.run, self.round_trip);
        runner.step("(a) same-scripts loop");
        let name = format!("distlock-bench-same/{run}/a");
        let client = SameScripts::new(
            conn.clone(),
            Scripts::new(server.layout),
            &name,
            self.owner(0),
        );
        let cycles = run_cycles(vec![client], WARMUP_ONE, d).await?;
        let mut out = vec![CycleFigures::new(SAME_SCRIPTS, &cycles, rtt)];
        runner.step("(a) rslock");
        let peer = Rslock::from_client(server.client(), format!("distlock-bench-peer/{run}/a"));
        let cycles = run_cycles(vec![peer], WARMUP_ONE, d).await?;
        out.push(CycleFigures::new(RSLOCK_SINGLE, &cycles, rtt));
        Ok(out)
    }

    /// (b): the same-scripts loop on a connection per task, then on one shared connection, then
    /// rslock with one `LockManager` shared by every task.
    pub(crate) async fn redis_peers_many(
        &self,
        runner: &mut Runner,
    ) -> Result<Vec<CycleFigures>, Error> {
        let mut out = Vec::new();
        if self.redis().is_none() {
            return Ok(out);
        }
        out.push(self.same_scripts_many(runner, false).await?);
        out.push(self.same_scripts_many(runner, true).await?);
        out.push(self.rslock_many(runner).await?);
        Ok(out)
    }

    /// (b) the same-scripts loop at `config.many_tasks` tasks, on one shared connection or one per
    /// task.
    pub(crate) async fn same_scripts_many(
        &self,
        runner: &mut Runner,
        shared: bool,
    ) -> Result<CycleFigures, Error> {
        let Some((server, conn)) = self.redis() else {
            return Err(Error::unavailable(
                "internal error: the same-scripts loop needs redis",
            ));
        };
        let (n, run) = (self.config.many_tasks, &self.config.run);
        let label = if shared {
            SAME_SCRIPTS_SHARED
        } else {
            SAME_SCRIPTS_PER_TASK
        };
        runner.step(&format!("(b) {label}"));
        let scripts = Scripts::new(server.layout);
        let case = if shared { "shared" } else { "own" };
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            let conn = if shared {
                conn.clone()
            } else {
                server.connect().await?
            };
            let name = format!("distlock-bench-same/{run}/b-{case}-{n}/{i}");
            clients.push(SameScripts::new(
                conn,
                scripts.clone(),
                &name,
                self.owner(i),
            ));
        }
        let cycles = run_cycles(clients, WARMUP_MANY, self.plan).await?;
        Ok(CycleFigures::new(label, &cycles, self.round_trip))
    }

    async fn rslock_many(&self, runner: &mut Runner) -> Result<CycleFigures, Error> {
        let Some((server, _)) = self.redis() else {
            return Err(Error::unavailable("internal error: rslock needs redis"));
        };
        let (n, run) = (self.config.many_tasks, &self.config.run);
        runner.step("(b) rslock, one shared LockManager");
        let first = Rslock::from_client(server.client(), String::new());
        let clients = (0..n)
            .map(|i| first.sharing(format!("distlock-bench-peer/{run}/b/{i}")))
            .collect();
        let cycles = run_cycles(clients, WARMUP_MANY, self.plan).await?;
        Ok(CycleFigures::new(
            RSLOCK_SHARED_MANAGER,
            &cycles,
            self.round_trip,
        ))
    }

    /// (c): rslock with one `LockManager` (one connection) per task, all on one name.
    pub(crate) async fn redis_rslock_contended(
        &self,
        runner: &mut Runner,
    ) -> Result<ContendedFigures, Error> {
        let Some((server, _)) = self.redis() else {
            return Err(Error::unavailable("internal error: rslock needs redis"));
        };
        runner.step("(c) rslock, contended");
        let name = format!("distlock-bench-peer/{}/c", self.config.run);
        let clients = (0..self.config.contended_tasks)
            .map(|_| Rslock::from_client(server.client(), name.clone()))
            .collect();
        let result = run_contended(clients, self.config.hold, self.plan).await?;
        Ok(ContendedFigures::new(
            RSLOCK_CONTENDED,
            &result,
            self.round_trip,
        ))
    }
}

/// The read-lock and permit scripts of [`distlock::redis::layout`], compiled once per run.
#[derive(Debug)]
pub struct KindScripts {
    read_acquire: redis::Script,
    read_release: redis::Script,
    permit_acquire: redis::Script,
    permit_release: redis::Script,
}

impl KindScripts {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            read_acquire: redis::Script::new(layout::READ_ACQUIRE),
            read_release: redis::Script::new(layout::READ_RELEASE),
            permit_acquire: redis::Script::new(layout::PERMIT_ACQUIRE),
            permit_release: redis::Script::new(layout::PERMIT_RELEASE),
        })
    }
}

/// The same-layout loop of the read lock (issue 25): distlock's read acquire script (`KEYS` the lock
/// and its token key; `ARGV` the lease in ms, the owner, its write field and its timeout prefix), then
/// its read release script (`KEYS` the lock; `ARGV` the owner, `publish`, the unlock message, the
/// read-write channel, the timeout prefix and the name's suffix base), the keys and arguments the
/// backend sends: one `EVALSHA` per acquire and one per release, nothing else.
#[derive(Debug)]
pub struct SameReadScripts {
    conn: redis::aio::MultiplexedConnection,
    scripts: Arc<KindScripts>,
    lock_key: String,
    token_key: String,
    channel: String,
    owner: String,
    write_field: String,
    timeout_prefix: String,
    suffix_base: String,
}

impl SameReadScripts {
    pub fn new(
        conn: redis::aio::MultiplexedConnection,
        scripts: Arc<KindScripts>,
        name: &str,
        owner: String,
    ) -> Self {
        Self {
            conn,
            scripts,
            lock_key: layout::lock_key(name).to_string(),
            token_key: layout::token_key(name),
            channel: layout::rw_channel(name),
            write_field: layout::write_field(&owner),
            timeout_prefix: layout::read_timeout_prefix(name, &owner),
            suffix_base: layout::suffix_base(name),
            owner,
        }
    }
}

/// A grant reply of distlock's acquire scripts: `{1, token, lease}`; the name is the client's alone, so
/// anything else is a fault.
fn granted(what: &str, key: &str, reply: &Value) -> Result<Option<()>, Error> {
    match reply {
        Value::Array(items) if matches!(items.first(), Some(Value::Int(1))) => Ok(Some(())),
        other => Err(Error::unavailable(format!(
            "{what}: key {key:?} not granted: {other:?}"
        ))),
    }
}

fn released(what: &str, key: &str, released: i64) -> Result<(), Error> {
    if released == 1 {
        Ok(())
    } else {
        Err(Error::unavailable(format!(
            "{what}: key {key:?} was not ours at release"
        )))
    }
}

impl Cycler for SameReadScripts {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.clone();
        let reply: Value = self
            .scripts
            .read_acquire
            .key(&self.lock_key)
            .key(&self.token_key)
            .arg(LEASE_MS)
            .arg(&self.owner)
            .arg(&self.write_field)
            .arg(&self.timeout_prefix)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        granted("same read scripts", &self.lock_key, &reply)
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .scripts
            .read_release
            .key(&self.lock_key)
            .arg(&self.owner)
            .arg("publish")
            .arg(layout::UNLOCK_MESSAGE)
            .arg(&self.channel)
            .arg(&self.timeout_prefix)
            .arg(&self.suffix_base)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        released("same read scripts", &self.lock_key, n)
    }
}

/// The same-layout loop of a permit (issue 25): distlock's permit acquire script (`KEYS` the counter,
/// the permits' sorted set and the token key; `ARGV` the limit, the lease in ms, the permit id (16 raw
/// bytes), `publish` and the semaphore's channel), then its permit release script (`KEYS` the counter
/// and the permits; `ARGV` the id, `publish`, the channel): one `EVALSHA` per acquire and one per
/// release, nothing else.
#[derive(Debug)]
pub struct SamePermitScripts {
    conn: redis::aio::MultiplexedConnection,
    scripts: Arc<KindScripts>,
    counter_key: String,
    permits_key: String,
    token_key: String,
    channel: String,
    limit: u32,
    permit_id: [u8; 16],
}

impl SamePermitScripts {
    pub fn new(
        conn: redis::aio::MultiplexedConnection,
        scripts: Arc<KindScripts>,
        name: &str,
        owner: &str,
        limit: u32,
    ) -> Self {
        Self {
            conn,
            scripts,
            counter_key: layout::lock_key(name).to_string(),
            permits_key: layout::semaphore_timeout_key(name),
            token_key: layout::token_key(name),
            channel: layout::semaphore_channel(name),
            limit,
            permit_id: layout::permit_id(owner),
        }
    }
}

impl Cycler for SamePermitScripts {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.clone();
        let reply: Value = self
            .scripts
            .permit_acquire
            .key(&self.counter_key)
            .key(&self.permits_key)
            .key(&self.token_key)
            .arg(self.limit)
            .arg(LEASE_MS)
            .arg(&self.permit_id[..])
            .arg("publish")
            .arg(&self.channel)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        granted("same permit scripts", &self.counter_key, &reply)
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let n: i64 = self
            .scripts
            .permit_release
            .key(&self.counter_key)
            .key(&self.permits_key)
            .arg(&self.permit_id[..])
            .arg("publish")
            .arg(&self.channel)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        released("same permit scripts", &self.counter_key, n)
    }
}
