//! Adversarial review of issue 9's memory work on the local gate (a62718c, 04a01de, 4a80b9f): the
//! early release's mark made by the release and counted in the gate, `Holding`'s one gate field, the
//! gate's boxed waiter queue freed when the gate is free. Behaviour must not change. Oracles: a second
//! client never takes a lock while a guard says Held, the store never loses a grant a guard says Held,
//! no waiter is left stuck while the lock is free, a cancelled waiter never takes the lock.
//!
//! All pass on 4a80b9f and on 8b80e46's core. Checked against local mutations of the library (not
//! committed): with the gate's count of releases in flight never raised (the acquire never looks for
//! its owner's release), `review_same_owner_…`, `review_release_in_flight_across_runtimes`,
//! `review_reentrancy_…`, `review_a_wait_for_the_own_release_…` and `review_no_handoff_…` fail; with
//! the handoff's check of the next owner's release in flight removed, only `review_no_handoff_…` fails
//! (no existing test does); with the queue freed on every pass, the stress, many-names and queue tests
//! fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use distlock_core::{ErrorKind, LockGuard, LockState, Locks, MemoryBackend};

/// A small deterministic generator (no dev-dependency for randomness).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn millis(&mut self, n: u64) -> Duration {
        Duration::from_millis(self.below(n))
    }
}

/// Polls `fut` once (so an acquire queues at the local gate), without waiting for it.
async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *fut).poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}

/// What the oracles saw going wrong; the test fails at its end with all of them.
#[derive(Clone, Default)]
struct Findings(Arc<Mutex<Vec<String>>>);

impl Findings {
    fn add(&self, what: String) {
        eprintln!("FINDING: {what}");
        self.0.lock().unwrap().push(what);
    }
    fn assert_none(&self) {
        let found = self.0.lock().unwrap();
        assert!(
            found.is_empty(),
            "{} findings, first ones: {:#?}",
            found.len(),
            &found[..found.len().min(10)]
        );
    }
}

/// While `guard` says Held: the store names its owner as the holder, and another client cannot take
/// the lock.
async fn check_held(guard: &LockGuard, elsewhere: &Locks, findings: &Findings, context: &str) {
    if guard.state() != LockState::Held {
        return;
    }
    let info = elsewhere.inspect(guard.name()).await.unwrap();
    let holder = info.holder.as_ref().and_then(|h| h.owner.clone());
    let token = info.holder.as_ref().and_then(|h| h.token);
    let other = elsewhere
        .lock(guard.name())
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    // Only a finding if the guard still says Held after the look (a loss reported meanwhile is honest).
    if guard.state() != LockState::Held {
        return;
    }
    if holder.as_deref() != Some(guard.owner()) || token != guard.token() {
        findings.add(format!(
            "{context}: guard of {} says Held with token {:?}, the store's holder is {holder:?} with {token:?}",
            guard.owner(),
            guard.token()
        ));
    }
    if let Some(other) = other {
        findings.add(format!(
            "{context}: another client took {} while a guard of {} says Held",
            guard.name(),
            guard.owner()
        ));
        other.release().await.unwrap();
    }
}

