//! The shared conformance suite on PostgreSQL, once per mode (advisory, row, lease). Each client is its
//! own `PostgresBackend` reaching a test server (its own, started per case) through a testkit fault
//! `Proxy` of its own, so the suite's cut is a real partition: `blackhole` drops that client's bytes
//! (probes and renewals go unanswered; the server ends the idle session, or the lease row expires) and
//! heal passes bytes again and resets the connections.
#![allow(clippy::expect_used)]

use std::sync::{Arc, Mutex};

use distlock_core::Locks;
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::proxy::Proxy;
use distlock_testkit::tls::TestCa;

struct Postgres {
    server: PostgresServer,
    /// `mode=…`, and the TLS parameters in the TLS run.
    query: String,
    proxies: Mutex<Vec<Arc<Proxy>>>,
    /// The TLS run's CA (its files live as long as this).
    _ca: Option<TestCa>,
}

#[async_trait::async_trait]
impl Provider for Postgres {
    async fn client(&self) -> Client {
        let proxy = Arc::new(Proxy::start(self.server.addr()).expect("proxy"));
        self.proxies.lock().expect("proxies").push(proxy.clone());
        let url = format!("{}?{}", self.server.url_for(proxy.addr()), self.query);
        let backend = PostgresBackend::connect(&url).await.expect("connect");
        Client::new(Locks::new(backend)).with_proxy_cut(vec![proxy])
    }

    fn url(&self) -> Option<String> {
        Some(format!("{}?{}", self.server.url(), self.query))
    }
}

fn start(mode: &'static str) -> Postgres {
    Postgres {
        server: PostgresServer::start_or_panic(),
        query: format!("mode={mode}"),
        proxies: Mutex::new(Vec::new()),
        _ca: None,
    }
}

/// Advisory mode over `sslmode=verify-full` (the proxy is on 127.0.0.1, in the certificate).
fn start_tls() -> Postgres {
    let ca = TestCa::new_or_panic();
    let server = PostgresServer::start_tls(&ca, &[]).expect("start PostgreSQL with TLS");
    Postgres {
        server,
        query: format!(
            "mode=advisory&sslmode=verify-full&sslrootcert={}",
            ca.ca_cert().display()
        ),
        proxies: Mutex::new(Vec::new()),
        _ca: Some(ca),
    }
}

mod advisory {
    async fn provider() -> super::Postgres {
        super::start("advisory")
    }
    distlock_testkit::conformance_suite!(provider);
}

mod row {
    async fn provider() -> super::Postgres {
        super::start("row")
    }
    distlock_testkit::conformance_suite!(provider);
}

mod lease {
    async fn provider() -> super::Postgres {
        super::start("lease")
    }
    distlock_testkit::conformance_suite!(provider);
}

mod tls {
    async fn provider() -> super::Postgres {
        super::start_tls()
    }
    distlock_testkit::conformance_suite!(provider);
}
