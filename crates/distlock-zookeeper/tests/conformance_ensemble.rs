//! The shared conformance suite on a 3-member ZooKeeper ensemble, each client through a fault proxy of
//! its own to one member (in turn), so a client's sessions live on a follower or on the leader (see
//! `common/provider.rs`).
#![allow(clippy::expect_used)]

#[path = "common/provider.rs"]
mod provider;

use distlock_testkit::zookeeper::ZkEnsemble;

async fn zookeeper() -> provider::Zk<ZkEnsemble> {
    let ensemble = ZkEnsemble::start_or_panic(3);
    let addrs = (0..3).map(|i| ensemble.addr(i).expect("member")).collect();
    let url = ensemble.url();
    provider::Zk::start(ensemble, addrs, url).await
}

distlock_testkit::conformance_suite!(zookeeper);
