//! What one cycle is, per client: distlock's `Lock`, and beside it each engine's own round trip and
//! the bare-client loops the peers were measured with (reference/baseline.md).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock::etcd::EtcdConfig;
use distlock::redis::{RedisConfig, Topology};
use distlock::{ErrorKind, Lock, LockGuard};
use distlock_core::url::LockUrl;
use distlock_etcd::rpc::pb::etcdserverpb::{LeaseGrantRequest, PutRequest, RangeRequest};
use distlock_etcd::rpc::pb::v3lockpb::{LockRequest, UnlockRequest};
use distlock_etcd::rpc::Client as EtcdClient;
use redis::IntoConnectionInfo as _;

use crate::error::Error;
use crate::harness::Cycler;

/// distlock's own cycle: `acquire` (waiting as asked) and `release`.
#[derive(Debug)]
pub struct Distlock {
    pub lock: Lock,
}

impl Cycler for Distlock {
    type Held = LockGuard;

    async fn acquire(&self, wait: Duration) -> Result<Option<LockGuard>, Error> {
        match self.lock.options().wait(wait).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(e) if e.kind() == ErrorKind::Timeout => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(&self, guard: LockGuard) -> Result<(), Error> {
        guard.release().await.map_err(Error::from)
    }
}

/// Where the engine baselines connect, read from the lock URL.
#[derive(Debug, Clone)]
pub enum Engine {
    /// No engine round trip (in-process).
    Memory,
    /// No engine round trip; the floor is a bare `flock` + unlock on an open file in this directory,
    /// with a write and `fdatasync` in between when the backend syncs (`sync`).
    File {
        dir: PathBuf,
        sync: bool,
    },
    Redis(Box<RedisServer>),
    /// N independent masters: the round trip is a parallel PING to all, the peer rslock.
    Redlock(Box<distlock::redis::redlock::RedlockConfig>),
    Etcd {
        config: Box<EtcdConfig>,
    },
    ZooKeeper {
        config: Box<distlock::zookeeper::ZkConfig>,
    },
    /// The driver's URL (distlock's parameters stripped); `advisory` when the lock mode is.
    Postgres {
        url: String,
        advisory: bool,
        /// `?mode=lease`: the lease row's cycle is compared with one conditional update.
        lease: bool,
    },
    /// MySQL / MariaDB: the driver's URL (distlock's parameters stripped); `advisory` when the lock
    /// mode is.
    Mysql {
        url: String,
        advisory: bool,
    },
    /// A scheme whose baselines this command does not measure; the reason says which.
    Unmeasured {
        reason: String,
    },
}

impl Engine {
    pub fn from_url(url: &str) -> Result<Engine, Error> {
        if let Some(("postgres" | "postgresql", _)) = url.split_once("://") {
            let config = distlock_sql::SqlConfig::from_url(url)?;
            return Ok(Engine::Postgres {
                advisory: config.mode == distlock_sql::Mode::Advisory,
                lease: config.mode == distlock_sql::Mode::Lease,
                url: config.url,
            });
        }
        if let Some(("mysql" | "mariadb", _)) = url.split_once("://") {
            let config = distlock_sql::SqlConfig::from_url(url)?;
            return Ok(Engine::Mysql {
                advisory: config.mode == distlock_sql::Mode::Advisory,
                url: config.url,
            });
        }
        let parsed = LockUrl::parse(url)?;
        let unmeasured = |why: &str| Engine::Unmeasured {
            reason: format!("{}://: {why}", parsed.scheme()),
        };
        Ok(match parsed.scheme() {
            "memory" => Engine::Memory,
            "file" => {
                let config = distlock::file::FileConfig::from_url(&parsed)?;
                Engine::File {
                    dir: config.dir,
                    sync: config.sync,
                }
            }
            "redis" | "rediss" | "redis+sentinel" | "redis+cluster" => {
                let config = RedisConfig::from_url(&parsed)?;
                match RedisServer::new(&config)? {
                    Some(server) => Engine::Redis(Box::new(server)),
                    None => unmeasured("the baselines need exactly one host"),
                }
            }
            "redlock" | "redlocks" => Engine::Redlock(Box::new(
                distlock::redis::redlock::RedlockConfig::from_url(&parsed)?,
            )),
            "etcd" | "etcds" => Engine::Etcd {
                config: Box::new(EtcdConfig::from_url(&parsed)?),
            },
            "zk" => Engine::ZooKeeper {
                config: Box::new(distlock::zookeeper::ZkConfig::from_url(&parsed)?),
            },
            _ => unmeasured("no engine baseline for this scheme in `distlock bench` yet"),
        })
    }
}

/// The one Redis server of a standalone URL, as the backend's own [`RedisConfig`] reads it
/// (address, credentials, database, TLS and its CA file, connect timeout), for plain redis-rs
/// connections: the round trip and the bare loops.
// The Redis backend keeps its redis-rs connection setup private (and is being rewritten), so the
// few lines that turn a config into a client are here; they follow its `conn.rs`.
#[derive(Debug, Clone)]
pub struct RedisServer {
    client: redis::Client,
    connect_timeout: Duration,
    /// The layout the URL asks for: the same-scripts loop runs its scripts.
    pub layout: distlock::redis::RedisLayout,
}

impl RedisServer {
    /// `None` for Sentinel and Cluster: the baselines talk to one server.
    pub fn new(config: &RedisConfig) -> Result<Option<Self>, Error> {
        let Topology::Standalone { addr } = &config.topology else {
            return Ok(None);
        };
        let connection = &config.connection;
        let (host, port) = (addr.host().to_string(), addr.port());
        let addr = if connection.tls {
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            redis::ConnectionAddr::Tcp(host, port)
        };
        let mut settings = redis::RedisConnectionInfo::default().set_db(config.db);
        if let Some(username) = &connection.username {
            settings = settings.set_username(username);
        }
        if let Some(password) = &connection.password {
            settings = settings.set_password(password);
        }
        let info = addr
            .into_connection_info()
            .map_err(redis_failure)?
            .set_redis_settings(settings);
        let client = match connection.ca_file.as_ref().filter(|_| connection.tls) {
            None => redis::Client::open(info),
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    Error::usage(format!(
                        "redis baseline: cannot read the TLS CA file {}: {e}",
                        path.display()
                    ))
                })?;
                let certificates = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                };
                redis::Client::build_with_tls(info, certificates)
            }
        }
        .map_err(redis_failure)?;
        Ok(Some(Self {
            layout: config.layout,
            client,
            connect_timeout: connection.connect_timeout,
        }))
    }

    /// A new multiplexed connection. Only the connect is bounded: the bare loops are plain redis-rs
    /// clients, as in the peers' measurements, with no per-request timer.
    pub async fn connect(&self) -> Result<redis::aio::MultiplexedConnection, Error> {
        let config =
            redis::AsyncConnectionConfig::new().set_connection_timeout(Some(self.connect_timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(redis_failure)
    }

    /// The redis-rs client the baselines connect with (rslock takes it as is).
    pub fn client(&self) -> redis::Client {
        self.client.clone()
    }

    /// The server's host and port (for reading its CPU time when it is local).
    pub fn host_port(&self) -> (String, u16) {
        match self.client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, port)
            | redis::ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
            _ => (String::new(), 0),
        }
    }

    /// The server's database (for the tests).
    #[cfg(test)]
    fn db(&self) -> i64 {
        self.client.get_connection_info().redis_settings().db()
    }
}

