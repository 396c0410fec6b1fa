//! Faults at the edges of a PostgreSQL hold (issue 24): a release whose reply is lost with its
//! connection (every mode), a lease released after it expired, a waiter whose connection dies silently
//! (at the defaults), and a server whose defaults are the unfriendly ones (isolation, timeouts).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockState, Locks};
use distlock_sql::postgres::layout::{advisory_key, pg_locks_row};
use distlock_sql::postgres::PostgresBackend;
use distlock_sql::AdvisoryKey;
use distlock_testkit::postgres::PostgresServer;
use distlock_testkit::proxy::Proxy;

/// Slack for "soon" on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(5);

fn unique(case: &str) -> String {
    format!("faults/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn backend(url: &str) -> Locks {
    Locks::new(PostgresBackend::connect(url).await.unwrap())
}

/// Whether the lock of `name` is held on the server: the advisory key granted to a session, a
/// session idle in a transaction (row mode: the only open transactions are lock holders'), or the
/// lease row owned and unexpired.
fn held_on_server(server: &PostgresServer, mode: &str, name: &str) -> bool {
    let sql = match mode {
        "advisory" => {
            let (classid, objid, objsubid) = pg_locks_row(AdvisoryKey::Single(advisory_key(name)));
            format!(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}"
            )
        }
        "row" => "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                  AND state = 'idle in transaction'"
            .to_string(),
        _ => format!(
            "SELECT count(*) FROM distlock_locks WHERE name = '{name}' AND owner IS NOT NULL \
             AND expires_at > now()"
        ),
    };
    server.psql(&sql).unwrap() != "0"
}

fn waiting_on_server(server: &PostgresServer) -> bool {
    server
        .psql(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
             AND wait_event_type = 'Lock'",
        )
        .unwrap()
        != "0"
}

/// Runs `proxy` control calls off the async threads (they block until applied).
async fn control(proxy: &Arc<Proxy>, f: impl FnOnce(&Proxy) + Send + 'static) {
    let p = proxy.clone();
    tokio::task::spawn_blocking(move || f(&p)).await.unwrap();
}

/// Scenarios 8 and 9: the release reaches the server and is applied (the lock is gone there), then the
/// connection resets before the reply. The outcome is done or unknown, never `NotHeld` (the hold was
/// ours to the end). Advisory, row and lease modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_release_reply_is_ambiguous_not_not_held_fault() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row", "lease"] {
        let proxy = Arc::new(Proxy::start(server.addr()).unwrap());
        let url = format!("{}?mode={mode}", server.url_for(proxy.addr()));
        let locks = backend(&url).await;
        let name = unique(&format!("lost-reply/{mode}"));
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        assert!(held_on_server(&server, mode, &name), "{mode}: not held");
        control(&proxy, |p| p.delay(Duration::from_secs(1)).unwrap()).await;
        let release = tokio::spawn(guard.release());
        let started = Instant::now();
        while held_on_server(&server, mode, &name) {
            assert!(
                started.elapsed() < SLACK,
                "{mode}: the release never reached the server"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Applied on the server, its reply still in the proxy: lost with the connection.
        control(&proxy, |p| {
            p.pass().unwrap();
            p.reset().unwrap();
        })
        .await;
        match release.await.unwrap() {
            Ok(()) => {}
            Err(e) => assert_eq!(e.kind(), ErrorKind::Unavailable, "{mode}: {e}"),
        }
        // And the name is free for the next holder.
        let next = locks
            .lock(&name)
            .unwrap()
            .options()
            .wait(SLACK)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("{mode}: the name stayed taken: {e}"));
        next.release().await.unwrap();
    }
}

/// Scenario 10: a lease that expired while its guard lived (here the row's expiry moved into the past
/// on the server, as a holder cut off past its lease would find it) is lost: the guard goes Lost and
/// the release says so (`NotHeld`, as MariaDB's lease mode), never `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_release_after_the_lease_expired_is_not_held() {
    let server = PostgresServer::start_or_panic();
    let locks = backend(&format!("{}?mode=lease", server.url())).await;
    let name = unique("expired-lease");
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    server
        .psql(&format!(
            "UPDATE distlock_locks SET expires_at = now() - interval '1 second' WHERE name = '{name}'"
        ))
        .unwrap();
    tokio::time::timeout(Duration::from_secs(3) + SLACK, guard.lost())
        .await
        .expect("the guard goes Lost once its lease row expired");
    assert_eq!(guard.state(), LockState::Lost);
    let err = guard
        .release()
        .await
        .expect_err("a lease that expired released Ok");
    assert_eq!(err.kind(), ErrorKind::NotHeld, "{err}");
}

