//! Helpers shared by the etcd test binaries: lock names, the keys as `etcdctl` sees them, the
//! server's metrics, and backends (directly or through fault-injecting proxies).
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_etcd::rpc::pb::etcdserverpb::RangeRequest;
use distlock_etcd::rpc::Client;
use distlock_etcd::{EtcdBackend, EtcdConfig};
use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::proxy::Proxy;

/// A unique lock name for one test case.
pub fn name(case: &str) -> String {
    format!(
        "etcd-test/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// One key under a prefix as `etcdctl get --prefix P -w fields` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFields {
    pub key: String,
    pub create_revision: u64,
    /// The lease the key hangs on (decimal, as etcdctl prints it).
    pub lease: i64,
}

/// Every key under `prefix`, as etcdctl sees it (`-w fields`: one `"Field" : value` line per field),
/// oldest first (the holder, then the waiters in queue order).
pub fn keys(endpoints: &str, prefix: &str) -> Vec<KeyFields> {
    let out =
        distlock_testkit::etcd::etcdctl(endpoints, &["get", "--prefix", prefix, "-w", "fields"])
            .expect("etcdctl get");
    let mut keys: Vec<KeyFields> = Vec::new();
    for line in out.lines() {
        let Some((field, value)) = line.split_once(" : ") else {
            continue;
        };
        let value = value.trim().trim_matches('"');
        match field.trim_matches('"') {
            "Key" => keys.push(KeyFields {
                key: value.to_string(),
                create_revision: 0,
                lease: 0,
            }),
            "CreateRevision" => {
                keys.last_mut().expect("Key first").create_revision = value.parse().unwrap()
            }
            "Lease" => keys.last_mut().expect("Key first").lease = value.parse().unwrap(),
            _ => {}
        }
    }
    // etcdctl lists keys in key order; the queue order is creation order.
    keys.sort_by_key(|k| k.create_revision);
    keys
}

/// Polls `keys(prefix)` until `pred` holds; panics after `within` with what it last saw.
pub fn wait_keys(
    endpoints: &str,
    prefix: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&[KeyFields]) -> bool,
) -> Vec<KeyFields> {
    let started = Instant::now();
    loop {
        let seen = keys(endpoints, prefix);
        if pred(&seen) {
            return seen;
        }
        assert!(
            started.elapsed() < within,
            "{what}: not within {within:?}; keys {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// etcd's `/metrics` page.
pub async fn metrics(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    body
}

/// A gauge from etcd's `/metrics`: `etcd_debugging_mvcc_watcher_total` (watches on the server) or
/// `etcd_debugging_mvcc_slow_watcher_total` (those served by its 100 ms catch-up loop: "unsynced").
pub async fn watch_gauge(addr: std::net::SocketAddr, gauge: &str) -> u64 {
    metrics(addr)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(gauge)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A new backend for `url`: its own sessions, another process as far as the server can tell.
pub async fn backend(url: &str) -> EtcdBackend {
    EtcdBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect")
}

/// `Locks` on `backend` with the backend's default options.
pub fn locks_on(backend: &EtcdBackend) -> Locks {
    Locks::with_defaults(backend.clone(), backend.default_options())
}

/// `Locks` on a new backend for `url`.
pub async fn locks(url: &str) -> Locks {
    locks_on(&backend(url).await)
}

/// A read of a key nobody writes: its reply's header has the server's current revision, and sent
/// through a backend's client it shifts which member that client's next requests go to.
pub fn probe() -> RangeRequest {
    RangeRequest {
        key: b"x".to_vec(),
        ..Default::default()
    }
}

/// The server's current revision, read with `raw`.
pub async fn revision(raw: &Client) -> i64 {
    raw.range(probe()).await.unwrap().header.unwrap().revision
}

/// One etcd server reached through `proxies` (to delay, reset or refuse a backend's traffic), for the
/// fault tests. The proxies' controls block: call them from a multi-threaded runtime.
pub struct Proxied {
    /// Before `server`: dropped first, as a test's own proxy declared after its server was.
    pub proxies: Vec<Proxy>,
    pub server: EtcdServer,
}

impl Proxied {
    /// A new server with `proxies` proxies in front of it.
    pub fn start(proxies: usize) -> Self {
        let server = EtcdServer::start_or_panic();
        let proxies = (0..proxies)
            .map(|_| Proxy::start_or_panic(server.addr()))
            .collect();
        Proxied { proxies, server }
    }

    /// The first proxy.
    pub fn proxy(&self) -> &Proxy {
        &self.proxies[0]
    }

    /// A backend URL whose members are the proxies, then the server itself if `direct`, with
    /// `query` (`request_timeout=1s`).
    pub fn url(&self, direct: bool, query: &str) -> String {
        let mut members: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        if direct {
            members.push(self.server.addr().to_string());
        }
        format!("etcd://{}?{query}", members.join(","))
    }

    /// A new backend on [`Proxied::url`] and `Locks` on it.
    pub async fn connect(&self, direct: bool, query: &str) -> (EtcdBackend, Locks) {
        let backend = backend(&self.url(direct, query)).await;
        let locks = locks_on(&backend);
        (backend, locks)
    }

    /// A client straight to the server (an operator's reads and deletes).
    pub async fn raw(&self) -> Client {
        Client::connect(&EtcdConfig::new([self.server.endpoints()]))
            .await
            .unwrap()
    }

    /// Every proxy passes traffic.
    pub fn pass(&self) {
        tokio::task::block_in_place(|| {
            for proxy in &self.proxies {
                proxy.pass().unwrap();
            }
        });
    }

    /// Every proxy holds each chunk for `delay`, each way.
    pub fn delay(&self, delay: Duration) {
        tokio::task::block_in_place(|| {
            for proxy in &self.proxies {
                proxy.delay(delay).unwrap();
            }
        });
    }

    /// Every proxy refuses new connections.
    pub fn refuse(&self) {
        tokio::task::block_in_place(|| {
            for proxy in &self.proxies {
                proxy.refuse().unwrap();
            }
        });
    }

    /// The server stalls (paused) for `stall`, then goes on.
    pub async fn stall(&mut self, stall: Duration) {
        tokio::task::block_in_place(|| self.server.pause().unwrap());
        tokio::time::sleep(stall).await;
        tokio::task::block_in_place(|| self.server.resume().unwrap());
    }
}
