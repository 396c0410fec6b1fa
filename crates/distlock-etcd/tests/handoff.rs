//! The one-write handoff between waiters of one `Locks` (issue 9's contended workload): the
//! releaser's key is deleted and the next local owner's key created in one txn, unless someone queued
//! on the server, who is never passed over. Fault tests have "fault" in their names (nextest's serial
//! group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{locks, Proxied};
use distlock_core::{ErrorKind, Lock, LockGuard, LockState, Locks, Result};
use distlock_testkit::etcd::EtcdServer;

/// How many unary requests of `method` (`Txn`, `Range`) etcd has started, from its `/metrics`.
async fn started(addr: std::net::SocketAddr, method: &str) -> u64 {
    let label = format!("grpc_method=\"{method}\"");
    common::metrics(addr)
        .await
        .lines()
        .filter(|l| l.starts_with("grpc_server_started_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Spawns `lock`'s acquire and gives it time to queue.
async fn queue(lock: &Arc<Lock>) -> tokio::task::JoinHandle<LockGuard> {
    let lock = lock.clone();
    let task = tokio::spawn(async move { lock.acquire().await.expect("acquire") });
    tokio::time::sleep(Duration::from_millis(150)).await;
    task
}

/// A holder of `name` on `locks` and a second owner's acquire (waiting at most `wait`) queued behind
/// it, for a release to hand the lock to.
async fn held_with_a_waiter(
    locks: &Locks,
    name: &str,
    wait: Duration,
) -> (LockGuard, tokio::task::JoinHandle<Result<LockGuard>>) {
    let first = locks.lock(name).unwrap();
    let second = locks.lock(name).unwrap();
    let held = first.acquire().await.unwrap();
    let waiter = tokio::spawn(async move { second.options().wait(wait).acquire().await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    (held, waiter)
}

/// The waiter got the lock (else: which keys blocked it), and once it releases no key is left.
async fn the_waiter_gets_it_and_leaves_nothing(
    waiter: tokio::task::JoinHandle<Result<LockGuard>>,
    endpoints: &str,
    prefix: &str,
) {
    let outcome = waiter.await.unwrap();
    let keys = common::keys(endpoints, prefix);
    let guard = outcome.unwrap_or_else(|e| {
        panic!("the waiter never got the lock ({e}); keys left on the server: {keys:?}")
    });
    guard.release().await.unwrap();
    common::wait_keys(
        endpoints,
        prefix,
        Duration::from_secs(5),
        "no key left",
        |keys| keys.is_empty(),
    );
}

/// Each handoff to a queued local waiter is one txn (the releaser's delete and the next owner's
/// create together; before: a delete txn, then the waiter's create txn), and tokens strictly increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_handoff_is_one_txn_and_tokens_increase() {
    let server = EtcdServer::start_or_panic();
    let locks = locks(&server.url()).await;
    let name = common::name("handoff_one_txn");
    let owners = [
        Arc::new(locks.lock(&name).unwrap()),
        Arc::new(locks.lock(&name).unwrap()),
    ];
    let mut held = owners[0].acquire().await.unwrap();
    let mut tokens = vec![held.token().unwrap()];
    let rounds = 6;
    let (txns_before, ranges_before) = (
        started(server.addr(), "Txn").await,
        started(server.addr(), "Range").await,
    );
    for round in 0..rounds {
        let next = &owners[(round + 1) % 2];
        let waiter = queue(next).await;
        held.release().await.expect("release");
        held = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter is granted")
            .unwrap();
        assert_eq!(held.state(), LockState::Held);
        tokens.push(held.token().unwrap());
        let info = locks.inspect(&name).await.unwrap();
        let holder = info.holder.expect("a holder");
        assert_eq!(holder.owner.as_deref(), Some(next.owner()));
        assert_eq!(
            holder.token,
            held.token(),
            "status shows the new holder's token"
        );
    }
    let txns = started(server.addr(), "Txn").await - txns_before;
    let ranges = started(server.addr(), "Range").await - ranges_before;
    assert_eq!(
        txns, rounds as u64,
        "{txns} txns for {rounds} handoffs ({ranges} ranges, of which {rounds} are the status reads)"
    );
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens strictly increase: {tokens:?}"
    );
    held.release().await.unwrap();
    common::wait_keys(
        &server.endpoints(),
        &format!("{name}/"),
        Duration::from_secs(2),
        "the name is free",
        |keys| keys.is_empty(),
    );
}

/// A waiter of another process (here another backend, its own session) queued on the server before
/// the release gets the lock next; the local waiter comes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_queued_on_the_server_is_not_passed_over() {
    let server = EtcdServer::start_or_panic();
    let local = locks(&server.url()).await;
    let remote = locks(&server.url()).await;
    let name = common::name("handoff_remote_first");
    let holder = local.lock(&name).unwrap();
    let local_next = Arc::new(local.lock(&name).unwrap());
    let remote_next = Arc::new(remote.lock(&name).unwrap());
    let held = holder.acquire().await.unwrap();
    let first_token = held.token().unwrap();
    let remote_waiter = queue(&remote_next).await;
    common::wait_keys(
        &server.endpoints(),
        &format!("{name}/"),
        Duration::from_secs(2),
        "the remote waiter queued on the server",
        |keys| keys.len() == 2,
    );
    let local_waiter = queue(&local_next).await;
    held.release().await.unwrap();
    let remote_guard = tokio::time::timeout(Duration::from_secs(5), remote_waiter)
        .await
        .expect("the remote waiter, queued first, gets the lock")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !local_waiter.is_finished(),
        "the local waiter was handed the lock past the remote one"
    );
    let remote_token = remote_guard.token().unwrap();
    assert!(remote_token > first_token);
    remote_guard.release().await.unwrap();
    let local_guard = tokio::time::timeout(Duration::from_secs(5), local_waiter)
        .await
        .expect("then the local waiter")
        .unwrap();
    assert!(local_guard.token().unwrap() > remote_token);
    local_guard.release().await.unwrap();
}

/// The holder a handoff made is `Lost` when its key is deleted by hand; the old holder's released
/// guard never turns `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handed_holder_is_lost_when_its_key_is_deleted() {
    let server = EtcdServer::start_or_panic();
    let locks = locks(&server.url()).await;
    let name = common::name("handoff_lost");
    let first = locks.lock(&name).unwrap();
    let second = Arc::new(locks.lock(&name).unwrap());
    let held = first.acquire().await.unwrap();
    let old_states = held.state_changes();
    let txns_before = started(server.addr(), "Txn").await;
    let waiter = queue(&second).await;
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("granted")
        .unwrap();
    assert_eq!(
        started(server.addr(), "Txn").await - txns_before,
        1,
        "granted by the handoff"
    );
    let keys = common::keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(keys[0].create_revision, guard.token().unwrap().get());
    server
        .etcdctl(&["del", "--prefix", &format!("{name}/")])
        .unwrap();
    tokio::time::timeout(Duration::from_secs(2), guard.lost())
        .await
        .expect("the handed holder learns its key was deleted");
    assert_eq!(guard.state(), LockState::Lost);
    assert_eq!(
        *old_states.borrow(),
        LockState::Held,
        "the old hold ended released, not lost"
    );
    drop(guard);
}

