//! The server-enforced loss deadline of connection-bound locks (advisory and row modes), under a
//! fault-proxy blackhole: the client's guard is Lost at its validity deadline, and the server frees
//! the lock (ends the idle session) no earlier than that deadline and within the lease of the last
//! confirmed probe (plus slack for the server's timer and a loaded machine).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::{LockState, Locks};
use distlock_sql::postgres::layout::{advisory_key, pg_locks_row};
use distlock_sql::postgres::PostgresBackend;
use distlock_sql::AdvisoryKey;
use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::proxy::Proxy;

/// A short lease is the tight case, so the default (30 s) needs no run of its own: the server ends the
/// idle session `idle_session_timeout` = the lease (in ms) after the last statement it received, while
/// the guard's deadline is the last confirmed probe's send time + 0.99 × lease − 2 ms; the margin between
/// the two (0.01 × lease + 2 ms) only grows with the lease.
const LEASE: Duration = Duration::from_secs(2);

fn held_on_server(server: &PostgresServer, mode: &str, name: &str) -> bool {
    let sql = if mode == "advisory" {
        let (classid, objid, objsubid) = pg_locks_row(AdvisoryKey::Single(advisory_key(name)));
        format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}"
        )
    } else {
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
         AND state = 'idle in transaction'"
            .to_string()
    };
    server.psql(&sql).unwrap() != "0"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_holder_is_lost_at_its_deadline_and_freed_by_the_server_fault() {
    for mode in ["advisory", "row"] {
        let server = PostgresServer::start_or_panic();
        let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
        let url = format!("{}?mode={mode}", server.url_for(proxy.addr()));
        let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
        let name = format!("loss/{mode}");
        let guard = locks
            .lock(&name)
            .unwrap()
            .options()
            .lease(LEASE)
            .acquire()
            .await
            .unwrap();
        // Let a probe or two confirm the hold.
        tokio::time::sleep(LEASE / 2).await;
        assert_eq!(guard.state(), LockState::Held);
        let deadline = guard.validity_deadline().expect("a loss deadline");
        let last_confirmed = deadline.checked_sub(LEASE).unwrap();
        tokio::task::spawn_blocking({
            let p = proxy.clone();
            move || p.blackhole().unwrap()
        })
        .await
        .unwrap();
        let cut = Instant::now();
        tokio::time::timeout(LEASE * 2, guard.jeopardy())
            .await
            .expect("Jeopardy after a failed probe");
        tokio::time::timeout(LEASE * 2, guard.lost())
            .await
            .expect("Lost at the deadline");
        let lost_at = Instant::now();
        assert!(lost_at >= deadline, "Lost before the deadline");
        // The server frees it after the idle bound.
        let mut freed_at = None;
        while cut.elapsed() < LEASE * 4 {
            if !held_on_server(&server, mode, &name) {
                freed_at = Some(Instant::now());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let freed_at = freed_at.expect("the server never freed the blackholed lock");
        assert!(
            freed_at + Duration::from_millis(20) >= deadline,
            "{mode}: the server freed the lock before the client's deadline"
        );
        assert!(
            freed_at <= last_confirmed + LEASE + Duration::from_secs(2),
            "{mode}: freed {:?} after the last confirmed probe's send",
            freed_at - last_confirmed
        );
        eprintln!(
            "{mode}: cut at +0, Lost at {:?}, server freed at {:?} (lease {LEASE:?}; the deadline was {:?} after the cut)",
            lost_at - cut,
            freed_at - cut,
            deadline.saturating_duration_since(cut)
        );
        drop(guard);
    }
}

/// A try whose statement fails on the server after its lock function ran (here the fencing counter's
/// bump: a trigger sleeps 3 s, then raises), with the client cut off meanwhile, so the acquire's undo
/// cannot reach the server: the session holds the lock, and only its idle bound frees it. The probe
/// that sets the bound is a statement of its own ahead of the try, committed whatever the try does;
/// folded into the try (as session 33 and session 34 once did), the failed statement rolled the
/// bound back and the lock stayed until the server's TCP keepalive, hours at the defaults. Mutex and
/// permit, whose tries bump the counter, each on a pooled connection that keeps the bound of an
/// earlier hold with the same lease (no probe is sent then: the bound is already in force), and a
/// permit on one whose bound is another lease's (the probe sets it, ahead of the try).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_that_fails_after_taking_the_lock_while_cut_off_is_freed_within_the_lease_fault() {
    // The probe ahead of the try is the same statement for either kind: one round of it.
    for (kind, first_lease) in [("mutex", LEASE), ("permit", LEASE), ("permit", LEASE * 3)] {
        let server = PostgresServer::start_or_panic();
        let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
        let url = format!("{}?mode=advisory", server.url_for(proxy.addr()));
        let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
        let name = format!("failed-try/{kind}");
        let try_once = |locks: Locks, name: String, lease: Duration| async move {
            match kind {
                "mutex" => {
                    let lock = locks.lock(&name).unwrap();
                    lock.options().lease(lease).try_acquire().await
                }
                _ => {
                    let permit = locks.semaphore(&name, 2).unwrap().permit();
                    permit.options().lease(lease).try_acquire().await
                }
            }
        };
        // One whole cycle first (it stores the semaphore's limit): the failing try then runs on the
        // connection it handed back to the pool, with that hold's idle bound, as a later acquire's would.
        try_once(locks.clone(), name.clone(), first_lease)
            .await
            .unwrap()
            .expect("free")
            .release()
            .await
            .unwrap();
        server
            .psql(&format!(
                "CREATE FUNCTION distlock_test_fail() RETURNS trigger AS $$ \
                 BEGIN PERFORM pg_sleep(3); RAISE EXCEPTION 'injected failure after the lock'; END \
                 $$ LANGUAGE plpgsql; \
                 CREATE TRIGGER distlock_test_fail BEFORE INSERT OR UPDATE ON distlock_locks_fence \
                 FOR EACH ROW WHEN (NEW.name = '{name}') EXECUTE FUNCTION distlock_test_fail()"
            ))
            .unwrap();
        let acquire = tokio::spawn(try_once(locks.clone(), name.clone(), LEASE));
        let started = Instant::now();
        // Sleeping in the trigger, after the lock function: the moment to cut.
        let sleeping = || {
            server
                .psql(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                     AND wait_event = 'PgSleep'",
                )
                .unwrap()
                == "1"
        };
        while !(sleeping() && held_on_server(&server, "advisory", &name)) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{kind} after a {first_lease:?} hold: the try never took the lock and reached the trigger's sleep"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::task::spawn_blocking({
            let p = proxy.clone();
            move || p.blackhole().unwrap()
        })
        .await
        .unwrap();
        let cut = Instant::now();
        // The cut came while the statement still runs (so its error, and the acquire's undo, cannot
        // reach the client's side): otherwise the undo could free the lock and the case proves nothing.
        assert!(
            sleeping(),
            "{kind} after a {first_lease:?} hold: the try's statement ended before the cut"
        );
        // The statement fails within 3 s; the session's idle bound (the lease) then ends it.
        let bound = Duration::from_secs(3) + LEASE + Duration::from_secs(3);
        while held_on_server(&server, "advisory", &name) {
            assert!(
                cut.elapsed() < bound,
                "{kind} after a {first_lease:?} hold: the lock of a failed try stayed with the cut-off session \
                 past its idle bound"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Freed by the idle bound, a lease after the statement ended, not by anything sooner.
        assert!(
            cut.elapsed() >= LEASE,
            "{kind} after a {first_lease:?} hold: freed {:?} after the cut, sooner than the idle bound could",
            cut.elapsed()
        );
        eprintln!(
            "{kind} after a {first_lease:?} hold: freed {:?} after the cut",
            cut.elapsed()
        );
        acquire.abort();
    }
}

/// The pids of distlock's sessions on `server`.
fn distlock_sessions(server: &PostgresServer) -> Vec<String> {
    let pids = server
        .psql("SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity WHERE application_name = 'distlock'")
        .unwrap();
    pids.split(',')
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

/// A released connection goes back to the idle pool with its idle bound (the lease) still set, so the
/// next try with that lease sends no probe; the pool resets the bound once the connection has waited
/// half of it, before the server would end the idle session. Here the pooled sessions outlive three
/// leases of idleness (without the reset the server ends each at one), and the next acquire, on one of
/// them, works. The reset is timed by the bound itself (half of it), so the default lease (30 s) runs
/// the same mechanism 15 s later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_connections_outlive_their_idle_bound() {
    let server = PostgresServer::start_or_panic();
    let url = format!("{}?mode=advisory", server.url());
    let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
    let lease = Duration::from_secs(1);
    // A cycle of each kind, each release handing its connection back with the bound of its lease.
    for kind in ["mutex", "read", "permit"] {
        let name = format!("pooled/{kind}");
        match kind {
            "mutex" => {
                let lock = locks.lock(&name).unwrap();
                let guard = lock.options().lease(lease).try_acquire().await.unwrap();
                guard.expect("free").release().await.unwrap();
            }
            "read" => {
                let rw = locks.read_write(&name).unwrap();
                let guard = rw
                    .reader()
                    .options()
                    .lease(lease)
                    .try_acquire()
                    .await
                    .unwrap();
                guard.expect("free").release().await.unwrap();
            }
            _ => {
                let permit = locks.semaphore(&name, 2).unwrap().permit();
                let guard = permit.options().lease(lease).try_acquire().await.unwrap();
                guard.expect("free").release().await.unwrap();
            }
        }
    }
    let before = distlock_sessions(&server);
    assert!(!before.is_empty(), "no distlock session on the server");
    tokio::time::sleep(lease * 3).await;
    let after = distlock_sessions(&server);
    for pid in &before {
        assert!(
            after.contains(pid),
            "session {pid} was ended while idle in the pool (before {before:?}, after {after:?})"
        );
    }
    let again = locks.lock("pooled/mutex").unwrap();
    let guard = again.options().lease(lease).try_acquire().await.unwrap();
    guard.expect("free").release().await.unwrap();
}

/// A try on a pooled connection whose session the server ended while it waited in the pool, before
/// the driver read the close (here the runtime's one thread is busy while the session is terminated),
/// runs again on a new connection instead of failing: nothing was held on the ended session.
#[tokio::test(flavor = "current_thread")]
async fn a_try_on_a_pooled_connection_the_server_ended_runs_on_a_new_one() {
    let server = PostgresServer::start_or_panic();
    let url = format!("{}?mode=advisory", server.url());
    let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
    for kind in ["mutex", "permit"] {
        let name = format!("ended/{kind}");
        let cycle = |locks: Locks, name: String| async move {
            let guard = match kind {
                "mutex" => locks.lock(&name).unwrap().try_acquire().await,
                _ => {
                    locks
                        .semaphore(&name, 2)
                        .unwrap()
                        .permit()
                        .try_acquire()
                        .await
                }
            };
            guard
        };
        cycle(locks.clone(), name.clone())
            .await
            .unwrap()
            .expect("free")
            .release()
            .await
            .unwrap();
        // Blocking calls: the driver tasks cannot run until the try below awaits.
        let ended = server
            .psql(
                "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity \
                 WHERE application_name = 'distlock' AND state = 'idle'",
            )
            .unwrap();
        assert_ne!(ended, "0", "{kind}: no idle distlock session to end");
        let guard = cycle(locks.clone(), name.clone())
            .await
            .unwrap_or_else(|e| {
                panic!("{kind}: the try failed on the ended pooled connection: {e}")
            })
            .expect("free");
        guard.release().await.unwrap();
    }
}
