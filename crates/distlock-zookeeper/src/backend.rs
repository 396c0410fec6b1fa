//! `impl raw::Backend` for ZooKeeper: the backend type, its construction, and the trait methods, which
//! delegate to the job files: `acquire.rs` (tries, waits, abandon), `lease.rs` (renewals, loss signal,
//! expiry, release), `session.rs` (sessions per timeout, state mapping), `layout.rs` (Curator's layout).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use distlock_core::raw::{
    AcquireRequest, Attempt, Backend, Grant, HolderInfo, LockInfo, Released, Renewal, RenewalId,
    Renewed,
};
use distlock_core::url::LockUrl;
use distlock_core::{
    Capabilities, Error, ErrorKind, Fencing, FencingToken, LockKind, LockKinds, LockOptions,
    ReadWriteOrder, Result,
};
use zookeeper_client as zk;

use crate::acquire::ZkAcquisition;
use crate::config::ZkConfig;
use crate::error::{retryable, session_gone};
use crate::error::{ZkError, BACKEND};
use crate::layout;
use crate::lease::{self, ZkLease};
use crate::request::retried;
use crate::rw::{delete_recording, WriteRecord};
use crate::session::{Session, Sessions};

/// How many times a break reads the holder again when its node's data changed between its read and
/// the delete pinned to that read's version.
const BREAK_TRIES: u32 = 3;

/// What a break's delete of the holder's node did.
enum BreakDelete {
    /// This delete removed the node.
    Deleted,
    /// The node was gone (the hold ended otherwise): nothing was touched.
    Gone,
    /// The node's data version is no longer the one read: read the holder again.
    Changed,
}

