//! The etcd backend's configuration and its URL form,
//! `etcd://[username:password@]h:p,h:p[?session_ttl=60s]` (`etcds://…[?ca=/path/ca.pem]` for TLS, `ca`
//! being a PEM file with the CA(s) that signed the servers' certificates, trusted **instead of** the
//! system roots, as `etcdctl --cacert` does).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::Result;

use crate::error::EtcdError;

/// Query parameters an etcd URL may carry. `lease` is read by the facade (the default lease of the
/// locks it hands out); the rest are ours.
const KNOWN_QUERY: &[&str] = &[
    "lease",
    "session_ttl",
    "connect_timeout",
    "request_timeout",
    "ca",
];

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
/// assert_eq!(config.retry.max_retries, 5); // 1, and 4 per endpoint beyond the first
/// assert!(config.validate().is_ok());
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each member (`host`: port 2379; `[v6]:port`); requests fail over between
    /// them. Parsed with [`Endpoint::parse`] by [`validate`](Self::validate).
    pub endpoints: Vec<String>,
    /// Talk TLS (`etcds://`), verifying the servers against the system roots, or against
    /// [`ca_file`](Self::ca_file) alone when it is set.
    pub tls: bool,
    /// A PEM file with the CA(s) that signed the servers' certificates (`?ca=/path`), trusted
    /// **instead of** the system roots.
    pub ca_file: Option<PathBuf>,
    /// User name for etcd's authentication.
    pub username: Option<String>,
    /// Password for etcd's authentication. Never printed.
    pub password: Option<String>,
    /// The TTL of the session used by locks that do not ask for a lease of their own; also the
    /// default lease [`EtcdBackend::default_lease`](crate::EtcdBackend::default_lease) reports.
    pub session_ttl: Duration,
    /// The bound of one connection attempt: TCP, TLS, authentication and the status call that proves a
    /// member answers (`?connect_timeout=`).
    pub connect_timeout: Duration,
    /// The bound of one request, its retries included; a keep-alive round trip is also bounded by a
    /// third of its TTL (`?request_timeout=`).
    pub request_timeout: Duration,
    /// How idempotent requests (every request of the backend: all are compare-guarded) are retried
    /// within the request timeout. Default: 1 retry with one endpoint, 4 more per endpoint beyond the
    /// first (requests are balanced over the endpoints at random, and one landing on a dead member
    /// fails: with one of three members down, ten picks all landing on it is a ~1-in-60 000 event),
    /// 50 ms apart, doubling up to 100 ms (jittered).
    pub retry: RetryPolicy,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("session_ttl", &self.session_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("retry", &self.retry)
            .finish()
    }
}

/// The default retry policy for `endpoints` endpoints (see [`EtcdConfig::retry`]).
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
            retry: default_retry(endpoints.len()),
            endpoints,
            tls: false,
            ca_file: None,
            username: None,
            password: None,
            session_ttl: DEFAULT_SESSION_TTL,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
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
    /// assert_eq!(c.username.as_deref(), Some("u"));
    /// assert_eq!(c.session_ttl, std::time::Duration::from_secs(10));
    /// assert_eq!(c.request_timeout, std::time::Duration::from_secs(2));
    ///
    /// let t = EtcdConfig::from_url(&LockUrl::parse("etcds://127.0.0.1:2379?ca=/etc/etcd/ca.pem")?)?;
    /// assert!(t.tls);
    /// assert_eq!(t.ca_file.as_deref(), Some(std::path::Path::new("/etc/etcd/ca.pem")));
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
        url.reject_unknown_query(KNOWN_QUERY)
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
        let mut config = Self::new(endpoints.iter().map(Endpoint::to_string)).with_tls(tls);
        if let (Some(username), Some(password)) = (url.username(), url.password()) {
            config = config.with_credentials(username, password);
        }
        if let Some(ttl) = url.query_duration("session_ttl").map_err(config_error)? {
            check_session_ttl(ttl)?;
            config.session_ttl = ttl;
        }
        if let Some(timeout) = url.query_timeout("connect_timeout").map_err(config_error)? {
            config.connect_timeout = timeout;
        }
        if let Some(timeout) = url.query_timeout("request_timeout").map_err(config_error)? {
            config.request_timeout = timeout;
        }
        config.ca_file = url.ca_file(tls).map_err(config_error)?;
        Ok(config)
    }

    /// Sets the username and password.
    pub fn with_credentials(
        mut self,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.username = Some(username.into());
        self.password = Some(password.into());
        self
    }

    /// Sets [`tls`](Self::tls).
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// Sets [`ca_file`](Self::ca_file) (trusted instead of the system roots) and turns TLS on.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self.tls = true;
        self
    }

    /// Sets [`session_ttl`](Self::session_ttl); checked (whole seconds, at least 1 s) by
    /// [`validate`](Self::validate).
    pub fn with_session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout).
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets [`retry`](Self::retry).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Checks what the builder allows but the backend cannot honour: no endpoint or one that is not
    /// `host[:port]`, a session TTL that is not whole seconds (at least 1 s), a zero timeout, a
    /// username without a password (or the reverse). [`EtcdBackend::from_config`](crate::EtcdBackend::from_config)
    /// calls it.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|e| e.into_core(None))
    }

    pub(crate) fn check(&self) -> std::result::Result<(), EtcdError> {
        self.parsed_endpoints()?;
        check_session_ttl(self.session_ttl)?;
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(EtcdError::Config(
                "the connect and request timeouts must not be 0".into(),
            ));
        }
        if self.username.is_some() != self.password.is_some() {
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
