//! Releases under one connection fault (issue 24), through the testkit's fault proxy between the
//! holder and a real ZooKeeper, the session surviving: the connection reset while the delete is on its
//! way, the server silent past the request timeout at the defaults users run, and the delete applied
//! with its reply lost. Each must end with the own node deleted by the same session once it is
//! connected again, a waiter granted right after that delete lands, and never a `NotHeld` for a hold
//! that was ours. Every test name contains `fault` (nextest's serial group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{children, locks_at, name, raw_client, wait_children};
use distlock_core::raw::{AcquireRequest, Attempt, Backend, Released};
use distlock_core::ErrorKind;
use distlock_testkit::proxy::Proxy;
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::ZkBackend;
use zookeeper_client as zk;

/// Runs a proxy control call off the async worker (it blocks until the proxy applied it).
async fn control(proxy: &Arc<Proxy>, call: fn(&Proxy) -> distlock_testkit::Result<()>) {
    let proxy = proxy.clone();
    tokio::task::spawn_blocking(move || call(&proxy).unwrap())
        .await
        .unwrap();
}

/// Waits (up to `within`) until `/name` no longer has the child `node`; returns how long it took.
async fn wait_gone(raw: &zk::Client, name: &str, node: &str, within: Duration) -> Duration {
    let started = Instant::now();
    while children(raw, name).await.iter().any(|c| c == node) {
        assert!(
            started.elapsed() < within,
            "the holder's node {node} is still there {within:?} later: {:?}",
            children(raw, name).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// A waiter on the server directly, queued behind the holder's node; returns its task (granted or
/// not within `wait`) once its node is on the server.
async fn queued_waiter(
    server: &ZkServer,
    raw: &zk::Client,
    name: &str,
    wait: Duration,
) -> tokio::task::JoinHandle<distlock_core::Result<distlock_core::LockGuard>> {
    let locks = locks_at(&server.url()).await;
    let n = name.to_string();
    let task =
        tokio::spawn(async move { locks.lock(&n).unwrap().options().wait(wait).acquire().await });
    wait_children(raw, name, 2).await;
    task
}

/// The holder's connection is reset while its release's delete is on the way (dropped by a silent
/// proxy, so it never reached the server); the session survives and the client reconnects at once.
/// Before issue 24 the request failed with the connection's I/O error, which was not taken for "no
/// answer": release returned a protocol error, no deferred delete was scheduled, and the node stayed
/// for as long as the session lived (the waiter timed out). Now the delete is sent again on the same
/// session once it reconnected: the node goes, the release reports success (or, if still unknown when
/// it returned, `Unavailable`), and the waiter is granted long before the 60 s session would free it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_release_during_a_connection_reset_deletes_the_node_after_reconnect() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let holder = locks_at(&format!("zk://{}", proxy.addr())).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("release_reset");
    let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
    let own = wait_children(&raw, &name, 1).await.remove(0);
    let waiter = queued_waiter(&server, &raw, &name, Duration::from_secs(20)).await;

    control(&proxy, Proxy::blackhole).await;
    let release = tokio::spawn(async move { guard.release().await });
    // The delete is written to the (silent) proxy and dropped there.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        children(&raw, &name).await.contains(&own),
        "the delete passed the silent proxy"
    );
    control(&proxy, Proxy::pass).await;
    control(&proxy, Proxy::reset).await;
    let reset_at = Instant::now();

    match release.await.unwrap() {
        Ok(()) => {}
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
            assert!(e.to_string().contains("unknown"), "{e}");
        }
    }
    wait_gone(&raw, &name, &own, Duration::from_secs(15)).await;
    let granted = waiter
        .await
        .unwrap()
        .expect("the waiter is granted once the holder's delete lands after the reconnect");
    assert!(
        reset_at.elapsed() < Duration::from_secs(20),
        "granted {:?} after the reset",
        reset_at.elapsed()
    );
    granted.release().await.unwrap();
    // The holder's session lived on: its backend still takes a lock on it.
    let again = holder.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(again.is_some());
}