pub fn redis_failure(e: redis::RedisError) -> Error {
    Error::unavailable(format!("redis baseline: {e}"))
}

/// One `PING` on a multiplexed redis-rs connection: the engine's round trip.
#[derive(Debug)]
pub struct RedisPing {
    pub conn: redis::aio::MultiplexedConnection,
}

impl Cycler for RedisPing {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// The in-process floors' acquire: `lock` within `wait` (FIFO, as tokio's `Mutex` is), `None` if it
/// elapsed first.
async fn lock_within(
    lock: &Arc<tokio::sync::Mutex<()>>,
    wait: Duration,
) -> Option<tokio::sync::OwnedMutexGuard<()>> {
    tokio::time::timeout(wait, lock.clone().lock_owned())
        .await
        .ok()
}

/// The harness's own floor in (c) on Redis: an in-process FIFO lock (tokio's `Mutex`) whose release
/// costs exactly one `PING` round trip on a shared redis-rs connection before it unlocks, waking the
/// next task. The same harness, hold and thread hops as distlock's contended run, with one round trip
/// per handoff and no lock logic: what distlock's handoff (one request) could at best cost here.
#[derive(Debug)]
pub struct RedisPingMutex {
    pub conn: redis::aio::MultiplexedConnection,
    pub lock: Arc<tokio::sync::Mutex<()>>,
}

impl Cycler for RedisPingMutex {
    type Held = tokio::sync::OwnedMutexGuard<()>;

