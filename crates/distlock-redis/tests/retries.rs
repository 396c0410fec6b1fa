//! Requests under faults (issue #7): a release whose reply was lost, an undo racing the delayed acquire
//! it undoes, renewals beside acquires stuck in `WAIT`, a deleted or overwritten key, and a `Locks`
//! moved to a second runtime. Real `redis-server`s, faults from the testkit's TCP proxy and `SIGSTOP`.
//! Test names carry `fault` (nextest's serial group).
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use distlock_core::raw::{AcquireRequest, Attempt, Backend, Released};
use distlock_core::retry::RetryPolicy;
use distlock_core::url::Endpoint;
use distlock_core::{ErrorKind, Locks};
use distlock_redis::{RedisBackend, RedisConfig};
use distlock_testkit::proxy::Proxy;
use distlock_testkit::redis::{RedisServer, RespValue};

fn unique(case: &str) -> String {
    format!("retries/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::new(addr.ip().to_string(), addr.port())
}

async fn backend_at(addr: SocketAddr, io: Duration) -> RedisBackend {
    let config = RedisConfig::new(endpoint(addr)).with_request_timeout(io);
    RedisBackend::from_config(config).await.expect("connect")
}

fn exists(server: &RedisServer, key: &str) -> bool {
    server.command(&["EXISTS", key]).unwrap().as_int() == Some(1)
}

/// Loads the scripts (an acquire and a release): a request delayed in the proxy must be the script
/// itself, not an `EVALSHA` the server refuses as unknown.
async fn warm_up(backend: &RedisBackend) {
    let locks = Locks::new(backend.clone());
    let guard = locks
        .lock(&unique("warm"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
}

/// A delayed acquire of `name` lands around `lands_at`; within `within` after that (far below the 30 s
/// lease) it must have run — its fencing counter exists, so the test really raced an undo against it —
/// and nothing of it may remain. Polls to the end rather than trusting one look before the acquire landed.
async fn assert_the_acquire_ran_and_was_undone(
    server: &RedisServer,
    name: &str,
    lands_at: Instant,
    within: Duration,
) {
    let bound = lands_at + within;
    let counter = distlock_redis::layout::token_key(name);
    loop {
        let ran = exists(server, &counter);
        let held = exists(server, name);
        if ran && !held {
            return;
        }
        assert!(
            Instant::now() < bound,
            "{}",
            if ran {
                format!(
                    "an orphan grant outlives the undo: pttl {:?} ms",
                    server.command(&["PTTL", name]).unwrap().as_int()
                )
            } else {
                "the delayed acquire never reached the server: the test raced nothing".to_string()
            }
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Loses the reply of the release sent now: the proxy holds each chunk 1 s, so the request reaches the
/// server after 1 s; once the server ran it (`key` is gone), and before the reply gets back, every
/// proxied connection is reset.
async fn lose_the_reply_of<T: Send + 'static>(
    proxy: &Proxy,
    server: &RedisServer,
    key: &str,
    request: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    proxy.delay(Duration::from_secs(1)).unwrap();
    let task = tokio::spawn(request);
    let started = Instant::now();
    while exists(server, key) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the release never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.pass().unwrap();
    proxy.reset().unwrap();
    task.await.unwrap()
}

/// Takes a free lock through the raw backend, then releases it with the reply lost (see
/// [`lose_the_reply_of`]); checks that the first attempt ran, and returns what the release reported.
async fn raw_release_with_lost_reply(
    backend: &RedisBackend,
    proxy: &Proxy,
    server: &RedisServer,
    prefix: &str,
) -> distlock_core::Result<Released> {
    let name = unique(prefix);
    let request = AcquireRequest::new(&name, "owner-a:1", Duration::from_secs(30));
    let mut acquisition = backend.begin(&request).unwrap();
    let Attempt::Acquired(grant) = backend
        .try_acquire(&mut acquisition, &request)
        .await
        .unwrap()
    else {
        panic!("free lock not granted");
    };
    let raw = backend.clone();
    let (n, o) = (name.clone(), request.owner.clone());
    let outcome = lose_the_reply_of(proxy, server, &name, async move {
        raw.release(&grant.lease, &n, &o).await
    })
    .await;
    assert!(!exists(server, &name), "the first attempt did not run");
    outcome
}

/// The reply of a release is lost and the connection reset; the release is retried on a fresh
/// connection and finds nothing of this owner's (the first attempt deleted the key). The backend must
/// not answer `NotHeld` (that means "not yours any more", and `distlock run` exits 76 on it): it answers
/// `Unavailable`, saying the outcome is unknown. The guard's release reports the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_release_reply_is_ambiguous_not_not_held_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let backend = backend_at(proxy.addr(), Duration::from_secs(5)).await;
    warm_up(&backend).await;

    // Backend level.
    let outcome = raw_release_with_lost_reply(&backend, &proxy, &server, "release-raw").await;
    match outcome {
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
            assert!(e.to_string().contains("unknown"), "{e}");
        }
        Ok(Released::NotHeld) => panic!("a release whose reply was lost reported NotHeld"),
        Ok(other) => panic!("unexpected {other:?}"),
    }

    // Through the guard.
    let locks = Locks::new(backend.clone());
    let name = unique("release-guard");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let outcome =
        lose_the_reply_of(&proxy, &server, &name, async move { guard.release().await }).await;
    let e = outcome.expect_err("the outcome is unknown");
    assert_ne!(e.kind(), ErrorKind::NotHeld, "{e}");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
}

/// An acquire is delayed on its way (the proxy holds it 3 s) and times out at the 1 s request bound;
/// the core abandons it and the backend sends the undo. The undo must not overtake the acquire: once
/// the acquire lands, nothing of it may stay on the server for the 30 s lease (on a fresh connection
/// the undo arrives first, finds nothing, and the late acquire leaves an orphan grant).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_is_not_overtaken_by_the_delayed_acquire_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let backend = backend_at(proxy.addr(), Duration::from_secs(1)).await;
    warm_up(&backend).await;
    let locks = Locks::new(backend);
    let name = unique("undo");
    let lock = locks.lock(&name).unwrap();

    let delay = Duration::from_secs(3);
    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let attempt = tokio::spawn(async move { lock.try_acquire().await.map(|g| g.is_some()) });
    // The acquire is on its way (held in the proxy); new traffic passes at once from now on (before the
    // acquire times out at 1 s and is undone).
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.pass().unwrap();
    let outcome = attempt.await.unwrap();
    assert!(outcome.is_err(), "the acquire should time out: {outcome:?}");
    assert_eq!(outcome.unwrap_err().kind(), ErrorKind::Unavailable);

    // The acquire lands at `delay`.
    assert_the_acquire_ran_and_was_undone(&server, &name, started + delay, Duration::from_secs(3))
        .await;
    // And the name is free for others.
    let other = Locks::new(backend_at(server.addr(), Duration::from_secs(5)).await);
    assert!(other
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_some());
}

/// As above, but the caller drops the acquire future while the acquire is held in the proxy (no
/// timeout): the core undoes it in the background, and the undo still runs after the acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_of_a_dropped_acquire_runs_after_it_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let backend = backend_at(proxy.addr(), Duration::from_secs(5)).await;
    warm_up(&backend).await;
    let locks = Locks::new(backend);
    let name = unique("undo-dropped");
    let lock = locks.lock(&name).unwrap();

    let delay = Duration::from_secs(2);
    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let attempt = tokio::spawn(async move { lock.try_acquire().await.map(|g| g.is_some()) });
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.pass().unwrap();
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());

    assert_the_acquire_ran_and_was_undone(&server, &name, started + delay, Duration::from_secs(3))
        .await;
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Holder and waiter on one backend (two `Locks` on clones of it): `waiter` waits for `name` while
/// `holder` holds it with a 30 s lease, then the holder releases; the waiter must be woken by the
/// release message (pub/sub), not by the lease's end. The release waits until the waiter has subscribed
/// to the release channel on `server`, so the wake-up cannot come from an early try instead.
async fn contended_wait_is_woken(server: &RedisServer, holder: &Locks, waiter: &Locks, name: &str) {
    let guard = holder
        .lock(name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let lock = waiter.lock(name).unwrap();
    let waiting = tokio::spawn(async move {
        let guard = lock
            .options()
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .expect("acquired");
        guard.release().await.unwrap();
        Instant::now()
    });
    let channel = distlock_redis::layout::channel(name);
    let subscribed_by = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = server.command(&["PUBSUB", "NUMSUB", &channel]).unwrap();
        let subscribers = match reply {
            RespValue::Array(items) => items.get(1).and_then(RespValue::as_int),
            _ => None,
        };
        if subscribers.is_some_and(|n| n >= 1) {
            break;
        }
        assert!(
            Instant::now() < subscribed_by,
            "the waiter never subscribed to {channel}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let released = Instant::now();
    guard.release().await.unwrap();
    let acquired = tokio::time::timeout(Duration::from_secs(25), waiting)
        .await
        .expect("the waiter finished")
        .unwrap();
    assert!(
        acquired - released < Duration::from_secs(5),
        "the waiter woke {:?} after the release: not by pub/sub (the lease was 30 s)",
        acquired - released
    );
}

/// A `Locks` on Redis used on a first runtime (a hold, and a contended wait, so the pub/sub hub and the
/// connections start there), which is then dropped, and used again on a second runtime: a hold with a
/// 1 s lease is still renewed after 3 s, and a waiter is still woken by pub/sub.
#[test]
fn a_backend_keeps_working_on_a_second_runtime() {
    let server = RedisServer::start_or_panic();
    let first = runtime();
    let (holder, waiter) = first.block_on(async {
        let backend = backend_at(server.addr(), Duration::from_secs(5)).await;
        let (holder, waiter) = (Locks::new(backend.clone()), Locks::new(backend));
        let guard = holder
            .lock(&unique("rt1"))
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
        contended_wait_is_woken(&server, &holder, &waiter, &unique("rt1-wait")).await;
        (holder, waiter)
    });
    drop(first);
    // As `#[tokio::test]` makes them: a current-thread runtime.
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let guard = holder
            .lock(&unique("rt2"))
            .unwrap()
            .options()
            .lease(Duration::from_secs(1))
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            guard.state(),
            distlock_core::LockState::Held,
            "{:?}",
            guard.loss_reason()
        );
        guard.release().await.unwrap();
        contended_wait_is_woken(&server, &holder, &waiter, &unique("rt2-wait")).await;
    });
}

