//! The shared conformance suite on a standalone ZooKeeper, each client through a fault proxy of its
//! own (see `common/provider.rs`).
#![allow(clippy::expect_used)]

#[path = "common/provider.rs"]
mod provider;

use distlock_testkit::zookeeper::ZkServer;

async fn zookeeper() -> provider::Zk<ZkServer> {
    let server = ZkServer::start_or_panic();
    let (addrs, url) = (vec![server.addr()], server.url());
    provider::Zk::start(server, addrs, url).await
}

distlock_testkit::conformance_suite!(zookeeper);
