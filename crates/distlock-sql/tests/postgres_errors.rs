//! Bad input on PostgreSQL: each a typed error, and nothing left locked or half-made on the server.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::{ErrorKind, Locks};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::postgres::{PostgresServer, PASSWORD};

async fn kind_of(url: &str) -> ErrorKind {
    PostgresBackend::connect(url).await.expect_err(url).kind()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_typed_error_and_leaves_nothing() {
    let server = PostgresServer::start_or_panic();
    let addr = server.addr();
    let base = server.url();

    // Wrong password, unknown database, a URL the driver refuses, an unknown mode.
    assert_eq!(
        kind_of(&format!("postgres://postgres:wrong@{addr}/postgres")).await,
        ErrorKind::PermissionDenied
    );
    assert_eq!(
        kind_of(&format!("postgres://postgres:{PASSWORD}@{addr}/nosuchdb")).await,
        ErrorKind::InvalidConfig
    );
    assert_eq!(
        kind_of(&format!("{base}?bogus_option=1")).await,
        ErrorKind::InvalidConfig
    );
    assert_eq!(
        kind_of(&format!("{base}?mode=bogus")).await,
        ErrorKind::InvalidConfig
    );
    assert_eq!(
        kind_of(&format!("{base}?table=bad-name")).await,
        ErrorKind::InvalidConfig
    );
    assert_eq!(kind_of("mysql://h/db").await, ErrorKind::InvalidConfig);
    // Nothing listens there.
    let closed = distlock_testkit::ports::reserve().unwrap();
    assert_eq!(
        kind_of(&format!(
            "postgres://postgres:x@{}/postgres?connect_timeout=2",
            closed.addr()
        ))
        .await,
        ErrorKind::Unavailable
    );

    // A role without CREATE, and no table yet: refused, nothing created.
    server
        .psql("CREATE ROLE app LOGIN PASSWORD 'apppw'; REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        .unwrap();
    let app = format!("postgres://app:apppw@{addr}/postgres");
    assert_eq!(kind_of(&app).await, ErrorKind::PermissionDenied);
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'distlock%'")
            .unwrap(),
        "0"
    );
    // Once the superuser made the tables and granted their use, the role works.
    drop(PostgresBackend::connect(&base).await.unwrap());
    server
        .psql("GRANT SELECT, INSERT, UPDATE ON distlock_locks, distlock_locks_fence TO app")
        .unwrap();
    let locks = Locks::new(PostgresBackend::connect(&app).await.unwrap());
    let guard = locks.lock("app/1").unwrap().acquire().await.unwrap();
    assert!(guard.token().is_some());
    guard.release().await.unwrap();
    // The semaphore limit table (distlock_locks_limit) came later: a role granted only the first two
    // tables still connects and locks; a semaphore, and a read lock (which must check for one), say
    // what to grant.
    let err = locks
        .semaphore("app/sem", 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(err.message().contains("distlock_locks_limit"), "{err}");
    let err = locks
        .read_write("app/rw")
        .unwrap()
        .read()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    server
        .psql("GRANT SELECT, INSERT ON distlock_locks_limit TO app")
        .unwrap();
    let permit = locks
        .semaphore("app/sem", 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    assert_eq!(permit.permit(), Some("0"));
    permit.release().await.unwrap();
    locks
        .read_write("app/rw")
        .unwrap()
        .read()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // A server whose tables predate the limit table, and a role that may not create it: everything
    // but semaphores works (with no table, no name can be a semaphore, so a read lock needs no
    // check); a semaphore says which table to create.
    server.psql("DROP TABLE distlock_locks_limit").unwrap();
    let old_schema = Locks::new(PostgresBackend::connect(&app).await.unwrap());
    let read = old_schema
        .read_write("app/rw")
        .unwrap()
        .read()
        .await
        .unwrap();
    let err = old_schema
        .semaphore("app/sem2", 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(
        err.message()
            .contains("CREATE TABLE \"distlock_locks_limit\""),
        "{err}"
    );
    read.release().await.unwrap();
    // A superuser's connect creates it again.
    drop(PostgresBackend::connect(&base).await.unwrap());
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_tables WHERE tablename = 'distlock_locks_limit'")
            .unwrap(),
        "1"
    );

    // A table of another shape.
    server
        .psql("CREATE TABLE wrong (name text PRIMARY KEY, owner int); CREATE TABLE wrong_fence (name text, token bigint)")
        .unwrap();
    let err = PostgresBackend::connect(&format!("{base}?table=wrong"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    server.psql("CREATE TABLE wrong2 (name text PRIMARY KEY, owner text, expires_at text, version bigint)").unwrap();
    let err = PostgresBackend::connect(&format!("{base}?table=wrong2"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.message().contains("expires_at"), "{err}");

    // Names: 1,024 bytes pass in every mode, 1,025 are refused before any I/O.
    for mode in ["advisory", "row", "lease"] {
        let locks = Locks::new(
            PostgresBackend::connect(&format!("{base}?mode={mode}"))
                .await
                .unwrap(),
        );
        let long = "n".repeat(1024);
        let guard = locks.lock(&long).unwrap().acquire().await.unwrap();
        guard.release().await.unwrap();
        let err = locks.lock(&"n".repeat(1025)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidName);
    }

    // Nothing left locked by any of it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            .unwrap(),
        "0"
    );
    assert_eq!(
        server
            .psql("SELECT count(*) FROM distlock_locks WHERE owner IS NOT NULL")
            .unwrap(),
        "0"
    );
}
