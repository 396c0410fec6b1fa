//! Deletes that got no answer (the connection was down or silent), finished in the background.
//!
//! ZooKeeper's pings keep a session, and with it its ephemeral nodes, alive for as long as the process
//! runs. A lock node whose delete was lost on a silent connection, or whose create was still queued
//! behind a reconnect when its acquire gave up, would stay once the client reconnects within its
//! session: queued first, it holds the lock for nobody, and every other contender waits behind it until
//! the process exits. So a release, an abandon or an expiry whose delete got no answer hands the node
//! to the session's cleanup task (one per session, started when a first node is queued), which waits
//! until the session is connected again, deletes the queued nodes (or, when a create's reply was lost,
//! every child with the acquire's `_c_<uuid>` prefix), and ends once that worked or the session is
//! gone (expired, closed, or disconnected longer than its timeout: the server has expired it, and its
//! nodes with it).

use std::sync::Arc;
use std::time::Duration;

use zookeeper_client as zk;

use crate::acquire::session_ends;
use crate::config::ZkConfig;
use crate::error::{session_gone, ZkError};
use crate::layout;
use crate::request::once;
use crate::session::{lock, Session};

/// What is left to remove.
#[derive(Debug, Clone)]
pub(crate) enum Leftover {
    /// A lock node, by its full path.
    Node(String),
    /// Every child of the lock path `parent` created with the protection id `protection` (the create's
    /// reply was lost, so its name is unknown; a create sent again may have left two).
    Protected { parent: String, protection: String },
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leftover::Node(path) => f.write_str(path),
            Leftover::Protected { parent, protection } => {
                write!(f, "{}*", layout::node_prefix(parent, protection))
            }
        }
    }
}

/// Removes `leftover` once: `Ok` when it is gone (or the session is, with its nodes).
pub(crate) async fn remove(
    config: &ZkConfig,
    session: &Session,
    leftover: &Leftover,
) -> Result<(), ZkError> {
    match leftover {
        Leftover::Node(path) => delete(config, session, path).await,
        Leftover::Protected { parent, protection } => {
            let children =
                match once(config, "getChildren", session.client.list_children(parent)).await {
                    Ok(children) => children,
                    Err(ZkError::Request { source, .. })
                        if source == zk::Error::NoNode || session_gone(&source) =>
                    {
                        return Ok(())
                    }
                    Err(e) => return Err(e),
                };
            for child in layout::protected_by(&children, protection) {
                delete(config, session, &layout::join(parent, child)).await?;
            }
            Ok(())
        }
    }
}

async fn delete(config: &ZkConfig, session: &Session, path: &str) -> Result<(), ZkError> {
    match once(config, "delete", session.client.delete(path, None)).await {
        Ok(()) => Ok(()),
        Err(ZkError::Request { source, .. })
            if source == zk::Error::NoNode || session_gone(&source) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The leftovers of one session waiting for it to be connected again, and whether its task is
/// draining them (one task per session, however many nodes a disconnect left).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    leftovers: Vec<Leftover>,
    draining: bool,
}

/// Queues `leftover` on its session, to be removed once the session is connected again (retrying while
/// requests get no answer) by the session's cleanup task, started on the current runtime when none
/// runs. The task ends when the queue is empty or the session is gone (with its nodes).
pub(crate) fn remove_later(config: &ZkConfig, session: &Arc<Session>, leftover: Leftover) {
    if session.is_gone() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(%leftover, "no tokio runtime to finish a delete on; the node goes with its session");
        return;
    };
    tracing::debug!(%leftover, session = %session.describe(), "delete got no answer; finishing it once reconnected");
    let mut pending = lock(&session.cleanup);
    pending.leftovers.push(leftover);
    if pending.draining {
        return;
    }
    pending.draining = true;
    drop(pending);
    let (config, session) = (config.clone(), session.clone());
    runtime.spawn(async move {
        tokio::select! {
            () = drain(&config, &session) => {}
            ended = session_ends(&session) => {
                tracing::debug!(reason = %ended, "session ended; its pending deletes went with it");
                let mut pending = lock(&session.cleanup);
                pending.leftovers.clear();
                pending.draining = false;
            }
        }
    });
}

/// Removes the session's queued leftovers, pipelined, each time the session is connected, until the
/// queue is empty.
async fn drain(config: &ZkConfig, session: &Session) {
    let mut backoff =
        distlock_core::retry::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let batch = {
            let mut pending = lock(&session.cleanup);
            if pending.leftovers.is_empty() {
                pending.draining = false;
                return;
            }
            std::mem::take(&mut pending.leftovers)
        };
        connected(session).await;
        let removals = batch.iter().map(|l| remove(config, session, l));
        let outcomes = futures_util::future::join_all(removals).await;
        let mut unanswered = Vec::new();
        for (leftover, outcome) in batch.into_iter().zip(outcomes) {
            match outcome {
                Ok(()) => tracing::debug!(%leftover, "finished an unanswered delete"),
                Err(e) if e.unanswered() => unanswered.push(leftover),
                Err(e) => {
                    tracing::warn!(%leftover, error = %e, "could not delete a lock node; it goes with its session");
                }
            }
        }
        if unanswered.is_empty() {
            backoff.reset();
        } else {
            lock(&session.cleanup).leftovers.extend(unanswered);
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }
}

/// Resolves once the session is connected (pending forever once it ended: `session_ends` covers that).
async fn connected(session: &Session) {
    let mut watcher = session.client.state_watcher();
    let mut state = session.client.state();
    while !matches!(
        state,
        zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly
    ) {
        state = watcher.changed().await;
    }
}