/// A waiter that gives up (its wait limit) while the handoff txn is on its way leaves nothing held:
/// the grant made for it is released, and the next acquire succeeds at once. The member is paused so
/// that the txn is in flight when the waiter gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_waiter_that_gives_up_during_the_handoff_leaves_nothing_held() {
    let mut server = EtcdServer::start_or_panic();
    let locks = locks(&format!("{}?request_timeout=10s", server.url())).await;
    let name = common::name("handoff_cancelled");
    let first = locks.lock(&name).unwrap();
    let second = locks.lock(&name).unwrap();
    let held = first.acquire().await.unwrap();
    let waiter = tokio::spawn(async move {
        second
            .options()
            .wait(Duration::from_millis(400))
            .acquire()
            .await
            .map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.pause().unwrap();
    let release = tokio::spawn(async move { held.release().await });
    let outcome = waiter.await.unwrap();
    assert_eq!(outcome.err().map(|e| e.kind()), Some(ErrorKind::Timeout));
    server.resume().unwrap();
    tokio::time::timeout(Duration::from_secs(5), release)
        .await
        .expect("the release finishes")
        .unwrap()
        .expect("released");
    // The grant nobody took is released in the background: the name is free soon, for anyone.
    let third = locks.lock(&name).unwrap();
    let guard = third
        .options()
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect("the name is free soon after");
    guard.release().await.unwrap();
    common::wait_keys(
        &server.endpoints(),
        &format!("{name}/"),
        Duration::from_secs(2),
        "no key left",
        |keys| keys.is_empty(),
    );
}

/// A release cut short by its runtime's shutdown after its handoff txn applied (the reply never read):
/// the next owner's key must not stay behind, blocking the name (the undo's delete was spawned on the
/// runtime that was shutting down, which drops new tasks unrun: the waiter waited in vain).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_runtime_shut_down_mid_handoff_leaves_no_orphan_key() {
    let server = EtcdServer::start_or_panic();
    // A short request timeout: `HandOffUndo`'s delete (at once, and again after 2 s) would be long
    // done when the waiter gives up after 8 s.
    let locks = locks(&format!("{}?request_timeout=1s", server.url())).await;
    let name = common::name("handoff_shutdown");
    let prefix = format!("{name}/");
    let (held, waiter) = held_with_a_waiter(&locks, &name, Duration::from_secs(8)).await;
    let endpoints = server.endpoints();
    let (eps, pfx) = (endpoints.clone(), prefix.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            // The release runs as a task on this runtime.
            drop(held);
            // Run it until its handoff txn has been applied on the server, then stop polling it
            // (the reply is not read: this runtime never runs its tasks again).
            let started = std::time::Instant::now();
            loop {
                tokio::task::yield_now().await;
                let keys = common::keys(&eps, &pfx);
                if keys.len() == 1 && keys[0].key.ends_with("_1") {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "the handoff txn never applied: {keys:?}"
                );
            }
        });
        // Shut down with the release task mid-handoff.
        drop(rt);
    })
    .join()
    .unwrap();
    // The restarted release ran on the background runtime meanwhile.
    tokio::time::sleep(Duration::from_millis(500)).await;
    the_waiter_gets_it_and_leaves_nothing(waiter, &endpoints, &prefix).await;
}

