//! Deadlines across a suspend of the machine (issue 24, scenario 7), simulated with
//! `clock::testing::suspend`: the boot clock jumps on, tokio's clock does not. A loss must be reported at
//! the resume (the product promises a loss signal that is never late), not as much later as the
//! suspend lasted, and the watchdog must renew at the resume a hold whose lease outlived the suspend.
//! Each test runs in a process of its own (nextest), as the simulated suspend is process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use distlock_core::clock;
use distlock_core::url::LockUrl;
use distlock_core::{LockState, Locks, MemoryBackend};

/// Far below the 30 s a tokio timer armed for the lease would still wait after the resume.
const PROMPT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_during_a_suspend_is_reported_at_the_resume() {
    // Renewals stall (the handle is cut off from the store soon after the grant).
    let url = LockUrl::parse("memory://suspend-loss?freeze_after=200ms").unwrap();
    let locks = Locks::new(MemoryBackend::from_url(&url).unwrap());
    let guard = Arc::new(
        locks
            .lock("s")
            .unwrap()
            .options()
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(guard.state(), LockState::Held);
    let mut changes = guard.state_changes();
    // A waiter already armed for the deadline before the suspend, as a real one would be.
    let lost = tokio::spawn({
        let guard = guard.clone();
        async move { guard.lost().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    clock::testing::suspend(Duration::from_secs(60));
    tokio::time::timeout(PROMPT, lost)
        .await
        .expect("lost() must resolve at the resume, not 30 s later")
        .unwrap();
    assert_eq!(guard.state(), LockState::Lost);
    // The watchdog publishes it too.
    tokio::time::timeout(PROMPT, changes.wait_for(|s| *s == LockState::Lost))
        .await
        .expect("state_changes() must report Lost at the resume")
        .unwrap();
    // A `lost()` called after the resume resolves at once.
    tokio::time::timeout(Duration::from_millis(100), guard.lost())
        .await
        .expect("lost() after the resume");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jeopardy_after_a_suspend_is_reported_at_the_resume() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let guard = Arc::new(
        locks
            .lock("j")
            .unwrap()
            .options()
            .lease(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap(),
    );
    backend.freeze();
    let jeopardy = tokio::spawn({
        let guard = guard.clone();
        async move { guard.jeopardy().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Past the renewal times, not past the deadline: the renewals fail (frozen), so the hold is in
    // Jeopardy with a few seconds left.
    clock::testing::suspend(Duration::from_secs(26));
    tokio::time::timeout(PROMPT, jeopardy)
        .await
        .expect("jeopardy() must resolve at the resume")
        .unwrap();
    assert_ne!(guard.state(), LockState::Held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_renews_at_the_resume_a_lease_that_outlived_the_suspend() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let guard = locks
        .lock("r")
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    // The watchdog is asleep, its timer armed for the renewal.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = backend.renewal_requests();
    // 25 s of the 30 s lease pass asleep: the renewal (due after 10 s) must go out at the resume, not
    // 10 s later on tokio's clock, by when the lease would have run out.
    clock::testing::suspend(Duration::from_secs(25));
    tokio::time::timeout(PROMPT, async {
        while backend.renewal_requests() == before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the watchdog must renew at the resume");
    let mut changes = guard.state_changes();
    tokio::time::timeout(PROMPT, changes.wait_for(|s| *s == LockState::Held))
        .await
        .expect("held again")
        .unwrap();
    // Past the old deadline (5 s after the resume) the renewed hold is still held.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(guard.state(), LockState::Held);
    assert!(guard.loss_reason().is_none());
    guard.release().await.unwrap();
}
