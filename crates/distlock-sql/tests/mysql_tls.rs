//! MariaDB over TLS: mysql_async's own URL parameters (`require_ssl=true`, `verify_ca=`,
//! `verify_identity=`) plus distlock's `ssl_ca=<file>`, against a test server with a certificate of a
//! throw-away CA. The server runs with `require_secure_transport=ON`, so every session distlock gets
//! is encrypted: a plain one is refused.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use distlock_core::{ErrorKind, Locks};
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::tls::TestCa;

fn unique(case: &str) -> String {
    format!("tls/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn tls_server(ca: &TestCa) -> MariaDbServer {
    MariaDbServer::builder()
        .tls(ca)
        .require_secure_transport()
        .start_or_panic()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verified_tls_locks_and_the_sessions_are_encrypted() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let root = ca.ca_cert().display().to_string();
    for mode in ["advisory", "row", "lease"] {
        let url = format!(
            "{}?require_ssl=true&verify_ca=true&verify_identity=true&ssl_ca={root}&mode={mode}",
            server.url()
        );
        let locks = Locks::new(distlock_sql::mysql::connect(&url).await.expect("connect"));
        let guard = locks.lock(&unique(mode)).unwrap().acquire().await.unwrap();
        assert!(guard.token().is_some());
        guard.release().await.unwrap();
    }
    // The server refuses sessions without TLS, so the ones above were encrypted.
    let err = distlock_sql::mysql::connect(&server.url())
        .await
        .expect_err("a plain session must be refused");
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    // And the driver's TLS session reports a cipher.
    let opts = distlock_sql::mysql::mysql_async::Opts::from_url(&format!(
        "{}?require_ssl=true&verify_ca=false",
        server.url()
    ))
    .unwrap();
    let mut conn = distlock_sql::mysql::mysql_async::Conn::new(opts)
        .await
        .unwrap();
    use distlock_sql::mysql::mysql_async::prelude::Queryable;
    let cipher: Option<(String, String)> = conn
        .query_first("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .await
        .unwrap();
    assert!(!cipher.unwrap().1.is_empty());
    conn.disconnect().await.unwrap();
}

/// `verify_ca=false` (mysql_async's spelling): encrypted, the certificate not checked, so a server
/// whose CA the client does not know is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unverified_tls_accepts_an_unknown_ca() {
    let ca = TestCa::new_or_panic();
    let server = tls_server(&ca);
    let url = format!("{}?require_ssl=true&verify_ca=false", server.url());
    let locks = Locks::new(distlock_sql::mysql::connect(&url).await.expect("connect"));
    let guard = locks
        .lock(&unique("unverified"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
}

/// A CA that did not sign the server's certificate: a typed error that says it was the TLS handshake,
/// and nothing was made on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_fails_clearly_and_leaves_nothing() {
    let ca = TestCa::new_or_panic();
    let other = TestCa::new_or_panic();
    let server = tls_server(&ca);
    for query in [
        format!("require_ssl=true&ssl_ca={}", other.ca_cert().display()),
        // Without ssl_ca the built-in roots do not know the test CA.
        "require_ssl=true".to_string(),
    ] {
        let err = distlock_sql::mysql::connect(&format!("{}?{query}", server.url()))
            .await
            .expect_err(&query);
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{query}: {err}");
        assert!(
            err.to_string().contains("the TLS handshake failed"),
            "{query}: {err}"
        );
    }
    assert_eq!(
        server
            .sql("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = 'distlock'")
            .unwrap()
            .trim(),
        "0"
    );
    // ssl_ca without TLS, or naming no file: InvalidConfig.
    for query in [
        format!("ssl_ca={}", ca.ca_cert().display()),
        format!(
            "require_ssl=true&ssl_ca={}",
            ca.dir().join("missing.pem").display()
        ),
    ] {
        let err = distlock_sql::mysql::connect(&format!("{}?{query}", server.url()))
            .await
            .expect_err(&query);
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{query}: {err}");
    }
}
