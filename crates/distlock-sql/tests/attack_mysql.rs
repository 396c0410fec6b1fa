//! Adversarial review of the MariaDB backend: cancelled waits racing their `KILL QUERY` and the
//! holder's release, pooled sessions that might still hold a lock, a cut-off holder at the default
//! lease, a release after `KILL`, and the shared process-tree scenarios of `distlock run`
//! (`distlock-cli/tests/tree`) on `mysql://`.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockState, Locks};
use distlock_sql::mysql::advisory_name;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::proxy::Proxy;

mod common;

#[path = "../../distlock-cli/tests/tree/mod.rs"]
mod tree;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("attack/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// Spawns an acquire of `name` (20 s wait) and returns once its wait is in the server.
async fn spawn_waiting_acquire(
    locks: &Locks,
    name: &str,
    server: &MariaDbServer,
) -> tokio::task::JoinHandle<distlock_core::Result<distlock_core::LockGuard>> {
    let waiter = {
        let locks = locks.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            locks
                .lock(&name)
                .unwrap()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
        })
    };
    let started = Instant::now();
    while !running_statements(server).contains("GET_LOCK") {
        assert!(
            started.elapsed() < SLACK,
            "the waiter never waited in the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    waiter
}

fn held_by(server: &MariaDbServer, name: &str) -> Option<u64> {
    server
        .sql(&format!("SELECT IS_USED_LOCK('{}')", advisory_name(name)))
        .expect("IS_USED_LOCK")
        .trim()
        .parse()
        .ok()
}

/// Statements of other sessions still running (a wait left in the server).
fn running_statements(server: &MariaDbServer) -> String {
    server
        .sql(
            "SELECT GROUP_CONCAT(CONCAT(ID, ':', INFO) SEPARATOR ' | ') FROM information_schema.PROCESSLIST \
             WHERE INFO IS NOT NULL AND ID <> CONNECTION_ID()",
        )
        .expect("processlist")
        .trim()
        .to_string()
}

async fn backend(url: &str) -> Locks {
    Locks::new(distlock_sql::mysql::connect(url).await.expect("connect"))
}

/// An acquire that gives up while its wait is in the server (wait limits from none to tens of
/// milliseconds, so the `KILL QUERY` lands before, during and after the wait statement) never takes
/// the lock later nor leaves a wait running: once the holder releases, a third party takes the name at
/// once, and no statement of the waiter is left in the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_never_take_the_lock_later_nor_leave_a_wait_running() {
    let server = MariaDbServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let url = format!("{}?mode={mode}", server.url());
        let holder = backend(&url).await;
        let waiter = backend(&url).await;
        let third = backend(&url).await;
        for wait_ms in [0u64, 1, 2, 3, 5, 8, 13, 21, 34, 55] {
            let name = unique(&format!("cancel/{mode}/{wait_ms}"));
            common::cancelled_wait_round(
                [&holder, &waiter, &third],
                &name,
                &format!("{mode}/{wait_ms}"),
                wait_ms,
                // The abandon (KILL QUERY) runs in the background.
                Duration::from_millis(200),
                SLACK,
                || running_statements(&server),
            )
            .await;
            let running = running_statements(&server);
            assert!(
                running.is_empty() || running == "NULL",
                "{mode}/{wait_ms}: left running: {running}"
            );
        }
    }
}

