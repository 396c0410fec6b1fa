//! A lock and a lock nested under its name (issue 24, scenario 20): lock `N` lives under the prefix
//! `N/`, which also holds the keys of lock `N/b` (`N/b/<lease hex>`). Only contender keys of `N`
//! (`N/<hex>`, `N/<hex>_<digits>`) contend for `N`, so neither lock blocks the other, a waiter of `N`
//! watches a key of `N`, and `status N` never names a nested lock's key. A Go `concurrency.Mutex`
//! (`etcdctl lock`) still counts every key under the prefix.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{keys, locks, name, wait_keys, Proxied};
use distlock_core::{LockGuard, Locks};
use distlock_testkit::etcd::{EtcdServer, ETCDCTL};

/// Nested names whose keys sort among (`b`, `abc`: hex, as a lease id) or before (`-x`, ` a`, `0`)
/// the outer name's contender keys.
const NESTED: [&str; 5] = ["b", "abc", "-x", " a", "0"];

/// The lease the nested holds take: far longer than any wait below, so only a release frees them.
const LONG: Duration = Duration::from_secs(30);

async fn hold(locks: &Locks, name: &str) -> LockGuard {
    locks
        .lock(name)
        .unwrap()
        .options()
        .lease(LONG)
        .acquire()
        .await
        .unwrap()
}

async fn take_at_once(locks: &Locks, name: &str, what: &str) -> LockGuard {
    locks
        .lock(name)
        .unwrap()
        .options()
        .lease(LONG)
        .try_acquire()
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: {name:?} is free but try_acquire found it busy"))
}

/// `N/x` held, then `N` taken at once; `N` held, then `N/x` taken at once; both held, each
/// `try_acquire` of either from another process is busy. Before: `N` was busy while only `N/x` was
/// held (its key, the oldest under `N/`, counted as `N`'s holder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_and_a_name_nested_under_it_never_block_each_other() {
    let server = EtcdServer::start_or_panic();
    let a = locks(&server.url()).await;
    let b = locks(&server.url()).await;
    let c = locks(&server.url()).await;
    for nested in NESTED {
        let outer = name("nested_block");
        let inner = format!("{outer}/{nested}");

        let inner_guard = hold(&a, &inner).await;
        let outer_guard = take_at_once(&b, &outer, &format!("{nested:?} held")).await;
        // Each is still held against a third process.
        assert!(c
            .lock(&outer)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        assert!(c
            .lock(&inner)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        // The outer token is its own key's create_revision, newer than the nested key.
        let seen = keys(&server.endpoints(), &format!("{outer}/"));
        let outer_key = seen
            .iter()
            .find(|k| !k.key[outer.len() + 1..].contains('/'))
            .expect("the outer key");
        assert_eq!(
            Some(outer_key.create_revision),
            outer_guard.token().map(|t| t.get())
        );
        assert!(outer_guard.token() > inner_guard.token());
        outer_guard.release().await.unwrap();
        inner_guard.release().await.unwrap();

        // The other way round: the outer name first.
        let outer_guard = hold(&b, &outer).await;
        let inner_guard = take_at_once(&a, &inner, &format!("the outer of {nested:?} held")).await;
        inner_guard.release().await.unwrap();
        outer_guard.release().await.unwrap();
    }
}

/// `status N` (`inspect`): while only `N/b` is held (with a waiter of its own), no holder and no waiter;
/// with `N` held too, `N`'s holder and `N`'s own waiter count. Before: `N/b`'s holder was shown as
/// `N`'s, and `N/b`'s waiter as `N`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_never_shows_a_nested_lock_as_holder_or_waiter() {
    let server = EtcdServer::start_or_panic();
    let a = locks(&server.url()).await;
    let b = locks(&server.url()).await;
    for nested in NESTED {
        let outer = name("nested_status");
        let inner = format!("{outer}/{nested}");
        let inner_guard = hold(&a, &inner).await;
        let inner_waiter = {
            let lock = b.lock(&inner).unwrap();
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(20)).acquire().await },
            )
        };
        wait_keys(
            &server.endpoints(),
            &format!("{inner}/"),
            Duration::from_secs(10),
            "the nested waiter queued",
            |k| k.len() == 2,
        );

        let info = a.inspect(&outer).await.unwrap();
        assert!(
            info.holder.is_none(),
            "{nested:?}: status of a free lock names a holder: {:?}",
            info.holder
        );
        assert_eq!(info.waiters.unwrap_or(0), 0, "{nested:?}: {info:?}");
        assert_eq!(info.last_token, None, "{nested:?}: {info:?}");

        let outer_lock = b.lock(&outer).unwrap();
        let outer_guard = outer_lock
            .options()
            .lease(LONG)
            .try_acquire()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{nested:?}: the outer lock is free but busy"));
        let outer_waiter = {
            let lock = a.lock(&outer).unwrap();
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(20)).acquire().await },
            )
        };
        wait_keys(
            &server.endpoints(),
            &format!("{outer}/"),
            Duration::from_secs(10),
            "the outer waiter queued",
            |k| k.len() == 4,
        );
        let info = a.inspect(&outer).await.unwrap();
        let holder = info.holder.clone().expect("the outer lock is held");
        assert_eq!(holder.token, outer_guard.token(), "{nested:?}: {info:?}");
        assert_eq!(
            holder.owner.as_deref(),
            Some(outer_lock.owner()),
            "{nested:?}"
        );
        assert_eq!(info.waiters, Some(1), "{nested:?}: {info:?}");

        outer_guard.release().await.unwrap();
        outer_waiter
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
        inner_guard.release().await.unwrap();
        inner_waiter
            .await
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

