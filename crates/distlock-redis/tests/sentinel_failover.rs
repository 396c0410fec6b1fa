//! Sentinel failover when the replica missed the lock (infra.md §2.4, safety.md §6.2): what distlock's
//! Redis backend can and cannot keep, per durability setting. Every test here has `fault` in its name,
//! so nextest runs them in the serial group.
//!
//! The recipe: `CLIENT PAUSE <ms> WRITE` on the replica ([`SentinelGroup::pause_replica_writes`]) stops
//! it applying the replication stream; a lock acquired on the master then never reaches it; kill -9 the
//! master, wait until every Sentinel names the replica and it reports `role:master`.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockGuard, LockState, Locks};
use distlock_redis::{layout, RedisBackend};
use distlock_testkit::redis::RespValue;
use distlock_testkit::sentinel::SentinelGroup;

/// Generous bound for "soon" on a loaded 2-core machine; mechanism bounds are added to it.
const PROMPT: Duration = Duration::from_secs(5);

async fn locks(url: &str) -> Locks {
    Locks::new(
        RedisBackend::connect(&LockUrl::parse(url).unwrap())
            .await
            .expect("connect through the Sentinels"),
    )
}

fn unique(case: &str) -> String {
    format!("failover/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn exists(reply: RespValue) -> i64 {
    reply.as_int().expect("EXISTS answers an integer")
}

/// Tries `lock` until a request reaches the promoted master: the first requests after the kill find
/// their connection dead (`Unavailable`), the next ones reconnect through the Sentinels.
async fn try_until_answered(lock: &distlock_core::Lock) -> Option<LockGuard> {
    let started = Instant::now();
    loop {
        match lock.try_acquire().await {
            Ok(answer) => return answer,
            Err(e) if started.elapsed() < PROMPT * 2 => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the promoted master never answered: {e}"),
        }
    }
}

/// Without `WAIT` (the default), a failover to a replica that missed the lock lets a second client
/// acquire it while the first guard still reads `Held`: two holders at once, with the **same** fencing
/// token, since the replica's counter also missed the increment. The first guard learns of it at its next
/// renewal (the key now has another owner on the promoted master) and goes `Lost` at once. This is the
/// documented unsafety (GUARANTEES.md, Redis); the test fails as "not reproduced" if the lock reached the
/// replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_without_wait_gives_two_holders_fault() {
    let mut group = SentinelGroup::start_or_panic();
    let url = group.url();
    let a = locks(&url).await;
    let b = locks(&url).await;
    let name = unique("no_wait");

    // Some history, replicated: the counter stands at 3 on both servers.
    for _ in 0..3 {
        a.lock(&name)
            .unwrap()
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    group.wait_replicated(PROMPT).unwrap();
    let token_key = layout::token_key(&name);
    assert_eq!(
        group
            .replica()
            .command(&["GET", &token_key])
            .unwrap()
            .as_str(),
        Some("3")
    );

    // The replica stops applying the stream; A acquires on the master with a 30 s lease (its first
    // renewal is 10 s away, so nothing but the failover touches it before B acquires).
    group.pause_replica_writes(Duration::from_secs(3)).unwrap();
    let lease = Duration::from_secs(30);
    let lock_a = a.lock(&name).unwrap();
    let guard_a = lock_a.options().lease(lease).acquire().await.unwrap();
    let token_a = guard_a.token().unwrap().get();
    assert_eq!(token_a, 4);
    // The replica serves reads while its writes are paused: it has not applied the grant.
    let on_replica = exists(group.replica().command(&["EXISTS", &name]).unwrap());
    group.master_mut().kill9().unwrap();
    assert_eq!(
        on_replica, 0,
        "not reproduced: the lock reached the replica before the master was killed"
    );

    group.wait_failover(Duration::from_secs(30)).unwrap();
    let promoted = group.master();
    assert_eq!(
        exists(promoted.command(&["EXISTS", &name]).unwrap()),
        0,
        "not reproduced: the promoted master has the lock"
    );

    // B acquires the same name on the promoted master while A's guard still believes it holds it.
    let lock_b = b.lock(&name).unwrap();
    let Some(guard_b) = try_until_answered(&lock_b).await else {
        panic!("not reproduced: the second acquire was refused, so the lock survived the failover");
    };
    assert_eq!(
        guard_a.state(),
        LockState::Held,
        "A should still believe it holds the lock (its first renewal is due {:?} after the grant)",
        lease / 3
    );
    assert_eq!(guard_b.state(), LockState::Held);
    // The counter lost A's increment too: B's token repeats A's. A resource that checks tokens
    // (accepting ≥ its high-water mark) accepts both holders' writes.
    let token_b = guard_b.token().unwrap().get();
    assert_eq!(
        token_b, token_a,
        "observed a token other than a repeat across the failover (A {token_a}, B {token_b})"
    );
    assert_eq!(
        promoted.command(&["GET", &token_key]).unwrap().as_str(),
        Some("4")
    );

    // A's next renewal reaches the promoted master (re-resolved through the Sentinels), finds B's field
    // and makes A Lost at once, long before A's validity deadline.
    tokio::time::timeout(lease / 3 + PROMPT, guard_a.lost())
        .await
        .expect("A must learn of the loss at its next renewal");
    let reason = guard_a.loss_reason().unwrap_or_default();
    assert!(reason.contains("another owner"), "{reason}");
    assert_eq!(guard_b.state(), LockState::Held);
    // A's late release does not delete B's lock.
    let err = guard_a.release().await.expect_err("A no longer holds it");
    assert!(
        matches!(err.kind(), ErrorKind::NotHeld | ErrorKind::LockLost),
        "{err}"
    );
    assert_eq!(exists(promoted.command(&["EXISTS", &name]).unwrap()), 1);
    guard_b.release().await.unwrap();
}

/// With `?wait_replicas=1&wait_timeout=200ms`, the same timeline cannot start: with replication stopped
/// the first acquire fails with `InsufficientReplicas { confirmed: 0, required: 1 }` and leaves no key
/// (the grant is undone). Once the replica applies the stream again, the same acquire succeeds; a held
/// lock whose renewal the replica does not confirm goes `Jeopardy` and back to `Held` when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_one_replica_refuses_unreplicated_grant_fault() {
    let group = SentinelGroup::start_or_panic();
    let url = format!("{}?wait_replicas=1&wait_timeout=200ms", group.url());
    let a = locks(&url).await;
    let name = unique("wait");

    let pause = Duration::from_millis(2500);
    let paused_at = Instant::now();
    group.pause_replica_writes(pause).unwrap();
    let lock = a.lock(&name).unwrap();
    let err = lock
        .try_acquire()
        .await
        .expect_err("no replica confirms while its writes are paused");
    assert!(
        paused_at.elapsed() < pause,
        "the acquire outlived the pause ({:?}); the test proves nothing",
        paused_at.elapsed()
    );
    assert_eq!(
        err.kind(),
        ErrorKind::InsufficientReplicas {
            confirmed: 0,
            required: 1
        },
        "{err}"
    );
    assert_eq!(
        exists(group.master().command(&["EXISTS", &name]).unwrap()),
        0
    );

    // The replica applies the stream again: the same acquire is confirmed.
    tokio::time::sleep(pause.saturating_sub(paused_at.elapsed())).await;
    group.wait_replicated(PROMPT).unwrap();
    let lease = Duration::from_secs(3);
    let guard = lock
        .options()
        .lease(lease)
        .wait(PROMPT)
        .acquire()
        .await
        .expect("confirmed by the replica");
    assert_eq!(
        exists(group.replica().command(&["EXISTS", &name]).unwrap()),
        1
    );

    // A renewal the replica does not confirm puts the guard in Jeopardy (not Lost: the key is still
    // there); a confirmed retry before the deadline makes it Held again.
    let pause = Duration::from_millis(1500);
    group.pause_replica_writes(pause).unwrap();
    tokio::time::timeout(pause + PROMPT, guard.jeopardy())
        .await
        .expect("an unconfirmed renewal means Jeopardy");
    let mut changes = guard.state_changes();
    tokio::time::timeout(
        lease + PROMPT,
        changes.wait_for(|s| *s != LockState::Jeopardy),
    )
    .await
    .expect("a confirmed renewal ends the Jeopardy")
    .unwrap();
    assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
    guard.release().await.unwrap();
}