/// A holder cut off by a fault-proxy blackhole at the DEFAULT lease (30 s): Lost no later than the
/// server frees the lock by `wait_timeout`, and the server frees it no earlier than the guard's
/// validity deadline. Advisory and row modes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_holder_at_the_default_lease_is_lost_before_the_server_frees_it_fault() {
    let server = MariaDbServer::start_or_panic();
    let cases = ["advisory", "row"].map(|mode| {
        let server = &server;
        async move {
            let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
            let url = format!("{}?mode={mode}", server.url_via(proxy.addr()));
            let locks = backend(&url).await;
            let name = unique(&format!("default-lease/{mode}"));
            let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
            let lease = Duration::from_secs(30);
            tokio::time::sleep(Duration::from_secs(11)).await;
            assert_eq!(guard.state(), LockState::Held, "{mode}");
            let id = guard_session(server, mode, &name);
            tokio::task::spawn_blocking({
                let p = proxy.clone();
                move || p.blackhole().unwrap()
            })
            .await
            .unwrap();
            let cut = Instant::now();
            let mut deadline = guard.validity_deadline().expect("a validity deadline");
            let mut lost_at = None;
            let mut freed_at = None;
            while cut.elapsed() < lease * 2 + SLACK && freed_at.is_none() {
                if let Some(d) = guard.validity_deadline() {
                    deadline = d;
                }
                if lost_at.is_none() && guard.state() == LockState::Lost {
                    lost_at = Some(Instant::now());
                }
                let alive = server
                    .sql(&format!(
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {id}"
                    ))
                    .unwrap();
                if alive.trim() == "0" {
                    freed_at = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let freed_at = freed_at.unwrap_or_else(|| panic!("{mode}: never freed by the server"));
            let lost_at =
                lost_at.unwrap_or_else(|| panic!("{mode}: not Lost when the server freed it"));
            eprintln!(
                "{mode}: deadline {:?}, Lost {:?}, freed {:?} after the cut",
                deadline.saturating_duration_since(cut),
                lost_at - cut,
                freed_at - cut
            );
            assert!(
                lost_at <= freed_at,
                "{mode}: Lost after the server freed the lock"
            );
            assert!(
                freed_at >= deadline,
                "{mode}: freed before the guard's deadline"
            );
        }
    });
    let [a, b] = cases;
    tokio::join!(a, b);
}

/// The server-side id of the session holding `name` (advisory: `IS_USED_LOCK`; row: the one session
/// of the root user in a transaction that holds a row lock).
fn guard_session(server: &MariaDbServer, mode: &str, name: &str) -> u64 {
    if mode == "advisory" {
        return held_by(server, name).expect("held");
    }
    server
        .sql(
            "SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX \
             WHERE trx_rows_locked > 0 LIMIT 1",
        )
        .unwrap()
        .trim()
        .parse()
        .expect("a row-lock holder")
}

/// A release after the server killed the holder's session is never reported released, and the name
/// is free for another holder with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_kill_of_the_session_is_not_released_fault() {
    let server = MariaDbServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let url = format!("{}?mode={mode}", server.url());
        let locks = backend(&url).await;
        let name = unique(&format!("killed/{mode}"));
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        let first = guard.token().unwrap();
        let id = guard_session(&server, mode, &name);
        server.sql(&format!("KILL {id}")).unwrap();
        tokio::time::timeout(SLACK, guard.lost())
            .await
            .expect("Lost");
        let released = guard.release().await;
        assert!(released.is_err(), "{mode}: a lost hold released Ok");
        // The server frees the killed session's locks once its thread has ended, which may be a
        // moment after the client saw the connection end (as on PostgreSQL, where CI caught it).
        let next = locks
            .lock(&name)
            .unwrap()
            .options()
            .wait(SLACK)
            .acquire()
            .await
            .expect("free once the killed session has ended");
        assert!(next.token().unwrap() > first, "{mode}: token not higher");
        next.release().await.unwrap();
    }
}

/// `distlock run --url mysql://…`: every shape of descendant dies before the next holder starts.
fn tree_dies_before_the_next_holder(ending: tree::Ending) {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    for shape in tree::SHAPES {
        let dir = distlock_testkit::process::temp_dir("my-attack").unwrap();
        let run = |args: &[&str]| {
            let mut command = Command::new(distlock_bin().expect("the distlock binary"));
            command
                .current_dir(dir.path())
                .env_remove("DISTLOCK_URL")
                .env_remove("DISTLOCK_TOKEN")
                .env_remove("RUST_LOG")
                .args(["run", "--url", &url, "--lease", "1s"])
                .args(args)
                .stderr(Stdio::null());
            command
        };
        let lose = |name: &str| {
            let id = held_by(&server, name).expect("held");
            server.sql(&format!("KILL {id}")).unwrap();
        };
        tree::check(shape, ending, dir.path(), &unique("tree"), &run, &lose);
    }
}