    async fn acquire(&self, wait: Duration) -> Result<Option<Self::Held>, Error> {
        Ok(lock_within(&self.lock, wait).await)
    }

    async fn release(&self, held: Self::Held) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        drop(held);
        Ok(())
    }
}

/// The compare-and-delete of the bare loop: delete the key only if it still holds our token.
const COMPARE_AND_DELETE: &str = r"
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
";

/// The bare redis-rs loop of baseline.md (`raw-1`): `SET key token NX PX 30000`, then the
/// compare-and-delete by `EVALSHA` (redis-rs's `Script` falls back to `EVAL` on `NOSCRIPT`).
#[derive(Debug)]
pub struct RedisBare {
    conn: redis::aio::MultiplexedConnection,
    key: String,
    script: Arc<redis::Script>,
    next: AtomicU64,
}

impl RedisBare {
    pub fn new(conn: redis::aio::MultiplexedConnection, key: String) -> Self {
        Self {
            conn,
            key,
            script: Arc::new(redis::Script::new(COMPARE_AND_DELETE)),
            next: AtomicU64::new(0),
        }
    }
}

impl Cycler for RedisBare {
    type Held = String;

    async fn acquire(&self, _wait: Duration) -> Result<Option<String>, Error> {
        let token = format!(
            "{}:{}",
            std::process::id(),
            self.next.fetch_add(1, Ordering::Relaxed)
        );
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&self.key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        match set {
            Some(_) => Ok(Some(token)),
            // The loop never waits: its key is its own, so "busy" means someone else uses it.
            None => Err(Error::unavailable(format!(
                "redis baseline: key {:?} is held by someone else",
                self.key
            ))),
        }
    }

    async fn release(&self, token: String) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let deleted: i64 = self
            .script
            .key(&self.key)
            .arg(token)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        if deleted == 1 {
            Ok(())
        } else {
            Err(Error::unavailable(format!(
                "redis baseline: key {:?} was not ours at release",
                self.key
            )))
        }
    }
}

pub fn etcd_failure(e: distlock_etcd::rpc::Status) -> Error {
    Error::unavailable(format!("etcd baseline: {:?}: {}", e.code(), e.message()))
}

/// The etcd lease every peer lock hangs on (like `etcdctl lock`'s session); as in baseline.md,
/// one 30 s lease per client, granted up front.
const ETCD_LEASE_SECS: i64 = 30;

/// A raw gRPC client of the engine (distlock-etcd's own: the same channel, TLS and auth as the
/// backend, without its retries).
pub async fn etcd_connect(config: &EtcdConfig) -> Result<EtcdClient, Error> {
    Ok(EtcdClient::connect(config).await?)
}

/// A put of a small value to `key`: one raft commit (fsync by default).
async fn etcd_put(client: &EtcdClient, key: &str) -> Result<(), Error> {
    client
        .put(PutRequest {
            key: key.as_bytes().to_vec(),
            value: b"x".to_vec(),
            ..PutRequest::default()
        })
        .await
        .map_err(etcd_failure)?;
    Ok(())
}

