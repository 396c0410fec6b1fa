//! Self-tests of the process manager against a real `redis-server` (never the system one on 6379).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::net::TcpListener;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use distlock_testkit::ports;
use distlock_testkit::process::{self, ServerProcess, ServerSpec};
use distlock_testkit::redis::{self, RedisServer, RespValue};
use distlock_testkit::sweep::{self, PidRecord};
use distlock_testkit::Error;

fn ping(server: &RedisServer) -> RespValue {
    server.command(&["PING"]).expect("PING")
}

fn pong() -> RespValue {
    RespValue::Simple("PONG".into())
}

/// Whether a process with this pid exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat[stat.rfind(')').unwrap() + 1..]
                .split_whitespace()
                .next();
            state != Some("Z")
        }
        Err(_) => false,
    }
}

fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn record_path(pid: u32) -> PathBuf {
    std::env::temp_dir()
        .join("distlock-testkit/pids")
        .join(pid.to_string())
}

#[test]
fn starts_and_answers_ping() {
    let server = RedisServer::start_or_panic();
    assert_eq!(ping(&server), pong());
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    assert_eq!(
        server.addr().to_string(),
        format!("127.0.0.1:{}", server.port())
    );
    assert!((ports::FIRST_PORT..=ports::LAST_PORT).contains(&server.port()));
    assert_ne!(server.port(), 6379);
    // No persistence by default: nothing may be written into the data dir on shutdown.
    let set = server.command(&["SET", "k", "v"]).unwrap();
    assert_eq!(set, RespValue::Simple("OK".into()));
    assert_eq!(
        server.command(&["GET", "k"]).unwrap(),
        RespValue::Bulk(b"v".to_vec())
    );
    assert!(server.command(&["NOSUCHCOMMAND"]).unwrap().is_error());
    assert!(server.dir().join("redis.log").exists());
    assert!(server.log_tail(20).contains("Ready to accept connections"));
    assert!(record_path(server.pid()).exists(), "pid record written");
}

#[test]
fn identifies_the_server_by_pid() {
    let server = RedisServer::start_or_panic();
    let info = server.command(&["INFO", "server"]).unwrap();
    let info = info.as_str().unwrap().to_owned();
    let line = format!("process_id:{}", server.pid());
    assert!(info.lines().any(|l| l.trim() == line), "{line} not in INFO");
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", server.pid())).unwrap();
    assert!(comm.starts_with("redis-server"), "comm = {comm}");
    // The server leads its own process group, so group signals never reach the test.
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", server.pid())).unwrap();
    let pgrp: u32 = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(pgrp, server.pid());
}

#[test]
fn kill9_then_restart_on_same_port_and_dir() {
    let mut server = RedisServer::start_or_panic();
    let (port, dir, old_pid) = (server.port(), server.dir().to_path_buf(), server.pid());
    server.command(&["SET", "lock", "tok"]).unwrap();

    server.kill9().unwrap();
    assert!(!alive(old_pid), "old server still alive");
    assert!(
        !record_path(old_pid).exists(),
        "record of killed server kept"
    );
    assert!(
        server.command(&["PING"]).is_err(),
        "PING answered after kill -9"
    );
    assert!(
        server.kill9().is_err(),
        "second kill9 must report the state"
    );

    server.restart().unwrap();
    assert_eq!(server.port(), port);
    assert_eq!(server.dir(), dir);
    assert_ne!(server.pid(), old_pid);
    assert_eq!(ping(&server), pong());
    // Without persistence the lock is gone: Redlock's restart hazard, reproduced.
    assert_eq!(server.command(&["GET", "lock"]).unwrap(), RespValue::Nil);
    assert!(server.log_tail(1000).contains("distlock-testkit: restart"));
}

#[test]
fn durable_server_keeps_data_across_kill9() {
    let mut server = RedisServer::builder().durable().start_or_panic();
    server.command(&["SET", "lock", "tok"]).unwrap();
    server.kill9().unwrap();
    server.restart().unwrap();
    assert_eq!(
        server.command(&["GET", "lock"]).unwrap(),
        RespValue::Bulk(b"tok".to_vec())
    );
}

