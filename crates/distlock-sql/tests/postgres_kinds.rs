//! The read-write lock and the semaphore on PostgreSQL (issue 25), beyond the shared conformance
//! cases: what each mode announces, the order of readers behind a waiting writer (the server's lock
//! queue), a downgrade that no waiting writer can get into, interop with a client that runs the
//! advisory calls itself on the documented key (as .NET DistributedLock's reader-writer lock does),
//! the semaphore's layout on the server (one slot and the name's key shared per permit, the stored
//! limit, the wake-up), how kinds on one name exclude each other, and a killed session freeing a
//! reader or a permit at once.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockKind, LockState, Locks, ReadWriteOrder};
use distlock_sql::postgres::layout::{advisory_key, permit_key, pg_locks_row};
use distlock_sql::postgres::tokio_postgres::{self, AsyncMessage, Client, NoTls};
use distlock_sql::postgres::PostgresBackend;
use distlock_testkit::postgres::PostgresServer;

/// Comfortably longer than anything here takes on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(10);

fn unique(case: &str) -> String {
    format!("kinds/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn locks(server: &PostgresServer, mode: &str) -> Locks {
    Locks::new(
        PostgresBackend::connect(&format!("{}?mode={mode}", server.url()))
            .await
            .expect("connect"),
    )
}

/// A plain client that runs the advisory calls itself; notifications go to the returned receiver.
async fn raw(
    server: &PostgresServer,
) -> (
    Client,
    tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
) {
    let (client, mut connection) = tokio_postgres::connect(&server.url(), NoTls)
        .await
        .expect("raw connect");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    let _ = tx.send(n);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    (client, rx)
}

/// `pg_locks` rows of a name's key: `(mode, granted)`, in the server's order.
fn key_rows(server: &PostgresServer, name: &str) -> Vec<(String, bool)> {
    let (classid, objid, objsubid) =
        pg_locks_row(distlock_sql::AdvisoryKey::Single(advisory_key(name)));
    let out = server
        .psql(&format!(
            "SELECT mode || ',' || granted FROM pg_locks WHERE locktype = 'advisory' \
             AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid} ORDER BY granted DESC, pid"
        ))
        .unwrap();
    out.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (mode, granted) = l.split_once(',').unwrap();
            (mode.to_string(), granted == "true")
        })
        .collect()
}

