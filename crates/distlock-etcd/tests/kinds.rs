//! The etcd backend's lock kinds on a real server (issue 25): the read-write lock's key layout (Go's
//! `recipe.RWMutex`: `NAME/read/<unix nanos>`, `NAME/write/<unix nanos>` on the session lease), its
//! FIFO order (a reader after a waiting writer waits), one queue with the mutex, the write token record
//! readers carry, the semaphore's layout (`NAME/permit.<lease hex>.<n>`, the kept limit key), a revoked
//! permit holder's permit coming back at once, cancelled waits leaving no key, `etcdctl lock` (Go's
//! `concurrency.Mutex`) and a reader waiting for each other, and a mixed-kinds race
//! that never has two kinds holding at once. The shared cases are in `conformance.rs`.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockKind, LockState};
use distlock_etcd::layout::{self, NameKey};
use distlock_testkit::etcd::EtcdServer;

const PROMPT: Duration = Duration::from_secs(5);

/// The one session lease of a backend that took locks with the default options.
async fn lease_of(backend: &distlock_etcd::EtcdBackend) -> i64 {
    let leases = backend.session_leases().await;
    assert_eq!(leases.len(), 1, "one session: {leases:?}");
    leases[0].1
}

/// The value of a key as etcdctl prints it (`None` when absent).
fn value(server: &EtcdServer, key: &str) -> Option<String> {
    let out = server.etcdctl(&["get", key, "--print-value-only"]).unwrap();
    let v = out.trim_end_matches('\n');
    (!v.is_empty()).then(|| v.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_layout_fifo_record_and_one_queue_with_the_mutex() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let ends = server.endpoints();
    let name = common::name("rw");
    let prefix = layout::prefix(&name);
    let (ba, bb, bc) = (
        common::backend(&url).await,
        common::backend(&url).await,
        common::backend(&url).await,
    );
    let (la, lb, lc) = (
        common::locks_on(&ba),
        common::locks_on(&bb),
        common::locks_on(&bc),
    );

    // A reader's key: Go's RWMutex shape, on the session lease, the owner id as the value.
    let ra = la.read_write(&name).unwrap();
    let r1 = ra.read().await.expect("read");
    let keys = common::keys(&ends, &prefix);
    assert_eq!(keys.len(), 1, "{keys:?}");
    let nanos = keys[0]
        .key
        .strip_prefix(&format!("{name}/read/"))
        .expect("NAME/read/<nanos>");
    assert!(nanos.bytes().all(|b| b.is_ascii_digit()), "{nanos}");
    assert_eq!(keys[0].lease, lease_of(&ba).await);
    assert_eq!(value(&server, &keys[0].key).as_deref(), Some(ra.owner()));
    assert_eq!(
        layout::classify(&prefix, keys[0].key.as_bytes()),
        Some(NameKey::Read)
    );

    // A writer queues behind it (NAME/write/<nanos>); a reader after the waiting writer waits too
    // (FIFO), and so does a mutex.
    let rb = lb.read_write(&name).unwrap();
    let writer = {
        let w = lb.read_write(&name).unwrap();
        tokio::spawn(async move { w.writer().options().wait(PROMPT * 2).acquire().await })
    };
    let keys = common::wait_keys(&ends, &prefix, PROMPT, "the writer's key", |k| k.len() == 2);
    assert!(
        keys[1].key.starts_with(&format!("{name}/write/")),
        "{keys:?}"
    );
    let rc = lc.read_write(&name).unwrap();
    assert!(
        rc.reader().try_acquire().await.unwrap().is_none(),
        "a reader after a waiting writer got in beside the first reader"
    );
    assert!(lc
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let info = la.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Read), "{info:?}");
    assert_eq!((info.holders.len(), info.waiters), (1, Some(1)), "{info:?}");
    let late_reader = {
        let r = lc.read_write(&name).unwrap();
        tokio::spawn(async move { r.reader().options().wait(PROMPT * 2).acquire().await })
    };
    common::wait_keys(&ends, &prefix, PROMPT, "the late reader's key", |k| {
        k.len() == 3
    });

    // The reader leaves: the writer gets in (woken by its watch), the late reader still waits.
    let released_at = Instant::now();
    r1.release().await.unwrap();
    let w = tokio::time::timeout(PROMPT, writer)
        .await
        .expect("the writer was not woken")
        .unwrap()
        .expect("write");
    assert!(released_at.elapsed() < PROMPT);
    assert_eq!(w.kind(), LockKind::Write);
    let keys = common::keys(&ends, &prefix);
    let wkey = keys
        .iter()
        .find(|k| k.key.starts_with(&format!("{name}/write/")))
        .unwrap();
    assert_eq!(
        w.token().unwrap().get(),
        wkey.create_revision,
        "write token"
    );
    let info = la.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Write), "{info:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !late_reader.is_finished(),
        "a reader got in beside the writer"
    );

    // A reader that gives up behind the writer leaves no key.
    let gave_up = la
        .read_write(&name)
        .unwrap()
        .reader()
        .options()
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert_eq!(
        gave_up.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::Timeout),
        "{gave_up:?}"
    );
    common::wait_keys(
        &ends,
        &prefix,
        PROMPT,
        "the given-up reader's key gone",
        |k| k.len() == 2,
    );

    // A queued reader whose key an operator deletes stops waiting at once (it watches its own key
    // too), with an error, long before the writer lets go or its wait limit.
    let doomed = {
        let r = la.read_write(&name).unwrap();
        tokio::spawn(async move { r.reader().options().wait(PROMPT * 4).acquire().await })
    };
    let keys = common::wait_keys(&ends, &prefix, PROMPT, "the doomed reader's key", |k| {
        k.len() == 3
    });
    let deleted_at = Instant::now();
    server.etcdctl(&["del", &keys[2].key]).unwrap();
    let outcome = tokio::time::timeout(PROMPT, doomed)
        .await
        .expect("a reader whose key was deleted kept waiting")
        .unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    assert!(deleted_at.elapsed() < PROMPT);

    // The writer's release records its token; the late reader carries it.
    let w_token = w.token().unwrap().get();
    w.release().await.unwrap();
    let r2 = tokio::time::timeout(PROMPT, late_reader)
        .await
        .expect("the late reader was not woken")
        .unwrap()
        .expect("read");
    assert_eq!(r2.token().unwrap().get(), w_token, "a reader's token");
    assert_eq!(
        value(&server, &layout::write_record_key(&name)),
        Some(w_token.to_string())
    );

    // One queue with the mutex: a mutex waits for the reader, a reader for the mutex.
    assert!(la
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    r2.release().await.unwrap();
    let m = la.lock(&name).unwrap().acquire().await.unwrap();
    assert!(m.token().unwrap().get() > w_token);
    assert!(rb.reader().try_acquire().await.unwrap().is_none());
    assert!(rb.writer().try_acquire().await.unwrap().is_none());
    m.release().await.unwrap();
    common::wait_keys(&ends, &prefix, PROMPT, "nothing left", |k| k.is_empty());

    // Go's Mutex (`etcdctl lock`) waits for a distlock reader, and a distlock reader for it.
    let r3 = ra.read().await.unwrap();
    let mut etcdctl = std::process::Command::new(distlock_testkit::etcd::ETCDCTL)
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &ends, "lock", &name])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("etcdctl");
    // Its stdout stays open until it exits (a closed pipe can kill it by SIGPIPE before it unlocks).
    let stdout = etcdctl.stdout.take().unwrap();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let mut stdout = std::io::BufReader::new(stdout);
        let _ = std::io::BufRead::read_line(&mut stdout, &mut line);
        let _ = held_tx.send(line);
        // Drain until etcdctl exits.
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    });
    common::wait_keys(&ends, &prefix, PROMPT, "etcdctl's key", |k| k.len() == 2);
    assert!(
        held_rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "etcdctl lock got the name while a distlock reader held it"
    );
    r3.release().await.unwrap();
    let line = held_rx
        .recv_timeout(PROMPT)
        .expect("etcdctl lock after the reader");
    assert!(line.starts_with(&prefix), "{line:?}");
    assert!(
        rb.reader().try_acquire().await.unwrap().is_none(),
        "a distlock reader got in beside etcdctl lock's holder"
    );
    let pid = rustix::process::Pid::from_child(&etcdctl);
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
    let _ = etcdctl.wait();
    common::wait_keys(&ends, &prefix, PROMPT, "etcdctl's key gone", |k| {
        k.is_empty()
    });

    // A race of all kinds on one name: never a mutex or writer beside anyone, never a reader beside
    // a permit, never more than two permits.
    mixed_kinds_race(&[la, lb, lc], &name).await;
    common::wait_keys(&ends, &prefix, PROMPT, "nothing left after the race", |k| {
        k.is_empty()
    });
}

