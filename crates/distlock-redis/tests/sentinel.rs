//! Sentinel: locks through `redis+sentinel://…/mymaster`, and after the master is killed and Sentinel
//! promotes the replica, the same backend re-resolves the master and keeps working; on the plain
//! layout too.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::{LockState, Locks};
use distlock_redis::RedisBackend;
use distlock_testkit::sentinel::SentinelGroup;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_locks_follow_a_failover_fault() {
    follow_a_failover("").await;
}

/// The plain layout's string key, token counter and channel through Sentinel (a poll of 60 s: only the
/// release message wakes the waiter in time), and after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_plain_layout_locks_follow_a_failover_fault() {
    follow_a_failover("?layout=plain&poll=60s").await;
}

/// Fair mode through Sentinel: the queue, the head's own channel and the token counter on the
/// Sentinel-resolved master, and after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_fair_locks_follow_a_failover_fault() {
    follow_a_failover("?fair=true").await;
}

async fn follow_a_failover(query: &str) {
    let mut group = SentinelGroup::start_or_panic();
    let url = LockUrl::parse(&format!("{}{query}", group.url())).unwrap();
    let a = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let b = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let name = format!("sentinel/{}", uuid::Uuid::new_v4().simple());

    // Exclusion and a pub/sub wake-up through the Sentinel-resolved master.
    let guard = a.lock(&name).unwrap().acquire().await.unwrap();
    let lock_b = b.lock(&name).unwrap();
    assert!(lock_b.try_acquire().await.unwrap().is_none());
    let first_token = guard.token().unwrap();
    let waiter = tokio::spawn(async move {
        let g = lock_b
            .options()
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .expect("woken by the release");
        let token = g.token();
        g.release().await.unwrap();
        token
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    guard.release().await.unwrap();
    let second_token = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke well before the 30 s lease")
        .unwrap()
        .unwrap();
    assert!(second_token > first_token);
    group.wait_replicated(Duration::from_secs(10)).unwrap();

    // Failover: the old master dies, Sentinel promotes the replica; new requests go there.
    group.master_mut().kill9().unwrap();
    group.wait_failover(Duration::from_secs(30)).unwrap();
    let lock = a.lock(&name).unwrap();
    let mut got = None;
    for _ in 0..50 {
        match lock.try_acquire().await {
            Ok(Some(g)) => {
                got = Some(g);
                break;
            }
            Ok(None) => panic!("the lock was released before the failover"),
            // The first request after the kill finds the old connection dead; the next reconnects.
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let guard = got.expect("acquired on the promoted master");
    assert_eq!(guard.state(), LockState::Held);
    // The token key replicated before the kill, so the counter carried over.
    assert!(guard.token().unwrap() > second_token);
    guard.release().await.unwrap();
}
