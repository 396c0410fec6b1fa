//! The PostgreSQL server handle's kill -9, restart, pause and stop. PostgreSQL's backends and helpers
//! leave the postmaster's process group (`setsid`), so a group kill alone leaves them running with the
//! old shared memory attached, and the restarted postmaster refuses to start on the same data dir.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::sweep;

/// A `psql` session, ended (and reaped) when dropped, also when the test panics.
struct Session(std::process::Child);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A session sleeping in a backend of its own, and that backend's pid.
fn sleeping_session(server: &PostgresServer) -> (Session, u32) {
    let session = Session(
        server
            .psql_command("SELECT pg_sleep(60)")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = server
            .psql("SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(60)'")
            .unwrap();
        if let Ok(pid) = found.parse() {
            return (session, pid);
        }
        assert!(
            Instant::now() < deadline,
            "the sleeping session never showed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` is stopped (`T` in `/proc/<pid>/stat`) or not, as wanted, within 5 s, polling (a
/// signal is taken when the process next runs).
fn stopped_within(pid: u32, want: bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let after_comm = &stat[stat.rfind(')').unwrap() + 1..];
        let stopped = after_comm.split_whitespace().next() == Some("T");
        if stopped == want {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server with a sleeping session, paused, its backend seen stopped.
fn paused_with_a_sleeping_session() -> (PostgresServer, Session, u32) {
    let mut server = PostgresServer::start_or_panic();
    let (session, backend) = sleeping_session(&server);
    server.process_mut().pause().unwrap();
    assert!(
        stopped_within(backend, true),
        "a paused server's backend still runs"
    );
    (server, session, backend)
}

#[test]
fn pause_and_resume_reach_the_backends_that_left_the_group() {
    let (mut server, session, backend) = paused_with_a_sleeping_session();
    server.process_mut().resume().unwrap();
    assert!(
        stopped_within(backend, false),
        "a resumed server's backend stays stopped"
    );
    assert_eq!(server.psql("SELECT 1").unwrap(), "1");
    drop(session);
}

#[test]
fn restart_after_kill9_ends_the_backends_that_left_the_group() {
    let mut server = PostgresServer::start_or_panic();
    let (session, backend) = sleeping_session(&server);
    // A stopped backend cannot notice its postmaster's death: only a kill of it frees the old shared
    // memory, whatever the timing.
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &backend.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());

    server.process_mut().restart().unwrap();
    assert!(
        !sweep::is_alive(backend),
        "the old backend {backend} outlived the restart"
    );
    assert_eq!(server.psql("SELECT 1").unwrap(), "1");
    drop(session);
}

#[test]
fn stop_of_a_paused_server_ends_the_backends_that_left_the_group() {
    let (mut server, session, backend) = paused_with_a_sleeping_session();
    // SIGTERM is PostgreSQL's smart shutdown, which waits for the sleeping session: the stop ends in its
    // SIGKILL, and that must reach the stopped backend too.
    server.process_mut().stop().unwrap();
    assert!(
        !sweep::is_alive(backend),
        "the paused server's backend {backend} outlived its stop"
    );
    drop(session);
}
