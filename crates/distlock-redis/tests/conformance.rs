//! The shared conformance suite on a standalone `redis-server`: a fresh server per case (about 20 ms to
//! start), every client its own `RedisBackend` reaching the server through its own testkit `Proxy`, so
//! a cut blackholes that client alone (and a heal lets its bytes pass again). Other processes reach the
//! server with its own `redis://` URL. The suite runs on Redisson's layout (the default), and its
//! mutex cases again on the plain layout, with tokens (`mod plain`) and without, and in fair mode
//! (`mod fair`).
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedisBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::proxy::Proxy;
use distlock_testkit::redis::RedisServer;

struct Standalone {
    server: RedisServer,
    /// The URL's query: the layout.
    query: &'static str,
}

#[async_trait::async_trait]
impl Provider for Standalone {
    async fn client(&self) -> Client {
        let proxy = Arc::new(Proxy::start_or_panic(self.server.addr()));
        let url = LockUrl::parse(&format!("redis://{}{}", proxy.addr(), self.query)).expect("url");
        let backend = RedisBackend::connect(&url).await.expect("connect");
        let (cut, heal) = (proxy.clone(), proxy.clone());
        Client::new(Locks::new(backend))
            .with_proxies(vec![proxy])
            .with_cut(move || {
                cut.blackhole().expect("blackhole");
                Box::pin(async {})
            })
            .with_heal(move || {
                heal.pass().expect("pass");
                Box::pin(async {})
            })
    }

    fn url(&self) -> Option<String> {
        Some(format!("{}{}", self.server.url(), self.query))
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn standalone() -> Standalone {
    Standalone {
        server: RedisServer::start_or_panic(),
        query: "",
    }
}

distlock_testkit::conformance_suite!(standalone);

/// The mutex's cases on the plain layout, with and without tokens (the read-write lock and the
/// semaphore keep Redisson's layouts under it: their cases above cover them).
mod plain {
    async fn standalone() -> super::Standalone {
        super::Standalone {
            query: "?layout=plain",
            ..super::standalone().await
        }
    }

    distlock_testkit::conformance_suite!(@mutex standalone);
}

mod plain_without_tokens {
    async fn standalone() -> super::Standalone {
        super::Standalone {
            query: "?layout=plain&tokens=false",
            ..super::standalone().await
        }
    }

    distlock_testkit::conformance_suite!(@mutex standalone);
}

/// The mutex's cases in fair mode (`?fair=true`): its waiters queue on the server, and every case's
/// promise (cancel safety, lost replies, resets) holds with the queue beside the lock.
mod fair {
    async fn standalone() -> super::Standalone {
        super::Standalone {
            query: "?fair=true",
            ..super::standalone().await
        }
    }

    distlock_testkit::conformance_suite!(@mutex standalone);
}
