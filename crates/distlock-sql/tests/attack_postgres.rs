//! Adversarial review of the PostgreSQL backend: a cut-off holder at the default lease, cancelled
//! waits racing the holder's release, pooled connections that might still hold a lock, releases of a
//! session the server ended, the resource-side fence helper at the edge of its token range, and the
//! shared process-tree scenarios of `distlock run` (`distlock-cli/tests/tree`) on `postgres://`.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, FencingToken, LockState, Locks};
use distlock_sql::postgres::fence::{execute_fenced, Fenced, FencedUpdate};
use distlock_sql::postgres::layout::{advisory_key, pg_locks_row};
use distlock_sql::postgres::{tokio_postgres, PostgresBackend};
use distlock_sql::AdvisoryKey;
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::postgres::PostgresServer;
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
    server: &PostgresServer,
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
    while distlock_server_state(server).ends_with("0 waiting") {
        assert!(
            started.elapsed() < SLACK,
            "the waiter never waited in the server"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    waiter
}

/// Granted `pg_locks` rows of the name's advisory key, any session.
fn advisory_holders(server: &PostgresServer, name: &str) -> usize {
    let (classid, objid, objsubid) = pg_locks_row(AdvisoryKey::Single(advisory_key(name)));
    server
        .psql(&format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}"
        ))
        .unwrap()
        .parse()
        .unwrap()
}

/// Every advisory lock and open transaction of a `distlock` session, and every waiting statement.
fn distlock_server_state(server: &PostgresServer) -> String {
    server
        .psql(
            "SELECT (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                     WHERE l.locktype = 'advisory' AND a.application_name = 'distlock') || ' advisory, ' || \
                    (SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                     AND state LIKE 'idle in transaction%') || ' in transaction, ' || \
                    (SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                     AND wait_event_type = 'Lock') || ' waiting'",
        )
        .unwrap()
}

async fn backend(url: &str) -> Locks {
    Locks::new(PostgresBackend::connect(url).await.unwrap())
}

/// A holder cut off by a fault-proxy blackhole at the DEFAULT lease (30 s): the guard is Lost at its
/// validity deadline, and that is no later than the server frees the lock (P2); the server frees it
/// within the lease of the last confirmed probe's send (plus slack). Both session modes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_holder_at_the_default_lease_is_lost_before_the_server_frees_it_fault() {
    let server = PostgresServer::start_or_panic();
    let cases = ["advisory", "row"].map(|mode| {
        let server = &server;
        async move {
            let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
            let url = format!("{}?mode={mode}", server.url_for(proxy.addr()));
            let locks = backend(&url).await;
            let name = unique(&format!("default-lease/{mode}"));
            let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
            let lease = Duration::from_secs(30);
            // Past the first renewal (a third of the lease), so the deadline counts from a probe.
            tokio::time::sleep(Duration::from_secs(11)).await;
            assert_eq!(guard.state(), LockState::Held, "{mode}");
            tokio::task::spawn_blocking({
                let p = proxy.clone();
                move || p.blackhole().unwrap()
            })
            .await
            .unwrap();
            let cut = Instant::now();
            // The deadline as of the last confirmed probe (nothing sent after the cut is confirmed).
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
                let held = if mode == "advisory" {
                    advisory_holders(server, &name) > 0
                } else {
                    server
                        .psql(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                             AND state LIKE 'idle in transaction%'",
                        )
                        .unwrap()
                        != "0"
                };
                if !held {
                    freed_at = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let freed_at = freed_at.unwrap_or_else(|| panic!("{mode}: never freed by the server"));
            let lost_at = lost_at.unwrap_or_else(|| panic!("{mode}: not Lost when the server freed it"));
            eprintln!(
                "{mode}: deadline {:?}, Lost {:?}, freed {:?} after the cut",
                deadline.saturating_duration_since(cut),
                lost_at - cut,
                freed_at - cut
            );
            assert!(lost_at <= freed_at, "{mode}: Lost after the server freed the lock");
            assert!(freed_at >= deadline, "{mode}: freed before the guard's deadline");
            assert!(
                freed_at <= deadline + lease / 10 + SLACK,
                "{mode}: freed {:?} after the deadline",
                freed_at - deadline
            );
        }
    });
    let [a, b] = cases;
    tokio::join!(a, b);
}

