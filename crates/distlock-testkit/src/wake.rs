//! A release waking a waiter of another client: the shape of every "woken by the notification, not
//! the lease" test.

use std::time::Duration;

use distlock_core::{Lock, LockGuard};

/// Starts `waiter.acquire()` while `held` is held, checks that it is still waiting after 300 ms,
/// releases `held`, and returns the waiter's guard, which must come within `bound` (pick a bound well
/// under the lease and any poll, so that only the release's notification can meet it).
///
/// # Panics
/// If the waiter acquires while `held` is held, fails, or is not woken within `bound` (`why` says
/// what should have woken it).
pub async fn release_wakes(held: LockGuard, waiter: Lock, bound: Duration, why: &str) -> LockGuard {
    let waiting = tokio::spawn(async move { waiter.acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "acquired while {:?} was held",
        held.name()
    );
    if let Err(e) = held.release().await {
        panic!("release: {e}");
    }
    match tokio::time::timeout(bound, waiting).await {
        Ok(Ok(Ok(guard))) => guard,
        Ok(Ok(Err(e))) => panic!("the waiter failed: {e}"),
        Ok(Err(e)) => panic!("the waiter's task: {e}"),
        Err(_) => panic!("the waiter was not woken within {bound:?}: {why}"),
    }
}
