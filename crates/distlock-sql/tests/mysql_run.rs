//! `distlock run --url mysql://…` against a real MariaDB, checked from the server's side with the
//! `mariadb` client: the advisory lock is the documented `GET_LOCK` name held by distlock's own session,
//! a `mariadb` session holding that name makes `--no-wait` exit 75, `KILL` of distlock's session stops the
//! command (exit 76) at once, a SIGINT during `--wait` leaves no waiting `GET_LOCK` behind, and in lease
//! mode a SIGSTOPped holder is taken over with a higher token and its late fenced write is refused.
//! Bounds are mechanism bounds plus slack, never speed figures.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use distlock_core::{FencingToken, Locks};
use distlock_sql::mysql::advisory_name;
use distlock_sql::mysql::fence::{FenceOutcome, FencedUpdate};
use distlock_testkit::cli_run::ChildGuard;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::mariadb::MariaDbServer;

/// Slack for "soon" on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("run/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// A `distlock run` child, killed if the test ends with it running.
struct Run {
    child: ChildGuard,
    dir: PathBuf,
}

impl Run {
    /// `distlock run --url URL ARGS… NAME -- sh -c SCRIPT` in a fresh temp dir (the script's `$PWD`).
    fn spawn(url: &str, args: &[&str], name: &str, script: &str) -> Run {
        let dir =
            std::env::temp_dir().join(format!("distlock-my-run-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&dir).unwrap();
        let child = ChildGuard::spawn(
            Command::new(distlock_bin().expect("the distlock binary"))
                .current_dir(&dir)
                .env_remove("DISTLOCK_URL")
                .env_remove("RUST_LOG")
                .args(["run", "--url", url])
                .args(args)
                .args([name, "--", "sh", "-c", script])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("stderr")).unwrap()),
        );
        Run { child, dir }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.path("stderr")).unwrap_or_default()
    }

    /// Waits until `file` exists in the run's dir (the command wrote it).
    fn wait_file(&self, file: &str, limit: Duration) -> String {
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Ok(text) = std::fs::read_to_string(self.path(file)) {
                if !text.is_empty() {
                    return text.trim().to_string();
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "{file} not written within {limit:?}; stderr: {}",
            self.stderr()
        );
    }

    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        self.child.wait(limit)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.child.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    rustix::process::kill_process(pid, sig).expect("signal");
}

/// The session id holding `GET_LOCK(advisory_name(name))`, if any.
fn holder_session(server: &MariaDbServer, name: &str) -> Option<u64> {
    let out = server
        .sql(&format!("SELECT IS_USED_LOCK('{}')", advisory_name(name)))
        .expect("IS_USED_LOCK");
    out.trim().parse().ok()
}

/// Whether the client port of session `id` (from the processlist) is a socket of process `pid`.
fn session_belongs_to(server: &MariaDbServer, id: u64, pid: u32) -> bool {
    let host = server
        .sql(&format!(
            "SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = {id}"
        ))
        .expect("processlist");
    let Some(port) = host
        .trim()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse::<u16>().ok())
    else {
        return false;
    };
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let local = format!(":{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            (cols.get(1).is_some_and(|l| l.ends_with(&local)))
                .then(|| cols.get(9).map(|s| format!("socket:[{s}]")))
                .flatten()
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path())
                    .map(|t| inodes.iter().any(|i| t.as_os_str() == i.as_str()))
                    .unwrap_or(false)
            })
        })
        .unwrap_or(false)
}

fn waiting_get_locks(server: &MariaDbServer) -> usize {
    server
        .sql("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT GET_LOCK(%'")
        .expect("processlist")
        .trim()
        .parse()
        .expect("a count")
}

const HOLD: &str = "echo \"$DISTLOCK_TOKEN\" > token; exec sleep 60";

#[test]
fn advisory_lock_is_distlocks_session_and_a_client_holder_makes_no_wait_exit_75() {
    let server = MariaDbServer::start_or_panic();
    let name = unique("interop");
    let mut run = Run::spawn(&server.url(), &[], &name, HOLD);
    let token: u64 = run
        .wait_file("token", Duration::from_secs(20))
        .parse()
        .expect("token");
    assert!(token > 0);
    let id = holder_session(&server, &name).expect("IS_USED_LOCK shows a holder");
    assert!(
        session_belongs_to(&server, id, run.pid()),
        "IS_USED_LOCK({}) = {id}, which is not a connection of the distlock process",
        advisory_name(&name)
    );
    signal(run.pid(), rustix::process::Signal::TERM);
    run.wait(Duration::from_secs(10))
        .expect("distlock exits on SIGTERM");
    assert_eq!(holder_session(&server, &name), None, "released on exit");

    // A `mariadb` client session holds the documented name: distlock --no-wait exits 75.
    let mut client = server
        .client()
        .arg("-e")
        .arg(format!(
            "SELECT GET_LOCK('{}', 0); SELECT SLEEP(60)",
            advisory_name(&name)
        ))
        .stdout(Stdio::null())
        .spawn()
        .expect("mariadb client");
    let started = Instant::now();
    while holder_session(&server, &name).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the client never got the lock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut busy = Run::spawn(&server.url(), &["--no-wait"], &name, "true");
    let status = busy
        .wait(Duration::from_secs(20))
        .expect("--no-wait returns");
    assert_eq!(status.code(), Some(75), "stderr: {}", busy.stderr());
    let _ = client.kill();
    let _ = client.wait();
}

