//! The file backend's read-write lock and semaphore on real files and real processes: `flock(1)`
//! interop both ways, the atomic downgrade against writers blocked in the kernel, writers first, names
//! being one kind, wake-ups by inotify alone, bad input, and `distlock run --read/--write/--permits`
//! and `distlock status` through the real binary. Bounds are mechanism bounds, never speed figures.
// Test helpers panic on setup failures, like the tests themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::{ErrorKind, LockKind, LockState, Locks};
use distlock_file::{layout, FileBackend, FileConfig};
use distlock_testkit::cli_run::Run;
use distlock_testkit::holder::distlock_bin;
use rustix::process::{kill_process_group, Pid, Signal};

/// How long a mechanism gets to act (a notification to arrive, a process to start or die).
const BOUND: Duration = Duration::from_secs(10);

/// A fallback poll so slow that only inotify can wake a waiter within [`BOUND`].
fn no_polling(dir: &Path) -> Locks {
    Locks::new(
        FileBackend::from_config(
            FileConfig::new(dir)
                .with_poll_backoff(Duration::from_secs(60), Duration::from_secs(60)),
        )
        .unwrap(),
    )
}

fn locks(dir: &Path) -> Locks {
    Locks::new(FileBackend::new(dir).unwrap())
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < BOUND, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A `flock(1)` process (util-linux) in a process group of its own, killed with its command when
/// dropped.
struct Flock {
    child: Child,
}

impl Flock {
    /// `flock MODE FILE sh -c SCRIPT`, where MODE is `-s` or `-x`: blocks in the kernel until it has
    /// the lock, then runs the script (which should not end by itself).
    fn spawn(mode: &str, file: &Path, script: &str) -> Flock {
        let child = Command::new("flock")
            .arg(mode)
            .arg(file)
            .args(["sh", "-c", script])
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("flock(1) is missing: apt-get install util-linux");
        Flock { child }
    }

    fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let group = Pid::from_raw(self.child.id() as i32).unwrap();
        let _ = kill_process_group(group, Signal::KILL);
        let _ = self.child.wait();
    }
}

impl Drop for Flock {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `flock MODE -n FILE true`: whether flock(1) could take the lock at once.
fn flock_now(mode: &str, file: &Path) -> bool {
    let status = Command::new("flock")
        .args([mode, "-n"])
        .arg(file)
        .arg("true")
        .stdin(Stdio::null())
        .status()
        .expect("flock(1) is missing: apt-get install util-linux");
    match status.code() {
        Some(0) => true,
        Some(1) => false,
        other => panic!("flock(1) exited with {other:?}"),
    }
}

/// How many `flock` requests are blocked on `file` in the kernel (`->` lines of `/proc/locks`).
fn blocked_on(file: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(file).unwrap();
    let needle = format!(
        " {:02x}:{:02x}:{} ",
        rustix::fs::major(meta.dev()),
        rustix::fs::minor(meta.dev()),
        meta.ino()
    );
    std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .filter(|line| line.contains(" -> ") && line.contains(&needle))
        .count()
}

/// Readers share the lock file with `flock -s` and exclude `flock -x`, both ways; a writer excludes
/// both; each side wakes the other's waiters by the close alone (no polling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_writers_interoperate_with_flock_s_and_flock_x() {
    let dir = tempfile::tempdir().unwrap();
    let locks = no_polling(dir.path());
    let file = FileBackend::new(dir.path()).unwrap().lock_file("shared");
    let (a, b) = (
        locks.read_write("shared").unwrap(),
        locks.read_write("shared").unwrap(),
    );

    // distlock's reader: flock -s shares it, flock -x is refused.
    let read = a.read().await.unwrap();
    assert!(flock_now("-s", &file), "flock -s refused beside a reader");
    assert!(!flock_now("-x", &file), "flock -x got in beside a reader");
    read.release().await.unwrap();
    // distlock's writer: both refused.
    let write = a.write().await.unwrap();
    assert!(!flock_now("-s", &file), "flock -s got in beside a writer");
    assert!(!flock_now("-x", &file), "flock -x got in beside a writer");
    write.release().await.unwrap();

