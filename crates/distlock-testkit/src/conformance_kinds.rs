//! The conformance suite's lock kinds section: read-write locks and semaphores, on every backend, as
//! its [`Capabilities::kinds`](distlock_core::Capabilities::kinds) announce them. A backend that
//! announces a kind runs every case of it; one that does not must refuse it with
//! [`ErrorKind::Unsupported`] before any I/O. The cases are expanded by
//! [`conformance_suite!`](crate::conformance_suite) with the rest of the suite.
//!
//! Each case runs several steps on one provider (one server start each: the suite's cost on CI is
//! mostly server starts), in the order a user meets them; a failure names its step.

// The cases are test code run inside `#[test]`s: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::{
    ErrorKind, Fencing, LockGuard, LockKind, LockState, ReadWriteOrder, Result, RwLock,
};

use crate::conformance::{
    connections_in_reach, lose_a_release_reply, unique_name, warm_up, Client, Provider, PROMPT,
};
use crate::holder::HolderProcess;

/// A try's outcome where the name is in use as another kind: never a grant. `KindConflict` (the
/// engine refuses the second kind) and `None` (the kinds exclude each other) both keep it safe.
fn assert_not_granted(outcome: Result<Option<LockGuard>>, step: &str) {
    match outcome {
        Ok(None) => {}
        Err(e) if e.kind() == ErrorKind::KindConflict => {}
        Ok(Some(guard)) => panic!(
            "{step}: granted a {} while the name was held as another kind",
            guard.kind()
        ),
        Err(e) => panic!("{step}: {e}"),
    }
}

/// Waits a while for `acquire` and then drops it: a cancelled wait.
async fn cancel_after_a_while(acquire: impl std::future::Future<Output = Result<LockGuard>>) {
    let outcome = tokio::time::timeout(Duration::from_millis(400), acquire).await;
    assert!(
        outcome.is_err(),
        "the wait was meant to be cut short, but it ended by itself: {outcome:?}"
    );
}

/// The read-write lock's cases, on one provider.
pub async fn read_write(provider: &impl Provider) {
    read_write_basics(provider).await;
    read_write_writer_not_starved(provider).await;
    lost_release_reply_of(provider, SharedSide::Read).await;
}

/// The semaphore's cases, on one provider.
pub async fn semaphore(provider: &impl Provider) {
    semaphore_basics(provider).await;
    semaphore_crashed_holders(provider).await;
    lost_release_reply_of(provider, SharedSide::Permit).await;
}

/// The token's value where the backend mints them.
fn token_of(guard: &LockGuard) -> Option<u64> {
    guard.token().map(|t| t.get())
}

