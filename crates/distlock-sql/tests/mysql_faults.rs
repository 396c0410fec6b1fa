//! MariaDB faults and bad input: the advisory loss deadline under a fault-proxy blackhole (the server
//! frees the lock by `wait_timeout` no earlier than the guard's validity deadline, and within a lease of
//! the cut), a server kill and restart (the hold is Lost at once, locking works again with higher
//! tokens), and every kind of bad input as a typed error.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockState, Locks};
use distlock_sql::mysql::advisory_name;
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::proxy::Proxy;

const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("faults/{case}/{}", uuid::Uuid::new_v4().simple())
}

fn held_by(server: &MariaDbServer, name: &str) -> Option<u64> {
    server
        .sql(&format!("SELECT IS_USED_LOCK('{}')", advisory_name(name)))
        .expect("IS_USED_LOCK")
        .trim()
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackholed_advisory_holder_is_freed_by_wait_timeout_after_its_deadline_fault() {
    let server = MariaDbServer::start_or_panic();
    let proxy = std::sync::Arc::new(Proxy::start(server.addr()).expect("proxy"));
    let locks = Locks::new(
        distlock_sql::mysql::connect(&server.url_via(proxy.addr()))
            .await
            .expect("connect"),
    );
    let name = unique("blackhole");
    // A short lease is the tight case, so the default (30 s) needs no run of its own: the server frees
    // the lock `wait_timeout` = the lease rounded up to whole seconds after the last statement it
    // received, while the guard's deadline is the last confirmed probe's send time + 0.99 × lease − 2 ms;
    // the margin between the two (0.01 × lease + 2 ms, plus the rounding) only grows with the lease.
    let lease = Duration::from_secs(2);
    let guard = locks
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    // Let a probe or two confirm the session, then cut it off.
    tokio::time::sleep(lease).await;
    let cut = Instant::now();
    tokio::task::spawn_blocking({
        let proxy = proxy.clone();
        move || proxy.blackhole().expect("blackhole")
    })
    .await
    .unwrap();
    // The deadline as of the last confirmed probe: nothing sent after the cut is confirmed, so the last
    // value read after the cut is final.
    let mut deadline = guard.validity_deadline().expect("a validity deadline");
    let mut freed = None;
    while cut.elapsed() < lease * 2 + SLACK {
        if let Some(d) = guard.validity_deadline() {
            deadline = d;
        }
        if held_by(&server, &name).is_none() {
            freed = Some(Instant::now());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let freed = freed.expect("the server never freed the blackholed session's lock");
    eprintln!(
        "freed {:?} after the cut; the guard's deadline was {:?} after the cut",
        freed - cut,
        deadline.saturating_duration_since(cut)
    );
    // P2: the server freed it no earlier than the client stopped believing it held it.
    assert!(
        freed >= deadline,
        "the server freed the lock {:?} before the guard's validity deadline",
        deadline - freed
    );
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("Lost by the deadline");
    assert_ne!(guard.state(), LockState::Held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_loses_the_hold_and_locking_resumes_fault() {
    let mut server = MariaDbServer::start_or_panic();
    let locks = Locks::new(
        distlock_sql::mysql::connect(&server.url())
            .await
            .expect("connect"),
    );
    let name = unique("restart");
    let guard = locks.lock(&name).unwrap().acquire().await.expect("acquire");
    let before = guard.token().expect("token");
    server.kill9().expect("kill");
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("Lost at once when the server's socket closes");
    server.restart().expect("restart");
    drop(guard);
    let again = locks
        .lock(&name)
        .unwrap()
        .options()
        .wait(SLACK)
        .acquire()
        .await
        .expect("locking works after the restart");
    assert!(
        again.token().expect("token") > before,
        "the fence counter went back after a restart"
    );
    again.release().await.expect("release");
}

async fn connect_err(url: &str) -> distlock_core::Error {
    match distlock_sql::mysql::connect(url).await {
        Ok(_) => panic!("{url} connected"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_typed_error() {
    let server = MariaDbServer::start_or_panic();
    let addr = server.addr();
    server
        .sql("CREATE USER 'ro'@'127.0.0.1' IDENTIFIED BY 'pw'; GRANT SELECT ON distlock.* TO 'ro'@'127.0.0.1'; CREATE TABLE distlock.wrong (name VARBINARY(10) PRIMARY KEY)")
        .expect("setup");
    let cases = [
        (
            format!("mysql://root:nope@{addr}/distlock"),
            ErrorKind::PermissionDenied,
        ),
        (
            format!("mysql://root@{addr}/nosuchdb"),
            ErrorKind::InvalidConfig,
        ),
        (
            format!("mysql://root@{addr}/distlock?mode=bogus"),
            ErrorKind::InvalidConfig,
        ),
        (
            format!("mysql://root@{addr}/distlock?table=wrong"),
            ErrorKind::InvalidConfig,
        ),
        (
            format!("mysql://ro:pw@{addr}/distlock"),
            ErrorKind::PermissionDenied,
        ),
        (
            format!("mysql://root@{addr}/distlock?table=a;b"),
            ErrorKind::InvalidConfig,
        ),
        (
            format!("mysql://root@{addr}/distlock?bogus_driver_option=1"),
            ErrorKind::InvalidConfig,
        ),
        (format!("mysql://root@{addr}"), ErrorKind::InvalidConfig),
    ];
    for (url, kind) in cases {
        let err = connect_err(&url).await;
        assert_eq!(err.kind(), kind, "{url}: {err}");
        assert!(
            !err.to_string().contains("nope"),
            "the password leaked: {err}"
        );
    }
    // mariadb:// is accepted and spelled mysql:// for the driver.
    let url = format!("mariadb://root@{addr}/distlock");
    distlock_sql::mysql::connect(&url)
        .await
        .expect("mariadb:// works");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_holder_and_last_token_in_every_mode() {
    use distlock_core::raw::Backend as _;
    let server = MariaDbServer::start_or_panic();
    for mode in ["advisory", "row", "lease"] {
        let url = format!("{}?mode={mode}", server.url());
        let backend = distlock_sql::mysql::connect(&url).await.expect("connect");
        let locks = Locks::new(backend.clone());
        let name = unique("inspect");
        let guard = locks.lock(&name).unwrap().acquire().await.expect("acquire");
        let info = backend.inspect(&name).await.expect("inspect");
        assert!(info.holder.is_some(), "{mode}: no holder shown: {info:?}");
        assert_eq!(info.last_token, guard.token(), "{mode}");
        guard.release().await.expect("release");
        let info = backend.inspect(&name).await.expect("inspect");
        assert!(
            info.holder.is_none(),
            "{mode}: a holder after release: {info:?}"
        );
        // The status read left nothing locked.
        let again = locks.lock(&name).unwrap().try_acquire().await.expect("try");
        assert!(again.is_some(), "{mode}: inspect left the lock taken");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_url_locks_and_a_killed_session_is_noticed_at_once_fault() {
    let server = MariaDbServer::start_or_panic();
    // mysql_async's own spelling of a unix socket: `?socket=/path` (the host is then unused).
    let url = format!(
        "mysql://root@localhost/distlock?socket={}",
        server.socket().display()
    );
    let locks = Locks::new(distlock_sql::mysql::connect(&url).await.expect("connect"));
    let name = unique("socket");
    let guard = locks.lock(&name).unwrap().acquire().await.expect("acquire");
    let id = held_by(&server, &name).expect("held over the socket");
    let killed = Instant::now();
    server.sql(&format!("KILL {id}")).expect("KILL");
    tokio::time::timeout(SLACK, guard.lost())
        .await
        .expect("a killed session over the unix socket is noticed");
    // At the default 30 s lease the first probe comes 10 s after the grant: only the socket watch is
    // this fast.
    assert!(killed.elapsed() < Duration::from_secs(5));
}
