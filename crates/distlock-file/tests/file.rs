//! The file backend on real files: exclusion, tokens, waking, cancellation, inspect, names, URLs, errors.
// Test helpers panic on setup failures, like the tests themselves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use distlock_core::url::LockUrl;
use distlock_core::{ErrorKind, Fencing, LockState, Locks};
use distlock_file::{FileBackend, FileConfig};

/// How long a mechanism gets to act (a notification to arrive, a background undo to finish). Tests
/// assert that something happens before it, never how fast.
const BOUND: Duration = Duration::from_secs(5);

/// A fallback poll so slow that only inotify can wake a waiter within [`BOUND`].
fn no_polling(dir: &Path) -> FileConfig {
    FileConfig::new(dir).with_poll_backoff(Duration::from_secs(60), Duration::from_secs(60))
}

fn locks(dir: &Path) -> Locks {
    Locks::new(FileBackend::new(dir).unwrap())
}

fn url(text: &str) -> distlock_core::Result<FileBackend> {
    FileBackend::from_url(&LockUrl::parse(text)?)
}

#[tokio::test]
async fn two_locks_of_one_name_in_one_process_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    let a = locks.lock("orders/42").unwrap();
    let b = locks.lock("orders/42").unwrap();
    let guard = a.try_acquire().await.unwrap().expect("free");
    assert!(b.try_acquire().await.unwrap().is_none());
    guard.release().await.unwrap();
    let guard = b.try_acquire().await.unwrap().expect("released");
    assert!(a.try_acquire().await.unwrap().is_none());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn two_handles_over_one_directory_exclude_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let one = locks(dir.path());
    let two = locks(dir.path());
    let guard = one.lock("x").unwrap().acquire().await.unwrap();
    assert!(two
        .lock("x")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    // Other names are independent.
    let other = two
        .lock("y")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("y is free");
    other.release().await.unwrap();
    guard.release().await.unwrap();
    let guard = two
        .lock("x")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("released");
    guard.release().await.unwrap();
}

