//! `distlock run --url etcd://…` through the real binary (issue 4's acceptance): the hold excludes
//! `etcdctl lock` and a second `distlock run`, the command's `DISTLOCK_TOKEN` is the holder key's
//! create_revision as etcdctl shows it, a revoked lease stops the command (SIGTERM) and `distlock`
//! exits 76, a SIGKILLed `distlock` takes its command with it and the lock frees when the session lease
//! expires, and a waiter paused past its session lease never runs its command while another holds.
//! Tests that inject faults have "fault" in their names (nextest's serial group).
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{keys, wait_keys};
use distlock_core::url::LockUrl;
use distlock_core::{LockState, Locks};
use distlock_etcd::EtcdBackend;
use distlock_testkit::cli_run::{no_wait_run, Run, HOLD_SCRIPT};
use distlock_testkit::etcd::{EtcdServer, ETCDCTL};
use distlock_testkit::sweep::{gone_within, is_alive};
use rustix::process::Signal;

/// `--lease 2s`: a 2 s session, kept alive every 2/3 s.
const LEASE: Duration = Duration::from_secs(2);
/// Slack for process start, etcdctl runs and scheduling on a loaded 2-core machine. Not a speed figure:
/// every bound below is a mechanism (one keep-alive interval, one lease) plus this.
const SLACK: Duration = Duration::from_secs(3);

async fn locks(server: &EtcdServer) -> (Locks, EtcdBackend) {
    let backend = EtcdBackend::connect(&LockUrl::parse(&server.url()).unwrap())
        .await
        .expect("connect");
    (Locks::new(backend.clone()), backend)
}

