//! A standalone server restarted under a holder, with and without persistence: what happens to the lock
//! and to the fencing counter (GUARANTEES.md, Redis). Test names carry `fault` (nextest's serial group).
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::{LockState, Locks};
use distlock_redis::{layout, RedisBackend};
use distlock_testkit::redis::RedisServer;

const PROMPT: Duration = Duration::from_secs(5);

async fn locks(url: &str) -> Locks {
    Locks::new(
        RedisBackend::connect(&LockUrl::parse(url).unwrap())
            .await
            .expect("connect"),
    )
}

/// Waits (up to [`PROMPT`]) for a waiter's acquire, a task of its own, to connect the backend's
/// pub/sub hub. A fixed pause was not enough under load: the spawned acquire had not run yet.
async fn until_pubsub_connected(backend: &RedisBackend, what: &str) {
    let deadline = std::time::Instant::now() + PROMPT;
    while !backend.pubsub_connected() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} within {PROMPT:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn unique(case: &str) -> String {
    format!("restart/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// Without persistence the counter restarts with the server: the first token after the restart is 1,
/// lower than (or equal to) tokens already handed out. A resource that checks tokens then refuses new
/// holders until its high-water mark is passed again, and at that point accepts a token that an earlier
/// holder also had: tokens are best-effort across such a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_persistence_resets_tokens_fault() {
    let mut server = RedisServer::start_or_panic();
    let name = unique("tokens");
    let locks = locks(&server.url()).await;
    let mut before = 0;
    for _ in 0..3 {
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        before = guard.token().unwrap().get();
        guard.release().await.unwrap();
    }
    assert_eq!(before, 3);
    server.kill9().unwrap();
    server.restart().unwrap();
    let lock = locks.lock(&name).unwrap();
    let started = std::time::Instant::now();
    let guard = loop {
        // The first request finds its connection dead; the next one reconnects.
        match lock.try_acquire().await {
            Ok(Some(g)) => break g,
            Ok(None) => panic!("the lock survived a restart without persistence"),
            Err(_) if started.elapsed() < PROMPT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the restarted server never answered: {e}"),
        }
    };
    let after = guard.token().unwrap().get();
    assert_eq!(
        after, 1,
        "the counter did not restart (token {after} after {before})"
    );
    guard.release().await.unwrap();
}

/// With `appendonly yes` and `appendfsync always`, a kill -9 and restart keeps both: the holder's key
/// comes back with its absolute expiry, so the holder's renewals find it (Jeopardy while the server is
/// down, then Held again), nobody else gets the lock meanwhile, and the counter goes on from where it
/// was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_aof_always_keeps_lock_and_counter_fault() {
    let mut server = RedisServer::builder().durable().start_or_panic();
    let name = unique("aof");
    let holder = locks(&server.url()).await;
    let lease = Duration::from_secs(3);
    let guard = holder
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let token = guard.token().unwrap().get();
    server.kill9().unwrap();
    server.restart().unwrap();
    let restarted_at = std::time::Instant::now();
    assert_eq!(
        server.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(1),
        "the AOF did not bring the key back"
    );
    assert_eq!(
        server
            .command(&["GET", &layout::token_key(&name)])
            .unwrap()
            .as_str(),
        Some(token.to_string().as_str())
    );
    // Renewals over two lease periods reach the restarted server and find the key: never Lost, and
    // a renewal sent after the restart is confirmed (the validity deadline it set lies more than a
    // lease past the restart). Sampled at one instant the state may be Jeopardy, a renewal still
    // unanswered (seen under load: each write waits for the AOF's fsync), so the confirmation is
    // waited for (up to PROMPT), not assumed at the two leases' end.
    tokio::time::sleep(lease * 2).await;
    let confirmed_by = std::time::Instant::now() + PROMPT;
    loop {
        let state = guard.state();
        assert_ne!(state, LockState::Lost, "{:?}", guard.loss_reason());
        let renewed = guard
            .validity_deadline()
            .is_some_and(|d| d > restarted_at + lease);
        if state == LockState::Held && renewed {
            break;
        }
        assert!(
            std::time::Instant::now() < confirmed_by,
            "no renewal after the restart confirmed: {state:?}, validity {:?} after the restart",
            guard
                .validity_deadline()
                .map(|d| d.saturating_duration_since(restarted_at))
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A client connected after the restart (an idle connection from before it would fail its first
    // request with a broken pipe and reconnect on the next).
    let other = locks(&server.url()).await;
    let lock = other.lock(&name).unwrap();
    assert!(
        lock.try_acquire().await.unwrap().is_none(),
        "another client got the lock of a live holder after the restart"
    );
    guard.release().await.unwrap();
    let next = lock
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("free after release");
    assert!(next.token().unwrap().get() > token);
    next.release().await.unwrap();
}

/// The first request on a connection that sat idle through a server restart finds it broken: it is
/// retried once on a fresh connection instead of failing with `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_request_after_a_restart_reconnects_fault() {
    let mut server = RedisServer::start_or_panic();
    let locks = locks(&server.url()).await;
    let name = unique("reconnect");
    let lock = locks.lock(&name).unwrap();
    lock.acquire().await.unwrap().release().await.unwrap();
    server.kill9().unwrap();
    server.restart().unwrap();
    let guard = lock.try_acquire().await;
    assert!(
        matches!(guard, Ok(Some(_))),
        "the first acquire after the restart failed: {guard:?}"
    );
}

/// Once nobody waits, the pub/sub connection is not re-established after the server restarts: the hub
/// stays idle until someone waits again (and then still wakes that waiter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pubsub_stays_disconnected_after_a_restart_fault() {
    let mut server = RedisServer::start_or_panic();
    let url = LockUrl::parse(&server.url()).unwrap();
    let holder = locks(&server.url()).await;
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let waiter = Locks::new(backend.clone());
    let name = unique("idle_pubsub");
    assert!(
        !backend.pubsub_connected(),
        "connected before anyone waited"
    );
    // A wait connects the waiter's pub/sub hub.
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let lock = waiter.lock(&name).unwrap();
    let waiting = tokio::spawn(async move { (lock.acquire().await, lock) });
    until_pubsub_connected(&backend, "a waiter did not connect the hub").await;
    held.release().await.unwrap();
    let (got, lock) = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("woken")
        .unwrap();
    got.unwrap().release().await.unwrap();

    server.kill9().unwrap();
    server.restart().unwrap();
    // Longer than the hub's reconnect backoff (50 ms, growing to 2 s only while connects fail).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !backend.pubsub_connected(),
        "the hub reconnected although nobody waits"
    );

    // Waiting again reconnects the hub, and a release still wakes the waiter.
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    until_pubsub_connected(
        &backend,
        "a waiter after the restart did not reconnect the hub",
    )
    .await;
    held.release().await.unwrap();
    let got = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("woken after the restart");
    got.unwrap().unwrap().release().await.unwrap();
}