/// Many readers share a read-write lock; a writer excludes readers, writers and the name's mutex;
/// a write while the same `RwLock` holds a read fails at once (no upgrade); a write grant's token is
/// above every earlier one and a reader carries the last writer's; a downgrade keeps the token and lets
/// readers in (or is refused, changing nothing, where the engine cannot do it atomically); waits
/// cancelled in either direction leave nothing behind; and read holds (downgraded ones too) are renewed
/// past their lease. A backend without read-write locks refuses
/// them before any I/O.
pub async fn read_write_basics(provider: &impl Provider) {
    let name = unique_name("rw_basics");
    let a = provider.client().await;
    let b = provider.client().await;
    let c = provider.client().await;
    let caps = a.locks.capabilities();
    if !caps.kinds.read_write {
        let err = a
            .locks
            .read_write(&name)
            .expect_err("a backend without read-write locks must refuse one");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert!(
            err.to_string().contains("read-write lock"),
            "the refusal must name the kind: {err}"
        );
        return;
    }
    let rw = |client: &Client| client.locks.read_write(&name).expect("read_write");
    let fenced = caps.fencing != Fencing::None;
    let (ra, rb, rc) = (rw(&a), rw(&b), rw(&c));

    // A first writer sets the token readers then carry.
    let first = rc.write().await.expect("step 1: the first write");
    assert_eq!(first.kind(), LockKind::Write);
    let first_token = token_of(&first);
    assert_eq!(
        fenced,
        first_token.is_some(),
        "step 1: a write grant's token"
    );
    first.release().await.expect("step 1: release");

    // Two readers at once, each with the last writer's token.
    let r1 = ra
        .reader()
        .try_acquire()
        .await
        .expect("step 2: read")
        .expect("step 2: the lock is free");
    let r2 = rb
        .reader()
        .try_acquire()
        .await
        .expect("step 2: second read")
        .expect("step 2: a second reader must share the lock");
    assert_eq!((r1.kind(), r2.kind()), (LockKind::Read, LockKind::Read));
    if fenced {
        assert_eq!(token_of(&r1), first_token, "step 2: a reader's token");
        assert_eq!(token_of(&r2), first_token, "step 2: a reader's token");
    }
    if let Ok(info) = a.locks.inspect(&name).await {
        assert!(
            info.holder.is_none(),
            "step 2: status shows an exclusive holder while only readers hold: {info:?}"
        );
        if info.kind.is_some() {
            assert_eq!(info.kind, Some(LockKind::Read), "step 2: status kind");
            assert_eq!(info.holders.len(), 2, "step 2: status holders: {info:?}");
        }
    }

    // Readers exclude writers and the name's mutex.
    assert!(
        rc.writer().try_acquire().await.expect("step 3").is_none(),
        "step 3: a writer got in while two readers held"
    );
    assert_not_granted(c.lock(&name).try_acquire().await, "step 3: the mutex");

    // No upgrade: the same RwLock's write fails at once.
    let upgrade = ra.writer().try_acquire().await;
    assert_eq!(
        upgrade.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::WouldDeadlock),
        "step 4: a write while this RwLock holds a read: {upgrade:?}"
    );

    // A writer that gives up waiting behind the readers leaves nothing that keeps readers out.
    cancel_after_a_while(rc.write()).await;
    drop(r2);
    let started = Instant::now();
    let r3 = rb
        .reader()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("step 5: a reader after a cancelled writer's wait");
    assert!(started.elapsed() < PROMPT);
    r1.release().await.expect("step 5: release");
    r3.release().await.expect("step 5: release");

    // A writer excludes readers, writers and the mutex; its token is above the first writer's.
    let w = rc
        .writer()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("step 6: the writer, once the readers left");
    let w_token = token_of(&w);
    if let (Some(before), Some(now)) = (first_token, w_token) {
        assert!(now > before, "step 6: write token {now} after {before}");
    }
    assert!(ra.reader().try_acquire().await.expect("step 6").is_none());
    assert!(rb.writer().try_acquire().await.expect("step 6").is_none());
    assert_not_granted(a.lock(&name).try_acquire().await, "step 6: the mutex");
    let mixed = rc.reader().try_acquire().await;
    assert_eq!(
        mixed.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::WouldDeadlock),
        "step 6: a read while this RwLock holds the write: {mixed:?}"
    );

    // A reader that gives up waiting behind the writer leaves nothing that keeps writers out.
    cancel_after_a_while(ra.read()).await;
    w.release().await.expect("step 7: release");
    let w2 = rb
        .writer()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("step 7: a writer after a cancelled reader's wait");
    w2.release().await.expect("step 7: release");

    downgrade_step(&caps, &ra, &rb, &rc, &c, &name).await;

    // Renewed: a reader and a downgraded writer with a short lease are still Held after several
    // leases, and a writer still cannot get in.
    let lease = provider.short_lease();
    let mut downgraded = None;
    if caps.kinds.atomic_downgrade {
        let mut w = rc
            .writer()
            .options()
            .lease(lease)
            .wait(PROMPT)
            .acquire()
            .await
            .expect("step 9: write");
        w.downgrade().await.expect("step 9: downgrade");
        downgraded = Some(w);
    }
    let reader = ra
        .reader()
        .options()
        .lease(lease)
        .wait(PROMPT)
        .acquire()
        .await
        .expect("step 9: read");
    let mut guards = vec![&reader];
    guards.extend(downgraded.as_ref());
    renewed_for_several_leases(
        &guards,
        lease,
        async { rb.writer().try_acquire().await.expect("step 9").is_none() },
        "step 9",
    )
    .await;
    reader.release().await.expect("step 9: release");
    if let Some(downgraded) = downgraded {
        downgraded.release().await.expect("step 9: release");
    }

    // Nothing is left: a writer gets the lock at once.
    let last = rb
        .writer()
        .try_acquire()
        .await
        .expect("end")
        .expect("end: everything was released, the write lock must be free");
    last.release().await.expect("end: release");
}

