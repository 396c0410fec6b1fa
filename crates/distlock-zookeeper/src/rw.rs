//! The read-write lock: Curator's `InterProcessReadWriteLock` on the mutex's machinery (`acquire.rs`
//! queues the `__READ__`/`__WRIT__` node as it queues a mutex's `lock-` node; `layout::standing` says
//! where each stands), and what differs:
//!
//! * **the reader's token**, the last write grant's: the name node's data holds the token of the last
//!   write that ended by a release or a downgrade (set in the same `multi` as the writer's node is
//!   deleted: [`delete_recording`]); a reader reads it right behind the listing that grants it
//!   (pipelined on the session, so it reflects every write released before that listing) and carries
//!   `layout::reader_token`: the newest of the record, the writer nodes it queued behind ([`saw`]:
//!   Curator's writers record nothing) and the name node's `czxid`;
//! * **the downgrade** ([`ZkBackend::downgrade_zk`]): one `multi` creates the plain ephemeral
//!   `_c_<uuid>-__READ__<writer's seq>` node (Curator 5.5's CURATOR-621 node, sorting in the writer's
//!   place), deletes the writer's node and records its token, so no writer gets in between.

use std::sync::Arc;

use distlock_core::raw::{AcquireRequest, Grant, LossReport};
use distlock_core::{FencingToken, LockKind};
use zookeeper_client as zk;

use crate::acquire::ZkAcquisition;
use crate::backend::ZkBackend;
use crate::cleanup::{self, Leftover};
use crate::config::ZkConfig;
use crate::error::{retryable, session_gone, ZkError};
use crate::layout;
use crate::lease::{self, ZkLease};
use crate::request::retried;
use crate::session::Session;

/// What a write release sets in the same `multi` as its delete: the name node's data, the writer's
/// token (`layout::write_record`).
#[derive(Debug)]
pub(crate) struct WriteRecord {
    name: String,
    data: [u8; 8],
}

/// The record a release of `held` sets: a write hold's token; nothing for any other hold.
pub(crate) fn release_record(held: &ZkLease) -> Option<WriteRecord> {
    (held.kind == LockKind::Write).then(|| WriteRecord::of(&held.node, held.czxid))
}

impl WriteRecord {
    /// The record that ends the write hold of `node` (its full path), whose czxid is `czxid`: a
    /// release's, or an operator's break (`backend.rs`), which records the broken writer's token as
    /// its release would.
    pub(crate) fn of(node: &str, czxid: i64) -> WriteRecord {
        WriteRecord {
            name: parent_of(node).to_string(),
            data: layout::write_record(czxid),
        }
    }
}

/// The parent of a node's path (`/a/b/_c_…` → `/a/b`).
fn parent_of(node: &str) -> &str {
    match node.rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((parent, _)) => parent,
    }
}

/// Deletes `path` (at data `version`, any with `None`), and with a `record` sets it in the same
/// `multi` (so it is set exactly when this call deletes the node: a resend after a lost reply finds
/// the node gone and sets nothing, and no later writer's record is overwritten). When an operator's
/// ACL on the name node lets this client delete its node but not write the name node, the delete is
/// sent alone: a record is worth less than a release.
pub(crate) async fn delete_recording(
    client: &zk::Client,
    path: &str,
    version: Option<i32>,
    record: Option<&WriteRecord>,
) -> Result<(), zk::Error> {
    let Some(record) = record else {
        return client.delete(path, version).await;
    };
    let mut multi = client.new_multi_writer();
    multi.add_set_data(&record.name, &record.data, None)?;
    multi.add_delete(path, version)?;
    match multi.commit().await {
        Ok(_) => Ok(()),
        Err(zk::MultiWriteError::OperationFailed {
            index: 0,
            source: zk::Error::NoAuth,
        }) => client.delete(path, version).await,
        Err(e) => Err(e.into()),
    }
}

/// Whether the acquire is a reader's, which reads the name node's record with its listings.
pub(crate) fn wants_name_record(acq: &ZkAcquisition) -> bool {
    acq.marker == layout::READ_NAME
}

