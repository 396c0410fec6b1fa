//! The read-write lock's and the semaphore's ZooKeeper machinery beyond the shared conformance cases:
//! a name's kinds never hold together (mutex and read-write nodes share one queue; a semaphore and
//! the others refuse each other, also when they race), the mutex's guarantees on the new node names
//! (a lost release reply is `Released`, never `NotHeld`; a wait abandoned during a disconnect or a try
//! dropped half-way leaves no node; an operator's delete is `Lost`; `max_hold` deletes the node), and
//! the write token recorded exactly by the release that deleted the writer's node. Test names with
//! `fault` cut or delay the connection with the testkit's fault proxy.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{children, locks_at, name, raw_client, wait_children};
use distlock_core::{ErrorKind, LockState, Locks};
use distlock_testkit::proxy::Proxy;
use distlock_testkit::zookeeper::ZkServer;
use zookeeper_client as zk;

/// Runs a proxy control call off the async worker (it blocks until the proxy applied it).
async fn control(proxy: &Arc<Proxy>, call: impl FnOnce(&Proxy) + Send + 'static) {
    let proxy = proxy.clone();
    tokio::task::spawn_blocking(move || call(&proxy))
        .await
        .unwrap();
}

/// Waits (10 s at most) until `/path` has no child left; panics with what is there.
async fn wait_empty(raw: &zk::Client, path: &str, what: &str) {
    let started = Instant::now();
    loop {
        let left = children(raw, path).await;
        if left.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: /{path} still has {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A mutex and a read-write lock of one name are one queue, served in creation order; a semaphore of
/// the name is refused with `KindConflict` naming the kind in use while any of their nodes is there,
/// and while permits are held the mutex and both sides of the read-write lock are refused naming the
/// semaphore. Once the other kind is gone the name is usable as either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_names_mutex_and_read_write_lock_share_one_queue_and_a_semaphore_is_refused_beside_them()
{
    let server = ZkServer::start_or_panic();
    let locks = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("one_kind");

    let mutex = locks.lock(&name).unwrap().acquire().await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Each its own client: one `Locks` queues its own exclusive acquires of a name locally first.
    let spawn = |what: &'static str, n: usize, locks: Locks| {
        let (name, order) = (name.clone(), order.clone());
        let task = tokio::spawn(async move {
            let rw = locks.read_write(&name).unwrap();
            let guard = match what {
                "write" => {
                    rw.writer()
                        .options()
                        .wait(Duration::from_secs(20))
                        .acquire()
                        .await
                }
                _ => {
                    rw.reader()
                        .options()
                        .wait(Duration::from_secs(20))
                        .acquire()
                        .await
                }
            }
            .unwrap();
            order.lock().unwrap().push(what);
            tokio::time::sleep(Duration::from_millis(200)).await;
            guard.release().await.unwrap();
        });
        (task, n)
    };
    let (writer, n) = spawn("write", 2, locks_at(&server.url()).await);
    wait_children(&raw, &name, n).await;
    let (reader, n) = spawn("read", 3, locks_at(&server.url()).await);
    wait_children(&raw, &name, n).await;

    let refused = locks.semaphore(&name, 2).unwrap().try_acquire().await;
    let err = refused.expect_err("a permit beside a mutex");
    assert_eq!(err.kind(), ErrorKind::KindConflict, "{err}");
    assert!(err.to_string().contains("in use as a mutex"), "{err}");
    assert!(children(&raw, &format!("{name}/leases")).await.is_empty());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "a read-write guard beside the mutex"
    );
    mutex.release().await.unwrap();
    writer.await.unwrap();
    reader.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["write", "read"], "creation order");

    let permit = locks
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    for (what, outcome) in [
        ("mutex", locks.lock(&name).unwrap().try_acquire().await),
        (
            "read",
            locks
                .read_write(&name)
                .unwrap()
                .reader()
                .try_acquire()
                .await,
        ),
        (
            "write",
            locks
                .read_write(&name)
                .unwrap()
                .writer()
                .try_acquire()
                .await,
        ),
    ] {
        let err = outcome.expect_err(what);
        assert_eq!(err.kind(), ErrorKind::KindConflict, "{what}: {err}");
        assert!(
            err.to_string().contains("in use as a semaphore"),
            "{what}: {err}"
        );
    }
    assert!(
        children(&raw, &name)
            .await
            .iter()
            .all(|c| !c.starts_with("_c_")),
        "a refused acquire left its node"
    );
    permit.release().await.unwrap();
    let again = locks.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(again.is_some(), "the mutex once every permit is back");
}

