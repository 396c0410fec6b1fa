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
