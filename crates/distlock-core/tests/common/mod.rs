//! Helpers of the renewal tests on the memory backend (`renewals.rs`, `review_batch.rs`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use distlock_core::MemoryBackend;
use distlock_core::{LockGuard, LockState, Locks};
use tokio::time::Instant;

/// A client `a` (with its backend handle, for the test facilities) and a second client `b`.
pub fn two_clients() -> (MemoryBackend, Locks, Locks) {
    let a = MemoryBackend::new();
    let b = a.another_client();
    (a.clone(), Locks::new(a), Locks::new(b))
}

/// Waits until `count` renew calls have reached the store.
pub async fn until_renewal_requests(backend: &MemoryBackend, count: u64, within: Duration) {
    tokio::time::timeout(within, async {
        while backend.renewal_requests() < count {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the renewal was not sent");
}

/// The oracle: for `watch`, whenever `b` can take the lock (the key is gone from the store), `guard`
/// must not say `Held`. Returns whether `b` took it.
pub async fn b_takes_it_only_when_not_held(guard: &LockGuard, b: &Locks, watch: Duration) -> bool {
    let lock = b.lock(guard.name()).unwrap();
    let end = Instant::now() + watch;
    while Instant::now() < end {
        if let Some(taken) = lock.try_acquire().await.unwrap() {
            assert_ne!(
                guard.state(),
                LockState::Held,
                "another client holds {} while the guard says Held (deadline {:?} from now)",
                guard.name(),
                guard
                    .validity_deadline()
                    .map(|d| d.saturating_duration_since(std::time::Instant::now()))
            );
            drop(taken);
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}