#[tokio::test]
async fn tokens_strictly_increase_across_holders_and_backends() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = None;
    for round in 0..3 {
        // A new backend each round: the counter lives in the file, not in memory.
        let locks = locks(dir.path());
        for _ in 0..3 {
            let guard = locks.lock("t").unwrap().acquire().await.unwrap();
            let token = guard.token().expect("file locks mint tokens");
            assert!(
                last.is_none_or(|l| token > l),
                "round {round}: {token} after {last:?}"
            );
            last = Some(token);
            guard.release().await.unwrap();
        }
    }
    assert_eq!(last.map(|t| t.get()), Some(9));
    let caps = locks(dir.path()).capabilities();
    assert_eq!(caps.fencing, Fencing::Strict);
    assert!(!caps.server_ttl && caps.frees_on_process_death && caps.notify_wait && !caps.fifo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_without_polling() {
    let dir = tempfile::tempdir().unwrap();
    // Two backends, so the waiter really waits on the file (inside one `Locks` the core's local queue
    // would hand over without the file being involved).
    let holder = Locks::new(FileBackend::from_config(no_polling(dir.path())).unwrap());
    let waiter = Locks::new(FileBackend::from_config(no_polling(dir.path())).unwrap());
    let guard = holder.lock("w").unwrap().acquire().await.unwrap();
    let lock = waiter.lock("w").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "acquired while held");
    let token = guard.token();
    guard.release().await.unwrap();
    // Without the inotify wake-up the waiter would sleep 30–60 s (its fallback poll).
    let got = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the waiter was not woken by the release")
        .unwrap()
        .unwrap();
    assert!(got.token() > token);
    got.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_are_all_woken() {
    // More waiters than the default per-user limit of inotify instances (128): they share one.
    let dir = tempfile::tempdir().unwrap();
    let holder = Locks::new(FileBackend::from_config(no_polling(dir.path())).unwrap());
    let waiter = Locks::new(FileBackend::from_config(no_polling(dir.path())).unwrap());
    let mut guards = Vec::new();
    for i in 0..150 {
        guards.push(
            holder
                .lock(&format!("n{i}"))
                .unwrap()
                .acquire()
                .await
                .unwrap(),
        );
    }
    let mut waiting = Vec::new();
    for i in 0..150 {
        let lock = waiter.lock(&format!("n{i}")).unwrap();
        waiting.push(tokio::spawn(async move { lock.acquire().await }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(waiting.iter().all(|w| !w.is_finished()));
    for guard in guards {
        guard.release().await.unwrap();
    }
    for w in waiting {
        let guard = tokio::time::timeout(BOUND, w)
            .await
            .expect("a waiter was not woken")
            .unwrap()
            .unwrap();
        guard.release().await.unwrap();
    }
}

#[tokio::test]
async fn polling_alone_still_finds_a_released_lock() {
    let dir = tempfile::tempdir().unwrap();
    let config = FileConfig::new(dir.path())
        .with_notify(false)
        .with_poll_backoff(Duration::from_millis(5), Duration::from_millis(50));
    let holder = Locks::new(FileBackend::from_config(config.clone()).unwrap());
    let waiter = Locks::new(FileBackend::from_config(config).unwrap());
    assert!(!waiter.capabilities().notify_wait);
    let guard = holder.lock("p").unwrap().acquire().await.unwrap();
    let lock = waiter.lock("p").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished());
    guard.release().await.unwrap();
    let got = tokio::time::timeout(BOUND, waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    got.release().await.unwrap();
}

/// Asserts that a fresh handle can take and release `name` now, and that the record shows it.
async fn free_for_a_third_party(dir: &Path, name: &str) {
    let third = locks(dir);
    let lock = third.lock(name).unwrap();
    let guard = lock
        .try_acquire()
        .await
        .unwrap()
        .expect("a phantom holder kept the lock");
    let info = third.inspect(name).await.unwrap();
    assert_eq!(info.holder.unwrap().owner.as_deref(), Some(lock.owner()));
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_timed_out_wait_leaves_no_lock_and_no_thread() {
    let dir = tempfile::tempdir().unwrap();
    let a = locks(dir.path());
    let b = locks(dir.path());
    let a_lock = a.lock("bounded").unwrap();
    let guard = a_lock.acquire().await.unwrap();

    let err = b
        .lock("bounded")
        .unwrap()
        .options()
        .wait(Duration::from_millis(200))
        .acquire()
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout);
    let info = b.inspect("bounded").await.unwrap();
    assert_eq!(info.holder.unwrap().owner.as_deref(), Some(a_lock.owner()));

    // Had the timed-out wait left a thread blocked in flock, it would take the lock at this release.
    guard.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    free_for_a_third_party(dir.path(), "bounded").await;

    // The original holder takes it again; its next release lets a third party in.
    let guard = a_lock.acquire().await.unwrap();
    guard.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    free_for_a_third_party(dir.path(), "bounded").await;
    assert!(b.inspect("bounded").await.unwrap().holder.is_none());
}

#[tokio::test]
async fn a_cancelled_wait_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let a = locks(dir.path());
    let b = locks(dir.path());
    let guard = a.lock("cancel").unwrap().acquire().await.unwrap();
    let b_lock = b.lock("cancel").unwrap();
    let cancelled = tokio::time::timeout(Duration::from_millis(200), b_lock.acquire()).await;
    assert!(cancelled.is_err(), "acquired a held lock");
    guard.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    free_for_a_third_party(dir.path(), "cancel").await;
    // The cancelled owner can still acquire normally afterwards.
    b_lock.acquire().await.unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_cancelled_at_any_point_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    for step in 0..40u64 {
        let lock = locks.lock("anywhere").unwrap();
        // Cut the acquire short at a different point each time, including inside the blocking try.
        let attempt = tokio::time::timeout(Duration::from_micros(step * 40), lock.acquire()).await;
        if let Ok(guard) = attempt {
            guard.unwrap().release().await.unwrap();
        }
        // A try that locked the file after its future was dropped unlocks when its result is dropped.
        let other = self::locks(dir.path());
        let deadline = tokio::time::Instant::now() + BOUND;
        loop {
            if let Some(guard) = other.lock("anywhere").unwrap().try_acquire().await.unwrap() {
                guard.release().await.unwrap();
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "step {step}: the cancelled acquire kept the lock"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(other.inspect("anywhere").await.unwrap().holder.is_none());
    }
}

#[tokio::test]
async fn inspect_shows_the_holder_while_held_and_none_after() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    let never = locks.inspect("never-used").await.unwrap();
    assert!(never.holder.is_none() && never.last_token.is_none());

    let lock = locks.lock("seen").unwrap();
    let before = std::time::SystemTime::now() - Duration::from_secs(1);
    let guard = lock.acquire().await.unwrap();
    let info = locks.inspect("seen").await.unwrap();
    let holder = info.holder.expect("held");
    assert_eq!(holder.owner.as_deref(), Some(lock.owner()));
    assert_eq!(holder.pid, Some(std::process::id()));
    assert_eq!(holder.token, guard.token());
    assert!(holder.host.is_some_and(|h| !h.is_empty()));
    assert!(holder.since.is_some_and(|s| s >= before));
    assert_eq!(info.last_token, guard.token());

    let token = guard.token();
    guard.release().await.unwrap();
    let info = locks.inspect("seen").await.unwrap();
    assert!(info.holder.is_none());
    assert_eq!(info.last_token, token);
}

#[tokio::test]
async fn lock_files_stay_after_release() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("stays");
    let locks = Locks::new(backend);
    locks
        .lock("stays")
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert!(path.is_file());
    let content = std::fs::read_to_string(&path).unwrap();
    assert!(
        content.contains("\ntoken=1\n") && !content.contains("owner="),
        "{content}"
    );
}

/// The lock file's size stays put from one cycle to the next (the release pads its shorter record
/// instead of truncating, and the next holder's record fits), so the acquire's `fdatasync` has no size
/// change to write to the inode: the mechanism that keeps a cycle at one device write (issue 9). The
/// file grows only when a record is longer than any before it (here once, as the token gains a
/// digit). The counter still reads right through the padding.
#[tokio::test]
async fn a_cycle_never_changes_the_lock_file_size() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("steady");
    let locks = Locks::new(backend);
    let lock = locks.lock("steady").unwrap();
    let size = || std::fs::metadata(&path).unwrap().len();
    lock.acquire().await.unwrap().release().await.unwrap();
    let (mut released, mut growths, mut last) = (size(), 0, None);
    for _ in 0..20 {
        let guard = lock.acquire().await.unwrap();
        let held = size();
        assert!(held >= released, "an acquire shrank the file");
        growths += usize::from(held > released);
        assert!(guard.token() > last);
        last = guard.token();
        guard.release().await.unwrap();
        released = size();
        assert_eq!(released, held, "a release changed the file's size");
        let content = std::fs::read_to_string(&path).unwrap();
        assert!(!content.contains("owner="), "{content}");
    }
    assert!(growths <= 1, "the file grew {growths} times");
    let info = locks.inspect("steady").await.unwrap();
    assert_eq!(info.last_token, last);
    assert!(info.holder.is_none());
}

#[tokio::test]
async fn odd_names_map_to_valid_distinct_files() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let names = [
        "a/b".to_string(),
        "a%2Fb".into(),
        "a/b/".into(),
        "größe".into(),
        "日本語/ロック".into(),
        ".hidden".into(),
        ".".into(),
        "..".into(),
        "~".into(),
        " ".into(),
        "x".repeat(1024),
        "x".repeat(1023),
        "é".repeat(512),
    ];
    let files: HashSet<_> = names.iter().map(|n| backend.lock_file(n)).collect();
    assert_eq!(files.len(), names.len());
    let locks = Locks::new(backend);
    let mut guards = Vec::new();
    for name in &names {
        // All distinct files: all free at once.
        guards.push(
            locks
                .lock(name)
                .unwrap()
                .try_acquire()
                .await
                .unwrap()
                .expect(name),
        );
    }
    let entries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    assert_eq!(entries.len(), names.len());
    for entry in &entries {
        assert!(entry.file_type().unwrap().is_file(), "{entry:?}");
        let file_name = entry.file_name();
        let file_name = file_name.to_str().unwrap();
        assert!(
            file_name.len() <= 255 && !file_name.starts_with('.'),
            "{file_name}"
        );
        assert!(files.contains(&entry.path()));
    }
    for guard in guards {
        guard.release().await.unwrap();
    }
}

#[test]
fn bad_urls_are_invalid_config() {
    for bad in [
        "file://relative",
        "file://relative/dir",
        "file://host/x",
        "file:///tmp/x?bogus=1",
        "file://",
        "file://localhost",
        "file://user@/tmp/x",
        "file://a,b/tmp/x",
    ] {
        let err = url(bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad}: {err}");
        assert_eq!(err.backend(), "file", "{bad}");
    }
    let message = url("file://relative").unwrap_err().to_string();
    assert!(message.contains("file:///"), "{message}");
    let message = url("file:///tmp/x?bogus=1").unwrap_err().to_string();
    assert!(message.contains("bogus"), "{message}");

    let dir = tempfile::tempdir().unwrap();
    let ok = format!("file://{}?lease=10s", dir.path().join("sub").display());
    assert_eq!(url(&ok).unwrap().dir(), dir.path().join("sub"));
    let ok = format!("file://localhost{}", dir.path().display());
    assert_eq!(url(&ok).unwrap().dir(), dir.path());
}

#[test]
fn a_directory_that_cannot_be_made_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain-file");
    std::fs::write(&file, "x").unwrap();

    let err = FileBackend::new(file.join("locks")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    let message = err.to_string();
    assert!(
        message.contains(&*file.join("locks").to_string_lossy()),
        "{message}"
    );
    assert!(message.contains("not a directory"), "{message}");

    let err = FileBackend::new(&file).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{err}");
    assert!(err.to_string().contains("not a directory"), "{err}");

    assert_eq!(
        FileBackend::new("").unwrap_err().kind(),
        ErrorKind::InvalidConfig
    );
}

#[tokio::test]
async fn a_missing_directory_is_created_again() {
    let dir = tempfile::tempdir().unwrap();
    let locks_dir = dir.path().join("a/b");
    let locks = locks(&locks_dir);
    std::fs::remove_dir_all(dir.path().join("a")).unwrap();
    locks
        .lock("x")
        .unwrap()
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert!(locks_dir.join("x.lock").is_file());
}

#[tokio::test]
async fn a_corrupt_counter_is_refused_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("c");
    std::fs::write(&path, "token=banana\n").unwrap();
    let locks = Locks::new(backend);
    let err = locks.lock("c").unwrap().acquire().await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    let message = err.to_string();
    assert!(
        message.contains(&*path.to_string_lossy()) && message.contains("token="),
        "{message}"
    );
    // The failed acquire did not keep the lock, and left the file as it was.
    assert!(locks.inspect("c").await.unwrap().holder.is_none());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "token=banana\n");

    // Repaired as the message says, the counter continues from there.
    std::fs::write(&path, "token=41\n").unwrap();
    let guard = locks.lock("c").unwrap().acquire().await.unwrap();
    assert_eq!(guard.token().map(|t| t.get()), Some(42));
    guard.release().await.unwrap();
}