    // flock -s holds: distlock's readers share it, its writer and the mutex wait.
    let reader = Flock::spawn("-s", &file, "exec sleep 60");
    wait_until("flock -s to hold", || !flock_now("-x", &file));
    let read = a
        .reader()
        .try_acquire()
        .await
        .unwrap()
        .expect("a reader beside flock -s");
    assert!(b.writer().try_acquire().await.unwrap().is_none());
    assert!(locks
        .lock("shared")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    let info = locks.inspect("shared").await.unwrap();
    assert_eq!(info.kind, Some(LockKind::Read), "{info:?}");
    let pids: Vec<Option<u32>> = info.holders.iter().map(|h| h.pid).collect();
    assert!(
        pids.contains(&Some(reader.child.id())) && pids.contains(&Some(std::process::id())),
        "status lists flock -s ({}) and this process among the readers: {info:?}",
        reader.child.id()
    );
    let writer = tokio::spawn(async move { b.write().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    read.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished(), "a writer got in beside flock -s");
    reader.kill();
    let write = tokio::time::timeout(BOUND, writer)
        .await
        .expect("flock -s's exit did not wake the writer")
        .unwrap()
        .unwrap();
    write.release().await.unwrap();

    // flock -x holds: distlock's readers wait, and wake when it goes.
    let exclusive = Flock::spawn("-x", &file, "exec sleep 60");
    wait_until("flock -x to hold", || !flock_now("-s", &file));
    assert!(a.reader().try_acquire().await.unwrap().is_none());
    let waiting = tokio::spawn(async move { a.read().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "a reader got in beside flock -x");
    exclusive.kill();
    let read = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("flock -x's exit did not wake the reader")
        .unwrap()
        .unwrap();
    read.release().await.unwrap();
}

/// A downgrade turns the writer's `LOCK_EX` into `LOCK_SH` in one step: a `flock -s` blocked in the
/// kernel behind the writer gets in, a `flock -x` blocked there never does while the read guard is
/// held (a downgrade made of an unlock and a new lock lets it in: it is woken first), and gets in
/// once the readers are gone. Several rounds, since a gap would be a race.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downgrade_lets_blocked_readers_in_and_never_a_blocked_writer() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    let file = FileBackend::new(dir.path()).unwrap().lock_file("down");
    let rw = locks.read_write("down").unwrap();
    for round in 0..8 {
        let (got_x, got_s) = (
            dir.path().join(format!("got-x-{round}")),
            dir.path().join(format!("got-s-{round}")),
        );
        let mut guard = rw.write().await.unwrap();
        let token = guard.token();
        let writer = Flock::spawn(
            "-x",
            &file,
            &format!("touch {}; exec sleep 60", got_x.display()),
        );
        let reader = Flock::spawn(
            "-s",
            &file,
            &format!("touch {}; exec sleep 60", got_s.display()),
        );
        wait_until("both flock(1)s to block", || blocked_on(&file) == 2);
        guard.downgrade().await.unwrap();
        assert_eq!(
            (guard.kind(), guard.token(), guard.state()),
            (LockKind::Read, token, LockState::Held)
        );
        wait_until("the blocked flock -s to get in", || got_s.exists());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !got_x.exists(),
            "round {round}: flock -x got in during the downgrade"
        );
        // Other readers share it; writers wait.
        let other = locks.read_write("down").unwrap();
        let shared = other
            .reader()
            .try_acquire()
            .await
            .unwrap()
            .expect("a reader");
        assert_eq!(shared.token(), token, "a reader carries the writer's token");
        let third = locks.read_write("down").unwrap();
        assert!(third.writer().try_acquire().await.unwrap().is_none());
        shared.release().await.unwrap();
        reader.kill();
        guard.release().await.unwrap();
        wait_until("flock -x to get in once the readers left", || {
            got_x.exists()
        });
        writer.kill();
    }
}

/// Writers first: a writer waiting behind a reader keeps new distlock readers out (a plain
/// `flock -s`, which knows no turnstile, still gets in), gets in when the old reader leaves, and
/// readers get in again after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_keeps_new_readers_out() {
    let dir = tempfile::tempdir().unwrap();
    let locks = no_polling(dir.path());
    let file = FileBackend::new(dir.path()).unwrap().lock_file("wf");
    let (a, b, c) = (
        locks.read_write("wf").unwrap(),
        locks.read_write("wf").unwrap(),
        locks.read_write("wf").unwrap(),
    );
    let old = a.read().await.unwrap();
    let writer = tokio::spawn(async move { b.write().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        c.reader().try_acquire().await.unwrap().is_none(),
        "a new reader got in while a writer waited"
    );
    assert!(
        flock_now("-s", &file),
        "flock -s knows no turnstile and shares with the old reader"
    );
    let late = tokio::spawn(async move {
        let guard = c.read().await;
        (c, guard)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!late.is_finished() && !writer.is_finished());
    old.release().await.unwrap();
    let write = tokio::time::timeout(BOUND, writer)
        .await
        .expect("the old reader's release did not wake the writer")
        .unwrap()
        .unwrap();
    assert!(!late.is_finished(), "a reader got in beside the writer");
    write.release().await.unwrap();
    let (_c, read) = tokio::time::timeout(BOUND, late)
        .await
        .expect("the writer's release did not wake the waiting reader")
        .unwrap();
    read.unwrap().release().await.unwrap();
    // The turnstile is the only file it added.
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [layout::file_name("wf"), layout::writer_file_name("wf")]
    );
}

/// A name's mutex, read-write lock and semaphore exclude each other (across backends, so across open
/// file descriptions), each waiting for the other and woken by inotify alone; the tokens of every
/// kind of the name come from one counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_names_mutex_readers_and_permits_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (no_polling(dir.path()), no_polling(dir.path()));

