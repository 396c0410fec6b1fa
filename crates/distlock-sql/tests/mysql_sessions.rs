//! What every MariaDB session distlock opens sets for itself, and what that buys: a server whose
//! global defaults are the unfriendly ones (`autocommit = 0`, `SERIALIZABLE`, read-only
//! transactions, `completion_type = CHAIN`, a parsing-changing `sql_mode`, a 1 s statement limit, a
//! 1 s row-lock wait) locks as any other, in every mode; TCP keepalive on every connection; and a
//! waiter whose connection dies silently waits on over a new one, at the defaults.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::Locks;
use distlock_sql::mysql::advisory_name;
use distlock_testkit::mariadb::MariaDbServer;
use distlock_testkit::proxy::Proxy;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("sessions/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn backend(url: &str) -> Locks {
    Locks::new(distlock_sql::mysql::connect(url).await.expect("connect"))
}

/// Hex of `bytes`, for the test's own `X'…'` literals.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The name's committed counter, read by a session of the test's own (another session sees only
/// committed rows).
fn committed_fence(server: &MariaDbServer, name: &str) -> u64 {
    server
        .sql(&format!(
            "SELECT fence FROM distlock.distlock_locks WHERE name = X'{}'",
            hex(name.as_bytes())
        ))
        .unwrap()
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Every setting a new session inherits from the server that distlock's statements rely on, set to
/// an unfriendly value. `max_statement_time = 1` would end a wait longer than a second; a 1 s
/// `innodb_lock_wait_timeout` shortens row waits.
const UNFRIENDLY: &str = "SET GLOBAL autocommit = 0; \
    SET GLOBAL TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ ONLY; \
    SET GLOBAL completion_type = 'CHAIN'; \
    SET GLOBAL sql_mode = 'ANSI_QUOTES,PIPES_AS_CONCAT,NO_BACKSLASH_ESCAPES,ONLY_FULL_GROUP_BY'; \
    SET GLOBAL max_statement_time = 1; \
    SET GLOBAL innodb_lock_wait_timeout = 1";

/// On a server with [`UNFRIENDLY`] defaults, each mode: tokens strictly increase across holders (a
/// waiter that waits past the server's statement limit included), the lock is free for the next
/// client at once after each release, and the counter is committed (another session reads it, and a
/// holder after every earlier client has closed its sessions still gets a higher token: an
/// uncommitted bump would roll back with its session and the token repeat).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_works_on_a_server_with_unfriendly_session_defaults() {
    let server = MariaDbServer::start_or_panic();
    server.sql(UNFRIENDLY).unwrap();
    let inherited = server
        .sql("SELECT @@autocommit, @@tx_isolation, @@tx_read_only, @@completion_type, @@max_statement_time")
        .unwrap();
    assert!(
        inherited.starts_with("0\tSERIALIZABLE\t1\tCHAIN\t1"),
        "the server's defaults are not the unfriendly ones: {inherited}"
    );
    every_mode_locks_and_commits(&server).await;
}

/// The case alone: `SET GLOBAL autocommit = 0`. Before the fix the bump stayed uncommitted in
/// the holder's pooled session, the next client's bump waited on its row lock ("no answer within
/// 5s"), and the token repeated once the first sessions closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_works_with_the_servers_global_autocommit_off() {
    let server = MariaDbServer::start_or_panic();
    server.sql("SET GLOBAL autocommit = 0").unwrap();
    every_mode_locks_and_commits(&server).await;
}

