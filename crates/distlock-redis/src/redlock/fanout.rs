//! Parallel fan-out: one request per node, all sent at once and polled together in the caller's task
//! (no task per node: on a 2-worker runtime the hand-offs between tasks cost more than the requests;
//! see DESIGN §9, Redlock).
//!
//! A try that returns at a quorum keeps the others in its [`Replies`] (see `acquire::Stragglers`):
//! each request was sent when first polled, and its reply waits in the connection's driver until the
//! release (or undo) polls it to the end before it sends its own command, so a release never reaches a
//! node before that node's acquire. Dropping an unfinished `Replies` drops its requests, which replaces
//! their connections (a reply no one reads must not be taken for the next request's).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};

use crate::redlock::node::Node;

type Request<T> = Pin<Box<dyn Future<Output = (usize, T)> + Send + 'static>>;

/// The replies of a fan-out, in the order they arrive, each with its node's index.
pub(crate) struct Replies<T> {
    pending: FuturesUnordered<Request<T>>,
}

/// Sends `request` to every node at once (each is sent when the replies are first polled).
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
            Box::pin(async move { (i, reply.await) }) as Request<T>
        })
        .collect();
    Replies { pending }
}

impl<T: Send + 'static> Replies<T> {
    /// The next reply; `None` when every node has answered.
    pub(crate) async fn next(&mut self) -> Option<(usize, T)> {
        self.pending.next().await
    }

    /// Every reply still to come, in node order (`None` for nodes that answered before).
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
