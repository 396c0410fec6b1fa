//! Redlock on 5 real `redis-server` processes, beyond the conformance suite: the quorum rules of
//! renewal, a retried try voting yes on its own key, `WRONGTYPE` against a `redis://` lock of the same
//! name, `inspect` per node, and no fencing token.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::raw::{AcquireRequest, Attempt, Backend};
use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, Fencing, LockState, Locks};
use distlock_redis::{RedisBackend, RedlockBackend};
use distlock_testkit::redlock::RedlockNodes;

async fn backend(url: &str) -> RedlockBackend {
    RedlockBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect")
}

fn unique(case: &str) -> String {
    format!("redlock/{case}/{}", uuid::Uuid::new_v4().simple())
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
    for node in nodes.nodes() {
        let value = node.command(&["GET", &name]).unwrap();
        assert_eq!(value.as_str(), Some(guard.owner()), "node {}", node.addr());
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
