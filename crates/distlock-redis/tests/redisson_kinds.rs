//! The read-write lock and the semaphore against Redisson's own scripts, copied from its source
//! (redisson/redisson @66863978: `RedissonReadLock.java`, `RedissonWriteLock.java`,
//! `RedissonPermitExpirableSemaphore.java`) and run as Redisson runs them: one Redis server per test,
//! Redisson's side driven through a plain connection with its keys and arguments. Also what happens
//! when one name is used as two kinds, and a crashed reader. Tests whose name contains "fault" kill
//! something (nextest runs them serially).
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_redis::{layout, RedisBackend};
use distlock_testkit::holder::HolderProcess;
use distlock_testkit::redis::RedisServer;
use futures_util::StreamExt;

/// `RedissonReadLock.tryLockInnerAsync`: KEYS = lock, timeout prefix (`{NAME}:<id>:<tid>:rwlock_timeout`);
/// ARGV = lease ms, `<id>:<tid>`, `<id>:<tid>:write`. nil = acquired, else the lock's pttl.
const REDISSON_READ_ACQUIRE: &str = "local mode = redis.call('hget', KEYS[1], 'mode'); \
    if (mode == false) then \
      redis.call('hset', KEYS[1], 'mode', 'read'); \
      redis.call('hset', KEYS[1], ARGV[2], 1); \
      redis.call('set', KEYS[2] .. ':1', 1); \
      redis.call('pexpire', KEYS[2] .. ':1', ARGV[1]); \
      redis.call('pexpire', KEYS[1], ARGV[1]); \
      return nil; \
    end; \
    if (mode == 'read') or (mode == 'write' and redis.call('hexists', KEYS[1], ARGV[3]) == 1) then \
      local ind = redis.call('hincrby', KEYS[1], ARGV[2], 1); \
      local key = KEYS[2] .. ':' .. ind;\
      redis.call('set', key, 1); \
      redis.call('pexpire', key, ARGV[1]); \
      local remainTime = redis.call('pttl', KEYS[1]); \
      redis.call('pexpire', KEYS[1], math.max(remainTime, ARGV[1])); \
      return nil; \
    end;\
    return redis.call('pttl', KEYS[1]);";

/// `RedissonReadLock.unlockInnerAsync`: KEYS = lock, channel, timeout prefix, key prefix (`{NAME}`),
/// unlock latch; ARGV = `0`, `<id>:<tid>`, publish command, latch timeout. nil = not held, 0 = still
/// held by others, 1 = the lock deleted and `0` published.
const REDISSON_READ_UNLOCK: &str = "local val = redis.call('get', KEYS[5]); \
    if val ~= false then \
        return tonumber(val);\
    end; \
    local mode = redis.call('hget', KEYS[1], 'mode'); \
    if (mode == false) then \
        redis.call(ARGV[3], KEYS[2], ARGV[1]); \
        redis.call('set', KEYS[5], 1, 'px', ARGV[4]); \
        return nil; \
    end; \
    local lockExists = redis.call('hexists', KEYS[1], ARGV[2]); \
    if (lockExists == 0) then \
        return nil;\
    end; \
    local counter = redis.call('hincrby', KEYS[1], ARGV[2], -1); \
    if (counter == 0) then \
        redis.call('hdel', KEYS[1], ARGV[2]); \
    end;\
    redis.call('del', KEYS[3] .. ':' .. (counter+1)); \
    if (redis.call('hlen', KEYS[1]) > 1) then \
        local maxRemainTime = -3; \
        local keys = redis.call('hkeys', KEYS[1]); \
        for n, key in ipairs(keys) do \
            counter = tonumber(redis.call('hget', KEYS[1], key)); \
            if type(counter) == 'number' then \
                for i=counter, 1, -1 do \
                    local remainTime = redis.call('pttl', KEYS[4] .. ':' .. key .. ':rwlock_timeout:' .. i); \
                    maxRemainTime = math.max(remainTime, maxRemainTime);\
                end; \
            end; \
        end; \
        if maxRemainTime > 0 then \
            redis.call('pexpire', KEYS[1], maxRemainTime); \
            redis.call('set', KEYS[5], 0, 'px', ARGV[4]); \
            return 0; \
        end;\
        if mode == 'write' then \
            redis.call('set', KEYS[5], 0, 'px', ARGV[4]); \
            return 0;\
        end; \
    end; \
    redis.call('del', KEYS[1]); \
    redis.call(ARGV[3], KEYS[2], ARGV[1]); \
    redis.call('set', KEYS[5], 1, 'px', ARGV[4]); \
    return 1; ";

/// `RedissonWriteLock.tryLockInnerAsync`: KEYS = lock; ARGV = lease ms, `<id>:<tid>:write`. nil =
/// acquired, else the lock's pttl.
const REDISSON_WRITE_ACQUIRE: &str = "local mode = redis.call('hget', KEYS[1], 'mode'); \
    if (mode == false) then \
          redis.call('hset', KEYS[1], 'mode', 'write'); \
          redis.call('hset', KEYS[1], ARGV[2], 1); \
          redis.call('pexpire', KEYS[1], ARGV[1]); \
          return nil; \
      end; \
      if (mode == 'write') then \
          if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then \
              redis.call('hincrby', KEYS[1], ARGV[2], 1); \
              local currentExpire = redis.call('pttl', KEYS[1]); \
              redis.call('pexpire', KEYS[1], currentExpire + ARGV[1]); \
              return nil; \
          end; \
        end;\
        return redis.call('pttl', KEYS[1]);";

