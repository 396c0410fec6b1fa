//! The Redis backend's configuration and its URL forms.

use std::time::Duration;

use distlock_core::connection::{self, ConnectionOptions};
use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::{Error, Result};

use crate::error::{RedisError, BACKEND};

/// Query parameters a Redis URL may carry besides [`connection::URL_QUERY`]. `lease` is read by the
/// facade (`connect`).
const KNOWN_QUERY: &[&str] = &[
    "lease",
    "wait_replicas",
    "wait_timeout",
    "layout",
    "poll",
    "tokens",
    "fair",
];

/// Default port of a Redis server.
pub const DEFAULT_PORT: u16 = 6379;
/// Default port of a Sentinel.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;
/// Default bound of one request (and of a pub/sub subscription's confirmation).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default bound of a connection attempt.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Default `WAIT` timeout: Redisson's `slavesSyncTimeout`.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default retry of a request whose connection broke under it (reset, closed): once, on a fresh
/// connection, after 5–10 ms. A connection found broken is typically one that sat idle while the server
/// restarted or failed over, and the fresh one reaches the new server; a request that timed out or was
/// refused by the server (`WRONGTYPE`, `NOPERM`, …) is never retried.
pub const DEFAULT_RETRY: RetryPolicy =
    RetryPolicy::new(1, Duration::from_millis(10), Duration::from_secs(1));

/// How often a waiter on a [`RedisLayout::Plain`] lock tries again when no release message comes:
/// redis-py's `Lock` sleeps 0.1 s between tries, and its release publishes nothing.
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

/// The shortest `poll` accepted: each waiter's try is a request to the server.
const MIN_POLL: Duration = Duration::from_millis(10);

/// Which on-server layout the mutex uses (`?layout=` in the URL). Read-write locks and semaphores
/// keep Redisson's layouts under either.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::url::LockUrl;
/// use distlock_redis::{RedisConfig, RedisLayout};
///
/// let default = RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1")?)?;
/// assert_eq!(default.layout, RedisLayout::Redisson);
/// let plain = RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1?layout=plain&poll=250ms")?)?;
/// assert_eq!(plain.layout, RedisLayout::Plain { poll: Duration::from_millis(250), tokens: true });
/// let bare = RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1?layout=plain&tokens=false")?)?;
/// assert!(matches!(bare.layout, RedisLayout::Plain { tokens: false, .. }));
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisLayout {
    /// Redisson's `RLock` hash (the default): Java services using Redisson exclude distlock's holders.
    Redisson,
    /// The plain string key redis-py's `Lock`, rslock and node-redlock (one node) use: `NAME` = the
    /// owner, `SET NX PX`, released by an owner-checked delete. Their holders and distlock's exclude
    /// each other; waiters are woken by distlock's own channel, and try again every `poll` (jittered
    /// to ½–1×) for holders that publish nothing (redis-py).
    Plain {
        /// The longest a waiter sleeps between tries ([`DEFAULT_POLL`]).
        poll: Duration,
        /// Whether a grant mints a fencing token (`INCR` of the token key in the acquire's script;
        /// the default). Without (`tokens=false`), an acquire is one `SET NX PX` as redis-py's and
        /// rslock's, and guards carry no token ([`Fencing::None`](distlock_core::Fencing::None)).
        tokens: bool,
    },
}

/// Where the servers are.
///
/// ```
/// use distlock_core::url::LockUrl;
/// use distlock_redis::{RedisConfig, Topology};
///
/// let url = LockUrl::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")?;
/// let config = RedisConfig::from_url(&url)?;
/// assert!(matches!(&config.topology, Topology::Cluster { nodes } if nodes.len() == 2));
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server (`redis://host:port`, `rediss://…`).
    Standalone {
        /// The server.
        addr: Endpoint,
    },
    /// A master found through Sentinel (`redis+sentinel://h:p,h:p/<master>`), re-resolved on every
    /// (re)connect so locks follow a failover.
    Sentinel {
        /// The Sentinels.
        sentinels: Vec<Endpoint>,
        /// The monitored master's name.
        master: String,
    },
    /// A Redis Cluster (`redis+cluster://h:p,h:p`): any reachable nodes; the rest is discovered.
    Cluster {
        /// Seed nodes.
        nodes: Vec<Endpoint>,
    },
}

