//! A transaction pooler (PgBouncer, `pool_mode=transaction`, the testkit's own) between distlock and
//! PostgreSQL. The session modes (advisory, row) are refused at connect, with a message naming the
//! pooler and pointing at `?mode=lease`, and leave nothing locked, so their read-write locks and
//! semaphores are refused with them; lease mode works through it (the mutex only: its read-write lock
//! and semaphore are refused before any I/O).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use distlock_core::{ErrorKind, Locks};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::pgbouncer::PgBouncer;
use distlock_testkit::postgres::PostgresServer;

fn unique(case: &str) -> String {
    format!("pooler/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// Before the login check (the pooler's cancel key is not the backend's pid), advisory mode through
/// PgBouncer was granted, and only a later probe that PgBouncer happened to route to another server
/// session turned the guard Lost; row mode was granted and stayed Held (its open transaction pins a
/// server connection), with a pid check that would fail at random once another client interleaved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_modes_through_a_transaction_pooler_are_refused_at_connect() {
    let server = PostgresServer::start_or_panic();
    let bouncer = PgBouncer::start_or_panic(&server);
    for mode in ["advisory", "row"] {
        let url = format!("{}?mode={mode}", bouncer.url());
        let err = PostgresBackend::connect(&url)
            .await
            .expect_err("a session mode through a transaction pooler must be refused");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{mode}: {err}");
        let message = err.to_string();
        assert!(message.contains("pooler (PgBouncer)"), "{mode}: {message}");
        assert!(message.contains("?mode=lease"), "{mode}: {message}");
    }
    // Nothing was locked on the server, and the refused backends opened no lock rows.
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            .unwrap(),
        "0"
    );
    // The same URLs straight to the server are fine: the check is the pooler's, not the mode's.
    for mode in ["advisory", "row"] {
        let backend = PostgresBackend::connect(&format!("{}?mode={mode}", server.url()))
            .await
            .expect("direct connect");
        let locks = Locks::new(backend);
        let guard = locks.lock(&unique(mode)).unwrap().acquire().await.unwrap();
        guard.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_through_a_transaction_pooler_works() {
    let server = PostgresServer::start_or_panic();
    let bouncer = PgBouncer::start_or_panic(&server);
    let url = format!("{}?mode=lease", bouncer.url());
    let a = Locks::new(PostgresBackend::connect(&url).await.expect("connect a"));
    let b = Locks::new(PostgresBackend::connect(&url).await.expect("connect b"));
    let name = unique("lease");
    let first = a.lock(&name).unwrap().acquire().await.unwrap();
    let t1 = first.token().expect("a token");
    assert!(
        b.lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "the lease is held"
    );
    first.release().await.unwrap();
    let second = b.lock(&name).unwrap().acquire().await.unwrap();
    let t2 = second.token().expect("a token");
    assert!(t2 > t1, "{t2:?} after {t1:?}");
    second.release().await.unwrap();

    // The kinds a session would hold are not lease mode's: refused before anything is sent, naming
    // the kind and what the backend has.
    let rw = a.read_write(&name).unwrap_err();
    let permits = a.semaphore(&name, 2).unwrap_err();
    for (err, kind) in [(rw, "read-write lock"), (permits, "semaphore")] {
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert!(err.to_string().contains(kind), "{err}");
        assert!(err.to_string().contains("supports: mutex"), "{err}");
    }
}
