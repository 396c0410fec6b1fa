//! The shared conformance suite on a 3-member etcd cluster: each client connects to all three members
//! through fault proxies of its own (one per member), so a cut blackholes all of its paths.
#![allow(clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_etcd::EtcdBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::etcd::EtcdCluster;
use distlock_testkit::proxy::Proxy;

struct Cluster {
    cluster: EtcdCluster,
    proxies: Mutex<Vec<Arc<Proxy>>>,
}

#[async_trait::async_trait]
impl Provider for Cluster {
    async fn client(&self) -> Client {
        let proxies: Vec<Arc<Proxy>> = (0..self.cluster.len())
            .map(|i| Arc::new(Proxy::start(self.cluster.addr(i).expect("member")).expect("proxy")))
            .collect();
        self.proxies
            .lock()
            .expect("proxies")
            .extend(proxies.iter().cloned());
        let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
        let url = LockUrl::parse(&format!("etcd://{}", hosts.join(","))).expect("url");
        let backend = EtcdBackend::connect(&url).await.expect("connect");
        Client::new(Locks::new(backend)).with_proxy_cut(proxies)
    }

    fn url(&self) -> Option<String> {
        Some(self.cluster.url())
    }

    fn short_lease(&self) -> Duration {
        self.cluster.timers().min_ttl()
    }
}

async fn cluster() -> Cluster {
    Cluster {
        cluster: tokio::task::spawn_blocking(|| EtcdCluster::start_or_panic(3))
            .await
            .expect("cluster start"),
        proxies: Mutex::new(Vec::new()),
    }
}

distlock_testkit::conformance_suite!(cluster);