/// Waits until `pg_locks` shows `waiting` requests of `mode` queued on the name's key.
async fn until_queued(server: &PostgresServer, name: &str, mode: &str, waiting: usize) {
    let started = Instant::now();
    loop {
        let queued = key_rows(server, name)
            .iter()
            .filter(|(m, granted)| m == mode && !granted)
            .count();
        if queued == waiting {
            return;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "{waiting} queued {mode} on the key never showed: {:?}; {}",
            key_rows(server, name),
            server
                .psql(
                    "SELECT l.pid, l.mode, l.granted, l.objid, a.state, a.query FROM pg_locks l \
                     JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory'"
                )
                .unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_write_queues_readers_behind_a_waiting_writer_downgrades_in_place_and_shares_the_key_with_raw_sql(
) {
    let server = PostgresServer::start_or_panic();
    let (a, b, c) = (
        locks(&server, "advisory").await,
        locks(&server, "advisory").await,
        locks(&server, "advisory").await,
    );

    // What each mode announces.
    let kinds = a.capabilities().kinds;
    assert!(kinds.read_write && kinds.semaphore && kinds.atomic_downgrade);
    assert_eq!(kinds.read_write_order, ReadWriteOrder::Fifo);
    let row = locks(&server, "row").await.capabilities().kinds;
    assert!(row.read_write && !row.semaphore && !row.atomic_downgrade);
    assert_eq!(row.read_write_order, ReadWriteOrder::ReadersFirst);
    let lease = locks(&server, "lease").await.capabilities().kinds;
    assert!(!lease.read_write && !lease.semaphore);

    // Order: a reader that comes while a writer waits behind a reader queues behind the writer.
    let name = unique("fifo");
    let first = a.read_write(&name).unwrap().read().await.unwrap();
    let writer = b.read_write(&name).unwrap();
    let waiting_writer = tokio::spawn(async move {
        let guard = writer
            .writer()
            .options()
            .wait(Duration::from_secs(60))
            .acquire()
            .await
            .expect("the writer");
        (guard, Instant::now())
    });
    until_queued(&server, &name, "ExclusiveLock", 1).await;
    let late = c.read_write(&name).unwrap();
    assert!(
        late.reader().try_acquire().await.unwrap().is_none(),
        "a reader got in past a waiting writer: {:?}",
        key_rows(&server, &name)
    );
    let late_reader = tokio::spawn(async move {
        let guard = late
            .reader()
            .options()
            .wait(Duration::from_secs(60))
            .acquire()
            .await
            .expect("the late reader");
        (guard, Instant::now())
    });
    until_queued(&server, &name, "ShareLock", 1).await;
    first.release().await.unwrap();
    let (write, written_at) = tokio::time::timeout(PATIENCE, waiting_writer)
        .await
        .expect("the writer got the lock once the first reader left")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !late_reader.is_finished(),
        "the late reader got in beside the writer"
    );
    write.release().await.unwrap();
    let (read, read_at) = tokio::time::timeout(PATIENCE, late_reader)
        .await
        .expect("the late reader got in after the writer")
        .unwrap();
    assert!(read_at > written_at);
    read.release().await.unwrap();

    // Downgrade: with a writer of another client waiting for the key (as a .NET DistributedLock
    // writer waits), the write hold becomes a read hold on the same session, and the waiting writer
    // does not get in between.
    let name = unique("downgrade");
    let key = advisory_key(&name);
    let rw = a.read_write(&name).unwrap();
    let mut guard = rw.write().await.unwrap();
    let token = guard.token();
    let (other, _) = raw(&server).await;
    let other_writer = tokio::spawn(async move {
        other
            .query_one("SELECT pg_catalog.pg_advisory_lock($1)", &[&key])
            .await
            .expect("the other writer");
        other
    });
    until_queued(&server, &name, "ExclusiveLock", 1).await;
    guard.downgrade().await.expect("downgrade");
    assert_eq!(
        (guard.kind(), guard.token(), guard.state()),
        (LockKind::Read, token, LockState::Held)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !other_writer.is_finished(),
        "a waiting writer got in during the downgrade"
    );
    assert_eq!(
        key_rows(&server, &name),
        vec![
            ("ShareLock".to_string(), true),
            ("ExclusiveLock".to_string(), false)
        ],
        "after the downgrade the session holds the key shared only"
    );
    guard.release().await.unwrap();
    let other = tokio::time::timeout(PATIENCE, other_writer)
        .await
        .expect("the other writer got the key after the read release")
        .unwrap();
    let unlocked: bool = other
        .query_one("SELECT pg_catalog.pg_advisory_unlock($1)", &[&key])
        .await
        .unwrap()
        .get(0);
    assert!(unlocked);

    // Interop with the raw calls on the documented key: a foreign reader shares with distlock's
    // readers and keeps distlock's writer and mutex out; a foreign writer keeps every distlock kind
    // out; distlock's reader keeps a foreign writer out and lets a foreign reader in.
    let name = unique("interop");
    let key = advisory_key(&name);
    let (foreign, _) = raw(&server).await;
    foreign
        .execute("SELECT pg_catalog.pg_advisory_lock_shared($1)", &[&key])
        .await
        .unwrap();
    let reader = a
        .read_write(&name)
        .unwrap()
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .expect("a distlock reader shares the key with a foreign reader");
    assert_eq!(
        reader.token().map(|t| t.get()),
        Some(0),
        "no write grant yet"
    );
    let rw_b = b.read_write(&name).unwrap();
    assert!(rw_b.writer().try_acquire().await.unwrap().is_none());
    assert!(c
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let try_foreign = |sql: &'static str| {
        let foreign = &foreign;
        async move {
            foreign
                .query_one(sql, &[&key])
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(try_foreign("SELECT pg_catalog.pg_advisory_unlock_shared($1)").await);
    assert!(
        !try_foreign("SELECT pg_catalog.pg_try_advisory_lock($1)").await,
        "a foreign writer got in beside a distlock reader"
    );
    assert!(try_foreign("SELECT pg_catalog.pg_try_advisory_lock_shared($1)").await);
    assert!(try_foreign("SELECT pg_catalog.pg_advisory_unlock_shared($1)").await);
    reader.release().await.unwrap();
    assert!(try_foreign("SELECT pg_catalog.pg_try_advisory_lock($1)").await);
    assert!(a
        .read_write(&name)
        .unwrap()
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    assert!(rw_b.writer().try_acquire().await.unwrap().is_none());
    assert!(
        a.semaphore(&name, 2)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "a permit beside a foreign writer"
    );
    assert!(try_foreign("SELECT pg_catalog.pg_advisory_unlock($1)").await);
    let write = rw_b.writer().try_acquire().await.unwrap().expect("free");
    assert!(write.token().unwrap().get() > 0);
    write.release().await.unwrap();

    // Nothing of distlock's is left on the server.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            .unwrap(),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_holds_one_slot_and_the_key_shared_per_permit_keeps_its_limit_and_excludes_other_kinds(
) {
    let server = PostgresServer::start_or_panic();
    let (a, b, c) = (
        locks(&server, "advisory").await,
        locks(&server, "advisory").await,
        locks(&server, "advisory").await,
    );
    let (listener, mut notifications) = raw(&server).await;
    listener
        .batch_execute("LISTEN \"distlock_locks\"")
        .await
        .unwrap();

    let name = unique("sem");
    let p0 = a
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("permit 1 of 2");
    let p1 = b
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("permit 2 of 2");
    assert_eq!(
        [p0.permit(), p1.permit()]
            .into_iter()
            .collect::<HashSet<_>>(),
        HashSet::from([Some("0"), Some("1")])
    );
    assert!(p1.token().unwrap() > p0.token().unwrap());
    assert!(c
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());

    // On the server: per permit session, one slot key (the documented two-int key) and the name's
    // key shared; nothing else.
    let (slot_class, slot_first, _) = pg_locks_row(permit_key(&name, 0));
    let (classid, objid, _) = pg_locks_row(distlock_sql::AdvisoryKey::Single(advisory_key(&name)));
    let per_session = server
        .psql(&format!(
            "SELECT string_agg(x, ';' ORDER BY x) FROM (SELECT \
               count(*) FILTER (WHERE objsubid = 2 AND classid = {slot_class} \
                 AND objid::bigint - {slot_first} IN (0, 1) AND mode = 'ExclusiveLock') || ',' || \
               count(*) FILTER (WHERE objsubid = 1 AND classid = {classid} AND objid = {objid} \
                 AND mode = 'ShareLock') || ',' || count(*) AS x \
             FROM pg_locks WHERE locktype = 'advisory' AND granted GROUP BY pid) s"
        ))
        .unwrap();
    assert_eq!(
        per_session, "1,1,2;1,1,2",
        "per session: slot, shared key, all"
    );

    // The name's mutex, a write lock and a foreign writer are kept out; a read lock is refused.
    assert!(c
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let rw = c.read_write(&name).unwrap();
    assert!(rw.writer().try_acquire().await.unwrap().is_none());
    let foreign_writer: bool = listener
        .query_one(
            "SELECT pg_catalog.pg_try_advisory_lock($1)",
            &[&advisory_key(&name)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!foreign_writer, "a foreign writer beside the permits");
    let refused = rw.reader().try_acquire().await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::KindConflict, "{refused}");
    assert!(
        refused.message().contains("semaphore of 2 permits"),
        "{refused}"
    );

    // Status shows the permits.
    let info = c.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 2 }), "{info:?}");
    let mut shown: Vec<_> = info.holders.iter().map(|h| h.permit.clone()).collect();
    shown.sort();
    assert_eq!(shown, vec![Some("0".to_string()), Some("1".to_string())]);

    // A release wakes waiters: a NOTIFY on the table's channel with the name.
    p0.release().await.unwrap();
    let woken = tokio::time::timeout(PATIENCE, notifications.recv())
        .await
        .expect("a notification")
        .expect("the listener");
    assert_eq!(
        (woken.channel(), woken.payload()),
        ("distlock_locks", name.as_str())
    );

    // Another limit: refused, naming both and how to change it; the limit is kept once every
    // permit is back; the operator's DELETE lets another limit in.
    let mismatch = c
        .semaphore(&name, 3)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(
        mismatch.kind(),
        ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }
    );
    let delete = format!("DELETE FROM \"distlock_locks_limit\" WHERE name = '{name}'");
    assert!(mismatch.message().contains(&delete), "{mismatch}");
    p1.release().await.unwrap();
    assert!(matches!(
        c.semaphore(&name, 3)
            .unwrap()
            .try_acquire()
            .await
            .map_err(|e| e.kind()),
        Err(ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        })
    ));
    server.psql(&delete).unwrap();
    let mut three = Vec::new();
    for locks in [&a, &b, &c] {
        three.push(
            locks
                .semaphore(&name, 3)
                .unwrap()
                .try_acquire()
                .await
                .unwrap()
                .expect("a permit of the new limit"),
        );
    }
    for permit in three {
        permit.release().await.unwrap();
    }

    // A mutex held first keeps the first permit out (busy, not refused) until it is released; the
    // name is a semaphore from then on, and a read lock is refused.
    let name = unique("mutex_first");
    let mutex = a.lock(&name).unwrap().acquire().await.unwrap();
    let semaphore = b.semaphore(&name, 2).unwrap();
    assert!(semaphore.try_acquire().await.unwrap().is_none());
    mutex.release().await.unwrap();
    let permit = semaphore.try_acquire().await.unwrap().expect("free now");
    permit.release().await.unwrap();
    let refused = c
        .read_write(&name)
        .unwrap()
        .reader()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::KindConflict);

    // A reader held first keeps the first permit out: its limit cannot be stored while the name
    // is read.
    let name = unique("read_first");
    let read = a.read_write(&name).unwrap().read().await.unwrap();
    let semaphore = b.semaphore(&name, 2).unwrap();
    assert!(semaphore.try_acquire().await.unwrap().is_none());
    assert_eq!(
        server
            .psql(&format!(
                "SELECT count(*) FROM distlock_locks_limit WHERE name = '{name}'"
            ))
            .unwrap(),
        "0"
    );
    read.release().await.unwrap();
    let permit = semaphore.try_acquire().await.unwrap().expect("free now");
    permit.release().await.unwrap();

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        server
            .psql("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
            .unwrap(),
        "0"
    );
}

