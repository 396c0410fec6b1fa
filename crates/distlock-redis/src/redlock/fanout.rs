//! Parallel fan-out: one task per node, so a slow node never holds up the others, and a request the
//! caller stopped waiting for still completes (its reply is read, and the connection stays in order).

use std::future::Future;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::task::JoinHandle;

use crate::redlock::node::Node;

/// The replies of a fan-out, in the order they arrive, each with its node's index.
pub(crate) struct Replies<T> {
    pending: FuturesUnordered<JoinHandle<(usize, T)>>,
}

/// Sends `request` to every node at once, each in its own task.
pub(crate) fn fan_out<T, F, Fut>(nodes: &[Arc<Node>], request: F) -> Replies<T>
where
    T: Send + 'static,
    F: Fn(Arc<Node>) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let pending = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let reply = request(node.clone());
            tokio::spawn(async move { (i, reply.await) })
        })
        .collect();
    Replies { pending }
}

impl<T: Send + 'static> Replies<T> {
    /// The next reply; `None` when every node has answered. A task that panicked counts as no reply.
    pub(crate) async fn next(&mut self) -> Option<(usize, T)> {
        loop {
            match self.pending.next().await? {
                Ok(reply) => return Some(reply),
                Err(e) => {
                    tracing::warn!(error = %e, "a Redlock node request task failed");
                    continue;
                }
            }
        }
    }

    /// Every reply still to come, in node order.
    pub(crate) async fn all(mut self, nodes: usize) -> Vec<Option<T>> {
        let mut out: Vec<Option<T>> = (0..nodes).map(|_| None).collect();
        while let Some((i, reply)) = self.next().await {
            if let Some(slot) = out.get_mut(i) {
                *slot = Some(reply);
            }
        }
        out
    }

    /// How many replies are still to come.
    pub(crate) fn outstanding(&self) -> usize {
        self.pending.len()
    }
}