/// Waits until `name` is free on the store (no holder), for at most `limit`.
async fn store_free_within(locks: &Locks, name: &str, limit: Duration) -> bool {
    let until = tokio::time::Instant::now() + limit;
    loop {
        if locks.inspect(name).await.unwrap().holder.is_none() {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Guarantee (1): an owner's own next acquire of a name never overtakes its earlier release that passed
/// the gate on early and reaches the store late. Every way the same owner comes back: the same `Lock`
/// after a dropped guard, after `release().await`, after a release cancelled (restarted in the
/// background), a second `Lock` of the owner id (`lock_as`), one made after the first was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_same_owner_never_overtakes_its_early_release() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let findings = Findings::default();
    let mut rng = Rng::new(1);
    for round in 0..60u64 {
        let name = format!("own-{}", round % 3);
        let owner = format!("owner-{round}");
        let first = locks.lock_as(&name, owner.as_str()).unwrap();
        let held = first.acquire().await.unwrap();
        let token = held.token();
        let late = Duration::from_millis(30 + rng.below(120));
        let variant = round % 5;
        // The release reaches the store `late` after it is sent (so it passes the gate on early at its
        // first poll); half the time its reply is held back as well.
        backend.delay_releases([late]);
        if rng.below(2) == 0 {
            backend.delay_release_replies([rng.millis(100)]);
        }
        let next = match variant {
            0 => {
                drop(held);
                first
            }
            1 => {
                tokio::spawn(held.release());
                // Until the release task has left the hold (else the acquire below re-enters it).
                while first.is_held() {
                    tokio::task::yield_now().await;
                }
                first
            }
            2 => {
                // Cancelled after its first poll: restarted in the background, still in flight.
                let mut release = Box::pin(held.release());
                assert!(poll_once(&mut release).await.is_none());
                drop(release);
                first
            }
            3 => {
                let second = locks.lock_as(&name, owner.as_str()).unwrap();
                drop(held);
                second
            }
            _ => {
                drop(first);
                let second = locks.lock_as(&name, owner.as_str()).unwrap();
                tokio::spawn(held.release());
                tokio::task::yield_now().await;
                second
            }
        };
        let guard = tokio::time::timeout(Duration::from_secs(10), next.acquire())
            .await
            .expect("the same owner's acquire is stuck")
            .unwrap();
        if guard.token() <= token {
            findings.add(format!(
                "round {round} (variant {variant}): a token {:?} not above the previous hold's {token:?}",
                guard.token()
            ));
        }
        // Past the late release's arrival (and its reply): the grant must have survived it.
        tokio::time::sleep(late + Duration::from_millis(30)).await;
        check_held(
            &guard,
            &elsewhere,
            &findings,
            &format!("round {round} (variant {variant})"),
        )
        .await;
        guard.release().await.ok();
        assert!(
            store_free_within(&locks, &name, Duration::from_secs(2)).await,
            "round {round}: the name stayed held after the release"
        );
    }
    locks.close().await;
    findings.assert_none();
}

/// Guarantee (2): a handoff is not made to an owner whose earlier release of the name (passed on
/// early) is still on its way: the handed grant would skip that owner's wait, and the late release
/// would then delete it. Set-up: owner Y's release passes the gate on early and reaches the store late;
/// Y's lease runs out meanwhile, so H takes the lock; then the backend turns to handoffs and Y queues
/// behind H.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_no_handoff_to_an_owner_whose_early_release_is_in_flight() {
    for round in 0..6u32 {
        let backend = MemoryBackend::new();
        let locks = Locks::new(backend.clone());
        let elsewhere = Locks::new(backend.another_client());
        let findings = Findings::default();
        let name = "handoff-in-flight";
        let y = locks.lock_as(name, "owner-y").unwrap();
        // Y comes back with the same `Lock` or a second one of its owner id.
        let y_again = locks.lock_as(name, "owner-y").unwrap();
        let h = locks.lock_as(name, "owner-h").unwrap();
        let held = y
            .options()
            .lease(Duration::from_millis(200))
            .acquire()
            .await
            .unwrap();
        let late = Duration::from_millis(1500);
        let started = tokio::time::Instant::now();
        backend.delay_releases([late]);
        match round / 2 {
            0 => {
                tokio::spawn(held.release());
            }
            // Y's release runs in the background (its guard dropped).
            1 => drop(held),
            // Polled once (passing the gate on, marked in flight), cancelled: restarted in the
            // background, the mark kept across the restart.
            _ => {
                let mut release = Box::pin(held.release());
                assert!(poll_once(&mut release).await.is_none());
                drop(release);
            }
        }
        // H gets the gate at once (passed on early) and the lock once Y's lease ran out on the store.
        let h_guard = tokio::time::timeout(Duration::from_secs(5), h.acquire())
            .await
            .expect("H is granted")
            .unwrap();
        assert!(
            started.elapsed() < late,
            "set-up: H was granted only after Y's release arrived ({:?})",
            started.elapsed()
        );
        backend.enable_hand_off();
        let y_lock = if round % 2 == 0 { y } else { y_again };
        let mut y_waiting = tokio::spawn(async move {
            let guard = y_lock.acquire().await;
            (guard, y_lock)
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            poll_once(&mut y_waiting).await.is_none(),
            "Y queued behind H"
        );
        h_guard.release().await.unwrap();
        let (y_guard, _y_lock) = tokio::time::timeout(Duration::from_secs(10), y_waiting)
            .await
            .expect("Y is granted")
            .unwrap();
        let y_guard = y_guard.unwrap();
        // Past Y's late release.
        let wait = late.saturating_sub(started.elapsed()) + Duration::from_millis(100);
        tokio::time::sleep(wait).await;
        check_held(&y_guard, &elsewhere, &findings, &format!("round {round}")).await;
        y_guard.release().await.ok();
        locks.close().await;
        findings.assert_none();
    }
}

/// Guarantee (3) and (5) under load: many tasks of one `Locks` race acquire (with and without wait
/// limits, some cancelled at random points), release (awaited, dropped, cancelled mid-way) on one name,
/// with releases passing the gate on early and reaching the store or replying late. Mutual exclusion
/// (local count, store holder, another client), no task stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_gate_stress_one_name() {
    gate_stress(false, 7).await;
}

/// As [`review_gate_stress_one_name`], with handoffs (the grant travels with the gate).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_gate_stress_one_name_with_handoff() {
    gate_stress(true, 11).await;
}

