//! The SQL backends' configuration, shared by both engines: the driver's own URL, kept as written, plus
//! distlock's query parameters, which are stripped before the URL reaches the driver.
//!
//! ```text
//! postgres://user:pw@host:5432/db?sslmode=disable&mode=lease&table=locks&schema=app
//! mysql://user:pw@host:3306/db?mode=row
//! ```
//!
//! distlock's parameters ([`DISTLOCK_QUERY`]): `mode=advisory|row|lease` (default `advisory`),
//! `table=` (default [`DEFAULT_TABLE`]), `schema=` (default: the connection's own, `search_path` /
//! the URL's database), `key=<int>` or `key=<int>,<int>` (PostgreSQL advisory mode: lock that numeric
//! key instead of the name's hash, to interoperate with applications that lock numeric keys),
//! `lease=` (read by the facade), `request_timeout=` (distlock's bound of one statement). Every other
//! parameter, and everything else in the URL, is the driver's and reaches it byte for byte.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use distlock_core::connection::ConnectionOptions;
use distlock_core::retry::RetryPolicy;
use distlock_core::url::{percent_decode, redact};
use distlock_core::Result;

use crate::error::SqlError;

/// The query parameters distlock reads from a SQL URL and strips before handing it to the driver.
pub const DISTLOCK_QUERY: &[&str] = &["mode", "table", "schema", "key", "lease", "request_timeout"];

/// The default table: one row per lock name (fencing counter; the lock itself in `row` and `lease`
/// modes).
pub const DEFAULT_TABLE: &str = "distlock_locks";
/// The default bound of one connection attempt (TCP, TLS, authentication).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default bound of one statement distlock sends (a fence commit, a renewal, a probe); waits
/// for a lock are bounded by the acquire's own wait limit instead.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest table or schema name accepted (PostgreSQL's identifier limit is 63 bytes, MariaDB's 64).
pub const MAX_IDENTIFIER_LEN: usize = 63;

/// How a name is locked. See the crate docs for what each mode promises.
///
/// ```
/// use distlock_sql::{Mode, SqlConfig};
///
/// // A lease row, for a database behind a transaction pooler (no session survives a statement).
/// let config = SqlConfig::from_url("postgres://app@db.internal/app?mode=lease")?;
/// assert_eq!(config.mode, Mode::Lease);
/// assert_eq!(SqlConfig::new("postgres://app@db.internal/app").mode, Mode::Advisory); // the default
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Mode {
    /// A session advisory lock (PostgreSQL `pg_advisory_lock`, MariaDB `GET_LOCK`) on a dedicated
    /// connection held for the life of the guard; waits in the server.
    #[default]
    Advisory,
    /// The pessimistic lock: the name's row locked with `SELECT … FOR UPDATE` in a transaction held
    /// open on a dedicated connection.
    Row,
    /// The optimistic lock: the name's row as a versioned lease (owner, expiry on the database's clock,
    /// version = the fencing token), renewed by the watchdog; no connection is held.
    Lease,
}

impl Mode {
    /// The URL spelling: `advisory`, `row`, `lease`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Advisory => "advisory",
            Mode::Row => "row",
            Mode::Lease => "lease",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = distlock_core::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "advisory" => Ok(Mode::Advisory),
            "row" => Ok(Mode::Row),
            "lease" => Ok(Mode::Lease),
            other => Err(SqlError::Config(format!(
                "URL parameter mode={other:?} is not a lock mode; use advisory, row or lease"
            ))
            .into_core(UNKNOWN_ENGINE, None)),
        }
    }
}

/// A numeric advisory-lock key given in the URL (`?key=42` or `?key=1,2`), locked instead of the
/// name's hash: PostgreSQL's one-`bigint` and two-`int` key spaces, which never overlap.
///
/// ```
/// use distlock_sql::{AdvisoryKey, SqlConfig};
///
/// // Lock the key an existing job already takes with pg_advisory_lock(7, 42), so both exclude each other.
/// let config = SqlConfig::from_url("postgres://app@db.internal/app?key=7,42")?;
/// assert_eq!(config.key, Some(AdvisoryKey::Pair(7, 42)));
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdvisoryKey {
    /// `pg_advisory_lock(bigint)`.
    Single(i64),
    /// `pg_advisory_lock(int, int)`.
    Pair(i32, i32),
}

impl FromStr for AdvisoryKey {
    type Err = distlock_core::Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            SqlError::Config(format!(
                "URL parameter key={s:?}: expected a 64-bit integer (key=42) or two 32-bit integers (key=1,2)"
            ))
            .into_core(UNKNOWN_ENGINE, None)
        };
        match s.split_once(',') {
            None => s.trim().parse().map(AdvisoryKey::Single).map_err(|_| bad()),
            Some((a, b)) => Ok(AdvisoryKey::Pair(
                a.trim().parse().map_err(|_| bad())?,
                b.trim().parse().map_err(|_| bad())?,
            )),
        }
    }
}

