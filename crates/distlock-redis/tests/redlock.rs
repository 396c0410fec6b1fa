//! Redlock on 5 real `redis-server` processes, beyond the conformance suite: the quorum rules of
//! renewal, a retried try voting yes on its own key, `WRONGTYPE` against a `redis://` lock of the same
//! name, `inspect` per node, and no fencing token.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Backend};
use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, Fencing, LockState, Locks};
use distlock_redis::redlock::layout;
use distlock_redis::{RedisBackend, RedlockBackend};
use distlock_testkit::redis::RedisServer;
use distlock_testkit::redlock::{url_of, RedlockNodes};
use distlock_testkit::tls::TestCa;

async fn backend(url: &str) -> RedlockBackend {
    RedlockBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect")
}

fn unique(case: &str) -> String {
    format!("redlock/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// Waits (up to 2 s) until every node holds `owner`'s key: an acquire returns once a quorum granted,
/// and the other nodes' grants land a moment later.
async fn on_every_node(nodes: &RedlockNodes, name: &str, owner: &str) {
    let started = std::time::Instant::now();
    loop {
        let holding = nodes
            .nodes()
            .iter()
            // The value is the owner id and the acquire's nonce.
            .filter(|n| {
                n.command(&["GET", name])
                    .unwrap()
                    .as_str()
                    .map(layout::owner_of)
                    == Some(owner)
            })
            .count();
        if holding == nodes.len() {
            return;
        }
        assert!(
            holding > nodes.len() / 2,
            "the acquire returned with {holding} of {} nodes",
            nodes.len()
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "only {holding} of {} nodes got the key",
            nodes.len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn del_on(nodes: &RedlockNodes, which: &[usize], name: &str) {
    for &i in which {
        nodes.node(i).command(&["DEL", name]).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fencing_token_and_node_strings_hold_the_owner() {
    let nodes = RedlockNodes::start_or_panic(5);
    let locks = Locks::new(backend(&nodes.url()).await);
    assert_eq!(locks.capabilities().fencing, Fencing::None);
    let name = unique("layout");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    assert_eq!(guard.token(), None, "Redlock must not mint a token");
    on_every_node(&nodes, &name, guard.owner()).await;
    for node in nodes.nodes() {
        let pttl = node.command(&["PTTL", &name]).unwrap().as_int().unwrap();
        assert!(pttl > 0 && pttl <= 30_000, "pttl {pttl}");
    }
    guard.release().await.unwrap();
    for node in nodes.nodes() {
        assert!(node.command(&["GET", &name]).unwrap().is_nil());
    }
}

/// A try sent again after its reply was lost finds its own keys and counts them as grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_try_votes_yes_on_its_own_key() {
    let nodes = RedlockNodes::start_or_panic(5);
    let backend = backend(&nodes.url()).await;
    let request = AcquireRequest::new(unique("retry"), "me:1", Duration::from_secs(5));
    let mut acquisition = backend.begin(&request).unwrap();
    for _ in 0..2 {
        let attempt = backend
            .try_acquire(&mut acquisition, &request)
            .await
            .unwrap();
        assert!(matches!(attempt, Attempt::Acquired(_)), "{attempt:?}");
    }
    let other = AcquireRequest::new(request.name.clone(), "other:1", Duration::from_secs(5));
    let mut theirs = backend.begin(&other).unwrap();
    let attempt = backend.try_acquire(&mut theirs, &other).await.unwrap();
    let Attempt::Busy { retry_after } = attempt else {
        panic!("another owner was granted: {attempt:?}");
    };
    let retry_after = retry_after.expect("the holders' pttl");
    assert!(retry_after <= Duration::from_secs(5), "{retry_after:?}");
    backend.abandon(acquisition, &request).await;
    assert!(nodes
        .node(0)
        .command(&["GET", &request.name])
        .unwrap()
        .is_nil());
}

/// Two clients using one caller-chosen owner id (`lock_as`, e.g. a job name, in two processes) exclude
/// each other: each acquire writes its own value. With the owner id as the value, the second was
/// granted on the first's keys (the acquire votes yes on its own value) and both held, and either's
/// release deleted the other's keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_with_one_owner_id_exclude_each_other() {
    let nodes = RedlockNodes::start_or_panic(5);
    let a = Locks::new(backend(&nodes.url()).await);
    let b = Locks::new(backend(&nodes.url()).await);
    let name = unique("same_owner");
    let first = a
        .lock_as(&name, "nightly-job")
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let second = b
        .lock_as(&name, "nightly-job")
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(second.is_none(), "two holders with one owner id");
    // The status shows the owner id, not the per-acquire value.
    let info = b.inspect(&name).await.unwrap();
    assert_eq!(
        info.holder.and_then(|h| h.owner).as_deref(),
        Some("nightly-job")
    );
    first.release().await.unwrap();
    let second = b
        .lock_as(&name, "nightly-job")
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(second.is_some(), "free after the release");
}

/// Renewal: keys gone on 2 of 5 nodes leave a quorum (still Held); gone on 3, no quorum is possible
/// and the guard is Lost at the next renewal, long before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_needs_a_quorum_and_is_gone_without_one() {
    let nodes = RedlockNodes::start_or_panic(5);
    let locks = Locks::new(backend(&nodes.url()).await);
    let lease = Duration::from_millis(900);
    let name = unique("renew");
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    on_every_node(&nodes, &name, guard.owner()).await;
    del_on(&nodes, &[0, 1], &name);
    tokio::time::sleep(lease).await;
    assert_eq!(guard.state(), LockState::Held, "{:?}", guard.loss_reason());
    del_on(&nodes, &[2], &name);
    let started = std::time::Instant::now();
    tokio::time::timeout(lease, guard.lost())
        .await
        .expect("Lost at the next renewal (a third of the lease)");
    assert!(started.elapsed() < lease / 2 + Duration::from_millis(200));
    let reason = guard.loss_reason().unwrap_or_default();
    assert!(reason.contains("no quorum"), "{reason}");
}

/// A `redis://` lock (Redisson's hash) and a `redlock://` lock (a string) of one name are different
/// locks; where they meet on a node Redis answers WRONGTYPE, which Redlock reports as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_hash_lock_of_the_same_name_is_a_clear_error() {
    let nodes = RedlockNodes::start_or_panic(5);
    let name = unique("wrongtype");
    let mut hashes = Vec::new();
    for node in &nodes.nodes()[..3] {
        let redis = RedisBackend::connect(&LockUrl::parse(&node.url()).unwrap())
            .await
            .unwrap();
        let guard = Locks::new(redis)
            .lock(&name)
            .unwrap()
            .acquire()
            .await
            .unwrap();
        hashes.push(guard);
    }
    let locks = Locks::new(backend(&nodes.url()).await);
    let err = locks
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("a hash at the key");
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("redis://"), "{err}");
    for node in &nodes.nodes()[3..] {
        assert!(
            node.command(&["GET", &name]).unwrap().is_nil(),
            "the failed acquire left a key"
        );
    }
    let info = locks.inspect(&name).await.unwrap();
    assert!(info.holder.is_none());
    for node in &info.nodes[..3] {
        let error = node.error.as_deref().unwrap_or_default();
        assert!(
            error.contains("WRONGTYPE") && error.contains("redis://"),
            "{error}"
        );
    }
    drop(hashes);
}

/// `inspect` shows each node's holder and pttl, and the quorum's holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_every_node() {
    let nodes = RedlockNodes::start_or_panic(5);
    let locks = Locks::new(backend(&nodes.url()).await);
    let name = unique("inspect");
    let free = locks.inspect(&name).await.unwrap();
    assert!(free.holder.is_none());
    assert_eq!(free.nodes.len(), 5);
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    on_every_node(&nodes, &name, guard.owner()).await;
    del_on(&nodes, &[4], &name);
    let info = locks.inspect(&name).await.unwrap();
    let holder = info.holder.expect("held on a quorum");
    assert_eq!(holder.owner.as_deref(), Some(guard.owner()));
    assert!(holder
        .remaining_lease
        .is_some_and(|d| d <= Duration::from_secs(30)));
    for (i, node) in info.nodes.iter().enumerate() {
        assert_eq!(node.address, nodes.node(i).addr().to_string());
        if i == 4 {
            assert_eq!(node.owner, None);
        } else {
            assert_eq!(node.owner.as_deref(), Some(guard.owner()));
            assert!(node.remaining_lease.is_some());
        }
    }
    guard.release().await.unwrap();
}

/// A break deletes, on every node, the key of the hold `inspect` shows and nothing else: a distlock
/// holder's (`<owner>#<nonce>`, the value shown; a node where the key is gone already counts as
/// not holding it), then another client's random value (node-redlock's), shown as it is, while other
/// values of the name on other nodes, including one whose owner id starts with the broken one's, stay.
/// The broken distlock holder's guard goes `Lost` at its next renewal, which recreates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_deletes_the_owners_key_on_every_node() {
    let nodes = RedlockNodes::start_or_panic(5);
    let operator = Locks::new(backend(&nodes.url()).await);
    let holder = Locks::new(backend(&nodes.url()).await);
    let name = unique("break");
    let lease = Duration::from_millis(1500);
    let lock = holder.lock(&name).unwrap();
    let guard = lock.options().lease(lease).acquire().await.unwrap();
    on_every_node(&nodes, &name, lock.owner()).await;
    let shown = operator.inspect(&name).await.unwrap().holder.expect("held");
    assert_eq!(shown.owner.as_deref(), Some(lock.owner()));
    del_on(&nodes, &[0], &name);
    assert!(operator.break_holder(&name, &shown).await.unwrap());
    for node in nodes.nodes() {
        assert!(node.command(&["GET", &name]).unwrap().is_nil());
    }
    tokio::time::timeout(lease, guard.lost())
        .await
        .expect("the broken guard is Lost at its next renewal");
    for node in nodes.nodes() {
        assert!(node.command(&["GET", &name]).unwrap().is_nil(), "recreated");
    }
    assert!(!operator.break_holder(&name, &shown).await.unwrap());

    let name = unique("break_foreign");
    let foreign = "9f86d081884c7d65";
    let longer = format!("{foreign}0#0123456789abcdef");
    for (i, value) in [foreign, foreign, foreign, &longer, "someone-else"]
        .into_iter()
        .enumerate()
    {
        let set = nodes
            .node(i)
            .command(&["SET", &name, value, "PX", "30000"])
            .unwrap();
        assert!(!set.is_error(), "{set}");
    }
    let shown = operator.inspect(&name).await.unwrap().holder.expect("held");
    assert_eq!(shown.owner.as_deref(), Some(foreign));
    assert!(operator.break_holder(&name, &shown).await.unwrap());
    let left: Vec<Option<String>> = nodes
        .nodes()
        .iter()
        .map(|n| {
            n.command(&["GET", &name])
                .unwrap()
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(
        left,
        vec![
            None,
            None,
            None,
            Some(longer.clone()),
            Some("someone-else".into())
        ]
    );
}

/// `inspect` shows the value a quorum holds (owner id and that acquire's nonce) as the hold id, and a
/// break compares the whole of it: the same `Lock`, released and acquired again (same owner id, a new
/// nonce), keeps its keys on every node against a break aimed at its first hold. A holder built by
/// hand with the owner id alone is matched by owner, any nonce: that later hold is broken then. A hold
/// id of another owner than the one given is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_spares_the_same_locks_next_hold() {
    let nodes = RedlockNodes::start_or_panic(5);
    let operator = Locks::new(backend(&nodes.url()).await);
    let holder = Locks::new(backend(&nodes.url()).await);
    let name = unique("break_same_lock");
    let lease = Duration::from_millis(1500);
    let lock = holder.lock(&name).unwrap();
    let first = lock.options().lease(lease).acquire().await.unwrap();
    on_every_node(&nodes, &name, lock.owner()).await;
    let shown = operator.inspect(&name).await.unwrap().holder.expect("held");
    let value = nodes.node(0).command(&["GET", &name]).unwrap();
    assert_eq!(shown.hold_id.as_deref(), value.as_str());
    assert_eq!(shown.owner.as_deref(), Some(lock.owner()));
    first.release().await.unwrap();
    let second = lock.options().lease(lease).acquire().await.unwrap();
    on_every_node(&nodes, &name, lock.owner()).await;
    let values = |nodes: &RedlockNodes| -> Vec<Option<String>> {
        nodes
            .nodes()
            .iter()
            .map(|n| {
                n.command(&["GET", &name])
                    .unwrap()
                    .as_str()
                    .map(str::to_string)
            })
            .collect()
    };
    let held = values(&nodes);
    assert!(held
        .iter()
        .all(|v| v.is_some() && v.as_deref() != shown.hold_id.as_deref()));
    assert!(
        !operator.break_holder(&name, &shown).await.unwrap(),
        "a break aimed at the first hold broke the same Lock's next hold"
    );
    assert_eq!(values(&nodes), held, "a key of the next hold was deleted");
    assert_eq!(second.state(), LockState::Held);

    let mut foreign = shown.clone();
    foreign.hold_id = Some("someone-else#0123456789abcdef".into());
    let err = operator
        .break_holder(&name, &foreign)
        .await
        .expect_err("a hold id of another owner");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert_eq!(values(&nodes), held);

    let mut by_owner = distlock_core::raw::HolderInfo::default();
    by_owner.owner = shown.owner.clone();
    assert!(operator.break_holder(&name, &by_owner).await.unwrap());
    assert!(values(&nodes).iter().all(Option::is_none));
    tokio::time::timeout(lease, second.lost())
        .await
        .expect("the broken guard is Lost at its next renewal");
}

/// A break that too few nodes answer cannot tell whether the holder still has a quorum on the silent
/// ones: `Unavailable`, saying what it deleted where (the keys on the nodes that answered are gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_without_enough_answers_is_unavailable_fault() {
    let mut nodes = RedlockNodes::start_or_panic(5);
    let operator = Locks::new(backend(&nodes.url()).await);
    let name = unique("break_partial");
    let value = "p:1#0123456789abcdef";
    for node in nodes.nodes() {
        assert!(!node
            .command(&["SET", &name, value, "PX", "30000"])
            .unwrap()
            .is_error());
    }
    let shown = operator.inspect(&name).await.unwrap().holder.expect("held");
    assert_eq!(shown.owner.as_deref(), Some("p:1"));
    for i in 2..5 {
        nodes.node_mut(i).stop().unwrap();
    }
    let err = operator
        .break_holder(&name, &shown)
        .await
        .expect_err("3 of 5 nodes silent");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("on 2 of 5 nodes"), "{err}");
    for node in &nodes.nodes()[..2] {
        assert!(node.command(&["GET", &name]).unwrap().is_nil());
    }
}

