//! A 6-node Redis Cluster (3 masters, 3 replicas) on loopback (infra.md §3), `cluster-node-timeout`
//! [`NODE_TIMEOUT_MS`], so a master's kill -9 is repaired by its replica in ~2 s.
//!
//! The cluster is built by hand rather than with `redis-cli --cluster create` (which sleeps in 1 s
//! polls): `CLUSTER SET-CONFIG-EPOCH` per node, `CLUSTER ADDSLOTSRANGE` on the masters (0-5460,
//! 5461-10922, 10923-16383), `CLUSTER MEET` to node 0, and, once every node knows the others,
//! `CLUSTER REPLICATE` so node `3 + i` replicates node `i`. Ready when every node reports
//! `cluster_state:ok`, every node's `CLUSTER SLOTS` shows the same three ranges with a master and a
//! replica each, and every replica's link is up.
//!
//! Node indexes are fixed (`nodes()[i]`); roles change on failover, so ask [`RedisCluster::slot_owner`]
//! who serves a slot *now*.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::process::READY_TIMEOUT;
use crate::redis::{RedisServer, RespValue};
use crate::sentinel::{info_map, info_replication, poll_until};

/// `cluster-node-timeout`.
pub const NODE_TIMEOUT_MS: u64 = 1000;
/// Number of hash slots.
pub const SLOTS: u16 = 16384;
/// Masters (and replicas: one each).
pub const MASTERS: usize = 3;
/// Per-command timeout of the cluster's own queries.
const QUERY_TIMEOUT: Duration = Duration::from_millis(1000);
/// Log lines quoted in errors.
const LOG_LINES: usize = 20;
/// The initial slot ranges of masters 0, 1, 2.
const RANGES: [(u16, u16); MASTERS] = [(0, 5460), (5461, 10922), (10923, 16383)];

/// CRC16-XMODEM (polynomial 0x1021, init 0), the hash Redis Cluster uses for key slots.
pub fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash slot of `key`: CRC16 of the key, or of its `{hashtag}` (the bytes between the first `{`
/// and the first `}` after it, if non-empty), modulo 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS
}

/// Who serves a slot right now, as indexes into [`RedisCluster::nodes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotOwner {
    /// The master.
    pub master: usize,
    /// Its (healthy) replicas.
    pub replicas: Vec<usize>,
}

/// One `CLUSTER SLOTS` range: (start, end, ports of master then replicas).
type SlotRange = (u16, u16, Vec<u16>);

/// Six cluster nodes on loopback. Dropping it kills them all.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    ids: Vec<String>,
}