/// The error of a break aimed at a shared holder of `name` (a reader, a permit holder), which a break
/// never ends.
fn shared_holder(name: &str, kind: layout::HoldKind) -> Error {
    let holder = if kind == layout::HoldKind::Permit {
        "a semaphore permit holder"
    } else {
        "a reader"
    };
    Error::new(
        ErrorKind::Unsupported,
        format!("break ends an exclusive holder only (a mutex or a write lock); the holder given is {holder} of {name:?}, which is left holding"),
    )
    .with_backend(BACKEND)
    .with_lock(name)
}

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
        // The name node's data (a write's record) is read right behind its children.
        let children = client.list_children(&path);
        let record = client.get_data(&path);
        let (children, record) = tokio::join!(children, record);
        let children = match children {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(LockInfo::default()),
            Err(_) => match retried(config, "getChildren", || client.list_children(&path)).await {
                Ok(children) => children,
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => return Ok(LockInfo::default()),
                Err(e) => return Err(e),
            },
        };
        if children
            .iter()
            .any(|c| c == layout::SEMAPHORE_LEASES || c == layout::SEMAPHORE_LIMIT)
        {
            if let Some(info) = self.inspect_semaphore(&session, &path).await? {
                return Ok(info);
            }
        }
        // Only lock nodes: a nested lock's container (or an operator's node) is never shown as holder.
        let children = layout::contenders(children);
        let mut info = LockInfo::default();
        let record = record.ok();
        info.last_token = record
            .as_ref()
            .and_then(|(data, _)| layout::parse_write_record(data))
            .and_then(|token| u64::try_from(token).ok())
            .map(FencingToken::new);
        let Some(first) = children.first() else {
            return Ok(info);
        };
        // An exclusive first node holds alone; else the readers before the first exclusive node hold.
        let holders: Vec<&String> = match layout::node_type(first) {
            Some(layout::NodeType::Read) => children
                .iter()
                .take_while(|c| layout::node_type(c) == Some(layout::NodeType::Read))
                .collect(),
            _ => vec![first],
        };
        let described = holders.iter().map(|node| {
            let kind =
                layout::HoldKind::Node(layout::node_type(node).unwrap_or(layout::NodeType::Mutex));
            describe_holder(config, client, &path, node, kind)
        });
        let described: Vec<Option<HolderInfo>> = futures_util::future::join_all(described)
            .await
            .into_iter()
            .collect::<std::result::Result<_, _>>()?;
        info.waiters = Some(children.len().saturating_sub(holders.len()));
        match layout::node_type(first) {
            Some(layout::NodeType::Read) => {
                info.kind = Some(LockKind::Read);
                let name_czxid = record.as_ref().map_or(0, |(_, stat)| stat.czxid);
                let recorded = record
                    .as_ref()
                    .and_then(|(data, _)| layout::parse_write_record(data));
                for mut holder in described.into_iter().flatten() {
                    // The token a reader carries, as far as the server tells (without the writers a
                    // distlock reader saw while it queued).
                    let own = holder
                        .token
                        .map_or(0, |t| i64::try_from(t.get()).unwrap_or(0));
                    let token = layout::reader_token(name_czxid, recorded, own, 0);
                    holder.token = u64::try_from(token).ok().map(FencingToken::new);
                    info.holders.push(holder);
                }
            }
            kind => {
                info.kind = Some(match kind {
                    Some(layout::NodeType::Write) => LockKind::Write,
                    _ => LockKind::Mutex,
                });
                info.holder = described.into_iter().flatten().next();
            }
        }
        Ok(info)
    }

    /// A semaphore's view: its stored limit, the lease nodes as permit holders (the first `limit` by
    /// sequence: a lease node beyond the limit is its acquirer's, waiting with the inner mutex), the
    /// acquires under way (the inner mutex's queue, less the one holding lease nodes over the limit)
    /// as waiters. `None` when no lease node is held (the name may be used as a lock since).
    async fn inspect_semaphore(
        &self,
        session: &Session,
        path: &str,
    ) -> std::result::Result<Option<LockInfo>, ZkError> {
        let config = self.sessions.config();
        let client = &session.client;
        let limit_path = layout::semaphore_limit_path(path);
        let leases_path = layout::semaphore_leases_path(path);
        let locks_path = layout::semaphore_locks_path(path);
        let absent_is_empty = |listed: std::result::Result<Vec<String>, ZkError>| match listed {
            Ok(children) => Ok(children),
            Err(ZkError::Request {
                source: zk::Error::NoNode,
                ..
            }) => Ok(Vec::new()),
            Err(e) => Err(e),
        };
        let leases = absent_is_empty(
            retried(config, "getChildren", || client.list_children(&leases_path)).await,
        )?;
        let mut leases: Vec<String> = leases
            .into_iter()
            .filter(|c| layout::is_lease_node(c))
            .collect();
        if leases.is_empty() {
            return Ok(None);
        }
        leases.sort_by(|a, b| layout::sequence(a).cmp(layout::sequence(b)));
        let limit = match retried(config, "getData", || client.get_data(&limit_path)).await {
            Ok((data, _)) => layout::parse_limit(&data).ok(),
            Err(ZkError::Request {
                source: zk::Error::NoNode,
                ..
            }) => None,
            Err(e) => return Err(e),
        };
        let inner = absent_is_empty(
            retried(config, "getChildren", || client.list_children(&locks_path)).await,
        )?;
        let held = limit.map_or(leases.len(), |l| {
            leases.len().min(usize::try_from(l).unwrap_or(usize::MAX))
        });
        let described = leases[..held].iter().map(|node| {
            describe_holder(config, client, &leases_path, node, layout::HoldKind::Permit)
        });
        let mut info = LockInfo::default();
        // A Curator semaphore stores no limit: its kind (and the permits line) is then unknown.
        info.kind = limit.map(|limit| LockKind::Permit { limit });
        for (node, holder) in leases
            .iter()
            .zip(futures_util::future::join_all(described).await)
        {
            if let Some(mut holder) = holder? {
                holder.permit = Some(node.clone());
                info.holders.push(holder);
            }
        }
        info.waiters = Some(layout::contenders(inner).len());
        Ok(Some(info))
    }
}