/// `redlocks://` with `?ca=`: every node over TLS, the same lock seen on every node's plain port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlocks_over_tls_with_a_ca() {
    let ca = TestCa::new_or_panic();
    let nodes = RedlockNodes::start_with(3, || RedisServer::builder().tls(&ca)).unwrap();
    let tls = url_of(nodes.nodes().iter().map(|n| n.tls_addr().unwrap()));
    let url = format!(
        "{}?ca={}",
        tls.replacen("redlock://", "redlocks://", 1),
        ca.ca_cert().display()
    );
    let locks = Locks::new(backend(&url).await);
    let name = unique("tls");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    on_every_node(&nodes, &name, guard.owner()).await;
    guard.release().await.unwrap();
    // Without the CA the servers' certificates are not trusted: no quorum, a clear error.
    let err = RedlockBackend::connect(
        &LockUrl::parse(&tls.replacen("redlock://", "redlocks://", 1)).unwrap(),
    )
    .await
    .expect_err("untrusted certificates");
    assert!(
        matches!(
            err.kind(),
            ErrorKind::Unavailable | ErrorKind::PermissionDenied
        ),
        "{err}"
    );
}

/// Fewer than three nodes and `wait_replicas` are refused before any I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_are_invalid_config() {
    for bad in [
        "redlock://127.0.0.1:1,127.0.0.1:2",
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?wait_replicas=1",
        // A node listed twice votes twice (its acquire grants again on its own key): 2 of "3" nodes
        // from one server.
        "redlock://127.0.0.1:1,127.0.0.1:1,127.0.0.1:3",
        // A node timeout not below the lease: a yes that slow is worthless.
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?lease=1s&node_timeout=1s",
    ] {
        let err = RedlockBackend::connect(&LockUrl::parse(bad).unwrap())
            .await
            .expect_err(bad);
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}: {err}");
    }
}

