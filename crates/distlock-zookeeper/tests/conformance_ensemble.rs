//! The shared conformance suite on a 3-member ZooKeeper ensemble, each client through a proxy to one
//! member (in turn), so a client's sessions live on a follower or on the leader. Otherwise as on a
//! standalone server (conformance.rs): Each client is its own `ZkBackend` (its own
//! sessions) reaching the server through a testkit fault `Proxy` of its own, so the suite's cut is a
//! real partition: `blackhole` drops that client's bytes (pings go unanswered, the server expires its
//! sessions, other clients take over), and heal passes bytes again and resets the connections so the
//! client reconnects (and learns its session expired).
#![allow(clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::proxy::Proxy;
use distlock_testkit::zookeeper::ZkEnsemble;
use distlock_zookeeper::ZkBackend;

struct Zk {
    server: ZkEnsemble,
    next: std::sync::atomic::AtomicUsize,
    proxies: Mutex<Vec<Arc<Proxy>>>,
}

#[async_trait::async_trait]
impl Provider for Zk {
    async fn client(&self) -> Client {
        let member = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 3;
        let proxy =
            Arc::new(Proxy::start(self.server.addr(member).expect("member")).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = LockUrl::parse(&format!("zk://{}", proxy.addr())).expect("url");
        let backend = ZkBackend::connect(&url).await.expect("connect");
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
        let (cut, heal) = (proxy.clone(), proxy);
        Client::new(Locks::with_defaults(
            backend.clone(),
            backend.default_options(),
        ))
        .with_cut(move || {
            let p = cut.clone();
            Box::pin(async move {
                tokio::task::spawn_blocking(move || p.blackhole().expect("blackhole"))
                    .await
                    .expect("blackhole task");
            })
        })
        .with_heal(move || {
            let p = heal.clone();
            Box::pin(async move {
                tokio::task::spawn_blocking(move || {
                    p.pass().expect("pass");
                    p.reset().expect("reset");
                })
                .await
                .expect("heal task");
            })
        })
    }

    fn url(&self) -> Option<String> {
        Some(self.server.url())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn zookeeper() -> Zk {
    let server = ZkEnsemble::start_or_panic(3);
    warm_up(&server).await;
    Zk {
        server,
        next: std::sync::atomic::AtomicUsize::new(0),
        proxies: Mutex::new(Vec::new()),
    }
}

/// A fresh JVM answers its first sessions and creates 5-10 times slower than a warm one (the JIT has
/// not compiled the request path yet), which the suite's timing bounds (lost at `max_hold` within
/// 50 ms of the cap, counted from before the acquire) would charge to the backend. A few sessions and
/// lock cycles first.
async fn warm_up(server: &ZkEnsemble) {
    let url = LockUrl::parse(&server.url()).expect("url");
    for round in 0..3 {
        let backend = ZkBackend::connect(&url).await.expect("connect");
        let locks = Locks::new(backend);
        for i in 0..10 {
            let lock = locks.lock(&format!("warm-up/{round}-{i}")).expect("name");
            let guard = lock
                .options()
                .lease(Duration::from_secs(1))
                .acquire()
                .await
                .expect("warm-up acquire");
            guard.release().await.expect("warm-up release");
        }
    }
}

distlock_testkit::conformance_suite!(zookeeper);
