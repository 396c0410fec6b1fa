//! Redis Cluster: exclusion, tokens, a sharded pub/sub wake-up (SPUBLISH/SSUBSCRIBE) of a mutex, a
//! semaphore and a read-write lock, and renewals of locks, read holds and permits on several slots,
//! through `redis+cluster://`.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::raw::{AcquireRequest, Attempt, Backend};
use distlock_core::retry::RetryPolicy;
use distlock_core::url::{Endpoint, LockUrl};
use distlock_core::{ErrorKind, LockGuard, LockKind, LockState, Locks};
use distlock_redis::{layout, RedisBackend, RedisConfig};
use distlock_testkit::cluster::{key_slot, RedisCluster};
use distlock_testkit::redis::{RedisServer, RespValue};
use distlock_testkit::wake::release_wakes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_locks_wake_and_renew() {
    let cluster = RedisCluster::start_or_panic();
    let url = LockUrl::parse(&cluster.url()).unwrap();
    let a = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let b = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let base = uuid::Uuid::new_v4().simple().to_string();

    // Names on many slots, held past their lease: renewals per slot keep every one of them. (A 1 s lease
    // was lost under the full suite's load on 2 cores: a renewal must be confirmed within 2/3 of it.)
    let lease = Duration::from_secs(2);
    let mut guards = Vec::new();
    for i in 0..8 {
        let name = format!("cluster/{base}/{i}");
        guards.push(
            a.lock(&name)
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
    }
    // Read holds and permits too, in the same batches (each kind's renew script, per slot).
    for i in 0..4 {
        let read = a.read_write(&format!("cluster/{base}/read/{i}")).unwrap();
        guards.push(
            read.reader()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
        let semaphore = a
            .semaphore(&format!("cluster/{base}/permit/{i}"), 2)
            .unwrap();
        guards.push(
            semaphore
                .permit()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(lease * 2).await;
    for g in &guards {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
    }

    // A waiter on another client is woken by the sharded release message (the holder's lease is
    // 30 s, so only the message can wake it within the bound).
    let name = format!("cluster/{base}/wake");
    let first = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let lock_b = b.lock(&name).unwrap();
    assert!(lock_b.try_acquire().await.unwrap().is_none());
    let first_token = first.token().unwrap();
    let waiter = tokio::spawn(async move {
        let g = lock_b
            .options()
            .lease(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .expect("woken");
        let t = g.token().unwrap();
        g.release().await.unwrap();
        t
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke by the message, not by a lease")
        .unwrap();
    assert!(next > first_token);
    for g in guards {
        g.release().await.unwrap();
    }

    // A semaphore's waiter is woken by the sharded release message on `redisson_sc:{NAME}` (the
    // permit's lease is 30 s, so only the message can wake it within the bound).
    let name = format!("cluster/{base}/permit-wake");
    let permit = a
        .semaphore(&name, 1)
        .unwrap()
        .permit()
        .options()
        .lease(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let waiter = {
        let semaphore = b.semaphore(&name, 1).unwrap();
        tokio::spawn(async move {
            semaphore
                .permit()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .expect("woken")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    permit.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("woke by the message, not by the permit's expiry")
        .unwrap();
    next.release().await.unwrap();

    // A read-write lock's releases publish on its channel with SPUBLISH, on the slot's master.
    let name = format!("cluster/{base}/rw-wake");
    let master = cluster.master_for_key(&name).unwrap();
    let spublished = || {
        let info = master.command(&["INFO", "commandstats"]).unwrap();
        let info = info.as_str().unwrap_or_default().to_string();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_spublish:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let read = a.read_write(&name).unwrap().read().await.unwrap();
    let writer = b.read_write(&name).unwrap();
    let waiter = tokio::spawn(async move {
        let guard = writer
            .writer()
            .options()
            .wait(Duration::from_secs(20))
            .acquire()
            .await
            .expect("woken");
        (guard, writer)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = spublished();
    read.release().await.unwrap();
    let (write, _writer) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the writer got in after the reader left")
        .unwrap();
    assert!(spublished() > before, "the read release published nothing");
    write.release().await.unwrap();

    // A name whose braces make no hash tag is refused before any I/O.
    let err = a.lock("x{}y").expect_err("keys on different slots");
    assert_eq!(err.kind(), ErrorKind::InvalidName, "{err}");
}

/// Runs `args` on `node`; the reply must not be an error.
fn ok(node: &RedisServer, args: &[&str]) {
    let reply = node.command(args).unwrap();
    assert!(!reply.is_error(), "{args:?} on {}: {reply}", node.addr());
}

/// A resharding of one slot by hand, as `redis-cli --cluster reshard` does it: `SETSLOT IMPORTING` on
/// the target and `MIGRATING` on the source, `MIGRATE` of the keys, then `SETSLOT … NODE` on every
/// master (on the source, that gives the slot up: the server unsubscribes its clients from the slot's
/// sharded channels).
struct Migration<'a> {
    cluster: &'a RedisCluster,
    slot: String,
    from: usize,
    to: usize,
    masters: Vec<usize>,
}

impl<'a> Migration<'a> {
    /// Opens the migration of `name`'s slot to another master: the source answers `ASK` for the keys
    /// it no longer has from now on.
    fn start(cluster: &'a RedisCluster, name: &str) -> Self {
        let slot = key_slot(name.as_bytes());
        let from = cluster.slot_owner(slot).unwrap().master;
        let masters: Vec<usize> = [0, 5461, 10923]
            .into_iter()
            .map(|s| cluster.slot_owner(s).unwrap().master)
            .collect();
        let to = *masters
            .iter()
            .find(|m| **m != from)
            .expect("another master");
        let migration = Self {
            cluster,
            slot: slot.to_string(),
            from,
            to,
            masters,
        };
        let (from_id, to_id) = (&cluster.node_ids()[from], &cluster.node_ids()[to]);
        ok(
            migration.target(),
            &["CLUSTER", "SETSLOT", &migration.slot, "IMPORTING", from_id],
        );
        ok(
            migration.source(),
            &["CLUSTER", "SETSLOT", &migration.slot, "MIGRATING", to_id],
        );
        migration
    }

    fn source(&self) -> &'a RedisServer {
        &self.cluster.nodes()[self.from]
    }

    fn target(&self) -> &'a RedisServer {
        &self.cluster.nodes()[self.to]
    }

    /// Moves `keys` to the target.
    fn move_keys(&self, keys: &[&str]) {
        let port = self.target().port().to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend_from_slice(keys);
        ok(self.source(), &args);
    }

    /// Moves a lock's keys (the lock and its token counter) to the target.
    fn move_lock(&self, name: &str) {
        let token_key = layout::token_key(name);
        self.move_keys(&[name, &token_key]);
    }

    /// Hands the slot to the target on every master.
    fn finish(&self) {
        let to_id = &self.cluster.node_ids()[self.to];
        for master in &self.masters {
            ok(
                &self.cluster.nodes()[*master],
                &["CLUSTER", "SETSLOT", &self.slot, "NODE", to_id],
            );
        }
    }

    fn exists_on_source(&self, key: &str) -> bool {
        // While the slot migrates, the source answers `ASK` for a key it does not have.
        let reply = self.source().command(&["EXISTS", key]).unwrap();
        match reply.as_int() {
            Some(n) => n == 1,
            None => {
                assert!(reply.is_error(), "{reply}");
                false
            }
        }
    }

    /// Deletes `key` on the target (as if it had expired there).
    fn delete_on_target(&self, key: &str) {
        let mut conn = self.target().connect(Duration::from_secs(5)).unwrap();
        assert!(!conn.command(&["ASKING"]).unwrap().is_error());
        assert_eq!(conn.command(&["DEL", key]).unwrap().as_int(), Some(1));
    }

    fn exists_on_target(&self, key: &str) -> bool {
        // Until the slot is the target's, it serves the key only after `ASKING` on the same
        // connection.
        let mut conn = self.target().connect(Duration::from_secs(5)).unwrap();
        assert!(!conn.command(&["ASKING"]).unwrap().is_error());
        conn.command(&["EXISTS", key]).unwrap().as_int() == Some(1)
    }
}

async fn locks_for(cluster: &RedisCluster) -> Locks {
    let url = LockUrl::parse(&cluster.url()).unwrap();
    Locks::new(RedisBackend::connect(&url).await.expect("connect"))
}

/// A slot moves to another master while a lock in it is held (a resharding: `MIGRATE`, then
/// `SETSLOT … NODE`). The release must follow the `MOVED` and release the lock, whatever the retry
/// policy: the old node ran nothing, so following it is no resend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_follows_a_moved_slot_under_any_retry_policy() {
    let cluster = RedisCluster::start_or_panic();
    let seeds = cluster
        .addrs()
        .iter()
        .map(|a| Endpoint::new(a.ip().to_string(), a.port()))
        .collect();
    let config = RedisConfig::cluster(seeds).with_retry(RetryPolicy::NEVER);
    let locks = Locks::new(RedisBackend::from_config(config).await.expect("connect"));
    let name = format!("{{moved-{}}}/lock", uuid::Uuid::new_v4().simple());
    // A first release: the release link learns the slot map as it is now.
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    guard.release().await.unwrap();
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();

    let migration = Migration::start(&cluster, &name);
    migration.move_lock(&name);
    migration.finish();
    assert!(migration.exists_on_target(&name));

    guard
        .release()
        .await
        .expect("the release follows the MOVED to the slot's new master");
    assert!(!migration.exists_on_target(&name));
}

/// Issue 24, scenario 15: the lock's keys already moved to the target while the source still marks
/// the slot migrating (it answers `ASK` for them). The release follows the `ASK` (`ASKING` and the
/// release, on one connection to the target) and deletes the lock at once: the next holder does not
/// wait for the 30 s lease. Before, the release went back to the source three times and failed with
/// `Unavailable`, and the key kept its whole lease. Two more locks of the slot: one whose keys are
/// still on the source is released there (before, the release script, which declared the channel as
/// a second key, got `TRYAGAIN` on a migrating slot and failed); one deleted on the target meanwhile
/// (as if expired) is `NotHeld`: following the `ASK` is no resend, so the outcome is known.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_follows_ask_while_its_slot_migrates() {
    let cluster = RedisCluster::start_or_panic();
    let (a, b) = (locks_for(&cluster).await, locks_for(&cluster).await);
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let [moved, stays, gone] = ["moved", "stays", "gone"].map(|n| format!("{{{tag}}}/{n}"));
    let lease = Duration::from_secs(30);
    let mut guards = Vec::new();
    for name in [&moved, &stays, &gone] {
        guards.push(
            a.lock(name)
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
    }
    let [moved_guard, stays_guard, gone_guard] = <[_; 3]>::try_from(guards).unwrap();
    let first = moved_guard.token().unwrap();

    let migration = Migration::start(&cluster, &moved);
    migration.move_lock(&moved);
    migration.move_lock(&gone);
    assert!(migration.exists_on_target(&moved));
    moved_guard
        .release()
        .await
        .expect("the release follows the ASK to the node that has the lock's keys");
    assert!(
        !migration.exists_on_target(&moved),
        "the release deleted the lock on the target"
    );
    stays_guard
        .release()
        .await
        .expect("a release on the source of a migrating slot");
    assert!(!migration.exists_on_source(&stays));
    migration.delete_on_target(&gone);
    let err = gone_guard.release().await.expect_err("the lock is gone");
    assert_eq!(err.kind(), ErrorKind::NotHeld, "{err}");

    // Redis refuses the two-key acquire script while the slot is half-way (TRYAGAIN): the next holder
    // takes the lock as soon as the slot is handed over, far inside the 30 s lease.
    migration.move_keys(&[&layout::token_key(&stays)]);
    migration.finish();
    let started = Instant::now();
    let next = b
        .lock(&moved)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("the lock is free");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(next.token().unwrap() > first);
    next.release().await.unwrap();
}

/// Issue 24, scenario 15: an acquire granted, then abandoned (a cancelled acquire) after its keys
/// moved to the target of a migration under way: the undo follows the `ASK` and leaves nothing
/// behind. Before, the undo was refused on both nodes and the grant kept its whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_acquire_is_undone_while_its_slot_migrates() {
    let cluster = RedisCluster::start_or_panic();
    let url = LockUrl::parse(&cluster.url()).unwrap();
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let name = format!("{{undo-{}}}/lock", uuid::Uuid::new_v4().simple());
    let request = AcquireRequest::new(&name, "owner-undo:1", Duration::from_secs(30));
    let mut acquisition = backend.begin(&request).unwrap();
    // The grant the caller never saw: its acquire is cancelled after the reply came.
    match backend
        .try_acquire(&mut acquisition, &request)
        .await
        .unwrap()
    {
        Attempt::Acquired(_) => {}
        other => panic!("not granted: {other:?}"),
    }

    let migration = Migration::start(&cluster, &name);
    migration.move_lock(&name);
    assert!(migration.exists_on_target(&name));
    backend.abandon(acquisition, &request).await;
    assert!(
        !migration.exists_on_target(&name),
        "the undo deleted the abandoned grant on the target"
    );
    migration.finish();
    let other = locks_for(&cluster).await;
    assert!(other
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_some());
}

/// The same cause on the renewal path: two locks of one slot, one of them already moved to the
/// target, the other still on the source, for longer than their lease. The slot's renewal pipeline
/// gets `ASK` for one of them: each renewal must go where its key is, and both locks stay held.
/// Before, the whole pipeline was redirected (the key still on the source then answered `MOVED`) and
/// both locks were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_follow_each_key_while_their_slot_migrates() {
    let cluster = RedisCluster::start_or_panic();
    let locks = locks_for(&cluster).await;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let (moved, stays) = (format!("{{{tag}}}/moved"), format!("{{{tag}}}/stays"));
    let lease = Duration::from_secs(2);
    let mut guards = Vec::new();
    for name in [&moved, &stays] {
        guards.push(
            locks
                .lock(name)
                .unwrap()
                .options()
                .lease(lease)
                .acquire()
                .await
                .unwrap(),
        );
    }
    // The lock itself moves; its token counter stays on the source for now.
    let migration = Migration::start(&cluster, &moved);
    migration.move_keys(&[&moved]);
    tokio::time::sleep(lease * 3).await;
    for g in &guards {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
    }

    // `inspect` reads the lock (moved) and its token counter (not yet) where each of them is.
    let info = locks
        .inspect(&moved)
        .await
        .expect("inspect follows each key");
    assert!(info.holder.is_some(), "{info:?}");
    assert_eq!(info.last_token, guards[0].token(), "{info:?}");

    migration.move_keys(&[&layout::token_key(&moved)]);
    migration.move_lock(&stays);
    migration.finish();
    for g in guards {
        g.release().await.unwrap();
    }
}

/// Issue 24, scenario 16: a waiter subscribed to the lock's sharded channel on the source is
/// unsubscribed by the server when the slot is handed to the target (`SETSLOT … NODE`). It must
/// subscribe again where the slot now lives, try again, and be woken by the holder's release, long
/// before the holder's 30 s lease would let it in. Before, it ignored the unsubscribe and slept until
/// the pttl it had read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_across_a_completed_slot_migration() {
    let cluster = RedisCluster::start_or_panic();
    let (a, b) = (locks_for(&cluster).await, locks_for(&cluster).await);
    let name = format!("{{wake-{}}}/lock", uuid::Uuid::new_v4().simple());
    let lease = Duration::from_secs(30);
    let holder = a
        .lock(&name)
        .unwrap()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let waiting = b.lock(&name).unwrap();
    let waiter = tokio::spawn(async move {
        waiting
            .options()
            .lease(lease)
            .wait(Duration::from_secs(25))
            .acquire()
            .await
    });
    // The waiter tried, subscribed on the source, and sleeps on the holder's pttl.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let migration = Migration::start(&cluster, &name);
    migration.move_lock(&name);
    migration.finish();
    // Time to notice the unsubscribe and subscribe again on the target.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let released = Instant::now();
    holder.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken by the release, not by the 30 s lease")
        .unwrap()
        .expect("the waiter got the lock");
    assert!(released.elapsed() < Duration::from_secs(10));
    guard.release().await.unwrap();
}

impl Migration<'_> {
    /// `GET key` on the target, after `ASKING`.
    fn get_on_target(&self, key: &str) -> Option<String> {
        let mut conn = self.target().connect(Duration::from_secs(5)).unwrap();
        assert!(!conn.command(&["ASKING"]).unwrap().is_error());
        let reply = conn.command(&["GET", key]).unwrap();
        reply.as_str().map(str::to_string)
    }

    /// `HKEYS key` on the target, after `ASKING`, sorted.
    fn hkeys_on_target(&self, key: &str) -> Vec<String> {
        let mut conn = self.target().connect(Duration::from_secs(5)).unwrap();
        assert!(!conn.command(&["ASKING"]).unwrap().is_error());
        let RespValue::Array(fields) = conn.command(&["HKEYS", key]).unwrap() else {
            panic!("HKEYS {key}");
        };
        let mut fields: Vec<String> = fields
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        fields.sort();
        fields
    }
}

/// Issue 24, scenario 15, for the lock kinds (issue 25): a read-write lock's and a semaphore's keys
/// moved, or half moved, to the target of a migration under way. Their scripts declare only real keys
/// (channels and key prefixes are arguments), so a release follows the `ASK` to where the keys are and
/// frees the hold at once; while a script's keys are split between the two nodes Redis (or the
/// script itself, for the timeout keys it cannot declare: `layout::ELSEWHERE`) answers `TRYAGAIN`,
/// and the request waits for them rather than decide on half the keys. Before: a read release and a
/// permit release declared their channel (and the read release its timeout-key prefixes) as keys, so
/// they got `TRYAGAIN` on both nodes for the whole migration and failed `Unavailable`, the hold kept
/// for its 30 s; run on the target with the other reader's timeout key still on the source, a read
/// release took that reader for expired and deleted the hash under it (a writer could then get in
/// beside it); `inspect` failed `Unavailable`; and a read hold whose timeout key had moved without its
/// hash failed its whole slot's renewal pipeline (`TRYAGAIN`), so a mutex and a permit renewed with it
/// were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_follow_ask_and_wait_out_split_keys_while_their_slot_migrates() {
    let cluster = RedisCluster::start_or_panic();
    let (a, b, c) = (
        locks_for(&cluster).await,
        locks_for(&cluster).await,
        locks_for(&cluster).await,
    );
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let [rw, renewed_rw, sem, mutex] =
        ["rw", "renewed-rw", "sem", "mutex"].map(|n| format!("{{{tag}}}/{n}"));
    let long = Duration::from_secs(30);
    let short = Duration::from_secs(2);
    // A write grant first, so that the name has its token counter (a write acquire in a migrating
    // slot runs only where the hash and the counter both are).
    let write = a.read_write(&rw).unwrap().write().await.unwrap();
    write.release().await.unwrap();
    let one = a
        .read_write(&rw)
        .unwrap()
        .reader()
        .options()
        .lease(long)
        .acquire()
        .await
        .unwrap();
    let two = b
        .read_write(&rw)
        .unwrap()
        .reader()
        .options()
        .lease(long)
        .acquire()
        .await
        .unwrap();
    let mut permits = Vec::new();
    for _ in 0..2 {
        let semaphore = a.semaphore(&sem, 3).unwrap();
        permits.push(
            semaphore
                .permit()
                .options()
                .lease(long)
                .acquire()
                .await
                .unwrap(),
        );
    }
    // One client's short holds in one slot: renewed together, one pipeline per tick.
    let renewed = vec![
        c.lock(&mutex)
            .unwrap()
            .options()
            .lease(short)
            .acquire()
            .await
            .unwrap(),
        c.semaphore(&sem, 3)
            .unwrap()
            .permit()
            .options()
            .lease(short)
            .acquire()
            .await
            .unwrap(),
    ];
    let three = c
        .read_write(&renewed_rw)
        .unwrap()
        .reader()
        .options()
        .lease(short)
        .acquire()
        .await
        .unwrap();
    let timeout_key =
        |name: &str, guard: &LockGuard| layout::read_timeout_prefix(name, guard.owner()) + ":1";
    let (one_key, two_key) = (timeout_key(&rw, &one), timeout_key(&rw, &two));

    let migration = Migration::start(&cluster, &rw);
    // The third reader's timeout key moves without its hash: its renewal is refused on both nodes
    // (TRYAGAIN) as long as they are split. The mutex and the permit renewed in the same pipeline
    // must not be held up by it.
    migration.move_keys(&[&timeout_key(&renewed_rw, &three)]);
    // The first read-write lock's hash, its token counter and the first reader's timeout key move;
    // the second reader's timeout key stays on the source for now.
    migration.move_keys(&[&rw, &layout::token_key(&rw), &one_key]);
    tokio::time::sleep(short * 2).await;
    for g in &renewed {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
    }

    // `inspect` reads each key where it is: both readers, each with its own timeout key's lease.
    let info = a
        .inspect(&rw)
        .await
        .expect("inspect reads each key where it is");
    assert_eq!(info.kind, Some(LockKind::Read), "{info:?}");
    assert_eq!(info.holders.len(), 2, "{info:?}");
    assert!(
        info.holders.iter().all(|h| h.remaining_lease.is_some()),
        "{info:?}"
    );

    // The first reader leaves while the second's timeout key is still on the source: its release
    // must not take the second reader for expired. It waits (TRYAGAIN) until that key moves too.
    let release = tokio::spawn(async move { one.release().await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    migration.move_keys(&[&two_key]);
    release
        .await
        .unwrap()
        .expect("the read release follows the ASK once the keys it reads are on one node");
    let mut fields = vec!["mode".to_string(), two.owner().to_string()];
    fields.sort();
    assert_eq!(
        migration.hkeys_on_target(&rw),
        fields,
        "the second reader still holds"
    );
    assert!(!migration.exists_on_target(&one_key));
    assert!(
        b.read_write(&rw)
            .unwrap()
            .writer()
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "no writer beside the second reader"
    );
    two.release()
        .await
        .expect("the last read release follows the ASK");
    assert!(
        !migration.exists_on_target(&rw),
        "the last read release deleted the hash on the target"
    );

    // The semaphore: its counter moves first, its permits' set a second later. A permit release
    // waits for both (TRYAGAIN), then frees the permit on the target at once.
    let permits_key = layout::semaphore_timeout_key(&sem);
    migration.move_keys(&[&sem]);
    let first = permits.remove(0);
    let release = tokio::spawn(async move { first.release().await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    migration.move_keys(&[&permits_key, &layout::token_key(&sem)]);
    release
        .await
        .unwrap()
        .expect("the permit release follows the ASK once counter and permits are on one node");
    assert_eq!(migration.get_on_target(&sem).as_deref(), Some("1"));
    let info = a.inspect(&sem).await.expect("inspect of the semaphore");
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 3 }), "{info:?}");
    assert_eq!(info.holders.len(), 2, "{info:?}");
    for p in permits {
        p.release().await.expect("a permit release after the ASK");
    }
    assert_eq!(migration.get_on_target(&sem).as_deref(), Some("2"));

    migration.move_keys(&[&mutex, &layout::token_key(&mutex), &renewed_rw]);
    migration.finish();
    for g in renewed {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
        g.release().await.unwrap();
    }
    // The third reader's renewals were refused for longer than its lease: lost, or not, it goes.
    let _ = three.release().await;
    // Free on the new master: a writer, and all three permits.
    let writer = b.read_write(&rw).unwrap().write().await.unwrap();
    writer.release().await.unwrap();
    let semaphore = b.semaphore(&sem, 3).unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            semaphore
                .permit()
                .try_acquire()
                .await
                .unwrap()
                .expect("a free permit"),
        );
    }
    for p in held {
        p.release().await.unwrap();
    }
}

/// The plain layout (`?layout=plain`) in Cluster: names on every master's slots held past their lease
/// (the plain renew script, per slot), another client kept out, and a waiter woken by the sharded
/// message on `distlock_lock__channel:{NAME}` (its poll is 60 s and the holder's lease 30 s, so only
/// the message can wake it within the bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_plain_layout_locks_wake_and_renew() {
    let cluster = RedisCluster::start_or_panic();
    let url = LockUrl::parse(&format!("{}?layout=plain&poll=60s", cluster.url())).unwrap();
    let a = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let b = Locks::new(RedisBackend::connect(&url).await.expect("connect"));
    let base = uuid::Uuid::new_v4().simple().to_string();
    let lease = Duration::from_secs(2);
    let mut guards = Vec::new();
    for i in 0..8 {
        let name = format!("cluster-plain/{base}/{i}");
        let guard = a
            .lock(&name)
            .unwrap()
            .options()
            .lease(lease)
            .acquire()
            .await;
        guards.push(guard.unwrap());
        assert!(b
            .lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        let info = b.inspect(&name).await.unwrap();
        assert_eq!(
            info.holder.and_then(|h| h.owner).as_deref(),
            Some(guards[i].owner())
        );
    }
    tokio::time::sleep(lease * 2).await;
    for g in &guards {
        assert_eq!(g.state(), LockState::Held, "{:?}", g.loss_reason());
    }
    let name = format!("cluster-plain/{base}/wake");
    let first = a.lock(&name).unwrap().acquire().await.unwrap();
    let next = release_wakes(
        first,
        b.lock(&name).unwrap(),
        Duration::from_secs(10),
        "the sharded release message",
    )
    .await;
    assert!(next.token() > first_token_of(&guards));
    next.release().await.unwrap();
    for g in guards {
        g.release().await.unwrap();
    }

    // `tokens=false`: the bare `SET NX PX` is routed to each name's master too, and the busy try's
    // script finds the holder there.
    let bare_url = format!("{}?layout=plain&tokens=false", cluster.url());
    let bare = Locks::new(
        RedisBackend::connect(&LockUrl::parse(&bare_url).unwrap())
            .await
            .expect("connect"),
    );
    for i in 0..8 {
        let name = format!("cluster-plain/{base}/bare/{i}");
        let guard = bare.lock(&name).unwrap().acquire().await.unwrap();
        assert_eq!(guard.token(), None);
        assert!(b
            .lock(&name)
            .unwrap()
            .try_acquire()
            .await
            .unwrap()
            .is_none());
        guard.release().await.unwrap();
        let again = b.lock(&name).unwrap().try_acquire().await.unwrap();
        again
            .expect("free after the release")
            .release()
            .await
            .unwrap();
    }
}

fn first_token_of(guards: &[LockGuard]) -> Option<distlock_core::FencingToken> {
    guards.iter().filter_map(LockGuard::token).min()
}

/// Fair mode (`?fair=true`) in Cluster, in both layouts: on names of several slots, waiters of
/// separate clients queue on the name's master (`distlock_lock_queue:{NAME}`, in the name's slot) and
/// are granted in that order, woken by the sharded message on their own channels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_fair_waiters_are_granted_in_arrival_order() {
    let cluster = RedisCluster::start_or_panic();
    let base = uuid::Uuid::new_v4().simple().to_string();
    for (i, query) in ["?fair=true", "?fair=true&layout=plain"].iter().enumerate() {
        let url = LockUrl::parse(&format!("{}{query}", cluster.url())).unwrap();
        let client = || async { Locks::new(RedisBackend::connect(&url).await.expect("connect")) };
        for slot in 0..3 {
            let name = format!("cluster-fair/{base}/{i}/{slot}");
            let master = cluster.master_for_key(&name).unwrap();
            let queued = |len: i64| {
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                loop {
                    let now = master
                        .command(&["LLEN", &layout::queue_key(&name)])
                        .unwrap()
                        .as_int();
                    if now == Some(len) {
                        return;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{name}: the queue has {now:?}, not {len}"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
            };
            let held = client().await.lock(&name).unwrap().acquire().await.unwrap();
            let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let mut waiters = Vec::new();
            for w in 0..3 {
                let lock = client().await.lock(&name).unwrap();
                let order = order.clone();
                waiters.push(tokio::spawn(async move {
                    let guard = lock.acquire().await.unwrap();
                    order.lock().unwrap().push(w);
                    guard.release().await.unwrap();
                }));
                queued(w + 1);
            }
            held.release().await.unwrap();
            for waiter in waiters {
                tokio::time::timeout(Duration::from_secs(20), waiter)
                    .await
                    .expect("granted")
                    .unwrap();
            }
            assert_eq!(*order.lock().unwrap(), vec![0, 1, 2], "{name} ({query})");
            queued(0);
        }
    }
}
