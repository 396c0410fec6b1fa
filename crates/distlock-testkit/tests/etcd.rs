//! Self-tests of the etcd servers the testkit starts.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_testkit::etcd::{self, EtcdCluster, EtcdServer};

#[test]
fn single_node_starts_ready_and_is_ours() {
    let server = EtcdServer::start_or_panic();
    assert!(etcd::health(server.addr(), Duration::from_secs(2)).unwrap());
    assert!(server.url().starts_with("etcd://127.0.0.1:"));
    assert_eq!(server.timers().min_ttl(), Duration::from_secs(1));
    server.etcdctl(&["put", "k", "v"]).unwrap();
    assert!(server.etcdctl(&["get", "k"]).unwrap().contains('v'));
}

#[test]
fn fault_kill9_and_restart_keep_data() {
    let mut server = EtcdServer::start_or_panic();
    server.etcdctl(&["put", "durable", "yes"]).unwrap();
    let pid = server.pid();
    server.kill9().unwrap();
    assert!(etcd::health(server.addr(), Duration::from_millis(300)).is_err());
    server.restart().unwrap();
    assert_ne!(server.pid(), pid);
    assert!(server.etcdctl(&["get", "durable"]).unwrap().contains("yes"));
}

#[test]
fn fault_pause_and_resume() {
    let mut server = EtcdServer::start_or_panic();
    server.pause().unwrap();
    assert!(etcd::health(server.addr(), Duration::from_millis(300)).is_err());
    server.resume().unwrap();
    let mut healthy = false;
    for _ in 0..100 {
        if etcd::health(server.addr(), Duration::from_secs(1)).unwrap_or(false) {
            healthy = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(healthy);
}

#[test]
fn fault_cluster_survives_a_member_kill9() {
    let mut cluster = EtcdCluster::start_or_panic(3);
    assert_eq!(cluster.url().matches(',').count(), 2);
    cluster.etcdctl(&["put", "before", "1"]).unwrap();
    cluster.kill9(0).unwrap();
    // Writes through the survivors (a new leader if the killed one led).
    let mut ok = false;
    for _ in 0..100 {
        if cluster
            .etcdctl(&["--command-timeout=2s", "put", "during", "2"])
            .is_ok()
        {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ok, "no write succeeded with two of three members");
    cluster.restart(0).unwrap();
    cluster.wait_healthy(Duration::from_secs(30)).unwrap();
    let ep = cluster.addr(0).unwrap().to_string();
    let got = etcd::etcdctl(&ep, &["get", "during"]).unwrap();
    assert!(
        got.contains('2'),
        "the restarted member did not catch up: {got:?}"
    );
}