/// Issue 24, scenario 6: one server listed twice under different addresses (`127.0.0.1:p` and
/// `localhost:p`; its address and a proxy in front of it) would make "2 of 3" one real server. Connect
/// refuses it by the servers' `run_id`, naming both addresses; three distinct servers connect, and so do
/// two of them with the third down (its identity unknown: not checked, see `check_distinct_servers`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_named_twice_is_refused_by_its_run_id_fault() {
    let mut nodes = RedlockNodes::start_or_panic(3);
    let (p1, p2) = (nodes.node(0).addr().port(), nodes.node(1).addr().port());
    let proxy = distlock_testkit::proxy::Proxy::start_or_panic(nodes.node(0).addr());
    let by_name = format!("redlock://127.0.0.1:{p1},localhost:{p1},127.0.0.1:{p2}");
    let by_proxy = url_of([nodes.node(1).addr(), nodes.node(0).addr(), proxy.addr()]);
    for (url, first, second) in [
        (
            by_name,
            format!("127.0.0.1:{p1}"),
            format!("localhost:{p1}"),
        ),
        (
            by_proxy,
            nodes.node(0).addr().to_string(),
            proxy.addr().to_string(),
        ),
    ] {
        let err = RedlockBackend::connect(&LockUrl::parse(&url).unwrap())
            .await
            .expect_err(&url);
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{url}: {err}");
        let message = err.to_string();
        assert!(
            message.contains(&first) && message.contains(&second) && message.contains("run_id"),
            "the error does not name the duplicate: {message}"
        );
    }
    backend(&nodes.url()).await;
    nodes.node_mut(2).kill9().unwrap();
    backend(&nodes.url()).await;
}