/// `RedissonWriteLock.unlockInnerAsync`: KEYS = lock, channel, unlock latch; ARGV = `1`, lease ms,
/// `<id>:<tid>:write`, publish command, latch timeout. nil = not held, 0 = still held (reentrant),
/// 1 = released.
const REDISSON_WRITE_UNLOCK: &str = "local val = redis.call('get', KEYS[3]); \
    if val ~= false then \
        return tonumber(val);\
    end; \
    local mode = redis.call('hget', KEYS[1], 'mode'); \
    if (mode == false) then \
        redis.call(ARGV[4], KEYS[2], ARGV[1]); \
        redis.call('set', KEYS[3], 1, 'px', ARGV[5]); \
        return nil; \
    end;\
    if (mode == 'write') then \
        local lockExists = redis.call('hexists', KEYS[1], ARGV[3]); \
        if (lockExists == 0) then \
            return nil;\
        else \
            local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1); \
            if (counter > 0) then \
                redis.call('pexpire', KEYS[1], ARGV[2]); \
                redis.call('set', KEYS[3], 0, 'px', ARGV[5]); \
                return 0; \
            else \
                redis.call('hdel', KEYS[1], ARGV[3]); \
                if (redis.call('hlen', KEYS[1]) == 1) then \
                    redis.call('del', KEYS[1]); \
                    redis.call(ARGV[4], KEYS[2], ARGV[1]); \
                else \
                    redis.call('hset', KEYS[1], 'mode', 'read'); \
                end; \
                redis.call('set', KEYS[3], 1, 'px', ARGV[5]); \
                return 1; \
            end; \
        end; \
    end; \
    return nil;";

/// `RedissonPermitExpirableSemaphore.tryAcquireAsync(ids, timeoutDate)`: KEYS = counter, permits
/// (`{NAME}:timeout`), channel; ARGV = count, expiry (client epoch ms), now (client epoch ms),
/// `nonExpirableTimeout`, publish command, raw ids. `OK` = acquired, `:<score>` = busy until then,
/// nil = busy.
const REDISSON_PERMIT_ACQUIRE: &str =
    "local expiredIds = redis.call('zrangebyscore', KEYS[2], 0, ARGV[3], 'limit', 0, ARGV[1]); \
      if #expiredIds > 0 then \
          redis.call('zrem', KEYS[2], unpack(expiredIds)); \
          local value = redis.call('incrby', KEYS[1], #expiredIds); \
          if tonumber(value) > 0 then \
              redis.call(ARGV[5], KEYS[3], value); \
          end;\
      end; \
      local value = redis.call('get', KEYS[1]); \
      if (value ~= false and tonumber(value) >= tonumber(ARGV[1])) then \
          redis.call('decrby', KEYS[1], ARGV[1]); \
          for i = 6, #ARGV, 1 do \
              redis.call('zadd', KEYS[2], ARGV[2], ARGV[i]); \
          end; \
          local ttl = redis.call('pttl', KEYS[1]); \
          if ttl > 0 then \
              redis.call('pexpire', KEYS[2], ttl); \
          end; \
          return 'OK'; \
      end; \
      local v = redis.call('zrange', KEYS[2], 0, 0, 'WITHSCORES'); \
      if v[1] ~= nil and v[2] ~= ARGV[4] then \
          return ':' .. tostring(v[2]); \
      end \
      return nil;";

/// `RedissonPermitExpirableSemaphore.tryReleaseAsync(permitId)`: KEYS = counter, channel, permits;
/// ARGV = raw id, 1, now (client epoch ms), publish command. 1 = released, 0 = not there or expired.
const REDISSON_PERMIT_RELEASE: &str = "local expire = redis.call('zscore', KEYS[3], ARGV[1]);\
        local removed = redis.call('zrem', KEYS[3], ARGV[1]);\
        if tonumber(removed) ~= 1 then \
            return 0;\
        end;\
        local value = redis.call('incrby', KEYS[1], ARGV[2]); \
        redis.call(ARGV[4], KEYS[2], value); \
        if tonumber(expire) <= tonumber(ARGV[3]) then \
            return 0;\
        end;\
        return 1;";

/// `RedissonPermitExpirableSemaphore.trySetPermitsAsync`: KEYS = counter, channel; ARGV = permits,
/// publish command. 1 = set, 0 = already there.
const REDISSON_TRY_SET_PERMITS: &str = "local value = redis.call('get', KEYS[1]); \
    if (value == false) then \
        redis.call('set', KEYS[1], ARGV[1]); \
        redis.call(ARGV[2], KEYS[2], ARGV[1]); \
        return 1;\
    end;\
    return 0;";

/// `RedissonLock.tryLockInnerAsync` (the plain `RLock`), as in `tests/redis.rs`.
const REDISSON_LOCK_ACQUIRE: &str = "if ((redis.call('exists', KEYS[1]) == 0) \
    or (redis.call('hexists', KEYS[1], ARGV[2]) == 1)) then \
        redis.call('hincrby', KEYS[1], ARGV[2], 1); \
        redis.call('pexpire', KEYS[1], ARGV[1]); \
        return nil; \
    end; \
    return redis.call('pttl', KEYS[1]);";