/// Scenario 11: a waiter whose connection dies silently (the proxy blackholes it: no FIN or RST) while
/// it waits in the server, at the defaults (30 s lease, 5 s request bound, wait forever). The holder
/// releases during the blackhole, so the server grants the lock to the waiting session and the grant
/// is lost. The waiter notices within a wait slice plus the request bound (10 s) and goes on over a
/// new connection: it holds the lock long before the server would end the lost session (its idle
/// bound, the 30 s lease). Advisory and row modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_a_silently_dead_connection_goes_on_over_a_new_one_fault() {
    let server = PostgresServer::start_or_panic();
    let cases = ["advisory", "row"].map(|mode| {
        let server = &server;
        async move {
            let proxy = Arc::new(Proxy::start(server.addr()).unwrap());
            let holder = backend(&format!("{}?mode={mode}", server.url())).await;
            let waiter = backend(&format!("{}?mode={mode}", server.url_for(proxy.addr()))).await;
            let name = unique(&format!("silent-waiter/{mode}"));
            let held = holder.lock(&name).unwrap().acquire().await.unwrap();
            let waiting = {
                let name = name.clone();
                tokio::spawn(async move {
                    let guard = waiter
                        .lock(&name)
                        .unwrap()
                        .options()
                        .wait_forever()
                        .acquire()
                        .await;
                    (guard, waiter)
                })
            };
            (server, proxy, held, waiting, name, mode)
        }
    });
    let mut runs = Vec::new();
    for case in cases {
        runs.push(case.await);
    }
    let started = Instant::now();
    while !waiting_on_server(&server) {
        assert!(started.elapsed() < SLACK, "no waiter waits in the server");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Both waiters in the server (row mode's probe comes first).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut after_release = Vec::new();
    for (server, proxy, held, waiting, name, mode) in runs {
        control(&proxy, |p| p.blackhole().unwrap()).await;
        held.release().await.unwrap();
        let started = Instant::now();
        while !held_on_server(server, mode, &name) {
            assert!(
                started.elapsed() < SLACK,
                "{mode}: the server never granted the waiting session"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The grant's reply was dropped; the link comes back for new connections (and the old one).
        control(&proxy, |p| p.pass().unwrap()).await;
        after_release.push((Instant::now(), proxy, waiting, mode));
    }
    for (released_at, _proxy, waiting, mode) in after_release {
        // The bound: the slice and the request bound (10 s), the discard of the dead connection
        // (cancel 2 s, undo up to 5 s), slack; well before the lost session's 30 s idle bound.
        let (guard, _waiter) = tokio::time::timeout(Duration::from_secs(25), waiting)
            .await
            .unwrap_or_else(|_| panic!("{mode}: the waiter sat on its dead connection"))
            .unwrap();
        let guard = guard.unwrap_or_else(|e| panic!("{mode}: the wait failed: {e}"));
        assert!(
            released_at.elapsed() < Duration::from_secs(25),
            "{mode}: taken late"
        );
        guard.release().await.unwrap();
    }
}

/// Scenarios 12 and 13: a server whose defaults break what distlock's statements rely on
/// (SERIALIZABLE isolation, short statement, lock and idle timeouts). Every session sets its own, so
/// in each mode eight contenders take the lock in turn, none failing, with strictly increasing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_works_on_a_server_with_unfriendly_defaults() {
    let server = PostgresServer::start_with(&[
        "default_transaction_isolation=serializable",
        "statement_timeout=300",
        "lock_timeout=20",
        "idle_in_transaction_session_timeout=400",
        "idle_session_timeout=600",
    ])
    .unwrap();
    for mode in ["advisory", "row", "lease"] {
        let url = format!("{}?mode={mode}", server.url());
        let name = unique(&format!("unfriendly/{mode}"));
        let mut contenders = Vec::new();
        for _ in 0..8 {
            let locks = backend(&url).await;
            let name = name.clone();
            contenders.push(tokio::spawn(async move {
                let mut tokens = Vec::new();
                for _ in 0..2 {
                    let guard = locks
                        .lock(&name)
                        .unwrap()
                        .options()
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await?;
                    tokens.push(guard.token().unwrap());
                    // Held past the server's statement, lock and idle-in-transaction timeouts.
                    tokio::time::sleep(Duration::from_millis(450)).await;
                    guard.release().await?;
                    // Idle past the server's idle_session_timeout before the next round.
                    tokio::time::sleep(Duration::from_millis(700)).await;
                }
                Ok::<_, distlock_core::Error>(tokens)
            }));
        }
        let mut tokens = Vec::new();
        for c in contenders {
            let got = c.await.unwrap();
            tokens.extend(got.unwrap_or_else(|e| panic!("{mode}: an acquire failed: {e}")));
        }
        let count = tokens.len();
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), count, "{mode}: a token was repeated");
    }
}
