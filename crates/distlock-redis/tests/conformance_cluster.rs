//! The shared conformance suite on a 6-node Redis Cluster (`redis+cluster://…`).
//!
//! Every client is its own `RedisBackend` logged in as its own ACL user, created on all six nodes (the
//! client follows slots to any master, and a replica may be promoted); cutting a client disables its
//! user and kills its connections on every node (see `support`), so only that client is partitioned.
//! The clients working at all shows the cluster client authenticates to every node it is redirected to
//! (the suite's names spread over all three masters' slots). Other processes (`distlock run`) use the
//! default user, which is never cut.
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedisBackend;
use distlock_testkit::cluster::RedisCluster;
use distlock_testkit::conformance::{Client, Provider};
use support::{resp_port_tail, rewriting_proxies, AclUser, Shared};

static CLUSTER: Shared<RedisCluster> = Shared::new();

struct Cluster {
    cluster: Arc<RedisCluster>,
    nodes: Vec<SocketAddr>,
    /// The masters serving the three slot ranges.
    masters: Vec<SocketAddr>,
}

#[async_trait::async_trait]
impl Provider for Cluster {
    async fn client(&self) -> Client {
        let user = AclUser::create(&self.nodes).await;
        // The nodes hand out their own addresses (`CLUSTER SLOTS`, `MOVED`, `ASK`): the client's proxy
        // in front of each node rewrites every node's port to the client's proxy in front of that node.
        let proxies = rewriting_proxies(&self.nodes, &[], resp_port_tail);
        let seeds: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
        let url = format!("redis+cluster://{}{}", user.credentials(), seeds.join(","));
        let backend = RedisBackend::connect(&LockUrl::parse(&url).expect("url"))
            .await
            .expect("connect as the client's own user");
        // The cluster client logged in as this user on every master it will send commands to.
        let connected = user.connected_nodes().await;
        for master in &self.masters {
            assert!(
                connected.contains(master),
                "{} is not logged in on master {master}: only on {connected:?}",
                user.name
            );
        }
        Client::new(Locks::new(backend))
            .with_proxies(proxies)
            .with_cut(user.cut_hook())
            .with_heal(user.heal_hook())
    }

    fn url(&self) -> Option<String> {
        Some(self.cluster.url())
    }

    fn short_lease(&self) -> Duration {
        Duration::from_secs(1)
    }
}

async fn cluster() -> Cluster {
    let cluster = CLUSTER.get(RedisCluster::start_or_panic).await;
    let nodes = cluster.addrs();
    let masters = [0, 5461, 10923]
        .into_iter()
        .map(|slot| cluster.node_for_slot(slot).expect("slot owner").addr())
        .collect();
    Cluster {
        cluster,
        nodes,
        masters,
    }
}

distlock_testkit::conformance_suite!(cluster);

/// The suite's `read_write` and `semaphore` cases run their steps on this topology (a backend that
/// does not announce a kind passes them by refusing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kinds_cases_run_here() {
    let kinds = cluster().await.client().await.locks.capabilities().kinds;
    assert!(
        kinds.read_write && kinds.atomic_downgrade && kinds.semaphore,
        "{kinds:?}"
    );
}