/// The backend pid of the session holding `row` of pg_locks (`mode` on the name's key, or a slot).
fn holder_pid(server: &PostgresServer, filter: &str) -> String {
    let pid = server
        .psql(&format!(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND {filter}"
        ))
        .unwrap();
    assert!(!pid.is_empty() && !pid.contains('\n'), "holders: {pid:?}");
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_session_frees_its_read_lock_and_its_permit_at_once_fault() {
    let server = PostgresServer::start_or_panic();
    let (a, b) = (
        locks(&server, "advisory").await,
        locks(&server, "advisory").await,
    );
    let long = Duration::from_secs(60);

    // A reader's session is terminated: a writer waiting in the server gets the lock at once.
    let name = unique("killed_reader");
    let reader = a
        .read_write(&name)
        .unwrap()
        .reader()
        .options()
        .lease(long)
        .acquire()
        .await
        .unwrap();
    let writer = b.read_write(&name).unwrap();
    let waiting = tokio::spawn(async move {
        writer
            .writer()
            .options()
            .wait(long)
            .acquire()
            .await
            .expect("the writer")
    });
    until_queued(&server, &name, "ExclusiveLock", 1).await;
    let (classid, objid, _) = pg_locks_row(distlock_sql::AdvisoryKey::Single(advisory_key(&name)));
    let pid = holder_pid(
        &server,
        &format!("classid = {classid} AND objid = {objid} AND objsubid = 1 AND mode = 'ShareLock'"),
    );
    server
        .psql(&format!("SELECT pg_terminate_backend({pid})"))
        .unwrap();
    let write = tokio::time::timeout(PATIENCE, waiting)
        .await
        .expect("the writer got in long before the reader's 60 s lease")
        .unwrap();
    let started = Instant::now();
    while reader.state() != LockState::Lost {
        assert!(
            started.elapsed() < PATIENCE,
            "the reader never saw its loss"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    write.release().await.unwrap();

    // A permit holder's session is terminated: a waiter for the one permit gets it at its next poll,
    // long before the holder's lease, and never beside it.
    let name = unique("killed_permit");
    let held = a
        .semaphore(&name, 1)
        .unwrap()
        .permit()
        .options()
        .lease(long)
        .acquire()
        .await
        .unwrap();
    let semaphore = b.semaphore(&name, 1).unwrap();
    let waiter = semaphore.clone();
    let waiting = tokio::spawn(async move {
        waiter
            .permit()
            .options()
            .wait(long)
            .acquire()
            .await
            .expect("the waiter")
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "two holders of one permit");
    let (slot_class, slot_objid, _) = pg_locks_row(permit_key(&name, 0));
    let pid = holder_pid(
        &server,
        &format!("classid = {slot_class} AND objid = {slot_objid} AND objsubid = 2"),
    );
    server
        .psql(&format!("SELECT pg_terminate_backend({pid})"))
        .unwrap();
    let back = tokio::time::timeout(PATIENCE, waiting)
        .await
        .expect("the permit came back long before the holder's 60 s lease")
        .unwrap();
    assert_eq!(back.permit(), Some("0"));
    let started = Instant::now();
    while held.state() != LockState::Lost {
        assert!(
            started.elapsed() < PATIENCE,
            "the holder never saw its loss"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(semaphore.try_acquire().await.unwrap().is_none());
    back.release().await.unwrap();
}

/// A URL's numeric key (`?key=a,b`, and a one-`bigint` key at the type's edge) is what every kind's
/// statement locks: the statements take the key as parameters (one prepared text per key shape), so
/// both shapes are run through the mutex, the write and the read side, checked from a plain client
/// that calls the advisory functions on the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_key_of_either_shape_is_the_key_every_kind_locks() {
    let server = PostgresServer::start_or_panic();
    let (raw, _notifications) = raw(&server).await;
    for (query, exclusive, shared, unlock, unlock_shared) in [
        (
            "7,42",
            "SELECT pg_try_advisory_lock(7, 42)",
            "SELECT pg_try_advisory_lock_shared(7, 42)",
            "SELECT pg_advisory_unlock(7, 42)",
            "SELECT pg_advisory_unlock_shared(7, 42)",
        ),
        (
            "-9223372036854775808",
            "SELECT pg_try_advisory_lock((-9223372036854775808)::bigint)",
            "SELECT pg_try_advisory_lock_shared((-9223372036854775808)::bigint)",
            "SELECT pg_advisory_unlock((-9223372036854775808)::bigint)",
            "SELECT pg_advisory_unlock_shared((-9223372036854775808)::bigint)",
        ),
    ] {
        let locks = Locks::new(
            PostgresBackend::connect(&format!("{}?mode=advisory&key={query}", server.url()))
                .await
                .expect("connect"),
        );
        let got = |sql: &'static str| {
            let raw = &raw;
            async move {
                raw.query_one(sql, &[])
                    .await
                    .expect("raw advisory call")
                    .get::<_, bool>(0)
            }
        };
        // Twice each, so the second use runs the statement prepared by the first.
        for round in 0..2 {
            let mutex = locks
                .lock(&unique("url-key"))
                .expect("lock")
                .acquire()
                .await
                .expect("mutex");
            assert!(
                !got(exclusive).await,
                "key={query} round {round}: the mutex holds the key"
            );
            mutex.release().await.expect("release");
            assert!(got(exclusive).await, "key={query}: released");
            assert!(got(unlock).await);

            let rw = locks.read_write(&unique("url-key")).expect("read_write");
            let read = rw.read().await.expect("read");
            assert!(
                !got(exclusive).await,
                "key={query} round {round}: a reader holds the key shared"
            );
            assert!(got(shared).await, "key={query}: readers share it");
            assert!(got(unlock_shared).await);
            read.release().await.expect("release");
            let write = rw.write().await.expect("write");
            assert!(
                !got(shared).await,
                "key={query} round {round}: the writer holds the key"
            );
            write.release().await.expect("release");
            assert!(got(exclusive).await, "key={query}: all released");
            assert!(got(unlock).await);
        }
        locks.close().await;
    }
}

/// The statements the server ran, as `log_statement = all` wrote them to `log` from byte `from` on:
/// one line per execution (`execute <name>: …` for the extended protocol, `statement: …` for a simple
/// query).
fn statements_logged(log: &std::path::Path, from: u64) -> Vec<String> {
    let text = std::fs::read(log).expect("the server's log");
    String::from_utf8_lossy(&text[usize::try_from(from).unwrap()..])
        .lines()
        .filter(|l| l.contains("LOG:  execute ") || l.contains("LOG:  statement: "))
        .map(str::to_string)
        .collect()
}

/// An uncontended cycle of each kind, at the default lease, sends the fewest statements its layout
/// needs: a mutex its try-and-bump and its unlock, a read lock its try, its token-and-kind read and
/// its unlock, a permit its try and its release. No probe (the connection keeps the idle bound of the
/// lease from the last hold), no `LISTEN` or `UNLISTEN` (nobody waits), nothing on another connection.
/// Counted from the server's own log, so a statement added to the hot path fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_cycles_send_the_fewest_statements() {
    let mut server = PostgresServer::start_with(&["log_statement=all"]).expect("postgres");
    let log = server.process_mut().log_path().to_path_buf();
    let locks = locks(&server, "advisory").await;
    const CYCLES: usize = 10;
    for (kind, per_cycle) in [("mutex", 2), ("read", 3), ("permit", 2)] {
        let name = unique(&format!("statements-{kind}"));
        let cycle = || async {
            let guard = match kind {
                "mutex" => locks.lock(&name).unwrap().try_acquire().await,
                "read" => {
                    locks
                        .read_write(&name)
                        .unwrap()
                        .reader()
                        .try_acquire()
                        .await
                }
                _ => {
                    locks
                        .semaphore(&name, 3)
                        .unwrap()
                        .permit()
                        .try_acquire()
                        .await
                }
            };
            guard.unwrap().expect("free").release().await.unwrap();
        };
        // The first cycles prepare the statements, store the limit, set the idle bound and fill
        // the pool (a spare opens in the background).
        for _ in 0..3 {
            cycle().await;
        }
        // The spare opens in the background: its setup must not land in the counted window.
        let started = Instant::now();
        while server
            .psql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'distlock'")
            .unwrap()
            .parse::<u32>()
            .unwrap()
            < 3
        {
            assert!(started.elapsed() < PATIENCE, "no spare connection opened");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cycle().await;
        let from = std::fs::metadata(&log).unwrap().len();
        for _ in 0..CYCLES {
            cycle().await;
        }
        let sent = statements_logged(&log, from);
        assert_eq!(
            sent.len(),
            CYCLES * per_cycle,
            "{kind}: {} statements for {CYCLES} cycles, not {per_cycle} a cycle:\n{}",
            sent.len(),
            sent.join("\n")
        );
        for line in &sent {
            assert!(
                !line.contains("idle_session_timeout") && !line.contains("LISTEN"),
                "{kind}: a probe or a LISTEN in an uncontended cycle: {line}"
            );
        }
    }
}

/// The log from byte `from` on.
fn log_since(log: &std::path::Path, from: u64) -> String {
    let text = std::fs::read(log).expect("the server's log");
    String::from_utf8_lossy(&text[usize::try_from(from).unwrap()..]).into_owned()
}

/// Waits until `done` holds for the log written since `from`.
async fn until_logged(log: &std::path::Path, from: u64, what: &str, done: impl Fn(&str) -> bool) {
    let started = Instant::now();
    while !done(&log_since(log, from)) {
        assert!(started.elapsed() < PATIENCE, "never logged: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The control connection `LISTEN`s only while a waiter wants release notifications (a permit, or a
/// lease-mode lock): not while locks are taken uncontended, from a waiter's first wait on (which
/// tries again at once after its `LISTEN`), all the while it waits (2.5 s here, past the 1 s linger
/// and the polls), and `UNLISTEN`s once the last waiter has left. A waiter asleep after its try is
/// woken by the release's `NOTIFY`, well before its poll (a permit waiter sleeps 0.5 to 1 s, a
/// lease-mode one 2 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_listen_only_while_they_wait_and_are_woken_by_the_release() {
    let mut server = PostgresServer::start_with(&["log_statement=all"]).expect("postgres");
    let log = server.process_mut().log_path().to_path_buf();
    // (mode, the text of its try, how much sooner than the poll a notified waiter must be granted)
    for (mode, try_text, woken_within) in [
        ("advisory", "lim.stored", Duration::from_millis(400)),
        (
            "lease",
            "(name, owner, expires_at, version)",
            Duration::from_millis(1500),
        ),
    ] {
        let holder = locks(&server, mode).await;
        let waiter = locks(&server, mode).await;
        let name = unique(&format!("listen-{mode}"));
        let acquire = |locks: Locks, name: String| async move {
            if mode == "advisory" {
                let permit = locks.semaphore(&name, 1).unwrap().permit();
                permit.options().wait(PATIENCE).acquire().await
            } else {
                let lock = locks.lock(&name).unwrap();
                lock.options().wait(PATIENCE).acquire().await
            }
        };
        let from = std::fs::metadata(&log).unwrap().len();
        let held = acquire(holder.clone(), name.clone()).await.unwrap();
        let uncontended = log_since(&log, from);
        assert!(
            !uncontended.contains("LISTEN"),
            "{mode}: an uncontended acquire listened:\n{uncontended}"
        );
        let from = std::fs::metadata(&log).unwrap().len();
        let waiting = tokio::spawn(acquire(waiter.clone(), name.clone()));
        // Its LISTEN, then at once (not after a poll: 0.5 s at the soonest) its try after it.
        until_logged(&log, from, "the waiter's LISTEN", |text| {
            text.contains("LISTEN")
        })
        .await;
        let listened_at = Instant::now();
        until_logged(&log, from, "the waiter's try after its LISTEN", |text| {
            text.split_once("LISTEN")
                .is_some_and(|(_, after)| after.contains(try_text))
        })
        .await;
        assert!(
            listened_at.elapsed() < Duration::from_millis(400),
            "{mode}: the try after the LISTEN came {:?} later: not at once",
            listened_at.elapsed()
        );
        // Still listening while it waits, past the linger and past a poll or two.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let waited = log_since(&log, from);
        assert!(
            !waited.contains("UNLISTEN"),
            "{mode}: the control connection stopped listening while a waiter waits:\n{waited}"
        );
        let released_at = Instant::now();
        held.release().await.unwrap();
        let got = tokio::time::timeout(PATIENCE, waiting)
            .await
            .expect("the waiter")
            .unwrap()
            .expect("granted");
        let woken_after = released_at.elapsed();
        assert!(
            woken_after < woken_within,
            "{mode}: the waiter was granted {woken_after:?} after the release: not by its NOTIFY"
        );
        got.release().await.unwrap();
        // Nobody waits any more: UNLISTEN after the linger.
        until_logged(&log, from, "UNLISTEN after the last waiter left", |text| {
            text.contains("UNLISTEN")
        })
        .await;
    }
}
