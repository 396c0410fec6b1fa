//! MariaDB lock kinds (issue 25), advisory mode: the semaphore's slot names on the server, its stored
//! limit, a mutex and permits on one name, a killed permit session and a cancelled permit wait; the
//! read-write lock's refusal. Each test starts one server and runs several steps on it.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_sql::mysql::mysql_async::prelude::Queryable as _;
use distlock_sql::mysql::mysql_async::Conn;
use distlock_sql::mysql::{advisory_name, permit_name};
use distlock_testkit::mariadb::MariaDbServer;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("kinds/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn locks(url: &str) -> Locks {
    Locks::new(distlock_sql::mysql::connect(url).await.expect("connect"))
}

async fn raw(server: &MariaDbServer) -> Conn {
    Conn::from_url(server.url().as_str())
        .await
        .expect("raw connection")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn holder_of(conn: &mut Conn, lock_name: &str) -> Option<u64> {
    conn.query_first::<Option<u64>, _>(format!("SELECT IS_USED_LOCK('{lock_name}')"))
        .await
        .expect("IS_USED_LOCK")
        .flatten()
}

/// One permit of `name`'s 1-permit semaphore, waited for up to `wait` in a task of its own.
fn spawn_permit_waiter(
    locks: &Locks,
    name: &str,
    wait: Duration,
) -> tokio::task::JoinHandle<distlock_core::Result<distlock_core::LockGuard>> {
    let semaphore = locks.semaphore(name, 1).unwrap();
    tokio::spawn(async move { semaphore.permit().options().wait(wait).acquire().await })
}

async fn stored_limit(conn: &mut Conn, name: &str) -> Option<u32> {
    conn.query_first(format!(
        "SELECT permits FROM distlock_locks_limit WHERE name = X'{}'",
        hex(name.as_bytes())
    ))
    .await
    .expect("reading the limit table")
}

/// Permits are `GET_LOCK` slot names (`dls:<hash>#<slot>`), one per holder session; the limit row is
/// written with the first permit and kept (another limit refused, also with no permit held, with the
/// statement that removes it); `status` shows the permits; a mutex and permits on one name never hold
/// together, in either order and when racing; the read-write lock is refused before any I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_slots_limit_and_one_kind_per_name() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b) = (locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;

    // Read-write: refused, naming the kind.
    let rw = a
        .read_write("rw")
        .expect_err("MariaDB has no read-write lock");
    assert_eq!(rw.kind(), ErrorKind::Unsupported, "{rw}");
    assert!(rw.to_string().contains("read-write lock"), "{rw}");

    // Slot names on the server, one per permit, each held by its own session.
    let name = unique("slots");
    let p1 = a
        .semaphore(&name, 3)
        .unwrap()
        .acquire()
        .await
        .expect("permit 1");
    let p2 = b
        .semaphore(&name, 3)
        .unwrap()
        .acquire()
        .await
        .expect("permit 2");
    assert_eq!(p1.kind(), LockKind::Permit { limit: 3 });
    let mut sessions = Vec::new();
    for permit in [&p1, &p2] {
        let slot: u32 = permit
            .permit()
            .expect("a permit id")
            .parse()
            .expect("a slot number");
        assert!(slot < 3, "slot {slot} of 3");
        let slot_name = permit_name(&name, slot);
        assert!(slot_name.len() <= 64, "{slot_name}");
        let session = holder_of(&mut sql, &slot_name).await;
        assert!(session.is_some(), "{slot_name} is not held on the server");
        sessions.push(session);
    }
    assert_ne!(p1.permit(), p2.permit(), "two permits on one slot");
    assert_ne!(sessions[0], sessions[1], "two permits on one session");
    assert!(p2.token().unwrap() > p1.token().unwrap(), "tokens rise");
    assert_eq!(stored_limit(&mut sql, &name).await, Some(3));
    assert_eq!(
        holder_of(&mut sql, &advisory_name(&name)).await,
        None,
        "permits do not take the name's mutex"
    );
    let info = a.inspect(&name).await.expect("status");
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 3 }), "{info:?}");
    let mut shown: Vec<_> = info
        .holders
        .iter()
        .filter_map(|h| h.permit.clone())
        .collect();
    shown.sort();
    let mut held: Vec<_> = [&p1, &p2]
        .iter()
        .map(|p| p.permit().unwrap().to_string())
        .collect();
    held.sort();
    assert_eq!(shown, held, "status names the slots held: {info:?}");

    // The name's mutex is refused beside the permits.
    let mutex = b.lock(&name).unwrap().try_acquire().await;
    assert_eq!(
        mutex.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::KindConflict),
        "a mutex beside permits: {mutex:?}"
    );
    assert_eq!(
        holder_of(&mut sql, &advisory_name(&name)).await,
        None,
        "the refused mutex let go"
    );

    // Another limit: refused, with and without permits held; the message says how to change it.
    let other = b
        .semaphore(&name, 4)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("limit 4");
    assert_eq!(
        other.kind(),
        ErrorKind::LimitMismatch {
            stored: 3,
            requested: 4
        }
    );
    assert!(other.to_string().contains("DELETE FROM"), "{other}");
    p1.release().await.unwrap();
    p2.release().await.unwrap();
    let kept = b
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("limit 2");
    assert_eq!(
        kept.kind(),
        ErrorKind::LimitMismatch {
            stored: 3,
            requested: 2
        }
    );
    assert_eq!(
        stored_limit(&mut sql, &name).await,
        Some(3),
        "the limit is kept"
    );
    // The name stays a semaphore with no permit held: the mutex is still refused ...
    let mutex = b.lock(&name).unwrap().try_acquire().await;
    assert_eq!(
        mutex.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::KindConflict)
    );
    // ... until the row is deleted, as the message says.
    sql.query_drop(format!(
        "DELETE FROM distlock_locks_limit WHERE name = X'{}'",
        hex(name.as_bytes())
    ))
    .await
    .unwrap();
    let mutex = b
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the mutex, once the row is gone");
    mutex.release().await.unwrap();

    // The other order: a mutex held first refuses the permit and writes no limit.
    let name = unique("mutex-first");
    let mutex = a.lock(&name).unwrap().acquire().await.unwrap();
    let permit = b.semaphore(&name, 2).unwrap().try_acquire().await;
    assert_eq!(
        permit.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::KindConflict),
        "a permit beside the mutex: {permit:?}"
    );
    assert_eq!(
        stored_limit(&mut sql, &name).await,
        None,
        "no limit stored beside a mutex"
    );
    for slot in 0..2 {
        assert_eq!(holder_of(&mut sql, &permit_name(&name, slot)).await, None);
    }
    mutex.release().await.unwrap();
    let permit = b
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("a permit");
    permit.release().await.unwrap();

    // More permits than one statement walks (256): slots 0..299 but one held by another application's
    // session (raw GET_LOCK on the documented names), the permit finds the free one; then all are held
    // and a try is refused; status lists every holder.
    let name = unique("wide");
    let free_slot = 299;
    let mut foreign = raw(&server).await;
    let takes: Vec<String> = (0..300)
        .filter(|slot| *slot != free_slot)
        .map(|slot| format!("GET_LOCK('{}', 0)", permit_name(&name, slot)))
        .collect();
    for chunk in takes.chunks(100) {
        foreign
            .query_drop(format!("DO {}", chunk.join(", ")))
            .await
            .unwrap();
    }
    let wide = a.semaphore(&name, 300).unwrap();
    let got = wide
        .try_acquire()
        .await
        .unwrap()
        .expect("the one free slot of 300");
    assert_eq!(got.permit(), Some("299"));
    assert!(
        wide.try_acquire().await.unwrap().is_none(),
        "301 permits of 300"
    );
    let info = a.inspect(&name).await.expect("status");
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 300 }));
    assert_eq!(info.holders.len(), 300, "status holders of 300 slots");
    got.release().await.unwrap();
    drop(foreign);

    // Racing first users of a name: never both held (both may be refused).
    let mut both_refused = 0;
    for round in 0..20 {
        let name = unique(&format!("race-{round}"));
        let mutex = a.lock(&name).unwrap();
        let semaphore = b.semaphore(&name, 2).unwrap();
        let (m, p) = tokio::join!(mutex.try_acquire(), semaphore.try_acquire());
        let m = match m {
            Ok(held) => held,
            Err(e) if e.kind() == ErrorKind::KindConflict => None,
            Err(e) => panic!("round {round}: the mutex: {e}"),
        };
        let p = match p {
            Ok(held) => held,
            Err(e) if e.kind() == ErrorKind::KindConflict => None,
            Err(e) => panic!("round {round}: the permit: {e}"),
        };
        assert!(
            m.is_none() || p.is_none(),
            "round {round}: a mutex and a permit of one name held together"
        );
        both_refused += usize::from(m.is_none() && p.is_none());
        for guard in [m, p].into_iter().flatten() {
            guard.release().await.unwrap();
        }
    }
    eprintln!("racing first users: both refused in {both_refused} of 20 rounds");
}

