//! Adversarial review of the lock kinds (issue 25, e2f01b7): read-write locks and semaphores in the
//! core and the memory backend. Oracles: never a writer beside a reader or another writer, never N+1
//! permits, a guard never says Held while the store no longer has its hold, the two sides of one
//! `RwLock` never wait for each other (a typed `WouldDeadlock` instead), writers first also for the
//! name's mutex, tokens as DESIGN says, `max_hold` kept through a downgrade.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use distlock_core::{ErrorKind, LockGuard, LockKind, LockState, Locks, MemoryBackend};

/// Well past anything the store or the core waits for by itself here (a loaded machine's slack).
const PROMPT: Duration = Duration::from_secs(5);

/// Polls `fut` once, without waiting for it.
async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *fut).poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// Lets spawned work run a little (the current-thread runtime runs it only while this waits).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// A read of an `RwLock` whose write is waiting (behind another owner's reader) must not leave that
/// write waiting for its own read: the read waits its turn (and then finds the write held: no
/// upgrade), or the write fails with `WouldDeadlock` once the read is in.
///
/// Failed on e2f01b7: the write's refusal was checked once, before its wait; the read went in past
/// the writers-first mark (its own owner's), and after the other reader left, the write kept waiting
/// for the read of its own `RwLock` (until its wait limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_while_the_same_rwlocks_write_waits_never_leaves_the_write_waiting_for_it() {
    let locks = Locks::new(MemoryBackend::new());
    let other = locks.read_write("rw-race-1").unwrap();
    let rw = Arc::new(locks.read_write("rw-race-1").unwrap());
    let other_read = other.read().await.unwrap();
    let write = tokio::spawn({
        let rw = rw.clone();
        async move { rw.writer().options().wait(PROMPT * 6).acquire().await }
    });
    // The write is waiting behind the other owner's reader.
    settle().await;
    assert!(!write.is_finished());
    let read = rw.reader().try_acquire().await;
    other_read.release().await.unwrap();
    let outcome = tokio::time::timeout(PROMPT, write)
        .await
        .expect("the write of an RwLock kept waiting for that RwLock's own read")
        .unwrap();
    match read {
        Ok(Some(read)) => {
            assert_eq!(
                outcome.as_ref().err().map(|e| e.kind()),
                Some(ErrorKind::WouldDeadlock),
                "a write beside its own RwLock's read: {outcome:?}"
            );
            read.release().await.unwrap();
        }
        Ok(None) | Err(_) => {
            // The read waited its turn: the write gets the lock.
            outcome.unwrap().release().await.unwrap();
        }
    }
}

/// The other way round: a write of an `RwLock` whose read is waiting (behind another owner's writer).
/// When that writer leaves, one side gets the lock and the other must not wait for it.
///
/// Failed on e2f01b7: whichever side took the lock first, the other kept waiting for it (until its
/// wait limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_while_the_same_rwlocks_read_waits_never_leaves_one_side_waiting_for_the_other() {
    let locks = Locks::new(MemoryBackend::new());
    let other = locks.read_write("rw-race-2").unwrap();
    let rw = Arc::new(locks.read_write("rw-race-2").unwrap());
    let other_write = other.write().await.unwrap();
    let read = tokio::spawn({
        let rw = rw.clone();
        async move { rw.reader().options().wait(PROMPT * 6).acquire().await }
    });
    settle().await;
    let write = tokio::spawn({
        let rw = rw.clone();
        async move { rw.writer().options().wait(PROMPT * 6).acquire().await }
    });
    settle().await;
    other_write.release().await.unwrap();
    let both = tokio::time::timeout(PROMPT, async { (read.await, write.await) })
        .await
        .expect("one side of an RwLock kept waiting for the other side's hold");
    let (read, write) = (both.0.unwrap(), both.1.unwrap());
    let refused = |outcome: &distlock_core::Result<LockGuard>| {
        outcome.as_ref().err().map(|e| e.kind()) == Some(ErrorKind::WouldDeadlock)
    };
    assert!(
        (read.is_ok() && refused(&write)) || (write.is_ok() && refused(&read)),
        "one side granted, the other refused: read {read:?}, write {write:?}"
    );
}

