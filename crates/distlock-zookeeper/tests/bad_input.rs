//! Bad input: one line, the right kind (and `distlock` exit code), nothing left on the server.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{children, locks_at, name};
use distlock_core::url::LockUrl;
use distlock_core::ErrorKind;
use distlock_testkit::zookeeper::ZkServer;
use distlock_zookeeper::ZkBackend;
use zookeeper_client as zk;

/// `distlock run --url URL [--lease L] NAME -- true`: exit code and stderr.
fn run(url: &str, lease: Option<&str>, name: &str) -> (i32, String) {
    let bin = distlock_testkit::holder::distlock_bin().expect("the distlock binary");
    let mut cmd = Command::new(bin);
    cmd.args(["run", "--url", url]);
    if let Some(lease) = lease {
        cmd.args(["--lease", lease]);
    }
    let out = cmd
        .args([name, "--", "true"])
        .stdin(Stdio::null())
        .output()
        .expect("distlock run");
    (
        out.status.code().expect("exit code"),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_names_and_leases_fail_with_the_right_code_and_leave_nothing() {
    let server = ZkServer::start_or_panic();
    let url = server.url();
    let raw = common::raw_client(&server.addr().to_string()).await;
    let cases: Vec<(String, Option<&str>, &str, i32)> = vec![
        (format!("{url}?bogus=1"), None, "x", 64),
        (format!("{url}/a//b"), None, "x", 64),
        (format!("{url}?session_timeout=0s"), None, "x", 64),
        ("zks://127.0.0.1:1".into(), None, "x", 69),
        (url.clone(), None, "a//b", 64),
        (url.clone(), None, "zookeeper/quota", 64),
        (url.clone(), None, "trailing/", 64),
        (url.clone(), None, "ctl\u{1}char", 64),
        // The test server grants session timeouts of 400 ms to 60 s: a 200 ms lease cannot be honoured.
        (url.clone(), Some("200ms"), "lease-too-short", 64),
        (url.clone(), Some("120s"), "lease-too-long", 64),
    ];
    for (url, lease, name, code) in cases {
        let (got, stderr) = tokio::task::spawn_blocking({
            let (url, name) = (url.clone(), name.to_string());
            move || run(&url, lease, &name)
        })
        .await
        .unwrap();
        assert_eq!(got, code, "{url} {lease:?} {name:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    }
    let (_, stderr) = tokio::task::spawn_blocking({
        let url = url.clone();
        move || run(&url, Some("200ms"), "lease-too-short")
    })
    .await
    .unwrap();
    assert!(
        stderr.contains("negotiated"),
        "the refusal says what the server granted: {stderr}"
    );
    // Nothing was created for the refused names and leases.
    let top = raw.list_children("/").await.unwrap();
    assert!(
        !top.iter()
            .any(|c| c.starts_with("lease-too") || c == "a" || c == "trailing"),
        "{top:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_created_and_locks_live_under_it() {
    let server = ZkServer::start_or_panic();
    let raw = common::raw_client(&server.addr().to_string()).await;
    let locks = locks_at(&format!("{}/app/locks", server.url())).await;
    let name = name("chroot");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    assert_eq!(children(&raw, &format!("app/locks/{name}")).await.len(), 1);
    guard.release().await.unwrap();
    assert!(children(&raw, &format!("app/locks/{name}"))
        .await
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn digest_credentials_an_acl_refuses_are_permission_denied_and_leave_nothing() {
    let server = ZkServer::start_or_panic();
    let admin = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .with_auth("digest", b"admin:s3cret")
        .connect(&server.addr().to_string())
        .await
        .unwrap();
    admin
        .create(
            "/secured",
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::creator_all()),
        )
        .await
        .unwrap();
    let addr = server.addr();
    for url in [format!("zk://{addr}"), format!("zk://admin:wrong@{addr}")] {
        let locks = locks_at(&url).await;
        let err = locks
            .lock("secured/job")
            .unwrap()
            .options()
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .expect_err("the ACL refuses these credentials");
        assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{url}: {err}");
    }
    let (code, stderr) = tokio::task::spawn_blocking(move || {
        run(&format!("zk://admin:wrong@{addr}"), None, "secured/job")
    })
    .await
    .unwrap();
    assert_eq!(code, 69, "{stderr}");
    assert!(
        admin.list_children("/secured").await.unwrap().is_empty(),
        "a refused acquire left a node"
    );
    // (With the right credentials the parent /secured/job is created as a container with the open
    // ACL, as Curator's default ACL provider does; from then on anyone may queue under it.)
    let locks = locks_at(&format!("zk://admin:s3cret@{addr}")).await;
    let guard = locks
        .lock("secured/job")
        .unwrap()
        .acquire()
        .await
        .expect("the right credentials");
    guard.release().await.unwrap();
}

/// ZooKeeper refuses UTF-16 surrogates in a path (`PathUtils.validatePath`: U+D800–U+F8FF), so every
/// character outside the Basic Multilingual Plane (an emoji is two surrogates in Java's string): such
/// a name is `InvalidName` up front and such a chroot `InvalidConfig`, and neither leaves a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_and_chroots_outside_the_bmp_are_refused_up_front_and_leave_nothing() {
    let server = ZkServer::start_or_panic();
    let raw = common::raw_client(&server.addr().to_string()).await;
    let locks = locks_at(&server.url()).await;
    for bad in ["smile-\u{1F600}", "emoji-parent/\u{1F600}"] {
        let err = match locks.lock(bad) {
            Err(e) => e,
            Ok(lock) => lock
                .options()
                .wait(Duration::from_secs(2))
                .acquire()
                .await
                .map(drop)
                .expect_err("ZooKeeper cannot store this name"),
        };
        assert_eq!(err.kind(), ErrorKind::InvalidName, "{bad:?}: {err}");
    }
    let config = distlock_zookeeper::ZkConfig::new([server.addr().to_string()])
        .with_chroot("/emoji-chroot/\u{1F600}");
    let err = ZkBackend::from_config(config)
        .await
        .expect_err("ZooKeeper cannot store this chroot");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    let top = raw.list_children("/").await.unwrap();
    assert!(
        !top.iter()
            .any(|c| c.starts_with("emoji") || c.starts_with("smile")),
        "a refused name or chroot left a node: {top:?}"
    );
}

/// A server that refuses connections is reported (`Unavailable`) within the connect timeout, not after
/// the session timeout the client would otherwise keep trying for (60 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_fails_within_the_connect_timeout() {
    let refusing = distlock_testkit::proxy::Proxy::start("127.0.0.1:9".parse().unwrap()).unwrap();
    refusing.refuse().unwrap();
    let url = format!(
        "zk://{}?connect_timeout=1s&session_timeout=30s",
        refusing.addr()
    );
    let started = std::time::Instant::now();
    let err = ZkBackend::connect(&LockUrl::parse(&url).unwrap())
        .await
        .expect_err("nothing listens there");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "reported after {:?}, not within the 1 s connect timeout (the session timeout is 30 s)",
        started.elapsed()
    );
}

/// A lock name under an ephemeral node (ZooKeeper refuses children of ephemerals) is a bad name, said
/// so (`InvalidName`, "pick another name"), and leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_under_an_ephemeral_node_is_an_invalid_name_and_leaves_nothing() {
    let server = ZkServer::start_or_panic();
    let raw = common::raw_client(&server.addr().to_string()).await;
    raw.create(
        "/ephemeral-parent",
        b"",
        &zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all()),
    )
    .await
    .unwrap();
    let locks = locks_at(&server.url()).await;
    let err = locks
        .lock("ephemeral-parent/job")
        .unwrap()
        .options()
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect_err("no children under an ephemeral");
    assert_eq!(err.kind(), ErrorKind::InvalidName, "{err}");
    assert!(err.to_string().contains("another name"), "{err}");
    assert!(raw
        .list_children("/ephemeral-parent")
        .await
        .unwrap()
        .is_empty());
}
