//! Inspect: every node's holder and pttl.

use distlock_core::raw::{HolderInfo, LockInfo, NodeInfo};
use distlock_core::Result;
use redis::Value;

use crate::redlock::backend::{text, RedlockBackend};
use crate::redlock::fanout::fan_out;
use crate::redlock::layout;
use crate::rpc::{int, pttl, server_error};

impl RedlockBackend {
    /// `GET` and `PTTL` of the key on every node at once. The holder is the owner whose key (one
    /// acquire's value, see [`layout::value`]) a quorum of nodes holds, with the Q-th longest of their
    /// pttls (how long that quorum lasts unrenewed) and that value as its `hold_id` (what a break
    /// compares, so that a later acquire of the same owner is never broken); a
    /// name held on fewer nodes shows as free, with the nodes' keys in [`LockInfo::nodes`]. A node whose
    /// key is not a string (a `redis://` lock of the same name) shows a `WRONGTYPE` error saying so.
    pub(crate) async fn inspect_nodes(&self, name: &str) -> Result<LockInfo> {
        let bound = self.config().connection.request_timeout;
        let key = layout::lock_key(name).to_string();
        let replies = fan_out(self.nodes(), |node| {
            let key = key.clone();
            async move {
                node.run("Redlock inspect", bound, |mut c| {
                    let mut pipe = redis::pipe();
                    pipe.cmd("GET")
                        .arg(&key)
                        .cmd("PTTL")
                        .arg(&key)
                        .ignore_errors();
                    async move { pipe.query_async::<Vec<Value>>(&mut c).await }
                })
                .await
            }
        })
        .all(self.nodes().len())
        .await;
        let mut info = LockInfo::default();
        // Each node's value as it is: one acquire's keys are the ones with one value.
        let mut node_values = Vec::with_capacity(replies.len());
        for (node, reply) in self.nodes().iter().zip(replies) {
            let mut value = None;
            let mut shown = NodeInfo::new(node.shown());
            match reply {
                Some(Ok(values)) => match values.first().and_then(server_error) {
                    Some(e) if e.code() == Some("WRONGTYPE") => {
                        shown.error = Some(
                            "WRONGTYPE: the key is not a Redlock string (a redis:// lock, Redisson's hash, or other data uses this name)"
                                .into(),
                        );
                    }
                    Some(e) => shown.error = Some(e.to_string()),
                    None => {
                        value = values.first().and_then(text);
                        shown.owner = value.as_deref().map(|v| layout::owner_of(v).to_string());
                        shown.remaining_lease = values.get(1).and_then(int).and_then(pttl);
                    }
                },
                Some(Err(e)) => shown.error = Some(e.to_string()),
                None => shown.error = Some("no reply".into()),
            }
            info.nodes.push(shown);
            node_values.push(value);
        }
        info.holder = quorum_holder(&info.nodes, &node_values, self.config().quorum());
        Ok(info)
    }
}

/// The holder whose value (`values[i]` is node `i`'s) a quorum of nodes holds, shown by its owner id,
/// with the whole value as its `hold_id`.
fn quorum_holder(
    nodes: &[NodeInfo],
    values: &[Option<String>],
    quorum: usize,
) -> Option<HolderInfo> {
    for value in values.iter().flatten() {
        let mut pttls: Vec<_> = nodes
            .iter()
            .zip(values)
            .filter(|(_, v)| v.as_ref() == Some(value))
            .map(|(n, _)| n.remaining_lease)
            .collect();
        if pttls.len() >= quorum {
            pttls.sort_by(|a, b| b.cmp(a));
            let mut holder = HolderInfo::default();
            holder.owner = Some(layout::owner_of(value).to_string());
            // The hold itself (owner and nonce): what a break compares (see `layout::BREAK`).
            holder.hold_id = Some(value.clone());
            holder.remaining_lease = pttls.get(quorum - 1).copied().flatten();
            return Some(holder);
        }
    }
    None
}