async fn gate_stress(hand_off: bool, seed: u64) {
    let backend = MemoryBackend::new();
    if hand_off {
        backend.enable_hand_off();
    }
    let locks = Locks::new(backend.clone());
    let elsewhere = Arc::new(Locks::new(backend.another_client()));
    let findings = Findings::default();
    let holders = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let name = "stress";
    let mut tasks = Vec::new();
    for task in 0..16u64 {
        // Four tasks share two owner ids (two `Lock`s of one owner exclude each other locally).
        let lock = if task < 4 {
            locks.lock_as(name, format!("shared-{}", task % 2)).unwrap()
        } else {
            locks.lock(name).unwrap()
        };
        let (backend, elsewhere, findings, holders, granted) = (
            backend.clone(),
            elsewhere.clone(),
            findings.clone(),
            holders.clone(),
            granted.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed * 1000 + task);
            for step in 0..40u32 {
                let (kind, limit) = (rng.below(4), rng.millis(60));
                let attempt = async {
                    match kind {
                        0 => lock.try_acquire().await.unwrap(),
                        // A bounded wait (`try_acquire` would ignore the limit).
                        1 => match lock.options().wait(limit).acquire().await {
                            Ok(guard) => Some(guard),
                            Err(e) if e.kind() == ErrorKind::Timeout => None,
                            Err(e) => panic!("{e}"),
                        },
                        _ => Some(lock.acquire().await.unwrap()),
                    }
                };
                // Some acquires are cancelled from outside at a random point.
                let cancel_after = if rng.below(4) == 0 {
                    rng.millis(40)
                } else {
                    Duration::from_secs(20)
                };
                let guard = match tokio::time::timeout(cancel_after, attempt).await {
                    Ok(Some(guard)) => guard,
                    Ok(None) => continue,
                    Err(_) if cancel_after < Duration::from_secs(20) => continue,
                    Err(_) => {
                        findings.add(format!(
                            "task {task} step {step}: an acquire waited 20 s (stuck)"
                        ));
                        return;
                    }
                };
                granted.fetch_add(1, Ordering::Relaxed);
                let before = holders.fetch_add(1, Ordering::SeqCst);
                if before != 0 {
                    findings.add(format!(
                        "task {task} step {step}: granted while {before} other guard(s) of this Locks hold"
                    ));
                }
                if rng.below(3) == 0 {
                    // Past any late release (delays up to 30 ms) of an earlier hold of this owner id.
                    tokio::time::sleep(Duration::from_millis(35)).await;
                    check_held(&guard, &elsewhere, &findings, &format!("task {task} step {step}"))
                        .await;
                } else {
                    tokio::time::sleep(rng.millis(5)).await;
                }
                if guard.state() != LockState::Held {
                    findings.add(format!(
                        "task {task} step {step}: a guard not Held ({:?}, {:?})",
                        guard.state(),
                        guard.loss_reason()
                    ));
                }
                holders.fetch_sub(1, Ordering::SeqCst);
                // The next release reaches the store late or replies late (passing the gate on early).
                match rng.below(4) {
                    0 => backend.delay_releases([rng.millis(30)]),
                    1 => backend.delay_release_replies([rng.millis(30)]),
                    _ => {}
                }
                match rng.below(3) {
                    0 => drop(guard),
                    1 => {
                        // Polled once (passing the gate on early if it did not finish), then
                        // cancelled (restarted in the background) or awaited.
                        let mut release = Box::pin(guard.release());
                        if poll_once(&mut release).await.is_none() {
                            if rng.below(2) == 0 {
                                drop(release);
                            } else {
                                let _ = release.await;
                            }
                        }
                    }
                    _ => {
                        let _ = guard.release().await;
                    }
                }
            }
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .unwrap_or_else(|_| panic!("task {i} stuck"))
            .unwrap();
    }
    // Nothing left held: the gate and the store are free for a newcomer.
    locks.close().await;
    let newcomer =
        tokio::time::timeout(Duration::from_secs(5), locks.lock(name).unwrap().acquire())
            .await
            .expect("the gate is stuck after the storm")
            .unwrap();
    newcomer.release().await.unwrap();
    assert!(store_free_within(&locks, name, Duration::from_secs(2)).await);
    assert!(
        granted.load(Ordering::Relaxed) > 50,
        "too few grants to mean anything"
    );
    findings.assert_none();
}