/// A downgrade whose future was dropped finishes in its task; a write acquire of the same `RwLock`
/// made meanwhile must not join the write hold that task is ending (it would say Held and then go
/// Lost with no fault at all).
///
/// Failed on e2f01b7: the acquire joined the write hold the downgrade's task ended a moment later:
/// the fresh guard went Lost.
#[tokio::test(flavor = "current_thread")]
async fn a_write_after_a_dropped_downgrade_is_not_lost_by_that_downgrade() {
    let locks = Locks::new(MemoryBackend::new());
    let rw = locks.read_write("dropped-downgrade").unwrap();
    let mut write = rw.write().await.unwrap();
    {
        let mut downgrade = Box::pin(write.downgrade());
        assert!(poll_once(&mut downgrade).await.is_none());
    }
    let again = rw
        .writer()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("a write after a dropped downgrade");
    settle().await;
    assert_eq!(
        again.state(),
        LockState::Held,
        "a fresh write guard was lost by an earlier, abandoned downgrade: {:?}",
        again.loss_reason()
    );
    // The task found the write hold shared by `again` and changed nothing: `write` is still a
    // guard of that hold (or, had it run first, it would be Lost and `again` a fresh hold).
    assert_eq!(write.kind(), LockKind::Write);
    let other = locks.read_write("dropped-downgrade").unwrap();
    assert!(other.reader().try_acquire().await.unwrap().is_none());
    drop(write);
    again.release().await.unwrap();
}

/// A downgrade waits for its owner's read release still on its way, as an acquire of the read side
/// does: a release that reaches the store after the downgrade would delete the read hold it made.
///
/// Failed on e2f01b7: a `release()` of a read guard was dropped after the store applied it and its
/// restart was delayed; the write and the downgrade went ahead, the restarted release deleted the
/// downgraded read hold, and another client's writer got the lock while the guard said Held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downgrade_is_not_undone_by_its_owners_late_read_release() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let rw = locks.read_write("late-read-release").unwrap();
    let read = rw.read().await.unwrap();
    // The first release reaches the store at once and its reply is late; the release is then
    // dropped, and its restart reaches the store 2 s later.
    backend.delay_releases([Duration::ZERO, Duration::from_secs(2)]);
    backend.delay_release_replies([Duration::from_secs(1)]);
    {
        let mut release = Box::pin(read.release());
        assert!(poll_once(&mut release).await.is_none());
    }
    let mut write = rw.writer().options().wait(PROMPT).acquire().await.unwrap();
    write.downgrade().await.expect("downgrade");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let writer = elsewhere.read_write("late-read-release").unwrap();
    let got = writer.writer().try_acquire().await.unwrap();
    assert!(
        got.is_none() || write.state() != LockState::Held,
        "another client's writer holds the lock beside a downgraded read guard that says Held"
    );
    drop(got);
    drop(write);
}

/// A downgrade keeps the write guard's `max_hold`, also when it had to wait for the read side's
/// gate: the read guard must not outlive the cap.
///
/// Failed on e2f01b7: the cap left was computed before the wait for the read side's gate (held by
/// a read release whose reply was 1.5 s late) and counted again from the request, so a write with a
/// 3 s `max_hold` became a read guard still Held (and held in the store) 3.5 s after the acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downgrade_keeps_max_hold_through_a_wait_for_the_read_gate() {
    let backend = MemoryBackend::new();
    backend.enable_hand_off();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let rw = locks.read_write("downgrade-max-hold").unwrap();
    let read = rw.read().await.unwrap();
    backend.delay_release_replies([Duration::from_millis(1500)]);
    drop(read);
    settle().await;
    let acquired = tokio::time::Instant::now();
    let mut write = rw
        .writer()
        .options()
        .max_hold(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let outcome = write.downgrade().await;
    tokio::time::sleep_until(acquired + Duration::from_millis(3500)).await;
    assert_ne!(
        write.state(),
        LockState::Held,
        "a guard with a 3 s max_hold is Held {:?} after its acquire (downgrade: {outcome:?})",
        acquired.elapsed()
    );
    let writer = elsewhere.read_write("downgrade-max-hold").unwrap();
    let got = writer.writer().try_acquire().await.unwrap();
    assert!(got.is_some(), "the store still holds past max_hold");
    drop(write);
}