/// Mutex holders and permit holders of one name racing (each side checks for the other after its own
/// create): never a mutex holder and a permit holder at once, whoever refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_mutex_and_permit_acquires_never_hold_together() {
    let server = ZkServer::start_or_panic();
    let name = name("kind_race");
    let mutexes = Arc::new(AtomicUsize::new(0));
    let permits = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let locks = locks_at(&server.url()).await;
        let (name, mutexes, permits, granted) = (
            name.clone(),
            mutexes.clone(),
            permits.clone(),
            granted.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(6);
            while Instant::now() < deadline {
                let (mine, theirs) = if i % 2 == 0 {
                    (&mutexes, &permits)
                } else {
                    (&permits, &mutexes)
                };
                let outcome = if i % 2 == 0 {
                    locks.lock(&name).unwrap().try_acquire().await
                } else {
                    locks.semaphore(&name, 2).unwrap().try_acquire().await
                };
                match outcome {
                    Ok(Some(guard)) => {
                        mine.fetch_add(1, Ordering::SeqCst);
                        granted.fetch_add(1, Ordering::SeqCst);
                        assert_eq!(
                            theirs.load(Ordering::SeqCst),
                            0,
                            "a mutex and a permit held at once"
                        );
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        assert_eq!(
                            theirs.load(Ordering::SeqCst),
                            0,
                            "a mutex and a permit held at once"
                        );
                        mine.fetch_sub(1, Ordering::SeqCst);
                        guard.release().await.unwrap();
                    }
                    Ok(None) => {}
                    Err(e) => assert_eq!(e.kind(), ErrorKind::KindConflict, "{e}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        granted.load(Ordering::SeqCst) > 10,
        "too few grants to mean anything"
    );
}

/// Lets `request` reach the server and loses its reply: the proxy holds every chunk 1 s, the test
/// waits until `node` is gone from `/parent`, then passes and resets the connection (the delayed reply
/// is dropped with it). As in `release_faults.rs`.
async fn lose_the_reply_of<T: Send + 'static>(
    proxy: &Arc<Proxy>,
    raw: &zk::Client,
    parent: &str,
    node: &str,
    request: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    control(proxy, |p| p.delay(Duration::from_secs(1)).unwrap()).await;
    let task = tokio::spawn(request);
    let started = Instant::now();
    while children(raw, parent).await.iter().any(|c| c == node) {
        assert!(started.elapsed() < Duration::from_secs(10), "{node} stays");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    control(proxy, |p| p.pass().unwrap()).await;
    control(proxy, |p| p.reset().unwrap()).await;
    task.await.unwrap()
}

/// A release whose delete is applied and its reply lost is a release (never `NotHeld`), for a write
/// (whose delete is the `multi` recording its token), a read and a permit; the write's token is
/// recorded once, by that landed `multi` (the resend finds no node and sets nothing), and the next
/// reader carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_lost_release_replies_of_a_write_a_read_and_a_permit_are_released_not_not_held() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let locks = locks_at(&format!("zk://{}", proxy.addr())).await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("lost_kind_replies");
    let leases = format!("{name}/leases");

    let write = locks.read_write(&name).unwrap().write().await.unwrap();
    let token = write.token().unwrap();
    let node = wait_children(&raw, &name, 1).await.remove(0);
    let outcome = lose_the_reply_of(
        &proxy,
        &raw,
        &name,
        &node,
        async move { write.release().await },
    )
    .await;
    if let Err(e) = outcome {
        assert_eq!(
            e.kind(),
            ErrorKind::Unavailable,
            "a write release that landed: {e}"
        );
    }
    let reader = other.read_write(&name).unwrap().read().await.unwrap();
    assert_eq!(
        reader.token(),
        Some(token),
        "the landed release recorded the write's token"
    );
    reader.release().await.unwrap();

    let read = locks.read_write(&name).unwrap().read().await.unwrap();
    let node = wait_children(&raw, &name, 1).await.remove(0);
    let outcome = lose_the_reply_of(
        &proxy,
        &raw,
        &name,
        &node,
        async move { read.release().await },
    )
    .await;
    if let Err(e) = outcome {
        assert_eq!(
            e.kind(),
            ErrorKind::Unavailable,
            "a read release that landed: {e}"
        );
    }

    let permit = locks.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let node = wait_children(&raw, &leases, 1).await.remove(0);
    let outcome = lose_the_reply_of(&proxy, &raw, &leases, &node, async move {
        permit.release().await
    })
    .await;
    if let Err(e) = outcome {
        assert_eq!(
            e.kind(),
            ErrorKind::Unavailable,
            "a permit release that landed: {e}"
        );
    }
    let back = other
        .semaphore(&name, 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(back.is_some(), "the permit is back");
}

/// The session timeout of the cut-off client: far longer than the cut, so the session survives it.
const SESSION: Duration = Duration::from_secs(20);

/// A reader waiting behind a writer and a permit waiting with the inner mutex and its lease node give
/// up while the connection is silent: their deletes get no answer then, and are finished once the
/// client reconnects within its session, so neither node holds the name for nobody (the reader's would
/// keep a later writer out, the lease node a permit, the inner mutex node every later acquire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_waits_abandoned_during_a_disconnect_leave_no_node_once_reconnected() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let cut = locks_at(&format!(
        "zk://{}?session_timeout={}s&request_timeout=300ms",
        proxy.addr(),
        SESSION.as_secs()
    ))
    .await;
    let other = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let rw_name = name("abandon_cut_rw");
    let sem_name = name("abandon_cut_sem");

    let writer = other.read_write(&rw_name).unwrap().write().await.unwrap();
    let permit = other
        .semaphore(&sem_name, 1)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let (rw, semaphore) = (
        cut.read_write(&rw_name).unwrap(),
        cut.semaphore(&sem_name, 1).unwrap(),
    );
    let waiters = tokio::spawn(async move {
        let read = rw.reader().options().wait(Duration::from_secs(2)).acquire();
        let permit_lock = semaphore.permit();
        let permit = permit_lock.options().wait(Duration::from_secs(2)).acquire();
        let (read, permit) = tokio::join!(read, permit);
        (read.map(drop), permit.map(drop))
    });
    wait_children(&raw, &rw_name, 2).await;
    wait_children(&raw, &format!("{sem_name}/leases"), 2).await;
    control(&proxy, |p| p.blackhole().unwrap()).await;
    let (read, permit_wait) = waiters.await.unwrap();
    assert!(read.is_err() && permit_wait.is_err(), "both waits time out");
    control(&proxy, |p| p.pass().unwrap()).await;
    let restored = Instant::now();
    writer.release().await.unwrap();
    permit.release().await.unwrap();
    let within = SESSION / 2;
    let w = other
        .read_write(&rw_name)
        .unwrap()
        .writer()
        .options()
        .wait(within)
        .acquire()
        .await;
    let w = w.unwrap_or_else(|e| panic!("the abandoned reader's node stayed: {e}"));
    let p = other
        .semaphore(&sem_name, 1)
        .unwrap()
        .permit()
        .options()
        .wait(within)
        .acquire()
        .await;
    let p = p.unwrap_or_else(|e| panic!("the abandoned permit's nodes stayed: {e}"));
    assert!(restored.elapsed() < SESSION, "freed only by session expiry");
    w.release().await.unwrap();
    p.release().await.unwrap();
    wait_empty(&raw, &format!("{sem_name}/locks"), "the inner mutex").await;
    wait_empty(&raw, &format!("{sem_name}/leases"), "the leases").await;
}

