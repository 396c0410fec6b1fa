//! The plain layout (`?layout=plain`, issue 27) on a real `redis-server`: the string key redis-py's
//! `Lock` writes, both ways against redis-py itself (Debian's `python3-redis`, run by
//! `/usr/bin/python3`: scripts/setup.sh installs it), the key's shape, the status of a foreign holder,
//! and the two layouts refusing each other's keys instead of both granting.
// Test code: a failed expectation is the test's failure.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, LockKind, Locks};
use distlock_redis::{layout, RedisBackend};
use distlock_testkit::redis::RedisServer;
use distlock_testkit::wake::release_wakes;

const PYTHON: &str = "/usr/bin/python3";

fn unique(case: &str) -> String {
    format!("plain/{case}/{}", uuid::Uuid::new_v4().simple())
}

/// The redis-py driver script, after checking that Debian's python3 has redis-py.
fn script() -> PathBuf {
    let import = Command::new(PYTHON).args(["-c", "import redis"]).output();
    assert!(
        import.is_ok_and(|o| o.status.success()),
        "redis-py is missing for {PYTHON}: install it with `sudo apt-get install -y python3-redis` (scripts/setup.sh does)"
    );
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/redis-py/lock.py")
}

fn python(command: &str, server: &RedisServer, name: &str, timeout: Duration) -> Command {
    let mut cmd = Command::new(PYTHON);
    cmd.arg(script()).args([
        command,
        &server.port().to_string(),
        name,
        &timeout.as_millis().to_string(),
    ]);
    cmd
}

/// A redis-py `Lock` holding a name until `release` (stdin closed) or drop (killed).
struct PyHolder {
    child: Child,
    stdout: BufReader<ChildStdout>,
    token: String,
}

impl PyHolder {
    fn hold(server: &RedisServer, name: &str, timeout: Duration) -> PyHolder {
        let mut child = python("hold", server, name, timeout)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn python3");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let token = read_held(&mut stdout);
        PyHolder {
            child,
            stdout,
            token,
        }
    }

    fn release(mut self) {
        drop(self.child.stdin.take());
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read redis-py");
        assert_eq!(line.trim(), "released");
        assert!(self.child.wait().expect("wait python3").success());
    }
}

impl Drop for PyHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_held(stdout: &mut impl BufRead) -> String {
    let mut line = String::new();
    stdout.read_line(&mut line).expect("read redis-py");
    line.trim()
        .strip_prefix("held ")
        .unwrap_or_else(|| panic!("redis-py did not acquire: {line:?}"))
        .to_string()
}

