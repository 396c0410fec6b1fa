//! The ZooKeeper backend's configuration and its URL form,
//! `zk://[user:password@]h1:p1,h2:p2[/chroot][?session_timeout=60s]`.

use std::time::Duration;

use distlock_core::connection::{self, ConnectionOptions};
use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::Result;

use crate::error::ZkError;
use crate::layout;

/// Query parameters a ZooKeeper URL may carry besides [`connection::URL_QUERY`]. `lease` is read by
/// the facade (the default lease of the locks it hands out); `session_timeout` is ours.
const KNOWN_QUERY: &[&str] = &["lease", "session_timeout", "tick_time"];

/// The session timeout asked for by default: 60 s, Curator's default. The server bounds it by its
/// `minSessionTimeout`/`maxSessionTimeout` (2 and 20 ticks unless set: 40 s with the default 2 s tick);
/// what it negotiates is the default lease ([`ZkBackend::default_lease`](crate::ZkBackend::default_lease)).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(60);
/// The default bound of one connection attempt (TCP and the session handshake).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default bound of one request, its retries included.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// ZooKeeper's client port.
pub const DEFAULT_PORT: u16 = 2181;

/// How the ZooKeeper backend is set up. Built with [`ZkConfig::new`] or [`ZkConfig::from_url`],
/// adjusted with the `with_*` methods, connected with [`ZkBackend::from_config`](crate::ZkBackend::from_config).
///
/// `Debug` never shows the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_zookeeper::ZkConfig;
///
/// let config = ZkConfig::new(["127.0.0.1:2181", "127.0.0.1:2182"])
///     .with_credentials("app", "s3cret")
///     .with_chroot("/locks")
///     .with_session_timeout(Duration::from_secs(10));
/// assert!(config.validate().is_ok());
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZkConfig {
    /// `host:port` of each server (port 2181 if omitted).
    pub endpoints: Vec<String>,
    /// Credentials, timeouts and retries. On ZooKeeper:
    ///
    /// * `username` and `password` are added to every session as `digest` authentication
    ///   (`addauth digest user:password`); nodes are created with the open ACL, as Curator does by
    ///   default, so credentials matter where an operator's ACL on a parent asks for them;
    /// * `tls` is not supported (`zks://` fails with `Unsupported`);
    /// * `connect_timeout` (default [`DEFAULT_CONNECT_TIMEOUT`]) bounds establishing a session;
    /// * `request_timeout` (default [`DEFAULT_REQUEST_TIMEOUT`]) bounds one request, its retries
    ///   (after a lost connection, within the session) included;
    /// * `retry`: every request of the backend is safe to repeat (creates are found again by their
    ///   `_c_<uuid>` protection prefix).
    pub connection: ConnectionOptions,
    /// The session timeout to ask for; the negotiated one is the default lease.
    pub session_timeout: Duration,
    /// A path every lock path is put under (`/locks`), created when absent; `None` for the root.
    pub chroot: Option<String>,
    /// The servers' `tickTime`, or an upper bound of it; `None` (the default) assumes half the
    /// negotiated session timeout, the largest tickTime a server with ZooKeeper's default
    /// `minSessionTimeout` (2 ticks) can have with that timeout. A server a client reaches through a
    /// follower reports the client's activity to the leader only when the leader pings it (every
    /// tickTime/2), so grants and renewals are trusted for less than the session timeout by about
    /// 0.75·tickTime (see GUARANTEES); a smaller, true tickTime gives longer validity and fewer
    /// renewals. Setting it lower than the servers' real tickTime voids that guarantee.
    pub tick_time: Option<Duration>,
}