/// A downgrade where the engine can do one atomically: the guard becomes a read guard with its
/// token, other readers get in, writers do not. Elsewhere it is refused and the guard stays the write
/// guard.
async fn downgrade_step(
    caps: &distlock_core::Capabilities,
    ra: &RwLock,
    rb: &RwLock,
    rc: &RwLock,
    c: &Client,
    name: &str,
) {
    let mut w = rc.write().await.expect("step 8: write");
    let token = w.token();
    let outcome = w.downgrade().await;
    if !caps.kinds.atomic_downgrade {
        let err = outcome.expect_err("step 8: a downgrade the backend cannot do");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert_eq!((w.kind(), w.state()), (LockKind::Write, LockState::Held));
        assert!(ra.reader().try_acquire().await.expect("step 8").is_none());
        w.release().await.expect("step 8: release");
        return;
    }
    outcome.expect("step 8: downgrade");
    assert_eq!((w.kind(), w.token()), (LockKind::Read, token));
    assert_eq!(w.state(), LockState::Held);
    let other = ra
        .reader()
        .try_acquire()
        .await
        .expect("step 8")
        .expect("step 8: another reader must get in after a downgrade");
    assert!(rb.writer().try_acquire().await.expect("step 8").is_none());
    assert_not_granted(c.lock(name).try_acquire().await, "step 8: the mutex");
    other.release().await.expect("step 8: release");
    // Only the downgraded guard holds now: its read hold (not merely the other reader's) keeps
    // writers out.
    assert!(
        rb.writer().try_acquire().await.expect("step 8").is_none(),
        "step 8: a writer got in beside a downgraded read guard"
    );
    w.release()
        .await
        .expect("step 8: release of the downgraded guard");
}

/// A read hold, a downgraded read hold and a permit are renewed as a mutex is: each outlives several
/// leases, Held, and keeps out what it excludes.
async fn renewed_for_several_leases(
    guards: &[&LockGuard],
    lease: Duration,
    still_excluded: impl std::future::Future<Output = bool>,
    step: &str,
) {
    tokio::time::sleep(lease * 3).await;
    for guard in guards {
        assert_eq!(
            guard.state(),
            LockState::Held,
            "{step}: a {} guard was not renewed past its {lease:?} lease: {:?}",
            guard.kind(),
            guard.loss_reason()
        );
    }
    assert!(
        still_excluded.await,
        "{step}: the hold was not kept past its lease"
    );
}

/// A writer waiting behind a steady stream of overlapping readers: where the engine puts writers
/// first or serves in order, it gets in promptly; where readers come first, it gets in once the
/// stream stops, and the figure is reported.
pub async fn read_write_writer_not_starved(provider: &impl Provider) {
    let a = provider.client().await;
    let caps = a.locks.capabilities();
    if !caps.kinds.read_write {
        return;
    }
    let name = unique_name("rw_starve");
    let readers = [provider.client().await, provider.client().await];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let granted_reads = Arc::new(AtomicUsize::new(0));
    let mut stream = Vec::new();
    for (i, client) in readers.into_iter().enumerate() {
        let (name, stop, granted_reads) = (name.clone(), stop.clone(), granted_reads.clone());
        stream.push(tokio::spawn(async move {
            // The whole client, not only its `locks` (an `async move` block captures only the fields
            // it uses): its proxies must live as long as the task, or its connections are refused.
            let client = client;
            let rw = client.locks.read_write(&name).expect("read_write");
            // Offset, so the two readers' holds overlap and the lock is never free of readers.
            tokio::time::sleep(Duration::from_millis(100 * i as u64)).await;
            while !stop.load(Ordering::SeqCst) {
                match rw
                    .reader()
                    .options()
                    .wait(Duration::from_millis(300))
                    .acquire()
                    .await
                {
                    Ok(guard) => {
                        granted_reads.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        guard.release().await.expect("reader release");
                    }
                    Err(e) if e.kind() == ErrorKind::Timeout => {}
                    Err(e) => panic!("a reader of the stream: {e}"),
                }
            }
        }));
    }
    // The stream is under way.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let writer = a.locks.read_write(&name).expect("read_write");
    let started = Instant::now();
    let bounded = caps.kinds.read_write_order != ReadWriteOrder::ReadersFirst;
    // A bounded order must let the writer in while the stream still runs; readers first, the stream
    // stops after a while and the writer must get in then.
    let stream_for = if bounded {
        PROMPT
    } else {
        Duration::from_secs(3)
    };
    let acquire = writer
        .writer()
        .options()
        .wait(stream_for + PROMPT * 2)
        .acquire();
    tokio::pin!(acquire);
    let (guard, while_streaming) = tokio::select! {
        guard = &mut acquire => (guard, true),
        () = tokio::time::sleep(stream_for) => {
            stop.store(true, Ordering::SeqCst);
            (acquire.await, false)
        }
    };
    let guard = guard.expect("the writer must get the lock");
    let waited = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    eprintln!(
        "read_write_writer_not_starved: {:?} order: the writer waited {waited:?} behind a stream of readers ({} reads granted)",
        caps.kinds.read_write_order,
        granted_reads.load(Ordering::SeqCst)
    );
    if bounded {
        assert!(
            while_streaming,
            "a {:?} read-write lock kept a writer out for {stream_for:?} while readers streamed (it got in only once they stopped, after {waited:?})",
            caps.kinds.read_write_order
        );
    }
    guard.release().await.expect("release");
    for task in stream {
        tokio::time::timeout(PROMPT * 2, task)
            .await
            .expect("the reader stream ends")
            .expect("reader task");
    }
}

