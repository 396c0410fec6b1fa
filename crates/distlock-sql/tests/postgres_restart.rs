//! A PostgreSQL server restart (kill -9 of the server's process group, then start on the same data
//! dir): session locks (advisory, row) end with their sessions, so their guards are `Lost` at once and
//! the name is free after the restart, with a higher token (the counter row is committed); a lease row
//! survives the restart, and its holder's watchdog reconnects and keeps it.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::{LockState, Locks};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::postgres::PostgresServer;

const PROMPT: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_ends_session_locks_and_keeps_leases_fault() {
    let mut server = PostgresServer::start_or_panic();
    let base = server.url();
    let url = |mode: &str| format!("{base}?mode={mode}");
    let advisory = Locks::new(PostgresBackend::connect(&url("advisory")).await.unwrap());
    let row = Locks::new(PostgresBackend::connect(&url("row")).await.unwrap());
    let lease = Locks::new(PostgresBackend::connect(&url("lease")).await.unwrap());
    let a = advisory.lock("restart/a").unwrap().acquire().await.unwrap();
    let r = row.lock("restart/r").unwrap().acquire().await.unwrap();
    let l = lease
        .lock("restart/l")
        .unwrap()
        .options()
        .lease(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    let (a_token, r_token, l_token) = (a.token().unwrap(), r.token().unwrap(), l.token().unwrap());

    let _server = tokio::task::spawn_blocking(move || {
        server.process_mut().restart().unwrap();
        server
    })
    .await
    .unwrap();

    for (what, guard) in [("advisory", &a), ("row", &r)] {
        tokio::time::timeout(PROMPT, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{what}: not Lost after the server restart"));
    }
    let other = Locks::new(PostgresBackend::connect(&url("advisory")).await.unwrap());
    let again = other
        .lock("restart/a")
        .unwrap()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .unwrap();
    assert!(
        again.token().unwrap() > a_token,
        "the counter went back across the restart"
    );
    again.release().await.unwrap();
    let other_row = Locks::new(PostgresBackend::connect(&url("row")).await.unwrap());
    let again = other_row
        .lock("restart/r")
        .unwrap()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .unwrap();
    assert!(again.token().unwrap() > r_token);
    again.release().await.unwrap();

    // The lease row survived; the watchdog's next renewal reconnects and keeps it.
    let other_lease = Locks::new(PostgresBackend::connect(&url("lease")).await.unwrap());
    assert!(other_lease
        .lock("restart/l")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(l.state(), LockState::Held, "{:?}", l.loss_reason());
    assert_eq!(l.token(), Some(l_token));
    l.release().await.unwrap();
    let next = other_lease
        .lock("restart/l")
        .unwrap()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .unwrap();
    assert!(next.token().unwrap() > l_token);
    next.release().await.unwrap();
    drop((a, r));
}
