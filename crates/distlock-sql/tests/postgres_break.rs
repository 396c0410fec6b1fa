//! `distlock break` on PostgreSQL (`Locks::break_holder`), beyond the conformance case: in the
//! session modes (advisory, row) the holder's backend is terminated, so its guard is Lost at once and
//! a waiter in the server gets the lock at once, at default settings (a 30 s lease); a break aimed at a
//! holder that has gone terminates nothing (neither the session now holding nor the old holder's
//! session, idle in its pool, nor a later hold on that same session); readers and permit holders are
//! never broken; a role without the privilege to end the holder's session is refused.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::postgres::PostgresServer;

/// How soon a broken session holder's guard is Lost and a waiter holds: the server ends the session
/// at once and the driver reads the close at once; this is slack for a loaded machine.
const PROMPT: Duration = Duration::from_secs(3);

async fn locks(url: &str) -> Locks {
    Locks::new(PostgresBackend::connect(url).await.expect("connect"))
}

fn url(server: &PostgresServer, mode: &str) -> String {
    format!("{}?mode={mode}", server.url())
}

/// The backend pid in a session holder's owner (`postgres backend <pid>`).
fn backend_pid(holder: &HolderInfo) -> i32 {
    holder
        .owner
        .as_deref()
        .and_then(|o| o.strip_prefix("postgres backend "))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("inspect shows no backend pid: {holder:?}"))
}