    // A mutex holds: no permit; a permit's waiter gets one when it goes, with a later token.
    let mutex = one.lock("job").unwrap().acquire().await.unwrap();
    let sem = two.semaphore("job", 2).unwrap();
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "a permit beside the mutex"
    );
    let waiting = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    let mutex_token = mutex.token().unwrap();
    mutex.release().await.unwrap();
    let p1 = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the mutex's release did not wake the permit's waiter")
        .unwrap()
        .unwrap();
    assert!(p1.token().unwrap() > mutex_token);
    let p2 = sem.try_acquire().await.unwrap().expect("the second permit");
    assert!(p2.token().unwrap() > p1.token().unwrap());

    // Permits hold: no mutex, writer or reader; a writer's waiter gets in when the last permit goes.
    let rw = one.read_write("job").unwrap();
    assert!(one
        .lock("job")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    assert!(rw.reader().try_acquire().await.unwrap().is_none());
    assert!(rw.writer().try_acquire().await.unwrap().is_none());
    let writer = tokio::spawn(async move {
        let guard = rw.write().await;
        (rw, guard)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let last_permit = p2.token().unwrap();
    p1.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished(), "a writer got in beside a permit");
    p2.release().await.unwrap();
    let (rw, write) = tokio::time::timeout(BOUND, writer)
        .await
        .expect("the last permit's release did not wake the writer")
        .unwrap();
    let write = write.unwrap();
    assert!(write.token().unwrap() > last_permit);
    write.release().await.unwrap();

    // Readers hold: no permit, until they leave.
    let read = rw.read().await.unwrap();
    assert!(
        sem.try_acquire().await.unwrap().is_none(),
        "a permit beside a reader"
    );
    let waiting = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    read.release().await.unwrap();
    let permit = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the reader's release did not wake the permit's waiter")
        .unwrap()
        .unwrap();
    assert_eq!(permit.permit(), Some("0"));
    permit.release().await.unwrap();
}

/// Under contention from several processes' worth of backends (each its own open file descriptions
/// and inotify instance) mixing every kind on one name: never an exclusive holder beside anyone,
/// never a reader beside a permit, never more than the limit of permits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_kinds_ever_hold_at_once_under_contention() {
    #[derive(Default)]
    struct Inside {
        exclusive: AtomicUsize,
        readers: AtomicUsize,
        permits: AtomicUsize,
        violations: std::sync::Mutex<Vec<String>>,
        /// Grants of each kind: exclusive, reader, permit.
        grants: [AtomicUsize; 3],
    }
    impl Inside {
        fn check(&self, who: &str) {
            let (x, r, p) = (
                self.exclusive.load(Ordering::SeqCst),
                self.readers.load(Ordering::SeqCst),
                self.permits.load(Ordering::SeqCst),
            );
            if x > 1 || (x == 1 && r + p > 0) || (r > 0 && p > 0) || p > 2 {
                self.violations
                    .lock()
                    .unwrap()
                    .push(format!("{who}: {x} exclusive, {r} readers, {p} permits"));
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let inside = Arc::new(Inside::default());
    let until = Instant::now() + Duration::from_millis(2500);
    let mut tasks = Vec::new();
    // 1 mutex, 1 writer, 6 readers, 4 permit holders.
    for task in 0..12 {
        let (locks, inside) = (locks(dir.path()), inside.clone());
        tasks.push(tokio::spawn(async move {
            let hold = || tokio::time::sleep(Duration::from_millis(3));
            while Instant::now() < until {
                let wait = Duration::from_secs(20);
                let (kind, guard) = match task {
                    0 => (
                        0,
                        locks
                            .lock("mixed")
                            .unwrap()
                            .options()
                            .wait(wait)
                            .acquire()
                            .await,
                    ),
                    1 => (
                        0,
                        locks
                            .read_write("mixed")
                            .unwrap()
                            .writer()
                            .options()
                            .wait(wait)
                            .acquire()
                            .await,
                    ),
                    2..=7 => (
                        1,
                        locks
                            .read_write("mixed")
                            .unwrap()
                            .reader()
                            .options()
                            .wait(wait)
                            .acquire()
                            .await,
                    ),
                    _ => (
                        2,
                        locks
                            .semaphore("mixed", 2)
                            .unwrap()
                            .permit()
                            .options()
                            .wait(wait)
                            .acquire()
                            .await,
                    ),
                };
                let guard = guard.expect("every kind gets its turn");
                let counter = [&inside.exclusive, &inside.readers, &inside.permits][kind];
                counter.fetch_add(1, Ordering::SeqCst);
                inside.check("granted");
                hold().await;
                inside.check("holding");
                counter.fetch_sub(1, Ordering::SeqCst);
                inside.grants[kind].fetch_add(1, Ordering::SeqCst);
                guard.release().await.unwrap();
                // Room for the others (a waiting writer keeps readers out while it waits).
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("a task never finished")
            .unwrap();
    }
    let violations = inside.violations.lock().unwrap();
    assert!(violations.is_empty(), "{violations:?}");
    let grants = inside.grants.each_ref().map(|g| g.load(Ordering::SeqCst));
    eprintln!("grants (exclusive, reader, permit): {grants:?}");
    assert!(
        grants.iter().all(|g| *g > 5),
        "a kind hardly ran: {grants:?}"
    );
}

/// A waiting permit is woken by a release and by the death of a holder process (`distlock run
/// --permits 1` SIGKILLed: its supervisor holds the slot until the command's tree is gone, and the
/// last close wakes the waiter; no polling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permits_waiter_wakes_at_a_release_and_at_a_holders_death_fault() {
    let dir = tempfile::tempdir().unwrap();
    let locks = no_polling(dir.path());
    let sem = locks.semaphore("one", 1).unwrap();
    let held = sem.acquire().await.unwrap();
    let waiting = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    held.release().await.unwrap();
    let permit = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("a release did not wake the waiter")
        .unwrap()
        .unwrap();
    permit.release().await.unwrap();

    let url = format!("file://{}", dir.path().display());
    let mut holder = Run::spawn(&url, "30s", &["--permits", "1"], "one", HOLD);
    holder.wait_started();
    assert_eq!(holder.read("permit").as_deref(), Some("0"));
    let waiting = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a second permit of 1");
    holder.child.kill().unwrap();
    let permit = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the holder's death did not wake the waiter")
        .unwrap()
        .unwrap();
    let command: u32 = holder.read("pid").unwrap().parse().unwrap();
    assert!(
        !distlock_testkit::sweep::is_alive(command),
        "the permit came back while the holder's command still ran"
    );
    permit.release().await.unwrap();
}

/// Bad input: a limit beyond the slot files' cap is refused before any file is made; a corrupt limit
/// file, and another limit than the stored one, fail naming the file (and both limits).
#[tokio::test]
async fn bad_limits_are_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    let err = locks
        .semaphore("big", layout::MAX_SLOTS + 1)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("1024"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    locks
        .semaphore("sem", 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let limit_file = dir.path().join(layout::semaphore_file_name("sem"));
    let err = locks
        .semaphore("sem", 3)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::LimitMismatch {
            stored: 2,
            requested: 3
        }
    );
    assert!(
        err.to_string().contains(&limit_file.display().to_string()),
        "{err}"
    );
    std::fs::write(&limit_file, "limit=lots\nend\n").unwrap();
    let err = locks
        .semaphore("sem", 2)
        .unwrap()
        .try_acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(
        err.to_string().contains(&limit_file.display().to_string()),
        "{err}"
    );
    // Deleted (with no permit held), the limit is stored anew by the next user.
    std::fs::remove_file(&limit_file).unwrap();
    let permit = locks
        .semaphore("sem", 3)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("a permit of the new limit");
    permit.release().await.unwrap();
}

// --- the command line ---------------------------------------------------------------------------

/// A command for `distlock run` that records its permit, token and pid in `$1`, then runs until
/// `$1/stop` exists.
const HOLD: &str = r#"D=$1
echo "${DISTLOCK_PERMIT:-none}" > "$D/permit"
echo "${DISTLOCK_TOKEN:-none}" > "$D/token.tmp"; echo $$ > "$D/pid"; mv "$D/token.tmp" "$D/token"
while [ ! -e "$D/stop" ]; do sleep 0.05; done"#;

fn stop(run: &mut Run) {
    std::fs::write(run.path("stop"), "").unwrap();
    let status = run.wait_for_exit(BOUND).expect("distlock run exits");
    assert_eq!(status.code(), Some(0), "{}", run.stderr());
}

fn distlock(args: &[&str]) -> std::process::Output {
    Command::new(distlock_bin().expect("the distlock binary"))
        .args(args)
        .env_remove("DISTLOCK_URL")
        .stdin(Stdio::null())
        .output()
        .expect("distlock runs")
}

/// `distlock status NAME`'s lines.
fn status(url: &str, name: &str) -> Vec<String> {
    let out = distlock(&["status", "--url", url, name]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn has(lines: &[String], line: &str) -> bool {
    lines.iter().any(|l| l == line)
}

/// `distlock run --read` twice at once: both commands run together with the last writer's token;
/// `--write --no-wait` is refused (75) meanwhile, and a waiting `--write` runs once both readers are
/// done; `distlock status` lists both readers with their pids.
#[test]
fn cli_readers_run_together_and_a_writer_waits_for_them() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let first = distlock(&["run", "--url", &url, "--write", "doc", "--", "true"]);
    assert_eq!(first.status.code(), Some(0));

    let mut readers = [
        Run::spawn(&url, "30s", &["--read"], "doc", HOLD),
        Run::spawn(&url, "30s", &["--read"], "doc", HOLD),
    ];
    let (t1, _) = readers[0].wait_started();
    let (t2, _) = readers[1].wait_started();
    assert_eq!((t1, t2), (1, 1), "readers carry the last writer's token");

    let busy = distlock(&[
        "run",
        "--url",
        &url,
        "--write",
        "--no-wait",
        "doc",
        "--",
        "true",
    ]);
    assert_eq!(
        busy.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    let lines = status(&url, "doc");
    assert!(
        has(&lines, "kind: read") && has(&lines, "state: held"),
        "{lines:?}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("holder: ")).count(),
        2,
        "{lines:?}"
    );
    for reader in &readers {
        let pid = format!("pid: {}", reader.child.id());
        assert!(has(&lines, &pid), "{pid} missing: {lines:?}");
    }

    let mut writer = Run::spawn(&url, "30s", &["--write"], "doc", HOLD);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !writer.path("token").exists(),
        "the writer ran beside the readers"
    );
    for reader in &mut readers {
        stop(reader);
    }
    let (token, _) = writer.wait_started();
    assert_eq!(token, 2);
    let lines = status(&url, "doc");
    assert!(
        has(&lines, "kind: mutex") && has(&lines, "token: 2"),
        "{lines:?}"
    );
    stop(&mut writer);
}

/// `distlock run --permits 2` three times: two run at once with distinct `DISTLOCK_PERMIT`s and
/// tokens, the third waits and gets the permit given back; `distlock status` shows the semaphore;
/// `--permits 3` exits 64 naming both limits without running its command.
#[test]
fn cli_permits_let_two_of_three_run_with_distinct_permits() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let mut runs: Vec<Run> = (0..3)
        .map(|_| Run::spawn(&url, "30s", &["--permits", "2"], "pool", HOLD))
        .collect();
    wait_until("two of three to run", || {
        runs.iter().filter(|r| r.path("token").exists()).count() == 2
    });
    std::thread::sleep(Duration::from_millis(500));
    let running: Vec<usize> = (0..3).filter(|&i| runs[i].path("token").exists()).collect();
    assert_eq!(running.len(), 2, "a third command ran beside two permits");
    let waiting = (0..3).find(|i| !running.contains(i)).unwrap();
    let permits: Vec<String> = running
        .iter()
        .map(|&i| runs[i].read("permit").unwrap())
        .collect();
    let mut sorted = permits.clone();
    sorted.sort();
    assert_eq!(sorted, ["0", "1"]);
    let tokens: Vec<String> = running
        .iter()
        .map(|&i| runs[i].read("token").unwrap())
        .collect();
    assert_ne!(tokens[0], tokens[1], "two permits with one token");

    let lines = status(&url, "pool");
    assert!(
        has(&lines, "kind: semaphore") && has(&lines, "permits: 2") && has(&lines, "state: held"),
        "{lines:?}"
    );
    for permit in &permits {
        assert!(has(&lines, &format!("permit: {permit}")), "{lines:?}");
    }
    for &i in &running {
        assert!(
            has(&lines, &format!("pid: {}", runs[i].child.id())),
            "{lines:?}"
        );
    }

    let marker = dir.path().join("ran");
    let mismatch = distlock(&[
        "run",
        "--url",
        &url,
        "--permits",
        "3",
        "pool",
        "--",
        "touch",
        marker.to_str().unwrap(),
    ]);
    assert_eq!(mismatch.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&mismatch.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("2 permits") && stderr.contains("--permits 3"),
        "{stderr}"
    );
    assert!(!marker.exists(), "the mismatched command ran");

    let freed = permits[0].clone();
    stop(&mut runs[running[0]]);
    let third = &mut runs[waiting];
    third.wait_started();
    assert_eq!(third.read("permit"), Some(freed));
    stop(third);
    stop(&mut runs[running[1]]);
}

/// The parent of `pid`, from /proc.
fn parent(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat.rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

/// `distlock run --read` and `--permits` hand the locked descriptor (the lock file, the slot file) to
/// the command's supervisor, as for the mutex: with the supervisor stopped, SIGKILLing `distlock`
/// leaves the read lock and the permit held (a `flock -x` and another permit are refused) until the
/// supervisor continues, kills the command and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_hold_and_a_permit_outlive_a_sigkilled_distlock_until_its_tree_is_gone_fault() {
    // The orphaned supervisor is reparented to this test process, in the same session: otherwise its
    // process group would be orphaned with a stopped member, and the kernel would continue it at once.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let locks = locks(dir.path());
    let file = FileBackend::new(dir.path()).unwrap().lock_file("tree");
    let sem = locks.semaphore("pool", 1).unwrap();
    for flags in [&["--read"][..], &["--permits", "1"]] {
        let name = if flags[0] == "--read" { "tree" } else { "pool" };
        let mut run = Run::spawn(&url, "30s", flags, name, HOLD);
        run.wait_started();
        let command: u32 = run.read("pid").unwrap().parse().unwrap();
        let supervisor = parent(command);
        assert_ne!(
            supervisor,
            run.child.id(),
            "the command runs under a supervisor"
        );
        let supervisor_pid = Pid::from_raw(supervisor as i32).unwrap();
        rustix::process::kill_process(supervisor_pid, Signal::STOP).unwrap();
        run.child.kill().unwrap();
        run.wait_for_exit(BOUND).expect("distlock died");
        std::thread::sleep(Duration::from_millis(200));
        let held = if name == "tree" {
            !flock_now("-x", &file)
        } else {
            sem.try_acquire().await.unwrap().is_none()
        };
        assert!(held, "{flags:?}: freed while the command still ran");
        assert!(distlock_testkit::sweep::is_alive(command));
        rustix::process::kill_process(supervisor_pid, Signal::CONT).unwrap();
        wait_until("the supervisor to kill the command and exit", || {
            !distlock_testkit::sweep::is_alive(command)
                && !distlock_testkit::sweep::is_alive(supervisor)
        });
        if name == "tree" {
            assert!(flock_now("-x", &file), "the read lock outlived its tree");
        } else {
            let permit = sem.try_acquire().await.unwrap();
            assert!(permit.is_some(), "the permit outlived its tree");
        }
    }
}

/// `--read` and `--permits` on an engine without those kinds (Redlock never has them) exit 64 with one
/// line naming the engine and what it has, without running the command.
#[test]
fn cli_kinds_on_an_engine_without_them_exit_64() {
    let nodes = distlock_testkit::redlock::RedlockNodes::start_or_panic(3);
    let dir = tempfile::tempdir().unwrap();
    let marker: PathBuf = dir.path().join("ran");
    for flags in [&["--read"][..], &["--permits", "2"]] {
        let mut args = vec!["run", "--url"];
        let url = nodes.url();
        args.push(&url);
        args.extend_from_slice(flags);
        args.extend_from_slice(&["x", "--", "touch", marker.to_str().unwrap()]);
        let out = distlock(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{flags:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("redlock") && stderr.contains("mutex"),
            "{stderr}"
        );
        assert!(!marker.exists(), "{flags:?} ran the command");
    }
}
