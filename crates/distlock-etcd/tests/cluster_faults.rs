//! Faults on a 3-member etcd cluster: the leader killed (kill -9) while a lock is held and others wait,
//! then restarted; and a holder cut off from every member by the fault proxy. Every test here has
//! "fault" in its name (nextest's serial group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{keys, wait_keys, watch_gauge};
use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockGuard, LockState, Locks};
use distlock_etcd::rpc::pb::etcdserverpb::{TxnRequest, TxnResponse};
use distlock_etcd::{layout, EtcdBackend};
use distlock_testkit::etcd::{etcdctl, EtcdCluster};
use distlock_testkit::proxy::Proxy;

/// Slack for elections, process start and scheduling on a loaded 2-core machine (not a speed figure).
const SLACK: Duration = Duration::from_secs(5);

async fn start_cluster() -> EtcdCluster {
    tokio::task::spawn_blocking(|| EtcdCluster::start_or_panic(3))
        .await
        .expect("cluster start")
}

async fn backend(url: &str) -> EtcdBackend {
    EtcdBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect")
}

/// The index of the leader, from `etcdctl endpoint status -w fields` (the member whose MemberID is the
/// Leader it reports).
fn leader(cluster: &EtcdCluster) -> usize {
    let out = cluster
        .etcdctl(&["endpoint", "status", "-w", "fields"])
        .unwrap();
    let (mut member, mut leader) = (None, None);
    for line in out.lines() {
        let Some((field, value)) = line.split_once(" : ") else {
            continue;
        };
        let value = value.trim().trim_matches('"').to_string();
        match field.trim_matches('"') {
            "MemberID" => member = Some(value),
            "Leader" => leader = Some(value),
            "Endpoint" => {
                if member.is_some() && member == leader {
                    let i = (0..cluster.len())
                        .find(|&i| cluster.addr(i).unwrap().to_string() == value)
                        .unwrap_or_else(|| panic!("endpoint {value} is not a member"));
                    return i;
                }
                (member, leader) = (None, None);
            }
            _ => {}
        }
    }
    panic!("no leader in: {out}");
}