/// Guarantee (3)/(5) at the gate itself: a holder with waiters queued, some of them dropped at random
/// (queued, or after the gate or a handed grant reached them unread), the hold released; repeated so
/// the queue is made and freed many times, on a multi-thread runtime. Every waiter not dropped is
/// granted (in queue order), no dropped waiter holds anything, and the name ends free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_queue_made_and_freed_loses_no_waiter() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let mut rng = Rng::new(3);
    for round in 0..300u32 {
        if round == 150 {
            backend.enable_hand_off();
        }
        let name = format!("queue-{}", round % 7);
        let holder = locks.lock(&name).unwrap().acquire().await.unwrap();
        let waiters: Vec<_> = (0..1 + rng.below(5))
            .map(|_| locks.lock(&name).unwrap())
            .collect();
        let mut pending: Vec<_> = waiters.iter().map(|w| Box::pin(w.acquire())).collect();
        for p in &mut pending {
            assert!(poll_once(p).await.is_none(), "queued behind the holder");
        }
        // Some are dropped while queued.
        let mut kept = Vec::new();
        for (i, p) in pending.into_iter().enumerate() {
            if rng.below(3) == 0 {
                drop(p);
            } else {
                kept.push((i, p));
            }
        }
        if rng.below(2) == 0 {
            backend.delay_release_replies([rng.millis(20)]);
        }
        holder.release().await.unwrap();
        // The front one may now have its pass (or a handed grant) unread; sometimes it is dropped.
        if !kept.is_empty() && rng.below(3) == 0 {
            drop(kept.remove(0));
        }
        let mut order = Vec::new();
        for (i, p) in kept {
            let guard = tokio::time::timeout(Duration::from_secs(5), p)
                .await
                .unwrap_or_else(|_| panic!("round {round}: waiter {i} never woken"))
                .unwrap();
            order.push(i);
            assert_eq!(guard.state(), LockState::Held);
            guard.release().await.unwrap();
        }
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(order, sorted, "round {round}: not in queue order");
        // A fresh waiter gets the gate at once, and nothing is held on the store.
        let fresh =
            tokio::time::timeout(Duration::from_secs(5), locks.lock(&name).unwrap().acquire())
                .await
                .unwrap_or_else(|_| panic!("round {round}: the gate is stuck"))
                .unwrap();
        fresh.release().await.unwrap();
        assert!(
            store_free_within(&elsewhere, &name, Duration::from_secs(2)).await,
            "round {round}: a dropped waiter's grant was left held"
        );
    }
}