/// Tasks taking every kind on one name for a while, counting who is inside.
async fn mixed_kinds_race(locks: &[distlock_core::Locks], name: &str) {
    #[derive(Default)]
    struct Inside {
        exclusive: AtomicUsize,
        readers: AtomicUsize,
        permits: AtomicUsize,
        grants: AtomicUsize,
        bad: AtomicBool,
    }
    let inside = Arc::new(Inside::default());
    let stop = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for (i, locks) in locks.iter().enumerate() {
        for kind in 0..4 {
            let (locks, name, inside) = (locks.clone(), name.to_string(), inside.clone());
            tasks.push(tokio::spawn(async move {
                let rw = locks.read_write(&name).unwrap();
                let sem = locks.semaphore(&name, 2).unwrap();
                while Instant::now() < stop {
                    let guard = match (kind + i) % 4 {
                        0 => {
                            locks
                                .lock(&name)
                                .unwrap()
                                .options()
                                .wait(PROMPT)
                                .acquire()
                                .await
                        }
                        1 => rw.writer().options().wait(PROMPT).acquire().await,
                        2 => rw.reader().options().wait(PROMPT).acquire().await,
                        _ => sem.permit().options().wait(PROMPT).acquire().await,
                    }
                    .expect("an acquire in the race");
                    let counter = match guard.kind() {
                        LockKind::Mutex | LockKind::Write => &inside.exclusive,
                        LockKind::Read => &inside.readers,
                        _ => &inside.permits,
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                    inside.grants.fetch_add(1, Ordering::SeqCst);
                    let (e, r, p) = (
                        inside.exclusive.load(Ordering::SeqCst),
                        inside.readers.load(Ordering::SeqCst),
                        inside.permits.load(Ordering::SeqCst),
                    );
                    let others = match guard.kind() {
                        LockKind::Mutex | LockKind::Write => r + p + e - 1,
                        LockKind::Read => e + p,
                        _ => e + r + usize::from(p > 2),
                    };
                    if others > 0 {
                        inside.bad.store(true, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    counter.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.expect("release in the race");
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        !inside.bad.load(Ordering::SeqCst),
        "two kinds (or a third permit of 2) held at once"
    );
    assert!(inside.grants.load(Ordering::SeqCst) > 12, "the race ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_layout_kept_limit_revoked_holder_and_cancelled_wait() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let ends = server.endpoints();
    let name = common::name("sem/a%b");
    let prefix = layout::prefix(&name);
    let (ba, bb) = (common::backend(&url).await, common::backend(&url).await);
    let (la, lb) = (common::locks_on(&ba), common::locks_on(&bb));
    let sa = la.semaphore(&name, 2).unwrap();
    let sb = lb.semaphore(&name, 2).unwrap();

    // Two permits of one backend: slots 0 and 1 on its session lease; the limit key, with no lease.
    let p1 = sa.acquire().await.unwrap();
    let p2 = sa.acquire().await.unwrap();
    let lease = lease_of(&ba).await;
    let keys = common::keys(&ends, &prefix);
    let expected: Vec<String> = (0..2)
        .map(|n| layout::permit_key(&name, lease, n))
        .collect();
    assert_eq!(
        keys.iter().map(|k| k.key.clone()).collect::<Vec<_>>(),
        expected
    );
    assert!(keys.iter().all(|k| k.lease == lease));
    assert_eq!(p1.permit(), Some(format!("permit.{lease:x}.0").as_str()));
    assert_eq!(p2.permit(), Some(format!("permit.{lease:x}.1").as_str()));
    assert_eq!(p1.token().unwrap().get(), keys[0].create_revision);
    let limit_key = layout::limit_key(&name);
    assert!(!limit_key.contains('/'), "{limit_key}");
    assert_eq!(value(&server, &limit_key).as_deref(), Some("2"));
    let limit_lease = common::keys(&ends, &limit_key);
    assert_eq!(limit_lease[0].lease, 0, "the limit key has no lease");
    let info = lb.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 2 }), "{info:?}");
    let shown: Vec<_> = info.holders.iter().map(|h| h.permit.clone()).collect();
    assert_eq!(
        shown,
        vec![
            p1.permit().map(str::to_string),
            p2.permit().map(str::to_string)
        ]
    );

    // Full: a third permit, a mutex, a reader and a writer do not get in.
    assert!(sb.try_acquire().await.unwrap().is_none());
    assert!(lb
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let rw = lb.read_write(&name).unwrap();
    assert!(rw.reader().try_acquire().await.unwrap().is_none());
    assert!(rw.writer().try_acquire().await.unwrap().is_none());

    // Another limit is refused, naming where the limit is.
    let err = lb
        .semaphore(&name, 3)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }
    );
    assert!(err.to_string().contains(&limit_key), "{err}");

    // The holder's session lease revoked (a dead holder's lease ran out): both permits go, and a
    // waiter is woken by the deletes, not by a poll or a lease.
    let waiter = {
        let sb = sb.clone();
        tokio::spawn(async move { sb.permit().options().wait(PROMPT * 2).acquire().await })
    };
    common::wait_keys(&ends, &prefix, PROMPT, "the waiter's key", |k| k.len() == 3);
    let raw = distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([ends.clone()]))
        .await
        .unwrap();
    let revoked_at = Instant::now();
    raw.lease_revoke(lease).await.unwrap();
    let back = tokio::time::timeout(PROMPT, waiter)
        .await
        .expect("the waiter was not woken by the revoke")
        .unwrap()
        .expect("a permit after the revoke");
    assert!(revoked_at.elapsed() < PROMPT);
    for p in [&p1, &p2] {
        let started = Instant::now();
        while p.state() != LockState::Lost && started.elapsed() < PROMPT {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(p.state(), LockState::Lost);
    }
    let second = sb.try_acquire().await.unwrap().expect("the second permit");
    assert_ne!(back.permit(), second.permit());

    // A wait given up takes nothing and leaves no key.
    let gave_up = sa
        .permit()
        .options()
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert_eq!(
        gave_up.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::Timeout),
        "{gave_up:?}"
    );
    common::wait_keys(&ends, &prefix, PROMPT, "two permit keys only", |k| {
        k.len() == 2
    });
    drop((p1, p2));
    back.release().await.unwrap();
    second.release().await.unwrap();
    common::wait_keys(&ends, &prefix, PROMPT, "nothing left", |k| k.is_empty());

    // The limit is kept; deleting its key (with no permit held) lets another limit in.
    assert_eq!(value(&server, &limit_key).as_deref(), Some("2"));
    let kept = lb.semaphore(&name, 3).unwrap().try_acquire().await;
    assert_eq!(
        kept.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        })
    );
    server.etcdctl(&["del", &limit_key]).unwrap();
    let three = lb.semaphore(&name, 3).unwrap();
    let p = three.try_acquire().await.unwrap().expect("a permit of 3");
    assert_eq!(value(&server, &limit_key).as_deref(), Some("3"));
    p.release().await.unwrap();
}

/// Nested names `X/read` and `X/write` beside a read-write lock `X` (adversarial review): a reader's
/// key `X/read/<unix nanos>` (19 digits) is no contender of the mutex `X/read`, whose keys carry a
/// lease id (at most 16 hex digits), and a mutex `X/read` key with an all-digit lease id is no reader
/// of `X`. Before, each side counted the other's keys as its own: a process holding `X`'s read (or
/// write) lock that took the mutex `X/read` (`X/write`) waited for itself until its wait limit, and
/// `X`'s writers waited for a Go `Mutex` of `X/read` whose lease prints as digits only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_read_and_write_names_beside_a_read_write_lock_never_wait_for_it() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let ends = server.endpoints();
    let name = common::name("nest");
    let backend = common::backend(&url).await;
    let locks = common::locks_on(&backend);
    let rw = locks.read_write(&name).unwrap();
    let short = Duration::from_secs(2);

    // Holding X's read lock, the same process takes the mutex X/read.
    let read = rw.read().await.expect("read");
    let nested = locks
        .lock(&format!("{name}/read"))
        .unwrap()
        .options()
        .wait(short)
        .acquire()
        .await
        .expect("the mutex X/read beside X's own reader (it waited for that reader's key)");
    nested.release().await.unwrap();
    read.release().await.unwrap();

    // Holding X's write lock, the same process takes the mutex X/write.
    let write = rw.write().await.expect("write");
    let nested = locks
        .lock(&format!("{name}/write"))
        .unwrap()
        .options()
        .wait(short)
        .acquire()
        .await
        .expect("the mutex X/write beside X's own writer (it waited for that writer's key)");
    nested.release().await.unwrap();
    write.release().await.unwrap();

    // A Go `Mutex` of X/read and of X/write whose lease ids print as digits only (`%x` of 0x1234):
    // neither is a reader or a writer of X, so X's writer takes X at once.
    for nested in ["read", "write"] {
        let key = format!("{name}/{nested}/1234");
        server.etcdctl(&["put", &key, ""]).unwrap();
        assert_eq!(
            layout::classify(&layout::prefix(&name), key.as_bytes()),
            None,
            "{key}"
        );
        let w = rw
            .writer()
            .options()
            .wait(short)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("X's writer waited for the mutex key {key}: {e}"));
        w.release().await.unwrap();
        server.etcdctl(&["del", &key]).unwrap();
    }
    assert!(common::keys(&ends, &layout::prefix(&name)).is_empty());
}

