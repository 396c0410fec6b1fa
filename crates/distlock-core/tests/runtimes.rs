//! A `Locks` outlives the runtimes that use it (issue #7, item 5): its background work (the watchdog,
//! releases of dropped guards) moves to a live runtime when the one it ran on is dropped, as with a
//! `Locks` in a `static` used by several `#[tokio::test]`s.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use distlock_core::MemoryBackend;
use distlock_core::{LockState, Locks};
use tokio::runtime::Runtime;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn current_thread_runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The reproduction: used on a first runtime, which is then dropped, then on a second one.
#[test]
fn a_hold_on_a_second_runtime_is_renewed_after_the_first_is_dropped() {
    let locks = Locks::new(MemoryBackend::new());
    let first = runtime();
    first.block_on(async {
        let guard = locks
            .lock("first")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        let guard = locks
            .lock("second")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
        guard.release().await.unwrap();
    });
}

/// The watchdog runs on the first runtime while a hold of the second one is acquired; the first one
/// is dropped and nobody acquires again: the second runtime's hold is still renewed.
#[test]
fn a_hold_is_renewed_after_the_watchdogs_runtime_is_dropped_without_another_acquire() {
    let (a, b) = {
        let backend = MemoryBackend::new();
        let other = backend.another_client();
        (Locks::new(backend), Locks::new(other))
    };
    let first = runtime();
    let kept = first.block_on(async {
        a.lock("kept")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap()
    });
    let second = current_thread_runtime();
    let guard = second.block_on(async {
        a.lock("later")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap()
    });
    drop(first);
    second.block_on(async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
        assert_eq!(kept.state(), LockState::Held, "{:?}", kept.loss_reason());
        let taken = b.lock("later").unwrap().try_acquire().await.unwrap();
        assert!(taken.is_none(), "the lease of a live guard expired");
        guard.release().await.unwrap();
        kept.release().await.unwrap();
    });
}

/// A guard whose runtime is gone is dropped outside any runtime: the release still happens (not only
/// when its 30 s lease runs out).
#[test]
fn a_guard_dropped_after_its_runtime_is_gone_still_releases() {
    let backend = MemoryBackend::new();
    let other = Locks::new(backend.another_client());
    let locks = Locks::new(backend);
    let first = runtime();
    let guard = first.block_on(async { locks.lock("orphan").unwrap().acquire().await.unwrap() });
    drop(first);
    drop(guard);
    let second = current_thread_runtime();
    second.block_on(async {
        assert_released(&other, "orphan").await;
    });
}

/// Another client gets `name` within 5 s: a dropped guard's release happened (not the 30 s lease).
async fn assert_released(other: &Locks, name: &str) {
    let got = other
        .lock(name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    assert!(got.is_ok(), "the dropped guard was not released: {got:?}");
}

/// A guard dropped at the end of a `#[tokio::test]`-style body: the release task is queued on the
/// runtime, which is dropped before it ever polls it. The release must still happen (on a thread of its
/// own), not wait for the 30 s lease.
#[test]
fn a_guard_dropped_as_its_runtime_ends_still_releases() {
    let backend = MemoryBackend::new();
    let other = Locks::new(backend.another_client());
    let locks = Locks::new(backend);
    let first = current_thread_runtime();
    first.block_on(async {
        let guard = locks.lock("at-end").unwrap().acquire().await.unwrap();
        drop(guard);
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), locks.close())
            .await
            .expect("close() did not return");
        assert_released(&other, "at-end").await;
    });
}

/// The watchdog's runtime is dropped with no other candidate; the hold's owner, now on another runtime,
/// acquires again (reentrant). That acquire restarts the watchdog, as a first acquire would, so the
/// hold is renewed instead of going Lost.
#[test]
fn a_reentrant_acquire_restarts_the_watchdog() {
    let locks = Locks::new(MemoryBackend::new());
    let lock = locks.lock("reentered").unwrap();
    let first = runtime();
    let guard = first.block_on(async {
        lock.options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap()
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        let again = lock
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(again.state(), LockState::Held, "{:?}", again.loss_reason());
        drop(again);
        guard.release().await.unwrap();
    });
}

/// A task that takes a while to drop: spread over a runtime's task list, it spaces out the drops of the
/// other tasks at shutdown, so a watchdog restarted elsewhere gets to look at its holds before the
/// renewal batch is dropped.
struct SlowDrop;