/// Commits a fenced write through the backend's raw client. Requests are balanced over the
/// endpoints and one sent to the dead member fails, so the caller retries (the txn is
/// compare-guarded, hence idempotent).
async fn fenced_txn(backend: &EtcdBackend, txn: TxnRequest) -> TxnResponse {
    let client = backend.client();
    let mut last = None;
    for _ in 0..20 {
        match client.txn(txn.clone()).await {
            Ok(resp) => return resp,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fenced write failed 20 times: {last:?}");
}

/// Records every state a guard goes through (Jeopardy may be short; Lost is final).
fn record_states(guard: &LockGuard) -> Arc<Mutex<Vec<LockState>>> {
    let seen = Arc::new(Mutex::new(vec![guard.state()]));
    let mut changes = guard.state_changes();
    let out = seen.clone();
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let state = *changes.borrow_and_update();
            out.lock().unwrap().push(state);
        }
    });
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_cluster_leader_kill9_keeps_the_hold_and_hands_on_after_release() {
    let mut cluster = start_cluster().await;
    let url = cluster.url();
    let eps = cluster.endpoints();
    let name = common::name("cluster_leader_kill");
    let prefix = format!("{name}/");
    // A lease long enough that one election (well under a second with the testkit's timers) cannot
    // use it up: the point is that a quorum keeps the hold, not how fast the election is.
    let lease = Duration::from_secs(5);

    let a = Locks::new(backend(&url).await);
    let b = Locks::new(backend(&url).await);
    let c = Locks::new(backend(&url).await);
    let held = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let token_a = held.token().unwrap().get();
    let states = record_states(&held);
    let wait = |locks: &Locks| {
        let lock = locks.lock(&name).unwrap();
        tokio::spawn(async move {
            let guard = lock
                .options()
                .lease(lease)
                .wait(Duration::from_secs(90))
                .acquire()
                .await;
            (guard, Instant::now())
        })
    };
    // B queues first, then C (FIFO by key creation).
    let waiting_b = wait(&b);
    wait_keys(&eps, &prefix, SLACK, "B queued", |k| k.len() == 2);
    let waiting_c = wait(&c);
    wait_keys(&eps, &prefix, SLACK, "C queued", |k| k.len() == 3);

    let victim = leader(&cluster);
    cluster.kill9(victim).unwrap();
    let killed_at = Instant::now();
    let survivors: Vec<String> = (0..cluster.len())
        .filter(|&i| i != victim)
        .map(|i| cluster.addr(i).unwrap().to_string())
        .collect();
    let survivors = survivors.join(",");
    // With a member down, connecting with the whole endpoint list still works (requests are spread
    // over the endpoints at random, so each of these would hit the dead one now and then).
    for _ in 0..10 {
        drop(backend(&url).await);
    }

    // Through two whole leases, the hold lives on: Held, or Jeopardy and back — never Lost.
    while killed_at.elapsed() < lease * 2 {
        assert_ne!(
            held.state(),
            LockState::Lost,
            "a false loss while a quorum lives: {:?}",
            held.loss_reason()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Renewals go through the new leader: Held again (Jeopardy, if any, has ended).
    tokio::time::timeout(SLACK, async {
        while held.state() != LockState::Held {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the hold is Held again under the new leader");
    let history = states.lock().unwrap().clone();
    assert!(!history.contains(&LockState::Lost), "{history:?}");
    eprintln!("holder states through the leader kill: {history:?}");
    // Nobody else got it meanwhile, and the queue is intact on the survivors.
    assert!(!waiting_b.is_finished() && !waiting_c.is_finished());
    let queue = keys(&survivors, &prefix);
    assert_eq!(queue.len(), 3, "{queue:?}");
    assert_eq!(queue[0].create_revision, token_a);

    // The release hands the lock to B (the next key), then to C: tokens keep increasing.
    // Read before the call: the server deletes A's key before A hears back, so B's watch may fire
    // before A's release returns.
    let release_called = Instant::now();
    held.release().await.unwrap();
    let (guard_b, got_b) = tokio::time::timeout(SLACK * 2, waiting_b)
        .await
        .expect("B gets the lock after the release")
        .unwrap();
    let guard_b = guard_b.expect("B acquires");
    assert!(
        got_b >= release_called,
        "B got the lock before A released it"
    );
    let token_b = guard_b.token().unwrap().get();
    assert!(token_b > token_a, "{token_b} after {token_a}");
    assert!(!waiting_c.is_finished(), "C got a lock B holds");
    // B writes, fenced by its token, while the old leader is down.
    let marker = format!("{name}-marker");
    let own_key = keys(&survivors, &prefix)[0].key.clone();
    let writer = backend(&url).await;
    let fenced = fenced_txn(&writer, layout::fenced_put(&own_key, token_b, &marker, "b")).await;
    assert!(fenced.succeeded, "B's fenced write was refused");
    guard_b.release().await.unwrap();
    let (guard_c, _) = tokio::time::timeout(SLACK * 2, waiting_c)
        .await
        .expect("C gets the lock after B")
        .unwrap();
    let guard_c = guard_c.expect("C acquires");
    let token_c = guard_c.token().unwrap().get();
    assert!(token_c > token_b, "{token_c} after {token_b}");
    // A write fenced by B's (now superseded) token is refused by the server.
    let stale = fenced_txn(
        &writer,
        layout::fenced_put(&own_key, token_b, &marker, "stale"),
    )
    .await;
    assert!(
        !stale.succeeded,
        "a superseded holder's fenced write went through"
    );
    guard_c.release().await.unwrap();

    // The killed member restarts on its data dir and catches up: a local (serializable) read on it
    // alone sees the write made while it was down.
    let victim_addr = cluster.addr(victim).unwrap().to_string();
    tokio::task::block_in_place(|| {
        cluster.restart(victim).unwrap();
        cluster.wait_healthy(Duration::from_secs(30)).unwrap();
        let started = Instant::now();
        loop {
            let local = etcdctl(
                &victim_addr,
                &["get", &marker, "--print-value-only", "--consistency=s"],
            )
            .unwrap_or_default();
            if local.trim() == "b" {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the restarted member never caught up (read {local:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    // And locks work through the restarted member alone, with a token above all before.
    let d = Locks::new(backend(&format!("etcd://{victim_addr}")).await);
    let guard_d = d
        .lock(&name)
        .unwrap()
        .options()
        .wait(SLACK)
        .acquire()
        .await
        .unwrap();
    assert!(guard_d.token().unwrap().get() > token_c);
    guard_d.release().await.unwrap();
    assert!(keys(&eps, &prefix).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_cluster_holder_cut_off_goes_jeopardy_then_lost_then_the_lock_is_handed_on() {
    let cluster = start_cluster().await;
    let name = common::name("cluster_cut");
    let prefix = format!("{name}/");
    let eps = cluster.endpoints();
    // The holder reaches every member only through a fault proxy of its own.
    let proxies: Vec<Proxy> = (0..cluster.len())
        .map(|i| Proxy::start(cluster.addr(i).unwrap()).unwrap())
        .collect();
    let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    let a = Locks::new(backend(&format!("etcd://{}", hosts.join(","))).await);
    let b = Locks::new(backend(&cluster.url()).await);
    let lease = Duration::from_secs(2);
    let held = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let token_a = held.token().unwrap().get();
    let states = record_states(&held);
    let lock_b = b.lock(&name).unwrap();
    let waiting = tokio::spawn(async move {
        let guard = lock_b
            .options()
            .lease(lease)
            .wait(Duration::from_secs(60))
            .acquire()
            .await;
        (guard, Instant::now())
    });
    wait_keys(&eps, &prefix, SLACK, "B queued", |k| k.len() == 2);

    tokio::task::block_in_place(|| {
        for p in &proxies {
            p.blackhole().unwrap();
        }
    });
    let cut_at = Instant::now();
    // The next renewal fails: Jeopardy, within one renewal period plus its timeout.
    tokio::time::timeout(lease + SLACK, held.jeopardy())
        .await
        .expect("Jeopardy after the cut");
    let deadline = held.validity_deadline().expect("a deadline");
    // Lost at the deadline (which no renewal moves any more), never Held after it.
    let lost_at = tokio::time::timeout(lease + SLACK, async {
        loop {
            let state = held.state();
            if Instant::now() >= deadline {
                assert_ne!(state, LockState::Held, "Held after the validity deadline");
            }
            if state == LockState::Lost {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("Lost after the cut");
    // No renewal moved the deadline (the conversion from the boot clock jitters by a few ms).
    let now_deadline = held.validity_deadline().expect("a deadline");
    let moved = now_deadline.max(deadline) - now_deadline.min(deadline);
    assert!(
        moved < Duration::from_millis(50),
        "the deadline moved by {moved:?} while cut off"
    );
    assert!(
        lost_at + Duration::from_millis(20) >= deadline,
        "Lost {:?} before the deadline",
        deadline - lost_at
    );
    assert!(
        lost_at <= deadline + Duration::from_millis(500),
        "Lost {:?} after the deadline",
        lost_at - deadline
    );
    assert!(
        lost_at - cut_at <= lease + Duration::from_millis(100),
        "the deadline lay more than a lease after the cut: {:?}",
        lost_at - cut_at
    );
    // The recorder is a task of its own: let it catch up with the transition state() just published.
    let _ = tokio::time::timeout(SLACK, async {
        while !states.lock().unwrap().contains(&LockState::Lost) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let history = states.lock().unwrap().clone();
    let jeopardy = history.iter().position(|s| *s == LockState::Jeopardy);
    let lost = history.iter().position(|s| *s == LockState::Lost);
    assert!(
        matches!((jeopardy, lost), (Some(j), Some(l)) if j < l),
        "Jeopardy, then Lost: {history:?}"
    );

    // B gets the lock once A's session lease expires on the server — never before A's guard is Lost.
    let (guard_b, got_b) = tokio::time::timeout(lease * 2 + SLACK, waiting)
        .await
        .expect("B gets the lock after A's lease expired")
        .unwrap();
    let guard_b = guard_b.expect("B acquires");
    assert!(
        got_b >= lost_at,
        "B held {:?} before A's guard went Lost",
        lost_at - got_b
    );
    assert!(guard_b.token().unwrap().get() > token_a);
    eprintln!(
        "cut → A Lost {:?}, → B holds {:?}; A's states {history:?}",
        lost_at - cut_at,
        got_b - cut_at
    );

    // Healed, A's late release finds nothing of its own and leaves B's key alone.
    tokio::task::block_in_place(|| {
        for p in &proxies {
            p.pass().unwrap();
            p.reset().unwrap();
        }
    });
    let err = held
        .release()
        .await
        .expect_err("a lost guard's release fails");
    assert!(
        matches!(err.kind(), ErrorKind::NotHeld | ErrorKind::LockLost),
        "{err}"
    );
    let left = keys(&eps, &prefix);
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].create_revision, guard_b.token().unwrap().get());
    assert_eq!(guard_b.state(), LockState::Held);
    guard_b.release().await.unwrap();
}

/// One member of three paused (SIGSTOP: its TCP connections stay open, nothing answers): requests
/// balanced onto it must not fail or wait the whole request timeout each. Every acquire and release
/// completes, each well within the request timeout, while it stays paused. The member paused is the
/// follower that carries the backend's held-keys watch stream, so every grant's wait for its watch's
/// confirmation meets the paused member too (that wait once took the whole request timeout: 3.76 s
/// in CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_cluster_a_paused_member_does_not_fail_requests() {
    let mut cluster = start_cluster().await;
    const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
    let url = format!("{}?request_timeout=3s", cluster.url());
    let leader = leader(&cluster);
    // A backend whose held-keys watch stream is on a follower: requests go to the members in turn,
    // so one more request before the stream opens moves it to the next member.
    let mut found = None;
    for attempt in 0..12 {
        // The previous attempt's backend is gone, but the server drops its watches (released keys'
        // watches are kept for a second, for their next grant) only once it sees its stream closed.
        let deadline = Instant::now() + Duration::from_secs(5);
        for i in 0..cluster.len() {
            let addr = cluster.addr(i).unwrap();
            while watch_gauge(addr, "etcd_debugging_mvcc_watcher_total").await > 0 {
                assert!(
                    Instant::now() < deadline,
                    "a dropped backend's watches stayed on member {i}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let backend = backend(&url).await;
        for _ in 0..attempt {
            backend.client().status().await.unwrap();
        }
        let locks = Locks::with_defaults(backend.clone(), backend.default_options());
        // Connections to every member exist before the pause.
        for i in 0..6 {
            let guard = locks
                .lock(&common::name(&format!("paused-warm-{i}")))
                .unwrap()
                .acquire()
                .await
                .unwrap();
            guard.release().await.unwrap();
        }
        let probe = locks
            .lock(&common::name("paused-probe"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        let mut on = Vec::new();
        for i in 0..cluster.len() {
            let addr = cluster.addr(i).unwrap();
            if watch_gauge(addr, "etcd_debugging_mvcc_watcher_total").await > 0 {
                on.push(i);
            }
        }
        probe.release().await.unwrap();
        assert_eq!(
            on.len(),
            1,
            "one member carries the held-keys watch: {on:?}"
        );
        if on[0] != leader {
            found = Some((locks, on[0]));
            break;
        }
    }
    let (locks, follower) =
        found.expect("no backend's held-keys watch stream landed on a follower");
    cluster.pause(follower).unwrap();
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..12 {
        let started = Instant::now();
        let outcome = async {
            let guard = locks
                .lock(&common::name(&format!("paused-{i}")))
                .unwrap()
                .try_acquire()
                .await?
                .expect("free");
            guard.release().await
        }
        .await;
        let took = started.elapsed();
        slowest = slowest.max(took);
        eprintln!("cycle {i}: {took:?} {outcome:?}");
        if let Err(e) = outcome {
            failures.push(e.to_string());
        }
    }
    cluster.resume(follower).unwrap();
    assert!(
        failures.is_empty(),
        "failed while one member of three was paused: {failures:?}"
    );
    assert!(
        slowest < REQUEST_TIMEOUT,
        "an acquire + release took {slowest:?}: a request waited out the request timeout on the paused member"
    );
}

/// As above, for acquires that need a new session (a lease length not used before): the lease grant
/// is not failed by a paused member either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_cluster_a_paused_member_does_not_fail_session_grants() {
    let mut cluster = start_cluster().await;
    let backend = backend(&format!("{}?request_timeout=3s", cluster.url())).await;
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    for i in 0..6 {
        let guard = locks
            .lock(&common::name(&format!("paused-grant-warm-{i}")))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    }
    let follower = (leader(&cluster) + 1) % cluster.len();
    cluster.pause(follower).unwrap();
    let mut failures = Vec::new();
    for i in 0..9 {
        let started = Instant::now();
        let outcome = async {
            let guard = locks
                .lock(&common::name(&format!("paused-grant-{i}")))
                .unwrap()
                .options()
                .lease(Duration::from_secs(10 + i))
                .wait(Duration::ZERO)
                .acquire()
                .await?;
            guard.release().await
        }
        .await;
        eprintln!("cycle {i}: {:?} {outcome:?}", started.elapsed());
        if let Err(e) = outcome {
            failures.push(e.to_string());
        }
    }
    cluster.resume(follower).unwrap();
    assert!(
        failures.is_empty(),
        "failed while one member of three was paused: {failures:?}"
    );
}
