//! `connect(url)`: the backend is picked by the URL's scheme.

use std::path::PathBuf;

use distlock_core::url::{redact, LockUrl};
use distlock_core::{Error, ErrorKind, LockOptions, Locks, Result};

/// Connects to the lock service a URL names.
///
/// | scheme | form |
/// |---|---|
/// | `memory` | `memory://[namespace]`: a process-global store per namespace (with cargo feature `testing`, `?freeze_after=DURATION` cuts the connection off that long after it is made, as on a partition) |
/// | `file` | `file:///dir`: flock(2) lock files in `dir` (created if missing) |
/// | `redis`, `rediss` | `redis://[user:pass@]host:port[/db][?wait_replicas=1&wait_timeout=200ms&request_timeout=5s&connect_timeout=3s]`, `rediss://…?ca=/path/ca.pem`: Redisson-compatible layout; `?layout=plain[&poll=100ms]`: redis-py `Lock` / rslock layout |
/// | `redis+sentinel` | `redis+sentinel://[user:pass@]h:p,h:p/<master name>[/db]`: the master re-resolved on every reconnect |
/// | `redis+cluster` | `redis+cluster://[user:pass@]h:p,h:p`: slot-aware, sharded pub/sub |
/// | `redlock`, `redlocks` | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3[?node_timeout=50ms]`, `redlocks://…?ca=/path/ca.pem` (at least 3 independent masters; feature `redis`): node-redlock / redis-py layout, quorum N/2+1, no fencing token |
/// | `mysql`, `mariadb` | `mysql://user:pw@host:3306/db[?mode=advisory|row|lease&table=distlock_locks&schema=db]`: `GET_LOCK`, `SELECT … FOR UPDATE` or a versioned lease row; the rest of the URL is mysql_async's |
/// | `etcd`, `etcds` | `etcd://[user:pass@]h:p,h:p[?session_ttl=60s&request_timeout=5s&connect_timeout=5s]`, `etcds://…?ca=/path/ca.pem`: Go-compatible `concurrency.Mutex` layout |
/// | `zk` | `zk://[user:pass@]h:p,h:p[/chroot][?session_timeout=60s&tick_time=2s&request_timeout=5s&connect_timeout=5s]`: Curator `InterProcessMutex`-compatible layout; `zks` (TLS) fails with [`ErrorKind::Unsupported`] |
/// | `postgres`, `postgresql` | `postgres://user:pass@host:port/db[?mode=advisory|row|lease&table=…&schema=…&key=…]`: the driver's URL as written (distlock's parameters stripped) |
///
/// Every URL may carry `?lease=DURATION` (default 30 s; for etcd the session TTL, for ZooKeeper the
/// negotiated session timeout), the lease of the locks it hands out. A
/// scheme whose cargo feature is off fails with [`ErrorKind::InvalidConfig`] naming the feature.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use distlock::ErrorKind;
/// let err = distlock::connect("gopher://x").await.unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::InvalidConfig);
/// let err = distlock::connect("memory://?lease=0s").await.unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::InvalidConfig);
/// # }
/// ```
pub async fn connect(url: &str) -> Result<Locks> {
    // The SQL drivers' own URLs (unix-socket forms such as `postgresql:///db?host=/dir` included), read
    // by the SQL crate (`SqlConfig::from_url`, `?lease=` included) rather than LockUrl.
    match url.split_once("://") {
        Some(("postgres" | "postgresql", _)) => return postgres(url).await,
        Some(("mysql" | "mariadb", _)) => return mysql(url).await,
        _ => {}
    }
    let parsed = LockUrl::parse(url)?;
    let lease = parsed.query_duration("lease")?;
    let mut defaults = LockOptions::default();
    if let Some(lease) = lease {
        defaults = defaults.with_lease(lease);
    }
    defaults.validate()?;
    match parsed.scheme() {
        "memory" => Ok(Locks::with_defaults(
            distlock_core::MemoryBackend::from_url(&parsed)?,
            defaults,
        )),
        "file" => file(&parsed, defaults),
        "etcd" | "etcds" => etcd(&parsed, lease).await,
        "zk" | "zks" => zookeeper(&parsed, lease).await,
        "redis" | "rediss" | "redis+sentinel" | "redis+cluster" => redis(&parsed, defaults).await,
        "redlock" | "redlocks" => redlock(&parsed, defaults).await,
        other => Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "unknown URL scheme {other:?} in {:?}; known: memory, file, redis, rediss, redis+sentinel, redis+cluster, redlock, redlocks, etcd, etcds, zk, zks, postgres, postgresql, mysql, mariadb",
                redact(url)
            ),
        )),
    }
}

#[cfg(feature = "file")]
fn file(url: &LockUrl, defaults: LockOptions) -> Result<Locks> {
    Ok(Locks::with_defaults(
        distlock_file::FileBackend::from_url(url)?,
        defaults,
    ))
}

#[cfg(not(feature = "file"))]
fn file(_url: &LockUrl, _defaults: LockOptions) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        "file:// needs distlock's `file` cargo feature, which is not enabled",
    ))
}

/// Erases a driver's connect future. Its type is deep enough (tonic, redis-rs) that checking auto traits
/// of `connect`'s future overflowed the compiler's query depth in callers' crates once several backends
/// were compiled in.
#[cfg(any(feature = "redis", feature = "etcd", feature = "zookeeper"))]
fn erased<'a, T>(
    future: impl std::future::Future<Output = T> + Send + 'a,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>> {
    Box::pin(future)
}

#[cfg(feature = "redis")]
async fn redis(url: &LockUrl, defaults: LockOptions) -> Result<Locks> {
    let backend = erased(distlock_redis::connect(url)).await?;
    Ok(Locks::with_defaults(backend, defaults))
}

