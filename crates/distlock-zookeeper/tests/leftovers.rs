//! Nothing left behind while the process lives: a lock node whose delete failed during a disconnect
//! (a release, an abandoned acquire) must not stay on the server once the client reconnects within its
//! session (ZooKeeper's pings keep the session, and so the node, alive for as long as the process
//! runs: every other contender would queue behind it forever); sessions of leases no longer in use
//! are closed. Test names with `fault` cut the client off with the testkit's fault proxy.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{children, locks_at, name, raw_client, wait_children};
use distlock_core::Locks;
use distlock_testkit::proxy::Proxy;
use distlock_testkit::zookeeper::{four_letter, ZkServer};

/// The session timeout of the cut-off client: far longer than the cut, so the session survives it.
const SESSION: Duration = Duration::from_secs(20);

/// A client through `proxy` with a 20 s session and a 300 ms request bound (so a delete during the
/// cut gives up long before the session could expire).
async fn cut_client(proxy: &Proxy) -> Locks {
    locks_at(&format!(
        "zk://{}?session_timeout={}s&request_timeout=300ms",
        proxy.addr(),
        SESSION.as_secs()
    ))
    .await
}

/// Blackholes (`cut`) or restores the proxy. A blackhole, not a refusal: requests written to the
/// connection are lost (a refused or reset connection makes the client queue them until it reconnects,
/// and send them then).
async fn set_cut(proxy: &Arc<Proxy>, cut: bool) {
    let proxy = proxy.clone();
    tokio::task::spawn_blocking(move || {
        if cut {
            proxy.blackhole().unwrap();
        } else {
            proxy.pass().unwrap();
        }
    })
    .await
    .unwrap();
}

/// A release that fails because the connection is silent (the delete is lost on the way) is reported; once the client reconnects within its session, the node is deleted after all, long
/// before the session could expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_release_during_a_disconnect_deletes_the_node_once_reconnected() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let cut = cut_client(&proxy).await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("release_cut");
    let guard = cut.lock(&name).unwrap().acquire().await.unwrap();
    set_cut(&proxy, true).await;
    let released = guard.release().await;
    assert!(released.is_err(), "a release while cut off cannot succeed");
    set_cut(&proxy, false).await;
    let restored = Instant::now();
    assert_freed_long_before_the_session_expires(
        &other,
        &raw,
        &name,
        restored,
        "the node of the failed release stayed with its live session",
    )
    .await;
}

/// Two releases on one session that fail during the same cut: both nodes are queued on the session's
/// one cleanup task, and both are deleted once the client reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_two_releases_during_a_disconnect_both_delete_their_nodes_once_reconnected() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let cut = cut_client(&proxy).await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let names = [name("release_cut_a"), name("release_cut_b")];
    let mut guards = Vec::new();
    for name in &names {
        guards.push(cut.lock(name).unwrap().acquire().await.unwrap());
    }
    set_cut(&proxy, true).await;
    for guard in guards {
        assert!(
            guard.release().await.is_err(),
            "a release while cut off cannot succeed"
        );
    }
    set_cut(&proxy, false).await;
    let restored = Instant::now();
    for name in &names {
        assert_freed_long_before_the_session_expires(
            &other,
            &raw,
            name,
            restored,
            "a node of a failed release stayed with its live session",
        )
        .await;
    }
}

/// A waiter whose wait times out while the connection is down cannot delete its node then; once the
/// client reconnects within its session the node is deleted, so it never becomes a holder nobody
/// knows of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_abandon_during_a_disconnect_deletes_the_node_once_reconnected() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let cut = cut_client(&proxy).await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("abandon_cut");
    let holder = other.lock(&name).unwrap().acquire().await.unwrap();
    let lock = cut.lock(&name).unwrap();
    let waiter = tokio::spawn(async move {
        lock.options()
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .map(drop)
    });
    wait_children(&raw, &name, 2).await;
    set_cut(&proxy, true).await;
    let result = waiter.await.unwrap();
    assert!(result.is_err(), "the waiter must time out");
    set_cut(&proxy, false).await;
    let restored = Instant::now();
    holder.release().await.unwrap();
    assert_freed_long_before_the_session_expires(
        &other,
        &raw,
        &name,
        restored,
        "the abandoned waiter's node stayed with its live session and now holds the lock for nobody",
    )
    .await;
}