/// A lock file cut down to its header (or left with only fields this version does not know, or only
/// blank lines) has lost its counter: only a zero-length file is fresh. Before, such a file read as
/// token 0, and the next grant got token 1 again under `Fencing::Strict`.
#[tokio::test]
async fn a_lock_file_cut_to_its_header_is_refused_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("cut");
    let locks = Locks::new(backend);
    let guard = locks.lock("cut").unwrap().acquire().await.unwrap();
    guard.release().await.unwrap();
    let header = distlock_file::layout::HEADER;
    for content in [
        format!("{header}\n"),
        header.to_string(),
        format!("{header}\nfuture=1\nend\n"),
        "\n\n\n".to_string(),
    ] {
        std::fs::write(&path, &content).unwrap();
        let err = match locks.lock("cut").unwrap().acquire().await {
            Ok(guard) => panic!(
                "{content:?} was taken as a fresh file: token {:?}",
                guard.token()
            ),
            Err(err) => err,
        };
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        let message = err.to_string();
        assert!(
            message.contains(&*path.to_string_lossy()) && message.contains("corrupt"),
            "{message}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), content);
    }
    // Only a zero-length file is fresh.
    std::fs::write(&path, "").unwrap();
    let guard = locks.lock("cut").unwrap().acquire().await.unwrap();
    assert_eq!(guard.token().map(|t| t.get()), Some(1));
    guard.release().await.unwrap();
}