/// A master and a replica of it, the replication link up.
fn master_and_replica() -> (RedisServer, RedisServer) {
    let master = RedisServer::builder()
        .args(["--repl-diskless-sync-delay", "0"])
        .start_or_panic();
    let replica = RedisServer::builder()
        .args(["--replicaof", "127.0.0.1"])
        .arg(master.port().to_string())
        .start_or_panic();
    let started = Instant::now();
    loop {
        let info = replica.command(&["INFO", "replication"]).unwrap();
        if info
            .as_str()
            .is_some_and(|i| i.contains("master_link_status:up"))
        {
            return (master, replica);
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replica never linked up: {info}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// With `wait_replicas`, an acquire stuck in `WAIT` (the replica is stopped; `wait_timeout` 25 s) does
/// not hold back the renewal of another lock of the same backend: with the default 30 s lease the
/// renewal is due after 10 s and must reach the master then (its pttl back near 30 s), not after the
/// acquire's `WAIT` ends. Once the replica runs again, both are confirmed and the hold is still Held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_does_not_queue_behind_an_acquire_in_wait_fault() {
    let (master, mut replica) = master_and_replica();
    let config =
        RedisConfig::new(endpoint(master.addr())).with_wait_replicas(1, Duration::from_secs(25));
    let backend = RedisBackend::from_config(config).await.expect("connect");
    let locks = Locks::new(backend);
    let held = unique("held");
    let guard = locks.lock(&held).unwrap().acquire().await.unwrap();
    let acquired = Instant::now();

    replica.pause().unwrap();
    let stuck = locks.lock(&unique("stuck")).unwrap();
    let stuck = tokio::spawn(async move { stuck.try_acquire().await.map(|g| g.is_some()) });

    // The renewal is due at a third of the lease; give it 3 s more to reach the master.
    let renewal_due = acquired + Duration::from_secs(10);
    let bound = renewal_due + Duration::from_secs(3);
    tokio::time::sleep_until(renewal_due.into()).await;
    loop {
        let pttl = master.command(&["PTTL", &held]).unwrap().as_int().unwrap();
        if pttl > 25_000 {
            break;
        }
        assert!(
            Instant::now() < bound,
            "the renewal has not reached the master {:?} after it was due (pttl {pttl} ms): it queues behind the acquire in WAIT",
            renewal_due.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!stuck.is_finished(), "the acquire was not stuck in WAIT");

    replica.resume().unwrap();
    let granted = tokio::time::timeout(Duration::from_secs(30), stuck)
        .await
        .expect("the acquire finished")
        .unwrap();
    assert_eq!(granted.as_ref().ok(), Some(&true), "{granted:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        guard.state(),
        distlock_core::LockState::Held,
        "{:?}",
        guard.loss_reason()
    );
    guard.release().await.unwrap();
}

/// With the default 30 s lease, a holder's key deleted, overwritten with another owner's hash, or
/// overwritten with another type (an operator breaking a stuck lock, a foreign client) makes the guard
/// Lost at the next renewal, a third of the lease after the grant, with the server's reason: not at the
/// lease's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_or_overwritten_key_is_lost_at_the_next_renewal_fault() {
    let server = RedisServer::start_or_panic();
    let locks = Locks::new(backend_at(server.addr(), Duration::from_secs(5)).await);
    let names = [unique("deleted"), unique("other-owner"), unique("string")];
    let mut guards = Vec::new();
    for name in &names {
        guards.push(locks.lock(name).unwrap().acquire().await.unwrap());
    }
    let acquired = Instant::now();
    let ok = |v: distlock_testkit::redis::RespValue| assert!(!v.is_error(), "{v}");
    ok(server.command(&["DEL", &names[0]]).unwrap());
    ok(server
        .command(&[
            "EVAL",
            "redis.call('del', KEYS[1]); redis.call('hset', KEYS[1], 'someone-else:1', 1); return redis.call('pexpire', KEYS[1], 30000)",
            "1",
            &names[1],
        ])
        .unwrap());
    ok(server.command(&["SET", &names[2], "x"]).unwrap());

    let lease = Duration::from_secs(30);
    let bound = lease / 3 + Duration::from_secs(2);
    for (guard, expected) in guards.iter().zip(["gone", "another owner", "another type"]) {
        tokio::time::timeout_at((acquired + bound).into(), guard.lost())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{}: not Lost within {bound:?} of the grant (the next renewal is due at a third of the lease)",
                    guard.name()
                )
            });
        let reason = guard.loss_reason().unwrap_or_default();
        assert!(reason.contains(expected), "{}: {reason}", guard.name());
    }
    assert!(
        acquired.elapsed() >= lease / 3 - Duration::from_secs(1),
        "Lost before the renewal was due: {:?}",
        acquired.elapsed()
    );
}

