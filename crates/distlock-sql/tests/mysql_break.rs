//! `distlock break` on MariaDB (`Locks::break_holder`), beyond the conformance case: in the session
//! modes (advisory, row) the holder's session is killed, so its guard is Lost at once and a waiter in
//! the server gets the lock at once, at default settings (a 30 s lease); a break aimed at a holder that
//! has gone kills nothing (neither the session now holding nor the old holder's session, idle in its
//! pool, nor a later hold on that same session, even before that hold's token is committed); a renewal
//! in flight does not undo a lease break; permit holders are never broken (a stale break while they
//! hold is no refusal either); a holder that is not distlock's, or that cannot be identified, is
//! refused; a user without the privilege to kill the holder's session is refused.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_sql::mysql::mysql_async::prelude::Queryable as _;
use distlock_sql::mysql::mysql_async::Conn;
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

/// A plain session of the server's root user, not distlock's: a blocker, or a foreign holder.
async fn raw(server: &MariaDbServer) -> Conn {
    Conn::from_url(server.url().as_str())
        .await
        .expect("raw connection")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A SQL hex literal of a name (the lock table keys names by their bytes).
fn literal(bytes: &[u8]) -> String {
    format!("X'{}'", hex(bytes))
}

/// The row-mode lock row of a name: `X'FF' || SHA-256(name)`, as `row.rs` keys it.
fn lock_row(server: &MariaDbServer, name: &str) -> String {
    let hex = server
        .sql(&format!("SELECT SHA2({}, 256)", literal(name.as_bytes())))
        .unwrap();
    format!("X'ff{}'", hex.trim())
}

/// Polls `inspect` until it shows an exclusive holder with its session (row mode: the acquire's
/// query locks the row, then marks it, microseconds apart).
async fn holder_shown(operator: &Locks, name: &str) -> HolderInfo {
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        if let Some(holder) = operator.inspect(name).await.unwrap().holder {
            if holder.owner.is_some() {
                return holder;
            }
        }
        assert!(Instant::now() < deadline, "{name}: no holder shown");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
            got
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            operator.break_holder(&name, &shown).await.unwrap(),
            "{mode}: the holder shown was not broken"
        );
        tokio::time::timeout(PROMPT, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{mode}: the broken guard was not Lost within {PROMPT:?}"));
        let got = tokio::time::timeout(PROMPT, waiting)
            .await
            .unwrap_or_else(|_| panic!("{mode}: the waiter did not get the lock within {PROMPT:?}"))
            .unwrap();
        let next = got.unwrap();
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

    // A mutex holder that has gone while permits of the name are held now (the same process's, on
    // its pooled sessions: its own old session among them): nothing to break, and no refusal either.
    server
        .sql("DELETE FROM distlock.distlock_locks_limit WHERE name = 'permits'")
        .unwrap();
    let mutex = a.lock("permits").unwrap().acquire().await.unwrap();
    let mutex_shown = operator.inspect("permits").await.unwrap().holder.unwrap();
    mutex.release().await.unwrap();
    let p1 = a.semaphore("permits", 2).unwrap().acquire().await.unwrap();
    let p2 = a.semaphore("permits", 2).unwrap().acquire().await.unwrap();
    let holders = operator.inspect("permits").await.unwrap().holders;
    assert!(
        holders.iter().any(|h| h.owner == mutex_shown.owner),
        "the mutex's old session holds a permit now (the case this checks): {holders:?}"
    );
    assert!(!operator
        .break_holder("permits", &mutex_shown)
        .await
        .unwrap());
    assert_eq!(p1.state(), LockState::Held);
    assert_eq!(p2.state(), LockState::Held);
    p1.release().await.unwrap();
    p2.release().await.unwrap();
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

/// The same session holds the name again (the pooled session the same process takes first) while its
/// grant's token is held back (the name's row locked by another transaction): the lock is taken, the
/// counter still says the first hold's token. A break aimed at the first hold kills nothing: row mode
/// tells the holds apart by their marks (`<id>/<uuid>`), advisory mode finds the counter being bumped
/// (its row read `FOR UPDATE SKIP LOCKED`). Advisory mode also on the wait path: a wait that gets the
/// lock mints the token in the same query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_hold_of_the_same_session_is_not_broken_before_its_token_is_in() {
    for (mode, waits) in [("row", false), ("advisory", false), ("advisory", true)] {
        let label = format!("{mode}{}", if waits { ", after a wait" } else { "" });
        let server = MariaDbServer::start_or_panic();
        let (a, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("m1/{mode}/{waits}");
        let lock = a.lock(&name).unwrap();
        let first = lock.acquire().await.unwrap();
        let shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        assert!(shown.token.is_some(), "{label}: {shown:?}");
        first.release().await.unwrap();

        // A holder that mints nothing takes the name first, so the next grant comes from a wait.
        let mut foreign = raw(&server).await;
        let key = distlock_sql::mysql::advisory_name(&name);
        if waits {
            foreign
                .query_drop(format!("DO GET_LOCK('{key}', 0)"))
                .await
                .unwrap();
        }
        let mut blocker = raw(&server).await;
        blocker.query_drop("START TRANSACTION").await.unwrap();
        blocker
            .query_drop(format!(
                "SELECT fence FROM distlock_locks WHERE name = {} FOR UPDATE",
                literal(name.as_bytes())
            ))
            .await
            .unwrap();
        let again =
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(20)).acquire().await },
            );
        if waits {
            tokio::time::sleep(Duration::from_millis(300)).await;
            foreign
                .query_drop(format!("DO RELEASE_LOCK('{key}')"))
                .await
                .unwrap();
        }
        let now_shown = holder_shown(&operator, &name).await;
        assert_eq!(
            now_shown.owner, shown.owner,
            "{label}: the re-acquire did not take the pooled session (the case this checks)"
        );
        if mode == "row" {
            assert_ne!(now_shown.hold_id, shown.hold_id, "{label}");
            assert_eq!(
                now_shown.token, shown.token,
                "{label}: the counter is not bumped yet"
            );
        }
        assert!(
            !operator.break_holder(&name, &shown).await.unwrap(),
            "{label}: a break aimed at the first hold ended the same session's next hold"
        );
        assert!(session_alive(&server, session_id(&shown)), "{label}");
        blocker.query_drop("ROLLBACK").await.unwrap();
        let again = again.await.unwrap().expect("the re-acquire");
        assert!(again.token() > shown.token, "{label}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(again.state(), LockState::Held, "{label}");
        assert!(
            again.extend(Duration::from_secs(30)).await.is_ok(),
            "{label}"
        );
        // The hold shown now is broken as usual.
        let again_shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        assert!(
            operator.break_holder(&name, &again_shown).await.unwrap(),
            "{label}"
        );
        tokio::time::timeout(PROMPT, again.lost()).await.unwrap();
    }
}

