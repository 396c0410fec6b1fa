//! Issue 7 on etcd: one owner per key and one token per grant (clones of one backend, a key on the
//! session's lease written by someone else, a release that failed), a deleted or revoked key noticed at
//! the default session TTL long before the next keep-alive, a session known to be gone not reused, and
//! a backend used from a second tokio runtime after the first was dropped.
//! Tests that inject faults have "fault" in their names (nextest's serial group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{backend, keys, locks, locks_on, probe, revision, wait_keys, watch_gauge, Proxied};
use distlock_core::{LockState, Locks};
use distlock_etcd::rpc::pb::etcdserverpb::{CompactionRequest, DeleteRangeRequest, PutRequest};
use distlock_etcd::rpc::Client;
use distlock_etcd::EtcdConfig;
use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::proxy::Proxy;

/// Slack for scheduling on a loaded 2-core machine. Not a speed figure: each bound below is a mechanism
/// (one round trip, one keep-alive interval) plus this.
const SLACK: Duration = Duration::from_secs(3);

/// How late a holder may see an external delete of its key after the next client was granted on
/// the same delete: half the period of etcd's catch-up loop for unsynced watches (100 ms). Two clients
/// cannot be ordered in real time: etcd sends the delete to every synced watch in one pass, and which
/// process runs first afterwards is the scheduler's business (on a loaded machine the next client's
/// check round trip and grant sometimes finish before the holder's watch task runs). What distlock
/// promises is that the holder learns of the delete from that same event, with no wait of its own: its
/// watch is synced (checked with etcd's slow-watcher gauge) and the loss is a couple of local task
/// hops away. A watch served by the catch-up loop instead sees the delete at the loop's next tick,
/// 50–80 ms after the next grant in the runs that found this (one tick coincided). Not a speed figure:
/// on the loaded 2-core machine the holder was at most ~17 ms behind the grant (48 rounds).
const CATCH_UP_HALF: Duration = Duration::from_millis(50);

/// etcd's counter of watch streams opened (gRPC's, by method): only grows.
const WATCH_STREAMS_STARTED: &str = "grpc_server_started_total{grpc_method=\"Watch\",grpc_service=\"etcdserverpb.Watch\",grpc_type=\"bidi_stream\"}";

/// Two `Locks` on clones of one backend share its sessions, so both owners' keys would be
/// `NAME/<lease hex>`: the second must queue behind the first, never adopt its key and token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_backend_exclude_each_other() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let a = locks_on(&backend);
    let b = locks_on(&backend);
    let name = common::name("adopt");

    // At once: exactly one of the two gets it.
    let (la, lb) = (a.lock(&name).unwrap(), b.lock(&name).unwrap());
    let (ga, gb) = tokio::join!(la.try_acquire(), lb.try_acquire());
    let (ga, gb) = (ga.unwrap(), gb.unwrap());
    assert!(
        ga.is_some() != gb.is_some(),
        "both or neither got the lock: tokens {:?} {:?}",
        ga.as_ref().map(|g| g.token()),
        gb.as_ref().map(|g| g.token())
    );
    let (held, other_lock) = match ga {
        Some(g) => (g, lb),
        None => (gb.unwrap(), la),
    };
    let first = held.token().unwrap();
    // Again, while it is held.
    assert!(other_lock.try_acquire().await.unwrap().is_none());

    // A waiting clone queues on the server and gets the lock on release, with a new token.
    let waiting = tokio::spawn(async move {
        let guard = other_lock
            .options()
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        let token = guard.token().unwrap();
        guard.release().await.unwrap();
        token
    });
    let prefix = format!("{name}/");
    let eps = server.endpoints();
    tokio::task::block_in_place(|| {
        wait_keys(&eps, &prefix, SLACK, "the second owner queued", |k| {
            k.len() == 2
        })
    });
    assert_eq!(held.state(), LockState::Held);
    held.release().await.unwrap();
    let second = tokio::time::timeout(SLACK * 3, waiting)
        .await
        .expect("the waiter gets the lock after the release")
        .unwrap();
    assert!(second > first, "token {second:?} after {first:?}");
    assert!(keys(&eps, &prefix).is_empty());
}

/// A key on this backend's session lease that this owner did not write (here written by hand, as a
/// Go client handed the same lease would) is not adopted: the acquire must not report it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_on_the_own_lease_written_by_another_owner_is_not_adopted() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("foreign");
    // Create the session (a hold and a release on another name).
    locks
        .lock(&common::name("warmup"))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let (_, lease) = backend.session_leases().await[0];
    let key = format!("{name}/{lease:x}");
    server
        .etcdctl(&[
            "put",
            "--lease",
            &format!("{lease:x}"),
            &key,
            "someone-else",
        ])
        .unwrap();
    let foreign = keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(foreign.len(), 1);

    let lock = locks.lock(&name).unwrap();
    let got = lock.try_acquire().await.unwrap();
    assert!(
        got.is_none(),
        "adopted another owner's key with its token {:?}",
        got.as_ref().map(|g| g.token())
    );
    // The foreign key is left alone, and once it goes the lock is ours with a newer token.
    let seen = keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(seen[0], foreign[0], "{seen:?}");
    server.etcdctl(&["del", &key]).unwrap();
    let guard = lock
        .options()
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    assert!(guard.token().unwrap().get() > foreign[0].create_revision);
    guard.release().await.unwrap();
}

/// A release that fails (etcd unreachable) leaves the key; the next local owner of the name must not
/// adopt it with the previous holder's token: the key is deleted by a retry first, and the next owner
/// gets a newer token once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_failed_release_is_retried_and_its_key_never_adopted() {
    let fx = Proxied::start(1);
    let (server, proxy) = (&fx.server, fx.proxy());
    let (_backend, locks) = fx.connect(false, "request_timeout=1s").await;
    let name = common::name("failed_release");
    let prefix = format!("{name}/");
    let eps = server.endpoints();

    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let first = guard.token().unwrap().get();
    tokio::task::block_in_place(|| proxy.blackhole().unwrap());
    guard
        .release()
        .await
        .expect_err("a release through a blackhole fails");
    // The key is still there, on a live session.
    assert_eq!(keys(&eps, &prefix).len(), 1);
    tokio::task::block_in_place(|| proxy.pass().unwrap());

    let next = locks
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let second = next.token().unwrap().get();
    assert!(
        second > first,
        "the next local owner got token {second} after {first}: it adopted the stale key"
    );
    let seen = keys(&eps, &prefix);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].create_revision, second);
    next.release().await.unwrap();
    assert!(keys(&eps, &prefix).is_empty());
}

/// Deleting the holder's key (`etcdctl del`, an operator breaking a stuck lock) is noticed within a
/// round trip at the default 60 s session TTL, not at the next keep-alive 20 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_deleted_key_is_lost_at_once_at_the_default_session_ttl() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    assert_eq!(backend.default_lease(), Duration::from_secs(60));
    let locks = locks_on(&backend);
    let name = common::name("deleted");
    let prefix = format!("{name}/");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let seen = keys(&server.endpoints(), &prefix);
    assert_eq!(seen.len(), 1);
    // A second hold on the same session stays held: only the deleted key's guard is lost.
    let bystander = locks
        .lock(&common::name("bystander"))
        .unwrap()
        .acquire()
        .await
        .unwrap();

    let deleted_at = Instant::now();
    server.etcdctl(&["del", &seen[0].key]).unwrap();
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("Lost within a round trip of the delete, not at the next keep-alive (20 s)");
    eprintln!("delete → Lost: {:?}", deleted_at.elapsed());
    assert!(guard.loss_reason().unwrap().contains("deleted"));
    assert_eq!(bystander.state(), LockState::Held);
    bystander.release().await.unwrap();
    let _ = guard.release().await;
}

