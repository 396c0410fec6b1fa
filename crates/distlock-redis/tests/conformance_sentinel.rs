//! The shared conformance suite on master + replica + 3 Sentinels (`redis+sentinel://…/mymaster`).
//!
//! Every client is its own `RedisBackend` logged in as its own ACL user, created on the master and on
//! the replica (it may be promoted); cutting a client disables its user and kills its connections on
//! both (see `support`), so only that client is partitioned. The backend passes the URL's credentials
//! to the master it resolves, not to the Sentinels (which have no ACL users here): the clients working
//! at all shows the credentials reach the master, and the cut taking effect shows every connection of
//! the client (commands and pub/sub) uses them. Other processes (`distlock run`) use the default user,
//! which is never cut.
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedisBackend;
use distlock_testkit::conformance::{Client, Provider};
use distlock_testkit::sentinel::SentinelGroup;
use support::{resp_bulk_port, rewriting_proxies, AclUser, Shared};

static GROUP: Shared<SentinelGroup> = Shared::new();

struct Sentinel {
    group: Arc<SentinelGroup>,
    nodes: Vec<SocketAddr>,
}

#[async_trait::async_trait]
impl Provider for Sentinel {
    async fn client(&self) -> Client {
        let user = AclUser::create(&self.nodes).await;
        // The Sentinels hand out the master's (or, after a failover, the replica's) own address: the
        // client's proxies in front of them rewrite it to the client's proxy in front of that server.
        let proxies = rewriting_proxies(&self.nodes, &self.group.sentinel_addrs(), resp_bulk_port);
        let sentinels: Vec<String> = proxies[self.nodes.len()..]
            .iter()
            .map(|p| p.addr().to_string())
            .collect();
        let url = format!(
            "redis+sentinel://{}{}/{}",
            user.credentials(),
            sentinels.join(","),
            self.group.master_name()
        );
        let backend = RedisBackend::connect(&LockUrl::parse(&url).expect("url"))
            .await
            .expect("connect as the client's own user");
        // The credentials reached the master the Sentinels named (and the Sentinels, which have no such
        // user, were asked without them: connecting would have failed otherwise).
        let master = self.group.master().addr();
        assert_eq!(
            user.connected_nodes().await,
            vec![master],
            "{} is not logged in on the master (only)",
            user.name
        );
        Client::new(Locks::new(backend))
            .with_proxies(proxies)
            .with_cut(user.cut_hook())
            .with_heal(user.heal_hook())
    }

    fn url(&self) -> Option<String> {
        Some(self.group.url())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn sentinel() -> Sentinel {
    let group = GROUP.get(SentinelGroup::start_or_panic).await;
    let nodes = vec![group.master().addr(), group.replica().addr()];
    Sentinel { group, nodes }
}

distlock_testkit::conformance_suite!(sentinel);

/// The suite's `read_write` and `semaphore` cases run their steps on this topology (a backend that
/// does not announce a kind passes them by refusing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kinds_cases_run_here() {
    let kinds = sentinel().await.client().await.locks.capabilities().kinds;
    assert!(
        kinds.read_write && kinds.atomic_downgrade && kinds.semaphore,
        "{kinds:?}"
    );
}