/// Redlock lives in the Redis crate and comes with the `redis` feature.
#[cfg(feature = "redis")]
async fn redlock(url: &LockUrl, defaults: LockOptions) -> Result<Locks> {
    let backend = erased(distlock_redis::RedlockBackend::connect(url)).await?;
    Ok(Locks::with_defaults(backend, defaults))
}

#[cfg(not(feature = "redis"))]
async fn redlock(url: &LockUrl, defaults: LockOptions) -> Result<Locks> {
    redis(url, defaults).await
}

#[cfg(not(feature = "redis"))]
async fn redis(url: &LockUrl, _defaults: LockOptions) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "{}:// needs distlock's `redis` cargo feature, which is not enabled",
            url.scheme()
        ),
    ))
}

/// etcd locks default to the session TTL (`?session_ttl=`, 60 s like Go's `concurrency.Session`), so
/// that a lock without its own lease rides the default session.
#[cfg(feature = "etcd")]
async fn etcd(url: &LockUrl, lease: Option<std::time::Duration>) -> Result<Locks> {
    let backend = erased(distlock_etcd::connect(url)).await?;
    let mut defaults = backend.default_options();
    if let Some(lease) = lease {
        defaults = defaults.with_lease(lease);
    }
    Ok(Locks::with_defaults(backend, defaults))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(_url: &LockUrl, _lease: Option<std::time::Duration>) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        "etcd:// needs distlock's `etcd` cargo feature, which is not enabled",
    ))
}

/// ZooKeeper locks default to the negotiated session timeout (`?session_timeout=`, 60 s asked as
/// Curator does, bounded by the server's `maxSessionTimeout`), so a lock without its own lease rides the
/// default session.
#[cfg(feature = "zookeeper")]
async fn zookeeper(url: &LockUrl, lease: Option<std::time::Duration>) -> Result<Locks> {
    let backend = erased(distlock_zookeeper::connect(url)).await?;
    let mut defaults = backend.default_options();
    if let Some(lease) = lease {
        defaults = defaults.with_lease(lease);
    }
    Ok(Locks::with_defaults(backend, defaults))
}

#[cfg(not(feature = "zookeeper"))]
async fn zookeeper(url: &LockUrl, _lease: Option<std::time::Duration>) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "{}:// needs distlock's `zookeeper` cargo feature, which is not enabled",
            url.scheme()
        ),
    ))
}

/// The default options of an SQL URL's locks (`?lease=`), checked before any I/O.
#[cfg(any(feature = "mysql", feature = "postgres"))]
fn sql_defaults(config: &distlock_sql::SqlConfig) -> Result<LockOptions> {
    let mut defaults = LockOptions::default();
    if let Some(lease) = config.lease {
        defaults = defaults.with_lease(lease);
    }
    defaults.validate()?;
    Ok(defaults)
}

/// MySQL / MariaDB: `mysql://` and `mariadb://` (`?mode=advisory|row|lease&table=&schema=&lease=`),
/// the rest of the URL handed to mysql_async as written (`mariadb://` spelled `mysql://`).
#[cfg(feature = "mysql")]
async fn mysql(url: &str) -> Result<Locks> {
    let config = distlock_sql::SqlConfig::from_url(url)?;
    let defaults = sql_defaults(&config)?;
    let backend = Box::pin(distlock_sql::mysql::MysqlBackend::from_config(config)).await?;
    Ok(Locks::with_defaults(backend, defaults))
}

#[cfg(not(feature = "mysql"))]
async fn mysql(_url: &str) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        "mysql:// and mariadb:// need distlock's `mysql` cargo feature, which is not enabled",
    ))
}

/// `postgres://` / `postgresql://`: the URL as tokio-postgres reads it, plus distlock's
/// `?mode=advisory|row|lease&table=&schema=&key=&lease=` (see `distlock_sql::SqlConfig::from_url`).
#[cfg(feature = "postgres")]
async fn postgres(url: &str) -> Result<Locks> {
    let config = distlock_sql::SqlConfig::from_url(url)?;
    let defaults = sql_defaults(&config)?;
    let backend = Box::pin(distlock_sql::postgres::PostgresBackend::from_config(config)).await?;
    Ok(Locks::with_defaults(backend, defaults))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(_url: &str) -> Result<Locks> {
    Err(Error::new(
        ErrorKind::InvalidConfig,
        "postgres:// needs distlock's `postgres` cargo feature, which is not enabled",
    ))
}

/// The directory `distlock run` uses when no URL is given: `$XDG_STATE_HOME/distlock`, else
/// `~/.local/state/distlock`, else `/tmp/distlock-<uid>`. Per user; pass `file:///var/lock/…` to share
/// across users.
pub fn default_file_dir() -> PathBuf {
    if let Some(state) = std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(state).join("distlock");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home).join(".local/state/distlock");
    }
    std::env::temp_dir().join(format!("distlock-{}", rustix::process::getuid().as_raw()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An SQL URL's `?lease=` is checked before any I/O, as every other scheme's is (port 1 would
    /// answer `Unavailable` if a connect were tried).
    #[cfg(all(feature = "mysql", feature = "postgres"))]
    #[tokio::test]
    async fn sql_lease_is_checked_before_connecting() {
        for url in [
            "mysql://u@127.0.0.1:1/db?lease=0s",
            "mariadb://u@127.0.0.1:1/db?lease=0s",
            "postgres://u@127.0.0.1:1/db?lease=0s",
            "postgresql://u@127.0.0.1:1/db?lease=bogus",
        ] {
            let err = connect(url).await.err().map(|e| e.kind());
            assert_eq!(err, Some(ErrorKind::InvalidConfig), "{url}");
        }
    }
}