/// Many quick acquire/release cycles leave no key on any node. A smoke test only: on its own it passes
/// even when releases do not wait for the granting try's stragglers (each node's release goes on the
/// connection its acquire went on, so it usually queues behind it);
/// [`a_release_waits_for_a_straggler_s_noscript_fallback`] is the test that fails without that wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_right_after_the_quorum_leaves_no_key() {
    let nodes = RedlockNodes::start_or_panic(5);
    let locks = Locks::new(backend(&nodes.url()).await);
    let name = unique("quick_cycles");
    let lock = locks.lock(&name).unwrap();
    for _ in 0..100 {
        let guard = lock.acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    for node in nodes.nodes() {
        assert!(
            node.command(&["GET", &name]).unwrap().is_nil(),
            "a key was left on {}",
            node.addr()
        );
    }
}

/// An acquire returns once a quorum granted, while the other nodes' requests may be on their way; the
/// release must not overtake them, or it leaves an orphan key for a whole lease. Ordering on the
/// connection is not enough where a request takes more than one command: after `SCRIPT FLUSH` (a
/// restart does the same) an acquire is `EVALSHA`, `NOSCRIPT`, `SCRIPT LOAD`, `EVALSHA`, and so is the
/// release, so on a node that answers late the two fallbacks race unless the release waits for the
/// acquire to finish. Nodes 3 and 4 are held in `DEBUG SLEEP` (well under the 1 s node timeout of the
/// default lease) so their acquires are the stragglers; without the wait a key is left on one of them
/// in about half of the cases, so ten cycles on two nodes catch it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_waits_for_a_straggler_s_noscript_fallback() {
    let nodes = RedlockNodes::start_with(5, || RedisServer::builder().enable_debug_command())
        .expect("5 redis-server processes");
    let locks = Locks::new(backend(&nodes.url()).await);
    let name = unique("straggler_noscript");
    let lock = locks.lock(&name).unwrap();
    let slow: Vec<_> = nodes.nodes()[3..].iter().map(RedisServer::addr).collect();
    for cycle in 0..10 {
        for node in nodes.nodes() {
            node.command(&["SCRIPT", "FLUSH"]).unwrap();
        }
        let sleepers: Vec<_> = slow
            .iter()
            .map(|&addr| {
                std::thread::spawn(move || {
                    let mut conn =
                        distlock_testkit::redis::RespConn::connect(addr, Duration::from_secs(5))
                            .unwrap();
                    conn.command(&["DEBUG", "SLEEP", "0.2"]).unwrap();
                })
            })
            .collect();
        // The sleeps have reached the servers before the acquire's requests do.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let guard = lock.acquire().await.unwrap();
        guard.release().await.unwrap();
        for sleeper in sleepers {
            sleeper.join().unwrap();
        }
        // Without the wait, the straggler's EVALSHA lands a round trip after the sleep ends.
        tokio::time::sleep(Duration::from_millis(100)).await;
        for node in nodes.nodes() {
            assert!(
                node.command(&["GET", &name]).unwrap().is_nil(),
                "cycle {cycle}: the release overtook a straggling acquire and left a key on {}",
                node.addr()
            );
        }
    }
}