/// A waiter of `N` queued behind `N`'s holder, with keys of nested locks created between the two and
/// after the waiter's: the waiter's predecessor is `N`'s holder, so its release wakes the waiter, which
/// gets the lock at once, the nested locks still held. Before: the waiter watched the nested key just
/// before its own and queued behind the nested holds (their 30 s leases, held on: never, here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_the_holders_release_whatever_nested_keys_lie_between() {
    let server = EtcdServer::start_or_panic();
    let holder = locks(&server.url()).await;
    let waiter = locks(&server.url()).await;
    let nested = locks(&server.url()).await;
    for case in NESTED {
        let outer = name("nested_wait");
        let prefix = format!("{outer}/");
        let held = hold(&holder, &outer).await;
        let before = hold(&nested, &format!("{outer}/{case}")).await;
        let queued = {
            let lock = waiter.lock(&outer).unwrap();
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(25)).acquire().await },
            )
        };
        wait_keys(
            &server.endpoints(),
            &prefix,
            Duration::from_secs(10),
            "the waiter queued",
            |k| k.len() == 3,
        );
        let after = hold(&nested, &format!("{outer}/{case}/{case}")).await;
        let sibling = hold(&nested, &format!("{outer}/{case}x")).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !queued.is_finished(),
            "{case:?}: the waiter got a held lock"
        );

        let released_at = Instant::now();
        held.release().await.unwrap();
        let granted = tokio::time::timeout(Duration::from_secs(10), queued)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{case:?}: the waiter was not granted within 10 s of the release; keys {:?}",
                    keys(&server.endpoints(), &prefix)
                )
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("{case:?}: the waiter failed: {e}"));
        assert!(released_at.elapsed() < Duration::from_secs(10));
        assert!(granted.token() > before.token(), "{case:?}");
        granted.release().await.unwrap();
        for guard in [before, after, sibling] {
            guard.release().await.unwrap();
        }
    }
}