impl ZkBackend {
    /// `distlock break`: ends the exclusive hold `holder` (as [`inspect_zk`](Self::inspect_zk) showed
    /// it: the node's data as owner, its czxid as token and in its hold id, [`layout::hold_id`]). A
    /// holder given that is a reader or a permit holder (its hold id or its permit says so; with
    /// neither, it matches one of the name's shared holders now by owner and token) is
    /// `Unsupported`. Otherwise the holder is the first lock node of the name: a node there that is
    /// not the one shown (a reader's, another holder's) or none is `Ok(false)`, the holder shown having
    /// gone. The node shown is deleted at the data version read with its czxid (a writer's with its
    /// token recorded in the same `multi`, as its release would): its path (`_c_<uuid>-…<seq>`) is
    /// its own, and no node sorting before it can appear, so the node deleted is the holder shown.
    /// The waiter behind it watches it, and so does the holder's own session (`held.rs`), so both
    /// learn of the delete as of a release.
    async fn break_zk(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let core = |e: ZkError| e.into_core(Some(name));
        let path = layout::lock_path(name).map_err(|m| core(ZkError::Config(m)))?;
        let aimed = holder.hold_id.as_deref().and_then(layout::parse_hold_id);
        if holder.token.is_none() && holder.owner.is_none() && aimed.is_none() {
            return Err(core(ZkError::Config(
                "the holder to break has neither a token, an owner id nor a hold id: pass the holder status showed"
                    .into(),
            )));
        }
        if let Some((kind, _)) = aimed.filter(|(kind, _)| !kind.is_exclusive()) {
            return Err(shared_holder(name, kind));
        }
        if holder.permit.is_some() {
            return Err(shared_holder(name, layout::HoldKind::Permit));
        }
        // The holder shown holds no lock node now: `Ok(false)`, unless the holder given (with no hold
        // id: built by hand) is one of the readers or permit holders status shows now.
        let not_held = || async move {
            if aimed.is_none() {
                if let Some(kind) = self.shared_holder_kind(name, holder).await.map_err(core)? {
                    return Err(shared_holder(name, kind));
                }
            }
            Ok(false)
        };
        let session = self.sessions.any().await.map_err(core)?;
        let config = self.sessions.config();
        let client = &session.client;
        for _ in 0..BREAK_TRIES {
            let children =
                match retried(config, "getChildren", || client.list_children(&path)).await {
                    Ok(children) => children,
                    Err(ZkError::Request {
                        source: zk::Error::NoNode,
                        ..
                    }) => return Ok(false),
                    Err(e) => return Err(core(e)),
                };
            let children = layout::contenders(children);
            let Some(first) = children.first() else {
                return not_held().await;
            };
            let kind = layout::node_type(first);
            if kind == Some(layout::NodeType::Read) {
                return not_held().await;
            }
            let node = layout::join(&path, first);
            let (data, stat) = match retried(config, "getData", || client.get_data(&node)).await {
                Ok(read) => read,
                // The first node went since the listing: the hold shown (as old, or older) is gone.
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => return not_held().await,
                Err(e) => return Err(core(e)),
            };
            let same_hold = aimed.is_none_or(|(aimed_kind, czxid)| {
                czxid == stat.czxid
                    && aimed_kind == layout::HoldKind::Node(kind.unwrap_or(layout::NodeType::Mutex))
            });
            let same_token = holder
                .token
                .is_none_or(|t| u64::try_from(stat.czxid).is_ok_and(|c| c == t.get()));
            let same_owner = holder
                .owner
                .as_deref()
                .is_none_or(|o| o.as_bytes() == data.as_slice());
            if !(same_hold && same_token && same_owner) {
                return not_held().await;
            }
            let record =
                (kind == Some(layout::NodeType::Write)).then(|| WriteRecord::of(&node, stat.czxid));
            match break_delete(config, &session, &node, stat.version, record.as_ref())
                .await
                .map_err(core)?
            {
                BreakDelete::Deleted => {
                    tracing::debug!(%node, czxid = stat.czxid, "zookeeper: broke a hold (deleted its node)");
                    return Ok(true);
                }
                BreakDelete::Gone => return Ok(false),
                BreakDelete::Changed => {}
            }
        }
        Err(core(ZkError::OutcomeUnknown(format!(
            "break of {name:?}: the holder's node changed {BREAK_TRIES} times between its read and its delete (is something writing its data?); nothing was deleted"
        ))))
    }

    /// Whether `holder` (given with no hold id) is one of the readers or permit holders `status`
    /// shows for `name` now (the same owner id and token, where given), and which.
    async fn shared_holder_kind(
        &self,
        name: &str,
        holder: &HolderInfo,
    ) -> std::result::Result<Option<layout::HoldKind>, ZkError> {
        let info = self.inspect_zk(name).await?;
        let kind = match info.kind {
            Some(LockKind::Read) => layout::HoldKind::Node(layout::NodeType::Read),
            _ => layout::HoldKind::Permit,
        };
        let shared = info.holders.iter().any(|shared| {
            holder
                .owner
                .as_ref()
                .is_none_or(|o| shared.owner.as_ref() == Some(o))
                && holder.token.is_none_or(|t| shared.token == Some(t))
        });
        Ok(shared.then_some(kind))
    }
}

