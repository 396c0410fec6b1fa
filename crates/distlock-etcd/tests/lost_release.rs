//! Issue 24, scenario 19: a release whose reply is lost after etcd applied it. The release txn
//! deletes the key, the connection resets before the reply, and the resend on a new connection finds
//! no key of ours. That is not a definite "not held" (the first send did the delete): the release
//! must report `Unavailable` ("the outcome is unknown"), never `NotHeld`, on the plain release and
//! on the handoff path (a release folded into the handoff txn), and `distlock run` must exit with
//! its command's own status. Tests that inject faults have "fault" in their names (nextest's serial
//! group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{keys, Proxied};
use distlock_core::{ErrorKind, LockGuard, Locks};
use distlock_testkit::cli_run::Run;

/// Runs `release` with its reply lost: the proxy holds every chunk for 1 s, the txn reaches etcd
/// and applies (the key `gone` says so, read straight from the server), and the connection is reset
/// while the reply is still held, so the backend sends the release again on a new connection.
async fn release_with_its_reply_lost<T: Send + 'static>(
    fx: &Proxied,
    prefix: &str,
    gone: impl Fn(&[common::KeyFields]) -> bool,
    release: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    fx.delay(Duration::from_secs(1));
    let task = tokio::spawn(release);
    let endpoints = fx.server.endpoints();
    let started = Instant::now();
    loop {
        let seen = tokio::task::block_in_place(|| keys(&endpoints, prefix));
        if gone(&seen) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the release never reached the server: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fx.pass();
    tokio::task::block_in_place(|| fx.proxy().reset().unwrap());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the release finishes")
        .unwrap()
}

fn assert_outcome_unknown(outcome: distlock_core::Result<()>) {
    match outcome {
        // A release that can show it did the delete may count as done.
        Ok(()) => {}
        Err(e) => {
            assert_ne!(
                e.kind(),
                ErrorKind::NotHeld,
                "the release's own first send deleted the key, yet it reports NotHeld: {e}"
            );
            assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
            assert!(e.to_string().contains("outcome is unknown"), "{e}");
        }
    }
}