/// Writers first holds for the name's mutex too (on memory it is the write side itself): a mutex
/// waiting behind readers keeps new readers out, as a waiting writer does.
///
/// Failed on e2f01b7: only a `Write` request set the mark; a new reader got in beside the waiting
/// mutex, so a stream of readers could keep a mutex out for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_mutex_keeps_new_readers_out_as_a_waiting_writer_does() {
    let locks = Locks::new(MemoryBackend::new());
    let first = locks.read_write("mutex-first").unwrap();
    let first_read = first.read().await.unwrap();
    for exclusive in [LockKind::Write, LockKind::Mutex] {
        let rw = Arc::new(locks.read_write("mutex-first").unwrap());
        let mutex = Arc::new(locks.lock("mutex-first").unwrap());
        let waiting = tokio::spawn(async move {
            let lock = match exclusive {
                LockKind::Write => rw.writer(),
                _ => &*mutex,
            };
            let _ = lock.options().wait(Duration::from_secs(2)).acquire().await;
        });
        settle().await;
        let late = locks.read_write("mutex-first").unwrap();
        let got = late.reader().try_acquire().await.unwrap();
        assert!(
            got.is_none(),
            "a new reader got in beside a waiting {exclusive}"
        );
        waiting.abort();
        let _ = waiting.await;
        settle().await;
    }
    first_read.release().await.unwrap();
}

/// A reader carries the last write (or mutex) grant's token, not a permit's minted since.
///
/// Failed on e2f01b7: the reader got the last token of any kind: the permit's.
#[tokio::test]
async fn a_reader_carries_the_last_write_token_not_a_permits() {
    let locks = Locks::new(MemoryBackend::new());
    let rw = locks.read_write("read-token").unwrap();
    let write = rw.write().await.unwrap();
    let write_token = write.token();
    write.release().await.unwrap();
    let permit = locks
        .semaphore("read-token", 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    assert!(permit.token() > write_token);
    permit.release().await.unwrap();
    let read = rw.read().await.unwrap();
    assert_eq!(
        read.token(),
        write_token,
        "a reader's token must be the last write grant's"
    );
    read.release().await.unwrap();
}

// --- probes that hold ----------------------------------------------------------------------------

/// A reentrant permit `Lock` gives the same permit and token; a second permit another one.
#[tokio::test]
async fn a_reentrant_permit_is_the_same_permit() {
    let locks = Locks::new(MemoryBackend::new());
    let semaphore = locks.semaphore("reentrant-permit", 2).unwrap();
    let lock = semaphore.permit();
    let a = lock.acquire().await.unwrap();
    let b = lock.acquire().await.unwrap();
    assert_eq!((a.permit(), a.token()), (b.permit(), b.token()));
    let c = semaphore.acquire().await.unwrap();
    assert_ne!(a.permit(), c.permit());
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "a 3rd of 2"
    );
    drop(a);
    settle().await;
    assert!(semaphore.try_acquire().await.unwrap().is_none(), "b holds");
    drop((b, c));
}

/// Read and write holds of one owner are told apart by kind: a lost read hold's late release never
/// deletes the same owner's write hold, and a write release never deletes a read.
#[tokio::test]
async fn a_read_release_never_deletes_the_same_owners_write() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let rw = locks.read_write("kind-release").unwrap();
    let read = rw.read().await.unwrap();
    // The read release reaches the store only after the write that follows it is in.
    backend.delay_releases([Duration::from_millis(300)]);
    drop(read);
    let write = rw.writer().options().wait(PROMPT).acquire().await.unwrap();
    settle().await;
    let other = elsewhere.read_write("kind-release").unwrap();
    assert!(other.reader().try_acquire().await.unwrap().is_none());
    assert_eq!(write.state(), LockState::Held);
    write.release().await.unwrap();
}

/// A read hold and a permit whose lease ran out (the client cut off) go Lost, and another client's
/// writer or permit gets in only then.
#[tokio::test]
async fn an_expired_read_hold_and_permit_go_lost() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let lease = Duration::from_millis(600);
    let rw = locks.read_write("expired-read").unwrap();
    let read = rw.reader().options().lease(lease).acquire().await.unwrap();
    let permit = locks
        .semaphore("expired-permit", 1)
        .unwrap()
        .permit()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    backend.freeze();
    let writer = elsewhere.read_write("expired-read").unwrap();
    let w = writer
        .writer()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .unwrap();
    assert_eq!(read.state(), LockState::Lost);
    let p = elsewhere
        .semaphore("expired-permit", 1)
        .unwrap()
        .permit()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .unwrap();
    assert_eq!(permit.state(), LockState::Lost);
    backend.unfreeze();
    assert!(read.release().await.is_err());
    assert!(permit.release().await.is_err());
    let again = elsewhere.read_write("expired-read").unwrap();
    assert!(again.reader().try_acquire().await.unwrap().is_none());
    drop((w, p));
}

