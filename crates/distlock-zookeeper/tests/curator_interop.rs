//! Interop with real Apache Curator (Debian's libcurator-*-java 5.x): a Java program using
//! `InterProcessMutex`, compiled at test time with javac (tests/java/CuratorLock.java), and distlock
//! exclude each other on the same path and share one queue in creation order.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{children, name, raw_client, wait_children, Curator};
use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_testkit::cli_run::no_wait_run;
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::ZkBackend;

async fn locks(server: &ZkServer) -> Locks {
    let backend = ZkBackend::connect(&LockUrl::parse(&server.url()).unwrap())
        .await
        .expect("connect");
    Locks::with_defaults(backend.clone(), backend.default_options())
}

fn status(url: &str, name: &str) -> String {
    let bin = distlock_testkit::holder::distlock_bin().expect("the distlock binary");
    let out = Command::new(bin)
        .args(["status", "--url", url, name])
        .stdin(Stdio::null())
        .output()
        .expect("distlock status");
    assert!(
        out.status.success(),
        "distlock status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_holds_then_run_no_wait_exits_75_and_status_names_holder_and_waiters() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let name = name("curator_holds");
    let mut holder = Curator::hold(&connect, &name);
    holder.wait_acquired();
    let mut waiter = Curator::hold(&connect, &name);
    let queue = wait_children(&raw, &name, 2).await;
    assert!(
        queue
            .iter()
            .all(|c| c.starts_with("_c_") && c.contains("-lock-")),
        "Curator's protected-mode names: {queue:?}"
    );

    let code = tokio::task::spawn_blocking({
        let (url, name) = (server.url(), name.clone());
        move || no_wait_run(&url, &name)
    })
    .await
    .unwrap();
    assert_eq!(code, 75, "distlock run --no-wait while Curator holds");
    // The refused attempt left no node behind.
    assert_eq!(children(&raw, &name).await.len(), 2);

    let (data, stat) = raw
        .get_data(&format!("/{name}/{}", queue[0]))
        .await
        .expect("holder node");
    let text = status(&server.url(), &name);
    assert!(text.contains("state: held"), "{text}");
    assert!(text.contains(&format!("token: {}", stat.czxid)), "{text}");
    assert!(
        text.contains(&format!("owner: {}", String::from_utf8_lossy(&data))),
        "the holder is named by its node's data (Curator writes its IP address): {text}"
    );
    assert!(text.contains("waiters: 1"), "{text}");

    holder.release();
    waiter.wait_acquired();
    waiter.release();
    assert!(children(&raw, &name).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distlock_holds_then_curator_acquire_200ms_returns_false() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let locks = locks(&server).await;
    let name = name("distlock_holds");
    let guard = locks.lock(&name).unwrap().acquire().await.expect("acquire");
    let ours = children(&raw, &name).await;
    assert_eq!(ours.len(), 1);
    let (_, stat) = raw
        .get_data(&format!("/{name}/{}", ours[0]))
        .await
        .expect("own node");
    assert_eq!(
        guard.token().expect("token").get(),
        u64::try_from(stat.czxid).unwrap(),
        "the token is the node's czxid"
    );

    let got = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::try_acquire(&connect, &name, 200)
    })
    .await
    .unwrap();
    assert!(!got, "Curator acquired a lock distlock holds");
    assert_eq!(
        children(&raw, &name).await,
        ours,
        "Curator's timed-out node was not removed"
    );

    guard.release().await.expect("release");
    let got = tokio::task::spawn_blocking({
        let (connect, name) = (connect.clone(), name.clone());
        move || Curator::try_acquire(&connect, &name, 5000)
    })
    .await
    .unwrap();
    assert!(got, "Curator could not acquire after distlock released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_curator_and_distlock_waiters_are_served_in_creation_order() {
    let server = ZkServer::start_or_panic();
    let connect = server.addr().to_string();
    let raw = raw_client(&connect).await;
    let first = locks(&server).await;
    let second = locks(&server).await;
    let name = name("mixed_order");

    let holder = first.lock(&name).unwrap().acquire().await.expect("acquire");
    let mut curator1 = Curator::hold(&connect, &name);
    wait_children(&raw, &name, 2).await;
    let lock2 = second.lock(&name).unwrap();
    let distlock2 = tokio::spawn(async move { lock2.acquire().await });
    wait_children(&raw, &name, 3).await;
    let mut curator3 = Curator::hold(&connect, &name);
    wait_children(&raw, &name, 4).await;

    holder.release().await.expect("release");
    let curator1 = tokio::task::spawn_blocking(move || {
        curator1.wait_acquired();
        curator1
    })
    .await
    .unwrap();
    assert!(
        !distlock2.is_finished(),
        "distlock's waiter went before the earlier Curator waiter"
    );
    let mut curator1 = curator1;
    tokio::task::spawn_blocking(move || curator1.release())
        .await
        .unwrap();
    let guard2 = tokio::time::timeout(Duration::from_secs(20), distlock2)
        .await
        .expect("distlock's waiter was not served after Curator's release")
        .unwrap()
        .expect("acquire");
    assert_eq!(
        children(&raw, &name).await.len(),
        2,
        "Curator's second waiter still queued"
    );
    guard2.release().await.expect("release");
    tokio::task::spawn_blocking(move || {
        curator3.wait_acquired();
        curator3.release();
    })
    .await
    .unwrap();
    assert!(children(&raw, &name).await.is_empty());
}