/// The lease hex of a key `NAME/<lease hex>`.
fn lease_hex(name: &str, key: &str) -> String {
    key.strip_prefix(&format!("{name}/"))
        .unwrap_or_else(|| panic!("{key} is not under {name}/"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_holds_excludes_etcdctl_and_token_is_create_revision() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let eps = server.endpoints();
    let name = common::name("run_holds");
    let prefix = format!("{name}/");
    let mut run = Run::spawn(&url, "2s", &[], &name, HOLD_SCRIPT);
    let (token, child_pid) = run.wait_started();

    // One key, NAME/<lease hex>, hanging on that very lease, whose create_revision is the token.
    let seen = keys(&eps, &prefix);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].key,
        format!("{name}/{:x}", seen[0].lease),
        "{seen:?}"
    );
    assert_eq!(
        seen[0].create_revision, token,
        "DISTLOCK_TOKEN must be the holder key's create_revision"
    );
    // The session lease is the lock's --lease, rounded up to whole seconds.
    let ttl = server
        .etcdctl(&["lease", "timetolive", &lease_hex(&name, &seen[0].key)])
        .unwrap();
    assert!(ttl.contains("granted with TTL(2s)"), "{ttl}");

    // A second `distlock run --no-wait` cannot get it: exit 75.
    assert_eq!(no_wait_run(&url, &name), 75);

    // `etcdctl lock NAME` blocks while distlock holds.
    let mut etcdctl = Command::new(ETCDCTL)
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &eps, "lock", &name])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcdctl");
    let stdout = etcdctl.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
        // Keep the pipe open until etcdctl exits (a closed pipe can kill it before it cleans up).
        let mut rest = String::new();
        while reader.read_line(&mut rest).is_ok_and(|n| n > 0) {}
    });
    // etcdctl queues a key of its own behind distlock's, and gets nothing.
    wait_keys(
        &eps,
        &prefix,
        Duration::from_secs(10),
        "etcdctl queued",
        |k| k.len() == 2,
    );
    assert!(
        rx.recv_timeout(Duration::from_millis(1000)).is_err(),
        "etcdctl lock got a lock distlock run holds"
    );
    assert!(
        run.try_status().is_none(),
        "distlock run ended: {}",
        run.stderr()
    );
    rustix::process::kill_process(rustix::process::Pid::from_child(&etcdctl), Signal::INT).unwrap();
    let _ = etcdctl.wait();
    // etcdctl deletes its key (and revokes its session) on SIGINT; at worst it goes with its 10 s TTL.
    wait_keys(
        &eps,
        &prefix,
        Duration::from_secs(15),
        "etcdctl's key gone",
        |k| k.len() == 1,
    );
    assert!(is_alive(child_pid), "the command stopped on its own");
    run.signal(Signal::TERM);
    let status = run
        .wait_for_exit(Duration::from_secs(10))
        .expect("distlock run exits after SIGTERM");
    // SIGTERM is passed on to the command once; it exits 143 by its trap, and distlock passes that on.
    assert_eq!(status.code(), Some(143), "{}", run.stderr());
    assert_eq!(run.read("term").as_deref(), Some("term"));
    // The release deleted the key.
    assert!(keys(&eps, &prefix).is_empty());
    assert_eq!(
        no_wait_run(&url, &name),
        0,
        "the lock is free after the run"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_run_revoked_lease_terms_the_command_and_exits_76() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let eps = server.endpoints();
    let name = common::name("run_revoked");
    let prefix = format!("{name}/");
    let mut run = Run::spawn(&url, "2s", &[], &name, HOLD_SCRIPT);
    let (token, child_pid) = run.wait_started();
    let seen = keys(&eps, &prefix);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].create_revision, token);

    // Revoke the holder's session lease, found from its key NAME/<lease hex>.
    let revoked_at = Instant::now();
    server
        .etcdctl(&["lease", "revoke", &lease_hex(&name, &seen[0].key)])
        .unwrap();
    // The revoke deletes the key at once: the lock is free on the server from here on.
    assert!(keys(&eps, &prefix).is_empty());

    // Noticed by the next keep-alive (one interval: a third of the TTL), then the command gets SIGTERM.
    let bound = LEASE / 3 + SLACK;
    let status = run.wait_for_exit(bound);
    let elapsed = revoked_at.elapsed();
    let status = status.unwrap_or_else(|| {
        panic!(
            "distlock still running {bound:?} after the revoke: {}",
            run.stderr()
        )
    });
    assert_eq!(status.code(), Some(76), "{}", run.stderr());
    assert_eq!(
        run.read("term").as_deref(),
        Some("term"),
        "the command did not get SIGTERM"
    );
    assert!(gone_within(child_pid, Duration::from_secs(1)));
    // The mechanism is the keep-alive learning the lease is gone, not the validity deadline running out.
    let stderr = run.stderr();
    assert!(stderr.contains("revoked"), "{stderr}");
    assert!(stderr.contains("SIGTERM"), "{stderr}");
    eprintln!("revoke → distlock exit 76: {elapsed:?}");
    assert_eq!(
        no_wait_run(&url, &name),
        0,
        "the lock is free after the revoke"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_run_sigkilled_takes_its_command_and_the_lock_frees_after_the_session_ttl() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let eps = server.endpoints();
    let name = common::name("run_killed");
    let prefix = format!("{name}/");
    let mut run = Run::spawn(&url, "2s", &[], &name, HOLD_SCRIPT);
    let (token, child_pid) = run.wait_started();
    assert!(is_alive(child_pid));

    // A waiter in this process queues behind it.
    let (waiter, _) = locks(&server).await;
    let lock = waiter.lock(&name).unwrap();
    let waiting = tokio::spawn(async move {
        let guard = lock
            .options()
            .lease(Duration::from_secs(5))
            .wait(LEASE * 4 + SLACK * 2)
            .acquire()
            .await;
        (guard, Instant::now())
    });
    let queued = wait_keys(
        &eps,
        &prefix,
        Duration::from_secs(10),
        "waiter queued",
        |k| k.len() == 2,
    );
    let holder_key = queued[0].clone();
    assert_eq!(holder_key.create_revision, token);

    run.signal(Signal::KILL);
    let killed_at = Instant::now();
    let status = run
        .wait_for_exit(Duration::from_secs(5))
        .expect("SIGKILL ends distlock");
    assert_eq!(status.code(), None, "killed by a signal");
    // Its command dies with it (parent-death signal); a zombie counts as gone.
    assert!(
        gone_within(child_pid, SLACK),
        "the command of a SIGKILLed distlock outlived it"
    );
    // Nothing released the lock: the holder key is still there, on its lease, right after the kill.
    let still = keys(&eps, &prefix);
    assert!(still.contains(&holder_key), "{still:?}");

    // The lease expires on the server (at most one TTL after the last keep-alive) and hands the lock on.
    let (guard, got_at) = waiting.await.unwrap();
    let guard = guard.expect("the waiter gets the lock once the dead holder's lease expires");
    let after = got_at - killed_at;
    eprintln!("SIGKILL → waiter holds: {after:?}");
    // The last keep-alive was at most a third of the TTL before the kill: the lease had ≥ 2/3 left.
    assert!(
        after >= LEASE / 3,
        "the lock freed {after:?} after the kill, before the lease could expire"
    );
    assert!(after <= LEASE * 2 + SLACK, "{after:?}");
    assert!(guard.token().unwrap().get() > token);
    assert_eq!(guard.state(), LockState::Held);
    guard.release().await.unwrap();
}