/// A Redisson client's lock name for thread 1 (`<client uuid>:<thread id>`).
const REDISSON_OWNER: &str = "7c9e6679-7425-40de-944b-e07fc1f90ae7:1";

/// "Promptly": well before any lease or pttl in these tests (30 s) could let a waiter in.
const PROMPT: Duration = Duration::from_secs(5);

fn unique(case: &str) -> String {
    format!("kinds-test/{case}/{}", uuid::Uuid::new_v4().simple())
}

async fn locks(url: &str) -> Locks {
    let backend = RedisBackend::connect(&LockUrl::parse(url).unwrap())
        .await
        .expect("connect");
    Locks::new(backend)
}

async fn driver(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Redisson's side of one name: its scripts with its keys.
struct Redisson {
    conn: redis::aio::MultiplexedConnection,
    name: String,
}

impl Redisson {
    fn latch(&self) -> String {
        format!(
            "{}:{}",
            layout::prefix_name("redisson_unlock_latch", &self.name),
            uuid::Uuid::new_v4()
        )
    }

    async fn read_acquire(&mut self, lease_ms: u64) -> Option<i64> {
        redis::Script::new(REDISSON_READ_ACQUIRE)
            .key(&self.name)
            .key(layout::read_timeout_prefix(&self.name, REDISSON_OWNER))
            .arg(lease_ms)
            .arg(REDISSON_OWNER)
            .arg(layout::write_field(REDISSON_OWNER))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn read_unlock(&mut self) -> Option<i64> {
        redis::Script::new(REDISSON_READ_UNLOCK)
            .key(&self.name)
            .key(layout::rw_channel(&self.name))
            .key(layout::read_timeout_prefix(&self.name, REDISSON_OWNER))
            .key(layout::suffix_base(&self.name))
            .key(self.latch())
            .arg(0)
            .arg(REDISSON_OWNER)
            .arg("PUBLISH")
            .arg(5_000)
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn write_acquire(&mut self, lease_ms: u64) -> Option<i64> {
        redis::Script::new(REDISSON_WRITE_ACQUIRE)
            .key(&self.name)
            .arg(lease_ms)
            .arg(layout::write_field(REDISSON_OWNER))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn write_unlock(&mut self) -> Option<i64> {
        redis::Script::new(REDISSON_WRITE_UNLOCK)
            .key(&self.name)
            .key(layout::rw_channel(&self.name))
            .key(self.latch())
            .arg(1)
            .arg(30_000)
            .arg(layout::write_field(REDISSON_OWNER))
            .arg("PUBLISH")
            .arg(5_000)
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn lock_acquire(&mut self, lease_ms: u64) -> Option<i64> {
        redis::Script::new(REDISSON_LOCK_ACQUIRE)
            .key(&self.name)
            .arg(lease_ms)
            .arg(REDISSON_OWNER)
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn try_set_permits(&mut self, permits: u32) -> i64 {
        redis::Script::new(REDISSON_TRY_SET_PERMITS)
            .key(&self.name)
            .key(layout::semaphore_channel(&self.name))
            .arg(permits)
            .arg("PUBLISH")
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    /// One permit with `lease` (by this client's clock, as Redisson's); `Ok(id)` if acquired, else the
    /// script's answer.
    async fn permit_acquire(&mut self, lease: Duration) -> Result<[u8; 16], Option<String>> {
        let id: [u8; 16] = *uuid::Uuid::new_v4().as_bytes();
        let now = epoch_ms();
        let answer: Option<String> = redis::Script::new(REDISSON_PERMIT_ACQUIRE)
            .key(&self.name)
            .key(layout::semaphore_timeout_key(&self.name))
            .key(layout::semaphore_channel(&self.name))
            .arg(1)
            .arg(now + u64::try_from(lease.as_millis()).unwrap())
            .arg(now)
            .arg(922_337_203_685_477_u64)
            .arg("PUBLISH")
            .arg(&id[..])
            .invoke_async(&mut self.conn)
            .await
            .unwrap();
        match answer.as_deref() {
            Some("OK") => Ok(id),
            _ => Err(answer),
        }
    }

    async fn permit_release(&mut self, id: &[u8]) -> i64 {
        redis::Script::new(REDISSON_PERMIT_RELEASE)
            .key(&self.name)
            .key(layout::semaphore_channel(&self.name))
            .key(layout::semaphore_timeout_key(&self.name))
            .arg(id)
            .arg(1)
            .arg(epoch_ms())
            .arg("PUBLISH")
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }
}

fn epoch_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn sorted<T: Ord>(mut items: Vec<T>) -> Vec<T> {
    items.sort();
    items
}

/// `HGETALL` of a hash as (field, value) pairs, sorted.
fn hash_of(server: &RedisServer, name: &str) -> Vec<(String, String)> {
    let reply = server.command(&["HGETALL", name]).unwrap();
    let distlock_testkit::redis::RespValue::Array(values) = reply else {
        panic!("HGETALL: {reply}");
    };
    let items: Vec<String> = values
        .iter()
        .map(|v| v.as_str().unwrap_or_default().to_string())
        .collect();
    let mut pairs: Vec<(String, String)> = items
        .chunks(2)
        .map(|pair| (pair[0].clone(), pair[1].clone()))
        .collect();
    pairs.sort();
    pairs
}

/// The next message of a subscription, within [`PROMPT`].
async fn next_message(
    messages: &mut (impl futures_util::Stream<Item = redis::Msg> + Unpin),
) -> String {
    tokio::time::timeout(PROMPT, messages.next())
        .await
        .expect("a message on the channel")
        .expect("stream open")
        .get_payload()
        .unwrap()
}

fn int(server: &RedisServer, args: &[&str]) -> i64 {
    server.command(args).unwrap().as_int().unwrap()
}

/// Readers of both share; a writer of either excludes the other's readers and writers; the layout on
/// the server is Redisson's (`mode`, the reader's field and `rwlock_timeout` key, the writer's `:write`
/// field); a Redisson write release wakes a waiting distlock reader long before the 30 s pttl; both
/// releases publish on `redisson_rwlock:{NAME}` what Redisson's waiters expect; after a distlock
/// downgrade a Redisson reader gets in and no writer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_read_write_interop_both_ways() {
    let server = RedisServer::start_or_panic();
    let name = unique("rw");
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    let (a, b) = (locks(&server.url()).await, locks(&server.url()).await);
    let (ra, rb) = (a.read_write(&name).unwrap(), b.read_write(&name).unwrap());
    let client = redis::Client::open(server.url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub
        .subscribe(format!("redisson_rwlock:{{{name}}}"))
        .await
        .unwrap();
    let mut messages = Box::pin(pubsub.on_message());

    // A Redisson reader and a distlock reader share.
    assert_eq!(redisson.read_acquire(30_000).await, None);
    let read = ra
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .expect("a distlock reader beside a Redisson reader");
    assert_eq!(read.kind(), LockKind::Read);
    assert_eq!(
        hash_of(&server, &name),
        sorted(vec![
            (REDISSON_OWNER.to_string(), "1".to_string()),
            (ra.owner().to_string(), "1".to_string()),
            ("mode".to_string(), "read".to_string()),
        ])
    );
    let timeout_key = format!("{{{name}}}:{}:rwlock_timeout:1", ra.owner());
    assert!(int(&server, &["PTTL", &timeout_key]) > 25_000);
    // Readers keep writers of either side out.
    assert!(rb.writer().try_acquire().await.unwrap().is_none());
    assert!(redisson.write_acquire(30_000).await.is_some_and(|p| p > 0));
    // Redisson's release finds the distlock reader's timeout key alive: the lock stays.
    assert_eq!(redisson.read_unlock().await, Some(0));
    assert!(rb.writer().try_acquire().await.unwrap().is_none());
    read.release().await.unwrap();
    assert_eq!(int(&server, &["EXISTS", &name]), 0);
    assert_eq!(
        next_message(&mut messages).await,
        "0",
        "a read release publishes 0"
    );

    // A Redisson writer excludes distlock readers and writers; its release wakes a waiting distlock
    // reader at once, not at the end of its 30 s lease.
    assert_eq!(redisson.write_acquire(30_000).await, None);
    assert!(ra.reader().try_acquire().await.unwrap().is_none());
    assert!(rb.writer().try_acquire().await.unwrap().is_none());
    let waiting = {
        let reader = a.read_write(&name).unwrap();
        tokio::spawn(async move {
            let guard = reader
                .reader()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .expect("woken by Redisson's write release");
            (guard, reader)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The waiter listens where Redisson's release publishes (this test's subscriber and the waiter's
    // backend).
    let info = a.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Write));
    assert_eq!(
        info.holder.and_then(|h| h.owner),
        Some(REDISSON_OWNER.to_string())
    );
    assert_eq!(
        info.waiters,
        Some(2),
        "subscribers of redisson_rwlock:{{NAME}}"
    );
    let released = Instant::now();
    assert_eq!(redisson.write_unlock().await, Some(1));
    assert_eq!(next_message(&mut messages).await, "1");
    let (woken, reader) = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the distlock reader woke within the bound, not at the 30 s pttl")
        .unwrap();
    assert!(released.elapsed() < PROMPT);
    woken.release().await.unwrap();
    assert_eq!(next_message(&mut messages).await, "0");
    drop(reader);

    // A distlock writer excludes Redisson's readers and writers; it writes Redisson's write field;
    // Redisson cannot release it.
    let write = rb.write().await.unwrap();
    let token = write.token().expect("a write grant's token").get();
    assert_eq!(
        hash_of(&server, &name),
        sorted(vec![
            (format!("{}:write", rb.owner()), "1".to_string()),
            ("mode".to_string(), "write".to_string()),
        ])
    );
    assert_eq!(
        server
            .command(&["GET", &layout::token_key(&name)])
            .unwrap()
            .as_str(),
        Some(token.to_string().as_str())
    );
    assert!(redisson.read_acquire(30_000).await.is_some_and(|p| p > 0));
    assert!(redisson.write_acquire(30_000).await.is_some_and(|p| p > 0));
    assert_eq!(redisson.write_unlock().await, None);
    assert_eq!(write.state(), LockState::Held);

    // The downgrade: the writer's read field and timeout key come, its write field goes, `1` is
    // published; a Redisson reader gets in, writers do not; the reader carries the write's token.
    let mut write = write;
    write.downgrade().await.unwrap();
    assert_eq!(write.kind(), LockKind::Read);
    assert_eq!(write.token().map(|t| t.get()), Some(token));
    assert_eq!(
        next_message(&mut messages).await,
        "1",
        "a downgrade tells waiting readers"
    );
    assert_eq!(
        hash_of(&server, &name),
        sorted(vec![
            (rb.owner().to_string(), "1".to_string()),
            ("mode".to_string(), "read".to_string()),
        ])
    );
    assert_eq!(redisson.read_acquire(30_000).await, None);
    assert!(ra.writer().try_acquire().await.unwrap().is_none());
    let other = ra.reader().try_acquire().await.unwrap().expect("a reader");
    assert_eq!(other.token().map(|t| t.get()), Some(token));
    let info = a.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Read));
    let mut readers: Vec<String> = info
        .holders
        .iter()
        .filter_map(|h| h.owner.clone())
        .collect();
    readers.sort();
    let mut expected = vec![
        REDISSON_OWNER.to_string(),
        ra.owner().to_string(),
        rb.owner().to_string(),
    ];
    expected.sort();
    assert_eq!(readers, expected, "{info:?}");
    assert!(info.holder.is_none());
    write.release().await.unwrap();
    other.release().await.unwrap();
    assert_eq!(redisson.read_unlock().await, Some(1), "the last reader");
    assert_eq!(int(&server, &["EXISTS", &name]), 0);
}

/// A reader that stops renewing stops blocking a writer within its lease: a Redisson reader that
/// "crashed" (its 1.5 s timeout key never renewed) beside a live distlock reader no longer counts when
/// the live one leaves (the release reads every reader's timeout keys, as Redisson's does, and deletes
/// the lock); and a `distlock run --read` process SIGKILLed frees the lock when its lease ends, not
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_readers_stop_blocking_a_writer_fault() {
    let server = RedisServer::start_or_panic();
    let name = unique("crashed_reader");
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    let (a, b) = (locks(&server.url()).await, locks(&server.url()).await);
    assert_eq!(redisson.read_acquire(1_500).await, None);
    let live = a
        .read_write(&name)
        .unwrap()
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .expect("a reader beside Redisson's");
    let writer = b.read_write(&name).unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    // The crashed reader's field is still there; its timeout key is gone; the live reader holds.
    assert_eq!(
        int(&server, &["HEXISTS", &name, REDISSON_OWNER]),
        1,
        "the crashed reader's field"
    );
    assert!(writer.writer().try_acquire().await.unwrap().is_none());
    live.release().await.unwrap();
    let write = writer
        .writer()
        .try_acquire()
        .await
        .unwrap()
        .expect("the crashed reader's expired field must not keep the writer out");
    write.release().await.unwrap();

    // A distlock reader process killed: the writer gets in once its 2 s lease ends (renewed every
    // third of it, so at least ~1.3 s after the kill), not before.
    let lease = Duration::from_secs(2);
    let name = unique("killed_reader");
    let mut holder =
        HolderProcess::spawn_with(&server.url(), &name, lease, &["--read"]).expect("reader");
    let writer = b.read_write(&name).unwrap();
    assert!(writer.writer().try_acquire().await.unwrap().is_none());
    holder.kill9().expect("kill the reader");
    let killed = Instant::now();
    assert!(
        writer.writer().try_acquire().await.unwrap().is_none(),
        "a killed reader's hold lasts until its lease ends"
    );
    let write = writer
        .writer()
        .options()
        .wait(lease * 2 + PROMPT)
        .acquire()
        .await
        .expect("the killed reader's hold ends with its lease");
    assert!(killed.elapsed() >= Duration::from_millis(500));
    write.release().await.unwrap();
}

/// Redisson's permits and distlock's count against one limit: Redisson's `trySetPermits` sets it,
/// distlock's and Redisson's permits fill it, another limit is refused, Redisson's release wakes a
/// distlock waiter long before any lease ends, Redisson's expired permit is reclaimed by distlock's
/// acquire (by the server's clock), and a distlock permit renewed by the watchdog outlives its lease
/// while Redisson keeps trying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_and_distlock_permits_count_against_one_limit() {
    let server = RedisServer::start_or_panic();
    let name = unique("permits");
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    let (a, b) = (locks(&server.url()).await, locks(&server.url()).await);
    let semaphore = a.semaphore(&name, 3).unwrap();
    assert_eq!(redisson.try_set_permits(3).await, 1);

    let p1 = semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("permit 1 of 3");
    let p2 = b
        .semaphore(&name, 3)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("permit 2 of 3");
    // Ids are Redisson's: 16 raw bytes in `{NAME}:timeout`, 32 hex digits outside; the expiry is the
    // server's time plus the lease.
    let hex = p1.permit().expect("a permit id").to_string();
    assert_eq!(hex.len(), 32);
    let raw: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap())
        .collect();
    let score: f64 = redis::cmd("ZSCORE")
        .arg(layout::semaphore_timeout_key(&name))
        .arg(&raw[..])
        .query_async(&mut redisson.conn)
        .await
        .unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut redisson.conn)
        .await
        .unwrap();
    let server_now = secs * 1000 + micros / 1000;
    assert!(
        score > (server_now + 25_000) as f64 && score <= (server_now + 30_000) as f64,
        "{score} against the server's {server_now}"
    );
    let theirs = redisson
        .permit_acquire(Duration::from_secs(30))
        .await
        .expect("Redisson's permit 3 of 3");
    assert_eq!(server.command(&["GET", &name]).unwrap().as_str(), Some("0"));
    assert!(semaphore.try_acquire().await.unwrap().is_none(), "4 of 3");
    assert!(redisson
        .permit_acquire(Duration::from_secs(30))
        .await
        .is_err());
    let info = a.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 3 }));
    let mut ids: Vec<String> = info
        .holders
        .iter()
        .filter_map(|h| h.permit.clone())
        .collect();
    ids.sort();
    let mut expected = vec![
        hex.clone(),
        p2.permit().unwrap().to_string(),
        layout::permit_hex(&theirs),
    ];
    expected.sort();
    assert_eq!(ids, expected);

    // Another limit is refused, naming both.
    let err = b
        .semaphore(&name, 4)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("another limit");
    assert_eq!(
        err.kind(),
        ErrorKind::LimitMismatch {
            stored: 3,
            requested: 4
        },
        "{err}"
    );

    // Redisson's release publishes the new count: a waiting distlock wakes at once (every permit's
    // lease is 30 s).
    let waiting = {
        let semaphore = b.semaphore(&name, 3).unwrap();
        tokio::spawn(async move {
            semaphore
                .permit()
                .options()
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .expect("woken by Redisson's release")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = Instant::now();
    assert_eq!(redisson.permit_release(&theirs).await, 1);
    let p3 = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the waiter woke within the bound")
        .unwrap();
    assert!(released.elapsed() < PROMPT);

    // A Redisson permit whose (client-clock) lease ran out is reclaimed by distlock's next acquire.
    p1.release().await.unwrap();
    redisson
        .permit_acquire(Duration::from_millis(500))
        .await
        .expect("Redisson's short permit");
    assert!(semaphore.try_acquire().await.unwrap().is_none());
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let p4 = semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("Redisson's expired permit reclaimed");
    assert_eq!(server.command(&["GET", &name]).unwrap().as_str(), Some("0"));
    assert_eq!(
        int(&server, &["ZCARD", &layout::semaphore_timeout_key(&name)]),
        3
    );
    for permit in [p2, p3, p4] {
        permit.release().await.unwrap();
    }
    assert_eq!(server.command(&["GET", &name]).unwrap().as_str(), Some("3"));
    // The limit is kept: Redisson's trySetPermits finds it set.
    assert_eq!(redisson.try_set_permits(5).await, 0);

    // Renewed by the watchdog (`ZADD XX` on the server's clock), a 1 s permit outlives its lease:
    // Redisson's tries meanwhile reclaim nothing of it.
    let name = unique("renewed_permit");
    redisson.name = name.clone();
    let held = a
        .semaphore(&name, 1)
        .unwrap()
        .permit()
        .options()
        .lease(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(redisson
            .permit_acquire(Duration::from_secs(30))
            .await
            .is_err());
    }
    assert_eq!(held.state(), LockState::Held);
    held.release().await.unwrap();
    assert!(redisson
        .permit_acquire(Duration::from_secs(30))
        .await
        .is_ok());
}

/// One name is one kind: while it is a mutex, a read-write lock or a semaphore (whose counter is
/// kept when no permit is held), the other kinds' acquires fail with `KindConflict` naming the kind in
/// use, never a grant; a Redisson `RLock` counts as a mutex; a string that is no lock is a
/// `Protocol` error; and a mutex released after its key became a semaphore's counter is `NotHeld`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_name_is_one_kind() {
    let server = RedisServer::start_or_panic();
    // The tries come from another client: exclusive kinds of one `Locks` queue on its local gate
    // before they reach the server.
    let (locks, other) = (locks(&server.url()).await, locks(&server.url()).await);
    let conflict = |outcome: distlock_core::Result<Option<distlock_core::LockGuard>>,
                    in_use: &str,
                    step: &str| {
        match outcome {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::KindConflict, "{step}: {e}");
                assert!(e.to_string().contains(in_use), "{step}: {e}");
            }
            Ok(held) => panic!("{step}: {held:?} while the name is another kind"),
        }
    };

    let name = unique("mutex");
    let mutex = locks.lock(&name).unwrap().acquire().await.unwrap();
    let rw = other.read_write(&name).unwrap();
    conflict(rw.reader().try_acquire().await, "mutex", "read on a mutex");
    conflict(rw.writer().try_acquire().await, "mutex", "write on a mutex");
    let semaphore = other.semaphore(&name, 2).unwrap();
    conflict(semaphore.try_acquire().await, "mutex", "permit on a mutex");
    mutex.release().await.unwrap();

    let name = unique("rw");
    let rw = locks.read_write(&name).unwrap();
    let read = rw.read().await.unwrap();
    conflict(
        other.lock(&name).unwrap().try_acquire().await,
        "read-write lock",
        "mutex on readers",
    );
    conflict(
        other.semaphore(&name, 2).unwrap().try_acquire().await,
        "read-write lock",
        "permit on readers",
    );
    read.release().await.unwrap();
    let write = rw.write().await.unwrap();
    conflict(
        other.lock(&name).unwrap().try_acquire().await,
        "read-write lock",
        "mutex on a writer",
    );
    write.release().await.unwrap();

    let name = unique("semaphore");
    let semaphore = locks.semaphore(&name, 2).unwrap();
    semaphore.acquire().await.unwrap().release().await.unwrap();
    // No permit held: the counter (and its limit) is kept, and says what to delete.
    let err = locks
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .expect_err("a mutex on a semaphore's name");
    assert_eq!(err.kind(), ErrorKind::KindConflict, "{err}");
    let message = err.to_string();
    assert!(
        message.contains("semaphore") && message.contains(&format!("{{{name}}}:timeout")),
        "{message}"
    );
    let rw = locks.read_write(&name).unwrap();
    conflict(rw.reader().try_acquire().await, "semaphore", "read");
    conflict(rw.writer().try_acquire().await, "semaphore", "write");

    // Redisson's RLock is a mutex.
    let name = unique("rlock");
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    assert_eq!(redisson.lock_acquire(30_000).await, None);
    let rw = locks.read_write(&name).unwrap();
    conflict(rw.reader().try_acquire().await, "mutex", "read on an RLock");
    conflict(
        locks.semaphore(&name, 2).unwrap().try_acquire().await,
        "mutex",
        "permit on an RLock",
    );
    // And Redisson's RLock sees a distlock read-write lock as held.
    let name = unique("rlock_on_rw");
    redisson.name = name.clone();
    let read = locks.read_write(&name).unwrap().read().await.unwrap();
    assert!(redisson.lock_acquire(30_000).await.is_some_and(|p| p > 0));
    read.release().await.unwrap();

    // A string that is no lock: Protocol, for every kind.
    let name = unique("string");
    server.command(&["SET", &name, "x"]).unwrap();
    let rw = locks.read_write(&name).unwrap();
    for (outcome, step) in [
        (rw.reader().try_acquire().await, "read"),
        (rw.writer().try_acquire().await, "write"),
        (
            locks.semaphore(&name, 2).unwrap().try_acquire().await,
            "permit",
        ),
    ] {
        let err = outcome.expect_err(step);
        assert_eq!(err.kind(), ErrorKind::Protocol, "{step}: {err}");
        assert!(err.to_string().contains("another type"), "{step}: {err}");
    }

    // A mutex whose key was replaced by a semaphore's counter: its release says NotHeld.
    let name = unique("replaced");
    let mutex = locks.lock(&name).unwrap().acquire().await.unwrap();
    server.command(&["DEL", &name]).unwrap();
    server.command(&["SET", &name, "2"]).unwrap();
    let err = mutex
        .release()
        .await
        .expect_err("the mutex's key is a semaphore's counter now");
    assert_eq!(err.kind(), ErrorKind::NotHeld, "{err}");
}

