//! Deadlines across a suspend of the machine (issue 24, scenario 7), simulated with
//! `distlock_core::clock::testing::suspend`: the boot clock jumps on, tokio's clock does not (nextest
//! runs each test in a process of its own, as the simulated suspend is process-wide).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{backend, keys, locks, locks_on, watch_gauge};
use distlock_core::clock;
use distlock_core::LockState;
use distlock_testkit::etcd::EtcdServer;

/// Far below the 20 s `max_hold` a tokio timer would still wait.
const PROMPT: Duration = Duration::from_secs(5);

/// The client-side expiry (`expiry.rs`) must report the loss and delete the key at the resume, not as
/// much later as the suspend lasted: the session lives on (kept alive for the process's other locks),
/// so nothing else frees the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_passed_during_a_suspend_frees_the_name_at_the_resume() {
    let server = EtcdServer::start_or_panic();
    let a = locks(&server.url()).await;
    let name = common::name("suspend_max_hold");
    let prefix = format!("{name}/");
    let guard = a
        .lock(&name)
        .unwrap()
        .options()
        .max_hold(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    assert_eq!(keys(&server.endpoints(), &prefix).len(), 1);
    // The expiry task is asleep, its timer armed for the deadline.
    tokio::time::sleep(Duration::from_millis(300)).await;
    clock::testing::suspend(Duration::from_secs(25));
    let resumed = Instant::now();
    assert_eq!(guard.state(), LockState::Lost);
    while !keys(&server.endpoints(), &prefix).is_empty() {
        assert!(
            resumed.elapsed() < PROMPT,
            "the key is still there {:?} after the resume, though max_hold passed during the suspend",
            resumed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = locks(&server.url()).await;
    let next = tokio::time::timeout(PROMPT, b.lock(&name).unwrap().options().acquire())
        .await
        .expect("another client takes the lock at once")
        .unwrap();
    next.release().await.unwrap();
    drop(guard);
}

/// Keep-alives the server received.
async fn keep_alives(server: &EtcdServer) -> u64 {
    watch_gauge(
        server.addr(),
        "grpc_server_msg_received_total{grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"}",
    )
    .await
}

/// The session's own keep-alive must go out at the resume: a suspend shorter than the session's TTL
/// leaves its lease alive (the server counted the suspend too), and a keep-alive due during it that
/// fired as much later as the suspend lasted could let the lease run out while the machine is up
/// again. (No lock is held: the watchdog's renewals, which keep the session alive too, stay out of it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_keep_alive_goes_out_at_the_resume() {
    let server = EtcdServer::start_or_panic();
    let backend = backend(&server.url()).await;
    let a = locks_on(&backend);
    let name = common::name("suspend_keep_alive");
    // The session stays for the next acquire.
    a.lock(&name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(backend.session_leases().await.len(), 1);
    // The keep-alive loop is asleep (a keep-alive every third of the 60 s TTL).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = keep_alives(&server).await;
    // Within the lease, past a third of it.
    clock::testing::suspend(Duration::from_secs(45));
    let resumed = Instant::now();
    while keep_alives(&server).await == before {
        assert!(
            resumed.elapsed() < PROMPT,
            "no keep-alive {:?} after the resume",
            resumed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        backend.session_leases().await.len(),
        1,
        "the session lives on"
    );
}
