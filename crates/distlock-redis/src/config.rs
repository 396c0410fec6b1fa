//! The Redis backend's configuration and its URL forms.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Result;

use crate::error::RedisError;

/// Query parameters a Redis URL may carry. `lease` is read by the facade (`connect`).
const KNOWN_QUERY: &[&str] = &["lease", "wait_replicas", "wait_timeout", "ca"];

/// Default port of a Redis server.
pub const DEFAULT_PORT: u16 = 6379;
/// Default port of a Sentinel.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;
/// Default bound of one request (and of a pub/sub subscription's confirmation).
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a connection attempt.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Default `WAIT` timeout: Redisson's `slavesSyncTimeout`.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the servers are.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (`redis://host:port`, `rediss://…`).
    Standalone {
        /// `host:port`.
        addr: String,
    },
    /// A master found through Sentinel (`redis+sentinel://h:p,h:p/<master>`), re-resolved on every
    /// (re)connect so locks follow a failover.
    Sentinel {
        /// The Sentinels, `host:port` each.
        sentinels: Vec<String>,
        /// The monitored master's name.
        master: String,
    },
    /// A Redis Cluster (`redis+cluster://h:p,h:p`): any reachable nodes; the rest is discovered.
    Cluster {
        /// Seed nodes, `host:port` each.
        nodes: Vec<String>,
    },
}

