//! The file backend's configuration and its URL form, `file:///abs/dir`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Result;

use crate::error::FileError;

/// The query parameters a `file://` URL may carry. `lease` is read by the facade (`connect`), and means
/// nothing to file locks, which have no lease; it is accepted so one URL shape works everywhere.
const KNOWN_QUERY: &[&str] = &["lease"];

/// Default first delay of the fallback poll.
pub const DEFAULT_POLL_INITIAL: Duration = Duration::from_millis(25);
/// Default cap of the fallback poll.
pub const DEFAULT_POLL_MAX: Duration = Duration::from_secs(1);

/// How the file backend is set up. Built with [`FileConfig::new`] or [`FileConfig::from_url`], adjusted
/// with the `with_*` methods, and turned into a backend with
/// [`FileBackend::from_config`](crate::FileBackend::from_config).
///
/// ```
/// use std::time::Duration;
/// use distlock_file::FileConfig;
///
/// let config = FileConfig::new("/var/lock/myapp")
///     .with_sync(true)
///     .with_poll_backoff(Duration::from_millis(50), Duration::from_secs(2));
/// assert_eq!(config.dir, std::path::Path::new("/var/lock/myapp"));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileConfig {
    /// The directory holding the lock files; created (mode 0755, less the umask) if missing.
    pub dir: PathBuf,
    /// `fdatasync` the lock file after writing the new token, before the grant is reported (default
    /// `true`). With it, the counter never goes backwards, even after a power loss: fencing is
    /// [`Strict`](distlock_core::Fencing::Strict). Without it, an OS crash or power loss can lose the last
    /// increments (a process crash cannot: the page cache survives it), so fencing is only
    /// [`BestEffort`](distlock_core::Fencing::BestEffort).
    pub sync: bool,
    /// Wake waiters with inotify when the lock file is closed (default `true`). Off, waiters only poll
    /// with the backoff below; that is also what happens, in effect, where inotify sees nothing (network
    /// file systems, which are not supported anyway). Off, held lock files are not watched either:
    /// their deletion is noticed by a check of every held file once a second.
    pub notify: bool,
    /// First delay of the fallback poll a waiter runs alongside inotify (in case an event is missed), and
    /// the delay it returns to after every event.
    pub poll_initial: Duration,
    /// Cap of the fallback poll: the delay doubles (with jitter) up to this.
    pub poll_max: Duration,
}

impl FileConfig {
    /// Locks in `dir`, with the defaults: sync on, inotify on, polling from 25 ms up to 1 s.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            sync: true,
            notify: true,
            poll_initial: DEFAULT_POLL_INITIAL,
            poll_max: DEFAULT_POLL_MAX,
        }
    }

    /// Parses `file:///abs/dir` (or `file://localhost/abs/dir`). The path is percent-decoded. Refused,
    /// with [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig): a host other than
    /// `localhost` (which is what `file://relative/dir` is), an empty path, a user or password, and query
    /// parameters other than `lease`.
    ///
    /// ```
    /// use distlock_core::{url::LockUrl, ErrorKind};
    /// use distlock_file::FileConfig;
    ///
    /// let config = FileConfig::from_url(&LockUrl::parse("file:///var/lock/my%20app?lease=10s")?)?;
    /// assert_eq!(config.dir, std::path::Path::new("/var/lock/my app"));
    ///
    /// for bad in ["file://relative/dir", "file://host/x", "file:///tmp/x?bogus=1", "file://"] {
    ///     let err = FileConfig::from_url(&LockUrl::parse(bad)?).unwrap_err();
    ///     assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}");
    /// }
    /// # Ok::<(), distlock_core::Error>(())
    /// ```
    pub fn from_url(url: &LockUrl) -> Result<Self> {
        Self::parse_url(url).map_err(|e| e.into_core(None))
    }

    fn parse_url(url: &LockUrl) -> Result<Self, FileError> {
        let shown = || format!("file://{}{}", url.hosts().join(","), url.path());
        if url.scheme() != "file" {
            return Err(FileError::Config(format!(
                "the file backend takes file:///dir URLs, not {}://",
                url.scheme()
            )));
        }
        if let Err(e) = url.reject_unknown_query(KNOWN_QUERY) {
            return Err(FileError::Config(e.message().to_string()));
        }
        if url.username().is_some() || url.password().is_some() {
            return Err(FileError::Config(format!(
                "{}: file URLs take no user or password",
                shown()
            )));
        }
        match url.hosts() {
            [] => {}
            [host] if host.eq_ignore_ascii_case("localhost") => {}
            [host] => {
                return Err(FileError::Config(format!(
                    "{}: a file URL names a local directory by its absolute path, so {host:?} cannot be a host. Write file:///absolute/dir (three slashes); relative paths are not accepted",
                    shown()
                )))
            }
            _ => {
                return Err(FileError::Config(format!(
                    "{}: a file URL takes one local directory, not a host list",
                    shown()
                )))
            }
        }
        let path = url.path();
        if path.is_empty() {
            return Err(FileError::Config(
                "a file URL needs the lock directory's absolute path: file:///absolute/dir".into(),
            ));
        }
        if !Path::new(path).is_absolute() {
            return Err(FileError::Config(format!(
                "{}: the lock directory must be an absolute path (file:///absolute/dir)",
                shown()
            )));
        }
        Ok(Self::new(path))
    }

    /// Checks what the fields allow but the backend cannot honour: an empty directory, a first poll delay
    /// of zero, a poll cap below the first delay. Fails with
    /// [`ErrorKind::InvalidConfig`](distlock_core::ErrorKind::InvalidConfig);
    /// [`FileBackend::from_config`](crate::FileBackend::from_config) calls it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use distlock_file::FileConfig;
    ///
    /// assert!(FileConfig::new("/var/lock/myapp").validate().is_ok());
    /// assert!(FileConfig::new("").validate().is_err());
    /// let mut config = FileConfig::new("/var/lock/myapp");
    /// config.poll_max = Duration::ZERO;
    /// assert!(config.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<()> {
        let problem = if self.dir.as_os_str().is_empty() {
            "the lock directory must not be empty; pass a directory such as /var/lock/myapp"
                .to_string()
        } else if self.poll_initial.is_zero() {
            "the fallback poll's first delay (poll_initial) must not be 0".to_string()
        } else if self.poll_max < self.poll_initial {
            format!(
                "the fallback poll's cap (poll_max, {:?}) must not be below its first delay (poll_initial, {:?})",
                self.poll_max, self.poll_initial
            )
        } else {
            return Ok(());
        };
        Err(FileError::Config(problem).into_core(None))
    }

    /// Sets [`sync`](Self::sync).
    pub fn with_sync(mut self, sync: bool) -> Self {
        self.sync = sync;
        self
    }

    /// Sets [`notify`](Self::notify).
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Sets the fallback poll's first delay and cap ([`poll_initial`](Self::poll_initial),
    /// [`poll_max`](Self::poll_max)). The first is raised to at least 1 ms, the cap to at least the
    /// first.
    pub fn with_poll_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.poll_initial = initial.max(Duration::from_millis(1));
        self.poll_max = max.max(self.poll_initial);
        self
    }
}