/// A `WRONGTYPE` on a minority of nodes is one failed vote, like a node down: a waiter for a lock that
/// is merely busy on the other nodes keeps waiting and gets it once the holder releases, instead of
/// failing at its first try with a `Protocol` error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minority_wrongtype_does_not_fail_a_waiter_for_a_busy_lock() {
    let nodes = RedlockNodes::start_or_panic(5);
    let name = unique("minority_wrongtype");
    nodes
        .node(0)
        .command(&["HSET", &name, "someone", "1"])
        .unwrap();
    let holder = Locks::new(backend(&nodes.url()).await);
    let waiter = Locks::new(backend(&nodes.url()).await);
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        held.release().await.unwrap();
    });
    let got = waiter
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(5))
        .acquire()
        .await;
    release.await.unwrap();
    let guard = got.expect("the lock once its holder released (4 string nodes of 5 are a quorum)");
    guard.release().await.unwrap();
}

/// A `Lock` keeps its last granted request for its next acquire: each acquire still sets its own
/// lease on every node, and writes a value of its own (`<owner>#<16 hex>`, fresh per acquire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_acquire_of_one_lock_has_its_own_lease_and_value() {
    let nodes = RedlockNodes::start_or_panic(5);
    let locks = Locks::new(backend(&nodes.url()).await);
    let name = unique("lease_per_acquire");
    let lock = locks.lock(&name).unwrap();
    let mut values = Vec::new();
    for secs in [60u64, 5, 120, 3] {
        let lease = Duration::from_secs(secs);
        let guard = lock.options().lease(lease).acquire().await.unwrap();
        on_every_node(&nodes, &name, guard.owner()).await;
        let ms = i64::try_from(lease.as_millis()).unwrap();
        for node in nodes.nodes() {
            let pttl = node.command(&["PTTL", &name]).unwrap().as_int().unwrap();
            assert!(
                pttl <= ms && pttl > ms - 2_000,
                "asked for {lease:?}, a node has {pttl} ms"
            );
        }
        let value = nodes.nodes()[0].command(&["GET", &name]).unwrap();
        values.push(value.as_str().unwrap().to_string());
        guard.release().await.unwrap();
    }
    let mut distinct = values.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        values.len(),
        "a value was reused: {values:?}"
    );
}