#[test]
fn pause_times_out_and_resume_recovers() {
    let mut server = RedisServer::start_or_panic();
    server.pause().unwrap();
    assert!(!server.process().is_running());
    let err = server
        .command_timeout(&["PING"], Duration::from_millis(300))
        .expect_err("a paused server must not answer");
    assert!(err.is_timeout(), "expected a timeout, got {err}");
    server.resume().unwrap();
    assert!(server.process().is_running());
    assert_eq!(ping(&server), pong());
}

#[test]
fn restart_of_a_paused_server_works() {
    let mut server = RedisServer::start_or_panic();
    let old = server.pid();
    server.pause().unwrap();
    server.restart().unwrap();
    assert!(!alive(old));
    assert_eq!(ping(&server), pong());
}

#[test]
fn dropping_the_handle_leaves_no_process_and_no_files() {
    let server = RedisServer::start_or_panic();
    let pid = server.pid();
    let dir = server.dir().to_path_buf();
    assert!(alive(pid));
    drop(server);
    assert!(!alive(pid), "server {pid} survived drop");
    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "not reaped");
    assert!(!record_path(pid).exists(), "pid record left behind");
    assert!(!dir.exists(), "temp dir left behind");
}

#[test]
fn dropping_a_paused_server_kills_it() {
    let mut server = RedisServer::start_or_panic();
    let pid = server.pid();
    server.pause().unwrap();
    drop(server);
    assert!(!alive(pid));
}

#[test]
fn stop_is_graceful() {
    let mut server = RedisServer::start_or_panic();
    let pid = server.pid();
    let status = server.process_mut().stop().unwrap();
    assert!(
        status.success(),
        "redis should exit 0 on SIGTERM, got {status:?}"
    );
    assert!(!alive(pid));
    server.restart().unwrap();
    assert_eq!(ping(&server), pong());
}