#[tokio::test]
async fn deleting_a_held_lock_file_makes_the_guard_lost() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("deleted");
    let locks = Locks::new(backend);
    let guard = locks.lock("deleted").unwrap().acquire().await.unwrap();
    assert_eq!(guard.state(), LockState::Held);
    assert!(guard.validity_deadline().is_none());
    // A chmod is not a loss.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(guard.state(), LockState::Held);

    std::fs::remove_file(&path).unwrap();
    tokio::time::timeout(BOUND, guard.lost())
        .await
        .expect("the deletion went unnoticed");
    assert!(guard.loss_reason().unwrap().contains("deleted"));
    // Which is why: another process can now lock a new file of the name.
    let other = self::locks(dir.path());
    let taken = other
        .lock("deleted")
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .expect("a new file is free");
    assert_eq!(
        guard.release().await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
    taken.release().await.unwrap();
}

/// `unlink(2)` sends inotify's `ATTRIB` before the name leaves the dentry cache, so a holder woken by it
/// can still stat the old inode at the path (with its link count already 0). It must count that as a
/// deletion: no later event comes. With the link count ignored, this loop (the deleting thread on the
/// other core) hit that window within 3,000-9,000 rounds in each of 4 runs here; it passes 20,000 with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_seen_in_the_middle_of_unlink_is_still_a_loss() {
    // tmpfs: no fdatasync per grant, so many rounds fit in a second.
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let paths = FileBackend::new(dir.path()).unwrap();
    let locks = Locks::new(backend);
    for round in 0..20000 {
        let name = format!("unlink-{round}");
        let guard = locks.lock(&name).unwrap().acquire().await.unwrap();
        let path = paths.lock_file(&name);
        std::thread::spawn(move || std::fs::remove_file(path).unwrap())
            .join()
            .unwrap();
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the deletion went unnoticed"));
    }
}