/// A linearizable range (get) of `key`.
async fn etcd_range(client: &EtcdClient, key: &str) -> Result<(), Error> {
    client
        .range(RangeRequest {
            key: key.as_bytes().to_vec(),
            ..RangeRequest::default()
        })
        .await
        .map_err(etcd_failure)?;
    Ok(())
}

/// A put of a small value: etcd's write round trip (one raft commit, fsync by default).
#[derive(Debug)]
pub struct EtcdPut {
    pub client: EtcdClient,
    pub key: String,
}

impl Cycler for EtcdPut {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        etcd_put(&self.client, &self.key).await?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// A linearizable range (get) of one key: etcd's read round trip.
#[derive(Debug)]
pub struct EtcdRange {
    pub client: EtcdClient,
    pub key: String,
}

impl Cycler for EtcdRange {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        etcd_range(&self.client, &self.key).await?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        Ok(())
    }
}

/// The harness's own floor in (c) on etcd, the peer of [`RedisPingMutex`]: an in-process FIFO lock
/// (tokio's `Mutex`) whose release costs one put and then one linearizable range on a shared raw gRPC
/// client before it unlocks, waking the next task. It is the (c) target's `hold + put + range` run in
/// the same harness (the same tasks, `block_in_place` holds and thread hops as distlock's contended
/// run), so its CPU per acquisition is that target's floor in CPU, the harness's own cost included.
#[derive(Debug)]
pub struct EtcdPutRangeMutex {
    pub client: EtcdClient,
    pub key: String,
    pub lock: Arc<tokio::sync::Mutex<()>>,
}

impl Cycler for EtcdPutRangeMutex {
    type Held = tokio::sync::OwnedMutexGuard<()>;

    async fn acquire(&self, wait: Duration) -> Result<Option<Self::Held>, Error> {
        Ok(lock_within(&self.lock, wait).await)
    }

    async fn release(&self, held: Self::Held) -> Result<(), Error> {
        etcd_put(&self.client, &self.key).await?;
        etcd_range(&self.client, &self.key).await?;
        drop(held);
        Ok(())
    }
}

/// The peer of baseline.md (measured there with `etcd-client`): etcd's server-side `Lock` / `Unlock`
/// RPCs, on a lease granted up front.
#[derive(Debug)]
pub struct EtcdLockRpc {
    client: EtcdClient,
    name: String,
    lease: i64,
}

impl EtcdLockRpc {
    pub async fn new(client: EtcdClient, name: String) -> Result<Self, Error> {
        let lease = client
            .lease_grant(LeaseGrantRequest {
                ttl: ETCD_LEASE_SECS,
                id: 0,
            })
            .await
            .map_err(etcd_failure)?
            .id;
        Ok(Self {
            client,
            name,
            lease,
        })
    }

    /// What [`etcd_revoke`] needs once the client has been used up by a run.
    pub fn lease(&self) -> (EtcdClient, i64) {
        (self.client.clone(), self.lease)
    }
}

/// Revokes the peer's leases, so nothing of the run is left on the server (best effort).
pub async fn etcd_revoke(leases: Vec<(EtcdClient, i64)>) {
    for (client, lease) in leases {
        let _ = client.lease_revoke(lease).await;
    }
}

impl Cycler for EtcdLockRpc {
    type Held = Vec<u8>;

    async fn acquire(&self, wait: Duration) -> Result<Option<Vec<u8>>, Error> {
        let request = LockRequest {
            name: self.name.as_bytes().to_vec(),
            lease: self.lease,
        };
        match tokio::time::timeout(wait, self.client.lock(request)).await {
            Ok(locked) => Ok(Some(locked.map_err(etcd_failure)?.key)),
            Err(_) => Ok(None),
        }
    }

    async fn release(&self, key: Vec<u8>) -> Result<(), Error> {
        self.client
            .unlock(UnlockRequest { key })
            .await
            .map_err(etcd_failure)?;
        Ok(())
    }
}

