//! A request's bound wakes no parked runtime (issue 9, the handoff's profile). Every request is bounded
//! by a tokio timer; registering a timer due before every timer the time driver knew of when it parked
//! wakes the driver (an eventfd write, and a parked worker woken for nothing). After an idle spell —
//! every handoff of the contended workload — a request's bound was such a timer. The link keeps an
//! earlier timer armed on its runtime while requests go out (`conn::Anchor`), so it no longer is.
//!
//! Counted, not timed: the write-type system calls of this process (`/proc/self/io`, `syscw`) per
//! acquire + release after a short timer sleep. Each request is one `writev` to the server and the
//! sleep's registration one eventfd write; without the anchor each acquire after the sleep also wrote
//! the time driver's eventfd (3 → 4 writes per cycle).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedisBackend;
use distlock_testkit::redis::RedisServer;

/// Write-type system calls of this process so far.
fn write_calls() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("syscw:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("syscw in /proc/self/io")
}

const CYCLES: u64 = 60;

#[tokio::test]
async fn a_request_after_an_idle_spell_wakes_no_parked_driver() {
    let server = RedisServer::start_or_panic();
    let backend = RedisBackend::connect(&LockUrl::parse(&server.url()).unwrap())
        .await
        .expect("connect");
    let locks = Locks::new(backend);
    let lock = locks
        .lock(&format!(
            "redis-test/timer-wakes/{}",
            uuid::Uuid::new_v4().simple()
        ))
        .unwrap();
    let cycle = || async {
        // The runtime parks on the sleep's timer, which then fires: the driver's wheel is left with
        // whatever else is armed.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let guard = lock.acquire().await.expect("acquire");
        guard.release().await.expect("release");
    };
    for _ in 0..5 {
        cycle().await;
    }
    let before = write_calls();
    for _ in 0..CYCLES {
        cycle().await;
    }
    let writes = write_calls() - before;
    // Per cycle: the two requests (acquire, release), and the sleep's own registration (the earliest
    // timer: it wakes the driver) — three writes. Without the anchor, four (the acquire's bound woke
    // the driver too). Half a write per cycle of slack for anything else.
    assert!(
        writes <= CYCLES * 3 + CYCLES / 2,
        "{writes} write calls for {CYCLES} cycles of two requests each: a request's bound woke the \
         time driver"
    );
    locks.close().await;
}