/// A handoff txn whose first copy applied and whose reply was lost is sent again; the copy's compares
/// fail, and the key the first copy made must be taken as the handoff, not unclaimed and left
/// blocking the name (the releaser was also told `NotHeld`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_handoff_retried_after_a_lost_reply_leaves_no_orphan_key() {
    let fx = Proxied::start(1);
    let proxy = fx.proxy();
    let (_backend, locks) = fx.connect(false, "request_timeout=5s").await;
    let name = common::name("handoff_retry");
    let prefix = format!("{name}/");
    let endpoints = fx.server.endpoints();
    let (held, waiter) = held_with_a_waiter(&locks, &name, Duration::from_secs(10)).await;
    // Every chunk held 300 ms each way: the txn reaches etcd at ~300 ms, its reply would be back at
    // ~600 ms; the connection is reset in between.
    proxy.delay(Duration::from_millis(300)).unwrap();
    let release = tokio::spawn(async move { held.release().await });
    // Reset as soon as the txn has applied (its reply is then still held by the proxy).
    let seen = common::wait_keys(
        &endpoints,
        &prefix,
        Duration::from_millis(550),
        "the handoff txn applied before its reply came back",
        |keys| keys.len() == 1 && keys[0].key.ends_with("_1"),
    );
    proxy.reset().unwrap();
    proxy.pass().unwrap();
    eprintln!("keys at the reset: {seen:?}");
    let released = tokio::time::timeout(Duration::from_secs(10), release)
        .await
        .expect("the release finishes")
        .unwrap();
    eprintln!("release outcome: {released:?}");
    the_waiter_gets_it_and_leaves_nothing(waiter, &endpoints, &prefix).await;
}
