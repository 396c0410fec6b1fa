//! `distlock break` on PostgreSQL (`Locks::break_holder`), beyond the conformance case: in the
//! session modes (advisory, row) the holder's backend is terminated, so its guard is Lost at once and
//! a waiter in the server gets the lock at once, at default settings (a 30 s lease); a break aimed at a
//! holder that has gone terminates nothing (neither the session now holding nor the old holder's
//! session, idle in its pool, nor a later hold on that same session, even before that hold's token is
//! committed); a renewal in flight does not undo a lease break; readers and permit holders are never
//! broken (a stale break while they hold is no refusal either); a holder that is not distlock's is
//! broken only while inspect can tell its hold from a later one; a role without the privilege to end
//! the holder's session is refused.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant, SystemTime};

use distlock_core::raw::HolderInfo;
use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_sql::postgres::tokio_postgres::{self, Client, NoTls};
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

/// A plain client of the superuser, not distlock's (`application_name` as given): a blocker, or a
/// foreign holder.
async fn raw(server: &PostgresServer, application: &str) -> Client {
    let url = format!("{}?application_name={application}", server.url());
    let (client, connection) = tokio_postgres::connect(&url, NoTls)
        .await
        .expect("raw connect");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Polls `inspect` until it shows an exclusive holder.
async fn holder_shown(operator: &Locks, name: &str) -> HolderInfo {
    let deadline = Instant::now() + Duration::from_secs(4);
    loop {
        if let Some(holder) = operator.inspect(name).await.unwrap().holder {
            return holder;
        }
        assert!(Instant::now() < deadline, "{name}: no holder shown");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
            got
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
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
        let got = tokio::time::timeout(PROMPT, waiting)
            .await
            .unwrap_or_else(|_| panic!("{mode}: the waiter did not get the lock within {PROMPT:?}"))
            .unwrap();
        let next = got.unwrap();
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
        // Both modes list the readers (row mode from the row's multixact), never "free".
        assert_eq!(info.kind, Some(LockKind::Read), "{mode}: {info:?}");
        assert_eq!(info.holders.len(), 2, "{mode}: {info:?}");
        for aimed in &info.holders {
            let refused = operator.break_holder(&name, aimed).await.unwrap_err();
            assert_eq!(refused.kind(), ErrorKind::Unsupported, "{mode}: {refused}");
            assert!(
                refused.to_string().contains("exclusive holder"),
                "{mode}: {refused}"
            );
            // Given without its hold id (not as inspect showed it), its session is found reading.
            let mut bare = aimed.clone();
            bare.hold_id = None;
            let refused = operator.break_holder(&name, &bare).await.unwrap_err();
            assert_eq!(refused.kind(), ErrorKind::Unsupported, "{mode}: {refused}");
            assert!(session_alive(&server, backend_pid(aimed)), "{mode}");
        }
        // A holder that is not there: nothing to break, and no refusal.
        let mut gone = HolderInfo::default();
        gone.owner = Some("postgres backend 1".into());
        assert!(
            !operator.break_holder(&name, &gone).await.unwrap(),
            "{mode}"
        );
        // One reader left: row mode finds it as the row's xmax.
        r2.release().await.unwrap();
        let info = operator.inspect(&name).await.unwrap();
        assert_eq!(info.kind, Some(LockKind::Read), "{mode}: {info:?}");
        assert_eq!(info.holders.len(), 1, "{mode}: {info:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(r1.state(), LockState::Held, "{mode}");
        r1.release().await.unwrap();
        let info = operator.inspect(&name).await.unwrap();
        assert_eq!(
            (info.kind, info.holders.len()),
            (None, 0),
            "{mode}: {info:?}"
        );
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

    // A mutex holder that has gone while permits of the name are held now (the same process's, on
    // its pooled sessions): nothing to break, and no refusal either.
    let mutex = a.lock("permits").unwrap().acquire().await.unwrap();
    let mutex_shown = operator.inspect("permits").await.unwrap().holder.unwrap();
    mutex.release().await.unwrap();
    let permit = a.semaphore("permits", 2).unwrap().acquire().await.unwrap();
    let holders = operator.inspect("permits").await.unwrap().holders;
    assert!(
        holders.iter().any(|h| h.owner == mutex_shown.owner),
        "the mutex's old session holds the permit now (the case this checks): {holders:?}"
    );
    assert!(!operator
        .break_holder("permits", &mutex_shown)
        .await
        .unwrap());
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

/// The same session holds the name again (the pooled connection the same process takes first) while
/// its grant's token is held back (the counter row locked by another transaction): the lock is taken,
/// the counter still says the first hold's token. A break aimed at the first hold terminates nothing:
/// row mode tells the holds apart by their transaction, advisory mode finds the counter being bumped
/// (read `FOR SHARE SKIP LOCKED`). Advisory mode also on the wait path: a wait that gets the lock
/// mints the token in the same statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_hold_of_the_same_session_is_not_broken_before_its_token_is_in() {
    for (mode, waits) in [("row", false), ("advisory", false), ("advisory", true)] {
        let label = format!("{mode}{}", if waits { ", after a wait" } else { "" });
        let server = PostgresServer::start_or_panic();
        let (a, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("m1/{mode}/{waits}");
        let lock = a.lock(&name).unwrap();
        let first = lock.acquire().await.unwrap();
        let shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        assert!(shown.hold_id.is_some(), "{label}: {shown:?}");
        first.release().await.unwrap();

        // A holder that mints nothing takes the name first, so the next grant comes from a wait.
        let foreign = raw(&server, "psql").await;
        if waits {
            foreign
                .execute(
                    "SELECT pg_advisory_lock($1)",
                    &[&distlock_sql::postgres::layout::advisory_key(&name)],
                )
                .await
                .unwrap();
        }
        let blocker = raw(&server, "blocker").await;
        blocker.batch_execute("BEGIN").await.unwrap();
        blocker
            .query(
                "SELECT token FROM distlock_locks_fence WHERE name = $1 FOR UPDATE",
                &[&name],
            )
            .await
            .unwrap();
        let again =
            tokio::spawn(
                async move { lock.options().wait(Duration::from_secs(20)).acquire().await },
            );
        if waits {
            tokio::time::sleep(Duration::from_millis(300)).await;
            foreign
                .execute(
                    "SELECT pg_advisory_unlock($1)",
                    &[&distlock_sql::postgres::layout::advisory_key(&name)],
                )
                .await
                .unwrap();
        }
        let now_shown = holder_shown(&operator, &name).await;
        assert_eq!(
            now_shown.owner, shown.owner,
            "{label}: the re-acquire did not take the pooled session (the case this checks)"
        );
        assert_eq!(
            now_shown.token, shown.token,
            "{label}: the counter is not bumped yet"
        );
        assert!(
            !operator.break_holder(&name, &shown).await.unwrap(),
            "{label}: a break aimed at the first hold ended the same session's next hold"
        );
        assert!(session_alive(&server, backend_pid(&shown)), "{label}");
        blocker.batch_execute("COMMIT").await.unwrap();
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

/// A lease break is not undone by a renewal already in flight: the renewal's statement began (its
/// `now()` taken) before the break and reaches the row after the break committed (held back by a
/// statement trigger that sleeps in renewals), and re-checks `expires_at > now()` on the broken row.
/// The row expired at `-infinity` fails it: the lock is free after the renewal, the holder Lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_in_flight_does_not_undo_a_lease_break() {
    let server = PostgresServer::start_or_panic();
    let (holder, operator, other) = (
        locks(&url(&server, "lease")).await,
        locks(&url(&server, "lease")).await,
        locks(&url(&server, "lease")).await,
    );
    let name = "m2/lease";
    // A 6 s lease: the watchdog renews every 2 s.
    let guard = holder
        .lock(name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    server
        .psql(
            "CREATE TABLE slow_renewal (on_ boolean NOT NULL); INSERT INTO slow_renewal VALUES (true); \
             CREATE FUNCTION slow_renewal() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               IF current_query() LIKE '%unnest%' AND (SELECT on_ FROM slow_renewal) THEN \
                 PERFORM pg_sleep(1.5); END IF; RETURN NULL; END $$; \
             CREATE TRIGGER slow_renewal BEFORE UPDATE ON distlock_locks \
               FOR EACH STATEMENT EXECUTE FUNCTION slow_renewal()",
        )
        .unwrap();
    let shown = operator.inspect(name).await.unwrap().holder.unwrap();
    // The next renewal (within 2 s) begins and sleeps in the trigger, before it reads the row.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server
        .psql(
            "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
             AND query LIKE '%unnest%' AND wait_event = 'PgSleep'",
        )
        .unwrap()
        != "1"
    {
        assert!(Instant::now() < deadline, "no renewal came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(operator.break_holder(name, &shown).await.unwrap());
    server.psql("UPDATE slow_renewal SET on_ = false").unwrap();
    // The renewal goes on after its sleep and finds the lease broken.
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the broken holder is Lost at its renewal");
    let next = other
        .lock(name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the broken lease is free after the renewal that was in flight");
    assert!(next.token() > shown.token);
    next.release().await.unwrap();
}

/// A holder that is not one of distlock's sessions (`application_name` not distlock's, no token) is
/// broken only while its session stayed idle since inspect saw it so (a later hold of it would have
/// run statements); a role that cannot read its activity cannot tell, and is refused. It is shown with
/// its `application_name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_is_not_distlock_is_broken_only_while_its_hold_is_known() {
    let server = PostgresServer::start_or_panic();
    let operator = locks(&url(&server, "advisory")).await;
    let name = "foreign";
    let key = distlock_sql::postgres::layout::advisory_key(name);
    let lock = "SELECT pg_advisory_lock($1)";
    let unlock = "SELECT pg_advisory_unlock($1)";

    // Seen idle, then it lets go and takes the name again: a break aimed at the first hold is stale.
    let psql = raw(&server, "psql").await;
    psql.execute(lock, &[&key]).await.unwrap();
    let shown = operator.inspect(name).await.unwrap().holder.unwrap();
    assert!(
        shown
            .host
            .as_deref()
            .is_some_and(|h| h.contains("\"psql\"")),
        "{shown:?}"
    );
    assert_eq!(shown.token, None, "{shown:?}");
    assert!(shown
        .hold_id
        .as_deref()
        .is_some_and(|h| h.contains("idle=")));
    psql.execute(unlock, &[&key]).await.unwrap();
    psql.execute(lock, &[&key]).await.unwrap();
    assert!(!operator.break_holder(name, &shown).await.unwrap());
    assert!(session_alive(&server, backend_pid(&shown)));
    // Shown again, idle since: broken.
    let shown = operator.inspect(name).await.unwrap().holder.unwrap();
    assert!(operator.break_holder(name, &shown).await.unwrap());
    assert!(!session_alive(&server, backend_pid(&shown)));

    // A role that may end the session but cannot read its activity: refused, nothing ended.
    server
        .psql(
            "CREATE ROLE op LOGIN PASSWORD 'op-pw'; GRANT pg_signal_backend TO op; \
             GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO op; \
             CREATE ROLE app LOGIN PASSWORD 'app-pw'",
        )
        .unwrap();
    let op = locks(&format!(
        "postgres://op:op-pw@{}/postgres?mode=advisory",
        server.addr()
    ))
    .await;
    let (app, connection) = tokio_postgres::connect(
        &format!(
            "postgres://app:app-pw@{}/postgres?application_name=app",
            server.addr()
        ),
        NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    app.execute(lock, &[&key]).await.unwrap();
    let shown = op.inspect(name).await.unwrap().holder.unwrap();
    assert!(
        shown.host.as_deref().is_some_and(|h| h.contains("\"app\"")),
        "{shown:?}"
    );
    let refused = op.break_holder(name, &shown).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unsupported, "{refused}");
    assert!(
        refused.to_string().contains("not one of distlock's"),
        "{refused}"
    );
    assert!(session_alive(&server, backend_pid(&shown)));
}

/// Row mode shows when the hold began (its transaction's start), advisory mode nothing (the session's
/// start is not the hold's); a role that may not tell a writer from readers (no UPDATE on the table)
/// gets an error, never "free".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_the_holds_start_and_never_guesses_free() {
    let server = PostgresServer::start_or_panic();
    for mode in ["advisory", "row"] {
        let (a, operator) = (
            locks(&url(&server, mode)).await,
            locks(&url(&server, mode)).await,
        );
        let name = format!("since/{mode}");
        // Sessions opened well before the hold.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let before = SystemTime::now() - Duration::from_millis(200);
        let guard = a.lock(&name).unwrap().acquire().await.unwrap();
        let shown = operator.inspect(&name).await.unwrap().holder.unwrap();
        match mode {
            "row" => {
                let since = shown.since.expect("row mode shows the hold's start");
                assert!(since >= before, "{mode}: {shown:?}");
                assert!(since <= SystemTime::now(), "{mode}: {shown:?}");
            }
            _ => assert_eq!(shown.since, None, "{mode}: {shown:?}"),
        }
        assert!(
            shown
                .host
                .as_deref()
                .is_some_and(|h| h.contains("\"distlock\"")),
            "{mode}: {shown:?}"
        );
        guard.release().await.unwrap();
    }

    server
        .psql(
            "CREATE ROLE reader LOGIN PASSWORD 'r-pw'; GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader",
        )
        .unwrap();
    let reader = locks(&format!(
        "postgres://reader:r-pw@{}/postgres?mode=row",
        server.addr()
    ))
    .await;
    let a = locks(&url(&server, "row")).await;
    let guard = a.lock("since/row").unwrap().acquire().await.unwrap();
    let refused = reader.inspect("since/row").await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");
    assert!(refused.to_string().contains("GRANT UPDATE"), "{refused}");
    guard.release().await.unwrap();
}
