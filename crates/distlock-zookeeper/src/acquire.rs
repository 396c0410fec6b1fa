//! Acquires, Curator's `LockInternals.attemptLock` done right: one protected-mode create of an
//! ephemeral sequential child (found again by its `_c_<uuid>` after a lost reply: CURATOR-678, kazoo
//! #760), the holder read from the sorted children, a waiter watching only its predecessor, a waiter
//! whose session expires failing instead of waiting on (etcd #19597's analogue), and an abandoned
//! acquire deleting its node. The same machinery queues a reader or a writer (`rw.rs`: what differs is
//! the node's name, where it stands, and the reader's token) and a semaphore's inner mutex and lease
//! node (`semaphore.rs`).

use std::sync::Arc;
use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Grant, LossReport};
use distlock_core::FencingToken;
use zookeeper_client as zk;

use crate::backend::ZkBackend;
use crate::cleanup::{self, Leftover};
use crate::error::{session_gone, ZkError};
use crate::layout;
use crate::lease::{self, ZkLease};
use crate::request::{once, retried};
use crate::session::{state_is_terminal, Session};

/// How many times one try creates the node again (its parent reaped, or the node deleted before the
/// first read) before giving up.
pub(crate) const MAX_RECREATES: u32 = 3;

/// An acquire under way: the session it queues on, its protection id, and its node once created.
#[derive(Debug)]
pub struct ZkAcquisition {
    /// The lock path.
    path: String,
    /// The uuid of the `_c_<uuid>-` protection prefix.
    protection: String,
    session: Option<Arc<Session>>,
    /// The own node's name (leaf), once the create is confirmed or found.
    node: Option<String>,
    czxid: i64,
    /// A create was sent (its reply may have been lost): `abandon` must look for the node.
    create_sent: bool,
    /// The child to watch in `wait`.
    predecessor: Option<String>,
    /// The node's name before the sequence: `lock-`, `__READ__`, `__WRIT__`, `lease-`.
    pub(crate) marker: &'static str,
    /// Whether a semaphore's lease nodes under the path refuse this acquire (`KindConflict`): for a
    /// name's mutex and read-write nodes, not for a semaphore's own inner mutex.
    pub(crate) refuses_semaphore: bool,
    semaphore_checked_for: i64,
    /// A reader's: the newest writer node it queued behind (czxid), and the name node's data and czxid
    /// read with the listing that granted it (`rw::reader_token`).
    pub(crate) seen_write: i64,
    pub(crate) name_record: Option<(Vec<u8>, i64)>,
    /// A semaphore's acquire: its inner mutex's and lease node's (this acquisition is then a shell).
    pub(crate) permit: Option<Box<crate::semaphore::PermitAcquisition>>,
}

impl ZkAcquisition {
    pub(crate) fn new(path: String) -> Self {
        Self {
            path,
            protection: uuid::Uuid::new_v4().to_string(),
            session: None,
            node: None,
            czxid: 0,
            create_sent: false,
            predecessor: None,
            marker: layout::LOCK_NAME,
            refuses_semaphore: true,
            semaphore_checked_for: 0,
            seen_write: 0,
            name_record: None,
            permit: None,
        }
    }

    /// The same acquire of a node named with `marker` (`__READ__`, `__WRIT__`, `lease-`).
    pub(crate) fn with_marker(mut self, marker: &'static str) -> Self {
        self.marker = marker;
        self
    }

    /// The session it queues on, once chosen.
    pub(crate) fn session(&self) -> Option<&Arc<Session>> {
        self.session.as_ref()
    }

    /// The lock path (the node's parent).
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The own node's name and czxid, once created.
    pub(crate) fn node(&self) -> Option<(&str, i64)> {
        self.node.as_deref().map(|n| (n, self.czxid))
    }

    /// Forgets the own node (deleted under it): the next turn creates it again.
    pub(crate) fn lose_node(&mut self) {
        self.node = None;
    }

    /// The own node was deleted on purpose (a semaphore's inner mutex, once the permit is held):
    /// nothing is left for `abandon`.
    pub(crate) fn forget_node(&mut self) {
        self.node = None;
        self.create_sent = false;
    }