/// Permit tokens in the order the permits are granted (adversarial review; contract: "each permit
/// grant mints one above every earlier grant of the name"). Two waiters, R queued before Q, are woken by
/// one revision that frees both permits of a limit of 2 (an `etcdctl del --prefix` of the holders'
/// keys); R's client is slow (its traffic delayed through a proxy), so Q tries first and is granted
/// (one older permit key, R's, below the limit), then R. With the create_revision as the token R's was
/// the lower one (`[6, 5]` in grant order); the token is now the revision of the grant's own write
/// (`layout::permit_grant_txn`). That write wakes no other waiter: while the two wait, each after its
/// try's write, the store's revision stands still (a waiter woken by the other's put would write
/// again, and the two would wake each other for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_tokens_rise_in_grant_order_when_two_permits_free_at_once() {
    let proxied = common::Proxied::start(1);
    let server = &proxied.server;
    let url = server.url();
    let ends = server.endpoints();
    let (ba, bc) = (common::backend(&url).await, common::backend(&url).await);
    let (la, lc) = (common::locks_on(&ba), common::locks_on(&bc));
    let (_bb, lb) = proxied.connect(false, "request_timeout=5s").await;
    let name = common::name("sem-order");
    let prefix = layout::prefix(&name);
    let held = [
        la.semaphore(&name, 2).unwrap().acquire().await.unwrap(),
        la.semaphore(&name, 2).unwrap().acquire().await.unwrap(),
    ];
    let order = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for (n, locks) in [&lb, &lc].into_iter().enumerate() {
        let (sem, order) = (locks.semaphore(&name, 2).unwrap(), order.clone());
        waiters.push(tokio::spawn(async move {
            let guard = sem.permit().options().wait(PROMPT).acquire().await.unwrap();
            let at = order.fetch_add(1, Ordering::SeqCst);
            (at, guard)
        }));
        common::wait_keys(&ends, &prefix, PROMPT, "the waiter's key", |k| {
            k.len() == 3 + n
        });
    }
    // Both waiters watch the permits for a delete, each after a try that wrote its key again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let raw = distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([ends.clone()]))
        .await
        .unwrap();
    let before = common::revision(&raw).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = common::revision(&raw).await;
    assert!(
        after - before <= 2,
        "the store's revision kept climbing while two permits waited ({before} -> {after}): the waiters' writes wake each other"
    );
    // R's client now hears of the delete late.
    proxied.delay(Duration::from_millis(300));
    let lease = lease_of(&ba).await;
    server
        .etcdctl(&["del", "--prefix", &format!("{name}/permit.{lease:x}.")])
        .unwrap();
    let mut granted = Vec::new();
    for waiter in waiters {
        granted.push(waiter.await.unwrap());
    }
    proxied.pass();
    granted.sort_by_key(|(at, _)| *at);
    let tokens: Vec<u64> = granted
        .iter()
        .map(|(_, g)| g.token().unwrap().get())
        .collect();
    // Status shows the tokens the guards carry; `fenced_put` takes a permit's token, and refuses its
    // key's create_revision once the grant's write moved past it.
    let info = la.inspect(&name).await.unwrap();
    let mut shown: Vec<u64> = info
        .holders
        .iter()
        .map(|h| h.token.unwrap().get())
        .collect();
    let mut carried = tokens.clone();
    shown.sort_unstable();
    carried.sort_unstable();
    assert_eq!(shown, carried, "status tokens: {info:?}");
    let keys = common::keys(&ends, &prefix);
    for (_, g) in &granted {
        let key = format!("{name}/{}", g.permit().unwrap());
        let token = g.token().unwrap().get();
        let fenced = raw
            .txn(layout::fenced_put(
                &key,
                token,
                &format!("{name}-fenced"),
                "x",
            ))
            .await
            .unwrap();
        assert!(fenced.succeeded, "fenced_put with {key}'s token {token}");
        let created = keys.iter().find(|k| k.key == key).unwrap().create_revision;
        if created != token {
            let stale = raw
                .txn(layout::fenced_put(
                    &key,
                    created,
                    &format!("{name}-fenced"),
                    "y",
                ))
                .await
                .unwrap();
            assert!(
                !stale.succeeded,
                "fenced_put with {key}'s create_revision {created}"
            );
        }
    }
    for (_, g) in granted {
        g.release().await.unwrap();
    }
    drop(held);
    server.etcdctl(&["del", &format!("{name}-fenced")]).unwrap();
    assert!(
        tokens[0] < tokens[1],
        "a permit granted after another carried a lower token (tokens in grant order): {tokens:?}"
    );
}