impl std::future::Future for SlowDrop {
    type Output = ();
    fn poll(self: std::pin::Pin<&mut Self>, _: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        std::task::Poll::Pending
    }
}

impl Drop for SlowDrop {
    fn drop(&mut self) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The watchdog's runtime is dropped while its renewal batch waits for a slow reply. The holds of that
/// batch are freed for the next renewal, and the watchdog restarted on another runtime must renew them,
/// not sleep until their deadline (they would go Lost while their owner is alive and connected).
/// Repeated, as the order in which tokio drops a runtime's tasks varies with their ids.
#[test]
fn holds_of_a_batch_dropped_with_its_runtime_are_renewed_by_the_restarted_watchdog() {
    // 2 s: the runtime's drop takes 0.4 s (the `SlowDrop`s) and the batch goes out a third into the
    // lease, so a 1 s lease left a loaded machine ~0.25 s for the restarted watchdog's renewal (it
    // failed once in a review's loaded run).
    let lease = Duration::from_secs(2);
    let second = runtime();
    for round in 0..4 {
        let backend = MemoryBackend::new();
        let locks = Locks::new(backend.clone());
        let first = runtime();
        let name = format!("batch-{round}");
        let kept = first.block_on(async {
            let kept = locks
                .lock(&format!("{name}-first"))
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap();
            for _ in 0..8 {
                tokio::spawn(SlowDrop);
            }
            kept
        });
        let guard = second.block_on(async {
            locks
                .lock(&name)
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap()
        });
        // The first renewal's reply comes long after the lease.
        backend.delay_renewals([Duration::from_secs(30)]);
        second.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), async {
                while backend.renewal_requests() < 1 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("the renewal was not sent");
        });
        drop(first);
        second.block_on(async {
            tokio::time::sleep(lease + lease / 2).await;
            assert_eq!(
                guard.state(),
                LockState::Held,
                "round {round}: {:?}",
                guard.loss_reason()
            );
            guard.release().await.unwrap();
            drop(kept);
        });
    }
}

/// A guard is dropped on a multi-thread runtime, whose worker starts the release at once; the runtime
/// is dropped while the release is under way (its request slow to reach the store). The release must
/// still happen, and `close()` wait for it, not leave the key to its 30 s lease.
#[test]
fn a_release_under_way_when_its_runtime_is_dropped_still_happens() {
    let backend = MemoryBackend::new();
    let other = Locks::new(backend.another_client());
    let locks = Locks::new(backend.clone());
    let first = runtime();
    first.block_on(async {
        let guard = locks.lock("under-way").unwrap().acquire().await.unwrap();
        backend.delay_releases([Duration::from_secs(1)]);
        drop(guard);
        // The worker has started the release, which now waits for its request to reach the store.
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), locks.close())
            .await
            .expect("close() did not return");
        let taken = other
            .lock("under-way")
            .unwrap()
            .try_acquire()
            .await
            .unwrap();
        assert!(
            taken.is_some(),
            "close() returned while the dropped guard's key is still on the store"
        );
    });
}

/// The watchdog went with a dropped runtime and nothing restarted it; the guard's owner, now on another
/// runtime, only watches `state_changes()`. The client is cut off, so the hold goes Lost at its
/// deadline: the channel must say so then (it is the watchdog that publishes a loss by time), as
/// `lost()` would.
#[test]
fn state_changes_reports_a_loss_after_the_watchdogs_runtime_is_dropped() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let first = runtime();
    let guard = first.block_on(async {
        locks
            .lock("watched")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap()
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        let mut changes = guard.state_changes();
        backend.freeze();
        tokio::time::timeout(
            Duration::from_secs(5),
            changes.wait_for(|state| *state == LockState::Lost),
        )
        .await
        .expect("state_changes() never reported the loss")
        .unwrap();
    });
}

/// A `Locks` is first used on a current-thread runtime that is kept but idle (a sync helper that calls
/// `block_on` now and then), then on a multi-thread runtime that runs all along. The watchdog started on
/// the idle runtime never runs there; the hold on the running runtime must still be renewed.
#[test]
fn a_hold_on_a_running_runtime_is_renewed_while_the_first_runtime_idles() {
    let locks = Locks::new(MemoryBackend::new());
    let idle = current_thread_runtime();
    idle.block_on(async {
        let guard = locks
            .lock("first")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    });
    let running = runtime();
    running.block_on(async {
        let guard = locks
            .lock("second")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
        guard.release().await.unwrap();
    });
    drop(idle);
}