async fn every_mode_locks_and_commits(server: &MariaDbServer) {
    for mode in ["advisory", "row", "lease"] {
        let url = format!("{}?mode={mode}", server.url());
        let name = unique(mode);
        let (first, second) = (backend(&url).await, backend(&url).await);

        let held = first.lock(&name).unwrap().acquire().await.unwrap();
        let t1 = held.token().unwrap().get();
        assert_eq!(
            committed_fence(server, &name),
            t1,
            "{mode}: bump not committed"
        );
        let waiter = {
            let (second, name) = (second.clone(), name.clone());
            tokio::spawn(async move {
                second
                    .lock(&name)
                    .unwrap()
                    .options()
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
            })
        };
        // Past the server's 1 s statement limit and 1 s row-lock wait.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(
            !waiter.is_finished(),
            "{mode}: the waiter ended while the lock was held"
        );
        held.release().await.unwrap();
        let waited = tokio::time::timeout(SLACK * 2, waiter)
            .await
            .unwrap_or_else(|_| panic!("{mode}: the waiter did not get the released lock"))
            .unwrap()
            .unwrap_or_else(|e| panic!("{mode}: the waiter failed: {e}"));
        let t2 = waited.token().unwrap().get();
        assert!(t2 > t1, "{mode}: token {t2} after {t1}");
        waited.release().await.unwrap();

        // A third client takes the free lock at once.
        let third = backend(&url).await;
        let g = third
            .lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap_or_else(|e| panic!("{mode}: a third client could not take the free lock: {e}"))
            .unwrap_or_else(|| panic!("{mode}: the free lock was busy for a third client"));
        let t3 = g.token().unwrap().get();
        assert!(t3 > t2, "{mode}: token {t3} after {t2}");
        g.release().await.unwrap();
        assert_eq!(
            committed_fence(server, &name),
            t3,
            "{mode}: bump not committed"
        );

        // Every earlier client closes its sessions: nothing committed may roll back.
        drop((first, second, third));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let fourth = backend(&url).await;
        let g = fourth.lock(&name).unwrap().try_acquire().await.unwrap();
        let g = g.unwrap_or_else(|| panic!("{mode}: the free lock was busy for a fourth client"));
        let t4 = g.token().unwrap().get();
        assert!(
            t4 > t3,
            "{mode}: token {t4} repeated or went back after {t3}"
        );
        g.release().await.unwrap();
        if mode == "advisory" {
            let used = server
                .sql(&format!("SELECT IS_USED_LOCK('{}')", advisory_name(&name)))
                .unwrap();
            assert_eq!(used.trim(), "NULL", "{mode}: left locked");
        }
    }
}

/// The sockets of this process connected to `port`.
fn sockets_to(port: u16) -> Vec<std::os::fd::OwnedFd> {
    use std::os::fd::BorrowedFd;
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: the descriptor is only duplicated; a number closed meanwhile fails cleanly.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let Ok(Some(peer)) = rustix::net::getpeername(borrowed) else {
            continue;
        };
        if std::net::SocketAddr::try_from(peer).is_ok_and(|a| a.port() == port) {
            if let Ok(dup) = borrowed.try_clone_to_owned() {
                out.push(dup);
            }
        }
    }
    out
}

/// Every connection distlock opens (a held lock's, the pooled ones, a waiter's, the control
/// connection that ends waits) has TCP keepalive on, with distlock's probe timing: a peer that
/// vanishes without a FIN or RST is noticed within 25 s of silence. Before the fix: no keepalive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_has_tcp_keepalive() {
    use rustix::net::sockopt;
    let server = MariaDbServer::start_or_panic();
    let locks = backend(&server.url()).await;
    let other = backend(&server.url()).await;
    let name = unique("keepalive");
    let held = locks.lock(&name).unwrap().acquire().await.unwrap();
    // A wait given up: its session and the control connection (KILL QUERY) are opened too.
    let waited = other
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_millis(300))
        .acquire()
        .await;
    assert!(waited.is_err());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sockets = sockets_to(server.addr().port());
    assert!(
        sockets.len() >= 3,
        "only {} connections found",
        sockets.len()
    );
    for fd in &sockets {
        assert!(
            sockopt::socket_keepalive(fd).unwrap(),
            "a connection without keepalive"
        );
        assert_eq!(sockopt::tcp_keepidle(fd).unwrap(), Duration::from_secs(10));
        assert_eq!(sockopt::tcp_keepintvl(fd).unwrap(), Duration::from_secs(5));
        assert_eq!(sockopt::tcp_keepcnt(fd).unwrap(), 3);
    }
    held.release().await.unwrap();
}

/// Statements of other sessions still running, as `id:statement`.
fn running(server: &MariaDbServer) -> Vec<(u64, String)> {
    server
        .sql(
            "SELECT ID, INFO FROM information_schema.PROCESSLIST \
             WHERE INFO IS NOT NULL AND ID <> CONNECTION_ID()",
        )
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (id, info) = l.split_once('\t')?;
            Some((id.parse().ok()?, info.to_string()))
        })
        .collect()
}

fn held_by(server: &MariaDbServer, name: &str) -> Option<u64> {
    server
        .sql(&format!("SELECT IS_USED_LOCK('{}')", advisory_name(name)))
        .unwrap()
        .trim()
        .parse()
        .ok()
}