/// A permit's acquire dropped in the middle of a try (the try future itself, not a wait: a `timeout`
/// around `acquire` on a slow connection) leaves neither its lease node nor its inner mutex node: the
/// acquisition keeps both phases for `abandon` through the whole try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_permit_acquire_dropped_mid_try_leaves_no_node() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let locks = locks_at(&format!("zk://{}", proxy.addr())).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("permit_dropped_mid_try");
    // The limit stored, the session warm.
    locks
        .semaphore(&name, 1)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    control(&proxy, |p| p.delay(Duration::from_millis(300)).unwrap()).await;
    let semaphore = locks.semaphore(&name, 1).unwrap();
    // Each phase takes a delayed round trip (≥ 600 ms): cut in the lease node's create.
    for cut_after in [900, 1500] {
        let dropped =
            tokio::time::timeout(Duration::from_millis(cut_after), semaphore.acquire()).await;
        assert!(
            dropped.is_err(),
            "the acquire ended before the cut at {cut_after} ms"
        );
    }
    control(&proxy, |p| p.pass().unwrap()).await;
    wait_empty(
        &raw,
        &format!("{name}/leases"),
        "a lease node of a dropped acquire",
    )
    .await;
    wait_empty(
        &raw,
        &format!("{name}/locks"),
        "an inner mutex node of a dropped acquire",
    )
    .await;
}

