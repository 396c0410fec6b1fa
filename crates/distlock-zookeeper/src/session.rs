//! ZooKeeper sessions: one per distinct session timeout per backend (the lease of a lock picks its
//! session, as etcd's lease TTL picks its session lease), established lazily, replaced once expired,
//! and how a session's states map onto distlock's `Held`/`Jeopardy`/`Lost`:
//!
//! * `Disconnected`: requests fail with `ConnectionLoss`, so the renewal (a `sync` + `exists` of the
//!   own node) fails and the guard is `Jeopardy`; the session may live on;
//! * `SyncConnected` again within the session: the next renewal succeeds, the guard is `Held`;
//! * `Expired`, `Closed`, `AuthFailed`, or the own node deleted: the loss signal fires, `Lost`;
//!   a renewal that cannot be confirmed in time lets the core's deadline (from the negotiated
//!   timeout) make it `Lost` at the latest then, even when the client never hears of the expiry
//!   (CURATOR-206/604/696: never `Held` after the session could have expired).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Mutex as AsyncMutex;
use zookeeper_client as zk;

use crate::config::ZkConfig;
use crate::error::ZkError;

/// One ZooKeeper session.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) client: zk::Client,
    /// False once the tokio runtime the session was connected on is gone: the client's I/O task ran
    /// there and died with it, so the session answers nothing any more (its nodes go when the server
    /// expires it).
    runtime_alive: Arc<AtomicBool>,
    /// Dropped with the session: ends the sentinel task.
    _sentinel: tokio::sync::oneshot::Sender<()>,
    /// The timeout the server negotiated.
    pub(crate) timeout: Duration,
    /// Deletes that got no answer, finished once the session is connected again (`cleanup`).
    pub(crate) cleanup: Mutex<crate::cleanup::Pending>,
}

impl Session {
    /// Whether the session is gone for good (expired, closed, refused): its ephemeral nodes are gone
    /// or going, and its client answers nothing any more.
    pub(crate) fn is_gone(&self) -> bool {
        !self.runtime_alive.load(Ordering::Acquire) || state_is_terminal(self.client.state())
    }

    /// Whether the runtime the session's I/O ran on is gone (the session may still live on the server
    /// until it expires there).
    pub(crate) fn runtime_gone(&self) -> bool {
        !self.runtime_alive.load(Ordering::Acquire)
    }

    /// A description of the session for messages.
    pub(crate) fn describe(&self) -> String {
        format!(
            "session 0x{:x} ({:?} timeout)",
            self.client.session_id().0,
            self.timeout
        )
    }
}

/// Whether a session state is terminal.
pub(crate) fn state_is_terminal(state: zk::SessionState) -> bool {
    matches!(
        state,
        zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
    )
}

/// The sessions of one backend (and its clones).
#[derive(Debug)]
pub(crate) struct Sessions {
    config: ZkConfig,
    connect_string: String,
    live: Mutex<Vec<Arc<Session>>>,
    /// Serialises session creation, so concurrent acquires with one lease share one session.
    connecting: AsyncMutex<()>,
    /// The timeout the server negotiated for the configured session timeout: the default lease.
    default_timeout: Mutex<Duration>,
}

impl Sessions {
    /// Establishes the default session (its negotiated timeout is the default lease).
    pub(crate) async fn connect(config: ZkConfig) -> Result<Sessions, ZkError> {
        config.check()?;
        let connect_string = config.connect_string()?;
        let sessions = Sessions {
            default_timeout: Mutex::new(config.session_timeout),
            connect_string,
            config,
            live: Mutex::new(Vec::new()),
            connecting: AsyncMutex::new(()),
        };
        let session = sessions.establish(sessions.config.session_timeout).await?;
        *lock(&sessions.default_timeout) = session.timeout;
        lock(&sessions.live).push(session);
        Ok(sessions)
    }

    pub(crate) fn config(&self) -> &ZkConfig {
        &self.config
    }

    /// The negotiated timeout of the default session.
    pub(crate) fn default_timeout(&self) -> Duration {
        *lock(&self.default_timeout)
    }