/// How a SQL backend is set up. Made by [`SqlConfig::from_url`] (or [`SqlConfig::new`] from a driver
/// URL), adjusted with the `with_*` methods, connected by the engine's backend
/// (`PostgresBackend::from_config`, `MysqlBackend::from_config`).
///
/// `Debug` never shows the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_sql::{Mode, SqlConfig};
///
/// let config = SqlConfig::from_url("postgres://app:s3cret@db.internal/app?mode=row&table=locks")?
///     .with_request_timeout(Duration::from_secs(2));
/// assert_eq!((config.mode, config.table.as_str()), (Mode::Row, "locks"));
/// assert_eq!(config.url, "postgres://app:s3cret@db.internal/app"); // the driver's part only
/// assert!(!format!("{config:?}").contains("s3cret"));
/// # Ok::<(), distlock_core::Error>(())
/// ```
#[non_exhaustive]
#[derive(Clone, PartialEq, Eq)]
pub struct SqlConfig {
    /// The driver's URL as written, minus distlock's own query parameters ([`DISTLOCK_QUERY`]).
    /// Credentials, TLS (`sslmode=` / `ssl-mode=`), the database and the driver's options live here,
    /// spelled as the driver spells them.
    pub url: String,
    /// Timeouts and retries. Credentials and TLS are read by the driver from [`url`](Self::url), so
    /// `tls`, `ca_file`, `username` and `password` stay unset here. `connect_timeout` (default
    /// [`DEFAULT_CONNECT_TIMEOUT`]) bounds one connection attempt; `request_timeout` (default
    /// [`DEFAULT_REQUEST_TIMEOUT`], `?request_timeout=`) one statement.
    pub connection: ConnectionOptions,
    /// How names are locked (`?mode=`).
    pub mode: Mode,
    /// The table of lock rows (`?table=`), created on first use.
    pub table: String,
    /// The schema (PostgreSQL) or database (MariaDB) of the table (`?schema=`); `None`: the
    /// connection's default.
    pub schema: Option<String>,
    /// A numeric advisory key to lock instead of the name's hash (`?key=`, PostgreSQL advisory mode).
    pub key: Option<AdvisoryKey>,
    /// The default lease of the locks the facade hands out (`?lease=`); `None`: the core's default.
    pub lease: Option<Duration>,
}

impl fmt::Debug for SqlConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlConfig")
            .field("url", &redact(&self.url))
            .field("connection", &self.connection)
            .field("mode", &self.mode)
            .field("table", &self.table)
            .field("schema", &self.schema)
            .field("key", &self.key)
            .field("lease", &self.lease)
            .finish()
    }
}