/// A `Locks` with many names, releases of each passing the gate on early and arriving late: every
/// name's exclusion holds (the gate's count of releases in flight is per name; the `releasing` map is
/// shared by all names).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn review_many_names_early_releases() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Arc::new(Locks::new(backend.another_client()));
    let findings = Findings::default();
    const NAMES: usize = 40;
    let holders: Arc<Vec<AtomicUsize>> =
        Arc::new((0..NAMES).map(|_| AtomicUsize::new(0)).collect());
    let mut tasks = Vec::new();
    for task in 0..24u64 {
        let (locks, backend, elsewhere, findings, holders) = (
            locks.clone(),
            backend.clone(),
            elsewhere.clone(),
            findings.clone(),
            holders.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(500 + task);
            // Each task keeps one `Lock` per name with a per-task owner id, reused across holds.
            let mine: Vec<_> = (0..NAMES)
                .map(|n| {
                    locks
                        .lock_as(&format!("many-{n}"), format!("t{task}"))
                        .unwrap()
                })
                .collect();
            for step in 0..60u32 {
                let n = rng.below(NAMES as u64) as usize;
                let guard =
                    match tokio::time::timeout(Duration::from_secs(20), mine[n].acquire()).await {
                        Ok(guard) => guard.unwrap(),
                        Err(_) => {
                            findings.add(format!("task {task} step {step}: stuck on name {n}"));
                            return;
                        }
                    };
                let before = holders[n].fetch_add(1, Ordering::SeqCst);
                if before != 0 {
                    findings.add(format!("task {task}: name {n} granted while held locally"));
                }
                if rng.below(4) == 0 {
                    check_held(
                        &guard,
                        &elsewhere,
                        &findings,
                        &format!("task {task} name {n}"),
                    )
                    .await;
                }
                holders[n].fetch_sub(1, Ordering::SeqCst);
                match rng.below(3) {
                    0 => backend.delay_releases([rng.millis(25)]),
                    1 => backend.delay_release_replies([rng.millis(25)]),
                    _ => {}
                }
                if rng.below(2) == 0 {
                    drop(guard);
                } else {
                    let _ = guard.release().await;
                }
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("a task stuck")
            .unwrap();
    }
    locks.close().await;
    for n in 0..NAMES {
        assert!(
            store_free_within(&locks, &format!("many-{n}"), Duration::from_secs(2)).await,
            "name {n} left held"
        );
    }
    findings.assert_none();
}

/// Guarantee (1) across runtimes: a hold acquired on one runtime, its guard dropped on a plain thread
/// or on that runtime which is then dropped while the release (passed on early) is still in flight;
/// the same owner acquires again on a second runtime. It must wait for the release (restarted on
/// distlock's background runtime), be granted, and its grant survive the late release.
#[test]
fn review_release_in_flight_across_runtimes() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let findings = Findings::default();
    for round in 0..18u32 {
        let name = format!("rt-{}", round % 2);
        let lock = locks.lock_as(&name, format!("rt-owner-{round}")).unwrap();
        let first = if round % 2 == 0 {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap()
        } else {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let guard = first.block_on(lock.acquire()).unwrap();
        let token = guard.token();
        let late = Duration::from_millis(150);
        backend.delay_releases([late]);
        backend.delay_release_replies([Duration::from_millis(50)]);
        match round % 3 {
            // Dropped on a plain thread, no runtime.
            0 => std::thread::spawn(move || drop(guard)).join().unwrap(),
            // Dropped on the first runtime, which is dropped right after.
            1 => first.block_on(async move {
                drop(guard);
                tokio::task::yield_now().await;
            }),
            // Its release polled once on the first runtime (passing the gate on), then cancelled.
            _ => first.block_on(async move {
                let mut release = Box::pin(guard.release());
                assert!(poll_once(&mut release).await.is_none());
                drop(release);
            }),
        }
        drop(first);
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            let again = tokio::time::timeout(Duration::from_secs(10), lock.acquire())
                .await
                .expect("the same owner's acquire is stuck")
                .unwrap();
            if again.token() <= token {
                findings.add(format!("round {round}: token not increased"));
            }
            tokio::time::sleep(late + Duration::from_millis(100)).await;
            check_held(&again, &elsewhere, &findings, &format!("round {round}")).await;
            again.release().await.ok();
            locks.close().await;
        });
    }
    findings.assert_none();
}

