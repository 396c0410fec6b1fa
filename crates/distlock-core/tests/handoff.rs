//! The one-step handoff between waiters of one `Locks` (`Backend::hand_off`), on the memory backend
//! with `enable_hand_off`: the grant travels with the local gate, and a grant nobody can take is
//! released on the server, never left held.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use distlock_core::{ErrorKind, Locks, MemoryBackend};

fn handing() -> (MemoryBackend, Locks) {
    let backend = MemoryBackend::new();
    backend.enable_hand_off();
    (backend.clone(), Locks::new(backend))
}

/// Polls `fut` once (so an acquire queues at the local gate), without waiting for it.
async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *fut).poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// Waits until `name` can be taken at once by a new owner, for at most `limit`.
async fn free_within(locks: &Locks, name: &str, limit: Duration) -> bool {
    let probe = locks.lock(name).expect("lock");
    let until = tokio::time::Instant::now() + limit;
    loop {
        if let Ok(Some(guard)) = probe.try_acquire().await {
            guard.release().await.expect("release");
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_the_next_local_waiter_with_a_new_token() {
    let (backend, locks) = handing();
    let first = locks.lock("h").expect("lock");
    let second = locks.lock("h").expect("lock");
    let held = first.acquire().await.expect("acquire");
    let waiter = tokio::spawn(async move {
        let guard = second.acquire().await.expect("acquire");
        let token = guard.token();
        guard.release().await.expect("release");
        token
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let old = held.token();
    held.release().await.expect("the handing release succeeds");
    let new = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the waiter is granted")
        .expect("task");
    assert_eq!(
        backend.hand_offs(),
        1,
        "one handoff, no try of the waiter's"
    );
    assert!(
        new > old,
        "tokens increase across a handoff: {old:?} then {new:?}"
    );
}

/// The same owner id queued behind its own hold (two `Lock`s by `lock_as`) is not handed the lock:
/// to the engine they are one owner, and its acquire must not ride on its own release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_owner_next_in_line_is_not_handed_the_lock() {
    let (backend, locks) = handing();
    let first = locks.lock_as("same", "owner-1").expect("lock");
    let second = locks.lock_as("same", "owner-1").expect("lock");
    let held = first.acquire().await.expect("acquire");
    let waiter = tokio::spawn(async move {
        let guard = second.acquire().await.expect("acquire");
        guard.release().await.expect("release");
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    held.release().await.expect("release");
    tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the waiter acquires")
        .expect("task");
    assert_eq!(backend.hand_offs(), 0);
}

/// A waiter whose future is dropped after the handed grant reached it (not yet taken) releases the
/// grant and passes the gate on: the name is free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_with_a_handed_grant_unread_releases_it() {
    let (backend, locks) = handing();
    let first = locks.lock("dropped").expect("lock");
    let second = locks.lock("dropped").expect("lock");
    let held = first.acquire().await.expect("acquire");
    let mut waiting = Box::pin(second.acquire());
    assert!(
        poll_once(&mut waiting).await.is_none(),
        "queued at the gate"
    );
    held.release().await.expect("release");
    assert_eq!(backend.hand_offs(), 1, "the lock was handed to the waiter");
    drop(waiting);
    assert!(
        free_within(&locks, "dropped", Duration::from_millis(500)).await,
        "the grant nobody took was left held"
    );
    let info = locks.inspect("dropped").await.expect("inspect");
    assert!(info.holder.is_none(), "held by {:?}", info.holder);
}

/// A waiter that gives up (its wait limit) while the handoff is in flight leaves nothing held: the
/// grant made for it is released, and the next acquire succeeds at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_times_out_during_the_handoff_leaves_nothing_held() {
    let (backend, locks) = handing();
    let first = locks.lock("inflight").expect("lock");
    let second = locks.lock("inflight").expect("lock");
    let held = first.acquire().await.expect("acquire");
    let waiter = tokio::spawn(async move {
        second
            .options()
            .wait(Duration::from_millis(150))
            .acquire()
            .await
            .map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The handoff reaches the store 300 ms after it starts, after the waiter gave up.
    backend.delay_releases([Duration::from_millis(300)]);
    held.release().await.expect("release");
    let outcome = waiter.await.expect("task");
    assert_eq!(
        outcome.err().map(|e| e.kind()),
        Some(ErrorKind::Timeout),
        "the waiter gave up"
    );
    assert_eq!(backend.hand_offs(), 1, "the store granted the lock to it");
    assert!(
        free_within(&locks, "inflight", Duration::from_millis(500)).await,
        "the grant nobody took was left held"
    );
}
