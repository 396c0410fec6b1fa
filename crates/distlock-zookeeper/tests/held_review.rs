//! Adversarial review of the per-session held-node task (branch h-zk): losses reported late or never,
//! `max_hold` not enforced, runtimes dropped under the session's task.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{children, locks_at, name, raw_client, wait_children};
use distlock_core::{LockGuard, LockState, Locks};
use distlock_testkit::proxy::{Mode, Proxy};
use distlock_testkit::zookeeper::ZkServer;

/// An operator deletes the holder's node right after its grant (before the session's task could have
/// set its watch, no sleep in between), while another client waits behind it: the holder must be
/// `Lost` by the time the next holder is granted. All three clients' sessions share one current-thread
/// runtime with the test, so the session tasks compete with the test for the thread.
#[tokio::test(flavor = "current_thread")]
async fn review_operator_delete_right_after_grant_is_lost_before_the_next_grant() {
    let server = ZkServer::start_or_panic();
    let addr = server.addr().to_string();
    let raw = raw_client(&addr).await;
    let (locks_a, locks_b, locks_c) = (
        locks_at(&server.url()).await,
        Arc::new(locks_at(&server.url()).await),
        locks_at(&server.url()).await,
    );
    let mut held_at_next_grant = Vec::new();
    for round in 0..20 {
        let lock_name = name("delete_after_grant");
        let first = locks_c.lock(&lock_name).unwrap().acquire().await.unwrap();
        let a_node: Arc<Mutex<Option<String>>> = Arc::default();
        let (a_state_tx, a_state_rx) =
            tokio::sync::oneshot::channel::<tokio::sync::watch::Receiver<LockState>>();
        // The helper: once A waits, B queues behind it, then the first holder releases.
        let helper = {
            let (raw, lock_name, a_node, locks_b) =
                (raw.clone(), lock_name.clone(), a_node.clone(), locks_b.clone());
            tokio::spawn(async move {
                let c = wait_children(&raw, &lock_name, 2).await;
                *a_node.lock().unwrap() = Some(c[1].clone());
                let b = {
                    let (lock_name, locks_b) = (lock_name.clone(), locks_b.clone());
                    tokio::spawn(async move {
                        let guard = locks_b.lock(&lock_name).unwrap().acquire().await.unwrap();
                        // The moment B is granted: A's state.
                        let a_state = *a_state_rx.await.unwrap().borrow();
                        (guard, a_state, locks_b)
                    })
                };
                wait_children(&raw, &lock_name, 3).await;
                first.release().await.unwrap();
                b.await.unwrap()
            })
        };
        let a = locks_a.lock(&lock_name).unwrap().acquire().await.unwrap();
        let node = a_node.lock().unwrap().clone().unwrap();
        a_state_tx.send(a.state_changes()).unwrap();
        raw.delete(&format!("/{lock_name}/{node}"), None)
            .await
            .expect("operator delete");
        let (b, a_state_at_b_grant, _locks_b) = helper.await.unwrap();
        if a_state_at_b_grant != LockState::Lost {
            // How much later A turns Lost after all.
            let since = Instant::now();
            let late = tokio::time::timeout(Duration::from_secs(10), a.lost()).await;
            held_at_next_grant.push((round, a_state_at_b_grant, late.map(|()| since.elapsed())));
        }
        b.release().await.unwrap();
        drop(a);
    }
    assert!(
        held_at_next_grant.is_empty(),
        "A's node deleted right after A's grant: A not yet Lost when B was granted in {} of 20 rounds: {held_at_next_grant:?}",
        held_at_next_grant.len()
    );
}

/// Many holds with a `max_hold`: once it passes, the session's one task deletes every node (the
/// session lives on with pings, so nothing else would), while the guards are still alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_max_hold_deletes_every_node_of_many_holds() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let locks = locks_at(&server.url()).await;
    let base = name("max_hold_many");
    let names: Vec<String> = (0..25).map(|i| format!("{base}/{i}")).collect();
    let started = Instant::now();
    let mut guards = Vec::new();
    for n in &names {
        guards.push(
            locks
                .lock(n)
                .unwrap()
                .options()
                .lease(Duration::from_secs(2))
                .max_hold(Duration::from_secs(3))
                .acquire()
                .await
                .unwrap(),
        );
    }
    let cap = started + Duration::from_secs(3);
    loop {
        let mut left = 0;
        for n in &names {
            left += children(&raw, n).await.len();
        }
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < cap + Duration::from_secs(3),
            "{left} nodes still there {:?} after max_hold",
            Instant::now().saturating_duration_since(cap)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for g in &guards {
        assert_eq!(g.state(), LockState::Lost);
    }
    drop(guards);
}