/// redis-py's one non-blocking acquire: true if it got (and released) the lock.
fn py_tries(server: &RedisServer, name: &str) -> bool {
    let out = python("try", server, name, Duration::from_secs(10))
        .output()
        .expect("run python3");
    match out.status.code() {
        Some(0) => true,
        Some(3) => false,
        _ => panic!(
            "redis-py failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

async fn locks(server: &RedisServer, query: &str) -> Locks {
    let url = LockUrl::parse(&format!("{}{query}", server.url())).expect("url");
    Locks::new(RedisBackend::connect(&url).await.expect("connect"))
}

async fn plain(server: &RedisServer) -> Locks {
    locks(server, "?layout=plain").await
}

async fn driver(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_a_string_of_the_owner_with_the_lease_and_tokens_rise() {
    let server = RedisServer::start_or_panic();
    let locks = plain(&server).await;
    let mut raw = driver(&server).await;
    let name = unique("shape");
    let lease = locks.defaults().lease;
    let first = locks.lock(&name).unwrap().acquire().await.unwrap();
    let kind: String = redis::cmd("TYPE")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    let value: String = redis::cmd("GET")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!((kind.as_str(), value.as_str()), ("string", first.owner()));
    assert!(
        pttl > 0 && pttl <= i64::try_from(lease.as_millis()).unwrap(),
        "pttl {pttl} ms, lease {lease:?}"
    );
    let counter: u64 = redis::cmd("GET")
        .arg(layout::token_key(&name))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(first.token().map(|t| t.get()), Some(counter));
    let first_token = first.token().unwrap();
    first.release().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&name)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(exists, 0, "the release deletes the key");
    let second = locks.lock(&name).unwrap().acquire().await.unwrap();
    assert!(second.token().unwrap() > first_token);
    second.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_py_holding_keeps_distlock_out_shows_in_status_and_its_release_wakes_a_waiter() {
    let server = RedisServer::start_or_panic();
    let locks = plain(&server).await;
    let name = unique("py_holds");
    // A 30 s lease: a waiter that acquires long before it was woken by the poll, not the expiry.
    let holder = PyHolder::hold(&server, &name, Duration::from_secs(30));
    assert!(locks
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());

    let info = locks.inspect(&name).await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Mutex));
    let shown = info.holder.expect("a holder");
    assert_eq!(shown.owner.as_deref(), Some(holder.token.as_str()));
    assert!(shown
        .remaining_lease
        .is_some_and(|d| d > Duration::from_secs(20)));

    let waiter = {
        let lock = locks.lock(&name).unwrap();
        tokio::spawn(async move { lock.acquire().await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "acquired while redis-py held");
    let released = Instant::now();
    tokio::task::spawn_blocking(move || holder.release())
        .await
        .unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter polls: woken long before the 30 s lease")
        .unwrap()
        .unwrap();
    tracing::info!(after = ?released.elapsed(), "acquired after redis-py's release");
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distlock_holding_keeps_redis_py_out_and_its_waiter_gets_in_after_the_release() {
    let server = RedisServer::start_or_panic();
    let locks = plain(&server).await;
    let name = unique("distlock_holds");
    let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
    assert!(!py_tries(&server, &name), "redis-py acquired a held lock");

    let mut waiter = python("wait", &server, &name, Duration::from_secs(10))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn python3");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        waiter.try_wait().unwrap().is_none(),
        "redis-py's waiter stopped while distlock held"
    );
    guard.release().await.unwrap();
    let out = tokio::task::spawn_blocking(move || waiter.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "redis-py never acquired: {out:?}");
    let token = read_held(&mut out.stdout.as_slice());
    assert!(!token.is_empty());
    assert!(
        py_tries(&server, &name),
        "redis-py released and can take it again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_two_layouts_refuse_each_others_lock_and_neither_grants() {
    let server = RedisServer::start_or_panic();
    let (plain, redisson) = (plain(&server).await, locks(&server, "").await);

    let name = unique("plain_held");
    let held = plain.lock(&name).unwrap().acquire().await.unwrap();
    let err = redisson
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("layout"), "{err}");
    // The kinds keep Redisson's layouts: a plain lock's string is not theirs either.
    let read = plain.read_write(&name).unwrap();
    let err = read.reader().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    let err = plain
        .semaphore(&name, 2)
        .unwrap()
        .permit()
        .try_acquire()
        .await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::Protocol);
    assert_eq!(
        plain
            .inspect(&name)
            .await
            .unwrap()
            .holder
            .and_then(|h| h.owner)
            .as_deref(),
        Some(held.owner()),
        "nothing changed the plain lock"
    );
    held.release().await.unwrap();

    let name = unique("redisson_held");
    let held = redisson.lock(&name).unwrap().acquire().await.unwrap();
    let err = plain.lock(&name).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("layout=redisson"), "{err}");
    // A read-write lock or a semaphore on the name is the kind conflict it is under either layout.
    let rw = unique("rw");
    let reader = plain.read_write(&rw).unwrap().read().await.unwrap();
    let err = plain.lock(&rw).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KindConflict, "{err}");
    reader.release().await.unwrap();
    let sem = unique("sem");
    let permit = plain.semaphore(&sem, 2).unwrap().acquire().await.unwrap();
    let err = plain.lock(&sem).unwrap().try_acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::KindConflict, "{err}");
    permit.release().await.unwrap();
    held.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_distlock_release_wakes_a_plain_waiter_by_its_channel_not_the_poll() {
    let server = RedisServer::start_or_panic();
    // A poll far longer than the test's bound: only the release message can wake the waiter in time.
    // Two backends: within one `Locks` the release would hand the lock on in the process.
    let (holder, other) = (
        locks(&server, "?layout=plain&poll=60s").await,
        locks(&server, "?layout=plain&poll=60s").await,
    );
    let name = unique("channel");
    let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
    let next = release_wakes(
        guard,
        other.lock(&name).unwrap(),
        Duration::from_secs(10),
        "the release message, well before the 60 s poll and the 30 s lease",
    )
    .await;
    next.release().await.unwrap();
}

/// Another client's lock whose value is digits or reads as a number to Lua's `tonumber` (a
/// hand-written `SET lock 1 NX PX`, a timestamp, a hex token with one `e`, rslock's random bytes with a
/// NUL after a digit) is a lock held, waited for: not a semaphore's counter (review of issue 27).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_that_reads_as_a_number_is_a_lock_held_not_a_semaphore() {
    let server = RedisServer::start_or_panic();
    let locks = plain(&server).await;
    let mut raw = driver(&server).await;
    let mut rslock = vec![b'5', 0];
    rslock.extend([0xab_u8; 18]);
    let values: [(&str, Vec<u8>); 4] = [
        ("hand_written", b"1".to_vec()),
        ("timestamp", b"1765126800123".to_vec()),
        ("hex_token", b"3141592653e58979323846264338327".to_vec()),
        ("rslock_bytes", rslock),
    ];
    for (case, value) in values {
        let name = unique(case);
        let set: Option<String> = redis::cmd("SET")
            .arg(&name)
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(set.as_deref(), Some("OK"));
        let lock = locks.lock(&name).unwrap();
        assert!(lock.try_acquire().await.unwrap().is_none(), "{case}");
        let waited = tokio::time::timeout(Duration::from_millis(500), lock.acquire()).await;
        assert!(waited.is_err(), "{case}: the acquire ended: {waited:?}");
        let info = locks.inspect(&name).await.unwrap();
        assert_eq!(info.kind, Some(LockKind::Mutex), "{case}: {info:?}");
        let holder = info.holder.expect("the other client holds it");
        assert!(holder.remaining_lease.is_some(), "{case}");
    }
}

