//! `distlock run --url redis://…` as a user runs it (issue 3's acceptance): the real `distlock` binary
//! (`distlock_testkit::holder::distlock_bin()`), real `sh` commands, a real `redis-server`. Bounds are
//! mechanism bounds (a renewal tick, a lease) plus slack for a loaded machine, never speed figures.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use distlock_redis::layout;
// A `distlock run` process, SIGKILLed (this child only) if the test ends with it still running; its
// supervisor then kills everything the command started.
use distlock_testkit::cli_run::ChildGuard as Run;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::redis::RedisServer;
use distlock_testkit::sweep::{gone_within, is_alive};

#[path = "../../distlock-cli/tests/tree/mod.rs"]
mod tree;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);
/// The lease of every run here, as the acceptance criterion says.
const LEASE: Duration = Duration::from_secs(1);

fn unique(case: &str) -> String {
    format!("run/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// A temp dir for the commands' records, and `distlock run` commands on one server.
struct Sandbox {
    dir: PathBuf,
    url: String,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Sandbox {
    fn new(server: &RedisServer) -> Sandbox {
        let dir = std::env::temp_dir().join(format!(
            "distlock-redis-run-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir(&dir).unwrap();
        Sandbox {
            dir,
            url: server.url(),
        }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// `distlock run --url <server> --lease 1s ARGS…`, clean environment, stderr to `stderr`.
    fn run(&self, args: &[&str]) -> Command {
        self.run_with_lease("1s", args)
    }

    /// `distlock run --url <server> --lease LEASE ARGS…`, as [`Sandbox::run`].
    fn run_with_lease(&self, lease: &str, args: &[&str]) -> Command {
        let mut command = Command::new(distlock_bin().expect("the distlock binary"));
        command
            .current_dir(&self.dir)
            .env_remove("DISTLOCK_URL")
            .env_remove("DISTLOCK_TOKEN")
            .env_remove("RUST_LOG")
            .args(["run", "--url", &self.url, "--lease", lease])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.path("stderr")).unwrap());
        command
    }

    /// Starts a holder of `name` whose command records its token and pid, traps SIGTERM (recording it
    /// in `term`) and otherwise runs until killed; returns once the command runs under the lock.
    fn hold(&self, name: &str) -> (Run, u32) {
        let script = "trap 'echo TERM > term; exit 143' TERM; \
                      echo \"$DISTLOCK_TOKEN\" > token; echo $$ > pid.tmp; mv pid.tmp pid; \
                      while :; do sleep 0.05; done";
        let mut run = Run::spawn(&mut self.run(&[name, "--", "sh", "-c", script]));
        let started = Instant::now();
        while !self.path("pid").exists() {
            if let Some(status) = run.wait(Duration::ZERO) {
                panic!(
                    "distlock run exited with {status} before running its command: {}",
                    self.stderr()
                );
            }
            assert!(started.elapsed() < SLACK * 5, "the command never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = read(&self.path("pid")).parse().unwrap();
        (run, pid)
    }

    /// `distlock run --no-wait NAME -- true`'s exit code.
    fn try_run(&self, name: &str) -> Option<i32> {
        let status = self
            .run(&["--no-wait", name, "--", "true"])
            .stderr(Stdio::null())
            .status()
            .unwrap();
        status.code()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.path("stderr")).unwrap_or_default()
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The command runs under the lock (with the token Redis minted in `DISTLOCK_TOKEN`) and keeps it past
/// several 1 s leases (another `--no-wait` run exits 75 throughout); deleting the key under it makes the
/// next renewal find it gone: the command gets SIGTERM and `distlock` exits 76 within one renewal tick
/// (a third of the lease) plus slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_holds_and_deleted_key_stops_command_fault() {
    let server = RedisServer::start_or_panic();
    let sandbox = Sandbox::new(&server);
    let name = unique("deleted");
    let (mut holder, child_pid) = sandbox.hold(&name);
    let token = read(&sandbox.path("token"));
    assert_eq!(
        server
            .command(&["GET", &layout::token_key(&name)])
            .unwrap()
            .as_str(),
        Some(token.as_str()),
        "DISTLOCK_TOKEN is the INCRed token"
    );
    assert_eq!(
        sandbox.try_run(&name),
        Some(75),
        "busy: held by the first run"
    );

    // Held across three leases: the watchdog renews it.
    tokio::time::sleep(LEASE * 3).await;
    assert!(
        holder.wait(Duration::ZERO).is_none(),
        "{}",
        sandbox.stderr()
    );
    assert_eq!(
        sandbox.try_run(&name),
        Some(75),
        "the lease ran out under a live run"
    );
    let pttl = server.command(&["PTTL", &name]).unwrap().as_int().unwrap();
    assert!(pttl > 0, "the key has no lease: {pttl}");

    // The key is deleted under the run.
    server.command(&["DEL", &name]).unwrap();
    let deleted = Instant::now();
    let bound = LEASE / 3 + SLACK;
    let status = holder
        .wait(bound)
        .unwrap_or_else(|| panic!("distlock still runs {bound:?} after the key was deleted"));
    let took = deleted.elapsed();
    assert_eq!(status.code(), Some(76), "{status}: {}", sandbox.stderr());
    assert_eq!(
        read(&sandbox.path("term")),
        "TERM",
        "the command got no SIGTERM"
    );
    assert!(!is_alive(child_pid), "the command outlived distlock");
    let stderr = sandbox.stderr();
    assert!(
        stderr.contains("lost") && stderr.contains("gone"),
        "{stderr}"
    );
    eprintln!("distlock exited 76 {took:?} after the DEL (bound {bound:?})");
}

/// A SIGKILLed `distlock run` takes its command with it (its supervisor kills it), and the lock frees once
/// its lease runs out, not before two thirds of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_run_takes_its_command_fault() {
    let server = RedisServer::start_or_panic();
    let sandbox = Sandbox::new(&server);
    let name = unique("sigkill");
    let (mut holder, child_pid) = sandbox.hold(&name);
    assert!(is_alive(child_pid));
    holder.kill9();
    let killed = Instant::now();
    assert!(
        gone_within(child_pid, SLACK),
        "the command (pid {child_pid}) outlived its SIGKILLed distlock"
    );
    // Nothing released the lock: it is held until its lease ends.
    let mut freed = None;
    while freed.is_none() && killed.elapsed() < LEASE + SLACK {
        match sandbox.try_run(&name) {
            Some(0) => freed = Some(killed.elapsed()),
            Some(75) => std::thread::sleep(Duration::from_millis(20)),
            other => panic!("unexpected exit {other:?}"),
        }
    }
    let freed = freed.expect("the lease of the killed run never ran out");
    assert!(
        freed >= LEASE * 2 / 3 - Duration::from_millis(50),
        "freed {freed:?} after the kill, inside the lease"
    );
}

/// The server restarts without persistence under a run: the key is gone, so the run's next renewal
/// that reaches the new server (or, failing that, its validity deadline) ends it with exit 76, the
/// command stopped by SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_without_persistence_exits_76_fault() {
    let mut server = RedisServer::start_or_panic();
    let sandbox = Sandbox::new(&server);
    let name = unique("restart");
    let (mut holder, child_pid) = sandbox.hold(&name);
    server.kill9().unwrap();
    server.restart().unwrap();
    let restarted = Instant::now();
    assert_eq!(
        server.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(0),
        "the restarted server kept the key: persistence is on"
    );
    let bound = LEASE + SLACK;
    let status = holder
        .wait(bound)
        .unwrap_or_else(|| panic!("distlock still runs {bound:?} after the restart"));
    assert_eq!(status.code(), Some(76), "{status}: {}", sandbox.stderr());
    assert_eq!(
        read(&sandbox.path("term")),
        "TERM",
        "the command got no SIGTERM"
    );
    assert!(!is_alive(child_pid), "the command outlived distlock");
    assert!(sandbox.stderr().contains("lost"), "{}", sandbox.stderr());
    eprintln!(
        "distlock exited 76 {:?} after the restart; it said: {}",
        restarted.elapsed(),
        sandbox.stderr().trim()
    );
    // The lock is free for the next run.
    assert_eq!(sandbox.try_run(&name), Some(0));
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

/// `distlock` itself paused (SIGSTOP) past its lease: the key expires and another run gets the lock with
/// a greater token, while the paused run's command keeps running (only `distlock` was stopped) — the
/// unsafety every lease-based lock has, which fencing tokens exist for. On SIGCONT the paused run finds
/// its validity deadline passed at once: the command gets SIGTERM and `distlock` exits 76.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_run_loses_lock_on_resume_fault() {
    let server = RedisServer::start_or_panic();
    let sandbox = Sandbox::new(&server);
    let name = unique("paused");
    let (mut holder, child_pid) = sandbox.hold(&name);
    let first: u64 = read(&sandbox.path("token")).parse().unwrap();
    signal(holder.pid(), "-STOP");
    let paused = Instant::now();
    let second = sandbox
        .run(&[
            "--wait",
            "10s",
            &name,
            "--",
            "sh",
            "-c",
            "echo \"$DISTLOCK_TOKEN\" > token2",
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let took_over = paused.elapsed();
    assert_eq!(second.code(), Some(0));
    assert!(
        took_over >= LEASE * 2 / 3 - Duration::from_millis(50),
        "taken over {took_over:?} after the pause, inside the lease"
    );
    let token2: u64 = read(&sandbox.path("token2")).parse().unwrap();
    assert!(token2 > first, "token {token2} after {first}");
    assert!(
        is_alive(child_pid),
        "the paused run's command stopped while distlock was paused"
    );
    signal(holder.pid(), "-CONT");
    let resumed = Instant::now();
    let bound = LEASE / 3 + SLACK;
    let status = holder
        .wait(bound)
        .unwrap_or_else(|| panic!("distlock still runs {bound:?} after SIGCONT"));
    assert_eq!(status.code(), Some(76), "{status}: {}", sandbox.stderr());
    assert_eq!(
        read(&sandbox.path("term")),
        "TERM",
        "the command got no SIGTERM"
    );
    assert!(
        gone_within(child_pid, SLACK),
        "the command outlived distlock"
    );
    eprintln!(
        "taken over {took_over:?} after SIGSTOP; exit 76 {:?} after SIGCONT",
        resumed.elapsed()
    );
}

/// Every shape of descendant the command starts (same-group grandchild, `setsid` grandchild, one that
/// ignores SIGTERM, a background child) is dead before the next holder starts: after a SIGKILL of
/// `distlock` (the supervisor kills the tree at once, long before the 1 s lease runs out; with the
/// default 30 s lease there is only more time), after a loss (DEL of the key; dead before `distlock`
/// exits 76), and after the command exits leaving them (SIGTERM, SIGKILL after `--grace`, then the
/// release).
fn tree_dies_before_the_next_holder(ending: tree::Ending) {
    let server = RedisServer::start_or_panic();
    for shape in tree::SHAPES {
        let sandbox = Sandbox::new(&server);
        let name = unique("tree");
        let run = |args: &[&str]| sandbox.run(args);
        let lose = |name: &str| {
            server.command(&["DEL", name]).unwrap();
        };
        tree::check(shape, ending, &sandbox.dir, &name, &run, &lose);
    }
}

#[test]
fn a_sigkilled_runs_whole_tree_dies_before_the_next_holder_fault() {
    tree_dies_before_the_next_holder(tree::Ending::KillDistlock);
}

#[test]
fn on_loss_the_whole_tree_dies_before_run_exits_fault() {
    tree_dies_before_the_next_holder(tree::Ending::Loss);
}

#[test]
fn leftover_descendants_die_before_the_release_fault() {
    tree_dies_before_the_next_holder(tree::Ending::CommandExits);
}

/// Issue #7, item 6: the release's reply is lost (the proxy holds each chunk 2 s; once the server ran
/// the release, so the key is gone, every proxied connection is reset before the reply gets back). The
/// backend retries on a fresh connection, finds nothing, and reports the outcome unknown. The command
/// ran wholly under the lock, so `distlock run` exits with the command's code (7), not 76, and says in
/// one line that the lock frees when its lease ends. At the default 30 s lease (no renewal falls in the
/// few seconds this takes, and one that did would only be delayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_release_reply_keeps_the_commands_exit_code_fault() {
    let server = RedisServer::start_or_panic();
    let proxy = distlock_testkit::proxy::Proxy::start_or_panic(server.addr());
    let mut sandbox = Sandbox::new(&server);

    // One whole run straight to the server loads the scripts there, so the delayed release is the
    // script itself (an `EVALSHA` the server knows), not a `NOSCRIPT` round trip first.
    let warm = sandbox
        .run(&[&unique("lost-reply-warm"), "--", "true"])
        .status()
        .unwrap();
    assert_eq!(warm.code(), Some(0), "{warm}: {}", sandbox.stderr());

    sandbox.url = format!("redis://{}", proxy.addr());
    let name = unique("lost-reply");
    let script = "touch started; while [ ! -e go ]; do sleep 0.05; done; exit 7";
    // The default lease (the CLI's `--lease` default), not the sandbox's 1 s.
    let mut run =
        Run::spawn(&mut sandbox.run_with_lease("30s", &[&name, "--", "sh", "-c", script]));
    let started = Instant::now();
    while !sandbox.path("started").exists() {
        if let Some(status) = run.wait(Duration::ZERO) {
            panic!(
                "exited with {status} before its command ran: {}",
                sandbox.stderr()
            );
        }
        assert!(started.elapsed() < SLACK * 5, "the command never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let key = layout::lock_key(&name);
    assert_eq!(server.command(&["EXISTS", key]).unwrap().as_int(), Some(1));

    // The command ends; its release goes out delayed. Watch the server itself (not through the proxy)
    // until the release ran there, then lose its reply.
    proxy.delay(Duration::from_secs(2)).unwrap();
    std::fs::write(sandbox.path("go"), "").unwrap();
    let sent = Instant::now();
    while server.command(&["EXISTS", key]).unwrap().as_int() == Some(1) {
        assert!(
            sent.elapsed() < Duration::from_secs(20),
            "the release never reached the server: {}",
            sandbox.stderr()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.pass().unwrap();
    proxy.reset().unwrap();

    let status = run
        .wait(Duration::from_secs(30))
        .expect("distlock exits after the retried release");
    let stderr = sandbox.stderr();
    assert_eq!(
        status.code(),
        Some(7),
        "the command's code, not 76: {status}: {stderr}"
    );
    let lines: Vec<_> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on the release: {stderr}");
    assert!(
        lines[0].contains("unknown") && lines[0].contains("lock frees when its lease ends"),
        "{stderr}"
    );
    assert_eq!(
        server.command(&["EXISTS", key]).unwrap().as_int(),
        Some(0),
        "the first release attempt deleted the key"
    );
}