/// A lease break is not undone by a renewal already in flight: one renewal batch covers two names, is
/// held back on the first name's row (locked by another transaction) after its statement began (its
/// clock read), and reaches the second name's row after the break of that one committed, re-checking
/// `expires_at > clock` on the broken row. The row expired at `1000-01-01` fails it: the second name
/// is free after the renewal, its holder Lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_in_flight_does_not_undo_a_lease_break() {
    let server = MariaDbServer::start_or_panic();
    let (holder, operator, other) = (
        locks(&url(&server, "lease")).await,
        locks(&url(&server, "lease")).await,
        locks(&url(&server, "lease")).await,
    );
    let (first, second) = ("m2/a", "m2/b");
    // Two leases of 3 s taken together: their renewals (every second) go out in one batch, which
    // reaches the rows in key order.
    let lease = Duration::from_secs(3);
    let kept = holder
        .lock(first)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let broken = holder
        .lock(second)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let shown = operator.inspect(second).await.unwrap().holder.unwrap();
    let mut blocker = raw(&server).await;
    blocker.query_drop("START TRANSACTION").await.unwrap();
    blocker
        .query_drop(format!(
            "SELECT fence FROM distlock_locks WHERE name = {} FOR UPDATE",
            literal(first.as_bytes())
        ))
        .await
        .unwrap();
    let waiting = format!(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'UPDATE%CASE name%' \
         AND INFO LIKE '%{}%' AND INFO LIKE '%{}%'",
        hex(first.as_bytes()),
        hex(second.as_bytes())
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while server.sql(&waiting).unwrap().trim() != "1" {
        assert!(
            Instant::now() < deadline,
            "no renewal batch of both names came"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(operator.break_holder(second, &shown).await.unwrap());
    blocker.query_drop("ROLLBACK").await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), broken.lost())
        .await
        .expect("the broken holder is Lost at its renewal");
    let next = other
        .lock(second)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the broken lease is free after the renewal that was in flight");
    assert!(next.token() > shown.token);
    assert_eq!(kept.state(), LockState::Held);
    next.release().await.unwrap();
    kept.release().await.unwrap();
}

