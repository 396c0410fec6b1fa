//! Redlock's configuration and its URL form.

use std::time::Duration;

use distlock_core::connection::{self, ConnectionOptions};
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::{Error, ErrorKind, Result};

use crate::config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRY,
};

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "redlock";

/// Query parameters a Redlock URL may carry besides [`connection::URL_QUERY`]. `lease` is read by the
/// facade (`connect`).
const KNOWN_QUERY: &[&str] = &["lease", "node_timeout"];

/// The fewest nodes Redlock runs on: with 2, a quorum (2) tolerates no failure at all.
pub const MIN_NODES: usize = 3;

/// How the Redlock backend reaches its N independent Redis masters. Built with [`RedlockConfig::new`] or
/// [`RedlockConfig::from_url`], turned into a backend with
/// [`RedlockBackend::from_config`](crate::redlock::RedlockBackend::from_config).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::url::{Endpoint, LockUrl};
/// use distlock_core::ErrorKind;
/// use distlock_redis::redlock::RedlockConfig;
///
/// let c = RedlockConfig::from_url(&LockUrl::parse("redlock://a:1,b:2,c?node_timeout=50ms&lease=5s")?)?;
/// assert_eq!(c.nodes, [Endpoint::new("a", 1), Endpoint::new("b", 2), Endpoint::new("c", 6379)]);
/// assert_eq!(c.node_timeout, Some(Duration::from_millis(50)));
/// assert_eq!(c.quorum(), 2);
/// let t = RedlockConfig::from_url(&LockUrl::parse("redlocks://u:pw@a,b,c,d,e")?)?;
/// assert!(t.connection.tls);
/// assert_eq!(t.quorum(), 3);
/// assert!(!format!("{t:?}").contains("pw"));
/// for bad in ["redlock://a,b", "redlock://a,b,c?wait_replicas=1", "redlock://a,b,c/1",
///             "redlock://a,b,c?node_timeout=0s", "redlock://a,b,c?bogus=1"] {
///     let err = RedlockConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}: {err}");
/// }
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedlockConfig {
    /// The independent masters (no replication between them), at least [`MIN_NODES`]; an odd number
    /// is recommended (an even one tolerates no more failures than the odd number below it).
    pub nodes: Vec<Endpoint>,
    /// Credentials (the same on every node), TLS (`redlocks://`), timeouts and retries, as for
    /// `redis://` ([`RedisConfig::connection`](crate::RedisConfig::connection)).
    /// `request_timeout` bounds releases and `inspect`; acquires and renewals use `node_timeout`.
    pub connection: ConnectionOptions,
    /// The bound of one node's reply to an acquire or renewal (`?node_timeout=`), which must be far
    /// below the lease: a node slower than this counts as a "no" vote. `None` (the default): a tenth
    /// of the lease asked for, between 5 ms and 1 s.
    pub node_timeout: Option<Duration>,
}

impl RedlockConfig {
    /// Redlock over these masters, with `redis://`'s default timeouts.
    pub fn new(nodes: Vec<Endpoint>) -> Self {
        Self {
            nodes,
            connection: ConnectionOptions::new(
                DEFAULT_CONNECT_TIMEOUT,
                DEFAULT_REQUEST_TIMEOUT,
                DEFAULT_RETRY,
            ),
            node_timeout: None,
        }
    }

    // `with_credentials`, `with_password`, `with_tls`, `with_ca_file`, `with_connect_timeout`,
    // `with_request_timeout`, `with_retry`.
    distlock_core::connection_builders!(connection, with_password);

    /// Sets [`node_timeout`](Self::node_timeout).
    pub fn with_node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// Grants needed: N/2 + 1.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The per-node bound for a request about a lease of `lease`: [`node_timeout`](Self::node_timeout),
    /// else a tenth of the lease, between 5 ms and 1 s.
    pub fn node_timeout_for(&self, lease: Duration) -> Duration {
        self.node_timeout
            .unwrap_or_else(|| (lease / 10).clamp(Duration::from_millis(5), Duration::from_secs(1)))
    }

    /// Parses `redlock://[user:pass@]h1:p1,h2:p2,h3:p3[?node_timeout=50ms]` (port 6379 by default) or
    /// `redlocks://…` (TLS, `?ca=/path/ca.pem`), with `lease`, `connect_timeout`, `request_timeout`
    /// as for `redis://`. Fewer than three nodes, a node listed twice, a path (`/db`), `wait_replicas`
    /// (it means nothing over independent masters), a `node_timeout` not below the URL's `lease`, and
    /// unknown parameters are refused with `InvalidConfig`.
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.with_backend(BACKEND))
    }

    fn parse_url(url: &LockUrl) -> Result<Self> {
        let tls = match url.scheme() {
            "redlock" => false,
            "redlocks" => true,
            other => {
                return Err(invalid(format!(
                    "the Redlock backend takes redlock:// and redlocks:// URLs, not {other}://"
                )))
            }
        };
        if url.query("wait_replicas").is_some() || url.query("wait_timeout").is_some() {
            return Err(invalid(
                "wait_replicas is not supported on redlock://: Redlock's nodes are independent masters without replicas; the quorum of nodes is its durability",
            ));
        }
        url.reject_unknown_query(&[KNOWN_QUERY, connection::URL_QUERY].concat())?;
        if !url.path().trim_matches('/').is_empty() {
            return Err(invalid(
                "redlock:// takes no path: every node uses database 0",
            ));
        }
        let mut config = Self::new(url.endpoints(DEFAULT_PORT)?);
        config.connection.read_url(url, tls)?;
        if let Some(t) = url.query_timeout("node_timeout")? {
            config.node_timeout = Some(t);
            if let Some(lease) = url.query_duration("lease")?.filter(|lease| t >= *lease) {
                return Err(invalid(format!(
                    "node_timeout ({t:?}) must be far below the lease ({lease:?}): a node's yes that slow leaves no validity; a tenth of the lease is the default"
                )));
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what the builder allows but Redlock cannot honour: fewer than three nodes, a node listed
    /// twice, a zero timeout, TLS without the `tls` feature.
    pub fn validate(&self) -> Result<()> {
        if self.nodes.len() < MIN_NODES {
            return Err(invalid(format!(
                "Redlock needs at least {MIN_NODES} independent Redis masters (an odd number such as 3 or 5), got {}; use redis:// for one server",
                self.nodes.len()
            )));
        }
        if self.nodes.iter().any(|n| n.host().is_empty()) {
            return Err(invalid("a Redlock node address is empty"));
        }
        if let Some((i, node)) = self
            .nodes
            .iter()
            .enumerate()
            .find(|(i, n)| self.nodes[..*i].contains(n))
        {
            return Err(invalid(format!(
                "the Redlock node {node} is listed twice (at {} and {}): each listed node must be a different Redis master, or one server's votes count twice toward the quorum",
                self.nodes.iter().position(|n| n == node).unwrap_or(0) + 1,
                i + 1
            )));
        }
        if self.node_timeout.is_some_and(|t| t.is_zero()) {
            return Err(invalid("node_timeout must not be 0"));
        }
        if self.connection.tls && !cfg!(feature = "tls") {
            return Err(invalid(
                "redlocks:// needs the `tls` feature of distlock-redis",
            ));
        }
        self.connection
            .validate()
            .map_err(|e| e.with_backend(BACKEND))
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidConfig, message.into()).with_backend(BACKEND)
}