#[test]
fn mysql_run_on_loss_the_whole_tree_dies_before_run_exits_fault() {
    tree_dies_before_the_next_holder(tree::Ending::Loss);
}

#[test]
fn mysql_run_a_sigkilled_runs_whole_tree_dies_before_the_next_holder_fault() {
    tree_dies_before_the_next_holder(tree::Ending::KillDistlock);
}

#[test]
fn mysql_run_leftover_descendants_die_before_the_release() {
    tree_dies_before_the_next_holder(tree::Ending::CommandExits);
}

/// A lease longer than the server's largest `wait_timeout` (31,536,000 s: MariaDB and MySQL clamp a
/// larger value with only a warning) cannot get a server-enforced loss deadline: the server would end
/// a cut-off holder's session (freeing the lock) a year after its last probe while the guard still
/// counts on its longer lease. Such an acquire is refused as bad input, and leaves nothing locked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_beyond_the_servers_wait_timeout_is_refused_and_leaves_nothing_locked() {
    let server = MariaDbServer::start_or_panic();
    // The clamp this guards against.
    let clamped = server
        .sql("SET SESSION wait_timeout = 34560000; SELECT @@wait_timeout")
        .unwrap();
    assert_eq!(clamped.trim(), "31536000");
    for mode in ["advisory", "row"] {
        let locks = backend(&format!("{}?mode={mode}", server.url())).await;
        let name = unique(&format!("long-lease/{mode}"));
        let got = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(Duration::from_secs(400 * 24 * 3600))
            .try_acquire()
            .await;
        let err = got.expect_err("a 400-day lease the server cannot enforce was granted");
        assert_eq!(
            err.kind(),
            distlock_core::ErrorKind::InvalidConfig,
            "{mode}: {err}"
        );
        assert!(err.to_string().contains("wait_timeout"), "{mode}: {err}");
        assert_eq!(held_by(&server, &name), None, "{mode}: left locked");
        // The name is free for a normal lease.
        let g = locks.lock(&name).unwrap().try_acquire().await.unwrap();
        g.expect("free").release().await.unwrap();
    }
}

/// The advisory try sends `GET_LOCK` and the counter bump in one multi-statement query: when the bump
/// fails after `GET_LOCK` got the lock, the acquire must fail and the session (dropped, never pooled)
/// must not keep the lock. Likewise when the bump after a won wait fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_bump_fails_the_acquire_and_leaves_the_lock_free() {
    let server = MariaDbServer::start_or_panic();
    let locks = backend(&server.url()).await;
    let holder = backend(&server.url()).await;
    let other = backend(&server.url()).await;
    let refuse = "CREATE TRIGGER distlock.refuse_insert BEFORE INSERT ON distlock.distlock_locks FOR EACH ROW \
                  SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'; \
                  CREATE TRIGGER distlock.refuse_update BEFORE UPDATE ON distlock.distlock_locks FOR EACH ROW \
                  SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'";
    let allow = "DROP TRIGGER distlock.refuse_insert; DROP TRIGGER distlock.refuse_update";
    let freed = |name: &str| {
        let started = Instant::now();
        while held_by(&server, name).is_some() {
            assert!(started.elapsed() < SLACK, "the lock of {name} stayed held");
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    // The try path.
    let name = unique("bump-fails/try");
    server.sql(refuse).unwrap();
    let err = locks.lock(&name).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    freed(&name);
    server.sql(allow).unwrap();
    let g = other.lock(&name).unwrap().try_acquire().await.unwrap();
    g.expect("the name is free").release().await.unwrap();

    // The wait path.
    let name = unique("bump-fails/wait");
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let waiter = spawn_waiting_acquire(&locks, &name, &server).await;
    server.sql(refuse).unwrap();
    held.release().await.unwrap();
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    freed(&name);
    server.sql(allow).unwrap();
    let g = other.lock(&name).unwrap().try_acquire().await.unwrap();
    g.expect("the name is free").release().await.unwrap();

    // Row mode (issue 24, scenario 14): the bump, on another session, is refused after the lock row
    // was locked: the acquire fails and the row is not left locked (the lock's session is dropped,
    // rolling its transaction back): the next client gets it within the slack.
    let row_url = format!("{}?mode=row", server.url());
    let (row_a, row_b) = (backend(&row_url).await, backend(&row_url).await);
    let name = unique("bump-fails/row");
    let g = row_a.lock(&name).unwrap().try_acquire().await.unwrap();
    g.expect("the name is free").release().await.unwrap(); // the rows exist now
    server
        .sql(
            "CREATE TRIGGER distlock.refuse_update BEFORE UPDATE ON distlock.distlock_locks FOR EACH ROW \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'",
        )
        .unwrap();
    let err = row_a.lock(&name).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "row: {err}");
    server.sql("DROP TRIGGER distlock.refuse_update").unwrap();
    let started = Instant::now();
    let g = row_b
        .lock(&name)
        .unwrap()
        .options()
        .wait(SLACK)
        .acquire()
        .await
        .expect("row: the lock row was left locked by the failed acquire");
    eprintln!(
        "row: the lock row was free {:?} after the failed acquire",
        started.elapsed()
    );
    g.release().await.unwrap();
}