/// An operator's delete of a key right after its grant (the key of a hold that has just begun, with
/// the next client queued behind it): the guard learns of it from the same delete event as that next
/// client, so it is `Lost` (for that reason) within [`CATCH_UP_HALF`] of the next client's grant. With
/// the held-key watch made 100 ms after the grant, it stayed `Held` up to ~200 ms after the delete
/// while the next client was granted within a round trip. Not asserted: `Lost` *before* that grant —
/// two processes woken by one event are not ordered in real time (see [`CATCH_UP_HALF`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_delete_right_after_the_grant_reaches_the_holder_with_the_next_grant() {
    let server = EtcdServer::start_or_panic();
    let raw = Client::connect(&EtcdConfig::new([server.endpoints()]))
        .await
        .unwrap();
    let first = locks(&server.url()).await;
    let second = locks(&server.url()).await;
    let third = locks(&server.url()).await;
    for round in 0..3 {
        let name = common::name(&format!("early_delete_{round}"));
        let prefix = format!("{name}/");
        let blocker = first.lock(&name).unwrap().acquire().await.unwrap();
        // The next holder queues behind the blocker, the one after it behind the next holder.
        let lock = second.lock(&name).unwrap();
        let next = tokio::spawn(async move { lock.acquire().await.unwrap() });
        let queued = wait_keys(&server.endpoints(), &prefix, SLACK, "second queued", |k| {
            k.len() == 2
        });
        let lock = third.lock(&name).unwrap();
        let after = tokio::spawn(async move { lock.acquire().await.unwrap() });
        wait_keys(&server.endpoints(), &prefix, SLACK, "third queued", |k| {
            k.len() == 3
        });
        let own = queued[1].key.clone();
        let raw = raw.clone();
        // Deleted as soon as the grant is returned, from the task that got it.
        let next = tokio::spawn(async move {
            let guard = next.await.unwrap();
            raw.delete_range(DeleteRangeRequest {
                key: own.into_bytes(),
                ..DeleteRangeRequest::default()
            })
            .await
            .unwrap();
            guard
        });
        blocker.release().await.unwrap();
        let last = after.await.unwrap();
        let granted_at = Instant::now();
        let guard = next.await.unwrap();
        tokio::time::timeout(CATCH_UP_HALF.saturating_sub(granted_at.elapsed()), guard.lost())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the key was deleted, the client queued behind it was granted, and its guard was still Held {CATCH_UP_HALF:?} later"));
        assert!(
            guard.loss_reason().unwrap().contains("deleted"),
            "round {round}: {:?}",
            guard.loss_reason()
        );
        last.release().await.unwrap();
        let _ = guard.release().await;
    }
}

/// Revoking the session lease (`etcdctl lease revoke`) is noticed within a round trip at the default
/// 60 s session TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_revoked_lease_is_lost_at_once_at_the_default_session_ttl() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("revoked");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let (ttl, lease) = backend.session_leases().await[0];
    assert_eq!(ttl, Duration::from_secs(60));
    let revoked_at = Instant::now();
    server
        .etcdctl(&["lease", "revoke", &format!("{lease:x}")])
        .unwrap();
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("Lost within a round trip of the revoke, not at the next keep-alive (20 s)");
    eprintln!("revoke → Lost: {:?}", revoked_at.elapsed());
    let _ = guard.release().await;
}

/// A session whose lease was revoked behind its back (the keep-alive, every 20 s at the default TTL,
/// has not noticed yet) is not used for the next acquire: that acquire gets a new session and a key on
/// a live lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_revoked_session_is_not_reused_for_new_acquires() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("dead_session");
    locks
        .lock(&name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let (_, old) = backend.session_leases().await[0];
    server
        .etcdctl(&["lease", "revoke", &format!("{old:x}")])
        .unwrap();

    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("an acquire after the session was revoked gets a new session");
    let seen = keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_ne!(seen[0].lease, old, "the key hangs on the revoked lease");
    assert_eq!(seen[0].create_revision, guard.token().unwrap().get());
    let ttl = server
        .etcdctl(&["lease", "timetolive", &format!("{:x}", seen[0].lease)])
        .unwrap();
    assert!(ttl.contains("remaining"), "{ttl}");
    assert!(!ttl.contains("already expired"), "{ttl}");
    assert_eq!(guard.state(), LockState::Held);
    guard.release().await.unwrap();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Issue 7 item 5: a backend (and its `Locks`) used on a first runtime, which is then dropped with the
/// tasks the backend spawned on it (the connection's, the session keep-alive, the held-keys watch), keeps
/// working on a second runtime: a hold whose lease needs renewals is still `Held` after three leases,
/// because the renewals reach the server, and a delete of its key is still noticed at once.
#[test]
fn a_backend_keeps_working_on_a_second_runtime_after_the_first_is_dropped() {
    let server = EtcdServer::start_or_panic();
    let lease = Duration::from_secs(2);
    let name = common::name("runtimes");
    let prefix = format!("{name}/");
    let eps = server.endpoints();

    let rt1 = runtime();
    let (locks, backend) = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        // Everything the backend starts lazily starts here: the session of this TTL and its keep-alive,
        // the held-keys watch.
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
        (locks, backend)
    });
    drop(rt1);

    let rt2 = runtime();
    rt2.block_on(async {
        let lock = locks.lock(&name).unwrap();
        let guard =
            tokio::time::timeout(SLACK * 2, lock.options().lease(lease).wait(SLACK).acquire())
                .await
                .expect("an acquire on the second runtime answers")
                .expect("an acquire on the second runtime succeeds");
        let token = guard.token().unwrap().get();
        tokio::time::sleep(lease * 3).await;
        assert_eq!(
            guard.state(),
            LockState::Held,
            "not held after three leases on the second runtime: {:?}",
            guard.loss_reason()
        );
        // The renewals reached the server: the key is there, on a live lease.
        let seen = keys(&eps, &prefix);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].create_revision, token);
        assert!(backend
            .session_leases()
            .await
            .iter()
            .any(|(_, id)| *id == seen[0].lease));
        // The held-keys watch runs again too.
        server.etcdctl(&["del", &seen[0].key]).unwrap();
        tokio::time::timeout(SLACK, guard.lost())
            .await
            .expect("a delete noticed at once on the second runtime");
        let _ = guard.release().await;
    });
}

/// The held-keys watch stream breaks (connections reset, then refused), the key is deleted meanwhile,
/// and the connection comes back: the reopened watch starts from the grant's revision, so it still sees
/// the delete, long before the next keep-alive (which would not notice anyway: the lease is alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_delete_while_the_watch_is_disconnected_is_still_reported() {
    let fx = Proxied::start(1);
    let (server, proxy) = (&fx.server, fx.proxy());
    let (_backend, locks) = fx.connect(false, "request_timeout=1s").await;
    let name = common::name("deleted_offline");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let seen = keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(seen.len(), 1);

    tokio::task::block_in_place(|| {
        proxy.refuse().unwrap();
        proxy.reset().unwrap();
    });
    server.etcdctl(&["del", &seen[0].key]).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        guard.state(),
        LockState::Held,
        "nothing can tell while cut off"
    );
    let healed_at = Instant::now();
    tokio::task::block_in_place(|| proxy.pass().unwrap());
    tokio::time::timeout(SLACK * 2, guard.lost())
        .await
        .expect("the delete made while disconnected is reported once the watch is back");
    eprintln!("heal → Lost: {:?}", healed_at.elapsed());
    assert!(guard.loss_reason().unwrap().contains("deleted"));
    // The key's watch, made again and found without its key, is cancelled (nothing else would: the
    // guard's release finds its entry gone).
    let deadline = Instant::now() + SLACK;
    while watch_gauge(server.addr(), "etcd_debugging_mvcc_watcher_total").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the lost key's watch is left on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = guard.release().await;
}

/// Many short holds, each watched from its grant on: every watch is cancelled at its release, none is
/// left on the server (the stream stays open, so a leaked watch would stay until the process ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_holds_leave_no_watch_on_the_server() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("short_holds");
    for _ in 0..100 {
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    let deadline = Instant::now() + SLACK;
    loop {
        let left = watch_gauge(server.addr(), "etcd_debugging_mvcc_watcher_total").await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} watches left on the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Compacts the store at its current revision, after a few writes, so every watch starting at or
/// before the revision of a read made before this call is compacted away.
async fn compact_now(endpoints: &str) {
    let client = Client::connect(&EtcdConfig::new([endpoints]))
        .await
        .unwrap();
    let mut rev = 0;
    for _ in 0..3 {
        let put = client
            .put(PutRequest {
                key: b"etcd-test/compact-filler".to_vec(),
                value: b"x".to_vec(),
                ..PutRequest::default()
            })
            .await
            .unwrap();
        rev = put.header.unwrap().revision;
    }
    client
        .compact(CompactionRequest {
            revision: rev,
            physical: false,
        })
        .await
        .unwrap();
}

/// The held-keys watch is cut off, the store is compacted past the grants' revisions meanwhile (as
/// etcd's auto-compaction does), and the watch comes back: the start revisions are gone, so the server
/// cancels the watches; the keys are re-read and watched again. A delete after that must still be
/// reported within a round trip, for every held key, not never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_delete_after_the_watch_start_was_compacted_is_reported() {
    let fx = Proxied::start(1);
    let (server, proxy) = (&fx.server, fx.proxy());
    let (_backend, locks) = fx.connect(false, "request_timeout=1s").await;
    let names = [common::name("compacted"), common::name("compacted")];
    let mut guards = Vec::new();
    for name in &names {
        guards.push(locks.lock(name).unwrap().acquire().await.unwrap());
    }
    let held: Vec<_> = names
        .iter()
        .map(|name| keys(&server.endpoints(), &format!("{name}/")).remove(0))
        .collect();

    tokio::task::block_in_place(|| {
        proxy.refuse().unwrap();
        proxy.reset().unwrap();
    });
    compact_now(&server.endpoints()).await;
    tokio::task::block_in_place(|| proxy.pass().unwrap());
    // Time for the watch to reconnect, be cancelled for the compaction, re-read and watch again.
    tokio::time::sleep(SLACK).await;
    for guard in &guards {
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
    }

    for (guard, key) in guards.iter().zip(&held) {
        server.etcdctl(&["del", &key.key]).unwrap();
        tokio::time::timeout(SLACK, guard.lost())
            .await
            .expect("a delete after a compaction is reported within a round trip");
        assert!(guard.loss_reason().unwrap().contains("deleted"));
    }
    for guard in guards {
        let _ = guard.release().await;
    }
}