#[test]
fn panicking_test_keeps_the_dir_and_kills_the_server() {
    let (tx, rx) = std::sync::mpsc::channel();
    let joined = std::thread::spawn(move || {
        let server = RedisServer::start_or_panic();
        tx.send((server.pid(), server.dir().to_path_buf())).unwrap();
        panic!("deliberate panic to exercise the unwind path");
    })
    .join();
    assert!(joined.is_err());
    let (pid, dir) = rx.recv().unwrap();
    assert!(!alive(pid), "server survived the panic");
    assert!(dir.join("redis.log").exists(), "dir not kept on panic");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn parallel_starts_get_distinct_ports() {
    let handles: Vec<_> = (0..6)
        .map(|_| std::thread::spawn(RedisServer::start_or_panic))
        .collect();
    let servers: Vec<RedisServer> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ports: HashSet<u16> = servers.iter().map(RedisServer::port).collect();
    assert_eq!(ports.len(), servers.len(), "ports collided: {ports:?}");
    for s in &servers {
        assert_eq!(ping(s), pong());
        let info = s.command(&["INFO", "server"]).unwrap();
        let expect = format!("process_id:{}", s.pid());
        assert!(info.as_str().unwrap().contains(&expect));
    }
}

#[test]
fn port_leases_exclude_each_other_and_bus_ports_are_free() {
    let a = ports::reserve().unwrap();
    let b = ports::reserve().unwrap();
    assert_ne!(a.port(), b.port());
    let bus = ports::reserve_with_bus().unwrap();
    let bus_port = bus.bus_port().unwrap();
    assert_eq!(bus_port, bus.port() + ports::BUS_OFFSET);
    assert!(bus_port < 55535);
    // Reserved ports are free to bind (nothing listens), which is what the server will do.
    TcpListener::bind(("127.0.0.1", bus_port)).unwrap();
    let cluster = RedisServer::builder().with_cluster_bus().start_or_panic();
    assert_eq!(cluster.bus_port(), Some(cluster.port() + ports::BUS_OFFSET));
}

#[test]
fn a_taken_port_is_reported_not_mistaken_for_our_server() {
    // Another redis already serves the port: a PING-only probe would get PONG from it.
    let other = RedisServer::start_or_panic();
    let dir = process::temp_dir("redis-impostor").unwrap();
    let spec = redis::base_spec(other.port(), dir.path());
    let err = ServerProcess::spawn(spec, dir, Vec::new(), redis::ready_probe(other.addr()))
        .expect_err("second server on a taken port must fail");
    match &err {
        Error::Exited { log_tail, dir, .. } => {
            assert!(log_tail.contains("Address already in use"), "{log_tail}");
            std::fs::remove_dir_all(dir).unwrap();
        }
        other => panic!("expected Exited, got {other}"),
    }
    assert_eq!(ping(&other), pong());
}

#[test]
fn missing_binary_names_the_install_command() {
    let dir = process::temp_dir("missing").unwrap();
    let spec =
        ServerSpec::new("redis", "distlock-no-such-server").install_hint(redis::INSTALL_HINT);
    let probe = redis::ready_probe("127.0.0.1:1".parse().unwrap());
    let err = ServerProcess::spawn(spec, dir, Vec::new(), probe).unwrap_err();
    assert!(matches!(err, Error::MissingBinary { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("apt-get install -y redis-server"), "{msg}");
    assert!(msg.contains("scripts/setup.sh"), "{msg}");
}

/// Spawns `sleep` as its own process group, like a server.
fn spawn_sleep() -> std::process::Child {
    Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap()
}

#[test]
fn sweep_kills_leftovers_of_dead_owners_only() {
    // A pid that certainly belongs to no live process of the same start time: a child we reaped.
    let mut gone = Command::new("true").spawn().unwrap();
    let dead_owner = gone.id();
    gone.wait().unwrap();

    let mut orphan = spawn_sleep();
    let orphan_rec = PidRecord::register_with_owner(orphan.id(), "sleep", dead_owner, 1).unwrap();
    let mut owned = spawn_sleep();
    let owned_rec = PidRecord::register(owned.id(), "sleep").unwrap();

    // Other test processes sweep too (on their first spawn), so assert outcomes, not who did it.
    let report = sweep::sweep().unwrap();
    assert!(report.kept.contains(&owned.id()), "{report:?}");
    let status = orphan.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "orphan not SIGKILLed: {status:?}");
    assert!(
        !orphan_rec.path().exists(),
        "record of the swept server kept"
    );

    assert!(
        owned.try_wait().unwrap().is_none(),
        "a live owner's server was killed"
    );
    assert!(owned_rec.path().exists());
    owned.kill().unwrap();
    owned.wait().unwrap();
}

#[test]
fn sweep_drops_records_of_servers_that_are_gone() {
    let mut child = spawn_sleep();
    let rec = PidRecord::register_with_owner(child.id(), "sleep", u32::MAX - 1, 1).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(rec.path().exists());
    let report = sweep::sweep().unwrap();
    assert!(!report.killed.contains(&rec.pid()), "{report:?}");
    assert!(!rec.path().exists(), "stale record kept");
}

/// Kills the helper process even when the test fails, so no helper outlives the test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn servers_die_with_a_sigkilled_test_process() {
    // The helper gets its own TMPDIR, so its pid record is out of reach of every other test process's
    // sweep: if the server dies, PR_SET_PDEATHSIG killed it, not a sweep.
    let tmp = tempfile::tempdir().unwrap();
    let pidfile = tmp.path().join("pid");
    let helper = Command::new(env!("CARGO_BIN_EXE_testkit-server-holder"))
        .arg(&pidfile)
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut helper = KillOnDrop(helper);
    wait_until("the helper's servers", Duration::from_secs(30), || {
        std::fs::read_to_string(&pidfile).is_ok_and(|s| s.split_whitespace().count() == 2)
    });
    let pids: Vec<u32> = std::fs::read_to_string(&pidfile)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    let (redis, nobody) = (pids[0], pids[1]);
    let status = std::fs::read_to_string(format!("/proc/{nobody}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line.contains("65534"),
        "not running as nobody: {uid_line}"
    );
    let record = tmp
        .path()
        .join("distlock-testkit/pids")
        .join(redis.to_string());
    assert!(record.exists(), "the helper's server has no pid record");
    // The helper's spawning threads have ended; PDEATHSIG must not have fired for that.
    std::thread::sleep(Duration::from_millis(100));
    for pid in [redis, nobody] {
        assert!(
            alive(pid),
            "{pid} died with the thread that asked for it (PDEATHSIG bound to a short-lived thread)"
        );
    }

    helper.0.kill().unwrap(); // SIGKILL: no Drop runs in the helper
    helper.0.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let survivors: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    if !survivors.is_empty() {
        // Out of every sweep's reach (their records sit in our temp dir): clean up, then fail.
        for pid in &survivors {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        panic!("PR_SET_PDEATHSIG did not kill the orphaned servers {survivors:?}");
    }
    assert!(record.exists(), "someone else swept the helper's record");
}