/// How the Redis backend connects and how durable its grants are. Built with [`RedisConfig::new`] (or
/// the `sentinel`/`cluster` constructors) or [`RedisConfig::from_url`], adjusted with `with_*`, and
/// turned into a backend with [`RedisBackend::from_config`](crate::RedisBackend::from_config).
///
/// ```
/// use std::time::Duration;
/// use distlock_redis::RedisConfig;
///
/// let config = RedisConfig::new("127.0.0.1:6379")
///     .with_credentials(Some("app".into()), Some("s3cret".into()))
///     .with_wait_replicas(1, Duration::from_millis(200));
/// assert!(!format!("{config:?}").contains("s3cret"));
/// assert_eq!(config.wait_replicas, 1);
/// ```
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Where the servers are.
    pub topology: Topology,
    /// TLS to the servers (`rediss://`); needs the `tls` feature (on by default). The servers'
    /// certificates are verified against the system roots, or only against [`ca_file`](Self::ca_file).
    pub tls: bool,
    /// A PEM file with the CA(s) that signed the servers' certificates (`rediss://…?ca=/path/ca.pem`),
    /// trusted instead of the system roots; read on every connect.
    pub ca_file: Option<PathBuf>,
    /// ACL user name (Redis ≥ 6), for the data nodes (not the Sentinels).
    pub username: Option<String>,
    /// Password, for the data nodes (not the Sentinels). Never shown by `Debug`.
    pub password: Option<String>,
    /// Database number (not in Cluster).
    pub db: i64,
    /// Replicas that must confirm a grant (`WAIT n`) before it counts; 0 (the default) = no wait.
    pub wait_replicas: u32,
    /// How long `WAIT` may block.
    pub wait_timeout: Duration,
    /// Bound of one request; a connection whose request timed out is replaced.
    pub io_timeout: Duration,
    /// Bound of one connection attempt.
    pub connect_timeout: Duration,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("topology", &self.topology)
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("wait_replicas", &self.wait_replicas)
            .field("wait_timeout", &self.wait_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl RedisConfig {
    fn with_topology(topology: Topology) -> Self {
        Self {
            topology,
            tls: false,
            ca_file: None,
            username: None,
            password: None,
            db: 0,
            wait_replicas: 0,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            io_timeout: DEFAULT_IO_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// One server at `host:port`.
    pub fn new(addr: impl Into<String>) -> Self {
        Self::with_topology(Topology::Standalone { addr: addr.into() })
    }

    /// The master `master` monitored by these Sentinels.
    pub fn sentinel(sentinels: Vec<String>, master: impl Into<String>) -> Self {
        Self::with_topology(Topology::Sentinel {
            sentinels,
            master: master.into(),
        })
    }

    /// A Cluster reached through these seed nodes.
    pub fn cluster(nodes: Vec<String>) -> Self {
        Self::with_topology(Topology::Cluster { nodes })
    }

    /// Sets the user and password.
    pub fn with_credentials(mut self, username: Option<String>, password: Option<String>) -> Self {
        self.username = username;
        self.password = password;
        self
    }

    /// Sets TLS.
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// Trusts the CA(s) in this PEM file (instead of the system roots) for the servers' certificates,
    /// and turns TLS on.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self.tls = true;
        self
    }

    /// Sets the database number.
    pub fn with_db(mut self, db: i64) -> Self {
        self.db = db;
        self
    }

    /// Requires `replicas` replicas to confirm every grant and renewal within `timeout` (`WAIT`).
    pub fn with_wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas = replicas;
        self.wait_timeout = timeout;
        self
    }

    /// Sets the request and connect bounds.
    pub fn with_timeouts(mut self, io: Duration, connect: Duration) -> Self {
        self.io_timeout = io.max(Duration::from_millis(10));
        self.connect_timeout = connect.max(Duration::from_millis(10));
        self
    }

    /// Parses a URL (DESIGN §2):
    ///
    /// * `redis://[user:pass@]host[:port][/db]` and `rediss://…` (TLS); port 6379 by default;
    /// * `redis+sentinel://[user:pass@]h:p,h:p/<master>[/db]`; port 26379 by default; the credentials
    ///   are for the master, not the Sentinels;
    /// * `redis+cluster://[user:pass@]h:p,h:p`;
    ///
    /// with query parameters `lease` (read by the facade), `wait_replicas=N`, `wait_timeout=DUR`
    /// (default 1 s) and, for `rediss://`, `ca=/path/ca.pem` (a PEM file with the CA that signed the
    /// server's certificate, trusted instead of the system roots; a missing or unreadable file fails the
    /// connect with `InvalidConfig`). Anything else is refused with `InvalidConfig`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use distlock_core::{url::LockUrl, ErrorKind};
    /// use distlock_redis::{RedisConfig, Topology};
    ///
    /// let c = RedisConfig::from_url(&LockUrl::parse("redis://u:pw@127.0.0.1:7000/3?wait_replicas=1&wait_timeout=200ms&lease=5s")?)?;
    /// assert_eq!(c.topology, Topology::Standalone { addr: "127.0.0.1:7000".into() });
    /// assert_eq!((c.db, c.wait_replicas, c.wait_timeout), (3, 1, Duration::from_millis(200)));
    /// assert_eq!(c.password.as_deref(), Some("pw"));
    ///
    /// let t = RedisConfig::from_url(&LockUrl::parse("rediss://127.0.0.1:6380?ca=/etc/redis/ca.pem")?)?;
    /// assert!(t.tls);
    /// assert_eq!(t.ca_file.as_deref(), Some(std::path::Path::new("/etc/redis/ca.pem")));
    ///
    /// let s = RedisConfig::from_url(&LockUrl::parse("redis+sentinel://127.0.0.1:26379,127.0.0.1/mymaster")?)?;
    /// assert_eq!(s.topology, Topology::Sentinel {
    ///     sentinels: vec!["127.0.0.1:26379".into(), "127.0.0.1:26379".into()],
    ///     master: "mymaster".into(),
    /// });
    ///
    /// for bad in ["redis://a:1,b:2", "redis://h?bogus=1", "redis://h/x", "redis+sentinel://h",
    ///             "redis+cluster://h/1", "redis://h?wait_replicas=x", "redis://", "redis://h?ca=/ca.pem"] {
    ///     let err = RedisConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.into_core(None))
    }

    fn parse_url(url: &LockUrl) -> std::result::Result<Self, RedisError> {
        url.reject_unknown_query(KNOWN_QUERY)
            .map_err(|e| RedisError::Config(e.message().to_string()))?;
        let scheme = url.scheme();
        let hosts = url.hosts();
        if hosts.is_empty() {
            return Err(RedisError::Config(format!(
                "a {scheme}:// URL needs a host, for example {scheme}://127.0.0.1:{}",
                if scheme == "redis+sentinel" {
                    DEFAULT_SENTINEL_PORT
                } else {
                    DEFAULT_PORT
                }
            )));
        }
        let segments: Vec<&str> = url.path().split('/').filter(|s| !s.is_empty()).collect();
        let parse_db = |s: &str| {
            s.parse::<i64>().ok().filter(|d| *d >= 0).ok_or_else(|| {
                RedisError::Config(format!(
                    "{s:?} is not a database number; the URL path is /<db>, a number such as /0"
                ))
            })
        };
        let mut config = match scheme {
            "redis" | "rediss" => {
                let [host] = hosts else {
                    return Err(RedisError::Config(format!(
                        "{scheme}:// takes one host; use redis+sentinel:// or redis+cluster:// for several, or redlock:// for independent masters"
                    )));
                };
                let db = match segments.as_slice() {
                    [] => 0,
                    [db] => parse_db(db)?,
                    _ => {
                        return Err(RedisError::Config(
                            "the URL path is /<db>, a number such as /0".into(),
                        ))
                    }
                };
                Self::new(with_port(host, DEFAULT_PORT)?)
                    .with_tls(scheme == "rediss")
                    .with_db(db)
            }
            "redis+sentinel" => {
                let (master, db) = match segments.as_slice() {
                    [master] => (*master, 0),
                    [master, db] => (*master, parse_db(db)?),
                    _ => {
                        return Err(RedisError::Config(
                            "redis+sentinel://h:p,h:p/<master name>[/db]: the master's name is missing"
                                .into(),
                        ))
                    }
                };
                let sentinels = hosts
                    .iter()
                    .map(|h| with_port(h, DEFAULT_SENTINEL_PORT))
                    .collect::<std::result::Result<_, _>>()?;
                Self::sentinel(sentinels, master).with_db(db)
            }
            "redis+cluster" => {
                if !segments.is_empty() {
                    return Err(RedisError::Config(
                        "redis+cluster:// takes no path: a Cluster has only database 0".into(),
                    ));
                }
                let nodes = hosts
                    .iter()
                    .map(|h| with_port(h, DEFAULT_PORT))
                    .collect::<std::result::Result<_, _>>()?;
                Self::cluster(nodes)
            }
            other => {
                return Err(RedisError::Config(format!(
                    "the Redis backend takes redis://, rediss://, redis+sentinel:// and redis+cluster:// URLs, not {other}://"
                )))
            }
        };
        config.username = url.username().map(str::to_string);
        config.password = url.password().map(str::to_string);
        if let Some(n) = url.query("wait_replicas") {
            config.wait_replicas = n.parse().map_err(|_| {
                RedisError::Config(format!(
                    "URL parameter wait_replicas: {n:?} is not a number of replicas"
                ))
            })?;
        }
        if let Some(t) = url
            .query_duration("wait_timeout")
            .map_err(|e| RedisError::Config(e.message().to_string()))?
        {
            if config.wait_replicas == 0 {
                return Err(RedisError::Config(
                    "URL parameter wait_timeout needs wait_replicas=N (N ≥ 1): without it nothing waits"
                        .into(),
                ));
            }
            config.wait_timeout = t;
        }
        if let Some(ca) = url.query("ca") {
            if !config.tls {
                return Err(RedisError::Config(format!(
                    "URL parameter ca needs TLS: use rediss:// (not {scheme}://)"
                )));
            }
            if ca.is_empty() {
                return Err(RedisError::Config(
                    "URL parameter ca: the path of a PEM file is missing, e.g. ?ca=/path/ca.pem"
                        .into(),
                ));
            }
            config.ca_file = Some(PathBuf::from(ca));
        }
        config.check()?;
        Ok(config)
    }

    /// Checks combinations the builder allows but the backend cannot honour.
    pub(crate) fn check(&self) -> std::result::Result<(), RedisError> {
        if self.tls && !cfg!(feature = "tls") {
            return Err(RedisError::Config(
                "rediss:// needs the `tls` feature of distlock-redis".into(),
            ));
        }
        if self.ca_file.is_some() && !self.tls {
            return Err(RedisError::Config(
                "a CA file (ca_file, ?ca=) needs TLS (rediss://)".into(),
            ));
        }
        if self.ca_file.is_some() && matches!(self.topology, Topology::Sentinel { .. }) {
            return Err(RedisError::Unsupported(
                "a CA file (ca_file) is not supported with Sentinel yet; use a CA in the system roots"
                    .into(),
            ));
        }
        match &self.topology {
            Topology::Standalone { addr } if addr.is_empty() => {
                Err(RedisError::Config("the server address is empty".into()))
            }
            Topology::Sentinel { sentinels, master } if sentinels.is_empty() || master.is_empty() => {
                Err(RedisError::Config(
                    "Sentinel needs at least one Sentinel address and the master's name".into(),
                ))
            }
            Topology::Cluster { nodes } if nodes.is_empty() => Err(RedisError::Config(
                "Cluster needs at least one seed node".into(),
            )),
            Topology::Cluster { .. } if self.db != 0 => Err(RedisError::Config(
                "a Cluster has only database 0".into(),
            )),
            Topology::Cluster { .. } if self.wait_replicas > 0 => Err(RedisError::Unsupported(
                "wait_replicas is not supported in Cluster mode yet (WAIT needs a dedicated connection to the key's master); use Sentinel or standalone".into(),
            )),
            _ => Ok(()),
        }
    }
}

/// `host` or `host:port` (or `[v6]`, `[v6]:port`) → `host:port`.
fn with_port(host: &str, default: u16) -> std::result::Result<String, RedisError> {
    split_host(host, default).map(|(h, p)| {
        if h.contains(':') {
            format!("[{h}]:{p}")
        } else {
            format!("{h}:{p}")
        }
    })
}

/// `host:port` (as [`with_port`] makes it) → (host without brackets, port).
pub(crate) fn split_host(
    host: &str,
    default: u16,
) -> std::result::Result<(String, u16), RedisError> {
    let bad = || RedisError::Config(format!("{host:?} is not host[:port]"));
    if let Some(rest) = host.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad())?,
            None if after.is_empty() => default,
            None => return Err(bad()),
        };
        return Ok((h.to_string(), port));
    }
    match host.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() => Ok((h.to_string(), p.parse().map_err(|_| bad())?)),
        Some(_) => Err(bad()),
        None if host.is_empty() => Err(bad()),
        None => Ok((host.to_string(), default)),
    }
}
