//! Issue 9: held ZooKeeper locks cost no task each. Every held node of a session is watched by that
//! session's one task (`held.rs`), which reports into each hold's `LossReport`: a node deleted reports
//! exactly its hold, a session that ends reports every hold on it, and a release forgets its record at
//! once. Test names with `fault` end a session.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{children, name, raw_client};
use distlock_core::{LockGuard, LockState, Locks};
use distlock_testkit::proxy::{Mode, Proxy};
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::ZkBackend;
use zookeeper_client as zk;

/// Slack for scheduling on a loaded 2-core machine; far below the default lease (60 s session, TTL
/// ≈ 30 s), by which a loss could also come from a renewal or the core's deadline.
const BOUND: Duration = Duration::from_secs(5);

async fn backend_at(url: &str) -> ZkBackend {
    let url = distlock_core::url::LockUrl::parse(url).unwrap();
    ZkBackend::connect(&url).await.expect("connect")
}

async fn set_mode(proxy: &Arc<Proxy>, mode: Mode) {
    let proxy = proxy.clone();
    tokio::task::spawn_blocking(move || proxy.set_mode(mode).unwrap())
        .await
        .unwrap();
}

async fn hold(locks: &Locks, names: &[String]) -> Vec<LockGuard> {
    let mut guards = Vec::new();
    for name in names {
        guards.push(locks.lock(name).unwrap().acquire().await.unwrap());
    }
    guards
}

/// Held ZooKeeper locks run no task each: as many tokio tasks with 41 holds as with one (the session's
/// task, its touch keeper, the core's watchdog). With a loss future per hold, the core ran a task per
/// hold (and the `max_hold` timer another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_locks_run_no_task_per_hold() {
    let server = ZkServer::start_or_panic();
    let backend = backend_at(&server.url()).await;
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    let base = name("no_task");
    let first = locks
        .lock(&format!("{base}/first"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let metrics = tokio::runtime::Handle::current().metrics();
    let with_one = metrics.num_alive_tasks();
    let names: Vec<String> = (0..40).map(|i| format!("{base}/{i}")).collect();
    let guards = hold(&locks, &names).await;
    let with_many = metrics.num_alive_tasks();
    assert!(
        with_many < with_one + 5,
        "{with_one} tasks with one hold, {with_many} with 41"
    );
    assert_eq!(backend.held_nodes().0, 41, "every hold is recorded");
    for guard in guards.iter().chain([&first]) {
        assert_eq!(guard.state(), LockState::Held);
    }
}

/// An operator deleting one held node: exactly that hold is `Lost` (within a round trip, long before
/// a renewal could find the node missing), the others of the same session stay `Held`, and the lost
/// hold's record goes with its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_delete_reports_exactly_that_hold() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let backend = backend_at(&server.url()).await;
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    let base = name("one_deleted");
    let names: Vec<String> = (0..12).map(|i| format!("{base}/{i}")).collect();
    let guards = hold(&locks, &names).await;
    let victim = 7;
    let node = children(&raw, &names[victim]).await.remove(0);
    raw.delete(&format!("/{}/{node}", names[victim]), None)
        .await
        .expect("operator delete");
    tokio::time::timeout(BOUND, guards[victim].lost())
        .await
        .expect("the deleted node's hold was not reported Lost");
    let reason = guards[victim].loss_reason().unwrap();
    assert!(
        reason.contains("deleted") && reason.contains(&node),
        "{reason}"
    );
    // The others' watches saw nothing: give a stray report time to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (i, guard) in guards.iter().enumerate().filter(|(i, _)| *i != victim) {
        assert_eq!(guard.state(), LockState::Held, "{}", names[i]);
    }
    assert_eq!(backend.held_nodes().0, names.len() - 1);
}

/// The session ended for good (closed on the server by another client that took it over while the
/// backend's connection was down, as the server expiring it would end it): once the backend's client
/// reconnects and hears of it, every hold of that session is reported `Lost` at once, long before
/// its deadline, and the holds of the backend's other session (another lease) are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_session_end_reports_every_hold_of_that_session() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let backend = backend_at(&format!("zk://{}", proxy.addr())).await;
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    let base = name("session_end");
    let on_default: Vec<String> = (0..8).map(|i| format!("{base}/d{i}")).collect();
    let default_guards = hold(&locks, &on_default).await;
    let mut other_guards = Vec::new();
    for i in 0..3 {
        other_guards.push(
            locks
                .lock(&format!("{base}/o{i}"))
                .unwrap()
                .options()
                .lease(Duration::from_secs(40))
                .acquire()
                .await
                .unwrap(),
        );
    }
    let info = backend
        .session_info(backend.default_lease())
        .expect("the default session");
    // The backend's connections closed (the server forgets them), the session taken over and closed.
    set_mode(&proxy, Mode::Refuse).await;
    let mut tries = 0;
    let thief = loop {
        match zk::Client::connector()
            .with_session(info.clone())
            .connect(&server.addr().to_string())
            .await
        {
            Ok(thief) => break thief,
            Err(e) => {
                tries += 1;
                assert!(tries < 5, "could not take the session over: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    drop(thief); // closes the session on the server
    tokio::time::sleep(Duration::from_millis(200)).await;
    set_mode(&proxy, Mode::Pass).await;
    let ended = Instant::now();
    for (name, guard) in on_default.iter().zip(&default_guards) {
        let left = BOUND.saturating_sub(ended.elapsed());
        tokio::time::timeout(left, guard.lost())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{name}: not Lost {:?} after its session ended",
                    ended.elapsed()
                )
            });
        let reason = guard.loss_reason().unwrap();
        assert!(reason.contains("session"), "{name}: {reason}");
    }
    // A stray report has had time to arrive by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for guard in &other_guards {
        assert_ne!(
            guard.state(),
            LockState::Lost,
            "a hold on the other session was reported: {:?}",
            guard.loss_reason()
        );
    }
    assert_eq!(
        backend.held_nodes().0,
        other_guards.len(),
        "the ended session's records were not all reported"
    );
}

/// A release forgets its hold's record at once, and its node watch ends with the release's delete:
/// many acquire/release cycles leave nothing recorded and no watch in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_holds_leave_no_record_and_no_watch() {
    let server = ZkServer::start_or_panic();
    let backend = backend_at(&server.url()).await;
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    let base = name("forgotten");
    for round in 0..30 {
        let name = format!("{base}/{}", round % 3);
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        assert_eq!(
            backend.held_nodes().0,
            1,
            "round {round}: the hold's record"
        );
        guard.release().await.unwrap();
        assert_eq!(
            backend.held_nodes().0,
            0,
            "round {round}: a released hold's record was kept"
        );
    }
    let released = Instant::now();
    while backend.held_nodes().1 > 0 {
        assert!(
            released.elapsed() < BOUND,
            "{} node watches of released holds left",
            backend.held_nodes().1
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
