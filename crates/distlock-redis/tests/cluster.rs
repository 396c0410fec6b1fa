//! Redis Cluster: exclusion, tokens, a sharded pub/sub wake-up (SPUBLISH/SSUBSCRIBE) and renewals of
//! locks on several slots, through `redis+cluster://`.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_redis::RedisBackend;
use distlock_testkit::cluster::RedisCluster;

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