/// Runs `request` with its reply lost (as `lost_release.rs` does): the proxy holds every chunk for
/// 1 s, the txn reaches etcd and applies (`applied` says so, read straight from the server), and the
/// connection is reset while the reply is still held, so the backend sends it again on a new
/// connection.
async fn with_its_reply_lost<T: Send + 'static>(
    fx: &common::Proxied,
    prefix: &str,
    applied: impl Fn(&[common::KeyFields]) -> bool,
    request: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    fx.delay(Duration::from_secs(1));
    let task = tokio::spawn(request);
    let endpoints = fx.server.endpoints();
    let started = Instant::now();
    loop {
        let seen = tokio::task::block_in_place(|| common::keys(&endpoints, prefix));
        if applied(&seen) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the request never reached the server: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fx.pass();
    tokio::task::block_in_place(|| fx.proxy().reset().unwrap());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the request finishes")
        .unwrap()
}

/// Lost replies on the kinds' own txns (adversarial review): a reader's and a permit's create txn
/// applied with its reply lost is adopted by the resend (one key, held, keeping a writer out, gone
/// after the release), and a writer's release whose reply is lost is not `NotHeld` and recorded its
/// token once (the reader after it carries it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_kinds_create_and_release_with_their_replies_lost() {
    let fx = common::Proxied::start(1);
    let (_b, locks) = fx.connect(false, "request_timeout=5s").await;
    let direct = common::locks(&fx.server.url()).await;
    let ends = fx.server.endpoints();
    let name = common::name("kinds-lost");
    let prefix = layout::prefix(&name);
    let rw = Arc::new(locks.read_write(&name).unwrap());
    // A session first (its lease grant is not the request under test).
    rw.read().await.unwrap().release().await.unwrap();

    // The reader's create, its reply lost: adopted.
    let reader = {
        let rw = rw.clone();
        with_its_reply_lost(
            &fx,
            &prefix,
            |k| k.len() == 1,
            async move { rw.read().await },
        )
        .await
    }
    .expect("the reader adopts its own key after the lost reply");
    let keys = common::keys(&ends, &prefix);
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(reader.state(), LockState::Held);
    let other = direct.read_write(&name).unwrap();
    assert!(
        other.writer().try_acquire().await.unwrap().is_none(),
        "a writer got in beside the adopted reader"
    );
    reader.release().await.unwrap();
    assert!(common::keys(&ends, &prefix).is_empty());

    // A writer's release, its reply lost: not NotHeld, and recorded once, with its token.
    let writer = rw.write().await.unwrap();
    let token = writer.token().unwrap().get();
    let outcome = with_its_reply_lost(&fx, &prefix, |k| k.is_empty(), writer.release()).await;
    if let Err(e) = &outcome {
        assert_ne!(e.kind(), ErrorKind::NotHeld, "{e}");
    }
    assert_eq!(
        value(&fx.server, &layout::write_record_key(&name)),
        Some(token.to_string())
    );
    let r = other.read().await.unwrap();
    assert_eq!(
        r.token().unwrap().get(),
        token,
        "the reader carries the last write's token"
    );
    r.release().await.unwrap();

    // A permit's create, its reply lost: adopted, one permit of 1 taken.
    let sem_name = common::name("kinds-lost-sem");
    let sem_prefix = layout::prefix(&sem_name);
    let sem = Arc::new(locks.semaphore(&sem_name, 1).unwrap());
    let permit = {
        let sem = sem.clone();
        with_its_reply_lost(&fx, &sem_prefix, |k| k.len() == 1, async move {
            sem.acquire().await
        })
        .await
    }
    .expect("the permit adopts its own key after the lost reply");
    assert_eq!(common::keys(&ends, &sem_prefix).len(), 1);
    let other_sem = direct.semaphore(&sem_name, 1).unwrap();
    assert!(
        other_sem.try_acquire().await.unwrap().is_none(),
        "a second permit of 1 beside the adopted one"
    );
    permit.release().await.unwrap();
    assert!(common::keys(&ends, &sem_prefix).is_empty());
    other_sem.acquire().await.unwrap().release().await.unwrap();
}

