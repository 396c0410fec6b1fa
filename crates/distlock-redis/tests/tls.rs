//! `rediss://` on a real `redis-server` with a TLS port, its certificates made at test time by the
//! testkit's [`TestCa`]: locks and pub/sub wake-ups over TLS with `?ca=`, and clear errors for a CA that
//! did not sign the server's certificate and for a CA file that does not exist.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::{ErrorKind, Locks};
use distlock_redis::{RedisBackend, RedisConfig};
use distlock_testkit::redis::RedisServer;
use distlock_testkit::tls::TestCa;

fn unique(case: &str) -> String {
    format!("redis-tls/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn tls_url(server: &RedisServer, ca: &TestCa) -> String {
    format!(
        "{}?ca={}",
        server.tls_url().expect("started with TLS"),
        ca.ca_cert().display()
    )
}

async fn locks(url: &str) -> Locks {
    let backend = RedisBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect");
    Locks::new(backend)
}

/// Acquire and release over TLS, and a waiter on another connection woken by the release through
/// pub/sub (also over TLS), well before the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_ca_locks_and_wakes() {
    let ca = TestCa::new_or_panic();
    let server = RedisServer::builder().tls(&ca).start_or_panic();
    let url = tls_url(&server, &ca);
    let holder = locks(&url).await;
    let waiting = locks(&url).await;
    let name = unique("wake");

    let guard = holder
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    // The lock really is in the server (seen through the plain port).
    assert_eq!(
        server.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(1)
    );
    let lock = waiting.lock(&name).unwrap();
    let waiter = tokio::spawn(async move {
        lock.options()
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .map(|g| (g, lock))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The waiter subscribed over TLS: the server counts one subscriber on the lock's channel.
    let subscribers = server
        .command(&["PUBSUB", "NUMSUB", &distlock_redis::layout::channel(&name)])
        .unwrap();
    assert!(
        subscribers.to_string().ends_with("(integer) 1]"),
        "subscribers: {subscribers}"
    );
    let released = Instant::now();
    guard.release().await.unwrap();
    let (got, _lock) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("waiter finished")
        .unwrap()
        .expect("acquired");
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "woke {:?} after the release",
        released.elapsed()
    );
    got.release().await.unwrap();
    assert_eq!(
        server.command(&["EXISTS", &name]).unwrap().as_int(),
        Some(0)
    );
}

/// The typed configuration takes the CA file too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_ca_file_config() {
    let ca = TestCa::new_or_panic();
    let server = RedisServer::builder().tls(&ca).start_or_panic();
    let addr = server.tls_addr().expect("started with TLS");
    let addr = Endpoint::new(addr.ip().to_string(), addr.port());
    let backend = RedisBackend::from_config(RedisConfig::new(addr).with_ca_file(ca.ca_cert()))
        .await
        .expect("connect");
    let locks = Locks::new(backend);
    let guard = locks
        .lock(&unique("config"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
}

/// A CA that did not sign the server's certificate: the connect fails as `Unavailable`, and the
/// message says it was the TLS handshake (the certificate), not an unreachable server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_wrong_ca_fails_clearly() {
    let ca = TestCa::new_or_panic();
    let other = TestCa::new_or_panic();
    let server = RedisServer::builder().tls(&ca).start_or_panic();
    let started = Instant::now();
    let err = RedisBackend::connect(&LockUrl::parse(&tls_url(&server, &other)).unwrap())
        .await
        .expect_err("a foreign CA must not be trusted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let message = err.to_string();
    // The advice comes from the typed check (a rustls error under the I/O error), not from the text.
    assert!(message.contains("the TLS handshake failed"), "{message}");
    assert!(message.contains("certificate"), "{message}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    // Without ?ca= the system roots do not know the test CA either.
    let err = RedisBackend::connect(&LockUrl::parse(&server.tls_url().unwrap()).unwrap())
        .await
        .expect_err("the test CA is not a system root");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("the TLS handshake failed"),
        "{err}"
    );
}

/// `?ca=` naming a file that does not exist: `InvalidConfig` naming the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_missing_ca_file_is_invalid_config() {
    let ca = TestCa::new_or_panic();
    let server = RedisServer::builder().tls(&ca).start_or_panic();
    let missing = ca.dir().join("no-such-ca.pem");
    let url = format!("{}?ca={}", server.tls_url().unwrap(), missing.display());
    let err = RedisBackend::connect(&LockUrl::parse(&url).unwrap())
        .await
        .expect_err("a missing CA file must fail");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    // ?ca= on a plain redis:// URL is refused before any connect.
    let err = RedisConfig::from_url(
        &LockUrl::parse(&format!("{}?ca={}", server.url(), ca.ca_cert().display())).unwrap(),
    )
    .expect_err("ca needs rediss://");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
}
