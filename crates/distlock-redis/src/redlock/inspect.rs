//! Inspect: every node's holder and pttl.

use distlock_core::raw::{HolderInfo, LockInfo, NodeInfo};
use distlock_core::Result;
use redis::Value;

use crate::redlock::backend::{text, RedlockBackend};
use crate::redlock::fanout::fan_out;
use crate::redlock::layout;
use crate::rpc::{int, pttl, server_error};

impl RedlockBackend {
    /// `GET` and `PTTL` of the key on every node at once. The holder is the owner whose key a quorum of
    /// nodes holds, with the Q-th longest of their pttls (how long that quorum lasts unrenewed); a
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
        for (node, reply) in self.nodes().iter().zip(replies) {
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
                        shown.owner = values.first().and_then(text);
                        shown.remaining_lease = values.get(1).and_then(int).and_then(pttl);
                    }
                },
                Some(Err(e)) => shown.error = Some(e.to_string()),
                None => shown.error = Some("no reply".into()),
            }
            info.nodes.push(shown);
        }
        info.holder = quorum_holder(&info.nodes, self.config().quorum());
        Ok(info)
    }
}

fn quorum_holder(nodes: &[NodeInfo], quorum: usize) -> Option<HolderInfo> {
    let owners = nodes.iter().filter_map(|n| n.owner.as_ref());
    for owner in owners {
        let mut pttls: Vec<_> = nodes
            .iter()
            .filter(|n| n.owner.as_ref() == Some(owner))
            .map(|n| n.remaining_lease)
            .collect();
        if pttls.len() >= quorum {
            pttls.sort_by(|a, b| b.cmp(a));
            let mut holder = HolderInfo::default();
            holder.owner = Some(owner.clone());
            holder.remaining_lease = pttls.get(quorum - 1).copied().flatten();
            return Some(holder);
        }
    }
    None
}
