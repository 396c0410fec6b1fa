//! The shared conformance suite on MariaDB, once per mode (`advisory_*`, `lease_*`, `row_*`). Each test
//! starts its own server (about 0.6 s); each client is its own `MysqlBackend` reaching the server through
//! a testkit fault `Proxy` of its own, so the suite's cut is a real partition: `blackhole` drops that
//! client's bytes (its probes go unanswered, the server's `wait_timeout` ends its held session, or its
//! lease row expires), and heal passes bytes again and resets its connections.
#![allow(clippy::expect_used)]

use std::sync::{Arc, Mutex};

use distlock_core::Locks;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::proxy::Proxy;

struct Mariadb {
    server: MariaDbServer,
    mode: &'static str,
    proxies: Mutex<Vec<Arc<Proxy>>>,
}

#[async_trait::async_trait]
impl Provider for Mariadb {
    async fn client(&self) -> Client {
        let proxy = Arc::new(Proxy::start(self.server.addr()).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = format!("{}?mode={}", self.server.url_via(proxy.addr()), self.mode);
        let backend = distlock_sql::mysql::connect(&url).await.expect("connect");
        Client::new(Locks::new(backend)).with_proxy_cut(vec![proxy])
    }

    fn url(&self) -> Option<String> {
        Some(format!("{}?mode={}", self.server.url(), self.mode))
    }
}

fn start(mode: &'static str) -> Mariadb {
    Mariadb {
        server: MariaDbServer::start_or_panic(),
        mode,
        proxies: Mutex::new(Vec::new()),
    }
}

mod advisory {
    use super::*;
    async fn provider() -> Mariadb {
        start("advisory")
    }
    distlock_testkit::conformance_suite!(provider);
}

mod lease {
    use super::*;
    async fn provider() -> Mariadb {
        start("lease")
    }
    distlock_testkit::conformance_suite!(provider);
}

mod row {
    use super::*;
    async fn provider() -> Mariadb {
        start("row")
    }
    distlock_testkit::conformance_suite!(provider);
}