    /// A live session for a lock with `lease`: one whose negotiated timeout is the lease (the default
    /// session for the default lease), else a new one asking for it. A server that will not negotiate
    /// exactly that timeout makes the acquire fail: a lease is never silently changed.
    pub(crate) async fn for_lease(&self, lease: Duration) -> Result<Arc<Session>, ZkError> {
        let lease = round_to_millis(lease);
        if let Some(found) = self.find(lease) {
            return Ok(found);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(found) = self.find(lease) {
            return Ok(found);
        }
        let session = self.establish(lease).await?;
        if session.timeout != lease {
            let negotiated = session.timeout;
            drop(session); // the last client: closes the session
            return Err(ZkError::LeaseNotHonoured {
                asked: lease,
                negotiated,
            });
        }
        lock(&self.live).push(session.clone());
        Ok(session)
    }

    /// Any live session (for `inspect`), the default one when possible.
    pub(crate) async fn any(&self) -> Result<Arc<Session>, ZkError> {
        let default = self.default_timeout();
        if let Some(found) = self.find(default) {
            return Ok(found);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(found) = self.find(default) {
            return Ok(found);
        }
        let session = self.establish(self.config.session_timeout).await?;
        *lock(&self.default_timeout) = session.timeout;
        lock(&self.live).push(session.clone());
        Ok(session)
    }

    /// The live session with `timeout`, if any. Retires the sessions that are gone, and closes the idle
    /// ones of other leases than `timeout` and the default: no lock, acquire or pending delete uses them
    /// (only this list holds them), so a backend used with many leases over time keeps one idle session
    /// at most besides the default one, instead of one per lease ever used (ZooKeeper refuses a host's
    /// 61st connection by default).
    fn find(&self, timeout: Duration) -> Option<Arc<Session>> {
        let default = self.default_timeout();
        let mut live = lock(&self.live);
        live.retain(|s| {
            let idle = Arc::strong_count(s) == 1 && s.timeout != default && s.timeout != timeout;
            if idle {
                tracing::debug!(session = %s.describe(), "closing an idle session");
            }
            !s.is_gone() && !idle
        });
        live.iter().find(|s| s.timeout == timeout).cloned()
    }

    /// Connects a new session asking for `timeout`, adds the digest credentials and makes sure the
    /// chroot exists (created as a persistent node when absent).
    async fn establish(&self, timeout: Duration) -> Result<Arc<Session>, ZkError> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(timeout)
            .with_connection_timeout(self.config.connection.connect_timeout);
        if let (Some(user), Some(password)) = (
            &self.config.connection.username,
            &self.config.connection.password,
        ) {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        // The client tries the servers in turn until the session timeout (60 s by default) runs out;
        // the connect timeout bounds one attempt, so one try of each server is the bound (a server that
        // is down or refuses is reported then, not a session timeout later).
        let servers = u32::try_from(self.config.endpoints.len().max(1)).unwrap_or(u32::MAX);
        let bound = self
            .config
            .connection
            .connect_timeout
            .saturating_mul(servers);
        let connect = connector.connect(&self.connect_string);
        let client = match tokio::time::timeout(bound, connect).await {
            Ok(Ok(client)) => client,
            Ok(Err(source)) => {
                return Err(ZkError::Connect {
                    servers: self.connect_string.clone(),
                    source,
                })
            }
            Err(_) => {
                return Err(ZkError::Connect {
                    servers: self.connect_string.clone(),
                    source: zk::Error::Timeout,
                })
            }
        };
        let client = match &self.config.chroot {
            None => client,
            Some(chroot) => self.enter_chroot(client, chroot).await?,
        };
        let timeout_negotiated = client.session_timeout();
        let (runtime_alive, sentinel) = runtime_sentinel();
        tracing::debug!(
            session = client.session_id().0,
            asked = ?timeout,
            negotiated = ?timeout_negotiated,
            "ZooKeeper session established"
        );
        Ok(Arc::new(Session {
            client,
            runtime_alive,
            _sentinel: sentinel,
            timeout: timeout_negotiated,
            cleanup: Mutex::default(),
        }))
    }

    async fn enter_chroot(&self, client: zk::Client, chroot: &str) -> Result<zk::Client, ZkError> {
        let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let bound = self.config.connection.request_timeout;
        match tokio::time::timeout(bound, client.mkdir(chroot, &options)).await {
            Ok(Ok(())) => {}
            Ok(Err(source @ (zk::Error::NoChildrenForEphemerals | zk::Error::BadArguments(_)))) => {
                return Err(ZkError::Config(format!(
                    "the chroot {chroot:?} cannot be created ({source}): pick another chroot"
                )))
            }
            Ok(Err(source)) => {
                return Err(ZkError::Request {
                    action: "create of the chroot",
                    source,
                })
            }
            Err(_) => {
                return Err(ZkError::Timeout {
                    action: "create of the chroot",
                    after: bound,
                })
            }
        }
        client
            .chroot(chroot.to_string())
            .map_err(|_| ZkError::Config(format!("the chroot {chroot:?} is not a valid path")))
    }
}

/// A flag that turns false when the current tokio runtime is dropped: a task on it holds a guard that
/// clears the flag when the runtime drops the task. The task ends when the returned sender is dropped
/// (with its session).
fn runtime_sentinel() -> (Arc<AtomicBool>, tokio::sync::oneshot::Sender<()>) {
    struct ClearOnDrop(Arc<AtomicBool>);
    impl Drop for ClearOnDrop {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let flag = Arc::new(AtomicBool::new(true));
    let guard = ClearOnDrop(flag.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _guard = guard;
        let _ = stopped.await;
    });
    (flag, stop)
}

/// ZooKeeper session timeouts are whole milliseconds.
fn round_to_millis(d: Duration) -> Duration {
    let millis = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// Locks a std mutex, ignoring poisoning (the data are plain values, consistent at every unlock).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
