//! `distlock run --url postgres://…` as a user runs it: the real `distlock` binary, real `sh` commands,
//! `psql` as the other application, a real PostgreSQL server per test. Bounds are mechanism bounds plus
//! slack for a loaded machine, never speed figures.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use distlock_core::{FencingToken, Locks};
use distlock_sql::postgres::fence::{execute_fenced, Fenced, FencedUpdate};
use distlock_sql::postgres::layout::{advisory_key, pg_locks_row};
use distlock_sql::postgres::{tokio_postgres, PostgresBackend};
use distlock_sql::AdvisoryKey;
use distlock_testkit::cli_run::ChildGuard as Proc;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::sweep::is_alive;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("run/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
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
    fn new(url: String) -> Sandbox {
        let dir =
            std::env::temp_dir().join(format!("distlock-pg-run-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&dir).unwrap();
        Sandbox { dir, url }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// `distlock run --url <url> --lease 1s ARGS…`, clean environment, stderr to `stderr`.
    fn run(&self, args: &[&str]) -> Command {
        let mut command = Command::new(distlock_bin().expect("the distlock binary"));
        command
            .current_dir(&self.dir)
            .env_remove("DISTLOCK_URL")
            .env_remove("DISTLOCK_TOKEN")
            .env_remove("RUST_LOG")
            .args(["run", "--url", &self.url, "--lease", "1s"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.path("stderr")).unwrap());
        command
    }

    /// A holder of `name` whose command records its token and pid and traps SIGTERM; returns once the
    /// command runs under the lock.
    fn hold(&self, name: &str) -> (Proc, u32) {
        let script = "trap 'echo TERM > term; exit 143' TERM; \
                      echo \"$DISTLOCK_TOKEN\" > token; echo $$ > pid.tmp; mv pid.tmp pid; \
                      while :; do sleep 0.05; done";
        let mut run = Proc::spawn(&mut self.run(&[name, "--", "sh", "-c", script]));
        let started = Instant::now();
        while !self.path("pid").exists() {
            if let Some(status) = run.wait(Duration::ZERO) {
                panic!("distlock run exited with {status} first: {}", self.stderr());
            }
            assert!(started.elapsed() < SLACK * 5, "the command never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = read(&self.path("pid")).parse().unwrap();
        (run, pid)
    }

    /// `distlock run --no-wait NAME -- true`'s exit code.
    fn try_run(&self, name: &str) -> Option<i32> {
        self.run(&["--no-wait", name, "--", "true"])
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .code()
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

/// `pg_locks` rows of the key: `granted` ones' pids and how many wait.
fn advisory_locks(server: &PostgresServer, key: AdvisoryKey) -> (Vec<i32>, usize) {
    let (classid, objid, objsubid) = pg_locks_row(key);
    let out = server
        .psql(&format!(
            "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND classid = {classid} \
             AND objid = {objid} AND objsubid = {objsubid}"
        ))
        .unwrap();
    let mut granted = Vec::new();
    let mut waiting = 0;
    for line in out.lines().filter(|l| !l.is_empty()) {
        let (pid, g) = line.split_once('|').unwrap();
        if g == "t" {
            granted.push(pid.parse().unwrap());
        } else {
            waiting += 1;
        }
    }
    (granted, waiting)
}

fn wait_until(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// While `distlock run` holds a name, `pg_locks` shows the documented key held by a `distlock`
/// session; once it ends, `psql` holding that key makes `distlock run --no-wait` exit 75.
#[test]
fn pg_locks_shows_the_key_and_psql_holding_it_makes_no_wait_exit_75() {
    let server = PostgresServer::start_or_panic();
    let sandbox = Sandbox::new(server.url());
    let name = unique("interop");
    let key = AdvisoryKey::Single(advisory_key(&name));
    let (mut holder, _) = sandbox.hold(&name);
    let (granted, _) = advisory_locks(&server, key);
    assert_eq!(granted.len(), 1, "pg_locks does not show the key held");
    let app = server
        .psql(&format!(
            "SELECT application_name FROM pg_stat_activity WHERE pid = {}",
            granted[0]
        ))
        .unwrap();
    assert_eq!(app, "distlock");
    assert_eq!(
        sandbox.try_run(&name),
        Some(75),
        "busy while distlock holds it"
    );
    signal(holder.pid(), "TERM");
    holder.wait(SLACK).expect("the holder ends on SIGTERM");
    wait_until(SLACK, "released", || {
        advisory_locks(&server, key).0.is_empty()
    });

    let sql = format!(
        "SELECT pg_advisory_lock({}); SELECT pg_sleep(60)",
        advisory_key(&name)
    );
    let _psql = Proc::spawn(server.psql_command(&sql).stdout(Stdio::null()));
    wait_until(SLACK, "psql holds the key", || {
        advisory_locks(&server, key).0.len() == 1
    });
    assert_eq!(sandbox.try_run(&name), Some(75), "busy while psql holds it");

    // `?key=` locks a numeric key chosen by another application.
    let keyed = Sandbox::new(format!("{}?key=4242", server.url()));
    let (mut holder, _) = keyed.hold(&unique("keyed"));
    assert_eq!(
        advisory_locks(&server, AdvisoryKey::Single(4242)).0.len(),
        1
    );
    signal(holder.pid(), "TERM");
    holder.wait(SLACK).expect("ends");
}

/// `pg_terminate_backend` of the holder's session: the command is stopped and `distlock` exits 76
/// within one second (the driver sees the connection end at once).
#[test]
fn pg_terminate_backend_stops_the_command_exit_76_fault() {
    for mode in ["advisory", "row"] {
        let server = PostgresServer::start_or_panic();
        let sandbox = Sandbox::new(format!("{}?mode={mode}", server.url()));
        let name = unique("terminate");
        let (mut holder, child_pid) = sandbox.hold(&name);
        let terminated = server
            .psql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'distlock' AND pid <> pg_backend_pid() \
                 AND (backend_xid IS NOT NULL OR pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'))",
            )
            .unwrap();
        let at = Instant::now();
        assert_eq!(terminated, "1", "{mode}: one holder session");
        let status = holder.wait(SLACK).unwrap_or_else(|| {
            panic!("{mode}: distlock still runs after its session was terminated")
        });
        let took = at.elapsed();
        assert_eq!(
            status.code(),
            Some(76),
            "{mode}: {status}: {}",
            sandbox.stderr()
        );
        assert_eq!(
            read(&sandbox.path("term")),
            "TERM",
            "{mode}: the command got no SIGTERM"
        );
        assert!(
            !is_alive(child_pid),
            "{mode}: the command outlived distlock"
        );
        assert!(
            took <= Duration::from_secs(1),
            "{mode}: exit 76 took {took:?}"
        );
        eprintln!("{mode}: distlock exited 76 {took:?} after pg_terminate_backend");
    }
}

/// A SIGINT to `distlock run --wait` while it waits in the server leaves no waiting query and no
/// lock: the wait is cancelled on the server, and the name, once free, is not taken by the dead
/// waiter.
#[test]
fn sigint_during_wait_leaves_no_waiting_query_fault() {
    let server = PostgresServer::start_or_panic();
    let sandbox = Sandbox::new(server.url());
    let name = unique("sigint");
    let key = AdvisoryKey::Single(advisory_key(&name));
    let sql = format!(
        "SELECT pg_advisory_lock({}); SELECT pg_sleep(60)",
        advisory_key(&name)
    );
    let mut psql = Proc::spawn(server.psql_command(&sql).stdout(Stdio::null()));
    wait_until(SLACK, "psql holds the key", || {
        advisory_locks(&server, key).0.len() == 1
    });
    let mut waiter = Proc::spawn(&mut sandbox.run(&["--wait", "60s", &name, "--", "true"]));
    wait_until(SLACK * 2, "distlock waits in the server", || {
        advisory_locks(&server, key).1 == 1
    });
    signal(waiter.pid(), "INT");
    let status = waiter.wait(SLACK).expect("distlock ends on SIGINT");
    assert_ne!(status.code(), Some(0), "{}", sandbox.stderr());
    wait_until(Duration::from_secs(1) + SLACK, "no waiting query", || {
        advisory_locks(&server, key).1 == 0
    });
    let waiting = server
        .psql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' AND wait_event_type = 'Lock'")
        .unwrap();
    assert_eq!(waiting, "0");
    // psql's session ends (killing psql alone would leave its pg_sleep running).
    let (holders, _) = advisory_locks(&server, key);
    server
        .psql(&format!("SELECT pg_terminate_backend({})", holders[0]))
        .unwrap();
    wait_until(SLACK, "psql's lock freed", || {
        advisory_locks(&server, key).0.is_empty()
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        advisory_locks(&server, key).0.is_empty(),
        "the cancelled waiter took the lock later"
    );
    let _ = psql.wait(Duration::ZERO);
}

/// Lease mode: a SIGSTOPped `distlock run` is taken over once its lease runs out, with a higher
/// token; its late write with the old token is refused by the fence helper; on SIGCONT it finds the
/// lease gone and exits 76.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_sigstopped_holder_taken_over_late_write_refused_fault() {
    let server = PostgresServer::start_or_panic();
    let url = format!("{}?mode=lease", server.url());
    let sandbox = Sandbox::new(url.clone());
    let name = unique("sigstop");
    let (mut holder, child_pid) = sandbox.hold(&name);
    let old = FencingToken::new(read(&sandbox.path("token")).parse().unwrap());

    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE ledger (id int PRIMARY KEY, v text, fence_token bigint NOT NULL DEFAULT 0); \
             INSERT INTO ledger (id, v) VALUES (1, 'init')",
        )
        .await
        .unwrap();
    let update = FencedUpdate::new("ledger", "fence_token", "v = $2", "id = $3");
    assert_eq!(
        execute_fenced(&client, &update, old, &[&"old holder", &1])
            .await
            .unwrap(),
        Fenced::Applied(1)
    );

    signal(holder.pid(), "STOP");
    let stopped = Instant::now();
    let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(1) * 2 + SLACK)
        .acquire()
        .await
        .expect("taken over once the stopped holder's lease ran out");
    assert!(
        stopped.elapsed() >= Duration::from_millis(600),
        "taken over inside the lease"
    );
    let new = guard.token().unwrap();
    assert!(new > old, "token {new} after {old}");
    assert_eq!(
        execute_fenced(&client, &update, new, &[&"new holder", &1])
            .await
            .unwrap(),
        Fenced::Applied(1)
    );
    assert_eq!(
        execute_fenced(&client, &update, old, &[&"late write", &1])
            .await
            .unwrap(),
        Fenced::Refused,
        "the stale holder's write went through"
    );
    let v: String = client
        .query_one("SELECT v FROM ledger WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, "new holder");

    signal(holder.pid(), "CONT");
    let status = holder.wait(SLACK).expect("the resumed holder ends");
    assert_eq!(status.code(), Some(76), "{status}: {}", sandbox.stderr());
    assert!(!is_alive(child_pid));
    guard.release().await.unwrap();
}