/// A hold taken on a first runtime, which is then dropped (with the held-keys watch and the core's
/// loss watcher that ran there), lives on while the process goes on using the backend on a second
/// runtime (another acquire moves the connection and the background tasks, and the watchdog renews
/// the old hold there). Its key is then deleted (`etcdctl del`): the hold must go `Lost` within a few
/// renewals, not stay `Held` for good while renewals of its live session keep succeeding.
#[test]
fn fault_a_hold_from_a_dropped_runtime_is_lost_when_its_key_is_deleted() {
    let server = EtcdServer::start_or_panic();
    let name = common::name("runtime_delete");
    // Renewals every second: the bound below is a few renewal intervals.
    let lease = Duration::from_secs(3);
    let rt1 = runtime();
    let (locks, guard) = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        // The key's watch exists (it is created 100 ms after the grant).
        tokio::time::sleep(Duration::from_millis(500)).await;
        (locks, guard)
    });
    drop(rt1);

    let rt2 = runtime();
    rt2.block_on(async {
        let other = locks
            .lock(&common::name("runtime_other"))
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await
            .unwrap();
        tokio::time::sleep(lease).await;
        assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
        let seen = keys(&server.endpoints(), &format!("{name}/"));
        assert_eq!(seen.len(), 1);
        server.etcdctl(&["del", &seen[0].key]).unwrap();
        tokio::time::timeout(lease + SLACK, guard.lost())
            .await
            .expect("the deleted key's hold is reported lost within a few renewals, not never");
        assert!(
            guard.loss_reason().unwrap().contains("deleted"),
            "{:?}",
            guard.loss_reason()
        );
        assert_eq!(other.state(), LockState::Held);
        other.release().await.unwrap();
        let _ = guard.release().await;
        drop(locks);
    });
}

/// An acquire queued behind another client's hold is dropped (its caller timed out) just before its
/// runtime is dropped, so the core's undo, spawned on that runtime, never runs. The process goes on
/// using the backend on a second runtime (which keeps its session alive): the queued key it left must
/// not block the name, and the next client gets the lock soon after the holder lets go.
#[test]
fn fault_an_acquire_dropped_with_its_runtime_leaves_no_key_blocking_the_name() {
    let server = EtcdServer::start_or_panic();
    let name = common::name("runtime_abandon");
    let prefix = format!("{name}/");
    let eps = server.endpoints();
    let rt0 = runtime();
    let (holder_locks, held) = rt0.block_on(async {
        let other = backend(&server.url()).await;
        let locks = locks_on(&other);
        let held = locks.lock(&name).unwrap().acquire().await.unwrap();
        (locks, held)
    });

    let rt1 = runtime();
    let locks = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        let lock = locks.lock(&name).unwrap();
        let queued = tokio::time::timeout(SLACK, async {
            let acquire = lock.acquire();
            tokio::pin!(acquire);
            // Poll the acquire until its key is queued on the server, then drop it.
            loop {
                tokio::select! {
                    _ = &mut acquire => panic!("acquired while held elsewhere"),
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
                if keys(&eps, &prefix).len() == 2 {
                    return;
                }
            }
        })
        .await;
        queued.expect("the acquire queued a key");
        locks
    });
    drop(rt1);

    let rt2 = runtime();
    rt2.block_on(async {
        keep_using(&locks, "runtime_abandon_other").await;
    });
    rt0.block_on(async {
        held.release().await.unwrap();
        let next = holder_locks
            .lock(&name)
            .unwrap()
            .options()
            .wait(SLACK * 3)
            .acquire()
            .await
            .expect("the next client gets the lock: no key of the dropped acquire blocks it");
        next.release().await.unwrap();
    });
    drop(locks);
}

/// The process goes on using the backend on the current runtime (which keeps its session alive from now
/// on): a hold of another name, taken and released.
async fn keep_using(locks: &Locks, prefix: &str) {
    locks
        .lock(&common::name(prefix))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A guard dropped just before its runtime is dropped: the core's release-on-drop task, spawned on that
/// runtime, never runs. The process goes on using the backend on a second runtime (which keeps its
/// session alive): the held key must not block the name for good; the next client gets the lock.
#[test]
fn fault_a_guard_dropped_with_its_runtime_leaves_no_key_blocking_the_name() {
    let server = EtcdServer::start_or_panic();
    let name = common::name("runtime_drop_guard");
    let rt1 = runtime();
    let locks = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        drop(guard);
        locks
    });
    drop(rt1);

    let rt2 = runtime();
    rt2.block_on(async {
        keep_using(&locks, "runtime_drop_guard_other").await;
        let other = backend(&server.url()).await;
        let other_locks = locks_on(&other);
        let next = other_locks
            .lock(&name)
            .unwrap()
            .options()
            .wait(SLACK * 3)
            .acquire()
            .await
            .expect("the next client gets the lock: the dropped guard's key does not block it");
        next.release().await.unwrap();
    });
    drop(locks);
}

/// A queued acquisition watches its own key while it waits (issue 9), so the grant after the wait
/// finds its held-key watch confirmed and needs no round trip for it: while the second owner waits,
/// the server holds the blocker's held-key watch, the waiter's predecessor watch and the waiter's
/// own-key watch; after the handoff, the grant made no watch of its own (the predecessor watch and
/// the blocker's are gone, the own-key watch stays until the release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_acquisition_watches_its_own_key_before_its_grant() {
    let server = EtcdServer::start_or_panic();
    let first = locks(&server.url()).await;
    let second = locks(&server.url()).await;
    let name = common::name("queued_watch");
    let prefix = format!("{name}/");
    let all = "etcd_debugging_mvcc_watcher_total";
    let idle = watch_gauge(server.addr(), all).await;
    let blocker = first.lock(&name).unwrap().acquire().await.unwrap();
    assert_eq!(
        watch_gauge(server.addr(), all).await,
        idle + 1,
        "the blocker's held-key watch"
    );
    let lock = second.lock(&name).unwrap();
    let next = tokio::spawn(async move { lock.acquire().await.unwrap() });
    wait_keys(&server.endpoints(), &prefix, SLACK, "second queued", |k| {
        k.len() == 2
    });
    let deadline = Instant::now() + SLACK;
    while watch_gauge(server.addr(), all).await < idle + 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        watch_gauge(server.addr(), all).await,
        idle + 3,
        "while queued: the blocker's held key, the waiter's predecessor and the waiter's own key"
    );
    blocker.release().await.unwrap();
    let granted = next.await.unwrap();
    assert_eq!(granted.state(), LockState::Held);
    let deadline = Instant::now() + SLACK;
    while watch_gauge(server.addr(), all).await > idle + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        watch_gauge(server.addr(), all).await,
        idle + 1,
        "after the handoff: only the new holder's own-key watch"
    );
    granted.release().await.unwrap();
}

