//! Redlock under faults on 5 real `redis-server` processes: nodes killed (the quorum's margin, then its
//! loss), a node restarted without persistence during a hold (the documented double grant, and the
//! delayed restart that prevents it), a key expired early on one node (the stand-in for that node's
//! clock jumping forward: the known violation), and a client whose quorum arrives after its validity
//! deadline (a paused client: discarded). Test names carry `fault` (nextest's serial group).
//!
//! The double-grant cases need a holder whose keys sit on exactly a quorum (3 of 5) of nodes: client A
//! reaches the nodes through proxies, two of which refuse it (nodes 3 and 4 unreachable for A alone),
//! as in the scenario of Redis's own analysis and Kleppmann's.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_redis::redlock::layout;
use distlock_redis::RedlockBackend;
use distlock_testkit::proxy::Proxy;
use distlock_testkit::redis::RespValue;
use distlock_testkit::redlock::{url_of, RedlockNodes};

async fn locks(url: &str) -> Locks {
    Locks::new(
        RedlockBackend::connect(&LockUrl::parse(url).unwrap())
            .await
            .expect("connect"),
    )
}

fn unique(case: &str) -> String {
    format!("redlock/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// Which nodes hold `name` for anyone (`GET` not nil); a dead node counts as not holding it.
fn holding(nodes: &RedlockNodes, name: &str) -> Vec<usize> {
    (0..nodes.len())
        .filter(|&i| {
            nodes
                .node(i)
                .command_timeout(&["GET", name], Duration::from_secs(1))
                .is_ok_and(|v| !v.is_nil())
        })
        .collect()
}

/// One acquire and release, so that every node has the scripts loaded before a fault (a first
/// `EVALSHA` costs a `NOSCRIPT` round trip more).
async fn load_scripts(locks: &Locks) {
    let warm = locks
        .lock(&unique("warm"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    warm.release().await.unwrap();
}

/// `name` held by another owner for 30 s on the nodes `which`.
fn held_elsewhere(nodes: &RedlockNodes, which: std::ops::Range<usize>, name: &str) {
    for i in which {
        nodes
            .node(i)
            .command(&["SET", name, "someone-else", "PX", "30000"])
            .unwrap();
    }
}

/// Client A: reaches every node through a proxy; nodes 3 and 4 refuse it.
async fn client_on_first_three(nodes: &RedlockNodes) -> (Locks, Vec<Proxy>) {
    let proxies = nodes.proxies();
    let url = url_of(proxies.iter().map(Proxy::addr));
    let a = locks(&url).await;
    for p in &proxies[3..] {
        p.refuse().unwrap();
    }
    (a, proxies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_two_of_five_nodes_killed_still_locks() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let (a, b) = (locks(&nodes.url()).await, locks(&nodes.url()).await);
    nodes.node_mut(0).kill9().unwrap();
    nodes.node_mut(1).kill9().unwrap();
    let name = unique("two_killed");
    let guard = a
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .expect("three of five nodes are a quorum")
        .expect("free");
    assert_eq!(holding(&nodes, &name), vec![2, 3, 4]);
    assert!(
        b.lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a second client got the lock on the same three nodes"
    );
    // The watchdog renews on the three (a quorum): still held after several renewal periods.
    let lease = Duration::from_millis(600);
    let renewed = a.lock(&unique("two_killed_renew")).unwrap();
    let held = renewed.options().lease(lease).acquire().await.unwrap();
    tokio::time::sleep(lease * 3).await;
    assert_eq!(held.state(), LockState::Held, "{:?}", held.loss_reason());
    held.release().await.unwrap();
    guard.release().await.unwrap();
    assert!(holding(&nodes, &name).is_empty(), "the release left keys");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_three_of_five_nodes_killed_is_unavailable_naming_the_quorum() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let a = locks(&nodes.url()).await;
    let lease = Duration::from_secs(1);
    let held_name = unique("held_when_killed");
    let held = a.lock(&held_name).unwrap();
    let held = held.options().lease(lease).acquire().await.unwrap();
    for i in 0..3 {
        nodes.node_mut(i).kill9().unwrap();
    }
    let name = unique("three_killed");
    let err = a
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("two of five nodes are no quorum");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("quorum needs 3"),
        "the error does not name the quorum: {err}"
    );
    assert_eq!(
        holding(&nodes, &name),
        Vec::<usize>::new(),
        "a failed quorum left keys behind"
    );
    // A held lock cannot be renewed on a quorum any more: Lost by its deadline.
    tokio::time::timeout(lease * 2, held.lost())
        .await
        .expect("lost() by the deadline");
    assert_eq!(held.state(), LockState::Lost);
    // Connecting with fewer than a quorum of nodes up fails the same way.
    let err = RedlockBackend::connect(&LockUrl::parse(&nodes.url()).unwrap())
        .await
        .expect_err("no quorum to connect to");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("quorum needs 3"), "{err}");
}

/// The hazard of Redis's own analysis: a node that restarts without persistence forgets the keys it
/// granted, and its vote can go to a second client while the first still holds the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_restart_without_persistence_grants_twice() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let (a, _proxies) = client_on_first_three(&nodes).await;
    let b = locks(&nodes.url()).await;
    let name = unique("restart_double_grant");
    let lock_a = a.lock(&name).unwrap();
    let guard_a = lock_a
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    assert_eq!(holding(&nodes, &name), vec![0, 1, 2]);
    nodes.node_mut(2).kill9().unwrap();
    nodes.node_mut(2).restart().unwrap();
    let guard_b = b
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the documented double grant did not show: B was refused");
    assert_eq!(
        guard_a.state(),
        LockState::Held,
        "A must still believe it holds the lock for the double grant to show"
    );
    assert_eq!(guard_b.state(), LockState::Held);
    drop(guard_b);
    drop(guard_a);
}

/// The mitigation: a crashed node stays down longer than the longest lease before it rejoins. A holder
/// whose quorum shrank below Q cannot renew and is Lost by its deadline, before the node can vote for
/// anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_delayed_restart_after_the_lease_prevents_the_double_grant() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let (a, _proxies) = client_on_first_three(&nodes).await;
    let b = locks(&nodes.url()).await;
    let name = unique("delayed_restart");
    let lease = Duration::from_millis(900);
    let lock_a = a.lock(&name).unwrap();
    let guard_a = lock_a.options().lease(lease).acquire().await.unwrap();
    nodes.node_mut(2).kill9().unwrap();
    // Down for longer than the lease (plus the renewal period): then back, empty.
    tokio::time::sleep(lease + lease / 2).await;
    nodes.node_mut(2).restart().unwrap();
    assert_eq!(
        guard_a.state(),
        LockState::Lost,
        "A kept the lock without a quorum for longer than its lease"
    );
    let guard_b = b
        .lock(&name)
        .unwrap()
        .options()
        .wait(lease * 4)
        .acquire()
        .await
        .expect("B gets the lock after A lost it");
    assert_eq!(guard_a.state(), LockState::Lost, "no overlap");
    guard_b.release().await.unwrap();
}

/// One node's key expiring early stands in for that node's clock jumping forward (the system clock is
/// never touched here): the node frees A's key while A holds it, and B's quorum includes that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_key_expired_early_on_one_node_grants_twice() {
    let nodes = RedlockNodes::start_or_panic(5);
    let (a, _proxies) = client_on_first_three(&nodes).await;
    let b = locks(&nodes.url()).await;
    let name = unique("clock_jump");
    let lock_a = a.lock(&name).unwrap();
    let guard_a = lock_a
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let shortened = nodes.node(2).command(&["PEXPIRE", &name, "1"]).unwrap();
    assert_eq!(shortened, RespValue::Int(1));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let guard_b = b
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the known violation did not show: B was refused");
    assert_eq!(guard_a.state(), LockState::Held, "both hold the lock");
    assert_eq!(guard_b.state(), LockState::Held);
    drop(guard_b);
    drop(guard_a);
}

