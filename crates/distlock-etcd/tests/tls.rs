//! `etcds://` on a real etcd with an https client listener whose certificates the testkit's
//! [`TestCa`] made at test time (a plain http listener stays for readiness and etcdctl), and user /
//! password authentication over plain http.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, Locks};
use distlock_etcd::{EtcdBackend, EtcdConfig};
use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::tls::TestCa;

fn name(case: &str) -> String {
    format!(
        "etcd-tls/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn tls_url(server: &EtcdServer, ca: &TestCa) -> String {
    format!(
        "{}?ca={}",
        server.tls_url().expect("started with TLS"),
        ca.ca_cert().display()
    )
}

/// Acquire and release over TLS; the key is in etcd (seen by etcdctl on the plain listener) while
/// held and gone after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_with_ca_locks() {
    let ca = TestCa::new_or_panic();
    let server = EtcdServer::builder().tls(&ca).start_or_panic();
    let backend = EtcdBackend::connect(&LockUrl::parse(&tls_url(&server, &ca)).unwrap())
        .await
        .expect("connect over TLS");
    assert!(backend.config().connection.tls);
    let locks = Locks::new(backend);
    let lock_name = name("lock");
    let guard = locks.lock(&lock_name).unwrap().acquire().await.unwrap();
    let keys = server
        .etcdctl(&["get", "--prefix", "--keys-only", &format!("{lock_name}/")])
        .unwrap();
    assert!(keys.contains(&format!("{lock_name}/")), "keys: {keys:?}");
    // A second handle on another connection finds it busy.
    let other = Locks::new(
        EtcdBackend::from_config(
            EtcdConfig::new([server.tls_addr().unwrap().to_string()]).with_ca_file(ca.ca_cert()),
        )
        .await
        .expect("connect with the typed config"),
    );
    assert!(other
        .lock(&lock_name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    guard.release().await.unwrap();
    let keys = server
        .etcdctl(&["get", "--prefix", "--keys-only", &format!("{lock_name}/")])
        .unwrap();
    assert!(keys.trim().is_empty(), "keys left: {keys:?}");
    let again = other.lock(&lock_name).unwrap().try_acquire().await.unwrap();
    again
        .expect("free after the release")
        .release()
        .await
        .unwrap();
}

/// A CA that did not sign the server's certificate: the connect fails as `Unavailable`, promptly,
/// and the message names TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_wrong_ca_fails_clearly() {
    let ca = TestCa::new_or_panic();
    let other = TestCa::new_or_panic();
    let server = EtcdServer::builder().tls(&ca).start_or_panic();
    let started = Instant::now();
    let url = format!("{}&connect_timeout=2s", tls_url(&server, &other));
    let err = EtcdBackend::connect(&LockUrl::parse(&url).unwrap())
        .await
        .expect_err("a foreign CA must not be trusted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("TLS"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    // A CA file that does not exist: InvalidConfig naming it.
    let missing = ca.dir().join("no-such-ca.pem");
    let url = format!("{}?ca={}", server.tls_url().unwrap(), missing.display());
    let err = EtcdBackend::connect(&LockUrl::parse(&url).unwrap())
        .await
        .expect_err("a missing CA file must fail");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
}

/// User and password over plain http: with auth enabled, `etcd://root:pw@…` locks; a wrong password
/// is `PermissionDenied`, and so is no user at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_user_password_auth() {
    let server = server_with_auth();
    let addr = server.addr();

    let backend = connect_as_root(&addr).await;
    let locks = Locks::new(backend);
    let lock_name = name("auth");
    let guard = locks.lock(&lock_name).unwrap().acquire().await.unwrap();
    let keys = server
        .etcdctl(&[
            "--user",
            "root:pw",
            "get",
            "--prefix",
            "--keys-only",
            &format!("{lock_name}/"),
        ])
        .unwrap();
    assert!(keys.contains(&format!("{lock_name}/")), "keys: {keys:?}");
    guard.release().await.unwrap();

    let err = EtcdBackend::connect(&LockUrl::parse(&format!("etcd://root:nope@{addr}")).unwrap())
        .await
        .expect_err("a wrong password must fail");
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");

    // Without credentials the connect (a status call) may pass; the first lock request may not.
    match EtcdBackend::connect(&LockUrl::parse(&format!("etcd://{addr}")).unwrap()).await {
        Err(err) => assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}"),
        Ok(backend) => {
            let err = Locks::new(backend)
                .lock(&name("anon"))
                .unwrap()
                .try_acquire()
                .await
                .expect_err("no user, auth enabled");
            assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
        }
    }
}

