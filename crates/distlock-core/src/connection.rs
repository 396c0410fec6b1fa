//! How a network backend connects: credentials, TLS, timeouts and the retry policy, in one type
//! every backend's config holds as its `connection` field, so these settings have one name, one
//! meaning, one URL form and one set of checks everywhere (DESIGN §9).
//!
//! A backend's config holds a [`ConnectionOptions`] built with [`ConnectionOptions::new`] from its
//! defaults, reads its URL with [`ConnectionOptions::read_url`], checks it with
//! [`ConnectionOptions::validate`], and gets the `with_*` builders its users call
//! (`RedisConfig::new(..).with_credentials(..)`) from
//! [`connection_builders!`](crate::connection_builders).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::retry::RetryPolicy;
use crate::url::LockUrl;

/// The URL query parameters [`ConnectionOptions::read_url`] reads; a backend's list of known
/// parameters includes them.
pub const URL_QUERY: &[&str] = &["ca", "connect_timeout", "request_timeout"];

/// Credentials, TLS, timeouts and retries of a network backend; a backend config's `connection`
/// field. The backend's config documents its defaults and what each bound covers on that engine.
///
/// `Debug` prints the password as `***`.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::connection::ConnectionOptions;
/// use distlock_core::retry::RetryPolicy;
/// use distlock_core::url::LockUrl;
///
/// let mut options = ConnectionOptions::new(Duration::from_secs(3), Duration::from_secs(5), RetryPolicy::NEVER);
/// options.read_url(&LockUrl::parse("rediss://u:s3cret@h?ca=/ca.pem&request_timeout=2s")?, true)?;
/// assert_eq!((options.username.as_deref(), options.password.as_deref()), (Some("u"), Some("s3cret")));
/// assert_eq!(options.ca_file.as_deref(), Some(std::path::Path::new("/ca.pem")));
/// assert_eq!(options.request_timeout, Duration::from_secs(2));
/// assert_eq!(options.connect_timeout, Duration::from_secs(3));
/// assert!(!format!("{options:?}").contains("s3cret"));
/// options.validate()?;
/// assert!(options.with_tls(false).validate().is_err()); // a CA without TLS
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectionOptions {
    /// TLS to the servers (the scheme ending in `s`: `rediss://`, `etcds://`). The servers'
    /// certificates are verified against the system roots, or against [`ca_file`](Self::ca_file)
    /// alone when it is set.
    pub tls: bool,
    /// A PEM file with the CA(s) that signed the servers' certificates (`?ca=/path/ca.pem`),
    /// trusted **instead of** the system roots, as `curl --cacert`, `redis-cli --cacert` and
    /// `etcdctl --cacert` do: naming a CA pins trust to it. Needs [`tls`](Self::tls); a missing or
    /// unreadable file fails the connect with `InvalidConfig`.
    pub ca_file: Option<PathBuf>,
    /// The user name to authenticate as (`scheme://user:pass@…`).
    pub username: Option<String>,
    /// The password to authenticate with. Never shown by `Debug`.
    pub password: Option<String>,
    /// The bound of one connection attempt: TCP, TLS, authentication, and whatever the backend does
    /// to prove the server answers (`?connect_timeout=`). Must not be 0.
    pub connect_timeout: Duration,
    /// The bound of one request (`?request_timeout=`); the backend's config says whether its
    /// retries count within it. Must not be 0.
    pub request_timeout: Duration,
    /// How requests that are safe to repeat (every request distlock sends) are retried when the
    /// backend finds a failure retryable; the default is the backend's.
    pub retry: RetryPolicy,
}

impl fmt::Debug for ConnectionOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionOptions")
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("retry", &self.retry)
            .finish()
    }
}