/// How the Redis backend connects and how durable its grants are. Built with [`RedisConfig::new`] (or
/// the `sentinel`/`cluster` constructors) or [`RedisConfig::from_url`], adjusted with `with_*`, and
/// turned into a backend with [`RedisBackend::from_config`](crate::RedisBackend::from_config).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::url::Endpoint;
/// use distlock_redis::RedisConfig;
///
/// let config = RedisConfig::new(Endpoint::new("127.0.0.1", 6379))
///     .with_credentials("app", "s3cret")
///     .with_request_timeout(Duration::from_secs(2))
///     .with_wait_replicas(1, Duration::from_millis(200));
/// assert!(!format!("{config:?}").contains("s3cret"));
/// assert_eq!(config.wait_replicas, 1);
/// assert_eq!(config.connection.request_timeout, Duration::from_secs(2));
/// config.validate()?;
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// Where the servers are.
    pub topology: Topology,
    /// Credentials, TLS, timeouts and retries, set with the `with_*` builders below. On Redis:
    ///
    /// * `tls` (`rediss://`) needs the `tls` feature (on by default); `ca_file` is read on every
    ///   connect, and not supported with Sentinel yet;
    /// * `username` is an ACL user (Redis ≥ 6); `password` alone authenticates the `default` user
    ///   (`requirepass`, [`with_password`](Self::with_password)). Both are for the data nodes, not
    ///   the Sentinels;
    /// * `connect_timeout` (default [`DEFAULT_CONNECT_TIMEOUT`]) bounds TCP, TLS, `HELLO`/`AUTH`
    ///   and asking the Sentinels;
    /// * `request_timeout` (default [`DEFAULT_REQUEST_TIMEOUT`]) bounds one request round trip; a
    ///   connection whose request timed out is replaced;
    /// * `retry` (default [`DEFAULT_RETRY`]) retries a request whose connection broke under it.
    pub connection: ConnectionOptions,
    /// Database number (not in Cluster).
    pub db: i64,
    /// Replicas that must confirm a grant (`WAIT n`) before it counts; 0 (the default) = no wait.
    pub wait_replicas: u32,
    /// How long `WAIT` may block.
    pub wait_timeout: Duration,
    /// The mutex's on-server layout ([`RedisLayout::Redisson`] by default).
    pub layout: RedisLayout,
    /// First come, first served across processes (`?fair=true`; off by default): a mutex's waiters
    /// queue on the server beside the lock, in either layout, and only the queue's head may take it
    /// (see [`layout::FAIR_ACQUIRE`](crate::layout::FAIR_ACQUIRE)). Read-write locks and semaphores
    /// are not queued.
    pub fair: bool,
}

impl RedisConfig {
    fn with_topology(topology: Topology) -> Self {
        Self {
            topology,
            connection: ConnectionOptions::new(
                DEFAULT_CONNECT_TIMEOUT,
                DEFAULT_REQUEST_TIMEOUT,
                DEFAULT_RETRY,
            ),
            db: 0,
            wait_replicas: 0,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            layout: RedisLayout::Redisson,
            fair: false,
        }
    }

    /// One server.
    pub fn new(addr: Endpoint) -> Self {
        Self::with_topology(Topology::Standalone { addr })
    }

    /// The master `master` monitored by these Sentinels.
    pub fn sentinel(sentinels: Vec<Endpoint>, master: impl Into<String>) -> Self {
        Self::with_topology(Topology::Sentinel {
            sentinels,
            master: master.into(),
        })
    }

    /// A Cluster reached through these seed nodes.
    pub fn cluster(nodes: Vec<Endpoint>) -> Self {
        Self::with_topology(Topology::Cluster { nodes })
    }

    // `with_credentials` (an ACL user, Redis ≥ 6), `with_password` (`requirepass`), `with_tls`,
    // `with_ca_file`, `with_connect_timeout`, `with_request_timeout`, `with_retry`.
    distlock_core::connection_builders!(connection, with_password);

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