/// With `wait_replicas` and a `wait_timeout` longer than the request bound (15 s here, the 5 s default
/// request bound), an acquire whose future is dropped while its `WAIT` blocks (the replica is stopped)
/// must still be undone once the `WAIT` ends: the undo queues behind it on the same connection, so that
/// connection must stay open until then. Closing it earlier makes the server drop the blocked client
/// with the undo unread, and the grant stays for the whole 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_of_an_acquire_dropped_in_wait_is_not_lost_fault() {
    let (master, mut replica) = master_and_replica();
    let wait_timeout = Duration::from_secs(15);
    let config = RedisConfig::new(endpoint(master.addr())).with_wait_replicas(1, wait_timeout);
    let backend = RedisBackend::from_config(config).await.expect("connect");
    let locks = Locks::new(backend);
    let name = unique("undo-in-wait");
    let lock = locks.lock(&name).unwrap();

    replica.pause().unwrap();
    let started = Instant::now();
    let attempt = tokio::spawn(async move { lock.try_acquire().await.map(|g| g.is_some()) });
    // The acquire ran on the master and blocks in WAIT; the caller gives up.
    let granted_at = started + Duration::from_secs(1);
    while !exists(&master, &name) {
        assert!(
            Instant::now() < granted_at,
            "the acquire never reached the master"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep_until(granted_at.into()).await;
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());

    // The WAIT ends at `wait_timeout`; the undo queued behind it must run then, long before the lease.
    let bound = started + wait_timeout + Duration::from_secs(3);
    while exists(&master, &name) {
        assert!(
            Instant::now() < bound,
            "an orphan grant outlives the WAIT it was undone behind: pttl {:?} ms",
            master.command(&["PTTL", &name]).unwrap().as_int()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    replica.resume().unwrap();
}

/// A one-node Redis Cluster reached through `proxy` only: the node announces the proxy's port, so the
/// Cluster client's node connections go through it too.
fn cluster_node_behind_a_proxy() -> (RedisServer, Proxy) {
    let node = RedisServer::builder()
        .with_cluster_bus()
        .args(["--cluster-enabled", "yes"])
        .args(["--cluster-config-file", "nodes.conf"])
        .start_or_panic();
    let proxy = Proxy::start_or_panic(node.addr());
    let ok = |v: distlock_testkit::redis::RespValue| assert!(!v.is_error(), "{v}");
    ok(node
        .command(&["CONFIG", "SET", "cluster-announce-ip", "127.0.0.1"])
        .unwrap());
    ok(node
        .command(&[
            "CONFIG",
            "SET",
            "cluster-announce-port",
            &proxy.port().to_string(),
        ])
        .unwrap());
    ok(node
        .command(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
        .unwrap());
    let started = Instant::now();
    loop {
        let info = node.command(&["CLUSTER", "INFO"]).unwrap();
        let slots = node.command(&["CLUSTER", "SLOTS"]).unwrap();
        if info
            .as_str()
            .is_some_and(|i| i.contains("cluster_state:ok"))
            && slots.to_string().contains(&proxy.port().to_string())
        {
            return (node, proxy);
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the one-node cluster is not ready: {info} {slots}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Redis Cluster: the reply of a release is lost and the connection reset. The Cluster client must not
/// resend the release behind distlock's back and answer `NotHeld` from the resend: the outcome is
/// unknown (`Unavailable`), as on a single server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_lost_release_reply_is_not_not_held_fault() {
    let (node, proxy) = cluster_node_behind_a_proxy();
    let config = RedisConfig::cluster(vec![endpoint(proxy.addr())]);
    let backend = RedisBackend::from_config(config).await.expect("connect");
    warm_up(&backend).await;

    let outcome = raw_release_with_lost_reply(&backend, &proxy, &node, "cluster-release").await;
    match outcome {
        Err(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}"),
        Ok(Released::NotHeld) => panic!("a Cluster release whose reply was lost reported NotHeld"),
        Ok(other) => panic!("unexpected {other:?}"),
    }
}

/// An acquire is delayed on its way (3 s) and times out at the 1 s request bound; the undo queued
/// behind it on its connection is still on its way when `try_acquire` returns the error. The same
/// `Lock` (the same owner) tries again at once and is granted on a fresh connection. The late acquire
/// and then its undo land after that grant: the undo must not delete the new hold of the same owner
/// (the core would call it Held while another client takes the lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_undo_does_not_delete_the_same_owners_next_hold_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let backend = backend_at(proxy.addr(), Duration::from_secs(1)).await;
    let other = backend_at(server.addr(), Duration::from_secs(5)).await;
    late_undo_spares_the_next_hold(backend, other, &server, &proxy).await;
}

/// The same in Redis Cluster (a one-node Cluster behind the proxy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_late_undo_does_not_delete_the_same_owners_next_hold_fault() {
    let (node, proxy) = cluster_node_behind_a_proxy();
    let cluster = |io| RedisConfig::cluster(vec![endpoint(proxy.addr())]).with_request_timeout(io);
    let backend = RedisBackend::from_config(cluster(Duration::from_secs(1)))
        .await
        .expect("connect");
    let other = RedisBackend::from_config(cluster(Duration::from_secs(5)))
        .await
        .expect("connect");
    late_undo_spares_the_next_hold(backend, other, &node, &proxy).await;
}

async fn late_undo_spares_the_next_hold(
    backend: RedisBackend,
    other: RedisBackend,
    server: &RedisServer,
    proxy: &Proxy,
) {
    warm_up(&backend).await;
    let locks = Locks::new(backend);
    let name = unique("late-undo");
    let lock = locks.lock(&name).unwrap();

    let delay = Duration::from_secs(3);
    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let first = {
        let attempt = lock.try_acquire();
        tokio::pin!(attempt);
        tokio::select! {
            outcome = &mut attempt => outcome.map(|g| g.is_some()),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                // Held in the proxy; from now on new traffic passes at once.
                proxy.pass().unwrap();
                attempt.await.map(|g| g.is_some())
            }
        }
    };
    assert!(first.is_err(), "the acquire should time out: {first:?}");
    // Try again until granted (an attempt may fail while the earlier undo is on its way).
    let guard = loop {
        match lock.try_acquire().await {
            Ok(Some(guard)) => break guard,
            Ok(None) => panic!("the lock is held by someone else"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "never granted: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // The late acquire and its undo have landed by `delay` and a bit.
    tokio::time::sleep_until((started + delay + Duration::from_millis(1500)).into()).await;
    assert_eq!(guard.state(), distlock_core::LockState::Held);
    let other = Locks::new(other);
    let stolen = other.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(
        stolen.is_none(),
        "two holders: the late undo deleted the same owner's new hold (key exists: {})",
        exists(server, &name)
    );
    guard.release().await.unwrap();
}

/// A release is delayed on its way (3 s) and times out at the 1 s request bound (`Unavailable`). The
/// same `Lock` (the same owner) acquires again at once: the late release must not delete that new
/// hold when it lands (the core would call it Held while another client takes the lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_release_does_not_delete_the_same_owners_next_hold_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let backend = backend_at(proxy.addr(), Duration::from_secs(1)).await;
    let other = Locks::new(backend_at(server.addr(), Duration::from_secs(5)).await);
    warm_up(&backend).await;
    let locks = Locks::new(backend);
    let name = unique("late-release");
    let lock = locks.lock(&name).unwrap();
    let first = lock.acquire().await.unwrap();

    let delay = Duration::from_secs(3);
    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let released = {
        let release = first.release();
        tokio::pin!(release);
        tokio::select! {
            outcome = &mut release => outcome,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                proxy.pass().unwrap();
                release.await
            }
        }
    };
    let e = released.expect_err("the release should time out");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    let guard = loop {
        match lock.try_acquire().await {
            Ok(Some(guard)) => break guard,
            Ok(None) => panic!("the lock is held by someone else"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "never granted: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    tokio::time::sleep_until((started + delay + Duration::from_millis(1500)).into()).await;
    assert_eq!(guard.state(), distlock_core::LockState::Held);
    let stolen = other.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(
        stolen.is_none(),
        "two holders: the late release deleted the same owner's new hold (key exists: {})",
        exists(&server, &name)
    );
    guard.release().await.unwrap();
}

/// The server stalls (SIGSTOP) with an acquire in its socket buffer, and the acquire's connection is
/// reset on the way (a middlebox; here the proxy): a request the server has received still runs when
/// the server resumes, even after the reset. The resend and the undo cannot reach the stalled server
/// (1 s connect bound), so `try_acquire` fails; once the server is back, the grant it then makes must
/// still be undone, not left for the 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_after_the_server_stalled_with_the_acquire_buffered_fault() {
    let mut server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let config = RedisConfig::new(endpoint(proxy.addr()))
        .with_request_timeout(Duration::from_secs(1))
        .with_connect_timeout(Duration::from_secs(1));
    let backend = RedisBackend::from_config(config).await.expect("connect");
    warm_up(&backend).await;
    let locks = Locks::new(backend);
    let name = unique("stalled");
    let lock = locks.lock(&name).unwrap();

    server.pause().unwrap();
    let attempt = tokio::spawn(async move { lock.try_acquire().await.map(|g| g.is_some()) });
    // The acquire reaches the stalled server's socket buffer; then the connection is reset.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.reset().unwrap();
    let outcome = attempt.await.unwrap();
    assert!(outcome.is_err(), "the acquire cannot succeed: {outcome:?}");
    server.resume().unwrap();
    let resumed = Instant::now();
    // The buffered acquire runs now; the undo must follow within a few seconds.
    assert_the_acquire_ran_and_was_undone(&server, &name, resumed, Duration::from_secs(8)).await;
}

/// Script calls the server received since the last `CONFIG RESETSTAT`: run (`calls`, failed ones
/// included) plus refused before running (`rejected_calls`, e.g. by an ACL).
fn script_calls(server: &RedisServer) -> i64 {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    let info = info.as_str().expect("INFO is text").to_string();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .flat_map(|l| {
            l.split_once(':')
                .map(|(_, v)| v.split(','))
                .into_iter()
                .flatten()
        })
        .filter_map(|field| field.split_once('='))
        .filter(|(k, _)| *k == "calls" || *k == "rejected_calls")
        .map(|(_, v)| v.parse::<i64>().unwrap())
        .sum()
}

/// One raw try of `name` (no abandon, which would send an undo): the error, and the script calls the
/// server received for it.
async fn one_try_fails(
    server: &RedisServer,
    backend: &RedisBackend,
    name: &str,
) -> (ErrorKind, i64) {
    let request = AcquireRequest::new(name, "owner-a:1", Duration::from_secs(30));
    let mut acquisition = backend.begin(&request).unwrap();
    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let err = match backend.try_acquire(&mut acquisition, &request).await {
        Ok(_) => panic!("the try of {name} must fail"),
        Err(e) => e,
    };
    (err.kind(), script_calls(server))
}

/// A request the server refuses is not retried: `WRONGTYPE` (the name holds a string) and `NOPERM`
/// (the user may not run scripts) fail at once, with the request sent exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_is_sent_once_fault() {
    let server = RedisServer::start_or_panic();
    let backend = backend_at(server.addr(), Duration::from_secs(5)).await;
    warm_up(&backend).await;
    let name = unique("wrongtype");
    server.command(&["SET", &name, "a string"]).unwrap();
    let started = Instant::now();
    assert_eq!(
        one_try_fails(&server, &backend, &name).await,
        (ErrorKind::Protocol, 1)
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    let user = format!("noscripts{}", uuid::Uuid::new_v4().simple());
    let reply = server
        .command(&[
            "ACL", "SETUSER", &user, "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval",
        ])
        .unwrap();
    assert!(!reply.is_error(), "{reply}");
    let config = RedisConfig::new(endpoint(server.addr())).with_credentials(user.as_str(), "pw");
    let limited = RedisBackend::from_config(config).await.expect("connect");
    assert_eq!(
        one_try_fails(&server, &limited, &unique("noperm")).await,
        (ErrorKind::PermissionDenied, 1)
    );
}

/// A connection closed under an idle backend is found broken by the next request, which is sent
/// again on a fresh connection (once, by default) and succeeds; with `RetryPolicy::NEVER` the same
/// request fails `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_is_retried_as_the_policy_says_fault() {
    let server = RedisServer::start_or_panic();
    let retrying = backend_at(server.addr(), Duration::from_secs(5)).await;
    let never = RedisBackend::from_config(
        RedisConfig::new(endpoint(server.addr())).with_retry(RetryPolicy::NEVER),
    )
    .await
    .expect("connect");
    assert_eq!(
        retrying.config().connection.retry,
        distlock_redis::DEFAULT_RETRY
    );
    assert_eq!(distlock_redis::DEFAULT_RETRY.max_retries, 1);
    let kill = server
        .command(&["CLIENT", "KILL", "TYPE", "normal"])
        .unwrap();
    assert_eq!(kill.as_int(), Some(2), "{kill}: both backends' connections");

    let locks = Locks::new(retrying);
    let guard = locks
        .lock(&unique("retried"))
        .unwrap()
        .try_acquire()
        .await
        .expect("retried on a fresh connection")
        .expect("free");
    guard.release().await.unwrap();

    let err = Locks::new(never)
        .lock(&unique("never"))
        .unwrap()
        .try_acquire()
        .await
        .expect_err("the broken connection is not retried");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
}
