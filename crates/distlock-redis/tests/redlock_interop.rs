//! Redlock against node-redlock (npm `redlock` v5 with ioredis, run by Node): the same string keys on
//! the same 5 nodes, so each side sees the other's lock. The npm packages are installed by
//! scripts/setup.sh (`npm ci --prefix crates/distlock-redis/tests/node-redlock`); the CLI side is the
//! real `distlock` binary.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_redis::RedlockBackend;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::redlock::RedlockNodes;

fn unique(case: &str) -> String {
    format!("interop/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// The node-redlock script, after checking that Node and the npm packages are there.
fn script() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/node-redlock");
    let node = Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|o| o.status.success()),
        "node is missing: install it with `sudo apt-get install -y nodejs npm` (scripts/setup.sh does)"
    );
    assert!(
        dir.join("node_modules/redlock").is_dir() && dir.join("node_modules/ioredis").is_dir(),
        "node-redlock is not installed: run scripts/setup.sh, or `npm ci --prefix {}`",
        dir.display()
    );
    dir.join("redlock.mjs")
}

fn ports(nodes: &RedlockNodes) -> String {
    let ports: Vec<String> = nodes.addrs().iter().map(|a| a.port().to_string()).collect();
    ports.join(",")
}

/// A node-redlock process holding `name` until it is dropped (stdin closed, then it releases).
struct NodeHolder {
    child: Child,
    stdout: BufReader<ChildStdout>,
    value: String,
}

impl NodeHolder {
    fn hold(nodes: &RedlockNodes, name: &str) -> NodeHolder {
        let mut child = Command::new("node")
            .arg(script())
            .args(["hold", &ports(nodes), name, "10000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn node");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("read node-redlock");
        let value = line
            .trim()
            .strip_prefix("held ")
            .unwrap_or_else(|| panic!("node-redlock did not acquire: {line:?}"))
            .to_string();
        NodeHolder {
            child,
            stdout,
            value,
        }
    }

    /// Closes stdin: node-redlock releases and exits.
    fn release(mut self) {
        drop(self.child.stdin.take());
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read node-redlock");
        assert_eq!(line.trim(), "released");
        assert!(self.child.wait().expect("wait node").success());
    }
}

impl Drop for NodeHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// node-redlock's one acquire with `retryCount: 0`: true if it got (and released) the lock.
fn node_tries(nodes: &RedlockNodes, name: &str) -> bool {
    let out = Command::new("node")
        .arg(script())
        .args(["try", &ports(nodes), name, "10000"])
        .output()
        .expect("run node");
    match out.status.code() {
        Some(0) => true,
        Some(3) => false,
        _ => panic!(
            "node-redlock failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn distlock(args: &[&str]) -> std::process::Output {
    Command::new(distlock_bin().expect("the distlock binary"))
        .args(args)
        .output()
        .expect("run distlock")
}

#[test]
fn node_redlock_holding_makes_distlock_run_no_wait_exit_75() {
    let nodes = RedlockNodes::start_or_panic(5);
    let name = unique("node_holds");
    let url = nodes.url();
    let holder = NodeHolder::hold(&nodes, &name);
    let busy = distlock(&["run", "--url", &url, "--no-wait", &name, "--", "true"]);
    assert_eq!(
        busy.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    // `distlock status` shows node-redlock's value on every node, with its pttl.
    let status = distlock(&["status", "--url", &url, &name]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(text.contains("state: held"), "{text}");
    assert!(text.contains(&format!("owner: {}", holder.value)), "{text}");
    for addr in nodes.addrs() {
        assert!(
            text.contains(&format!("node: {addr} {} ", holder.value)),
            "{addr} missing in {text}"
        );
    }
    holder.release();
    let free = distlock(&["run", "--url", &url, "--no-wait", &name, "--", "true"]);
    assert_eq!(
        free.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&free.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distlock_holding_makes_node_redlock_fail() {
    let nodes = RedlockNodes::start_or_panic(5);
    let name = unique("distlock_holds");
    let locks = Locks::new(
        RedlockBackend::connect(&LockUrl::parse(&nodes.url()).unwrap())
            .await
            .unwrap(),
    );
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    let (n, task_name) = (&nodes, name.clone());
    let node_got_it = tokio::task::block_in_place(|| node_tries(n, &task_name));
    assert!(!node_got_it, "node-redlock acquired a lock distlock holds");
    let owner = format!("{}#", guard.owner());
    guard.release().await.unwrap();
    // distlock's release deleted its key on every node, not only on a quorum. (Checked here, not after
    // node-redlock's cycle below: node-redlock's release resolves at a quorum, and its NOSCRIPT fallback
    // can run a slow node's acquire after that node's release, leaving node-redlock's key there; the
    // last CI run met it.)
    for node in nodes.nodes() {
        let left = node.command(&["GET", &name]).unwrap();
        let ours = left.as_str().is_some_and(|v| v.starts_with(&owner));
        assert!(
            !ours,
            "distlock's key {left:?} left on a node after the release"
        );
    }
    let got = tokio::task::block_in_place(|| node_tries(n, &name));
    assert!(
        got,
        "node-redlock could not acquire after distlock released"
    );
}

/// `distlock run` on Redlock: no fencing token, so `DISTLOCK_TOKEN` is unset (even if inherited).
#[test]
fn distlock_run_leaves_distlock_token_unset() {
    let nodes = RedlockNodes::start_or_panic(3);
    let name = unique("no_token");
    let out = Command::new(distlock_bin().expect("the distlock binary"))
        .env("DISTLOCK_TOKEN", "999")
        .args(["run", "--url", &nodes.url(), &name, "--"])
        .args([
            "sh",
            "-c",
            r#"test -z "${DISTLOCK_TOKEN+x}" && test -n "$DISTLOCK_NAME""#,
        ])
        .output()
        .expect("run distlock");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