/// With handoff on, a mutex and a write of one name share the local gate: the mutex's release does
/// not hand its lock to the queued write (another kind), which then gets it by its own acquire; a
/// write hands on to a queued write, whose guard then downgrades as any write guard does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_off_only_between_same_kinds_and_the_handed_write_downgrades() {
    let backend = MemoryBackend::new();
    backend.enable_hand_off();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let mutex = locks.lock("handoff-kinds").unwrap();
    let rw1 = Arc::new(locks.read_write("handoff-kinds").unwrap());
    let rw2 = Arc::new(locks.read_write("handoff-kinds").unwrap());
    let m = mutex.acquire().await.unwrap();
    let first = tokio::spawn({
        let rw1 = rw1.clone();
        async move { rw1.writer().options().wait(PROMPT).acquire().await }
    });
    settle().await;
    m.release().await.unwrap();
    let w1 = first.await.unwrap().unwrap();
    assert_eq!(backend.hand_offs(), 0, "a mutex handed on to a write");
    let second = tokio::spawn({
        let rw2 = rw2.clone();
        async move { rw2.writer().options().wait(PROMPT).acquire().await }
    });
    settle().await;
    let t1 = w1.token();
    w1.release().await.unwrap();
    let mut w2 = second.await.unwrap().unwrap();
    assert_eq!(backend.hand_offs(), 1, "a write handed on to a write");
    assert!(w2.token() > t1);
    w2.downgrade().await.unwrap();
    assert_eq!(w2.kind(), LockKind::Read);
    let other = elsewhere.read_write("handoff-kinds").unwrap();
    assert!(other.writer().try_acquire().await.unwrap().is_none());
    let r = other.reader().try_acquire().await.unwrap().unwrap();
    assert_eq!(r.token(), w2.token());
    drop(r);
    w2.release().await.unwrap();
}

/// Guards outlive their `RwLock`, `Semaphore` and `Locks`: a write guard still downgrades and each
/// guard still releases.
#[tokio::test]
async fn guards_outlive_their_handles() {
    let backend = MemoryBackend::new();
    let elsewhere = Locks::new(backend.another_client());
    let (mut write, permit) = {
        let locks = Locks::new(backend.clone());
        let rw = locks.read_write("outlived").unwrap();
        let semaphore = locks.semaphore("outlived-sem", 1).unwrap();
        (
            rw.write().await.unwrap(),
            semaphore.acquire().await.unwrap(),
        )
    };
    write.downgrade().await.unwrap();
    let rw = elsewhere.read_write("outlived").unwrap();
    assert!(rw.writer().try_acquire().await.unwrap().is_none());
    assert!(elsewhere
        .semaphore("outlived-sem", 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    write.release().await.unwrap();
    permit.release().await.unwrap();
    assert!(rw.writer().try_acquire().await.unwrap().is_some());
    assert!(elsewhere
        .semaphore("outlived-sem", 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_some());
}

/// `LimitMismatch` and `KindConflict` paths: the limit is checked before "all taken", kept after
/// every permit is back, and a name held as one kind refuses the other with `KindConflict`, in
/// both directions, and takes it once the other is released.
#[tokio::test]
async fn limit_and_kind_conflicts() {
    let locks = Locks::new(MemoryBackend::new());
    let two = locks.semaphore("conflicts", 2).unwrap();
    let (a, b) = (two.acquire().await.unwrap(), two.acquire().await.unwrap());
    let three = locks.semaphore("conflicts", 3).unwrap();
    let err = three.try_acquire().await.unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }
    );
    let mutex = locks.lock("conflicts").unwrap();
    assert_eq!(
        mutex.try_acquire().await.unwrap_err().kind(),
        ErrorKind::KindConflict
    );
    let rw = locks.read_write("conflicts").unwrap();
    assert_eq!(
        rw.reader().try_acquire().await.unwrap_err().kind(),
        ErrorKind::KindConflict
    );
    drop((a, b));
    settle().await;
    let m = mutex
        .try_acquire()
        .await
        .unwrap()
        .expect("free once the permits are back");
    assert_eq!(
        two.try_acquire().await.unwrap_err().kind(),
        ErrorKind::KindConflict
    );
    drop(m);
    settle().await;
    let r = rw.read().await.unwrap();
    assert_eq!(
        two.try_acquire().await.unwrap_err().kind(),
        ErrorKind::KindConflict
    );
    drop(r);
    settle().await;
    assert_eq!(
        three.try_acquire().await.unwrap_err().kind(),
        ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }
    );
    assert!(two.try_acquire().await.unwrap().is_some());
}

