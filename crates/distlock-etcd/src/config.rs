//! The etcd backend's configuration and its URL form,
//! `etcd://[user:pass@]h:p,h:p[?session_ttl=60s]` (`etcds://…[?ca=/path/ca.pem]` for TLS, `ca` being a
//! PEM file with the CA that signed the servers' certificates, trusted besides the system roots).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Result;

use crate::error::EtcdError;

/// Query parameters an etcd URL may carry. `lease` is read by the facade (the default lease of the
/// locks it hands out); the rest are ours.
const KNOWN_QUERY: &[&str] = &["lease", "session_ttl", "timeout", "ca"];

/// The default session TTL: 60 s, as Go's `concurrency.NewSession`.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(60);
/// The default bound of one request (connect, txn, keep-alive round trip).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
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
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port` of each member; requests fail over between them.
    pub endpoints: Vec<String>,
    /// Talk TLS (`etcds://`), verifying the server against the system roots and [`ca_file`](Self::ca_file).
    pub tls: bool,
    /// A PEM file with the CA that signed the servers' certificates (`?ca=/path`).
    pub ca_file: Option<PathBuf>,
    /// User name for etcd's authentication.
    pub user: Option<String>,
    /// Password for etcd's authentication. Never printed.
    pub password: Option<String>,
    /// The TTL of the session used by locks that do not ask for a lease of their own; also the
    /// default lease [`EtcdBackend::default_lease`](crate::EtcdBackend::default_lease) reports.
    pub session_ttl: Duration,
    /// The bound of one request; a keep-alive round trip is also bounded by a third of its TTL.
    pub timeout: Duration,
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("session_ttl", &self.session_ttl)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl EtcdConfig {
    /// Plain-text connections to `endpoints` (`host:port`, port 2379 if omitted), no auth, the defaults.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls: false,
            ca_file: None,
            user: None,
            password: None,
            session_ttl: DEFAULT_SESSION_TTL,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Parses `etcd://[user:pass@]h:p[,h:p…][?session_ttl=60s&timeout=5s]` or `etcds://…[?ca=/ca.pem]`.
    /// Refused with [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig): another
    /// scheme, no host, a path, unknown parameters, a session TTL under 1 s or not whole seconds.
    ///
    /// ```
    /// use distlock_core::{url::LockUrl, ErrorKind};
    /// use distlock_etcd::EtcdConfig;
    ///
    /// let c = EtcdConfig::from_url(&LockUrl::parse("etcd://u:pw@10.0.0.1:2379,10.0.0.2?session_ttl=10s")?)?;
    /// assert_eq!(c.endpoints, ["10.0.0.1:2379", "10.0.0.2:2379"]);
    /// assert_eq!(c.user.as_deref(), Some("u"));
    /// assert_eq!(c.session_ttl, std::time::Duration::from_secs(10));
    ///
    /// let t = EtcdConfig::from_url(&LockUrl::parse("etcds://127.0.0.1:2379?ca=/etc/etcd/ca.pem")?)?;
    /// assert!(t.tls);
    /// assert_eq!(t.ca_file.as_deref(), Some(std::path::Path::new("/etc/etcd/ca.pem")));
    ///
    /// for bad in ["etcd://", "etcd://h:1/path", "etcd://h:1?bogus=1", "etcd://h:1?session_ttl=1500ms",
    ///             "etcd://u@h:1", "redis://h:1", "etcd://h:1?ca=/ca.pem"] {
    ///     let err = EtcdConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.into_core(None))
    }

    fn parse_url(url: &LockUrl) -> std::result::Result<Self, EtcdError> {
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
            .map_err(|e| EtcdError::Config(e.message().to_string()))?;
        if url.hosts().is_empty() {
            return Err(EtcdError::Config(
                "an etcd URL needs at least one endpoint: etcd://host:port[,host:port…]".into(),
            ));
        }
        if !url.path().trim_matches('/').is_empty() {
            return Err(EtcdError::Config(format!(
                "an etcd URL takes no path (got {:?}); lock names are given to lock(), not in the URL",
                url.path()
            )));
        }
        if url.username().is_some() != url.password().is_some() {
            return Err(EtcdError::Config(
                "etcd authentication needs both a user and a password: etcd://user:password@host:port"
                    .into(),
            ));
        }
        let duration = |key: &str| {
            url.query_duration(key)
                .map_err(|e| EtcdError::Config(e.message().to_string()))
        };
        let mut config = Self::new(url.hosts().iter().cloned()).with_tls(tls);
        config.endpoints = config
            .endpoints
            .iter()
            .map(|h| with_default_port(h))
            .collect();
        if let (Some(user), Some(password)) = (url.username(), url.password()) {
            config = config.with_credentials(user, password);
        }
        if let Some(ttl) = duration("session_ttl")? {
            check_session_ttl(ttl)?;
            config.session_ttl = ttl;
        }
        if let Some(timeout) = duration("timeout")? {
            if timeout.is_zero() {
                return Err(EtcdError::Config(
                    "URL parameter timeout must not be 0".into(),
                ));
            }
            config.timeout = timeout;
        }
        if let Some(ca) = url.query("ca") {
            if !tls {
                return Err(EtcdError::Config(
                    "URL parameter ca needs TLS: use etcds://".into(),
                ));
            }
            config.ca_file = Some(PathBuf::from(ca));
        }
        Ok(config)
    }

    /// Sets the user and password.
    pub fn with_credentials(
        mut self,
        user: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.user = Some(user.into());
        self.password = Some(password.into());
        self
    }

    /// Sets [`tls`](Self::tls).
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// Sets [`ca_file`](Self::ca_file) (and turns TLS on).
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self.tls = true;
        self
    }

    /// Sets [`session_ttl`](Self::session_ttl); checked (whole seconds, at least 1 s) on connect.
    pub fn with_session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub(crate) fn validate(&self) -> std::result::Result<(), EtcdError> {
        if self.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoints given".into()));
        }
        check_session_ttl(self.session_ttl)?;
        if self.timeout.is_zero() {
            return Err(EtcdError::Config(
                "the request timeout must not be 0".into(),
            ));
        }
        Ok(())
    }

    /// The endpoints as etcd-client takes them (with the scheme).
    pub(crate) fn client_endpoints(&self) -> Vec<String> {
        let scheme = if self.tls { "https" } else { "http" };
        self.endpoints
            .iter()
            .map(|e| format!("{scheme}://{}", with_default_port(e)))
            .collect()
    }
}

fn with_default_port(host: &str) -> String {
    // `[::1]` has no port; `[::1]:2379` and `h:2379` have one.
    let has_port = !host.ends_with(']') && host.contains(':');
    if has_port {
        host.to_string()
    } else {
        format!("{host}:{DEFAULT_PORT}")
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