/// A session holding the name's `GET_LOCK` that minted no token (another client's) is shown without a
/// token and refused: a break could not tell its hold from a later one of that session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_is_not_distlock_is_refused() {
    let server = MariaDbServer::start_or_panic();
    let (a, operator) = (
        locks(&url(&server, "advisory")).await,
        locks(&url(&server, "advisory")).await,
    );
    let name = "foreign";
    // A distlock hold first, so the name has a counter (minted by another session).
    a.lock(name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let mut foreign = raw(&server).await;
    foreign
        .query_drop(format!(
            "DO GET_LOCK('{}', 0)",
            distlock_sql::mysql::advisory_name(name)
        ))
        .await
        .unwrap();
    let info = operator.inspect(name).await.unwrap();
    let shown = info.holder.unwrap();
    assert_eq!(shown.token, None, "{shown:?}");
    assert!(info.last_token.is_some());
    assert!(shown.host.is_some(), "{shown:?}");
    let refused = operator.break_holder(name, &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(
        refused.to_string().contains("no distlock holder"),
        "{refused}"
    );
    // Given with the name's last token, as if it were the minter's: still refused.
    let mut with_token = shown.clone();
    with_token.token = info.last_token;
    let refused = operator.break_holder(name, &with_token).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(session_alive(&server, session_id(&shown)));
}

/// Row mode: a row locked by a session that recorded no mark is shown held, without a session, and a
/// break says it cannot tell whom to end; a mark left committed in a free row (not a live hold's) is
/// not shown as a holder, and a break aimed at it kills nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_mode_shows_only_a_live_marked_hold() {
    let server = MariaDbServer::start_or_panic();
    let (a, operator) = (
        locks(&url(&server, "row")).await,
        locks(&url(&server, "row")).await,
    );
    let name = "unmarked";
    a.lock(name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let row = lock_row(&server, name);
    let mut foreign = raw(&server).await;
    foreign.query_drop("START TRANSACTION").await.unwrap();
    foreign
        .query_drop(format!(
            "SELECT 1 FROM distlock_locks WHERE name = {row} FOR UPDATE"
        ))
        .await
        .unwrap();
    let shown = operator.inspect(name).await.unwrap().holder.unwrap();
    assert_eq!(shown.owner, None, "{shown:?}");
    let refused = operator.break_holder(name, &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(
        refused.to_string().contains("cannot tell whom"),
        "{refused}"
    );
    foreign.query_drop("ROLLBACK").await.unwrap();

    // A mark committed by hand, naming a live session (the operator's own pooled one would do; a raw
    // one here): the row is free, so nobody holds it.
    let victim: u64 = foreign
        .query_first("SELECT CONNECTION_ID()")
        .await
        .unwrap()
        .unwrap();
    let mark = format!("{victim}/00000000-0000-0000-0000-000000000000");
    server
        .sql(&format!(
            "UPDATE distlock.distlock_locks SET owner = '{mark}' WHERE name = {row}"
        ))
        .unwrap();
    let info = operator.inspect(name).await.unwrap();
    assert!(info.holder.is_none(), "{info:?}");
    let mut stale = HolderInfo::default();
    stale.owner = Some(format!("mysql session {victim}"));
    stale.hold_id = Some(mark);
    assert!(!operator.break_holder(name, &stale).await.unwrap());
    assert!(session_alive(&server, victim));
}
