//! `distlock run --url zk://…` through the real binary: the command's `DISTLOCK_TOKEN` is the lock node's
//! czxid (what `zkCli.sh get -s` shows as `cZxid`, there in hex), and the node is a Curator-style
//! protected ephemeral sequential child holding the owner id.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::{name, raw_client, wait_children};
use distlock_testkit::cli_run::{Run, HOLD_SCRIPT};
use distlock_testkit::zookeeper::ZkServer;
use rustix::process::Signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_token_is_the_lock_nodes_czxid() {
    let server = ZkServer::start_or_panic();
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("run_token");
    let mut run = Run::spawn(&server.url(), "2s", &[], &name, HOLD_SCRIPT);
    let (token, _child) = run.wait_started();
    let nodes = wait_children(&raw, &name, 1).await;
    assert!(
        nodes[0].starts_with("_c_") && nodes[0].contains("-lock-"),
        "{nodes:?}"
    );
    let (data, stat) = raw
        .get_data(&format!("/{name}/{}", nodes[0]))
        .await
        .unwrap();
    assert_eq!(
        token,
        u64::try_from(stat.czxid).unwrap(),
        "DISTLOCK_TOKEN = cZxid"
    );
    assert_ne!(stat.ephemeral_owner, 0, "the lock node is ephemeral");
    assert!(!data.is_empty(), "the node holds the owner id");
    run.signal(Signal::TERM);
    run.wait_for_exit(std::time::Duration::from_secs(10))
        .expect("distlock exits on SIGTERM");
    wait_children(&raw, &name, 0).await;
}

/// The command's release is applied but its reply lost with the connection (the fault proxy holds
/// every chunk 1 s, the node goes on the server, then the connection is reset): the delete sent again
/// after the reconnect finds no node. Before issue 24 `distlock run` read that as `NotHeld` (or the
/// reset as a protocol error) and exited 76, "lock lost", for a command that ran under the lock to its
/// end. Now it exits with the command's own status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_exits_with_the_commands_status_when_the_release_reply_is_lost_fault() {
    const EXIT_3_ON_GO: &str = r#"D=$1
echo "${DISTLOCK_TOKEN:-none}" > "$D/token.tmp"; echo $$ > "$D/pid"; mv "$D/token.tmp" "$D/token"
while [ ! -e "$D/go" ]; do sleep 0.05; done
exit 3"#;
    let server = ZkServer::start_or_panic();
    let proxy = distlock_testkit::proxy::Proxy::start_or_panic(server.addr());
    let raw = raw_client(&server.addr().to_string()).await;
    let name = name("run_lost_reply");
    let mut run = Run::spawn(
        &format!("zk://{}", proxy.addr()),
        "10s",
        &[],
        &name,
        EXIT_3_ON_GO,
    );
    run.wait_started();
    let own = wait_children(&raw, &name, 1).await.remove(0);
    proxy.delay(std::time::Duration::from_secs(1)).unwrap();
    std::fs::write(run.path("go"), b"").unwrap();
    let started = std::time::Instant::now();
    while raw
        .list_children(&format!("/{name}"))
        .await
        .unwrap_or_default()
        .contains(&own)
    {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(15),
            "the release never reached the server: {}",
            run.stderr()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    proxy.pass().unwrap();
    proxy.reset().unwrap();
    let status = run
        .wait_for_exit(std::time::Duration::from_secs(20))
        .expect("distlock run exits after the release");
    assert_eq!(
        status.code(),
        Some(3),
        "distlock run must exit with the command's status: {}",
        run.stderr()
    );
}
