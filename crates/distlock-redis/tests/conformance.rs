//! The shared conformance suite on a standalone `redis-server`: a fresh server per case (about 20 ms to
//! start), every client its own `RedisBackend` reaching the server through its own testkit `Proxy`, so
//! a cut blackholes that client alone (and a heal lets its bytes pass again). Other processes reach the
//! server with its own `redis://` URL. The suite runs twice: on Redisson's layout (the default) and,
//! in `mod plain`, on the plain layout (`?layout=plain`).
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

mod plain {
    async fn standalone() -> super::Standalone {
        super::Standalone {
            query: "?layout=plain",
            ..super::standalone().await
        }
    }

    distlock_testkit::conformance_suite!(standalone);
}

/// The plain layout without tokens (`tokens=false`: an acquire is one `SET NX PX`): the cases whose
/// path differs from the plain layout's with tokens (acquire, busy, resend, undo, loss), and
/// `tokens_strictly_increase`, which checks that no token comes back.
mod plain_without_tokens {
    async fn standalone() -> super::Standalone {
        super::Standalone {
            query: "?layout=plain&tokens=false",
            ..super::standalone().await
        }
    }

    distlock_testkit::conformance_suite!(@cases standalone;
        mutual_exclusion,
        try_acquire_when_held_is_none,
        wait_timeout,
        cancelled_acquire_leaves_nothing,
        release_is_owner_only,
        reentrancy_same_token,
        lost_fires_when_cut_off,
        tokens_strictly_increase,
        local_waiters_fifo,
        killed_holder_process_frees_lock,
        release_under_a_reset,
        lost_release_reply,
    );
}

/// The suite's `read_write` and `semaphore` cases run their steps on this topology (a backend that
/// does not announce a kind passes them by refusing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kinds_cases_run_here() {
    let kinds = standalone().await.client().await.locks.capabilities().kinds;
    assert!(
        kinds.read_write && kinds.atomic_downgrade && kinds.semaphore,
        "{kinds:?}"
    );
}
