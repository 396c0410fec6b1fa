//! Shared by the Sentinel and Cluster test binaries: a per-client partition that works on any topology,
//! and a topology shared by the cases of one test binary.
//!
//! # The cut: one ACL user per client
//!
//! Clients of Sentinel and Cluster connect to the addresses the servers hand back, so a TCP proxy in front
//! of one address cannot isolate one client. Instead every [`distlock_testkit::conformance::Client`] gets
//! its own ACL user (`ACL SETUSER c<n> on >pw ~* &* +@all`) on every data node it may reach (the master
//! and the replica, which may be promoted; all six Cluster nodes); ACLs are not replicated, so each node
//! is told. The cut is `ACL SETUSER c<n> off` and `CLIENT KILL USER c<n>` on every node: the client's
//! connections close, its reconnects are refused (`WRONGPASS`), its renewals fail, while every other
//! client goes on untouched. The heal is `ACL SETUSER c<n> on`.
// Test support: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use distlock_testkit::conformance::CutFuture;
use distlock_testkit::redis::{RespConn, RespValue};

/// The password of every per-client user.
pub const PASSWORD: &str = "pw";

/// Runs `args` on every node (blocking, fresh connection each), and returns the replies.
fn on_every_node(nodes: &[SocketAddr], args: &[&str]) -> Vec<RespValue> {
    nodes
        .iter()
        .map(|addr| {
            let reply = RespConn::connect(*addr, Duration::from_secs(5))
                .and_then(|mut c| c.command(args))
                .unwrap_or_else(|e| panic!("{args:?} on {addr}: {e}"));
            assert!(!reply.is_error(), "{args:?} on {addr}: {reply}");
            reply
        })
        .collect()
}

async fn on_every_node_async(nodes: Arc<Vec<SocketAddr>>, args: Vec<String>) -> Vec<RespValue> {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        on_every_node(&nodes, &args)
    })
    .await
    .expect("ACL command task")
}

/// One client's ACL user on a set of nodes.
#[derive(Debug, Clone)]
pub struct AclUser {
    pub name: String,
    nodes: Arc<Vec<SocketAddr>>,
}

impl AclUser {
    /// Creates a fresh user `c<n>` (enabled, all keys, channels and commands) on every node.
    pub async fn create(nodes: &[SocketAddr]) -> AclUser {
        static NEXT: AtomicUsize = AtomicUsize::new(1);
        let name = format!("c{}", NEXT.fetch_add(1, Ordering::SeqCst));
        let nodes = Arc::new(nodes.to_vec());
        let password = format!(">{PASSWORD}");
        on_every_node_async(
            nodes.clone(),
            [
                "ACL", "SETUSER", &name, "reset", "on", &password, "~*", "&*", "+@all",
            ]
            .map(String::from)
            .to_vec(),
        )
        .await;
        AclUser { name, nodes }
    }

    /// `user:pw@`, to put after `scheme://`.
    pub fn credentials(&self) -> String {
        format!("{}:{PASSWORD}@", self.name)
    }

    /// The nodes (by address) that have at least one connection logged in as this user
    /// (`CLIENT LIST`, whose lines carry `user=<name>`; Redis 7.0 has no `CLIENT LIST USER`).
    pub async fn connected_nodes(&self) -> Vec<SocketAddr> {
        let replies =
            on_every_node_async(self.nodes.clone(), vec!["CLIENT".into(), "LIST".into()]).await;
        let field = format!("user={}", self.name);
        self.nodes
            .iter()
            .zip(replies)
            .filter(|(_, reply)| {
                reply
                    .as_str()
                    .is_some_and(|s| s.lines().any(|l| l.split(' ').any(|f| f == field)))
            })
            .map(|(addr, _)| *addr)
            .collect()
    }