/// An operator's delete of a reader's node or of a permit's lease node reaches the holder (`Lost`,
/// from the session's one watch task, as the mutex's), and `max_hold` ends a reader's and a permit's
/// hold by deleting its node while the session lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_deletes_and_max_hold_end_readers_and_permits() {
    let server = ZkServer::start_or_panic();
    let locks = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("kind_losses");
    let capped_sem = format!("{name}-capped");

    let reader = locks.read_write(&name).unwrap().read().await.unwrap();
    let permit = locks
        .semaphore(&format!("{name}-sem"), 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let read_node = wait_children(&raw, &name, 1).await.remove(0);
    let sem_leases = format!("{name}-sem/leases");
    let lease_node = wait_children(&raw, &sem_leases, 1).await.remove(0);
    raw.delete(&format!("/{name}/{read_node}"), None)
        .await
        .unwrap();
    raw.delete(&format!("/{sem_leases}/{lease_node}"), None)
        .await
        .unwrap();
    for (what, guard) in [("reader", &reader), ("permit", &permit)] {
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .unwrap_or_else(|_| panic!("the {what} was not told its node was deleted"));
        assert_eq!(guard.state(), LockState::Lost, "{what}");
    }
    let _ = (reader.release().await, permit.release().await);

    // A writer whose node an operator deleted cannot downgrade (whether the watch told the guard
    // first, LockLost, or the server refused the multi, NotHeld), and no read node is left.
    let mut writer = locks.read_write(&name).unwrap().write().await.unwrap();
    let write_node = wait_children(&raw, &name, 1).await.remove(0);
    raw.delete(&format!("/{name}/{write_node}"), None)
        .await
        .unwrap();
    let refused = writer
        .downgrade()
        .await
        .expect_err("a downgrade of a deleted write node");
    assert!(
        matches!(refused.kind(), ErrorKind::NotHeld | ErrorKind::LockLost),
        "{refused}"
    );
    assert!(
        children(&raw, &name).await.is_empty(),
        "a read node was left"
    );
    let _ = writer.release().await;

    let reader = locks
        .read_write(&name)
        .unwrap()
        .reader()
        .options()
        .lease(Duration::from_secs(1))
        .max_hold(Duration::from_millis(1500))
        .acquire()
        .await
        .unwrap();
    let permit = locks
        .semaphore(&capped_sem, 1)
        .unwrap()
        .permit()
        .options()
        .lease(Duration::from_secs(1))
        .max_hold(Duration::from_millis(1500))
        .acquire()
        .await
        .unwrap();
    assert_eq!(reader.state(), LockState::Held);
    wait_empty(&raw, &name, "a reader past max_hold").await;
    wait_empty(
        &raw,
        &format!("{capped_sem}/leases"),
        "a permit past max_hold",
    )
    .await;
    assert_eq!(reader.state(), LockState::Lost);
    assert_eq!(permit.state(), LockState::Lost);
}

/// The write token is recorded only by the release (or downgrade) that deletes the writer's node: a
/// reader after a writer that was abandoned in the queue (never granted) and after a downgrade carries
/// the last *granted* write's token, and `status` shows it as `last_token`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_carry_the_last_granted_writes_token() {
    let server = ZkServer::start_or_panic();
    let locks: Locks = locks_at(&server.url()).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("reader_tokens");
    let (a, b) = (
        locks.read_write(&name).unwrap(),
        locks.read_write(&name).unwrap(),
    );

    let first = a.read().await.unwrap();
    let name_czxid = {
        let (_, stat) = raw.get_data(&format!("/{name}")).await.unwrap();
        u64::try_from(stat.czxid).unwrap()
    };
    assert_eq!(
        first.token().unwrap().get(),
        name_czxid,
        "no write yet: the name node's czxid"
    );
    let mut write = {
        let w = b
            .writer()
            .options()
            .wait(Duration::from_millis(300))
            .acquire()
            .await;
        assert_eq!(
            w.as_ref().err().map(|e| e.kind()),
            Some(ErrorKind::Timeout),
            "{w:?}"
        );
        first.release().await.unwrap();
        b.write().await.unwrap()
    };
    let token = write.token().unwrap();
    write.downgrade().await.unwrap();
    let shared = a.read().await.unwrap();
    assert_eq!(
        shared.token(),
        Some(token),
        "a reader beside the downgraded writer"
    );
    // A writer queued behind the readers gives up: it never held, and records nothing.
    let gave_up = locks
        .read_write(&name)
        .unwrap()
        .writer()
        .options()
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(gave_up.is_err());
    write.release().await.unwrap();
    shared.release().await.unwrap();
    let after = a.read().await.unwrap();
    assert_eq!(after.token(), Some(token), "the last granted write's token");
    let info = locks.inspect(&name).await.unwrap();
    assert_eq!(info.last_token, Some(token));
    after.release().await.unwrap();
}