impl fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCluster")
            .field(
                "nodes",
                &self.nodes.iter().map(RedisServer::addr).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl RedisCluster {
    /// Starts 6 nodes on ports from [`crate::ports::reserve_with_bus`], joins them, and waits until
    /// the cluster is ok with every replica linked (~1-2 s on an idle machine).
    pub fn start() -> Result<RedisCluster> {
        let started = Instant::now();
        let timeout = NODE_TIMEOUT_MS.to_string();
        let nodes = (0..2 * MASTERS)
            .map(|_| {
                RedisServer::builder()
                    .with_cluster_bus()
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", "nodes.conf"])
                    .args(["--cluster-node-timeout", &timeout])
                    .args(["--repl-diskless-sync-delay", "0"])
                    // CLUSTER SLOTS lists a replica only once its gossiped replication offset is
                    // non-zero, and an idle master moves the offset only with its replica pings
                    // (every 10 s by default).
                    .args(["--repl-ping-replica-period", "1"])
                    .start()
            })
            .collect::<Result<Vec<_>>>()?;
        let mut cluster = RedisCluster {
            nodes,
            ids: Vec::new(),
        };
        cluster.create()?;
        cluster.wait_ready(READY_TIMEOUT)?;
        tracing::debug!(elapsed = ?started.elapsed(), cluster = ?cluster, "redis cluster ready");
        Ok(cluster)
    }

    /// [`start`](Self::start), panicking with the error (which carries log tails). For tests.
    pub fn start_or_panic() -> RedisCluster {
        match Self::start() {
            Ok(c) => c,
            Err(e) => panic!("starting the redis cluster failed: {e}"),
        }
    }

    fn create(&mut self) -> Result<()> {
        for (i, node) in self.nodes.iter().enumerate() {
            let id = node.command(&["CLUSTER", "MYID"])?;
            let id = id
                .as_str()
                .ok_or_else(|| Error::Protocol(format!("CLUSTER MYID answered {id}")))?;
            self.ids.push(id.to_owned());
            ok(node, &["CLUSTER", "SET-CONFIG-EPOCH", &(i + 1).to_string()])?;
        }
        for (node, (lo, hi)) in self.nodes.iter().zip(RANGES) {
            ok(
                node,
                &["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()],
            )?;
        }
        let first = &self.nodes[0];
        let (port, bus) = (first.port().to_string(), bus_port(first).to_string());
        for node in &self.nodes[1..] {
            ok(node, &["CLUSTER", "MEET", "127.0.0.1", &port, &bus])?;
        }
        self.poll("every node to know the other five", READY_TIMEOUT, || {
            for node in &self.nodes {
                let nodes = node
                    .command_timeout(&["CLUSTER", "NODES"], QUERY_TIMEOUT)
                    .map_err(|e| e.to_string())?;
                let text = nodes.as_str().unwrap_or_default();
                let known = text
                    .lines()
                    .filter(|l| !l.contains("handshake") && !l.contains("noaddr"))
                    .count();
                if known != self.nodes.len() {
                    return Err(format!("{} knows {known} nodes", node.addr()));
                }
            }
            Ok(())
        })?;
        for i in 0..MASTERS {
            ok(
                &self.nodes[MASTERS + i],
                &["CLUSTER", "REPLICATE", &self.ids[i]],
            )?;
        }
        Ok(())
    }

    fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.poll("the cluster to be ready", timeout, || {
            let first = self.check_ok()?;
            for (lo, hi, ports) in &first {
                if ports.len() != 2 {
                    return Err(format!("slots {lo}-{hi} served by {ports:?}, want 2 nodes"));
                }
            }
            for node in &self.nodes[MASTERS..] {
                let info = info_replication(node).map_err(|e| e.to_string())?;
                if info.get("master_link_status").map(String::as_str) != Some("up") {
                    return Err(format!("replica {} link not up", node.addr()));
                }
            }
            Ok(())
        })
    }

    /// Waits until every running node reports `cluster_state:ok` and all of them agree on a slot map
    /// that covers all 16384 slots with running masters. After a master's kill -9 this returns once
    /// its replica has taken over (the killed node is skipped; paused nodes are skipped too).
    pub fn wait_state_ok(&self, timeout: Duration) -> Result<()> {
        self.poll("cluster_state:ok", timeout, || self.check_ok().map(|_| ()))
    }

    /// One round of [`wait_state_ok`](Self::wait_state_ok); returns the agreed slot map.
    fn check_ok(&self) -> std::result::Result<Vec<SlotRange>, String> {
        let running: Vec<&RedisServer> = self
            .nodes
            .iter()
            .filter(|n| n.process().is_running())
            .collect();
        let running_ports: BTreeSet<u16> = running.iter().map(|n| n.port()).collect();
        let mut agreed: Option<Vec<SlotRange>> = None;
        for node in running {
            let info = node
                .command_timeout(&["CLUSTER", "INFO"], QUERY_TIMEOUT)
                .map_err(|e| e.to_string())?;
            let info = info_map(info.as_str().unwrap_or_default());
            if info.get("cluster_state").map(String::as_str) != Some("ok") {
                return Err(format!(
                    "{} reports cluster_state {:?}",
                    node.addr(),
                    info.get("cluster_state")
                ));
            }
            let map = slot_map(node).map_err(|e| e.to_string())?;
            let covered: u32 = map
                .iter()
                .map(|(lo, hi, _)| u32::from(*hi) - u32::from(*lo) + 1)
                .sum();
            if covered != u32::from(SLOTS) {
                return Err(format!("{} maps {covered} slots", node.addr()));
            }
            if let Some((lo, hi, _)) = map
                .iter()
                .find(|(_, _, ports)| ports.first().is_none_or(|p| !running_ports.contains(p)))
            {
                return Err(format!(
                    "{} names no running master for {lo}-{hi}",
                    node.addr()
                ));
            }
            let masters: Vec<(u16, u16, u16)> = map
                .iter()
                .map(|(lo, hi, p)| (*lo, *hi, p.first().copied().unwrap_or(0)))
                .collect();
            match &agreed {
                None => agreed = Some(map),
                Some(prev) => {
                    let prev_masters: Vec<(u16, u16, u16)> = prev
                        .iter()
                        .map(|(lo, hi, p)| (*lo, *hi, p.first().copied().unwrap_or(0)))
                        .collect();
                    if prev_masters != masters {
                        return Err(format!(
                            "nodes disagree on the slot map: {prev_masters:?} vs {masters:?} ({})",
                            node.addr()
                        ));
                    }
                }
            }
        }
        agreed.ok_or_else(|| "no node is running".to_owned())
    }

    /// The six nodes (fixed order: 0-2 started as masters, `3 + i` as the replica of `i`).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, i: usize) -> Option<&RedisServer> {
        self.nodes.get(i)
    }

    /// One node, mutably (kill9, restart, pause, resume).
    pub fn node_mut(&mut self, i: usize) -> Option<&mut RedisServer> {
        self.nodes.get_mut(i)
    }

    /// The cluster node ids, in node order.
    pub fn node_ids(&self) -> &[String] {
        &self.ids
    }

    /// The nodes' addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…` (all six nodes).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| n.addr().to_string()).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// Who serves `slot` now, per `CLUSTER SLOTS` of the first running node that answers.
    pub fn slot_owner(&self, slot: u16) -> Result<SlotOwner> {
        let mut last = Error::State("no cluster node is running".to_owned());
        for node in self.nodes.iter().filter(|n| n.process().is_running()) {
            match slot_map(node) {
                Ok(map) => {
                    let (_, _, ports) = map
                        .iter()
                        .find(|(lo, hi, _)| (*lo..=*hi).contains(&slot))
                        .ok_or_else(|| {
                            Error::State(format!("{} maps no node to slot {slot}", node.addr()))
                        })?;
                    let index = |port: &u16| {
                        self.nodes
                            .iter()
                            .position(|n| n.port() == *port)
                            .ok_or_else(|| {
                                Error::State(format!("slot {slot} served by unknown port {port}"))
                            })
                    };
                    let master = ports
                        .first()
                        .ok_or_else(|| Error::State(format!("slot {slot} has no master")))
                        .and_then(index)?;
                    let replicas = ports[1..].iter().map(index).collect::<Result<_>>()?;
                    return Ok(SlotOwner { master, replicas });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The master serving `slot` now.
    pub fn node_for_slot(&self, slot: u16) -> Result<&RedisServer> {
        let owner = self.slot_owner(slot)?;
        Ok(&self.nodes[owner.master])
    }

    /// The master serving `key`'s slot now.
    pub fn master_for_key(&self, key: &str) -> Result<&RedisServer> {
        self.node_for_slot(key_slot(key.as_bytes()))
    }

    /// The last `n` log lines of every node, labelled, for error messages.
    pub fn log_tails(&self, n: usize) -> String {
        let mut out = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            out.push_str(&format!(
                "--- node {i} {} ---\n{}\n",
                node.addr(),
                node.log_tail(n)
            ));
        }
        out
    }

    fn poll(
        &self,
        what: &str,
        timeout: Duration,
        check: impl FnMut() -> std::result::Result<(), String>,
    ) -> Result<()> {
        poll_until(timeout, check).map_err(|last| Error::Timeout {
            what: format!(
                "waiting for {what} (last: {last}); logs:\n{}",
                self.log_tails(LOG_LINES)
            ),
            after: timeout,
        })
    }
}

fn bus_port(node: &RedisServer) -> u16 {
    node.bus_port()
        .unwrap_or(node.port() + crate::ports::BUS_OFFSET)
}

/// Runs a command that must answer `+OK`.
fn ok(node: &RedisServer, args: &[&str]) -> Result<()> {
    match node.command(args)? {
        RespValue::Simple(s) if s == "OK" => Ok(()),
        other => Err(Error::Protocol(format!(
            "`{}` on {} answered {other}",
            args.join(" "),
            node.addr()
        ))),
    }
}

/// `CLUSTER SLOTS` of one node, sorted by range start.
fn slot_map(node: &RedisServer) -> Result<Vec<SlotRange>> {
    let reply = node.command_timeout(&["CLUSTER", "SLOTS"], QUERY_TIMEOUT)?;
    let bad = || Error::Protocol(format!("CLUSTER SLOTS on {} answered {reply}", node.addr()));
    let RespValue::Array(ranges) = &reply else {
        return Err(bad());
    };
    let mut map = Vec::with_capacity(ranges.len());
    for range in ranges {
        let RespValue::Array(items) = range else {
            return Err(bad());
        };
        let int = |v: Option<&RespValue>| {
            v.and_then(RespValue::as_int)
                .and_then(|i| u16::try_from(i).ok())
        };
        let (Some(lo), Some(hi)) = (int(items.first()), int(items.get(1))) else {
            return Err(bad());
        };
        let ports = items[2..]
            .iter()
            .map(|n| match n {
                RespValue::Array(f) => int(f.get(1)),
                _ => None,
            })
            .collect::<Option<Vec<u16>>>()
            .ok_or_else(bad)?;
        map.push((lo, hi, ports));
    }
    map.sort();
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_the_published_check_value() {
        // CRC-16/XMODEM check value, also the one in the Redis Cluster spec.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16(b""), 0);
    }

    #[test]
    fn key_slots_follow_the_hashtag_rule() {
        // Examples from the CLUSTER KEYSLOT documentation.
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"foo{hash_tag}"), 2515);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // Empty tag: the whole key is hashed.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        // Only the first `{` and the first `}` after it count.
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        // No closing brace: the whole key.
        assert_eq!(key_slot(b"foo{bar"), crc16(b"foo{bar") % SLOTS);
    }
}
