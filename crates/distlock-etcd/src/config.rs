//! The etcd backend's configuration and its URL form,
//! `etcd://[username:password@]h:p,h:p[?session_ttl=60s]` (`etcds://…[?ca=/path/ca.pem]` for TLS, `ca`
//! being a PEM file with the CA(s) that signed the servers' certificates, trusted **instead of** the
//! system roots, as `etcdctl --cacert` does).

use std::time::Duration;

use distlock_core::connection::{self, ConnectionOptions};
use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::Result;

use crate::error::EtcdError;

/// Query parameters an etcd URL may carry besides [`connection::URL_QUERY`]. `lease` is read by the
/// facade (the default lease of the locks it hands out); `session_ttl` is ours.
const KNOWN_QUERY: &[&str] = &["lease", "session_ttl"];

/// The default session TTL: 60 s, as Go's `concurrency.NewSession`.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(60);
/// The default bound of one connection attempt (TCP, TLS, authentication, the first status call).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default bound of one request (a txn, a keep-alive round trip), retries included.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The default port of etcd's client URL.
pub const DEFAULT_PORT: u16 = 2379;

/// How the etcd backend is set up. Built with [`EtcdConfig::new`] or [`EtcdConfig::from_url`], adjusted
/// with the `with_*` methods, and connected with [`EtcdBackend::from_config`](crate::EtcdBackend::from_config).
///
/// `Debug` never shows the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_etcd::EtcdConfig;
///
/// let config = EtcdConfig::new(["127.0.0.1:2379", "127.0.0.1:22379"])
///     .with_credentials("app", "s3cret")
///     .with_session_ttl(Duration::from_secs(10));
/// assert_eq!(config.endpoints.len(), 2);
/// assert_eq!(config.connection.retry.max_retries, 5); // 1, and 4 per endpoint beyond the first
/// assert!(config.validate().is_ok());
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each member (`host`: port 2379; `[v6]:port`); requests fail over between
    /// them. Parsed with [`Endpoint::parse`] by [`validate`](Self::validate).
    pub endpoints: Vec<String>,
    /// Credentials, TLS, timeouts and retries, set with the `with_*` builders below. On etcd:
    ///
    /// * `tls` is `etcds://`; `username` and `password` (etcd's authentication) go together;
    /// * `connect_timeout` (default [`DEFAULT_CONNECT_TIMEOUT`]) bounds TCP, TLS, authentication
    ///   and the status call that proves a member answers;
    /// * `request_timeout` (default [`DEFAULT_REQUEST_TIMEOUT`]) bounds one request, its retries
    ///   included; a keep-alive round trip is also bounded by a third of its TTL;
    /// * `retry` retries idempotent requests (every request of the backend: all are
    ///   compare-guarded) within the request timeout. Default: 1 retry with one endpoint, 4 more per
    ///   endpoint beyond the first (requests go to the endpoints in turn, and one landing on a dead
    ///   member fails: the retry goes to the next; with several endpoints a request unanswered after
    ///   a quarter of the request timeout is also sent again, to the next member, alongside), 50 ms
    ///   apart, doubling up to 100 ms (jittered).
    pub connection: ConnectionOptions,
    /// The TTL of the session used by locks that do not ask for a lease of their own; also the
    /// default lease [`EtcdBackend::default_lease`](crate::EtcdBackend::default_lease) reports.
    pub session_ttl: Duration,
}

/// The default retry policy for `endpoints` endpoints (see [`EtcdConfig::connection`]).
fn default_retry(endpoints: usize) -> RetryPolicy {
    let retries = 1 + 4 * endpoints.saturating_sub(1);
    RetryPolicy::new(
        u32::try_from(retries).unwrap_or(u32::MAX),
        Duration::from_millis(50),
        Duration::from_millis(100),
    )
}