    /// Sets the mutex's on-server layout.
    pub fn with_layout(mut self, layout: RedisLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Sets fair mode (see [`fair`](Self::fair)).
    ///
    /// ```
    /// use distlock_core::url::LockUrl;
    /// use distlock_redis::RedisConfig;
    ///
    /// let fair = RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1?fair=true")?)?;
    /// assert!(fair.fair);
    /// assert!(!RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1")?)?.fair);
    /// assert_eq!(fair, RedisConfig::from_url(&LockUrl::parse("redis://127.0.0.1")?)?.with_fair(true));
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn with_fair(mut self, fair: bool) -> Self {
        self.fair = fair;
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
    /// (default 1 s), `layout=redisson|plain` (default `redisson`: see [`RedisLayout`]), `poll=DUR`
    /// (with `layout=plain`; default [`DEFAULT_POLL`]), `tokens=true|false` (with `layout=plain`;
    /// default `true`), `fair=true|false` (default `false`: see [`fair`](Self::fair)), `connect_timeout=DUR` (default 3 s), `request_timeout=DUR` (default 5 s) and, for
    /// `rediss://`, `ca=/path/ca.pem` (a PEM file with the CA that signed the server's certificate,
    /// trusted instead of the system roots; a missing or unreadable file fails the connect with
    /// `InvalidConfig`). Anything else is refused with `InvalidConfig`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use distlock_core::{url::{Endpoint, LockUrl}, ErrorKind};
    /// use distlock_redis::{RedisConfig, Topology};
    ///
    /// let c = RedisConfig::from_url(&LockUrl::parse("redis://u:pw@127.0.0.1:7000/3?wait_replicas=1&wait_timeout=200ms&lease=5s&request_timeout=2s")?)?;
    /// assert_eq!(c.topology, Topology::Standalone { addr: Endpoint::new("127.0.0.1", 7000) });
    /// assert_eq!((c.db, c.wait_replicas, c.wait_timeout), (3, 1, Duration::from_millis(200)));
    /// let (u, pw) = (&c.connection.username, &c.connection.password);
    /// assert_eq!((u.as_deref(), pw.as_deref()), (Some("u"), Some("pw")));
    /// assert_eq!(c.connection.request_timeout, Duration::from_secs(2));
    ///
    /// let t = RedisConfig::from_url(&LockUrl::parse("rediss://127.0.0.1:6380?ca=/etc/redis/ca.pem&connect_timeout=1s")?)?;
    /// assert!(t.connection.tls);
    /// assert_eq!(t.connection.ca_file, Some("/etc/redis/ca.pem".into()));
    /// assert_eq!(t.connection.connect_timeout, Duration::from_secs(1));
    ///
    /// let s = RedisConfig::from_url(&LockUrl::parse("redis+sentinel://127.0.0.1:26379,127.0.0.1/mymaster")?)?;
    /// assert_eq!(s.topology, Topology::Sentinel {
    ///     sentinels: vec![Endpoint::new("127.0.0.1", 26379), Endpoint::new("127.0.0.1", 26379)],
    ///     master: "mymaster".into(),
    /// });
    ///
    /// for bad in ["redis://a:1,b:2", "redis://h?bogus=1", "redis://h/x", "redis+sentinel://h",
    ///             "redis+cluster://h/1", "redis://h?wait_replicas=x", "redis://", "redis://h?ca=/ca.pem",
    ///             "redis://h?request_timeout=0s", "redis+cluster://", "redis://h?layout=flat",
    ///             "redis://h?poll=1s", "redis://h?layout=plain&poll=0s", "redis://h?layout=plain&poll=1ms",
    ///             "redis://h?tokens=false", "redis://h?layout=plain&tokens=no", "redis://h?fair=yes",
    ///             "redis://h?fair=redisson"] {
    ///     let err = RedisConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        // The URL's own errors (a bad host list, timeout, `ca`) are tagged as this backend's too.
        Self::parse_url(url).map_err(|e| e.with_backend(BACKEND))
    }

    fn parse_url(url: &LockUrl) -> Result<Self> {
        url.reject_unknown_query(&[KNOWN_QUERY, connection::URL_QUERY].concat())?;
        let segments: Vec<&str> = url.path().split('/').filter(|s| !s.is_empty()).collect();
        let mut config = match url.scheme() {
            "redis" | "rediss" => standalone(url, &segments)?,
            "redis+sentinel" => sentinel(url, &segments)?,
            "redis+cluster" => cluster(url, &segments)?,
            other => {
                return Err(config_error(format!(
                    "the Redis backend takes redis://, rediss://, redis+sentinel:// and redis+cluster:// URLs, not {other}://"
                )))
            }
        };
        config.connection.read_url(url, url.scheme() == "rediss")?;
        config.apply_query(url)?;
        config.validate()?;
        Ok(config)
    }

    /// The query parameters of Redis's own that every scheme shares.
    fn apply_query(&mut self, url: &LockUrl) -> Result<()> {
        if let Some(n) = url.query("wait_replicas") {
            self.wait_replicas = n.parse().map_err(|_| {
                config_error(format!(
                    "URL parameter wait_replicas: {n:?} is not a number of replicas"
                ))
            })?;
        }
        if let Some(t) = url.query_duration("wait_timeout")? {
            if self.wait_replicas == 0 {
                return Err(config_error(
                    "URL parameter wait_timeout needs wait_replicas=N (N ≥ 1): without it nothing waits",
                ));
            }
            self.wait_timeout = t;
        }
        match url.query("layout") {
            None | Some("redisson") => {}
            Some("plain") => {
                self.layout = RedisLayout::Plain {
                    poll: DEFAULT_POLL,
                    tokens: true,
                }
            }
            Some(other) => {
                return Err(config_error(format!(
                    "URL parameter layout: {other:?} is not a layout; use layout=redisson (Redisson's RLock hash, the default) or layout=plain (SET NX PX, as redis-py's Lock)"
                )))
            }
        }
        if let Some(poll) = url.query_duration("poll")? {
            let RedisLayout::Plain {
                poll: ref mut p, ..
            } = self.layout
            else {
                return Err(config_error(
                    "URL parameter poll needs layout=plain: with Redisson's layout every release publishes, so waiters do not poll",
                ));
            };
            *p = poll;
        }
        match url.query("fair") {
            None | Some("false") => {}
            Some("true") => self.fair = true,
            Some("redisson") => {
                return Err(config_error(
                    "URL parameter fair=redisson: Redisson's RFairLock layout is not offered (its queue trusts each client's clock and stalls behind a dead waiter); use fair=true, distlock's queue beside the same RLock hash",
                ))
            }
            Some(other) => {
                return Err(config_error(format!(
                    "URL parameter fair: {other:?} is neither true nor false"
                )))
            }
        }
        if let Some(value) = url.query("tokens") {
            let RedisLayout::Plain { ref mut tokens, .. } = self.layout else {
                return Err(config_error(
                    "URL parameter tokens needs layout=plain: Redisson's layout always mints a token",
                ));
            };
            *tokens = match value {
                "true" => true,
                "false" => false,
                other => {
                    return Err(config_error(format!(
                        "URL parameter tokens: {other:?} is neither true nor false"
                    )))
                }
            };
        }
        Ok(())
    }

    /// Checks combinations the builder allows but the backend cannot honour (those of
    /// [`ConnectionOptions::validate`], and Redis's own);
    /// [`RedisBackend::from_config`](crate::RedisBackend::from_config) calls it.
    pub fn validate(&self) -> Result<()> {
        if self.connection.tls && !cfg!(feature = "tls") {
            return Err(config_error(
                "rediss:// needs the `tls` feature of distlock-redis",
            ));
        }
        self.connection
            .validate()
            .map_err(|e| e.with_backend(BACKEND))?;
        self.problem().map_err(|e| e.into_core(None))
    }

    fn problem(&self) -> std::result::Result<(), RedisError> {
        let config = |m: &str| Err(RedisError::Config(m.to_string()));
        let unsupported = |m: &str| Err(RedisError::Unsupported(m.to_string()));
        let sentinel = matches!(self.topology, Topology::Sentinel { .. });
        if self.connection.ca_file.is_some() && sentinel {
            return unsupported(
                "a CA file (ca_file) is not supported with Sentinel yet; use a CA in the system roots",
            );
        }
        match &self.topology {
            Topology::Standalone { addr } if addr.host().is_empty() => {
                config("the server address is empty")
            }
            Topology::Sentinel { sentinels, master } if sentinels.is_empty() || master.is_empty() => {
                config("Sentinel needs at least one Sentinel address and the master's name")
            }
            Topology::Cluster { nodes } if nodes.is_empty() => {
                config("Cluster needs at least one seed node")
            }
            Topology::Cluster { .. } if self.db != 0 => config("a Cluster has only database 0"),
            _ if matches!(self.layout, RedisLayout::Plain { poll, .. } if poll < MIN_POLL) => {
                config("poll must be at least 10 ms: it is how long a waiter sleeps between tries, and each try is a request to the server")
            }
            Topology::Cluster { .. } if self.wait_replicas > 0 => unsupported(
                "wait_replicas is not supported in Cluster mode yet (WAIT needs a dedicated connection to the key's master); use Sentinel or standalone",
            ),
            _ => Ok(()),
        }
    }
}

fn config_error(message: impl Into<String>) -> Error {
    RedisError::Config(message.into()).into_core(None)
}

/// `/<db>`: a non-negative number.
fn parse_db(segment: &str) -> Result<i64> {
    segment
        .parse::<i64>()
        .ok()
        .filter(|d| *d >= 0)
        .ok_or_else(|| {
            config_error(format!(
                "{segment:?} is not a database number; the URL path is /<db>, a number such as /0"
            ))
        })
}

/// `redis://host[:port][/db]`, `rediss://…`.
fn standalone(url: &LockUrl, segments: &[&str]) -> Result<RedisConfig> {
    let scheme = url.scheme();
    let [addr] = <[Endpoint; 1]>::try_from(url.endpoints(DEFAULT_PORT)?).map_err(|_| {
        config_error(format!(
            "{scheme}:// takes one host; use redis+sentinel:// or redis+cluster:// for several, or redlock:// for independent masters"
        ))
    })?;
    let db = match segments {
        [] => 0,
        [db] => parse_db(db)?,
        _ => return Err(config_error("the URL path is /<db>, a number such as /0")),
    };
    Ok(RedisConfig::new(addr).with_db(db))
}

/// `redis+sentinel://h:p,h:p/<master>[/db]`.
fn sentinel(url: &LockUrl, segments: &[&str]) -> Result<RedisConfig> {
    let sentinels = url.endpoints(DEFAULT_SENTINEL_PORT)?;
    let (master, db) = match segments {
        [master] => (*master, 0),
        [master, db] => (*master, parse_db(db)?),
        _ => {
            return Err(config_error(
                "redis+sentinel://h:p,h:p/<master name>[/db]: the master's name is missing",
            ))
        }
    };
    Ok(RedisConfig::sentinel(sentinels, master).with_db(db))
}

/// `redis+cluster://h:p,h:p`.
fn cluster(url: &LockUrl, segments: &[&str]) -> Result<RedisConfig> {
    let nodes = url.endpoints(DEFAULT_PORT)?;
    if !segments.is_empty() {
        return Err(config_error(
            "redis+cluster:// takes no path: a Cluster has only database 0",
        ));
    }
    Ok(RedisConfig::cluster(nodes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock_core::ErrorKind;

    #[test]
    fn zero_timeouts_set_on_the_fields_are_refused() {
        let base = RedisConfig::new(Endpoint::new("127.0.0.1", DEFAULT_PORT));
        assert!(base.validate().is_ok());
        let mut request = base.clone();
        request.connection.request_timeout = Duration::ZERO;
        let mut connect = base;
        connect.connection.connect_timeout = Duration::ZERO;
        for config in [request, connect] {
            let err = config.validate().expect_err("a zero timeout");
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
        }
    }
}