/// An acquire that gives up while its wait is in the server (every wait limit from none to some
/// tens of milliseconds, so the give-up lands before, during and after the wait statement is sent)
/// never takes the lock later: once the holder releases, a third party takes it at once, and no
/// `distlock` session of the waiter's backend (its pooled connections included) holds anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_never_take_the_lock_later_nor_leave_it_on_a_pooled_connection() {
    let server = PostgresServer::start_or_panic();
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
                // The abandon runs in the background: give it the cancel's bound.
                Duration::from_millis(100),
                SLACK,
                || distlock_server_state(&server),
            )
            .await;
            if mode == "advisory" {
                assert_eq!(advisory_holders(&server, &name), 0, "{mode}/{wait_ms}");
            }
        }
        // Nothing left by any of it.
        let started = Instant::now();
        loop {
            let state = distlock_server_state(&server);
            if state == "0 advisory, 0 in transaction, 0 waiting" {
                break;
            }
            assert!(started.elapsed() < SLACK, "{mode}: left behind: {state}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A release after the server ended the holder's session (`pg_terminate_backend`) is never
/// `Released`; a second release is `NotHeld`; and the name is then free for another holder with a
/// higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_the_session_was_terminated_is_not_released_fault() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let url = format!("{}?mode={mode}", server.url());
        let locks = backend(&url).await;
        let name = unique(&format!("terminated/{mode}"));
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        let first = guard.token().unwrap();
        server
            .psql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE application_name = 'distlock' AND pid <> pg_backend_pid() \
                 AND (backend_xid IS NOT NULL OR pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'))",
            )
            .unwrap();
        tokio::time::timeout(SLACK, guard.lost())
            .await
            .expect("Lost");
        let released = guard.release().await;
        assert!(released.is_err(), "{mode}: a lost hold released Ok");
        // The server frees the terminated session's locks when its backend process has ended, a
        // moment after the client saw the connection end (CI, row mode: `FOR UPDATE NOWAIT` found
        // the row still locked): a wait bounded by the slack, not a try.
        let next = locks
            .lock(&name)
            .unwrap()
            .options()
            .wait(SLACK)
            .acquire()
            .await
            .expect("free once the terminated session has ended");
        assert!(next.token().unwrap() > first, "{mode}: token not higher");
        next.release().await.unwrap();
    }
}

/// The resource-side helper with a token beyond `i64::MAX` (another backend's `u64` token): the
/// docs promise a parameter error; it must never be clamped so that a lower token passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_helper_never_clamps_a_token_beyond_i64_max() {
    let server = PostgresServer::start_or_panic();
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE res (id int PRIMARY KEY, v int NOT NULL, fence_token bigint NOT NULL DEFAULT 0); \
             INSERT INTO res (id, v) VALUES (1, 0)",
        )
        .await
        .unwrap();
    let update = FencedUpdate::new("res", "fence_token", "v = $2", "id = $3");
    let newer = FencingToken::new(u64::MAX);
    let older = FencingToken::new(u64::MAX - 1);
    let first = execute_fenced(&client, &update, newer, &[&1, &1]).await;
    assert!(first.is_err(), "token beyond i64::MAX accepted: {first:?}");
    let stale = execute_fenced(&client, &update, older, &[&2, &1]).await;
    assert!(
        !matches!(stale, Ok(Fenced::Applied(_))),
        "a lower token than the last one was applied: {stale:?}"
    );
}