/// Deletes the holder's `node` at data `version` for a break (with a writer's `record`), retried on
/// the same session while requests get no answer, for at most the request timeout. A resend that
/// finds the node gone cannot tell whether the unanswered send deleted it: the outcome is unknown.
async fn break_delete(
    config: &ZkConfig,
    session: &Session,
    node: &str,
    version: i32,
    record: Option<&WriteRecord>,
) -> std::result::Result<BreakDelete, ZkError> {
    let bound = config.connection.request_timeout;
    let deadline = tokio::time::Instant::now() + bound;
    let mut retries = config.connection.retry.start(Some(deadline));
    let unknown = |why: &str| {
        ZkError::OutcomeUnknown(format!(
            "the delete of the lock node {node} got no answer ({why}): the outcome of the break is unknown (it may have been applied); no other hold was touched"
        ))
    };
    let mut unanswered: Option<String> = None;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let delete = delete_recording(&session.client, node, Some(version), record);
        let source = match tokio::time::timeout(left, delete).await {
            Ok(Ok(())) => return Ok(BreakDelete::Deleted),
            Ok(Err(zk::Error::NoNode)) => {
                return match unanswered {
                    Some(why) => Err(unknown(&why)),
                    None => Ok(BreakDelete::Gone),
                }
            }
            Ok(Err(zk::Error::BadVersion)) => return Ok(BreakDelete::Changed),
            Ok(Err(source)) if session_gone(&source) => {
                return match unanswered {
                    Some(why) => Err(unknown(&format!("{why}; then the session ended"))),
                    None => Err(ZkError::Request {
                        action: "delete",
                        source,
                    }),
                }
            }
            Ok(Err(source)) if retryable(&source) => source,
            Ok(Err(source)) => {
                return Err(ZkError::Request {
                    action: "delete",
                    source,
                })
            }
            Err(_) => return Err(unknown(&format!("no answer within {bound:?}"))),
        };
        let why = source.to_string();
        match retries.next_delay() {
            Some(delay) => {
                unanswered = Some(why);
                tokio::time::sleep(delay).await;
            }
            None => return Err(unknown(&why)),
        }
    }
}

/// One holder's node: its data as the owner (Curator writes the client's IP address) and its czxid as
/// the token; `None` when it went meanwhile.
async fn describe_holder(
    config: &ZkConfig,
    client: &zk::Client,
    parent: &str,
    node: &str,
    kind: layout::HoldKind,
) -> std::result::Result<Option<HolderInfo>, ZkError> {
    let path = layout::join(parent, node);
    match retried(config, "getData", || client.get_data(&path)).await {
        Ok((data, stat)) => {
            let mut holder = HolderInfo::default();
            holder.owner = Some(String::from_utf8_lossy(&data).into_owned());
            holder.token = u64::try_from(stat.czxid).ok().map(FencingToken::new);
            holder.hold_id = Some(layout::hold_id(kind, stat.czxid));
            Ok(Some(holder))
        }
        Err(ZkError::Request {
            source: zk::Error::NoNode,
            ..
        }) => Ok(None),
        Err(e) => Err(e),
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
            // `distlock break`: the holder's node deleted at the version read with its czxid.
            .with_breaks_holders(true)
            // One queue of sequential nodes for readers, writers and the mutex: first come, first
            // served; the downgrade is one `multi` (`rw.rs`); the semaphore is Curator's V2.
            .with_kinds(
                LockKinds::mutex_only()
                    .with_read_write(ReadWriteOrder::Fifo)
                    .with_atomic_downgrade()
                    .with_semaphore(),
            )
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
        Ok(match request.kind {
            LockKind::Read => ZkAcquisition::new(path).with_marker(layout::READ_NAME),
            LockKind::Write => ZkAcquisition::new(path).with_marker(layout::WRITE_NAME),
            LockKind::Permit { limit } => crate::semaphore::permit_acquisition(path, limit),
            _ => ZkAcquisition::new(path),
        })
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
        let waited = if acquisition.permit.is_some() {
            self.wait_permit(acquisition).await
        } else {
            self.wait_zk(acquisition).await
        };
        waited.map_err(|e| e.into_core(Some(&request.name)))
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

    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        self.break_zk(name, holder).await
    }

    async fn downgrade(&self, lease: &ZkLease, read: &AcquireRequest) -> Result<Grant<ZkLease>> {
        self.downgrade_zk(lease, read)
            .await
            .map_err(|e| e.into_core(Some(&read.name)))
    }
}