/// Guarantee (4): reentrant guards of one `Lock` share one hold and its token; ending one of them
/// does not release (the other stays Held on the store); the last one's release passes the gate on
/// early and reaches the store late, and the owner's next acquire (a new hold) is not overtaken by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_reentrancy_with_early_release() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let findings = Findings::default();
    let lock = locks.lock("reenter").unwrap();
    for round in 0..20u32 {
        let a = lock.acquire().await.unwrap();
        let b = lock.acquire().await.unwrap();
        assert_eq!(a.token(), b.token(), "reentrant guards share the hold");
        if round % 2 == 0 {
            a.release().await.unwrap();
        } else {
            drop(a);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        check_held(
            &b,
            &elsewhere,
            &findings,
            &format!("round {round}: b after a"),
        )
        .await;
        let c = lock.acquire().await.unwrap();
        assert_eq!(c.token(), b.token());
        drop(b);
        // c is the last guard: its release passes the gate on early and arrives late.
        backend.delay_releases([Duration::from_millis(40)]);
        drop(c);
        let d = tokio::time::timeout(Duration::from_secs(5), lock.acquire())
            .await
            .expect("stuck")
            .unwrap();
        tokio::time::sleep(Duration::from_millis(80)).await;
        check_held(&d, &elsewhere, &findings, &format!("round {round}: d")).await;
        d.release().await.unwrap();
    }
    findings.assert_none();
}

/// Guarantee (3) on the new wait: an owner's acquire that has the gate and waits for its own release's
/// reply (the release's mark) gives up at its wait limit without taking the lock, passes the gate on to
/// the other owner queued behind it (not stuck behind the reply), and is granted after the reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_wait_for_the_own_release_gives_up_and_passes_the_gate_on() {
    let backend = MemoryBackend::new();
    let locks = Locks::new(backend.clone());
    let elsewhere = Locks::new(backend.another_client());
    let findings = Findings::default();
    let mut rounds_that_showed = 0;
    for round in 0..10u32 {
        let name = format!("give-up-{round}");
        let x = locks.lock(&name).unwrap();
        let z = locks.lock(&name).unwrap();
        let held = x.acquire().await.unwrap();
        // The reply's delay is far past X's wait, so that a loaded machine (CI's) cannot blur the two.
        let reply = Duration::from_millis(1000);
        let x_gives_up_after = Duration::from_millis(250);
        backend.delay_release_replies([reply]);
        let started = tokio::time::Instant::now();
        drop(held);
        while x.is_held() {
            tokio::task::yield_now().await;
        }
        // X takes the gate (passed on early) and waits for its release's reply; Z queues behind it.
        let x_started = tokio::time::Instant::now();
        // `acquire` with a wait limit: `try_acquire` ignores the limit (one attempt, zero wait), so X
        // would give up at its first poll whenever that came a timer tick after it began (under load).
        let mut x_wait = Box::pin(x.options().wait(x_gives_up_after).acquire());
        let _ = poll_once(&mut x_wait).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut z_wait = Box::pin(z.acquire());
        if let Some(z_early) = poll_once(&mut z_wait).await {
            // Only a machine too slow to poll Z within X's wait may see Z granted here: X had given
            // up already, so the round shows nothing; anything sooner is Z not queued behind X.
            assert!(x_started.elapsed() >= x_gives_up_after, "Z queued behind X");
            z_early.unwrap().release().await.unwrap();
            continue;
        }
        rounds_that_showed += 1;
        if round % 2 == 0 {
            let gave_up = x_wait.await;
            assert!(
                gave_up
                    .as_ref()
                    .is_err_and(|e| e.kind() == ErrorKind::Timeout),
                "X was granted before its release's reply: {:?}",
                gave_up.map(|g| g.token())
            );
        } else {
            // Cancelled instead.
            drop(x_wait);
        }
        let z_guard = tokio::time::timeout(Duration::from_secs(5), z_wait)
            .await
            .expect("Z is stuck behind X's given-up wait")
            .unwrap();
        if started.elapsed() >= reply {
            findings.add(format!(
                "round {round}: Z waited for X's release reply ({:?})",
                started.elapsed()
            ));
        }
        check_held(
            &z_guard,
            &elsewhere,
            &findings,
            &format!("round {round}: Z"),
        )
        .await;
        assert!(!x.is_held(), "X holds after it gave up");
        z_guard.release().await.unwrap();
        let x_guard = tokio::time::timeout(Duration::from_secs(5), x.acquire())
            .await
            .expect("X is stuck")
            .unwrap();
        check_held(
            &x_guard,
            &elsewhere,
            &findings,
            &format!("round {round}: X"),
        )
        .await;
        x_guard.release().await.unwrap();
    }
    assert!(rounds_that_showed > 0, "no round polled Z within X's wait");
    locks.close().await;
    findings.assert_none();
}
