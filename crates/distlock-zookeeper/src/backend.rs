//! `impl raw::Backend` for ZooKeeper: the backend type, its construction, and the trait methods, which
//! delegate to the job files: `acquire.rs` (tries, waits, abandon), `lease.rs` (renewals, loss signal,
//! expiry, release), `session.rs` (sessions per timeout, state mapping), `layout.rs` (Curator's layout).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, HolderInfo, LockInfo, Released, Renewal, RenewalId, Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{Capabilities, Error, ErrorKind, Fencing, FencingToken, LockOptions, Result};
use zookeeper_client as zk;

use crate::acquire::ZkAcquisition;
use crate::config::ZkConfig;
use crate::error::{ZkError, BACKEND};
use crate::layout;
use crate::lease::{self, ZkLease};
use crate::request::retried;
use crate::session::Sessions;

/// The ZooKeeper backend: Curator `InterProcessMutex`-compatible locks (see [`layout`]). Cheap to
/// clone; clones share the sessions.
///
/// ```no_run
/// # async fn demo() -> distlock_core::Result<()> {
/// use distlock_core::Locks;
/// use distlock_zookeeper::{ZkBackend, ZkConfig};
///
/// let backend = ZkBackend::from_config(ZkConfig::new(["127.0.0.1:2181"])).await?;
/// let locks = Locks::with_defaults(backend.clone(), backend.default_options());
/// let guard = locks.lock("orders/42")?.acquire().await?;   // node /orders/42/_c_<uuid>-lock-<seq>
/// let token = guard.token();                               // its czxid
/// guard.release().await?;
/// # let _ = token; Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZkBackend {
    sessions: Arc<Sessions>,
}

impl std::fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkBackend")
            .field("config", self.sessions.config())
            .finish_non_exhaustive()
    }
}

impl ZkBackend {
    /// Connects as `url` says (see [`ZkConfig::from_url`]).
    pub async fn connect(url: &LockUrl) -> Result<Self> {
        Self::from_config(ZkConfig::from_url(url)?).await
    }

    /// Validates `config` and establishes the default session (creating the chroot if absent).
    pub async fn from_config(config: ZkConfig) -> Result<Self> {
        let sessions = Sessions::connect(config)
            .await
            .map_err(|e| e.into_core(None))?;
        Ok(Self {
            sessions: Arc::new(sessions),
        })
    }

    pub(crate) fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The session timeout the server negotiated for [`ZkConfig::session_timeout`]: the lease of locks
    /// that ask for none (as etcd's is its session TTL). A lock with another lease gets a session of
    /// its own with that timeout, or fails with `InvalidConfig` if the server will not grant it.
    pub fn default_lease(&self) -> Duration {
        self.sessions.default_timeout()
    }

    /// Lock options with [`default_lease`](Self::default_lease) as the lease, for
    /// [`Locks::with_defaults`](distlock_core::Locks::with_defaults).
    pub fn default_options(&self) -> LockOptions {
        LockOptions::default().with_lease(self.default_lease())
    }

    /// Over the backend's live sessions: the holds recorded for their sessions' tasks, and the
    /// node watches those tasks have in flight. A test hook.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn held_nodes(&self) -> (usize, usize) {
        self.sessions.held_counts()
    }

    /// The id and password of the live session whose negotiated timeout is `timeout`. A test hook (a
    /// test takes the session over and closes it).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn session_info(&self, timeout: Duration) -> Option<zk::SessionInfo> {
        self.sessions.session_info(timeout)
    }

    async fn inspect_zk(&self, name: &str) -> std::result::Result<LockInfo, ZkError> {
        let path = layout::lock_path(name).map_err(ZkError::Config)?;
        let session = self.sessions.any().await?;
        let config = self.sessions.config();
        let client = &session.client;
        let mut children =
            match retried(config, "getChildren", || client.list_children(&path)).await {
                Ok(children) => children,
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => return Ok(LockInfo::default()),
                Err(e) => return Err(e),
            };
        layout::sort_children(&mut children);
        let Some(first) = children.first() else {
            return Ok(LockInfo::default());
        };
        let holder_path = layout::join(&path, first);
        let mut info = LockInfo::default();
        match retried(config, "getData", || client.get_data(&holder_path)).await {
            Ok((data, stat)) => {
                let mut holder = HolderInfo::default();
                holder.owner = Some(String::from_utf8_lossy(&data).into_owned());
                holder.token = u64::try_from(stat.czxid).ok().map(FencingToken::new);
                info.holder = Some(holder);
            }
            Err(ZkError::Request {
                source: zk::Error::NoNode,
                ..
            }) => {}
            Err(e) => return Err(e),
        }
        info.waiters = Some(children.len().saturating_sub(1));
        Ok(info)
    }
}

#[async_trait]
impl Backend for ZkBackend {
    type Lease = ZkLease;
    type Acquisition = ZkAcquisition;

    fn kind(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::mutex()
            .with_server_ttl(true)
            .with_fencing(Fencing::Strict)
            .with_fifo(true)
            .with_notify_wait(true)
            .with_frees_on_process_death(false)
            .with_shared_across_processes(true)
    }

    fn validate_name(&self, name: &str) -> Result<()> {
        layout::lock_path(name)
            .map(drop)
            .map_err(|message| Error::new(ErrorKind::InvalidName, message).with_backend(BACKEND))
    }

    fn begin(&self, request: &AcquireRequest) -> Result<ZkAcquisition> {
        let path = layout::lock_path(&request.name).map_err(|message| {
            Error::new(ErrorKind::InvalidName, message)
                .with_backend(BACKEND)
                .with_lock(&request.name)
        })?;
        Ok(ZkAcquisition::new(path))
    }

    async fn try_acquire(
        &self,
        acquisition: &mut ZkAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<ZkLease>> {
        self.try_acquire_zk(acquisition, request)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))
    }

    async fn wait(
        &self,
        acquisition: &mut ZkAcquisition,
        request: &AcquireRequest,
        _retry_after: Option<Duration>,
    ) -> Result<()> {
        self.wait_zk(acquisition)
            .await
            .map_err(|e| e.into_core(Some(&request.name)))
    }

    async fn abandon(&self, acquisition: ZkAcquisition, _request: &AcquireRequest) {
        self.abandon_zk(acquisition).await;
    }

    async fn renew(&self, batch: &[Renewal<'_, ZkLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        lease::renew(self.sessions.config(), batch).await
    }

    async fn release(&self, held: &ZkLease, name: &str, _owner: &str) -> Result<Released> {
        lease::release(self.sessions.config(), held)
            .await
            .map_err(|e| e.into_core(Some(name)))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        self.inspect_zk(name)
            .await
            .map_err(|e| e.into_core(Some(name)))
    }
}