#[tokio::test]
async fn child_processes_do_not_inherit_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("cloexec");
    let locks = Locks::new(backend);
    let guard = locks.lock("cloexec").unwrap().acquire().await.unwrap();
    let output = Command::new("ls")
        .arg("-l")
        .arg("/proc/self/fd/")
        .output()
        .expect("ls runs");
    assert!(output.status.success());
    let listing = String::from_utf8_lossy(&output.stdout);
    assert!(
        !listing.contains(&*path.to_string_lossy()),
        "the child inherited the lock file:\n{listing}"
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_process_frees_the_lock_and_wakes_the_waiter() {
    let dir = tempfile::tempdir().unwrap();
    let locks = locks(dir.path());
    let first = locks.lock("killed").unwrap().acquire().await.unwrap();
    let first_token = first.token();
    first.release().await.unwrap();

    // Another process holds it: util-linux flock(1), which flocks the same file.
    let path = FileBackend::new(dir.path()).unwrap().lock_file("killed");
    let mut holder = Command::new("flock")
        .arg("-o")
        .arg(&path)
        .args(["sleep", "60"])
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("flock(1) is missing: apt-get install util-linux");
    let deadline = tokio::time::Instant::now() + BOUND;
    while locks.inspect("killed").await.unwrap().holder.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "flock(1) never took the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let lock = locks.lock("killed").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "acquired while flock(1) held it");

    let group = rustix::process::Pid::from_raw(holder.id() as i32).unwrap();
    rustix::process::kill_process_group(group, rustix::process::Signal::KILL).unwrap();
    holder.wait().unwrap();
    let got = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the holder's death did not free the lock")
        .unwrap()
        .unwrap();
    assert!(got.token() > first_token);
    got.release().await.unwrap();
}

/// A hold outlives the runtime it was acquired on (a `Locks` used from several runtimes): deleting its
/// lock file must still make it Lost. The loss signal's watcher went down with the first runtime.
#[test]
fn deleting_a_lock_file_held_from_a_dropped_runtime_makes_the_guard_lost() {
    held_from_a_dropped_runtime(true);
}

/// The same without `sync`: the acquire never yields, so the first runtime is dropped before its
/// inotify reader ever ran.
#[test]
fn deleting_a_lock_file_held_from_a_dropped_runtime_without_sync_makes_the_guard_lost() {
    held_from_a_dropped_runtime(false);
}

fn held_from_a_dropped_runtime(sync: bool) {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::from_config(FileConfig::new(dir.path()).with_sync(sync)).unwrap();
    let path = backend.lock_file("orphaned");
    let locks = Locks::new(backend);
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let guard = first.block_on(async { locks.lock("orphaned").unwrap().acquire().await.unwrap() });
    drop(first);

    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        assert_eq!(guard.state(), LockState::Held);
        std::fs::remove_file(&path).unwrap();
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .expect("the deletion went unnoticed");
        assert!(guard.loss_reason().unwrap().contains("deleted"));
    });
}

