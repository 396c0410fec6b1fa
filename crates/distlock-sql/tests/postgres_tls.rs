//! PostgreSQL over TLS (rustls): libpq's `sslmode` and `sslrootcert=` in the URL, against a test server
//! with `ssl=on` serving a certificate of a throw-away CA (for `localhost` and `127.0.0.1`).
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::Duration;

use distlock_core::{ErrorKind, Locks};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::postgres::{PostgresServer, PASSWORD};
use distlock_testkit::tls::TestCa;

fn unique(case: &str) -> String {
    format!("tls/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn tls_server(ca: &TestCa) -> PostgresServer {
    PostgresServer::start_tls(ca, &[]).expect("start PostgreSQL with TLS")
}

/// `sslmode` and `sslrootcert` appended to the server's URL.
fn url(server: &PostgresServer, query: &str) -> String {
    format!("{}?{query}", server.url())
}

/// `(sessions, encrypted)` among distlock's sessions, from `pg_stat_ssl`.
fn distlock_sessions(server: &PostgresServer) -> (u32, u32) {
    let out = server
        .psql(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'distlock'",
        )
        .unwrap();
    let (all, ssl) = out.split_once('|').unwrap();
    (all.parse().unwrap(), ssl.parse().unwrap())
}

fn no_advisory_locks(server: &PostgresServer) -> bool {
    server
        .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
        .unwrap()
        == "0"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_ca_locks_over_an_encrypted_session() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let root = ca.ca_cert().display().to_string();
    for mode in ["advisory", "row", "lease"] {
        let backend = PostgresBackend::connect(&url(
            &server,
            &format!("sslmode=verify-full&sslrootcert={root}&mode={mode}"),
        ))
        .await
        .expect("connect over verify-full");
        let locks = Locks::new(backend);
        let name = unique(mode);
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        assert!(guard.token().is_some());
        let (all, encrypted) = distlock_sessions(&server);
        assert!(all >= 1, "{mode}: no distlock session seen");
        assert_eq!(all, encrypted, "{mode}: a distlock session without TLS");
        guard.release().await.unwrap();
    }
    // The host name is checked too: `localhost` is in the certificate as a DNS name.
    let localhost = format!(
        "postgres://postgres:{PASSWORD}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={root}",
        server.addr().port()
    );
    let locks = Locks::new(
        PostgresBackend::connect(&localhost)
            .await
            .expect("localhost"),
    );
    locks
        .lock(&unique("localhost"))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// verify-full checks the host name, verify-ca does not: `host=` names the certificate to expect,
/// `hostaddr=` where to connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_skips_the_host_name_and_verify_full_does_not() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let root = ca.ca_cert().display().to_string();
    let port = server.addr().port();
    let elsewhere = |mode: &str| {
        format!(
            "postgres://postgres:{PASSWORD}@db.invalid:{port}/postgres?hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={root}"
        )
    };
    let backend = PostgresBackend::connect(&elsewhere("verify-ca"))
        .await
        .expect("verify-ca accepts a certificate for another name");
    let locks = Locks::new(backend);
    locks
        .lock(&unique("ca"))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let err = PostgresBackend::connect(&elsewhere("verify-full"))
        .await
        .expect_err("verify-full must refuse a certificate for another name");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("the TLS handshake failed"),
        "{err}"
    );
}

/// A CA that did not sign the server's certificate: a typed error that says it was the TLS handshake,
/// and nothing was made or locked on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_clearly_and_leaves_nothing() {
    let ca = TestCa::new_or_panic();
    let other = TestCa::new_or_panic();
    let server = tls_server(&ca);
    for query in [
        format!(
            "sslmode=verify-full&sslrootcert={}",
            other.ca_cert().display()
        ),
        format!(
            "sslmode=verify-ca&sslrootcert={}",
            other.ca_cert().display()
        ),
        // libpq: a root certificate makes require verify the chain too.
        format!("sslmode=require&sslrootcert={}", other.ca_cert().display()),
        // Without sslrootcert the system roots do not know the test CA.
        "sslmode=verify-full".to_string(),
    ] {
        let err = PostgresBackend::connect(&url(&server, &query))
            .await
            .expect_err(&query);
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{query}: {err}");
        let message = err.to_string();
        assert!(
            message.contains("the TLS handshake failed"),
            "{query}: {message}"
        );
        assert!(message.contains("sslrootcert"), "{query}: {message}");
    }
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'distlock%'")
            .unwrap(),
        "0"
    );
    assert!(no_advisory_locks(&server));
    // A CA file that is missing: InvalidConfig naming it.
    let missing = ca.dir().join("missing.pem");
    let err = PostgresBackend::connect(&url(
        &server,
        &format!("sslmode=verify-full&sslrootcert={}", missing.display()),
    ))
    .await
    .expect_err("missing CA file");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
}

/// `require` encrypts without checking the certificate (libpq's meaning), so a server whose CA the
/// client does not know is accepted; against a server without TLS it fails, and `prefer` falls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_encrypts_without_verifying() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let locks = Locks::new(
        PostgresBackend::connect(&url(&server, "sslmode=require"))
            .await
            .expect("require"),
    );
    let guard = locks
        .lock(&unique("require"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let (all, encrypted) = distlock_sessions(&server);
    assert!(
        all >= 1 && all == encrypted,
        "{all} sessions, {encrypted} encrypted"
    );
    guard.release().await.unwrap();

    let plain = PostgresServer::start_or_panic();
    let err = PostgresBackend::connect(&url(&plain, "sslmode=require"))
        .await
        .expect_err("require against a server without TLS");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("TLS"), "{err}");
    let locks = Locks::new(
        PostgresBackend::connect(&url(&plain, "sslmode=prefer"))
            .await
            .expect("prefer falls back to plain"),
    );
    locks
        .lock(&unique("prefer"))
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(distlock_sessions(&plain).1, 0);
}

/// An acquire given up while it waits in the server sends the cancel request over TLS (the same
/// connector): the wait ends in the server, nothing of distlock's is left waiting or holding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_wait_is_cancelled_over_tls() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let base = url(
        &server,
        &format!("sslmode=verify-full&sslrootcert={}", ca.ca_cert().display()),
    );
    let holder = Locks::new(PostgresBackend::connect(&base).await.unwrap());
    let waiter = Locks::new(PostgresBackend::connect(&base).await.unwrap());
    let name = unique("cancel");
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let lock = waiter.lock(&name).unwrap();
    let err = lock
        .options()
        .wait(Duration::from_millis(300))
        .acquire()
        .await
        .expect_err("the lock is held");
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    let waiting = || {
        server
            .psql(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock' \
                 AND wait_event_type = 'Lock'",
            )
            .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while waiting() != "0" {
        assert!(
            std::time::Instant::now() < deadline,
            "a wait is still in the server"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    held.release().await.unwrap();
    assert!(no_advisory_locks(&server));
}