impl SqlConfig {
    /// A driver URL (no distlock parameters in it), advisory mode, the default table and timeouts.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            connection: ConnectionOptions::new(
                DEFAULT_CONNECT_TIMEOUT,
                DEFAULT_REQUEST_TIMEOUT,
                RetryPolicy::new(2, Duration::from_millis(50), Duration::from_millis(200)),
            ),
            mode: Mode::Advisory,
            table: DEFAULT_TABLE.to_string(),
            schema: None,
            key: None,
            lease: None,
        }
    }

    /// Splits a URL into the driver's URL (as written) and distlock's parameters. The scheme is not
    /// checked here: each engine's `connect` checks its own.
    ///
    /// ```
    /// use distlock_sql::{Mode, SqlConfig, AdvisoryKey};
    /// let c = SqlConfig::from_url("postgres://u:s3cret@h:5433/db?sslmode=disable&mode=lease&table=locks&application_name=x")?;
    /// assert_eq!(c.url, "postgres://u:s3cret@h:5433/db?sslmode=disable&application_name=x");
    /// assert_eq!((c.mode, c.table.as_str(), c.schema.as_deref()), (Mode::Lease, "locks", None));
    /// assert!(!format!("{c:?}").contains("s3cret"));
    /// let k = SqlConfig::from_url("postgresql:///db?host=/tmp&key=7,-3")?;
    /// assert_eq!((k.url.as_str(), k.key), ("postgresql:///db?host=/tmp", Some(AdvisoryKey::Pair(7, -3))));
    /// for bad in ["postgres://h/db?mode=bogus", "postgres://h?table=a;b", "postgres://h?key=x",
    ///             "postgres://h?schema=", "postgres://h?request_timeout=0s",
    ///             "postgres://h?mode=row&key=7", "mysql://h?key=7"] {
    ///     assert_eq!(SqlConfig::from_url(bad).unwrap_err().kind(), distlock_core::ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// // Errors name the engine of the URL's scheme, as the backend's own errors do.
    /// assert_eq!(SqlConfig::from_url("postgresql://h?mode=x").unwrap_err().backend(), "postgres");
    /// assert_eq!(SqlConfig::from_url("mariadb://h?table=a;b").unwrap_err().backend(), "mysql");
    /// assert_eq!(SqlConfig::new("mysql://h").with_table("").validate().unwrap_err().backend(), "mysql");
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(text: &str) -> Result<Self> {
        Self::parse(text).map_err(|e| e.with_backend(engine_of(text)))
    }

    fn parse(text: &str) -> Result<Self> {
        let (base, query) = match text.split_once('?') {
            Some((base, query)) => (base, query),
            None => (text, ""),
        };
        let mut kept = Vec::new();
        let mut config = Self::new("");
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value);
            match key {
                "mode" => config.mode = value.parse()?,
                "table" => config.table = value,
                "schema" => config.schema = Some(value),
                "key" => config.key = Some(value.parse()?),
                "request_timeout" => {
                    config.connection.request_timeout = parse_timeout(&value)?;
                }
                "lease" => {
                    config.lease = Some(distlock_core::duration::parse(&value).map_err(|e| {
                        SqlError::Config(format!("URL parameter lease: {}", e.message()))
                            .into_core(UNKNOWN_ENGINE, None)
                    })?);
                }
                _ => kept.push(pair),
            }
        }
        config.url = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        config.validate()?;
        Ok(config)
    }

    /// Sets [`ConnectionOptions::connect_timeout`] (credentials and TLS are the URL's).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connection.connect_timeout = timeout;
        self
    }

    /// Sets [`ConnectionOptions::request_timeout`].
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.connection.request_timeout = timeout;
        self
    }

    /// Sets [`mode`](Self::mode).
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Sets [`table`](Self::table).
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets [`schema`](Self::schema).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// Sets [`key`](Self::key).
    pub fn with_key(mut self, key: AdvisoryKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Checks the table and schema names (letters, digits and `_`, not starting with a digit, at most
    /// [`MAX_IDENTIFIER_LEN`] bytes: they are put in SQL quoted, but distlock accepts only names that
    /// need no quoting to be safe and portable) and the timeouts.
    pub fn validate(&self) -> Result<()> {
        let checked = check_identifier("table", &self.table)
            .and_then(|()| match &self.schema {
                Some(schema) => check_identifier("schema", schema),
                None => Ok(()),
            })
            .and_then(|()| self.check_key())
            .and_then(|()| self.connection.validate());
        checked.map_err(|e| e.with_backend(engine_of(&self.url)))
    }

    /// `key` picks a PostgreSQL advisory key: refused where nothing would read it, rather than ignored.
    fn check_key(&self) -> Result<()> {
        let refuse = |why: &str| {
            Err(SqlError::Config(format!("URL parameter key: {why}"))
                .into_core(UNKNOWN_ENGINE, None))
        };
        match (self.key, engine_of(&self.url), self.mode) {
            (None, _, _) => Ok(()),
            (Some(_), "mysql", _) => refuse(
                "MariaDB/MySQL has no numeric advisory keys (GET_LOCK takes a name, derived from the lock \
                 name); remove it",
            ),
            (Some(_), _, Mode::Advisory) => Ok(()),
            (Some(_), _, mode) => refuse(&format!(
                "a numeric advisory key applies to mode=advisory only, not mode={mode}; remove it or use \
                 mode=advisory"
            )),
        }
    }
}

/// The backend name a config error is tagged with before the engine is known (a bare [`Mode`] or
/// [`AdvisoryKey`] parse); [`SqlConfig::from_url`] and [`SqlConfig::validate`] retag with the engine.
const UNKNOWN_ENGINE: &str = "sql";

/// The engine's backend name (`"postgres"`, `"mysql"`, as its errors are tagged) from a URL's scheme.
fn engine_of(url: &str) -> &'static str {
    match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("postgres" | "postgresql") => "postgres",
        Some("mysql" | "mariadb") => "mysql",
        _ => UNKNOWN_ENGINE,
    }
}

fn parse_timeout(value: &str) -> Result<Duration> {
    let d = distlock_core::duration::parse(value).map_err(|e| {
        SqlError::Config(format!("URL parameter request_timeout: {}", e.message()))
            .into_core(UNKNOWN_ENGINE, None)
    })?;
    if d.is_zero() {
        return Err(
            SqlError::Config("URL parameter request_timeout must not be 0".into())
                .into_core(UNKNOWN_ENGINE, None),
        );
    }
    Ok(d)
}

fn check_identifier(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IDENTIFIER_LEN
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(SqlError::Config(format!(
            "{what} {name:?} is not accepted: use 1 to {MAX_IDENTIFIER_LEN} ASCII letters, digits and _, not starting with a digit"
        ))
        .into_core(UNKNOWN_ENGINE, None))
    }
}
