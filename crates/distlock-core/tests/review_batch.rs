//! Review of 5c8ed21 (a renewal batch's time limit is each hold's own). Attacks on the memory backend:
//! `delay_renewals` holds replies back (the store applied the renewal at once), `cap_ttl` grants short,
//! `freeze` cuts the client off, `another_client` is a second client on the same store.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{b_takes_it_only_when_not_held, two_clients, until_renewal_requests};
use distlock_core::{LockGuard, LockState, Locks};
use tokio::time::Instant;

async fn until_not_held(guard: &LockGuard, within: Duration) {
    tokio::time::timeout(within, async {
        while guard.state() == LockState::Held {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("the guard never left Held");
}

/// A hold `x` (lease 3 s) and a hold `y` (lease 6 s, granted 0.5 s before) share the first renewal
/// batch (`y` rides along), with limits of about 1.05 s and 2.3 s: `x` times out first while the
/// call goes on for `y`.
async fn x_and_y(a: &Locks, tag: &str) -> (LockGuard, LockGuard) {
    let y = a.lock(&format!("{tag}-y")).unwrap();
    let y = y
        .options()
        .lease(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let x = a.lock(&format!("{tag}-x")).unwrap();
    let x = x
        .options()
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    (x, y)
}

/// Attack: a hold times out in a batch whose call goes on (for `y`); its owner then calls
/// `extend(1s)` (answered at once) and the client is cut off. The batch's late reply (granting 3 s,
/// sent before the extend) must not make the guard trust more than the 1 s the store applied last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_late_reply_after_a_timed_out_hold_extends_is_ignored() {
    let (a_backend, a, b) = two_clients();
    let (x, y) = x_and_y(&a, "late-reply").await;
    // The batch's reply comes 1.5 s late: after x's limit (~1.05 s), before y's (~2.3 s).
    a_backend.delay_renewals([Duration::from_millis(1_500)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    let sent = Instant::now();
    until_not_held(&x, Duration::from_secs(3)).await;
    assert!(
        sent.elapsed() < Duration::from_millis(1_400),
        "x timed out at the reply, not its limit"
    );
    x.extend(Duration::from_secs(1)).await.unwrap();
    a_backend.freeze();
    // The late reply arrives about 0.5 s later; the store drops x about 1 s after the extend.
    assert!(
        b_takes_it_only_when_not_held(&x, &b, Duration::from_secs(3)).await,
        "the store never dropped x"
    );
    drop(y);
}

/// Attack: x times out in a batch whose call goes on (for y); x's retry is granted only 2.1 s (the
/// store applies it after the batch's 6 s). The batch's late reply (6 s) must not outlive the retry's
/// deadline in the guard: after a cut, the guard is not `Held` once the store dropped x, and its
/// deadline is not past that drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_late_reply_does_not_override_a_shorter_retry() {
    // A round proves something only if the cut came between x's capped retry and the late reply, and
    // the store dropped x after that reply but before the deadline the reply would give x. A loaded
    // machine may miss that window: such a round still runs the oracle, and another is run.
    let mut conclusive = false;
    for round in 0..3 {
        if shorter_retry_round(round).await {
            conclusive = true;
            break;
        }
    }
    assert!(
        conclusive,
        "in no round did the late reply come between the cut and the store's drop of x"
    );
}

/// One round of the shorter-retry case; returns whether its timing made it a test of the case.
async fn shorter_retry_round(round: u32) -> bool {
    let (a_backend, a, b) = two_clients();
    // x (lease 6 s) and y (lease 18 s, granted 1.6 s before) share x's first batch (x is due 2 s after
    // its grant, y 4.4 s: within half y's 6 s period). Limits: x ~2.1 s, y ~7.3 s after the batch.
    let y = a
        .lock(&format!("shorter-retry{round}-y"))
        .unwrap()
        .options()
        .lease(Duration::from_secs(18))
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let x = a
        .lock(&format!("shorter-retry{round}-x"))
        .unwrap()
        .options()
        .lease(Duration::from_secs(6))
        .acquire()
        .await
        .unwrap();
    // The batch's reply comes 3.6 s late: after x's limit and its retry (~2.6 s), before y's limit.
    a_backend.delay_renewals([Duration::from_millis(3_600)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(5)).await;
    let sent = Instant::now();
    // The reply moves y's deadline ~3.3 s later: whether it has come is read from there.
    let y_before = y.validity_deadline().unwrap();
    let reply_applied = || {
        y.validity_deadline()
            .is_some_and(|d| d > y_before + Duration::from_millis(1_000))
    };
    // The store applied the batch (6 s for x) in the step that counted it; the next request to reach
    // it is x's retry, granted 2.1 s (renewed every 0.7 s: the store drops x 1.4 to 2.1 s after the
    // cut).
    tokio::time::sleep(Duration::from_millis(50)).await;
    a_backend.cap_ttl(Some(Duration::from_millis(2_100)));
    until_not_held(&x, Duration::from_secs(5)).await;
    until_renewal_requests(&a_backend, 2, Duration::from_secs(5)).await;
    tokio::time::timeout(Duration::from_secs(5), async {
        while x.state() != LockState::Held {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("x's retry was not answered");
    // Cut at 2.8 s: the store drops x at 4.2 s at the earliest, after the reply (3.6 s).
    tokio::time::sleep_until(sent + Duration::from_millis(2_800)).await;
    a_backend.freeze();
    let cut_before_reply = !reply_applied();
    assert!(
        b_takes_it_only_when_not_held(&x, &b, Duration::from_secs(5)).await,
        "the store never dropped x"
    );
    let taken_at = std::time::Instant::now();
    // Not `Held` is not enough: the late reply's deadline, if applied, shows as Jeopardy (x's renewals
    // fail after the cut) while the guard still trusts the key 1.2 s past the store's drop.
    // (A deadline already passed reads as now.)
    let left = x
        .validity_deadline()
        .unwrap()
        .saturating_duration_since(std::time::Instant::now());
    assert!(
        left < Duration::from_millis(1),
        "x trusts its key {left:?} past the store's drop ({:?})",
        x.state()
    );
    // y's outcome is applied before x's, in one pass: seen now, x's was applied before b took x.
    let reply_before_take = reply_applied();
    let y_after = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if reply_applied() {
                break y.validity_deadline();
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .ok()
    .flatten();
    drop(y);
    // y's new deadline is the batch's `sent_at + 18 s × 0.99 − 2 ms`; the late reply would give x
    // `sent_at + 6 s × 0.99 − 2 ms`: b must have taken x before that to show the reply ignored.
    let before_x_late_deadline =
        y_after.is_some_and(|y_after| taken_at < y_after - Duration::from_millis(11_880));
    cut_before_reply && reply_before_take && before_x_late_deadline
}

/// Attack: x times out in a batch whose call goes on (for y); x's owner calls `extend(1s)`, whose reply
/// is slow (the store applied it: x's key now lives 1 s from the extend). The batch's late reply (3 s)
/// arrives while the extend is in flight. The documented invariant (`renewal_sent`): while a request
/// is in flight the deadline is at most the one it would set, here the extend's 1 s. Only the rule
/// that a reply after its hold's limit counts only if it is `Gone` keeps it: the ordering by `sent_at`
/// does not (nothing after the batch is confirmed), and applying the late reply would also clear
/// `renewing` under the extend, letting a second renewal of x go out (checked by mutating that rule:
/// this test then fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_late_reply_during_an_unconfirmed_extend_is_ignored() {
    let (a_backend, a, _b) = two_clients();
    let (x, y) = x_and_y(&a, "during-extend").await;
    // The batch's reply 1.3 s late (x's limit is ~1.05 s); the extend's 3 s late.
    a_backend.delay_renewals([Duration::from_millis(1_300), Duration::from_secs(3)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    let sent = Instant::now();
    until_not_held(&x, Duration::from_secs(3)).await;
    let extend_sent = std::time::Instant::now();
    let watch = async {
        // Until the extend gives up (half the 1 s left), past the batch's late reply (~1.3 s).
        while std::time::Instant::now() < extend_sent + Duration::from_millis(480) {
            let deadline = x.validity_deadline().unwrap();
            assert!(
                deadline <= extend_sent + Duration::from_secs(1),
                "x trusts {:?} past the extend's 1 s ({:?} after the batch went out)",
                deadline - (extend_sent + Duration::from_secs(1)),
                sent.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let (extended, ()) = tokio::join!(x.extend(Duration::from_secs(1)), watch);
    assert!(extended.is_err(), "the extend's reply was meant to be slow");
    assert!(
        sent.elapsed() > Duration::from_millis(1_350),
        "the batch's reply did not come during the extend"
    );
    drop(y);
}

/// Attack: y's key is deleted on the store before the batch goes out (an operator's delete: the same
/// owner id on another client, then a release), the batch's reply is late past y's own limit, and the
/// retries' replies are later still. The batch's late `Gone` must still make y Lost at once, not at
/// its deadline (the loss must not be reported later than the reply that proves it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_late_gone_after_a_holds_limit_reports_the_loss_at_once() {
    let (a_backend, a, b) = two_clients();
    // x (limit ~1.05 s, deadline ~2.1 s after the batch goes out) is the one whose key goes.
    let (x, y) = x_and_y(&a, "late-gone").await;
    let taken = b
        .lock_as(x.name(), x.owner())
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("same owner: refreshed");
    taken.release().await.unwrap();
    // The batch's reply 1.6 s late (after x's limit, ~0.5 s before x's deadline); its retries 10 s.
    a_backend.delay_renewals([
        Duration::from_millis(1_600),
        Duration::from_secs(10),
        Duration::from_secs(10),
        Duration::from_secs(10),
    ]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    let sent = Instant::now();
    let deadline = x.validity_deadline().unwrap();
    tokio::time::timeout(Duration::from_secs(4), x.lost())
        .await
        .expect("x never Lost");
    let lost_at = std::time::Instant::now();
    assert!(
        lost_at + Duration::from_millis(200) < deadline,
        "x Lost {:?} after the batch went out, at its deadline: the late Gone was not applied ({:?})",
        sent.elapsed(),
        x.loss_reason()
    );
    assert_eq!(y.state(), LockState::Held, "{:?}", y.loss_reason());
}

/// Attack: a late `Gone` (for x's old hold: its key deleted before the batch went out) arrives after
/// x timed out, was released, and the same `Lock` acquired the name again. It must not touch the new
/// hold (the same name and owner id, another `Holding`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_late_gone_does_not_reach_the_next_hold_of_the_same_lock() {
    // A round proves something only if the new hold was granted before the late reply came, which a
    // loaded machine may miss: such a round still checks both holds, and another is run.
    let mut conclusive = false;
    for round in 0..3 {
        if late_gone_round(round).await {
            conclusive = true;
            break;
        }
    }
    assert!(
        conclusive,
        "in no round was the next hold granted before the late Gone came"
    );
}

/// One round of the late-`Gone` case; returns whether the new hold was granted before the late reply
/// was applied.
async fn late_gone_round(round: u32) -> bool {
    let (a_backend, a, b) = two_clients();
    // y (lease 9 s, granted 0.8 s before x) rides along in x's first batch (x's renewal is due 1 s
    // after its grant, y's 2.2 s: within half y's 3 s period) with a limit of about 3.6 s; x's limit
    // is about 1.05 s. The reply comes between the two, 1.5 s after x's.
    let y = a.lock(&format!("regone{round}-y")).unwrap();
    let y = y
        .options()
        .lease(Duration::from_secs(9))
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let x_lock = a.lock(&format!("regone{round}-x")).unwrap();
    let x = x_lock
        .options()
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    let taken = b
        .lock_as(x.name(), x.owner())
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("same owner: refreshed");
    taken.release().await.unwrap();
    // The batch's reply (x: Gone, y: extended) comes 2.6 s late.
    a_backend.delay_renewals([Duration::from_millis(2_600)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    // The reply moves y's deadline ~1.7 s later: whether it has come is read from there.
    let y_before = y.validity_deadline().unwrap();
    let reply_applied = || {
        y.validity_deadline()
            .is_some_and(|d| d > y_before + Duration::from_millis(500))
    };
    until_not_held(&x, Duration::from_secs(3)).await;
    // The retry (answered at once) may find the key gone first: either way the old hold ends here.
    let _ = x.release().await;
    let again = x_lock
        .options()
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .unwrap();
    // y's outcome is applied before x's, in one pass: y's deadline unmoved now, x's Gone comes later.
    let conclusive = !reply_applied();
    tokio::time::timeout(Duration::from_secs(5), async {
        while !reply_applied() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the batch's late reply never reached y");
    // x's outcome follows y's in the same pass.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(again.state(), LockState::Held, "{:?}", again.loss_reason());
    assert_eq!(y.state(), LockState::Held, "{:?}", y.loss_reason());
    conclusive
}

/// Attack: the batch's reply stalls far past every limit, and the client is cut off right after the
/// batch went out, so every retry fails: neither hold may be `Held` once the store dropped its key, and
/// each goes `Lost` by its own deadline (`lost()` fires on time although the batch task still waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_stalled_batch_and_a_cut_never_leave_a_hold_held() {
    let (a_backend, a, b) = two_clients();
    let (x, y) = x_and_y(&a, "stalled-cut").await;
    a_backend.delay_renewals([Duration::from_secs(60)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    a_backend.freeze();
    let (x_dropped, y_dropped, (), ()) = tokio::join!(
        b_takes_it_only_when_not_held(&x, &b, Duration::from_secs(8)),
        b_takes_it_only_when_not_held(&y, &b, Duration::from_secs(8)),
        lost_on_time(&x),
        lost_on_time(&y),
    );
    assert!(
        x_dropped && y_dropped,
        "the store kept a key of a frozen client"
    );
}

/// `lost()` fires by the deadline (it can only move earlier here: the client is cut off).
async fn lost_on_time(guard: &LockGuard) {
    let deadline = guard.validity_deadline().unwrap();
    tokio::time::timeout(Duration::from_secs(8), guard.lost())
        .await
        .expect("lost() did not fire");
    let late = std::time::Instant::now().saturating_duration_since(deadline);
    assert!(
        late < Duration::from_millis(100),
        "{}: lost() {late:?} after the deadline",
        guard.name()
    );
}

/// Probe of `Unanswered::drop`: the runtime that runs the watchdog (and so the batch) is dropped after
/// x's renewal timed out (and was maybe retried) but while y's is still waiting. y's must count as
/// abandoned, so the watchdog restarted on the other runtime renews it; x's must not be touched twice.
/// Both stay held on the store and end `Held`.
#[test]
fn review_a_runtime_dropped_after_some_holds_timed_out_leaves_every_hold_renewed() {
    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (a_backend, a, b) = two_clients();
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // The watchdog starts on `first` with this hold's acquire.
    let starter = first.block_on(async {
        a.lock("rt-starter")
            .unwrap()
            .options()
            .lease(Duration::from_secs(60))
            .acquire()
            .await
            .unwrap()
    });
    let (x, y) = second.block_on(x_and_y(&a, "rt"));
    // The batch's reply far later than any deadline; the retries are answered at once.
    a_backend.delay_renewals([Duration::from_secs(60)]);
    second.block_on(async {
        until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
        until_not_held(&x, Duration::from_secs(3)).await;
        // x's retry is answered at once: x is Held again, y still waits for the batch.
        tokio::time::timeout(Duration::from_secs(1), async {
            while x.state() != LockState::Held {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("x's retry was not answered");
        assert_eq!(y.state(), LockState::Held, "{:?}", y.loss_reason());
    });
    let x_deadline = x.validity_deadline();
    drop(first);
    // The batch was dropped: y's renewal is abandoned (Jeopardy until its retry), x's answered one is
    // left alone (its state and deadline are its retry's).
    assert_eq!(x.state(), LockState::Held, "{:?}", x.loss_reason());
    // (Read through the boot clock's conversion: equal within a few µs.)
    let moved = x_deadline
        .unwrap()
        .saturating_duration_since(x.validity_deadline().unwrap());
    assert!(
        moved < Duration::from_millis(1),
        "the dropped batch moved x's deadline {moved:?} earlier"
    );
    second.block_on(async {
        // x's deadline (from its grant, ~3 s) and y's (~5.9 s) pass meanwhile: renewed in time, both
        // are held on the store and end Held.
        tokio::time::sleep(Duration::from_secs(6)).await;
        for guard in [&x, &y] {
            assert_eq!(
                guard.state(),
                LockState::Held,
                "{}: {:?}",
                guard.name(),
                guard.loss_reason()
            );
            assert!(
                b.lock(guard.name())
                    .unwrap()
                    .try_acquire()
                    .await
                    .unwrap()
                    .is_none(),
                "{}: the store dropped the key",
                guard.name()
            );
        }
        drop((x, y));
    });
    drop(starter);
}

/// CPU cost: holds granted 10 ms apart share one batch (riding along), so their limits are 5 ms apart.
/// With a reply slower than every limit, the batch task wakes once per distinct limit, and each wake
/// pokes the watchdog, which scans every hold of the `Locks`: O(holds × distinct limits) per stalled
/// batch (10,000 holds granted over 0.4 s: up to ~200 wakes, each a full scan), where the batch-wide
/// limit woke once. Timing a hold out a little early is safe (Jeopardy and a retry sooner), so the
/// limits can be coalesced (say every limit within an eighth past the one that fired), which bounds the
/// wake-ups by a logarithm of the spread. Mechanism: the distinct moments at which holds left `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_timed_out_holds_of_one_batch_leave_held_in_few_wake_ups() {
    let (a_backend, a, _b) = two_clients();
    let lease = Duration::from_secs(3);
    let mut guards = Vec::new();
    for i in 0..25 {
        let lock = a.lock(&format!("spread-{i}")).unwrap();
        guards.push(lock.options().lease(lease).acquire().await.unwrap());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a_backend.delay_renewals([Duration::from_secs(10)]);
    until_renewal_requests(&a_backend, 1, Duration::from_secs(3)).await;
    assert_eq!(
        a_backend.renewal_requests(),
        1,
        "the holds did not share one batch"
    );
    let moments: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let guards = Arc::new(guards);
    let waiters: Vec<_> = (0..guards.len())
        .map(|i| {
            let (guards, moments) = (guards.clone(), moments.clone());
            tokio::spawn(async move {
                guards[i].jeopardy().await;
                moments.lock().unwrap().push(Instant::now());
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    for waiter in &waiters {
        waiter.abort();
    }
    let mut moments = moments.lock().unwrap().clone();
    assert!(
        moments.len() * 2 > guards.len(),
        "only {} of {} holds timed out",
        moments.len(),
        guards.len()
    );
    moments.sort();
    let wake_ups = 1 + moments
        .windows(2)
        .filter(|w| w[1] - w[0] > Duration::from_millis(2))
        .count();
    assert!(
        wake_ups <= 8,
        "the {} holds that timed out in one batch left Held at {wake_ups} distinct moments over \
         {:?}: one batch-task wake-up (and one full watchdog scan) per hold",
        moments.len(),
        moments[moments.len() - 1] - moments[0]
    );
}
