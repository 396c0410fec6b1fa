//! What one cycle is, per client: distlock's `Lock`, and beside it each engine's own round trip and
//! the bare-client loops the peers were measured with (reference/baseline.md).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use distlock::etcd::rpc::pb::etcdserverpb::{LeaseGrantRequest, PutRequest, RangeRequest};
use distlock::etcd::rpc::pb::v3lockpb::{LockRequest, UnlockRequest};
use distlock::etcd::rpc::Client as EtcdClient;
use distlock::etcd::EtcdConfig;
use distlock::url::LockUrl;
use distlock::{ErrorKind, Lock, LockGuard};

use super::harness::Cycler;
use crate::exit::{Code, Failure};

/// distlock's own cycle: `acquire` (waiting as asked) and `release`.
#[derive(Debug)]
pub struct Distlock {
    pub lock: Lock,
}

impl Cycler for Distlock {
    type Held = LockGuard;

    async fn acquire(&self, wait: Duration) -> Result<Option<LockGuard>, Failure> {
        match self.lock.options().wait(wait).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(e) if e.kind() == ErrorKind::Timeout => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn release(&self, guard: LockGuard) -> Result<(), Failure> {
        guard.release().await.map_err(Failure::from)
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
    Redis(Box<redis::ConnectionInfo>),
    Etcd {
        config: Box<EtcdConfig>,
    },
    /// A scheme whose baselines this command does not measure; the reason says which.
    Unmeasured {
        reason: String,
    },
}

impl Engine {
    pub fn from_url(url: &str) -> Result<Engine, Failure> {
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
            "redis" => match parsed.hosts() {
                [host] => Engine::Redis(Box::new(redis_info(&parsed, host)?)),
                _ => unmeasured("the baselines need exactly one host"),
            },
            "etcd" | "etcds" => Engine::Etcd {
                config: Box::new(EtcdConfig::from_url(&parsed)?),
            },
            _ => unmeasured("no engine baseline for this scheme in `distlock bench` yet"),
        })
    }
}

fn with_port(host: &str, default: u16) -> String {
    // `[::1]` alone has a colon but no port.
    let has_port = match host.rsplit_once(':') {
        Some((_, port)) => !host.ends_with(']') && port.parse::<u16>().is_ok(),
        None => false,
    };
    if has_port {
        host.to_string()
    } else {
        format!("{host}:{default}")
    }
}

fn redis_info(url: &LockUrl, host: &str) -> Result<redis::ConnectionInfo, Failure> {
    use redis::IntoConnectionInfo;
    let host_port = with_port(host, 6379);
    let (name, port) = host_port
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.trim_matches(['[', ']']).to_string(), p.parse().ok()?)))
        .ok_or_else(|| Failure::new(Code::Usage, format!("invalid Redis host {host:?}")))?;
    let db = match url.path().trim_matches('/') {
        "" => 0,
        db => db
            .parse::<i64>()
            .map_err(|_| Failure::new(Code::Usage, format!("invalid Redis database {db:?}")))?,
    };
    let mut settings = redis::RedisConnectionInfo::default().set_db(db);
    if let Some(user) = url.username() {
        settings = settings.set_username(user);
    }
    if let Some(password) = url.password() {
        settings = settings.set_password(password);
    }
    let info = redis::ConnectionAddr::Tcp(name, port)
        .into_connection_info()
        .map_err(redis_failure)?;
    Ok(info.set_redis_settings(settings))
}

pub fn redis_failure(e: redis::RedisError) -> Failure {
    Failure::new(Code::Unavailable, format!("redis baseline: {e}"))
}

pub async fn redis_connect(
    info: &redis::ConnectionInfo,
) -> Result<redis::aio::MultiplexedConnection, Failure> {
    let client = redis::Client::open(info.clone()).map_err(redis_failure)?;
    client
        .get_multiplexed_async_connection()
        .await
        .map_err(redis_failure)
}

/// One `PING` on a multiplexed redis-rs connection: the engine's round trip.
#[derive(Debug)]
pub struct RedisPing {
    pub conn: redis::aio::MultiplexedConnection,
}

impl Cycler for RedisPing {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Failure> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(redis_failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Failure> {
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

    async fn acquire(&self, _wait: Duration) -> Result<Option<String>, Failure> {
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
            None => Err(Failure::new(
                Code::Unavailable,
                format!("redis baseline: key {:?} is held by someone else", self.key),
            )),
        }
    }

    async fn release(&self, token: String) -> Result<(), Failure> {
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
            Err(Failure::new(
                Code::Unavailable,
                format!("redis baseline: key {:?} was not ours at release", self.key),
            ))
        }
    }
}