/// Tokens of `N` strictly increase while nested locks come and go (each round a nested key created
/// before `N`'s acquire, one during its hold; every other round `N` goes to a local waiter through the
/// handoff, whose compare sees the nested key created after the holder's). Before: the first acquire of
/// `N` was busy behind the nested hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_a_name_strictly_increase_across_nested_holds() {
    let server = EtcdServer::start_or_panic();
    let outer_locks = locks(&server.url()).await;
    let nested = locks(&server.url()).await;
    let outer = name("nested_tokens");
    let mut last = None;
    let mut nested_holds = Vec::new();
    for round in 0..6 {
        let case = NESTED[round % NESTED.len()];
        nested_holds.push(hold(&nested, &format!("{outer}/{case}/{round}")).await);
        let guard = take_at_once(&outer_locks, &outer, &format!("round {round}")).await;
        assert!(
            guard.token() > last,
            "round {round}: {:?} after {last:?}",
            guard.token()
        );
        last = guard.token();
        let local_waiter = (round % 2 == 1).then(|| {
            let lock = outer_locks.lock(&outer).unwrap();
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(10)).acquire().await },
            )
        });
        if local_waiter.is_some() {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        nested_holds.push(hold(&nested, &format!("{outer}/{case}")).await);
        guard.release().await.unwrap();
        if let Some(waiter) = local_waiter {
            let handed = tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .unwrap_or_else(|_| panic!("round {round}: the local waiter was not granted"))
                .unwrap()
                .unwrap();
            assert!(
                handed.token() > last,
                "round {round}: {:?} after {last:?}",
                handed.token()
            );
            last = handed.token();
            handed.release().await.unwrap();
        }
        nested_holds.pop().unwrap().release().await.unwrap();
    }
    for guard in nested_holds {
        guard.release().await.unwrap();
    }
}

/// The read further (the `limit: 1` holder read answered a nested key) is made at the revision of the
/// try's txn; when that revision was compacted before the read arrives, it is made at the current
/// revision instead (with the own key in it), and the free lock is granted. Before (without the
/// fallback): the compacted read (`OutOfRange`) was retried until the request timeout and the acquire
/// failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_contenders_read_at_a_compacted_revision_reads_the_current_one() {
    use distlock_etcd::rpc::pb::etcdserverpb::{CompactionRequest, PutRequest};
    let fx = Proxied::start(1);
    let (_backend, proxied) = fx.connect(false, "request_timeout=8s").await;
    let nested = locks(&fx.server.url()).await;
    let raw = fx.raw().await;
    let outer = name("nested_compacted");
    let prefix = format!("{outer}/");
    let inner_guard = hold(&nested, &format!("{outer}/b")).await;
    // The proxied backend's session of that lease exists before the delay.
    hold(&proxied, &name("warm")).await.release().await.unwrap();

    fx.delay(Duration::from_millis(800));
    let lock = proxied.lock(&outer).unwrap();
    let task = tokio::spawn(async move { lock.options().lease(LONG).try_acquire().await });
    // The try's txn applied (the outer key is there); its reply and the read further are on their way.
    wait_keys(
        &fx.server.endpoints(),
        &prefix,
        Duration::from_secs(10),
        "the try's txn applied",
        |k| k.iter().any(|k| !k.key[prefix.len()..].contains('/')),
    );
    let revision = raw
        .put(PutRequest {
            key: b"compaction-marker".to_vec(),
            value: b"x".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .header
        .unwrap()
        .revision;
    raw.compact(CompactionRequest {
        revision,
        physical: true,
    })
    .await
    .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the try finishes")
        .unwrap();
    fx.pass();
    let guard = outcome
        .unwrap_or_else(|e| panic!("the try failed: {e}"))
        .expect("the outer lock is free");
    assert!(guard.token() > inner_guard.token());
    guard.release().await.unwrap();
    inner_guard.release().await.unwrap();
}

/// `etcdctl lock NAME` without a command: prints the key once held, holds until SIGINT.
fn etcdctl_lock(server: &EtcdServer, name: &str) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(ETCDCTL)
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &server.endpoints(), "lock", name])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Keep reading until etcdctl exits: a closed pipe can kill it with SIGPIPE before it unlocks.
        let mut lines = BufReader::new(stdout).lines();
        while let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