/// The held-key watch stream breaks (a connection reset) and is reopened; a delete of the key right
/// after its watch is made again must reach the holder from the same event as the client queued
/// behind it: at the delete no watch is unsynced (etcd's slow-watcher gauge is 0), and the guard is
/// `Lost`, for that reason, within [`CATCH_UP_HALF`] of that client's grant. A watch made again from
/// the grant's revision is "unsynced" in etcd once the store has moved (the waiter's own key moved
/// it): the delete reached it only through etcd's 100 ms catch-up loop, 50–80 ms after the waiter was
/// granted. Not asserted: `Lost` *before* that grant — two processes woken by one event are not
/// ordered in real time (see [`CATCH_UP_HALF`]; the holder here is also one proxy hop farther away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_delete_right_after_the_held_watch_is_reopened_reaches_the_holder_with_the_next_grant(
) {
    use distlock_testkit::proxy::Proxy;
    let server = EtcdServer::start_or_panic();
    let raw = Client::connect(&EtcdConfig::new([server.endpoints()]))
        .await
        .unwrap();
    let proxy = Proxy::start_or_panic(server.addr());
    let first = locks(&format!("etcd://{}", proxy.addr())).await;
    let second = locks(&server.url()).await;
    let all = "etcd_debugging_mvcc_watcher_total";
    let idle = watch_gauge(server.addr(), all).await;
    for round in 0..3 {
        // The last round's released keys keep their watches for a second (the held-key watch's
        // linger): one cancelled while the reopen below is awaited would move the count it waits
        // for. Each round starts once they are gone.
        let deadline = Instant::now() + Duration::from_secs(2) + SLACK;
        while watch_gauge(server.addr(), all).await != idle && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            watch_gauge(server.addr(), all).await,
            idle,
            "round {round}: the last round's kept watches were not cancelled"
        );
        let name = common::name(&format!("reopened_delete_{round}"));
        let prefix = format!("{name}/");
        let guard = first.lock(&name).unwrap().acquire().await.unwrap();
        let lock = second.lock(&name).unwrap();
        let next = tokio::spawn(async move { lock.acquire().await.unwrap() });
        let queued = wait_keys(&server.endpoints(), &prefix, SLACK, "second queued", |k| {
            k.len() == 2
        });
        // Every watch synced (the catch-up loop runs every 100 ms).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let slow = "etcd_debugging_mvcc_slow_watcher_total";
        assert_eq!(watch_gauge(server.addr(), slow).await, 0);
        let watches = watch_gauge(server.addr(), all).await;
        let streams = watch_gauge(server.addr(), WATCH_STREAMS_STARTED).await;
        proxy.reset().unwrap();
        // The held key's watch goes with its stream, and is made again on a new one (the reopen
        // waits 100 ms at least): delete the key as soon as it is back, that is once a new watch
        // stream was opened and the watch count is what it was (the old stream's watch gone, the new
        // one made). Told by etcd's counter of opened streams, not by catching the dip in the gauge,
        // which a slow scrape on a loaded machine can miss.
        let deadline = Instant::now() + SLACK;
        while Instant::now() < deadline
            && (watch_gauge(server.addr(), WATCH_STREAMS_STARTED).await <= streams
                || watch_gauge(server.addr(), all).await != watches)
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            Instant::now() < deadline,
            "round {round}: the watch was not made again on a new stream"
        );
        assert_eq!(
            watch_gauge(server.addr(), slow).await,
            0,
            "round {round}: at the delete, a watch (the holder's, made again) is unsynced: etcd sends it the delete from its 100 ms catch-up loop, not with the next client's"
        );
        raw.delete_range(DeleteRangeRequest {
            key: queued[0].key.clone().into_bytes(),
            ..DeleteRangeRequest::default()
        })
        .await
        .unwrap();
        let granted = next.await.unwrap();
        tokio::time::timeout(CATCH_UP_HALF, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the key was deleted after its watch was made again, the next client was granted, and the guard was still Held {CATCH_UP_HALF:?} later"));
        assert!(
            guard.loss_reason().unwrap().contains("deleted"),
            "round {round}: {:?}",
            guard.loss_reason()
        );
        granted.release().await.unwrap();
        let _ = guard.release().await;
    }
}

/// A queued acquisition that gives up (its wait times out, or its future is dropped) or whose own key
/// is deleted while it waits leaves no watch on the server: its own-key watch goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_acquisition_that_ends_without_a_grant_leaves_no_watch() {
    let server = EtcdServer::start_or_panic();
    let raw = Client::connect(&EtcdConfig::new([server.endpoints()]))
        .await
        .unwrap();
    let first = locks(&server.url()).await;
    let second = locks(&server.url()).await;
    let all = "etcd_debugging_mvcc_watcher_total";
    let idle = watch_gauge(server.addr(), all).await;
    let name = common::name("queued_watch_ends");
    let prefix = format!("{name}/");
    let blocker = first.lock(&name).unwrap().acquire().await.unwrap();
    let settle = |want: u64, what: &'static str| {
        let addr = server.addr();
        async move {
            let deadline = Instant::now() + SLACK;
            while watch_gauge(addr, all).await != want && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(watch_gauge(addr, all).await, want, "{what}");
        }
    };
    settle(idle + 1, "the blocker's held-key watch").await;
    // 1. The wait times out.
    let timed_out = second
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_millis(800))
        .acquire()
        .await;
    assert!(timed_out.is_err());
    settle(idle + 1, "after a timed-out wait: only the blocker's watch").await;
    // 2. The acquire future is dropped while queued.
    let lock = second.lock(&name).unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    settle(idle + 3, "queued: blocker, predecessor, own key").await;
    waiting.abort();
    let _ = waiting.await;
    settle(idle + 1, "after a dropped wait: only the blocker's watch").await;
    // 3. The waiter's own key is deleted while it waits: never granted, no watch left.
    let lock = second.lock(&name).unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    settle(idle + 3, "queued again").await;
    let queued = keys(&server.endpoints(), &prefix);
    assert_eq!(queued.len(), 2);
    raw.delete_range(DeleteRangeRequest {
        key: queued[1].key.clone().into_bytes(),
        ..DeleteRangeRequest::default()
    })
    .await
    .unwrap();
    blocker.release().await.unwrap();
    let outcome = tokio::time::timeout(SLACK * 2, waiting)
        .await
        .expect("the waiter ends")
        .unwrap();
    if let Ok(guard) = &outcome {
        assert_eq!(
            guard.state(),
            LockState::Lost,
            "granted on a key deleted while it waited"
        );
    }
    drop(outcome);
    settle(idle, "nothing held, nothing watched").await;
}

/// `max_hold` of exactly the session's TTL (a 2 s lease capped at 2 s: the session is 2 s too): the
/// guard is `Lost` at the cap and the name is free right after, although the session itself is kept
/// alive (for this backend's other locks and its next acquires). Its key must go with the hold's own
/// lease. Failed while the expiry timer was skipped for a lease equal to the session's TTL: the key
/// stayed as long as the session, here for the whole test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_equal_to_the_session_ttl_frees_the_name_at_the_cap() {
    let server = EtcdServer::start_or_panic();
    let a = locks(&server.url()).await;
    let b = locks(&server.url()).await;
    let name = common::name("max_hold_session_ttl");
    let cap = Duration::from_secs(2);
    let guard = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(cap)
        .max_hold(cap)
        .acquire()
        .await
        .unwrap();
    tokio::time::timeout(cap + SLACK, guard.lost())
        .await
        .expect("Lost at max_hold");
    // The key goes when the hold's lease runs out (the timer fires no earlier than the core's
    // deadline, within a round trip after it).
    let next = b
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(3))
        .acquire()
        .await
        .expect(
            "the name is free once the capped hold's lease ran out, though its session lives on",
        );
    assert!(
        next.token().unwrap() > guard.token().unwrap(),
        "the next holder's token is greater"
    );
    next.release().await.unwrap();
    drop(guard);
}

/// Watch messages the server received (creates and cancels on every watch stream).
async fn watch_messages(server: &EtcdServer) -> u64 {
    watch_gauge(
        server.addr(),
        "grpc_server_msg_received_total{grpc_method=\"Watch\",grpc_service=\"etcdserverpb.Watch\",grpc_type=\"bidi_stream\"}",
    )
    .await
}