/// A permit holder's session killed on the server frees its slot at once (a waiter on that slot gets
/// it, and the holder's guard is `Lost`); a waiter gets a slot freed elsewhere within a slice; a wait
/// given up (wait limit, dropped future) leaves no `GET_LOCK` running and takes no permit later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sessions_and_cancelled_waits_fault() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b, c) = (locks(&url).await, locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;

    // A killed holder session: its slot is free at once.
    let name = unique("killed");
    let held = a.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let session = holder_of(&mut sql, &permit_name(&name, 0))
        .await
        .expect("slot 0 held");
    let waiter = spawn_permit_waiter(&b, &name, Duration::from_secs(60));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    sql.query_drop(format!("KILL {session}")).await.unwrap();
    let got = waiter.await.unwrap().expect("the killed holder's permit");
    let took = killed.elapsed();
    assert!(took < SLACK, "the permit came back after {took:?}");
    eprintln!("a killed holder's permit went to the waiter in {took:?}");
    let deadline = Instant::now() + SLACK;
    while held.state() != LockState::Lost && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(held.state(), LockState::Lost, "the killed holder's guard");
    got.release().await.unwrap();
    drop(held);

    // A slot freed elsewhere than the one waited on: taken within a wait slice (1 s).
    let name = unique("elsewhere");
    let semaphore = |l: &Locks| l.semaphore(&name, 2).unwrap();
    let (h1, h2) = (
        semaphore(&a).acquire().await.unwrap(),
        semaphore(&b).acquire().await.unwrap(),
    );
    let waiter = {
        let semaphore = semaphore(&c);
        tokio::spawn(async move {
            semaphore
                .permit()
                .options()
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let released = Instant::now();
    let freed_slot = h1.permit().unwrap().to_string();
    h1.release().await.unwrap();
    let got = waiter
        .await
        .unwrap()
        .expect("a permit once one was given back");
    let took = released.elapsed();
    assert_eq!(got.permit(), Some(freed_slot.as_str()));
    assert!(
        took < Duration::from_secs(1) + SLACK,
        "waited {took:?} for a free slot"
    );
    eprintln!("a permit given back went to the waiter in {took:?}");
    got.release().await.unwrap();
    h2.release().await.unwrap();

    // Waits given up: by the wait limit, and by dropping the future.
    let name = unique("cancelled");
    let full = a.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let timed_out = b
        .semaphore(&name, 1)
        .unwrap()
        .permit()
        .options()
        .wait(Duration::from_millis(1500))
        .acquire()
        .await
        .expect_err("a full semaphore");
    assert_eq!(timed_out.kind(), ErrorKind::Timeout, "{timed_out}");
    let dropped = tokio::time::timeout(
        Duration::from_millis(700),
        c.semaphore(&name, 1).unwrap().acquire(),
    )
    .await;
    assert!(
        dropped.is_err(),
        "the dropped wait got a permit: {dropped:?}"
    );
    // Nothing of the waits runs on the server, once their abandon is done.
    let deadline = Instant::now() + SLACK;
    let waits = loop {
        let waits: Option<u64> = sql
            .query_first(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT GET_LOCK(%'",
            )
            .await
            .unwrap();
        if waits == Some(0) || Instant::now() > deadline {
            break waits;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(waits, Some(0), "GET_LOCK waits left on the server");
    full.release().await.unwrap();
    // The permit given back goes to the next try, not to a cancelled wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = a
        .semaphore(&name, 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the permit given back must not have gone to a cancelled wait");
    let slot_holder = holder_of(&mut sql, &permit_name(&name, 0)).await;
    assert!(slot_holder.is_some());
    next.release().await.unwrap();
    assert_eq!(holder_of(&mut sql, &permit_name(&name, 0)).await, None);

    // A permit try whose counter bump fails (a trigger refuses it) after its walk took a slot: the
    // acquire fails and the slot is free the moment the error is reported.
    let name = unique("bump-fails");
    let warm = a.semaphore(&name, 2).unwrap().acquire().await.unwrap(); // stores the limit
    warm.release().await.unwrap();
    sql.query_drop(
        "CREATE TRIGGER refuse_update BEFORE UPDATE ON distlock_locks FOR EACH ROW \
         SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'",
    )
    .await
    .unwrap();
    let err = b
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("a refused bump");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    for slot in 0..2 {
        assert_eq!(
            holder_of(&mut sql, &permit_name(&name, slot)).await,
            None,
            "slot {slot} stayed held after a failed permit"
        );
    }
    sql.query_drop("DROP TRIGGER refuse_update").await.unwrap();
    let permit = c
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("a permit");
    permit.release().await.unwrap();
}

/// A small deterministic generator for the adversarial schedules (no `rand` in the dev-dependencies).
struct Dice(u64);

impl Dice {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below.max(1)
    }
}

/// Adversarial schedule: six tasks over three clients take permits of a 2-permit semaphore with waits
/// cut short by the wait limit, acquire futures dropped mid-try or mid-wait, plain tries, and the name's
/// mutex in between. Never more than 2 inside, never two guards on one slot, every token distinct, the
/// mutex never granted; afterwards no slot is left held (by a pooled session either: every client can
/// still take both permits, and a third is refused) and no `GET_LOCK` runs on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_and_timed_out_permit_acquires_never_over_admit_nor_leak_a_slot() {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let clients = [locks(&url).await, locks(&url).await, locks(&url).await];
    let mut sql = raw(&server).await;
    let name = unique("schedule");
    const N: u32 = 2;
    clients[0]
        .semaphore(&name, N)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let slots = Arc::new(Mutex::new(HashSet::<String>::new()));
    let tokens = Arc::new(Mutex::new(Vec::<u64>::new()));
    let outcomes = Arc::new(Mutex::new([0usize; 5]));
    let mut tasks = Vec::new();
    for t in 0..6u64 {
        let client = clients[(t % 3) as usize].clone();
        let name = name.clone();
        let (inside, most, slots, tokens, outcomes) = (
            inside.clone(),
            most.clone(),
            slots.clone(),
            tokens.clone(),
            outcomes.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut dice =
                Dice(0x9E37_79B9_7F4A_7C15 ^ (t + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
            for round in 0..14 {
                let semaphore = client.semaphore(&name, N).unwrap();
                let choice = dice.next(4);
                let got = match choice {
                    0 => {
                        let wait = Duration::from_millis(dice.next(1500));
                        match semaphore.permit().options().wait(wait).acquire().await {
                            Ok(g) => Some(g),
                            Err(e) if e.kind() == ErrorKind::Timeout => None,
                            Err(e) => panic!("task {t} round {round}: a wait: {e}"),
                        }
                    }
                    1 => {
                        let cut = Duration::from_millis(dice.next(60));
                        match tokio::time::timeout(cut, semaphore.acquire()).await {
                            Ok(Ok(g)) => Some(g),
                            Ok(Err(e)) => panic!("task {t} round {round}: an acquire: {e}"),
                            Err(_) => None,
                        }
                    }
                    2 => semaphore.try_acquire().await.expect("a try"),
                    _ => {
                        // Refused, or not tried (the same client's other mutex try had the local gate).
                        let m = client.lock(&name).unwrap().try_acquire().await;
                        assert!(
                            matches!(&m, Ok(None))
                                || m.as_ref().err().map(|e| e.kind())
                                    == Some(ErrorKind::KindConflict),
                            "task {t} round {round}: the mutex of a semaphore name: {m:?}"
                        );
                        None
                    }
                };
                outcomes.lock().unwrap()[choice as usize] += 1;
                let Some(permit) = got else { continue };
                outcomes.lock().unwrap()[4] += 1;
                let slot = permit.permit().expect("a slot").to_string();
                assert!(
                    slots.lock().unwrap().insert(slot.clone()),
                    "task {t} round {round}: two guards on slot {slot}"
                );
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokens.lock().unwrap().push(permit.token().unwrap().get());
                tokio::time::sleep(Duration::from_millis(dice.next(80))).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                slots.lock().unwrap().remove(&slot);
                permit
                    .release()
                    .await
                    .unwrap_or_else(|e| panic!("task {t} round {round}: release: {e}"));
            }
        }));
    }
    for task in tasks {
        task.await.expect("a task");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= N as usize,
        "{most} holders of a {N}-permit semaphore"
    );
    let tokens = tokens.lock().unwrap().clone();
    let distinct: HashSet<_> = tokens.iter().collect();
    assert_eq!(distinct.len(), tokens.len(), "a token twice: {tokens:?}");
    eprintln!(
        "outcomes (waits, dropped, tries, mutex tries, grants): {:?}; most inside {most}",
        outcomes.lock().unwrap()
    );

    // Nothing left behind once the background undos are done: no wait in the server, no slot held.
    let deadline = Instant::now() + SLACK;
    loop {
        let waits: Option<u64> = sql
            .query_first(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT GET_LOCK(%'",
            )
            .await
            .unwrap();
        let mut held = Vec::new();
        for slot in 0..N {
            if let Some(s) = holder_of(&mut sql, &permit_name(&name, slot)).await {
                held.push((slot, s));
            }
        }
        if waits == Some(0) && held.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: {waits:?} GET_LOCK waits, slots held {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(holder_of(&mut sql, &advisory_name(&name)).await, None);
    // Every client's pooled sessions are clean: each takes both permits, and a third is refused.
    for (i, client) in clients.iter().enumerate() {
        let semaphore = client.semaphore(&name, N).unwrap();
        let mut held = Vec::new();
        for _ in 0..N {
            held.push(
                semaphore
                    .try_acquire()
                    .await
                    .unwrap()
                    .unwrap_or_else(|| panic!("client {i}: a permit of a free semaphore")),
            );
        }
        assert!(
            semaphore.try_acquire().await.unwrap().is_none(),
            "client {i}: {} permits of {N}",
            N + 1
        );
        for permit in held {
            permit.release().await.unwrap();
        }
    }
}

/// A refused mutex try on a semaphore name takes nothing, not even for a moment: permits taken while
/// another client keeps trying the name's mutex are never refused with `KindConflict` ("held as a
/// mutex"). Before, the mutex's try took `GET_LOCK(mutex name)` and only then found the limit row, and
/// a permit whose bump ran in between was refused, a permit wait failing with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_mutex_try_never_makes_a_permit_fail() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b) = (locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;
    let name = unique("mutex-probes");
    let semaphore = b.semaphore(&name, 1).unwrap();
    semaphore.acquire().await.unwrap().release().await.unwrap(); // stores the limit
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (stop, name) = (stop.clone(), name.clone());
        tokio::spawn(async move {
            let mut probes = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let m = a.lock(&name).unwrap().try_acquire().await;
                assert_eq!(
                    m.as_ref().err().map(|e| e.kind()),
                    Some(ErrorKind::KindConflict),
                    "the mutex of a semaphore name: {m:?}"
                );
                probes += 1;
            }
            probes
        })
    };
    let mut permits = 0;
    for _ in 0..300 {
        let permit = semaphore
            .permit()
            .options()
            .wait(Duration::from_secs(10))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("permit {permits} beside mutex probes: {e}"));
        permit.release().await.unwrap();
        permits += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let probes = prober.await.unwrap();
    eprintln!("{permits} permits beside {probes} refused mutex tries");
    assert!(probes > 0);
    assert_eq!(holder_of(&mut sql, &advisory_name(&name)).await, None);
}

/// A `?table=` name of 59 to 63 characters is accepted, but `<table>_limit` is longer than the server
/// allows: the mutex works and a semaphore is refused as a configuration error naming the length
/// (before, it was `PermissionDenied`, telling an operator to grant a table the server cannot create).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_too_long_for_the_limit_table_is_a_config_error() {
    let server = MariaDbServer::start_or_panic();
    let table = format!("t{}", "x".repeat(59));
    let url = format!("{}?table={table}", server.url());
    let l = locks(&url).await;
    let name = unique("long-table");
    let mutex = l.lock(&name).unwrap().try_acquire().await.unwrap();
    assert!(mutex.is_some(), "the mutex with a 60-character table");
    drop(mutex);
    let err = l
        .semaphore(&name, 2)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("no limit table can exist");
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("at most 58"), "{err}");
}

/// Tokens rise strictly across the kinds of one name (a mutex, then permits, then, once the limit row
/// is deleted, the mutex again), and a name full of SQL metacharacters (quotes, backslash, `;`, a tab,
/// `%`, non-ASCII) at the longest length is stored byte for byte as the limit row's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_rise_across_kinds_and_hostile_names_are_data() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b) = (locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;
    let seed = format!(
        "x'); DROP TABLE distlock_locks; -- \\ \" ` % _ \t ü {}",
        unique("evil")
    );
    let mut name = seed.clone();
    while name.len() < 1024 {
        name.push('\'');
    }
    name.truncate(1024);
    let token = |g: &distlock_core::LockGuard| g.token().expect("a token").get();

    let m1 = a.lock(&name).unwrap().acquire().await.expect("the mutex");
    let t1 = token(&m1);
    m1.release().await.unwrap();
    let p1 = a
        .semaphore(&name, 2)
        .unwrap()
        .acquire()
        .await
        .expect("permit 1");
    let p2 = b
        .semaphore(&name, 2)
        .unwrap()
        .acquire()
        .await
        .expect("permit 2");
    let (t2, t3) = (token(&p1), token(&p2));
    assert!(t1 < t2 && t2 < t3, "mutex {t1}, then permits {t2}, {t3}");
    assert_eq!(
        stored_limit(&mut sql, &name).await,
        Some(2),
        "the row's key is the name's bytes"
    );
    p1.release().await.unwrap();
    p2.release().await.unwrap();
    sql.query_drop(format!(
        "DELETE FROM distlock_locks_limit WHERE name = X'{}'",
        hex(name.as_bytes())
    ))
    .await
    .unwrap();
    let m2 = b
        .lock(&name)
        .unwrap()
        .acquire()
        .await
        .expect("the mutex again");
    assert!(token(&m2) > t3, "mutex {} after permit {t3}", token(&m2));
    m2.release().await.unwrap();
    let tables: Vec<String> = sql.query("SHOW TABLES").await.unwrap();
    assert!(tables.iter().any(|t| t == "distlock_locks"), "{tables:?}");
}

/// A permit try whose reply does not come back within the request timeout (a 3 s delay on the path,
/// both ways): the try fails, and the slot its statement took on the server once it arrived comes back
/// within the delay (the undo travels behind it, and the session is closed), not after the 30 s lease;
/// a release whose reply is delayed likewise fails and its slot is free within the delay. Never does
/// the delayed client count a permit it did not get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_try_or_release_with_a_lost_reply_leaves_the_slot_free_within_the_delay_fault() {
    use distlock_testkit::proxy::Proxy;
    let server = MariaDbServer::start_or_panic();
    let proxy = Proxy::start(server.addr()).unwrap();
    let slow_url = format!("{}?request_timeout=1s", server.url_via(proxy.addr()));
    let slow = locks(&slow_url).await;
    let other = locks(&server.url()).await;
    let mut sql = raw(&server).await;
    let name = unique("lost-reply");
    let delay = Duration::from_secs(3);
    // Warm: the limit row is stored and the slow client has a session in its pool.
    slow.semaphore(&name, 1)
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let tried = slow.semaphore(&name, 1).unwrap().try_acquire().await;
    assert!(tried.is_err(), "a try without its reply: {tried:?}");
    // The statement reaches the server only after the delay: it may take the slot then.
    let mut taken_by_it = None;
    while started.elapsed() < delay + Duration::from_millis(500) {
        taken_by_it = taken_by_it.or(holder_of(&mut sql, &permit_name(&name, 0)).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let free_by = started + delay * 2 + SLACK;
    let got = loop {
        if let Some(permit) = other
            .semaphore(&name, 1)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
        {
            break permit;
        }
        assert!(
            Instant::now() < free_by,
            "the slot of a failed try still held after {:?} (held by {:?})",
            started.elapsed(),
            holder_of(&mut sql, &permit_name(&name, 0)).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "the failed try's slot was free {:?} after the try (taken meanwhile by session {taken_by_it:?})",
        started.elapsed()
    );
    got.release().await.unwrap();

    proxy.pass().unwrap();
    let held = slow.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    proxy.delay(delay).unwrap();
    let started = Instant::now();
    let released = held.release().await;
    assert!(
        released.is_err(),
        "a release without its reply: {released:?}"
    );
    let free_by = started + delay * 2 + SLACK;
    loop {
        if let Some(permit) = other
            .semaphore(&name, 1)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
        {
            permit.release().await.unwrap();
            break;
        }
        assert!(
            Instant::now() < free_by,
            "the slot of a release without reply still held after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "the released slot was free {:?} after the release",
        started.elapsed()
    );
    proxy.pass().unwrap();
}

/// First users of a fresh name racing with waits, not only tries: a mutex `acquire` with a wait
/// limit against two permit `acquire`s, 15 rounds; never the mutex beside a permit (checked on the
/// server too: the mutex name and a slot never held at once while both guards are `Held`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_users_with_waits_never_hold_two_kinds() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b, c) = (locks(&url).await, locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;
    let wait = Duration::from_millis(400);
    let mut mutex_won = 0;
    let mut permits_won = 0;
    for round in 0..15u64 {
        let name = unique(&format!("wait-race-{round}"));
        let mutex = a.lock(&name).unwrap();
        let (s1, s2) = (
            b.semaphore(&name, 2).unwrap().permit(),
            c.semaphore(&name, 2).unwrap().permit(),
        );
        // Odd rounds the mutex starts a little later, even rounds the permits do: both sides win.
        let later = |side: u64| Duration::from_micros(if round % 2 == side { 0 } else { 700 });
        let (m, p1, p2) = tokio::join!(
            async {
                tokio::time::sleep(later(0)).await;
                mutex.options().wait(wait).acquire().await
            },
            async {
                tokio::time::sleep(later(1)).await;
                s1.options().wait(wait).acquire().await
            },
            async {
                tokio::time::sleep(later(1)).await;
                s2.options().wait(wait).acquire().await
            },
        );
        let keep = |r: distlock_core::Result<distlock_core::LockGuard>, what: &str| match r {
            Ok(g) => Some(g),
            Err(e) if matches!(e.kind(), ErrorKind::KindConflict | ErrorKind::Timeout) => None,
            Err(e) => panic!("round {round}: {what}: {e}"),
        };
        let m = keep(m, "the mutex");
        let permits: Vec<_> = [keep(p1, "permit 1"), keep(p2, "permit 2")]
            .into_iter()
            .flatten()
            .collect();
        assert!(
            m.is_none() || permits.is_empty(),
            "round {round}: the mutex and {} permit(s) of one name held together",
            permits.len()
        );
        let mutex_holder = holder_of(&mut sql, &advisory_name(&name)).await;
        let slot_holders = [
            holder_of(&mut sql, &permit_name(&name, 0)).await,
            holder_of(&mut sql, &permit_name(&name, 1)).await,
        ];
        assert!(
            mutex_holder.is_none() || slot_holders.iter().all(Option::is_none),
            "round {round}: on the server, mutex {mutex_holder:?} and slots {slot_holders:?}"
        );
        mutex_won += usize::from(m.is_some());
        permits_won += usize::from(!permits.is_empty());
        for guard in m.into_iter().chain(permits) {
            guard.release().await.unwrap();
        }
    }
    eprintln!(
        "racing with waits: the mutex won {mutex_won}, permits won {permits_won} of 15 rounds"
    );
}

/// The session of a permit wait that won its slot in the server, but whose grant is refused (another
/// application holds the name's mutex), gives the slot back before it is pooled: the slot is free at
/// once, and the same client's next permits (on pooled sessions, where a kept slot would be taken again
/// by `GET_LOCK`'s per-session reentrancy) are exactly N.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_won_wait_refused_gives_its_slot_back_before_the_session_is_pooled() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let (a, b) = (locks(&url).await, locks(&url).await);
    let mut sql = raw(&server).await;
    let mut foreign = raw(&server).await;
    let name = unique("won-refused");
    let holder = a.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let waiter = spawn_permit_waiter(&b, &name, Duration::from_secs(20));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another application takes the name's mutex (the documented interop name) while permits wait.
    let got: Option<i64> = foreign
        .query_first(format!("SELECT GET_LOCK('{}', 0)", advisory_name(&name)))
        .await
        .unwrap();
    assert_eq!(got, Some(1));
    holder.release().await.unwrap();
    let refused = waiter
        .await
        .unwrap()
        .expect_err("a permit beside a held mutex");
    assert_eq!(refused.kind(), ErrorKind::KindConflict, "{refused}");
    assert_eq!(
        holder_of(&mut sql, &permit_name(&name, 0)).await,
        None,
        "the won slot was kept"
    );
    foreign
        .query_drop(format!("DO RELEASE_LOCK('{}')", advisory_name(&name)))
        .await
        .unwrap();
    let semaphore = b.semaphore(&name, 1).unwrap();
    let first = semaphore.try_acquire().await.unwrap().expect("the permit");
    for _ in 0..3 {
        assert!(
            semaphore.try_acquire().await.unwrap().is_none(),
            "two permits of 1 through one client's pooled sessions"
        );
    }
    first.release().await.unwrap();
    assert_eq!(holder_of(&mut sql, &permit_name(&name, 0)).await, None);
}

/// A limit row written by hand (or by another program) with a limit no distlock client can ask for
/// (4,000,000,000, above `MAX_PERMITS`): status still answers at once (it reads at most `MAX_PERMITS`
/// slots, 256 per statement; before, it walked every one of the four billion slot names), and a permit
/// is `LimitMismatch` naming the stored limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_of_a_hand_written_huge_limit_answers_at_once() {
    let server = MariaDbServer::start_or_panic();
    let url = server.url();
    let a = locks(&url).await;
    let mut sql = raw(&server).await;
    let name = unique("huge-limit");
    // The tables exist once a client connected.
    sql.query_drop(format!(
        "INSERT INTO distlock_locks_limit (name, permits) VALUES (X'{}', 4000000000)",
        hex(name.as_bytes())
    ))
    .await
    .unwrap();
    let info = tokio::time::timeout(Duration::from_secs(30), a.inspect(&name))
        .await
        .expect("status of a huge stored limit did not answer within 30 s")
        .expect("status");
    assert!(info.holders.is_empty(), "{info:?}");
    let err = a
        .semaphore(&name, 3)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("another limit");
    assert_eq!(
        err.kind(),
        ErrorKind::LimitMismatch {
            stored: 4_000_000_000,
            requested: 3
        }
    );
}

/// A permit waiter whose connection goes silent (every byte dropped, no FIN or RST) gives it up after
/// its 1 s slice + the request timeout, not the mutex's 10 s slice + the request timeout, and goes on
/// waiting over a new connection: with `request_timeout=1s`, a permit freed 1.5 s after the connection
/// went silent reaches it within about 2 s, well before the 11 s the mutex's bound took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_waiter_gives_up_a_silent_connection_after_its_one_second_slice_fault() {
    use distlock_testkit::proxy::Proxy;
    let server = MariaDbServer::start_or_panic();
    let proxy = Proxy::start(server.addr()).unwrap();
    let slow_url = format!("{}?request_timeout=1s", server.url_via(proxy.addr()));
    let waiting = locks(&slow_url).await;
    let holder = locks(&server.url()).await;
    let name = unique("silent-waiter");
    let held = holder.semaphore(&name, 1).unwrap().acquire().await.unwrap();
    let waiter = spawn_permit_waiter(&waiting, &name, Duration::from_secs(60));
    tokio::time::sleep(Duration::from_millis(1500)).await; // waiting in the server
    proxy.blackhole().unwrap();
    let silent = Instant::now();
    // The reply of the slice in flight is dropped: that connection never answers again. Other
    // connections pass again from 0.8 s on. The permit is freed after the slice has ended in the server
    // (at most 1 s after it went silent), so the silent connection's session cannot win it.
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.pass().unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    held.release().await.unwrap();
    let got = waiter
        .await
        .unwrap()
        .expect("the permit, over a new connection");
    let took = silent.elapsed();
    eprintln!("a waiter whose connection went silent got the freed permit {took:?} after");
    assert!(
        took < Duration::from_secs(8),
        "the silent connection was given up after {took:?}: the bound is the 10 s mutex slice, not the permit's 1 s"
    );
    got.release().await.unwrap();
}