fn session_alive(server: &PostgresServer, pid: i32) -> bool {
    server
        .psql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
        ))
        .unwrap()
        == "1"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_session_holder_is_lost_at_once_and_a_waiter_gets_the_lock() {
    for mode in ["advisory", "row"] {
        let server = PostgresServer::start_or_panic();
        let (holder, other, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("break/{mode}");
        // Default settings: a 30 s lease, so only the closed session can tell the guard so soon.
        let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
        let info = operator.inspect(&name).await.unwrap();
        assert_eq!(info.kind, Some(LockKind::Mutex), "{mode}");
        let shown = info.holder.expect("inspect shows the holder");
        assert_eq!(shown.token, guard.token(), "{mode}: the holder's token");
        let pid = backend_pid(&shown);
        assert!(session_alive(&server, pid), "{mode}");

        let waiter = other.lock(&name).unwrap();
        let waiting = tokio::spawn(async move {
            let got = waiter
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await;
            (got, Instant::now())
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let broke_at = Instant::now();
        assert!(
            operator.break_holder(&name, &shown).await.unwrap(),
            "{mode}: the holder shown was not broken"
        );
        assert!(
            !session_alive(&server, pid),
            "{mode}: the break returned with the holder's backend still there"
        );
        tokio::time::timeout(PROMPT, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{mode}: the broken guard was not Lost within {PROMPT:?}"));
        let (got, got_at) = tokio::time::timeout(PROMPT, waiting)
            .await
            .unwrap_or_else(|_| panic!("{mode}: the waiter did not get the lock within {PROMPT:?}"))
            .unwrap();
        let next = got.unwrap();
        assert!(
            got_at.duration_since(broke_at) < PROMPT,
            "{mode}: the waiter got it {:?} after the break",
            got_at.duration_since(broke_at)
        );
        assert!(
            next.token() > shown.token,
            "{mode}: a new token after the broken one"
        );
        // Broken again with the same holder: it is gone, nothing is touched.
        assert!(!operator.break_holder(&name, &shown).await.unwrap());
        assert_eq!(next.state(), LockState::Held);
        next.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_break_terminates_nothing() {
    for mode in ["advisory", "row"] {
        let server = PostgresServer::start_or_panic();
        let (a, b, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("stale/{mode}");
        let first = a.lock(&name).unwrap().acquire().await.unwrap();
        let first_shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        first.release().await.unwrap();
        let second = b.lock(&name).unwrap().acquire().await.unwrap();
        let second_shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        let (pid_a, pid_b) = (backend_pid(&first_shown), backend_pid(&second_shown));
        assert_ne!(pid_a, pid_b, "{mode}: two clients, two sessions");

        assert!(
            !operator.break_holder(&name, &first_shown).await.unwrap(),
            "{mode}: a break aimed at the first holder reported a broken hold"
        );
        // The session alone (no token, no session start) tells the holders apart too.
        let mut by_session = first_shown.clone();
        (by_session.token, by_session.since) = (None, None);
        assert!(
            !operator.break_holder(&name, &by_session).await.unwrap(),
            "{mode}: a break aimed at the first holder's session reported a broken hold"
        );
        assert!(
            session_alive(&server, pid_b),
            "{mode}: the new holder's session was ended"
        );
        assert!(
            session_alive(&server, pid_a),
            "{mode}: the old holder's session (idle in its pool) was ended"
        );
        // The new holder still holds, on a live connection: its probe goes through.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(second.state(), LockState::Held, "{mode}");
        assert!(
            second.extend(Duration::from_secs(30)).await.is_ok(),
            "{mode}: the new holder's connection is not alive"
        );
        assert_eq!(
            operator.inspect(&name).await.unwrap().holder.unwrap().owner,
            second_shown.owner,
            "{mode}"
        );
        assert!(a
            .lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        second.release().await.unwrap();

        // The same session holds the name again (the old holder's pooled connection): the break aimed
        // at its earlier hold is refused by the token, not by the session.
        let again = a.lock(&name).unwrap().acquire().await.unwrap();
        let again_shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        assert_eq!(
            again_shown.owner, first_shown.owner,
            "{mode}: the re-acquire did not reuse the pooled session (the case this checks)"
        );
        assert!(again_shown.token > first_shown.token);
        assert!(
            !operator.break_holder(&name, &first_shown).await.unwrap(),
            "{mode}: a break aimed at an earlier hold ended a later hold of the same session"
        );
        assert!(session_alive(&server, pid_a), "{mode}");
        assert_eq!(again.state(), LockState::Held, "{mode}");
        again.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_permit_holders_are_never_broken() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let (a, b, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("readers/{mode}");
        let r1 = a.read_write(&name).unwrap().read().await.unwrap();
        let r2 = b.read_write(&name).unwrap().read().await.unwrap();
        let info = operator.inspect(&name).await.unwrap();
        assert!(info.holder.is_none(), "{mode}: {info:?}");
        // Advisory mode lists the readers; row mode cannot (a reader's row lock names no session):
        // a holder that is not there stands for them.
        let aimed = match mode {
            "advisory" => {
                assert_eq!(info.kind, Some(LockKind::Read));
                assert_eq!(info.holders.len(), 2, "{info:?}");
                info.holders[0].clone()
            }
            _ => {
                let mut h = HolderInfo::default();
                h.owner = Some("postgres backend 1".into());
                h
            }
        };
        let refused = operator.break_holder(&name, &aimed).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Unsupported, "{mode}: {refused}");
        assert!(
            refused.to_string().contains("exclusive holder"),
            "{mode}: {refused}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(r1.state(), LockState::Held, "{mode}");
        assert_eq!(r2.state(), LockState::Held, "{mode}");
        r1.release().await.unwrap();
        r2.release().await.unwrap();
    }

    // Permits (advisory mode): the holder shown is refused for its permit, and a holder without one
    // is refused because the name is held only by permits.
    let (a, operator) = (
        locks(&url(&server, "advisory")).await,
        locks(&url(&server, "advisory")).await,
    );
    let permit = a.semaphore("permits", 2).unwrap().acquire().await.unwrap();
    let info = operator.inspect("permits").await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 2 }));
    let shown = info.holders[0].clone();
    assert!(shown.permit.is_some());
    let refused = operator.break_holder("permits", &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    let mut without_permit = shown.clone();
    without_permit.permit = None;
    let refused = operator
        .break_holder("permits", &without_permit)
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(session_alive(&server, backend_pid(&shown)));
    assert_eq!(permit.state(), LockState::Held);
    permit.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_end_the_session_is_denied() {
    let server = PostgresServer::start_or_panic();
    let holder = locks(&url(&server, "advisory")).await;
    server
        .psql(
            "CREATE ROLE op LOGIN PASSWORD 'op-pw'; \
             GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO op",
        )
        .unwrap();
    let op_url = format!(
        "postgres://op:op-pw@{}/postgres?mode=advisory",
        server.addr()
    );
    let operator = locks(&op_url).await;
    let guard = holder.lock("guarded").unwrap().acquire().await.unwrap();
    let shown = operator.inspect("guarded").await.unwrap().holder.unwrap();
    let refused = operator.break_holder("guarded", &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");
    assert!(
        refused.to_string().contains("pg_signal_backend"),
        "{refused}"
    );
    assert!(session_alive(&server, backend_pid(&shown)));
    assert_eq!(guard.state(), LockState::Held);
    // With pg_signal_backend it may (the holder is no superuser's session: distlock's `postgres`
    // is a superuser, so its sessions stay out of reach; a plain role's are in reach).
    drop(guard);
    server
        .psql("CREATE ROLE app LOGIN PASSWORD 'app-pw'; GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO app; GRANT pg_signal_backend TO op")
        .unwrap();
    let app_url = format!(
        "postgres://app:app-pw@{}/postgres?mode=advisory",
        server.addr()
    );
    let app = locks(&app_url).await;
    let guard = app.lock("guarded").unwrap().acquire().await.unwrap();
    let shown = operator.inspect("guarded").await.unwrap().holder.unwrap();
    assert!(operator.break_holder("guarded", &shown).await.unwrap());
    tokio::time::timeout(PROMPT, guard.lost()).await.unwrap();
}
