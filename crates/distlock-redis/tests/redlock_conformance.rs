//! The shared conformance suite on Redlock over 5 independent `redis-server` processes (fresh per case,
//! about 100 ms to start). Every client is its own `RedlockBackend` reaching each node through its own
//! testkit `Proxy`, so a cut blackholes that client alone on all five nodes. Other processes (the
//! holder-process case) use the nodes' own `redlock://` URL.
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedlockBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::proxy::Proxy;
use distlock_testkit::redlock::{url_of, RedlockNodes};

struct FiveNodes {
    nodes: RedlockNodes,
}

#[async_trait::async_trait]
impl Provider for FiveNodes {
    async fn client(&self) -> Client {
        let proxies: Arc<Vec<Arc<Proxy>>> =
            Arc::new(self.nodes.proxies().into_iter().map(Arc::new).collect());
        let url = LockUrl::parse(&url_of(proxies.iter().map(|p| p.addr()))).expect("url");
        let backend = RedlockBackend::connect(&url).await.expect("connect");
        let (cut, heal) = (proxies.clone(), proxies.clone());
        Client::new(Locks::new(backend))
            .with_proxies(proxies.to_vec())
            .with_cut(move || {
                for p in cut.iter() {
                    p.blackhole().expect("blackhole");
                }
                Box::pin(async {})
            })
            .with_heal(move || {
                for p in heal.iter() {
                    p.pass().expect("pass");
                }
                Box::pin(async {})
            })
    }

    fn url(&self) -> Option<String> {
        Some(self.nodes.url())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn five_nodes() -> FiveNodes {
    FiveNodes {
        nodes: RedlockNodes::start_or_panic(5),
    }
}

distlock_testkit::conformance_suite!(five_nodes);
