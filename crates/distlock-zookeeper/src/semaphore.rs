//! The semaphore: Curator's `InterProcessSemaphoreV2` on the mutex's machinery (`acquire.rs`). One
//! permit's acquire:
//!
//! 1. checks the stored limit (`<name>/limit`, a 4-byte big-endian int as Curator's `SharedCount`
//!    writes; stored by the first permit ever, persistent, and kept: another limit fails with
//!    `LimitMismatch`), read in the same round trip as the next step's create;
//! 2. takes the inner mutex `<name>/locks` (a mutex acquire: protected ephemeral sequential
//!    `_c_<uuid>-lock-<seq>`, predecessor watch);
//! 3. holding it, creates its lease node `<name>/leases/_c_<uuid>-lease-<seq>` (protected ephemeral
//!    sequential, found again by its `_c_<uuid>` after a lost reply) and counts the lease nodes, its own
//!    included: at most the limit, the permit is held (token: the lease node's czxid; permit id: its
//!    name), and the inner mutex is released in the same round trip as the kind check below; more,
//!    it waits **still holding the inner mutex**, with its lease node, watching `leases`' children,
//!    and counts again (Curator's hold-the-inner-mutex wait: one waiter watches, no herd, and no two
//!    waiters each wait for the other's node to go);
//! 4. once per lease node, after it was created, lists the name's children: a mutex's or read-write
//!    lock's node there refuses the permit with `KindConflict` (a mutex or read-write acquire does the
//!    converse after creating its node: each side checks after its own create, so the later of two
//!    concurrent ones sees the earlier).
//!
//! Safety does not rest on the inner mutex: a holder's count, taken after its own create, included
//! every lease node created before it, so of any set of holders the last to count saw them all.
//! A session loss frees the lease (ephemeral); an abandoned acquire deletes its lease node and its
//! inner mutex node.

use std::sync::Arc;

use distlock_core::raw::{AcquireRequest, Attempt};
use zookeeper_client as zk;

use crate::acquire::{session_ends, session_lost, ZkAcquisition, MAX_RECREATES};
use crate::backend::ZkBackend;
use crate::error::{session_gone, ZkError};
use crate::layout;
use crate::lease::{self, ZkLease};
use crate::request::{once, retried};
use crate::session::{state_is_terminal, Session};

/// A permit's acquire: its inner mutex's and its lease node's, kept in the acquisition for the whole
/// acquire (never taken out of it during a try: a try dropped half-way leaves `abandon` both).
#[derive(Debug)]
pub(crate) struct PermitAcquisition {
    /// The semaphore's path (the name's node).
    path: String,
    limit: u32,
    /// The stored limit was checked by this acquire.
    limit_checked: bool,
    /// The inner mutex's acquire (its path is `<path>/locks`).
    pub(crate) inner: ZkAcquisition,
    /// The inner mutex is held.
    inner_held: bool,
    /// The lease node's acquire (its path is `<path>/leases`).
    pub(crate) lease: ZkAcquisition,
    /// The czxid of the lease node the kind check was made for.
    kind_checked_for: Option<i64>,
    /// The lease node waits for a lease to free (the wait watches `leases`, not a predecessor).
    waiting: bool,
}

/// The acquisition of one permit of the `limit`-permit semaphore at `path`: a shell that creates
/// nothing itself, holding the inner mutex's and the lease node's acquires.
pub(crate) fn permit_acquisition(path: String, limit: u32) -> ZkAcquisition {
    let mut inner = ZkAcquisition::new(layout::semaphore_locks_path(&path));
    // The inner mutex is the semaphore's own: it never refuses a semaphore.
    inner.refuses_semaphore = false;
    let mut lease =
        ZkAcquisition::new(layout::semaphore_leases_path(&path)).with_marker(layout::LEASE_NAME);
    lease.refuses_semaphore = false;
    let mut shell = ZkAcquisition::new(path.clone());
    shell.permit = Some(Box::new(PermitAcquisition {
        path,
        limit,
        limit_checked: false,
        inner,
        inner_held: false,
        lease,
        kind_checked_for: None,
        waiting: false,
    }));
    shell
}