/// `distlock run --url postgres://…`: every shape of descendant the command starts dies before the
/// next holder starts, whether `distlock` is SIGKILLed, the lock is lost (the holder's session
/// terminated by `pg_terminate_backend`), or the command exits leaving them.
fn tree_dies_before_the_next_holder(mode: &str, ending: tree::Ending) {
    let server = PostgresServer::start_or_panic();
    let url = format!("{}?mode={mode}", server.url());
    for shape in tree::SHAPES {
        let dir = distlock_testkit::process::temp_dir("pg-attack").unwrap();
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
        let lose = |_: &str| {
            let killed = server
                .psql(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = 'distlock' AND pid <> pg_backend_pid() \
                     AND (backend_xid IS NOT NULL OR pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'))",
                )
                .unwrap();
            assert_eq!(killed, "1", "{mode}: one holder session");
        };
        tree::check(shape, ending, dir.path(), &unique("tree"), &run, &lose);
    }
}

#[test]
fn postgres_run_on_loss_the_whole_tree_dies_before_run_exits_fault() {
    tree_dies_before_the_next_holder("advisory", tree::Ending::Loss);
    tree_dies_before_the_next_holder("row", tree::Ending::Loss);
}

#[test]
fn postgres_run_a_sigkilled_runs_whole_tree_dies_before_the_next_holder_fault() {
    tree_dies_before_the_next_holder("advisory", tree::Ending::KillDistlock);
}

#[test]
fn postgres_run_leftover_descendants_die_before_the_release() {
    tree_dies_before_the_next_holder("advisory", tree::Ending::CommandExits);
}

/// A lease longer than `idle_session_timeout` can hold (2,147,483,647 ms, about 24.8 days) cannot get
/// a server-enforced loss deadline: such an acquire is refused as bad input (InvalidConfig naming the
/// limit, not a transient-looking server error), before any statement is sent (no fencing token is
/// spent), and leaves nothing locked. The mutex in both session modes, and a permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_beyond_idle_session_timeouts_range_is_refused_and_leaves_nothing_locked() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let locks = backend(&format!("{}?mode={mode}", server.url())).await;
        let name = unique(&format!("long-lease/{mode}"));
        let got = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(Duration::from_secs(30 * 24 * 3600))
            .try_acquire()
            .await;
        let err = got.expect_err("a 30-day lease the server cannot enforce was granted");
        assert_eq!(
            err.kind(),
            distlock_core::ErrorKind::InvalidConfig,
            "{mode}: {err}"
        );
        assert!(
            err.to_string().contains("idle_session_timeout"),
            "{mode}: {err}"
        );
        assert_eq!(advisory_holders(&server, &name), 0, "{mode}: left locked");
        // Refused before any statement went out: no try ran, so no fencing token was spent.
        let tokens_spent = || {
            server
                .psql(&format!(
                    "SELECT count(*) FROM distlock_locks_fence WHERE name = '{name}'"
                ))
                .unwrap()
        };
        assert_eq!(
            tokens_spent(),
            "0",
            "{mode}: the refused acquire bumped the counter"
        );
        if mode == "advisory" {
            let permit = locks.semaphore(&name, 2).unwrap().permit();
            let err = permit
                .options()
                .lease(Duration::from_secs(30 * 24 * 3600))
                .try_acquire()
                .await
                .expect_err("a 30-day permit the server cannot enforce was granted");
            assert_eq!(err.kind(), distlock_core::ErrorKind::InvalidConfig, "{err}");
            assert_eq!(
                tokens_spent(),
                "0",
                "permit: the refused acquire bumped the counter"
            );
        }
        let g = locks.lock(&name).unwrap().try_acquire().await.unwrap();
        g.expect("free").release().await.unwrap();
        let state = distlock_server_state(&server);
        assert_eq!(state, "0 advisory, 0 in transaction, 0 waiting", "{mode}");
    }
}

