//! Self-tests of the Sentinel group and the Cluster against real servers. Tests that kill servers carry
//! `fault` in their name, so nextest runs them in the serial group.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use distlock_testkit::cluster::{key_slot, RedisCluster};
use distlock_testkit::redis::{RedisServer, RespValue};
use distlock_testkit::sentinel::SentinelGroup;

const FAILOVER: Duration = Duration::from_secs(30);

fn ok() -> RespValue {
    RespValue::Simple("OK".into())
}

fn wait_for_value(server: &RedisServer, key: &str, want: &str, readonly: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut conn = server.connect(Duration::from_secs(5)).unwrap();
        if readonly {
            assert_eq!(conn.command(&["READONLY"]).unwrap(), ok());
        }
        let got = conn.command(&["GET", key]).unwrap();
        if got == RespValue::Bulk(want.as_bytes().to_vec()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key} never reached {}: {got}",
            server.addr()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sentinel_group_replicates_and_names_its_master() {
    let group = SentinelGroup::start_or_panic();
    assert_eq!(group.master_name(), "mymaster");
    let s = group.sentinel_addrs();
    assert_eq!(s.len(), 3);
    assert_eq!(
        group.url(),
        format!("redis+sentinel://{},{},{}/mymaster", s[0], s[1], s[2])
    );
    assert!(group.url().starts_with("redis+sentinel://127.0.0.1:"));
    for named in group.sentinel_master_addrs().unwrap() {
        assert_eq!(named, group.master().addr());
    }
    assert_eq!(group.master().command(&["SET", "k", "v"]).unwrap(), ok());
    wait_for_value(group.replica(), "k", "v", false);
    group.wait_replicated(Duration::from_secs(5)).unwrap();
    // The replica refuses writes.
    assert!(group
        .replica()
        .command(&["SET", "k", "w"])
        .unwrap()
        .is_error());

    // A detached replica keeps its data and misses new writes until it is reattached.
    let mut group = group;
    group.detach_replica().unwrap();
    assert_eq!(group.master().command(&["SET", "k2", "v"]).unwrap(), ok());
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        group.replica().command(&["GET", "k2"]).unwrap(),
        RespValue::Nil
    );
    wait_for_value(group.replica(), "k", "v", false);
    group.reattach_replica().unwrap();
    wait_for_value(group.replica(), "k2", "v", false);
    group.wait_replicated(Duration::from_secs(5)).unwrap();
}

#[test]
fn sentinel_fault_failover_after_master_kill9() {
    let mut group = SentinelGroup::start_or_panic();
    let old_master = group.master().addr();
    let promoted = group.replica().addr();
    group.master_mut().kill9().unwrap();
    let t = Instant::now();
    group.wait_failover(FAILOVER).unwrap();
    eprintln!("failover took {:?}", t.elapsed());
    assert_eq!(group.master().addr(), promoted);
    assert_eq!(group.replica().addr(), old_master);
    for named in group.sentinel_master_addrs().unwrap() {
        assert_eq!(named, promoted);
    }
    assert_eq!(group.master().command(&["SET", "k", "v2"]).unwrap(), ok());
}

#[test]
fn sentinel_fault_paused_replica_loses_the_write_on_failover() {
    // infra.md §2.4: the deterministic lost-lock recipe the Redis backend's safety tests build on.
    let mut group = SentinelGroup::start_or_panic();
    group
        .pause_replica_writes(Duration::from_millis(1000))
        .unwrap();
    let mut conn = group.master().connect(Duration::from_secs(5)).unwrap();
    assert_eq!(
        conn.command(&["SET", "lock", "clientA", "PX", "30000"])
            .unwrap(),
        ok()
    );
    assert_eq!(
        conn.command(&["WAIT", "1", "100"]).unwrap(),
        RespValue::Int(0)
    );
    group.master_mut().kill9().unwrap();
    group.wait_failover(FAILOVER).unwrap();
    let master = group.master();
    assert_eq!(master.command(&["GET", "lock"]).unwrap(), RespValue::Nil);
    assert_eq!(
        master
            .command(&["SET", "lock", "clientB", "NX", "PX", "30000"])
            .unwrap(),
        ok(),
        "a second holder gets the lock: the write was lost"
    );
}

#[test]
fn cluster_serves_keys_from_their_master_and_replica() {
    let cluster = RedisCluster::start_or_panic();
    let addrs = cluster.addrs();
    assert_eq!(addrs.len(), 6);
    let hosts: Vec<String> = addrs.iter().map(ToString::to_string).collect();
    assert_eq!(
        cluster.url(),
        format!("redis+cluster://{}", hosts.join(","))
    );
    for node in cluster.nodes() {
        assert_eq!(node.bus_port(), Some(node.port() + 10000));
    }

    let key = "distlock:{orders}:lock";
    let slot = key_slot(key.as_bytes());
    // Our CRC16 agrees with the server's.
    let server_slot = cluster.nodes()[0]
        .command(&["CLUSTER", "KEYSLOT", key])
        .unwrap();
    assert_eq!(server_slot, RespValue::Int(i64::from(slot)));

    let owner = cluster.slot_owner(slot).unwrap();
    assert_eq!(owner.replicas.len(), 1);
    assert_eq!(owner.replicas[0], owner.master + 3);
    let master = cluster.master_for_key(key).unwrap();
    assert_eq!(master.addr(), cluster.nodes()[owner.master].addr());
    assert_eq!(master.command(&["SET", key, "tok"]).unwrap(), ok());
    wait_for_value(&cluster.nodes()[owner.replicas[0]], key, "tok", true);

    // Any other master redirects.
    let other = (owner.master + 1) % 3;
    let moved = cluster.nodes()[other].command(&["GET", key]).unwrap();
    assert!(
        matches!(&moved, RespValue::Error(e) if e.starts_with("MOVED")),
        "{moved}"
    );
}

#[test]
fn cluster_fault_replica_takes_over_after_master_kill9() {
    let mut cluster = RedisCluster::start_or_panic();
    let key = "distlock:{failover}";
    let slot = key_slot(key.as_bytes());
    let before = cluster.slot_owner(slot).unwrap();
    cluster.nodes()[before.master]
        .command(&["SET", key, "v"])
        .unwrap();
    cluster.node_mut(before.master).unwrap().kill9().unwrap();
    let t = Instant::now();
    cluster.wait_state_ok(FAILOVER).unwrap();
    eprintln!("cluster failover took {:?}", t.elapsed());
    let after = cluster.slot_owner(slot).unwrap();
    assert_eq!(after.master, before.replicas[0]);
    let master = cluster.node_for_slot(slot).unwrap();
    assert_eq!(master.command(&["SET", key, "w"]).unwrap(), ok());
}