async fn held(locks: &Locks, name: &str) -> LockGuard {
    locks.lock(name).unwrap().acquire().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_release_whose_reply_is_lost_is_not_not_held() {
    let fx = Proxied::start(1);
    let (_backend, locks) = fx.connect(false, "request_timeout=5s").await;
    let name = common::name("lost_release");
    let prefix = format!("{name}/");
    let guard = held(&locks, &name).await;
    assert_eq!(keys(&fx.server.endpoints(), &prefix).len(), 1);
    let outcome =
        release_with_its_reply_lost(&fx, &prefix, |keys| keys.is_empty(), guard.release()).await;
    eprintln!("release outcome: {outcome:?}");
    assert_outcome_unknown(outcome);
    // Nothing left behind, and the name is free.
    assert!(keys(&fx.server.endpoints(), &prefix).is_empty());
    let again = locks.lock(&name).unwrap().try_acquire().await.unwrap();
    again
        .expect("free after the release")
        .release()
        .await
        .unwrap();
}

/// The handoff path: a local waiter makes the release a handoff txn, and a waiter of another process
/// queued on the server makes its compare fail, so the txn's failure branch releases (deletes the
/// key); its reply is lost and the resend finds nothing to release and no key made for the next owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_handoff_release_whose_reply_is_lost_is_not_not_held() {
    let fx = Proxied::start(1);
    let (_backend, locks) = fx.connect(false, "request_timeout=5s").await;
    let remote = common::locks(&fx.server.url()).await;
    let name = common::name("lost_handoff_release");
    let prefix = format!("{name}/");
    let guard = held(&locks, &name).await;
    let holder_key = keys(&fx.server.endpoints(), &prefix)[0].key.clone();
    // The waiter of another process queues on the server first, then the local one.
    let remote_lock = remote.lock(&name).unwrap();
    let remote_waiter = tokio::spawn(async move { remote_lock.acquire().await });
    common::wait_keys(
        &fx.server.endpoints(),
        &prefix,
        Duration::from_secs(10),
        "the remote waiter queued",
        |keys| keys.len() == 2,
    );
    let local_lock = locks.lock(&name).unwrap();
    let local_waiter = tokio::spawn(async move { local_lock.acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let outcome = release_with_its_reply_lost(
        &fx,
        &prefix,
        move |keys| keys.iter().all(|k| k.key != holder_key),
        guard.release(),
    )
    .await;
    eprintln!("release outcome: {outcome:?}");
    assert_outcome_unknown(outcome);
    // The remote waiter, queued first, gets it; then the local one; nothing is left.
    let remote_guard = tokio::time::timeout(Duration::from_secs(10), remote_waiter)
        .await
        .expect("the remote waiter gets the lock")
        .unwrap()
        .unwrap();
    remote_guard.release().await.unwrap();
    let local_guard = tokio::time::timeout(Duration::from_secs(10), local_waiter)
        .await
        .expect("the local waiter gets the lock")
        .unwrap()
        .unwrap();
    local_guard.release().await.unwrap();
    common::wait_keys(
        &fx.server.endpoints(),
        &prefix,
        Duration::from_secs(5),
        "no key left",
        |keys| keys.is_empty(),
    );
}

/// `distlock run`: the command exits 3 under the lock, the release's reply is lost; `distlock` must
/// exit 3 (the command's status), not 76 ("lock lost").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_run_whose_release_reply_is_lost_exits_with_the_commands_status() {
    const SCRIPT: &str = r#"D=$1
echo "${DISTLOCK_TOKEN:-none}" > "$D/token.tmp"; echo $$ > "$D/pid"; mv "$D/token.tmp" "$D/token"
while [ ! -e "$D/go" ]; do sleep 0.05; done
exit 3"#;
    let fx = Proxied::start(1);
    let name = common::name("run_lost_release");
    let prefix = format!("{name}/");
    let mut run = Run::spawn(
        &fx.url(false, "request_timeout=5s"),
        "30s",
        &[],
        &name,
        SCRIPT,
    );
    tokio::task::block_in_place(|| run.wait_started());
    assert_eq!(keys(&fx.server.endpoints(), &prefix).len(), 1);
    let go = run.path("go");
    release_with_its_reply_lost(&fx, &prefix, |keys| keys.is_empty(), async move {
        std::fs::write(go, "go").unwrap()
    })
    .await;
    let status = tokio::task::block_in_place(|| run.wait_for_exit(Duration::from_secs(20)))
        .unwrap_or_else(|| panic!("distlock still running: {}", run.stderr()));
    let stderr = run.stderr();
    eprintln!("{stderr}");
    assert_eq!(status.code(), Some(3), "{stderr}");
}

/// No fault at all, several members: a release unanswered after a quarter of the request timeout is
/// also sent to the next member. With member 0 slow (350 ms each way, the hedge after 500 ms), a
/// release sent there first is applied there first, the copy sent to member 1 is applied second,
/// finds the key gone and answers first. That answer must not be taken for the outcome: the release
/// waits for the other copy, which did the delete, and counts as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_slow_release_hedged_to_another_member_counts_as_done() {
    let fx = Proxied::start(2);
    let (_backend, locks) = fx.connect(false, "request_timeout=2s").await;
    let name = common::name("hedged_release");
    let prefix = format!("{name}/");
    tokio::task::block_in_place(|| fx.proxies[0].delay(Duration::from_millis(350)).unwrap());
    let mut outcomes = Vec::new();
    for _ in 0..4 {
        let guard = held(&locks, &name).await;
        outcomes.push(guard.release().await.map_err(|e| e.kind()));
    }
    eprintln!("release outcomes: {outcomes:?}");
    assert!(
        outcomes.iter().all(Result::is_ok),
        "a release hedged to a second member did not count as done: {outcomes:?}"
    );
    fx.pass();
    assert!(keys(&fx.server.endpoints(), &prefix).is_empty());
}