/// The advisory try takes the lock and bumps the counter in one statement, and a session advisory lock
/// ignores transactions: when the bump fails, the acquire must fail and the lock must not stay with the
/// session (its connection is closed, never pooled). Likewise after a won wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_bump_fails_the_acquire_and_leaves_the_lock_free() {
    let server = PostgresServer::start_or_panic();
    let locks = backend(&server.url()).await;
    let holder = backend(&server.url()).await;
    let other = backend(&server.url()).await;
    let refuse = "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
                  $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$; \
                  CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON distlock_locks_fence \
                  FOR EACH ROW EXECUTE FUNCTION refuse()";
    let allow = "DROP TRIGGER refuse ON distlock_locks_fence; DROP FUNCTION refuse()";

    // The try path.
    let name = unique("bump-fails/try");
    server.psql(refuse).unwrap();
    let err = locks.lock(&name).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let started = Instant::now();
    while advisory_holders(&server, &name) != 0 {
        assert!(
            started.elapsed() < SLACK,
            "the failed try's lock stayed held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.psql(allow).unwrap();
    let g = other.lock(&name).unwrap().try_acquire().await.unwrap();
    g.expect("the name is free").release().await.unwrap();

    // The wait path: the bump after a won wait fails.
    let name = unique("bump-fails/wait");
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let waiter = spawn_waiting_acquire(&locks, &name, &server).await;
    server.psql(refuse).unwrap();
    held.release().await.unwrap();
    let err = waiter.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let started = Instant::now();
    while advisory_holders(&server, &name) != 0 {
        assert!(
            started.elapsed() < SLACK,
            "the failed wait's lock stayed held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.psql(allow).unwrap();
    let g = other.lock(&name).unwrap().try_acquire().await.unwrap();
    g.expect("the name is free").release().await.unwrap();
}

/// A wait given up just as its holder releases: PostgreSQL acts on a cancel request asynchronously
/// (and `cancel_query` returns once the request is written), so the waiter's server session may take
/// the lock between the give-up and the cancel. The waiter reaches the server through a delaying
/// proxy, so its cancel (and the close of its connection) lands late: the holder releases as soon as
/// the waiter's acquire returned, or concurrently around its limit. The moment both are done, a third
/// party must find the name free, and the waiter must have reported no grant it did not keep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_given_up_as_the_holder_releases_leaves_the_name_free_at_once() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let url = format!("{}?mode={mode}", server.url());
        let proxy = Proxy::start(server.addr()).unwrap();
        let waiter = backend(&format!("{}?mode={mode}", server.url_for(proxy.addr()))).await;
        let holder = backend(&url).await;
        let third = backend(&url).await;
        // Warm the waiter's pool and tables before the delay.
        let warm = waiter
            .lock(&unique("warm"))
            .unwrap()
            .acquire()
            .await
            .unwrap();
        warm.release().await.unwrap();
        proxy.delay(Duration::from_millis(40)).unwrap();
        let limit = Duration::from_millis(400);
        // `None`: release once the waiter's acquire returned; `Some(ms)`: release `ms` after the
        // waiter's limit began, concurrently.
        let schedule = [
            None,
            Some(380),
            None,
            Some(400),
            None,
            Some(420),
            None,
            Some(440),
        ];
        for (round, at) in schedule.iter().enumerate() {
            let name = unique(&format!("give-up-race/{mode}/{round}"));
            let held = holder.lock(&name).unwrap().acquire().await.unwrap();
            let started = Instant::now();
            let release = async {
                if let Some(ms) = at {
                    tokio::time::sleep_until((started + Duration::from_millis(*ms)).into()).await;
                    held.release().await.unwrap();
                    None
                } else {
                    Some(held)
                }
            };
            let lock = waiter.lock(&name).unwrap();
            let acquire = lock.options().wait(limit).acquire();
            let (got, held) = tokio::join!(acquire, release);
            match got {
                Ok(g) => g.release().await.unwrap(),
                Err(e) => assert_eq!(e.kind(), ErrorKind::Timeout, "{mode}/{round}: {e}"),
            }
            if let Some(held) = held {
                held.release().await.unwrap();
            }
            // At once: no retry.
            let taken = third.lock(&name).unwrap().try_acquire().await.unwrap();
            let taken = taken.unwrap_or_else(|| {
                panic!(
                    "{mode}/{round} ({at:?}): the given-up waiter's session held the name ({})",
                    distlock_server_state(&server)
                )
            });
            taken.release().await.unwrap();
        }
    }
}

/// As `a_failed_fence_bump_fails_the_acquire_and_leaves_the_lock_free`, but the lock must be free the
/// moment the acquire reports its error (read in-process on a connection of the test's own, no retry):
/// the session advisory lock outlives the failed statement, so the abandon must unlock it, not leave
/// it to the server noticing a closed socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_bump_leaves_the_lock_free_at_once() {
    let server = PostgresServer::start_or_panic();
    let locks = backend(&server.url()).await;
    let holder = backend(&server.url()).await;
    let g = locks
        .lock(&unique("warm"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    g.release().await.unwrap();
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let held_now = |name: String| {
        let client = &client;
        async move {
            let (classid, objid, objsubid) = pg_locks_row(AdvisoryKey::Single(advisory_key(&name)));
            let row = client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                         AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}"
                    ),
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, i64>(0)
        }
    };
    let refuse = "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
                  $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$; \
                  CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON distlock_locks_fence \
                  FOR EACH ROW EXECUTE FUNCTION refuse()";
    let allow = "DROP TRIGGER refuse ON distlock_locks_fence; DROP FUNCTION refuse()";
    server.psql(refuse).unwrap();
    for round in 0..5 {
        let name = unique(&format!("bump-fails-at-once/try/{round}"));
        let err = locks.lock(&name).unwrap().try_acquire().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert_eq!(held_now(name).await, 0, "try {round}: the lock stayed held");
    }
    for round in 0..3 {
        let name = unique(&format!("bump-fails-at-once/wait/{round}"));
        server.psql(allow).unwrap();
        let held = holder.lock(&name).unwrap().acquire().await.unwrap();
        server.psql(refuse).unwrap();
        let waiter = spawn_waiting_acquire(&locks, &name, &server).await;
        held.release().await.unwrap();
        let err = waiter.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert_eq!(
            held_now(name).await,
            0,
            "wait {round}: the lock stayed held"
        );
    }
    server.psql(allow).unwrap();
}