/// A client whose quorum of grants arrives after the validity deadline (here every reply is delayed
/// by more than the lease, as for a client paused between sending and reading) discards it: the
/// acquire fails, the keys it got are released on every node, and another client gets the lock.
/// A short lease, and no case at the default: the deadline is the core's `sent_at + lease·0.99 − 2 ms`
/// for every lease (Redlock adds no timer of its own), so the default only scales the delay needed,
/// to more than 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_late_quorum_from_a_paused_client_is_discarded() {
    let nodes = RedlockNodes::start_or_panic(5);
    let proxies = nodes.proxies();
    // A node timeout above the lease, so that the slow grants are waited for and then judged late.
    let url = format!(
        "{}?node_timeout=3s",
        url_of(proxies.iter().map(Proxy::addr))
    );
    let a = locks(&url).await;
    let b = locks(&nodes.url()).await;
    let name = unique("late_quorum");
    let lease = Duration::from_millis(300);
    load_scripts(&a).await;
    for p in &proxies {
        p.delay(Duration::from_millis(400)).unwrap();
    }
    let err = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect_err("a quorum after the validity deadline must not count");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("validity deadline"), "{err}");
    // The undo (compare-and-delete on every node) goes through the same slow proxies.
    let started = std::time::Instant::now();
    while !holding(&nodes, &name).is_empty() {
        assert!(
            started.elapsed() < lease,
            "the late grants were not released before their lease ran out: {:?}",
            holding(&nodes, &name)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let guard_b = b
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the discarded quorum still blocks the lock");
    guard_b.release().await.unwrap();
}

/// A node paused (SIGSTOP) while an acquire's request to it is on its way: the acquire succeeds on the
/// other four and is released, and the release is sent to every node, the paused one included. Once
/// that node resumes it runs the late acquire; its release must run after it (on the same connection),
/// so that no key of a released hold is left there for a whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_paused_node_keeps_no_key_after_the_release() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let url = format!("{}?request_timeout=300ms", nodes.url());
    let locks = locks(&url).await;
    load_scripts(&locks).await;
    let name = unique("paused_release");
    nodes.node_mut(4).pause().unwrap();
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
    nodes.node_mut(4).resume().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        holding(&nodes, &name),
        Vec::<usize>::new(),
        "a released hold left its key on the node that was paused"
    );
}