/// Turning auth off and on again drops every token etcd handed out, so the backend's token is then
/// refused ("invalid auth token", `Unauthenticated`), as an expired one is. The client authenticates
/// again and the next lock works, on the same backend, without a new connect. (A restart does not do
/// it: etcd replays the authentications from its log.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_token_refused_by_the_server_is_renewed() {
    let server = server_with_auth();
    let addr = server.addr();
    let backend = connect_as_root(&addr).await;
    let locks = Locks::new(backend);
    let lock_name = name("reauth");
    let first = locks.lock(&lock_name).unwrap().acquire().await.unwrap();
    let token = first.token();
    first.release().await.unwrap();
    server
        .etcdctl(&["--user", "root:pw", "auth", "disable"])
        .unwrap();
    server.etcdctl(&["auth", "enable"]).unwrap();
    let guard = locks
        .lock(&lock_name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the refused token is replaced by a new one");
    assert!(guard.token() > token);
    guard.release().await.unwrap();
    let keys = server
        .etcdctl(&[
            "--user",
            "root:pw",
            "get",
            "--prefix",
            "--keys-only",
            &format!("{lock_name}/"),
        ])
        .unwrap();
    assert!(keys.trim().is_empty(), "keys left: {keys:?}");
}

/// The held-keys watch stream carries the token it was opened with: etcd checks every watch created
/// on it against that token. Once the token is refused (auth turned off and on, as an expiry does) and
/// another request has authenticated again, a lock taken afterwards gets its watch refused on the
/// old stream (etcd answers the create with watch id -1 and a cancel reason). That refusal must not
/// leave the key unwatched: a delete of it is still reported within a round trip at the default 60 s
/// session TTL (the keep-alives, not checked against the token, go on confirming the session, so
/// nothing else would notice before the release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_a_held_key_whose_watch_was_refused_for_a_stale_token_is_still_lost_when_deleted() {
    let server = server_with_auth();
    let addr = server.addr();
    let backend = connect_as_root(&addr).await;
    assert_eq!(backend.default_lease(), Duration::from_secs(60));
    let locks = Locks::with_defaults(backend.clone(), backend.default_options());
    // A first hold opens the held-keys watch stream with the first token.
    let first = locks
        .lock(&name("stale-first"))
        .unwrap()
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server
        .etcdctl(&["--user", "root:pw", "auth", "disable"])
        .unwrap();
    server.etcdctl(&["auth", "enable"]).unwrap();
    // This acquire's request is refused for its token and authenticates again; its key's watch goes
    // to the stream opened with the old token.
    let lock_name = name("stale-second");
    let second = locks
        .lock(&lock_name)
        .unwrap()
        .options()
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the refused token is replaced by a new one");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let deleted_at = Instant::now();
    server
        .etcdctl(&[
            "--user",
            "root:pw",
            "del",
            "--prefix",
            &format!("{lock_name}/"),
        ])
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), second.lost())
        .await
        .expect("Lost within a round trip of the delete, not at the release");
    eprintln!("delete → Lost: {:?}", deleted_at.elapsed());
    assert!(second.loss_reason().unwrap().contains("deleted"));
    assert_eq!(first.state(), distlock_core::LockState::Held);
    first.release().await.unwrap();
    let _ = second.release().await;
}

/// An etcd with user `root` (password `pw`) and authentication on.
fn server_with_auth() -> EtcdServer {
    let server = EtcdServer::start_or_panic();
    server
        .etcdctl(&["user", "add", "root:pw", "--interactive=false"])
        .unwrap();
    server.etcdctl(&["auth", "enable"]).unwrap();
    server
}

/// A backend signed in as `root` on `addr`.
async fn connect_as_root(addr: &std::net::SocketAddr) -> EtcdBackend {
    EtcdBackend::connect(&LockUrl::parse(&format!("etcd://root:pw@{addr}")).unwrap())
        .await
        .expect("connect with the right password")
}