/// A loop of acquire and release on one name (issue 9's uncontended cycle) keeps its key's held-key
/// watch from one hold to the next instead of creating and cancelling one per cycle (two messages and
/// a confirmation wait per grant). Each release's own delete reaches the kept watch and must not make
/// the next hold `Lost`; the kept watch is cancelled soon after the last release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loop_of_cycles_on_one_name_keeps_one_held_key_watch() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let lock = locks.lock(&common::name("kept_watch")).unwrap();
    let first = lock.acquire().await.unwrap();
    first.release().await.unwrap();
    let before = watch_messages(&server).await;
    let cycles = 20;
    for cycle in 0..cycles {
        let guard = lock.acquire().await.unwrap();
        if cycle % 4 == 0 {
            // Time for the previous release's delete to reach the kept watch.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            guard.state(),
            LockState::Held,
            "cycle {cycle}: a former hold's delete was taken for this hold's: {:?}",
            guard.loss_reason()
        );
        guard.release().await.unwrap();
    }
    let messages = watch_messages(&server).await - before;
    assert!(
        messages <= 2,
        "{messages} watch messages for {cycles} cycles on one name: a watch made per grant"
    );
    let deadline = Instant::now() + SLACK;
    loop {
        let left = watch_gauge(server.addr(), "etcd_debugging_mvcc_watcher_total").await;
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the kept watch is left on the server ({left} watches)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A hold that took the watch kept from the previous release of its key is still told of a delete of
/// that key at once (at the default session TTL, whose keep-alive would notice only 20 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_on_a_kept_watch_is_lost_when_its_key_is_deleted() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("kept_watch_delete");
    let lock = locks.lock(&name).unwrap();
    lock.acquire().await.unwrap().release().await.unwrap();
    let before = watch_messages(&server).await;
    let guard = lock.acquire().await.unwrap();
    assert_eq!(
        watch_messages(&server).await,
        before,
        "the second hold made a watch of its own instead of taking the kept one"
    );
    let seen = keys(&server.endpoints(), &format!("{name}/"));
    assert_eq!(seen.len(), 1, "{seen:?}");
    let deleted_at = Instant::now();
    server.etcdctl(&["del", &seen[0].key]).unwrap();
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("a delete of the key reaches the hold on the kept watch");
    eprintln!("delete → Lost: {:?}", deleted_at.elapsed());
    assert!(guard.loss_reason().unwrap().contains("deleted"));
    // The next hold of the name is not told of that delete (an earlier revision than its key's).
    drop(guard);
    let next = lock.acquire().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(next.state(), LockState::Held, "{:?}", next.loss_reason());
    next.release().await.unwrap();
}

/// A delete of the next hold's key that reaches the kept watch *before* the grant takes it (the
/// create's reply comes back later than the delete's event: here the create went through a slow
/// path to a member, the watch stream is on a fast one) is dropped as "no hold has this watch", and
/// the grant then trusts the kept watch's old confirmation (at or before its read) and skips the
/// re-read. The hold stays `Held` with its key gone, for good (renewals of the live session succeed).
/// Several rounds: the member each request goes to is chosen in turn, so some rounds put the create
/// on the slow path and the watch stream on the fast one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_delete_reaching_the_kept_watch_before_the_grant_takes_it_is_reported() {
    let fx = Proxied::start(1);
    let server = &fx.server;
    let raw = fx.raw().await;
    let mut slow_creates = 0;
    for round in 0..4 {
        fx.pass();
        // Two "members" (one server, one of them behind a slow proxy); no hedged resend within the
        // test. The held-keys stream stays on whichever the backend opened it on.
        let (backend, locks) = fx.connect(true, "request_timeout=20s").await;
        for cycle in 0..3 {
            fx.pass();
            // Shift which member the next requests go to.
            let _ = backend.client().range(probe()).await;
            let name = common::name(&format!("kept_watch_early_delete_{round}_{cycle}"));
            let prefix = format!("{name}/");
            let lock = locks.lock(&name).unwrap();
            // A first cycle leaves its key's watch kept (confirmed).
            lock.acquire().await.unwrap().release().await.unwrap();
            let start = revision(&raw).await;
            // An operator deletes the next key as soon as it exists (polling directly).
            let deleter = delete_the_next_key(&raw, &prefix, start);
            fx.delay(Duration::from_millis(300));
            let asked = Instant::now();
            let guard = tokio::time::timeout(SLACK * 2, lock.acquire())
                .await
                .expect("acquire answers")
                .unwrap();
            if asked.elapsed() >= Duration::from_millis(550) {
                slow_creates += 1;
            }
            let (_, deleted) = deleter.await.unwrap();
            fx.pass();
            assert_eq!(guard.token().unwrap().get(), deleted as u64);
            // A round trip and then some.
            tokio::time::sleep(Duration::from_millis(800)).await;
            let left = keys(&server.endpoints(), &prefix);
            assert!(left.is_empty(), "{left:?}");
            eprintln!("round {round}.{cycle}: state {:?}", guard.state());
            assert_ne!(
                guard.state(),
                LockState::Held,
                "round {round}.{cycle}: its key was deleted 0.8 s ago and the guard is still Held (the kept watch dropped the delete before the grant took it)"
            );
            let _ = guard.release().await;
        }
        drop(locks);
        drop(backend);
    }
    eprintln!("{slow_creates} creates went the slow way");
}

