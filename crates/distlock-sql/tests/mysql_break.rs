//! `distlock break` on MariaDB (`Locks::break_holder`), beyond the conformance case: in the session
//! modes (advisory, row) the holder's session is killed, so its guard is Lost at once and a waiter in
//! the server gets the lock at once, at default settings (a 30 s lease); a break aimed at a holder that
//! has gone kills nothing (neither the session now holding nor the old holder's session, idle in its
//! pool, nor a later hold on that same session); permit holders are never broken; a user without the
//! privilege to kill the holder's session is refused.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_testkit::mariadb::MariaDbServer;

/// How soon a broken session holder's guard is Lost and a waiter holds: the server ends the session
/// at once and the holder's socket watch sees it close at once; this is slack for a loaded machine.
const PROMPT: Duration = Duration::from_secs(3);

async fn locks(url: &str) -> Locks {
    Locks::new(distlock_sql::mysql::connect(url).await.expect("connect"))
}

fn url(server: &MariaDbServer, mode: &str) -> String {
    format!("{}?mode={mode}", server.url())
}

/// The session id in a session holder's owner (`mysql session <id>`).
fn session_id(holder: &HolderInfo) -> u64 {
    holder
        .owner
        .as_deref()
        .and_then(|o| o.strip_prefix("mysql session "))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("inspect shows no session id: {holder:?}"))
}

fn session_alive(server: &MariaDbServer, id: u64) -> bool {
    server
        .sql(&format!(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {id}"
        ))
        .unwrap()
        .trim()
        == "1"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_session_holder_is_lost_at_once_and_a_waiter_gets_the_lock() {
    for mode in ["advisory", "row"] {
        let server = MariaDbServer::start_or_panic();
        let (holder, other, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("break/{mode}");
        // Default settings: a 30 s lease, so only the killed session can tell the guard so soon.
        let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
        let info = operator.inspect(&name).await.unwrap();
        assert_eq!(info.kind, Some(LockKind::Mutex), "{mode}");
        let shown = info.holder.expect("inspect shows the holder");
        assert_eq!(shown.token, guard.token(), "{mode}: the holder's token");
        let id = session_id(&shown);
        assert!(session_alive(&server, id), "{mode}");

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
            !session_alive(&server, id),
            "{mode}: the holder's session is still there"
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
async fn a_stale_break_kills_nothing() {
    for mode in ["advisory", "row"] {
        let server = MariaDbServer::start_or_panic();
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
        let (id_a, id_b) = (session_id(&first_shown), session_id(&second_shown));
        assert_ne!(id_a, id_b, "{mode}: two clients, two sessions");

        assert!(
            !operator.break_holder(&name, &first_shown).await.unwrap(),
            "{mode}: a break aimed at the first holder reported a broken hold"
        );
        // The session alone (no token) tells the holders apart too.
        let mut by_session = first_shown.clone();
        by_session.token = None;
        assert!(
            !operator.break_holder(&name, &by_session).await.unwrap(),
            "{mode}: a break aimed at the first holder's session reported a broken hold"
        );
        assert!(
            session_alive(&server, id_b),
            "{mode}: the new holder's session was killed"
        );
        assert!(
            session_alive(&server, id_a),
            "{mode}: the old holder's session (idle in its pool) was killed"
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

        // The same session holds the name again (the old holder's pooled session): the break aimed at
        // its earlier hold is refused by the token, not by the session.
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
        assert!(session_alive(&server, id_a), "{mode}");
        assert_eq!(again.state(), LockState::Held, "{mode}");
        again.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_holders_are_never_broken() {
    let server = MariaDbServer::start_or_panic();
    let (a, operator) = (
        locks(&url(&server, "advisory")).await,
        locks(&url(&server, "advisory")).await,
    );
    let permit = a.semaphore("permits", 2).unwrap().acquire().await.unwrap();
    let info = operator.inspect("permits").await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 2 }));
    assert!(info.holder.is_none());
    let shown = info.holders[0].clone();
    assert!(shown.permit.is_some());
    let refused = operator.break_holder("permits", &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(
        refused.to_string().contains("exclusive holder"),
        "{refused}"
    );
    // Without its permit it is aimed at the name's mutex, which nobody holds: the name is held only
    // by permits.
    let mut without_permit = shown.clone();
    without_permit.permit = None;
    let refused = operator
        .break_holder("permits", &without_permit)
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(session_alive(&server, session_id(&shown)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(permit.state(), LockState::Held);
    permit.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_that_may_not_kill_the_session_is_denied() {
    let server = MariaDbServer::start_or_panic();
    let holder = locks(&url(&server, "advisory")).await;
    server
        .sql(
            "CREATE USER 'op'@'127.0.0.1' IDENTIFIED BY 'op-pw'; \
             GRANT SELECT, INSERT, UPDATE, CREATE ON distlock.* TO 'op'@'127.0.0.1'",
        )
        .unwrap();
    let op_url = format!("mysql://op:op-pw@{}/distlock?mode=advisory", server.addr());
    let operator = locks(&op_url).await;
    let guard = holder.lock("guarded").unwrap().acquire().await.unwrap();
    let shown = operator.inspect("guarded").await.unwrap().holder.unwrap();
    let refused = operator.break_holder("guarded", &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");
    assert!(
        refused.to_string().contains("CONNECTION ADMIN"),
        "{refused}"
    );
    assert!(session_alive(&server, session_id(&shown)));
    assert_eq!(guard.state(), LockState::Held);
    server
        .sql("GRANT CONNECTION ADMIN ON *.* TO 'op'@'127.0.0.1'")
        .unwrap();
    // A privilege granted applies to sessions opened after it: a new backend.
    let operator = locks(&op_url).await;
    assert!(operator.break_holder("guarded", &shown).await.unwrap());
    tokio::time::timeout(PROMPT, guard.lost()).await.unwrap();
}