/// Many tasks on one name with random kinds, cancellations, downgrades and drops: never a writer
/// beside another holder, never more than N permits; nobody stuck at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_kinds_stress() {
    for round in 0..3u64 {
        stress_round(round).await;
    }
}

async fn stress_round(seed: u64) {
    let backend = MemoryBackend::new();
    let clients: Vec<Locks> = (0..3)
        .map(|i| {
            if i == 0 {
                Locks::new(backend.clone())
            } else {
                Locks::new(backend.another_client())
            }
        })
        .collect();
    let readers = Arc::new(AtomicUsize::new(0));
    let writers = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut tasks = Vec::new();
    for t in 0..9u64 {
        let locks = clients[(t % 3) as usize].clone();
        let (readers, writers, violations) = (readers.clone(), writers.clone(), violations.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = seed
                .wrapping_mul(31)
                .wrapping_add(t)
                .wrapping_mul(0x9E37_79B9)
                | 1;
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let rw = locks.read_write("stress").unwrap();
            for _ in 0..40 {
                let op = next(6);
                let wait = Duration::from_millis(next(40));
                match op {
                    0 | 1 => {
                        let Ok(Ok(guard)) =
                            tokio::time::timeout(wait, rw.reader().options().acquire()).await
                        else {
                            continue;
                        };
                        let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                        if writers.load(Ordering::SeqCst) > 0 {
                            violations
                                .lock()
                                .unwrap()
                                .push(format!("reader {now} beside a writer"));
                        }
                        tokio::time::sleep(Duration::from_millis(next(5))).await;
                        readers.fetch_sub(1, Ordering::SeqCst);
                        if next(2) == 0 {
                            drop(guard);
                        } else {
                            let _ = guard.release().await;
                        }
                    }
                    2..=4 => {
                        let Ok(Ok(mut guard)) =
                            tokio::time::timeout(wait, rw.writer().options().acquire()).await
                        else {
                            continue;
                        };
                        let w = writers.fetch_add(1, Ordering::SeqCst) + 1;
                        let r = readers.load(Ordering::SeqCst);
                        if w > 1 || r > 0 {
                            violations
                                .lock()
                                .unwrap()
                                .push(format!("{w} writers, {r} readers"));
                        }
                        tokio::time::sleep(Duration::from_millis(next(5))).await;
                        if op == 4 {
                            // The count moves before the hold does: a reader beside is fine now.
                            readers.fetch_add(1, Ordering::SeqCst);
                            writers.fetch_sub(1, Ordering::SeqCst);
                            let down = guard.downgrade().await;
                            if down.is_err() && guard.state() == LockState::Held {
                                violations
                                    .lock()
                                    .unwrap()
                                    .push(format!("a failed downgrade left Held: {down:?}"));
                            }
                            tokio::time::sleep(Duration::from_millis(next(5))).await;
                            readers.fetch_sub(1, Ordering::SeqCst);
                        } else {
                            writers.fetch_sub(1, Ordering::SeqCst);
                        }
                        if next(2) == 0 {
                            drop(guard);
                        } else {
                            let _ = guard.release().await;
                        }
                    }
                    _ => {
                        // A read and a write of this RwLock at once: neither may wait for the other.
                        let (read, write) = tokio::join!(
                            rw.reader().options().wait(PROMPT).acquire(),
                            rw.writer().options().wait(PROMPT).acquire()
                        );
                        for outcome in [&read, &write] {
                            if let Err(e) = outcome {
                                if e.kind() != ErrorKind::WouldDeadlock {
                                    violations
                                        .lock()
                                        .unwrap()
                                        .push(format!("read and write at once: {e}"));
                                }
                            }
                        }
                        if read.is_ok() && write.is_ok() {
                            violations
                                .lock()
                                .unwrap()
                                .push("one RwLock held both sides".into());
                        }
                    }
                }
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(PROMPT * 6, task)
            .await
            .expect("a stress task is stuck")
            .unwrap();
    }
    let found = violations.lock().unwrap().clone();
    assert!(found.is_empty(), "round {seed}: {found:?}");
    for locks in &clients {
        locks.close().await;
    }
    let w = clients[1]
        .read_write("stress")
        .unwrap()
        .writer()
        .options()
        .wait(PROMPT)
        .acquire()
        .await
        .expect("everything was released: the write lock is free");
    w.release().await.unwrap();
}