/// The same for an acquire that fails: two nodes held by another owner, one paused; the acquire gives
/// up and undoes on every node; the paused node must not keep its key once it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_paused_node_keeps_no_key_after_a_failed_acquire() {
    let mut nodes = RedlockNodes::start_or_panic(3);
    let url = format!("{}?request_timeout=300ms", nodes.url());
    let locks = locks(&url).await;
    load_scripts(&locks).await;
    let name = unique("paused_failed");
    held_elsewhere(&nodes, 0..2, &name);
    nodes.node_mut(2).pause().unwrap();
    let got = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .wait(Duration::from_millis(500))
        .acquire()
        .await;
    assert!(got.is_err(), "acquired a lock held on 2 of 3 nodes");
    tokio::time::sleep(Duration::from_millis(300)).await;
    nodes.node_mut(2).resume().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        nodes.node(2).command(&["GET", &name]).unwrap().as_str(),
        None,
        "a failed acquire left its key on the node that was paused"
    );
}

/// One paused node of five is a failure Redlock tolerates: a try that fails its quorum (two nodes
/// held elsewhere, two granted, the paused one unanswered) releases its grants and reports busy
/// within about the node timeout, not after the paused node's release has waited out the whole
/// `request_timeout` (here 20 s, far above everything else).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_paused_node_does_not_stall_a_failed_try() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let url = format!("{}?request_timeout=20s&node_timeout=100ms", nodes.url());
    let locks = locks(&url).await;
    load_scripts(&locks).await;
    let name = unique("paused_stall");
    held_elsewhere(&nodes, 0..2, &name);
    nodes.node_mut(4).pause().unwrap();
    let started = std::time::Instant::now();
    let got = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .try_acquire()
        .await;
    let took = started.elapsed();
    nodes.node_mut(4).resume().unwrap();
    assert!(matches!(got, Ok(None)), "{got:?}");
    assert!(
        took < Duration::from_secs(10),
        "a failed try took {took:?}: it waited out request_timeout on the paused node"
    );
}

