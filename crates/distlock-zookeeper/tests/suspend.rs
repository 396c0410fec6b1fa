//! Deadlines across a suspend of the machine (issue 24, scenario 7), simulated with
//! `distlock_core::clock::testing::suspend`: the boot clock jumps on, tokio's clock does not (nextest
//! runs each test in a process of its own, as the simulated suspend is process-wide). The `max_hold`
//! expiry must delete the node at the resume, not as much later as the suspend lasted.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{children, locks_at, name, raw_client};
use distlock_core::clock;
use distlock_core::LockState;
use distlock_testkit::zookeeper::ZkServer;

/// Far below the 20 s `max_hold` a tokio (or `std::time::Instant`) timer would still wait.
const PROMPT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_passed_during_a_suspend_deletes_the_node_at_the_resume() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let locks = locks_at(&server.url()).await;
    let lock_name = name("suspend_max_hold");
    let guard = locks
        .lock(&lock_name)
        .unwrap()
        .options()
        .max_hold(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert_eq!(children(&raw, &lock_name).await.len(), 1);
    // The session's task is asleep, its timer armed for the deadline.
    tokio::time::sleep(Duration::from_millis(300)).await;
    clock::testing::suspend(Duration::from_secs(25));
    let resumed = Instant::now();
    assert_eq!(guard.state(), LockState::Lost);
    loop {
        let left = children(&raw, &lock_name).await;
        if left.is_empty() {
            break;
        }
        assert!(
            resumed.elapsed() < PROMPT,
            "the node {left:?} is still there {:?} after the resume, though max_hold passed during the suspend",
            resumed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nobody is kept out: another session takes the lock.
    let other = locks_at(&server.url()).await;
    let next = tokio::time::timeout(PROMPT, other.lock(&lock_name).unwrap().options().acquire())
        .await
        .expect("another session takes the lock at once")
        .unwrap();
    next.release().await.unwrap();
    drop(guard);
}