/// The held-keys stream is reopened (a new runtime, or a connection that came back) after a kept
/// watch of a released key is already due: the reopen takes every entry, watches it on the new stream,
/// and only then prunes the due ones from the state without cancelling them, so that watch stays on
/// the server for as long as the stream lives (nothing else cancels it: only a delete of the key
/// reaching it would).
#[test]
fn a_kept_watch_due_at_a_reopen_is_not_left_on_the_server() {
    let server = EtcdServer::start_or_panic();
    let name = common::name("kept_watch_reopen");
    let rt1 = runtime();
    let locks = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        locks
            .lock(&name)
            .unwrap()
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        locks
    });
    drop(rt1);
    // The kept watch is due now; nothing pruned it (its task went with the runtime).
    std::thread::sleep(Duration::from_millis(1500));
    let rt2 = runtime();
    rt2.block_on(async {
        // Any use of the backend moves the held-keys task here (the kept entry makes it run).
        let other = locks
            .lock(&common::name("kept_watch_reopen_other"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        other.release().await.unwrap();
        let deadline = Instant::now() + LINGER_AND_SLACK;
        loop {
            let left = watch_gauge(server.addr(), "etcd_debugging_mvcc_watcher_total").await;
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{left} watches left on the server: the kept watch of {name} was made again on the new stream and never cancelled"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    drop(locks);
}

const LINGER_AND_SLACK: Duration = Duration::from_secs(5);

/// Review of the kept watch (r-watch): a grant whose watch was confirmed after its read (the store
/// moved: here the key itself was deleted in between) re-reads the key in `recheck_granted`; if that
/// read fails (the member stalls for longer than the request timeout, then comes back), the error is
/// only logged ("its watch still reports a delete, if later"), but the delete was *earlier* than the
/// watch, the watch task was handed the confirmation (so it does not re-read), and the stream did not
/// break: nothing ever reports it. The guard stays `Held` with its key gone, and renewals of the live
/// session keep it so. The same re-read is what the kept-watch fix relies on when a grant finds its
/// kept watch saw a later delete (`take_lingering` → own watch → `recheck_granted`).
/// Timeline (proxy delay d = 300 ms each way, request_timeout 1 s): create reaches etcd at t, the
/// deleter (direct) deletes at ~t; create reply at the client t+d; watch created at etcd t+2d;
/// confirmation at the client t+3d, get sent; etcd paused at t+800 ms (before the get arrives at
/// t+4d) for 1.5 s, so the get times out. (HTTP/2 pings run every 2 s with a 1 s timeout: a ping
/// caught by the pause breaks the stream, whose reopen re-reads and masks the hole, so several rounds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_delete_before_the_grants_watch_is_reported_when_the_grants_re_read_fails() {
    let mut fx = Proxied::start(1);
    let raw = fx.raw().await;
    let (_backend, locks) = fx.connect(false, "request_timeout=1s").await;
    // A session exists before the delay (its lease grant is not part of the timeline).
    locks
        .lock(&common::name("reread_fails_warmup"))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let mut held_with_key_gone = Vec::new();
    for round in 0..4 {
        let name = common::name(&format!("reread_fails_{round}"));
        let prefix = format!("{name}/");
        let start = revision(&raw).await;
        let deleter = delete_the_next_key(&raw, &prefix, start);
        fx.delay(Duration::from_millis(300));
        let lock = locks.lock(&name).unwrap();
        let acquire = tokio::spawn(async move { lock.acquire().await });
        let (deleted_at, _) = deleter.await.unwrap();
        tokio::time::sleep_until((deleted_at + Duration::from_millis(800)).into()).await;
        if stalled_grant_held_with_its_key_gone(
            &mut fx,
            acquire,
            &prefix,
            &format!("round {round}"),
        )
        .await
        {
            held_with_key_gone.push(round);
        }
    }
    assert!(
        held_with_key_gone.is_empty(),
        "rounds {held_with_key_gone:?}: the key was deleted before the grant's watch and the grant's re-read failed; the guard is still Held {} s later with its key gone",
        SLACK.as_secs()
    );
}

/// The same hole on the kept-watch fix's own path (9948eec): the kept watch saw the delete of the next
/// key before the grant took it (the create's reply came the slow way), so `take_lingering` refuses it
/// and the grant makes its own watch, confirmed after the delete, and re-reads the key. That re-read
/// fails (etcd stalls past the request timeout right after the confirmation), the error is only
/// logged, and nothing else re-reads: `Held` with its key gone although the kept watch *knew* the key
/// was deleted (`deleted_while_kept > rev`). Three "members" (two behind slow proxies, one direct;
/// the held-keys stream opened on the direct one): when the create goes to the first proxy, the
/// grant's re-read goes to the second (requests go to the endpoints in turn). Observed: the take was
/// refused in every cycle, and cycles 0-3 of 9 stayed `Held` (2 runs of 2; 6 cycles are run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_kept_watch_delete_is_reported_when_the_grants_re_read_fails() {
    let mut fx = Proxied::start(2);
    let raw = fx.raw().await;
    let (backend, locks) = fx.connect(true, "request_timeout=1s").await;
    // The held-keys stream on the direct member: opened while the proxies refuse.
    fx.refuse();
    let warm = locks
        .lock(&common::name("kept_watch_reread_fails_warm"))
        .unwrap();
    for _ in 0..3 {
        if let Ok(guard) = warm.acquire().await {
            let _ = guard.release().await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut hits = Vec::new();
    for cycle in 0..6 {
        fx.pass();
        // Shift which member the next requests go to.
        let _ = backend.client().range(probe()).await;
        let name = common::name(&format!("kept_watch_reread_fails_{cycle}"));
        let prefix = format!("{name}/");
        let lock = locks.lock(&name).unwrap();
        lock.acquire().await.unwrap().release().await.unwrap();
        let start = revision(&raw).await;
        let deleter = delete_the_next_key(&raw, &prefix, start);
        // Under the 250 ms hedge of a 1 s request timeout with two endpoints.
        fx.delay(Duration::from_millis(100));
        let acquire = tokio::spawn(async move { lock.acquire().await });
        let (deleted_at, _) = deleter.await.unwrap();
        // After the grant's own watch is confirmed (create reply ~+100 ms, confirmation a local
        // round trip later), before its re-read reaches etcd through the slow member (~+200 ms).
        tokio::time::sleep_until((deleted_at + Duration::from_millis(150)).into()).await;
        if stalled_grant_held_with_its_key_gone(
            &mut fx,
            acquire,
            &prefix,
            &format!("cycle {cycle}"),
        )
        .await
        {
            hits.push(cycle);
        }
    }
    assert!(
        hits.is_empty(),
        "cycles {hits:?}: the next key's delete reached the kept watch first, the grant's re-read failed, and the guard is still Held {} s later with its key gone",
        SLACK.as_secs()
    );
}

/// The two re-read tests' stall: etcd paused for 1.5 s (past the 1 s request timeout of the grant's
/// re-read), then `acquire`'s grant, if any, checked far more than a round trip later (see
/// [`held_with_its_key_gone`]) and released. `what` names the round in the log.
async fn stalled_grant_held_with_its_key_gone(
    fx: &mut Proxied,
    acquire: tokio::task::JoinHandle<distlock_core::Result<distlock_core::LockGuard>>,
    prefix: &str,
    what: &str,
) -> bool {
    fx.stall(Duration::from_millis(1500)).await;
    let guard = tokio::time::timeout(SLACK * 2, acquire)
        .await
        .expect("acquire answers")
        .unwrap();
    fx.pass();
    let Ok(guard) = guard else {
        eprintln!("{what}: acquire failed: {guard:?}");
        return false;
    };
    // Far more than a round trip.
    tokio::time::sleep(SLACK).await;
    let held = held_with_its_key_gone(&fx.server, prefix, &guard);
    let _ = guard.release().await;
    held
}

/// Deletes the first key under `prefix` created after revision `after`, as soon as it appears (an
/// operator's delete racing a grant): when, and the key's create_revision.
fn delete_the_next_key(
    raw: &Client,
    prefix: &str,
    after: i64,
) -> tokio::task::JoinHandle<(Instant, i64)> {
    use distlock_etcd::rpc::pb::etcdserverpb::RangeRequest;
    let raw = raw.clone();
    let prefix = prefix.as_bytes().to_vec();
    tokio::spawn(async move {
        let mut end = prefix.clone();
        *end.last_mut().unwrap() += 1;
        loop {
            let got = raw
                .range(RangeRequest {
                    key: prefix.clone(),
                    range_end: end.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            if let Some(kv) = got.kvs.iter().find(|kv| kv.create_revision > after) {
                raw.delete_range(DeleteRangeRequest {
                    key: kv.key.clone(),
                    ..DeleteRangeRequest::default()
                })
                .await
                .unwrap();
                return (Instant::now(), kv.create_revision);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
}

/// Whether `guard` still says `Held` although its own key (its token is the key's create_revision) is
/// gone from the server.
fn held_with_its_key_gone(
    server: &EtcdServer,
    prefix: &str,
    guard: &distlock_core::LockGuard,
) -> bool {
    let left = keys(&server.endpoints(), prefix);
    eprintln!("state {:?}, keys left {left:?}", guard.state());
    let token = guard.token().unwrap().get();
    !left.iter().any(|k| k.create_revision == token) && guard.state() == LockState::Held
}

/// Issue 9: the client-side expiry of held locks is one task per backend, not one per held lock.
/// Holding 200 more locks adds O(1) tokio tasks beside the core's loss watch per hold (a task per
/// lock added >= 200 more), every hold has a
/// deadline in the shared structure, and a release removes its entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holding_many_locks_adds_no_expiry_task_per_lock() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let name = common::name("many_held");
    // Everything the backend starts lazily starts here (session, keep-alive, held-keys watch, expiry).
    let first = locks
        .lock(&format!("{name}/warm"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let mut guards = Vec::new();
    for i in 0..200 {
        guards.push(
            locks
                .lock(&format!("{name}/{i}"))
                .unwrap()
                .acquire()
                .await
                .unwrap(),
        );
    }
    let after = metrics.num_alive_tasks();
    // The core watches each hold's loss signal in a task of its own (one per hold, not the
    // backend's); the backend adds O(1) on top (a task per lock: >= 200 more).
    let core_loss_watches = 200;
    assert!(
        after < before + core_loss_watches + 20,
        "holding 200 more locks went from {before} to {after} tokio tasks"
    );
    assert_eq!(backend.held_deadlines(), 201);
    for guard in guards {
        guard.release().await.unwrap();
    }
    assert_eq!(
        backend.held_deadlines(),
        1,
        "a release removes its deadline"
    );
    // A dropped guard is released in the background.
    drop(first);
    let dropped_at = Instant::now();
    while backend.held_deadlines() != 0 {
        assert!(
            dropped_at.elapsed() < SLACK,
            "a dropped hold's deadline is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls until no key is left under `prefix`, at most until `start + by`, and not before `start + cap`:
/// a capped hold's key is deleted at its cap.
async fn gone_at_its_cap(eps: &str, prefix: &str, start: Instant, cap: Duration, by: Duration) {
    while !keys(eps, prefix).is_empty() {
        assert!(
            start.elapsed() < by,
            "the key under {prefix} (max_hold {cap:?}) is still there after {:?}",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(start.elapsed() >= cap, "{prefix}: not before its cap");
}

/// A hold of `name` with `locks`' default lease and a `max_hold` of `cap`.
async fn capped_hold(locks: &Locks, name: &str, cap: Duration) -> distlock_core::LockGuard {
    let lock = locks.lock(name).unwrap();
    lock.options().max_hold(cap).acquire().await.unwrap()
}

/// At the defaults users run (the backend's default lease, the default 60 s session TTL, nothing
/// shortened), a hold with a `max_hold` of 2 s is `Lost` at the cap and its key is deleted on the
/// server within a few seconds of it, long before a 60 s session would take it, so another process
/// (another backend: its own session) gets the name. The first lease asked is capped by `max_hold`,
/// so the hold is on the backend's 2 s session (one per lease length), not the 60 s one; that session
/// is kept alive, and the key would stay with it but for the client-side expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_defaults_a_max_hold_frees_the_name_on_the_server_at_the_cap() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    assert_eq!(backend.default_lease(), Duration::from_secs(60));
    let holder = locks_on(&backend);
    let other = locks(&server.url()).await;
    let name = common::name("max_hold_defaults");
    let prefix = format!("{name}/");
    let cap = Duration::from_secs(2);
    let start = Instant::now();
    let guard = capped_hold(&holder, &name, cap).await;
    eprintln!(
        "the hold's key {:?}; the backend's sessions (ttl, id): {:?}",
        keys(&server.endpoints(), &prefix),
        backend.session_leases().await
    );
    tokio::time::timeout_at((start + cap + SLACK).into(), guard.lost())
        .await
        .expect("Lost at max_hold");
    let reason = guard.loss_reason().unwrap_or_default();
    assert!(
        reason.contains("max_hold was reached"),
        "the loss names its cause: {reason}"
    );
    gone_at_its_cap(&server.endpoints(), &prefix, start, cap, cap + SLACK).await;
    let next = other
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(1))
        .acquire()
        .await
        .expect("another process gets the name once the capped hold's key is gone");
    assert!(
        next.token().unwrap() > guard.token().unwrap(),
        "the next holder's token is greater"
    );
    next.release().await.unwrap();
    drop(guard);
}

/// At the defaults (long lease, 60 s session TTL), two holds of one backend on two runtimes with
/// different `max_hold` caps: the first granted on runtime A (where the expiry task starts), the second
/// on runtime B; A is dropped right after, with the first hold's deadline still ahead: both keys are
/// still deleted at their caps (the first by a task on B), while the sessions live on (their keep-alives
/// move to B with the core's early renewals).
#[test]
fn at_the_defaults_capped_holds_on_two_runtimes_expire_after_the_first_is_dropped() {
    let server = EtcdServer::start_or_panic();
    let eps = server.endpoints();
    let name = common::name("caps_defaults_two_rts");
    let (cap_a, cap_b) = (Duration::from_secs(2), Duration::from_secs(4));
    let rt_a = runtime();
    let rt_b = runtime();
    let locks = rt_a.block_on(locks(&server.url()));
    let start = Instant::now();
    let a = rt_a.block_on(capped_hold(&locks, &format!("{name}-a"), cap_a));
    let b = rt_b.block_on(capped_hold(&locks, &format!("{name}-b"), cap_b));
    drop(rt_a);
    rt_b.block_on(async {
        let prefix = |suffix: &str| format!("{name}-{suffix}/");
        gone_at_its_cap(&eps, &prefix("a"), start, cap_a, cap_a + SLACK).await;
        gone_at_its_cap(&eps, &prefix("b"), start, cap_b, cap_b + SLACK).await;
    });
    assert_ne!(a.state(), LockState::Held);
    assert_ne!(b.state(), LockState::Held);
    drop((a, b));
    drop(locks);
}

/// Several holds with different `max_hold` caps on one backend: each key is deleted at its own cap,
/// in order of the caps though not of the acquires (the latest cap first, so the earlier deadlines
/// inserted after it must wake the expiry task), and a hold that is renewed (no cap) is not expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_with_different_caps_expire_in_order_and_a_renewed_one_does_not() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let locks = locks_on(&backend);
    let eps = server.endpoints();
    let name = common::name("caps");
    let lease = Duration::from_secs(2);
    let acquire = |suffix: &'static str, cap: Option<Duration>| {
        let locks = locks.clone();
        let name = format!("{name}/{suffix}");
        async move {
            let lock = locks.lock(&name).unwrap();
            let options = lock.options().lease(lease);
            let options = match cap {
                Some(cap) => options.max_hold(cap),
                None => options,
            };
            options.acquire().await.unwrap()
        }
    };
    let start = Instant::now();
    let late = acquire("late", Some(Duration::from_secs(10))).await;
    let early = acquire("early", Some(Duration::from_secs(2))).await;
    let middle = acquire("middle", Some(Duration::from_secs(5))).await;
    let renewed = acquire("renewed", None).await;
    let present = |suffix: &str| !keys(&eps, &format!("{name}/{suffix}/")).is_empty();
    assert!(present("late") && present("early") && present("middle") && present("renewed"));

    let gone = |suffix: &'static str, by: Duration| {
        let present = &present;
        async move {
            while present(suffix) {
                assert!(
                    start.elapsed() < by,
                    "the key of {suffix} is still there after {:?}",
                    start.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    gone("early", Duration::from_secs(2) + SLACK).await;
    assert!(
        start.elapsed() >= Duration::from_secs(2),
        "not before its cap"
    );
    assert!(
        present("late"),
        "the later cap is not expired with the earlier one"
    );
    gone("middle", Duration::from_secs(5) + SLACK).await;
    assert!(
        start.elapsed() >= Duration::from_secs(5),
        "not before its cap"
    );
    assert!(
        present("late"),
        "the later cap is not expired with the earlier one"
    );
    gone("late", Duration::from_secs(10) + SLACK).await;
    assert!(
        start.elapsed() >= Duration::from_secs(10),
        "not before its cap"
    );
    for guard in [&early, &middle, &late] {
        assert_ne!(guard.state(), LockState::Held);
    }
    // Renewed through five of its leases: still held, its key still there, its deadline still kept.
    assert_eq!(
        renewed.state(),
        LockState::Held,
        "{:?}",
        renewed.loss_reason()
    );
    assert!(present("renewed"));
    assert_eq!(backend.held_deadlines(), 1);
    renewed.release().await.unwrap();
    assert_eq!(backend.held_deadlines(), 0);
    drop((early, middle, late));
}

/// A hold made on a runtime that is then dropped (with the expiry task and the core's watchdog):
/// once the backend is used on a second runtime, the expiry task runs there and still deletes the
/// hold's key at its cap.
#[test]
fn a_capped_hold_still_expires_after_its_runtime_is_dropped() {
    let server = EtcdServer::start_or_panic();
    let cap = Duration::from_secs(2);
    let name = common::name("cap_runtimes");
    let eps = server.endpoints();

    let rt1 = runtime();
    let (locks, guard, start) = rt1.block_on(async {
        let backend = backend(&server.url()).await;
        let locks = locks_on(&backend);
        let start = Instant::now();
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(cap)
            .max_hold(cap)
            .acquire()
            .await
            .unwrap();
        (locks, guard, start)
    });
    drop(rt1);

    let rt2 = runtime();
    rt2.block_on(async {
        // Any use of the backend starts its background tasks again on this runtime.
        let other = locks
            .lock(&format!("{name}-other"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        while !keys(&eps, &format!("{name}/")).is_empty() {
            assert!(
                start.elapsed() < cap + SLACK,
                "the capped hold's key is still there after {:?}",
                start.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(start.elapsed() >= cap, "not before its cap");
        other.release().await.unwrap();
    });
    drop(guard);
}

/// The expiry task of a backend was bound to the runtime it was first spawned on. A hold
/// granted on a second runtime (whose grant finds the task alive on the first, so does not move it),
/// after which the first runtime is dropped: with no renewal due (lease == max_hold) and no other use
/// of the backend, nothing restarts the task and the key is not deleted at its cap. Before, the
/// hold's own timer was spawned on the runtime of its grant and survived.
#[test]
fn a_hold_granted_on_a_second_runtime_expires_after_the_first_is_dropped() {
    let server = EtcdServer::start_or_panic();
    let cap = Duration::from_secs(2);
    let name = common::name("cap_second_rt");
    let eps = server.endpoints();

    let rt_b = runtime();
    let locks = rt_b.block_on(locks(&server.url()));
    // The first hold on the backend is made on runtime A: the expiry task starts there.
    let rt_a = runtime();
    rt_a.block_on(async {
        let warm = locks
            .lock(&format!("{name}-warm"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        warm.release().await.unwrap();
    });
    // The capped hold is granted on runtime B.
    let (guard, start) = rt_b.block_on(async {
        let start = Instant::now();
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(cap)
            .max_hold(cap)
            .acquire()
            .await
            .unwrap();
        // The core renews once or twice early on (each renewal restarts a dead task on this
        // runtime) and not once the grant covers the rest of the cap: wait for that.
        tokio::time::sleep_until((start + cap * 3 / 4).into()).await;
        (guard, start)
    });
    drop(rt_a);
    rt_b.block_on(async {
        while !keys(&eps, &format!("{name}/")).is_empty() {
            assert!(
                start.elapsed() < cap + SLACK,
                "the capped hold's key is still there after {:?} (its guard: {:?})",
                start.elapsed(),
                guard.state()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(start.elapsed() >= cap, "not before its cap");
    });
    drop(guard);
}

/// Review of a37632b (pre-existing since e24c33a): the expiry task removes a due entry from the
/// deadline map before its delete succeeds, and `delete_own` gives up after three attempts. A
/// connection that is down for ~2 s at the deadline (shorter than the session TTL, so the session
/// lives on) makes the delete fail its attempts; nothing tries again (the entry is gone, the renewal
/// path says `Expired`), and the key blocks the name past `max_hold` until the guard is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_expiry_delete_failing_at_the_deadline_is_not_abandoned() {
    let fx = Proxied::start(1);
    let (server, proxy) = (&fx.server, fx.proxy());
    // 2 s, not 300 ms: the acquire below must succeed on a loaded machine (etcd alone took 250 ms
    // to apply a put under load). The refused connects fail at once whatever the timeout.
    let (backend, locks) = fx.connect(false, "request_timeout=2s").await;
    let name = common::name("expiry_delete_fails");
    let eps = server.endpoints();
    let cap = Duration::from_secs(4);
    let start = Instant::now();
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(cap)
        .max_hold(cap)
        .acquire()
        .await
        .unwrap();
    // Down (refused: every attempt fails at once) from just before the deadline for 2 s: longer
    // than three attempts with 50/100 ms backoff, shorter than the 4 s session TTL.
    tokio::time::sleep_until((start + cap - Duration::from_millis(200)).into()).await;
    tokio::task::block_in_place(|| proxy.refuse().unwrap());
    tokio::time::sleep(Duration::from_millis(2000)).await;
    tokio::task::block_in_place(|| proxy.pass().unwrap());
    assert_eq!(
        backend.held_deadlines(),
        0,
        "the expiry task took the entry"
    );
    while !keys(&eps, &format!("{name}/")).is_empty() {
        assert!(
            start.elapsed() < cap + Duration::from_secs(2) + SLACK,
            "the capped hold's key is still there after {:?} (guard: {:?}); the session lives on",
            start.elapsed(),
            guard.state()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(guard);
}

/// Review of a37632b: every runtime's task serves every deadline, so a hold granted on a long-lived
/// runtime B may be taken, at its deadline, by the task of a short-lived runtime C that happens to be
/// driven then. The task removes the entry and spawns the delete (with its retries) on C; C is
/// dropped while the delete is still retrying (the connection was down for ~200 ms around the
/// deadline, well within the delete's retry budget): the delete is dropped with C, nothing else has
/// the entry, and the key stays past `max_hold` on a live session. With B's task taking it, the
/// delete is retried on B and succeeds. Which task wins is a race: a few rounds.
#[test]
fn fault_an_expiry_taken_by_a_short_lived_runtime_still_deletes_the_key() {
    let server = EtcdServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let eps = server.endpoints();
    let cap = Duration::from_secs(3);
    let rt_b = runtime();
    let (backend, locks) = rt_b.block_on(async {
        // A request timeout far past a loaded machine's round trip: the acquires and the release
        // below must succeed. (At 300 ms one failed under CI load with no answer in time.) Nothing
        // here needs requests to give up early: C is dropped while its delete is still in flight or
        // between retries however long the timeout, and the refused connects fail at once.
        let backend = backend(&format!("etcd://{}?request_timeout=3s", proxy.addr())).await;
        let locks = locks_on(&backend);
        (backend, locks)
    });
    for round in 0..6 {
        let name = common::name(&format!("short_rt_expiry{round}"));
        let (guard, start) = rt_b.block_on(async {
            let start = Instant::now();
            let guard = locks
                .lock(&name)
                .unwrap()
                .options()
                .lease(cap)
                .max_hold(cap)
                .acquire()
                .await
                .unwrap();
            (guard, start)
        });
        // B's two workers busy for 300 ms across the deadline (a loaded runtime): C's task, not
        // B's, takes the entry (without this it is a race that C wins in about half the rounds).
        for _ in 0..2 {
            let busy_from = start + cap - Duration::from_millis(20);
            rt_b.spawn(async move {
                tokio::time::sleep_until(busy_from.into()).await;
                std::thread::sleep(Duration::from_millis(300));
            });
        }
        let rt_c = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt_c.block_on(async {
            // Any use of the backend on C starts an expiry task there.
            let warm = locks
                .lock(&format!("{name}-warm"))
                .unwrap()
                .options()
                .lease(cap)
                .acquire()
                .await
                .unwrap();
            warm.release().await.unwrap();
            tokio::time::sleep_until((start + cap - Duration::from_millis(50)).into()).await;
            proxy.refuse().unwrap();
            while backend.held_deadlines() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        });
        drop(rt_c);
        proxy.pass().unwrap();
        rt_b.block_on(async {
            while !keys(&eps, &format!("{name}/")).is_empty() {
                assert!(
                    start.elapsed() < cap + SLACK,
                    "round {round}: the capped hold's key is still there after {:?} (guard: {:?})",
                    start.elapsed(),
                    guard.state()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        drop(guard);
    }
}

/// The expiry task's deletes of expired keys run together: awaited one after the other (as first
/// built), they held up the next deadline by a round trip each. With etcd slow (here 400 ms each way
/// through the proxy, well within the 2 s request timeout: every delete succeeds), eight holds expiring
/// together keep the runtime's only expiry task busy for ~8 round trips; a ninth hold's deadline
/// passing meanwhile is served only after them, so its key blocks the name for several seconds past
/// its `max_hold`. Before 98e2eb5 the deletes were spawned and ran concurrently (one round trip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_many_expiries_on_a_slow_etcd_do_not_hold_up_a_later_deadline() {
    let fx = Proxied::start(1);
    let (_backend, locks) = fx.connect(false, "request_timeout=2s").await;
    // A round proves something only if its nine holds were granted in time (below); a loaded machine
    // may miss that: such a round still checks B's key, and another is run.
    let mut conclusive = false;
    for round in 0..3 {
        if many_expiries_round(&fx, &locks, round).await {
            conclusive = true;
            break;
        }
    }
    assert!(
        conclusive,
        "in no round were the nine holds granted in time to test the case"
    );
}

/// One round of the many-expiries case; returns whether its setup was in time to catch deletes
/// awaited one after the other.
async fn many_expiries_round(fx: &Proxied, locks: &Locks, round: u32) -> bool {
    let eps = fx.server.endpoints();
    let cap = Duration::from_secs(5);
    let start = Instant::now();
    let mut early = Vec::new();
    let k: usize = 8;
    for i in 0..k {
        let name = common::name(&format!("inline_expiry{round}_a{i}"));
        early.push(
            locks
                .lock(&name)
                .unwrap()
                .options()
                .lease(cap)
                .max_hold(cap)
                .acquire()
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep_until((start + Duration::from_millis(1000)).into()).await;
    let b_name = common::name(&format!("inline_expiry{round}_b"));
    let b_start = Instant::now();
    let b = locks
        .lock(&b_name)
        .unwrap()
        .options()
        .lease(cap)
        .max_hold(cap)
        .acquire()
        .await
        .unwrap();
    let b_granted = start.elapsed();
    // Slow from just before the first deadline (the first hold's, `start + cap` at the earliest).
    tokio::time::sleep_until((start + cap - Duration::from_millis(400)).into()).await;
    fx.delay(Duration::from_millis(400));
    let slow_from = start.elapsed();
    // With the deletes awaited one by one (a round trip, ~0.8 s, each), B's would end at least
    // 9 × 0.8 s after the first deadline, so at least `cap + 7.2 s − b_granted` after B's grant: past
    // the limit below by 1.2 s or more if B was granted within 3.5 s and every delete was slow.
    let conclusive = b_granted < Duration::from_millis(3_500) && slow_from < cap;
    eprintln!(
        "round {round}: B granted {b_granted:?}, etcd slow from {slow_from:?} after the start"
    );
    // B's deadline is at b_start + cap; one delete round trip is ~0.8 s.
    let limit = cap + Duration::from_millis(2500);
    while !keys(&eps, &format!("{b_name}/")).is_empty() {
        assert!(
            b_start.elapsed() < limit,
            "B's key is still there {:?} after its grant (max_hold {:?}; guard: {:?}): its deadline waited for the other holds' inline deletes",
            b_start.elapsed(),
            cap,
            b.state()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("B's key gone {:?} after its grant", b_start.elapsed());
    fx.pass();
    drop(b);
    drop(early);
    conclusive
}