fn interrupt(child: &mut Child) {
    let pid = rustix::process::Pid::from_child(child);
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
    let _ = child.wait();
}

/// What a Go client (`etcdctl lock`, Go's `concurrency.Mutex`) sees: on `N` it still counts every key
/// under `N/`, so it waits behind a nested hold; meanwhile its key is `N`'s oldest contender, so
/// distlock shows it as `N`'s holder and queues behind it. Exclusion on `N` holds both ways; a Go client
/// on `N/b` is never blocked by `N`'s holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_go_client_still_counts_nested_keys_and_exclusion_on_the_name_holds() {
    let server = EtcdServer::start_or_panic();
    let a = locks(&server.url()).await;
    let b = locks(&server.url()).await;
    let outer = name("nested_go");
    let inner = format!("{outer}/b");
    let prefix = format!("{outer}/");

    let inner_guard = hold(&a, &inner).await;
    let (mut go, go_lines) = etcdctl_lock(&server, &outer);
    let seen = wait_keys(
        &server.endpoints(),
        &prefix,
        Duration::from_secs(10),
        "etcdctl queued",
        |k| k.len() == 2,
    );
    let go_rev = seen[1].create_revision;
    // Go's flaw: the nested key is older than etcdctl's, so etcdctl waits for it.
    assert!(
        go_lines.recv_timeout(Duration::from_millis(1500)).is_err(),
        "etcdctl lock {outer} got the lock while a nested key was older than its own"
    );
    // distlock: etcdctl's key is N's only contender, so it is N's holder.
    assert!(b
        .lock(&outer)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let info = b.inspect(&outer).await.unwrap();
    let holder = info.holder.expect("etcdctl's key is N's holder");
    assert_eq!(holder.token.map(|t| t.get()), Some(go_rev));
    assert_eq!(holder.owner, None, "Go writes an empty value");

    // The nested hold ends: etcdctl gets the lock, and distlock still waits for it.
    let waiter = {
        let lock = b.lock(&outer).unwrap();
        tokio::spawn(async move { lock.options().wait(Duration::from_secs(20)).acquire().await })
    };
    inner_guard.release().await.unwrap();
    let line = go_lines
        .recv_timeout(Duration::from_secs(10))
        .expect("etcdctl gets the lock once the nested hold ends");
    assert!(line.starts_with(&prefix), "{line:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished(), "distlock got a lock etcdctl holds");
    interrupt(&mut go);
    let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("distlock gets the lock once etcdctl lets go")
        .unwrap()
        .unwrap();
    assert!(guard.token().unwrap().get() > go_rev);

    // distlock holds N: etcdctl lock N waits; etcdctl lock N/b (prefix N/b/) does not.
    let (mut go_outer, go_outer_lines) = etcdctl_lock(&server, &outer);
    // Queued before etcdctl's N/b key exists: a nested key older than its own would block it (above).
    wait_keys(
        &server.endpoints(),
        &prefix,
        Duration::from_secs(10),
        "etcdctl queued on N",
        |k| k.len() == 2,
    );
    let (mut go_inner, go_inner_lines) = etcdctl_lock(&server, &inner);
    let line = go_inner_lines
        .recv_timeout(Duration::from_secs(10))
        .expect("etcdctl lock N/b is not blocked by N's holder");
    assert!(line.starts_with(&format!("{inner}/")), "{line:?}");
    assert!(
        go_outer_lines
            .recv_timeout(Duration::from_millis(1000))
            .is_err(),
        "etcdctl got N while distlock holds it"
    );
    guard.release().await.unwrap();
    go_outer_lines
        .recv_timeout(Duration::from_secs(10))
        .expect("etcdctl gets N after distlock's release");
    interrupt(&mut go_outer);
    interrupt(&mut go_inner);
}