impl EtcdConfig {
    /// Plain-text connections to `endpoints` (`host:port`, port 2379 if omitted), no auth, the defaults.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let endpoints: Vec<String> = endpoints.into_iter().map(Into::into).collect();
        Self {
            connection: ConnectionOptions::new(
                DEFAULT_CONNECT_TIMEOUT,
                DEFAULT_REQUEST_TIMEOUT,
                default_retry(endpoints.len()),
            ),
            endpoints,
            session_ttl: DEFAULT_SESSION_TTL,
        }
    }

    /// Parses `etcd://[username:password@]h:p[,h:p…][?session_ttl=60s&connect_timeout=5s&request_timeout=5s]`
    /// or `etcds://…[?ca=/ca.pem]`. Refused with
    /// [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig): another scheme, no host,
    /// a path, unknown parameters, a session TTL under 1 s or not whole seconds, a zero timeout.
    ///
    /// ```
    /// use distlock_core::{url::LockUrl, ErrorKind};
    /// use distlock_etcd::EtcdConfig;
    ///
    /// let c = EtcdConfig::from_url(&LockUrl::parse("etcd://u:pw@10.0.0.1:2379,10.0.0.2?session_ttl=10s&request_timeout=2s")?)?;
    /// assert_eq!(c.endpoints, ["10.0.0.1:2379", "10.0.0.2:2379"]);
    /// assert_eq!(c.connection.username.as_deref(), Some("u"));
    /// assert_eq!(c.session_ttl, std::time::Duration::from_secs(10));
    /// assert_eq!(c.connection.request_timeout, std::time::Duration::from_secs(2));
    ///
    /// let t = EtcdConfig::from_url(&LockUrl::parse("etcds://127.0.0.1:2379?ca=/etc/etcd/ca.pem")?)?;
    /// assert!(t.connection.tls);
    /// assert_eq!(t.connection.ca_file, Some("/etc/etcd/ca.pem".into()));
    ///
    /// for bad in ["etcd://", "etcd://h:1/path", "etcd://h:1?bogus=1", "etcd://h:1?session_ttl=1500ms",
    ///             "etcd://u@h:1", "redis://h:1", "etcd://h:1?ca=/ca.pem", "etcd://h:1?timeout=1s",
    ///             "etcd://h:1?request_timeout=0s"] {
    ///     let err = EtcdConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.into_core(None))
    }

    fn parse_url(url: &LockUrl) -> std::result::Result<Self, EtcdError> {
        let config_error = |e: distlock_core::Error| EtcdError::Config(e.message().to_string());
        let tls = match url.scheme() {
            "etcd" => false,
            "etcds" => true,
            other => {
                return Err(EtcdError::Config(format!(
                    "the etcd backend takes etcd:// or etcds:// URLs, not {other}://"
                )))
            }
        };
        url.reject_unknown_query(&[KNOWN_QUERY, connection::URL_QUERY].concat())
            .map_err(config_error)?;
        let endpoints = url.endpoints(DEFAULT_PORT).map_err(config_error)?;
        if !url.path().trim_matches('/').is_empty() {
            return Err(EtcdError::Config(format!(
                "an etcd URL takes no path (got {:?}); lock names are given to lock(), not in the URL",
                url.path()
            )));
        }
        if url.username().is_some() != url.password().is_some() {
            return Err(EtcdError::Config(
                "etcd authentication needs both a username and a password: etcd://username:password@host:port"
                    .into(),
            ));
        }
        let mut config = Self::new(endpoints.iter().map(Endpoint::to_string));
        if let Some(ttl) = url.query_duration("session_ttl").map_err(config_error)? {
            check_session_ttl(ttl)?;
            config.session_ttl = ttl;
        }
        config.connection.read_url(url, tls).map_err(config_error)?;
        Ok(config)
    }

    // `with_credentials`, `with_tls`, `with_ca_file`, `with_connect_timeout`,
    // `with_request_timeout`, `with_retry`.
    distlock_core::connection_builders!(connection);

    /// Sets [`session_ttl`](Self::session_ttl); checked (whole seconds, at least 1 s) by
    /// [`validate`](Self::validate).
    pub fn with_session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// Checks what the builder allows but the backend cannot honour: no endpoint or one that is not
    /// `host[:port]`, a session TTL that is not whole seconds (at least 1 s), a zero timeout or a
    /// CA file without TLS ([`ConnectionOptions::validate`]), a username without a password (or
    /// the reverse). [`EtcdBackend::from_config`](crate::EtcdBackend::from_config)
    /// calls it.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|e| e.into_core(None))
    }

    pub(crate) fn check(&self) -> std::result::Result<(), EtcdError> {
        self.parsed_endpoints()?;
        check_session_ttl(self.session_ttl)?;
        self.connection
            .validate()
            .map_err(|e| EtcdError::Config(e.message().to_string()))?;
        if self.connection.username.is_some() != self.connection.password.is_some() {
            return Err(EtcdError::Config(
                "etcd authentication needs both a username and a password".into(),
            ));
        }
        Ok(())
    }

    /// The endpoints, parsed (port 2379 where none is given).
    pub(crate) fn parsed_endpoints(&self) -> std::result::Result<Vec<Endpoint>, EtcdError> {
        if self.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoints given".into()));
        }
        self.endpoints
            .iter()
            .map(|e| Endpoint::parse(e, DEFAULT_PORT))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| EtcdError::Config(e.message().to_string()))
    }
}

/// etcd leases are whole seconds: a session TTL that is not would be silently rounded.
fn check_session_ttl(ttl: Duration) -> std::result::Result<(), EtcdError> {
    if ttl < Duration::from_secs(1) || ttl.subsec_nanos() != 0 {
        return Err(EtcdError::Config(format!(
            "session_ttl must be whole seconds, at least 1s (etcd leases are whole seconds); got {ttl:?}"
        )));
    }
    Ok(())
}