/// Acquires cancelled at many points (before, during and after the quorum), with two of five nodes
/// slow (delayed 30 ms by proxies, so their requests are still on the way when the quorum is in):
/// after each cancel no node keeps the cancelled owner's key for long (the undo runs in the
/// background), and another client then gets the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_cancelled_acquires_on_slow_nodes_leave_no_key() {
    let nodes = RedlockNodes::start_or_panic(5);
    let proxies = nodes.proxies();
    let a = locks(&url_of(proxies.iter().map(Proxy::addr))).await;
    let b = locks(&nodes.url()).await;
    load_scripts(&a).await;
    for p in &proxies[3..] {
        p.delay(Duration::from_millis(30)).unwrap();
    }
    let lease = Duration::from_secs(10);
    for step in 0..24u64 {
        let name = unique("cancelled");
        let cancel_after = Duration::from_micros(step * 2_500);
        let lock = a.lock(&name).unwrap();
        let acquire = lock.options().lease(lease).acquire();
        if let Ok(got) = tokio::time::timeout(cancel_after, acquire).await {
            got.unwrap().release().await.unwrap();
        }
        let started = std::time::Instant::now();
        while !holding(&nodes, &name).is_empty() {
            assert!(
                started.elapsed() < lease / 4,
                "step {step} (cancel after {cancel_after:?}): keys left on {:?}",
                holding(&nodes, &name)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A request of the cancelled acquire may still be on its way (the keys checked above can land
        // after the check) until its undo runs: the other client must get the lock well within the
        // lease, not necessarily at its first try.
        let guard = b
            .lock(&name)
            .unwrap()
            .options()
            .wait(lease / 4)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("step {step}: the cancelled acquire still holds: {e}"));
        // The cancelled acquire must not take it later either.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(guard.state(), LockState::Held);
        // No node keeps the cancelled acquire's key for long. A node where its late request landed
        // before this acquire's voted no is emptied by the undo, which first waits for the cancelled
        // try's replies (two nodes 30 ms away each way, more on a loaded machine): this hold may have a
        // quorum, not all 5.
        let started = std::time::Instant::now();
        loop {
            let mut ours = 0;
            let mut others = Vec::new();
            for i in 0..5 {
                let v = nodes.node(i).command(&["GET", &name]).unwrap();
                if !v.is_nil() {
                    if v.as_str().map(layout::owner_of) == Some(guard.owner()) {
                        ours += 1;
                    } else {
                        others.push((i, v));
                    }
                }
            }
            assert!(ours >= 3, "step {step}: this hold is on {ours} nodes");
            if others.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < lease / 4,
                "step {step}: the cancelled acquire's keys stay on {others:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(guard.state(), LockState::Held);
        guard.release().await.unwrap();
    }
}

/// A release that reaches one node late (held up on the way, past its request timeout) must not delete
/// the key of the same `Lock`'s next hold there: each acquire writes its own value. With one value per
/// `Lock`, the late compare-and-delete matched the new hold's key and removed it from that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_late_release_spares_the_same_locks_next_hold() {
    let nodes = RedlockNodes::start_or_panic(5);
    let proxies = nodes.proxies();
    // Requests that must succeed (every acquire, the release on nodes 0 to 3) have 1 s; only node 4's
    // release is held back past it.
    let url = format!(
        "{}?request_timeout=1s",
        url_of(proxies.iter().map(Proxy::addr))
    );
    let locks = locks(&url).await;
    load_scripts(&locks).await;
    // A round proves something only if the next hold got node 4 before the late release landed there;
    // a loaded machine may miss that: such a round still checks the key, and another is run.
    let mut conclusive = false;
    for round in 0..3 {
        if late_release_round(&nodes, &proxies, &locks, round).await {
            conclusive = true;
            break;
        }
    }
    assert!(
        conclusive,
        "in no round did the next hold get node 4 before the late release landed"
    );
}

/// One round of the late-release case; returns whether the next hold got node 4 before the late
/// release landed.
async fn late_release_round(
    nodes: &RedlockNodes,
    proxies: &[Proxy],
    locks: &Locks,
    round: u32,
) -> bool {
    let name = unique(&format!("late_release{round}"));
    let lock = locks.lock(&name).unwrap();
    let first = lock
        .options()
        .lease(Duration::from_millis(600))
        .acquire()
        .await
        .unwrap();
    // Node 4's release is held back 4 s: the release returns without it (4 of 5 deleted).
    let late_by = Duration::from_secs(4);
    proxies[4].delay(late_by).unwrap();
    let released_at = std::time::Instant::now();
    first.release().await.unwrap();
    proxies[4].pass().unwrap();
    // The first hold's key on node 4 expires; the next hold of the same `Lock` then gets node 4 too.
    let started = std::time::Instant::now();
    while holding(nodes, &name).contains(&4) {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the first hold's key on node 4 did not expire"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = lock
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let started = std::time::Instant::now();
    while !holding(nodes, &name).contains(&4) {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the second hold got no key on node 4"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let scripts_before = scripts_run(nodes, 4);
    let conclusive = released_at.elapsed() < late_by;
    if conclusive {
        // The late release is the next script to run on node 4 (nothing else of this client's is due
        // there), and it cannot land before `late_by`.
        let started = std::time::Instant::now();
        while scripts_run(nodes, 4) == scripts_before || released_at.elapsed() < late_by {
            assert!(
                started.elapsed() < late_by + Duration::from_secs(5),
                "the late release never ran on node 4"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    } else {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        holding(nodes, &name),
        vec![0, 1, 2, 3, 4],
        "the first hold's late release deleted the second hold's key"
    );
    assert_eq!(second.state(), LockState::Held);
    second.release().await.unwrap();
    conclusive
}

/// How many scripts (`EVALSHA`, `EVAL`) have run on node `i`.
fn scripts_run(nodes: &RedlockNodes, i: usize) -> u64 {
    let info = nodes.node(i).command(&["INFO", "commandstats"]).unwrap();
    let info = info.as_str().unwrap_or_default().to_string();
    ["cmdstat_evalsha:calls=", "cmdstat_eval:calls="]
        .iter()
        .filter_map(|prefix| {
            info.lines()
                .find_map(|line| line.strip_prefix(prefix))
                .and_then(|rest| rest.split(',').next())
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

/// Releases `name`'s hold (`guard`) with the replies of the nodes `lost` lost: their proxies hold the
/// request 2 s, and once the node ran it (its key is gone) every connection through them is reset
/// before the reply gets back (held 2 s too: the test has that long to see the key gone; at 1 s a
/// loaded CI machine once let the reply through, and the release rightly said `Ok`), so the release
/// is sent again on a fresh connection and finds nothing.
/// The nodes `not_ours` lost this hold's key before the release (deleted by hand: expired, or a node
/// restarted without persistence). Returns what the release reported.
async fn release_losing_replies(
    nodes: &RedlockNodes,
    proxies: &[Proxy],
    guard: distlock_core::LockGuard,
    name: &str,
    lost: &[usize],
    not_ours: &[usize],
) -> distlock_core::Result<()> {
    for &i in not_ours {
        nodes.node(i).command(&["DEL", name]).unwrap();
    }
    for &i in lost {
        proxies[i].delay(Duration::from_secs(2)).unwrap();
    }
    let release = tokio::spawn(async move { guard.release().await });
    let started = std::time::Instant::now();
    while lost.iter().any(|i| holding(nodes, name).contains(i)) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the release never reached the nodes {lost:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for &i in lost {
        proxies[i].pass().unwrap();
        proxies[i].reset().unwrap();
    }
    let outcome = release.await.unwrap();
    assert!(holding(nodes, name).is_empty(), "the release left keys");
    outcome
}

/// Issue 24, scenario 5: a release reaches every node but every reply is lost; the resend on a fresh
/// connection finds nothing to delete (the first attempt deleted it). That is no "not held": the
/// outcome is unknown (`Unavailable`), and `distlock run` keeps the command's exit code on it. The same
/// when some replies are lost and the other nodes say "not ours" but too few to rule a quorum out; when
/// enough nodes definitely say "not ours" that no quorum held this hold, `NotHeld` stays the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_release_with_lost_replies_is_unknown_not_not_held() {
    let nodes = RedlockNodes::start_or_panic(3);
    let proxies = nodes.proxies();
    let locks = locks(&url_of(proxies.iter().map(Proxy::addr))).await;
    load_scripts(&locks).await;
    let hold = |case: &'static str| {
        let locks = locks.clone();
        async move {
            let name = unique(case);
            let guard = locks
                .lock(&name)
                .unwrap()
                .options()
                .lease(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            (guard, name)
        }
    };

    // Every reply lost.
    let (guard, name) = hold("every_reply_lost").await;
    let outcome = release_losing_replies(&nodes, &proxies, guard, &name, &[0, 1, 2], &[]).await;
    let e = outcome.expect_err("the outcome is unknown");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("unknown"), "{e}");

    // Two replies lost, the third node says "not ours": a quorum (the first two) may have held it.
    let (guard, name) = hold("two_lost_one_not_ours").await;
    let outcome = release_losing_replies(&nodes, &proxies, guard, &name, &[0, 1], &[2]).await;
    let e = outcome.expect_err("the outcome is unknown");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");

    // One reply lost, two nodes say "not ours": no quorum held this hold when it was released.
    let (guard, name) = hold("one_lost_two_not_ours").await;
    let outcome = release_losing_replies(&nodes, &proxies, guard, &name, &[0], &[1, 2]).await;
    let e = outcome.expect_err("no quorum held it");
    assert_eq!(e.kind(), ErrorKind::NotHeld, "{e}");
}
