//! Faults around the Redis one-request handoff (from its review): lost replies, paused servers, aborted
//! waiters, runtime shutdown mid-handoff (the undo runs on the background runtime), remote waiters
//! after a handoff chain, the same owner twice, renewals of a handed hold.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{LockState, Locks};
use distlock_redis::RedisBackend;
use distlock_testkit::redis::RedisServer;

fn unique(case: &str) -> String {
    format!("handoff/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn locks(url: &str) -> Locks {
    let backend = RedisBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect");
    Locks::new(backend)
}

fn exists(server: &RedisServer, name: &str) -> bool {
    server.command(&["EXISTS", name]).unwrap().as_int() == Some(1)
}

fn fields(server: &RedisServer, name: &str) -> String {
    format!("{}", server.command(&["HGETALL", name]).unwrap())
}

/// A remote waiter (another `Locks`) queued while A held a long lease: the local chain A -> B is a
/// handoff (no PUBLISH), then B releases plainly: the remote acquires promptly, not at A's lease end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_remote_waiter_acquires_promptly_after_a_handoff_chain() {
    let server = RedisServer::start_or_panic();
    let name = unique("remote");
    let local = locks(&server.url()).await;
    let remote = locks(&server.url()).await;
    let (a, b) = (local.lock(&name).unwrap(), local.lock(&name).unwrap());
    let lease = Duration::from_secs(30);
    let held = a.options().lease(lease).acquire().await.unwrap();
    let r = remote.lock(&name).unwrap();
    let remote_wait = tokio::spawn(async move {
        let g = r.options().wait(Duration::from_secs(25)).acquire().await;
        (Instant::now(), g.map(|g| g.token()))
    });
    let waiter = tokio::spawn(async move { b.options().lease(lease).acquire().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("b handed")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released_at = Instant::now();
    guard.release().await.unwrap();
    let (at, got) = tokio::time::timeout(Duration::from_secs(28), remote_wait)
        .await
        .expect("remote done")
        .unwrap();
    got.expect("remote never acquired");
    assert!(
        at.duration_since(released_at) < Duration::from_secs(3),
        "remote woke {:?} after the plain release",
        at.duration_since(released_at)
    );
}

/// A handed hold with a short lease is kept by the watchdog well past its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_handed_hold_is_renewed() {
    let server = RedisServer::start_or_panic();
    let name = unique("renew");
    let local = locks(&server.url()).await;
    let (a, b) = (local.lock(&name).unwrap(), local.lock(&name).unwrap());
    let lease = Duration::from_millis(1500);
    let held = a.options().lease(lease).acquire().await.unwrap();
    let waiter = tokio::spawn(async move { b.options().lease(lease).acquire().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t1 = held.token().unwrap();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(guard.token().unwrap() > t1);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(guard.state(), LockState::Held);
    assert!(exists(&server, &name), "handed hold expired: not renewed");
    let pttl = server.command(&["PTTL", &name]).unwrap().as_int().unwrap();
    assert!(pttl > 0, "{pttl}");
    guard.release().await.unwrap();
    assert!(!exists(&server, &name));
}

/// The handoff script gets no reply within the request timeout (server paused for writes): the old
/// hold's release fails; the next owner's possible grant is undone. Afterwards: never two holders,
/// and the name is not left blocked until the 30 s lease ends (B acquires, or the name is free).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_timed_out_handoff_leaves_one_holder_and_no_blocked_name() {
    let server = RedisServer::start_or_panic();
    let name = unique("timeout");
    let url = format!("{}?request_timeout=1s", server.url());
    let local = locks(&url).await;
    let remote = locks(&server.url()).await;
    let (a, b) = (local.lock(&name).unwrap(), local.lock(&name).unwrap());
    let lease = Duration::from_secs(30);
    a.acquire().await.unwrap().release().await.unwrap();
    // Loads the handoff script.
    {
        let (x, y) = (
            local.lock("handoff/load").unwrap(),
            local.lock("handoff/load").unwrap(),
        );
        let g = x.acquire().await.unwrap();
        let w = tokio::spawn(async move { y.acquire().await.unwrap().release().await.unwrap() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        w.await.unwrap();
    }
    let held = a.options().lease(lease).acquire().await.unwrap();
    let waiter = tokio::spawn(async move {
        let r = b
            .options()
            .lease(lease)
            .wait(Duration::from_secs(20))
            .acquire()
            .await;
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pause = server
        .command(&["CLIENT", "PAUSE", "2500", "WRITE"])
        .unwrap();
    assert!(!pause.is_error(), "{pause}");
    let released = held.release().await;
    eprintln!("release: {released:?}");
    let got = tokio::time::timeout(Duration::from_secs(25), waiter)
        .await
        .expect("waiter ended")
        .unwrap();
    eprintln!("waiter: {:?}", got.as_ref().map(|g| g.token()));
    match got {
        Ok(guard) => {
            assert_eq!(guard.state(), LockState::Held);
            let other = remote.lock(&name).unwrap().try_acquire().await.unwrap();
            assert!(other.is_none(), "two holders");
            guard.release().await.unwrap();
        }
        other => {
            eprintln!("b did not hold: {other:?}; hash {}", fields(&server, &name));
            let bound = Instant::now() + Duration::from_secs(8);
            while exists(&server, &name) {
                assert!(
                    Instant::now() < bound,
                    "name blocked: {}",
                    fields(&server, &name)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The handoff script runs (A's hold handed to B) but its reply is lost and the connection reset:
/// redis-rs's link resends it on a fresh connection, where it finds nothing of A's. The handed grant is
/// undone, B's waiter acquires as usual: one holder (B) with a greater token, and nothing left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_handoff_with_lost_reply() {
    use distlock_testkit::proxy::Proxy;
    let server = RedisServer::start_or_panic();
    let proxy = Proxy::start_or_panic(server.addr());
    let url = format!("redis://{}", proxy.addr());
    let local = locks(&url).await;
    let name = unique("lost-reply");
    let (a, b) = (local.lock(&name).unwrap(), local.lock(&name).unwrap());
    // Loads the scripts, the handoff's included.
    {
        let (x, y) = (
            local.lock("handoff/load2").unwrap(),
            local.lock("handoff/load2").unwrap(),
        );
        let g = x.acquire().await.unwrap();
        let w = tokio::spawn(async move { y.acquire().await.unwrap().release().await.unwrap() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        w.await.unwrap();
    }
    let lease = Duration::from_secs(30);
    let held = a.options().lease(lease).acquire().await.unwrap();
    let (a_owner, t1) = (held.owner().to_string(), held.token().unwrap());
    let waiter = tokio::spawn(async move {
        b.options()
            .lease(lease)
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.delay(Duration::from_secs(1)).unwrap();
    let release = tokio::spawn(held.release());
    let started = Instant::now();
    while server
        .command(&["HEXISTS", &name, &a_owner])
        .unwrap()
        .as_int()
        == Some(1)
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "handoff never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("after the first copy: {}", fields(&server, &name));
    proxy.pass().unwrap();
    proxy.reset().unwrap();
    let released = release.await.unwrap();
    eprintln!("release: {released:?}");
    let got = tokio::time::timeout(Duration::from_secs(25), waiter)
        .await
        .expect("waiter ended")
        .unwrap();
    eprintln!(
        "waiter: {:?}; hash {}",
        got.as_ref().map(|g| g.token()),
        fields(&server, &name)
    );
    let guard = got.expect("b acquires once the handed grant is undone");
    assert!(guard.token().unwrap() > t1);
    let remote = locks(&server.url()).await;
    assert!(
        remote
            .lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "two holders"
    );
    guard.release().await.unwrap();
    assert!(
        !exists(&server, &name),
        "left behind: {}",
        fields(&server, &name)
    );
}

fn script_paused(server: &RedisServer) -> bool {
    let list = server.command(&["CLIENT", "LIST"]).unwrap();
    let list = list.as_str().unwrap_or_default().to_string();
    list.lines()
        .any(|client| client.contains(" cmd=evalsha ") && client.contains(" flags=b "))
}

/// B's acquiring task is aborted while the handoff to it is blocked on the server; C (local) queues
/// behind B and R (another process) waits. Once the server runs the handoff, B's grant is released, C
/// gets the lock promptly, and R gets it promptly after C's plain release. Never two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_aborted_waiter_during_handoff() {
    let server = RedisServer::start_or_panic();
    let name = unique("aborted");
    let local = locks(&server.url()).await;
    let remote = locks(&server.url()).await;
    let (a, b, c) = (
        local.lock(&name).unwrap(),
        local.lock(&name).unwrap(),
        local.lock(&name).unwrap(),
    );
    {
        let (x, y) = (
            local.lock("handoff/load3").unwrap(),
            local.lock("handoff/load3").unwrap(),
        );
        let g = x.acquire().await.unwrap();
        let w = tokio::spawn(async move { y.acquire().await.unwrap().release().await.unwrap() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        w.await.unwrap();
    }
    let lease = Duration::from_secs(30);
    let held = a.options().lease(lease).acquire().await.unwrap();
    let b_task = tokio::spawn(async move {
        b.options().lease(lease).acquire().await.map(|g| {
            std::mem::forget(g);
        })
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let c_task = tokio::spawn(async move { c.options().lease(lease).acquire().await.unwrap() });
    let r = remote.lock(&name).unwrap();
    let r_task = tokio::spawn(async move {
        let g = r.options().wait(Duration::from_secs(28)).acquire().await;
        (Instant::now(), g)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pause = server
        .command(&["CLIENT", "PAUSE", "1500", "WRITE"])
        .unwrap();
    assert!(!pause.is_error(), "{pause}");
    let release = tokio::spawn(held.release());
    let bound = Instant::now() + Duration::from_secs(5);
    while !script_paused(&server) && Instant::now() < bound {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(script_paused(&server), "handoff not blocked");
    b_task.abort();
    let _ = b_task.await;
    let released = release.await.unwrap();
    eprintln!("release: {released:?}");
    // R was woken by the release of B's grant (published) and races C: one of them holds promptly.
    let bound = Instant::now() + Duration::from_secs(5);
    while !c_task.is_finished() && !r_task.is_finished() {
        assert!(
            Instant::now() < bound,
            "nobody got the lock: {}",
            fields(&server, &name)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !(c_task.is_finished() && r_task.is_finished()),
        "two holders"
    );
    if c_task.is_finished() {
        let guard = c_task.await.unwrap();
        let at = Instant::now();
        guard.release().await.unwrap();
        let (got_at, got) = tokio::time::timeout(Duration::from_secs(28), r_task)
            .await
            .unwrap()
            .unwrap();
        let _r = got.expect("R acquired");
        assert!(
            got_at.duration_since(at) < Duration::from_secs(3),
            "R woke late: {:?}",
            got_at.duration_since(at)
        );
    } else {
        let (_, got) = r_task.await.unwrap();
        let at = Instant::now();
        got.expect("R acquired").release().await.unwrap();
        let guard = tokio::time::timeout(Duration::from_secs(5), c_task)
            .await
            .expect("C woke late")
            .unwrap();
        eprintln!("C after R: {:?}", at.elapsed());
        guard.release().await.unwrap();
    }
}

/// `lock_as` the same owner twice plus another owner, with a reentrant hold: X(L1) holds twice,
/// L2 (X) then B queue. L1's end is not a handoff (same owner next); L2 then hands to B. Tokens grow,
/// one holder at each step, nothing left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_same_owner_twice_then_handoff() {
    let server = RedisServer::start_or_panic();
    let name = unique("same-owner");
    let local = locks(&server.url()).await;
    let remote = locks(&server.url()).await;
    let l1 = local.lock_as(&name, "owner-x").unwrap();
    let l2 = local.lock_as(&name, "owner-x").unwrap();
    let b = local.lock(&name).unwrap();
    let g1 = l1.acquire().await.unwrap();
    let g1b = l1.acquire().await.unwrap();
    let t1 = g1.token().unwrap();
    let (tx2, rx2) = tokio::sync::oneshot::channel::<()>();
    let l2_task = tokio::spawn(async move {
        let g = l2.acquire().await.unwrap();
        let t = g.token().unwrap();
        rx2.await.unwrap();
        g.release().await.unwrap();
        t
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let b_task = tokio::spawn(async move { b.acquire().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(g1b);
    g1.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!b_task.is_finished(), "B holds while L2 should");
    assert!(remote
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    tx2.send(()).unwrap();
    let t2 = l2_task.await.unwrap();
    let gb = tokio::time::timeout(Duration::from_secs(5), b_task)
        .await
        .unwrap()
        .unwrap();
    let t3 = gb.token().unwrap();
    assert!(t1 < t2 && t2 < t3, "{t1:?} {t2:?} {t3:?}");
    assert!(remote
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    gb.release().await.unwrap();
    assert!(!exists(&server, &name));
}

/// How the handoff script is held up while its runtime shuts down.
enum HeldUp<'a> {
    /// The server is paused for writes: the connection dropped with the runtime frees the blocked
    /// script unrun.
    ServerPaused(&'a RedisServer),
    /// The script sits in a proxy for a second and reaches the server after the runtime is gone: it
    /// runs, and grants the waiter that went with the runtime (the review's finding: the undo was
    /// spawned on the dying runtime and never ran, so the name was blocked for the 30 s lease).
    Delayed(&'a distlock_testkit::proxy::Proxy),
}

/// A runtime shuts down (an app's, or a `#[tokio::test]`'s end) while a hold of it is being handed to
/// a waiter of the same runtime, the handoff script held up as `held_up` says; the waiter's task goes
/// with the runtime. The handed grant must be undone (on distlock's background runtime), not left to
/// block every other process for the lease: `remote` takes the name well before the lease ends.
async fn runtime_shutdown_during_handoff(
    server: &RedisServer,
    local: Locks,
    remote: Locks,
    name: &str,
    held_up: HeldUp<'_>,
) {
    // Loads the scripts and opens the connection on this runtime.
    {
        let (x, y) = (
            local.lock("handoff/load4").unwrap(),
            local.lock("handoff/load4").unwrap(),
        );
        let g = x.acquire().await.unwrap();
        let w = tokio::spawn(async move { y.acquire().await.unwrap().release().await.unwrap() });
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.unwrap();
        w.await.unwrap();
    }
    let (a, b) = (local.lock(name).unwrap(), local.lock(name).unwrap());
    let (to_main, from_thread) = std::sync::mpsc::channel::<()>();
    let (to_thread, from_main) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let held = a
                .options()
                .lease(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            let _waiter = tokio::spawn(async move {
                let g = b.options().lease(Duration::from_secs(30)).acquire().await;
                std::future::pending::<()>().await;
                drop(g);
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            to_main.send(()).unwrap();
            // Main holds the script up now.
            let _ = tokio::task::spawn_blocking(move || from_main.recv()).await;
            drop(held);
            tokio::time::sleep(Duration::from_millis(300)).await;
        });
        drop(rt);
    });
    from_thread.recv().unwrap();
    match &held_up {
        HeldUp::ServerPaused(server) => {
            let pause = server
                .command(&["CLIENT", "PAUSE", "2000", "WRITE"])
                .unwrap();
            assert!(!pause.is_error(), "{pause}");
        }
        HeldUp::Delayed(proxy) => proxy.delay(Duration::from_millis(1000)).unwrap(),
    }
    to_thread.send(()).unwrap();
    thread.join().unwrap();
    match &held_up {
        HeldUp::ServerPaused(server) => {
            eprintln!("runtime gone; handoff blocked: {}", script_paused(server));
            server.command(&["CLIENT", "UNPAUSE"]).unwrap();
        }
        HeldUp::Delayed(proxy) => {
            eprintln!("runtime gone: {}", fields(server, name));
            tokio::time::sleep(Duration::from_millis(1500)).await;
            proxy.pass().unwrap();
        }
    }
    let bound = Instant::now() + Duration::from_secs(8);
    loop {
        let got = remote.lock(name).unwrap().try_acquire().await.unwrap();
        if let Some(g) = got {
            g.release().await.unwrap();
            break;
        }
        assert!(
            Instant::now() < bound,
            "the name stays blocked for the 30 s lease: {} pttl {:?}",
            fields(server, name),
            server.command(&["PTTL", name]).unwrap().as_int()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_runtime_shutdown_during_handoff_leaves_no_grant() {
    let server = RedisServer::start_or_panic();
    let local = locks(&server.url()).await;
    let remote = locks(&server.url()).await;
    let name = unique("shutdown");
    runtime_shutdown_during_handoff(&server, local, remote, &name, HeldUp::ServerPaused(&server))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_runtime_shutdown_during_delayed_handoff_leaves_no_grant() {
    let server = RedisServer::start_or_panic();
    let proxy = distlock_testkit::proxy::Proxy::start_or_panic(server.addr());
    let local = locks(&format!("redis://{}", proxy.addr())).await;
    let remote = locks(&server.url()).await;
    let name = unique("shutdown-delayed");
    runtime_shutdown_during_handoff(&server, local, remote, &name, HeldUp::Delayed(&proxy)).await;
}