/// An acquire whose create is queued while the connection is refused gives up (its request bound
/// passes) without knowing whether its node will exist: the client sends the queued create once it
/// reconnects within its session. The node must be found by its `_c_<uuid>` prefix and deleted then,
/// not left to hold the lock for nobody once the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_acquire_whose_create_is_queued_while_refused_leaves_no_node_once_reconnected() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let cut = cut_client(&proxy).await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("create_queued");
    let holder = other.lock(&name).unwrap().acquire().await.unwrap();
    let refused = proxy.clone();
    tokio::task::spawn_blocking(move || refused.refuse().unwrap())
        .await
        .unwrap();
    let result = cut
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(1))
        .acquire()
        .await;
    assert!(result.is_err(), "no acquire while refused: {result:?}");
    set_cut(&proxy, false).await;
    reconnected(&cut).await;
    let restored = Instant::now();
    holder.release().await.unwrap();
    assert_freed_long_before_the_session_expires(
        &other,
        &raw,
        &name,
        restored,
        "the queued create's node stayed with its live session and holds the lock for nobody",
    )
    .await;
}

/// Waits until `locks`' session answers again: requests on a session are answered in order, so every
/// request queued during the cut has been applied by then.
async fn reconnected(locks: &Locks) {
    let started = Instant::now();
    let probe = locks.lock(&name("probe")).unwrap();
    loop {
        if let Ok(Some(guard)) = probe.try_acquire().await {
            guard.release().await.unwrap();
            return;
        }
        assert!(
            started.elapsed() < SESSION / 2,
            "the client did not reconnect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Once the cut is over (at `restored`), `other` gets the lock within half the cut client's session:
/// the node the cut left (`what` says which) was deleted, not left to go with its live session.
async fn assert_freed_long_before_the_session_expires(
    other: &Locks,
    raw: &zookeeper_client::Client,
    name: &str,
    restored: Instant,
    what: &str,
) {
    let acquired = other
        .lock(name)
        .unwrap()
        .options()
        .wait(SESSION / 2)
        .acquire()
        .await;
    let taken = match acquired {
        Ok(taken) => taken,
        Err(e) => panic!("{what}: {e} ({:?})", children(raw, name).await),
    };
    assert!(restored.elapsed() < SESSION, "freed only by session expiry");
    taken.release().await.unwrap();
}

/// The sessions the server has open (`cons` lists one line per connection with a session).
fn sessions(server: &ZkServer) -> usize {
    four_letter(server.addr(), "cons")
        .expect("cons")
        .lines()
        .filter(|l| l.contains("sid=0x") && !l.contains("sid=0x0]") && !l.contains("sid=0x0,"))
        .count()
}

/// Each distinct lease gets a session of its own (its timeout is the lease); once no lock uses it any
/// more it must be closed, not kept for the life of the backend (a service trying leases 2 s…11 s
/// would hold 10 sessions open, and ZooKeeper refuses a host's 61st connection by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_of_leases_no_longer_used_are_closed() {
    let server = ZkServer::start_or_panic();
    let locks = locks_at(&server.url()).await;
    let before = sessions(&server);
    let name = name("lease_sessions");
    for secs in 2..12 {
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(Duration::from_secs(secs))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    }
    // The next acquire (default lease) finds the idle sessions of the other leases and closes them;
    // one may still be in use for a moment (its hold's loss watch ends just after the release).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    guard.release().await.unwrap();
    let started = Instant::now();
    loop {
        let open = sessions(&server);
        if open <= before + 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{open} sessions open after 10 leases used one at a time (was {before} with the default one): {}",
            four_letter(server.addr(), "cons").unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A holder whose client sees its connection drop (reset, reconnects refused) is `Jeopardy` by its next
/// renewal (a third of the lease), which fails at once while the client is disconnected instead of
/// waiting the request bound (or half the time left) for a reply that cannot come. (`Jeopardy` at the
/// very moment of the disconnect would need the core to take a connection-state signal from backends.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_disconnected_holder_is_jeopardy_by_its_next_renewal() {
    let lease = Duration::from_secs(12);
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let locks = locks_at(&format!(
        "zk://{}?session_timeout={}s",
        proxy.addr(),
        lease.as_secs()
    ))
    .await;
    let guard = locks
        .lock(&name("disconnected"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let granted = Instant::now();
    let refused = proxy.clone();
    tokio::task::spawn_blocking(move || refused.refuse().unwrap())
        .await
        .unwrap();
    let mut changes = guard.state_changes();
    while guard.state() == distlock_core::LockState::Held {
        let _ = tokio::time::timeout(Duration::from_millis(100), changes.changed()).await;
        assert!(
            granted.elapsed() < lease / 3 + Duration::from_millis(1500),
            "still Held {:?} after the grant, disconnected all along: the renewal due at {:?} did not fail at once",
            granted.elapsed(),
            lease / 3
        );
    }
    assert_eq!(guard.state(), distlock_core::LockState::Jeopardy);
}

/// How long after the next waiter's grant a holder woken by the same watch event may still be `Held`:
/// half the 100 ms a late own-node watch cost (the bug below). Not a speed figure: the two sessions'
/// events leave the server in one pass; this is the slack for two processes scheduled apart.
const SAME_EVENT_SLACK: Duration = Duration::from_millis(50);

/// An operator deletes the holder's node right after the grant (before any renewal): the holder
/// learns of it from the same delete event as the next waiter (issue 10: an operator's delete is Lost
/// within a round trip; the own-node watch must cover the first moments of a hold too), so it is
/// `Lost` within [`SAME_EVENT_SLACK`] of that waiter's grant. Not asserted: `Lost` *before* that grant
/// — two processes woken by one event are not ordered in real time (GUARANTEES says so; the etcd tests
/// make the same check).
///
/// Failed while the own-node watch was set 100 ms after the grant (to save short holds a request, as
/// etcd's held-key watch does): for up to 100 ms both guards were `Held`. The watch is now set at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_operator_delete_right_after_the_grant_is_lost_with_the_next_holders_grant() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let first = locks_at(&server.url()).await;
    let second = locks_at(&server.url()).await;
    for round in 0..3 {
        let name = name(&format!("early_delete_{round}"));
        let guard = first.lock(&name).unwrap().acquire().await.unwrap();
        let lock = second.lock(&name).unwrap();
        let waiter = tokio::spawn(async move { lock.acquire().await.unwrap() });
        let own = wait_children(&raw, &name, 2).await.remove(0);
        raw.delete(&format!("/{name}/{own}"), None).await.unwrap();
        let next = waiter.await.unwrap();
        let granted = Instant::now();
        tokio::time::timeout(SAME_EVENT_SLACK, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the first holder's node was deleted, the next holder was granted, and the first was still Held {:?} later", granted.elapsed()));
        next.release().await.unwrap();
        drop(guard);
    }
}

/// Dropping the `Locks` (and with it the backend) after holds of several leases, an abandoned acquire,
/// a release and a guard dropped while held leaves no task running on the runtime and no session open
/// on the server (once the core's watchdog has had its next look, a third of the longest lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_locks_ends_its_tasks_and_sessions() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let baseline_sessions = sessions(&server);
    let metrics = tokio::runtime::Handle::current().metrics();
    let baseline_tasks = metrics.num_alive_tasks();
    {
        // Short leases: the core's watchdog keeps the backend until its next wake-up (a third of the
        // lease), so with the 60 s default the sessions would stay 20 s after the drop.
        let url = format!("{}?session_timeout=2s", server.url());
        let locks = locks_at(&url).await;
        let other = locks_at(&url).await;
        let name = name("drop_locks");
        for secs in [1, 3] {
            let guard = locks
                .lock(&name)
                .unwrap()
                .options()
                .lease(Duration::from_secs(secs))
                .acquire()
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let busy = other
                .lock(&name)
                .unwrap()
                .options()
                .wait(Duration::from_millis(100))
                .acquire()
                .await;
            assert!(busy.is_err(), "the lock is held");
            guard.release().await.unwrap();
        }
        let held = locks.lock(&name).unwrap().acquire().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(held);
        drop(locks);
        drop(other);
    }
    let started = Instant::now();
    loop {
        let (tasks, open) = (metrics.num_alive_tasks(), sessions(&server));
        if tasks <= baseline_tasks && open <= baseline_sessions {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "after dropping the Locks: {tasks} tasks alive (was {baseline_tasks}), {open} sessions open (was {baseline_sessions})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(raw);
}

/// The lock path reaped (deleted once empty, as ZooKeeper's container manager does) between two holds:
/// the next acquire creates it again, its sequence restarts, and the token (czxid) still grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaped_lock_path_is_recreated_and_the_token_still_grows() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let locks = locks_at(&server.url()).await;
    let name = name("reaped");
    let mut last = 0;
    for round in 0..3 {
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        let token = guard.token().unwrap().get();
        assert!(token > last, "round {round}: token {token} after {last}");
        last = token;
        let own = children(&raw, &name).await.remove(0);
        assert!(own.ends_with("lock-0000000000"), "round {round}: {own}");
        guard.release().await.unwrap();
        raw.delete(&format!("/{name}"), None)
            .await
            .expect("the empty lock path is deleted, as the reaper does");
    }
}