/// At the defaults users run (60 s session, 5 s connect and request timeouts): the server goes silent
/// for longer than the client's connection timeout ("no response from connection in 5000ms") and the
/// request timeout while the release's delete waits for its answer, but well within the session. Before
/// issue 24 the client's own error for the silent connection (not a `ConnectionLoss`) usually came
/// first: a protocol error, no deferred delete, the node stayed for the session's life. Now the release
/// reports `Unavailable` (the outcome is unknown when it returns), the delete is finished on the same
/// session once the connection is back, and the waiter gets the lock right after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_release_on_a_silent_connection_at_default_timeouts_deletes_the_node_after_reconnect()
{
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let holder = locks_at(&format!("zk://{}", proxy.addr())).await;
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("release_silent");
    let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
    let own = wait_children(&raw, &name, 1).await.remove(0);
    let waiter = queued_waiter(&server, &raw, &name, Duration::from_secs(40)).await;

    control(&proxy, Proxy::blackhole).await;
    let silent_from = Instant::now();
    // The server has been silent a while when the release starts, so the client's own "no response
    // from connection in 5000ms" comes before the release's 5 s request bound.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outcome = guard.release().await;
    let e = outcome.expect_err("the delete cannot be answered through a silent proxy");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("unknown"), "{e}");
    assert!(children(&raw, &name).await.contains(&own));
    // Silent past the client's connection timeout and the request timeout, then back.
    let silent = Duration::from_secs(9);
    tokio::time::sleep(silent.saturating_sub(silent_from.elapsed())).await;
    control(&proxy, Proxy::pass).await;
    let back_at = Instant::now();

    wait_gone(&raw, &name, &own, Duration::from_secs(20)).await;
    let granted = waiter
        .await
        .unwrap()
        .expect("the waiter is granted once the holder's delete lands after the reconnect");
    assert!(
        back_at.elapsed() < Duration::from_secs(25),
        "granted {:?} after the connection came back (the session lasts 60 s)",
        back_at.elapsed()
    );
    granted.release().await.unwrap();
}

/// Lets `request` reach the server and loses its reply: the proxy holds every chunk 1 s, the test waits
/// until the node is gone on the server, then passes and resets the connection (the delayed reply is
/// dropped with it). As `lose_the_reply_of` in the Redis tests.
async fn lose_the_reply_of<T: Send + 'static>(
    proxy: &Arc<Proxy>,
    raw: &zk::Client,
    name: &str,
    node: &str,
    request: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    control(proxy, |p| p.delay(Duration::from_secs(1))).await;
    let task = tokio::spawn(request);
    wait_gone(raw, name, node, Duration::from_secs(10)).await;
    control(proxy, Proxy::pass).await;
    control(proxy, Proxy::reset).await;
    task.await.unwrap()
}

/// The release's delete is applied, its reply lost with the connection; the delete sent again after
/// the reconnect finds no node. Before issue 24: `NotHeld` (and `distlock run` exited 76). The node's
/// path is unique to this acquire on this session and an attempt went unanswered, so the node being
/// gone is this release having landed: `Released`, at the backend and through the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_lost_release_reply_is_released_not_not_held() {
    let server = ZkServer::start_or_panic();
    let proxy = Arc::new(Proxy::start_or_panic(server.addr()));
    let raw = raw_client(&server.addr().to_string()).await;

    // Backend level.
    let url = distlock_core::url::LockUrl::parse(&format!("zk://{}", proxy.addr())).unwrap();
    let backend = ZkBackend::connect(&url).await.unwrap();
    let name_raw = name("lost_reply_raw");
    let request = AcquireRequest::new(&name_raw, "owner-a:1", backend.default_lease());
    let mut acquisition = backend.begin(&request).unwrap();
    let Attempt::Acquired(grant) = backend
        .try_acquire(&mut acquisition, &request)
        .await
        .unwrap()
    else {
        panic!("free lock not granted");
    };
    let own = wait_children(&raw, &name_raw, 1).await.remove(0);
    let b = backend.clone();
    let n = name_raw.clone();
    let outcome = lose_the_reply_of(&proxy, &raw, &name_raw, &own, async move {
        b.release(&grant.lease, &n, "owner-a:1").await
    })
    .await;
    match outcome {
        Ok(Released::Released) => {}
        Err(e) if e.kind() == ErrorKind::Unavailable => {}
        other => panic!("a release whose delete landed reported {other:?}"),
    }

    // Through the guard.
    let locks = locks_at(&format!("zk://{}", proxy.addr())).await;
    let name = name("lost_reply_guard");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let own = wait_children(&raw, &name, 1).await.remove(0);
    let outcome = lose_the_reply_of(
        &proxy,
        &raw,
        &name,
        &own,
        async move { guard.release().await },
    )
    .await;
    if let Err(e) = outcome {
        assert_ne!(e.kind(), ErrorKind::NotHeld, "{e}");
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    }
    assert!(children(&raw, &name).await.is_empty());
}
