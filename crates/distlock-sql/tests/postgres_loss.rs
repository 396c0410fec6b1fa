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