/// At the defaults (wait forever, 30 s lease, 5 s request timeout): a waiter whose connection goes
/// silent during `GET_LOCK` (fault-proxy blackhole: no FIN, no RST) while the holder releases — the
/// server grants the waiting session, and the grant's reply is dropped — notices within the
/// documented bound (a 10 s wait slice + the request timeout), drops the dead connection (which frees
/// what its session got) and takes the lock over a new one. Before the fix the wait had no client-side
/// bound: it sat until the server closed the idle session by `wait_timeout` (the lease), then failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_connection_dies_silently_waits_on_over_a_new_connection_fault() {
    let server = MariaDbServer::start_or_panic();
    let proxy = std::sync::Arc::new(Proxy::start(server.addr()).unwrap());
    let waiters = backend(&server.url_via(proxy.addr())).await;
    let holder = backend(&server.url()).await;
    let name = unique("silent-waiter");
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let first = held.token().unwrap().get();
    let waiter = {
        let name = name.clone();
        tokio::spawn(async move { waiters.lock(&name).unwrap().acquire().await })
    };
    let started = Instant::now();
    let waiting_session = loop {
        if let Some((id, _)) = running(&server)
            .into_iter()
            .find(|(_, info)| info.contains("GET_LOCK"))
        {
            break id;
        }
        assert!(
            started.elapsed() < SLACK * 2,
            "the waiter never waited in the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let blackhole =
        |p: std::sync::Arc<Proxy>| tokio::task::spawn_blocking(move || p.blackhole().unwrap());
    blackhole(proxy.clone()).await.unwrap();
    let cut = Instant::now();
    held.release().await.unwrap();
    // The server grants the waiting session; the reply is dropped by the blackhole.
    while held_by(&server, &name) != Some(waiting_session) {
        assert!(
            cut.elapsed() < SLACK,
            "the server did not grant the waiting session"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // New connections pass again; the waiting one never gets its reply.
    let p = proxy.clone();
    tokio::task::spawn_blocking(move || p.pass().unwrap())
        .await
        .unwrap();
    let bound = Duration::from_secs(10) + Duration::from_secs(5) + SLACK;
    let guard = tokio::time::timeout(bound, waiter)
        .await
        .unwrap_or_else(|_| {
            panic!("the waiter still waited {bound:?} after its connection went silent")
        })
        .unwrap()
        .unwrap_or_else(|e| panic!("the waiter failed instead of waiting on: {e}"));
    eprintln!("the waiter got the lock {:?} after the cut", cut.elapsed());
    let now = held_by(&server, &name).expect("held");
    assert_ne!(
        now, waiting_session,
        "still held by the dead connection's session"
    );
    assert!(guard.token().unwrap().get() > first);
    guard.release().await.unwrap();
}

/// Lease mode: an acquire whose last try answered a definite "busy" undoes nothing when abandoned.
/// Before the fix its abandon cleared the row by owner alone, so a busy try of one process freed a
/// hold of the same owner id that another process took after the busy answer ("name free while
/// held"). Driven through the raw backend, so the order (busy, the other process takes the lock,
/// abandon) is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_abandon_after_busy_never_frees_a_hold_it_did_not_create() {
    use distlock_core::raw::{AcquireRequest, Attempt, Backend as _};
    let server = MariaDbServer::start_or_panic();
    let url = format!("{}?mode=lease", server.url());
    let raw = distlock_sql::mysql::connect(&url).await.unwrap();
    let (c, a, d) = (
        backend(&url).await,
        backend(&url).await,
        backend(&url).await,
    );
    let name = unique("abandon-after-busy");
    let held_by_c = c.lock(&name).unwrap().acquire().await.unwrap();
    let request = AcquireRequest::new(name.clone(), "shared-owner", Duration::from_secs(30));
    let mut acquisition = raw.begin(&request).unwrap();
    let attempt = raw.try_acquire(&mut acquisition, &request).await.unwrap();
    assert!(
        matches!(attempt, Attempt::Busy { .. }),
        "the try was not busy"
    );
    held_by_c.release().await.unwrap();
    // Another process with the same owner id takes the lock after the busy answer.
    let held_by_a = a
        .lock_as(&name, "shared-owner")
        .unwrap()
        .acquire()
        .await
        .unwrap();
    raw.abandon(acquisition, &request).await;
    let taken = d.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(
        taken.is_none(),
        "the abandon of a busy try freed another process's hold of the same owner id"
    );
    held_by_a.release().await.unwrap();
}