impl ZkBackend {
    /// One try of a permit (see the module docs).
    pub(crate) async fn try_permit(
        &self,
        session: &Arc<Session>,
        acq: &mut ZkAcquisition,
        request: &AcquireRequest,
        started: distlock_core::clock::Instant,
    ) -> Result<Attempt<ZkLease>, ZkError> {
        let Some(permit) = acq.permit.as_deref_mut() else {
            return Err(ZkError::Unsupported(
                "internal error: a permit's acquire without its phases".into(),
            ));
        };
        let config = self.sessions().config();
        permit.inner.set_session(session.clone());
        permit.lease.set_session(session.clone());
        let inner = &mut permit.inner;
        if !permit.inner_held {
            // The limit's read is sent first, the inner mutex's create behind it: one round trip.
            let limit_path = layout::semaphore_limit_path(&permit.path);
            let stored = (!permit.limit_checked).then(|| session.client.get_data(&limit_path));
            let turn = self.take_turn(session, inner, &request.owner);
            let (stored, turn) = tokio::join!(
                async {
                    match stored {
                        Some(read) => Some(read.await),
                        None => None,
                    }
                },
                turn
            );
            if let Some(stored) = stored {
                self.check_limit(session, &permit.path, permit.limit, stored)
                    .await?;
                permit.limit_checked = true;
            }
            if !turn? {
                return Ok(Attempt::Busy { retry_after: None });
            }
            permit.inner_held = true;
        }
        for _ in 0..=MAX_RECREATES {
            let lease = &mut permit.lease;
            let listed = if lease.node().is_none() {
                self.create_node(session, lease, &request.owner).await?
            } else {
                None
            };
            let Some((own, czxid)) = lease.node().map(|(n, c)| (n.to_string(), c)) else {
                continue;
            };
            let children = match listed {
                Some(children) => children,
                None => {
                    let path = lease.path().to_string();
                    match retried(config, "getChildren", || {
                        session.client.list_children(&path)
                    })
                    .await
                    {
                        Ok(children) => children,
                        Err(ZkError::Request {
                            source: zk::Error::NoNode,
                            ..
                        }) => Vec::new(),
                        Err(e) => return Err(e),
                    }
                }
            };
            // Only lease nodes hold permits (a nested lock's container under `leases` holds none).
            let mut leases: Vec<String> = children
                .into_iter()
                .filter(|c| layout::is_lease_node(c))
                .collect();
            // A create sent again after a lost reply may have left a second lease node: it would
            // hold a permit for nobody.
            self.drop_duplicates(session, lease, &own, &mut leases)
                .await;
            if !leases.contains(&own) {
                if session.is_gone() {
                    return Err(session_lost(session));
                }
                tracing::debug!(path = %lease.path(), node = %own, "own lease node gone while counted; creating it again");
                lease.lose_node();
                continue;
            }
            let granted = leases.len() <= usize::try_from(permit.limit).unwrap_or(usize::MAX);
            let check = permit.kind_checked_for != Some(czxid);
            // Sent now, after the lease node's create was answered; the inner mutex's delete behind it.
            let names = check.then(|| session.client.list_children(&permit.path));
            let names = async {
                match names {
                    Some(list) => Some(list.await),
                    None => None,
                }
            };
            let release_inner = async {
                if granted {
                    self.release_inner(session, inner).await;
                }
            };
            let (names, ()) = tokio::join!(names, release_inner);
            if let Some(names) = names {
                match names {
                    Ok(names) => refuse_beside_lock_nodes(&permit.path, &names)?,
                    Err(zk::Error::NoNode) => {}
                    Err(source) => {
                        return Err(ZkError::Request {
                            action: "getChildren",
                            source,
                        })
                    }
                }
                permit.kind_checked_for = Some(czxid);
            }
            if !granted {
                permit.waiting = true;
                return Ok(Attempt::Busy { retry_after: None });
            }
            permit.waiting = false;
            let grant = self.grant(session, &permit.lease, request, started)?;
            return Ok(Attempt::Acquired(grant.with_permit(own)));
        }
        Err(ZkError::SessionLost(format!(
            "the lease node under {} kept disappearing while this acquire counted (deleted by someone else?)",
            permit.lease.path()
        )))
    }

    /// Releases the inner mutex once the permit is held (its delete, retried on the session, handed
    /// to the session's cleanup when it gets no answer). A failure only delays the next acquirer.
    async fn release_inner(&self, session: &Arc<Session>, inner: &mut ZkAcquisition) {
        let Some((node, _)) = inner.node() else {
            return;
        };
        let path = layout::join(inner.path(), node);
        inner.forget_node();
        if let Err(e) = lease::delete_node(self.sessions().config(), session, &path).await {
            tracing::warn!(%path, error = %e, "could not delete the semaphore's inner lock node now; retried once reconnected, else it goes with its session");
        }
    }

