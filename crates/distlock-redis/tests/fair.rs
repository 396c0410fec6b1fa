//! Fair mode (`?fair=true`, issue 27) on a real `redis-server`: waiters of separate clients (as
//! separate processes are, to the server) are granted in the order the server queued them, in either
//! layout; a release wakes the queue's head on its own channel; a waiter that dies holds the queue up
//! for its liveness at most, one that is cancelled not at all; a try that does not wait leaves nothing.
//! Bounds are mechanism bounds (the liveness, the heartbeat, the lease) plus slack, never speed figures.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockGuard, Locks};
use distlock_redis::{layout, RedisBackend};
use distlock_testkit::holder::distlock_bin;
use distlock_testkit::redis::RedisServer;
use distlock_testkit::wake::release_wakes;

/// Slack for "soon" on a loaded 2-core machine, added to mechanism bounds.
const SLACK: Duration = Duration::from_secs(3);

fn unique(case: &str) -> String {
    format!("fair/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// A `Locks` on a backend of its own: to the server, another process.
async fn client(server: &RedisServer, query: &str) -> Locks {
    let url = LockUrl::parse(&format!("{}{query}", server.url())).expect("url");
    Locks::new(RedisBackend::connect(&url).await.expect("connect"))
}

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The queue as the server keeps it: the waiting owners, head first.
async fn queue(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> Vec<String> {
    redis::cmd("LRANGE")
        .arg(layout::queue_key(name))
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .unwrap()
}

/// A fair client's hold of `name`.
async fn hold(server: &RedisServer, name: &str) -> LockGuard {
    hold_as(server, name, "?fair=true").await
}

/// A hold of `name` by a client with the URL's `query`, with the default lease (30 s).
async fn hold_as(server: &RedisServer, name: &str, query: &str) -> LockGuard {
    client(server, query)
        .await
        .lock(name)
        .unwrap()
        .acquire()
        .await
        .unwrap()
}

/// Waits (at most `within`) for a waiting task's guard, and releases it.
async fn release_when_granted(waiter: tokio::task::JoinHandle<LockGuard>, within: Duration) {
    let guard = tokio::time::timeout(within, waiter)
        .await
        .expect("granted in time")
        .expect("the waiter's task");
    guard.release().await.unwrap();
}

/// Waits until the queue has `len` waiters.
async fn queued(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    len: usize,
) -> Vec<String> {
    let deadline = Instant::now() + SLACK;
    loop {
        let waiting = queue(conn, name).await;
        if waiting.len() == len {
            return waiting;
        }
        assert!(
            Instant::now() < deadline,
            "the queue of {name} has {waiting:?}, not {len} waiters"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waiters of separate clients queue one after another; each, once granted, records its number and
/// releases after a moment: the grants must follow the queue, and every waiter must be granted.
async fn granted_in_arrival_order(query: &str) {
    const WAITERS: usize = 5;
    let server = RedisServer::start_or_panic();
    let name = unique("order");
    let mut conn = raw(&server).await;
    let holder = client(&server, query).await;
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let locks = client(&server, query).await;
        let (lock, order) = (locks.lock(&name).unwrap(), order.clone());
        tasks.push(tokio::spawn(async move {
            let guard = lock.acquire().await.unwrap();
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(20)).await;
            guard.release().await.unwrap();
        }));
        // The next one starts once this one has its place.
        queued(&mut conn, &name, i + 1).await;
    }
    held.release().await.unwrap();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every waiter is granted")
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    assert!(queue(&mut conn, &name).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_separate_clients_are_granted_in_arrival_order() {
    granted_in_arrival_order("?fair=true").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_layout_queues_the_same_way() {
    granted_in_arrival_order("?fair=true&layout=plain").await;
}

/// The release publishes `0` on the head's own channel (a raw subscriber to it sees the message), the
/// head listens there, and it is granted; the waiter behind it gets nothing from that release. (That
/// the message, not a heartbeat, grants it is timed in
/// `a_newcomer_right_behind_a_woken_head_is_not_left_to_its_heartbeat_fault`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_head_on_its_own_channel() {
    let server = RedisServer::start_or_panic();
    let name = unique("wake");
    let mut conn = raw(&server).await;
    let held = hold(&server, &name).await;
    let first = client(&server, "?fair=true").await.lock(&name).unwrap();
    let second = client(&server, "?fair=true").await.lock(&name).unwrap();
    let first = tokio::spawn(async move { first.acquire().await.unwrap() });
    let heads = queued(&mut conn, &name, 1).await;
    let second = tokio::spawn(async move { second.acquire().await.unwrap() });
    let waiting = queued(&mut conn, &name, 2).await;
    assert_eq!(waiting[0], heads[0]);
    let mut listener = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    listener
        .subscribe(layout::waiter_channel(&name, &waiting[0]))
        .await
        .unwrap();
    listener
        .subscribe(layout::waiter_channel(&name, &waiting[1]))
        .await
        .unwrap();
    let subscribers: Vec<(String, usize)> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(layout::waiter_channel(&name, &waiting[0]))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(subscribers[0].1, 2, "the head listens on its own channel");
    held.release().await.unwrap();
    let mut messages = listener.on_message();
    let message = tokio::time::timeout(SLACK, futures_util::StreamExt::next(&mut messages))
        .await
        .expect("a message on a waiter's channel")
        .unwrap();
    assert_eq!(
        message.get_channel_name(),
        layout::waiter_channel(&name, &waiting[0]),
        "the release wakes the head, not the waiter behind it"
    );
    let guard = tokio::time::timeout(SLACK, first).await.unwrap().unwrap();
    assert_eq!(queued(&mut conn, &name, 1).await[0], waiting[1]);
    guard.release().await.unwrap();
    let guard = tokio::time::timeout(SLACK, second).await.unwrap().unwrap();
    guard.release().await.unwrap();
}

/// A `try_acquire` that finds the lock held leaves no place in the queue (it never waits), and a
/// wait that gives up (`--wait`) takes its place off at once: the queue is empty long before the
/// waiter's liveness would have dropped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_leaves_nothing_and_a_cancelled_wait_leaves_at_once() {
    let server = RedisServer::start_or_panic();
    let name = unique("cancel");
    let mut conn = raw(&server).await;
    let held = hold(&server, &name).await;
    let other = client(&server, "?fair=true").await;
    assert!(other
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let exists: i64 = redis::cmd("EXISTS")
        .arg(layout::queue_key(&name))
        .arg(layout::queue_timeout_key(&name))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "a try that does not wait joins no queue");
    // A wait cut short by its limit, and one whose future is dropped.
    let gave_up = other
        .lock(&name)
        .unwrap()
        .options()
        .wait(Duration::from_millis(400))
        .acquire()
        .await;
    assert_eq!(gave_up.err().map(|e| e.kind()), Some(ErrorKind::Timeout));
    let left = Instant::now();
    queued(&mut conn, &name, 0).await;
    let lock = other.lock(&name).unwrap();
    let dropped = tokio::spawn(async move { lock.acquire().await });
    queued(&mut conn, &name, 1).await;
    dropped.abort();
    queued(&mut conn, &name, 0).await;
    assert!(
        left.elapsed() < layout::FAIR_LIVENESS,
        "the places went with the waits, not with their liveness"
    );
    // A head that leaves while the lock is free hands the turn on at once.
    let third = client(&server, "?fair=true").await.lock(&name).unwrap();
    let head = other.lock(&name).unwrap();
    let head = tokio::spawn(async move { head.acquire().await });
    queued(&mut conn, &name, 1).await;
    let behind = tokio::spawn(async move { third.acquire().await.unwrap() });
    queued(&mut conn, &name, 2).await;
    held.release().await.unwrap();
    let first: LockGuard = tokio::time::timeout(SLACK, head)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    first.release().await.unwrap();
    release_when_granted(behind, SLACK).await;
}

/// A waiter whose process is SIGKILLed (a `distlock run --fair` waiting) cannot take its place off
/// the queue; at the release it is still the head, and the waiter behind it is granted once the dead
/// one's liveness ran out: within [`layout::FAIR_LIVENESS`] of the kill (plus slack), far inside the
/// holder's 30 s lease. `distlock status` counts the queue as waiters meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_waiter_holds_the_queue_up_for_its_liveness_at_most_fault() {
    let server = RedisServer::start_or_panic();
    let name = unique("killed");
    let mut conn = raw(&server).await;
    let holder = client(&server, "?fair=true").await;
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    let mut run = std::process::Command::new(distlock_bin().unwrap())
        .args(["run", "--fair", "--url", &server.url(), &name, "--", "true"])
        .env_remove("DISTLOCK_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn distlock run");
    let dead = queued(&mut conn, &name, 1).await;
    let behind = client(&server, "?fair=true").await;
    let info = behind.inspect(&name).await.unwrap();
    assert_eq!(info.waiters, Some(1), "status counts the queued waiter");
    let lock = behind.lock(&name).unwrap();
    let next = tokio::spawn(async move { lock.acquire().await.unwrap() });
    let waiting = queued(&mut conn, &name, 2).await;
    assert_eq!(waiting[0], dead[0]);
    run.kill().unwrap();
    let killed = Instant::now();
    run.wait().unwrap();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(layout::FAIR_LIVENESS + SLACK, next)
        .await
        .expect("the waiter behind a dead one is granted once its liveness ran out")
        .unwrap();
    assert!(killed.elapsed() < layout::FAIR_LIVENESS + SLACK);
    assert!(queue(&mut conn, &name).await.is_empty());
    guard.release().await.unwrap();
    // Nothing is left on the server: both keys expire with the last waiter's liveness.
    tokio::time::sleep(layout::FAIR_LIVENESS).await;
    let exists: i64 = redis::cmd("EXISTS")
        .arg(layout::queue_key(&name))
        .arg(layout::queue_timeout_key(&name))
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0);
}

/// A fair holder's release still publishes on the layout's release channel: a waiter that is not fair
/// (distlock without `fair=true`, as Redisson's) is woken by it, long before the holder's 30 s lease
/// would let it in; and a fair waiter behind a holder that is not fair takes the lock at its next try
/// (at most a heartbeat after the release, which publishes nothing to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_and_unfair_clients_exclude_each_other_and_wake_across() {
    let server = RedisServer::start_or_panic();
    let name = unique("mixed");
    let fair = client(&server, "?fair=true").await;
    let unfair = client(&server, "").await;
    let held = fair.lock(&name).unwrap().acquire().await.unwrap();
    assert!(unfair
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let next = release_wakes(
        held,
        unfair.lock(&name).unwrap(),
        Duration::from_secs(5),
        "the fair release publishes on redisson_lock__channel too",
    )
    .await;
    assert!(fair
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let again = release_wakes(
        next,
        fair.lock(&name).unwrap(),
        layout::FAIR_HEARTBEAT + SLACK,
        "the fair waiter's next try",
    )
    .await;
    again.release().await.unwrap();
}

/// A waiter cut off from the server (its proxy blackholes every byte) cannot keep its place: the
/// waiter behind it is granted once the cut one's liveness ran out, far inside the holder's 30 s
/// lease. The cut waiter's next try finds no reply within the request timeout, so its acquire ends
/// `Unavailable` (a wait whose server is gone fails; it is not retried for ever), and once the cut
/// heals nothing of it is left in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_waiter_holds_the_queue_up_for_its_liveness_at_most_fault() {
    use distlock_testkit::proxy::Proxy;
    let server = RedisServer::start_or_panic();
    let name = unique("cut");
    let mut conn = raw(&server).await;
    let held = hold(&server, &name).await;
    let proxy = Proxy::start_or_panic(server.addr());
    let url = LockUrl::parse(&format!("redis://{}?fair=true", proxy.addr())).unwrap();
    let cut = Locks::new(RedisBackend::connect(&url).await.expect("connect"))
        .lock(&name)
        .unwrap();
    let cut = tokio::spawn(async move { cut.acquire().await });
    queued(&mut conn, &name, 1).await;
    let behind = client(&server, "?fair=true").await.lock(&name).unwrap();
    let behind = tokio::spawn(async move { behind.acquire().await.unwrap() });
    queued(&mut conn, &name, 2).await;
    proxy.blackhole().unwrap();
    let cut_at = Instant::now();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(layout::FAIR_LIVENESS + SLACK, behind)
        .await
        .expect("the waiter behind a cut-off one is granted once its liveness ran out")
        .unwrap();
    assert!(cut_at.elapsed() < layout::FAIR_LIVENESS + SLACK);
    assert!(!cut.is_finished());
    let ended = tokio::time::timeout(Duration::from_secs(20), cut)
        .await
        .expect("the cut waiter's acquire ends")
        .unwrap();
    assert_eq!(ended.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
    proxy.pass().unwrap();
    guard.release().await.unwrap();
    queued(&mut conn, &name, 0).await;
}

/// `n` and `{n}` are two locks (two keys), so two queues: a waiter of `n` does not hold up `{n}`
/// (with Redisson's prefix rule both queues would be `distlock_lock_queue:{n}`: the holder of `n`
/// asking for the free `{n}` would wait behind the waiter of `n`, which waits for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_and_the_name_in_braces_have_queues_of_their_own() {
    let server = RedisServer::start_or_panic();
    let bare = unique("braces");
    let braced = format!("{{{bare}}}");
    let mut conn = raw(&server).await;
    let a = client(&server, "?fair=true").await;
    let held = a.lock(&bare).unwrap().acquire().await.unwrap();
    let lock = client(&server, "?fair=true").await.lock(&bare).unwrap();
    let waiter = tokio::spawn(async move { lock.acquire().await.unwrap() });
    queued(&mut conn, &bare, 1).await;
    assert!(queue(&mut conn, &braced).await.is_empty());
    let other = a
        .lock(&braced)
        .unwrap()
        .options()
        .wait(Duration::from_secs(4))
        .acquire()
        .await
        .expect("the free {n} is granted while a waiter of n queues");
    other.release().await.unwrap();
    held.release().await.unwrap();
    release_when_granted(waiter, SLACK).await;
}

/// The fair scripts' calls, for driving a fair client by hand with exact timing.
fn fair_acquire(name: &str, owner: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(layout::FAIR_ACQUIRE)
        .arg(4)
        .arg(layout::lock_key(name))
        .arg(layout::token_key(name))
        .arg(layout::queue_key(name))
        .arg(layout::queue_timeout_key(name))
        .arg(30_000)
        .arg(owner)
        .arg("1")
        .arg(layout::FAIR_LIVENESS.as_millis() as u64);
    cmd
}

fn fair_release(name: &str, owner: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(layout::FAIR_RELEASE)
        .arg(3)
        .arg(layout::lock_key(name))
        .arg(layout::queue_key(name))
        .arg(layout::queue_timeout_key(name))
        .arg(owner)
        .arg("publish")
        .arg(layout::UNLOCK_MESSAGE)
        .arg(layout::channel(name))
        .arg(layout::waiter_channel_prefix(name));
    cmd
}

/// A newcomer (a fresh client, its pub/sub not connected yet) queues right behind a head that was
/// just woken to a free lock; the head takes it and releases at once, publishing to the newcomer
/// possibly before the newcomer's subscription is in place. The newcomer must not wait for its
/// heartbeat (0.6–1.2 s): a waiter right behind the head tries again once subscribed. (Review: it
/// skipped that try, and waited for its heartbeat in about half of the rounds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_right_behind_a_woken_head_is_not_left_to_its_heartbeat_fault() {
    let server = RedisServer::start_or_panic();
    let mut conn = raw(&server).await;
    for round in 0..10 {
        let name = unique("newcomer");
        let granted: Vec<i64> = fair_acquire(&name, "H")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(granted[0], 1);
        let busy: Vec<i64> = fair_acquire(&name, "A")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(busy[..2], [0, 0], "A heads the queue");
        let _: i64 = fair_release(&name, "H")
            .query_async(&mut conn)
            .await
            .unwrap();
        let newcomer = client(&server, "?fair=true").await.lock(&name).unwrap();
        let waiter = tokio::spawn(async move {
            let guard = newcomer.acquire().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        queued(&mut conn, &name, 2).await;
        let granted: Vec<i64> = fair_acquire(&name, "A")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(granted[0], 1);
        let _: i64 = fair_release(&name, "A")
            .query_async(&mut conn)
            .await
            .unwrap();
        let released = Instant::now();
        let at = tokio::time::timeout(SLACK, waiter).await.unwrap().unwrap();
        let took = at.saturating_duration_since(released);
        assert!(
            took < layout::FAIR_HEARTBEAT / 2,
            "round {round}: the newcomer was granted {took:?} after the release: by its heartbeat, not the release"
        );
    }
}

/// The deadline of `owner`'s place in the queue: each of its tries refreshes it.
async fn deadline(conn: &mut redis::aio::MultiplexedConnection, name: &str, owner: &str) -> f64 {
    redis::cmd("ZSCORE")
        .arg(layout::queue_timeout_key(name))
        .arg(owner)
        .query_async::<Option<f64>>(conn)
        .await
        .unwrap()
        .expect("the waiter has a deadline")
}

/// An operator's break of the holder (`distlock break`, from a client without `fair=true`: the
/// script finds the queue whatever the operator's own mode and layout) wakes the queue's head on its
/// own channel, as a fair release does. The broken holder has the default 30 s lease, and the break
/// lands right after one of the head's heartbeat tries (its deadline just refreshed), so the head's
/// next try of its own is 0.6–1.2 s away: granted within a third of the heartbeat, it was woken by the
/// break. The waiter behind it keeps its place. In either layout (the plain one with a `poll` longer
/// than the heartbeat, so that its polling cannot grant it either), a few rounds each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_of_the_holder_wakes_the_queues_head() {
    let server = RedisServer::start_or_panic();
    let mut conn = raw(&server).await;
    let operator = client(&server, "").await;
    let queries = ["?fair=true", "?fair=true&layout=plain&poll=10s"];
    for (round, query) in queries.into_iter().cycle().take(6).enumerate() {
        let name = unique("break");
        let held = hold_as(&server, &name, query).await;
        let head = client(&server, query).await.lock(&name).unwrap();
        let head = tokio::spawn(async move {
            let guard = head.acquire().await.unwrap();
            (Instant::now(), guard)
        });
        queued(&mut conn, &name, 1).await;
        let behind = client(&server, query).await.lock(&name).unwrap();
        let behind = tokio::spawn(async move { behind.acquire().await.unwrap() });
        let waiting = queued(&mut conn, &name, 2).await;
        let shown = operator.inspect(&name).await.unwrap().holder.expect("held");
        assert_eq!(shown.owner.as_deref(), Some(held.owner()));
        assert!(shown
            .remaining_lease
            .is_some_and(|l| l > Duration::from_secs(20)));
        // Right after a heartbeat try of the head's.
        let before = deadline(&mut conn, &name, &waiting[0]).await;
        let started = Instant::now();
        while deadline(&mut conn, &name, &waiting[0]).await == before {
            assert!(started.elapsed() < SLACK, "the head never tried again");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(operator.break_holder(&name, &shown).await.unwrap());
        let broken = Instant::now();
        let (at, guard) = tokio::time::timeout(SLACK, head)
            .await
            .expect("the head is granted after the break")
            .unwrap();
        let took = at.saturating_duration_since(broken);
        assert!(
            took < layout::FAIR_HEARTBEAT / 3,
            "round {round} ({query}): the head was granted {took:?} after the break: by its own next try, not woken by the break"
        );
        assert_eq!(
            queue(&mut conn, &name).await,
            vec![waiting[1].clone()],
            "the waiter behind the head keeps its place"
        );
        guard.release().await.unwrap();
        release_when_granted(behind, SLACK).await;
        drop(held);
    }
}

/// `distlock status` (a client without `fair=true`) still counts the fair queue as waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_without_fair_counts_the_queue() {
    let server = RedisServer::start_or_panic();
    let name = unique("status");
    let mut conn = raw(&server).await;
    let fair = client(&server, "?fair=true").await;
    assert!(fair.capabilities().fifo);
    assert!(!client(&server, "").await.capabilities().fifo);
    let held = fair.lock(&name).unwrap().acquire().await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let lock = client(&server, "?fair=true").await.lock(&name).unwrap();
        waiters.push(tokio::spawn(async move { lock.acquire().await.unwrap() }));
    }
    queued(&mut conn, &name, 3).await;
    let info = client(&server, "").await.inspect(&name).await.unwrap();
    assert_eq!(info.waiters, Some(3));
    held.release().await.unwrap();
    for waiter in waiters {
        release_when_granted(waiter, Duration::from_secs(20)).await;
    }
}

/// `poll` still counts in fair mode on the plain layout: after a holder that publishes nothing
/// (redis-py's bare `DEL` release) the head takes the lock within its poll, not its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plain_layouts_poll_holds_in_fair_mode_fault() {
    let server = RedisServer::start_or_panic();
    let name = unique("poll");
    let mut conn = raw(&server).await;
    for _ in 0..3 {
        let _: () = redis::cmd("SET")
            .arg(&name)
            .arg("redis-py-token")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let lock = client(&server, "?layout=plain&poll=100ms&fair=true")
            .await
            .lock(&name)
            .unwrap();
        let waiter = tokio::spawn(async move {
            let guard = lock.acquire().await.unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        });
        queued(&mut conn, &name, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _: () = redis::cmd("DEL")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap();
        let freed = Instant::now();
        let took = tokio::time::timeout(SLACK, waiter)
            .await
            .unwrap()
            .unwrap()
            .saturating_duration_since(freed);
        assert!(
            took < layout::FAIR_HEARTBEAT / 2,
            "poll=100ms, yet the free lock waited {took:?}"
        );
    }
}

/// The queue's two keys mend themselves when one is lost alone (evicted under `maxmemory`, deleted by
/// hand): without the deadlines, waiters join again without doubling in the list, and a head without
/// a deadline is dropped; without the list, waiters join it again and wait on. Every waiter is
/// granted, and a later one gets the free lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_mends_itself_when_one_of_its_keys_is_lost() {
    let server = RedisServer::start_or_panic();
    let mut conn = raw(&server).await;
    for lost in [
        layout::queue_timeout_key as fn(&str) -> String,
        layout::queue_key,
    ] {
        let name = unique("lost");
        let held = hold(&server, &name).await;
        let mut waiters = Vec::new();
        for i in 0..2 {
            let lock = client(&server, "?fair=true").await.lock(&name).unwrap();
            waiters.push(tokio::spawn(async move {
                lock.acquire().await.unwrap().release().await.unwrap();
            }));
            queued(&mut conn, &name, i + 1).await;
        }
        let _: () = redis::cmd("DEL")
            .arg(lost(&name))
            .query_async(&mut conn)
            .await
            .unwrap();
        // Every waiter tries (and joins again) within a heartbeat.
        tokio::time::sleep(layout::FAIR_HEARTBEAT + Duration::from_millis(300)).await;
        assert_eq!(
            queue(&mut conn, &name).await.len(),
            2,
            "no waiter twice, none lost"
        );
        held.release().await.unwrap();
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("every waiter is granted")
                .unwrap();
        }
        let late = client(&server, "?fair=true")
            .await
            .lock(&name)
            .unwrap()
            .options()
            .wait(Duration::from_secs(5))
            .acquire()
            .await
            .expect("a later waiter gets the free lock");
        late.release().await.unwrap();
    }
}