/// The lock directory is renamed away (or a symlink above it swapped,
/// as a deploy does) while a holder holds and a waiter of another process waits on the same old inode.
/// The waiter's next poll finds the path no longer names its file, closes it, recreates the directory
/// and locks a new file of the name: two holders. Nothing happened to the holder's inode but the
/// waiter's close: that close must wake the holder's loss signal, which finds the path no longer
/// names its file (`Lost`). A holder watch that asked for deletions only (tried for issue 9: its own
/// release then woke no reader) never woke, and the holder stayed `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_lock_directory_with_a_waiter_makes_the_holder_lost() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("locks");
    let holder = locks(&dir);
    let guard = holder.lock("x").unwrap().acquire().await.unwrap();
    // Another process's waiter: its own backend (its own inotify instance), polling fast.
    let waiter = locks(&dir);
    let lock = waiter.lock("x").unwrap();
    let waiting = tokio::spawn(async move { lock.acquire().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "acquired while held");

    std::fs::rename(&dir, root.path().join("locks.old")).unwrap();
    let second = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("the waiter did not take the new file")
        .unwrap()
        .unwrap();
    // Two holders of "x" now: the first must have been told.
    tokio::time::timeout(BOUND, guard.lost())
        .await
        .expect("two holders of one name, and the first was never told it lost the lock");
    second.release().await.unwrap();
}