impl ConnectionOptions {
    /// Plain-text connections without credentials, with a backend's default timeouts and retry
    /// policy.
    pub const fn new(
        connect_timeout: Duration,
        request_timeout: Duration,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            tls: false,
            ca_file: None,
            username: None,
            password: None,
            connect_timeout,
            request_timeout,
            retry,
        }
    }

    /// Sets [`username`](Self::username) and [`password`](Self::password).
    pub fn with_credentials(
        mut self,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.username = Some(username.into());
        self.password = Some(password.into());
        self
    }

    /// Sets [`password`](Self::password) alone, for engines with password-only authentication.
    pub fn with_password(mut self, password: impl Into<String>) -> Self {
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

    /// Applies what `url` carries of these settings: `tls` (the backend decides it from the
    /// scheme), the credentials (`user:pass@`, or `:pass@`), and the query parameters in
    /// [`URL_QUERY`]: `ca` (refused without TLS or empty, [`LockUrl::ca_file`]), `connect_timeout`
    /// and `request_timeout` (durations, not 0, [`LockUrl::query_timeout`]). Settings the URL
    /// leaves out keep their value. The backend still refuses parameters it does not know and reads
    /// its own.
    pub fn read_url(&mut self, url: &LockUrl, tls: bool) -> Result<()> {
        self.tls = tls;
        if let Some(username) = url.username() {
            self.username = Some(username.to_string());
        }
        if let Some(password) = url.password() {
            self.password = Some(password.to_string());
        }
        if let Some(ca_file) = url.ca_file(tls)? {
            self.ca_file = Some(ca_file);
        }
        if let Some(timeout) = url.query_timeout("connect_timeout")? {
            self.connect_timeout = timeout;
        }
        if let Some(timeout) = url.query_timeout("request_timeout")? {
            self.request_timeout = timeout;
        }
        Ok(())
    }

    /// Checks what the builders and the public fields allow but no backend can honour: a zero
    /// timeout (every connect or request would time out at once) and a CA file without TLS. Fails
    /// with [`ErrorKind::InvalidConfig`]; a backend's `validate` calls it and adds its own rules.
    pub fn validate(&self) -> Result<()> {
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return Err(invalid(
                "connect_timeout and request_timeout must not be 0: every connect or request would time out at once",
            ));
        }
        if self.ca_file.is_some() && !self.tls {
            return Err(invalid(
                "a CA file (ca_file, ?ca=) needs TLS (the scheme ending in s, or with_tls(true))",
            ));
        }
        Ok(())
    }
}

fn invalid(message: &str) -> Error {
    Error::new(ErrorKind::InvalidConfig, message)
}