/// The waiter script: records the token it ran with, and when.
const WAITER_SCRIPT: &str = r#"echo "${DISTLOCK_TOKEN:-none}" > "$1/got""#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_run_paused_waiter_never_runs_while_another_holds() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let eps = server.endpoints();
    let name = common::name("run_paused_waiter");
    let prefix = format!("{name}/");
    let (a, _) = locks(&server).await;
    let (b, _) = locks(&server).await;

    // Holder A writes its token where anyone can see it (the fenced marker).
    let marker = tempfile::tempdir().unwrap();
    let first = a.lock(&name).unwrap().acquire().await.unwrap();
    let first_token = first.token().unwrap().get();
    std::fs::write(marker.path().join("holder"), first_token.to_string()).unwrap();

    // The waiter: a real `distlock run` queued behind A.
    let mut waiter = Run::spawn(&url, "2s", &[], &name, WAITER_SCRIPT);
    let queued = wait_keys(
        &eps,
        &prefix,
        Duration::from_secs(15),
        "waiter queued",
        |k| k.len() == 2,
    );
    let waiter_key = queued[1].clone();

    // Pause it past its session lease: its key goes with the lease.
    waiter.signal(Signal::STOP);
    let paused_at = Instant::now();
    wait_keys(
        &eps,
        &prefix,
        LEASE * 2 + SLACK * 2,
        "the paused waiter's lease expired",
        |k| !k.contains(&waiter_key),
    );
    assert!(
        paused_at.elapsed() >= LEASE / 3,
        "the paused waiter's key went too early"
    );
    // A releases; B takes the lock (the paused waiter's key is gone, so B is next) and marks it.
    first.release().await.unwrap();
    let second = b
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let second_token = second.token().unwrap().get();
    assert!(second_token > first_token);
    std::fs::write(marker.path().join("holder"), second_token.to_string()).unwrap();

    // Resume the waiter while B holds: it must not run its command.
    waiter.signal(Signal::CONT);
    let resumed_at = Instant::now();
    let early_exit = waiter.wait_for_exit(LEASE + SLACK);
    assert!(
        waiter.read("got").is_none(),
        "the resumed waiter ran its command while B holds (token {:?}, B's {second_token}): {}",
        waiter.read("got"),
        waiter.stderr()
    );
    assert_eq!(second.state(), LockState::Held);
    second.release().await.unwrap();
    let status = match early_exit {
        Some(status) => status,
        None => waiter
            .wait_for_exit(Duration::from_secs(15))
            .expect("the waiter ends once B released"),
    };
    match waiter.read("got") {
        // It re-acquired with a fresh key after B let go: its token must be above every earlier one.
        Some(got) => {
            let got: u64 = got.parse().expect("a token");
            assert!(
                got > second_token,
                "ran with token {got} ≤ B's {second_token}"
            );
            assert_eq!(status.code(), Some(0), "{}", waiter.stderr());
            eprintln!("paused waiter: re-acquired afresh with token {got}");
        }
        // Or it failed with an error naming the lost queue place (issue 11456 / 19597).
        None => {
            let stderr = waiter.stderr();
            assert_ne!(status.code(), Some(0), "{stderr}");
            assert_eq!(status.code(), Some(69), "Unavailable: {stderr}");
            assert!(
                stderr.contains("session lease") || stderr.contains("queue"),
                "{stderr}"
            );
            eprintln!(
                "paused waiter: failed {:?} after SIGCONT with: {stderr}",
                resumed_at.elapsed()
            );
        }
    }
    assert!(
        keys(&eps, &prefix).is_empty(),
        "nothing left under the prefix"
    );
}

/// Issue 7 item 4: at the etcd backend's default 60 s session TTL (keep-alive every 20 s; `distlock run`'s
/// own default lease, 30 s, only brings the keep-alive closer), an operator revoking the holder's lease or
/// deleting its key stops the command (SIGTERM) and `distlock` exits 76 within `SLACK` (3 s) of the
/// delete — a mechanism bound far below the keep-alive interval, not at the next keep-alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_run_revoke_or_delete_at_the_default_session_ttl_terms_the_command_at_once() {
    let server = EtcdServer::start_or_panic();
    let url = server.url();
    let eps = server.endpoints();
    for breaker in ["lease revoke", "del"] {
        let name = common::name("run_broken");
        let prefix = format!("{name}/");
        let mut run = Run::spawn(&url, "60s", &[], &name, HOLD_SCRIPT);
        let (token, child_pid) = run.wait_started();
        let seen = keys(&eps, &prefix);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].create_revision, token);
        let ttl = server
            .etcdctl(&["lease", "timetolive", &lease_hex(&name, &seen[0].key)])
            .unwrap();
        assert!(ttl.contains("granted with TTL(60s)"), "{ttl}");

        let broken_at = Instant::now();
        if breaker == "del" {
            server.etcdctl(&["del", &seen[0].key]).unwrap();
        } else {
            server
                .etcdctl(&["lease", "revoke", &lease_hex(&name, &seen[0].key)])
                .unwrap();
        }
        assert!(keys(&eps, &prefix).is_empty());
        let status = run.wait_for_exit(SLACK);
        let elapsed = broken_at.elapsed();
        let status = status.unwrap_or_else(|| {
            panic!(
                "{breaker}: distlock still running {SLACK:?} after it: {}",
                run.stderr()
            )
        });
        assert_eq!(status.code(), Some(76), "{breaker}: {}", run.stderr());
        assert_eq!(
            run.read("term").as_deref(),
            Some("term"),
            "{breaker}: the command did not get SIGTERM"
        );
        assert!(gone_within(child_pid, Duration::from_secs(1)));
        let stderr = run.stderr();
        assert!(stderr.contains("was deleted on the server"), "{stderr}");
        eprintln!("{breaker} → distlock exit 76: {elapsed:?}");
        assert_eq!(
            no_wait_run(&url, &name),
            0,
            "the lock is free after {breaker}"
        );
    }
}