/// `max_hold` of holds acquired from a short-lived runtime (a `#[tokio::test]`'s, a thread's
/// current-thread runtime) on a session that lives on another, long-lived runtime: once the acquiring
/// runtime is dropped, the nodes must still be deleted at `max_hold` (the session keeps pinging, so
/// the node would outlive the hold and block every other client while the guard lives).
#[test]
fn review_max_hold_enforced_after_the_acquiring_runtime_is_dropped() {
    let server = ZkServer::start_or_panic();
    let url = server.url();
    let addr = server.addr().to_string();
    let main_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let base = name("max_hold_runtime");
    let (locks, raw): (Locks, _) = main_rt.block_on(async {
        let locks = locks_at(&url).await;
        // The 2 s session is established here, on the long-lived runtime.
        let g = locks
            .lock(&format!("{base}/warm"))
            .unwrap()
            .options()
            .lease(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap();
        g.release().await.unwrap();
        (locks, raw_client(&addr).await)
    });
    let names: Vec<String> = (0..5).map(|i| format!("{base}/{i}")).collect();
    let started = Instant::now();
    let guards: Vec<LockGuard> = std::thread::scope(|s| {
        s.spawn(|| {
            let short = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let guards = short.block_on(async {
                let mut guards = Vec::new();
                for n in &names {
                    guards.push(
                        locks
                            .lock(n)
                            .unwrap()
                            .options()
                            .lease(Duration::from_secs(2))
                            .max_hold(Duration::from_secs(3))
                            .acquire()
                            .await
                            .unwrap(),
                    );
                }
                guards
            });
            drop(short);
            guards
        })
        .join()
        .unwrap()
    });
    main_rt.block_on(async {
        let cap = started + Duration::from_secs(3);
        loop {
            let mut left = 0;
            for n in &names {
                left += children(&raw, n).await.len();
            }
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < cap + Duration::from_secs(3),
                "{left} nodes still there {:?} after max_hold (acquiring runtime dropped)",
                Instant::now().saturating_duration_since(cap)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    main_rt.block_on(async move {
        drop(guards);
        drop(locks);
    });
}

/// Holds whose session lived on a runtime that was then dropped (a `Locks` used from several
/// runtimes): the session's I/O and its task are gone, the lock cannot be renewed any more; the guard
/// must turn `Lost` promptly (by the next renewal at the latest), with no panic.
#[test]
fn review_holds_of_a_session_whose_runtime_was_dropped_turn_lost() {
    // Panics on distlock's background runtime (a loss watch moved there polling a dead client).
    static BACKGROUND_PANICS: AtomicUsize = AtomicUsize::new(0);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("distlock-background") {
            if BACKGROUND_PANICS.fetch_add(1, Ordering::Relaxed) < 2 {
                previous(info);
            }
        } else {
            previous(info);
        }
    }));
    let server = ZkServer::start_or_panic();
    let url = server.url();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let base = name("runtime_dropped");
    let (locks, guards) = first.block_on(async {
        let locks = locks_at(&url).await;
        let mut guards = Vec::new();
        for i in 0..3 {
            guards.push(
                locks
                    .lock(&format!("{base}/{i}"))
                    .unwrap()
                    .options()
                    .lease(Duration::from_secs(3))
                    .acquire()
                    .await
                    .unwrap(),
            );
        }
        (locks, guards)
    });
    drop(first);
    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let dropped = Instant::now();
        for g in &guards {
            tokio::time::timeout(Duration::from_secs(4), g.lost())
                .await
                .unwrap_or_else(|_| {
                    panic!("still {:?} {:?} after its session's runtime was dropped", g.state(), dropped.elapsed())
                });
        }
        eprintln!("lost {:?} after the drop: {:?}", dropped.elapsed(), guards[0].loss_reason());
        drop(guards);
        drop(locks);
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    let panics = BACKGROUND_PANICS.load(Ordering::Relaxed);
    assert_eq!(panics, 0, "{panics} panics on distlock's background runtime");
}

/// The holder's node deleted by an operator while the holder's client is reconnecting (its connection
/// dropped, the session alive): once it reconnects the hold is `Lost` within a round trip or two, not
/// at its deadline (the default lease's, ≈ 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_fault_delete_while_reconnecting_is_lost_on_reconnect() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let locks = locks_at(&format!("zk://{}", proxy.addr())).await;
    let lock_name = name("delete_reconnecting");
    let guard = locks.lock(&lock_name).unwrap().acquire().await.unwrap();
    let other = locks.lock(&format!("{lock_name}-other")).unwrap().acquire().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let node = children(&raw, &lock_name).await.remove(0);
    let p = proxy.clone();
    tokio::task::spawn_blocking(move || p.set_mode(Mode::Refuse).unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.delete(&format!("/{lock_name}/{node}"), None).await.expect("operator delete");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let p = proxy.clone();
    tokio::task::spawn_blocking(move || p.set_mode(Mode::Pass).unwrap()).await.unwrap();
    let restored = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .unwrap_or_else(|_| panic!("still {:?} {:?} after reconnecting", guard.state(), restored.elapsed()));
    eprintln!("lost {:?} after the reconnect: {:?}", restored.elapsed(), guard.loss_reason());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_ne!(other.state(), LockState::Lost, "{:?}", other.loss_reason());
}