/// A queue of four kinds behind a reader whose session lease is revoked (adversarial review): the
/// permit behind it is woken by the delete and granted, and only the permit (limit 1): the writer and
/// the mutex behind it keep waiting, each in turn, and each write (mutex) token is above the write
/// (mutex) grant before it. The permit's token is minted at its grant (the revision of its grant's
/// write, after the revoke), so it is above every earlier grant and also above the writer's token, the
/// create_revision of a key that queued before that grant: the contract orders a write only after
/// earlier writes and mutex grants ("a permit minted since is no write", docs/DESIGN.md §9 "Tokens").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_reader_lets_the_queue_in_one_kind_at_a_time() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let ends = server.endpoints();
    let name = common::name("chain");
    let prefix = layout::prefix(&name);
    let (ba, bb, bc, bd) = (
        common::backend(&url).await,
        common::backend(&url).await,
        common::backend(&url).await,
        common::backend(&url).await,
    );
    let (la, lb, lc, ld) = (
        common::locks_on(&ba),
        common::locks_on(&bb),
        common::locks_on(&bc),
        common::locks_on(&bd),
    );
    let reader = la.read_write(&name).unwrap().read().await.unwrap();
    let permit = {
        let sem = lb.semaphore(&name, 1).unwrap();
        tokio::spawn(async move { sem.permit().options().wait(PROMPT * 3).acquire().await })
    };
    common::wait_keys(&ends, &prefix, PROMPT, "the permit's key", |k| k.len() == 2);
    let writer = {
        let rw = lc.read_write(&name).unwrap();
        tokio::spawn(async move { rw.writer().options().wait(PROMPT * 3).acquire().await })
    };
    common::wait_keys(&ends, &prefix, PROMPT, "the writer's key", |k| k.len() == 3);
    let mutex = {
        let lock = ld.lock(&name).unwrap();
        tokio::spawn(async move { lock.options().wait(PROMPT * 3).acquire().await })
    };
    common::wait_keys(&ends, &prefix, PROMPT, "the mutex's key", |k| k.len() == 4);

    let raw = distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([ends.clone()]))
        .await
        .unwrap();
    raw.lease_revoke(lease_of(&ba).await).await.unwrap();
    let permit = tokio::time::timeout(PROMPT, permit)
        .await
        .expect("the permit was not woken by the revoke")
        .unwrap()
        .expect("the permit after the revoke");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!writer.is_finished(), "the writer got in beside the permit");
    assert!(!mutex.is_finished(), "the mutex got in beside the permit");
    let started = Instant::now();
    while reader.state() != LockState::Lost && started.elapsed() < PROMPT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reader.state(), LockState::Lost);

    let p_token = permit.token().unwrap().get();
    permit.release().await.unwrap();
    let writer = tokio::time::timeout(PROMPT, writer)
        .await
        .expect("the writer was not woken by the permit's release")
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!mutex.is_finished(), "the mutex got in beside the writer");
    let w_token = writer.token().unwrap().get();
    let w_key = common::keys(&ends, &prefix);
    assert_eq!(w_token, w_key[0].create_revision, "the writer's token");
    assert!(
        p_token > w_token,
        "the permit's token {p_token}, minted at its grant, is above the writer's key {w_token}, which queued before it"
    );
    writer.release().await.unwrap();
    let mutex = tokio::time::timeout(PROMPT, mutex)
        .await
        .expect("the mutex was not woken by the writer's release")
        .unwrap()
        .unwrap();
    assert!(mutex.token().unwrap().get() > w_token);
    mutex.release().await.unwrap();
    assert!(common::keys(&ends, &prefix).is_empty());
    drop(reader);
}