/// The multi-statement try's partial failure (GET_LOCK got the lock, the bump failed), and a bump that
/// fails after a won wait: the moment the acquire reports its error, the lock must be free (read on a
/// connection of the test's own, in-process, no retry), not left to the server noticing a closed
/// socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_bump_leaves_the_lock_free_at_once() {
    use distlock_sql::mysql::mysql_async::{self, prelude::Queryable as _};
    let server = MariaDbServer::start_or_panic();
    let locks = backend(&server.url()).await;
    let holder = backend(&server.url()).await;
    // Create the tables.
    let g = locks
        .lock(&unique("warm"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    g.release().await.unwrap();
    let mut probe = mysql_async::Conn::from_url(server.url().replacen("mariadb://", "mysql://", 1))
        .await
        .unwrap();
    let refuse = "CREATE TRIGGER distlock.refuse_insert BEFORE INSERT ON distlock.distlock_locks FOR EACH ROW \
                  SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'; \
                  CREATE TRIGGER distlock.refuse_update BEFORE UPDATE ON distlock.distlock_locks FOR EACH ROW \
                  SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'";
    let allow = "DROP TRIGGER distlock.refuse_insert; DROP TRIGGER distlock.refuse_update";
    server.sql(refuse).unwrap();
    for round in 0..5 {
        let name = unique(&format!("bump-fails-at-once/try/{round}"));
        let err = locks.lock(&name).unwrap().try_acquire().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        let used: Option<Option<u64>> = probe
            .query_first(format!("SELECT IS_USED_LOCK('{}')", advisory_name(&name)))
            .await
            .unwrap();
        assert_eq!(
            used.flatten(),
            None,
            "try {round}: the failed try's session still held the lock"
        );
    }
    for round in 0..3 {
        let name = unique(&format!("bump-fails-at-once/wait/{round}"));
        server.sql(allow).unwrap();
        let held = holder.lock(&name).unwrap().acquire().await.unwrap();
        server.sql(refuse).unwrap();
        let waiter = spawn_waiting_acquire(&locks, &name, &server).await;
        held.release().await.unwrap();
        let err = waiter.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        let used: Option<Option<u64>> = probe
            .query_first(format!("SELECT IS_USED_LOCK('{}')", advisory_name(&name)))
            .await
            .unwrap();
        assert_eq!(
            used.flatten(),
            None,
            "wait {round}: the failed wait's session still held the lock"
        );
    }
    server.sql(allow).unwrap();
}