/// A guard acquired on a current-thread runtime is dropped on a plain thread while that runtime is kept
/// but idle: the release must not wait in its queue for the next `block_on` (the key would stay until
/// its lease ran out, and `close()` would not return).
#[test]
fn a_guard_dropped_outside_any_runtime_is_released_while_its_runtime_idles() {
    let backend = MemoryBackend::new();
    let other = Locks::new(backend.another_client());
    let locks = Locks::new(backend);
    let idle = current_thread_runtime();
    let guard = idle.block_on(async { locks.lock("idling").unwrap().acquire().await.unwrap() });
    drop(guard);
    let second = current_thread_runtime();
    second.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), locks.close())
            .await
            .expect("close() did not return");
        let taken = other.lock("idling").unwrap().try_acquire().await.unwrap();
        assert!(taken.is_some(), "the dropped guard was not released");
    });
    drop(idle);
}

/// A runtime dropped after the watchdog spawned a renewal batch but before the batch first ran (tokio
/// drops such a task unpolled). The hold must be free for the next renewal: `extend` must not wait
/// forever for a renewal that never started, and the hold must go on being renewed.
///
/// Made deterministic with a current-thread runtime polling one task per turn: the watchdog's scan
/// that spawns the batch also marks a second hold Lost (its `max_hold`), which the `block_on` future
/// watches to return right after that scan.
#[test]
fn a_renewal_batch_dropped_before_it_ran_does_not_block_the_hold() {
    let locks = Locks::new(MemoryBackend::new());
    let first = tokio::runtime::Builder::new_current_thread()
        .event_interval(1)
        .enable_all()
        .build()
        .unwrap();
    let (renewed, _ended) = first.block_on(async {
        let renewed = locks
            .lock("renewed")
            .unwrap()
            .options()
            .lease(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        // Its deadline (with max_hold 1 s) comes when `renewed` is due (1 s, within an eighth of it).
        let ended = locks
            .lock("ended")
            .unwrap()
            .options()
            .max_hold(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        let changes = ended.state_changes();
        while *changes.borrow() != LockState::Lost {
            tokio::task::yield_now().await;
        }
        (renewed, ended)
    });
    drop(first);
    let second = current_thread_runtime();
    second.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(5),
            renewed.extend(Duration::from_secs(3)),
        )
        .await
        .expect("extend waits for a renewal that never started")
        .unwrap();
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert_eq!(
            renewed.state(),
            LockState::Held,
            "{:?}",
            renewed.loss_reason()
        );
    });
}

/// The only hold's runtime (and the watchdog's) is dropped, and its holder goes on without any runtime
/// and without calling distlock: the lease is still renewed (on distlock's background runtime), so
/// another client cannot take the lock from a live holder.
#[test]
fn the_only_holds_lease_is_renewed_after_every_runtime_is_gone() {
    let backend = MemoryBackend::new();
    let other = Locks::new(backend.another_client());
    let locks = Locks::new(backend);
    let first = runtime();
    let guard = first.block_on(async {
        locks
            .lock("alone")
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap()
    });
    drop(first);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
    let second = current_thread_runtime();
    second.block_on(async {
        let taken = other.lock("alone").unwrap().try_acquire().await.unwrap();
        assert!(taken.is_none(), "the lease of a live guard expired");
        guard.release().await.unwrap();
    });
}

/// A sync helper's pattern: each call runs in `block_on` of a current-thread runtime of its own thread
/// (kept, idle between calls). The first call's hold ended and the watchdog task found no hold before
/// that `block_on` returned; a hold of the next call, on another current-thread runtime, must be renewed
/// (a task that stays on the idle runtime after its last hold never runs there).
#[test]
fn a_hold_on_a_second_current_thread_runtime_is_renewed_after_the_first_idles() {
    let locks = Locks::new(MemoryBackend::new());
    let lease = Duration::from_millis(300);
    let idle = current_thread_runtime();
    idle.block_on(async {
        let guard = locks
            .lock("first")
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
        // Past the released hold's renewal time: the task looks, and finds no hold.
        tokio::time::sleep(Duration::from_millis(200)).await;
    });
    let second = current_thread_runtime();
    second.block_on(async {
        let guard = locks
            .lock("second")
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
        guard.release().await.unwrap();
    });
    drop(idle);
}