/// The floor of the file backend: `flock(LOCK_EX | LOCK_NB)` + `flock(LOCK_UN)` on a file kept open;
/// with `sync`, also a write and `fdatasync` while locked (what the backend does to make its fencing
/// counter durable).
#[derive(Debug)]
pub struct FlockFloor {
    file: std::fs::File,
    path: PathBuf,
    sync: bool,
    /// `LOCK_EX` (the mutex's and a permit slot's floor), else `LOCK_SH` (a reader's).
    exclusive: bool,
}

impl FlockFloor {
    pub fn new(path: PathBuf, sync: bool) -> Result<Self, Error> {
        // Without distlock in the run (`--baseline-only`, `--only baselines`) nothing else creates
        // the lock directory.
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| {
                Error::unavailable(format!(
                    "flock baseline: cannot open {}: {e}",
                    path.display()
                ))
            })?;
        Ok(Self {
            file,
            path,
            sync,
            exclusive: true,
        })
    }

    /// A reader's floor: `flock(LOCK_SH)` + unlock on the file at `path`, nothing written.
    pub fn shared(path: PathBuf) -> Result<Self, Error> {
        let mut floor = Self::new(path, false)?;
        floor.exclusive = false;
        Ok(floor)
    }
}

impl Drop for FlockFloor {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Cycler for FlockFloor {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Error> {
        use rustix::fs::{flock, FlockOperation};
        let failed = |e: &dyn std::fmt::Display| {
            Error::unavailable(format!("flock baseline on {}: {e}", self.path.display()))
        };
        let operation = if self.exclusive {
            FlockOperation::NonBlockingLockExclusive
        } else {
            FlockOperation::NonBlockingLockShared
        };
        flock(&self.file, operation).map_err(|e| failed(&e))?;
        if self.sync {
            rustix::io::pwrite(&self.file, &[0u8; 8], 0).map_err(|e| failed(&e))?;
            rustix::fs::fdatasync(&self.file).map_err(|e| failed(&e))?;
        }
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Error> {
        use rustix::fs::{flock, FlockOperation};
        flock(&self.file, FlockOperation::Unlock).map_err(|e| {
            Error::unavailable(format!("flock baseline on {}: {e}", self.path.display()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_from_urls() {
        assert!(matches!(Engine::from_url("memory://"), Ok(Engine::Memory)));
        let Ok(Engine::Redis(server)) = Engine::from_url("redis://u:p@127.0.0.1:6390/2?lease=5s")
        else {
            panic!("redis")
        };
        assert_eq!(server.db(), 2);
        let info = server.client.get_connection_info();
        assert_eq!(info.redis_settings().password(), Some("p"));
        assert_eq!(info.redis_settings().username(), Some("u"));
        assert!(matches!(
            info.addr(),
            redis::ConnectionAddr::Tcp(host, 6390) if host == "127.0.0.1"
        ));
        let Ok(Engine::Redis(server)) = Engine::from_url("rediss://[::1]") else {
            panic!("rediss")
        };
        assert!(matches!(
            server.client.get_connection_info().addr(),
            redis::ConnectionAddr::TcpTls { host, port: 6379, .. } if host == "::1"
        ));
        let Ok(Engine::Etcd { config }) = Engine::from_url("etcd://127.0.0.1,h:2391,[::1]") else {
            panic!("etcd")
        };
        assert_eq!(config.endpoints, ["127.0.0.1:2379", "h:2391", "[::1]:2379"]);
        assert!(matches!(
            Engine::from_url("redis+cluster://a:1,b:2"),
            Ok(Engine::Unmeasured { .. })
        ));
        // The backend's own URL rules apply: one host for redis://, a numeric database.
        for bad in ["redis://a:1,b:2", "redis://h/x", "redis://h:99999"] {
            assert!(
                matches!(Engine::from_url(bad), Err(Error::Lock(_))),
                "{bad}"
            );
        }
    }
}