/// Names that escape alike or nest (adversarial review): semaphores `N/a/b` and `N/a%2Fb` keep their
/// own limits and write records (`%` and `/` escaped apart), and a semaphore or read-write lock nested
/// under a semaphore's name (`N/permit.1a`, `N/permit.1a.0`) neither waits for it nor counts as its
/// permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escaped_and_nested_names_keep_their_own_limits_and_permits() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let (la, lb) = (common::locks(&url).await, common::locks(&url).await);
    let base = common::name("esc");
    let (slash, percent) = (format!("{base}/a/b"), format!("{base}/a%2Fb"));
    assert_ne!(layout::limit_key(&slash), layout::limit_key(&percent));
    assert_ne!(
        layout::write_record_key(&slash),
        layout::write_record_key(&percent)
    );
    let s1 = la.semaphore(&slash, 1).unwrap().acquire().await.unwrap();
    let s2 = la.semaphore(&percent, 2).unwrap().acquire().await.unwrap();
    let s3 = lb.semaphore(&percent, 2).unwrap().acquire().await.unwrap();
    assert!(
        lb.semaphore(&slash, 1)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a second permit of 1"
    );
    assert_eq!(
        value(&server, &layout::limit_key(&slash)).as_deref(),
        Some("1")
    );
    assert_eq!(
        value(&server, &layout::limit_key(&percent)).as_deref(),
        Some("2")
    );
    // A writer's record on one name is not the other's.
    for g in [s1, s2, s3] {
        g.release().await.unwrap();
    }
    let w = la.read_write(&slash).unwrap().write().await.unwrap();
    let token = w.token().unwrap().get();
    w.release().await.unwrap();
    assert_eq!(
        value(&server, &layout::write_record_key(&slash)),
        Some(token.to_string())
    );
    assert_eq!(value(&server, &layout::write_record_key(&percent)), None);

    // Nested under a semaphore's name, beside its one permit held.
    let sem = common::name("nest-sem");
    let held = la.semaphore(&sem, 1).unwrap().acquire().await.unwrap();
    let permit = held.permit().unwrap().to_string();
    for nested in [format!("{sem}/permit.1a"), format!("{sem}/{permit}")] {
        let g = lb
            .semaphore(&nested, 1)
            .unwrap()
            .permit()
            .options()
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("semaphore {nested} waited for {sem}: {e}"));
        let w = lb
            .read_write(&nested)
            .unwrap()
            .writer()
            .options()
            .wait(Duration::from_millis(500))
            .acquire()
            .await;
        assert!(w.is_err(), "a writer beside a permit of {nested}");
        g.release().await.unwrap();
        let w = lb
            .read_write(&nested)
            .unwrap()
            .writer()
            .options()
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("writer of {nested} waited for {sem}: {e}"));
        w.release().await.unwrap();
    }
    // The nested names' keys are no permits of `sem`: its one permit is still the only one.
    let info = lb.inspect(&sem).await.unwrap();
    assert_eq!(info.holders.len(), 1, "{info:?}");
    held.release().await.unwrap();
}