/// At most N holders of a semaphore: exactly N try at once, the N+1st is refused; under contention
/// never more than N inside; each grant's token above the earlier grants'; distinct permits; another
/// limit fails with `LimitMismatch` naming both (also once every permit is back: the limit is kept);
/// a cancelled wait takes no permit; the name's mutex is never granted beside permits; a permit is
/// renewed past its lease. A backend without semaphores refuses one before any I/O.
pub async fn semaphore_basics(provider: &impl Provider) {
    let name = unique_name("sem_basics");
    let a = provider.client().await;
    let caps = a.locks.capabilities();
    if !caps.kinds.semaphore {
        let err = a
            .locks
            .semaphore(&name, 3)
            .expect_err("a backend without semaphores must refuse one");
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
        assert!(
            err.to_string().contains("semaphore"),
            "the refusal must name the kind: {err}"
        );
        return;
    }
    assert_eq!(
        a.locks
            .semaphore(&name, 0)
            .map(|_| ())
            .map_err(|e| e.kind()),
        Err(ErrorKind::InvalidConfig),
        "a semaphore of 0 permits"
    );
    let clients = [a, provider.client().await, provider.client().await];
    let fenced = caps.fencing != Fencing::None;

    // Exactly N at once, one after another, each token above the last.
    let mut held = Vec::new();
    let mut last_token = None;
    for (i, client) in clients.iter().enumerate() {
        let permit = client
            .locks
            .semaphore(&name, 3)
            .expect("semaphore")
            .try_acquire()
            .await
            .expect("step 1: try")
            .unwrap_or_else(|| panic!("step 1: permit {} of 3 was refused", i + 1));
        assert_eq!(permit.kind(), LockKind::Permit { limit: 3 });
        assert_eq!(fenced, permit.token().is_some(), "step 1: a permit's token");
        if let (Some(before), Some(now)) = (last_token, token_of(&permit)) {
            assert!(now > before, "step 1: permit token {now} after {before}");
        }
        last_token = token_of(&permit).or(last_token);
        held.push(permit);
    }
    let permits: HashSet<Option<&str>> = held.iter().map(LockGuard::permit).collect();
    assert_eq!(
        permits.len(),
        3,
        "step 1: the permits held must be distinct: {permits:?}"
    );
    let fourth = clients[0].locks.semaphore(&name, 3).expect("semaphore");
    assert!(
        fourth.try_acquire().await.expect("step 1").is_none(),
        "step 1: a 4th permit of 3"
    );
    if let Ok(info) = clients[0].locks.inspect(&name).await {
        if info.kind.is_some() {
            assert_eq!(
                info.kind,
                Some(LockKind::Permit { limit: 3 }),
                "status kind"
            );
            assert_eq!(info.holders.len(), 3, "status holders: {info:?}");
        }
    }

    // Another limit is refused, naming both.
    let mismatch = clients[1]
        .locks
        .semaphore(&name, 4)
        .expect("semaphore")
        .try_acquire()
        .await;
    assert_eq!(
        mismatch.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::LimitMismatch {
            stored: 3,
            requested: 4
        }),
        "step 2: another limit: {mismatch:?}"
    );

    // The name's mutex and read-write lock are never granted beside the permits.
    assert_not_granted(
        clients[2].lock(&name).try_acquire().await,
        "step 3: the mutex",
    );
    if caps.kinds.read_write {
        let rw = clients[2].locks.read_write(&name).expect("read_write");
        assert_not_granted(rw.reader().try_acquire().await, "step 3: a read");
    }

    // A wait cut short takes no permit: the one given back goes to the next try.
    cancel_after_a_while(fourth.acquire()).await;
    held.pop()
        .expect("a permit")
        .release()
        .await
        .expect("step 4: release");
    let after_cancel = try_within(
        &clients[2].locks.semaphore(&name, 3).expect("semaphore"),
        PROMPT,
    )
    .await
    .expect("step 4: the permit given back must not have gone to a cancelled wait");
    held.push(after_cancel);
    for permit in held.drain(..) {
        permit.release().await.expect("step 4: release");
    }

    // Contention: six tasks, never more than three inside.
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let semaphore = clients[i % 3].locks.semaphore(&name, 3).expect("semaphore");
        let (inside, most, tokens) = (inside.clone(), most.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let permit = semaphore
                    .permit()
                    .options()
                    .wait(PROMPT * 4)
                    .acquire()
                    .await
                    .expect("step 5: a permit under contention");
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokens.lock().unwrap().push(token_of(&permit));
                tokio::time::sleep(Duration::from_millis(30)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                permit.release().await.expect("step 5: release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("step 5: task");
    }
    assert!(
        most.load(Ordering::SeqCst) <= 3,
        "step 5: {} holders of a 3-permit semaphore at once",
        most.load(Ordering::SeqCst)
    );
    let tokens = tokens.lock().unwrap().clone();
    if fenced {
        let distinct: HashSet<_> = tokens.iter().collect();
        assert_eq!(
            distinct.len(),
            tokens.len(),
            "step 5: a token was minted twice: {tokens:?}"
        );
    }

    // Renewed: a permit with a short lease is still Held after several leases, and still counts.
    let lease = provider.short_lease();
    let short = clients[0]
        .locks
        .semaphore(&name, 3)
        .expect("semaphore")
        .permit()
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("step 6: a permit");
    let (p2, p3) = (
        clients[1]
            .locks
            .semaphore(&name, 3)
            .expect("semaphore")
            .acquire()
            .await
            .expect("step 6"),
        clients[2]
            .locks
            .semaphore(&name, 3)
            .expect("semaphore")
            .acquire()
            .await
            .expect("step 6"),
    );
    renewed_for_several_leases(
        &[&short],
        lease,
        async {
            let fourth = clients[1].locks.semaphore(&name, 3).expect("semaphore");
            fourth.try_acquire().await.expect("step 6").is_none()
        },
        "step 6",
    )
    .await;
    for permit in [short, p2, p3] {
        permit.release().await.expect("step 6: release");
    }

    // The limit is kept once every permit is back.
    let kept = clients[0]
        .locks
        .semaphore(&name, 5)
        .expect("semaphore")
        .try_acquire()
        .await;
    assert_eq!(
        kept.as_ref().err().map(|e| e.kind()),
        Some(ErrorKind::LimitMismatch {
            stored: 3,
            requested: 5
        }),
        "step 7: the stored limit once every permit is back: {kept:?}"
    );
}

/// A crashed permit holder's permit comes back by itself, and never are more than N held: a holder
/// process killed by SIGKILL (at once where the engine frees on process death, else within its
/// lease), and a client cut off its server (within its lease).
pub async fn semaphore_crashed_holders(provider: &impl Provider) {
    let a = provider.client().await;
    let caps = a.locks.capabilities();
    if !caps.kinds.semaphore {
        return;
    }
    let b = provider.client().await;
    let lease = provider.short_lease();
    let name = unique_name("sem_crash");
    let semaphore = |client: &Client| client.locks.semaphore(&name, 2).expect("semaphore");

    if let Some(url) = provider.url() {
        let mut holder =
            HolderProcess::spawn_with(&url, &name, lease, &["--permits", "2"]).expect("holder");
        let mine = semaphore(&a)
            .try_acquire()
            .await
            .expect("try")
            .expect("the second permit of 2");
        assert!(
            semaphore(&b).try_acquire().await.expect("try").is_none(),
            "a third permit of 2 beside the holder process"
        );
        holder.kill9().expect("kill the holder");
        let bound = if caps.frees_on_process_death {
            PROMPT
        } else {
            lease * 4 + PROMPT
        };
        let back = semaphore(&b)
            .permit()
            .options()
            .wait(bound)
            .acquire()
            .await
            .expect("the killed holder's permit must come back");
        assert!(
            semaphore(&a).try_acquire().await.expect("try").is_none(),
            "three permits of 2 after the holder died"
        );
        back.release().await.expect("release");
        mine.release().await.expect("release");
    } else {
        assert!(
            !caps.shared_across_processes,
            "a backend shared across processes must give the suite a URL"
        );
    }

    // A cut-off holder's permit comes back within its lease.
    let cut_off = semaphore(&a)
        .permit()
        .options()
        .lease(lease)
        .acquire()
        .await
        .expect("a permit");
    let other = semaphore(&b)
        .try_acquire()
        .await
        .expect("try")
        .expect("the second permit");
    if !a.cut().await {
        assert!(
            !caps.server_ttl,
            "a backend with leases must let the suite cut a client off"
        );
        drop((cut_off, other));
        return;
    }
    let third = provider.client().await;
    let back = semaphore(&third)
        .permit()
        .options()
        .wait(lease * 4 + PROMPT)
        .acquire()
        .await
        .expect("the cut-off holder's permit must come back within its lease");
    assert!(
        semaphore(&b).try_acquire().await.expect("try").is_none(),
        "three permits of 2 after a holder was cut off"
    );
    a.heal().await;
    let late = cut_off.release().await;
    assert!(
        matches!(
            late.as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::NotHeld | ErrorKind::Unavailable)
        ),
        "the cut-off holder's release: {late:?}"
    );
    assert!(
        semaphore(&b).try_acquire().await.expect("try").is_none(),
        "the cut-off holder's late release freed someone else's permit"
    );
    back.release().await.expect("release");
    other.release().await.expect("release");
}