/// `tokens=false`: an uncontended cycle is one `SET NX PX` and one release script, as rslock's, the
/// token counter is never created, guards carry no token, and redis-py still sees the lock as held. A
/// key already holding this owner's value (a resend after a lost reply) is granted, not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokens_an_acquire_is_one_set_and_no_counter_is_kept() {
    let server = RedisServer::start_or_panic();
    let (holder, other) = (
        locks(&server, "?layout=plain&tokens=false").await,
        locks(&server, "?layout=plain&tokens=false").await,
    );
    assert_eq!(holder.capabilities().fencing, distlock_core::Fencing::None);
    let mut raw = driver(&server).await;
    let name = unique("no_tokens");
    reset_command_calls(&mut raw).await;
    let guard = holder.lock(&name).unwrap().acquire().await.unwrap();
    assert_eq!(guard.token(), None);
    let (stats, calls) = command_calls(&mut raw).await;
    // The acquire was one `SET` (nested calls in scripts count here too: none ran).
    assert_eq!(
        (calls("set"), calls("evalsha"), calls("incr")),
        (1, 0, 0),
        "{stats}"
    );
    assert!(other
        .lock(&name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    assert!(!py_tries(&server, &name), "redis-py acquired a held lock");
    guard.release().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(layout::token_key(&name))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(exists, 0, "no token counter");

    // A resend after a lost reply: the key already holds this owner's value.
    let owner = "resent-owner:1";
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg(owner)
        .arg("PX")
        .arg(30_000)
        .query_async(&mut raw)
        .await
        .unwrap();
    let resent = tokio::time::timeout(
        Duration::from_secs(5),
        holder.lock_as(&name, owner).unwrap().acquire(),
    )
    .await
    .expect("granted at once, not waited out")
    .unwrap();
    resent.release().await.unwrap();

    // A waiter's tries after its first busy answer are the script alone: one bare `SET`, then none.
    let held = holder.lock(&name).unwrap().acquire().await.unwrap();
    reset_command_calls(&mut raw).await;
    let waited = tokio::time::timeout(
        Duration::from_millis(600),
        other.lock(&name).unwrap().acquire(),
    )
    .await;
    assert!(waited.is_err(), "acquired a held lock: {waited:?}");
    let (stats, calls) = command_calls(&mut raw).await;
    assert_eq!(calls("set"), 1, "{stats}");
    assert!(
        calls("evalsha") >= 3,
        "the waiter polls by the script: {stats}"
    );
    held.release().await.unwrap();

    // No kind's guard carries a token: `Capabilities::fencing` is `None` for all of them.
    let writer = holder.read_write(&unique("rw")).unwrap();
    let write = writer.writer().acquire().await.unwrap();
    assert_eq!(write.token(), None);
    write.release().await.unwrap();
    let permit = holder
        .semaphore(&unique("sem"), 2)
        .unwrap()
        .acquire()
        .await
        .unwrap();
    assert_eq!(permit.token(), None);
    permit.release().await.unwrap();
}

async fn reset_command_calls(raw: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(raw)
        .await
        .unwrap();
}

/// `INFO commandstats` since the last reset, and the count of one command's calls in it (commands run
/// inside scripts count too).
async fn command_calls(
    raw: &mut redis::aio::MultiplexedConnection,
) -> (String, impl Fn(&str) -> u64) {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(raw)
        .await
        .unwrap();
    let counts = stats.clone();
    let calls = move |command: &str| -> u64 {
        counts
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    };
    (stats, calls)
}