/// A permit queued behind a mutex (it watches the mutex's key, not the permits' range) whose own key
/// an operator deletes stops waiting at once, as a queued reader or writer does (adversarial review:
/// it waited until the mutex let go or its wait limit ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_queued_behind_a_mutex_whose_key_is_deleted_stops_at_once() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let ends = server.endpoints();
    let name = common::name("perm-del");
    let prefix = layout::prefix(&name);
    let (la, lb) = (common::locks(&url).await, common::locks(&url).await);
    let mutex = la.lock(&name).unwrap().acquire().await.unwrap();
    let doomed = {
        let sem = lb.semaphore(&name, 2).unwrap();
        tokio::spawn(async move { sem.permit().options().wait(PROMPT * 3).acquire().await })
    };
    let keys = common::wait_keys(&ends, &prefix, PROMPT, "the permit's key", |k| k.len() == 2);
    assert_eq!(
        layout::classify(&prefix, keys[1].key.as_bytes()),
        Some(NameKey::Permit)
    );
    // Its watch is open (it waits behind the mutex) before the delete.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deleted_at = Instant::now();
    server.etcdctl(&["del", &keys[1].key]).unwrap();
    let outcome = tokio::time::timeout(PROMPT, doomed)
        .await
        .expect("a permit whose key was deleted kept waiting behind the mutex")
        .unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    assert!(deleted_at.elapsed() < PROMPT);
    assert_eq!(mutex.state(), LockState::Held);
    mutex.release().await.unwrap();
    assert!(common::keys(&ends, &prefix).is_empty());
}