/// One attempt after another, for at most `within`, until a permit is granted (a cancelled wait's
/// undo may still be on its way).
async fn try_within(semaphore: &distlock_core::Semaphore, within: Duration) -> Option<LockGuard> {
    let started = Instant::now();
    loop {
        if let Some(permit) = semaphore.try_acquire().await.expect("try") {
            return Some(permit);
        }
        if started.elapsed() > within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The shared hold a [`lost_release_reply_of`] case releases.
#[derive(Debug, Clone, Copy)]
pub enum SharedSide {
    /// A read hold; a writer getting in shows its release applied.
    Read,
    /// The one permit of a 1-permit semaphore; another client's permit shows its release applied.
    Permit,
}

/// The mutex's `lost_release_reply` for the shared kinds: a read hold's or a permit's release reaches
/// the server and is applied, but its reply is lost (the holder's proxies hold every byte 1 s both ways,
/// and once another client gets in they pass and reset, dropping the held reply). The release must
/// return `Ok` or `Unavailable`, never `NotHeld`; whatever the holder resends must leave the next
/// holder alone (it stays Held, a third client is kept out meanwhile, its release is `Ok`); and the
/// holder's `Lock` acquires again afterwards. Backends without connections to lose a reply on
/// (memory, file) have nothing to run; a kind the backend lacks is skipped (its refusal is checked
/// by the basics).
pub async fn lost_release_reply_of(provider: &impl Provider, side: SharedSide) {
    let case = match side {
        SharedSide::Read => "rw_lost_release_reply",
        SharedSide::Permit => "sem_lost_release_reply",
    };
    let a = provider.client().await;
    let kinds = a.locks.capabilities().kinds;
    let supported = match side {
        SharedSide::Read => kinds.read_write,
        SharedSide::Permit => kinds.semaphore,
    };
    if !supported || !connections_in_reach(&a, case) {
        return;
    }
    let b = provider.client().await;
    let c = provider.client().await;
    let lease = Duration::from_secs(30);
    warm_up(&a, case, lease).await;
    // Under load the reply may get through before the reset; then again with a fresh name.
    for attempt in 1..=3 {
        let name = unique_name(case);
        let reply_lost = match side {
            SharedSide::Read => {
                let rw = |client: &Client| client.locks.read_write(&name).expect("read_write");
                let (ra, rb, rc) = (rw(&a), rw(&b), rw(&c));
                lose_a_release_reply(&a, ra.reader(), rb.writer(), rc.reader(), case).await
            }
            SharedSide::Permit => {
                let permit = |client: &Client| {
                    client
                        .locks
                        .semaphore(&name, 1)
                        .expect("semaphore")
                        .permit()
                };
                let (pa, pb, pc) = (permit(&a), permit(&b), permit(&c));
                lose_a_release_reply(&a, &pa, &pb, &pc, case).await
            }
        };
        if reply_lost {
            return;
        }
        eprintln!("{case}: attempt {attempt}: the reply got through before the reset; again");
    }
    panic!("{case}: the release's reply got through before the reset in 3 attempts");
}