impl ZkConfig {
    /// Connections to `endpoints` (`host:port`, port 2181 if omitted), no auth, no chroot, the defaults.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connection: ConnectionOptions::new(
                DEFAULT_CONNECT_TIMEOUT,
                DEFAULT_REQUEST_TIMEOUT,
                RetryPolicy::new(5, Duration::from_millis(50), Duration::from_millis(400)),
            ),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            chroot: None,
            tick_time: None,
        }
    }

    /// Parses `zk://[user:password@]h:p[,h:p…][/chroot][?session_timeout=60s&tick_time=2s&connect_timeout=5s&request_timeout=5s]`.
    /// Refused with [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig): another
    /// scheme, no host, unknown parameters, a bad chroot, a session timeout under 1 ms, a zero tick
    /// time, a user without a password; `zks://` is
    /// [`ErrorKind::Unsupported`](distlock_core::ErrorKind::Unsupported).
    ///
    /// ```
    /// use distlock_core::{url::LockUrl, ErrorKind};
    /// use distlock_zookeeper::ZkConfig;
    ///
    /// let c = ZkConfig::from_url(&LockUrl::parse("zk://u:pw@10.0.0.1:2181,10.0.0.2/app/locks?session_timeout=10s")?)?;
    /// assert_eq!(c.endpoints, ["10.0.0.1:2181", "10.0.0.2:2181"]);
    /// assert_eq!(c.chroot.as_deref(), Some("/app/locks"));
    /// assert_eq!(c.connection.username.as_deref(), Some("u"));
    /// assert_eq!(c.session_timeout, std::time::Duration::from_secs(10));
    /// assert_eq!(c.tick_time, None);
    /// let c = ZkConfig::from_url(&LockUrl::parse("zk://h:1?tick_time=2s")?)?;
    /// assert_eq!(c.tick_time, Some(std::time::Duration::from_secs(2)));
    ///
    /// for bad in ["zk://", "zk://h:1?bogus=1", "zk://u@h:1", "redis://h:1", "zk://h:1/a//b",
    ///             "zk://h:1/zookeeper", "zk://h:1?session_timeout=0s", "zk://h:1/a/",
    ///             "zk://h:1?tick_time=0s", "zk://h:1?tick_time=soon"] {
    ///     let err = ZkConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// for tls in ["zks://h:1", "zk://h:1?ca=/ca.pem"] {
    ///     let err = ZkConfig::from_url(&LockUrl::parse(tls)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::Unsupported, "{tls}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.into_core(None))
    }

    fn parse_url(url: &LockUrl) -> std::result::Result<Self, ZkError> {
        let config_error = |e: distlock_core::Error| ZkError::Config(e.message().to_string());
        match url.scheme() {
            "zk" => {}
            "zks" => return Err(ZkError::Unsupported(
                "zks:// (ZooKeeper over TLS) is not supported by this version of distlock's ZooKeeper backend; use zk:// (through a TLS tunnel such as stunnel if the link needs encryption)".into(),
            )),
            other => {
                return Err(ZkError::Config(format!(
                    "the ZooKeeper backend takes zk:// URLs, not {other}://"
                )))
            }
        }
        if url.query("ca").is_some() {
            // The shared parser would say "use the scheme ending in s", which is refused too.
            return Err(ZkError::Unsupported(
                "URL parameter ca: ZooKeeper over TLS is not supported by this version of distlock's \
                 ZooKeeper backend (nor zks://); use zk:// through a TLS tunnel such as stunnel"
                    .into(),
            ));
        }
        url.reject_unknown_query(&[KNOWN_QUERY, connection::URL_QUERY].concat())
            .map_err(config_error)?;
        let endpoints = url.endpoints(DEFAULT_PORT).map_err(config_error)?;
        let mut config = Self::new(endpoints.iter().map(Endpoint::to_string));
        let path = url.path();
        if !path.is_empty() && path != "/" {
            config.chroot = Some(path.to_string());
        }
        if let Some(timeout) = url
            .query_duration("session_timeout")
            .map_err(config_error)?
        {
            config.session_timeout = timeout;
        }
        config.tick_time = url.query_duration("tick_time").map_err(config_error)?;
        config
            .connection
            .read_url(url, false)
            .map_err(config_error)?;
        config.check()?;
        Ok(config)
    }

    // `with_credentials`, `with_tls`, `with_ca_file`, `with_connect_timeout`,
    // `with_request_timeout`, `with_retry`.
    distlock_core::connection_builders!(connection);

    /// Sets [`session_timeout`](Self::session_timeout).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Sets [`tick_time`](Self::tick_time): the servers' `tickTime` (or an upper bound of it).
    pub fn with_tick_time(mut self, tick_time: Duration) -> Self {
        self.tick_time = Some(tick_time);
        self
    }

    /// Sets [`chroot`](Self::chroot) (`/locks`).
    pub fn with_chroot(mut self, chroot: impl Into<String>) -> Self {
        self.chroot = Some(chroot.into());
        self
    }

    /// Checks what the builder allows but the backend cannot honour: no endpoint or one that is not
    /// `host[:port]`, a session timeout under 1 ms or over `i32::MAX` ms, a zero tick time, a chroot
    /// ZooKeeper cannot store, a zero timeout ([`ConnectionOptions::validate`]), TLS (not supported), a
    /// username without a password (or the reverse).
    /// [`ZkBackend::from_config`](crate::ZkBackend::from_config) calls it.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|e| e.into_core(None))
    }

    pub(crate) fn check(&self) -> std::result::Result<(), ZkError> {
        self.parsed_endpoints()?;
        if self.session_timeout < Duration::from_millis(1)
            || self.session_timeout.as_millis() > i32::MAX as u128
        {
            return Err(ZkError::Config(format!(
                "session_timeout must be between 1ms and {}ms; got {:?}",
                i32::MAX,
                self.session_timeout
            )));
        }
        if self.tick_time.is_some_and(|t| t.is_zero()) {
            return Err(ZkError::Config(
                "tick_time must be the servers' tickTime (or more), not 0".into(),
            ));
        }
        if let Some(chroot) = &self.chroot {
            layout::check_chroot(chroot).map_err(ZkError::Config)?;
        }
        self.connection
            .validate()
            .map_err(|e| ZkError::Config(e.message().to_string()))?;
        if self.connection.tls {
            return Err(ZkError::Unsupported(
                "TLS to ZooKeeper is not supported by this version of distlock's ZooKeeper backend"
                    .into(),
            ));
        }
        if self.connection.username.is_some() != self.connection.password.is_some() {
            return Err(ZkError::Config(
                "ZooKeeper digest authentication needs both a username and a password: zk://username:password@host:port".into(),
            ));
        }
        Ok(())
    }

    /// The endpoints, parsed (port 2181 where none is given).
    pub(crate) fn parsed_endpoints(&self) -> std::result::Result<Vec<Endpoint>, ZkError> {
        if self.endpoints.is_empty() {
            return Err(ZkError::Config("no ZooKeeper endpoints given".into()));
        }
        self.endpoints
            .iter()
            .map(|e| Endpoint::parse(e, DEFAULT_PORT))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| ZkError::Config(e.message().to_string()))
    }

    /// The connect string the client takes: `h1:p1,h2:p2` (no chroot: the backend creates it first).
    pub(crate) fn connect_string(&self) -> std::result::Result<String, ZkError> {
        Ok(self
            .parsed_endpoints()?
            .iter()
            .map(Endpoint::to_string)
            .collect::<Vec<_>>()
            .join(","))
    }
}