#[test]
fn kill_of_the_holders_session_stops_the_command_fault() {
    let server = MariaDbServer::start_or_panic();
    let name = unique("kill");
    // The default 30 s lease: the watchdog probes every 10 s, so an exit within a second or so can only
    // come from noticing the closed socket.
    let mut run = Run::spawn(&server.url(), &[], &name, HOLD);
    run.wait_file("token", Duration::from_secs(20));
    let id = holder_session(&server, &name).expect("held");
    let killed_at = Instant::now();
    server.sql(&format!("KILL {id}")).expect("KILL");
    let status = run
        .wait(Duration::from_secs(1) + SLACK)
        .unwrap_or_else(|| panic!("still running after KILL; stderr: {}", run.stderr()));
    eprintln!(
        "distlock exited {:?} after KILL of its session",
        killed_at.elapsed()
    );
    assert_eq!(status.code(), Some(76), "stderr: {}", run.stderr());
    assert!(run.stderr().contains("closed"), "stderr: {}", run.stderr());
}

#[test]
fn sigint_during_wait_leaves_no_waiting_query() {
    let server = MariaDbServer::start_or_panic();
    let name = unique("sigint");
    let mut holder = Run::spawn(&server.url(), &[], &name, HOLD);
    holder.wait_file("token", Duration::from_secs(20));
    let mut waiter = Run::spawn(&server.url(), &["--wait", "60s"], &name, "true");
    let started = Instant::now();
    while waiting_get_locks(&server) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the waiter never waited in the server"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(waiter.pid(), rustix::process::Signal::INT);
    let status = waiter
        .wait(Duration::from_secs(10))
        .expect("the waiter exits on SIGINT");
    assert_ne!(status.code(), Some(0), "stderr: {}", waiter.stderr());
    let started = Instant::now();
    while waiting_get_locks(&server) > 0 {
        assert!(
            started.elapsed() < SLACK,
            "a GET_LOCK wait outlived the interrupted waiter"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The holder is untouched, and the name frees when it goes.
    assert!(holder_session(&server, &name).is_some());
    signal(holder.pid(), rustix::process::Signal::TERM);
    holder.wait(Duration::from_secs(10)).expect("holder exits");
    assert_eq!(holder_session(&server, &name), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_sigstopped_holder_is_taken_over_and_its_fenced_write_refused_fault() {
    let server = MariaDbServer::start_or_panic();
    server
        .sql("CREATE TABLE distlock.acct (id INT PRIMARY KEY, v VARCHAR(20), fence_token BIGINT UNSIGNED NOT NULL DEFAULT 0); INSERT INTO distlock.acct VALUES (1, 'initial', 0)")
        .expect("table");
    let url = format!("{}?mode=lease", server.url());
    let name = unique("lease-stop");
    let mut holder = Run::spawn(&url, &["--lease", "1s"], &name, HOLD);
    let stale = FencingToken::new(
        holder
            .wait_file("token", Duration::from_secs(20))
            .parse()
            .expect("token"),
    );
    signal(holder.pid(), rustix::process::Signal::STOP);
    let stopped_at = Instant::now();

    let locks = Locks::new(distlock_sql::mysql::connect(&url).await.expect("connect"));
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(1) * 4 + SLACK)
        .acquire()
        .await
        .expect("the stopped holder's lease expires");
    assert!(
        stopped_at.elapsed() >= Duration::from_millis(300),
        "taken over inside the lease"
    );
    let token = guard.token().expect("a token");
    assert!(
        token > stale,
        "token {token} after the stopped holder's {stale}"
    );

    let write = FencedUpdate::new("acct", "v = ?", "id = ?");
    let mut db = mysql_async::Conn::from_url(server.url().as_str())
        .await
        .expect("db");
    assert_eq!(
        write
            .execute(&mut db, ("new holder", 1), token)
            .await
            .expect("write"),
        FenceOutcome::Applied { rows: 1 }
    );
    // The stopped holder's late write, with its token: refused by the database.
    assert_eq!(
        write
            .execute(&mut db, ("stale holder", 1), stale)
            .await
            .expect("write"),
        FenceOutcome::Refused
    );
    assert_eq!(
        server
            .sql("SELECT v FROM distlock.acct WHERE id = 1")
            .unwrap()
            .trim(),
        "new holder"
    );

    // Resumed, the old holder finds its lease gone and stops its command.
    signal(holder.pid(), rustix::process::Signal::CONT);
    let status = holder
        .wait(Duration::from_secs(1) + SLACK)
        .expect("the resumed holder exits");
    assert_eq!(status.code(), Some(76), "stderr: {}", holder.stderr());
    guard.release().await.expect("release");
}