/// `distlock break` ends an exclusive holder only. A reader given (distlock's and a Redisson
/// reader) is `Unsupported`, saying why, and nothing is touched: the hash is as it was, the readers
/// hold on, a writer still cannot get in. The same for a permit held, whether the holder given is the
/// permit or its owner id; another owner id there (an exclusive holder that has gone) is `false`. A writer is broken: a Redisson writer that re-entered
/// and holds a read of its own under its write loses the whole hash, and a distlock reader waiting is
/// let in long before the 30 s pttl, and the writer shown, broken again under that reader, is `false`
/// (gone), not refused; a distlock writer's guard goes `Lost` at its next renewal, which does not
/// recreate the hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn break_ends_a_writer_and_refuses_readers_and_permits() {
    let server = RedisServer::start_or_panic();
    let (locks, operator) = (locks(&server.url()).await, locks(&server.url()).await);
    let refused = |outcome: distlock_core::Result<bool>, step: &str| {
        let err = outcome.expect_err(step);
        assert_eq!(err.kind(), ErrorKind::Unsupported, "{step}: {err}");
        assert!(
            err.to_string().contains("exclusive holder only"),
            "{step}: {err}"
        );
    };

    let name = unique("break_readers");
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    let read = locks.read_write(&name).unwrap().read().await.unwrap();
    assert_eq!(redisson.read_acquire(30_000).await, None);
    let before = hash_of(&server, &name);
    let info = operator.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Read));
    assert!(info.holder.is_none());
    assert_eq!(info.holders.len(), 2);
    for shown in &info.holders {
        refused(operator.break_holder(&name, shown).await, "a reader");
    }
    assert_eq!(
        hash_of(&server, &name),
        before,
        "the readers' hash was touched"
    );
    assert_eq!(read.state(), LockState::Held);
    let writer = operator.read_write(&name).unwrap();
    assert!(writer.writer().try_acquire().await.unwrap().is_none());
    read.release().await.unwrap();
    assert_eq!(redisson.read_unlock().await, Some(1));

    let name = unique("break_permits");
    let permit = locks.semaphore(&name, 2).unwrap().acquire().await.unwrap();
    let info = operator.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Permit { limit: 2 }));
    refused(
        operator.break_holder(&name, &info.holders[0]).await,
        "a permit",
    );
    let mut by_owner = info.holders[0].clone();
    by_owner.owner = Some(permit.owner().to_string());
    by_owner.permit = None;
    refused(
        operator.break_holder(&name, &by_owner).await,
        "the owner id of a permit held",
    );
    // An exclusive holder that has gone (not a permit's): nothing to break, and no refusal.
    let mut gone = distlock_core::raw::HolderInfo::default();
    gone.owner = Some(REDISSON_OWNER.to_string());
    assert!(!operator.break_holder(&name, &gone).await.unwrap());
    let timeout_key = layout::semaphore_timeout_key(&name);
    assert_eq!(int(&server, &["ZCARD", &timeout_key]), 1);
    assert_eq!(server.command(&["GET", &name]).unwrap().as_str(), Some("1"));
    assert_eq!(permit.state(), LockState::Held);
    permit.release().await.unwrap();

    let name = unique("break_writer");
    redisson.name = name.clone();
    assert_eq!(redisson.write_acquire(30_000).await, None);
    assert_eq!(redisson.write_acquire(30_000).await, None);
    assert_eq!(redisson.read_acquire(30_000).await, None);
    let info = operator.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Write));
    let shown = info.holder.expect("the writer");
    assert_eq!(shown.owner.as_deref(), Some(REDISSON_OWNER));
    let reader = locks.read_write(&name).unwrap();
    let waiting = tokio::spawn(async move { reader.read().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "read while a writer held");
    assert!(operator.break_holder(&name, &shown).await.unwrap());
    let read = tokio::time::timeout(PROMPT, waiting)
        .await
        .expect("the reader gets in after the break")
        .unwrap()
        .unwrap();
    let fields: Vec<String> = hash_of(&server, &name)
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    assert_eq!(
        fields,
        sorted(vec!["mode".to_string(), read.owner().to_string()]),
        "nothing of the broken writer is left"
    );
    // The name is a reader's now: the writer shown is gone, whatever holds the name now (a stale
    // break is no refusal), and the reader is not touched.
    assert!(!operator.break_holder(&name, &shown).await.unwrap());
    assert_eq!(read.state(), LockState::Held);
    assert_eq!(
        hash_of(&server, &name).len(),
        2,
        "the reader's hash was touched"
    );
    read.release().await.unwrap();
    assert!(!operator.break_holder(&name, &shown).await.unwrap());

    let name = unique("break_distlock_writer");
    let lease = Duration::from_secs(3);
    let write = locks
        .read_write(&name)
        .unwrap()
        .writer()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let shown = operator
        .inspect(&name)
        .await
        .unwrap()
        .holder
        .expect("the writer");
    assert_eq!(shown.owner.as_deref(), Some(write.owner()));
    assert!(operator.break_holder(&name, &shown).await.unwrap());
    assert_eq!(int(&server, &["EXISTS", &name]), 0);
    tokio::time::timeout(lease / 3 + Duration::from_millis(700), write.lost())
        .await
        .expect("the broken writer is Lost at its next renewal");
    assert_eq!(
        int(&server, &["EXISTS", &name]),
        0,
        "a renewal recreated the hash"
    );

    // A writer shown that has since turned into a reader (a downgrade: same owner, no new token) is
    // gone as a writer: `false`, its read hold left alone.
    let name = unique("break_downgraded");
    let mut write = locks.read_write(&name).unwrap().write().await.unwrap();
    let shown = operator
        .inspect(&name)
        .await
        .unwrap()
        .holder
        .expect("the writer");
    assert_eq!(shown.hold_id, write.token().map(|t| t.get().to_string()));
    write.downgrade().await.unwrap();
    assert!(!operator.break_holder(&name, &shown).await.unwrap());
    assert_eq!(write.state(), LockState::Held);
    assert_eq!(int(&server, &["EXISTS", &name]), 1);
    write.release().await.unwrap();
}