/// The lock path's children; for a reader, with the name node's data and czxid read right behind
/// them (sent after the listing on the session, so answered after it) into `acq.name_record`. A
/// record that got no answer is left out: the grant reads it then ([`fetch_name_record`]).
pub(crate) async fn list_children(
    config: &ZkConfig,
    client: &zk::Client,
    acq: &mut ZkAcquisition,
) -> Result<Vec<String>, ZkError> {
    let path = acq.path().to_string();
    if !wants_name_record(acq) {
        return retried(config, "getChildren", || client.list_children(&path)).await;
    }
    let list = client.list_children(&path);
    let data = client.get_data(&path);
    let both = async { tokio::join!(list, data) };
    match tokio::time::timeout(config.connection.request_timeout, both).await {
        Ok((Ok(children), data)) => {
            acq.name_record = data.ok().map(|(data, stat)| (data, stat.czxid));
            Ok(children)
        }
        Ok((Err(source), _)) if !retryable(&source) => Err(ZkError::Request {
            action: "getChildren",
            source,
        }),
        _ => retried(config, "getChildren", || client.list_children(&path)).await,
    }
}

/// Reads the name node's data and czxid into `acq.name_record` (after the granting listing).
pub(crate) async fn fetch_name_record(
    config: &ZkConfig,
    session: &Session,
    acq: &mut ZkAcquisition,
) -> Result<(), ZkError> {
    let path = acq.path().to_string();
    let (data, stat) = retried(config, "getData", || session.client.get_data(&path)).await?;
    acq.name_record = Some((data, stat.czxid));
    Ok(())
}

/// A reader waiting on `watched` (the first exclusive node before it) found it with `stat`: a writer
/// node's czxid counts toward the reader's token (a Curator writer records nothing on release).
pub(crate) fn saw(acq: &mut ZkAcquisition, watched: &str, stat: &zk::Stat) {
    if wants_name_record(acq) && layout::node_type(watched) == Some(layout::NodeType::Write) {
        acq.seen_write = acq.seen_write.max(stat.czxid);
    }
}

/// The token a granted reader carries (`layout::reader_token`).
pub(crate) fn reader_token(acq: &ZkAcquisition) -> i64 {
    let own = acq.node().map_or(0, |(_, czxid)| czxid);
    match &acq.name_record {
        Some((data, name_czxid)) => layout::reader_token(
            *name_czxid,
            layout::parse_write_record(data),
            own,
            acq.seen_write,
        ),
        None => acq.seen_write,
    }
}

