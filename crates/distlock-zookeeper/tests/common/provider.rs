//! The conformance suite's provider for ZooKeeper, on a standalone server (`conformance.rs`) or an
//! ensemble (`conformance_ensemble.rs`). Each client is its own `ZkBackend` (its own sessions) reaching
//! one server (members in turn) through a testkit fault `Proxy` of its own, so the suite's cut is a real
//! partition: `blackhole` drops that client's bytes (pings go unanswered, the server expires its
//! sessions, other clients take over), and heal passes bytes again and resets the connections so the
//! client reconnects (and learns its session expired).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::proxy::Proxy;
use distlock_zookeeper::ZkBackend;

pub struct Zk<S> {
    /// The server or ensemble, kept running as long as the provider.
    _servers: S,
    /// The client ports the clients' proxies lead to, one per client in turn.
    addrs: Vec<SocketAddr>,
    url: String,
    next: AtomicUsize,
    /// Every client's proxy, kept as long as the provider (a client's sessions may outlive it).
    proxies: Mutex<Vec<Arc<Proxy>>>,
}

impl<S: Send + Sync> Zk<S> {
    /// A provider on `servers` (reached at `addrs`, whose URL is `url`), warmed up.
    pub async fn start(servers: S, addrs: Vec<SocketAddr>, url: String) -> Self {
        warm_up(&url).await;
        Zk {
            _servers: servers,
            addrs,
            url,
            next: AtomicUsize::new(0),
            proxies: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait::async_trait]
impl<S: Send + Sync + 'static> Provider for Zk<S> {
    async fn client(&self) -> Client {
        let member = self.next.fetch_add(1, Ordering::Relaxed) % self.addrs.len();
        let proxy = Arc::new(Proxy::start(self.addrs[member]).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = LockUrl::parse(&format!("zk://{}", proxy.addr())).expect("url");
        let backend = ZkBackend::connect(&url).await.expect("connect");
        // The suite's kinds section runs the read-write lock (with its downgrade) and the semaphore only
        // where they are announced (else it checks their refusal): ZooKeeper has all three.
        let kinds = distlock_core::raw::Backend::capabilities(&backend).kinds;
        assert!(
            kinds.read_write && kinds.atomic_downgrade && kinds.semaphore,
            "the ZooKeeper backend announces {kinds:?}"
        );
        // A lease picks its session, and a new session costs the first acquire with that lease two
        // more round trips (TCP and the session handshake), which the suite's max_hold bound (lost
        // within 50 ms of the cap, counted from before the acquire) would charge to the lock. Open
        // the short lease's session now, as an application would with its one lease.
        let warm = Locks::new(backend.clone());
        warm.lock("warm-up/session")
            .expect("name")
            .options()
            .lease(self.short_lease())
            .acquire()
            .await
            .expect("warm-up acquire")
            .release()
            .await
            .expect("warm-up release");
        Client::new(Locks::with_defaults(
            backend.clone(),
            backend.default_options(),
        ))
        .with_proxy_cut(vec![proxy])
    }

    fn url(&self) -> Option<String> {
        Some(self.url.clone())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// A fresh JVM answers its first sessions and creates 5-10 times slower than a warm one (the JIT has
/// not compiled the request path yet), which the suite's timing bounds (lost at `max_hold` within
/// 50 ms of the cap, counted from before the acquire) would charge to the backend. A few sessions and
/// lock cycles first.
async fn warm_up(url: &str) {
    let url = LockUrl::parse(url).expect("url");
    for round in 0..3 {
        let backend = ZkBackend::connect(&url).await.expect("connect");
        let locks = Locks::new(backend);
        for i in 0..10 {
            let lock = locks.lock(&format!("warm-up/{round}-{i}")).expect("name");
            // Only the JIT's work matters here: a cold server's grant can arrive after a short
            // validity window (an ensemble trusts a renewal through a follower for less than the
            // lease), which is what warming up is for; the suite's steps check the outcomes.
            match lock.options().lease(Duration::from_secs(1)).acquire().await {
                Ok(guard) => {
                    let _ = guard.release().await;
                }
                Err(e) => eprintln!("warm-up acquire (not counted): {e}"),
            }
        }
    }
}