    /// Disables the user and kills its connections on every node.
    pub async fn cut(&self) {
        on_every_node_async(
            self.nodes.clone(),
            vec![
                "ACL".into(),
                "SETUSER".into(),
                self.name.clone(),
                "off".into(),
            ],
        )
        .await;
        on_every_node_async(
            self.nodes.clone(),
            vec![
                "CLIENT".into(),
                "KILL".into(),
                "USER".into(),
                self.name.clone(),
            ],
        )
        .await;
    }

    /// Enables the user again on every node.
    pub async fn heal(&self) {
        on_every_node_async(
            self.nodes.clone(),
            vec![
                "ACL".into(),
                "SETUSER".into(),
                self.name.clone(),
                "on".into(),
            ],
        )
        .await;
    }

    /// The `cut` hook for a conformance `Client`.
    pub fn cut_hook(&self) -> impl Fn() -> CutFuture + Send + Sync + 'static {
        let user = self.clone();
        move || {
            let user = user.clone();
            Box::pin(async move { user.cut().await })
        }
    }

    /// The `heal` hook for a conformance `Client`.
    pub fn heal_hook(&self) -> impl Fn() -> CutFuture + Send + Sync + 'static {
        let user = self.clone();
        move || {
            let user = user.clone();
            Box::pin(async move { user.heal().await })
        }
    }
}

/// `scheme://rest` → `scheme://<credentials>rest`.
pub fn with_credentials(url: &str, credentials: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    format!("{scheme}://{credentials}{rest}")
}

/// A topology shared by every case of one test binary that runs while another holds it, started on
/// first use and dropped (its servers killed, its temp dirs removed) when the last case using it ends.
/// Under nextest each case is its own process, so each gets its own; under `cargo test` concurrent cases
/// share one.
pub struct Shared<T> {
    slot: Mutex<Weak<T>>,
}

impl<T: Send + Sync + 'static> Shared<T> {
    pub const fn new() -> Self {
        Self {
            slot: Mutex::new(Weak::new()),
        }
    }

    /// The live topology, or a new one from `start` (run on the blocking pool: it sleeps while polling).
    pub async fn get(&'static self, start: fn() -> T) -> Arc<T> {
        tokio::task::spawn_blocking(move || {
            let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = slot.upgrade() {
                return t;
            }
            let t = Arc::new(start());
            *slot = Arc::downgrade(&t);
            t
        })
        .await
        .expect("starting the topology")
    }
}

/// One client's fault proxies on a topology that hands out server addresses: a proxy in front of each of
/// `servers` and of each of `discovery`, every one of which rewrites, in what its upstream sends back,
/// each server's port (as `encode` writes it in a reply) to the port of this client's proxy in front of
/// that server. The client then reaches every server through proxies of its own only, so the suite's
/// delay and reset act on this client alone. Returns the server proxies (in the order of `servers`),
/// then the discovery proxies.
pub fn rewriting_proxies(
    servers: &[SocketAddr],
    discovery: &[SocketAddr],
    encode: fn(u16) -> Vec<u8>,
) -> Vec<Arc<distlock_testkit::proxy::Proxy>> {
    use distlock_testkit::proxy::Proxy;
    let proxies: Vec<Arc<Proxy>> = servers
        .iter()
        .chain(discovery)
        .map(|s| Arc::new(Proxy::start(*s).expect("proxy")))
        .collect();
    let rewrites: Vec<(Vec<u8>, Vec<u8>)> = servers
        .iter()
        .zip(&proxies)
        .map(|(s, p)| (encode(s.port()), encode(p.port())))
        .collect();
    for p in &proxies {
        p.set_rewrites(rewrites.clone());
    }
    proxies
}

/// A port as a RESP bulk string (`SENTINEL MASTERS` fields).
pub fn resp_bulk_port(port: u16) -> Vec<u8> {
    let digits = port.to_string();
    format!("${}\r\n{digits}\r\n", digits.len()).into_bytes()
}

/// A port as the tail of a RESP integer (`CLUSTER SLOTS`) or of a `MOVED`/`ASK` address:
/// `:<port>\r\n`.
pub fn resp_port_tail(port: u16) -> Vec<u8> {
    format!(":{port}\r\n").into_bytes()
}