/// A hold whose own server-side expiry is gone is `Lost` at the next renewal (a third of the lease),
/// not renewed as if nothing happened: a reader whose timeout key was deleted (it no longer counts:
/// another reader's release would delete the lock under it, and a writer get in), a permit released
/// by Redisson's `release(permitId)` (or reclaimed), a permit whose score is in the past (any acquire
/// may reclaim it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_whose_expiry_is_gone_on_the_server_is_lost_at_the_next_renewal_fault() {
    let server = RedisServer::start_or_panic();
    let locks = locks(&server.url()).await;
    let lease = Duration::from_secs(3);
    let bound = lease / 3 + Duration::from_millis(1_500);

    let name = unique("reader_timeout_gone");
    let rw = locks.read_write(&name).unwrap();
    let read = rw.reader().options().lease(lease).acquire().await.unwrap();
    server
        .command(&[
            "DEL",
            &format!("{}:1", layout::read_timeout_prefix(&name, rw.owner())),
        ])
        .unwrap();
    tokio::time::timeout(bound, read.lost())
        .await
        .expect("Lost at the next renewal");
    let reason = read.loss_reason().unwrap_or_default();
    assert!(reason.contains("timeout key"), "{reason}");

    let name = unique("permit_removed");
    let semaphore = locks.semaphore(&name, 2).unwrap();
    let permit = semaphore
        .permit()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let id = layout::permit_id(permit.owner());
    assert_eq!(layout::permit_hex(&id), permit.permit().unwrap());
    let mut redisson = Redisson {
        conn: driver(&server).await,
        name: name.clone(),
    };
    assert_eq!(
        redisson.permit_release(&id).await,
        1,
        "Redisson's release(permitId)"
    );
    tokio::time::timeout(bound, permit.lost())
        .await
        .expect("Lost at the next renewal");
    let reason = permit.loss_reason().unwrap_or_default();
    assert!(reason.contains("permit is gone"), "{reason}");

    let expired = semaphore
        .permit()
        .options()
        .lease(lease)
        .acquire()
        .await
        .unwrap();
    let id = layout::permit_id(expired.owner());
    let _: i64 = redis::cmd("ZADD")
        .arg(layout::semaphore_timeout_key(&name))
        .arg("XX")
        .arg(1)
        .arg(&id[..])
        .query_async(&mut redisson.conn)
        .await
        .unwrap();
    tokio::time::timeout(bound, expired.lost())
        .await
        .expect("Lost at the next renewal");
    let reason = expired.loss_reason().unwrap_or_default();
    assert!(reason.contains("expiry passed"), "{reason}");
}