    /// Compares the stored limit (`stored`: its read) with `limit`; stores `limit` when none is.
    async fn check_limit(
        &self,
        session: &Session,
        path: &str,
        limit: u32,
        stored: Result<(Vec<u8>, zk::Stat), zk::Error>,
    ) -> Result<(), ZkError> {
        let config = self.sessions().config();
        let client = &session.client;
        let limit_path = layout::semaphore_limit_path(path);
        let mut stored = stored;
        for _ in 0..=MAX_RECREATES {
            match stored {
                Ok((data, _)) => return compare_limit(&limit_path, &data, limit),
                Err(zk::Error::NoNode) => {}
                Err(source) if crate::error::retryable(&source) => {}
                Err(source) => {
                    return Err(ZkError::Request {
                        action: "getData of the semaphore's limit",
                        source,
                    })
                }
            }
            // None stored yet (or its read got no answer): store it, persistent (kept when the
            // semaphore is idle and its containers are reaped), the name's missing levels as
            // containers first, as a lock's parents. A create resent after a lost reply finds it.
            let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
            let data = layout::limit_bytes(limit);
            let create = || client.create(&limit_path, &data, &persistent);
            match retried(config, "create of the semaphore's limit", create).await {
                Ok(_) => {
                    tracing::debug!(path = %limit_path, limit, "stored the semaphore's limit");
                    return Ok(());
                }
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => {
                    let containers = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
                    for level in crate::acquire::ancestors(path) {
                        match retried(config, "create of the semaphore's path", || {
                            client.create(level, b"", &containers)
                        })
                        .await
                        {
                            Ok(_)
                            | Err(ZkError::Request {
                                source: zk::Error::NodeExists,
                                ..
                            }) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                Err(ZkError::Request {
                    source: zk::Error::NodeExists,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
            stored = once(config, "getData", client.get_data(&limit_path))
                .await
                .map_err(|e| match e {
                    ZkError::Request { source, .. } => source,
                    _ => zk::Error::Timeout,
                });
        }
        Err(ZkError::SessionLost(format!(
            "the semaphore's limit {limit_path} kept disappearing while this acquire stored it (deleted by someone else?)"
        )))
    }

    /// A permit's wait: for the inner mutex, its predecessor (as a mutex's); holding it, until the
    /// lease nodes change (a watch on `leases`' children) and are at most the limit, or the session
    /// ends.
    pub(crate) async fn wait_permit(&self, acq: &mut ZkAcquisition) -> Result<(), ZkError> {
        let (Some(session), Some(permit)) = (acq.session().cloned(), acq.permit.as_deref_mut())
        else {
            return Ok(());
        };
        if !permit.waiting {
            return self.wait_zk(&mut permit.inner).await;
        }
        let config = self.sessions().config();
        let leases_path = permit.lease.path().to_string();
        let limit = usize::try_from(permit.limit).unwrap_or(usize::MAX);
        let watched = once(
            config,
            "getChildren (watch)",
            session.client.list_and_watch_children(&leases_path),
        )
        .await;
        let (children, watcher) = match watched {
            Ok(watched) => watched,
            Err(ZkError::Request { source, .. }) if session_gone(&source) => {
                return Err(session_lost(&session))
            }
            Err(ZkError::Request {
                source: zk::Error::NoNode,
                ..
            }) => return Ok(()),
            Err(e @ ZkError::Request { .. }) if !e.unanswered() => return Err(e),
            // A lost connection: count again after a pause.
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                return Ok(());
            }
        };
        if children.iter().filter(|c| layout::is_lease_node(c)).count() <= limit {
            return Ok(());
        }
        tokio::select! {
            event = watcher.changed() => {
                if event.event_type == zk::EventType::Session && state_is_terminal(event.session_state) {
                    return Err(session_lost(&session));
                }
                Ok(())
            }
            lost = session_ends(&session) => Err(lost),
        }
    }

    /// Names are one kind: a mutex or read-write acquire at `path` is refused while a semaphore's lease
    /// nodes are under it (`children` are `path`'s, read after the acquire's own node was created).
    pub(crate) async fn refuse_beside_permits(
        &self,
        session: &Session,
        path: &str,
        children: &[String],
    ) -> Result<(), ZkError> {
        if !children.iter().any(|c| c == layout::SEMAPHORE_LEASES) {
            return Ok(());
        }
        let config = self.sessions().config();
        let leases_path = layout::semaphore_leases_path(path);
        let leases = match retried(config, "getChildren", || {
            session.client.list_children(&leases_path)
        })
        .await
        {
            Ok(leases) => leases,
            Err(ZkError::Request {
                source: zk::Error::NoNode,
                ..
            }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let held = leases.iter().filter(|c| layout::is_lease_node(c)).count();
        if held == 0 {
            return Ok(());
        }
        Err(ZkError::KindConflict(format!(
            "{path} is in use as a semaphore ({held} lease node(s) under {leases_path}); it cannot be taken as a mutex or read-write lock until every permit is released"
        )))
    }
}

/// Names are one kind: a permit is refused while the name's node has a mutex's or read-write lock's
/// nodes (`names`, read after the permit's lease node was created).
fn refuse_beside_lock_nodes(path: &str, names: &[String]) -> Result<(), ZkError> {
    // Named after the holder: the first in the queue.
    let lock_nodes = layout::contenders(names.to_vec());
    let Some(first) = lock_nodes.first() else {
        return Ok(());
    };
    let what = match layout::node_type(first) {
        Some(layout::NodeType::Mutex) => "a mutex",
        _ => "a read-write lock",
    };
    Err(ZkError::KindConflict(format!(
        "{path} is in use as {what} ({} lock node(s) under it); it cannot be taken as a semaphore until they are released",
        lock_nodes.len()
    )))
}

/// The stored limit against the one asked for.
fn compare_limit(limit_path: &str, data: &[u8], limit: u32) -> Result<(), ZkError> {
    match layout::parse_limit(data) {
        Ok(stored) if stored == limit => Ok(()),
        Ok(stored) => Err(ZkError::LimitMismatch {
            stored,
            requested: limit,
            path: limit_path.to_string(),
        }),
        Err(what) => Err(ZkError::Config(format!(
            "the semaphore's limit node {limit_path} {what}: set it right, or delete it (`zkCli.sh delete {limit_path}`) while no permit is held so the next permit stores its own"
        ))),
    }
}
