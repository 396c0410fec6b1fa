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
use distlock_testkit::tls::TestCa;

struct Mariadb {
    server: MariaDbServer,
    /// `mode=…`, and the TLS parameters in the TLS run.
    query: String,
    proxies: Mutex<Vec<Arc<Proxy>>>,
    /// The TLS run's CA (the server reads its files).
    _ca: Option<TestCa>,
}

#[async_trait::async_trait]
impl Provider for Mariadb {
    async fn client(&self) -> Client {
        let proxy = Arc::new(Proxy::start(self.server.addr()).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = format!("{}?{}", self.server.url_via(proxy.addr()), self.query);
        let backend = distlock_sql::mysql::connect(&url).await.expect("connect");
        Client::new(Locks::new(backend)).with_proxy_cut(vec![proxy])
    }

    fn url(&self) -> Option<String> {
        Some(format!("{}?{}", self.server.url(), self.query))
    }
}

fn start(mode: &'static str) -> Mariadb {
    Mariadb {
        server: MariaDbServer::start_or_panic(),
        query: format!("mode={mode}"),
        proxies: Mutex::new(Vec::new()),
        _ca: None,
    }
}

/// Advisory mode over verified TLS, the server refusing plain sessions.
fn start_tls() -> Mariadb {
    let ca = TestCa::new_or_panic();
    let server = MariaDbServer::builder()
        .tls(&ca)
        .require_secure_transport()
        .start_or_panic();
    Mariadb {
        server,
        query: format!(
            "mode=advisory&require_ssl=true&verify_identity=true&ssl_ca={}",
            ca.ca_cert().display()
        ),
        proxies: Mutex::new(Vec::new()),
        _ca: Some(ca),
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

mod tls {
    use super::*;
    async fn provider() -> Mariadb {
        start_tls()
    }
    distlock_testkit::conformance_suite!(provider);
}
