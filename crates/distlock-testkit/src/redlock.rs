//! N independent `redis-server` processes for Redlock: no replication between them, each on its own
//! reserved port and data dir, no persistence (so a restart loses the keys: the hazard Redlock's
//! analysis names). Faults are per node through [`RedlockNodes::node_mut`] (kill -9, restart, pause).

use std::net::SocketAddr;

use crate::error::Result;
use crate::proxy::Proxy;
use crate::redis::{RedisServer, RedisServerBuilder};

/// N independent Redis masters owned by a test; dropping it kills them all.
#[derive(Debug)]
pub struct RedlockNodes {
    nodes: Vec<RedisServer>,
}

impl RedlockNodes {
    /// Starts `n` plain servers (no persistence).
    pub fn start(n: usize) -> Result<Self> {
        Self::start_with(n, RedisServer::builder)
    }

    /// Starts `n` servers, each from the builder `builder` makes (extra arguments, TLS).
    pub fn start_with(n: usize, builder: impl Fn() -> RedisServerBuilder) -> Result<Self> {
        let nodes = (0..n)
            .map(|_| builder().start())
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { nodes })
    }

    /// [`start`](Self::start), panicking with the error (and log tail). For tests.
    pub fn start_or_panic(n: usize) -> Self {
        match Self::start(n) {
            Ok(nodes) => nodes,
            Err(e) => panic!("starting {n} redis-server processes for Redlock failed: {e}"),
        }
    }

    /// `redlock://127.0.0.1:p1,127.0.0.1:p2,…`.
    pub fn url(&self) -> String {
        url_of(self.addrs())
    }

    /// The nodes' addresses, in order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// Node `i`.
    ///
    /// # Panics
    /// If `i` is out of range.
    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// Node `i`, for faults (kill -9, restart, pause).
    ///
    /// # Panics
    /// If `i` is out of range.
    pub fn node_mut(&mut self, i: usize) -> &mut RedisServer {
        &mut self.nodes[i]
    }

    /// One fault proxy in front of each node, in node order: a client that reaches the nodes through
    /// them (`url_of(proxies.iter().map(Proxy::addr))`) can be cut, delayed or refused alone.
    ///
    /// # Panics
    /// If a proxy cannot start (as [`Proxy::start_or_panic`]).
    pub fn proxies(&self) -> Vec<Proxy> {
        self.addrs()
            .into_iter()
            .map(Proxy::start_or_panic)
            .collect()
    }

    /// Every node.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// `redlock://a1,a2,…` for any addresses (nodes reached through proxies, for instance).
pub fn url_of(addrs: impl IntoIterator<Item = SocketAddr>) -> String {
    let hosts: Vec<String> = addrs.into_iter().map(|a| a.to_string()).collect();
    format!("redlock://{}", hosts.join(","))
}
