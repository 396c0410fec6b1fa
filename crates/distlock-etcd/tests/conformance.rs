//! The shared conformance suite on a single etcd node. Each client is its own `EtcdBackend` (its own
//! connection and sessions) reaching the server through a testkit fault `Proxy` of its own, so the
//! suite's cut is a real partition: `blackhole` drops that client's bytes (keep-alives go unanswered,
//! its session lease expires on the server, other clients take over), and heal passes bytes again and
//! resets the connections so the client reconnects.
#![allow(clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_etcd::EtcdBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::proxy::Proxy;

struct Etcd {
    server: EtcdServer,
    proxies: Mutex<Vec<Arc<Proxy>>>,
}

#[async_trait::async_trait]
impl Provider for Etcd {
    async fn client(&self) -> Client {
        let proxy = Arc::new(Proxy::start(self.server.addr()).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = LockUrl::parse(&format!("etcd://{}", proxy.addr())).expect("url");
        let backend = EtcdBackend::connect(&url).await.expect("connect");
        Client::new(Locks::new(backend)).with_proxy_cut(vec![proxy])
    }

    fn url(&self) -> Option<String> {
        Some(self.server.url())
    }

    fn short_lease(&self) -> Duration {
        // etcd's minimum TTL with the testkit's 50/500 ms timers: 1.5 × 500 ms rounded up to seconds.
        self.server.timers().min_ttl()
    }
}

async fn etcd() -> Etcd {
    Etcd {
        server: EtcdServer::start_or_panic(),
        proxies: Mutex::new(Vec::new()),
    }
}

distlock_testkit::conformance_suite!(etcd);