    /// Queues on `session` (a semaphore's lease node, on its inner mutex's session).
    pub(crate) fn set_session(&mut self, session: Arc<Session>) {
        self.session = Some(session);
    }
}

pub(crate) fn session_lost(session: &Session) -> ZkError {
    ZkError::SessionLost(format!(
        "the ZooKeeper {} this acquire queued on expired or closed; its queue position is gone (try again)",
        session.describe()
    ))
}

impl ZkBackend {
    pub(crate) async fn try_acquire_zk(
        &self,
        acq: &mut ZkAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<ZkLease>, ZkError> {
        // Not earlier than the core's send time for this attempt: a grant's TTL counts from here.
        let started = distlock_core::clock::now();
        let session = self.queue_session(acq, request).await?;
        if acq.permit.is_some() {
            return self.try_permit(&session, acq, request, started).await;
        }
        if !self.take_turn(&session, acq, &request.owner).await? {
            return Ok(Attempt::Busy { retry_after: None });
        }
        if crate::rw::wants_name_record(acq) && acq.name_record.is_none() {
            // The read behind the granting listing got no answer: read it now (still after it).
            crate::rw::fetch_name_record(self.sessions().config(), &session, acq).await?;
        }
        self.grant(&session, acq, request, started)
            .map(Attempt::Acquired)
    }

    /// The session the acquire queues on: chosen at its first try, and failing the acquire once it is
    /// gone (the queue position went with it).
    pub(crate) async fn queue_session(
        &self,
        acq: &mut ZkAcquisition,
        request: &AcquireRequest,
    ) -> Result<Arc<Session>, ZkError> {
        match &acq.session {
            Some(session) if session.is_gone() => Err(session_lost(session)),
            Some(session) => Ok(session.clone()),
            None => {
                let session = self.sessions().for_lease(request.lease).await?;
                acq.session = Some(session.clone());
                Ok(session)
            }
        }
    }

    /// One turn in the queue: creates the own node if there is none, reads the children and says
    /// whether the node holds (`true`) or must wait for `acq.predecessor` (`false`).
    pub(crate) async fn take_turn(
        &self,
        session: &Arc<Session>,
        acq: &mut ZkAcquisition,
        owner: &str,
    ) -> Result<bool, ZkError> {
        let config = self.sessions().config();
        for _ in 0..=MAX_RECREATES {
            // A reader's record is read with the listing that grants it, never an earlier one.
            acq.name_record = None;
            let listed = if acq.node.is_none() {
                self.create_node(session, acq, owner).await?
            } else {
                None
            };
            let Some(own) = acq.node.clone() else {
                continue;
            };
            let client = &session.client;
            let children = match listed {
                Some(children) => children,
                None => match crate::rw::list_children(config, client, acq).await {
                    Ok(children) => children,
                    Err(ZkError::Request {
                        source: zk::Error::NoNode,
                        ..
                    }) => Vec::new(),
                    Err(e) => return Err(e),
                },
            };
            if acq.refuses_semaphore && acq.semaphore_checked_for != acq.czxid {
                // Names are one kind: a semaphore's lease nodes under the path refuse this acquire.
                // Once per own node, after its create: a permit taken later sees this node.
                self.refuse_beside_permits(session, &acq.path, &children)
                    .await?;
                acq.semaphore_checked_for = acq.czxid;
            }
            // Only lock nodes contend: a nested lock's container under this path is no holder.
            let mut sorted = layout::contenders(children);
            self.drop_duplicates(session, acq, &own, &mut sorted).await;
            match layout::standing(&sorted, &own) {
                Ok(None) => return Ok(true),
                Ok(Some(predecessor)) => {
                    acq.predecessor = Some(predecessor.to_string());
                    return Ok(false);
                }
                Err(()) if session.is_gone() => return Err(session_lost(session)),
                Err(()) => {
                    // Deleted under us (an operator, or the parent reaped and recreated): queue again,
                    // as Curator does on its "Sequential path not found".
                    tracing::debug!(path = %acq.path, node = %own, "own node gone while queued; creating it again");
                    acq.node = None;
                }
            }
        }
        Err(ZkError::SessionLost(format!(
            "the lock node under {} kept disappearing while this acquire queued (deleted by someone else?)",
            acq.path
        )))
    }

    pub(crate) fn grant(
        &self,
        session: &Arc<Session>,
        acq: &ZkAcquisition,
        request: &AcquireRequest,
        started: distlock_core::clock::Instant,
    ) -> Result<Grant<ZkLease>, ZkError> {
        let node = layout::join(&acq.path, acq.node.as_deref().unwrap_or_default());
        // Counted from the attempt's start, which is not earlier than the core's send time: the core's
        // deadline stays within what the proven leader touch allows (issue 10). (Counted from now, an
        // attempt longer than half the trust left was refused as arriving after its deadline.) The
        // touch keeper keeps the touch recent on an idle session, so none left means the server has
        // not reached the leader lately: the core abandons the node.
        let ttl = session
            .leader_ttl(request.lease.min(session.timeout), started)
            .ok_or_else(|| lease::unproven_touch(session))?;
        // The session's task watches the node from now on and reports a loss here (`held.rs`).
        let lost = LossReport::new();
        let held = ZkLease::new(session.clone(), node.into(), acq.czxid, ttl, &lost)
            .with_kind(request.kind);
        let loss = lost.signal();
        // A reader carries the last write grant's token (`rw.rs`); every other hold its node's czxid.
        let token = match request.kind {
            distlock_core::LockKind::Read => crate::rw::reader_token(acq),
            _ => acq.czxid,
        };
        // czxid is positive (zxids start above 0); a negative one would be a server bug.
        let token = FencingToken::new(u64::try_from(token).unwrap_or(0));
        Ok(Grant::new(held)
            .with_token(token)
            .with_ttl(ttl)
            .with_loss(loss))
    }

    /// Creates the own node in protected mode; on a lost reply, looks for it by its prefix before
    /// creating again. Creates missing parents as containers. The children are read in the same round
    /// trip (sent right behind the create on the session, so they include the new node) and returned
    /// when that read worked.
    pub(crate) async fn create_node(
        &self,
        session: &Session,
        acq: &mut ZkAcquisition,
        owner: &str,
    ) -> Result<Option<Vec<String>>, ZkError> {
        let config = self.sessions().config();
        let client = &session.client;
        let prefix = layout::node_prefix_of(&acq.path, &acq.protection, acq.marker);
        let deadline = tokio::time::Instant::now() + config.connection.request_timeout;
        let mut retries = config.connection.retry.start(Some(deadline));
        // After a `NoNode`: the lock path is created in the same round trip as the retried create.
        let mut parent_missing = false;
        let mut recreated = 0;
        loop {
            acq.create_sent = true;
            let sent_at = distlock_core::clock::now();
            let (parent, created, listed) = send_create(
                config,
                client,
                (&acq.path, &prefix, owner),
                parent_missing,
                crate::rw::wants_name_record(acq).then_some(&mut acq.name_record),
            )
            .await;
            let failure = match created {
                Ok((stat, sequence)) => {
                    // A write: answered through the leader.
                    session.leader_confirmed(sent_at);
                    acq.node = Some(format!(
                        "{}{sequence}",
                        layout::node_name_prefix_of(&acq.protection, acq.marker)
                    ));
                    acq.czxid = stat.czxid;
                    return Ok(listed);
                }
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => {
                    if let Err(source) = parent {
                        return Err(ZkError::Request {
                            action: "create of the lock path",
                            source,
                        });
                    }
                    recreated += 1;
                    if recreated > MAX_RECREATES {
                        return Err(ZkError::SessionLost(format!(
                            "the lock path {} kept disappearing while this acquire created its node (reaped or deleted by someone else?)",
                            acq.path
                        )));
                    }
                    parent_missing = true;
                    continue;
                }
                Err(e @ ZkError::Request { .. }) if !e.unanswered() => return Err(e),
                Err(e) => e,
            };
            // The reply was lost: the node may exist. Curator's findProtectedNodeInForeground.
            if self.find_own(session, acq).await?.is_some() {
                return Ok(None);
            }
            match retries.next_delay() {
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(failure),
            }
        }
    }

    /// Looks for the own node by its protection prefix; records it (and its czxid) when found.
    pub(crate) async fn find_own(
        &self,
        session: &Session,
        acq: &mut ZkAcquisition,
    ) -> Result<Option<String>, ZkError> {
        let config = self.sessions().config();
        let client = &session.client;
        let children =
            match retried(config, "getChildren", || client.list_children(&acq.path)).await {
                Ok(children) => children,
                Err(ZkError::Request {
                    source: zk::Error::NoNode,
                    ..
                }) => return Ok(None),
                Err(e) => return Err(e),
            };
        let Some(found) = layout::find_protected(&children, &acq.protection).map(str::to_string)
        else {
            return Ok(None);
        };
        let path = layout::join(&acq.path, &found);
        match retried(config, "exists", || client.check_stat(&path)).await? {
            Some(stat) => {
                acq.czxid = stat.czxid;
                acq.node = Some(found.clone());
                Ok(Some(found))
            }
            None => Ok(None),
        }
    }

    /// Waits until the predecessor is gone (or its watch fires for any reason: the next try checks).
    /// Fails when the session expires or stays disconnected past its timeout.
    pub(crate) async fn wait_zk(&self, acq: &mut ZkAcquisition) -> Result<(), ZkError> {
        let (Some(session), Some(predecessor)) = (acq.session.clone(), acq.predecessor.take())
        else {
            return Ok(());
        };
        let config = self.sessions().config();
        let path = layout::join(&acq.path, &predecessor);
        let watched = match once(
            config,
            "exists (watch)",
            session.client.check_and_watch_stat(&path),
        )
        .await
        {
            Ok(watched) => watched,
            Err(ZkError::Request { source, .. }) if session_gone(&source) => {
                return Err(session_lost(&session))
            }
            Err(e @ ZkError::Request { .. }) if !e.unanswered() => return Err(e),
            // A lost connection: look again after a pause (the next try re-reads the children).
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Ok(());
            }
        };
        let (stat, watcher) = watched;
        let Some(stat) = stat else {
            return Ok(());
        };
        crate::rw::saw(acq, &predecessor, &stat);
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

    /// Removes whatever the acquisition may have left: its node, or, when the create's reply was lost,
    /// every child with its protection prefix. A delete or look-up that gets no answer (connection down
    /// or silent; a queued create may yet be applied once the client reconnects) is finished in the
    /// background once the session is connected again (`cleanup`). A session already gone took its
    /// nodes with it.
    pub(crate) async fn abandon_zk(&self, mut acq: ZkAcquisition) {
        match acq.permit.take() {
            // A semaphore's: its lease node and its inner mutex node, together.
            Some(permit) => {
                tokio::join!(
                    self.abandon_node(&permit.lease),
                    self.abandon_node(&permit.inner)
                );
            }
            None => self.abandon_node(&acq).await,
        }
    }

    async fn abandon_node(&self, acq: &ZkAcquisition) {
        let Some(session) = acq.session.clone() else {
            return;
        };
        if !acq.create_sent || session.is_gone() {
            return;
        }
        let config = self.sessions().config();
        if let Some(node) = acq.node.as_deref() {
            let path = layout::join(&acq.path, node);
            if let Err(e) = lease::delete_node(config, &session, &path).await {
                tracing::warn!(%path, error = %e, "could not delete an abandoned lock node now; retried once reconnected, else it goes with its session");
            }
            return;
        }
        let leftover = Leftover::Protected {
            parent: acq.path.clone(),
            protection: acq.protection.clone(),
        };
        match cleanup::remove(config, &session, &leftover).await {
            Ok(()) => {}
            Err(e) if e.unanswered() => cleanup::remove_later(config, &session, leftover),
            Err(e) => {
                tracing::warn!(%leftover, error = %e, "could not look for an abandoned lock node; it goes with its session");
            }
        }
    }

    /// Deletes other children with this acquire's protection prefix than `own` (a create sent again
    /// after a lost reply, whose first try was applied after all) and drops them from `sorted`: this
    /// acquire must never queue behind its own leftover, which would hold the lock for nobody.
    pub(crate) async fn drop_duplicates(
        &self,
        session: &Arc<Session>,
        acq: &ZkAcquisition,
        own: &str,
        sorted: &mut Vec<String>,
    ) {
        let duplicates: Vec<String> = layout::protected_by(sorted, &acq.protection)
            .filter(|c| *c != own)
            .map(str::to_string)
            .collect();
        for duplicate in &duplicates {
            let path = layout::join(&acq.path, duplicate);
            tracing::debug!(%path, "deleting a duplicate of this acquire's lock node");
            if let Err(e) = lease::delete_node(self.sessions().config(), session, &path).await {
                tracing::warn!(%path, error = %e, "could not delete a duplicate lock node now; retried once reconnected");
            }
        }
        sorted.retain(|c| !duplicates.contains(c));
    }
}

/// What one pipelined create answered: the lock path's and its ancestors' creates (sent first when
/// `with_parents`; `Err` holds the first refusal other than `NodeExists`), the own node's create, and
/// the children read right behind it.
type CreateAnswers = (
    Result<(), zk::Error>,
    Result<(zk::Stat, zk::CreateSequence), ZkError>,
    Option<Vec<String>>,
);

/// Every ancestor of `path` and `path` itself, top down: `/a`, `/a/b`, `/a/b/c`.
pub(crate) fn ancestors(path: &str) -> Vec<&str> {
    path.match_indices('/')
        .skip(1)
        .map(|(i, _)| &path[..i])
        .chain(std::iter::once(path))
        .collect()
}

/// Sends, in one round trip (the client writes requests in call order, the session answers them in
/// order): when `with_parents`, a container create of each level of the lock path, top down; the own
/// node's create; a `getChildren` of the lock path. Bounded by the request timeout.
async fn send_create(
    config: &crate::config::ZkConfig,
    client: &zk::Client,
    (path, prefix, owner): (&str, &str, &str),
    with_parents: bool,
    name_record: Option<&mut Option<(Vec<u8>, i64)>>,
) -> CreateAnswers {
    let containers = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
    let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let parents: Vec<_> = if with_parents {
        ancestors(path)
            .into_iter()
            .map(|p| client.create(p, b"", &containers))
            .collect()
    } else {
        Vec::new()
    };
    let create = client.create(prefix, owner.as_bytes(), &options);
    let list = client.list_children(path);
    // A reader's: the name node's data and czxid, read right behind the children (`rw.rs`).
    let record = name_record.is_some().then(|| client.get_data(path));
    let all = async {
        let mut parent = Ok(());
        for answer in futures_util::future::join_all(parents).await {
            match answer {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                Err(e) => {
                    if parent.is_ok() {
                        parent = Err(e);
                    }
                }
            }
        }
        let (created, listed) = tokio::join!(create, list);
        let record = match record {
            Some(record) => record.await.ok(),
            None => None,
        };
        (parent, created, listed, record)
    };
    match tokio::time::timeout(config.connection.request_timeout, all).await {
        Ok((parent, created, listed, record)) => {
            if let (Some(slot), Some((data, stat))) = (name_record, record) {
                *slot = Some((data, stat.czxid));
            }
            (
                parent,
                created.map_err(|source| ZkError::Request {
                    action: "create",
                    source,
                }),
                listed.ok(),
            )
        }
        Err(_) => (
            Ok(()),
            Err(ZkError::Timeout {
                action: "create",
                after: config.connection.request_timeout,
            }),
            None,
        ),
    }
}

/// Resolves when the session is gone for good, or has been disconnected longer than its timeout
/// (the server has expired it by then; the client learns it only on reconnecting).
pub(crate) async fn session_ends(session: &Session) -> ZkError {
    let mut watcher = session.client.state_watcher();
    let mut state = session.client.state();
    loop {
        if state_is_terminal(state) {
            return session_lost(session);
        }
        if state == zk::SessionState::Disconnected {
            tokio::select! {
                next = watcher.changed() => state = next,
                // On the boot clock: the server's expiry counts time this machine spent suspended.
                () = distlock_core::clock::sleep(session.timeout) => {
                    return ZkError::SessionLost(format!(
                        "the ZooKeeper {} was disconnected longer than its timeout: the server has expired it, and this acquire's queue position with it",
                        session.describe()
                    ));
                }
            }
        } else {
            state = watcher.changed().await;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ancestors_are_listed_top_down() {
        assert_eq!(super::ancestors("/a"), ["/a"]);
        assert_eq!(super::ancestors("/a/b/c"), ["/a", "/a/b", "/a/b/c"]);
    }
}