impl ZkBackend {
    /// Turns the write hold `write` into a read hold in one `multi` (see the module docs). The read
    /// node lives on the write node's session. On an error nothing of the read node is left: a
    /// refused `multi` applied nothing, and one that got no answer is undone (the read node found by
    /// its `_c_<uuid>` and deleted, now or once the session is connected again).
    pub(crate) async fn downgrade_zk(
        &self,
        write: &ZkLease,
        read: &AcquireRequest,
    ) -> Result<Grant<ZkLease>, ZkError> {
        let started = distlock_core::clock::now();
        if write.kind != LockKind::Write {
            return Err(ZkError::Unsupported(format!(
                "only a write lock can be downgraded, not a {}",
                write.kind
            )));
        }
        let session = write.session.clone();
        if session.is_gone() {
            return Err(ZkError::SessionLost(format!(
                "the ZooKeeper {} of the write lock expired or closed: nothing to downgrade",
                session.describe()
            )));
        }
        let parent = parent_of(&write.node);
        let write_leaf = write
            .node
            .rsplit_once('/')
            .map_or(&*write.node, |(_, leaf)| leaf);
        let protection = uuid::Uuid::new_v4().to_string();
        let Some(read_leaf) = layout::downgrade_node_name(&protection, write_leaf) else {
            return Err(ZkError::Unsupported(format!(
                "the node {} is no writer's node: it cannot be downgraded",
                write.node
            )));
        };
        let read_node = layout::join(parent, &read_leaf);
        // The write hold ends in the multi: its watch must not report that delete as a loss (on an
        // error the core marks the guard Lost anyway).
        write.forget();
        let config = self.sessions().config();
        let sent_at = distlock_core::clock::now();
        let mut outcome = send_downgrade(config, &session, &read_node, write, read, true).await;
        if matches!(
            outcome,
            Err(zk::MultiWriteError::OperationFailed {
                index: 2,
                source: zk::Error::NoAuth
            })
        ) {
            // An operator's ACL on the name node: downgrade without the record.
            outcome = send_downgrade(config, &session, &read_node, write, read, false).await;
        }
        let created = match outcome {
            Ok(results) => results.into_iter().next(),
            Err(zk::MultiWriteError::RequestFailed { source })
            | Err(zk::MultiWriteError::OperationFailed { source, .. })
                if retryable(&source) && !session_gone(&source) =>
            {
                // May have been applied: the read node must not stay behind.
                let leftover = Leftover::Protected {
                    parent: parent.to_string(),
                    protection,
                };
                match cleanup::remove(config, &session, &leftover).await {
                    Ok(()) => {}
                    Err(e) if e.unanswered() => cleanup::remove_later(config, &session, leftover),
                    Err(e) => {
                        tracing::warn!(%leftover, error = %e, "could not look for a downgrade's read node; it goes with its session");
                    }
                }
                return Err(ZkError::Request {
                    action: "downgrade (create the read node, delete the write node)",
                    source,
                });
            }
            Err(zk::MultiWriteError::OperationFailed {
                index: 1,
                source: zk::Error::NoNode,
            }) => {
                return Err(ZkError::NotHeld(format!(
                    "the write lock's node {} was gone (its session expired, or an operator deleted it): nothing was downgraded",
                    write.node
                )))
            }
            Err(e) => {
                return Err(ZkError::Request {
                    action: "downgrade (create the read node, delete the write node)",
                    source: e.into(),
                })
            }
        };
        // A write: answered through the leader.
        session.leader_confirmed(sent_at);
        let czxid = match created {
            Some(zk::MultiWriteResult::Create { stat, .. }) if stat.czxid > 0 => stat.czxid,
            // ZOOKEEPER-4026: some servers answer a create in a multi without its stat.
            _ => match retried(config, "exists", || session.client.check_stat(&read_node)).await? {
                Some(stat) => stat.czxid,
                None => {
                    return Err(ZkError::SessionLost(format!(
                        "the read node {read_node} was gone right after the downgrade created it (deleted by someone else?)"
                    )))
                }
            },
        };
        let Some(ttl) = session.leader_ttl(read.lease.min(session.timeout), started) else {
            if let Err(e) = lease::delete_node(config, &session, &read_node).await {
                tracing::warn!(path = %read_node, error = %e, "could not delete a downgrade's read node now; retried once reconnected");
            }
            return Err(lease::unproven_touch(&session));
        };
        let lost = LossReport::new();
        let held = ZkLease::new(session.clone(), read_node.into(), czxid, ttl, &lost)
            .with_kind(LockKind::Read);
        let loss = lost.signal();
        Ok(Grant::new(held)
            .with_token(FencingToken::new(u64::try_from(write.czxid).unwrap_or(0)))
            .with_ttl(ttl)
            .with_loss(loss))
    }
}

/// One downgrade `multi`: create the read node (ephemeral, the owner id as data), delete the write
/// node, and with `record` set the write's token on the name node. Bounded by the request timeout.
async fn send_downgrade(
    config: &ZkConfig,
    session: &Arc<Session>,
    read_node: &str,
    write: &ZkLease,
    read: &AcquireRequest,
    record: bool,
) -> Result<Vec<zk::MultiWriteResult>, zk::MultiWriteError> {
    let ephemeral = zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
    let mut multi = session.client.new_multi_writer();
    multi.add_create(read_node, read.owner.as_bytes(), &ephemeral)?;
    multi.add_delete(&write.node, None)?;
    if record {
        multi.add_set_data(
            parent_of(&write.node),
            &layout::write_record(write.czxid),
            None,
        )?;
    }
    match tokio::time::timeout(config.connection.request_timeout, multi.commit()).await {
        Ok(outcome) => outcome,
        Err(_) => Err(zk::MultiWriteError::RequestFailed {
            source: zk::Error::Timeout,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::parent_of;

    #[test]
    fn parents_of_node_paths() {
        assert_eq!(parent_of("/a/b/_c_x-__WRIT__0000000001"), "/a/b");
        assert_eq!(parent_of("/a/_c_x"), "/a");
        assert_eq!(parent_of("/_c_x"), "/");
    }
}