/// A holder and a waiter sharing one inotify instance (two `Locks` over clones of one
/// backend, so the core's local queue is not involved): the holder's close-free watch is on the inode
/// first, the waiter's full mask replaces it, and the release must wake the waiter without polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_sharing_the_holders_inotify_instance() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::from_config(no_polling(dir.path())).unwrap();
    let holder = Locks::new(backend.clone());
    let waiter = Locks::new(backend);
    for round in 0..20 {
        let guard = holder.lock("w").unwrap().acquire().await.unwrap();
        let lock = waiter.lock("w").unwrap();
        let waiting = tokio::spawn(async move { lock.acquire().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        guard.release().await.unwrap();
        let got = tokio::time::timeout(BOUND, waiting)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the waiter was not woken by the release"))
            .unwrap()
            .unwrap();
        got.release().await.unwrap();
    }
}

/// The ways a lock file leaves its path are noticed by the holder: renamed away, replaced by a rename over it, replaced by an exchange.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_or_replaced_lock_file_makes_the_guard_lost() {
    let dir = tempfile::tempdir().unwrap();
    let backend = FileBackend::new(dir.path()).unwrap();
    let path = backend.lock_file("r");
    let locks = Locks::new(backend);
    for how in ["away", "over", "exchange"] {
        let guard = locks.lock("r").unwrap().acquire().await.unwrap();
        let other = dir.path().join("other");
        match how {
            "away" => std::fs::rename(&path, &other).unwrap(),
            "over" => {
                std::fs::write(&other, b"").unwrap();
                std::fs::rename(&other, &path).unwrap();
            }
            _ => {
                std::fs::write(&other, b"").unwrap();
                rustix::fs::renameat_with(
                    rustix::fs::CWD,
                    &other,
                    rustix::fs::CWD,
                    &path,
                    rustix::fs::RenameFlags::EXCHANGE,
                )
                .unwrap();
            }
        }
        tokio::time::timeout(BOUND, guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{how}: the replacement went unnoticed"));
        let _ = guard.release().await;
        let _ = std::fs::remove_file(&other);
        let _ = std::fs::remove_file(&path);
    }
}

/// Acquires from several runtimes on several threads at once (the one sync thread
/// busy, the rest on each runtime's blocking pool), each runtime dropped right after an acquire that
/// was cut short at a different point: every lock is free again afterwards, and no grant was lost in
/// the slot (every uncut acquire completes).
#[test]
fn acquires_from_many_runtimes_cut_short_and_dropped_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let path = path.clone();
            std::thread::spawn(move || {
                let locks = Locks::new(FileBackend::new(&path).unwrap());
                for step in 0..60u64 {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    let name = format!("t{t}-{}", step % 3);
                    rt.block_on(async {
                        let lock = locks.lock(&name).unwrap();
                        let cut = Duration::from_micros((step * 37) % 600);
                        if let Ok(got) = tokio::time::timeout(cut, lock.acquire()).await {
                            got.unwrap().release().await.unwrap();
                        }
                        // An uncut acquire always completes.
                        let guard = tokio::time::timeout(BOUND, lock.acquire())
                            .await
                            .expect("an acquire never completed")
                            .unwrap();
                        // Dropped with the runtime, unreleased, on every other step.
                        if step % 2 == 0 {
                            guard.release().await.unwrap();
                        } else {
                            std::mem::forget(tokio::spawn(async move {
                                let _guard = guard;
                                std::future::pending::<()>().await;
                            }));
                        }
                    });
                    drop(rt);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let other = Locks::new(FileBackend::new(&path).unwrap());
        for t in 0..4 {
            for n in 0..3 {
                let name = format!("t{t}-{n}");
                let deadline = tokio::time::Instant::now() + BOUND;
                loop {
                    if let Some(g) = other.lock(&name).unwrap().try_acquire().await.unwrap() {
                        g.release().await.unwrap();
                        break;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "{name} left held");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    });
}

/// An acquire cut short while its sync runs (on the sync thread or the pool) leaves
/// the file locked until the sync's thread drops the result; a waiter of the same `Locks`, which never
/// polls, must be woken by that undo (its close) and get the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_the_undo_of_an_acquire_cut_short_during_its_sync() {
    let dir = tempfile::tempdir().unwrap();
    let locks = Locks::new(FileBackend::from_config(no_polling(dir.path())).unwrap());
    let mut cut_short = 0;
    for step in 0..60u64 {
        let lock = locks.lock("undo").unwrap();
        // Polled once: a free lock's acquire runs its try inline and parks on the sync; then dropped.
        let mut acquire = Box::pin(lock.acquire());
        let first = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(acquire.as_mut(), cx))
        })
        .await;
        match first {
            std::task::Poll::Ready(got) => got.unwrap().release().await.unwrap(),
            std::task::Poll::Pending => cut_short += 1,
        }
        drop(acquire);
        let guard = tokio::time::timeout(BOUND, locks.lock("undo").unwrap().acquire())
            .await
            .unwrap_or_else(|_| panic!("step {step}: the waiter was not woken by the undo"))
            .unwrap();
        guard.release().await.unwrap();
    }
    eprintln!("{cut_short} of 60 acquires cut short");
}
