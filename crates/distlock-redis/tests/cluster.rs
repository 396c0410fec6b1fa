//! Redis Cluster: exclusion, tokens, a sharded pub/sub wake-up (SPUBLISH/SSUBSCRIBE) and renewals of
//! locks on several slots, through `redis+cluster://`.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_redis::{layout, RedisBackend, RedisConfig};
use distlock_testkit::cluster::{key_slot, RedisCluster};
use distlock_testkit::redis::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_locks_wake_and_renew() {
    let cluster = RedisCluster::start_or_panic();
    let url = LockUrl::parse(&cluster.url()).unwrap();
    let a = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let b = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let base = uuid::Uuid::new_v4().simple().to_string();

    // Names on many slots, held past their lease: renewals per slot keep every one of them. (A 1 s lease
    // was lost under the full suite's load on 2 cores: a renewal must be confirmed within 2/3 of it.)
    let lease = Duration::from_secs(2);
    let mut guards = Vec::new();
    for i in 0..8 {
        let name = format!("cluster/{base}/{i}");
        guards.push(
            a.lock(&name)
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(lease * 2).await;
    for g in &guards {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
    }

    // A waiter on another client is woken by the sharded release message (the holder's lease is
    // 30 s, so only the message can wake it within the bound).
    let name = format!("cluster/{base}/wake");
    let first = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let lock_b = b.lock(&name).unwrap();
    assert!(lock_b.try_acquire().await.unwrap().is_none());
    let first_token = first.token().unwrap();
    let waiter = tokio::spawn(async move {
        let g = lock_b
            .options()
            .lease(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .expect("woken");
        let t = g.token().unwrap();
        g.release().await.unwrap();
        t
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke by the message, not by a lease")
        .unwrap();
    assert!(next > first_token);
    for g in guards {
        g.release().await.unwrap();
    }

    // A name whose braces make no hash tag is refused before any I/O.
    let err = a.lock("x{}y").expect_err("keys on different slots");
    assert_eq!(err.kind(), ErrorKind::InvalidName, "{err}");
}

/// Runs `args` on `node`; the reply must not be an error.
fn ok(node: &RedisServer, args: &[&str]) {
    let reply = node.command(args).unwrap();
    assert!(!reply.is_error(), "{args:?} on {}: {reply}", node.addr());
}

/// A slot moves to another master while a lock in it is held (a resharding: `MIGRATE`, then
/// `SETSLOT … NODE`). The release goes on a link whose Cluster client does not follow redirects by
/// itself (so that a resend is known as one); it must still follow the `MOVED` and release the lock,
/// whatever the retry policy: the old node ran nothing, so following it is no resend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_follows_a_moved_slot_under_any_retry_policy() {
    let cluster = RedisCluster::start_or_panic();
    let seeds = cluster
        .addrs()
        .iter()
        .map(|a| Endpoint::new(a.ip().to_string(), a.port()))
        .collect();
    let config = RedisConfig::cluster(seeds).with_retry(RetryPolicy::NEVER);
    let locks = Locks::new(RedisBackend::from_config(config).await.expect("connect"));
    let name = format!("{{moved-{}}}/lock", uuid::Uuid::new_v4().simple());
    // A first release: the release link learns the slot map as it is now.
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    guard.release().await.unwrap();
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();

    let slot = key_slot(name.as_bytes());
    let from = cluster.slot_owner(slot).unwrap().master;
    let masters: Vec<usize> = [0, 5461, 10923]
        .into_iter()
        .map(|s| cluster.slot_owner(s).unwrap().master)
        .collect();
    let to = *masters
        .iter()
        .find(|m| **m != from)
        .expect("another master");
    let (source, target) = (&cluster.nodes()[from], &cluster.nodes()[to]);
    let (from_id, to_id) = (&cluster.node_ids()[from], &cluster.node_ids()[to]);
    let slot = slot.to_string();
    ok(target, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", from_id]);
    ok(source, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", to_id]);
    let token_key = layout::token_key(&name);
    let port = target.port().to_string();
    ok(
        source,
        &[
            "MIGRATE",
            "127.0.0.1",
            &port,
            "",
            "0",
            "5000",
            "KEYS",
            &name,
            &token_key,
        ],
    );
    for master in &masters {
        ok(
            &cluster.nodes()[*master],
            &["CLUSTER", "SETSLOT", &slot, "NODE", to_id],
        );
    }
    assert_eq!(
        target.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(1)
    );

    guard
        .release()
        .await
        .expect("the release follows the MOVED to the slot's new master");
    assert_eq!(
        target.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(0)
    );
}