/// Tokens under a race of readers and writers on three clients (adversarial review): in the order the
/// grants complete, every writer's token is above every earlier grant's (writers' and readers'), and a
/// reader whose acquire began after a writer's release had completed carries at least that writer's
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reader_and_writer_tokens_in_a_race_never_go_back() {
    use std::sync::Mutex;
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("tok-race");
    let mut all = Vec::new();
    for _ in 0..3 {
        all.push(common::locks(&url).await);
    }
    // (completion seq, is writer, token, seq of the last writer release completed before the start)
    let events = Arc::new(Mutex::new(Vec::<(usize, bool, u64, Option<u64>)>::new()));
    let seq = Arc::new(AtomicUsize::new(0));
    let last_released = Arc::new(Mutex::new(None::<u64>));
    let stop = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for (i, locks) in all.iter().enumerate() {
        for role in 0..3 {
            let (locks, name) = (locks.clone(), name.clone());
            let (events, seq, last_released) = (events.clone(), seq.clone(), last_released.clone());
            tasks.push(tokio::spawn(async move {
                let rw = locks.read_write(&name).unwrap();
                let writer = (role + i) % 3 == 0;
                while Instant::now() < stop {
                    let before = *last_released.lock().unwrap();
                    let guard = if writer {
                        rw.writer().options().wait(PROMPT).acquire().await
                    } else {
                        rw.reader().options().wait(PROMPT).acquire().await
                    }
                    .expect("an acquire in the race");
                    let token = guard.token().unwrap().get();
                    let at = seq.fetch_add(1, Ordering::SeqCst);
                    events.lock().unwrap().push((at, writer, token, before));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    guard.release().await.expect("release");
                    if writer {
                        let mut last = last_released.lock().unwrap();
                        *last = Some(last.map_or(token, |t| t.max(token)));
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut events = events.lock().unwrap().clone();
    events.sort_by_key(|e| e.0);
    let writers = events.iter().filter(|e| e.1).count();
    assert!(
        writers > 3 && events.len() > writers + 3,
        "the race ran: {events:?}"
    );
    let mut highest = 0;
    for &(at, writer, token, before) in &events {
        if writer {
            assert!(
                token > highest,
                "grant {at}: write token {token} not above {highest}"
            );
        } else if let Some(released) = before {
            assert!(
                token >= released,
                "grant {at}: a reader started after the release of write {released} carries {token}"
            );
        }
        highest = highest.max(token);
    }
}

/// The four-kinds race while the store is compacted every few milliseconds (adversarial review): the
/// reads at a try's revision and the watches from it hit compacted revisions (the full read falls
/// back to the current revision, the watch is cancelled and the try made again); never two kinds at
/// once, never a third permit of two, and every acquire gets in within its wait limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_four_kinds_race_under_constant_compaction() {
    use distlock_etcd::rpc::pb::etcdserverpb::{CompactionRequest, PutRequest};
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let name = common::name("compact-race");
    let (la, lb, lc) = (
        common::locks(&url).await,
        common::locks(&url).await,
        common::locks(&url).await,
    );
    let raw =
        distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([server.endpoints()]))
            .await
            .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let compactor = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut compactions = 0;
            while !stop.load(Ordering::SeqCst) {
                let put = raw
                    .put(PutRequest {
                        key: b"etcd-test/compact-filler".to_vec(),
                        value: b"x".to_vec(),
                        ..PutRequest::default()
                    })
                    .await
                    .unwrap();
                let rev = put.header.unwrap().revision;
                if raw
                    .compact(CompactionRequest {
                        revision: rev,
                        physical: false,
                    })
                    .await
                    .is_ok()
                {
                    compactions += 1;
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            compactions
        })
    };
    mixed_kinds_race(&[la, lb, lc], &name).await;
    stop.store(true, Ordering::SeqCst);
    let compactions = compactor.await.unwrap();
    assert!(compactions > 50, "compacted {compactions} times");
}

/// The own key's mod_revision, read straight from the server (0 when absent).
async fn mod_revision(raw: &distlock_etcd::rpc::Client, key: &str) -> i64 {
    let read = raw
        .range(distlock_etcd::rpc::pb::etcdserverpb::RangeRequest {
            key: key.as_bytes().to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    read.kvs.first().map_or(0, |kv| kv.mod_revision)
}

/// A permit's grant txn with its reply lost (the waiter's traffic held 1 s, the connection reset once
/// the txn's put is on the server): the resend finds the key written since (its compare of the last
/// write fails) and tries again, so the granted permit's token is its key's last write, which
/// `status` shows and `fenced_put` takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_permits_grant_txn_with_its_reply_lost_keeps_token_and_key_in_step() {
    let fx = common::Proxied::start(1);
    let (_b, locks) = fx.connect(false, "request_timeout=5s").await;
    let direct = common::locks(&fx.server.url()).await;
    let ends = fx.server.endpoints();
    let raw = distlock_etcd::rpc::Client::connect(&distlock_etcd::EtcdConfig::new([ends.clone()]))
        .await
        .unwrap();
    let name = common::name("grant-lost");
    let prefix = layout::prefix(&name);
    let holder = direct.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let waiter = {
        let sem = locks.semaphore(&name, 1).unwrap();
        tokio::spawn(async move { sem.permit().options().wait(PROMPT * 4).acquire().await })
    };
    let keys = common::wait_keys(&ends, &prefix, PROMPT, "the waiter's key", |k| k.len() == 2);
    let key = keys[1].key.clone();
    // The waiter's first try wrote its key (a grant txn that found the holder); it now waits.
    let started = Instant::now();
    let mut first = mod_revision(&raw, &key).await;
    while first <= i64::try_from(keys[1].create_revision).unwrap() {
        assert!(
            started.elapsed() < PROMPT,
            "the waiter's grant txn never wrote its key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        first = mod_revision(&raw, &key).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        mod_revision(&raw, &key).await,
        first,
        "the waiter wrote while it waited"
    );

    fx.delay(Duration::from_secs(1));
    holder.release().await.unwrap();
    // The waiter hears of the delete 1 s late, and its grant txn reaches the server 1 s later.
    let started = Instant::now();
    while mod_revision(&raw, &key).await == first {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the grant txn never reached the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fx.pass();
    tokio::task::block_in_place(|| fx.proxy().reset().unwrap());
    let permit = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter finishes")
        .unwrap()
        .expect("the permit after the lost reply");
    let token = permit.token().unwrap().get();
    let last = mod_revision(&raw, &key).await;
    assert_eq!(
        i64::try_from(token).unwrap(),
        last,
        "the token is the key's last write"
    );
    let info = direct.inspect(&name).await.unwrap();
    assert_eq!(info.holders.len(), 1, "{info:?}");
    assert_eq!(info.holders[0].token.unwrap().get(), token, "{info:?}");
    let fenced = raw
        .txn(layout::fenced_put(
            &key,
            token,
            &format!("{name}-fenced"),
            "x",
        ))
        .await
        .unwrap();
    assert!(
        fenced.succeeded,
        "fenced_put with the permit's token {token}"
    );
    permit.release().await.unwrap();
    assert!(common::keys(&ends, &prefix).is_empty());
    fx.server
        .etcdctl(&["del", &format!("{name}-fenced")])
        .unwrap();
}
