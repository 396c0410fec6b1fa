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
/// permit, whose tries bump the counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_that_fails_after_taking_the_lock_while_cut_off_is_freed_within_the_lease_fault() {
    for kind in ["mutex", "permit"] {
        let server = PostgresServer::start_or_panic();
        let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
        let url = format!("{}?mode=advisory", server.url_for(proxy.addr()));
        let locks = Locks::new(PostgresBackend::connect(&url).await.unwrap());
        let name = format!("failed-try/{kind}");
        let try_once = |locks: Locks, name: String| async move {
            match kind {
                "mutex" => {
                    let lock = locks.lock(&name).unwrap();
                    lock.options().lease(LEASE).try_acquire().await
                }
                _ => {
                    let permit = locks.semaphore(&name, 2).unwrap().permit();
                    permit.options().lease(LEASE).try_acquire().await
                }
            }
        };
        // One whole cycle first (it stores the semaphore's limit): the failing try then runs on a
        // connection back from the pool, whose idle bound is off, as a later acquire's would.
        try_once(locks.clone(), name.clone())
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
        let acquire = tokio::spawn(try_once(locks.clone(), name.clone()));
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
                "{kind}: the try never took the lock and reached the trigger's sleep"
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
            "{kind}: the try's statement ended before the cut"
        );
        // The statement fails within 3 s; the session's idle bound (the lease) then ends it.
        let bound = Duration::from_secs(3) + LEASE + Duration::from_secs(3);
        while held_on_server(&server, "advisory", &name) {
            assert!(
                cut.elapsed() < bound,
                "{kind}: the lock of a failed try stayed with the cut-off session past its idle bound"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Freed by the idle bound, a lease after the statement ended, not by anything sooner.
        assert!(
            cut.elapsed() >= LEASE,
            "{kind}: freed {:?} after the cut, sooner than the idle bound could",
            cut.elapsed()
        );
        eprintln!("{kind}: freed {:?} after the cut", cut.elapsed());
        acquire.abort();
    }
}