/// Expands, inside a backend config's `impl` block, the `with_*` builders of its
/// [`ConnectionOptions`] field, so users call them on the config
/// (`RedisConfig::new(..).with_credentials(..)`) and no backend writes them again:
///
/// * `connection_builders!(connection);` gives `with_credentials`, `with_tls`, `with_ca_file`,
///   `with_connect_timeout`, `with_request_timeout` and `with_retry`, each delegating to the
///   [`ConnectionOptions`] method of that name on the field `connection`;
/// * `connection_builders!(connection, with_password);` adds `with_password`, for engines with
///   password-only authentication (Redis `requirepass`).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::connection::ConnectionOptions;
/// use distlock_core::retry::RetryPolicy;
///
/// /// A backend's config.
/// #[derive(Debug, Clone)]
/// pub struct EngineConfig {
///     /// Credentials, TLS, timeouts, retries.
///     pub connection: ConnectionOptions,
/// }
///
/// impl EngineConfig {
///     /// The defaults.
///     pub fn new() -> Self {
///         let connection = ConnectionOptions::new(Duration::from_secs(3), Duration::from_secs(5), RetryPolicy::NEVER);
///         Self { connection }
///     }
///
///     distlock_core::connection_builders!(connection, with_password);
/// }
///
/// let config = EngineConfig::new().with_password("pw").with_request_timeout(Duration::from_secs(1));
/// assert_eq!(config.connection.password.as_deref(), Some("pw"));
/// assert_eq!(config.connection.request_timeout, Duration::from_secs(1));
/// ```
#[macro_export]
macro_rules! connection_builders {
    ($field:ident) => {
        /// Sets the user name and password (see
        /// [`ConnectionOptions::username`](distlock_core::connection::ConnectionOptions::username)).
        pub fn with_credentials(
            mut self,
            username: impl ::core::convert::Into<::std::string::String>,
            password: impl ::core::convert::Into<::std::string::String>,
        ) -> Self {
            self.$field = self.$field.with_credentials(username, password);
            self
        }

        /// Sets TLS (see
        /// [`ConnectionOptions::tls`](distlock_core::connection::ConnectionOptions::tls)).
        pub fn with_tls(mut self, tls: bool) -> Self {
            self.$field = self.$field.with_tls(tls);
            self
        }

        /// Trusts the CA(s) in this PEM file instead of the system roots, and turns TLS on (see
        /// [`ConnectionOptions::ca_file`](distlock_core::connection::ConnectionOptions::ca_file)).
        pub fn with_ca_file(
            mut self,
            path: impl ::core::convert::Into<::std::path::PathBuf>,
        ) -> Self {
            self.$field = self.$field.with_ca_file(path);
            self
        }

        /// Sets the bound of one connection attempt (see
        /// [`ConnectionOptions::connect_timeout`](distlock_core::connection::ConnectionOptions::connect_timeout)).
        pub fn with_connect_timeout(mut self, timeout: ::core::time::Duration) -> Self {
            self.$field = self.$field.with_connect_timeout(timeout);
            self
        }

        /// Sets the bound of one request (see
        /// [`ConnectionOptions::request_timeout`](distlock_core::connection::ConnectionOptions::request_timeout)).
        pub fn with_request_timeout(mut self, timeout: ::core::time::Duration) -> Self {
            self.$field = self.$field.with_request_timeout(timeout);
            self
        }

        /// Sets how requests are retried (see
        /// [`ConnectionOptions::retry`](distlock_core::connection::ConnectionOptions::retry)).
        pub fn with_retry(mut self, retry: $crate::retry::RetryPolicy) -> Self {
            self.$field = self.$field.with_retry(retry);
            self
        }
    };
    ($field:ident, with_password) => {
        $crate::connection_builders!($field);

        /// Sets the password alone, for password-only authentication (see
        /// [`ConnectionOptions::password`](distlock_core::connection::ConnectionOptions::password)).
        pub fn with_password(
            mut self,
            password: impl ::core::convert::Into<::std::string::String>,
        ) -> Self {
            self.$field = self.$field.with_password(password);
            self
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> ConnectionOptions {
        ConnectionOptions::new(
            Duration::from_secs(3),
            Duration::from_secs(5),
            RetryPolicy::NEVER,
        )
    }

    #[test]
    fn zero_timeouts_and_a_ca_without_tls_are_refused() {
        assert!(defaults().validate().is_ok());
        let bad = [
            defaults().with_connect_timeout(Duration::ZERO),
            defaults().with_request_timeout(Duration::ZERO),
            defaults().with_ca_file("/ca.pem").with_tls(false),
        ];
        for options in bad {
            let err = options.validate().expect_err("refused");
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{options:?}: {err}");
        }
    }

    #[test]
    fn a_url_sets_only_what_it_carries() -> Result<()> {
        let mut options = defaults().with_credentials("app", "pw");
        options.read_url(&LockUrl::parse("etcd://h?connect_timeout=1s")?, false)?;
        assert_eq!(options.username.as_deref(), Some("app"));
        assert_eq!(options.password.as_deref(), Some("pw"));
        assert_eq!(options.connect_timeout, Duration::from_secs(1));
        assert_eq!(options.request_timeout, Duration::from_secs(5));
        assert!(!options.tls);

        let mut password_only = defaults();
        password_only.read_url(&LockUrl::parse("redis://:pw@h")?, false)?;
        assert_eq!(password_only.username, None);
        assert_eq!(password_only.password.as_deref(), Some("pw"));
        Ok(())
    }

    #[test]
    fn a_url_with_bad_connection_parameters_is_refused() -> Result<()> {
        for bad in [
            "redis://h?ca=/ca.pem",
            "rediss://h?ca=",
            "redis://h?connect_timeout=0s",
            "redis://h?request_timeout=soon",
        ] {
            let tls = bad.starts_with("rediss");
            let err = defaults()
                .read_url(&LockUrl::parse(bad)?, tls)
                .expect_err(bad);
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}: {err}");
        }
        Ok(())
    }

    #[test]
    fn debug_hides_the_password() {
        let shown = format!("{:?}", defaults().with_credentials("app", "s3cret"));
        assert!(shown.contains(r#"password: Some("***")"#), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}