pub fn etcd_failure(e: distlock::etcd::rpc::Status) -> Failure {
    Failure::new(
        Code::Unavailable,
        format!("etcd baseline: {:?}: {}", e.code(), e.message()),
    )
}

/// The etcd lease every peer lock hangs on (like `etcdctl lock`'s session); as in baseline.md,
/// one 30 s lease per client, granted up front.
const ETCD_LEASE_SECS: i64 = 30;

/// A raw gRPC client of the engine (distlock-etcd's own: the same channel, TLS and auth as the
/// backend, without its retries).
pub async fn etcd_connect(config: &EtcdConfig) -> Result<EtcdClient, Failure> {
    Ok(EtcdClient::connect(config).await?)
}

/// A put of a small value: etcd's write round trip (one raft commit, fsync by default).
#[derive(Debug)]
pub struct EtcdPut {
    pub client: EtcdClient,
    pub key: String,
}

impl Cycler for EtcdPut {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Failure> {
        self.client
            .put(PutRequest {
                key: self.key.as_bytes().to_vec(),
                value: b"x".to_vec(),
                ..PutRequest::default()
            })
            .await
            .map_err(etcd_failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Failure> {
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

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Failure> {
        self.client
            .range(RangeRequest {
                key: self.key.as_bytes().to_vec(),
                ..RangeRequest::default()
            })
            .await
            .map_err(etcd_failure)?;
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Failure> {
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
    pub async fn new(client: EtcdClient, name: String) -> Result<Self, Failure> {
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

    async fn acquire(&self, wait: Duration) -> Result<Option<Vec<u8>>, Failure> {
        let request = LockRequest {
            name: self.name.as_bytes().to_vec(),
            lease: self.lease,
        };
        match tokio::time::timeout(wait, self.client.lock(request)).await {
            Ok(locked) => Ok(Some(locked.map_err(etcd_failure)?.key)),
            Err(_) => Ok(None),
        }
    }

    async fn release(&self, key: Vec<u8>) -> Result<(), Failure> {
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
}

impl FlockFloor {
    pub fn new(path: PathBuf, sync: bool) -> Result<Self, Failure> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| {
                Failure::new(
                    Code::Unavailable,
                    format!("flock baseline: cannot open {}: {e}", path.display()),
                )
            })?;
        Ok(Self { file, path, sync })
    }
}

impl Drop for FlockFloor {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Cycler for FlockFloor {
    type Held = ();

    async fn acquire(&self, _wait: Duration) -> Result<Option<()>, Failure> {
        use rustix::fs::{flock, FlockOperation};
        let failed = |e: &dyn std::fmt::Display| {
            Failure::new(
                Code::Unavailable,
                format!("flock baseline on {}: {e}", self.path.display()),
            )
        };
        flock(&self.file, FlockOperation::NonBlockingLockExclusive).map_err(|e| failed(&e))?;
        if self.sync {
            rustix::io::pwrite(&self.file, &[0u8; 8], 0).map_err(|e| failed(&e))?;
            rustix::fs::fdatasync(&self.file).map_err(|e| failed(&e))?;
        }
        Ok(Some(()))
    }

    async fn release(&self, (): ()) -> Result<(), Failure> {
        use rustix::fs::{flock, FlockOperation};
        flock(&self.file, FlockOperation::Unlock).map_err(|e| {
            Failure::new(
                Code::Unavailable,
                format!("flock baseline on {}: {e}", self.path.display()),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_from_urls() {
        assert!(matches!(Engine::from_url("memory://"), Ok(Engine::Memory)));
        let Ok(Engine::Redis(info)) = Engine::from_url("redis://u:p@127.0.0.1:6390/2?lease=5s")
        else {
            panic!("redis")
        };
        assert_eq!(info.redis_settings().db(), 2);
        assert_eq!(info.redis_settings().password(), Some("p"));
        let Ok(Engine::Etcd { config }) = Engine::from_url("etcd://127.0.0.1,h:2391") else {
            panic!("etcd")
        };
        assert_eq!(config.endpoints, ["127.0.0.1:2379", "h:2391"]);
        assert!(matches!(
            Engine::from_url("redis+cluster://a:1,b:2"),
            Ok(Engine::Unmeasured { .. })
        ));
        assert_eq!(with_port("[::1]", 1), "[::1]:1");
    }
}
